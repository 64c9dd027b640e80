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
from array import array
from typing import Callable

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
    ):
        assert capacity_pages % pages_per_slab == 0 and capacity_pages <= max_pages
        self.max_pages = max_pages
        self.pages_per_slab = pages_per_slab
        self.capacity_pages = capacity_pages
        self._grow = grow
        # Page table: owning object id per page within capacity, FREE otherwise.
        self.owner = array("Q", bytes(8 * capacity_pages))
        # Free pages within capacity, kept as a stack popped from the end; it starts in
        # descending order so a fresh arena hands out low page numbers first.
        self._free: list[int] = list(range(capacity_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        """Pages that can be handed out, counting capacity the arena may still grow into."""
        return len(self._free) + self.max_pages - self.capacity_pages

    @property
    def free_in_capacity(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.capacity_pages - len(self._free)

    def take(self, owner_ids: list[int], sizes: list[int]) -> list[list[int]]:
        """Take ``sizes[i]`` free pages for object ``owner_ids[i]``, for each i.

        The caller has made sure enough pages are free within capacity (``grow`` first).
        """
        free = self._free
        owner = self.owner
        if len(sizes) == 1 and sizes[0] == 1:
            # The most common request: one page.
            p = free.pop()
            owner[p] = owner_ids[0]
            return [[p]]
        assert sum(sizes) <= len(free), "take() without enough free pages within capacity"
        out: list[list[int]] = []
        for oid, n in zip(owner_ids, sizes):
            # Not free[-n:]: for n == 0 that slice is the whole free list.
            cut = len(free) - n
            pages = free[cut:]
            del free[cut:]
            pages.reverse()
            for p in pages:
                owner[p] = oid
            out.append(pages)
        return out

    def give_back(self, pages: list[int]) -> None:
        """Return pages to the free stack."""
        owner = self.owner
        if len(pages) == 1:
            p = pages[0]
            owner[p] = FREE
            self._free.append(p)
            return
        for p in pages:
            owner[p] = FREE
        self._free.extend(reversed(pages))

    def grow(self, slabs: int) -> None:
        """Back ``slabs`` more slabs with memory (the arena creates them).

        Raises:
            MemoryError: past ``max_pages``, or the backend could not create a slab.
        """
        needed = slabs * self.pages_per_slab
        if self.capacity_pages + needed > self.max_pages:
            raise MemoryError(
                f"arena would need {self.capacity_pages + needed} pages; its maximum is {self.max_pages}"
            )
        self._grow(slabs)
        old = self.capacity_pages
        self.capacity_pages = old + needed
        self.owner.frombytes(bytes(8 * needed))
        # New pages go under the existing free pages so older (already touched) pages
        # are reused first; within the new range, low numbers first.
        self._free[:0] = range(old + needed - 1, old - 1, -1)

    def free_page_list(self) -> list[int]:
        """A copy of the free pages (for invariant checks and diagnostics)."""
        return list(self._free)


class WindowSpace:
    """Free extents of the virtual window, for placing contiguous allocations.

    Extents are kept sorted by start with their lengths, coalesced on release.
    """

    def __init__(self, window_pages: int, placement: str = "best_fit"):
        if placement not in ("best_fit", "first_fit"):
            raise ValueError(f"placement must be best_fit or first_fit, not {placement!r}")
        self.window_pages = window_pages
        self.placement = placement
        self._starts: list[int] = [0] if window_pages else []
        self._lengths: list[int] = [window_pages] if window_pages else []

    def place(self, count: int) -> int:
        """Reserve ``count`` window pages; returns the first one, or -1 if no extent fits."""
        starts, lengths = self._starts, self._lengths
        best = -1
        if self.placement == "first_fit":
            for i, length in enumerate(lengths):
                if length >= count:
                    best = i
                    break
        else:
            best_len = self.window_pages + 1
            for i, length in enumerate(lengths):
                if count <= length < best_len:
                    best, best_len = i, length
                    if length == count:
                        break
        if best < 0:
            return -1
        start = starts[best]
        if lengths[best] == count:
            del starts[best]
            del lengths[best]
        else:
            starts[best] += count
            lengths[best] -= count
        return start

    def release(self, start: int, count: int) -> None:
        """Return a placed range, merging it with free neighbours."""
        starts, lengths = self._starts, self._lengths
        i = bisect.bisect_left(starts, start)
        assert i == len(starts) or starts[i] >= start + count, "window range released twice"
        assert i == 0 or starts[i - 1] + lengths[i - 1] <= start, "window range released twice"
        merge_prev = i > 0 and starts[i - 1] + lengths[i - 1] == start
        merge_next = i < len(starts) and starts[i] == start + count
        if merge_prev and merge_next:
            lengths[i - 1] += count + lengths[i]
            del starts[i]
            del lengths[i]
        elif merge_prev:
            lengths[i - 1] += count
        elif merge_next:
            starts[i] = start
            lengths[i] += count
        else:
            starts.insert(i, start)
            lengths.insert(i, count)

    @property
    def free_pages(self) -> int:
        return sum(self._lengths)

    @property
    def free_extents(self) -> int:
        return len(self._starts)

    @property
    def largest_free(self) -> int:
        return max(self._lengths, default=0)

    def extents(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._lengths))
