"""One broker per socket path: an flock on ``<socket>.lock`` held for the broker's life.

gRPC silently unlinks an existing socket file when it binds, so this lock is the only
thing that stops a second broker from stealing a live one's path. The lock is held by an
open fd, so it dies with the process (a SIGKILLed broker leaves a lock file that the next
broker takes). This module only guards the path; it never touches the socket files.
"""

from __future__ import annotations

import fcntl
import os

# Attempts to lock a file that is not unlinked under us by a releasing holder.
_ACQUIRE_ATTEMPTS = 10


class SocketPathLocked(Exception):
    """Another live process holds the socket path's lock."""


class SocketLock:
    """The exclusive right to serve on ``socket_path``."""

    def __init__(self, socket_path: str):
        self.socket_path = socket_path
        self.path = socket_path + ".lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock and write our pid into the lock file.

        Only after this returns may the caller unlink a stale socket file.

        Raises:
            SocketPathLocked: another process holds it (the message names its pid).
            OSError: the lock file cannot be created.
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this SocketLock")
        for _ in range(_ACQUIRE_ATTEMPTS):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                raise SocketPathLocked(
                    f"another broker (pid {holder}) owns {self.socket_path}; stop it or choose another --socket"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            # A releasing holder unlinks the file before unlocking: if we locked that orphan,
            # the path is free but not ours; open it afresh.
            if _same_file(fd, self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._fd = fd
                return
            os.close(fd)
        raise SocketPathLocked(f"{self.path} keeps changing under us; is another broker starting and stopping?")

    def release(self) -> None:
        """Unlink the lock file, then unlock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        # Unlink while still locked, so no one can lock this inode and think the path is theirs.
        if _same_file(fd, self.path):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"
