"""The CUDA arena's owner side: the broker creates VMM slabs (``cuMemCreate``) and exports them as fds.

This module owns the broker's CUDA slabs (``CudaArena``: create, export as POSIX fds, map into
its own view, preallocate from the device's free memory). Importing and mapping slabs, the
device and the driver calls are the view's, shared with clients
(``memory_broker.proto.wire.mapping.cuda``); growth's bookkeeping is the base ``Arena``'s. It knows
nothing of objects or owners: the page pool decides which page goes where.
"""

from __future__ import annotations

import fcntl
import math
import os

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
    """The broker's CUDA arena: creates exportable VMM slabs and maps them into its own view.

    Args:
        geometry: sizes (page size a multiple of the device's granularity, usually 2 MiB).
        device: index or UUID of the device.
        name: shown in messages.
    """

    backend = "cuda"
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
        self.view.make_current()
        free, total = check("cuMemGetInfo()", self._drv.cuMemGetInfo(), self._drv)
        return int(free), int(total)

    def _prepare_growth(self) -> object:
        """The allocation properties of every slab, with the view's context current."""
        self.view.make_current()
        return self.view.allocation_prop()

    def _create_slab(self, idx: int, have: int, slabs: int, prepared: object) -> int:
        """``cuMemCreate`` + export as a close-on-exec fd + map into the broker's view;
        MemoryError naming the failed call (and nothing left behind) otherwise."""
        drv, view, g = self._drv, self.view, self.geometry
        handle = None
        fd = -1
        try:
            handle = check(f"cuMemCreate({g.slab_size} bytes)", drv.cuMemCreate(g.slab_size, prepared, 0), drv)
            fd = int(
                check(
                    f"cuMemExportToShareableHandle(slab {idx}, POSIX_FILE_DESCRIPTOR)",
                    drv.cuMemExportToShareableHandle(handle, view.fd_handle_type, 0),
                    drv,
                )
            )
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
            view.attach_handle(idx, handle)  # the view owns the handle from here
            handle = None
        except BaseException as e:
            if fd >= 0:
                os.close(fd)
            if isinstance(e, (CudaError, OSError)):
                raise MemoryError(self._growth_message(have, slabs, idx, e)) from e
            raise
        finally:
            if handle is not None:
                drv.cuMemRelease(handle)
        return fd

    def preallocate_fraction(self, fraction: float) -> int:
        """Grow by as many slabs as fit in ``fraction`` of the device's free memory (capped at
        the arena's maximum); returns how many were created.

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
