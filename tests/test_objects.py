"""ObjectStore: allocations, keys, pins, two-phase commit, sessions and eviction, in-process.

The store is driven with a fake grow callback and a fake clock: no arena, no gRPC.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from store_invariants import check_invariants

from memory_broker.broker.store.eviction import ContentType, PlainLRU
from memory_broker.broker.store.object_table import ReplyRoom
from memory_broker.broker.store.objects import (
    ObjectsEvicted,
    ObjectState,
    ObjectStore,
    Spec,
    StoreConfig,
    TransactionsExpired,
    TxnState,
)
from memory_broker.broker.store.pool import PagePool, WindowSpace
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.step import MAX_REPLY_BYTES, MAX_REPLY_RECORDS, REPLY_RECORD_BYTES

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

CT = ContentType
TEMP, ACT, GRAD, LORA, KV = CT.TEMP_BUFFER, CT.ACTIVATION, CT.GRADIENT, CT.LORA_WEIGHT, CT.KV_CACHE


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Grow:
    """A fake arena's grow: records calls; raises MemoryError when ``fail`` is set."""

    def __init__(self, fail: bool = False):
        self.calls: list[int] = []
        self.fail = fail

    def __call__(self, slabs: int) -> None:
        self.calls.append(slabs)
        if self.fail:
            raise MemoryError("cuMemCreate: out of memory")


# Every Harness made by the running test; their stores are checked when it ends.
_harnesses: list[Harness] = []


class Harness:
    """A store plus the fakes around it, and the notifications it sent."""

    def __init__(
        self,
        max_pages: int = 16,
        pages_per_slab: int = 4,
        capacity_pages: int = 0,
        grow: Grow | None = None,
        window_pages: int | None = None,
        placement: str = "best_fit",
        policy=None,
        **config,
    ):
        # Watermark eviction is off unless a test asks for it.
        config.setdefault("high_watermark", 1.0)
        config.setdefault("low_watermark", 1.0)
        self.clock = Clock()
        self.grow = grow or Grow()
        self.events: list[tuple[int, object]] = []
        self.pool = PagePool(max_pages, pages_per_slab, capacity_pages, self.grow)
        self.window = WindowSpace(4 * max_pages if window_pages is None else window_pages, placement)
        self.store = ObjectStore(
            self.pool,
            self.window,
            policy,
            StoreConfig(**config),
            notify=lambda sid, ev: self.events.append((sid, ev)),
            clock=self.clock,
        )
        _harnesses.append(self)

    def alloc(self, session: int, num_pages: int = 1, content_type=TEMP, **kw):
        """Allocate one object; returns it."""
        ((obj, _),) = self.store.allocate(session, [Spec(num_pages, content_type, **kw)])
        check_invariants(self.store)
        return obj


def snapshot(store: ObjectStore) -> dict:
    """Everything a refused request must leave as it was."""
    return {
        "stats": store.stats(),
        "free_list": store.pool.free_page_list(),
        "objects": {
            oid: (o.state, o.owner, o.key, list(o.pages), o.window_page, dict(o.pins), o.freed)
            for oid, o in store.objects.items()
        },
        "keys": {k: o.object_id for k, o in store.keys.items()},
        "sessions": {sid: (set(s.owned), dict(s.pins), s.pin_total, set(s.txns)) for sid, s in store.sessions.items()},
        "pin_contention": store.counters.pin_contention,
        "open_txns": sorted(store.open_txns),
        "evictable": [o.object_id for o in store.policy],
        "window": store.window.extents(),
    }


def without_failure_count(snap: dict) -> dict:
    stats = dataclasses.replace(snap["stats"], allocation_failures=0)
    return {**snap, "stats": stats}


def refused(code: Code, fn, *args, match: str | None = None, **kw) -> BrokerError:
    with pytest.raises(BrokerError) as info:
        fn(*args, **kw)
    assert info.value.code == code, info.value
    if match is not None:
        assert match in info.value.message, info.value.message
    return info.value


@pytest.fixture(autouse=True)
def invariants_hold_at_the_end():
    """Whatever a test did, every store it made must still be consistent afterwards."""
    _harnesses.clear()
    yield
    for harness in _harnesses:
        check_invariants(harness.store)
    _harnesses.clear()


@pytest.fixture
def h() -> Harness:
    return Harness()


# ============================================================ sessions


def test_sessions_get_distinct_ids(h):
    a, b = h.store.open_session(), h.store.open_session()
    assert a != b
    assert h.store.stats().sessions == 2


def test_unknown_session_is_permission_denied(h):
    refused(Code.PERMISSION_DENIED, h.store.allocate, 99, [Spec(1)], match="session 99 is not open")


def test_ended_session_can_no_longer_call(h):
    s = h.store.open_session()
    h.store.end_session(s)
    refused(Code.PERMISSION_DENIED, h.store.allocate, s, [Spec(1)])


def test_end_session_twice_is_a_no_op(h):
    s, other = h.store.open_session(), h.store.open_session()
    h.alloc(other, 2, key=b"k")
    h.store.end_session(s)
    before = snapshot(h.store)
    h.store.end_session(s)
    assert snapshot(h.store) == before


# ============================================================ allocation


def test_allocate_commits_an_owned_object_with_fresh_pages(h):
    s = h.store.open_session()
    obj = h.alloc(s, 3, KV)
    assert obj.state == ObjectState.COMMITTED
    assert obj.owner == s
    assert obj.content_type == KV
    assert obj.pages == [0, 1, 2]
    assert obj.window_page == -1
    st = h.store.stats()
    assert (st.used_pages, st.free_pages, st.evictable_pages, st.objects) == (3, 13, 3, 1)


def test_allocate_grows_the_arena_by_whole_slabs():
    h = Harness(max_pages=16, pages_per_slab=4)
    s = h.store.open_session()
    h.alloc(s, 5)
    assert h.grow.calls == [2]
    assert h.store.stats().capacity_pages == 8
    h.alloc(s, 3)
    assert h.grow.calls == [2]  # fits in the capacity already backed
    h.alloc(s, 1)
    assert h.grow.calls == [2, 1]
    assert h.store.stats().capacity_pages == 12


def test_allocate_with_pin_pins_for_the_session_and_is_not_evictable(h):
    s = h.store.open_session()
    obj = h.alloc(s, 2, pin=True)
    assert obj.pins == {s: 1}
    assert obj.pin_count == 1
    st = h.store.stats()
    assert (st.pinned_pages, st.evictable_pages) == (2, 0)


def test_allocate_of_an_existing_key_returns_the_existing_object_without_pages(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 3, KV, key=b"chunk")
    free_before = h.store.stats().free_pages
    ((obj, dedup),) = h.store.allocate(s2, [Spec(3, KV, key=b"chunk")])
    check_invariants(h.store)
    assert obj is a and dedup is True
    assert h.store.stats().free_pages == free_before
    assert h.store.stats().deduplicated_total == 1
    assert a.owner == s1


def test_allocate_dedup_with_pin_pins_the_existing_object(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 2, KV, key=b"chunk")
    h.store.allocate(s2, [Spec(2, KV, key=b"chunk", pin=True)])
    check_invariants(h.store)
    assert a.pins == {s2: 1}
    assert h.store.stats().evictable_pages == 0


def test_contiguous_allocation_gets_a_window_range(h):
    s = h.store.open_session()
    obj = h.alloc(s, 4, contiguous=True)
    assert obj.window_page == 0
    assert h.store.stats().window_free_pages == h.window.window_pages - 4


def test_freeing_a_contiguous_object_returns_its_window_range(h):
    s = h.store.open_session()
    obj = h.alloc(s, 4, contiguous=True)
    h.store.free(s, [obj.object_id])
    check_invariants(h.store)
    assert h.window.extents() == [(0, h.window.window_pages)]


def test_contiguous_allocation_succeeds_over_fragmented_physical_pages(h):
    s = h.store.open_session()
    objs = [h.alloc(s, 1) for _ in range(16)]
    h.store.free(s, [o.object_id for o in objs[::2]])
    check_invariants(h.store)
    assert h.store.stats().free_pages == 8
    big = h.alloc(s, 8, contiguous=True)
    assert big.window_page >= 0
    assert big.num_pages == 8
    assert sorted(big.pages) == list(range(0, 16, 2))
    assert h.store.stats().free_pages == 0


def test_contiguous_allocation_fails_when_no_window_extent_fits_and_changes_nothing():
    h = Harness(max_pages=16, window_pages=16)
    s = h.store.open_session()
    objs = [h.alloc(s, 4, contiguous=True) for _ in range(4)]
    h.store.free(s, [objs[0].object_id, objs[2].object_id])  # window: 8 free in two extents of 4
    before = snapshot(h.store)
    refused(
        Code.RESOURCE_EXHAUSTED,
        h.store.allocate,
        s,
        [Spec(2, contiguous=True), Spec(6, contiguous=True)],
        match="no free range of 6 pages in the virtual window (8 free in 2 extents, largest 4)",
    )
    check_invariants(h.store)
    # The first spec's window range was given back.
    assert without_failure_count(snapshot(h.store)) == without_failure_count(before)
    assert h.store.stats().allocation_failures == 1


# ============================================================ two-phase commit


def test_prepared_keyed_object_is_invisible_to_lookup_until_commit(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    txn = h.store.prepare(s1, [Spec(2, KV, key=b"k")])
    check_invariants(h.store)
    assert txn.objects[0].state == ObjectState.PREPARED
    assert h.store.lookup(s1, [b"k"], pin=False) == []
    assert h.store.lookup(s2, [b"k"], pin=False) == []
    h.store.commit(s1, [txn.txn_id])
    check_invariants(h.store)
    assert h.store.lookup(s2, [b"k"], pin=False) == [txn.objects[0]]


def test_prepared_object_cannot_be_pinned_by_another_session(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    txn = h.store.prepare(s1, [Spec(2)])
    oid = txn.objects[0].object_id
    before = snapshot(h.store)
    refused(Code.NOT_FOUND, h.store.pin, s2, [oid], match=f"no object {oid}")
    assert snapshot(h.store) == before


def test_prepared_object_cannot_be_pinned_by_its_own_session_before_commit(h):
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(2)])
    refused(Code.FAILED_PRECONDITION, h.store.pin, s, [txn.objects[0].object_id], match="pin it at commit")


def test_prepared_object_is_not_evictable(h):
    s = h.store.open_session()
    h.store.prepare(s, [Spec(4)])
    st = h.store.stats()
    assert (st.prepared_pages, st.evictable_pages, st.open_transactions) == (4, 0, 1)


def test_commit_makes_prepared_objects_committed_and_evictable(h):
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(2), Spec(3, pin=True)])
    (done,) = h.store.commit(s, [txn.txn_id])
    check_invariants(h.store)
    assert done.state == TxnState.COMMITTED
    assert [o.state for o, _ in done.result] == [ObjectState.COMMITTED] * 2
    assert [dedup for _, dedup in done.result] == [False, False]
    assert done.result[1][0].pins == {s: 1}
    st = h.store.stats()
    assert (st.prepared_pages, st.evictable_pages, st.pinned_pages) == (0, 2, 3)


def test_abort_returns_the_pages(h):
    s = h.store.open_session()
    free_before = h.store.stats().free_pages
    txn = h.store.prepare(s, [Spec(3), Spec(2, contiguous=True, key=b"k")])
    assert h.store.stats().free_pages == free_before - 5
    assert h.store.abort(s, [txn.txn_id]) == 5
    check_invariants(h.store)
    st = h.store.stats()
    assert (st.free_pages, st.objects, st.open_transactions) == (free_before, 0, 0)
    assert h.window.extents() == [(0, h.window.window_pages)]
    assert txn.state == TxnState.ABORTED


def test_abort_releases_prepare_time_pins(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 2)
    txn = h.store.prepare(s2, [], pin_ids=[a.object_id])
    assert a.pins == {s2: 1}
    h.store.abort(s2, [txn.txn_id])
    check_invariants(h.store)
    assert a.pins == {}
    assert h.store.stats().evictable_pages == 2


def test_commit_keeps_prepare_time_pins(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 2)
    txn = h.store.prepare(s2, [Spec(1)], pin_ids=[a.object_id])
    h.store.commit(s2, [txn.txn_id])
    check_invariants(h.store)
    assert a.pins == {s2: 1}


def test_abort_twice_is_a_no_op(h):
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(3)])
    h.store.abort(s, [txn.txn_id])
    before = snapshot(h.store)
    assert h.store.abort(s, [txn.txn_id]) == 0
    assert snapshot(h.store) == before


def test_second_commit_is_a_no_op_returning_the_same_objects(h):
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(2, key=b"a"), Spec(1)])
    (first,) = h.store.commit(s, [txn.txn_id])
    objs = [o for o, _ in first.result]
    before = snapshot(h.store)
    (second,) = h.store.commit(s, [txn.txn_id])
    assert second is first
    assert [o for o, _ in second.result] == objs
    assert all(a is b for a, b in zip((o for o, _ in second.result), objs))
    assert snapshot(h.store) == before


def test_abort_after_commit_is_failed_precondition(h):
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(2)])
    h.store.commit(s, [txn.txn_id])
    before = snapshot(h.store)
    refused(Code.FAILED_PRECONDITION, h.store.abort, s, [txn.txn_id], match="already committed")
    assert snapshot(h.store) == before


def test_commit_after_abort_is_failed_precondition(h):
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(2)])
    h.store.abort(s, [txn.txn_id])
    before = snapshot(h.store)
    refused(Code.FAILED_PRECONDITION, h.store.commit, s, [txn.txn_id], match="was aborted")
    assert snapshot(h.store) == before


def test_commit_of_another_sessions_transaction_is_permission_denied(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    txn = h.store.prepare(s1, [Spec(2)])
    before = snapshot(h.store)
    refused(Code.PERMISSION_DENIED, h.store.commit, s2, [txn.txn_id])
    refused(Code.PERMISSION_DENIED, h.store.abort, s2, [txn.txn_id])
    assert snapshot(h.store) == before


def test_commit_of_a_batch_with_an_unknown_transaction_commits_nothing(h):
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(2, key=b"k")])
    before = snapshot(h.store)
    refused(Code.NOT_FOUND, h.store.commit, s, [txn.txn_id, 777], match="no transaction 777")
    assert snapshot(h.store) == before
    assert txn.state == TxnState.OPEN


def test_committing_an_existing_key_deduplicates_and_frees_the_new_pages(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 3, KV, key=b"chunk")
    free_before = h.store.stats().free_pages
    txn = h.store.prepare(s2, [Spec(3, KV, key=b"chunk", contiguous=True)])
    new = txn.objects[0]
    assert h.store.stats().free_pages == free_before - 3
    (done,) = h.store.commit(s2, [txn.txn_id])
    check_invariants(h.store)
    assert done.result == [(a, True)]
    st = h.store.stats()
    assert st.free_pages == free_before
    assert (st.objects, st.deduplicated_total) == (1, 1)
    assert new.object_id not in h.store.objects
    assert new.object_id not in h.store.sessions[s2].owned
    assert h.window.extents() == [(0, h.window.window_pages)]


def test_committing_an_existing_key_with_pin_pins_the_existing_object(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 3, KV, key=b"chunk")
    txn = h.store.prepare(s2, [Spec(3, KV, key=b"chunk", pin=True)])
    h.store.commit(s2, [txn.txn_id])
    check_invariants(h.store)
    assert a.pins == {s2: 1}


# ============================================================ leases


def test_lease_expiry_returns_pages_and_notifies_the_session(h):
    s = h.store.open_session()
    free_before = h.store.stats().free_pages
    txn = h.store.prepare(s, [Spec(4)], lease_s=5.0)
    assert h.store.next_deadline() == h.clock.now + 5.0
    h.clock.advance(5.0)
    assert h.store.expire() == [txn.txn_id]
    check_invariants(h.store)
    assert h.store.stats().free_pages == free_before
    assert h.store.stats().open_transactions == 0
    assert txn.state == TxnState.EXPIRED
    assert h.events == [(s, TransactionsExpired([txn.txn_id]))]


def test_lease_not_yet_ended_does_not_expire(h):
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(4)], lease_s=5.0)
    h.clock.advance(4.9)
    assert h.store.expire() == []
    assert txn.state == TxnState.OPEN
    assert h.events == []


def test_expiry_notifies_each_session_of_its_own_transactions_only(h):
    s1, s2, s3 = (h.store.open_session() for _ in range(3))
    t1 = h.store.prepare(s1, [Spec(1)], lease_s=1.0)
    t2 = h.store.prepare(s2, [Spec(1)], lease_s=1.0)
    t3 = h.store.prepare(s1, [Spec(1)], lease_s=2.0)
    h.store.prepare(s3, [Spec(1)], lease_s=60.0)
    h.clock.advance(2.0)
    assert sorted(h.store.expire()) == sorted([t1.txn_id, t2.txn_id, t3.txn_id])
    check_invariants(h.store)
    assert sorted(h.events, key=lambda e: e[0]) == [
        (s1, TransactionsExpired([t1.txn_id, t3.txn_id])),
        (s2, TransactionsExpired([t2.txn_id])),
    ]
    assert h.store.stats().open_transactions == 1


def test_default_lease_applies_when_none_is_given():
    h = Harness(default_lease_s=7.0)
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(1)])
    assert txn.deadline == h.clock.now + 7.0


def test_commit_after_expiry_is_failed_precondition(h):
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(2)], lease_s=1.0)
    h.clock.advance(1.0)
    h.store.expire()
    before = snapshot(h.store)
    refused(Code.FAILED_PRECONDITION, h.store.commit, s, [txn.txn_id], match="expired")
    assert snapshot(h.store) == before


def test_commit_past_the_lease_expires_it_and_is_failed_precondition(h):
    s = h.store.open_session()
    free_before = h.store.stats().free_pages
    txn = h.store.prepare(s, [Spec(2)], lease_s=1.0)
    h.clock.advance(1.5)
    refused(Code.FAILED_PRECONDITION, h.store.commit, s, [txn.txn_id], match="expired before commit")
    check_invariants(h.store)
    assert txn.state == TxnState.EXPIRED
    assert h.store.stats().free_pages == free_before
    assert h.events == [(s, TransactionsExpired([txn.txn_id]))]


def test_abort_after_expiry_is_a_no_op(h):
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(2)], lease_s=1.0)
    h.clock.advance(1.0)
    h.store.expire()
    before = snapshot(h.store)
    assert h.store.abort(s, [txn.txn_id]) == 0
    assert snapshot(h.store) == before


# ============================================================ lookup and pins


def test_lookup_pins_the_longest_existing_prefix_of_keys(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 1, KV, key=b"a")
    b = h.alloc(s1, 1, KV, key=b"b")
    c = h.alloc(s1, 1, KV, key=b"d")  # "c" is missing
    found = h.store.lookup(s2, [b"a", b"b", b"c", b"d"], pin=True)
    check_invariants(h.store)
    assert found == [a, b]
    assert (a.pins, b.pins, c.pins) == ({s2: 1}, {s2: 1}, {})
    assert h.store.stats().evictable_pages == 1


def test_lookup_stops_at_a_missing_first_key(h):
    s = h.store.open_session()
    b = h.alloc(s, 1, KV, key=b"b")
    assert h.store.lookup(s, [b"a", b"b"], pin=True) == []
    assert b.pins == {}


def test_lookup_without_pin_pins_nothing_but_refreshes_recency(h):
    s = h.store.open_session()
    a = h.alloc(s, 1, KV, key=b"a")
    b = h.alloc(s, 1, KV, key=b"b")
    assert h.store.lookup(s, [b"a"], pin=False) == [a]
    assert a.pins == {}
    assert [o.object_id for o in h.store.policy] == [b.object_id, a.object_id]


def test_unpin_releases_the_lookup_pins(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 2, KV, key=b"a")
    h.store.lookup(s2, [b"a"], pin=True)
    h.store.unpin(s2, [a.object_id])
    check_invariants(h.store)
    assert a.pins == {}
    assert h.store.stats().evictable_pages == 2


def test_pin_counts_add_up_per_session(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 1)
    h.store.pin(s1, [a.object_id, a.object_id])
    h.store.pin(s2, [a.object_id])
    check_invariants(h.store)
    assert a.pins == {s1: 2, s2: 1}
    assert a.pin_count == 3
    h.store.unpin(s1, [a.object_id])
    check_invariants(h.store)
    assert a.pins == {s1: 1, s2: 1}


def test_unpin_of_an_unpinned_object_is_failed_precondition(h):
    s = h.store.open_session()
    a = h.alloc(s, 1)
    before = snapshot(h.store)
    refused(Code.FAILED_PRECONDITION, h.store.unpin, s, [a.object_id], match="holds 0 pin(s)")
    assert snapshot(h.store) == before


def test_unpin_of_more_pins_than_held_is_failed_precondition(h):
    s = h.store.open_session()
    a = h.alloc(s, 1, pin=True)
    before = snapshot(h.store)
    refused(Code.FAILED_PRECONDITION, h.store.unpin, s, [a.object_id, a.object_id], match="holds 1 pin(s)")
    assert snapshot(h.store) == before


def test_a_session_cannot_unpin_another_sessions_pins(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 1, pin=True)
    before = snapshot(h.store)
    refused(Code.PERMISSION_DENIED, h.store.unpin, s2, [a.object_id], match="pinned only by other sessions")
    assert snapshot(h.store) == before
    assert a.pins == {s1: 1}


def test_a_session_cannot_free_another_sessions_object(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 2, key=b"k")
    before = snapshot(h.store)
    refused(Code.PERMISSION_DENIED, h.store.free, s2, [a.object_id], match="not owned by session")
    assert snapshot(h.store) == before


def test_free_returns_pages_and_forgets_the_key(h):
    s = h.store.open_session()
    a = h.alloc(s, 3, key=b"k")
    assert h.store.free(s, [a.object_id]) == (3, 0)
    check_invariants(h.store)
    st = h.store.stats()
    assert (st.used_pages, st.objects, st.keyed_objects, st.evictable_pages) == (0, 0, 0, 0)
    assert h.store.lookup(s, [b"k"], pin=False) == []
    refused(Code.NOT_FOUND, h.store.pin, s, [a.object_id], match="was freed")


def test_free_drops_the_owners_own_pins(h):
    s = h.store.open_session()
    a = h.alloc(s, 2, pin=True)
    assert h.store.free(s, [a.object_id]) == (2, 0)
    check_invariants(h.store)
    assert h.store.sessions[s].pins == {}


def test_free_of_an_object_pinned_by_another_session_is_deferred_until_its_last_pin(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 2, key=b"k")
    h.store.pin(s2, [a.object_id])
    assert h.store.free(s1, [a.object_id]) == (0, 2)
    check_invariants(h.store)
    assert h.store.stats().used_pages == 2
    assert h.store.lookup(s2, [b"k"], pin=False) == []
    refused(Code.NOT_FOUND, h.store.pin, s2, [a.object_id], match="was freed")
    h.store.unpin(s2, [a.object_id])
    check_invariants(h.store)
    assert h.store.stats().used_pages == 0
    assert a.object_id not in h.store.objects


def test_free_of_a_prepared_object_is_failed_precondition(h):
    s = h.store.open_session()
    txn = h.store.prepare(s, [Spec(2)])
    before = snapshot(h.store)
    refused(Code.FAILED_PRECONDITION, h.store.free, s, [txn.objects[0].object_id], match="commit or abort")
    assert snapshot(h.store) == before


# ============================================================ end of a session


def test_end_session_releases_its_pins(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 2, key=b"k")
    h.store.pin(s2, [a.object_id, a.object_id])
    h.store.end_session(s2)
    check_invariants(h.store)
    assert a.pins == {} and a.pin_count == 0
    assert h.store.stats().evictable_pages == 2


def test_end_session_aborts_its_open_transactions(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 1)
    free_before = h.store.stats().free_pages
    txn = h.store.prepare(s2, [Spec(3, key=b"k")], pin_ids=[a.object_id])
    h.store.end_session(s2)
    check_invariants(h.store)
    assert txn.state == TxnState.ABORTED
    st = h.store.stats()
    assert (st.free_pages, st.open_transactions, st.prepared_pages) == (free_before, 0, 0)
    assert a.pins == {}


def test_end_session_frees_its_anonymous_objects(h):
    s = h.store.open_session()
    h.alloc(s, 2)
    h.alloc(s, 3, pin=True)
    h.store.end_session(s)
    check_invariants(h.store)
    st = h.store.stats()
    assert (st.used_pages, st.objects) == (0, 0)


def test_end_session_keeps_keyed_committed_objects_ownerless_and_findable(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 2, KV, key=b"k", pin=True)
    h.store.end_session(s1)
    check_invariants(h.store)
    assert a.owner == 0
    assert a.pins == {}
    assert h.store.lookup(s2, [b"k"], pin=True) == [a]
    check_invariants(h.store)
    # Nobody owns it any more, so nobody may free it; it leaves by eviction only.
    refused(Code.PERMISSION_DENIED, h.store.free, s2, [a.object_id])


def test_anonymous_object_pinned_by_another_session_outlives_its_owner_until_unpinned(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 2)
    h.store.pin(s2, [a.object_id])
    h.store.end_session(s1)
    check_invariants(h.store)
    assert a.object_id in h.store.objects
    assert h.store.stats().used_pages == 2
    h.store.unpin(s2, [a.object_id])
    check_invariants(h.store)
    assert a.object_id not in h.store.objects
    assert h.store.stats().used_pages == 0


def test_anonymous_object_pinned_by_another_session_is_freed_when_that_session_ends(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 2)
    h.store.pin(s2, [a.object_id])
    h.store.end_session(s1)
    h.store.end_session(s2)
    check_invariants(h.store)
    assert a.object_id not in h.store.objects
    assert h.store.stats().used_pages == 0


# ============================================================ eviction under pressure


def fill(h: Harness, session: int, *specs) -> list:
    """Allocate one object per (content_type, num_pages), oldest first."""
    return [h.alloc(session, n, ct) for ct, n in specs]


def test_pressure_evicts_unpinned_objects_in_priority_then_lru_order(h):
    s = h.store.open_session()
    kv1, temp1, lora, kv2, temp2, act = fill(h, s, (KV, 3), (TEMP, 2), (LORA, 3), (KV, 3), (TEMP, 2), (ACT, 3))
    assert h.store.stats().free_pages == 0
    h.alloc(s, 7, KV)
    # Need 7: both temp buffers (4), then the activation (3).
    gone = {temp1.object_id, temp2.object_id, act.object_id}
    assert gone.isdisjoint(h.store.objects)
    assert {kv1.object_id, lora.object_id, kv2.object_id} <= set(h.store.objects)
    h.alloc(s, 4, KV)
    # Need 4: the adapter weights (3), then the oldest KV chunk.
    assert lora.object_id not in h.store.objects
    assert kv1.object_id not in h.store.objects
    assert kv2.object_id in h.store.objects
    st = h.store.stats()
    assert (st.evicted_objects, st.evicted_pages) == (5, 13)


def test_pressure_evicts_least_recently_used_within_a_class(h):
    s = h.store.open_session()
    a, b, c, d = fill(h, s, (KV, 4), (KV, 4), (KV, 4), (KV, 4))
    h.store.pin(s, [a.object_id])
    h.store.unpin(s, [a.object_id])  # a is now the most recently used
    h.alloc(s, 4, KV)
    assert b.object_id not in h.store.objects
    assert {a.object_id, c.object_id, d.object_id} <= set(h.store.objects)


def test_plain_lru_policy_evicts_oldest_regardless_of_content():
    h = Harness(policy=PlainLRU())
    s = h.store.open_session()
    kv, temp = fill(h, s, (KV, 8), (TEMP, 8))
    h.alloc(s, 4, KV)
    assert kv.object_id not in h.store.objects
    assert temp.object_id in h.store.objects


def test_pinned_objects_are_never_evicted(h):
    s = h.store.open_session()
    pinned = h.alloc(s, 4, TEMP, pin=True)
    others = fill(h, s, (KV, 4), (KV, 4), (KV, 4))
    h.alloc(s, 8, KV)
    assert pinned.object_id in h.store.objects
    assert sum(o.object_id in h.store.objects for o in others) == 1


def test_objects_pinned_through_a_prepare_are_not_evicted_for_it(h):
    s = h.store.open_session()
    old, young = fill(h, s, (TEMP, 8), (TEMP, 8))
    txn = h.store.prepare(s, [Spec(8)], pin_ids=[old.object_id])
    check_invariants(h.store)
    assert old.object_id in h.store.objects
    assert young.object_id not in h.store.objects
    assert old.pins == {s: 1}
    assert txn.objects[0].num_pages == 8


def test_an_existing_key_in_the_batch_is_not_evicted_to_make_room_for_the_rest(h):
    s = h.store.open_session()
    keyed, other = h.alloc(s, 8, TEMP, key=b"k"), h.alloc(s, 8, KV)
    out = h.store.allocate(s, [Spec(8, TEMP, key=b"k"), Spec(8, TEMP)])
    check_invariants(h.store)
    assert out[0] == (keyed, True)
    assert keyed.object_id in h.store.objects
    assert other.object_id not in h.store.objects


def test_nothing_evictable_fails_with_resource_exhausted_and_numbers(h):
    s = h.store.open_session()
    h.alloc(s, 10, pin=True)
    h.alloc(s, 3)  # evictable
    before = snapshot(h.store)
    err = refused(Code.RESOURCE_EXHAUSTED, h.store.allocate, s, [Spec(7)])
    assert "need 7 pages, 3 free, 3 evictable" in err.message
    assert "10 pinned in 1 objects" in err.message
    check_invariants(h.store)
    assert without_failure_count(snapshot(h.store)) == without_failure_count(before)
    assert h.store.stats().allocation_failures == 1


def test_prepared_pages_cannot_be_evicted_for_a_request(h):
    s = h.store.open_session()
    h.store.prepare(s, [Spec(12)])
    before = snapshot(h.store)
    err = refused(Code.RESOURCE_EXHAUSTED, h.store.prepare, s, [Spec(5)])
    assert "need 5 pages, 4 free, 0 evictable" in err.message
    assert "12 prepared" in err.message
    assert without_failure_count(snapshot(h.store)) == without_failure_count(before)


def test_batch_larger_than_the_arena_is_resource_exhausted_and_changes_nothing(h):
    s = h.store.open_session()
    before = snapshot(h.store)
    refused(Code.RESOURCE_EXHAUSTED, h.store.allocate, s, [Spec(10), Spec(10)], match="batch needs 20 pages")
    assert snapshot(h.store) == before


def test_owner_is_notified_of_its_evicted_objects_with_ids_and_keys(h):
    s1, s2, s3 = (h.store.open_session() for _ in range(3))
    a = h.alloc(s1, 2, TEMP, key=b"a")
    b = h.alloc(s1, 2, TEMP)
    c = h.alloc(s2, 2, TEMP, key=b"c")
    h.alloc(s2, 10, KV)
    h.alloc(s3, 6, KV, pin=True)
    assert sorted(h.events, key=lambda e: e[0]) == [
        (s1, ObjectsEvicted([a.object_id, b.object_id], [b"a"])),
        (s2, ObjectsEvicted([c.object_id], [b"c"])),
    ]


def test_evicted_ownerless_object_notifies_nobody(h):
    s1, s2 = h.store.open_session(), h.store.open_session()
    h.alloc(s1, 8, TEMP, key=b"k")
    h.store.end_session(s1)
    h.alloc(s2, 16, KV)
    assert h.events == []
    assert h.store.stats().evicted_objects == 1


def test_pinning_an_evicted_object_is_not_found_saying_evicted(h):
    s = h.store.open_session()
    a = h.alloc(s, 8, TEMP, key=b"k")
    h.alloc(s, 16, KV)
    assert a.object_id not in h.store.objects
    before = snapshot(h.store)
    refused(Code.NOT_FOUND, h.store.pin, s, [a.object_id], match=f"object {a.object_id} was evicted")
    assert snapshot(h.store) == before
    assert h.store.lookup(s, [b"k"], pin=True) == []
    assert "evicted" in h.store.describe_gone(a.object_id)


# ============================================================ watermarks (hysteresis)


def watermark_harness() -> Harness:
    # 20 pages: evict when usage would pass 18 (0.9), down to 10 (0.5).
    return Harness(max_pages=20, pages_per_slab=4, high_watermark=0.9, low_watermark=0.5)


def test_allocating_below_the_high_watermark_does_not_evict():
    h = watermark_harness()
    s = h.store.open_session()
    fill(h, s, *[(TEMP, 1)] * 18)
    st = h.store.stats()
    assert (st.used_pages, st.eviction_runs, st.evicted_pages, st.eviction_active) == (18, 0, 0, False)


def test_crossing_the_high_watermark_evicts_down_to_the_low_watermark():
    h = watermark_harness()
    s = h.store.open_session()
    olds = fill(h, s, *[(TEMP, 1)] * 17)
    h.alloc(s, 2, KV)
    st = h.store.stats()
    assert st.eviction_runs == 1
    assert st.evicted_pages == 9  # 17 + 2 - 10
    assert st.used_pages == 10
    assert st.eviction_active is False  # reached the low watermark
    # The oldest went first.
    assert [o.object_id in h.store.objects for o in olds] == [False] * 9 + [True] * 8


def test_allocating_between_the_watermarks_after_an_eviction_run_does_not_evict():
    h = watermark_harness()
    s = h.store.open_session()
    fill(h, s, *[(TEMP, 1)] * 17)
    h.alloc(s, 2, KV)  # evicts down to 10
    fill(h, s, *[(TEMP, 1)] * 8)
    st = h.store.stats()
    assert (st.used_pages, st.eviction_runs, st.evicted_pages) == (18, 1, 9)


def test_crossing_the_high_watermark_again_evicts_again():
    h = watermark_harness()
    s = h.store.open_session()
    fill(h, s, *[(TEMP, 1)] * 17)
    h.alloc(s, 2, KV)
    fill(h, s, *[(TEMP, 1)] * 8)  # 18 used
    h.alloc(s, 1, TEMP)
    st = h.store.stats()
    assert st.eviction_runs == 2
    assert st.used_pages == 10
    assert st.evicted_pages == 9 + 9


def test_eviction_stays_active_while_pinned_pages_keep_usage_above_the_low_watermark():
    h = watermark_harness()
    s = h.store.open_session()
    h.alloc(s, 14, KV, pin=True)
    fill(h, s, (TEMP, 1), (TEMP, 1), (TEMP, 1))  # 17 used
    h.alloc(s, 2, TEMP)
    st = h.store.stats()
    assert st.eviction_active is True
    assert (st.used_pages, st.evicted_pages, st.eviction_runs) == (16, 3, 1)
    # Still active: the next allocation evicts although it stays below the high watermark.
    h.alloc(s, 1, TEMP)
    st = h.store.stats()
    assert st.eviction_runs == 2
    assert st.evicted_pages == 5
    assert st.used_pages == 15


def test_eviction_becomes_inactive_once_usage_is_back_at_the_low_watermark():
    h = watermark_harness()
    s = h.store.open_session()
    big = h.alloc(s, 14, KV, pin=True)
    fill(h, s, (TEMP, 1), (TEMP, 1), (TEMP, 1))
    h.alloc(s, 2, TEMP)
    assert h.store.stats().eviction_active is True
    h.store.free(s, [big.object_id])
    h.alloc(s, 1, TEMP)
    st = h.store.stats()
    assert st.eviction_active is False
    assert st.eviction_runs == 1


# ============================================================ arena growth failure


def test_growth_failure_makes_allocation_evict_inside_current_capacity():
    h = Harness(max_pages=16, pages_per_slab=4, capacity_pages=8, grow=Grow(fail=True))
    s = h.store.open_session()
    a, b = fill(h, s, (TEMP, 4), (KV, 4))
    c = h.alloc(s, 4, KV)
    assert h.grow.calls == [1]
    st = h.store.stats()
    assert st.capacity_pages == 8
    assert a.object_id not in h.store.objects
    assert b.object_id in h.store.objects
    assert sorted(c.pages) == [0, 1, 2, 3]
    assert h.events == [(s, ObjectsEvicted([a.object_id], []))]


def test_growth_failure_with_nothing_evictable_is_resource_exhausted_saying_the_arena_could_not_grow():
    h = Harness(max_pages=16, pages_per_slab=4, capacity_pages=8, grow=Grow(fail=True))
    s = h.store.open_session()
    h.alloc(s, 6, pin=True)
    h.alloc(s, 1)
    before = snapshot(h.store)
    err = refused(Code.RESOURCE_EXHAUSTED, h.store.allocate, s, [Spec(4)])
    assert "the arena could not grow" in err.message
    assert "need 4 pages, 1 free in 8 backed pages, 1 evictable" in err.message
    check_invariants(h.store)
    assert without_failure_count(snapshot(h.store)) == without_failure_count(before)
    assert h.store.stats().allocation_failures == 1


def test_growth_failure_refusal_evicts_nothing_when_the_pool_is_full():
    # 12 pages need growth even after evicting the 4 evictable ones; the backend cannot grow.
    h = Harness(max_pages=16, pages_per_slab=4, capacity_pages=8, grow=Grow(fail=True))
    s = h.store.open_session()
    h.alloc(s, 4, pin=True)
    h.alloc(s, 4)
    before = snapshot(h.store)
    refused(Code.RESOURCE_EXHAUSTED, h.store.allocate, s, [Spec(12)], match="could not grow")
    check_invariants(h.store)
    assert without_failure_count(snapshot(h.store)) == without_failure_count(before)
    assert h.events == []


def test_growth_failure_refusal_evicts_nothing_above_the_high_watermark():
    h = Harness(
        max_pages=16, pages_per_slab=4, capacity_pages=8, grow=Grow(fail=True), high_watermark=0.75, low_watermark=0.5
    )
    s = h.store.open_session()
    h.alloc(s, 6, pin=True)
    h.alloc(s, 2)
    before = snapshot(h.store)
    refused(Code.RESOURCE_EXHAUSTED, h.store.allocate, s, [Spec(5)], match="could not grow")
    check_invariants(h.store)
    assert without_failure_count(snapshot(h.store)) == without_failure_count(before)
    st = h.store.stats()
    assert (st.eviction_active, st.eviction_runs, st.evicted_pages) == (False, 0, 0)
    assert h.events == []


def test_growth_and_eviction_together_grow_only_what_eviction_cannot_cover():
    h = Harness(max_pages=16, pages_per_slab=4, capacity_pages=8)
    s = h.store.open_session()
    h.alloc(s, 4, pin=True)
    old = h.alloc(s, 4)
    new = h.alloc(s, 12)
    assert h.grow.calls == [2]
    assert h.store.stats().capacity_pages == 16
    assert old.object_id not in h.store.objects
    assert new.num_pages == 12


def test_growth_failure_releases_the_window_range_of_a_refused_contiguous_request():
    h = Harness(max_pages=16, pages_per_slab=4, capacity_pages=4, grow=Grow(fail=True))
    s = h.store.open_session()
    before = snapshot(h.store)
    refused(Code.RESOURCE_EXHAUSTED, h.store.allocate, s, [Spec(6, contiguous=True)], match="could not grow")
    check_invariants(h.store)
    assert without_failure_count(snapshot(h.store)) == without_failure_count(before)


# ============================================================ malformed and out-of-range input


@pytest.fixture
def world():
    """A store with some state: s1 owns a keyed object and an open transaction; s2 exists."""
    h = Harness(max_pages=16, max_batch=4, max_key_bytes=8, max_lease_s=60.0)
    s1, s2 = h.store.open_session(), h.store.open_session()
    obj = h.alloc(s1, 2, KV, key=b"key")
    txn = h.store.prepare(s1, [Spec(2)])
    check_invariants(h.store)
    return h, s1, s2, obj, txn


BAD_CALLS = {
    # allocate
    "allocate zero pages": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.allocate(s1, [Spec(0)])),
    "allocate negative pages": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.allocate(s1, [Spec(-1)])),
    "allocate more than max pages": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.allocate(s1, [Spec(17)])),
    "allocate content type 0": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.allocate(s1, [Spec(1, 0)])),
    "allocate content type 99": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.allocate(s1, [Spec(1, 99)])),
    "allocate empty key": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.allocate(s1, [Spec(1, key=b"")])),
    "allocate too-long key": (
        Code.INVALID_ARGUMENT,
        lambda st, s1, s2, o, t: st.allocate(s1, [Spec(1, key=b"123456789")]),
    ),
    "allocate duplicate keys in a batch": (
        Code.INVALID_ARGUMENT,
        lambda st, s1, s2, o, t: st.allocate(s1, [Spec(1, key=b"x"), Spec(1, key=b"x")]),
    ),
    "allocate bad spec after a good one": (
        Code.INVALID_ARGUMENT,
        lambda st, s1, s2, o, t: st.allocate(s1, [Spec(1, key=b"ok"), Spec(0)]),
    ),
    "allocate batch too large": (
        Code.INVALID_ARGUMENT,
        lambda st, s1, s2, o, t: st.allocate(s1, [Spec(1)] * 5),
    ),
    "allocate unknown session": (Code.PERMISSION_DENIED, lambda st, s1, s2, o, t: st.allocate(999, [Spec(1)])),
    # prepare
    "prepare negative lease": (
        Code.INVALID_ARGUMENT,
        lambda st, s1, s2, o, t: st.prepare(s1, [Spec(1)], lease_s=-1.0),
    ),
    "prepare lease past the maximum": (
        Code.INVALID_ARGUMENT,
        lambda st, s1, s2, o, t: st.prepare(s1, [Spec(1)], lease_s=61.0),
    ),
    "prepare NaN lease": (
        Code.INVALID_ARGUMENT,
        lambda st, s1, s2, o, t: st.prepare(s1, [Spec(1)], lease_s=math.nan),
    ),
    "prepare zero pages": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.prepare(s1, [Spec(0)])),
    "prepare bad content type with a pin": (
        Code.INVALID_ARGUMENT,
        lambda st, s1, s2, o, t: st.prepare(s2, [Spec(1, 42)], pin_ids=[o.object_id]),
    ),
    "prepare pin of an unknown object": (
        Code.NOT_FOUND,
        lambda st, s1, s2, o, t: st.prepare(s2, [Spec(1)], pin_ids=[o.object_id, 12345]),
    ),
    "prepare pin of another session's prepared object": (
        Code.NOT_FOUND,
        lambda st, s1, s2, o, t: st.prepare(s2, [Spec(1)], pin_ids=[t.objects[0].object_id]),
    ),
    "prepare batch too large": (
        Code.INVALID_ARGUMENT,
        lambda st, s1, s2, o, t: st.prepare(s1, [Spec(1)] * 3, pin_ids=[o.object_id] * 2),
    ),
    "prepare unknown session": (Code.PERMISSION_DENIED, lambda st, s1, s2, o, t: st.prepare(999, [Spec(1)])),
    # commit / abort
    "commit unknown transaction": (Code.NOT_FOUND, lambda st, s1, s2, o, t: st.commit(s1, [424242])),
    "commit known then unknown transaction": (
        Code.NOT_FOUND,
        lambda st, s1, s2, o, t: st.commit(s1, [t.txn_id, 424242]),
    ),
    "commit another session's transaction": (
        Code.PERMISSION_DENIED,
        lambda st, s1, s2, o, t: st.commit(s2, [t.txn_id]),
    ),
    "commit batch too large": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.commit(s1, [t.txn_id] * 5)),
    "commit unknown session": (Code.PERMISSION_DENIED, lambda st, s1, s2, o, t: st.commit(999, [t.txn_id])),
    "abort unknown transaction": (Code.NOT_FOUND, lambda st, s1, s2, o, t: st.abort(s1, [t.txn_id, 424242])),
    "abort another session's transaction": (
        Code.PERMISSION_DENIED,
        lambda st, s1, s2, o, t: st.abort(s2, [t.txn_id]),
    ),
    "abort batch too large": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.abort(s1, [t.txn_id] * 5)),
    "abort unknown session": (Code.PERMISSION_DENIED, lambda st, s1, s2, o, t: st.abort(999, [t.txn_id])),
    # free
    "free duplicate ids": (
        Code.INVALID_ARGUMENT,
        lambda st, s1, s2, o, t: st.free(s1, [o.object_id, o.object_id]),
    ),
    "free unknown id": (Code.NOT_FOUND, lambda st, s1, s2, o, t: st.free(s1, [o.object_id, 31337])),
    "free another session's object": (Code.PERMISSION_DENIED, lambda st, s1, s2, o, t: st.free(s2, [o.object_id])),
    "free a prepared object": (
        Code.FAILED_PRECONDITION,
        lambda st, s1, s2, o, t: st.free(s1, [o.object_id, t.objects[0].object_id]),
    ),
    "free batch too large": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.free(s1, [1, 2, 3, 4, 5])),
    "free unknown session": (Code.PERMISSION_DENIED, lambda st, s1, s2, o, t: st.free(999, [o.object_id])),
    # pin / unpin
    "pin unknown id": (Code.NOT_FOUND, lambda st, s1, s2, o, t: st.pin(s2, [o.object_id, 31337])),
    "pin batch too large": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.pin(s2, [o.object_id] * 5)),
    "pin unknown session": (Code.PERMISSION_DENIED, lambda st, s1, s2, o, t: st.pin(999, [o.object_id])),
    "unpin unknown id": (Code.NOT_FOUND, lambda st, s1, s2, o, t: st.unpin(s1, [31337])),
    "unpin unpinned object": (Code.FAILED_PRECONDITION, lambda st, s1, s2, o, t: st.unpin(s1, [o.object_id])),
    "unpin batch too large": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.unpin(s1, [o.object_id] * 5)),
    "unpin unknown session": (Code.PERMISSION_DENIED, lambda st, s1, s2, o, t: st.unpin(999, [o.object_id])),
    # lookup
    "lookup empty key": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.lookup(s2, [b"key", b""], pin=True)),
    "lookup too-long key": (
        Code.INVALID_ARGUMENT,
        lambda st, s1, s2, o, t: st.lookup(s2, [b"key", b"123456789"], pin=True),
    ),
    "lookup batch too large": (Code.INVALID_ARGUMENT, lambda st, s1, s2, o, t: st.lookup(s2, [b"key"] * 5, pin=True)),
    "lookup unknown session": (Code.PERMISSION_DENIED, lambda st, s1, s2, o, t: st.lookup(999, [b"key"], pin=True)),
}


@pytest.mark.parametrize("case", list(BAD_CALLS), ids=list(BAD_CALLS))
def test_malformed_or_out_of_range_request_is_refused_with_its_code_and_changes_nothing(world, case):
    h, s1, s2, obj, txn = world
    code, call = BAD_CALLS[case]
    before = snapshot(h.store)
    refused(code, call, h.store, s1, s2, obj, txn)
    check_invariants(h.store)
    assert snapshot(h.store) == before
    assert h.events == []


def test_refusals_name_the_numbers_that_explain_them(world):
    h, s1, s2, obj, txn = world
    refused(Code.INVALID_ARGUMENT, h.store.allocate, s1, [Spec(17)], match="num_pages is 17; must be 1..16")
    refused(Code.INVALID_ARGUMENT, h.store.allocate, s1, [Spec(1)] * 5, match="has 5 items; at most 4")
    refused(
        Code.INVALID_ARGUMENT, h.store.lookup, s2, [b"123456789"], pin=False, match="is 9 bytes; keys are at most 8"
    )
    refused(Code.INVALID_ARGUMENT, h.store.prepare, s1, [Spec(1)], lease_s=61.0, match="allowed 0 < lease <= 60 s")


def test_store_config_rejects_inverted_watermarks():
    with pytest.raises(ValueError, match="watermarks"):
        Harness(high_watermark=0.5, low_watermark=0.8)


# ============================================================ per-session pin limit


def pin_limited(limit: int = 2) -> Harness:
    return Harness(max_pins_per_session=limit)


def test_pin_beyond_the_session_limit_is_resource_exhausted_with_numbers_and_changes_nothing():
    h = pin_limited(2)
    s = h.store.open_session()
    a, b = h.alloc(s, 1), h.alloc(s, 1)
    h.store.pin(s, [a.object_id])
    before = snapshot(h.store)
    refused(
        Code.RESOURCE_EXHAUSTED,
        h.store.pin,
        s,
        [a.object_id, b.object_id],
        match="session 1 holds 1 pins and this call adds 2; the limit is 2",
    )
    check_invariants(h.store)
    assert snapshot(h.store) == before


def test_pin_up_to_the_session_limit_is_allowed():
    h = pin_limited(2)
    s = h.store.open_session()
    a = h.alloc(s, 1)
    h.store.pin(s, [a.object_id, a.object_id])
    check_invariants(h.store)
    assert h.store.sessions[s].pin_total == 2


def test_unpinning_makes_room_under_the_pin_limit():
    h = pin_limited(1)
    s = h.store.open_session()
    a, b = h.alloc(s, 1, pin=True), h.alloc(s, 1)
    refused(Code.RESOURCE_EXHAUSTED, h.store.pin, s, [b.object_id])
    h.store.unpin(s, [a.object_id])
    h.store.pin(s, [b.object_id])
    check_invariants(h.store)
    assert b.pins == {s: 1}


def test_other_sessions_pins_do_not_count_toward_a_sessions_limit():
    h = pin_limited(1)
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 1, pin=True)
    h.store.pin(s2, [a.object_id])
    check_invariants(h.store)
    assert a.pins == {s1: 1, s2: 1}


def test_allocate_with_pins_beyond_the_limit_is_refused_before_taking_pages():
    h = pin_limited(1)
    s = h.store.open_session()
    before = snapshot(h.store)
    refused(
        Code.RESOURCE_EXHAUSTED,
        h.store.allocate,
        s,
        [Spec(1, pin=True), Spec(1, pin=True)],
        match="max_pins_per_session",
    )
    assert snapshot(h.store) == before


def test_prepare_counts_prepare_time_pins_and_pins_on_commit_toward_the_limit():
    h = pin_limited(2)
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 1)
    before = snapshot(h.store)
    refused(
        Code.RESOURCE_EXHAUSTED,
        h.store.prepare,
        s2,
        [Spec(1, pin=True), Spec(1, pin=True)],
        pin_ids=[a.object_id],
        match="adds 3",
    )
    assert snapshot(h.store) == before


def test_lookup_with_pin_counts_only_the_keys_found_toward_the_limit():
    h = pin_limited(2)
    s = h.store.open_session()
    h.alloc(s, 1, KV, key=b"a")
    h.alloc(s, 1, KV, key=b"c")
    h.store.pin(s, [h.store.keys[b"c"].object_id])
    assert len(h.store.lookup(s, [b"a", b"b", b"c"], pin=True)) == 1
    check_invariants(h.store)
    before = snapshot(h.store)
    refused(
        Code.RESOURCE_EXHAUSTED, h.store.lookup, s, [b"a", b"c"], pin=True, match="holds 2 pins and this call adds 2"
    )
    assert snapshot(h.store) == before


def test_a_pin_limit_of_zero_means_no_limit():
    h = pin_limited(0)
    s = h.store.open_session()
    a = h.alloc(s, 1)
    h.store.pin(s, [a.object_id] * 100)
    check_invariants(h.store)
    assert a.pin_count == 100


def test_session_pin_total_follows_free_abort_and_unpin():
    h = pin_limited(10)
    s1, s2 = h.store.open_session(), h.store.open_session()
    a = h.alloc(s1, 1, pin=True)
    b = h.alloc(s2, 1)
    txn = h.store.prepare(s1, [], pin_ids=[b.object_id])
    h.store.pin(s1, [b.object_id])
    assert h.store.sessions[s1].pin_total == 3
    h.store.free(s1, [a.object_id])
    assert h.store.sessions[s1].pin_total == 2
    h.store.abort(s1, [txn.txn_id])
    assert h.store.sessions[s1].pin_total == 1
    h.store.unpin(s1, [b.object_id])
    check_invariants(h.store)
    assert h.store.sessions[s1].pin_total == 0


# ============================================================ pin contention


def test_pin_contention_counts_sessions_joining_an_already_pinned_object(h):
    s1, s2, s3 = (h.store.open_session() for _ in range(3))
    a = h.alloc(s1, 1, KV, key=b"a")
    h.store.pin(s1, [a.object_id])
    assert h.store.counters.pin_contention == 0  # first pin
    h.store.pin(s1, [a.object_id])
    assert h.store.counters.pin_contention == 0  # same session again
    h.store.lookup(s2, [b"a"], pin=True)
    h.store.pin(s3, [a.object_id])
    assert h.store.counters.pin_contention == 2


# ============================================================ settable watermarks


def test_set_watermarks_takes_effect_on_the_next_allocation():
    h = Harness(max_pages=20, pages_per_slab=4)  # watermarks off
    s = h.store.open_session()
    fill(h, s, *[(TEMP, 1)] * 17)
    h.store.set_watermarks(0.9, 0.5)
    h.alloc(s, 2, KV)
    st = h.store.stats()
    assert (st.high_watermark, st.low_watermark) == (0.9, 0.5)
    assert (st.eviction_runs, st.used_pages) == (1, 10)


@pytest.mark.parametrize("high, low", [(0.5, 0.8), (1.5, 0.5), (0.9, 0.0)])
def test_set_watermarks_rejects_bad_values_and_keeps_the_old_ones(high, low):
    h = Harness(high_watermark=0.9, low_watermark=0.8)
    with pytest.raises(ValueError, match="watermarks"):
        h.store.set_watermarks(high, low)
    st = h.store.stats()
    assert (st.high_watermark, st.low_watermark) == (0.9, 0.8)


def test_pins_promised_to_an_open_transaction_count_toward_the_limit_until_it_ends():
    h = pin_limited(2)
    s = h.store.open_session()
    a, b = h.alloc(s, 1), h.alloc(s, 1)
    txn = h.store.prepare(s, [Spec(1, pin=True)])
    h.store.pin(s, [a.object_id])
    # One pin held, one promised at commit: a third would break the limit at commit.
    refused(Code.RESOURCE_EXHAUSTED, h.store.pin, s, [b.object_id], match="1 promised to open transactions")
    h.store.commit(s, [txn.txn_id])
    check_invariants(h.store)
    assert h.store.sessions[s].pin_total == 2


def test_aborting_a_transaction_releases_its_promised_pins_from_the_limit():
    h = pin_limited(1)
    s = h.store.open_session()
    a = h.alloc(s, 1)
    txn = h.store.prepare(s, [Spec(1, pin=True)])
    refused(Code.RESOURCE_EXHAUSTED, h.store.pin, s, [a.object_id])
    h.store.abort(s, [txn.txn_id])
    h.store.pin(s, [a.object_id])
    check_invariants(h.store)
    assert a.pins == {s: 1}


def test_unpin_of_another_sessions_prepared_object_does_not_reveal_it(h):
    a, b = h.store.open_session(), h.store.open_session()
    t = h.store.prepare(a, [Spec(1)])
    before = snapshot(h.store)
    refused(Code.NOT_FOUND, h.store.unpin, b, [t.objects[0].object_id], match="no object")
    assert snapshot(h.store) == before


def test_watermarks_round_to_the_page_they_name():
    # 0.57 * 100 is 56.999... in floating point; the high watermark is page 57, not 56.
    h = Harness(max_pages=100, pages_per_slab=4, high_watermark=0.57, low_watermark=0.5)
    s = h.store.open_session()
    h.alloc(s, 57)
    assert h.store.counters.eviction_runs == 0 and not h.store.eviction_active


def test_a_non_integer_page_count_is_refused():
    h = Harness()
    s = h.store.open_session()
    refused(Code.INVALID_ARGUMENT, h.store.allocate, s, [Spec(1.5)], match="num_pages")


def _room(records: int, size: int) -> ReplyRoom:
    room = ReplyRoom()
    room.records, room.size = records, size
    return room


def test_a_clients_pin_or_lookup_past_its_reply_room_is_resource_exhausted_and_changes_nothing(h):
    """``reply`` (a client's request): ids and keys distinct, and the records within the room
    left of the reply, checked before anything is pinned (the fused lookup gives its pins back)."""
    s = h.store.open_session()
    objs = [h.alloc(s, 2, KV, key=b"r%02d" % i) for i in range(8)]
    keys, ids = [o.key for o in objs], [o.object_id for o in objs]
    before = snapshot(h.store)
    exact = 8 * REPLY_RECORD_BYTES + 5 * 16 + 8 * 3  # 8 records, 16 pages, 8 keys of 3 bytes
    for records, size in ((7, 1 << 20), (8, exact - 1)):
        for fn, args in (
            (h.store.pin, (s, ids)),
            (h.store.lookup, (s, keys, True)),
            (h.store.lookup, (s, keys, False)),
        ):
            room = _room(records, size)
            e = refused(Code.RESOURCE_EXHAUSTED, fn, *args, room, match="ask for fewer objects per call")
            assert "8 object records (16 pages" in e.message
            assert snapshot(h.store) == before and (room.records, room.size) == (records, size)
    refused(Code.INVALID_ARGUMENT, h.store.pin, s, [ids[0], ids[1], ids[0]], ReplyRoom(), match="object_ids[2] repeats")
    refused(Code.INVALID_ARGUMENT, h.store.lookup, s, [keys[0]] * 3, True, ReplyRoom(), match="keys[1] repeats")
    refused(Code.INVALID_ARGUMENT, h.store.lookup, s, [keys[0]] * 3, False, ReplyRoom(), match="keys[1] repeats")
    assert snapshot(h.store) == before
    room = _room(8, exact)  # exactly enough: taken from the room
    assert h.store.lookup(s, keys, True, room) == objs and (room.records, room.size) == (0, 0)
    room = ReplyRoom()  # one room across calls (a frame's ops): each takes its records
    h.store.lookup(s, keys[:3], False, room)
    h.store.pin(s, ids[:2], room)
    assert MAX_REPLY_RECORDS - room.records == 5
    assert MAX_REPLY_BYTES - room.size == 5 * REPLY_RECORD_BYTES + 5 * 10 + 5 * 3
    h.store.pin(s, [ids[0]] * 3)  # the broker's own pins (no reply) may name an id again
