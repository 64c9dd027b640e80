"""The host arena's owner side: the broker creates slabs as sealed memfds and exports their fds.

This module owns the broker's host slabs (``HostArena``: create, seal, map into its own view,
hand out fds, and populate them off the request path). Mapping slabs and pages is the view's, shared with clients
(``memory_broker.proto.wire.mapping.host``); growth's bookkeeping is the base ``Arena``'s. It knows
nothing of objects, owners or which page is free, and must not import torch.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import queue
import threading

from memory_broker.broker.arena.base import Arena
from memory_broker.broker.arena.machine import MachineMemory
from memory_broker.proto.wire.mapping.geometry import ArenaGeometry
from memory_broker.proto.wire.mapping.host import (
    F_ADD_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    HostArenaView,
    host_buffer,
    madvise_populate_write,
)

# Populated per lock hold (the close waits for at most one chunk).
POPULATE_CHUNK = 4 << 20
OS_PAGE = mmap.PAGESIZE


log = logging.getLogger(__name__)


class HostArena(Arena):
    """The broker's host arena: creates sealed memfd slabs and maps them into its own view.

    Each slab a grow adds is populated in a background thread (``MADV_POPULATE_WRITE`` on the
    broker's mapping, in chunks: the kernel allocates and zeroes every page once, content
    kept), so no request pays for a fresh page's allocation and zeroing on first touch
    (``fallocate`` would not do: shmem defers the zeroing of fallocated pages to first use). A grow returns at once; ``wait_populated`` waits for it. The
    memory is the arena's configured size: slabs grow only as pages are needed (or by
    ``preallocate`` at start), and a slab's pages are backed from its growth on.

    Since every grown page is backed, the machine bounds the arena: a maximum larger than
    its memory (or its cgroup's ``memory.max``) is refused at construction, and a grow that
    its memory cannot back now is refused before any slab is made (``machine.py``).
    """

    backend = "host"
    fd_unit = "slab"

    def __init__(self, geometry: ArenaGeometry, name: str = "memory-broker", *, populate: bool = True) -> None:
        """A host arena of ``geometry``'s sizes; no slab is made yet.

        Raises:
            ValueError: the geometry's maximum is more than the machine's memory or its cgroup's limit.
        """
        MachineMemory.read().check_pool(geometry.max_slabs * geometry.slab_size)
        super().__init__(geometry, HostArenaView(geometry), name)
        self.populate = populate
        # Slabs whose memfds are populated (in order) and the thread doing it.
        self._populated = 0
        self._populate_cv = threading.Condition()
        self._populate_q: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._populate_thread: threading.Thread | None = None
        self._populate_lock = threading.Lock()
        self._madvise_ok = True

    def grow(self, slabs: int) -> None:
        """``Arena.grow``, refused first (MemoryError, with the numbers) when the machine or
        the broker's cgroup cannot back ``slabs`` more slabs now: the populate thread would
        otherwise take them past physical memory, into the OOM killer."""
        if slabs > 0:
            g = self.geometry
            backed = self._populated if self.populate else 0
            MachineMemory.read().check_grow(slabs * g.slab_size, len(self._slabs) * g.slab_size, backed * g.slab_size)
        super().grow(slabs)

    @property
    def populated_slabs(self) -> int:
        """Slabs whose pages are all backed by memory (the first ``populated_slabs``)."""
        return self._populated

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Wait until every slab grown so far is populated; False on timeout or when closed first."""
        with self._populate_cv:
            return self._populate_cv.wait_for(
                lambda: self._populated >= len(self._slabs) or self._closed or not self.populate, timeout
            )

    def _grown(self, first: int, count: int) -> None:
        if not self.populate or count == 0:
            return
        for i in range(first, first + count):
            self._populate_q.put(i)
        if self._populate_thread is None:
            self._populate_thread = threading.Thread(
                target=self._populate_loop, name=f"{self.name}-populate", daemon=True
            )
            self._populate_thread.start()

    def _populate_loop(self) -> None:
        g = self.geometry
        chunk = max(g.page_size, POPULATE_CHUNK - POPULATE_CHUNK % g.page_size)
        while True:
            idx = self._populate_q.get()
            if idx is None:
                return
            base = idx * g.slab_size
            for off in range(0, g.slab_size, chunk):
                # Under the lock close takes first: the range is never unmapped mid-call.
                with self._populate_lock:
                    if self._closed:
                        return
                    self._populate_range(idx, self.view.phys_base + base + off, min(chunk, g.slab_size - off))
            with self._populate_cv:
                self._populated = idx + 1
                self._populate_cv.notify_all()

    def _populate_range(self, idx: int, addr: int, length: int) -> None:
        """Fault ``[addr, addr+length)`` of the broker's view in (allocated and zeroed by the
        kernel, content kept): MADV_POPULATE_WRITE, else a read of each OS page (Linux < 5.14;
        a shared memfd page is allocated on a read fault too, and reading changes nothing)."""
        if self._madvise_ok:
            try:
                madvise_populate_write(addr, length)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    log.warning(
                        "populating slab %d of arena %s failed (%s); its pages fault in on first use", idx, self.name, e
                    )
                    return
                self._madvise_ok = False  # this kernel has no MADV_POPULATE_WRITE
        for a in range(addr, addr + length, OS_PAGE):
            ctypes.c_uint8.from_address(a).value  # noqa: B018  (the read is the point)

    def close(self) -> None:
        with self._populate_lock:
            super().close()
        if self._populate_thread is not None:
            self._populate_q.put(None)
        with self._populate_cv:
            self._populate_cv.notify_all()

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
