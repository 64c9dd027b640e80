"""Making room for an allocation and taking it: evict unpinned objects or grow the arena, with
the watermark hysteresis that decides how far eviction goes (ARCHITECTURE.md, "Invariants"); then the
two allocation steps a one-step Allocate and a prepare/commit transaction share.

``RoomMaker`` owns the watermarks and the "eviction active" state; it asks the policy for
victims, has the table drop them and tells their owners (``notify``), and asks the pool to
grow. It never creates objects, changes pins or keys, or reads sessions.

``Allocator`` takes the room: ``reserve`` (make room, take pages for PREPARED objects) and
``publish`` (commit one object, or resolve it to the committed object that already has its
key); ``allocate`` runs both for a one-step batch. The store uses it for Allocate and
``Transactions`` for prepare and commit; it checks nothing about sessions, batches or specs
(the store does, first).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from memory_broker.broker.store.context import StoreContext
from memory_broker.broker.store.object_table import map_key
from memory_broker.broker.store.pins import PinLedger
from memory_broker.broker.store.records import Allocation, ObjectsEvicted, ObjectState, SessionState, pages_at
from memory_broker.proto.wire.errors import exhausted
from memory_broker.proto.wire.spec import Spec


class RoomMaker:
    """Free pages within capacity for the store, by eviction and growth.

    Args:
        ctx: the store's shared record: the pool (free pages and the arena's growth), the
            policy (eviction candidates, kept current by the store), the table (objects by id,
            read only here, and ``drop`` for victims), the counters (eviction runs, evicted
            objects and pages), the tally (read for error messages), ``notify`` (for
            ObjectsEvicted) and the config's watermarks (fractions of ``pool.max_pages``),
            taken at start; ``set_watermarks`` changes them.
    """

    def __init__(self, ctx: StoreContext):
        self.pool = ctx.pool
        self.policy = ctx.policy
        self._objects = ctx.table.objects
        self._counters = ctx.counters
        self._tally = ctx.tally
        self._drop = ctx.table.drop
        self._notify = ctx.notify
        # Hysteresis state: set when usage crosses the high watermark, cleared at the low.
        self.eviction_active = False
        # Set by a host that drains eviction off the request path (see ObjectStore.background).
        self.background: Callable[[], None] | None = None
        # Set by a host: called with each eviction's victims before they are dropped (ObjectStore.on_evict).
        self.on_evict: Callable[[list[Allocation]], None] | None = None
        # Starts its RESOURCE_EXHAUSTED messages: a tenant pool's name and setting (pools.py).
        self.label = ""
        self.set_watermarks(ctx.config.high_watermark, ctx.config.low_watermark)

    def set_watermarks(self, high: float, low: float) -> None:
        """Change the eviction watermarks (also of a running store: SIGHUP reload)."""
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"watermarks must satisfy 0 < low <= high <= 1; got low={low}, high={high}")
        self.high_watermark, self.low_watermark = high, low
        self.high_pages = pages_at(high, self.pool.max_pages)
        self.low_pages = pages_at(low, self.pool.max_pages)

    def drain(self, budget: int) -> bool:
        """One bounded batch of watermark eviction; True if more is needed."""
        if not self.eviction_active:
            return False
        over = self.pool.used_pages - self.low_pages
        if over <= 0:
            self.eviction_active = False
            return False
        if not self.policy.evictable_pages:
            return False  # all pinned: allocations retry as pins go
        self.evict(self.policy.select(over, budget), over, ())
        if self.pool.used_pages <= self.low_pages:
            self.eviction_active = False
            return False
        return bool(self.policy.evictable_pages)

    def make_room(self, total: int, exclude: Collection[int]) -> None:
        """Ensure ``total`` free pages within the arena's capacity, evicting and growing.

        Watermark eviction runs first (best effort, down to the low watermark, counting
        the pages about to be taken), then whatever the request itself still needs.
        ``exclude``: ids of objects the request uses, which must not be evicted for it.
        """
        pool = self.pool
        if (
            not exclude
            and not self.eviction_active
            and total <= pool.free_in_capacity
            and pool.used_pages + total <= self.high_pages
        ):
            return  # fast path: room within capacity and under the high watermark
        policy = self.policy
        objects = self._objects
        excluded_pages = sum(objects[o].num_pages for o in exclude if self.is_evictable(objects[o]))
        evictable = policy.evictable_pages - excluded_pages
        if pool.free_pages + evictable < total:
            raise exhausted(self.exhausted_message(total, evictable))
        # Growth the request needs even if every candidate were evicted: ask for it before
        # evicting anything or starting hysteresis, so that a backend that cannot grow
        # refuses the request without side effects. (Eviction moves pages from evictable
        # to free within capacity, so once this holds the fallback below always succeeds.)
        unavoidable = total - (pool.free_in_capacity + evictable)
        grow_error = self._grow_first(total, unavoidable, evictable)
        used_after = pool.used_pages + total
        if used_after > self.high_pages:
            self.eviction_active = True
        if self.eviction_active:
            over = used_after - self.low_pages
            if over > 0 and evictable > 0:
                self._counters.eviction_runs += 1
                if self.background is not None:
                    # The way down to the low watermark is drained by the store's work(),
                    # off this request; inline it evicts only what it needs itself (below).
                    self.background()
                else:
                    self.evict(policy.select(over + excluded_pages), over, exclude)
            if pool.used_pages + total <= self.low_pages:
                self.eviction_active = False
        if pool.free_pages < total:
            need = total - pool.free_pages
            self.evict(policy.select(need + excluded_pages), need, exclude)
        short = total - (pool.capacity_pages - pool.used_pages)
        if short > 0:
            try:
                if grow_error is not None:
                    raise grow_error
                pool.grow(-(-short // pool.pages_per_slab))
            except MemoryError as e:
                # The backend could not grow (device memory taken by others): make room
                # inside the capacity we have instead, if the cache allows.
                inside = pool.capacity_pages - pool.used_pages
                need = total - inside
                if policy.evictable_pages - excluded_pages < need:
                    raise exhausted(
                        f"the arena could not grow ({e}); need {total} pages, {inside} free in "
                        f"{pool.capacity_pages} backed pages, {policy.evictable_pages - excluded_pages} evictable"
                    ) from None
                self.evict(policy.select(need + excluded_pages), need, exclude)

    def _grow_first(self, total: int, unavoidable: int, evictable: int) -> MemoryError | None:
        """Grow before anything else changes: by what the request needs even if every
        candidate were evicted (refused if that fails), and, where watermark eviction is
        drained off the request (``background``), by all the growth it will take (known now:
        nothing is evicted inline for it), so that a grow made off the loop
        (``growth.Growth``) stops the call here, with no flag or eviction to undo. Returns
        the failure of a grow that was not unavoidable (the request then makes room inside)."""
        pool = self.pool
        early = unavoidable
        if self.background is not None:
            early = max(early, min(total - pool.free_in_capacity, pool.max_pages - pool.capacity_pages))
        if early <= 0:
            return None
        try:
            pool.grow(-(-early // pool.pages_per_slab))
        except MemoryError as e:
            if unavoidable > 0:
                raise exhausted(
                    f"{self.label}the arena could not grow ({e}); need {total} pages, {pool.free_in_capacity} free in "
                    f"{pool.capacity_pages} backed pages, {evictable} evictable"
                ) from None
            return e
        return None

    def exhausted_message(self, total: int, evictable: int) -> str:
        t = self._tally
        return (
            f"{self.label}need {total} pages, {self.pool.free_pages} free, {evictable} evictable "
            f"(of {self.pool.max_pages}: {t.pinned_pages} pinned in {t.pinned_objects} objects, "
            f"{t.prepared_pages} prepared); unpin or free objects, or raise the pool size"
        )

    def evict(self, victims: list, need: int, exclude: Collection[int]) -> None:
        """Evict victims in order until ``need`` pages are freed; tell each owner once."""
        if self.on_evict is not None:
            victims = self._taken(victims, need, exclude)
            self.on_evict(victims)
        freed = 0
        told: dict[int, tuple[list[int], list[bytes]]] = {}
        counters = self._counters
        for obj in victims:
            if freed >= need:
                break
            if obj.object_id in exclude:
                continue
            self.policy.remove(obj)
            freed += obj.num_pages
            if obj.owner:
                ids, keys = told.setdefault(obj.owner, ([], []))
                ids.append(obj.object_id)
                if obj.key is not None:
                    keys.append(obj.key)
            self._drop(obj, "evicted")
            counters.evicted_objects += 1
            counters.evicted_pages += obj.num_pages
        for sid, (ids, keys) in told.items():
            self._notify(sid, ObjectsEvicted(ids, keys))

    @staticmethod
    def _taken(victims: list, need: int, exclude: Collection[int]) -> list:
        """The victims ``evict`` will drop: in order, until ``need`` pages."""
        out, freed = [], 0
        for obj in victims:
            if freed >= need:
                break
            if obj.object_id not in exclude:
                out.append(obj)
                freed += obj.num_pages
        return out

    @staticmethod
    def is_evictable(obj: Allocation) -> bool:
        return obj.state == ObjectState.COMMITTED and obj.pin_count == 0 and not obj.freed


class Allocator:
    """Reserve and publish objects.

    Args:
        ctx: the store's shared record (the table, policy, counters and running figures).
        room: makes room before pages are taken.
        ledger: pins objects published with ``pin``.
    """

    def __init__(self, ctx: StoreContext, room: RoomMaker, ledger: PinLedger):
        self._table = ctx.table
        self._keys = ctx.table.keys
        self._policy = ctx.policy
        self._counters = ctx.counters
        self._tally = ctx.tally
        self._room = room
        # Each pool's room maker, by ``SessionState.pool`` (one without tenant pools).
        self.rooms = [room]
        self._ledger = ledger

    def allocate(
        self, s: SessionState, specs: Sequence[Spec], total: int, has_keys: bool
    ) -> list[tuple[Allocation, bool]]:
        """Reserve and publish a checked batch of ``total`` pages in one step; (object,
        deduplicated) per spec: a key already committed resolves to the existing object."""
        if not has_keys:
            # The common case: nothing to deduplicate.
            new = self.reserve(s, specs, (), total)
            publish = self.publish
            return [publish(s, obj, sp.pin) for obj, sp in zip(new, specs)]
        # Keys already committed need no pages: they resolve to the existing object,
        # which must not be evicted to make room for the rest of the batch.
        keys, pool = self._keys, s.pool
        existing = [keys.get(map_key(pool, sp.key)) if sp.key is not None else None for sp in specs]
        fresh = [sp for sp, e in zip(specs, existing) if e is None]
        new = self.reserve(
            s, fresh, {e.object_id for e in existing if e is not None}, sum(sp.num_pages for sp in fresh)
        )
        it = iter(new)
        out: list[tuple[Allocation, bool]] = []
        for sp, e in zip(specs, existing):
            if e is None:
                out.append(self.publish(s, next(it), sp.pin))
                continue
            self._counters.deduplicated_total += 1
            self.use(s, e, sp.pin)
            out.append((e, True))
        return out

    def reserve(self, s: SessionState, specs: Sequence[Spec], exclude: Collection[int], total: int) -> list[Allocation]:
        """Place and take ``total`` pages for specs as PREPARED objects owned by ``s``;
        ``exclude``: ids of objects the request uses, which must not be evicted for it."""
        if not specs:
            return []
        table = self._table
        try:
            # Window placement first: it can be undone without a trace.
            window_pages = table.place(specs)
            try:
                self.rooms[s.pool].make_room(total, exclude)
            except Exception:
                table.unplace(window_pages, specs)
                raise
        except Exception:
            self._counters.allocation_failures += 1
            raise
        out = table.create(s, specs, window_pages)
        self._counters.allocations_total += len(out)
        return out

    def publish(self, s: SessionState, obj: Allocation, pin: bool) -> tuple[Allocation, bool]:
        """Commit one prepared object; a key already present resolves to that object.
        Returns (the object, deduplicated)."""
        if obj.key is not None:
            key = map_key(obj.pool, obj.key)
            existing = self._keys.get(key)
            if existing is not None:
                s.owned.discard(obj.object_id)
                self._table.drop(obj, "deduplicated")
                self._counters.deduplicated_total += 1
                self.use(s, existing, pin)
                return existing, True
            self._keys[key] = obj
        self._tally.prepared_pages -= obj.num_pages
        obj.state = ObjectState.COMMITTED
        obj.txn_id = 0
        if pin:
            self._ledger.pin(s, obj)
        else:
            self._policy.add(obj)
        return obj, False

    def use(self, s: SessionState, obj: Allocation, pin: bool) -> None:
        """A committed object found again for ``s``: pin it, or mark it used."""
        if pin:
            self._ledger.pin(s, obj)
        else:
            self._policy.touch(obj)
