"""Opening files a client names, no further than that client could open them itself.

The broker usually holds more rights than its clients, so a path sent over RPC (an adapter
directory) is opened here by walking it one component at a time from ``/`` with
``O_PATH | O_NOFOLLOW``, following symlinks by hand and checking the caller's uid/gids
against the mode bits and ownership of every directory searched and of the file read
(so nothing can be swapped in between check and use), and only as a regular file of
bounded size, inside ``allowed_roots`` when they are configured. Every refusal is a
``BrokerError`` INVALID_ARGUMENT or PERMISSION_DENIED that says why. ``disk_free`` tells the
writers of the state directory how much room is left (refusals of a full disk name it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass

from memory_broker.proto.wire.errors import BrokerError, Code, invalid

# Longest path text accepted (PATH_MAX).
MAX_PATH_BYTES = 4096
# Symlinks followed in one walk before giving up (the kernel's limit).
MAX_SYMLINKS = 40

_R, _X = 4, 1


def disk_free(path: str) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (-1: unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def denied(message: str) -> BrokerError:
    return BrokerError(Code.PERMISSION_DENIED, message)


@dataclass(frozen=True, slots=True)
class Caller:
    """Whose rights a path is opened with: a process as the kernel reported it (SO_PEERCRED)."""

    uid: int
    gids: frozenset[int]
    pid: int = 0

    @classmethod
    def of_process(cls, pid: int, uid: int, gid: int) -> Caller:
        """The peer's uid, primary gid, and supplementary groups (from /proc when the pid is
        visible; otherwise the primary gid alone, which can only grant less)."""
        gids = {gid}
        if pid > 0:
            try:
                with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
                    for line in f:
                        if line.startswith("Groups:"):
                            gids.update(int(g) for g in line.split()[1:] if g.isdigit())
                            break
            except OSError:
                pass
        return cls(uid, frozenset(gids), pid)


def may(st: os.stat_result, caller: Caller, want: int) -> bool:
    """Whether the mode bits of ``st`` give ``caller`` the ``want`` bits (4 read, 1 search/exec).

    The classic owner / group / other rule as the kernel applies it; root reads and searches
    everything. ACL entries beyond the mode bits are not consulted (an ACL can only have
    granted the caller more, except a named-user entry that denies: then this is wider)."""
    if caller.uid == 0:
        return True
    mode = st.st_mode
    if st.st_uid == caller.uid:
        bits = (mode >> 6) & 7
    elif st.st_gid in caller.gids:
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & want == want


def check_path_text(path: object, what: str = "path") -> str:
    """A path as text a client may send: a non-empty absolute str without NUL bytes."""
    if not isinstance(path, str) or not path:
        raise invalid(f"{what} is empty; give the absolute path of a PEFT LoRA directory")
    if "\x00" in path:
        raise invalid(f"{what} contains a NUL byte; give a plain absolute path")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise invalid(f"{what} is longer than {MAX_PATH_BYTES} bytes")
    if not path.startswith("/"):
        raise invalid(
            f"{what} {path!r} is relative; give an absolute path (the broker's working directory is not yours)"
        )
    return path


def normalize_roots(roots: tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """Configured roots as real paths (so a symlinked root compares with resolved paths)."""
    return tuple(os.path.realpath(r) for r in roots or ())


def inside(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)


class Opened:
    """An fd opened by ``open_for``: ``fd`` (owned; close it), its fstat ``st`` and resolved ``path``."""

    __slots__ = ("fd", "st", "path")

    def __init__(self, fd: int, st: os.stat_result, path: str):
        self.fd = fd
        self.st = st
        self.path = path

    @property
    def proc_path(self) -> str:
        """A path naming exactly this open file, for libraries that want a file name."""
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Opened:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _kind(st: os.stat_result) -> str:
    m = st.st_mode
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(m):
            return name
    return "a regular file" if stat.S_ISREG(m) else "a special file"


def _walk(path: str, caller: Caller | None, start: Opened | None = None) -> tuple[int, str]:
    """Resolve ``path`` component by component (from ``start`` if relative): an O_PATH fd of
    the final object (not followed if it is a symlink: it is resolved) and its real path.

    Every directory searched must grant the caller search (x) permission."""
    base_flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    if path.startswith("/") or start is None:
        cur, cur_path = os.open("/", base_flags | os.O_DIRECTORY), "/"
    else:
        cur, cur_path = os.open(".", base_flags | os.O_DIRECTORY, dir_fd=start.fd), start.path
    pending = [c for c in path.split("/") if c not in ("", ".")]
    links = 0
    try:
        while pending:
            comp = pending.pop(0)
            st = os.fstat(cur)
            if caller is not None and not may(st, caller, _X):
                raise denied(
                    f"{cur_path}: uid {caller.uid} may not search this directory (mode {st.st_mode & 0o777:o})"
                )
            if comp == "..":
                nxt = os.open("..", base_flags | os.O_DIRECTORY, dir_fd=cur)
                os.close(cur)
                cur, cur_path = nxt, os.path.dirname(cur_path.rstrip("/")) or "/"
                continue
            try:
                nxt = os.open(comp, base_flags, dir_fd=cur)
            except FileNotFoundError:
                raise invalid(f"{os.path.join(cur_path, comp)}: no such file or directory") from None
            except OSError as e:
                raise invalid(f"{os.path.join(cur_path, comp)}: cannot be opened ({os.strerror(e.errno)})") from None
            nst = os.fstat(nxt)
            if stat.S_ISLNK(nst.st_mode):
                links += 1
                try:
                    target = os.readlink(comp, dir_fd=cur)
                finally:
                    os.close(nxt)
                if links > MAX_SYMLINKS:
                    raise invalid(f"{path}: more than {MAX_SYMLINKS} symlinks on the way (a loop?)")
                if target.startswith("/"):
                    os.close(cur)
                    cur, cur_path = os.open("/", base_flags | os.O_DIRECTORY), "/"
                pending[:0] = [c for c in target.split("/") if c not in ("", ".")]
                continue
            here = os.path.join(cur_path, comp)
            if pending and not stat.S_ISDIR(nst.st_mode):
                os.close(nxt)
                raise invalid(f"{here}: is {_kind(nst)}, not a directory")
            os.close(cur)
            cur, cur_path = nxt, here
        return cur, cur_path
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(cur)
        raise


def open_for(
    path: str,
    caller: Caller | None,
    roots: tuple[str, ...] = (),
    *,
    directory: bool = False,
    max_bytes: int | None = None,
    start: Opened | None = None,
    what: str = "",
) -> Opened:
    """Open ``path`` (absolute, or relative to the directory ``start``) for reading as
    ``caller`` could: a directory (``directory=True``, needing search permission) or a
    regular file (needing read permission, at most ``max_bytes``). ``caller`` None checks
    no permissions (the broker's own reads); ``roots``, when given, must contain the
    resolved path.

    Raises:
        BrokerError: INVALID_ARGUMENT (missing, wrong type, too large), PERMISSION_DENIED
            (the caller could not open it, or it resolves outside the roots).
    """
    label = what or path
    fd, real = _walk(path, caller, start)
    try:
        st = os.fstat(fd)
        if roots and not inside(real, roots):
            raise denied(f"{label} resolves to {real}, outside adapters.allowed_roots ({', '.join(roots)})")
        if directory:
            if not stat.S_ISDIR(st.st_mode):
                raise invalid(f"{label}: is {_kind(st)}, not a directory")
            if caller is not None and not may(st, caller, _X):
                raise denied(f"{real}: uid {caller.uid} may not search this directory (mode {st.st_mode & 0o777:o})")
            return Opened(fd, st, real)
        if not stat.S_ISREG(st.st_mode):
            raise invalid(f"{label}: is {_kind(st)}, not a regular file")
        if caller is not None and not may(st, caller, _R):
            raise denied(
                f"{real}: uid {caller.uid} may not read this file (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}); "
                "the broker reads only what its caller could"
            )
        if max_bytes is not None and st.st_size > max_bytes:
            raise invalid(f"{label}: {st.st_size} bytes, over the limit of {max_bytes} bytes")
        # Reopen the very inode the walk found (no path lookup in between).
        rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
        rst = os.fstat(rfd)
        if (rst.st_dev, rst.st_ino) != (st.st_dev, st.st_ino):  # pragma: no cover - /proc is sound
            os.close(rfd)
            raise invalid(f"{label}: changed while being opened; try again")
        os.close(fd)
        return Opened(rfd, rst, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def read_bounded(opened: Opened, max_bytes: int, label: str) -> bytes:
    """All of an opened regular file, refusing one that grows past ``max_bytes`` meanwhile."""
    chunks, total = [], 0
    while True:
        try:
            b = os.read(opened.fd, min(1 << 20, max_bytes + 1 - total))
        except OSError as e:
            if e.errno == errno.EINTR:
                continue
            raise invalid(f"{label}: cannot be read ({os.strerror(e.errno)})") from None
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        total += len(b)
        if total > max_bytes:
            raise invalid(f"{label}: over the limit of {max_bytes} bytes")
