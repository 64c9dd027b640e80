"""The fd side channel, server side: hands the arena's fds to authorized local processes.

This module owns the Unix socket that lends the arena's fds with ``SCM_RIGHTS`` (one per slab
on a host arena, one per page on a CUDA arena); the protocol (framing, limits, messages) is
``memory_broker.proto.wire.fd_channel``, shared with the client. It decides nothing about
sessions (``authorize`` does).

**Fds on demand, within a budget.** The fds it sends are made for the request
(``export_fds``: a ``dup`` of a slab's memfd, or ``cuMemExportToShareableHandle`` of a page,
31-77 us per page as measured by the GPU probes) in a small executor, never on the event
loop, ``MAX_FDS_PER_MESSAGE`` at a time, and closed as soon as their message is sent. At most
``EXPORT_BATCHES`` batches are held at once, whatever the number of connections, so the
broker holds at most ``FD_BUDGET`` exported fds: a whole GPU (~70,000 pages of 2 MiB on an
H200) never needs one fd per page open in the broker. It must not import gRPC.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from memory_broker.broker.sessions.peer import FdRequestRefused, PeerCred, peer_cred
from memory_broker.proto.wire.fd_channel import (
    BUSY,
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
# Batches of exported fds held at once (being made or sent), over all connections; the
# broker's fd budget for the channel is this many messages' worth.
EXPORT_BATCHES = 4
FD_BUDGET = EXPORT_BATCHES * MAX_FDS_PER_MESSAGE
# Threads that make fds (driver exports block for tens of microseconds per page).
EXPORT_THREADS = 2


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

    def __init__(  # noqa: PLR0913 - keyword-only settings, each named at the one call site
        self,
        path: str,
        *,
        allowed_uids: frozenset[int] | None,
        authorize: Callable[[str, PeerCred], str | None],
        export_fds: Callable[[int, int], list[int]] | None = None,
        units: Callable[[], int] | None = None,
        slab_fds: Callable[[int], list[int]] | None = None,
        log: Callable[..., None] | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_uid: int = MAX_CONNECTIONS_PER_UID,
        scope: Callable[[str, int, int | None, int], tuple[int, int]] | None = None,
    ):
        """
        Args:
            path: the socket path; it must not exist (the caller clears stale ones under its lock).
            allowed_uids: uids that may connect; None allows any.
            authorize: checks a token for a peer and returns the session's proof key (sent in
                the reply header, to this peer only; None: none); raises FdRequestRefused to
                refuse. Called on the event loop, so it may touch loop-owned state.
            export_fds: ``export_fds(first, n)``: new fds for units ``first..first+n-1``, owned
                by the caller (closed here once sent); called in the export executor.
            units: how many units (slabs or pages) the arena has now.
            slab_fds: instead of the two above: the broker's own fds for slabs ``k..end``
                (borrowed; they are duplicated for sending).
            log: ``log(event, **fields)``.
            request_timeout_s: time a client has to send its request, and to take its reply.
            max_connections, max_connections_per_uid: connections served at once; one
                over either is answered RESOURCE_EXHAUSTED and closed.
            scope: ``scope(token, first, count, units)``: the units an authorized request
                may be sent (tenant pools: ``count`` None answered with the session's part,
                an explicit range outside it refused with FdRequestRefused); None: all.
        """
        self.path = path
        self.allowed_uids = allowed_uids
        self._authorize = authorize
        self._scope = scope
        if slab_fds is not None:
            export_fds, units = _from_slab_fds(slab_fds)
        if export_fds is None or units is None:
            raise TypeError("FdChannelServer needs export_fds and units (or slab_fds)")
        self._export_fds = export_fds
        self._units = units
        self._executor: ThreadPoolExecutor | None = None
        self._export_slots: asyncio.Semaphore | None = None
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
        self._executor = ThreadPoolExecutor(EXPORT_THREADS, thread_name_prefix="fd-export")
        self._export_slots = asyncio.Semaphore(EXPORT_BATCHES)
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
        if self._executor is not None:
            # Exports under way finish in their thread (their fds are closed by their task's
            # cleanup, or here by the executor's callers); new ones are not started.
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

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
            return f"the fd channel is serving {len(self._conns) - 1} connections, its limit; {BUSY}"
        if self._per_uid.get(peer.uid, 0) > self.max_connections_per_uid:
            return (
                f"uid {peer.uid} has {self._per_uid[peer.uid] - 1} fd channel connections open, the limit "
                f"({self.max_connections_per_uid}); {BUSY}"
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
                first, count, key = await self._decide(conn, peer)
            except FdChannelError as r:  # FdRequestRefused, or a malformed request
                self._log("fd_request_refused", pid=peer.pid, uid=peer.uid, code=r.code, message=r.message)
                async with asyncio.timeout(self._timeout):
                    await asyncio.get_running_loop().sock_sendall(conn, refusal_line(r.code, r.message))
                return
            t0 = time.perf_counter()
            await self._send_fds(conn, first, count, key)
            ms = round((time.perf_counter() - t0) * 1e3, 3)
            self._log("fd_request_served", pid=peer.pid, uid=peer.uid, first=first, count=count, ms=ms)
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

    async def _decide(self, conn: socket.socket, peer: PeerCred) -> tuple[int, int, str | None]:
        """The units ``(first, count)`` to send for this connection's request and the session's
        proof key for the header, or FdRequestRefused."""
        # Read before judging, so a refused client reads our reply instead of a reset.
        line, unread = await self._read_request(conn)
        if self.allowed_uids is not None and peer.uid not in self.allowed_uids:
            raise FdRequestRefused(
                "PERMISSION_DENIED",
                f"uid {peer.uid} may not use this broker; allowed uids: {sorted(self.allowed_uids)}",
            )
        if unread is not None:
            raise FdRequestRefused("INVALID_ARGUMENT", unread)
        token, first, count = parse_request(line)
        try:
            key = self._authorize(token, peer)
        except FdChannelError:
            raise
        except Exception as e:
            self._log("fd_channel_authorize_failed", pid=peer.pid, error=f"{type(e).__name__}: {e}")
            raise FdRequestRefused("INTERNAL", f"broker failed to check the request: {type(e).__name__}: {e}") from e
        have = self._units()
        if count is not None and first + count > have:
            raise FdRequestRefused(
                "INVALID_ARGUMENT",
                f"units {first}..{first + count - 1} asked for, but the arena has {have} (0..{have - 1}); "
                "nothing was sent",
            )
        if self._scope is not None:
            return (*self._scope(token, first, count, have), key)
        if count is None:  # to the end (none past it)
            return first, max(0, have - first), key
        return first, count, key

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

    async def _send_fds(self, conn: socket.socket, first: int, count: int, key: str | None) -> None:
        """The header, then the fds in chunks: each made in the executor (within the budget),
        sent, and closed here; every chunk must be taken within the request timeout."""
        loop = asyncio.get_running_loop()
        assert self._executor is not None and self._export_slots is not None
        async with asyncio.timeout(self._timeout):
            await loop.sock_sendall(conn, header_line(first, count, key))
        for i, start in enumerate(range(first, first + count, MAX_FDS_PER_MESSAGE)):
            n = min(MAX_FDS_PER_MESSAGE, first + count - start)
            async with self._export_slots:
                try:
                    fds = await self._export(start, n)
                except Exception as e:
                    self._log("fd_channel_export_failed", first=start, count=n, error=f"{type(e).__name__}: {e}")
                    code = "RESOURCE_EXHAUSTED" if isinstance(e, (OSError, MemoryError)) else "INTERNAL"
                    async with asyncio.timeout(self._timeout):
                        await loop.sock_sendall(
                            conn, refusal_line(code, f"broker failed to export units {start}..{start + n - 1}: {e}")
                        )
                    return
                try:
                    if len(fds) != n:
                        raise RuntimeError(f"export_fds({start}, {n}) made {len(fds)} fds")
                    async with asyncio.timeout(self._timeout):
                        await _sendmsg_fds(loop, conn, chunk_line(i, n), fds)
                finally:
                    for fd in fds:
                        os.close(fd)

    async def _export(self, first: int, n: int) -> list[int]:
        """``export_fds(first, n)`` in the executor; fds made for a task cancelled meanwhile
        are closed when they come."""
        assert self._executor is not None
        cf = self._executor.submit(self._export_fds, first, n)
        try:
            return await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            cf.add_done_callback(_close_result)
            raise


def _close_result(cf) -> None:
    if not cf.cancelled() and cf.exception() is None:
        for fd in cf.result():
            os.close(fd)


def _from_slab_fds(slab_fds: Callable[[int], list[int]]) -> tuple[Callable[[int, int], list[int]], Callable[[], int]]:
    """``export_fds`` and ``units`` over a function listing the broker's own slab fds (each
    sent as a close-on-exec duplicate, so the caller's stay open)."""

    def export(first: int, n: int) -> list[int]:
        out: list[int] = []
        try:
            for fd in list(slab_fds(first))[:n]:
                out.append(os.dup(fd))
        except BaseException:
            for fd in out:
                os.close(fd)
            raise
        return out

    return export, lambda: len(list(slab_fds(0)))


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
