"""The step path's holdings cache: what this process holds at the broker, with local counts.

``StepHoldings`` is the bookkeeping part of a ``StepPath`` (``path.py``, which owns one as
``StepPath.held``): adapters and pins held
for this session, their local reference counts, which of them are idle (no reference here,
still pinned at the broker, so nothing of them can be evicted), and the release ops an idle
holding turns into when it is due. It sends nothing itself: the ops it returns ride along with
``StepPath``'s next frame (or ``StepPath.flush``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from memory_broker.proto.wire import step as w


@dataclass(slots=True)
class HeldAdapter:
    # What leases are made of (one record object for as long as it is held, so the client
    # can reuse what it built from it).
    record: w.AcquiredRecord
    # References this process's leases hold now.
    refs: int = 0
    # When refs last dropped to 0 (monotonic seconds).
    idle_since: float = 0.0


@dataclass(slots=True)
class HeldPin:
    record: w.ObjectRecord
    refs: int = 0
    # Pins the broker holds for this entry, given back with it (one: a lookup or pin of an
    # object held already pins it once more, and that pin goes back with the next frame,
    # ``StepHoldings.surplus``).
    broker_pins: int = 1
    idle_since: float = 0.0


def _drop_refs(held: dict, idle: dict, ids: Sequence, now: float) -> list:
    """Drop one local reference on each of ``ids`` in ``held`` (a holding whose last goes
    turns idle, kept at the broker); returns the ids held with no reference here, which the
    caller gives back to the broker directly. In one call of the native core where it is
    there (``_stepcore.c``'s ``drop_refs``)."""
    core = w._core
    if core is not None:
        direct = core.drop_refs(held, idle, ids, now)
        if direct is not None:
            return direct
    direct = []
    for i in ids:
        h = held.get(i)
        if h is None or h.refs <= 0:
            direct.append(i)
            continue
        h.refs -= 1
        if h.refs == 0:
            h.idle_since = now
            idle[i] = None
    return direct


class StepHoldings:
    """One step path's cache: its records and counts (``adapters``, ``pins``, idle sets).
    ``lock`` is the path's (a holding changes only while its path's socket is held)."""

    def __init__(self, hold_s: float, max_idle: int, lock):
        self.hold_s = hold_s
        self.max_idle = max_idle
        self.lock = lock
        self.adapters: dict[str, HeldAdapter] = {}
        # Object id -> its entry. Held by id only, never answered by key: a key may name
        # another object by the next lookup (its owner freed this one), and the broker tells
        # the holder nothing, so every lookup goes to the broker (ids are never reused).
        self.pins: dict[int, HeldPin] = {}
        # Idle holdings (no reference here, still held at the broker), oldest first.
        self.idle_a: dict[str, None] = {}
        self.idle_p: dict[int, None] = {}
        # Object ids the broker pinned once more than their entry counts (a lookup, which
        # always goes to the broker, or a pin, of an object held already): unpinned with the
        # next frame (``flush_ops``), so a key looked up step after step holds one pin.
        self.surplus: list[int] = []
        self._next_sweep = 0.0

    @property
    def caching(self) -> bool:
        return self.hold_s > 0

    def lease_record(self, aid: str) -> w.AcquiredRecord:
        h = self.adapters[aid]
        if h.refs == 0:
            self.idle_a.pop(aid, None)
        h.refs += 1
        h.idle_since = 0.0
        return h.record

    def drop_adapter_refs(self, ids: Sequence[str], now: float) -> list[str]:
        """Drop local references; the ids this cache holds no reference on (acquired over
        gRPC, or prepared), to release at the broker now."""
        return _drop_refs(self.adapters, self.idle_a, ids, now)

    def add_pin(self, rec: w.ObjectRecord, now: float) -> None:
        """Account one broker pin; the entry is idle until a reference is taken. Of an object
        held already, the pin is surplus (given back with the next frame)."""
        h = self.pins.get(rec.object_id)
        if h is None:
            self.pins[rec.object_id] = HeldPin(rec, 0, 1, now)
            self.idle_p[rec.object_id] = None
        else:
            self.surplus.append(rec.object_id)

    def add_ref_pin(self, rec: w.ObjectRecord) -> None:
        """``add_pin`` then ``ref_pin`` in one (a broker pin a reference holds at once)."""
        oid = rec.object_id
        h = self.pins.get(oid)
        if h is None:
            self.pins[oid] = HeldPin(rec, 1, 1, 0.0)
            return
        self.surplus.append(oid)
        if h.refs == 0:
            self.idle_p.pop(oid, None)
        h.refs += 1
        h.idle_since = 0.0

    def ref_pin(self, oid: int) -> None:
        h = self.pins[oid]
        if h.refs == 0:
            self.idle_p.pop(oid, None)
        h.refs += 1
        h.idle_since = 0.0

    def drop_pin_refs(self, oids: Sequence[int], now: float) -> list[int]:
        """Drop local references; the ids this cache does not hold, to unpin at the broker."""
        return _drop_refs(self.pins, self.idle_p, oids, now)

    def add_pins(self, recs: Sequence[w.ObjectRecord]) -> None:
        """Account pins a frame's PIN op took (one reference each)."""
        with self.lock:
            now = time.monotonic()
            for rec in recs:
                self.add_pin(rec, now)
                self.ref_pin(rec.object_id)

    def forget_pins(self, oids: Sequence[int]) -> None:
        """Objects this session freed: their pins went with them at the broker."""
        with self.lock:
            for oid in oids:
                h = self.pins.pop(oid, None)
                if h is None:
                    continue
                if h.refs == 0:
                    self.idle_p.pop(oid, None)
            if self.surplus:
                gone = set(oids)
                self.surplus = [o for o in self.surplus if o not in gone]

    def ref_pins(self, oids: Sequence[int]) -> list[w.ObjectRecord] | None:
        """Take a reference on each held object (all or none); None when one is not held."""
        with self.lock:
            if any(oid not in self.pins for oid in oids):
                return None
            for oid in oids:
                self.ref_pin(oid)
            return [self.pins[oid].record for oid in oids]

    @property
    def _idle(self) -> int:
        return len(self.idle_a) + len(self.idle_p)

    def flush_ops(self, now: float, force: bool) -> list[w.Op]:
        """Release and unpin ops for idle holdings that are due (all of them with ``force``),
        removed from the cache, and the unpins of every surplus pin. Walks the idle entries
        oldest first: O(what it releases)."""
        idle = self._idle
        sweep = idle and (force or now >= self._next_sweep or idle > self.max_idle)
        if not (sweep or self.surplus):
            return []
        unp, self.surplus = self.surplus, []
        rel: list[str] = []
        if sweep:
            self._next_sweep = now + self.hold_s / 2
            cutoff = now - self.hold_s
            over = idle - self.max_idle
            for aid in list(self.idle_a):
                h = self.adapters[aid]
                if not (force or h.idle_since <= cutoff or over > 0):
                    break
                rel.append(aid)
                over -= 1
                del self.adapters[aid]
                del self.idle_a[aid]
            for oid in list(self.idle_p):
                h = self.pins[oid]
                if not (force or h.idle_since <= cutoff or over > 0):
                    break
                unp.extend([oid] * h.broker_pins)
                over -= 1
                del self.pins[oid]
                del self.idle_p[oid]
        ops = []
        if rel:
            ops.append(w.Op(w.OP_RELEASE, tuple(rel)))
        if unp:
            ops.append(w.Op(w.OP_UNPIN, tuple(unp)))
        return ops

    def sweep_due(self) -> bool:
        """Whether the next frame would carry unpins of surplus pins, or idle holdings may be
        due for release."""
        return bool(self.surplus) or (
            bool(self._idle) and (time.monotonic() >= self._next_sweep or self._idle > self.max_idle)
        )

    def idle(self) -> int:
        return self._idle
