"""What the object store reports: its counters, the running per-content and per-owner figures,
and the typed ``StoreStats`` record that the service's GetStats, the metrics and the status
line read.

``Tally`` keeps the running figures so that reading them costs O(1) at any size; the store
tells it when an object comes, goes, changes owner or crosses a pin zero. Nothing here decides
anything about objects or touches the pool: it only counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from memory_broker.broker.store.records import Allocation, ObjectState


@dataclass(slots=True)
class Counters:
    allocations_total: int = 0
    deduplicated_total: int = 0
    allocation_failures: int = 0
    eviction_runs: int = 0
    evicted_objects: int = 0
    evicted_pages: int = 0
    # Pins taken on objects another session already pinned (shared use of hot objects).
    pin_contention: int = 0


class Usage(NamedTuple):
    """Objects and the pages they hold (a tuple, so ``(objects, pages)`` unpacks)."""

    objects: int
    pages: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    """One reading of the store; every field is a plain number taken at one instant."""

    # Most pages the arena may hold, and pages backed by slabs now.
    max_pages: int
    capacity_pages: int
    free_pages: int
    used_pages: int
    # Pages of objects in open transactions; of pinned objects; of evictable objects.
    prepared_pages: int
    pinned_pages: int
    evictable_pages: int
    # used_pages / max_pages.
    utilization: float
    high_watermark: float
    low_watermark: float
    # True from crossing the high watermark until reaching the low one.
    eviction_active: bool
    objects: int
    keyed_objects: int
    # Client sessions (the broker's own internal sessions are not counted).
    sessions: int
    open_transactions: int
    # Content type number -> usage, in content-type order.
    by_content: dict[int, Usage]
    # The virtual window: free pages, free extents, largest free extent, 1 - largest / free.
    window_free_pages: int
    window_free_extents: int
    window_largest_free: int
    window_fragmentation: float
    allocations_total: int
    deduplicated_total: int
    allocation_failures: int
    eviction_runs: int
    evicted_objects: int
    evicted_pages: int
    pin_contention: int


@dataclass(slots=True)
class Tally:
    """Running figures the store keeps up to date (a test re-derives them from the objects)."""

    # Content type number -> [objects, pages].
    by_content: dict[int, list[int]] = field(default_factory=dict)
    # (owning session, content type number) -> [objects, pages]; session 0: owner gone.
    by_owner: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    prepared_pages: int = 0
    pinned_pages: int = 0
    pinned_objects: int = 0

    def account(self, obj: Allocation, sign: int) -> None:
        """Add (sign 1) or take away (sign -1) an object's share of the running figures."""
        n = sign * obj.num_pages
        ct = int(obj.content_type)
        c = self.by_content.get(ct)
        if c is None:
            c = self.by_content[ct] = [0, 0]
        c[0] += sign
        c[1] += n
        if not c[0]:
            del self.by_content[ct]
        key = (obj.owner, ct)
        o = self.by_owner.get(key)
        if o is None:
            o = self.by_owner[key] = [0, 0]
        o[0] += sign
        o[1] += n
        if not o[0]:
            del self.by_owner[key]
        if obj.state == ObjectState.PREPARED:
            self.prepared_pages += n
        elif obj.pin_count:
            self.pinned_pages += n
            self.pinned_objects += sign

    def set_owner(self, obj: Allocation, owner: int) -> None:
        """Move an object to another owner (0: ownerless), keeping the per-owner figures."""
        ct = int(obj.content_type)
        o = self.by_owner[(obj.owner, ct)]
        o[0] -= 1
        o[1] -= obj.num_pages
        if not o[0]:
            del self.by_owner[(obj.owner, ct)]
        obj.owner = owner
        o = self.by_owner.get((owner, ct))
        if o is None:
            o = self.by_owner[(owner, ct)] = [0, 0]
        o[0] += 1
        o[1] += obj.num_pages

    def content_usage(self) -> dict[int, Usage]:
        return {ct: Usage(v[0], v[1]) for ct, v in sorted(self.by_content.items())}

    def owner_usage(self) -> dict[tuple[int, int], Usage]:
        return {k: Usage(v[0], v[1]) for k, v in sorted(self.by_owner.items())}


def read_stats(store, totals: tuple[int, int, int, int]) -> StoreStats:
    """``ObjectStore.stats``: one O(1) reading of ``store``'s pool, window and counters, with
    its pools' (max, capacity, free, used) pages ``totals``."""
    w, c, t, room = store.window, store.counters, store.tally, store.room
    max_pages, capacity, free, used = totals
    largest = w.largest_free
    wfree = w.free_pages
    return StoreStats(
        max_pages=max_pages,
        capacity_pages=capacity,
        free_pages=free,
        used_pages=used,
        prepared_pages=t.prepared_pages,
        pinned_pages=t.pinned_pages,
        evictable_pages=store.policy.evictable_pages,
        utilization=used / max_pages,
        high_watermark=room.high_watermark,
        low_watermark=room.low_watermark,
        eviction_active=store.eviction_active,
        objects=len(store.objects),
        keyed_objects=len(store.keys),
        sessions=len(store.sessions) - len(store.internal_sessions),
        open_transactions=len(store.txns.open),
        by_content=t.content_usage(),
        window_free_pages=wfree,
        window_free_extents=w.free_extents,
        window_largest_free=largest,
        window_fragmentation=(1.0 - largest / wfree) if wfree else 0.0,
        allocations_total=c.allocations_total,
        deduplicated_total=c.deduplicated_total,
        allocation_failures=c.allocation_failures,
        eviction_runs=c.eviction_runs,
        evicted_objects=c.evicted_objects,
        evicted_pages=c.evicted_pages,
        pin_contention=c.pin_contention,
    )
