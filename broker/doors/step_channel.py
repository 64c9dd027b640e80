"""The step channel, server side: an engine's per-step changes in one compact round trip.

This module owns the channel's Unix socket and its connections, served straight from the event
loop that owns the core (``add_reader`` on non-blocking sockets, the framing of
``memory_broker.proto.wire.step``): accepting under per-uid and per-session caps, HELLO (the
connection bound to the session its token names, as the peer's credentials prove), reading
frames and writing replies in order, and stopping a connection's reads while its replies wait.
Each STEP frame's ops run in ``step_ops.StepOps``. It decides nothing about sessions
(``SessionManager`` authorizes, as on the fd channel) and must not import gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from memory_broker.broker.doors.fd_channel import FdRequestRefused, PeerCred, listen_unix, peer_cred
from memory_broker.broker.doors.step_ops import StepCounters, StepOps
from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.errors import BrokerError, Code, denied, exhausted, invalid

# Connections served at once (each is one engine process; more is a client gone wrong).
MAX_CONNECTIONS = 1024
# Connections that have not yet sent an accepted HELLO: at most this many at once, in all and
# from one uid, each for at most HELLO_DEADLINE_S and holding at most one HELLO frame's bytes.
# Another uid's engine always finds a slot while one uid floods the socket.
MAX_UNAUTHENTICATED = 128
MAX_UNAUTHENTICATED_PER_UID = 16
HELLO_DEADLINE_S = 2.0
# Connections past HELLO one session may hold (a client uses one per session, shared by its
# threads and its step batch), and one uid at most half the channel's: a process that opens
# connections in a loop keeps other sessions and other uids' engines off the channel no more.
MAX_CONNECTIONS_PER_SESSION = 64
_STEP, _PING = w.STEP, w.PING
# Read size per readable callback: a step frame is a few hundred bytes.
RECV_BYTES = 1 << 16
# Replies answered at once on one connection before its socket is written: past them, the
# frames read already wait unanswered until the client has read the replies, and nothing more
# is read (a connection holds at most about this plus one frame's reply, ``w.MAX_REPLY_BYTES``).
REPLY_BACKLOG_BYTES = 1 << 20


@dataclass(slots=True, eq=False)
class _Conn:
    sock: socket.socket
    peer: PeerCred
    # The session bound by HELLO; None until then.
    session: object | None = None
    # The session's proof key, as HELLO's proof (the peer's credentials) returned it: the
    # connection is the owner process's, so its ops carry the key as gRPC calls do.
    key: str | None = None
    # Bytes received and not yet a whole frame.
    inbuf: bytearray = field(default_factory=bytearray)
    # Reply bytes the socket did not take yet (reading pauses until they are sent).
    outbuf: bytearray = field(default_factory=bytearray)
    # Close once outbuf is sent (after refusing a frame that cannot be skipped).
    closing: bool = False
    # Closes the connection if HELLO has not been accepted in time (cancelled by HELLO).
    deadline: asyncio.TimerHandle | None = None
    # A frame of this connection waits for an adapter load (``_Load``): nothing more is read
    # or answered on it until that frame's reply is out.
    waiting: bool = False


class _Waiting:
    """Connections without an accepted HELLO: how many by uid, and each one's deadline."""

    def __init__(self):
        self.by_uid: dict[int, int] = {}

    def over_limit(self, peer: PeerCred) -> str:
        """Why one more such connection from ``peer`` is refused ("" if it is not)."""
        if sum(self.by_uid.values()) >= MAX_UNAUTHENTICATED:
            return f"{MAX_UNAUTHENTICATED} connections are waiting to send HELLO"
        if self.by_uid.get(peer.uid, 0) >= MAX_UNAUTHENTICATED_PER_UID:
            return f"uid {peer.uid} has {MAX_UNAUTHENTICATED_PER_UID} connections waiting to send HELLO"
        return ""

    def start(self, c: _Conn, loop, late: Callable[[_Conn], None]) -> None:
        self.by_uid[c.peer.uid] = self.by_uid.get(c.peer.uid, 0) + 1
        c.deadline = loop.call_later(HELLO_DEADLINE_S, late, c)

    def stop(self, c: _Conn) -> None:
        """``c`` no longer waits: its HELLO was accepted, or it is dropped. Idempotent."""
        if c.deadline is None:
            return
        c.deadline.cancel()
        c.deadline = None
        left = self.by_uid[c.peer.uid] - 1
        if left:
            self.by_uid[c.peer.uid] = left
        else:
            del self.by_uid[c.peer.uid]


class _Held:
    """Connections past HELLO: how many by uid and by session, each under its cap."""

    def __init__(self, per_uid: int, per_session: int):
        self.per_uid, self.per_session = per_uid, per_session
        self.by_uid: dict[int, int] = {}
        self.by_session: dict[int, int] = {}

    def over_limit(self, uid: int, sid: int) -> str:
        """Why one more connection of session ``sid`` (of ``uid``) is refused ("" if it is not)."""
        if self.by_session.get(sid, 0) >= self.per_session:
            return (
                f"session {sid} holds {self.per_session} step connections, the most one session may hold; "
                "close one (each client needs one) or use gRPC"
            )
        if self.by_uid.get(uid, 0) >= self.per_uid:
            return f"uid {uid} holds {self.per_uid} step connections, the most one uid may hold (half the channel's)"
        return ""

    def start(self, uid: int, sid: int) -> None:
        self.by_uid[uid] = self.by_uid.get(uid, 0) + 1
        self.by_session[sid] = self.by_session.get(sid, 0) + 1

    def stop(self, uid: int, sid: int) -> None:
        for counts, k in ((self.by_uid, uid), (self.by_session, sid)):
            left = counts[k] - 1
            if left:
                counts[k] = left
            else:
                del counts[k]


class StepChannelServer:
    """Serves STEP frames on a Unix socket from the running event loop."""

    def __init__(  # noqa: PLR0913 - keyword-only settings, each named at the one call site
        self,
        path: str,
        *,
        loop,
        store,
        sessions,
        adapters,
        allowed_uids: frozenset[int] | None,
        num_slabs: Callable[[], int] = lambda: 0,
        record: Callable[[float, str, str], None] | None = None,
        log: Callable[..., None] | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_session: int = MAX_CONNECTIONS_PER_SESSION,
    ):
        """
        Args:
            path: the socket path; it must not exist (the caller clears stale ones under its lock).
            loop: the event loop that owns the core; every callback runs on it.
            store, sessions, adapters: the core (``adapters`` may be None: an acquire is
                refused FAILED_PRECONDITION, as over gRPC).
            allowed_uids: uids that may connect; None allows any.
            num_slabs: the arena's slab count now (a client maps new slabs before using pages).
            record: ``record(seconds, method, code)`` per op, and per refused frame as
                method "Step" (the RPC latency metric).
            max_connections, max_connections_per_session: connections served at once; past
                HELLO, one session holds at most the second and one uid half the first.
        """
        self.path = path
        self._loop = loop
        self.store = store
        self.sessions = sessions
        self.allowed_uids = allowed_uids
        self._num_slabs = num_slabs
        self._log = log or (lambda event, **kw: None)
        self.max_connections = max_connections
        self.counters = StepCounters()
        # Each STEP frame's ops (and a frame that waits for a load: ``pause``, ``resume``).
        self.ops = StepOps(
            loop=loop,
            store=store,
            sessions=sessions,
            adapters=adapters,
            num_slabs=num_slabs,
            record=record,
            log=self._log,
            counters=self.counters,
            links=self,
        )
        self._sock: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._waiting = _Waiting()
        self._held = _Held(max(1, max_connections // 2), min(max_connections_per_session, max(1, max_connections // 2)))

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind and listen; the socket's mode follows the umask."""
        if self._sock is not None:
            raise RuntimeError(f"step channel {self.path} already started")
        self._sock = sock = listen_unix(self.path)
        self._loop.add_reader(sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting, drop live connections, unlink the socket path. Idempotent."""
        if self._sock is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for c in list(self._conns.values()):
            self._drop(c)
        self.ops.close()
        k = self.counters
        self._log(
            "step_channel_closed",
            connections=k.connections,
            frames=k.frames,
            ops=k.ops,
            refused=k.refused,
            loads=k.loads,
            op_ms={w.OP_NAMES[o]: round(t * 1e3, 3) for o, t in k.op_seconds.items()},
        )

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # ------------------------------------------------------------ sockets

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # EMFILE and friends: the next readable callback tries again.
                self._log("step_channel_accept_failed", path=self.path, error=str(e))
                return
            sock.setblocking(False)
            try:
                peer = peer_cred(sock)
            except OSError:
                sock.close()
                continue
            over = self._waiting.over_limit(peer)
            if len(self._conns) >= self.max_connections:
                over = f"{self.max_connections} connections are open, the most it serves"
            if over:
                self._log("step_channel_refused", pid=peer.pid, uid=peer.uid, reason=over)
                with contextlib.suppress(OSError):  # the client's HELLO reads why (the buffer is empty)
                    sock.send(w.error_frame(exhausted(f"the step channel is full: {over}")))
                sock.close()
                continue
            c = _Conn(sock, peer)
            self._conns[sock.fileno()] = c
            self._waiting.start(c, self._loop, self._hello_late)
            self.counters.connections += 1
            self._loop.add_reader(sock.fileno(), self._readable, c)

    def _hello_late(self, c: _Conn) -> None:
        if c.session is None and self._conns.get(c.sock.fileno()) is c:
            self._log("step_channel_refused", pid=c.peer.pid, uid=c.peer.uid, reason="no HELLO in time")
            self._drop(c)

    def _drop(self, c: _Conn) -> None:
        fd = c.sock.fileno()
        if self._conns.pop(fd, None) is None:
            return
        self._waiting.stop(c)
        if c.session is not None:
            self._held.stop(c.peer.uid, c.session.session_id)
        self._loop.remove_reader(fd)
        if c.outbuf:
            self._loop.remove_writer(fd)
        c.sock.close()

    def _readable(self, c: _Conn) -> None:
        # Before HELLO, read no more than one HELLO frame can be.
        want = RECV_BYTES if c.session is not None else 5 + w.MAX_HELLO_BYTES - len(c.inbuf)
        try:
            data = c.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(c)
            return
        buf = c.inbuf
        if not buf:
            # The common case: exactly one whole frame arrived; no copy into the buffer.
            if len(data) >= 5:
                n, kind = w.HEADER.unpack_from(data)
                if len(data) == 5 + n:
                    if kind == _STEP and c.session is not None and self.ops._record is None:
                        # The common case of all: one STEP frame of a session, no recorder.
                        reply = self.ops.step_frame(c, memoryview(data)[5:])
                        if reply is not None:  # None: it waits for a load (``_wait``)
                            self._reply(c, reply)
                    elif kind == _PING and c.session is not None:
                        # ``_frame``'s PING past HELLO (it cannot be refused): the slab count.
                        self.counters.frames += 1
                        self._reply(c, w.encode_step_reply(self._num_slabs(), ()))
                    else:
                        reply = self._frame(c, kind, n, memoryview(data)[5:])
                        if reply is not None:
                            self._reply(c, reply)
                    return
            used = self._frames(c, data)  # several frames, or part of one: no copy of the whole ones
            if used < len(data) and not c.closing:
                buf += memoryview(data)[used:]
                self._buffered(c)  # frames past REPLY_BACKLOG_BYTES of replies, if sent at once
        else:
            buf += data
            self._buffered(c)
        if c.closing and not c.outbuf:
            self._drop(c)

    def _buffered(self, c: _Conn) -> None:
        """Answer the whole frames ``c.inbuf`` holds (one copy of the buffer per
        ``REPLY_BACKLOG_BYTES`` of replies), for as long as their replies are sent at once:
        a client that does not read them leaves the rest of its frames unanswered and unread."""
        buf = c.inbuf
        while len(buf) >= 5 and not c.outbuf and not c.closing and not c.waiting:
            n = w.HEADER.unpack_from(buf)[0]
            limit = w.MAX_FRAME_BYTES if c.session is not None else w.MAX_HELLO_BYTES
            if len(buf) < 5 + n and n <= limit:
                return  # part of a frame
            used = self._frames(c, bytes(buf))
            if self._conns.get(c.sock.fileno()) is not c:
                return  # dropped (its socket failed)
            del buf[:used]
            if not used:
                return

    def _reply(self, c: _Conn, data: bytes) -> None:
        if c.outbuf:
            c.outbuf += data
            return
        try:
            sent = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(c)
            return
        if sent < len(data):
            # A client that does not read its replies: stop reading its requests until it does.
            c.outbuf += data[sent:]
            fd = c.sock.fileno()
            self._loop.remove_reader(fd)
            self._loop.add_writer(fd, self._writable, c)
        elif c.closing:
            self._drop(c)

    def _writable(self, c: _Conn) -> None:
        try:
            sent = c.sock.send(c.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(c)
            return
        del c.outbuf[:sent]
        if not c.outbuf:
            fd = c.sock.fileno()
            self._loop.remove_writer(fd)
            if not c.closing and not c.waiting:
                self._buffered(c)  # the frames left unanswered while the replies waited
            if c.closing and not c.outbuf and not c.waiting:
                self._drop(c)
            elif not c.outbuf and not c.waiting and self._conns.get(fd) is c:
                self._loop.add_reader(fd, self._readable, c)

    # ------------------------------------------------------------ frames

    def _frame(self, c: _Conn, kind: int, n: int, body) -> bytes | None:
        """The reply to one frame (None: it waits for a load, ``_wait``); never raises."""
        t0 = time.perf_counter()
        self.counters.frames += 1
        code = "OK"
        try:
            if body is None:
                code = "INVALID_ARGUMENT"
                return b""
            if kind == w.STEP:
                return self.ops.step(c, body)
            if kind == w.HELLO:
                return self._hello(c, body)
            if kind == w.PING:
                if c.session is None:
                    raise denied("send HELLO with the session token first")
                return w.encode_step_reply(self._num_slabs(), ())  # the slab count, as every reply
            raise invalid(f"unknown frame kind {kind}; known: HELLO={w.HELLO}, STEP={w.STEP}, PING={w.PING}")
        except BrokerError as e:
            code = e.code.value
            self.counters.refused += 1
            if kind == w.HELLO or c.session is None:
                # A refused handshake ends the connection: nothing else may follow it.
                c.closing = True
                self._log("step_channel_refused", pid=c.peer.pid, uid=c.peer.uid, code=code, message=e.message)
            return w.error_frame(e)
        except Exception as e:  # a bug: say so on this connection only
            code = "INTERNAL"
            self._log("step_channel_internal_error", error=repr(e))
            return w.error_frame(BrokerError(Code.INTERNAL, f"internal error in the step channel: {e!r}"))
        finally:
            record = self.ops._record
            if record is not None and code != "OK":
                record(time.perf_counter() - t0, "Step", code)

    def _frames(self, c: _Conn, data: bytes) -> int:
        """``_readable``'s frames: answer each whole frame at the start of ``data`` in order, as its one
        frame is (a STEP frame of a session without a recorder straight to ``StepOps.step_frame``),
        their replies in one send; returns the bytes they took. A frame over the size limit
        is refused and ends the connection."""
        view = memoryview(data)
        pos, end, size = 0, len(data), 0
        replies: list[bytes] = []
        while end - pos >= 5 and not c.closing and not c.waiting:
            n, kind = w.HEADER.unpack_from(data, pos)
            session = c.session
            limit = w.MAX_FRAME_BYTES if session is not None else w.MAX_HELLO_BYTES
            if n > limit:
                self._frame(c, kind, n, None)
                what = "" if session is not None else " before HELLO (send HELLO with the session token first)"
                replies.append(w.error_frame(invalid(f"frame of {n} bytes{what}; at most {limit}")))
                c.closing = True
                break
            stop = pos + 5 + n
            if stop > end or size >= REPLY_BACKLOG_BYTES:
                break
            if kind == _STEP and session is not None and self.ops._record is None:
                reply = self.ops.step_frame(c, view[pos + 5 : stop])
            elif kind == _PING and session is not None:
                self.counters.frames += 1
                reply = w.encode_step_reply(self._num_slabs(), ())
            else:
                reply = self._frame(c, kind, n, view[pos + 5 : stop])
            pos = stop
            if reply is None:  # it waits for a load: the replies before it go now, in order
                break
            replies.append(reply)
            size += len(reply)
        if replies:
            self._reply(c, replies[0] if len(replies) == 1 else b"".join(replies))
        return pos

    def _hello(self, c: _Conn, body) -> bytes:
        """A HELLO frame: binds the connection to the session its token names, as the owner
        process proves it (the peer's credentials); refused, the connection ends."""
        if c.session is not None:
            raise invalid("HELLO twice on one connection")
        if self.allowed_uids is not None and c.peer.uid not in self.allowed_uids:
            raise denied(f"uid {c.peer.uid} may not use this broker; allowed uids: {sorted(self.allowed_uids)}")
        try:
            token = bytes(body).decode()
        except UnicodeDecodeError:
            raise invalid("the session token is not UTF-8") from None
        try:
            c.key = self.sessions.authorize_fd_request(token, c.peer)
        except FdRequestRefused as r:
            raise BrokerError(Code[r.code] if r.code in Code.__members__ else Code.INTERNAL, r.message) from None
        session = self.sessions.from_token(token)
        over = self._held.over_limit(c.peer.uid, session.session_id)
        if over:
            raise exhausted(over)
        self._held.start(c.peer.uid, session.session_id)
        c.session = session
        self._waiting.stop(c)
        return w.encode_step_reply(self._num_slabs(), ())

    # ------------------------------------------------------------ a frame that waits for a load

    def pause(self, c: _Conn) -> None:
        """``c``'s frame waits for a load (``StepOps``): nothing more is read or answered on it."""
        c.waiting = True
        if not c.outbuf:  # with an outbuf, reading stopped already
            self._loop.remove_reader(c.sock.fileno())

    def resume(self, c: _Conn, fd: int, reply: bytes) -> None:
        """``c``'s waiting frame is answered: its reply out, then the frames that arrived meanwhile."""
        c.waiting = False
        if self._conns.get(fd) is not c:
            return
        self._reply(c, reply)
        if self._conns.get(fd) is c and not c.outbuf and not c.waiting:
            if c.closing:
                self._drop(c)
                return
            self._loop.add_reader(fd, self._readable, c)
            self._buffered(c)

    def gone(self, c: _Conn, fd: int) -> bool:
        """Whether a waiting connection (not read meanwhile) went: dropped, or closed by its
        client (its end read without taking its bytes); one that went is dropped."""
        if self._conns.get(fd) is not c:
            return True
        try:
            gone = c.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            gone = True
        if gone:
            self._drop(c)
        return gone
