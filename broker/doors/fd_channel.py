"""The fd side channel, server side: hands the arena's slab fds to authorized local processes.

This module owns the Unix socket that lends slab fds with ``SCM_RIGHTS``; the protocol
(framing, limits, messages) is ``memory_broker.proto.wire.fd_channel``, shared with the client. It
decides nothing about sessions (``authorize`` does) and never owns or closes the slab fds it
sends (``slab_fds`` returns the broker's own; the kernel duplicates them into the receiver).
It must not import gRPC.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
from collections.abc import Callable

from memory_broker.broker.sessions.peer import FdRequestRefused, PeerCred, peer_cred
from memory_broker.proto.wire.fd_channel import (
    MAX_FDS_PER_MESSAGE,
    MAX_REQUEST_BYTES,
    FdChannelError,
    chunk_line,
    header_line,
    parse_request,
    refusal_line,
)

# How long a connection may take to send its request, and separately to take its reply.
DEFAULT_REQUEST_TIMEOUT_S = 5.0
# Pending connects the kernel queues while the loop is busy.
LISTEN_BACKLOG = 64
# Connections served at once, in all and from one uid (a request takes milliseconds; more
# than this at once is a client gone wrong or an attempt to wear the broker down).
MAX_CONNECTIONS = 256
MAX_CONNECTIONS_PER_UID = 32


def listen_unix(path: str) -> socket.socket:
    """A non-blocking Unix stream socket bound to ``path`` and listening (the fd and step
    channels' listeners); its mode follows the umask. Closed again if binding fails."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.bind(path)
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


class FdChannelServer:
    """Serves slab fds on a Unix socket from the running event loop; one task per connection."""

    def __init__(
        self,
        path: str,
        *,
        allowed_uids: frozenset[int] | None,
        authorize: Callable[[str, PeerCred], None],
        slab_fds: Callable[[int], list[int]],
        log: Callable[..., None] | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_uid: int = MAX_CONNECTIONS_PER_UID,
    ):
        """
        Args:
            path: the socket path; it must not exist (the caller clears stale ones under its lock).
            allowed_uids: uids that may connect; None allows any.
            authorize: checks a token for a peer; raises FdRequestRefused to refuse. Called
                on the event loop, so it may touch loop-owned state.
            slab_fds: the broker's fds for slabs ``k..end``; borrowed, never closed here.
            log: ``log(event, **fields)``.
            request_timeout_s: time a client has to send its request, and to take its reply.
            max_connections, max_connections_per_uid: connections served at once; one
                over either is answered RESOURCE_EXHAUSTED and closed.
        """
        self.path = path
        self.allowed_uids = allowed_uids
        self._authorize = authorize
        self._slab_fds = slab_fds
        self._log = log or (lambda event, **kw: None)
        self._timeout = request_timeout_s
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._conns: dict[asyncio.Task, socket.socket] = {}
        self.max_connections = max_connections
        self.max_connections_per_uid = max_connections_per_uid
        # Connections being served, by peer uid.
        self._per_uid: dict[int, int] = {}

    async def start(self) -> None:
        """Bind and listen; the socket's mode follows the umask."""
        if self._sock is not None:
            raise RuntimeError(f"fd channel {self.path} already started")
        self._sock = listen_unix(self.path)
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def close(self) -> None:
        """Stop accepting, drop live connections, unlink the socket path. Idempotent."""
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
            self._accept_task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        tasks = list(self._conns)
        for t in tasks:
            t.cancel()
        # Each task closes its own connection, also when cancelled.
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as e:
                # EMFILE and friends: keep serving once the pressure is gone, without spinning.
                self._log("fd_channel_accept_failed", path=self.path, error=str(e))
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            task = loop.create_task(self._serve(conn))
            self._conns[task] = conn
            task.add_done_callback(self._conns.pop)

    def _over_limit(self, peer: PeerCred) -> str | None:
        if len(self._conns) > self.max_connections:
            return f"the fd channel is serving {len(self._conns) - 1} connections, its limit; retry shortly"
        if self._per_uid.get(peer.uid, 0) > self.max_connections_per_uid:
            return (
                f"uid {peer.uid} has {self._per_uid[peer.uid] - 1} fd channel connections open, the limit "
                f"({self.max_connections_per_uid}); retry shortly"
            )
        return None

    async def _serve(self, conn: socket.socket) -> None:
        peer: PeerCred | None = None
        try:
            peer = peer_cred(conn)
            self._per_uid[peer.uid] = self._per_uid.get(peer.uid, 0) + 1
            try:
                over = self._over_limit(peer)
                if over is not None:
                    raise FdRequestRefused("RESOURCE_EXHAUSTED", over)
                fds, from_slab = await self._decide(conn, peer)
            except FdChannelError as r:  # FdRequestRefused, or a malformed request
                self._log("fd_request_refused", pid=peer.pid, uid=peer.uid, code=r.code, message=r.message)
                async with asyncio.timeout(self._timeout):
                    await asyncio.get_running_loop().sock_sendall(conn, refusal_line(r.code, r.message))
                return
            async with asyncio.timeout(self._timeout):
                await self._send_fds(conn, from_slab, fds)
            self._log("fd_request_served", pid=peer.pid, uid=peer.uid, from_slab=from_slab, count=len(fds))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # A client that vanishes mid-reply, or a bug in a callback: this connection only.
            self._log(
                "fd_channel_connection_failed",
                pid=peer.pid if peer else None,
                uid=peer.uid if peer else None,
                error=f"{type(e).__name__}: {e}",
            )
        finally:
            if peer is not None:
                left = self._per_uid.get(peer.uid, 1) - 1
                if left:
                    self._per_uid[peer.uid] = left
                else:
                    self._per_uid.pop(peer.uid, None)
            conn.close()

    async def _decide(self, conn: socket.socket, peer: PeerCred) -> tuple[list[int], int]:
        """The fds to send for this connection's request, or FdRequestRefused."""
        # Read before judging, so a refused client reads our reply instead of a reset.
        line, unread = await self._read_request(conn)
        if self.allowed_uids is not None and peer.uid not in self.allowed_uids:
            raise FdRequestRefused(
                "PERMISSION_DENIED",
                f"uid {peer.uid} may not use this broker; allowed uids: {sorted(self.allowed_uids)}",
            )
        if unread is not None:
            raise FdRequestRefused("INVALID_ARGUMENT", unread)
        token, from_slab = parse_request(line)
        try:
            self._authorize(token, peer)
        except FdChannelError:
            raise
        except Exception as e:
            self._log("fd_channel_authorize_failed", pid=peer.pid, error=f"{type(e).__name__}: {e}")
            raise FdRequestRefused("INTERNAL", f"broker failed to check the request: {type(e).__name__}: {e}") from e
        try:
            fds = list(self._slab_fds(from_slab))
        except Exception as e:
            self._log("fd_channel_slab_fds_failed", from_slab=from_slab, error=f"{type(e).__name__}: {e}")
            raise FdRequestRefused("INTERNAL", f"broker failed to list slab fds from {from_slab}: {e}") from e
        return fds, from_slab

    async def _read_request(self, conn: socket.socket) -> tuple[bytes, str | None]:
        """The request line, or what went wrong reading it (as a refusal message)."""
        loop = asyncio.get_running_loop()
        buf = bytearray()
        try:
            async with asyncio.timeout(self._timeout):
                while b"\n" not in buf:
                    if len(buf) > MAX_REQUEST_BYTES:
                        return b"", f"request over {MAX_REQUEST_BYTES} bytes"
                    data = await loop.sock_recv(conn, 4096)
                    if not data:
                        return b"", f"connection closed after {len(buf)} bytes, before a full request line"
                    buf += data
        except TimeoutError:
            return b"", f"no request line within {self._timeout:g} s"
        line = bytes(buf[: buf.index(b"\n")])
        if len(line) > MAX_REQUEST_BYTES:
            return b"", f"request over {MAX_REQUEST_BYTES} bytes"
        return line, None

    async def _send_fds(self, conn: socket.socket, from_slab: int, fds: list[int]) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(conn, header_line(from_slab, len(fds)))
        for i, start in enumerate(range(0, len(fds), MAX_FDS_PER_MESSAGE)):
            chunk = fds[start : start + MAX_FDS_PER_MESSAGE]
            await _sendmsg_fds(loop, conn, chunk_line(i, len(chunk)), chunk)


async def _sendmsg_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    """``sendmsg`` with SCM_RIGHTS on a non-blocking socket (the loop has no such helper)."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
    while True:
        try:
            sent = sock.sendmsg([payload], ancillary)
            break
        except (BlockingIOError, InterruptedError):
            await _writable(loop, sock)
    if sent < len(payload):
        # The fds travelled with the first byte; the rest of the payload is plain bytes.
        await loop.sock_sendall(sock, payload[sent:])


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut = loop.create_future()
    fd = sock.fileno()
    loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_writer(fd)
