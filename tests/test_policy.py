"""Adapter tier policies: the default (adaptive aged frequency) against LRU and LFU."""

from __future__ import annotations

import random

import pytest

from memory_broker.broker.adapters.policy import DEFAULT_POLICY, POLICIES, AdaptivePolicy, make_tier_policy


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
