"""What a CUDA arena view remembers about its mappings: window pages and who uses them.

This module owns the bookkeeping behind ``CudaArenaView``: the window's mappings, one per
page (only whole allocations map, and each page is its own allocation), with the streams that
used each, and the tensors
over the view with the leases they hold on its ranges (``CudaTensors``). It makes no driver
call and must not import the daemon or the client library.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
_LEASE_LOCK = threading.Lock()


@dataclass(slots=True)
class WindowPage:
    """One window page's mapping: a whole page allocation (physical page ``phys``)."""

    phys: int
    # Mapped read-only by ``map_window(readonly=True)``: stays read-only whatever the page's state.
    forced_ro: bool
    # The access it has now.
    readonly: bool


class WindowPages:
    """The window's mappings, one per window page (only whole allocations map on a GPU), the
    window pages each physical page is mapped at, and the streams that used each.

    The physical view is not here: only ``close`` unmaps it, after synchronizing the context.
    """

    def __init__(self) -> None:
        self._pages: dict[int, WindowPage] = {}
        self._of_phys: dict[int, set[int]] = {}
        # Streams (raw handles) that used each window page.
        self._streams: dict[int, set[int]] = {}

    def __iter__(self) -> Iterator[tuple[int, WindowPage]]:
        return iter(sorted(self._pages.items()))

    def __len__(self) -> int:
        return len(self._pages)

    def get(self, window_page: int) -> WindowPage | None:
        return self._pages.get(window_page)

    def mapped_in(self, window_page: int, count: int) -> list[int]:
        """The mapped window pages in ``[window_page, window_page + count)``, in order."""
        end = window_page + count
        if count <= len(self._pages):
            return [w for w in range(window_page, end) if w in self._pages]
        return sorted(w for w in self._pages if window_page <= w < end)

    def add(self, window_page: int, page: WindowPage) -> None:
        self._pages[window_page] = page
        self._of_phys.setdefault(page.phys, set()).add(window_page)

    def remove(self, window_page: int) -> WindowPage:
        page = self._pages.pop(window_page)
        self._streams.pop(window_page, None)
        ws = self._of_phys.get(page.phys)
        if ws is not None:
            ws.discard(window_page)
            if not ws:
                del self._of_phys[page.phys]
        return page

    def windows_of(self, phys_pages: Iterable[int]) -> list[int]:
        """Every window page that maps one of ``phys_pages``, in order."""
        return sorted(w for p in phys_pages for w in self._of_phys.get(p, ()))

    def note_streams(self, first: int, last: int, streams: set[int]) -> None:
        """Remember that ``streams`` use window pages ``first..last`` (inclusive)."""
        for w in self.mapped_in(first, last - first + 1):
            self._streams.setdefault(w, set()).update(streams)

    def streams(self, window_pages: Iterable[int]) -> set[int]:
        """Every stream that used one of ``window_pages``."""
        return set().union(*(self._streams.get(w, ()) for w in window_pages))

    def clear(self) -> None:
        self._pages.clear()
        self._of_phys.clear()
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


class CudaTensors:
    """Zero-copy tensors over a CUDA view, the leases they hold and the streams that use them.

    A base of ``CudaArenaView``, which provides the mappings (``_window``, ``_leases``, the
    bases and sizes, ``mapped_slabs``), ``_check_open`` and ``_current_stream``. It makes no
    driver call: the view refuses to unmap what a live lease covers.
    """

    geometry: Any
    device: Any
    _window: WindowPages
    _leases: Leases
    _phys_base: int
    _window_base: int
    _window_size: int
    _handles: dict[int, Any]
    mapped_slabs: int

    def physical_tensor(self, dtype=None):
        """The physical view of every page the arena has (as far as this view knows), as one
        tensor: page p at p * page_size. Pages are imported lazily, so it may span pages not
        mapped here yet: index only pages of objects this process was given (they are
        imported before they are handed out); touching another faults the context.

        Its base, page 0, must be attached here (the anchor page: depending on its version,
        torch asks the driver about a tensor's base address and refuses one not mapped, as
        kvcached's anchor page avoids; the client imports it first).

        Raises:
            ValueError: page 0 is not attached in this view.
        """
        n = self.mapped_slabs * self.geometry.slab_size
        if n and 0 not in self._handles:
            raise ValueError(
                "page 0, the physical view's anchor, is not attached in this view: a tensor's base address "
                "must be mapped (attach page 0 first; the client's physical_view does)"
            )
        return self._make_tensor(self._phys_base, n, dtype, holes_ok=True)

    def tensor(self, address: int, nbytes: int, dtype=None):
        """A zero-copy CUDA tensor over ``nbytes`` at ``address`` (uint8 unless ``dtype``).

        Built from ``__cuda_array_interface__`` with ``torch.as_tensor(..., device="cuda:N")``
        and checked to alias the address (a copy would be a silent bug). bf16 and other
        types the interface cannot express come from ``.view(dtype)``. The tensor holds a
        lease on the range: while it (or a slice or view of it) lives, the range is not
        unmapped (``MappingInUse`` instead). Its uses are assumed to be on torch's current
        stream; name other streams with ``record_stream``.

        Raises:
            ValueError: the range is not all mapped in this view.
            RuntimeError: torch made a copy instead of a view.
        """
        return self._make_tensor(address, nbytes, dtype)

    def _make_tensor(self, address: int, nbytes: int, dtype, holes_ok: bool = False):
        self._check_open()
        self._check_mapped(address, nbytes, holes_ok)
        import torch

        dev = torch.device("cuda", self.device.ordinal)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8 if dtype is None else dtype, device=dev)
        lease = Lease(self, address, nbytes)
        t = torch.as_tensor(lease, device=dev)
        if t.data_ptr() != address or t.numel() != nbytes or t.device != dev:
            raise RuntimeError(
                f"torch.as_tensor copied device memory at {address:#x} ({nbytes} bytes) instead of "
                f"viewing it (got {t.data_ptr():#x} on {t.device})"
            )
        self._leases.add(lease)
        self._note_streams(address, nbytes, {self._current_stream()})
        return t if dtype is None or dtype == torch.uint8 else t.view(dtype)

    def record_stream(self, tensor_or_address, stream, nbytes: int | None = None) -> None:
        """Declare that ``stream`` uses a range of this view (as torch's ``Tensor.record_stream``):
        unmapping the range then synchronizes that stream too.

        Args:
            tensor_or_address: a tensor from ``tensor`` (its whole storage), or an address.
            stream: a ``torch.cuda.Stream``, a ``CUstream``, or a raw stream handle.
            nbytes: the range's size, with an address.

        Raises:
            ValueError: the range is not mapped in this view.
        """
        self._check_open()
        if nbytes is None:
            storage = tensor_or_address.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
        else:
            address = int(tensor_or_address)
        self._check_mapped(address, nbytes)
        self._note_streams(address, nbytes, {int(getattr(stream, "cuda_stream", stream))})

    def live_tensors(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each live tensor's lease (diagnostics)."""
        return self._leases.ranges()

    def _note_streams(self, address: int, nbytes: int, streams: set[int]) -> None:
        """Remember that ``streams`` use ``[address, address + nbytes)``."""
        g = self.geometry
        if not self._window_base <= address < self._window_base + self._window_size:
            return  # the physical view: only close unmaps it
        first = (address - self._window_base) // g.page_size
        last = (address + max(nbytes, 1) - 1 - self._window_base) // g.page_size
        self._window.note_streams(first, last, streams)

    def _describe_leases(self, live: list[Lease]) -> str:
        g = self.geometry
        return describe_leases(live, self._phys_base, self._window_base, self._window_size, g.page_size)

    def _check_mapped(self, address: int, nbytes: int, holes_ok: bool = False) -> None:
        """Refuse a range this view has not mapped (a kernel touching it would fault the
        context); ``holes_ok``: a physical range may include pages not imported yet."""
        g = self.geometry
        if nbytes < 0:
            raise ValueError(f"negative size {nbytes}")
        end = address + nbytes
        ps = g.page_size
        phys_end = self._phys_base + self.mapped_slabs * g.slab_size
        if self._phys_base <= address and end <= phys_end:
            if not holes_ok and nbytes:
                for p in range((address - self._phys_base) // ps, (end - 1 - self._phys_base) // ps + 1):
                    if p not in self._handles:
                        raise ValueError(
                            f"physical page {p} (address {self._phys_base + p * ps:#x}) is not mapped in this view"
                        )
            return
        wb = self._window_base
        if wb <= address and end <= wb + self._window_size:
            first = (address - wb) // ps
            last = (end - 1 - wb) // ps if nbytes else first
            for w in range(first, last + 1):
                if self._window.get(w) is None:
                    raise ValueError(f"window page {w} (address {wb + w * ps:#x}) is not mapped in this view")
            return
        raise ValueError(
            f"{nbytes} bytes at {address:#x} are outside this view's mapped memory (physical view "
            f"{self._phys_base:#x}..{phys_end:#x}, window {wb:#x}..{wb + self._window_size:#x})"
        )


__all__ = ["CudaArrayInterface", "CudaTensors", "Lease", "Leases", "WindowPage", "WindowPages", "describe_leases"]
