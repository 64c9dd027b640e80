"""The sharded map, set and recency queue behave like dict, set and OrderedDict."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from memory_broker.broker.store.shards import SEGMENT, RecencyQueue, ShardedMap, ShardedSet


@pytest.mark.parametrize("seed", range(3))
def test_sharded_map_and_set_match_dict_and_set_under_random_operations(seed):
    rng = random.Random(seed)
    m, d = ShardedMap(), {}
    s, ref = ShardedSet(), set()
    for _ in range(20_000):
        k = rng.randrange(3000) if rng.random() < 0.7 else b"key%d" % rng.randrange(500)
        op = rng.random()
        if op < 0.5:
            m[k] = d[k] = rng.random()
        elif op < 0.7:
            assert m.pop(k, None) == d.pop(k, None)
        elif op < 0.8 and k in d:
            del m[k]
            del d[k]
        else:
            assert m.get(k) == d.get(k) and (k in m) == (k in d)
        if isinstance(k, int):
            x = k * 5003  # spread over the set's shards (runs of 4,096 ints each)
            if rng.random() < 0.5:
                s.add(x)
                ref.add(x)
            else:
                s.discard(x)
                ref.discard(x)
            assert (x in s) == (x in ref)
        assert len(m) == len(d) and len(s) == len(ref)
    assert dict(m.items()) == d and set(m) == set(d) and sorted(m.values(), key=repr) == sorted(d.values(), key=repr)
    assert set(s) == ref and s == ref
    assert len({x >> 12 for x in ref}) > 100  # many shards were used
    while ref:
        ref.remove(s.pop())
    assert len(s) == 0 and not s
    with pytest.raises(KeyError):
        s.pop()
    with pytest.raises(KeyError):
        ShardedMap().pop(1)


def test_recency_queue_keeps_ordereddict_order_across_segments():
    rng = random.Random(1)
    q, ref = RecencyQueue(), OrderedDict()
    for step in range(4 * SEGMENT * 3):
        k = rng.randrange(3 * SEGMENT)
        op = rng.random()
        if op < 0.5:
            if k not in ref:
                q[k] = ref[k] = step
        elif op < 0.8:
            assert q.pop(k) == ref.pop(k, None)
        elif k in ref:
            q.move_to_end(k)
            ref.move_to_end(k)
        assert len(q) == len(ref) and (k in q) == (k in ref)
    assert list(q.values()) == list(ref.values())
    # Emptied segments are dropped: at most one partly filled segment per SEGMENT entries, plus the newest.
    assert len(q._segs) <= len(ref) // 1 + 1
    for k in list(ref):
        q.pop(k)
    assert len(q) == 0 and len(q._segs) == 1 and list(q.values()) == []
