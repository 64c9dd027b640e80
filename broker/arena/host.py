"""The host arena's owner side: the broker creates slabs as sealed memfds and exports their fds.

This module owns the broker's host slabs (``HostArena``: create, seal, map into its own view,
hand out fds). Mapping slabs and pages is the view's, shared with clients
(``memory_broker.proto.wire.mapping.host``); growth's bookkeeping is the base ``Arena``'s. It knows
nothing of objects, owners or which page is free, and must not import torch.
"""

from __future__ import annotations

import errno
import fcntl
import os

from memory_broker.broker.arena.base import Arena
from memory_broker.proto.wire.mapping.geometry import ArenaGeometry
from memory_broker.proto.wire.mapping.host import (
    F_ADD_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    HostArenaView,
    host_buffer,
)


class HostArena(Arena):
    """The broker's host arena: creates sealed memfd slabs and maps them into its own view."""

    backend = "host"
    fd_unit = "slab"

    def __init__(self, geometry: ArenaGeometry, name: str = "memory-broker") -> None:
        super().__init__(geometry, HostArenaView(geometry), name)

    def _create_slab(self, idx: int, have: int, slabs: int, prepared: object) -> int:
        """A sealed memfd of one slab, mapped into the broker's view; MemoryError naming the
        failed OS call (and nothing left open) otherwise."""
        g = self.geometry
        label = f"{self.name}-slab{idx}"
        call = f"memfd_create({label!r})"
        fd = -1
        try:
            fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            call = f"ftruncate(slab {idx}, {g.slab_size})"
            os.ftruncate(fd, g.slab_size)
            # Sealed so no holder of the fd can shrink it under another's mapping (SIGBUS).
            call = f"fcntl(slab {idx}, F_ADD_SEALS)"
            fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
            call = f"mmap(slab {idx} into the physical view)"
            self.view.attach_slab(idx, fd)
        except BaseException as e:
            if fd >= 0:
                os.close(fd)
            if isinstance(e, OSError):
                err = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
                raise MemoryError(f"{call} failed growing the arena from {have} to {have + slabs} slabs: {err}") from e
            raise
        return fd

    def _discard_slab(self, record: int) -> None:
        os.close(record)

    def slab_fd(self, slab_index: int) -> int:
        """The broker-held fd of a slab; callers duplicate it (SCM_RIGHTS does) and never close it."""
        self._check_open()
        if not 0 <= slab_index < len(self._slabs):
            raise ValueError(f"slab {slab_index} does not exist; the arena has {len(self._slabs)} slabs")
        return self._slabs[slab_index]

    def export_fds(self, first: int, count: int) -> list[int]:
        """Close-on-exec duplicates of slabs ``first..first+count-1``'s memfds (the caller's)."""
        out: list[int] = []
        with self._lock:
            self._check_open()
            self._check_units(first, count)
            try:
                for i in range(first, first + count):
                    out.append(os.dup(self._slabs[i]))
            except BaseException:
                for fd in out:
                    os.close(fd)
                raise
        return out


__all__ = ["HostArena", "HostArenaView", "host_buffer"]
