"""The client's step path: one compact round trip per engine step, none when nothing changed.

``StepTransport`` (``transport.py``) is a blocking Unix socket to the broker's step
channel (the frames of ``memory_broker.proto.wire.step``, authenticated by the session token and this
process's credentials). ``StepPath`` sits on it for one session: it sends batches of ops and, when asked to
(``hold_s > 0``), keeps a cache of the adapters and pins this process holds, with local
reference counts. A release to count 0 is not sent at once: the broker keeps that pin (so
nothing of it can be evicted) until the release rides along with the next frame, and an
acquire of an adapter still held costs no round trip. A lookup always goes to the broker: the
cache holds objects by id, and a key may name another object by the next lookup (its owner
freed the one held) without the broker telling this process. Idle holdings are released
after ``hold_s`` or when more than ``max_idle`` are idle. ``StepPath.delta`` is the lean
call of a running batch (``clients/step/batch.py``): its work is proportional to the change. This
module knows nothing of gRPC, mappings or tensors (``BrokerClient`` turns its records into
leases and objects). The holdings cache's bookkeeping is ``StepHoldings`` (``holdings.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from memory_broker.clients.step.delta import PendingDelta, post_idle, send_delta
from memory_broker.clients.step.holdings import HeldAdapter, HeldPin, StepHoldings
from memory_broker.clients.step.pending import PendingStep, StepOutcome, _Plan
from memory_broker.clients.step.transport import StepTransport, StepUnavailable
from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.errors import BrokerError

log = logging.getLogger(__name__)

# Idle holdings kept at most (beyond this the oldest are released with the next frame).
DEFAULT_MAX_IDLE = 4096


class StepPath:
    """Batched step ops for one session, with an optional holdings cache (``hold_s > 0``)."""

    def __init__(self, transport: StepTransport, *, hold_s: float = 0.0, max_idle: int = DEFAULT_MAX_IDLE):
        self.transport = transport
        self.hold_s = hold_s
        # Whether the holdings cache is on (read on every step, several times: a plain field).
        self.caching = hold_s > 0
        # Reentrant: a step holds it while it sends; one caller at a time on the socket.
        self.lock = threading.RLock()
        # What this process holds at the broker, with local counts (``holdings.py``).
        self.held = StepHoldings(hold_s, max_idle, self.lock)
        # Frames sent (what tests and the benchmark count round trips by).
        self.frames = 0
        # A step sent by ``begin`` or ``delta`` whose reply is not read yet (at most one).
        self._pending = None

    @property
    def adapters(self) -> dict[str, HeldAdapter]:
        return self.held.adapters

    @property
    def pins(self) -> dict[int, HeldPin]:
        return self.held.pins

    def idle(self) -> int:
        """Holdings kept idle at the broker (released with a later frame)."""
        return self.held.idle()

    def sweep_due(self) -> bool:
        return self.held.sweep_due()

    def delta(self, acquire: list[str], release: list[str], keys: list[bytes], unpin: list[int]) -> PendingDelta:
        """A running batch's change (``StepBatch``): hold ``acquire`` (distinct ids), give back
        ``release``, look up and pin the longest present prefix of ``keys``, unpin ``unpin``.
        At most one frame, sent now; ``PendingDelta.result()`` reads its reply (``delta.py``)."""
        return send_delta(self, acquire, release, keys, unpin)

    # ------------------------------------------------------------ one round trip

    def send(self, ops: list[w.Op]) -> w.StepReply:
        """One frame and its reply (after the reply of a step begun earlier)."""
        with self.lock:
            if self._pending is not None:
                self._pending._collect()
            self.frames += 1
            return self.transport.request(w.encode_step(ops))

    def post(self, ops: list, own: int = -1) -> None:
        """A give-back's frame (``ops``: ``Op``s, or their fields as tuples) sent without
        waiting for its reply (``StepTransport.post``: read before the next awaited one, the
        refusal of one of its first ``own`` ops, all by default, kept in ``transport.refused``,
        of a later one only logged); at ``POST_LIMIT`` unread, the oldest is read first."""
        data = w.encode_step(ops)
        with self.lock:
            transport = self.transport
            while transport.full():
                if not transport.read_oldest():
                    self._pending._collect()  # a begun step's reply is the oldest: kept for it
            self.frames += 1
            transport.post(data, ops, own)

    def settle(self) -> None:
        """Read every unread reply: the posted frames', and a begun step's (kept for its
        ``result()``)."""
        with self.lock:
            if self._pending is not None:
                self._pending._collect()
            self.transport.settle()

    @staticmethod
    def raise_error(reply: w.StepReply) -> None:
        if reply.error is not None:
            raise reply.error

    # ------------------------------------------------------------ the step

    def step(  # noqa: PLR0913 - the public step call: each part of a step is an optional keyword
        self,
        adapter_ids: Sequence[str] = (),
        keys: Sequence[bytes] = (),
        *,
        max_adapters: int = 0,
        prepare: bool = False,
        lease_ms: int = 0,
        commit: Sequence[int] = (),
        abort: Sequence[int] = (),
        release: Sequence[str] = (),
        unpin: Sequence[int] = (),
        acquire: bool = True,
        lookup: bool = True,
        pin_keys: bool = True,
        carry: bool = False,
    ) -> StepOutcome:
        """Release and unpin, commit or abort prepared acquires, acquire adapters, look up
        (and pin) keys: at most one round trip, none when the cache has every adapter and
        there are no keys.

        With the cache, ``release`` and ``unpin`` drop local references (the broker is told
        with a later frame) and a held adapter costs nothing; keys always go to the broker
        (the pin it takes on an object the cache holds already goes back with the next
        frame, ``StepHoldings.surplus``). Raises
        BrokerError for a refused op; ops before it in the frame took effect and are
        accounted for.

        ``carry``: the adapters of ``release`` were taken from this cache by one earlier step,
        so what this step takes again passes over without a count change (objects do not:
        ``unpin`` drops their references, and what the keys name is the broker's answer)."""
        with self.lock:
            # A begun step's reply first: planned against the cache without it, this step
            # would acquire again what that step is acquiring and count it once.
            if self._pending is not None:
                self._pending._collect()
            plan = self._plan(
                list(adapter_ids) if acquire else None,
                list(keys) if lookup else None,
                max_adapters,
                prepare,
                lease_ms,
                commit,
                abort,
                release,
                unpin,
                pin_keys,
                carry,
            )
            reply = self.send(plan.ops) if plan.ops else None
            return self._finish(plan, reply)

    def begin(self, adapter_ids: Sequence[str] = (), keys: Sequence[bytes] = (), **kw) -> PendingStep:
        """``step`` without waiting: the frame is sent now and its reply read by
        ``PendingStep.result()`` (or before the next frame), so the round trip overlaps
        whatever the caller does in between (the model's work for the current step)."""
        acquire, lookup = kw.pop("acquire", True), kw.pop("lookup", True)
        with self.lock:
            if self._pending is not None:
                self._pending._collect()
            plan = self._plan(
                list(adapter_ids) if acquire else None,
                list(keys) if lookup else None,
                kw.pop("max_adapters", 0),
                kw.pop("prepare", False),
                kw.pop("lease_ms", 0),
                kw.pop("commit", ()),
                kw.pop("abort", ()),
                kw.pop("release", ()),
                kw.pop("unpin", ()),
                kw.pop("pin_keys", True),
                kw.pop("carry", False),
            )
            if kw:
                raise TypeError(f"unknown arguments {sorted(kw)}")
            p = PendingStep(self, plan)
            if plan.ops:
                self.frames += 1
                self.transport.send(w.encode_step(plan.ops))
                self._pending = p
            else:
                p._reply_done = True
            return p

    def _plan(self, ids, keys, cap, prepare, lease_ms, commit, abort, release, unpin, pin_keys, carry) -> _Plan:  # noqa: PLR0913 - step()'s own arguments, passed on
        out = StepOutcome()
        ops: list[w.Op] = []
        caching = self.caching and not prepare
        now = time.monotonic()
        admitted: list[str] = []
        if ids is not None:
            distinct = list(dict.fromkeys(ids))
            n = cap or len(distinct)
            admitted, out.deferred = distinct[:n], distinct[n:]
        carried_a, release = self._carried_adapters(caching, carry, release, admitted)
        self._give_back_ops(ops, release, unpin, commit, abort, now)
        acq_index, held, missing_ids = self._acquire_op(ops, ids, admitted, carried_a, caching, prepare, cap, lease_ms)
        look_index = self._lookup_op(ops, keys, pin_keys)
        # Idle holdings past their time ride at the end of this frame (the caller's ops run
        # first whatever becomes of them), or get a frame of their own when there is none.
        own = len(ops)
        if self.caching:
            ops.extend(self.held.flush_ops(now, force=False))
        return _Plan(
            out,
            ops,
            now,
            caching,
            acq_index,
            look_index,
            admitted,
            missing_ids,
            ids,
            keys,
            pin_keys,
            held,
            own,
        )

    def _carried_adapters(self, caching: bool, carry: bool, release, admitted: list[str]) -> tuple[set, list]:
        """What the previous step gives back and this one takes again keeps its reference
        (the usual step: most of the batch stays): those adapters, and what is still released."""
        carried_a: set = set()
        if caching and carry and release and admitted:
            carried_a = set(release).intersection(admitted)
            if carried_a:
                release = [a for a in release if a not in carried_a]
        return carried_a, release

    def _give_back_ops(self, ops: list[w.Op], release, unpin, commit, abort, now: float) -> None:
        """The ops that give back (appended to ``ops``): releases and unpins the cache does not
        keep, commits, aborts. They come first: what the step gives back makes room for what
        it takes."""
        if release:
            direct = self.held.drop_adapter_refs(release, now) if self.caching else release
            if direct:
                ops.append(w.Op(w.OP_RELEASE, tuple(direct)))
        if unpin:
            direct = self.held.drop_pin_refs(unpin, now) if self.caching else unpin
            if direct:
                ops.append(w.Op(w.OP_UNPIN, tuple(direct)))
        if commit:
            ops.append(w.Op(w.OP_COMMIT, tuple(commit)))
        if abort:
            ops.append(w.Op(w.OP_ABORT, tuple(abort)))

    def _acquire_op(
        self, ops: list[w.Op], ids, admitted: list[str], carried_a: set, caching: bool, prepare, cap, lease_ms
    ) -> tuple[int, dict[str, w.AcquiredRecord], list[str]]:
        """The acquire op, if the step needs one (appended to ``ops``): its index (-1: none),
        the cached adapters it took references on, and the ones it asks the broker for."""
        acq_index = -1
        held: dict[str, w.AcquiredRecord] = {}
        missing_ids: list[str] = []
        if ids is not None:
            if caching:
                # References taken now, so nothing can flush them before this step's reply.
                adapters = self.held.adapters
                for a in admitted:
                    h = adapters.get(a)
                    if h is not None:
                        held[a] = h.record if a in carried_a else self.held.lease_record(a)
                missing_ids = [a for a in admitted if a not in held]
            else:
                missing_ids = admitted
            if missing_ids or not caching:
                acq_index = len(ops)
                # Cached: only the missing ones, each admitted already (no cap needed).
                ops.append(
                    w.Op(
                        w.OP_ACQUIRE,
                        tuple(missing_ids) if caching else tuple(ids),
                        w.ACQUIRE_PREPARE if prepare else 0,
                        0 if caching else cap,
                        lease_ms,
                    )
                )
        return acq_index, held, missing_ids

    def _lookup_op(self, ops: list[w.Op], keys, pin_keys: bool) -> int:
        """The lookup op of ``keys`` (appended to ``ops``): its index (-1: none). Every key goes
        to the broker, held or not (the cache holds objects by id, never answers a key)."""
        if not keys:
            return -1
        ops.append(w.Op(w.OP_LOOKUP, tuple(keys), 1 if pin_keys else 0))
        return len(ops) - 1

    def _finish(self, plan: _Plan, reply: w.StepReply | None) -> StepOutcome:
        out = plan.out
        reply = self._settle(plan, reply)
        results = reply.results if reply is not None else []
        ok = reply is None or reply.error is None
        if plan.ids is not None:
            self._finish_adapters(plan, results, ok)
        if plan.keys is not None:
            look = plan.look_index
            new: list[w.ObjectRecord] = results[look] if 0 <= look < len(results) else []
            if self.caching and plan.pin_keys:
                for rec in new:
                    self.held.add_pin(rec, plan.now)
                if ok:
                    for rec in new:
                        self.held.ref_pin(rec.object_id)
            out.objects = list(new)
        if reply is not None:
            self.raise_error(reply)
        return out

    def _settle(self, plan: _Plan, reply: w.StepReply | None) -> w.StepReply | None:
        """The reply as the caller's ops see it: a refusal of the idle holdings' release alone
        (ops past ``plan.own``) is logged and dropped; those ops are posted again when an op
        of the caller's was refused before them."""
        if reply is None:
            return None
        plan.out.round_trips = 1
        plan.out.arena_slabs = reply.arena_slabs
        if reply.error is not None and reply.failed_index >= plan.own:
            # Only the release of idle holdings was refused (what they held is gone
            # already, e.g. freed): nothing the caller asked for.
            log.warning("step cache: releasing idle holdings was refused: %s", reply.error)
            return w.StepReply(reply.arena_slabs, reply.results)
        if reply.error is not None and len(plan.ops) > plan.own:
            post_idle(self, plan.ops[plan.own :])
        return reply

    def _finish_adapters(self, plan: _Plan, results: list, ok: bool) -> None:
        """The step's adapters into ``plan.out`` (their records in admitted order), the cache
        told what the acquire took; what a refused frame acquired is given back."""
        out, now, caching, admitted = plan.out, plan.now, plan.caching, plan.admitted
        got: Sequence[w.AcquiredRecord] = ()  # uncached: the records, in admitted order
        loaded: dict = {}  # cached: what this frame loaded (not hot when asked), by id
        if 0 <= plan.acq_index < len(results):
            r: w.AcquireOutcome = results[plan.acq_index]
            out.acquire_hot = r.hot
            out.txn_id = r.txn_id
            if r.hot and caching:
                for aid, rec in zip(plan.missing_ids, r.adapters):
                    # Held from now on; idle until a lease takes it below.
                    self.held.adapters[aid] = HeldAdapter(
                        w.AcquiredRecord(rec.generation, rec.object_id, w.TIER_HOT, rec.pages), 0, now
                    )
                    self.held.idle_a[aid] = None
                    if rec.found_in != w.TIER_HOT:
                        loaded[aid] = rec
            elif r.hot:
                got = r.adapters
                if not ok:
                    self._undo_acquire(admitted, r)
        if ok and out.acquire_hot:
            if caching:
                held = plan.held
                out.adapters = [(aid, held.get(aid) or self.held.lease_record(aid)) for aid in admitted]
                if loaded:  # this step's lease says where they were found; the cache holds them hot
                    out.adapters = [(aid, loaded.get(aid, rec)) for aid, rec in out.adapters]
            elif len(got) >= len(admitted):  # a record per admitted id, in order
                out.adapters = list(zip(admitted, got))
            else:
                out.adapters = [(aid, dict(zip(admitted, got))[aid]) for aid in admitted]  # KeyError
        elif plan.held:
            self.held.drop_adapter_refs(list(plan.held), now)

    def give_back(self, release: Sequence[str] = (), unpin: Sequence[int] = (), post: bool = True) -> None:
        """Release adapters and unpin objects: ``step`` with nothing to take, its frame (if
        any) posted (``post``; else sent, and its refusal raised): ``give_back``, below."""
        give_back(self, release, unpin, post)

    def _undo_acquire(self, admitted: list[str], r: w.AcquireOutcome) -> None:
        """A later op of the frame failed: give back what its acquire took (the caller gets
        the error, not a lease)."""
        op = w.Op(w.OP_ABORT, (r.txn_id,)) if r.txn_id else w.Op(w.OP_RELEASE, tuple(admitted))
        try:
            self.send([op])
        except (BrokerError, StepUnavailable):
            pass  # the session is gone, and its pins with it

    def flush(self, post: bool = False) -> int:
        """Release every idle holding now (one frame if there are any: posted with ``post``,
        else sent and its refusal raised); returns how many."""
        with self.lock:
            if self._pending is not None:
                self._pending._collect()
            ops = self.held.flush_ops(time.monotonic(), force=True)
            if not ops:
                return 0
            n = sum(len(op.items) for op in ops)
            if post:
                self.post(ops)
            else:
                self.raise_error(self.send(ops))
            return n


def give_back(path: StepPath, release: Sequence[str], unpin: Sequence[int], post: bool) -> None:
    """``StepPath.give_back``. With the cache, local references are dropped and what the cache
    does not hold goes to the broker; idle holdings now due go too, their refusal only logged
    (as ``StepPath.step``'s)."""
    if not post:
        path.step(release=release, unpin=unpin, acquire=False, lookup=False)
        return
    with path.lock:
        # A begun step's reply first, as for ``step``: the cache then holds what it took,
        # and a reference dropped on it stays local.
        if path._pending is not None:
            path._pending._collect()
        now = time.monotonic()
        ops: list[w.Op] = []
        path._give_back_ops(ops, release, unpin, (), (), now)
        if ops:
            path.post(ops)
        # Idle holdings now due: a frame of their own, which runs even where the caller's is
        # refused (behind it, a refused op would stop them; they have left the cache already).
        idle = path.held.flush_ops(now, force=False) if path.caching else None
        if idle:
            path.post(idle, own=0)
