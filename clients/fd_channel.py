"""The fd side channel, client side: fetches the arena's slab fds from a broker (blocking).

This module speaks the protocol described in ``broker.sessions.fd_channel`` and returns fds
that the caller owns and must close; it maps nothing and knows nothing of sessions beyond
the token. It must not import torch or gRPC.
"""

from __future__ import annotations

import array
import json
import os
import resource
import socket
import time

# The kernel's cap on fds in one message (SCM_MAX_FD); the server sends at most 200.
_MAX_FDS_PER_RECV = 253
_RECV_BYTES = 64 * 1024


class FdChannelError(Exception):
    """A failed fetch: ``code`` as sent by the server, "UNAVAILABLE" when the socket cannot
    be reached or does not answer in time, "INTERNAL" when the reply breaks the protocol."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"FdChannelError({self.code}, {self.message!r})"


def fetch_slab_fds(path: str, token: str, from_slab: int, *, timeout: float = 5.0) -> list[int]:
    """The fds of slabs ``from_slab..end``, in slab order, close-on-exec, owned by the caller.

    Args:
        path: the broker's fd socket.
        token: the session token from Attach.
        from_slab: the first slab wanted.
        timeout: seconds for the whole exchange.

    Raises:
        FdChannelError: refused by the broker (its code and message), unreachable or too slow
            (UNAVAILABLE), or a broken reply (INTERNAL). No fds are left open.
    """
    deadline = time.monotonic() + timeout
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    except OSError as e:
        raise FdChannelError("UNAVAILABLE", f"cannot create a socket: {e}") from None
    fds: list[int] = []
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (OSError, TimeoutError) as e:
            raise FdChannelError("UNAVAILABLE", f"cannot reach the broker's fd channel at {path}: {e}") from None
        request = json.dumps({"token": token, "from_slab": from_slab}).encode() + b"\n"
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            # The broker may have refused and closed before reading; its reply is still queued.
            pass
        _receive(sock, path, from_slab, deadline, fds)
        return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        sock.close()


def _receive(sock: socket.socket, path: str, from_slab: int, deadline: float, fds: list[int]) -> None:
    """Read the reply into ``fds`` (appended as they arrive, so the caller can close them)."""
    buf = bytearray()
    count: int | None = None
    chunks_total = 0
    next_chunk = 0
    while True:
        # Consume every complete line in the buffer before reading more.
        while b"\n" in buf:
            i = buf.index(b"\n")
            line, buf = bytes(buf[:i]), buf[i + 1 :]
            msg = _json(line, path)
            if count is None:
                count = _header(msg, path, from_slab)
            else:
                if msg.get("chunk") != next_chunk or not isinstance(msg.get("count"), int):
                    raise FdChannelError("INTERNAL", f"fd channel {path}: expected chunk {next_chunk}, got {msg}")
                next_chunk += 1
                chunks_total += msg["count"]
            if count is not None and chunks_total >= count:
                # Each chunk's fds arrive with its line, so the tally is complete here.
                if chunks_total != count or len(fds) != count:
                    raise FdChannelError(
                        "INTERNAL",
                        f"fd channel {path}: header announced {count} fds, chunks announced "
                        f"{chunks_total}, received {len(fds)}",
                    )
                return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FdChannelError("UNAVAILABLE", f"fd channel {path}: no complete reply in time ({len(fds)} fds so far)")
        sock.settimeout(remaining)
        try:
            data, ancdata, flags, _ = sock.recvmsg(
                _RECV_BYTES, socket.CMSG_SPACE(_MAX_FDS_PER_RECV * 4), socket.MSG_CMSG_CLOEXEC
            )
        except TimeoutError:
            raise FdChannelError(
                "UNAVAILABLE", f"fd channel {path}: no complete reply in time ({len(fds)} fds so far)"
            ) from None
        except ConnectionResetError:
            data, ancdata, flags = b"", [], 0
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(cdata[: len(cdata) - len(cdata) % got.itemsize])
                fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            raise FdChannelError(
                "INTERNAL",
                f"fd channel {path}: the kernel dropped fds from a message (MSG_CTRUNC) after {len(fds)} "
                f"received; this process may be at its open-file limit (RLIMIT_NOFILE soft limit {soft})",
            )
        if not data:
            got_what = "no reply" if count is None else f"{len(fds)} of {count} fds"
            raise FdChannelError("INTERNAL", f"fd channel {path}: connection closed after {got_what}")
        buf += data


def _json(line: bytes, path: str) -> dict:
    try:
        msg = json.loads(line)
    except ValueError:
        raise FdChannelError("INTERNAL", f"fd channel {path}: reply is not JSON: {line[:200]!r}") from None
    if not isinstance(msg, dict):
        raise FdChannelError("INTERNAL", f"fd channel {path}: reply is not a JSON object: {line[:200]!r}")
    return msg


def _header(msg: dict, path: str, from_slab: int) -> int:
    """The fd count the reply announces; raises the broker's refusal as FdChannelError."""
    if msg.get("ok") is not True:
        raise FdChannelError(str(msg.get("code", "INTERNAL")), str(msg.get("message", f"refused: {msg}")))
    count = msg.get("count")
    if not isinstance(count, int) or count < 0 or msg.get("from_slab") != from_slab:
        raise FdChannelError("INTERNAL", f"fd channel {path}: bad reply header {msg} for from_slab {from_slab}")
    return count
