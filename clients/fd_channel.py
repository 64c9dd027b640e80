"""The fd side channel, client side: fetches the arena's fds from a broker (blocking).

This module speaks the protocol of ``memory_broker.proto.wire.fd_channel`` and returns fds
that the caller owns and must close, and the session's proof key (``prove_session``); it maps
nothing and knows nothing of sessions beyond the token. It must not import torch or gRPC.
"""

from __future__ import annotations

import array
import os
import resource
import socket
import time
from collections.abc import Callable

from memory_broker.proto.wire import fd_channel as proto

# A failed fetch: ``code`` as sent by the server, "UNAVAILABLE" when the socket cannot be
# reached or does not answer in time, "INTERNAL" when the reply breaks the protocol.
FdChannelError = proto.FdChannelError


def fetch_slab_fds(path: str, token: str, from_slab: int, *, timeout: float = 5.0) -> list[int]:
    """The fds of units ``from_slab..end`` (slabs on a host arena), in order, close-on-exec,
    owned by the caller. For a few fds only: a CUDA arena's pages go through ``fetch_fds``
    with a ``consume`` that imports and closes each chunk. (With tenant pools the fds may
    start past ``from_slab``: ``fetch_slab_range`` says where.)

    Raises:
        FdChannelError: as ``fetch_fds``. No fds are left open.
    """
    return fetch_slab_range(path, token, from_slab, timeout=timeout)[1]


def fetch_slab_range(path: str, token: str, from_slab: int, *, timeout: float = 5.0) -> tuple[int, list[int]]:
    """``(first, fds)``: the fds of the slabs ``first..first+len(fds)-1`` this session may map
    among ``from_slab..end`` (all of them, ``first == from_slab``, without tenant pools; with
    them, its own pool's: the slabs before ``first`` and after the last are not its).

    Raises:
        FdChannelError: as ``fetch_fds``. No fds are left open.
    """
    fds: list[int] = []
    served: list[int] = []
    try:
        fetch_fds(path, token, from_slab, None, fds.extend, timeout=timeout, served=served)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return (served[0] if served else from_slab), fds


def prove_session(path: str, token: str, *, timeout: float = 5.0) -> str:
    """Present the session's token on the fd channel as this process, asking for no fds, and
    return the session's proof key from the reply: every session-bearing call carries it
    (``session_metadata(token, key)``). The first process to do this owns the session; the
    broker refuses the token from any other process.

    Raises:
        FdChannelError: as ``fetch_fds``; INTERNAL when the reply carries no key (a broker of
            an older protocol version).
    """
    header: dict = {}
    fetch_fds(path, token, 0, 0, _close_all, timeout=timeout, on_header=header.update)
    key = header.get("key")
    if not isinstance(key, str) or not key:
        raise FdChannelError(
            "INTERNAL",
            f"fd channel {path}: the broker sent no session key (it speaks an older protocol); "
            "run a client and a broker from the same memory-broker release",
        )
    return key


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def fetch_fds(
    path: str,
    token: str,
    first: int,
    count: int | None,
    consume: Callable[[list[int]], None],
    *,
    timeout: float = 5.0,
    on_header: Callable[[dict], None] | None = None,
    served: list[int] | None = None,
) -> int:
    """Fetch the fds of units ``first..first+count-1`` (``count`` None: to the arena's end) and
    hand each chunk (at most ``MAX_FDS_PER_MESSAGE``, in unit order) to ``consume`` as it
    arrives; returns how many fds came.

    ``consume`` owns the fds it is given (it must close them, also when it raises); this
    process so holds at most one chunk of fds at a time, whatever the count.

    Args:
        path: the broker's fd socket.
        token: the session token from Attach.
        first, count: the units wanted (slabs on a host arena, pages on a CUDA arena).
        consume: called with each chunk's fds.
        timeout: seconds for the whole exchange.
        on_header: called with the reply's header (it carries the session's proof key).
        served: when given, the reply's first unit is appended (past ``first`` only for a
            to-the-end request of a tenant pool's session).

    Raises:
        FdChannelError: refused by the broker (its code and message), unreachable or too slow
            (UNAVAILABLE), or a broken reply (INTERNAL). Fds not yet consumed are closed.
        Whatever ``consume`` raises (the rest of the reply is dropped, its fds closed).
    """
    deadline = time.monotonic() + timeout
    pause = 0.01
    got = [0]

    def counted(fds: list[int]) -> None:
        got[0] += len(fds)
        consume(fds)

    while True:
        try:
            return _fetch_once(path, token, first, count, counted, deadline, on_header, served)
        except FdChannelError as e:
            # The channel's connection caps are busy, not wrong: wait and ask again while
            # time is left (nothing was handed to ``consume`` yet, so nothing repeats).
            busy = e.code == "RESOURCE_EXHAUSTED" and e.message.endswith(proto.BUSY) and not got[0]
            if not busy or time.monotonic() + pause >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def _fetch_once(
    path: str,
    token: str,
    first: int,
    count: int | None,
    consume: Callable[[list[int]], None],
    deadline: float,
    on_header: Callable[[dict], None] | None,
    served: list[int] | None = None,
) -> int:
    """One connection's request and reply (``fetch_fds`` without its retries)."""
    timeout = max(deadline - time.monotonic(), 0.001)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    except OSError as e:
        raise FdChannelError("UNAVAILABLE", f"cannot create a socket: {e}") from None
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (OSError, TimeoutError) as e:
            raise FdChannelError("UNAVAILABLE", f"cannot reach the broker's fd channel at {path}: {e}") from None
        try:
            sock.sendall(proto.request_line(token, first, count))
        except (BrokenPipeError, ConnectionResetError):
            # The broker may have refused and closed before reading; its reply is still queued.
            pass
        return _receive(sock, path, first, deadline, consume, on_header, count is None, served)
    finally:
        sock.close()


def _receive(
    sock: socket.socket,
    path: str,
    first: int,
    deadline: float,
    consume: Callable[[list[int]], None],
    on_header: Callable[[dict], None] | None = None,
    to_end: bool = False,
    served: list[int] | None = None,
) -> int:
    """Read the reply, handing each chunk's fds to ``consume``; returns the fds received."""
    where = f"fd channel {path}"
    buf = bytearray()
    count: int | None = None
    announced = received = next_chunk = 0
    pending: list[int] = []  # fds received whose chunk line is not read yet
    try:
        while True:
            # Consume every complete line in the buffer before reading more.
            while b"\n" in buf:
                i = buf.index(b"\n")
                line, buf = bytes(buf[:i]), buf[i + 1 :]
                msg = proto.parse_reply_line(line, where)
                if count is None:
                    count = proto.header_count(msg, where, first, to_end)
                    if on_header is not None:
                        on_header(msg)
                    if served is not None:
                        served.append(msg["first"])
                else:
                    n = proto.chunk_count(msg, where, next_chunk)
                    next_chunk += 1
                    announced += n
                    if len(pending) < n:
                        raise FdChannelError(
                            "INTERNAL", f"{where}: chunk {next_chunk - 1} announced {n} fds, {len(pending)} came"
                        )
                    chunk, pending = pending[:n], pending[n:]
                    received += n
                    consume(chunk)
                if count is not None and announced >= count:
                    # Each chunk's fds arrive with its line, so the tally is complete here.
                    if announced != count or pending:
                        raise FdChannelError(
                            "INTERNAL",
                            f"{where}: header announced {count} fds, chunks announced {announced}, "
                            f"received {received + len(pending)}",
                        )
                    return received
            data = _recv_into(sock, where, deadline, pending, received)
            if not data:
                got_what = "no reply" if count is None else f"{received + len(pending)} of {count} fds"
                raise FdChannelError("INTERNAL", f"{where}: connection closed after {got_what}")
            buf += data
    finally:
        for fd in pending:
            os.close(fd)


def _recv_into(sock: socket.socket, where: str, deadline: float, fds: list[int], received: int) -> bytes:
    """One ``recvmsg``: its bytes, its fds appended to ``fds`` (close-on-exec)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise FdChannelError("UNAVAILABLE", f"{where}: no complete reply in time ({received} fds so far)")
    sock.settimeout(remaining)
    try:
        data, ancdata, flags, _ = sock.recvmsg(proto.RECV_BYTES, proto.FDS_ANCILLARY_BYTES, socket.MSG_CMSG_CLOEXEC)
    except TimeoutError:
        raise FdChannelError("UNAVAILABLE", f"{where}: no complete reply in time ({received} fds so far)") from None
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
            f"{where}: the kernel dropped fds from a message (MSG_CTRUNC) after {received + len(fds)} "
            f"received; this process may be at its open-file limit (RLIMIT_NOFILE soft limit {soft})",
        )
    return data
