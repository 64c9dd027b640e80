"""A running batch's change on the step path: ``send_delta`` plans it against the path's holdings
and sends it (at most one frame), ``PendingDelta`` reads its reply, ``finish_delta`` accounts it.

The work is proportional to the change (no cap, no prepare, no carry: the batch, ``batch.py``,
counts itself). The functions take the ``StepPath`` (``path.py``) whose socket and holdings
(``StepPath.held``) the change goes through, under that path's lock.
"""

from __future__ import annotations

import logging
import time

from memory_broker.clients.step.holdings import HeldAdapter, HeldPin
from memory_broker.clients.step.transport import StepUnavailable
from memory_broker.proto.wire import step as w

log = logging.getLogger(__name__)


class PendingDelta:
    """A change sent by ``StepPath.delta``; ``result()`` reads its reply (once)."""

    __slots__ = (
        "_path",
        "acquire",
        "held",
        "missing",
        "acq",
        "look",
        "own",
        "idle",
        "sent",
        "_reply_done",
        "_out",
        "_error",
    )

    def __init__(self, path, acquire, held, missing, acq, look, own, sent):
        self._path = path
        self.acquire, self.held, self.missing, self.acq = acquire, held, missing, acq
        self.look, self.own = look, own
        # The idle holdings' ops that ride at the frame's end (from ``own`` on).
        self.idle: list = []
        # Whether a frame went out (False: the cache held every adapter and there were no keys).
        self.sent: bool = sent
        self._reply_done = not sent
        self._out = None
        self._error: BaseException | None = None

    def _collect(self) -> None:
        path = self._path
        path._pending = None
        self._reply_done = True
        try:
            self._out = finish_delta(path, self, path.transport.reply())
        except BaseException as e:
            self._error = e

    def collect(self) -> None:
        """Read the reply now if no call of the path has (a failure is kept: ``result()``
        raises it)."""
        path = self._path
        with path.lock:
            if not self._reply_done:
                self._collect()

    def result(self):
        """(adapter records in order, or None: one is not hot; object records; arena slabs)."""
        path = self._path
        with path.lock:
            if self._out is None and self._error is None:
                if not self._reply_done:
                    self._collect()
                else:
                    try:
                        self._out = finish_delta(path, self, None)
                    except BaseException as e:
                        self._error = e
            if self._error is not None:
                raise self._error
            return self._out


def send_delta(
    path, acquire: list[str], release: list[str], keys: list[bytes], unpin: list[int], pending: type = PendingDelta
) -> PendingDelta:
    """A running batch's change (``StepBatch``): hold ``acquire`` (distinct ids), give back
    ``release``, look up and pin the longest present prefix of ``keys``, unpin ``unpin``.
    At most one frame, sent now; ``PendingDelta.result()`` reads its reply. The work is
    proportional to the change (no cap, no prepare, no carry: the batch counts itself).
    Keys always go to the broker (the holdings are by object id, never answered by key)."""
    cache = path.held
    with path.lock:
        if path._pending is not None:
            path._pending._collect()
        now = time.monotonic()
        got = None
        if caching := path.hold_s > 0:
            core = w._core
            if core is not None:  # one native pass (``_stepcore.c``'s ``delta_plan``)
                got = core.delta_plan(
                    cache.adapters,
                    cache.idle_a,
                    cache.pins,
                    cache.idle_p,
                    acquire,
                    release,
                    keys,
                    unpin,
                    now,
                )
        if got is None:
            got = _plan(cache, caching, acquire, release, keys, unpin, now)
        ops, held, missing, acq, look = got
        own = len(ops)
        if caching and (cache.idle_a or cache.idle_p or cache.surplus):
            ops.extend(cache.flush_ops(now, False))
        p = pending(path, acquire, held, missing, acq, look, own, bool(ops))
        if len(ops) > own:
            p.idle = ops[own:]
        if ops:
            path.frames += 1
            path.transport.send(w.encode_step(ops))
            path._pending = p
        return p


def _plan(cache, caching: bool, acquire, release, keys, unpin, now: float) -> tuple:
    """``send_delta``'s plan against the holdings (``_stepcore.c``'s ``delta_plan`` where the
    native core is there and the path caches): (ops as tuples of their fields, the held
    adapters' records by id, the ids to acquire, the ACQUIRE op's index, the index of the
    LOOKUP op of every key; -1: no such op)."""
    ops: list = []
    if release:
        direct = cache.drop_adapter_refs(release, now) if caching else release
        if direct:
            ops.append((w.OP_RELEASE, tuple(direct)))
    if unpin:
        direct = cache.drop_pin_refs(unpin, now) if caching else unpin
        if direct:
            ops.append((w.OP_UNPIN, tuple(direct)))
    held: dict[str, w.AcquiredRecord] = {}
    missing = acquire
    if caching and acquire:
        adapters = cache.adapters
        missing = []
        for a in acquire:
            h = adapters.get(a)
            if h is None:
                missing.append(a)
                continue
            if h.refs == 0:  # ``cache.lease_record(a)``, inline
                cache.idle_a.pop(a, None)
            h.refs += 1
            h.idle_since = 0.0
            held[a] = h.record
    acq = look = -1
    if missing:
        acq = len(ops)
        ops.append((w.OP_ACQUIRE, tuple(missing)))
    if keys:
        look = len(ops)
        ops.append((w.OP_LOOKUP, tuple(keys), 1))
    return ops, held, missing, acq, look


def finish_delta(path, p: PendingDelta, reply: w.StepReply | None):
    """Account a change's reply in the cache: (adapter records in ``acquire`` order, or
    None when one is not hot; object records of the found prefix). Raises its error."""
    cache = path.held
    caching = path.hold_s > 0
    if caching and reply is not None and reply.error is None and w._core is not None:
        got = _finish_native(cache, p, reply)  # the usual: an accepted change
        if got is not None:
            return got
    results: list = []
    ok = True
    if reply is not None:
        if reply.error is not None and reply.failed_index >= p.own:
            log.warning("step cache: releasing idle holdings was refused: %s", reply.error)
            reply = w.StepReply(reply.arena_slabs, reply.results)
        elif reply.error is not None and p.idle:
            post_idle(path, p.idle)  # refused before them: they did not run
        results = reply.results
        ok = reply.error is None
    # When a refused change's holdings turn idle (an accepted one's are held: no clock read).
    now = 0.0 if ok else time.monotonic()
    recs = _finish_adapters(path, p, results, ok, now) if p.acquire else None
    new: list = results[p.look] if 0 <= p.look < len(results) else []
    if caching:
        if ok:
            pins = cache.pins
            for rec in new:
                if rec.object_id in pins:
                    cache.add_ref_pin(rec)
                else:  # ``add_ref_pin`` of an object the cache does not hold yet (the usual), inline
                    pins[rec.object_id] = HeldPin(rec, 1, 1, 0.0)
        else:
            for rec in new:
                cache.add_pin(rec, now)
    if reply is not None and reply.error is not None:
        raise reply.error
    return recs, new, (reply.arena_slabs if reply is not None else 0)


def _finish_adapters(path, p: PendingDelta, results: list, ok: bool, now: float):
    """``finish_delta``'s adapters: their records in ``p.acquire`` order (None: one is not
    hot, or the change was refused), the cache told what the acquire took; what a refused
    uncached change acquired is given back."""
    cache = path.held
    hot = True
    got: dict = p.held
    if p.acq >= 0:
        r = results[p.acq] if p.acq < len(results) else None
        hot = r is not None and r.hot
        if hot and path.hold_s > 0:
            got = dict(got)
            for aid, rec in zip(p.missing, r.adapters):
                # Held hot from now on; this change's lease says where it was found.
                hot_rec = w.AcquiredRecord(rec.generation, rec.object_id, w.TIER_HOT, rec.pages)
                cache.adapters[aid] = HeldAdapter(hot_rec, 1 if ok else 0, 0.0 if ok else now)
                if not ok:
                    cache.idle_a[aid] = None
                got[aid] = rec if rec.found_in != w.TIER_HOT else hot_rec
        elif hot:
            got = dict(zip(p.missing, r.adapters))
            if not ok:
                path._undo_acquire(p.missing, r)
    if ok and hot:
        return [(aid, got[aid]) for aid in p.acquire]
    if p.held:
        cache.drop_adapter_refs(list(p.held), now or time.monotonic())
    return None


def _finish_native(cache, p: PendingDelta, reply: w.StepReply):
    """``finish_delta`` of an accepted change on a caching path in one native pass
    (``_stepcore.c``'s ``delta_finish``), or None, having changed nothing: the Python pass's."""
    if 0 <= p.acq < len(reply.results) and any(a.found_in != w.TIER_HOT for a in reply.results[p.acq].adapters):
        return None  # a load: its lease says the tier it was found in (the Python pass)
    got = w._core.delta_finish(
        cache.adapters, cache.pins, p.acquire, p.held, p.missing, p.acq, p.look,
        reply.results, w.AcquiredRecord, HeldAdapter, HeldPin, w.TIER_HOT,
    )  # fmt: skip
    return None if got is None else (got[0], got[1], reply.arena_slabs)


def post_idle(path, ops: list) -> None:
    """Idle holdings' ops that rode at the end of a frame refused before them (a refused op
    stops the frame, and they have left the cache already): sent again on ``path`` (a
    ``StepPath``) in a frame of their own, posted, its refusal only logged, so the broker
    does not keep them until the session ends."""
    try:
        path.post(ops, own=0)
    except StepUnavailable as e:  # the session's holdings end with the channel's session
        log.debug("idle holdings not sent again, the step channel broke: %s", e)


# ------------------------------------------------------------------ a step batch's change, in one lane


class LaneChange(PendingDelta):
    """A ``StepBatch`` change on a caching step channel where the native core is there
    (``lane_begin``): the path's pending reply (a ``PendingDelta``) and the batch's pending
    change (``PendingBatchStep``'s ``result``/``settled``) in one object, so the change
    passes through no layer between the batch and ``send_delta`` (``lane_begin`` calls it
    with this class): ``StepBatch._take_drops``, ``ChannelCalls.change``;
    ``_ChannelChange.result`` and ``StepBatch._finish`` each do what they do here for it,
    inline (the tests run both)."""

    __slots__ = ("calls", "batch", "add", "add_keys", "new_keys", "delta", "failed", "own_leases")

    @property
    def settled(self) -> bool:
        """Whether ``result()`` has run (it will not read or account anything again)."""
        return self.delta is not None or self.failed is not None

    def result(self):
        """The change's ``BatchDelta``: its reply read (unless another call of the path read
        it first), accounted in the holdings, its leases and objects made, the batch's counts
        changed (once; its error raised again after)."""
        if self.delta is not None:
            return self.delta
        if self.failed is not None:
            raise self.failed
        calls = self.calls
        try:
            recs, objs, slabs = PendingDelta.result(self)  # read (unless collected) and accounted
            client = calls.client
            if slabs and client.view.mapped_slabs < slabs:
                client._ensure_slabs(slabs)
            records = calls.records
            found = records.objects(objs) if objs else []
            batch = self.batch
            if self.acquire:
                if recs is not None:
                    adapters = batch.adapters
                    for aid, rec in recs:
                        adapters[aid] = records.leased_step(aid, rec)
                else:
                    batch._acquire_own(self.acquire, found)
            self.delta = batch._account(self.add, self.add_keys, self.new_keys, found, 1 if self.sent else 0)
            return self.delta
        except (w.WireError, StepUnavailable) as e:
            self.failed = calls._error_of(e)
            raise self.failed from None
        except BaseException as e:
            self.failed = e
            raise


def lane_begin(calls, batch, add, drop, add_keys, drop_keys) -> LaneChange | None:
    """Begin ``batch``'s change on ``calls``' caching step path (a ``ChannelCalls``) in its
    shortest form: the batch's counts, the plan against the holdings and the frame each in
    one native pass, the frame sent now. None, having changed nothing, where the native core
    is not there or does not take the change (a bad drop: the batch's own pass says why).
    The caller releases ``own_leases`` (``StepBatch._take_drops``' gRPC leases)."""
    core = w._core
    if core is None:
        return None
    got = core.batch_take(
        batch._acount, batch._kcount, batch.adapters, batch._own, batch.objects, add, drop, add_keys, drop_keys
    )
    if got is None:
        return None
    rel, unpin, new_ids, new_keys, own = got
    try:
        p = send_delta(calls.path, new_ids, rel, new_keys, unpin, LaneChange)
    except (w.WireError, StepUnavailable) as e:
        raise calls._error_of(e) from None
    p.calls, p.batch, p.add, p.add_keys, p.new_keys = calls, batch, add, add_keys, new_keys
    p.delta = p.failed = None
    # Adapters the batch acquired over gRPC, last held by this change's drops: the caller
    # releases them (a background batch's worker only once the session's other calls may
    # go, or its gRPC call would wait for itself).
    p.own_leases = own
    return p
