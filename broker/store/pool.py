"""The page pool: which physical page is free, and where contiguous ranges sit in the window.

``PagePool`` owns the page table (page -> owning object id) and the free pages, and asks
the arena to grow by whole slabs when the free pages within its current capacity run out.
``WindowSpace`` places contiguous allocations in the virtual window (best fit or first fit
over free extents); since any physical pages can back any window range, only the window's
own extents can fragment, and it is several times larger than the physical maximum.
Neither knows about objects, pins or eviction: the object store decides what to free.
"""

from __future__ import annotations

import bisect
import heapq
from array import array
from collections.abc import Callable

# Page-table value of a free page (object ids start at 1).
FREE = 0


class PagePool:
    """Free physical pages and the page table, up to ``max_pages``.

    Args:
        max_pages: most pages the arena may ever hold.
        pages_per_slab: the growth unit.
        capacity_pages: pages already backed by slabs.
        grow: called with a number of slabs when more capacity is needed; raises
            MemoryError when the backend cannot provide them.
    """

    def __init__(
        self,
        max_pages: int,
        pages_per_slab: int,
        capacity_pages: int,
        grow: Callable[[int], None],
        base: int = 0,
    ):
        assert capacity_pages % pages_per_slab == 0 and capacity_pages <= max_pages
        assert base % pages_per_slab == 0
        self.max_pages = max_pages
        self.pages_per_slab = pages_per_slab
        self.capacity_pages = capacity_pages
        # The arena's page number of this pool's first page: the pool is pages
        # ``base..base+capacity_pages-1`` (a tenant pool's whole slabs; 0 without tenants).
        self.base = base
        self._grow = grow
        # Page table: owning object id per page (indexed by arena page number) up to the
        # pool's end, FREE otherwise (pages below ``base`` are other pools': always FREE here).
        self.owner = array("Q", bytes(8 * (base + capacity_pages)))
        # Free pages within capacity: a stack in ``_free[:_top]``, popped from the top; it
        # starts in descending order so a fresh arena hands out low page numbers first. The
        # list is as long as the capacity and never resized by take/give_back: a resize of
        # a million-entry list copies it and stalls the call that happens to trigger it.
        self._free: list[int] = list(range(base + capacity_pages - 1, base - 1, -1))
        self._top = capacity_pages

    @property
    def free_pages(self) -> int:
        """Pages that can be handed out, counting capacity the arena may still grow into."""
        return self._top + self.max_pages - self.capacity_pages

    @property
    def free_in_capacity(self) -> int:
        return self._top

    @property
    def used_pages(self) -> int:
        return self.capacity_pages - self._top

    def take(self, owner_ids: list[int], sizes: list[int]) -> list[list[int]]:
        """Take ``sizes[i]`` free pages for object ``owner_ids[i]``, for each i.

        The caller has made sure enough pages are free within capacity (``grow`` first).
        """
        free = self._free
        owner = self.owner
        if len(sizes) == 1 and sizes[0] == 1:
            # The most common request: one page.
            self._top -= 1
            p = free[self._top]
            owner[p] = owner_ids[0]
            return [[p]]
        assert sum(sizes) <= self._top, "take() without enough free pages within capacity"
        out: list[list[int]] = []
        top = self._top
        for oid, n in zip(owner_ids, sizes):
            pages = free[top - n : top]
            top -= n
            pages.reverse()
            for p in pages:
                owner[p] = oid
            out.append(pages)
        self._top = top
        return out

    def give_back(self, pages: list[int]) -> None:
        """Return pages to the free stack."""
        owner = self.owner
        top = self._top
        if len(pages) == 1:
            p = pages[0]
            owner[p] = FREE
            self._free[top] = p
            self._top = top + 1
            return
        for p in pages:
            owner[p] = FREE
        n = len(pages)
        self._free[top : top + n] = pages[::-1]
        self._top = top + n

    def grow(self, slabs: int) -> None:
        """Back ``slabs`` more slabs with memory (the arena creates them).

        Raises:
            MemoryError: past ``max_pages``, or the backend could not create a slab.
        """
        needed = slabs * self.pages_per_slab
        if self.capacity_pages + needed > self.max_pages:
            raise MemoryError(f"arena would need {self.capacity_pages + needed} pages; its maximum is {self.max_pages}")
        self._grow(slabs)
        self.add_slabs(slabs)

    def add_slabs(self, slabs: int) -> None:
        """Hand out the pages of ``slabs`` more slabs, which the arena has created and mapped
        (by ``grow``, or by one made off the loop: ``store.growth.Growth``)."""
        needed = slabs * self.pages_per_slab
        old = self.capacity_pages
        self.capacity_pages = old + needed
        self.owner.frombytes(bytes(8 * needed))
        # New pages go under the existing free pages so older (already touched) pages
        # are reused first; within the new range, low numbers first.
        top, end = self._top, self.base + old
        self._free[:top] = [*range(end + needed - 1, end - 1, -1), *self._free[:top]]
        self._free.extend([0] * (self.capacity_pages - len(self._free)))
        self._top = top + needed

    def free_page_list(self) -> list[int]:
        """A copy of the free pages (for invariant checks and diagnostics)."""
        return self._free[: self._top]


class WindowSpace:
    """Free extents of the virtual window, for placing contiguous allocations.

    Every operation costs the same with 10 or 100,000 free extents: extents are indexed by
    start and by end (dicts, so a release finds its neighbours in O(1)) and by length (a
    sorted list of the distinct free lengths, each with a min-heap of starts). Best fit
    bisects the lengths (O(log n)) and takes the lowest start of the smallest length that
    fits; first fit descends a max-tree over the window's pages (O(log window pages)).
    Heap entries are dropped lazily: one is live only while ``_by_start`` still maps its
    start to its length.
    """

    def __init__(self, window_pages: int, placement: str = "best_fit"):
        if placement not in ("best_fit", "first_fit"):
            raise ValueError(f"placement must be best_fit or first_fit, not {placement!r}")
        self.window_pages = window_pages
        self.placement = placement
        self._by_start: dict[int, int] = {}
        self._end_at: dict[int, int] = {}
        # Distinct free lengths, ascending; per length: live extents and a heap of starts.
        self._lengths: list[int] = []
        self._count: dict[int, int] = {}
        self._heaps: dict[int, list[int]] = {}
        self._free = 0
        # First fit: a max-tree over window pages (leaf = length of the free extent that
        # starts there, else 0); the leftmost leaf >= count is found in O(log window).
        self._tree: array | None = None
        if placement == "first_fit" and window_pages:
            size = 1
            while size < window_pages:
                size *= 2
            self._leaves = size
            self._tree = array("q", bytes(16 * size))
        if window_pages:
            self._add(0, window_pages)

    def _set_leaf(self, start: int, length: int) -> None:
        tree = self._tree
        i = self._leaves + start
        tree[i] = length
        i >>= 1
        while i:
            m = max(tree[2 * i], tree[2 * i + 1])
            if tree[i] == m:
                break
            tree[i] = m
            i >>= 1

    def _first_fit(self, count: int) -> int:
        """The lowest start of a free extent of at least ``count`` pages, or -1."""
        tree = self._tree
        if tree[1] < count:
            return -1
        i, leaves = 1, self._leaves
        while i < leaves:
            i = 2 * i if tree[2 * i] >= count else 2 * i + 1
        return i - leaves

    def _add(self, start: int, length: int) -> None:
        if self._tree is not None:
            self._set_leaf(start, length)
        self._by_start[start] = length
        self._end_at[start + length] = start
        self._free += length
        n = self._count.get(length, 0)
        self._count[length] = n + 1
        heap = self._heaps.get(length)
        if heap is None:
            heap = self._heaps[length] = []
        if n == 0:
            bisect.insort(self._lengths, length)
            heap.clear()  # every entry left in it is stale
        heapq.heappush(heap, start)

    def _remove(self, start: int, length: int) -> None:
        if self._tree is not None:
            self._set_leaf(start, 0)
        del self._by_start[start]
        del self._end_at[start + length]
        self._free -= length
        n = self._count[length] - 1
        if n:
            self._count[length] = n
            heap = self._heaps[length]
            if len(heap) > 2 * n + 16:  # compact stale entries now and then
                by_start = self._by_start
                heap[:] = [s for s in heap if by_start.get(s) == length]
                heapq.heapify(heap)
        else:
            del self._count[length]
            del self._heaps[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]

    def _lowest(self, length: int) -> int:
        """The lowest start among the live extents of ``length`` (there is one)."""
        heap, by_start = self._heaps[length], self._by_start
        while by_start.get(heap[0]) != length:
            heapq.heappop(heap)
        return heap[0]

    def place(self, count: int) -> int:
        """Reserve ``count`` window pages; returns the first one, or -1 if no extent fits."""
        lengths = self._lengths
        i = bisect.bisect_left(lengths, count)
        if i == len(lengths):
            return -1
        if self._tree is not None:
            start = self._first_fit(count)
            length = self._by_start[start]
        else:
            length = lengths[i]
            start = self._lowest(length)
        self._remove(start, length)
        if length > count:
            self._add(start + count, length - count)
        return start

    def release(self, start: int, count: int) -> None:
        """Return a placed range, merging it with free neighbours."""
        by_start = self._by_start
        assert start not in by_start and start + count not in self._end_at, "window range released twice"
        prev = self._end_at.get(start)
        nxt = by_start.get(start + count)
        if prev is not None:
            assert prev + by_start[prev] == start
            plen = by_start[prev]
            self._remove(prev, plen)
            start, count = prev, count + plen
        if nxt is not None:
            self._remove(start + count, nxt)
            count += nxt
        self._add(start, count)

    @property
    def free_pages(self) -> int:
        return self._free

    @property
    def free_extents(self) -> int:
        return len(self._by_start)

    @property
    def largest_free(self) -> int:
        return self._lengths[-1] if self._lengths else 0

    def extents(self) -> list[tuple[int, int]]:
        """Free extents sorted by start (sorts: for diagnostics and checks, not hot paths)."""
        return sorted(self._by_start.items())
