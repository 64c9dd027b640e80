"""Test support: the object store's invariants, checked from scratch after a step.

``check_invariants(store)`` re-derives the page table, pins, keys, sessions, the eviction
candidates, the running figures and the window from the objects themselves and asserts they
agree with what the store keeps. It reads the store's internals and changes nothing; product
code never imports it.
"""

from __future__ import annotations

from memory_broker.broker.store.object_table import map_key
from memory_broker.broker.store.objects import ObjectState, ObjectStore
from memory_broker.broker.store.pool import FREE


def check_invariants(store: ObjectStore) -> None:
    """Assert the pool's invariants (tests call this after every step); with tenant pools,
    every pool's, and no object has a page outside its own pool."""
    for pool in store.pools:
        free = pool.free_page_list()
        assert len(free) == len(set(free)), "a page is on the free list twice"
        assert pool.used_pages + len(free) == pool.capacity_pages, "free + used != capacity"
        assert all(pool.base <= p < pool.base + pool.capacity_pages for p in free), "a free page of another pool"
    seen: dict[int, int] = {}
    every = {**store._ending, **store.sessions}
    assert not set(store._ending) & set(store.sessions), "a session is both open and ending"
    evictable_pages = 0
    evictable_ids = set()
    for oid, obj in store.objects.items():
        assert obj.object_id == oid
        pool = store.pools[obj.pool]
        for p in obj.pages:
            assert p not in seen, f"page {p} belongs to objects {seen[p]} and {oid}"
            seen[p] = oid
            assert pool.base <= p < pool.base + pool.capacity_pages, f"page {p} of object {oid} is not in its pool"
            assert pool.owner[p] == oid, f"page table says page {p} is {pool.owner[p]}, not {oid}"
        assert obj.pin_count == sum(obj.pins.values()) and obj.pin_count >= 0
        assert all(c > 0 for c in obj.pins.values()), "a zero or negative pin count is stored"
        for sid, c in obj.pins.items():
            assert every[sid].pins.get(oid) == c, "session pin mirror disagrees"
        if obj.state == ObjectState.PREPARED:
            t = store.txns.open[obj.txn_id]
            assert obj in t.objects and not obj.pins
        if obj.state == ObjectState.COMMITTED and obj.pin_count == 0:
            assert not obj.freed, "a freed object without pins was kept"
            evictable_pages += obj.num_pages
            evictable_ids.add(oid)
        if obj.key is not None and obj.state == ObjectState.COMMITTED and not obj.freed:
            assert store.keys.get(map_key(obj.pool, obj.key)) is obj, (
                "committed keyed object missing from the key index"
            )
        if obj.owner:
            assert oid in every[obj.owner].owned
    for pool in store.pools:
        for p in pool.free_page_list():
            assert p not in seen and pool.owner[p] == FREE, f"free page {p} is owned"
    assert len(seen) == sum(pool.used_pages for pool in store.pools), "pages in objects != used pages"
    assert store.policy.evictable_pages == evictable_pages, "evictable page count drifted"
    assert {o.object_id for o in store.policy} == evictable_ids, "eviction candidates drifted"
    for k, obj in store.keys.items():
        assert map_key(obj.pool, obj.key) == k and store.objects.get(obj.object_id) is obj
    for sid, s in every.items():
        assert s.pin_total == sum(s.pins.values()), "session pin total drifted"
        for oid in s.owned:
            assert store.objects[oid].owner == sid
        for oid, c in s.pins.items():
            assert store.objects[oid].pins.get(sid) == c
    by_content: dict[int, list[int]] = {}
    by_owner: dict[tuple[int, int], list[int]] = {}
    prepared = pinned = pinned_objs = 0
    for obj in store.objects.values():
        for d, k in ((by_content, int(obj.content_type)), (by_owner, (obj.owner, int(obj.content_type)))):
            c = d.setdefault(k, [0, 0])
            c[0] += 1
            c[1] += obj.num_pages
        if obj.state == ObjectState.PREPARED:
            prepared += obj.num_pages
        elif obj.pin_count:
            pinned += obj.num_pages
            pinned_objs += 1
    assert by_content == store.tally.by_content, "running per-content figures drifted"
    assert by_owner == store.tally.by_owner, "running per-owner figures drifted"
    assert (prepared, pinned, pinned_objs) == (
        store.tally.prepared_pages,
        store.tally.pinned_pages,
        store.tally.pinned_objects,
    ), "running prepared/pinned figures drifted"
    placed = sorted((o.window_page, o.num_pages) for o in store.objects.values() if o.window_page >= 0)
    ranges = sorted(placed + store.window.extents())
    pos = 0
    for start, length in ranges:
        assert start == pos, f"window ranges overlap or leave a hole at {pos}"
        pos = start + length
    assert pos == store.window.window_pages


def check_queues_alike(batch, single) -> None:
    """A recency queue changed in batches (``add_all``/``remove_all``/``touch_all``) holds what
    the same changes made one at a time hold, in the same order, with no stale segment."""
    assert [o.object_id for o in batch] == [o.object_id for o in single]
    assert batch.evictable_pages == single.evictable_pages and len(batch) == len(single)
    for q in batch._queues:
        assert all(list(q._segs)[:-1]), "an emptied segment was kept"
        assert all(batch._segments[o.queue_seg] is seg for seg in q._segs for o in seg.values())
    assert set(batch._segments) == {n for q in batch._queues for n in q._nums}
