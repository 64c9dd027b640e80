"""The adapter wing's parts: the entry state machine's table, readers that change nothing,
the deprecated AdapterConfig names, the tier policies' ``forget``, and the store's narrow
interface the wing uses."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from adapter_fixtures import AdapterHarness, peft_dirs, run  # noqa: F401  (peft_dirs is a fixture)

from memory_broker.broker.adapters import config as config_mod
from memory_broker.broker.adapters.config import AdapterConfig
from memory_broker.broker.adapters.entry import (
    TRANSITIONS,
    AdapterEntry,
    EntryEvent,
    EntryState,
    EntryTable,
    InvalidTransition,
)
from memory_broker.broker.adapters.policy import POLICIES
from memory_broker.broker.adapters.records import Tier
from memory_broker.broker.store.objects import ObjectStore, Spec, StoreConfig
from memory_broker.broker.store.pool import PagePool, WindowSpace

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

# ----------------------------------------------------------------- state machine


class _Obj:
    """Stands in for a hot Allocation (the state machine only asks whether there is one)."""

    object_id = 7
    num_pages = 1


def _entry_in(state: EntryState) -> AdapterEntry:
    """An entry whose facts put it in ``state``, built without a loop (futures are markers)."""
    e = AdapterEntry(SimpleNamespace(adapter_id="a"), layout=None)
    marker = object()
    if state is EntryState.WARMING:
        e.warming = marker
    elif state is EntryState.WARM:
        e.warm = SimpleNamespace(nbytes=1)
    elif state is EntryState.LOADING:
        e.loading = marker
    elif state is EntryState.HOT:
        e.obj = _Obj()
    elif state is EntryState.REMOVED:
        e.removed = True
    assert e.state is state
    return e


def _fire(e: AdapterEntry, event: EntryEvent) -> None:
    marker = object()
    {
        EntryEvent.WARM_START: lambda: e.start_warming(lambda: marker),
        EntryEvent.WARM_DONE: lambda: e.warmed(SimpleNamespace(nbytes=1)),
        EntryEvent.WARM_FAILED: e.warming_failed,
        EntryEvent.LOAD_START: lambda: e.start_loading(lambda: marker),
        EntryEvent.LOAD_DONE: lambda: e.loaded(_Obj(), "sha256:x", 1),
        EntryEvent.LOAD_FAILED: e.loading_failed,
        EntryEvent.HOT_DROPPED: e.drop_hot,
        EntryEvent.WARM_DROPPED: e.drop_warm,
        EntryEvent.REMOVE: e.remove,
    }[event]()


def _facts(e: AdapterEntry) -> tuple:
    return (e.warm, e.obj, e.loading, e.warming, e.removed, e.generation, e.hot_checksum)


def test_the_table_has_one_transition_per_event_and_every_event():
    assert sorted(t.event for t in TRANSITIONS) == sorted(EntryEvent)


@pytest.mark.parametrize("event", list(EntryEvent), ids=lambda ev: ev.value)
def test_an_event_from_a_state_the_table_does_not_list_raises_and_changes_nothing(event):
    (t,) = [t for t in TRANSITIONS if t.event is event]
    illegal = [s for s in EntryState if s not in t.from_states]
    assert illegal, f"{event.value} is allowed from every state"
    for state in illegal:
        e = _entry_in(state)
        before = _facts(e)
        with pytest.raises(InvalidTransition, match=event.value):
            _fire(e, event)
        assert _facts(e) == before and e.state is state


def test_illegal_transitions_named_in_the_issue_raise():
    # A hot adapter cannot start loading again, a cold one cannot finish a load, an adapter
    # in use cannot be unregistered from under its hot object, nothing warms twice.
    for state, event in [
        (EntryState.HOT, EntryEvent.LOAD_START),
        (EntryState.COLD, EntryEvent.LOAD_DONE),
        (EntryState.HOT, EntryEvent.REMOVE),
        (EntryState.WARMING, EntryEvent.WARM_START),
        (EntryState.WARM, EntryEvent.HOT_DROPPED),
        (EntryState.REMOVED, EntryEvent.LOAD_START),
    ]:
        with pytest.raises(InvalidTransition):
            _fire(_entry_in(state), event)


def test_state_is_derived_from_facts_through_a_whole_life():
    e = _entry_in(EntryState.COLD)
    seen = [e.state]
    for event in (
        EntryEvent.WARM_START,
        EntryEvent.WARM_DONE,
        EntryEvent.LOAD_START,
        EntryEvent.LOAD_DONE,
        EntryEvent.HOT_DROPPED,
        EntryEvent.WARM_DROPPED,
        EntryEvent.REMOVE,
    ):
        _fire(e, event)
        seen.append(e.state)
    S = EntryState
    assert seen == [S.COLD, S.WARMING, S.WARM, S.LOADING, S.HOT, S.WARM, S.COLD, S.REMOVED]


def test_a_legal_event_lands_in_a_state_the_table_lists():
    for t in TRANSITIONS:
        for state in t.from_states:
            e = _entry_in(state)
            try:
                _fire(e, t.event)
            except InvalidTransition as err:
                # Some events also need a fact the source state does not imply (a warm
                # load in flight to finish); those refuse with a reason, changing nothing.
                assert "with no" in str(err) or "with a warm image" in str(err), err
                continue
            assert e.state in t.to_states, (state, t.event, e.state)


def test_the_table_forgets_an_entry_only_when_it_is_cold_and_unheld():
    table = EntryTable(lambda aid: AdapterEntry(SimpleNamespace(adapter_id=aid), layout=None))
    e = table.entry("a")
    e.holds = 1
    table.forget_if_idle(e)
    assert "a" in table
    e.holds = 0
    e.warm = SimpleNamespace(nbytes=1)
    table.forget_if_idle(e)
    assert "a" in table
    e.drop_warm()
    table.forget_if_idle(e)
    assert "a" not in table


# ------------------------------------------------------------------ pure readers


@pytest.fixture
def state_dir(tmp_path) -> str:
    return str(tmp_path / "state")


def test_describe_and_stats_change_nothing_when_an_eviction_went_unreported(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        h.registry.register("r4", peft_dirs["r4"])
        h.registry.register("r8", peft_dirs["r8"])
        s = h.store.open_session()
        (a,) = (await h.manager.acquire(s, ["r4"])).adapters
        h.manager.release(s, ["r4"])
        # The object goes without the manager being told (as an unreported eviction would).
        h.store.free(h.manager.system_session, [a.object_id])
        evictions = h.manager.counters.evictions
        for _ in range(2):
            st = h.manager.describe("r4")
            assert (st.tier, st.object_id, st.pages) == (Tier.WARM, 0, ())
            snap = h.manager.stats()
            assert snap.resident.hot == 0 and snap.hot_pages == 0 and snap.resident.warm == 1
        assert h.manager.describe("r8").tier == Tier.COLD
        # Nothing was dropped or counted by the readers: the entry still names its old object,
        # and a cold adapter described got no entry.
        assert "r4" in h.manager.hot and h.manager.entries.get("r4").obj is not None
        assert "r8" not in h.manager.entries and h.manager.counters.evictions == evictions
        # The next writer notices, counts the eviction once and reloads.
        (again,) = (await h.manager.acquire(s, ["r4"])).adapters
        assert again.found_in == Tier.WARM and again.generation > a.generation
        assert h.manager.counters.evictions == evictions + 1
        h.manager.release(s, ["r4"])
        await h.close()

    run(main())


def test_stats_is_a_typed_record_with_a_dict_view(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        h.registry.register("r4", peft_dirs["r4"])
        s = h.store.open_session()
        await h.manager.acquire(s, ["r4"])
        st = h.manager.stats()
        assert (st.loads.hot, st.loads.warm, st.resident.hot, st.hot_pinned_adapters) == (1, 1, 1, 1)
        assert st.as_dict()["loads"] == {"hot": 1, "warm": 1} and st.policies.hot == "lru"
        h.manager.release(s, ["r4"])
        await h.close()

    run(main())


# ------------------------------------------------------------- config and policies


def test_old_adapter_config_names_are_deprecated_aliases_that_log_once(caplog, monkeypatch):
    monkeypatch.setattr(config_mod, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=config_mod.__name__):
        a = AdapterConfig(hot_budget_adapters=3, warm_budget_bytes=5, image_budget_bytes=7, hot_budget_pages=9)
        b = AdapterConfig(hot_budget_adapters=4)
        assert a.hot_budget_adapters == 3  # reading through the old name works too
    assert (a.hot_tier_adapters, a.warm_tier_bytes, a.image_budget, a.hot_tier_pages) == (3, 5, 7, 9)
    assert b.hot_tier_adapters == 4
    logged = [r.getMessage() for r in caplog.records]
    assert len([m for m in logged if "hot_budget_adapters" in m]) == 1, logged
    assert any("adapters.hot_tier_adapters (--hot-tier-adapters)" in m for m in logged)
    with pytest.raises(TypeError, match="give only hot_tier_adapters"):
        AdapterConfig(hot_budget_adapters=1, hot_tier_adapters=2)


def test_a_negative_budget_names_the_setting_an_operator_can_type():
    with pytest.raises(ValueError, match=r"adapters\.hot_tier_adapters \(--hot-tier-adapters\)"):
        AdapterConfig(hot_tier_adapters=-1).validate()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_tier_policy_forgets_what_it_knew(name):
    p = POLICIES[name]()
    p.insert("a", 4)
    p.access("a")
    p.forget("a")
    assert "a" not in p and len(p) == 0 and list(p.victims()) == []


# ------------------------------------------------------ the store's narrow interface


def test_the_store_interface_the_wing_uses():
    store = ObjectStore(
        PagePool(64, 16, 64, grow=lambda n: None), WindowSpace(128), config=StoreConfig(max_lease_s=60.0)
    )
    s = store.open_session()
    [(obj, _)] = store.allocate(s, [Spec(2)])
    assert store.has_session(s) and not store.has_session(s + 100)
    assert store.get(obj.object_id) is obj and store.is_live(obj) and store.max_pages == 64
    store.free(s, [obj.object_id])
    assert not store.is_live(obj) and store.get(obj.object_id) is None
    assert store.limits.max_lease_s == 60.0
    store.reconfigure(default_lease_s=10.0, max_pins_per_session=5)
    assert (store.limits.default_lease_s, store.limits.max_pins_per_session) == (10.0, 5)
    with pytest.raises(ValueError, match="at most max_lease_s"):
        store.reconfigure(default_lease_s=120.0, max_pins_per_session=9)
    assert (store.limits.default_lease_s, store.limits.max_pins_per_session) == (10.0, 5)


def test_this_module_runs_on_the_native_core_and_on_its_fallback(request, native_core):
    """conftest parametrizes the modules marked ``both_cores`` with ``native_core``: each test
    here runs on the C core and on its fallback (a second ``pytest_generate_tests`` in
    conftest once replaced the hook that does it, and the fallback runs silently stopped)."""
    from memory_broker.broker.adapters import hotcore

    params = getattr(getattr(request.node, "callspec", None), "params", {})
    assert params.get("native_core") == native_core
    if native_core == "fallback":
        assert hotcore.load() is None
