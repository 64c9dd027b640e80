"""Eviction policies: who goes first when the pool needs room."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from memory_broker.broker.store.eviction import EVICTION_ORDER, ContentType, PlainLRU, PriorityLRU, make_policy

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

CT = ContentType


@dataclass(eq=False)
class Obj:
    object_id: int
    content_type: ContentType
    num_pages: int = 1


def ids(objs) -> list[int]:
    return [o.object_id for o in objs]


def filled(policy, *specs):
    """Add objects (content_type, num_pages) with ids 1, 2, ... in that order (oldest first)."""
    objs = [Obj(i, ct, n) for i, (ct, n) in enumerate(specs, start=1)]
    for o in objs:
        policy.add(o)
    return objs


# ------------------------------------------------------------- PriorityLRU


def test_eviction_order_is_temp_activation_gradient_lora_kv():
    assert EVICTION_ORDER == (CT.TEMP_BUFFER, CT.ACTIVATION, CT.GRADIENT, CT.LORA_WEIGHT, CT.KV_CACHE)


def test_priority_lru_orders_candidates_by_content_priority_regardless_of_age():
    p = PriorityLRU()
    filled(p, (CT.KV_CACHE, 1), (CT.LORA_WEIGHT, 1), (CT.GRADIENT, 1), (CT.ACTIVATION, 1), (CT.TEMP_BUFFER, 1))
    assert ids(p) == [5, 4, 3, 2, 1]


def test_priority_lru_selects_lowest_priority_class_first():
    p = PriorityLRU()
    filled(p, (CT.KV_CACHE, 1), (CT.LORA_WEIGHT, 1), (CT.GRADIENT, 1), (CT.ACTIVATION, 1), (CT.TEMP_BUFFER, 1))
    assert ids(p.select(3)) == [5, 4, 3]


def test_priority_lru_within_a_class_selects_least_recently_added_first():
    p = PriorityLRU()
    filled(p, (CT.KV_CACHE, 1), (CT.KV_CACHE, 1), (CT.KV_CACHE, 1))
    assert ids(p.select(2)) == [1, 2]


def test_touch_moves_an_object_to_most_recent_in_its_class():
    p = PriorityLRU()
    objs = filled(p, (CT.KV_CACHE, 1), (CT.KV_CACHE, 1), (CT.KV_CACHE, 1))
    p.touch(objs[0])
    assert ids(p) == [2, 3, 1]
    assert ids(p.select(1)) == [2]


def test_touch_does_not_lift_an_object_above_a_higher_priority_class():
    p = PriorityLRU()
    objs = filled(p, (CT.TEMP_BUFFER, 1), (CT.KV_CACHE, 1))
    p.touch(objs[0])
    assert ids(p) == [1, 2]


def test_touch_of_an_object_not_in_the_policy_is_ignored():
    p = PriorityLRU()
    filled(p, (CT.KV_CACHE, 1))
    p.touch(Obj(99, CT.KV_CACHE, 4))
    assert ids(p) == [1]
    assert p.evictable_pages == 1


def test_size_aware_step_takes_one_object_covering_the_need_instead_of_older_small_ones():
    p = PriorityLRU(size_window=8)
    filled(p, (CT.KV_CACHE, 1), (CT.KV_CACHE, 1), (CT.KV_CACHE, 1), (CT.KV_CACHE, 4))
    assert ids(p.select(3)) == [4]


def test_size_aware_step_prefers_the_smallest_object_that_covers():
    p = PriorityLRU(size_window=8)
    filled(p, (CT.KV_CACHE, 1), (CT.KV_CACHE, 8), (CT.KV_CACHE, 3), (CT.KV_CACHE, 5))
    assert ids(p.select(3)) == [3]


def test_size_aware_step_only_looks_within_its_window():
    p = PriorityLRU(size_window=2)
    filled(p, (CT.KV_CACHE, 1), (CT.KV_CACHE, 1), (CT.KV_CACHE, 1), (CT.KV_CACHE, 4))
    # Object 4 lies outside the two oldest until objects 1 and 2 are gone; by then one page
    # is still needed and the oldest remaining object (3) covers it.
    assert ids(p.select(3)) == [1, 2, 3]


def test_size_aware_step_stays_within_the_lowest_class():
    p = PriorityLRU(size_window=8)
    filled(p, (CT.TEMP_BUFFER, 1), (CT.TEMP_BUFFER, 1), (CT.KV_CACHE, 10))
    assert ids(p.select(2)) == [1, 2]


def test_select_falls_through_to_the_next_class_when_one_is_not_enough():
    p = PriorityLRU(size_window=8)
    filled(p, (CT.KV_CACHE, 2), (CT.TEMP_BUFFER, 1), (CT.LORA_WEIGHT, 3))
    assert ids(p.select(3)) == [2, 3]


def test_select_returns_all_candidates_when_they_cannot_cover_the_need():
    p = PriorityLRU()
    filled(p, (CT.KV_CACHE, 2), (CT.TEMP_BUFFER, 1))
    assert ids(p.select(10)) == [2, 1]


def test_select_of_nothing_selects_nothing():
    p = PriorityLRU()
    filled(p, (CT.KV_CACHE, 2))
    assert p.select(0) == []


def test_select_does_not_remove_candidates():
    p = PriorityLRU()
    filled(p, (CT.KV_CACHE, 2), (CT.TEMP_BUFFER, 1))
    p.select(3)
    assert len(p) == 2
    assert p.evictable_pages == 3


# --------------------------------------------------------------- PlainLRU


def test_plain_lru_ignores_content_type():
    p = PlainLRU()
    filled(p, (CT.KV_CACHE, 1), (CT.LORA_WEIGHT, 1), (CT.TEMP_BUFFER, 1))
    assert ids(p) == [1, 2, 3]
    assert ids(p.select(2)) == [1, 2]


def test_plain_lru_has_no_size_aware_step():
    p = PlainLRU()
    filled(p, (CT.TEMP_BUFFER, 1), (CT.TEMP_BUFFER, 1), (CT.TEMP_BUFFER, 5))
    assert ids(p.select(2)) == [1, 2]


def test_plain_lru_touch_moves_to_most_recent():
    p = PlainLRU()
    objs = filled(p, (CT.KV_CACHE, 1), (CT.TEMP_BUFFER, 1))
    p.touch(objs[0])
    assert ids(p.select(1)) == [2]


def test_plain_lru_remove_drops_candidate_and_pages():
    p = PlainLRU()
    objs = filled(p, (CT.KV_CACHE, 2), (CT.TEMP_BUFFER, 3))
    p.remove(objs[1])
    assert ids(p) == [1]
    assert p.evictable_pages == 2


# ---------------------------------------------------------- bookkeeping


@pytest.mark.parametrize("policy_cls", [PriorityLRU, PlainLRU])
def test_evictable_pages_follows_add_and_remove(policy_cls):
    p = policy_cls()
    a, b = filled(p, (CT.KV_CACHE, 3), (CT.TEMP_BUFFER, 5))
    assert (len(p), p.evictable_pages) == (2, 8)
    p.remove(a)
    assert (len(p), p.evictable_pages) == (1, 5)


@pytest.mark.parametrize("policy_cls", [PriorityLRU, PlainLRU])
def test_removing_an_object_not_in_the_policy_changes_nothing(policy_cls):
    p = policy_cls()
    (a,) = filled(p, (CT.KV_CACHE, 3))
    p.remove(a)
    p.remove(a)
    p.remove(Obj(42, CT.TEMP_BUFFER, 7))
    assert (len(p), p.evictable_pages) == (0, 0)


def test_make_policy_builds_policies_by_name():
    assert isinstance(make_policy("lru_size_aware"), PriorityLRU)
    lru = make_policy("lru")
    assert isinstance(lru, PlainLRU)


def test_make_policy_rejects_unknown_names_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown eviction policy 'fifo'.*lru"):
        make_policy("fifo")
