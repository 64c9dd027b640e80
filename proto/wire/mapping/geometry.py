"""The arena's sizes, checked and written in one place, for the broker and every client.

This module owns ``ArenaGeometry`` (the sizes every process must agree on to mirror the
broker's views), the one check of those sizes (``check_sizes`` for settings,
``check_geometry`` for a backend's granularity) and the one way to write a size for people
(``format_size``). It maps nothing and must not import the daemon or the client library.
"""

from __future__ import annotations

from dataclasses import dataclass

# Page sizes a broker accepts: a power of two from 512 KiB to 4 MiB (ARCHITECTURE.md, "The arena").
MIN_PAGE_SIZE = 512 << 10
MAX_PAGE_SIZE = 4 << 20

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_size(n: int) -> str:
    """Bytes as people read them, in the largest binary unit reached: 2097152 -> '2 MiB'."""
    for unit, k in _UNITS:
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n} B"


@dataclass(frozen=True, slots=True)
class ArenaGeometry:
    """Sizes every process must agree on to mirror the broker's views."""

    # Bytes in one page, the unit of allocation.
    page_size: int
    # Pages in one slab: the unit of growth (and of fd export on the host arena; a CUDA arena
    # exports one fd per page, each page its own allocation).
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


def check_sizes(page_size: int, slab_size: int, pool_size: int) -> None:
    """Refuse arena settings a broker cannot build a geometry from.

    The page size is a power of two from 512 KiB to 4 MiB, the slab size a multiple of it, and
    the pool size a positive multiple of the slab size.

    Raises:
        ValueError: naming the first bad setting (``page_size``, ``slab_size``, ``pool_size``).
    """
    ps = page_size
    if not MIN_PAGE_SIZE <= ps <= MAX_PAGE_SIZE or ps & (ps - 1):
        raise ValueError(
            f"page_size: {ps} bytes; must be a power of two from "
            f"{format_size(MIN_PAGE_SIZE).replace(' ', '')} to {format_size(MAX_PAGE_SIZE).replace(' ', '')}"
        )
    if slab_size % ps or slab_size < ps:
        raise ValueError(f"slab_size: {slab_size} bytes is not a multiple of page_size ({ps})")
    if pool_size < slab_size or pool_size % slab_size:
        raise ValueError(f"pool_size: {pool_size} bytes must be a positive multiple of slab_size ({slab_size})")


def check_geometry(geometry: ArenaGeometry, granularity: int, where: str, granule: str) -> None:
    """Refuse a geometry a backend cannot map: positive sizes, pages a multiple of its granule.

    Args:
        geometry: the sizes to check.
        granularity: the backend's mapping granule in bytes (the OS page, the CUDA granularity).
        where: what the granule belongs to, for the message ("CUDA device 0 (...)").
        granule: what the granule is called, for the message ("the OS page size").

    Raises:
        ValueError: naming the size, the granule and the nearest usable page size.
    """
    g = geometry
    if g.pages_per_slab <= 0 or g.max_slabs <= 0 or g.window_pages <= 0:
        raise ValueError(
            f"geometry needs positive sizes: {g.pages_per_slab} pages per slab, "
            f"{g.max_slabs} slabs, {g.window_pages} window pages"
        )
    if granularity <= 0:
        raise ValueError(f"{granule} {granularity} of {where} is not positive")
    if g.page_size <= 0 or g.page_size % granularity:
        up = max(granularity, -(-g.page_size // granularity) * granularity)
        raise ValueError(
            f"page size {g.page_size} bytes ({format_size(max(g.page_size, 0))}) is not a multiple of "
            f"{granule} of {where}, {granularity} bytes ({format_size(granularity)}); "
            f"use a page size of {format_size(up)}"
        )


__all__ = ["MAX_PAGE_SIZE", "MIN_PAGE_SIZE", "ArenaGeometry", "check_geometry", "check_sizes", "format_size"]
