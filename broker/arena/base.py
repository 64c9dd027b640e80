"""The arena interface: physical memory in slabs, and the two views every process keeps.

An arena owns slabs of physical memory, each exportable as a file descriptor, and maps them
into two reserved virtual ranges: the *physical view* (slab after slab, so page ``p`` is at
``phys_base + p * page_size``) and the *virtual window* (where a contiguous allocation's
pages are mapped one by one, wherever they physically are). It knows nothing of objects,
owners or eviction: the page pool above decides which page goes where.

Two sides share this module: the broker's ``Arena`` creates slabs; an ``ArenaView`` (used by
the broker's arena internally and by every client) maps slabs it was handed as fds.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class ArenaGeometry:
    """Sizes every process must agree on to mirror the broker's views."""

    # Bytes in one page, the unit of allocation.
    page_size: int
    # Pages in one slab (a slab is the unit of growth and of fd export).
    pages_per_slab: int
    # Most slabs the arena may ever hold; the physical view reserves this much VA.
    max_slabs: int
    # Pages in the virtual window (a multiple of the physical maximum).
    window_pages: int

    @property
    def slab_size(self) -> int:
        return self.page_size * self.pages_per_slab

    @property
    def max_pages(self) -> int:
        return self.pages_per_slab * self.max_slabs


class ArenaView(abc.ABC):
    """One process's mappings of an arena: the physical view and the virtual window.

    Addresses are plain integers (host pointers on the host backend, device pointers on
    CUDA). Mapping calls are idempotent where that is cheap: mapping a window page again
    replaces the old mapping.
    """

    geometry: ArenaGeometry

    @property
    @abc.abstractmethod
    def phys_base(self) -> int:
        """Address of page 0 in the physical view."""

    @property
    @abc.abstractmethod
    def window_base(self) -> int:
        """Address of window page 0."""

    @property
    @abc.abstractmethod
    def mapped_slabs(self) -> int:
        """How many slabs (0..n-1) this view has mapped into the physical view."""

    @abc.abstractmethod
    def attach_slab(self, slab_index: int, fd: int) -> None:
        """Map the slab behind ``fd`` at its place in the physical view.

        Slabs are attached in order (``slab_index == mapped_slabs``). The caller keeps
        ownership of ``fd`` and may close it afterwards.
        """

    @abc.abstractmethod
    def map_window(self, window_page: int, phys_pages: Sequence[int]) -> None:
        """Map ``phys_pages`` back to back at window pages ``window_page, window_page+1, ...``."""

    @abc.abstractmethod
    def unmap_window(self, window_page: int, count: int) -> None:
        """Return window pages to reserved, inaccessible address space."""

    def set_page_access(self, pages: Sequence[int], readonly: bool) -> None:
        """Make physical ``pages`` read-only (or writable again) in this view: in the physical
        view and in every window page that maps them now or is mapped onto them later.

        Clients call it to keep their mapping in step with what the pages hold: pages of
        shared content (adapters) read-only once learned, pages they are given to write
        writable again. A write to a read-only page faults (SIGSEGV on the host). Pages of a
        slab attached read-only stay read-only whatever ``readonly`` says.

        Raises:
            ValueError: a page is outside the mapped slabs (nothing changed).
            NotImplementedError: this backend cannot change access per page.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot change page access")

    @abc.abstractmethod
    def tensor(self, address: int, nbytes: int, dtype=None):
        """A zero-copy torch tensor over ``nbytes`` at ``address`` in this view (uint8 unless
        ``dtype`` is given). It does not keep the mapping alive."""

    def page_address(self, page: int) -> int:
        return self.phys_base + page * self.geometry.page_size

    def window_address(self, window_page: int) -> int:
        return self.window_base + window_page * self.geometry.page_size

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap everything and release the reservations. Idempotent."""


class Arena(abc.ABC):
    """The broker's arena: creates slabs on demand and keeps its own view of them."""

    # Short name shown in logs and status: "host" or "cuda".
    backend: str
    geometry: ArenaGeometry
    # The broker's own mappings.
    view: ArenaView

    @property
    @abc.abstractmethod
    def num_slabs(self) -> int:
        """Slabs created so far."""

    @property
    def capacity_pages(self) -> int:
        """Pages backed by physical memory now (grows up to ``geometry.max_pages``)."""
        return self.num_slabs * self.geometry.pages_per_slab

    @abc.abstractmethod
    def grow(self, slabs: int) -> None:
        """Create ``slabs`` more slabs and map them into the broker's view.

        Raises:
            MemoryError: the backend could not create a slab (device or host out of memory),
                or the arena would exceed ``geometry.max_slabs``.
        """

    @abc.abstractmethod
    def slab_fd(self, slab_index: int) -> int:
        """The broker-held fd of a slab; callers duplicate it (SCM_RIGHTS does) and never close it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap, close every slab fd and release memory. Idempotent."""
