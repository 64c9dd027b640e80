"""The fd side channel, client side: fetches the arena's slab fds from a broker (blocking).

This module speaks the protocol of ``memory_broker.proto.wire.fd_channel`` and returns fds
that the caller owns and must close; it maps nothing and knows nothing of sessions beyond
the token. It must not import torch or gRPC.
"""

from __future__ import annotations

import array
import os
import resource
import socket
import time

from memory_broker.proto.wire import fd_channel as proto

# A failed fetch: ``code`` as sent by the server, "UNAVAILABLE" when the socket cannot be
# reached or does not answer in time, "INTERNAL" when the reply breaks the protocol.
FdChannelError = proto.FdChannelError


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
        request = proto.request_line(token, from_slab)
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
    where = f"fd channel {path}"
    buf = bytearray()
    count: int | None = None
    chunks_total = 0
    next_chunk = 0
    while True:
        # Consume every complete line in the buffer before reading more.
        while b"\n" in buf:
            i = buf.index(b"\n")
            line, buf = bytes(buf[:i]), buf[i + 1 :]
            msg = proto.parse_reply_line(line, where)
            if count is None:
                count = proto.header_count(msg, where, from_slab)
            else:
                chunks_total += proto.chunk_count(msg, where, next_chunk)
                next_chunk += 1
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
            data, ancdata, flags, _ = sock.recvmsg(proto.RECV_BYTES, proto.FDS_ANCILLARY_BYTES, socket.MSG_CMSG_CLOEXEC)
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
