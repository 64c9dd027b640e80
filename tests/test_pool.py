"""PagePool and WindowSpace: which physical page is free, and where contiguous ranges sit."""

from __future__ import annotations

import asyncio
import threading

import pytest

from memory_broker.broker.store.pool import FREE, PagePool, WindowSpace


def make_pool(max_pages=16, pages_per_slab=4, capacity_pages=0, grow=None) -> PagePool:
    return PagePool(max_pages, pages_per_slab, capacity_pages, grow or (lambda n: None))


class GrowLog:
    """A fake arena: records every grow call."""

    def __init__(self, fail: bool = False):
        self.calls: list[int] = []
        self.fail = fail

    def __call__(self, slabs: int) -> None:
        self.calls.append(slabs)
        if self.fail:
            raise MemoryError("device out of memory")


# ------------------------------------------------------------------ PagePool


def test_fresh_pool_hands_out_low_pages_first():
    pool = make_pool(capacity_pages=8)
    assert pool.take([1, 2], [3, 2]) == [[0, 1, 2], [3, 4]]


def test_take_records_owner_of_each_page_in_page_table():
    pool = make_pool(capacity_pages=8)
    pool.take([7, 9], [2, 1])
    assert list(pool.owner[:4]) == [7, 7, 9, FREE]


def test_take_updates_free_and_used_counts():
    pool = make_pool(max_pages=16, capacity_pages=8)
    pool.take([1], [3])
    assert (pool.used_pages, pool.free_in_capacity, pool.free_pages) == (3, 5, 13)


def test_free_pages_counts_capacity_not_yet_grown():
    pool = make_pool(max_pages=16, capacity_pages=4)
    assert pool.free_pages == 16
    assert pool.free_in_capacity == 4


def test_give_back_then_take_reuses_the_returned_pages():
    pool = make_pool(capacity_pages=8)
    pool.take([1, 2, 3], [2, 2, 2])  # 0,1 | 2,3 | 4,5
    pool.give_back([2, 3])
    assert pool.take([4], [2]) == [[2, 3]]


def test_one_page_takes_hand_out_low_pages_first():
    pool = make_pool(capacity_pages=4)
    assert [pool.take([i], [1]) for i in (1, 2, 3)] == [[[0]], [[1]], [[2]]]
    assert list(pool.owner) == [1, 2, 3, FREE]


def test_one_page_give_back_is_reused_by_the_next_take():
    pool = make_pool(capacity_pages=4)
    for i in (1, 2, 3):
        pool.take([i], [1])
    pool.give_back([1])
    assert pool.owner[1] == FREE
    assert pool.take([9], [1]) == [[1]]
    assert pool.owner[1] == 9


def test_give_back_of_several_pages_hands_them_out_again_in_order():
    pool = make_pool(capacity_pages=8)
    pool.take([1], [8])
    pool.give_back([5, 2, 7])
    assert pool.take([2], [3]) == [[5, 2, 7]]


def test_give_back_marks_pages_free_in_page_table():
    pool = make_pool(capacity_pages=4)
    (pages,) = pool.take([5], [3])
    pool.give_back(pages)
    assert list(pool.owner) == [FREE] * 4
    assert sorted(pool.free_page_list()) == [0, 1, 2, 3]
    assert pool.used_pages == 0


def test_take_of_zero_pages_takes_nothing():
    pool = make_pool(capacity_pages=4)
    assert pool.take([1], [0]) == [[]]
    assert pool.free_in_capacity == 4


def test_free_page_list_is_a_copy():
    pool = make_pool(capacity_pages=4)
    pool.free_page_list().clear()
    assert pool.free_in_capacity == 4


def test_grow_is_called_with_the_slab_count_and_extends_capacity():
    log = GrowLog()
    pool = make_pool(max_pages=16, pages_per_slab=4, grow=log)
    pool.grow(2)
    assert log.calls == [2]
    assert pool.capacity_pages == 8
    assert pool.free_in_capacity == 8
    assert len(pool.owner) == 8


def test_grown_pages_are_handed_out_after_older_free_pages_low_first():
    pool = make_pool(max_pages=16, pages_per_slab=4, capacity_pages=4)
    pool.take([1], [4])
    pool.give_back([2])
    pool.grow(1)
    assert pool.take([2], [3]) == [[2, 4, 5]]


def test_grow_past_max_pages_raises_memory_error_with_numbers_and_does_not_call_backend():
    log = GrowLog()
    pool = make_pool(max_pages=16, pages_per_slab=4, capacity_pages=12, grow=log)
    with pytest.raises(MemoryError, match=r"20 pages.*maximum is 16"):
        pool.grow(2)
    assert log.calls == []
    assert pool.capacity_pages == 12
    assert pool.free_in_capacity == 12


def test_grow_up_to_exactly_max_pages_succeeds():
    pool = make_pool(max_pages=16, pages_per_slab=4, capacity_pages=12)
    pool.grow(1)
    assert pool.capacity_pages == 16
    assert pool.free_pages == 16


def test_backend_failure_to_grow_leaves_pool_unchanged():
    log = GrowLog(fail=True)
    pool = make_pool(max_pages=16, pages_per_slab=4, capacity_pages=4, grow=log)
    with pytest.raises(MemoryError):
        pool.grow(1)
    assert log.calls == [1]
    assert pool.capacity_pages == 4
    assert pool.free_page_list() == [3, 2, 1, 0]
    assert len(pool.owner) == 4


def test_used_plus_free_is_always_max_pages():
    pool = make_pool(max_pages=16, pages_per_slab=4, capacity_pages=4)
    pool.take([1], [3])
    pool.grow(1)
    pool.take([2], [4])
    assert pool.used_pages + pool.free_pages == 16
    assert pool.used_pages == 7


# --------------------------------------------------------------- WindowSpace


def test_window_rejects_unknown_placement():
    with pytest.raises(ValueError, match="placement"):
        WindowSpace(16, "worst_fit")


def test_fresh_window_places_from_zero():
    w = WindowSpace(16)
    assert w.place(4) == 0
    assert w.place(3) == 4
    assert w.extents() == [(7, 9)]


def fragmented(placement: str) -> WindowSpace:
    """A 32-page window whose free extents are (0,5), (9,3), (16,4), (24,8)."""
    w = WindowSpace(32, placement)
    assert w.place(32) == 0
    for start, count in ((0, 5), (9, 3), (16, 4), (24, 8)):
        w.release(start, count)
    assert w.extents() == [(0, 5), (9, 3), (16, 4), (24, 8)]
    return w


def test_best_fit_picks_the_smallest_extent_that_fits():
    w = fragmented("best_fit")
    assert w.place(4) == 16
    assert w.extents() == [(0, 5), (9, 3), (24, 8)]


def test_best_fit_takes_the_front_of_a_larger_extent():
    w = fragmented("best_fit")
    assert w.place(6) == 24
    assert w.extents() == [(0, 5), (9, 3), (16, 4), (30, 2)]


def test_first_fit_picks_the_lowest_extent_that_fits():
    w = fragmented("first_fit")
    assert w.place(4) == 0
    assert w.extents() == [(4, 1), (9, 3), (16, 4), (24, 8)]


def test_first_fit_skips_extents_too_small():
    w = fragmented("first_fit")
    assert w.place(6) == 24


def test_place_returns_minus_one_when_no_extent_fits_and_changes_nothing():
    w = fragmented("best_fit")
    before = w.extents()
    assert w.place(9) == -1
    assert w.extents() == before
    assert w.free_pages == 20


def test_place_larger_than_window_returns_minus_one():
    w = WindowSpace(8)
    assert w.place(9) == -1
    assert w.extents() == [(0, 8)]


def test_release_coalesces_with_both_neighbours():
    w = WindowSpace(12)
    a, b, c = w.place(4), w.place(4), w.place(4)
    w.release(a, 4)
    w.release(c, 4)
    assert w.free_extents == 2
    w.release(b, 4)
    assert w.extents() == [(0, 12)]


def test_release_coalesces_with_previous_neighbour_only():
    w = WindowSpace(12)
    a, b, _ = w.place(4), w.place(4), w.place(4)
    w.release(a, 4)
    w.release(b, 4)
    assert w.extents() == [(0, 8)]


def test_release_coalesces_with_next_neighbour_only():
    w = WindowSpace(12)
    _, b, c = w.place(4), w.place(4), w.place(4)
    w.release(c, 4)
    w.release(b, 4)
    assert w.extents() == [(4, 8)]


def test_release_between_used_ranges_makes_a_separate_extent():
    w = WindowSpace(12)
    _, b, _ = w.place(4), w.place(4), w.place(4)
    w.release(b, 4)
    assert w.extents() == [(4, 4)]


def test_release_twice_is_caught():
    w = WindowSpace(12)
    a = w.place(4)
    w.place(4)
    w.release(a, 4)
    with pytest.raises(AssertionError, match="twice"):
        w.release(a, 4)


def test_window_size_summaries():
    w = fragmented("best_fit")
    assert (w.free_pages, w.free_extents, w.largest_free) == (20, 4, 8)


def test_empty_window_has_no_extents():
    w = WindowSpace(0)
    assert w.place(1) == -1
    assert (w.free_pages, w.free_extents, w.largest_free) == (0, 0, 0)


@pytest.mark.parametrize("placement", ["first_fit", "best_fit"])
def test_indexed_placement_matches_a_scan_of_the_free_extents(placement):
    import random

    rng = random.Random(5)
    w = WindowSpace(1000, placement)
    placed: list[tuple[int, int]] = []
    for _ in range(3000):
        if placed and rng.random() < 0.45:
            start, n = placed.pop(rng.randrange(len(placed)))
            w.release(start, n)
            continue
        n = rng.randint(1, 40)
        ext = w.extents()
        fits = [(s, ln) for s, ln in ext if ln >= n]
        if placement == "first_fit":
            want = fits[0][0] if fits else -1
        else:
            want = min(fits, key=lambda e: (e[1], e[0]))[0] if fits else -1
        got = w.place(n)
        assert got == want, (placement, n, ext)
        if got >= 0:
            placed.append((got, n))
        assert w.free_pages == sum(ln for _, ln in w.extents())
        assert w.largest_free == max((ln for _, ln in w.extents()), default=0)


def _growing_store(grow_arena, background=False):
    from memory_broker.broker.store.growth import Growth
    from memory_broker.broker.store.objects import ObjectStore

    growth = Growth(grow_arena, lambda slabs, seconds: None)
    pool = PagePool(16, 4, 4, grow=growth)
    growth.pool = pool
    store = ObjectStore(pool, WindowSpace(64))
    store.growth = growth
    if background:
        store.background = lambda: None
    return store, growth, threading.get_ident()


@pytest.mark.parametrize("background", [False, True])
def test_a_call_that_must_grow_sees_the_new_pages_only_after_the_grow_made_off_its_thread(background):
    """Growth.run (issue 45, item 4): the store call stops before it changes anything, the
    arena grows on the grow thread, and only then does the pool hand out the new pages."""
    from memory_broker.proto.wire.spec import Spec

    seen = []

    def grow_arena(slabs):
        seen.append((threading.get_ident(), store.pool.capacity_pages, store.stats().used_pages))

    store, growth, me = _growing_store(grow_arena, background)
    sid = store.open_session()
    ((obj, _),) = asyncio.run(growth.run(lambda: store.allocate(sid, [Spec(6)])))
    assert len(obj.pages) == 6 and store.pool.capacity_pages == 8
    assert [(t != me, cap, used) for t, cap, used in seen] == [(True, 4, 0)]  # one grow, off this thread
    growth.close()


def test_a_failed_grow_off_the_loop_is_resource_exhausted_naming_it():
    from memory_broker.proto.wire.errors import BrokerError, Code
    from memory_broker.proto.wire.spec import Spec

    def grow_arena(slabs):
        raise MemoryError("cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY")

    store, growth, _ = _growing_store(grow_arena, background=True)
    sid = store.open_session()
    with pytest.raises(BrokerError) as e:
        asyncio.run(growth.run(lambda: store.allocate(sid, [Spec(6)])))
    assert e.value.code == Code.RESOURCE_EXHAUSTED and "CUDA_ERROR_OUT_OF_MEMORY" in e.value.message
    assert store.pool.capacity_pages == 4 and store.stats().used_pages == 0
    growth.close()
