"""A step's KV keys on the broker in batches (issue 28): the same outcome as item by item.

The store pins a lookup's objects and unpins a step's ids in one loop each, and moves the
objects whose pin count crosses zero out of or into the eviction queues in one batch; the
queues find an object's entry through its ``queue_seg`` slot; a reply's object records are
built from parts cached on the object; a lookup's keys of one length are decoded in one
``struct`` call. Each is checked here against the item-by-item path it replaces.
"""

from __future__ import annotations

import random

import pytest
from store_invariants import check_invariants, check_queues_alike

from memory_broker.broker.store import eviction
from memory_broker.broker.store.eviction import ContentType, ObjectQueue, PlainLRU, PriorityLRU
from memory_broker.broker.store.objects import ObjectStore, Spec, StoreConfig
from memory_broker.broker.store.pool import PagePool, WindowSpace
from memory_broker.broker.store.records import Allocation, ObjectState
from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.errors import BrokerError

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores


def make_store(max_pages: int = 256) -> ObjectStore:
    pool = PagePool(max_pages, max_pages, max_pages, lambda slabs: None)
    config = StoreConfig(high_watermark=1.0, low_watermark=1.0)
    return ObjectStore(pool, WindowSpace(4 * max_pages), config=config)


def item_by_item(store: ObjectStore) -> ObjectStore:
    """``store`` made to take the item-by-item paths (the batch forms hidden)."""
    store.ledger._add_all = store.ledger._remove_all = None
    store.table.held_once = lambda session, ids: None
    return store


def order(store: ObjectStore) -> list[int]:
    return [o.object_id for o in store.policy]


def random_steps(store: ObjectStore, seed: int) -> list:
    """A random run of lookups (pinned or not, with repeats and misses), pins and unpins
    (with repeats, foreign and unknown ids), frees and evictions by three sessions; what
    each call gave or refused, the eviction order and figures after each."""
    rng = random.Random(seed)
    owner, a, b = store.open_session(), store.open_session(), store.open_session()
    keys = [b"k%03d" % i for i in range(60)]
    store.allocate(owner, [Spec(1 + i % 3, key=k, content_type=1 + i % 2) for i, k in enumerate(keys)])
    held: dict[int, list[int]] = {a: [], b: []}
    log: list = []
    for _ in range(400):
        sid = rng.choice((a, b))
        r = rng.random()
        try:
            if r < 0.35:
                ks = [rng.choice(keys + [b"missing"]) for _ in range(rng.randint(1, 12))]
                pin = rng.random() < 0.8
                got = [o.object_id for o in store.lookup(sid, ks, pin)]
                if pin:
                    held[sid] += got
                log.append(("lookup", got))
            elif r < 0.65 and held[sid]:
                rng.shuffle(held[sid])
                n = rng.randint(1, len(held[sid]))
                ids, held[sid] = held[sid][:n], held[sid][n:]
                if rng.random() < 0.1:
                    ids.append(rng.choice([999999, ids[0]]))  # unknown, or one pin too many
                store.unpin(sid, ids)
                log.append(("unpin", ids))
            elif r < 0.8:
                ids = [o.object_id for o in store.objects.values()]
                ids = [rng.choice(ids) for _ in range(rng.randint(1, 6))]
                store.pin(sid, ids)
                held[sid] += ids
                log.append(("pin", ids))
            elif r < 0.9:
                other = a if sid == b else b
                if held[other]:
                    store.unpin(sid, [held[other][0]])  # another session's pin: refused
            else:
                victims = store.policy.select(4, limit=2)
                log.append(("select", [o.object_id for o in victims]))
        except BrokerError as e:
            log.append(("refused", e.code, e.message))
        check_invariants(store)
        log.append((order(store), store.policy.evictable_pages, store.tally.pinned_pages))
    return log


@pytest.mark.parametrize("seed", range(6))
def test_batch_pins_and_unpins_match_item_by_item(seed):
    """The same calls give the same objects, refusals, pins, eviction order and figures
    whether a step's keys go through the batch forms or one at a time."""
    assert random_steps(make_store(), seed) == random_steps(item_by_item(make_store()), seed)


def test_a_refused_unpin_batch_changes_nothing():
    store = make_store()
    owner, s = store.open_session(), store.open_session()
    store.allocate(owner, [Spec(1, key=b"k%d" % i) for i in range(4)])
    objs = store.lookup(s, [b"k0", b"k1", b"k2"], True)
    before = (order(store), dict(store.sessions[s].pins), [dict(o.pins) for o in objs])
    for ids in ([objs[0].object_id, objs[1].object_id, 424242], [objs[0].object_id, objs[0].object_id]):
        with pytest.raises(BrokerError):
            store.unpin(s, ids)
        assert (order(store), dict(store.sessions[s].pins), [dict(o.pins) for o in objs]) == before
    check_invariants(store)


def test_an_unpinned_object_is_the_newest_candidate_and_a_pinned_one_is_none():
    store = make_store()
    owner, s = store.open_session(), store.open_session()
    objs = [o for o, _ in store.allocate(owner, [Spec(1, key=b"k%d" % i) for i in range(5)])]
    ids = [o.object_id for o in objs]
    assert order(store) == ids
    store.lookup(s, [b"k1", b"k3"], True)
    assert order(store) == [ids[0], ids[2], ids[4]]
    assert objs[1].queue_seg is None and objs[0].queue_seg is not None
    store.unpin(s, [ids[3], ids[1]])
    assert order(store) == [ids[0], ids[2], ids[4], ids[3], ids[1]]


class Obj:
    """A candidate as the store's are: id, content type, size, and the queue's slot."""

    __slots__ = ("object_id", "content_type", "num_pages", "queue_seg")

    def __init__(self, oid: int, ct: ContentType, pages: int = 1):
        self.object_id, self.content_type, self.num_pages, self.queue_seg = oid, ct, pages, None


@pytest.mark.parametrize("policy", [PriorityLRU, PlainLRU])
def test_add_all_and_remove_all_are_add_and_remove_in_order(policy, monkeypatch):
    """Across segment ends (a small SEGMENT here), mixed content types, and objects already in."""
    monkeypatch.setattr(eviction, "SEGMENT", 7)
    rng = random.Random(3)
    cts = [ContentType.KV_CACHE, ContentType.TEMP_BUFFER, ContentType.LORA_WEIGHT]
    objs_a = [Obj(i, rng.choice(cts), rng.randint(1, 4)) for i in range(60)]
    objs_b = [Obj(i, o.content_type, o.num_pages) for i, o in enumerate(objs_a)]
    batch, single = policy(), policy()
    for _ in range(40):
        pick = rng.sample(range(60), rng.randint(1, 20))
        if rng.random() < 0.5:
            batch.add_all([objs_a[i] for i in pick])
            for i in pick:
                single.add(objs_b[i])
        else:
            batch.remove_all([objs_a[i] for i in pick])
            for i in pick:
                single.remove(objs_b[i])
        check_queues_alike(batch, single)


def test_an_object_queue_forgets_emptied_segments(monkeypatch):
    monkeypatch.setattr(eviction, "SEGMENT", 3)
    q = ObjectQueue()
    objs = [Obj(i, ContentType.KV_CACHE) for i in range(9)]
    for o in objs:
        q.add(o)
    assert len(q._segs) == 3 and len(q) == 9
    for o in objs[3:6]:
        assert q.remove(o)
    assert len(q._segs) == 2 and [o.object_id for o in q.values()] == [0, 1, 2, 6, 7, 8]
    assert not q.remove(objs[4]) and objs[4] not in q and objs[0] in q


# ------------------------------------------------------------------ the wire


def committed(oid: int, owner: int, key: bytes | None, pages: list[int], pins: dict) -> Allocation:
    o = Allocation(oid, owner, ContentType.KV_CACHE, key, pages, -1, ObjectState.COMMITTED, len(pages), pins=pins)
    o.pin_count = sum(pins.values())
    return o


class Plain:
    """The same fields without the cache's slots (encoded field by field)."""

    def __init__(self, o: Allocation):
        for f in ("object_id", "window_page", "state", "content_type", "owner", "pins", "pin_count", "pages", "key"):
            setattr(self, f, getattr(o, f))


def test_reply_records_from_cached_parts_are_the_field_by_field_bytes():
    objs = [committed(5, 7, b"key", [4, 9], {7: 1, 8: 2}), committed(6, 8, None, [3], {8: 1})]
    first = w.encode_allocations(w.OP_LOOKUP, 7, objs)
    assert first == w.encode_allocations(w.OP_LOOKUP, 7, [Plain(o) for o in objs])
    assert all(o.wire_head is not None and o.wire_tail is not None for o in objs)
    # The changing fields are read anew each time: pins and the session's flag.
    objs[0].pins[9] = 4
    objs[0].pin_count += 4
    for sid in (7, 8, 9):
        assert w.encode_allocations(w.OP_PIN, sid, objs) == w.encode_allocations(
            w.OP_PIN, sid, [Plain(o) for o in objs]
        )


def test_a_prepared_objects_record_is_not_kept():
    o = committed(5, 7, b"key", [4], {})
    o.state = ObjectState.PREPARED
    prepared = w.encode_allocations(w.OP_LOOKUP, 7, [o])
    assert o.wire_head is None
    o.state = ObjectState.COMMITTED
    assert w.encode_allocations(w.OP_LOOKUP, 7, [o]) != prepared
    assert w.encode_allocations(w.OP_LOOKUP, 7, [o]) == w.encode_allocations(w.OP_LOOKUP, 7, [Plain(o)])


def keys_body(keys) -> bytes:
    return w.encode_step([w.Op(w.OP_LOOKUP, tuple(keys), 1)])[5:]


@pytest.mark.parametrize(
    "keys",
    [
        [b"a" * 3, b"b" * 3, b"c" * 4],  # one longer
        [b"a" * 0x102, b"b" * 0x102, b"c" * 0x002 + b"d" * 0x100],  # same length
        [b"x" * 0x101, b"y" * 0x001],  # the same low byte, another high byte
    ],
)
def test_keys_of_several_lengths_or_a_lying_prefix_are_read_key_by_key(keys):
    body = keys_body(keys)
    assert w.decode_step(body) == w._decode_step_checked(body)
    assert w.decode_step(body)[0].items == tuple(keys)
