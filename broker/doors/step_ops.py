"""The step channel's frames, executed: a STEP frame's ops run in order on the core, as its session.

``StepOps`` is what the step channel (``step_channel.py``, the connections) hands each STEP frame
of a session: its ops (release adapters, unpin, pin, commit/abort adapter acquires, acquire
adapters, look up keys) run in order on the same ``ObjectStore`` and ``AdapterManager`` the gRPC
service uses, each authorized with the rule of the RPC it stands for, so gRPC sees every change
and a dead process's pins go with its session. An acquire whose adapters are all hot is answered
in the frame's callback; one that needs a load (or a conversion) raises ``_Load``: the frame goes
on in a task of the loop, and the connection (its ``links``: ``StepChannelServer.pause`` and
``resume``) reads nothing more until the frame's reply is out, so its replies stay in order while
every other connection and gRPC are served. It must not import gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from memory_broker.broker.adapters import hotcore
from memory_broker.broker.doors.policy import POLICY
from memory_broker.broker.sessions.manager import NO_FIELDS
from memory_broker.broker.store.object_table import ReplyRoom
from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.errors import BrokerError, Code, denied, invalid
from memory_broker.proto.wire.layout import parse_shards
from memory_broker.proto.wire.messages import layout_to_proto

# Acquire reply rows of hot adapter objects kept at most (each a few dozen bytes).
ROWS_KEPT = 16384
# An object's id (C-level, over a list of objects).
_OID = attrgetter("object_id")
_STEP, _PING, _OP_LOOKUP, _Op, _encode_allocations = w.STEP, w.PING, w.OP_LOOKUP, w.Op, w.encode_allocations
# An acquire reply's head by adapter count (C-level cache: no Python frame when it hits).
_acquire_head = functools.lru_cache(maxsize=1024)(w.acquire_head)

# The result records of the ops that answer only their kind.
_UNPIN_DONE, _RELEASE_DONE, _COMMIT_DONE, _ABORT_DONE = (
    bytes((k,)) for k in (w.OP_UNPIN, w.OP_RELEASE, w.OP_COMMIT, w.OP_ABORT)
)

_TIERS = {"hot": w.TIER_HOT, "warm": w.TIER_WARM, "cold": w.TIER_COLD}
# Each op is recorded in the RPC latency metric under the gRPC method it stands for, so
# dashboards and alerts count fast-path work as they count RPCs; refused frames as "Step".
METHODS = {
    w.OP_RELEASE: "ReleaseAdapters",
    w.OP_RELEASE_IN: "ReleaseAdapters",
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


class _Load(Exception):
    """Raised by an acquire op that must wait for a load: ``start()`` makes the manager's
    acquire coroutine (``prepare``: a two-phase one), which the frame's task awaits."""

    def __init__(self, start: Callable, prepare: bool, dtype: str = ""):
        super().__init__("an adapter load")
        # ``dtype``: the copies' (what a give-back releases them in).
        self.start, self.prepare, self.dtype = start, prepare, dtype


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


class StepOps:
    """Runs STEP frames' ops on the core (``store``, ``sessions``, ``adapters``), on the loop."""

    def __init__(  # noqa: PLR0913 - keyword-only settings, each named at the one call site
        self,
        *,
        loop,
        store,
        sessions,
        adapters,
        num_slabs: Callable[[], int] = lambda: 0,
        record: Callable[[float, str, str], None] | None = None,
        log: Callable[..., None] | None = None,
        counters: StepCounters | None = None,
        links=None,
    ):
        """
        Args:
            loop: the event loop that owns the core; every frame runs on it.
            store, sessions, adapters: the core (``adapters`` may be None: an acquire is
                refused FAILED_PRECONDITION, as over gRPC).
            num_slabs: the arena's slab count now (every reply carries it).
            record: ``record(seconds, method, code)`` per op (the RPC latency metric).
            counters: what the channel did (shared with its connections).
            links: the connections' side of a frame that waits for a load: ``pause(c)``,
                ``gone(c, fd)`` and ``resume(c, fd, reply)`` (``StepChannelServer``).
        """
        self._loop = loop
        self.store = store
        self.sessions = sessions
        self.adapters = adapters
        self._num_slabs = num_slabs
        self._record = record
        self._log = log or (lambda event, **kw: None)
        self.counters = counters if counters is not None else StepCounters()
        self.links = links
        # Each hot adapter object's row of an acquire reply, by object id (its generation and
        # pages never change): a hot acquire joins them. Cleared when it grows past ROWS_KEPT.
        self._rows: dict[int, bytes] = {}
        self._core = hotcore.load()
        # What is left of the reply of the frame being answered (its object records are
        # bounded like its request: ``ReplyRoom``, reset per frame).
        self.room = ReplyRoom()
        # Frames waiting for an adapter load (``_Load``), one task each; cancelled by ``close``.
        self._tasks: set[asyncio.Task] = set()

    def close(self) -> None:
        """Cancel the frames that wait for a load."""
        for t in list(self._tasks):
            t.cancel()

    def step_frame(self, c, body) -> bytes | None:
        """``_frame`` of a STEP frame on a connection past HELLO where no recorder is set
        (nothing to time): the same reply and counters, without the rest of the dispatch."""
        counters = self.counters
        counters.frames += 1
        try:
            core = w._core  # read per frame: the codec may be switched (tests, benchmarks)
            ops = None if core is None else core.decode_step(body, _Op)
            if ops is None:  # the pure-Python codec, or a body the native pass leaves to it
                return self.step(c, body)
            return self._ops(c, c.session, ops)
        except BrokerError as e:
            counters.refused += 1
            return w.error_frame(e)
        except Exception as e:  # a bug: say so on this connection only
            self._log("step_channel_internal_error", error=repr(e))
            return w.error_frame(BrokerError(Code.INTERNAL, f"internal error in the step channel: {e!r}"))

    def step(self, c, body) -> bytes | None:
        s = c.session
        if s is None:
            raise denied("send HELLO with the session token first")
        try:
            ops = w.decode_step(body)
        except w.WireError as e:
            raise invalid(f"malformed step frame: {e}") from None
        return self._ops(c, s, ops)

    def _ops(self, c, s, ops: list) -> bytes | None:
        """A decoded STEP frame's ops, in order, as ``s`` (the connection's session): the
        reply, which carries the error of the first op refused (and the results before it);
        None when an op waits for an adapter load (``_wait`` sends the reply)."""
        sessions = self.sessions
        # The frame as a whole: a draining broker or an ended session refuses it before any op.
        if sessions.draining or s.closed:
            sessions.check_session(s, "a step")  # raises, saying why
        self.counters.ops += len(ops)
        self.room.reset()  # the frame's reply: its records and bytes (the store takes from it)
        results: list[bytes] = []
        i, error, load = self._run(c, s, ops, 0, results, sessions.authorize_open)
        if load is not None:
            return self._wait(c, s, ops, i, results, load)
        return self._reply(results, error, i)

    def _run(self, c, s, ops: list, i: int, results: list, check_first) -> tuple[int, BrokerError | None, _Load | None]:
        """``ops[i:]`` in order as session ``s``, each op's record appended to ``results``:
        the first op's whole rule through ``check_first`` (``authorize_open`` in the callback
        that checked the session, ``authorize`` after a wait), later ones only the rules that
        look at the op's own ids (the session and its proof cannot change between two ops of
        one callback). Returns where it stopped: (the index of the op that stopped it, or
        ``len(ops)``; that op's refusal; the load it waits for). With a recorder, each op is
        timed and its latency recorded once the reply is out (the metric costs more than
        most ops)."""
        sid, key, sessions = s.session_id, c.key, self.sessions
        record = self._record
        done: list | None = None if record is None else []
        spent = self.counters.op_seconds
        clock = time.perf_counter
        t0 = clock() if done is not None else 0.0
        first, k = i, 0
        try:
            for op in ops[i:] if i else ops:
                k = op.kind
                if i == first:
                    check_first(METHODS[k], RULES[k], s, op_ids(op) if VISIBLE[k] else NO_FIELDS, key=key)
                elif PER_OP_RULE[k]:
                    sessions.authorize(METHODS[k], RULES[k], s, op_ids(op), key=key)
                results.append(HANDLERS[k](self, sid, op))
                i += 1
                if done is not None:
                    t1 = clock()
                    spent[k] += t1 - t0
                    done.append((t1 - t0, METHODS[k], "OK"))
                    t0 = t1
        except BrokerError as e:
            if done is not None:
                done.append((clock() - t0, METHODS[k], e.code.value))
            return i, e, None
        except _Load as load:
            return i, None, load  # the wait's own latency is the acquire's
        finally:
            if done:
                self._loop.call_soon(_record_all, record, done)
        return i, None, None

    def _reply(self, results: list, error: BrokerError | None, i: int) -> bytes:
        """A frame's reply: its results, and the refusal of op ``i`` if one was refused."""
        if error is not None:
            self.counters.refused += 1
            return w.encode_step_reply(self._num_slabs(), results, error, i)
        core = w._core
        if core is not None:  # ``encode_step_reply``'s native case
            out = core.encode_ok_reply(self._num_slabs(), results)
            if out is not None:
                return out
        return w.encode_step_reply(self._num_slabs(), results)

    def op(self, sid: int, op: w.Op) -> bytes:
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
        """A lookup's or pin's reply: the objects' records for ``sid``."""
        return w.encode_allocations(kind, sid, objs)

    # ------------------------------------------------------------ frames that wait for a load

    def _wait(self, c, s, ops: list, i: int, results: list, load: _Load) -> None:
        """Op ``i`` of a frame needs an adapter load: the frame goes on in a task of the loop
        (``_after_load``), and the connection is not read until its reply is out."""
        self.counters.loads += 1
        self.links.pause(c)
        task = self._loop.create_task(self._after_load(c, s, ops, i, results, load))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _after_load(self, c, s, ops: list, i: int, results: list, load: _Load | None) -> None:
        """The rest of a waiting frame: the acquire's result, then its later ops (a second
        load waits the same way), its reply, and reading the connection again."""
        fd, sid = c.sock.fileno(), s.session_id
        error = None
        while load is not None:
            try:
                r = await load.start()
            except BrokerError as e:
                error = e
                break
            except Exception as e:  # a bug: say so on this connection only
                self._log("step_channel_internal_error", error=repr(e))
                error = BrokerError(Code.INTERNAL, f"internal error in the step channel: {e!r}")
                break
            if self.links.gone(c, fd):  # the connection went meanwhile: nobody holds these
                _give_back(self.adapters, sid, load, r)
                return
            results.append(_acquired(r, self._num_slabs()))
            self.room.reset()
            i, error, load = self._run(c, s, ops, i + 1, results, self.sessions.authorize)
        self.links.resume(c, fd, self._reply(results, error, i))

    # ------------------------------------------------------------ each op kind's handler
    # (session id, op) -> the op's result record, its rule already enforced (decode_step lets
    # no other kind through). The store and the manager take the op's items as decoded (a
    # tuple: they read it, never keep or change it).

    def _lookup(self, sid: int, op: w.Op) -> bytes:
        return _encode_allocations(_OP_LOOKUP, sid, self.store.lookup(sid, op.items, bool(op.flags), self.room))

    def _unpin(self, sid: int, op: w.Op) -> bytes:
        self.store.unpin(sid, op.items)
        return _UNPIN_DONE

    def _release(self, sid: int, op: w.Op) -> bytes:
        m = self.adapters
        if m is None:
            m = self._manager()  # raises
        if not m.release_hot(sid, op.items):
            m.release(sid, list(op.items))
        return _RELEASE_DONE

    def _release_in(self, sid: int, op: w.Op) -> bytes:
        self._manager().release(sid, list(op.items), op.dtype)
        return _RELEASE_DONE

    def _acquire(self, sid: int, op: w.Op) -> bytes:
        """Pin adapters as ``AdapterManager.acquire`` (or ``prepare_acquire``) does, with its
        admission, deferral and errors.

        When every admitted adapter is hot the manager's acquire does not yield to the loop, so
        it runs to completion right here, between two other callbacks of the loop, like any
        other core call. Otherwise it raises ``_Load``: the frame waits for the load in a task
        (``StepChannelServer._wait``) and is answered when it is done. So does an acquire of
        copies in another dtype or of a rank's shards (``ACQUIRE_SHAPED``): an engine asks for
        those as it loads an adapter, not every step."""
        m = self.adapters
        if m is None:
            m = self._manager()  # raises FAILED_PRECONDITION, as gRPC does
        prepare, shaped = bool(op.flags & w.ACQUIRE_PREPARE), bool(op.flags & w.ACQUIRE_SHAPED)
        if not (prepare or shaped):
            objs = m.pin_hot(sid, op.items, op.max_adapters)
            if objs is not None:
                return _hot_rows(self._rows, self._core, m, op.items, objs)
        ids, cap, lease = list(op.items), op.max_adapters or None, (op.lease_ms / 1000.0) or None
        try:
            dtype, shards = op.dtype, parse_shards(op.shard)
        except ValueError as e:
            raise invalid(f"shards: {e}") from None

        def start():
            if prepare:
                return m.prepare_acquire(sid, ids, cap, True, lease, dtype, shards)
            return m.acquire(sid, ids, cap, True, dtype, shards)

        distinct = list(dict.fromkeys(ids))
        if shaped or not all(isinstance(a, str) and m.is_hot(a) for a in distinct[: cap or len(distinct)]):
            raise _Load(start, prepare, dtype)
        coro = start()
        try:
            coro.send(None)
        except StopIteration as done:
            return _acquired(done.value, self._num_slabs())
        # It waited on something after all: never leave it half done; the frame waits for it.
        coro.close()
        raise _Load(start, prepare)

    def _pin(self, sid: int, op: w.Op) -> bytes:
        return self._objects(w.OP_PIN, sid, self.store.pin(sid, op.items, self.room))

    def _commit(self, sid: int, op: w.Op) -> bytes:
        m = self._manager()
        for t in op.items:
            m.commit_acquire(sid, t)
        return _COMMIT_DONE

    def _abort(self, sid: int, op: w.Op) -> bytes:
        m = self._manager()
        for t in op.items:
            m.abort_acquire(sid, t)
        return _ABORT_DONE


def _acquired(r, slabs: int) -> bytes:
    """An ``AcquireResult``'s reply record: with the layouts of the adapters it loaded (a new
    generation: the client would otherwise ask GetAdapterLayout for each)."""
    rows = [(a.generation, a.object_id, _TIERS[a.found_in.value], a.pages) for a in r.adapters]
    layouts = [b"" if a.layout is None or a.found_in.value == "hot" else _layout_bytes(a, slabs) for a in r.adapters]
    return w.encode_acquire_rows(r.txn_id, r.deadline_unix, rows, layouts if any(layouts) else ())


def _layout_bytes(a, slabs: int) -> bytes:
    return layout_to_proto(a.adapter_id, a.layout, a.generation, a.object_id, a.pages, slabs).SerializeToString()


def _give_back(m, sid: int, load: _Load, r) -> None:
    """What a load acquired for a connection that went before its reply: given back (a session
    that ended meanwhile has dropped it already, hence the refusals ignored)."""
    with contextlib.suppress(BrokerError):
        if load.prepare and r.txn_id:
            m.abort_acquire(sid, r.txn_id)
        elif r.adapters:
            m.release(sid, [a.adapter_id for a in r.adapters], load.dtype)


# Each op kind's handler (a StepOps method, called with the server).
HANDLERS: dict[int, Callable[[StepOps, int, w.Op], bytes]] = {
    w.OP_LOOKUP: StepOps._lookup,
    w.OP_UNPIN: StepOps._unpin,
    w.OP_ACQUIRE: StepOps._acquire,
    w.OP_RELEASE: StepOps._release,
    w.OP_RELEASE_IN: StepOps._release_in,
    w.OP_PIN: StepOps._pin,
    w.OP_COMMIT: StepOps._commit,
    w.OP_ABORT: StepOps._abort,
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
