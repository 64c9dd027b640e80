"""What a CUDA arena view remembers about its mappings: window segments and who uses them.

This module owns the pure bookkeeping behind ``CudaArenaView``: the window's mappings as
segments (``cuMemUnmap`` only takes whole mappings) with the streams that used each, and the
leases that live tensors hold on ranges of the view. It makes no driver call and must not
import the daemon or the client library.
"""

from __future__ import annotations

import bisect
import gc
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)
_LEASE_LOCK = threading.Lock()


@dataclass(slots=True)
class Segment:
    """One window mapping: ``count`` pages from page ``slab_page`` of slab ``slab``."""

    count: int
    slab: int
    slab_page: int
    readonly: bool


class WindowSegments:
    """The window's mappings by first window page, in order, and the streams that used each.

    The physical view is not here: only ``close`` unmaps it, after synchronizing the context.
    """

    def __init__(self) -> None:
        self._segments: dict[int, Segment] = {}
        self._starts: list[int] = []
        # Streams (raw handles) that used each mapping, by its first page.
        self._streams: dict[int, set[int]] = {}

    def __iter__(self) -> Iterator[tuple[int, Segment]]:
        return ((s, self._segments[s]) for s in list(self._starts))

    def __getitem__(self, start: int) -> Segment:
        return self._segments[start]

    def overlapping(self, window_page: int, count: int) -> list[int]:
        """Starts of the segments that share a page with ``[window_page, window_page + count)``."""
        end = window_page + count
        i = bisect.bisect_right(self._starts, window_page) - 1
        if i < 0 or self._starts[i] + self._segments[self._starts[i]].count <= window_page:
            i += 1
        out = []
        while i < len(self._starts) and self._starts[i] < end:
            out.append(self._starts[i])
            i += 1
        return out

    def add(self, start: int, seg: Segment) -> None:
        bisect.insort(self._starts, start)
        self._segments[start] = seg

    def remove(self, start: int) -> Segment:
        del self._starts[bisect.bisect_left(self._starts, start)]
        self._streams.pop(start, None)
        return self._segments.pop(start)

    def note_streams(self, first: int, last: int, streams: set[int]) -> None:
        """Remember that ``streams`` use window pages ``first..last`` (inclusive)."""
        for start in self.overlapping(first, last - first + 1):
            self._streams.setdefault(start, set()).update(streams)

    def streams(self, starts: Iterable[int]) -> set[int]:
        """Every stream that used one of the segments starting at ``starts``."""
        return set().union(*(self._streams.get(start, ()) for start in starts))

    def clear(self) -> None:
        self._segments.clear()
        self._starts.clear()
        self._streams.clear()


class CudaArrayInterface:
    """A byte range of device memory, exposed as ``__cuda_array_interface__`` (v3) for torch."""

    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


class Lease(CudaArrayInterface):
    """What a tensor over a view holds: torch keeps this object (it is the tensor's
    ``__cuda_array_interface__`` source) until the tensor's storage dies. The view keeps only
    weak references, so a live lease means a live tensor over ``[address, address + nbytes)``."""

    __slots__ = ("view", "address", "nbytes")

    def __init__(self, view: object, address: int, nbytes: int) -> None:
        super().__init__(address, nbytes)
        self.view = view  # keeps the view object (and so its mappings' bookkeeping) alive
        self.address = address
        self.nbytes = nbytes

    def overlaps(self, start: int, end: int) -> bool:
        return self.address < end and start < self.address + self.nbytes


class Leases:
    """The live tensors' leases over one view (weak: a lease goes when its tensor does)."""

    def __init__(self) -> None:
        self._leases: weakref.WeakSet[Lease] = weakref.WeakSet()
        self._waiting_for = 0

    def add(self, lease: Lease) -> None:
        self._leases.add(lease)

    def ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each live lease, in address order."""
        return sorted((lease.address, lease.nbytes) for lease in self._leases)

    def live(self, start: int, end: int) -> list[Lease]:
        """Live leases overlapping addresses ``[start, end)``; collects cycles once before
        reporting any (a tensor held only by a cycle is not in use)."""
        live = [lease for lease in list(self._leases) if lease.overlaps(start, end)]
        if live:
            del live
            gc.collect()
            live = [lease for lease in list(self._leases) if lease.overlaps(start, end)]
        return live

    def when_gone(self, live: list[Lease], then: Callable[[], None]) -> None:
        """Run ``then`` once every lease in ``live`` has died (in the thread that drops the
        last one; its errors are logged)."""
        self._waiting_for = len(live)
        for lease in live:
            weakref.finalize(lease, self._gone, then)

    def _gone(self, then: Callable[[], None]) -> None:
        with _LEASE_LOCK:  # leases may die in several threads at once
            self._waiting_for -= 1
            last = self._waiting_for == 0
        if last:
            try:
                then()
            except Exception:
                log.exception("deferred teardown of a CUDA arena view failed")


def describe_leases(live: list[Lease], phys_base: int, window_base: int, window_size: int, page_size: int) -> str:
    """The first three of ``live`` with the pages they cover, for a refusal or a log line."""
    ps = page_size
    parts = []
    for lease in sorted(live, key=lambda x: x.address)[:3]:
        if window_base <= lease.address < window_base + window_size:
            w = (lease.address - window_base) // ps
            where = f"window pages {w}..{-(-(lease.address + lease.nbytes - window_base) // ps)}"
        else:
            p = (lease.address - phys_base) // ps
            where = f"physical pages {p}..{-(-(lease.address + lease.nbytes - phys_base) // ps)}"
        parts.append(f"{lease.nbytes} bytes at {lease.address:#x} ({where})")
    more = f" and {len(live) - 3} more" if len(live) > 3 else ""
    return f"{len(live)} tensor(s) over this view ({'; '.join(parts)}{more}) are"


__all__ = ["CudaArrayInterface", "Lease", "Leases", "Segment", "WindowSegments", "describe_leases"]
