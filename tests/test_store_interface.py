"""The object store's narrow interface (what the service, the server and the adapter wing may
call), its typed stats record, and the test-support invariant checker.

The store runs in-process with a fake clock and an arena that grows on demand.
"""

from __future__ import annotations

import dataclasses

import pytest
from store_invariants import check_invariants

from memory_broker.broker.store.objects import ObjectStore, Spec, StoreConfig, StoreLimits, StoreStats
from memory_broker.broker.store.pool import PagePool, WindowSpace
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.v1 import broker_pb2 as pb

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(max_pages: int = 16, **config) -> tuple[ObjectStore, Clock]:
    clock = Clock()
    pool = PagePool(max_pages, 4, 0, lambda slabs: None)
    config.setdefault("high_watermark", 1.0)
    config.setdefault("low_watermark", 1.0)
    return ObjectStore(pool, WindowSpace(4 * max_pages), config=StoreConfig(**config), clock=clock), clock


def test_stats_is_a_frozen_typed_record_with_usage_pairs():
    store, _ = make_store()
    s = store.open_session()
    store.allocate(s, [Spec(3, key=b"a"), Spec(2)])
    st = store.stats()
    assert isinstance(st, StoreStats)
    assert not hasattr(st, "__dict__")  # slots
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.used_pages = 0  # type: ignore[misc]
    ((ct, usage),) = st.by_content.items()
    objects, pages = usage
    assert (usage.objects, usage.pages) == (objects, pages) == (2, 5)
    assert (st.used_pages, st.keyed_objects, st.allocations_total) == (5, 1, 2)


def test_every_pool_figure_of_the_wire_stats_has_a_field_in_the_store_record():
    # The service fills pb.Stats field by field from StoreStats; the rest comes from the
    # arena (backend, page size, slabs), the adapter wing, the sessions (by owner), the
    # tier past one host (broker/store/tiering.py) and the engine pool (broker/store/engine_pool.py).
    from_elsewhere = {"backend", "page_size", "num_slabs", "adapters", "by_owner", "tier", "engines"}
    wire = {f.name for f in pb.Stats.DESCRIPTOR.fields} - from_elsewhere
    record = {f.name for f in dataclasses.fields(StoreStats)}
    assert wire - record == set()


def test_reading_stats_changes_nothing():
    store, _ = make_store()
    s = store.open_session()
    store.allocate(s, [Spec(2, pin=True), Spec(1)])
    assert store.stats() == store.stats()
    check_invariants(store)


def test_limits_are_a_read_only_record_of_the_config():
    store, _ = make_store(max_lease_s=60.0, default_lease_s=5.0, max_batch=7, max_pins_per_session=3)
    assert store.limits == StoreLimits(max_lease_s=60.0, max_batch=7, default_lease_s=5.0, max_pins_per_session=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        store.limits.max_batch = 8  # type: ignore[misc]
    assert store.max_pages == 16


def test_reconfigure_changes_the_default_lease_of_later_transactions():
    store, clock = make_store(default_lease_s=5.0)
    s = store.open_session()
    store.reconfigure(default_lease_s=20.0)
    assert store.limits.default_lease_s == 20.0
    t = store.prepare(s, [Spec(1)])
    assert t.deadline == clock.now + 20.0


def test_reconfigure_changes_the_pin_limit_of_a_running_store():
    store, _ = make_store()
    s = store.open_session()
    ((a, _), (b, _)) = store.allocate(s, [Spec(1), Spec(1)])
    store.reconfigure(max_pins_per_session=1)
    store.pin(s, [a.object_id])
    with pytest.raises(BrokerError) as info:
        store.pin(s, [b.object_id])
    assert info.value.code == Code.RESOURCE_EXHAUSTED and "the limit is 1" in str(info.value)
    store.reconfigure(max_pins_per_session=0)
    store.pin(s, [b.object_id])
    check_invariants(store)


@pytest.mark.parametrize("change", [{"default_lease_s": 0.0}, {"default_lease_s": 601.0}, {"max_pins_per_session": -1}])
def test_reconfigure_with_a_bad_value_changes_nothing(change):
    store, _ = make_store(default_lease_s=5.0, max_pins_per_session=4)
    before = (store.limits, dataclasses.replace(store.config))
    with pytest.raises(ValueError):
        store.reconfigure(**change)
    assert (store.limits, store.config) == before


def test_is_live_until_freed_or_evicted():
    store, _ = make_store(max_pages=4, high_watermark=1.0, low_watermark=1.0)
    s, other = store.open_session(), store.open_session()
    ((a, _), (b, _)) = store.allocate(s, [Spec(2), Spec(2)])
    assert store.get(a.object_id) is a and store.is_live(a) and store.is_live(b)
    # Freed while another session pins it: still in the table, no longer live.
    store.pin(other, [a.object_id])
    store.free(s, [a.object_id])
    assert store.get(a.object_id) is a and a.freed and not store.is_live(a)
    # Evicted to make room: gone.
    store.unpin(other, [a.object_id])
    store.allocate(s, [Spec(4)])
    assert store.get(b.object_id) is None and not store.is_live(b)
    check_invariants(store)


def test_has_session_follows_open_and_end():
    store, _ = make_store()
    s = store.open_session()
    assert store.has_session(s) and not store.has_session(s + 1)
    store.end_session(s)
    assert not store.has_session(s)


def test_an_internal_session_is_not_counted_and_has_no_pin_limit():
    store, _ = make_store(max_pins_per_session=1)
    client, internal = store.open_session(), store.open_session()
    store.mark_internal(internal)
    assert store.is_internal(internal) and not store.is_internal(client)
    assert store.stats().sessions == 1
    objs = [o for o, _ in store.allocate(internal, [Spec(1), Spec(1)])]
    store.pin(internal, [o.object_id for o in objs])
    with pytest.raises(BrokerError):
        store.pin(client, [o.object_id for o in objs])


def test_the_invariant_checker_notices_a_running_figure_that_drifted():
    store, _ = make_store()
    s = store.open_session()
    store.allocate(s, [Spec(2, pin=True)])
    check_invariants(store)
    store.tally.pinned_pages += 1
    with pytest.raises(AssertionError, match="prepared/pinned figures drifted"):
        check_invariants(store)
