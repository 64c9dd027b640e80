"""The adapter wing's native core (``native/_hotcore.c``) against its Python fallback.

A step's hot acquire and release (``AdapterPins.pin_hot`` / ``release_hot``), the tier
policies' batched record of uses and the acquire reply's kept rows each have a C pass and a
Python one. Random sequences of step acquires and releases, demotions, objects the store lost
without telling the manager, prefetches and ended sessions run through two identical brokers'
adapter wings, one on each: every reply (or refusal) and every book (pins per session and per
object, the store's pinned figures, counters, the policies' victim order) must be the same.
"""

from __future__ import annotations

import dataclasses

import pytest
from adapter_fixtures import AdapterHarness, peft_dirs, run  # noqa: F401  (peft_dirs is a fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memory_broker.broker.adapters import hotcore
from memory_broker.broker.adapters.config import AdapterConfig
from memory_broker.broker.doors import step_ops
from memory_broker.broker.doors.step_ops import StepOps
from memory_broker.broker.store.objects import StoreConfig
from memory_broker.proto.wire import native
from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.errors import BrokerError

IDS = ["r4", "r8", "r16"]
# What a step may name: the registered adapters, an unregistered id and a copy's key.
NAMES = [*IDS, "nope", "r4#float16"]
PIN_COUNTERS = {"acquires", "acquired_adapters", "deferred", "hot_hits", "hot_misses", "warm_hits", "warm_misses"}
PIN_COUNTERS |= {"demotions", "evictions", "loads_hot", "unregistered"}


def _wing(state_dir: str, peft_dirs: dict, fallback: bool, monkeypatch):
    """A store, adapter wing and step channel; on the Python path when ``fallback``."""
    with monkeypatch.context() as mp:
        if fallback:
            mp.setenv(native.ENV, "0")
            mp.setattr(native, "_loaded", {})
        store_config = StoreConfig(high_watermark=1.0, low_watermark=1.0, max_pins_per_session=12)
        h = AdapterHarness(
            state_dir, config=AdapterConfig(dtype="float32", convert_ahead=False), store_config=store_config
        )
        server = StepOps(loop=None, store=h.store, sessions=None, adapters=h.manager)
    assert (h.manager.pins._core is None) == fallback and (server._core is None) == fallback
    assert (h.manager.hot.policy._core is None) == fallback
    for aid in IDS:
        h.registry.register(aid, peft_dirs[aid])
    return h, server


def _books(h, sessions: list[int]) -> tuple:
    m, store = h.manager, h.store
    objs = {aid: (e.obj.object_id, dict(e.obj.pins), e.obj.pin_count) for aid, e in sorted(m.hot.own.items())}
    per_session = [
        (store.sessions[s].pin_total, dict(store.sessions[s].pins)) if store.has_session(s) else None for s in sessions
    ]
    tally = store.tally
    victims = (list(m.hot.policy.victims()), list(m.warm.policy.victims()))
    # The acquire and tier counters (load timings and image-cache figures depend on threads' timing).
    counts = {k: v for k, v in dataclasses.asdict(m.counters).items() if k in PIN_COUNTERS}
    return objs, per_session, tally.pinned_pages, tally.pinned_objects, counts, victims


OPS = st.one_of(
    st.tuples(
        st.just("acquire"),
        st.integers(0, 2),
        st.lists(st.sampled_from(NAMES), max_size=7),
        st.sampled_from([0, 0, 1, 2]),
    ),
    st.tuples(st.just("release"), st.integers(0, 2), st.lists(st.sampled_from(NAMES), max_size=7)),
    st.tuples(st.just("demote"), st.sampled_from(IDS)),
    st.tuples(st.just("lose"), st.sampled_from(IDS)),  # the store frees it; the manager is not told
    st.tuples(st.just("prefetch"), st.lists(st.sampled_from(IDS), min_size=1, max_size=3)),
    st.tuples(st.just("end"), st.integers(0, 2)),
)


async def _prefetch(m, ids) -> list:
    """Prefetch one adapter at a time: the loads' order (their generations and object ids) is then
    the same in both wings."""
    return [(await m.prefetch([aid], "hot")).loaded for aid in dict.fromkeys(ids)]


async def _apply(h, server, sessions: list[int], op) -> object:
    """Run ``op``; its reply bytes, or what it raised (code and message)."""
    m = h.manager
    try:
        if op[0] == "acquire":
            return server.op(sessions[op[1]], w.Op(w.OP_ACQUIRE, tuple(op[2]), 0, op[3]))
        if op[0] == "release":
            return server.op(sessions[op[1]], w.Op(w.OP_RELEASE, tuple(op[2])))
        if op[0] == "demote":
            return m.demote(op[1]).value
        if op[0] == "lose":
            e = m.hot.own.get(op[1])
            if e is not None:
                h.store.free(m.system_session, [e.obj.object_id])
            return None
        if op[0] == "prefetch":
            return await _prefetch(m, op[1])
        if op[0] == "end":
            if h.store.has_session(sessions[op[1]]):
                h.store.end_session(sessions[op[1]])
            return None
    except BrokerError as e:
        return (e.code, e.message)
    except step_ops._Load:  # the frame would wait for the manager's full acquire (a load)
        return "waits for a load"
    raise AssertionError(op)


def test_the_native_core_is_built_and_in_use():
    # As test_native.py: CI builds it, so the comparison below is never Python against Python.
    assert hotcore.load() is not None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=24), hot_first=st.lists(st.sampled_from(IDS), max_size=3))
def test_random_sequences_give_the_same_replies_and_books_native_and_python(
    peft_dirs, tmp_path_factory, monkeypatch, ops, hot_first
):
    async def main():
        wings = []
        for fallback in (False, True):
            h, server = _wing(str(tmp_path_factory.mktemp("wing")), peft_dirs, fallback, monkeypatch)
            if hot_first:
                await _prefetch(h.manager, hot_first)
            wings.append((h, server, [h.store.open_session() for _ in range(3)]))
        (ha, sa, sessions_a), (hb, sb, sessions_b) = wings
        assert sessions_a == sessions_b
        try:
            for i, op in enumerate(ops):
                got = await _apply(ha, sa, sessions_a, op), await _apply(hb, sb, sessions_b, op)
                assert got[0] == got[1], (i, op)
                assert _books(ha, sessions_a) == _books(hb, sessions_b), (i, op)
        finally:
            for h, _, _ in wings:
                await h.close()

    run(main())


def _core():
    core = hotcore.load()
    assert core is not None
    return core


class _Obj:
    def __init__(self, oid, pins=None, freed=False, state=2):
        self.object_id, self.pins, self.freed, self.state = oid, pins or {}, freed, state


class _Entry:
    def __init__(self, obj):
        self.obj = obj


def test_the_c_passes_refuse_bad_input_with_python_errors_and_answer_none_where_not_the_case():
    core = _core()
    shards = [{} for _ in range(4)]
    a, b = _Obj(5, {7: 2}), _Obj(6, {7: 1})
    shards[1][5], shards[2][6] = a, b
    own = {"a": _Entry(a), "b": _Entry(b), "none": _Entry(None)}
    assert core.pin_plan(own, ("a", "b", "a"), 0, shards, 2) == (["a", "b"], [a, b], True)
    assert core.pin_plan(own, ["a", "b"], 1, shards, 2) is None  # the cap defers one
    assert core.pin_plan(own, ["a", "x"], 0, shards, 2) is None
    assert core.pin_plan(own, ["none"], 0, shards, 2) is None
    a.freed = True
    assert core.pin_plan(own, ["b", "a"], 0, shards, 2) == (["b", "a"], [b, a], False)
    assert core.release_plan(own, ("a", "a", "b"), 7, shards) == ([a, b], [2, 1])
    assert core.release_plan(own, ("b",), 7, shards) == ([b], None)
    assert core.release_plan(own, ("b", "b"), 7, shards) is None  # holds one
    assert core.release_plan(own, ("a",), 8, shards) is None
    del shards[2][6]
    odd = _Obj(5)
    odd.pins = [1]
    assert core.release_plan(own, ("b",), 7, shards) is None  # not the store's any more
    for bad in (
        lambda: core.pin_plan(own, 5, 0, shards, 2),
        lambda: core.pin_plan(own, ["a"], 0, [{}, {}, {}], 2),  # not a power of two
        lambda: core.pin_plan(own, [["unhashable"]], 0, shards, 2),
        lambda: core.pin_plan({"a": _Entry(_Obj("x"))}, ["a"], 0, shards, 2),
        lambda: core.pin_plan({"a": object()}, ["a"], 0, shards, 2),
        lambda: core.release_plan({"a": _Entry(odd)}, ["a"], 7, [{5: odd}]),  # pins not a dict
        lambda: core.record_run(None, 0, [None, 0, 0], {}, {}),
        lambda: core.record_run(("a",), 0, [None, 0], {}, {}),  # not [run, uses, position]
        lambda: core.record_run(("a",), 0, [["a"], 1, 0], {}, {}),  # the last run is not a tuple
        lambda: core.join_rows(b"h", {5: "text"}, [a]),
        lambda: core.join_rows(b"h", {}, [object()]),
    ):
        with pytest.raises((TypeError, AttributeError)):
            bad()
    counts, order = {"a": 3}, {"a": 0}
    last = [None, 0, 0]
    assert core.record_run(("b", "a", "b"), 10, last, counts, order) == 13
    assert counts == {"a": 4, "b": 2} and order == {"a": 11, "b": 12} and list(order) == ["a", "b"]
    assert last == [("b", "a", "b"), 0, 10]
    for at in (20, 30):  # the same run again: counted with it
        assert core.record_run(tuple("bab"), at, last, counts, order) == at + 3
    assert counts == {"a": 4, "b": 2} and order == {"a": 11, "b": 12} and last == [("b", "a", "b"), 2, 30]
    assert core.record_run(("c",), 40, last, counts, order) == 41  # another: the last one's uses counted first
    assert counts == {"a": 6, "b": 6, "c": 1} and order == {"a": 31, "b": 32, "c": 40} and last == [("c",), 0, 40]
    assert core.join_rows(b"h", {5: b"1", 6: b"22"}, [b, a, b]) == b"h22122"
    assert core.join_rows(b"h", {5: b"1"}, [b]) is None


def test_slotted_classes_are_read_by_their_attributes_with_the_same_answers():
    @dataclasses.dataclass(slots=True, eq=False)
    class Entry:
        obj: object = None

    @dataclasses.dataclass(slots=True, eq=False)
    class Obj:
        object_id: int
        pins: dict
        freed: bool = False
        state: int = 2

    core = _core()
    shards = [{} for _ in range(4)]
    a, b = Obj(5, {7: 2}), Obj(6, {7: 1})
    shards[1][5], shards[2][6] = a, b
    own = {"a": Entry(a), "b": Entry(b), "none": Entry(None), "plain": _Entry(_Obj(9))}
    assert core.pin_plan(own, ("a", "b", "a"), 0, shards, 2) == (["a", "b"], [a, b], True)
    assert core.pin_plan(own, ["none"], 0, shards, 2) is None
    assert core.pin_plan(own, ["plain"], 0, shards, 2) == (["plain"], [own["plain"].obj], False)
    a.freed = True
    assert core.pin_plan(own, ["b", "a"], 0, shards, 2) == (["b", "a"], [b, a], False)
    assert core.release_plan(own, ("a", "a", "b"), 7, shards) == ([a, b], [2, 1])
    assert core.release_plan(own, ("b", "b"), 7, shards) is None
    assert core.join_rows(b"h", {5: b"1", 6: b"22"}, [b, a]) == b"h221"
    del b.pins  # an unset slot: what getattr raises
    with pytest.raises(AttributeError):
        core.release_plan(own, ("b",), 7, shards)


def test_the_c_passes_leak_no_reference_and_no_memory_over_a_long_run():
    import sys
    import tracemalloc

    core = _core()
    shards = [{} for _ in range(4)]
    a, b = _Obj(5, {7: 2}), _Obj(6, {7: 1})
    shards[1][5], shards[2][6] = a, b
    own = {"a": _Entry(a), "b": _Entry(b)}
    kept = {5: b"1", 6: b"22"}

    def once():
        core.pin_plan(own, ("a", "b", "a"), 0, shards, 2)
        core.pin_plan(own, ["a", "x"], 0, shards, 2)
        core.release_plan(own, ("a", "a", "b"), 7, shards)
        core.release_plan(own, ["b", "b"], 7, shards)
        core.record_run(("a", "b"), 0, [None, 0, 0], {}, {}, [None, 0, 0], {}, {})
        core.record_run(("a", "b"), 0, [("a", "b"), 1, 0], {"a": 1}, {}, [("b",), 2, 0], {}, {})
        core.join_rows(b"h", kept, [a, b])
        core.join_rows(b"h", {}, [a])
        for bad in (lambda: core.pin_plan(own, 5, 0, shards, 2), lambda: core.join_rows(b"h", {5: "x"}, [a])):
            try:
                bad()
            except TypeError:
                pass
            else:
                raise AssertionError("not refused")

    for _ in range(100):
        once()
    refs = [sys.getrefcount(x) for x in (a, b, own, shards, kept, *kept.values())]
    tracemalloc.start()
    for _ in range(1000):
        once()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(20000):
        once()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert [sys.getrefcount(x) for x in (a, b, own, shards, kept, *kept.values())] == refs
    # One object kept per run would be 560 KB or more.
    assert grown < 64 * 1024, f"{grown} bytes more after 20,000 runs"
