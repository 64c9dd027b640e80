"""A process's view of an arena: the physical view and the virtual window, backend-neutral.

This module owns the ``ArenaView`` interface and the logic every backend's view shares: the
two base addresses, the range and page checks (one message for each refusal) and splitting
pages into runs that one mapping call can cover. A backend keeps only what differs (how a
slab is imported and mapped). It creates no slabs (the broker's ``Arena`` does) and must not
import the daemon or the client library.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Sequence

from memory_broker.proto.wire.mapping.geometry import ArenaGeometry


def page_runs(
    pages: Sequence[int], per_slab: int | None = None, key: Callable[[int], Hashable] | None = None
) -> list[tuple[int, int, int]]:
    """Split ``pages`` (in their order) into runs of consecutive pages: ``(index, first, count)``.

    A run never crosses a slab boundary (every ``per_slab`` pages, when given) nor a change of
    ``key(page)`` (when given), so each run is one mapping call.
    """
    out: list[tuple[int, int, int]] = []
    start = 0
    while start < len(pages):
        first = pages[start]
        slab = first // per_slab if per_slab else 0
        k = key(first) if key is not None else None
        end = start + 1
        while (
            end < len(pages)
            and pages[end] == pages[end - 1] + 1
            and (not per_slab or pages[end] // per_slab == slab)
            and (key is None or key(pages[end]) == k)
        ):
            end += 1
        out.append((start, first, end - start))
        start = end
    return out


class ArenaView(abc.ABC):
    """One process's mappings of an arena: the physical view and the virtual window.

    Addresses are plain integers (host pointers on the host backend, device pointers on
    CUDA). Mapping calls are idempotent where that is cheap: mapping a window page again
    replaces the old mapping. A backend sets ``geometry``, ``_phys_base``, ``_window_base``
    and ``_closed`` in its constructor.
    """

    geometry: ArenaGeometry
    # Whether code on the host may dereference this view's addresses (False for device memory).
    host_addressable: bool = True
    # What one fd of the fd channel stands for in this view: a slab (host: ``attach_slab``,
    # slabs in order) or a page (CUDA: ``attach_pages``, imported lazily, any order).
    fd_unit: str = "slab"
    _phys_base: int
    _window_base: int
    _closed: bool

    @property
    def phys_base(self) -> int:
        """Address of page 0 in the physical view."""
        self._check_open()
        return self._phys_base

    @property
    def window_base(self) -> int:
        """Address of window page 0."""
        self._check_open()
        return self._window_base

    @property
    @abc.abstractmethod
    def mapped_slabs(self) -> int:
        """How many slabs (0..n-1) this view has mapped into the physical view."""

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

    def reads_only(self, pages: Sequence[int]) -> bool:
        """Whether each of physical ``pages`` is read-only in this view already (then
        ``set_page_access(pages, True)`` would change nothing); False where not, or unknown."""
        return False

    @abc.abstractmethod
    def tensor(self, address: int, nbytes: int, dtype=None):
        """A zero-copy torch tensor over ``nbytes`` at ``address`` in this view (uint8 unless
        ``dtype`` is given). It does not keep the mapping alive."""

    def physical_tensor(self, dtype=None):
        """The whole physical view mapped so far, as one tensor (page p at p * page_size)."""
        return self.tensor(self.phys_base, self.mapped_slabs * self.geometry.slab_size, dtype)

    def page_address(self, page: int) -> int:
        return self.phys_base + page * self.geometry.page_size

    def window_address(self, window_page: int) -> int:
        return self.window_base + window_page * self.geometry.page_size

    @abc.abstractmethod
    def detach_from(self, first_slab: int) -> None:
        """Unmap slabs ``first_slab..`` again; for the broker's failed grow (those slabs have
        no window pages yet)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap everything and release the reservations. Idempotent."""

    # ------------------------------------------------------------- shared checks

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this arena view is closed")

    def _check_attach_index(self, slab_index: int) -> None:
        """Slabs attach in order, up to the geometry's maximum."""
        self._check_open()
        have, most = self.mapped_slabs, self.geometry.max_slabs
        if slab_index != have:
            raise ValueError(f"slab {slab_index} attached out of order: {have} slabs are mapped")
        if slab_index >= most:
            raise ValueError(f"slab {slab_index} is past the arena's maximum of {most} slabs")

    def _check_window_range(self, window_page: int, count: int) -> None:
        n = self.geometry.window_pages
        if window_page < 0 or count < 0 or window_page + count > n:
            raise ValueError(
                f"window pages {window_page}..{window_page + count} (count {count}) are outside the window of {n} pages"
            )

    def _page_problem(self, page: int) -> str | None:
        """Why physical ``page`` cannot be used in this view now, or None (a backend whose
        pages are imported one by one says more)."""
        mapped_pages = self.mapped_slabs * self.geometry.pages_per_slab
        if not 0 <= page < mapped_pages:
            return f"outside the {mapped_pages} pages of the {self.mapped_slabs} mapped slabs"
        return None

    def _range_usable(self, first: int, last: int) -> bool:
        """True when every page in ``first..last`` is usable (``_page_problem`` finds nothing):
        one check for a whole lookup's pages. False: ask page by page (a backend whose
        pages are imported one by one says False)."""
        return 0 <= first and last < self.mapped_slabs * self.geometry.pages_per_slab

    def _check_window_pages(self, pages: Sequence[int]) -> None:
        """Every page of a window mapping is usable here (the first one that is not is named)."""
        for i, p in enumerate(pages):
            why = self._page_problem(p)
            if why is not None:
                raise ValueError(f"physical page {p} (index {i}) is {why}")

    def _access_pages(self, pages: Sequence[int]) -> list[int]:
        """``pages`` for ``set_page_access``: sorted, distinct, all in mapped slabs.

        Raises:
            ValueError: naming (up to five of) the pages outside the mapped slabs.
        """
        want = sorted(set(map(int, pages)))
        if not want or self._range_usable(want[0], want[-1]):
            return want
        bad = [(p, why) for p in want if (why := self._page_problem(p)) is not None]
        if bad:
            raise ValueError(f"page(s) {', '.join(str(p) for p, _ in bad[:5])} are {bad[0][1]}")
        return want


__all__ = ["ArenaView", "page_runs"]
