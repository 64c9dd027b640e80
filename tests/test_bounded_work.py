"""Work that grows with what the broker holds runs in bounded batches (issue 13).

With a ``background`` host (the daemon's loop), ending a session that owns many objects and
evicting down to the low watermark happen ``work_batch`` objects at a time through
``ObjectStore.work()``; nothing is lost, the invariants hold after every batch, and other
sessions keep working in between. Without a host the store behaves as before (all inline).
"""

from __future__ import annotations

import random

import pytest
from store_invariants import check_invariants

from memory_broker.broker.store.objects import ObjectStore, Spec, StoreConfig
from memory_broker.broker.store.pool import PagePool, WindowSpace
from memory_broker.proto.wire.errors import BrokerError

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores


class Host:
    """Records the store's requests for background work; runs it when asked."""

    def __init__(self, store: ObjectStore, batch: int):
        self.store = store
        self.asked = 0
        store.background = self.ask
        store.work_batch = batch

    def ask(self) -> None:
        self.asked += 1

    def run(self, check: bool = True) -> int:
        """Call work() until done; returns the number of batches."""
        batches = 0
        while True:
            more = self.store.work()
            batches += 1
            if check:
                check_invariants(self.store)
            if not more:
                return batches


def make_store(max_pages: int, **config) -> ObjectStore:
    config.setdefault("high_watermark", 1.0)
    config.setdefault("low_watermark", 1.0)
    pool = PagePool(max_pages, max_pages, max_pages, lambda slabs: None)
    return ObjectStore(pool, WindowSpace(4 * max_pages), config=StoreConfig(**config))


def test_ending_a_large_session_is_released_in_batches_and_nothing_is_lost():
    store = make_store(4096)
    host = Host(store, batch=100)
    big, other = store.open_session(), store.open_session()
    objs = store.allocate(big, [Spec(1, contiguous=i % 3 == 0) for i in range(1000)])
    kept = store.allocate(big, [Spec(1, key=b"k%d" % i) for i in range(50)])
    store.pin(big, [o.object_id for o, _ in objs[:300]])
    shared = objs[0][0].object_id
    store.pin(other, [shared])
    check_invariants(store)

    store.end_session(big)
    # The session is gone at once; only one batch of its holdings went inline.
    assert big not in store.sessions and store.ending_sessions == 1
    assert host.asked == 1
    assert len(store.objects) > 900
    check_invariants(store)
    # Other sessions work between batches, including on objects the ended session held.
    store.allocate(other, [Spec(2)])
    store.unpin(other, [shared])
    batches = host.run()
    assert batches >= 10
    assert store.ending_sessions == 0
    # Anonymous objects are freed, keyed ones stay (ownerless) as when ending inline.
    assert {o.key for o in store.objects.values() if o.owner == 0} == {o.key for o, _ in kept}
    assert store.stats().used_pages == 50 + 2


def test_without_a_host_a_session_ends_inline_as_before():
    store = make_store(256)
    sid = store.open_session()
    store.allocate(sid, [Spec(1) for _ in range(200)])
    store.end_session(sid)
    assert store.ending_sessions == 0 and not store.objects
    check_invariants(store)


def test_crossing_the_high_watermark_evicts_one_batch_inline_and_drains_in_batches():
    store = make_store(2000, high_watermark=0.9, low_watermark=0.5)
    host = Host(store, batch=64)
    sid = store.open_session()
    for _ in range(17):
        store.allocate(sid, [Spec(1) for _ in range(100)])
    assert store.stats().used_pages == 1700 and not store.eviction_active
    before = store.counters.evicted_objects
    # This allocation crosses 1800 pages: it may evict only one batch inline.
    store.allocate(sid, [Spec(1) for _ in range(150)])
    assert store.eviction_active and host.asked >= 1
    assert store.counters.evicted_objects - before <= 64
    check_invariants(store)
    host.run()
    st = store.stats()
    assert st.used_pages <= 1000 and not st.eviction_active
    assert st.evicted_objects >= 850


def test_draining_stops_when_everything_left_is_pinned():
    store = make_store(1000, high_watermark=0.9, low_watermark=0.2)
    host = Host(store, batch=10)
    sid = store.open_session()
    objs = store.allocate(sid, [Spec(1) for _ in range(850)])
    store.pin(sid, [o.object_id for o, _ in objs[:800]])
    store.allocate(sid, [Spec(1) for _ in range(100)])
    host.run()
    st = store.stats()
    assert st.pinned_pages == 800 and st.evictable_pages == 0
    # Nothing else to evict: hysteresis stays on until pins go, as it did inline.
    assert st.eviction_active


def test_random_operations_interleaved_with_background_work_keep_every_invariant():
    rng = random.Random(7)
    store = make_store(600, high_watermark=0.8, low_watermark=0.5)
    host = Host(store, batch=7)
    sessions = [store.open_session() for _ in range(4)]
    for _ in range(600):
        sid = rng.choice(sessions)
        op = rng.random()
        try:
            if op < 0.5:
                store.allocate(
                    sid,
                    [
                        Spec(
                            rng.randint(1, 4),
                            contiguous=rng.random() < 0.3,
                            key=(b"%d" % rng.randint(0, 300)) if rng.random() < 0.3 else None,
                            pin=rng.random() < 0.2,
                        )
                        for _ in range(rng.randint(1, 20))
                    ],
                )
            elif op < 0.6:
                held = list(store.sessions[sid].pins)
                if held:
                    store.unpin(sid, [rng.choice(held)])
            elif op < 0.65:
                sessions.remove(sid)
                store.end_session(sid)
                sessions.append(store.open_session())
            elif op < 0.9:
                store.work()
        except Exception as e:  # refusals (exhausted) are fine; corruption is not
            assert type(e).__name__ == "BrokerError", e
        check_invariants(store)
    host.run()
    assert store.ending_sessions == 0


def test_lease_expiry_and_the_next_deadline_skip_transactions_that_ended_early():
    now = [100.0]
    pool = PagePool(512, 512, 512, lambda slabs: None)
    store = ObjectStore(
        pool, WindowSpace(2048), config=StoreConfig(high_watermark=1.0, low_watermark=1.0), clock=lambda: now[0]
    )
    sid = store.open_session()
    txns = [store.prepare(sid, [Spec(1)], lease_s=float(1 + i % 5)) for i in range(100)]
    # Transactions with the earliest deadlines end early: the next deadline is a live one.
    early = [t for t in txns if t.deadline == 101.0]
    store.commit(sid, [t.txn_id for t in early[:10]])
    store.abort(sid, [t.txn_id for t in early[10:]])
    assert store.next_deadline() == 102.0
    now[0] = 103.5
    expired = store.expire()
    want = sorted(t.txn_id for t in txns if t.deadline <= 103.5 and t not in early)
    assert expired == want and len(want) == 40
    assert store.next_deadline() == 104.0
    check_invariants(store)
    now[0] = 1000.0
    assert len(store.expire()) == 40 and store.next_deadline() is None and not store.open_txns
    check_invariants(store)


def test_transactions_that_end_early_behind_a_long_lease_leave_bounded_memory():
    """A session that prepares and aborts (or commits) over and over while one long lease
    stays open: the deadline heap keeps about the open transactions' entries, not one per
    transaction ever prepared, and a remembered aborted transaction keeps none of its
    objects (they are gone); expiry and a retried commit or abort still work."""
    from memory_broker.broker.store.txn_book import STALE_SLACK

    now = [100.0]
    pool = PagePool(64, 64, 64, lambda slabs: None)
    store = ObjectStore(
        pool, WindowSpace(256), config=StoreConfig(high_watermark=1.0, low_watermark=1.0), clock=lambda: now[0]
    )
    sid = store.open_session()
    long = store.prepare(sid, [Spec(1)], lease_s=600.0)
    book = store.txns
    ended = []
    for i in range(20 * STALE_SLACK):
        t = store.prepare(sid, [Spec(2)], lease_s=300.0)
        if i % 2:
            store.abort(sid, [t.txn_id])
            assert not t.objects and not t.pinned  # not kept alive while remembered
        else:
            (committed,) = store.commit(sid, [t.txn_id])
            store.free(sid, [o.object_id for o, _ in committed.result])
        ended.append(t.txn_id)
        assert len(book._deadlines) <= 2 * len(book.open) + STALE_SLACK + 1
    check_invariants(store)
    # Retries of the ended ones still answer as before.
    assert store.abort(sid, [ended[-1]]) == 0
    assert [t.txn_id for t in store.commit(sid, [ended[-2]])] == [ended[-2]]
    short = store.prepare(sid, [Spec(1)], lease_s=5.0)
    assert store.next_deadline() == 105.0
    now[0] = 106.0
    assert store.expire() == [short.txn_id] and store.next_deadline() == 700.0
    now[0] = 701.0
    assert store.expire() == [long.txn_id] and store.next_deadline() is None
    check_invariants(store)


def test_remembered_transactions_are_bounded_by_their_objects_too():
    """A committed transaction is remembered with its result (a retried commit returns it),
    so the book is bounded by transactions and objects together: committing and freeing
    large batches keeps about ``remember`` objects' worth, not ``remember`` batches."""
    pool = PagePool(4096, 4096, 4096, lambda slabs: None)
    store = ObjectStore(
        pool, WindowSpace(8192), config=StoreConfig(high_watermark=1.0, low_watermark=1.0, remember=1024)
    )
    sid = store.open_session()
    ids = []
    for _ in range(200):
        t = store.prepare(sid, [Spec(1) for _ in range(100)])
        (done,) = store.commit(sid, [t.txn_id])
        store.free(sid, [o.object_id for o, _ in done.result])
        ids.append(t.txn_id)
    kept = [tid for tid in ids if store.txns._finished.get(tid) is not None]
    remembered_objects = sum(len(store.txns._finished.get(tid).result) for tid in kept)
    # At most ``remember`` plus one entry per generation (8) of its own weight.
    assert remembered_objects <= 1024 + 8 * 101 and len(kept) >= 8, (len(kept), remembered_objects)
    # The newest still answer a retried commit; the forgotten ones say so.
    assert [t.txn_id for t in store.commit(sid, [ids[-1]])] == [ids[-1]]
    with pytest.raises(BrokerError, match="finished too long ago"):
        store.commit(sid, [ids[0]])
