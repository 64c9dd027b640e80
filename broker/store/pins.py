"""Pins between sessions and committed objects: the two mirrored counts (``Allocation.pins``
and ``SessionState.pins``), the per-session limit, and the zero crossings that move an object
out of and back into the eviction candidates.

``PinLedger`` changes only pin counts, the policy's candidate set (and its order: what a
lookup without pins found is touched) and the pinned figures of the tally; it decides nothing
about visibility or ownership (the store checks those first) and frees nothing itself: the
last pin of a freed object goes to the store's ``drop``. A client's lookup that pins in one
native call (``lookup_pin``) gives those pins back when its reply's room refuses them.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING

from memory_broker.broker.store.context import StoreContext
from memory_broker.broker.store.eviction import PriorityLRU
from memory_broker.broker.store.records import Allocation, SessionState, store_core
from memory_broker.broker.store.shards import ShardedMap
from memory_broker.proto.wire.errors import BrokerError, denied, exhausted, precondition

if TYPE_CHECKING:
    from memory_broker.broker.store.object_table import ReplyRoom

_PAGES, _FREED = attrgetter("num_pages"), attrgetter("freed")


class PinLedger:
    """Who pins what, and how many.

    Args:
        ctx: the store's shared record: the policy (eviction candidates; an object with pins
            is never one), the tally (pinned pages and objects), the counters (pin
            contention), the config (``max_pins_per_session``, read at each check: it may be
            reconfigured), the internal sessions (the limit does not apply to them), the open
            transactions (their promised pins count against the limit) and the table
            (``drop`` forgets a freed object at its last pin).
    """

    def __init__(self, ctx: StoreContext):
        self._policy = ctx.policy
        self._tally = ctx.tally
        self._counters = ctx.counters
        self._config = ctx.config
        self._internal = ctx.internal_sessions
        self._txns = ctx.txns
        self._drop = ctx.table.drop
        # Batch forms of the policy's add, remove and touch, where it has them.
        self._add_all = getattr(ctx.policy, "add_all", None)
        self._remove_all = getattr(ctx.policy, "remove_all", None)
        self._touch_all = getattr(ctx.policy, "touch_all", None)
        # ``add_all`` of a list (what the native unpin hands over): ``PriorityLRU``'s native
        # loop itself where its core is built (``add_all`` would only dispatch to it).
        native_add = getattr(ctx.policy, "_add_all_native", None)
        self._add_list = native_add if getattr(ctx.policy, "_core", None) is not None and native_add else self._add_all
        # The batch loops in C (``_storecore.c``), or None: the Python loops below.
        self._core = store_core()
        # A lookup's pins and the usual unpin each in one native call (``lookup_pin`` and
        # ``unpin_held``: the table's pass, the pins and the queues' removal together) where
        # the core is built and the policy is a ``PriorityLRU`` running on it (its queues'
        # segments and figures are what the call changes); else None.
        policy = ctx.policy
        fused = self._core is not None and isinstance(policy, PriorityLRU) and policy._core is not None
        self.fused = self._core if fused else None
        self._segments = policy._segments if fused else None
        # The table's shard lists (a ShardedMap never replaces them), read by the fused calls.
        self._key_shards, self._obj_shards = ctx.table.keys.shards, ctx.table.objects.shards

    def check_limit(self, s: SessionState, adding: int) -> None:
        """Refuse (RESOURCE_EXHAUSTED) if ``adding`` pins would take ``s`` over its limit."""
        limit = self._config.max_pins_per_session
        if not (limit and adding) or s.session_id in self._internal:
            return
        # Pins promised to open transactions (ObjectSpec.pin) are taken at commit, which does
        # not check the limit again: they count as held until the transaction ends.
        promised = self._txns.promised_pins(s.txns)
        if s.pin_total + promised + adding > limit:
            held = f"{s.pin_total} pins" + (f" (and {promised} promised to open transactions)" if promised else "")
            raise exhausted(
                f"session {s.session_id} holds {held} and this call adds {adding}; "
                f"the limit is {limit} (max_pins_per_session): unpin first"
            )

    def lookup_pin(self, s: SessionState, keys, most: int, reply: ReplyRoom | None = None) -> list[Allocation] | None:
        """``ObjectTable.find`` then ``check_limit`` and ``pin_all`` of what it found, in one
        native call (``self.fused`` set); None where a key is left to the table's checks
        (nothing changed). ``reply``: a client's (``ReplyRoom``): the keys distinct, and what
        was found taken from it, or each pin given back and the refusal raised."""
        if reply is not None:
            reply.admit(keys, "keys")
        found = self._lookup_pin(s, keys, most)
        if reply is not None and found is not None:
            try:
                reply.take(found, "lookup", self._core)
            except BrokerError:
                self.unpin_once(s, found)  # past the reply's room: nothing stays pinned
                raise
        return found

    def _lookup_pin(self, s: SessionState, keys, most: int) -> list[Allocation] | None:
        limit = self._config.max_pins_per_session
        room = -1  # how many pins ``s`` may add now (``check_limit``'s bound), -1: no limit
        if limit and s.session_id not in self._internal:
            room = max(0, limit - s.pin_total - self._txns.promised_pins(s.txns))
        r = self.fused.lookup_pin(self._key_shards, keys, most, s.pool, s.session_id, s.pins, self._segments, room)
        if r is None:
            return None
        found, fresh, pages, contention, queued, emptied = r if r[1] is not None else (*r, 0, 0, 0, 0)
        if fresh is None:  # more than the limit allows: nothing pinned
            self.check_limit(s, len(found))  # raises
        s.pin_total += len(found)
        if fresh:  # as ``pin_all``'s
            self._pinned_out(fresh, pages, queued, emptied)
        if contention:
            self._counters.pin_contention += contention
        return found

    def _pinned_out(self, fresh: int, pages: int, queued: int, emptied: list) -> None:
        """After a fused native pin (``lookup_pin``, ``pin_remove``): ``fresh`` objects of
        ``pages`` pages newly pinned, ``queued`` of those pages out of the eviction queues,
        and each queue segment the pass ``emptied`` dropped (as ``PriorityLRU.remove_all``
        does: a queue's newest segment is kept)."""
        tally = self._tally
        tally.pinned_pages += pages
        tally.pinned_objects += fresh
        policy = self._policy
        policy.evictable_pages -= queued
        for num, obj in emptied:
            q = policy._queues[policy._rank[obj.content_type]]
            if self._segments[num] is not q._segs[-1]:
                q.drop(num)

    def unpin_held(self, s: SessionState, object_ids) -> bool:
        """``ObjectTable.held_once`` then ``unpin_once`` in one native call (``self.fused``
        set): False where ``held_once`` finds what the caller must check id by id (nothing
        changed)."""
        r = self.fused.unpin_held(self._obj_shards, object_ids, s.session_id, s.pins)
        if r is None:
            return False
        objs, zero, pages, freed = r
        s.pin_total -= len(objs)
        if zero:
            if freed:
                self._became_unpinned_all(zero, pages, freed)
            else:
                tally = self._tally
                tally.pinned_pages -= pages
                tally.pinned_objects -= len(zero)
                self._add_list(zero)
        return True

    def check_unpin(self, session: int, obj: Allocation, count: int) -> None:
        """Refuse unless ``session`` holds at least ``count`` pins on ``obj``."""
        held = obj.pins.get(session, 0)
        if held < count:
            oid = obj.object_id
            if held == 0 and obj.pin_count > 0:
                raise denied(f"object {oid} is pinned only by other sessions; session {session} holds no pin on it")
            raise precondition(f"object {oid}: asked to unpin {count}, session {session} holds {held} pin(s)")

    def pin(self, s: SessionState, obj: Allocation) -> None:
        """One more pin of ``obj`` for ``s`` (the object must be committed and visible)."""
        if obj.pin_count == 0:
            self._policy.remove(obj)
            tally = self._tally
            tally.pinned_pages += obj.num_pages
            tally.pinned_objects += 1
        elif s.session_id not in obj.pins:
            self._counters.pin_contention += 1
        s.pin_total += 1
        obj.pin_count += 1
        sid = s.session_id
        obj.pins[sid] = obj.pins.get(sid, 0) + 1
        s.pins[obj.object_id] = s.pins.get(obj.object_id, 0) + 1

    def touch_all(self, objs: list[Allocation]) -> None:
        """Objects a lookup without pins found: used now, they move up the eviction order."""
        if self._touch_all is not None:
            self._touch_all(objs)
        else:
            for obj in objs:
                self._policy.touch(obj)

    def pin_all(self, s: SessionState, objs: list[Allocation]) -> None:
        """``pin`` for each of ``objs`` in order (a step pins hundreds): one loop, and the
        objects that were unpinned leave the eviction candidates in one batch."""
        remove_all = self._remove_all
        if remove_all is None:
            self._pin_each(s, objs)
            return
        sid = s.session_id
        spins = s.pins
        if self.fused is not None and objs.__class__ is list:  # the pins and the queues in one call
            fresh, pages, contention, queued, emptied = self.fused.pin_remove(objs, sid, spins, self._segments)
            s.pin_total += len(objs)
            if fresh:
                self._pinned_out(fresh, pages, queued, emptied)
            if contention:
                self._counters.pin_contention += contention
            return
        if self._core is not None and objs.__class__ is list:
            fresh, pages, contention = self._core.pin_all(objs, sid, spins)
            s.pin_total += len(objs)
            if fresh:  # ``_pinned``, inline
                remove_all(fresh)
                tally = self._tally
                tally.pinned_pages += pages
                tally.pinned_objects += len(fresh)
            if contention:
                self._counters.pin_contention += contention
            return
        fresh = []
        contention = 0
        for obj in objs:
            n = obj.pin_count
            obj.pin_count = n + 1
            if not n:  # no pins at all: none of this session's either (s.pins mirrors obj.pins)
                fresh.append(obj)
                obj.pins[sid] = spins[obj.object_id] = 1
                continue
            pins = obj.pins
            if sid not in pins:
                contention += 1
            pins[sid] = pins.get(sid, 0) + 1
            oid = obj.object_id
            spins[oid] = spins.get(oid, 0) + 1
        s.pin_total += len(objs)
        self._pinned(fresh, sum(map(_PAGES, fresh)), contention)

    def _pinned(self, fresh: list[Allocation], pages: int, contention: int) -> None:
        """After ``pin_all``'s loop: the ``fresh`` objects (no pins before, ``pages`` in all)
        leave the eviction candidates in one batch; the figures."""
        if fresh:
            self._remove_all(fresh)
            tally = self._tally
            tally.pinned_pages += pages
            tally.pinned_objects += len(fresh)
        if contention:
            self._counters.pin_contention += contention

    def _pin_each(self, s: SessionState, objs: list[Allocation]) -> None:
        """``pin_all``, one object at a time."""
        sid = s.session_id
        spins = s.pins
        remove = self._policy.remove
        pages = newly = contention = 0
        for obj in objs:
            pins = obj.pins
            if obj.pin_count == 0:
                remove(obj)
                pages += obj.num_pages
                newly += 1
            elif sid not in pins:
                contention += 1
            obj.pin_count += 1
            pins[sid] = pins.get(sid, 0) + 1
            oid = obj.object_id
            spins[oid] = spins.get(oid, 0) + 1
        s.pin_total += len(objs)
        if newly:
            tally = self._tally
            tally.pinned_pages += pages
            tally.pinned_objects += newly
        if contention:
            self._counters.pin_contention += contention

    def unpin_all(self, s: SessionState, counted: list[tuple[Allocation, int]]) -> None:
        """``unpin`` for each (object, count) in order, in one pass."""
        sid = s.session_id
        spins = s.pins
        total = 0
        for obj, count in counted:
            pins = obj.pins
            left = pins[sid] - count
            if left:
                pins[sid] = left
                spins[obj.object_id] = left
            else:
                del pins[sid]
                del spins[obj.object_id]
            total += count
            obj.pin_count -= count
            if obj.pin_count == 0:
                s.pin_total -= total
                total = 0
                self._became_unpinned(obj)
        s.pin_total -= total

    def unpin_once(self, s: SessionState, objs: list[Allocation]) -> None:
        """``unpin_all`` of one pin on each of ``objs``: distinct objects on each of which
        ``s`` holds a pin (the caller checked); one loop, and the objects left unpinned
        become eviction candidates in one batch."""
        if self._add_all is None:
            self.unpin_all(s, [(obj, 1) for obj in objs])
            return
        sid, spins = s.session_id, s.pins
        if self._core is not None and objs.__class__ is list:
            zero, pages, freed = self._core.unpin_once(objs, sid, spins)
            s.pin_total -= len(objs)
            if zero:
                if freed:
                    self._became_unpinned_all(zero, pages, freed)
                    return
                # ``_became_unpinned_all`` of objects none of which is freed, inline.
                tally = self._tally
                tally.pinned_pages -= pages
                tally.pinned_objects -= len(zero)
                self._add_list(zero)
            return
        zero = []
        for obj in objs:
            pins = obj.pins
            left = pins[sid] - 1
            if left:
                pins[sid] = spins[obj.object_id] = left
            else:
                del pins[sid]
                del spins[obj.object_id]
            n = obj.pin_count - 1
            obj.pin_count = n
            if not n:
                zero.append(obj)
        s.pin_total -= len(objs)
        if zero:
            self._became_unpinned_all(zero)

    def _became_unpinned_all(self, objs: list[Allocation], pages: int = -1, freed: bool | None = None) -> None:
        """``_became_unpinned`` for each of ``objs``, in order (``pages``: theirs, and ``freed``:
        whether any is freed, where the caller's loop counted them)."""
        tally = self._tally
        tally.pinned_pages -= sum(map(_PAGES, objs)) if pages < 0 else pages
        tally.pinned_objects -= len(objs)
        if any(map(_FREED, objs)) if freed is None else freed:
            keep = [obj for obj in objs if not obj.freed]
            for obj in objs:
                if obj.freed:
                    self._drop(obj, "freed")
            objs = keep
        self._add_all(objs)

    def unpin(self, s: SessionState, obj: Allocation, count: int) -> None:
        """Drop ``count`` of the pins ``s`` holds on ``obj`` (the caller checked it holds them)."""
        sid = s.session_id
        left = obj.pins[sid] - count
        if left:
            obj.pins[sid] = left
            s.pins[obj.object_id] = left
        else:
            del obj.pins[sid]
            del s.pins[obj.object_id]
        obj.pin_count -= count
        s.pin_total -= count
        if obj.pin_count == 0:
            self._became_unpinned(obj)

    def drop_own(self, s: SessionState, obj: Allocation) -> None:
        """Drop every pin ``s`` holds on ``obj``, which its owner ``s`` is freeing: the object
        does not become an eviction candidate (the store frees it, or marks it freed)."""
        own = s.pins.pop(obj.object_id, 0)
        if own:
            del obj.pins[s.session_id]
            obj.pin_count -= own
            s.pin_total -= own
            if obj.pin_count == 0:
                self._tally.pinned_pages -= obj.num_pages
                self._tally.pinned_objects -= 1

    def release(self, s: SessionState, objects: ShardedMap, budget: int | None) -> int:
        """Drop up to ``budget`` objects' worth of an ended session's pins; returns how many."""
        sid, pins = s.session_id, s.pins
        work = 0
        while pins and (budget is None or work < budget):
            oid, count = pins.popitem()
            obj = objects[oid]
            del obj.pins[sid]
            obj.pin_count -= count
            s.pin_total -= count
            if obj.pin_count == 0:
                self._became_unpinned(obj)
            work += 1
        return work

    def _became_unpinned(self, obj: Allocation) -> None:
        tally = self._tally
        tally.pinned_pages -= obj.num_pages
        tally.pinned_objects -= 1
        if obj.freed:
            self._drop(obj, "freed")
        else:
            self._policy.add(obj)
