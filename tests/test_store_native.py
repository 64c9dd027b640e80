"""The store's native core (``native/_storecore.c``) against its Python fallback.

Random runs of lookups, pins, unpins, frees, allocations that evict, and ended sessions go
through two stores, one with the native core and one with ``MEMORY_BROKER_NATIVE=0``: every
reply, refusal, pin book, eviction order and figure must be the same, and a step reply's
records the same bytes. The C functions are also fed inputs the store never gives them (wrong
types, objects of other shapes, lists that change) and must raise or decline, never crash;
and a long run must leave every reference count and the allocator where it started.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import random
import sys

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from store_invariants import check_invariants, check_queues_alike

from memory_broker.broker.store import eviction
from memory_broker.broker.store.eviction import ContentType, PlainLRU, PriorityLRU
from memory_broker.broker.store.objects import ObjectStore, Spec, StoreConfig
from memory_broker.broker.store.pool import PagePool, WindowSpace
from memory_broker.broker.store.records import Allocation, ObjectState, store_core
from memory_broker.proto.wire import native
from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.errors import BrokerError

KEYS = [b"k%02d" % i for i in range(24)] + [b"x" * 41]
MAX_PAGES = 40


@contextlib.contextmanager
def core(on: bool):
    """Parts of stores made inside take the native core (``on``) or the Python loops."""
    saved, env = native._loaded, os.environ.get(native.ENV)
    native._loaded = {}
    if on:
        os.environ.pop(native.ENV, None)
    else:
        os.environ[native.ENV] = "0"
    try:
        yield
    finally:
        native._loaded = saved
        if env is None:
            os.environ.pop(native.ENV, None)
        else:
            os.environ[native.ENV] = env


def make_store(on: bool, pin_limit: int = 0) -> ObjectStore:
    with core(on):
        pool = PagePool(MAX_PAGES, MAX_PAGES, MAX_PAGES, lambda slabs: None)
        config = StoreConfig(high_watermark=1.0, low_watermark=1.0, max_pins_per_session=pin_limit)
        store = ObjectStore(pool, WindowSpace(4 * MAX_PAGES), config=config)
    assert (store.table.core is not None) == on and (store.ledger._core is not None) == on
    assert (store.ledger.fused is not None) == on  # a lookup's pins and the usual unpin: one native call
    return store


def snapshot(store: ObjectStore) -> tuple:
    """Everything the per-key paths change, comparable across two stores."""
    objs = sorted(
        (o.object_id, o.owner, o.pin_count, sorted(o.pins.items()), o.freed, int(o.state), o.queue_seg is None)
        for o in store.objects.values()
    )
    sessions = sorted((sid, sorted(s.pins.items()), s.pin_total, sorted(s.owned)) for sid, s in store.sessions.items())
    t = store.tally
    return (
        objs,
        sessions,
        [o.object_id for o in store.policy],
        store.policy.evictable_pages,
        (t.pinned_pages, t.pinned_objects, t.prepared_pages),
        store.counters.pin_contention,
        sorted(store.keys),
        store.pool.used_pages,
    )


OPS = st.one_of(
    st.tuples(
        st.just("lookup"),
        st.integers(0, 2),
        st.lists(st.integers(0, len(KEYS)), max_size=10),
        st.booleans(),
    ),
    st.tuples(st.just("pin"), st.integers(0, 2), st.lists(st.integers(0, 40), max_size=8)),
    st.tuples(st.just("unpin"), st.integers(0, 2), st.lists(st.integers(0, 40), max_size=10), st.booleans()),
    st.tuples(st.just("alloc"), st.integers(0, 2), st.lists(st.integers(0, len(KEYS) - 1), max_size=4)),
    st.tuples(st.just("free"), st.integers(0, 2), st.lists(st.integers(0, 40), max_size=3)),
    st.tuples(st.just("end"), st.integers(0, 2)),
    st.tuples(st.just("select"), st.integers(1, 8)),
)


def apply(store: ObjectStore, sessions: list[int], op: tuple):
    """Run one op; its outcome as plain data (ids, or the refusal's code and message) and the
    reply records' bytes for a lookup or pin."""
    kind, i = op[0], op[1]
    sid = sessions[i] if kind != "select" else 0
    ids = sorted(store.objects)  # the same in both stores: ids are given out in order
    pick = (lambda n: ids[n % len(ids)] if ids and n < 36 else 10**6 + n) if kind != "lookup" else None
    try:
        if kind == "lookup":
            objs = store.lookup(sid, [KEYS[k] if k < len(KEYS) else b"missing" for k in op[2]], op[3])
            return [o.object_id for o in objs], w.encode_allocations(w.OP_LOOKUP, sid, objs)
        if kind == "pin":
            objs = store.pin(sid, [pick(n) for n in op[2]])
            return [o.object_id for o in objs], w.encode_allocations(w.OP_PIN, sid, objs)
        if kind == "unpin":
            held = sorted(store.sessions[sid].pins)
            if op[3] and held:  # what the session holds (the usual unpin), maybe with repeats
                wanted = [held[n % len(held)] for n in op[2]] or held
            else:
                wanted = [pick(n) for n in op[2]]
            store.unpin(sid, wanted)
            return wanted
        if kind == "alloc":
            got = store.allocate(
                sid, [Spec(1 + k % 3, key=KEYS[k], content_type=1 + k % 2) for k in dict.fromkeys(op[2])]
            )
            return [(o.object_id, dedup) for o, dedup in got]
        if kind == "free":
            return store.free(sid, [pick(n) for n in op[2]])
        if kind == "end":
            store.end_session(sid)
            sessions[i] = store.open_session()
            return sessions[i]
        return [o.object_id for o in store.policy.select(op[1], limit=3)]
    except BrokerError as e:
        return ("refused", e.code, e.message)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=1, max_size=40), st.sampled_from([0, 3, 9]))
def test_random_runs_give_the_same_replies_books_and_order_native_or_not(ops, pin_limit):
    # (with a pin limit too: a lookup's pins and its limit check are one native call)
    fast, slow = make_store(True, pin_limit), make_store(False, pin_limit)
    fs = [fast.open_session() for _ in range(3)]
    ss = [slow.open_session() for _ in range(3)]
    for st_ in (fast, slow):
        sid = fs[0] if st_ is fast else ss[0]
        st_.allocate(sid, [Spec(1 + i % 2, key=k, content_type=1 + i % 2) for i, k in enumerate(KEYS[:10])])
    assert fs == ss
    for op in ops:
        a, b = apply(fast, fs, op), apply(slow, ss, op)
        assert a == b, op
        assert snapshot(fast) == snapshot(slow), op
        check_invariants(fast)
        for o in fast.objects.values():  # eviction never takes a pinned object: it is still here
            assert o.pin_count == 0 or fast.objects.get(o.object_id) is o
    for sid in fs:  # a dead session's pins all go
        fast.end_session(sid)
    for sid in ss:
        slow.end_session(sid)
    assert snapshot(fast) == snapshot(slow)
    assert not any(o.pin_count for o in fast.objects.values())
    check_invariants(fast)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 6]), min_size=0, max_size=30))
def test_a_replys_sums_in_c_are_the_python_ones(picks):
    """``reply_size``: the pages and key bytes ``ReplyRoom.take`` estimates a reply from, as its
    Python sums; and a room refuses or takes alike with the core and without."""
    from memory_broker.broker.store.object_table import ReplyRoom

    c = store_core()
    store = make_store(True)
    s = store.open_session()
    objs = [o for o, _ in store.allocate(s, [Spec(1 + i % 3, key=KEYS[i] * (i + 1)) for i in range(6)])]
    objs.append(store.allocate(s, [Spec(2)])[0][0])  # no key
    chosen = [objs[p] for p in picks]
    want = (sum(o.num_pages for o in chosen), sum(len(o.key or b"") for o in chosen))
    assert c.reply_size(chosen) == want
    assert c.reply_size(tuple(chosen)) is None  # not a list: the Python sums
    rooms = [ReplyRoom(), ReplyRoom()]
    for room in rooms:
        room.size = 64 * len(chosen) + 5 * want[0] + want[1]  # exactly enough
    rooms[0].take(chosen, "lookup", c)
    rooms[1].take(chosen, "lookup")
    assert [(r.records, r.size) for r in rooms] == [(ReplyRoom().records - len(chosen), 0)] * 2


# ------------------------------------------------------------------ inputs the store never gives


class Odd:
    """An object of another shape: plain attributes, any values (the C reads them by getattr)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


JUNK = st.one_of(
    st.none(),
    st.integers(-(2**70), 2**70),
    st.binary(max_size=8),
    st.text(max_size=3),
    st.booleans(),
    st.floats(allow_nan=False),
)
VALUES = st.recursive(
    JUNK,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(JUNK.filter(lambda x: x is not None and not isinstance(x, float)), inner, max_size=3),
    ),
    max_leaves=8,
)
ODD = st.builds(
    lambda d: Odd(**d),
    st.dictionaries(
        st.sampled_from(
            [
                "object_id",
                "pins",
                "pin_count",
                "num_pages",
                "queue_seg",
                "content_type",
                "freed",
                "state",
                "key",
            ]
        ),
        VALUES,
    ),
)
ARG = st.one_of(
    VALUES,
    ODD,
    st.lists(st.one_of(ODD, VALUES), max_size=5),
    st.lists(
        st.dictionaries(
            JUNK.filter(lambda x: x is not None and not isinstance(x, float)), st.one_of(ODD, VALUES), max_size=3
        ),
        min_size=1,
        max_size=4,
    ),
)
ARITY = {
    "find_keys": 4,
    "pin_all": 3,
    "held_once": 3,
    "unpin_once": 3,
    "pinnable_all": 3,
    "remove_all": 2,
    "fill": 6,
    "pin_remove": 4,
    "lookup_pin": 8,
    "unpin_held": 4,
    "reply_size": 1,
}


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(sorted(ARITY)), st.lists(ARG, min_size=8, max_size=8))
def test_the_c_functions_raise_or_decline_on_any_input_and_never_crash(name, args):
    c = store_core()
    fn = getattr(c, name)
    try:
        fn(*args[: ARITY[name]])
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, IndexError):
        pass  # what the Python loops raise on such input
    with pytest.raises(TypeError):
        fn(*args[: ARITY[name] - 1])


def test_an_unset_slot_is_an_attribute_error_not_a_crash():
    c = store_core()
    bare = Allocation.__new__(Allocation)  # no field set
    with pytest.raises(AttributeError):
        c.pin_all([bare], 1, {})
    with pytest.raises(AttributeError):
        c.unpin_once([bare], 1, {})
    with pytest.raises(AttributeError):
        c.remove_all([bare], {})


def test_a_long_run_leaks_no_reference_and_no_memory():
    store = make_store(True)
    # Ids past the small ints CPython shares, so that a leaked reference to one shows.
    store._session_ids, store.table._ids = itertools.count(10**6), itertools.count(10**9)
    owner, s = store.open_session(), store.open_session()
    keys = [b"leak-%03d" % i for i in range(32)]
    objs = [o for o, _ in store.allocate(owner, [Spec(1, key=k, content_type=ContentType.KV_CACHE) for k in keys])]
    c = store_core()

    def cycle():
        found = store.lookup(s, keys, True)
        ids = [o.object_id for o in found]
        w.encode_allocations(w.OP_LOOKUP, s, found)
        store.pin(s, ids)
        store.unpin(s, ids)
        for bad in (ids + ids[:1], ids[:3] + [10**12], ids[:2] + [2**80]):
            with pytest.raises(BrokerError):
                store.unpin(s, bad)
        store.unpin(s, ids)
        store.lookup(s, keys[:5] + [b"nope"] + keys[5:], False)
        with pytest.raises(BrokerError):
            store.lookup(s, [b""], True)
        store.reconfigure(max_pins_per_session=3)  # lookup_pin finds more than the room: pins none
        with pytest.raises(BrokerError):
            store.lookup(s, keys, True)
        store.reconfigure(max_pins_per_session=0)
        assert c.held_once(store.objects.shards, ids, s) is None  # no pins left
        assert c.pinnable_all(store.objects.shards, ids + ["x"], ObjectState.COMMITTED) is None

    for _ in range(50):
        cycle()
    gc.collect()

    def refs():
        return [sys.getrefcount(x) for o in objs for x in (o, o.object_id, o.pins, o.wire_head)] + [
            sys.getrefcount(x) for x in (*keys, s, store.sessions[s].pins)
        ]

    before = refs()
    blocks = sys.getallocatedblocks()
    for _ in range(500):
        cycle()
    gc.collect()
    assert refs() == before
    assert sys.getallocatedblocks() - blocks < 200, "memory grew with each cycle"
    check_invariants(store)


class Cand:
    """An eviction candidate as the store's are: id, content type, size, the queue's slot."""

    __slots__ = ("object_id", "content_type", "num_pages", "queue_seg")

    def __init__(self, oid: int, ct: ContentType, pages: int = 1):
        self.object_id, self.content_type, self.num_pages, self.queue_seg = oid, ct, pages, None


@pytest.mark.parametrize("policy", [PriorityLRU, PlainLRU])
@pytest.mark.parametrize("seed", range(4))
def test_the_batch_queue_moves_are_add_remove_and_touch_in_order(policy, seed, monkeypatch):
    """``add_all``, ``remove_all`` and ``touch_all`` of the native core against the Python
    ``add``, ``remove`` and ``touch`` one object at a time: across segment ends (a small
    SEGMENT), mixed content types, objects in no queue and repeats."""
    monkeypatch.setattr(eviction, "SEGMENT", 5)
    rng = random.Random(seed)
    cts = [ContentType.KV_CACHE, ContentType.TEMP_BUFFER, ContentType.LORA_WEIGHT]
    objs_a = [Cand(i, rng.choice(cts), rng.randint(1, 4)) for i in range(50)]
    objs_b = [Cand(i, o.content_type, o.num_pages) for i, o in enumerate(objs_a)]
    with core(True):
        batch = policy()
    with core(False):
        single = policy()
    assert batch._core is not None and single._core is None
    for _ in range(60):
        pick = [rng.randrange(50) for _ in range(rng.randint(1, 20))]
        r = rng.random()
        if r < 0.4:
            batch.add_all([objs_a[i] for i in dict.fromkeys(pick)])
            for i in dict.fromkeys(pick):
                single.add(objs_b[i])
        elif r < 0.6:
            batch.remove_all([objs_a[i] for i in dict.fromkeys(pick)])
            for i in dict.fromkeys(pick):
                single.remove(objs_b[i])
        else:
            batch.touch_all([objs_a[i] for i in pick])
            for i in pick:
                single.touch(objs_b[i])
        check_queues_alike(batch, single)
        assert [len(q._segs) for q in batch._queues] == [len(q._segs) for q in single._queues]


def test_code_an_odd_object_runs_cannot_pull_the_batch_from_under_the_c_loop():
    c = store_core()
    ids = list(range(1, 300))

    class Evil:
        """Reading its fields empties the caller's list of ids."""

        freed = False

        @property
        def pins(self):
            ids.clear()
            return {1: 1}

        @property
        def state(self):
            ids.clear()
            return ObjectState.COMMITTED

    shards = [{i: Evil() for i in range(1, 300)}]
    assert len(c.held_once(shards, ids, 1)) == 299
    ids[:] = range(1, 300)
    assert len(c.pinnable_all(shards, ids, ObjectState.COMMITTED)) == 299
