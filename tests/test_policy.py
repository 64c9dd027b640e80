"""Adapter tier policies: the default (adaptive aged frequency) against LRU and LFU."""

from __future__ import annotations

import random

import pytest

from memory_broker.broker.adapters.policy import (
    DEFAULT_POLICY,
    POLICIES,
    AdaptivePolicy,
    BatchedAccess,
    make_tier_policy,
)

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores


def _hit_rate(policy, trace, slots: int) -> float:
    hits = 0
    for k in trace:
        if k in policy:
            hits += 1
        else:
            if len(policy) >= slots:
                policy.remove(next(iter(policy.victims())))
            policy.insert(k, 1)
        policy.access(k)
    return hits / len(trace)


def _skewed(n: int, popular: list[str], others: list[str], seed: int) -> list[str]:
    r = random.Random(seed)
    return [r.choice(popular) if r.random() < 0.8 else r.choice(others) for _ in range(n)]


def test_default_policy_is_adaptive():
    assert DEFAULT_POLICY == "adaptive" and isinstance(make_tier_policy(DEFAULT_POLICY), AdaptivePolicy)


def test_adaptive_keeps_the_popular_adapters_where_lru_lets_a_scan_push_them_out():
    names = [f"a{i}" for i in range(16)]
    trace = _skewed(4000, names[:3], names[3:], seed=7)
    adaptive = _hit_rate(AdaptivePolicy(), trace, 4)
    lru = _hit_rate(POLICIES["lru"](), trace, 4)
    assert adaptive > lru + 0.05, (adaptive, lru)


def test_adaptive_follows_a_shift_in_popularity_that_plain_lfu_does_not():
    names = [f"a{i}" for i in range(40)]
    # 6000 requests mostly to a0..a3, then 6000 mostly to a20..a23: LFU's old counts keep
    # the first set resident long after nobody asks for it.
    trace = _skewed(6000, names[:4], names[4:], seed=1) + _skewed(6000, names[20:24], names[:20] + names[24:], seed=2)
    tail = len(trace) // 2
    pa, pl = AdaptivePolicy(), POLICIES["lfu"]()
    _hit_rate(pa, trace[:tail], 6)
    _hit_rate(pl, trace[:tail], 6)
    after_shift_adaptive = _hit_rate(pa, trace[tail:], 6)
    after_shift_lfu = _hit_rate(pl, trace[tail:], 6)
    assert after_shift_adaptive > after_shift_lfu + 0.1, (after_shift_adaptive, after_shift_lfu)


def test_victims_put_rarely_used_first_and_recency_breaks_ties():
    p = AdaptivePolicy()
    for k in ("a", "b", "c"):
        p.insert(k, 1)
    for k in ("a", "a", "a", "b", "c", "c"):
        p.access(k)
    assert list(p.victims()) == ["b", "c", "a"]
    p.insert("d", 1)
    p.access("d")  # d and b were used once each; b less recently
    assert list(p.victims())[:2] == ["b", "d"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_forget_drops_an_adapter_and_its_history(name):
    p = make_tier_policy(name)
    p.insert("x", 1)
    p.access("x")
    p.forget("x")
    assert "x" not in p and len(p) == 0 and list(p.victims()) == []
    if name == "lru":
        return  # no history beyond recency
    p.insert("x", 1)  # comes back as new: no stale count puts it ahead of a fresh adapter
    p.insert("y", 1)
    p.access("y")
    p.access("y")
    p.access("x")
    assert list(p.victims())[0] == "x"


def test_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="adaptive, lru, lfu, gdsf"):
        make_tier_policy("mru")


# ----------------------------------------------------------------- uses counted in batch


class _Heard:
    """A policy that records what reaches it."""

    name = "heard"

    def __init__(self):
        self.events = []

    def access_counts(self, uses):
        self.events.append(("uses", list(uses)))

    def insert(self, key, size):
        self.events.append(("insert", key))

    def remove(self, key):
        self.events.append(("remove", key))

    def forget(self, key):
        self.events.append(("forget", key))

    def victims(self):
        self.events.append(("victims",))
        return iter(())

    def __contains__(self, key):
        return False

    def __len__(self):
        return 0


def test_batched_uses_reach_the_policy_once_per_key_in_last_use_order_before_anything_else():
    inner = _Heard()
    p = BatchedAccess(inner)
    p.access_many(["a", "b", "c"])
    p.access_many(["b", "a"])
    p.access("c")
    assert inner.events == [] and p.pending == 3
    p.insert("d", 1)
    list(p.victims())
    assert inner.events == [("uses", [("b", 2), ("a", 2), ("c", 2)]), ("insert", "d"), ("victims",)]
    assert p.pending == 0


def test_batched_uses_wait_for_at_most_max_pending_keys():
    inner = _Heard()
    p = BatchedAccess(inner, max_pending=4)
    p.access_many([f"k{i}" for i in range(4)])
    assert inner.events == []
    p.access_many(["k4"])
    assert inner.events == [("uses", [(f"k{i}", 1) for i in range(5)])] and p.pending == 0


def test_two_tiers_recording_the_same_uses_together_hear_what_each_alone_hears():
    # access_with (one C pass with the native core) against access_many on each tier apart:
    # the same uses, counts and order reach each policy, and each flushes at its own events.
    alone, together = [(_Heard(), _Heard()) for _ in range(2)]
    pa, pb = BatchedAccess(alone[0], max_pending=5), BatchedAccess(alone[1], max_pending=3)
    qa, qb = BatchedAccess(together[0], max_pending=5), BatchedAccess(together[1], max_pending=3)
    pb.access_many(["x", "y"])
    qb.access_many(["x", "y"])
    for step, keys in enumerate([["a", "b", "a"], ["c"], ["b", "d", "e"], ["a"], ["f", "g"]]):
        pa.access_many(keys)
        pb.access_many(keys)
        qa.access_with(qb, keys)
        if step == 1:
            pa.insert("z", 1)
            qa.insert("z", 1)
        assert (alone[0].events, alone[1].events) == (together[0].events, together[1].events)
        assert (pa.pending, pb.pending) == (qa.pending, qb.pending)
    list(pa.victims()), list(pb.victims()), list(qa.victims()), list(qb.victims())
    assert (alone[0].events, alone[1].events) == (together[0].events, together[1].events)
    assert alone[1].events[0][0] == "uses"  # the second tier's own max_pending flushed it


def test_runs_recorded_again_reach_the_policy_as_each_use_recorded_apart_would():
    # A run (an acquire's keys) recorded again is one lookup of its tuple: at a flush each key
    # still reaches the policy once, with every use counted, in the order of its last use.
    r = random.Random(11)
    runs = [tuple(r.sample("abcdefgh", r.randint(1, 5))) for _ in range(6)] + [("a", "b", "a")]
    inner = _Heard()
    p = BatchedAccess(inner)
    counts: dict[str, int] = {}
    last: dict[str, int] = {}
    at = 0
    for i in range(200):
        run = r.choice(runs)
        p.access_many(list(run) if i % 2 else run)
        for k in run:
            counts[k] = counts.get(k, 0) + 1
            last[k] = at
            at += 1
        if i % 37 == 36:
            assert p.pending == len(counts)
            p.flush()
            assert inner.events.pop() == ("uses", [(k, counts[k]) for k in sorted(last, key=last.__getitem__)])
            counts.clear()
            last.clear()
    assert inner.events == []


def _frames(seed: int, n: int = 300) -> list[list[str]]:
    """Acquires of 1..6 distinct adapters out of 12, skewed to the first few."""
    r = random.Random(seed)
    names = [f"a{i}" for i in range(12)]
    return [
        list(dict.fromkeys(r.choice(names[:4]) if r.random() < 0.6 else r.choice(names) for _ in range(6)))
        for _ in range(n)
    ]


@pytest.mark.parametrize("name", ["lru", "lfu", "gdsf", "adaptive"])
def test_a_tier_fed_in_batch_picks_the_victims_one_fed_use_by_use_picks(name):
    """Both tiers see the same frames and the same misses; every few frames a miss makes room."""
    serial, batched = make_tier_policy(name), BatchedAccess(make_tier_policy(name))
    slots = 5
    for i, frame in enumerate(_frames(3)):
        for p in (serial, batched):
            for k in frame:
                if k not in p:
                    if len(p) >= slots:
                        p.remove(next(iter(p.victims())))
                    p.insert(k, 1)
        for k in frame:
            serial.access(k)
        batched.access_many(frame)
        if i % 7 == 0:
            assert list(batched.victims()) == list(serial.victims()), i
    assert list(batched.victims()) == list(serial.victims())
