"""The CUDA arena's owner side: the broker creates one VMM allocation per page and exports
page fds on demand.

This module owns the broker's CUDA pages (``CudaArena``): create them a slab at a time
(``pages_per_slab`` calls to ``cuMemCreate``, one per page: only whole allocations map on a
GPU), map them into its own view with one ``cuMemSetAccess`` per slab, export a page's fd
only when a client asks for it (``export_fds``, from the fd channel's export threads), and
preallocate from the device's free memory. Importing and mapping pages, the device and the
driver calls are the view's, shared with clients (``memory_broker.proto.wire.mapping.cuda``);
growth's bookkeeping is the base ``Arena``'s.

Measured on an H200 by the GPU probes (FIELD-NOTES "CUDA VMM on a real GPU"), per 2 MiB page:
``cuMemCreate`` 7-22 us, map + first access 31 us, export 31-77 us. A whole H200 (~70,000
pages) so takes about 2-4 s to create and map at start; exporting it all would take ~4.5 s,
which is why fds are made on demand, off the event loop, and closed once sent (the broker
holds no fd per page). This module has not yet run on a GPU.
"""

from __future__ import annotations

import fcntl
import math
import os
from typing import Any

from memory_broker.broker.arena.base import Arena
from memory_broker.proto.wire.mapping.cuda import (
    CudaArenaView,
    CudaDevice,
    CudaError,
    CudaUnavailable,
    MappingInUse,
    check,
    check_geometry,
    cuda_available,
    parse_device_spec,
    resolve_device,
)
from memory_broker.proto.wire.mapping.geometry import ArenaGeometry, format_size


class CudaArena(Arena):
    """The broker's CUDA arena: creates one exportable VMM allocation per page, a slab at a
    time, and maps them into its own view.

    Args:
        geometry: sizes (page size a multiple of the device's granularity, usually 2 MiB).
        device: index or UUID of the device.
        name: shown in messages.
    """

    backend = "cuda"
    fd_unit = "page"
    view: CudaArenaView

    def __init__(self, geometry: ArenaGeometry, device: str | int | None = "0", name: str = "memory-broker") -> None:
        super().__init__(geometry, CudaArenaView(geometry, device), name)
        self._drv = self.view.driver

    @property
    def device(self) -> CudaDevice:
        return self.view.device

    @property
    def device_id(self) -> str:
        """The device's UUID, for ``ArenaInfo.device``: clients find the same GPU by it."""
        return self.view.device.uuid

    def memory_info(self) -> tuple[int, int]:
        """The device's (free, total) bytes, from ``cuMemGetInfo``."""
        self._check_open()
        with self.view.current():
            free, total = check("cuMemGetInfo()", self._drv.cuMemGetInfo(), self._drv)
        return int(free), int(total)

    def _grow_locked(self, slabs: int) -> None:
        """As ``Arena.grow``, with the device's context current in this thread for the whole
        grow (its creates, and the undoing of a failed one) and this thread's own after it."""
        with self.view.current():
            super()._grow_locked(slabs)

    def _prepare_growth(self) -> object:
        """The allocation properties of every slab (the grow's context is current)."""
        return self.view.allocation_prop()

    def _create_slab(self, idx: int, have: int, slabs: int, prepared: object) -> Any:
        """``cuMemCreate`` each page of slab ``idx`` and map them into the broker's view (one
        access call for the slab); MemoryError naming the failed call (and nothing of the
        slab left behind) otherwise."""
        drv, view, g = self._drv, self.view, self.geometry
        handles: list[Any] = []
        try:
            for i in range(g.pages_per_slab):
                page = idx * g.pages_per_slab + i
                handles.append(
                    check(
                        f"cuMemCreate({g.page_size} bytes, page {page})", drv.cuMemCreate(g.page_size, prepared, 0), drv
                    )
                )
            view.attach_handles(idx * g.pages_per_slab, handles)  # the view owns them from here
            handles = []
        except (CudaError, OSError) as e:
            raise MemoryError(self._growth_message(have, slabs, idx, e)) from e
        finally:
            for h in handles:
                drv.cuMemRelease(h)
        return None

    def export_fds(self, first: int, count: int) -> list[int]:
        """New close-on-exec fds for pages ``first..first+count-1``
        (``cuMemExportToShareableHandle``, 31-77 us per page measured), owned by the caller.

        Raises:
            ValueError: a page does not exist.
            MemoryError: an export failed (none of this call's fds is left open); the message
                names the call (an fd limit shows as the driver's error here).
        """
        out: list[int] = []
        view, drv = self.view, self._drv
        # The arena's lock covers only the check that the pages exist: the exports themselves
        # (the slow part) of two clients' threads overlap; close waits for them.
        with self._exporting(first, count):
            try:
                with view.current():
                    for p in range(first, first + count):
                        fd = int(
                            check(
                                f"cuMemExportToShareableHandle(page {p}, POSIX_FILE_DESCRIPTOR)",
                                drv.cuMemExportToShareableHandle(view.page_handle(p), view.fd_handle_type, 0),
                                drv,
                            )
                        )
                        out.append(fd)
                        fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
            except BaseException as e:
                for fd in out:
                    os.close(fd)
                if isinstance(e, CudaError):
                    raise MemoryError(f"{e} exporting pages {first}..{first + count - 1} ({len(out)} made)") from e
                raise
        return out

    def preallocate_fraction(self, fraction: float) -> int:
        """Grow by as many slabs (of page allocations) as fit in ``fraction`` of the device's free
        memory (capped at the arena's maximum); returns how many were created.

        Raises:
            ValueError: ``fraction`` outside (0, 1].
            MemoryError: as ``grow``.
        """
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction {fraction} must be in (0, 1]")
        free, _total = self.memory_info()
        n = min(int(math.floor(free * fraction)) // self.geometry.slab_size, self.geometry.max_slabs - self.num_slabs)
        if n > 0:
            self.grow(n)
        return max(n, 0)

    def _growth_message(self, have: int, slabs: int, idx: int, e: Exception) -> str:
        g = self.geometry
        free = ""
        try:
            f, t = check("cuMemGetInfo()", self._drv.cuMemGetInfo(), self._drv)
            free = f"; {self.device.describe()} has {format_size(int(f))} free of {format_size(int(t))}"
        except Exception:
            pass
        return (
            f"{e} creating slab {idx} ({format_size(g.slab_size)}) while growing the CUDA arena from "
            f"{have} to {have + slabs} slabs ({format_size(have * g.slab_size)} -> "
            f"{format_size((have + slabs) * g.slab_size)} of at most {format_size(g.max_slabs * g.slab_size)}){free}"
        )


# The view side's names, re-exported for the broker's callers (ops/gpu, benchmarks, tests).
__all__ = [
    "MappingInUse",
    "CudaArena",
    "CudaArenaView",
    "CudaDevice",
    "CudaError",
    "CudaUnavailable",
    "check",
    "check_geometry",
    "cuda_available",
    "parse_device_spec",
    "resolve_device",
]
