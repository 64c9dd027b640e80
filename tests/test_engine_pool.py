"""EnginePool: engines' own KV groups in the store's one budget, in-process (no arena, no gRPC).

A grow takes pinned groups, evicting unpinned content first and never a pinned object; what the
store cannot give is asked back from engines above their floor (largest weighted excess first),
and a refusal changes nothing. An engine's end frees its groups.
"""

from __future__ import annotations

import pytest
from store_invariants import check_invariants

from memory_broker.broker.store.engine_pool import EngineKvReclaim, EngineLimits, EnginePool
from memory_broker.broker.store.eviction import ContentType
from memory_broker.broker.store.objects import ObjectsEvicted, ObjectStore, Spec, StoreConfig
from memory_broker.broker.store.pool import PagePool, WindowSpace
from memory_broker.proto.wire.errors import BrokerError, Code

KV, LORA = ContentType.KV_CACHE, ContentType.LORA_WEIGHT


class Rig:
    """A 64-page store (slabs of 8), its events, and an engine pool over it."""

    def __init__(self, max_pages: int = 64, limits: dict | None = None):
        self.events: list[tuple[int, object]] = []
        self.pool = PagePool(max_pages, 8, 0, lambda slabs: None)
        self.store = ObjectStore(
            self.pool,
            WindowSpace(4 * max_pages),
            config=StoreConfig(high_watermark=1.0, low_watermark=1.0),
            notify=lambda sid, ev: self.events.append((sid, ev)),
        )
        self.engines = EnginePool(self.store, limits, clock=lambda: 100.0)
        self.store.on_session_end = self.engines.session_ended
        self.changes = 0
        self.engines.on_change = self._changed

    def _changed(self) -> None:
        self.changes += 1

    def engine(self, name: str, group_pages: int = 4, **kw) -> int:
        sid = self.store.open_session()
        self.engines.register(sid, name, group_pages, **kw)
        return sid

    def reclaims(self, sid: int) -> list[EngineKvReclaim]:
        return [ev for s, ev in self.events if s == sid and isinstance(ev, EngineKvReclaim)]


def test_a_grow_takes_pinned_groups_owned_by_the_engine():
    r = Rig()
    a = r.engine("a", group_pages=4)
    groups = r.engines.grow(a, 3)
    assert [g.num_pages for g in groups] == [4, 4, 4]
    assert all(g.owner == a and g.pins == {a: 1} for g in groups)
    assert r.engines.engines[a].held_pages == 12
    assert r.store.policy.evictable_pages == 0  # never evicted from under the engine
    check_invariants(r.store)


def test_a_grow_evicts_unpinned_prefix_kv_first_and_never_a_held_adapter():
    r = Rig(max_pages=16)
    other = r.store.open_session()
    ((prefix, _),) = r.store.allocate(other, [Spec(6, KV, key=b"prefix")])
    ((adapter, _),) = r.store.allocate(other, [Spec(6, LORA, key=b"adapter", pin=True)])
    a = r.engine("a", group_pages=8)
    (g,) = r.engines.grow(a, 1)  # 4 free: 4 more from eviction
    assert r.store.get(prefix.object_id) is None  # the unpinned prefix went
    assert r.store.get(adapter.object_id) is adapter  # the held adapter stayed
    assert (other, ObjectsEvicted([prefix.object_id], [b"prefix"])) in r.events
    with pytest.raises(BrokerError) as e:  # 8 more pages would need the held adapter's
        r.engines.grow(a, 1)
    assert e.value.code == Code.RESOURCE_EXHAUSTED
    assert r.store.get(adapter.object_id) is adapter
    check_invariants(r.store)


def test_a_grow_past_the_ceiling_is_refused_and_changes_nothing():
    r = Rig()
    a = r.engine("a", group_pages=4, ceiling=8)
    r.engines.grow(a, 2)
    before = r.store.stats()
    with pytest.raises(BrokerError) as e:
        r.engines.grow(a, 1)
    assert e.value.code == Code.RESOURCE_EXHAUSTED and "ceiling" in e.value.message
    assert r.store.stats() == before
    assert r.engines.engines[a].refusals == 1


def test_configuration_bounds_what_an_engine_asks_for():
    r = Rig(limits={"llama": EngineLimits(floor=8, ceiling=16, weight=3.0)})
    a = r.engine("llama", floor=40, ceiling=60)
    e = r.engines.engines[a]
    assert (e.floor, e.ceiling, e.weight) == (8, 16, 3.0)
    b = r.engine("other", floor=4, ceiling=0, weight=0.5)
    e = r.engines.engines[b]
    assert (e.floor, e.ceiling, e.weight) == (4, 64, 0.5)


def test_floors_that_do_not_fit_the_pool_are_refused():
    r = Rig(max_pages=64)
    r.engine("a", floor=40)
    sid = r.store.open_session()
    with pytest.raises(BrokerError) as e:
        r.engines.register(sid, "b", 4, floor=32)
    assert e.value.code == Code.RESOURCE_EXHAUSTED and "floor" in e.value.message
    assert sid not in r.engines.engines


@pytest.mark.parametrize(
    "kw",
    [
        {"name": "", "group_pages": 4},
        {"name": "a", "group_pages": 0},
        {"name": "a", "group_pages": 65},
        {"name": "a", "group_pages": 4, "floor": -1},
        {"name": "a", "group_pages": 4, "weight": float("nan")},
        {"name": "a", "group_pages": 4, "floor": 9, "ceiling": 8},
        {"name": "bad\nname", "group_pages": 4},
    ],
)
def test_bad_registrations_are_invalid_and_change_nothing(kw):
    r = Rig()
    sid = r.store.open_session()
    with pytest.raises(BrokerError) as e:
        r.engines.register(sid, **kw)
    assert e.value.code == Code.INVALID_ARGUMENT
    assert not r.engines.engines


def test_a_grow_another_engine_could_cover_asks_it_back_by_weighted_excess():
    r = Rig(max_pages=64)
    a = r.engine("a", group_pages=4, floor=8, weight=1.0)
    b = r.engine("b", group_pages=4, floor=0, weight=4.0)
    c = r.engine("c", group_pages=4)
    r.engines.grow(a, 8)  # 32 pages, 24 above its floor: 24 per weight
    r.engines.grow(b, 8)  # 32 pages, 32 above its floor: 8 per weight
    assert r.engines.shortfall(c, 2) == 8
    with pytest.raises(BrokerError):
        r.engines.grow(c, 2)
    assert r.engines.ask_back(c, 8, 0.5) == 8
    assert r.reclaims(a) == [EngineKvReclaim(8, 100.5)]  # the largest excess per weight first
    assert r.reclaims(b) == []
    # A donor is never asked below its floor.
    assert r.engines.ask_back(c, 64, 0.5) == 24 + 32
    assert r.reclaims(a)[-1].pages == 24 and r.reclaims(b)[-1].pages == 32


def test_a_give_back_frees_the_groups_and_wakes_waiting_grows():
    r = Rig(max_pages=16)
    a = r.engine("a", group_pages=4)
    b = r.engine("b", group_pages=4)
    ga = r.engines.grow(a, 4)
    assert r.engines.shortfall(b, 1) == 4
    assert r.engines.give_back(a, [ga[0].object_id]) == 4
    assert r.changes == 1
    (gb,) = r.engines.grow(b, 1)
    assert gb.pages == ga[0].pages  # the pages a gave back
    e = r.engines.engines[a]
    assert (e.held_pages, e.give_backs, e.given_pages) == (12, 1, 4)
    check_invariants(r.store)


def test_a_give_back_of_what_is_not_the_engines_group_changes_nothing():
    r = Rig()
    a = r.engine("a")
    b = r.engine("b")
    ga = r.engines.grow(a, 2)
    gb = r.engines.grow(b, 1)
    before = r.store.stats()
    for ids in ([gb[0].object_id], [ga[0].object_id, 999], [ga[0].object_id, ga[0].object_id]):
        with pytest.raises(BrokerError) as e:
            r.engines.give_back(a, ids)
        assert e.value.code in (Code.NOT_FOUND, Code.INVALID_ARGUMENT)
    assert r.store.stats() == before and r.engines.engines[a].held_pages == 8


def test_an_engines_end_frees_its_groups_and_wakes_waiting_grows():
    r = Rig(max_pages=16)
    a = r.engine("a", group_pages=4)
    b = r.engine("b", group_pages=4)
    r.engines.grow(a, 4)
    r.store.end_session(a)
    assert a not in r.engines.engines and r.changes == 1
    assert r.pool.used_pages == 0
    assert len(r.engines.grow(b, 4)) == 4
    check_invariants(r.store)


def test_a_grow_keeps_the_floor_another_engine_has_not_taken_yet():
    r = Rig(max_pages=32)
    a = r.engine("a", group_pages=4, floor=16)
    b = r.engine("b", group_pages=4)
    r.engines.grow(b, 4)
    with pytest.raises(BrokerError) as e:  # 16 free, all of them a's floor
        r.engines.grow(b, 1)
    assert "short" in e.value.message
    assert len(r.engines.grow(a, 4)) == 4  # a's floor is there for it


def test_a_grow_of_an_unregistered_session_is_refused():
    r = Rig()
    sid = r.store.open_session()
    with pytest.raises(BrokerError) as e:
        r.engines.grow(sid, 1)
    assert e.value.code == Code.FAILED_PRECONDITION


def test_stats_report_each_engine():
    r = Rig()
    a = r.engine("a", group_pages=4, floor=4, ceiling=32, weight=2.0)
    objs = r.engines.grow(a, 2)
    r.engines.granted(a, objs, 0.002)
    r.engines.give_back(a, [objs[0].object_id])
    (s,) = r.engines.stats()
    assert (s.name, s.floor, s.ceiling, s.weight, s.held_pages) == ("a", 4, 32, 2.0, 4)
    assert (s.grows, s.grown_pages, s.give_backs, s.given_pages, s.grow_seconds_max) == (1, 8, 1, 4, 0.002)


def test_a_group_freed_with_a_plain_free_leaves_the_figures_true():
    r = Rig()
    a = r.engine("a", group_pages=4)
    g = r.engines.grow(a, 2)
    r.store.free(a, [g[0].object_id])
    (s,) = r.engines.stats()
    assert s.held_pages == 4
    assert r.engines.shortfall(a, 15) == 0  # 60 of 64 pages: the freed group's pages count as free
