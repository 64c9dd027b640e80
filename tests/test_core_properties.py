"""Random operation sequences from a few sessions keep the core's invariants.

A hypothesis state machine drives one ObjectStore (fake grow, fake clock) with allocations,
two-phase transactions, lease expiry, frees, pins, lookups and sessions coming and going.
Any call may be refused; a refusal must leave the store exactly as it was. After every step
the pool's accounting is checked from scratch, independently of ``check_invariants``.
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from store_invariants import check_invariants

from memory_broker.broker.store.eviction import ContentType, PlainLRU, PriorityLRU
from memory_broker.broker.store.objects import (
    ObjectsEvicted,
    ObjectState,
    ObjectStore,
    Spec,
    StoreConfig,
    TransactionsExpired,
    TxnState,
)
from memory_broker.broker.store.pool import FREE, PagePool, WindowSpace
from memory_broker.proto.wire.errors import BrokerError, Code

MAX_PAGES = 24
PAGES_PER_SLAB = 4
MAX_BATCH = 5
MAX_KEY = 4
KEYS = [b"a", b"b", b"c", b"d", b"e"]
BAD_KEYS = [b"", b"toolong"]
MAX_SESSIONS = 4
# (high, low); (1.0, 1.0) turns watermark eviction off.
WATERMARKS = [(1.0, 1.0), (0.9, 0.6), (0.75, 0.5)]


def mostly(valid, invalid, one_in: int = 12):
    """``valid``, except about once in ``one_in`` draws ``invalid`` (malformed input)."""
    return st.integers(0, one_in - 1).flatmap(lambda i: invalid if i == one_in - 1 else valid)


sizes = mostly(st.integers(1, 8), st.sampled_from([0, -1, MAX_PAGES + 1]))
content_types = mostly(st.sampled_from(list(ContentType)), st.sampled_from([0, 9]))
keys = mostly(st.one_of(st.none(), st.sampled_from(KEYS)), st.sampled_from(BAD_KEYS))
specs = st.builds(
    Spec,
    num_pages=sizes,
    content_type=content_types,
    contiguous=st.booleans(),
    key=keys,
    pin=st.booleans(),
)
spec_lists = mostly(st.lists(specs, min_size=1, max_size=3), st.lists(specs, max_size=MAX_BATCH + 1), one_in=8)
leases = mostly(st.sampled_from([None, 0, 1.0, 3.0, 10.0]), st.sampled_from([-1.0, 1000.0, float("nan")]))


class Grow:
    def __init__(self) -> None:
        self.fail = False
        self.calls: list[int] = []

    def __call__(self, slabs: int) -> None:
        self.calls.append(slabs)
        if self.fail:
            raise MemoryError("backend out of memory")


def snapshot(store: ObjectStore) -> dict:
    # A refused allocation is counted; that counter is the one thing a refusal may change.
    stats = dataclasses.replace(store.stats(), allocation_failures=0)
    return {
        "stats": stats,
        "free_list": store.pool.free_page_list(),
        "page_table": list(store.pool.owner),
        "objects": {
            oid: (o.state, o.owner, o.key, list(o.pages), o.window_page, dict(o.pins), o.pin_count, o.freed)
            for oid, o in store.objects.items()
        },
        "keys": {k: o.object_id for k, o in store.keys.items()},
        "sessions": {sid: (set(s.owned), dict(s.pins), s.pin_total, set(s.txns)) for sid, s in store.sessions.items()},
        "pin_contention": store.counters.pin_contention,
        "open_txns": sorted(store.open_txns),
        "evictable": [o.object_id for o in store.policy],
        "window": store.window.extents(),
        "eviction_active": store.eviction_active,
    }


class CoreMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["priority0", "priority2", "priority8", "plain"]),
        placement=st.sampled_from(["best_fit", "first_fit"]),
        window_factor=st.sampled_from([1, 2, 4]),
        capacity_slabs=st.integers(0, MAX_PAGES // PAGES_PER_SLAB),
        watermarks=st.sampled_from(WATERMARKS),
        pin_limit=st.sampled_from([0, 0, 2]),
    )
    def setup(self, policy, placement, window_factor, capacity_slabs, watermarks, pin_limit):
        self.grow = Grow()
        self.events: list[tuple[int, object]] = []
        self.now = 100.0
        pool = PagePool(MAX_PAGES, PAGES_PER_SLAB, capacity_slabs * PAGES_PER_SLAB, self.grow)
        window = WindowSpace(MAX_PAGES * window_factor, placement)
        chosen = PlainLRU() if policy == "plain" else PriorityLRU(size_window=int(policy[len("priority") :]))
        high, low = watermarks
        self.watermarks_off = high == 1.0
        self.store = ObjectStore(
            pool,
            window,
            chosen,
            StoreConfig(
                high_watermark=high,
                low_watermark=low,
                default_lease_s=5.0,
                max_lease_s=20.0,
                max_key_bytes=MAX_KEY,
                max_batch=MAX_BATCH,
                max_pins_per_session=pin_limit,
            ),
            notify=lambda sid, ev: self.events.append((sid, ev)),
            clock=lambda: self.now,
        )
        self.live: list[int] = [self.store.open_session() for _ in range(3)]
        self.ended: list[int] = []
        self.object_ids: list[int] = []
        self.txn_ids: list[int] = []
        self.txn_session: dict[int, int] = {}

    # ------------------------------------------------------------ helpers

    def session(self, data) -> int:
        """Usually a live session; now and then one that ended or never existed."""
        others = st.sampled_from(self.ended[-2:] + [10_000])
        return data.draw(mostly(st.sampled_from(self.live), others) if self.live else others)

    def ids(self, data, likely: list[int], max_size: int = 3, unique: bool = False) -> list[int]:
        """Usually a few of ``likely``; now and then any known ids and an unknown one."""
        anything = st.lists(
            st.sampled_from(self.object_ids[-10:] + self.txn_ids[-5:] + [99_999]), max_size=MAX_BATCH + 1
        )
        usual = st.lists(st.sampled_from(likely), max_size=max_size, unique=unique) if likely else st.just([])
        return data.draw(mostly(usual, anything))

    def committed(self) -> list[int]:
        return [oid for oid, o in self.store.objects.items() if o.state == ObjectState.COMMITTED and not o.freed]

    def attempt(self, call):
        """Run a core call; a refusal must change nothing. Returns the result or None."""
        before = snapshot(self.store)
        events_before = len(self.events)
        failures_before = self.store.counters.allocation_failures
        try:
            result = call()
        except BrokerError as e:
            assert e.code in Code and e.code != Code.INTERNAL, e
            assert e.message
            if "expired before commit" in e.message:
                # Commit ran the expiry that was due; the lease's end, not the refusal, did that.
                assert all(t.deadline > self.now for t in self.store.open_txns.values())
                return None
            assert snapshot(self.store) == before, f"refused call changed the store: {e!r}"
            assert len(self.events) == events_before, f"refused call sent events: {e!r}"
            assert self.store.counters.allocation_failures - failures_before in (0, 1)
            return None
        assert self.store.counters.allocation_failures == failures_before
        return result

    def check_events_since(self, start: int, owned_before: dict[int, int]) -> None:
        for sid, ev in self.events[start:]:
            assert sid in self.store.sessions, f"event {ev} sent to closed session {sid}"
            if isinstance(ev, ObjectsEvicted):
                assert ev.object_ids and len(set(ev.object_ids)) == len(ev.object_ids)
                for oid in ev.object_ids:
                    assert oid not in self.store.objects, f"object {oid} reported evicted but still there"
                    assert owned_before.get(oid) == sid, f"object {oid} reported to {sid}, not its owner"
                assert len(ev.keys) <= len(ev.object_ids)
            elif isinstance(ev, TransactionsExpired):
                for tid in ev.transaction_ids:
                    assert tid not in self.store.open_txns
            else:  # pragma: no cover
                raise AssertionError(f"unexpected event {ev!r}")

    def owners(self) -> dict[int, int]:
        return {oid: o.owner for oid, o in self.store.objects.items()}

    def protected(self) -> set[int]:
        """Objects no allocation may evict: pinned or prepared."""
        return {oid for oid, o in self.store.objects.items() if o.pin_count or o.state == ObjectState.PREPARED}

    def room_without_eviction(self, batch, dedup_now: bool) -> bool:
        """Whether ``batch`` fits in free pages, so an allocation must evict nothing.

        ``allocate`` resolves existing keys at once (no pages); ``prepare`` reserves pages
        for every spec and deduplicates at commit.
        """
        pool = self.store.pool
        fresh = sum(sp.num_pages for sp in batch if not (dedup_now and sp.key in self.store.keys))
        free = pool.free_in_capacity if self.grow.fail else pool.free_pages
        return self.watermarks_off and fresh <= free

    def check_allocation_side_effects(self, protected: set[int], evicted_before: int, fits: bool) -> None:
        assert protected <= set(self.store.objects), "an allocation evicted a pinned or prepared object"
        if fits:
            assert self.store.counters.evicted_objects == evicted_before, "evicted although the batch fit"

    # ------------------------------------------------------------ rules

    @precondition(lambda self: len(self.live) < MAX_SESSIONS)
    @rule()
    def open_session(self):
        sid = self.store.open_session()
        assert sid not in self.live and sid not in self.ended
        self.live.append(sid)

    @precondition(lambda self: len(self.live) > 1)
    @rule(data=st.data())
    def end_session(self, data):
        sid = data.draw(st.sampled_from(self.live))
        owned = [o for o in self.store.objects.values() if o.owner == sid]
        keyed = [o for o in owned if o.key is not None and o.state == ObjectState.COMMITTED and not o.freed]
        anonymous = [o for o in owned if o.key is None]
        self.store.end_session(sid)
        self.live.remove(sid)
        self.ended.append(sid)
        assert sid not in self.store.sessions
        assert all(t.session != sid for t in self.store.open_txns.values())
        for o in self.store.objects.values():
            assert sid not in o.pins
            assert o.owner != sid
        for o in anonymous:
            # Gone, or kept only until another session's pin goes.
            if o.object_id in self.store.objects:
                assert o.freed and o.pin_count > 0, "anonymous object of an ended session kept"
        for o in keyed:
            assert self.store.keys.get(o.key) is o and o.owner == 0

    @rule(data=st.data(), batch=spec_lists)
    def allocate(self, data, batch):
        sid = self.session(data)
        start, owners, protected = len(self.events), self.owners(), self.protected()
        keys_before = dict(self.store.keys)
        evicted_before, fits = self.store.counters.evicted_objects, self.room_without_eviction(batch, True)
        out = self.attempt(lambda: self.store.allocate(sid, batch))
        if out is None:
            return
        self.check_events_since(start, owners)
        self.check_allocation_side_effects(protected, evicted_before, fits)
        assert len(out) == len(batch)
        for sp, (obj, dedup) in zip(batch, out):
            self.object_ids.append(obj.object_id)
            assert obj.state == ObjectState.COMMITTED
            if dedup:
                assert keys_before.get(sp.key) is obj
            else:
                assert obj.num_pages == sp.num_pages
                assert obj.content_type == sp.content_type
                assert obj.owner == sid
                assert (obj.window_page >= 0) == sp.contiguous
            if sp.key is not None:
                assert self.store.keys[sp.key] is obj
            if sp.pin:
                assert obj.pins.get(sid, 0) >= 1

    @rule(data=st.data(), batch=spec_lists, lease=leases)
    def prepare(self, data, batch, lease):
        sid = self.session(data)
        pin_ids = self.ids(data, self.committed(), max_size=2)
        start, owners, protected = len(self.events), self.owners(), self.protected() | set(pin_ids)
        evicted_before, fits = self.store.counters.evicted_objects, self.room_without_eviction(batch, False)
        txn = self.attempt(lambda: self.store.prepare(sid, batch, pin_ids, lease))
        if txn is None:
            return
        self.check_events_since(start, owners)
        self.check_allocation_side_effects(protected, evicted_before, fits)
        for oid in pin_ids:
            assert self.store.objects[oid].pins.get(sid, 0) >= pin_ids.count(oid)
        self.txn_ids.append(txn.txn_id)
        self.txn_session[txn.txn_id] = sid
        assert txn.state == TxnState.OPEN and txn.deadline > self.now
        assert [o.num_pages for o in txn.objects] == [sp.num_pages for sp in batch]
        for obj in txn.objects:
            self.object_ids.append(obj.object_id)
            assert obj.state == ObjectState.PREPARED and obj.txn_id == txn.txn_id and not obj.pins
            if obj.key is not None:
                assert self.store.keys.get(obj.key) is not obj, "a prepared key is visible"

    @rule(data=st.data())
    def commit(self, data):
        sid = self.session(data)
        ids = self.ids(data, [t for t in self.txn_ids if self.txn_session.get(t) == sid])
        start, owners = len(self.events), self.owners()
        was_open = set(ids) & set(self.store.open_txns)
        done = self.attempt(lambda: self.store.commit(sid, ids))
        if done is None:
            return
        self.check_events_since(start, owners)
        assert [t.txn_id for t in done] == ids
        for t in done:
            assert t.state == TxnState.COMMITTED and t.txn_id not in self.store.open_txns
            assert len(t.result) == len(t.objects)
            if t.txn_id not in was_open:
                continue  # an earlier commit's result, repeated
            for (obj, dedup), prepared, pin in zip(t.result, t.objects, t.pin_on_commit):
                assert obj.state == ObjectState.COMMITTED and self.store.objects.get(obj.object_id) is obj
                assert (obj is not prepared) == dedup
                if dedup:
                    assert prepared.object_id not in self.store.objects, "deduplicated pages kept"
                if obj.key is not None:
                    assert self.store.keys[obj.key] is obj
                if pin:
                    assert obj.pins.get(sid, 0) >= 1

    @rule(data=st.data())
    def abort(self, data):
        sid = self.session(data)
        ids = self.ids(data, [t for t in self.txn_ids if self.txn_session.get(t) == sid])
        free_before = self.store.pool.free_pages
        freed = self.attempt(lambda: self.store.abort(sid, ids))
        if freed is None:
            return
        # Aborting may also drop the last pin of an object freed earlier: at least this many.
        assert self.store.pool.free_pages >= free_before + freed
        for tid in ids:
            assert tid not in self.store.open_txns

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 8.0]), expire=st.booleans())
    def advance_clock(self, seconds, expire):
        self.now += seconds
        if expire:
            start = len(self.events)
            late = {t.txn_id for t in self.store.open_txns.values() if t.deadline <= self.now}
            expired = self.store.expire()
            assert set(expired) == late
            self.check_events_since(start, {})
            assert all(t.deadline > self.now for t in self.store.open_txns.values())

    @rule(data=st.data())
    def free(self, data):
        sid = self.session(data)
        mine = [oid for oid in self.committed() if self.store.objects[oid].owner == sid]
        ids = self.ids(data, mine, unique=True)
        out = self.attempt(lambda: self.store.free(sid, ids))
        if out is None:
            return
        for oid in ids:
            obj = self.store.objects.get(oid)
            assert obj is None or (obj.freed and obj.pin_count > 0)

    @rule(data=st.data())
    def pin(self, data):
        sid = self.session(data)
        ids = self.ids(data, self.committed())
        counts = {oid: self.store.objects[oid].pins.get(sid, 0) for oid in set(ids) if oid in self.store.objects}
        out = self.attempt(lambda: self.store.pin(sid, ids))
        if out is None:
            return
        for oid in set(ids):
            assert self.store.objects[oid].pins[sid] == counts[oid] + ids.count(oid)

    @rule(data=st.data())
    def unpin(self, data):
        sid = self.session(data)
        held = list(self.store.sessions[sid].pins) if sid in self.store.sessions else []
        ids = self.ids(data, held)
        self.attempt(lambda: self.store.unpin(sid, ids))

    @rule(
        data=st.data(),
        wanted=mostly(
            st.lists(st.sampled_from(KEYS), max_size=4),
            st.lists(st.sampled_from(KEYS + BAD_KEYS), max_size=MAX_BATCH + 1),
        ),
        pin=st.booleans(),
    )
    def lookup(self, data, wanted, pin):
        sid = self.session(data)
        prefix = []
        for k in wanted:
            if k not in self.store.keys:
                break
            prefix.append(self.store.keys[k])
        found = self.attempt(lambda: self.store.lookup(sid, wanted, pin))
        if found is None:
            return
        assert found == prefix

    @rule()
    def toggle_growth_failure(self):
        self.grow.fail = not self.grow.fail

    @rule(watermarks=st.sampled_from(WATERMARKS))
    def set_watermarks(self, watermarks):
        high, low = watermarks
        self.store.set_watermarks(high, low)
        self.watermarks_off = high == 1.0

    # ------------------------------------------------------------ invariants

    @invariant()
    def core_invariants_hold(self):
        if hasattr(self, "store"):
            check_invariants(self.store)

    @invariant()
    def every_page_is_in_exactly_one_state(self):
        if not hasattr(self, "store"):
            return
        pool = self.store.pool
        holders: dict[int, int] = {}
        for oid, obj in self.store.objects.items():
            assert obj.num_pages == len(obj.pages) > 0
            for p in obj.pages:
                assert p not in holders, f"page {p} in objects {holders[p]} and {oid}"
                holders[p] = oid
        free = pool.free_page_list()
        assert len(set(free)) == len(free), "a page is free twice"
        assert not set(free) & set(holders), "a page is both free and held"
        assert set(free) | set(holders) == set(range(pool.capacity_pages)), "a page is lost"
        for p in range(pool.capacity_pages):
            assert pool.owner[p] == holders.get(p, FREE)

    @invariant()
    def page_counts_add_up(self):
        if not hasattr(self, "store"):
            return
        pool, stats = self.store.pool, self.store.stats()
        assert pool.free_in_capacity + pool.used_pages == pool.capacity_pages
        assert stats.used_pages + stats.free_pages == MAX_PAGES
        assert stats.used_pages == sum(o.num_pages for o in self.store.objects.values())
        assert pool.capacity_pages <= MAX_PAGES and pool.capacity_pages % PAGES_PER_SLAB == 0
        evictable = sum(
            o.num_pages
            for o in self.store.objects.values()
            if o.state == ObjectState.COMMITTED and o.pin_count == 0 and not o.freed
        )
        assert stats.evictable_pages == evictable

    @invariant()
    def pins_are_positive_and_mirrored(self):
        if not hasattr(self, "store"):
            return
        for oid, obj in self.store.objects.items():
            assert obj.pin_count >= 0
            assert obj.pin_count == sum(obj.pins.values())
            for sid, c in obj.pins.items():
                assert c > 0
                assert self.store.sessions[sid].pins[oid] == c
            if obj.state == ObjectState.PREPARED:
                assert obj.pin_count == 0 and obj.owner in self.store.sessions
        limit = self.store.config.max_pins_per_session
        for sid, s in self.store.sessions.items():
            assert s.pin_total == sum(s.pins.values())
            promised = sum(sum(self.store.open_txns[t].pin_on_commit) for t in s.txns)
            assert not limit or s.pin_total + promised <= limit, f"session {sid} is past its pin limit"
            for oid, c in s.pins.items():
                assert c > 0 and self.store.objects[oid].pins[sid] == c

    @invariant()
    def only_live_sessions_own_objects_or_transactions(self):
        if not hasattr(self, "store"):
            return
        for obj in self.store.objects.values():
            assert obj.owner == 0 or obj.owner in self.store.sessions
        for t in self.store.open_txns.values():
            assert t.session in self.store.sessions and t.state == TxnState.OPEN


CoreMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_core_state_machine = CoreMachine.TestCase


def test_core_state_machine_on_the_python_fallback(monkeypatch):
    """The same machine with the store's native core off (``MEMORY_BROKER_NATIVE=0``): the
    ``TestCase`` above runs with it on, where it is built."""
    from memory_broker.proto.wire import native

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv(native.ENV, "0")
    run_state_machine_as_test(CoreMachine, settings=CoreMachine.TestCase.settings)
