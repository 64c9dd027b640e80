"""The two allocation steps shared by a one-step Allocate and a prepare/commit transaction:
``reserve`` (make room, take pages for PREPARED objects) and ``publish`` (commit one object,
or resolve it to the committed object that already has its key); ``allocate`` runs both for
a one-step batch.

``Allocator`` drives the object table, the room maker and the pin ledger; it checks nothing
about sessions, batches or specs (the store does, first).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from memory_broker.broker.store.context import StoreContext
from memory_broker.broker.store.pins import PinLedger
from memory_broker.broker.store.records import Allocation, ObjectState, SessionState, Spec
from memory_broker.broker.store.room import RoomMaker


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
        keys = self._keys
        existing = [keys.get(sp.key) if sp.key is not None else None for sp in specs]
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
                self._room.make_room(total, exclude)
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
            existing = self._keys.get(obj.key)
            if existing is not None:
                s.owned.discard(obj.object_id)
                self._table.drop(obj, "deduplicated")
                self._counters.deduplicated_total += 1
                self.use(s, existing, pin)
                return existing, True
            self._keys[obj.key] = obj
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
