"""The step channel, server side: an engine's per-step changes in one compact round trip.

This module owns a Unix socket served straight from the event loop that owns the core
(``add_reader`` on non-blocking sockets, the ``struct`` codec of ``memory_broker.proto.wire.step``): each STEP
frame's ops (release adapters, unpin, pin, commit/abort adapter acquires, acquire hot
adapters, look up keys) run in order on the same ``ObjectStore`` and ``AdapterManager`` the
gRPC service uses, as the session that presented its token, so gRPC sees every change and a
dead process's pins go with its session. It decides nothing about sessions (``SessionManager``
authorizes, as on the fd channel). An acquire whose adapters are all hot is answered in the
frame's callback; one that needs a load (or a conversion) runs as a task of the loop, and its
frame's reply, with the frame's later ops, waits for it: the connection reads nothing more
meanwhile (its replies stay in order), while every other connection and gRPC are served. It
must not import gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from memory_broker.broker.adapters import hotcore
from memory_broker.broker.doors.fd_channel import FdRequestRefused, PeerCred, listen_unix, peer_cred
from memory_broker.broker.doors.policy import POLICY
from memory_broker.broker.sessions.manager import NO_FIELDS
from memory_broker.broker.store.object_table import ReplyRoom
from memory_broker.broker.store.records import store_core
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
# Acquire reply rows of hot adapter objects kept at most (each a few dozen bytes).
ROWS_KEPT = 16384
# An object's id (C-level, over a list of objects).
_OID = attrgetter("object_id")
_STEP, _PING, _OP_LOOKUP, _Op, _wire_parts = w.STEP, w.PING, w.OP_LOOKUP, w.Op, w._wire_parts
# An acquire reply's head by adapter count (C-level cache: no Python frame when it hits).
_acquire_head = functools.lru_cache(maxsize=1024)(w.acquire_head)
# Read size per readable callback: a step frame is a few hundred bytes.
RECV_BYTES = 1 << 16
# Replies answered at once on one connection before its socket is written: past them, the
# frames read already wait unanswered until the client has read the replies, and nothing more
# is read (a connection holds at most about this plus one frame's reply, ``w.MAX_REPLY_BYTES``).
REPLY_BACKLOG_BYTES = 1 << 20

# The result records of the ops that answer only their kind.
_UNPIN_DONE, _RELEASE_DONE, _COMMIT_DONE, _ABORT_DONE = (
    bytes((k,)) for k in (w.OP_UNPIN, w.OP_RELEASE, w.OP_COMMIT, w.OP_ABORT)
)

_TIERS = {"hot": w.TIER_HOT, "warm": w.TIER_WARM, "cold": w.TIER_COLD}
# Each op is recorded in the RPC latency metric under the gRPC method it stands for, so
# dashboards and alerts count fast-path work as they count RPCs; refused frames as "Step".
METHODS = {
    w.OP_RELEASE: "ReleaseAdapters",
    w.OP_UNPIN: "Unpin",
    w.OP_PIN: "Pin",
    w.OP_COMMIT: "Commit",
    w.OP_ABORT: "Abort",
    w.OP_ACQUIRE: "AcquireAdapters",
    w.OP_LOOKUP: "Lookup",
}

# The rule of the RPC each op stands for: the step channel authorizes ops as gRPC calls.
RULES = {op: POLICY[method] for op, method in METHODS.items()}
# Whether an op's rule asks more than a session and its proof (the frame's first op checks
# those for every op of the frame): it names ids the session must see, or needs a manager.
PER_OP_RULE = {op: bool(r.visible or r.manage or not r.session) for op, r in RULES.items()}
# Whether an op's rule looks at the ids it names (only then are they gathered for it).
VISIBLE = {op: bool(r.visible) for op, r in RULES.items()}


def _record_all(record: Callable[[float, str, str], None], done: list) -> None:
    """Each op's latency into the metric, called soon after the frame (so after its reply is
    sent): ``done`` is (seconds, method, code) per op that ran or was refused."""
    for seconds, method, code in done:
        record(seconds, method, code)


def op_ids(op: w.Op):
    """The ids an op names, by the request field of the RPC it stands for (``POLICY``'s
    ``visible`` fields): a PIN's items are ``PinRequest.object_ids``."""
    if op.kind == w.OP_PIN:
        items = op.items
        return lambda field: items
    return NO_FIELDS


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


class _Load(Exception):
    """Raised by an acquire op that must wait for a load: ``start()`` makes the manager's
    acquire coroutine (``prepare``: a two-phase one), which the frame's task awaits."""

    def __init__(self, start: Callable, prepare: bool):
        super().__init__("an adapter load")
        self.start, self.prepare = start, prepare


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


@dataclass(slots=True)
class StepCounters:
    """What the channel did since start (for tests and the status line)."""

    connections: int = 0
    frames: int = 0
    ops: int = 0
    refused: int = 0
    # Acquires whose reply waited for a load or conversion (answered on the channel all the same).
    loads: int = 0
    # Seconds spent running ops, by op kind (what the store and manager cost per frame), where
    # a recorder is configured (the RPC latency metric: ops are timed for it, and only then).
    op_seconds: defaultdict = field(default_factory=lambda: defaultdict(float))


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
        self.adapters = adapters
        self.allowed_uids = allowed_uids
        self._num_slabs = num_slabs
        self._record = record
        self._log = log or (lambda event, **kw: None)
        self.max_connections = max_connections
        self.counters = StepCounters()
        self._sock: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._waiting = _Waiting()
        self._held = _Held(max(1, max_connections // 2), min(max_connections_per_session, max(1, max_connections // 2)))
        # Each hot adapter object's row of an acquire reply, by object id (its generation and
        # pages never change): a hot acquire joins them. Cleared when it grows past ROWS_KEPT.
        self._rows: dict[int, bytes] = {}
        # The store's native core (``_storecore.c``): a lookup's or pin's reply records joined
        # in C; None where it is not built (``encode_allocations`` then).
        self._store_core = store_core()
        self._core = hotcore.load()
        # What is left of the reply of the frame being answered (its object records are
        # bounded like its request: ``ReplyRoom``, reset per frame).
        self.room = ReplyRoom()
        # Frames waiting for an adapter load (``_Load``), one task each; cancelled by ``close``.
        self._tasks: set[asyncio.Task] = set()

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
        for t in list(self._tasks):
            t.cancel()
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
                    if kind == _STEP and c.session is not None and self._record is None:
                        # The common case of all: one STEP frame of a session, no recorder.
                        reply = self._step_frame(c, memoryview(data)[5:])
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
                return self._step(c, body)
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
            if self._record is not None and code != "OK":
                self._record(time.perf_counter() - t0, "Step", code)

    def _step_frame(self, c: _Conn, body) -> bytes | None:
        """``_frame`` of a STEP frame on a connection past HELLO where no recorder is set
        (nothing to time): the same reply and counters, without the rest of the dispatch."""
        counters = self.counters
        counters.frames += 1
        try:
            core = w._core  # read per frame: the codec may be switched (tests, benchmarks)
            ops = None if core is None else core.decode_step(body, _Op)
            if ops is None:  # the pure-Python codec, or a body the native pass leaves to it
                return self._step(c, body)
            return self._ops(c, c.session, ops)
        except BrokerError as e:
            counters.refused += 1
            return w.error_frame(e)
        except Exception as e:  # a bug: say so on this connection only
            self._log("step_channel_internal_error", error=repr(e))
            return w.error_frame(BrokerError(Code.INTERNAL, f"internal error in the step channel: {e!r}"))

    def _step(self, c: _Conn, body) -> bytes | None:
        s = c.session
        if s is None:
            raise denied("send HELLO with the session token first")
        try:
            ops = w.decode_step(body)
        except w.WireError as e:
            raise invalid(f"malformed step frame: {e}") from None
        return self._ops(c, s, ops)

    def _ops(self, c: _Conn, s, ops: list) -> bytes | None:
        """A decoded STEP frame's ops, in order, as ``s`` (the connection's session): the
        reply, which carries the error of the first op refused (and the results before it);
        None when an op waits for an adapter load (``_wait`` sends the reply)."""
        sessions = self.sessions
        # The frame as a whole: a draining broker or an ended session refuses it before any op.
        if sessions.draining or s.closed:
            sessions.check_session(s, "a step")  # raises, saying why
        counters = self.counters
        counters.ops += len(ops)
        self.room.reset()  # the frame's reply: its records and bytes (the store takes from it)
        if self._record is not None:
            return self._step_timed(c, s, ops)
        sid = s.session_id
        if len(ops) == 1:  # the usual frame: the loop below for one op, without its bookkeeping
            op = ops[0]
            k = op.kind
            try:
                sessions.authorize_open(METHODS[k], RULES[k], s, op_ids(op) if VISIBLE[k] else NO_FIELDS, key=c.key)
                results = [HANDLERS[k](self, sid, op)]
            except BrokerError as e:
                counters.refused += 1
                return w.encode_step_reply(self._num_slabs(), (), e, 0)
            except _Load as load:
                return self._wait(c, s, ops, 0, [], load)
            core = w._core
            out = None if core is None else core.encode_ok_reply(self._num_slabs(), results)
            return w.encode_step_reply(self._num_slabs(), results) if out is None else out
        results = []
        append = results.append
        i = 0
        try:
            for op in ops:
                k = op.kind
                # An op's whole rule once per frame (the session and its proof cannot change
                # between two ops of one frame: they run in one callback of the loop; the
                # session itself was checked just above); then only the rules that look at
                # the op's own ids (Pin's visibility) again.
                if not i:
                    sessions.authorize_open(METHODS[k], RULES[k], s, op_ids(op) if VISIBLE[k] else NO_FIELDS, key=c.key)
                elif PER_OP_RULE[k]:
                    sessions.authorize(METHODS[k], RULES[k], s, op_ids(op), key=c.key)
                append(HANDLERS[k](self, sid, op))
                i += 1
        except BrokerError as e:
            counters.refused += 1
            return w.encode_step_reply(self._num_slabs(), results, e, i)
        except _Load as load:
            return self._wait(c, s, ops, i, results, load)
        core = w._core
        if core is not None:  # ``encode_step_reply``'s native case, inline
            out = core.encode_ok_reply(self._num_slabs(), results)
            if out is not None:
                return out
        return w.encode_step_reply(self._num_slabs(), results)

    def _op(self, sid: int, op: w.Op) -> bytes:
        """One op's result record (its rule already enforced)."""
        handler = HANDLERS.get(op.kind)
        if handler is None:
            raise invalid(f"unknown op kind {op.kind}")  # decode_step lets none through
        return handler(self, sid, op)

    def _manager(self):
        if self.adapters is None:
            raise BrokerError(Code.FAILED_PRECONDITION, "adapters are not enabled on this broker")
        return self.adapters

    def _objects(self, kind: int, sid: int, objs) -> bytes:
        """A lookup's or pin's reply: the objects' records for ``sid``, joined by the store's
        native core where it is built (the same bytes as ``encode_allocations``)."""
        core = self._store_core
        if core is not None and objs.__class__ is list:
            out = core.encode_rows(kind, sid, objs, w._wire_parts)
            if out is not None:
                return out
        return w.encode_allocations(kind, sid, objs)

    def _frames(self, c: _Conn, data: bytes) -> int:
        """``_readable``'s frames: answer each whole frame at the start of ``data`` in order, as its one
        frame is (a STEP frame of a session without a recorder straight to ``_step_frame``),
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
            if kind == _STEP and session is not None and self._record is None:
                reply = self._step_frame(c, view[pos + 5 : stop])
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

    def _step_timed(self, c: _Conn, s, ops: list) -> bytes:
        """``_step``'s ops with a recorder: each op timed, its latency recorded once the reply
        is out (the metric costs more than most ops), and its seconds counted by kind."""
        sessions, counters = self.sessions, self.counters
        sid = s.session_id
        results: list[bytes] = []
        spent = counters.op_seconds
        handlers = HANDLERS
        done: list = []
        checked = False
        clock = time.perf_counter
        t0 = clock()
        for i, op in enumerate(ops):
            k = op.kind
            try:
                if not checked or PER_OP_RULE[k]:
                    sessions.authorize(METHODS[k], RULES[k], s, op_ids(op), key=c.key)
                    checked = True
                results.append(handlers[k](self, sid, op))
            except BrokerError as e:
                counters.refused += 1
                done.append((clock() - t0, METHODS[k], e.code.value))
                self._loop.call_soon(_record_all, self._record, done)
                return w.encode_step_reply(self._num_slabs(), results, e, i)
            except _Load as load:
                # The wait's own latency is the acquire's; the ops after it are not timed.
                self._loop.call_soon(_record_all, self._record, done)
                return self._wait(c, s, ops, i, results, load)
            t1 = clock()
            spent[k] += t1 - t0
            done.append((t1 - t0, METHODS[k], "OK"))
            t0 = t1
        if done:
            self._loop.call_soon(_record_all, self._record, done)
        return w.encode_step_reply(self._num_slabs(), results)

    # ------------------------------------------------------------ frames that wait for a load

    def _wait(self, c: _Conn, s, ops: list, i: int, results: list, load: _Load) -> None:
        """Op ``i`` of a frame needs an adapter load: the frame goes on in a task of the loop
        (``_after_load``), and the connection is not read until its reply is out."""
        self.counters.loads += 1
        c.waiting = True
        if not c.outbuf:  # with an outbuf, reading stopped already
            self._loop.remove_reader(c.sock.fileno())
        task = self._loop.create_task(self._after_load(c, s, ops, i, results, load))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _gone(self, c: _Conn, fd: int) -> bool:
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

    async def _after_load(self, c: _Conn, s, ops: list, i: int, results: list, load: _Load) -> None:
        """The rest of a waiting frame: the acquire's result, then its later ops (a second
        load waits the same way), its reply, and reading the connection again."""
        fd, sid = c.sock.fileno(), s.session_id
        error = None
        while error is None:
            try:
                r = await load.start()
            except BrokerError as e:
                error = e
                break
            except Exception as e:  # a bug: say so on this connection only
                self._log("step_channel_internal_error", error=repr(e))
                error = BrokerError(Code.INTERNAL, f"internal error in the step channel: {e!r}")
                break
            if self._gone(c, fd):  # the connection went meanwhile: nobody holds these
                _give_back(self.adapters, sid, load, r)
                return
            results.append(_acquired(r))
            i += 1
            self.room.reset()
            try:
                for op in ops[i:]:
                    k = op.kind
                    self.sessions.authorize(METHODS[k], RULES[k], s, op_ids(op), key=c.key)
                    results.append(HANDLERS[k](self, sid, op))
                    i += 1
                break
            except _Load as again:
                load = again
            except BrokerError as e:
                error = e
        if error is not None:
            self.counters.refused += 1
        c.waiting = False
        if self._conns.get(fd) is not c:
            return
        self._reply(c, w.encode_step_reply(self._num_slabs(), results, error, i))
        if self._conns.get(fd) is c and not c.outbuf and not c.waiting:
            if c.closing:
                self._drop(c)
                return
            self._loop.add_reader(fd, self._readable, c)
            self._buffered(c)  # frames that arrived while it waited


# Each op kind's handler: (server, session id, op) -> the op's result record, its rule already
# enforced (decode_step lets no other kind through). The store and the manager take the op's
# items as decoded (a tuple: they read it, never keep or change it).


def _lookup(server: StepChannelServer, sid: int, op: w.Op) -> bytes:
    objs = server.store.lookup(sid, op.items, bool(op.flags), server.room)
    core = server._store_core  # ``_objects``, inline
    if core is not None and objs.__class__ is list:
        out = core.encode_rows(_OP_LOOKUP, sid, objs, _wire_parts)
        if out is not None:
            return out
    return w.encode_allocations(_OP_LOOKUP, sid, objs)


def _unpin(server: StepChannelServer, sid: int, op: w.Op) -> bytes:
    server.store.unpin(sid, op.items)
    return _UNPIN_DONE


def _release(server: StepChannelServer, sid: int, op: w.Op) -> bytes:
    m = server.adapters
    if m is None:
        m = server._manager()  # raises
    if not m.release_hot(sid, op.items):
        m.release(sid, list(op.items))
    return _RELEASE_DONE


def _acquire(server: StepChannelServer, sid: int, op: w.Op) -> bytes:
    """Pin adapters as ``AdapterManager.acquire`` (or ``prepare_acquire``) does, with its
    admission, deferral and errors.

    When every admitted adapter is hot the manager's acquire does not yield to the loop, so
    it runs to completion right here, between two other callbacks of the loop, like any
    other core call. Otherwise it raises ``_Load``: the frame waits for the load in a task
    (``StepChannelServer._wait``) and is answered when it is done."""
    m = server.adapters
    if m is None:
        m = server._manager()  # raises FAILED_PRECONDITION, as gRPC does
    prepare = bool(op.flags & w.ACQUIRE_PREPARE)
    if not prepare:
        objs = m.pin_hot(sid, op.items, op.max_adapters)
        if objs is not None:
            return _hot_rows(server._rows, server._core, m, op.items, objs)
    ids, cap, lease = list(op.items), op.max_adapters or None, (op.lease_ms / 1000.0) or None

    def start():
        return m.prepare_acquire(sid, ids, cap, False, lease) if prepare else m.acquire(sid, ids, cap, False)

    distinct = list(dict.fromkeys(ids))
    if not all(isinstance(a, str) and m.is_hot(a) for a in distinct[: cap or len(distinct)]):
        raise _Load(start, prepare)
    coro = start()
    try:
        coro.send(None)
    except StopIteration as done:
        return _acquired(done.value)
    # It waited on something after all: never leave it half done; the frame waits for it.
    coro.close()
    raise _Load(start, prepare)


def _acquired(r) -> bytes:
    """An ``AcquireResult``'s reply record."""
    return w.encode_acquire_rows(
        r.txn_id,
        r.deadline_unix,
        [(a.generation, a.object_id, _TIERS[a.found_in.value], a.pages) for a in r.adapters],
    )


def _give_back(m, sid: int, load: _Load, r) -> None:
    """What a load acquired for a connection that went before its reply: given back (a session
    that ended meanwhile has dropped it already, hence the refusals ignored)."""
    with contextlib.suppress(BrokerError):
        if load.prepare and r.txn_id:
            m.abort_acquire(sid, r.txn_id)
        elif r.adapters:
            m.release(sid, [a.adapter_id for a in r.adapters])


def _pin(server: StepChannelServer, sid: int, op: w.Op) -> bytes:
    return server._objects(w.OP_PIN, sid, server.store.pin(sid, op.items, server.room))


def _commit(server: StepChannelServer, sid: int, op: w.Op) -> bytes:
    m = server._manager()
    for t in op.items:
        m.commit_acquire(sid, t)
    return _COMMIT_DONE


def _abort(server: StepChannelServer, sid: int, op: w.Op) -> bytes:
    m = server._manager()
    for t in op.items:
        m.abort_acquire(sid, t)
    return _ABORT_DONE


HANDLERS: dict[int, Callable[[StepChannelServer, int, w.Op], bytes]] = {
    w.OP_LOOKUP: _lookup,
    w.OP_UNPIN: _unpin,
    w.OP_ACQUIRE: _acquire,
    w.OP_RELEASE: _release,
    w.OP_PIN: _pin,
    w.OP_COMMIT: _commit,
    w.OP_ABORT: _abort,
}


def _hot_rows(kept: dict[int, bytes], core, m, items, objs: list) -> bytes:
    """The reply to an acquire ``pin_hot`` made: each object's row, kept from the last time
    (joined in one C call with the native core)."""
    if core is not None:
        joined = core.join_rows(_acquire_head(len(objs)), kept, objs)
        if joined is not None:
            return joined
    rows = list(map(kept.get, map(_OID, objs)))
    if None in rows:
        if len(kept) > ROWS_KEPT:
            kept.clear()
        own = m.hot.own
        for i, aid in enumerate(dict.fromkeys(items)):
            if rows[i] is None:
                o = objs[i]
                rows[i] = kept[o.object_id] = w.acquire_row(own[aid].generation, o.object_id, w.TIER_HOT, o.pages)
    return w.encode_acquire_joined(rows)
