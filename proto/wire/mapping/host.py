"""A process's view of a host arena: sealed memfd slabs mapped at fixed addresses with ``mmap``.

This module owns what every process (client or broker) does with a host arena's slab fds:
reserve address space, map slabs into the physical view and pages into the window, change
page access (``HostArenaView``), and the libc calls that do it. Creating and sealing slabs
is the broker's (``memory_broker.broker.arena.host``). It knows nothing of objects or owners,
must not import torch (clients wrap addresses themselves, see ``host_buffer``), and must not
import the daemon.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

from memory_broker.proto.wire.mapping.geometry import ArenaGeometry, check_geometry
from memory_broker.proto.wire.mapping.view import ArenaView, page_runs

PROT_NONE = 0x0
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MAP_POPULATE = 0x8000
# Older Pythons' fcntl lacks the sealing constants; the values are Linux's ABI.
F_ADD_SEALS: int = getattr(fcntl, "F_ADD_SEALS", 1033)
F_SEAL_SEAL: int = getattr(fcntl, "F_SEAL_SEAL", 1)
F_SEAL_SHRINK: int = getattr(fcntl, "F_SEAL_SHRINK", 2)
F_SEAL_GROW: int = getattr(fcntl, "F_SEAL_GROW", 4)

# A reservation is address space only: no memory and no swap is committed for it.
_RESERVE_FLAGS = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE

_libc = ctypes.CDLL(None, use_errno=True)
_libc_mmap = _libc.mmap
_libc_mmap.restype = ctypes.c_void_p
_libc_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc_munmap = _libc.munmap
_libc_munmap.restype = ctypes.c_int
_libc_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc_mprotect = _libc.mprotect
_libc_mprotect.restype = ctypes.c_int
_libc_mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc_madvise = _libc.madvise
_libc_madvise.restype = ctypes.c_int
_libc_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FAILED: int = ctypes.c_void_p(-1).value  # type: ignore[assignment]
# Linux >= 5.14: fault a range in, writable, without writing it (content is kept).
MADV_POPULATE_WRITE = 23


def _mmap(addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    """libc ``mmap``; returns the address or raises OSError naming the call.

    Every mapping in this module goes through here, so tests can count syscalls.
    """
    ctypes.set_errno(0)
    res = _libc_mmap(addr, length, prot, flags, fd, offset)
    if res is None or res == MAP_FAILED:
        err = ctypes.get_errno()
        at = "NULL" if addr is None else hex(addr)
        call = f"mmap({at}, {length}, prot={prot:#x}, flags={flags:#x}, fd={fd}, offset={offset})"
        raise OSError(err, f"{call}: {os.strerror(err)}")
    return res


def _munmap(addr: int, length: int) -> None:
    if _libc_munmap(addr, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap({addr:#x}, {length}): {os.strerror(err)}")


def _mprotect(addr: int, length: int, prot: int) -> None:
    if _libc_mprotect(addr, length, prot) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mprotect({addr:#x}, {length}, prot={prot:#x}): {os.strerror(err)}")


def madvise_populate_write(addr: int, length: int) -> None:
    """``madvise(MADV_POPULATE_WRITE)``: back ``[addr, addr+length)`` with memory and map it
    writable in this process, keeping its content; OSError naming the call otherwise (EINVAL
    before Linux 5.14)."""
    ctypes.set_errno(0)
    if _libc_madvise(addr, length, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({addr:#x}, {length}, MADV_POPULATE_WRITE): {os.strerror(err)}")


def host_buffer(address: int, nbytes: int) -> ctypes.Array[ctypes.c_uint8]:
    """A zero-copy, writable buffer over ``nbytes`` at ``address`` (``torch.frombuffer`` takes it).

    The buffer does not keep the mapping alive: once the view is closed or the range
    unmapped, touching it faults (SIGSEGV), so drop it first.
    """
    return (ctypes.c_uint8 * nbytes).from_address(address)


@dataclass(slots=True)
class _AttachedSlab:
    # This view's own dup of the slab fd (close-on-exec), for mapping pages into the window.
    fd: int
    # Mapped PROT_READ only; window mappings of its pages are read-only too.
    readonly: bool


class HostArenaView(ArenaView):
    """One process's physical view and window over memfd slabs, at addresses it reserved.

    Not thread-safe: callers serialize attach/map/unmap/close (the client does, under its
    mapping lock).
    """

    def __init__(self, geometry: ArenaGeometry) -> None:
        check_geometry(geometry, mmap.PAGESIZE, "this machine", "the OS page size")
        self.geometry = geometry
        self._phys_size = geometry.max_pages * geometry.page_size
        self._window_size = geometry.window_pages * geometry.page_size
        self._slabs: list[_AttachedSlab] = []
        # Physical pages made read-only by set_page_access (their window pages are too).
        self._readonly_pages: set[int] = set()
        # Window page -> the physical page mapped there, and the reverse (for set_page_access).
        self._window_phys: dict[int, int] = {}
        self._phys_windows: dict[int, set[int]] = {}
        self._closed = False
        self._phys_base = _mmap(None, self._phys_size, PROT_NONE, _RESERVE_FLAGS, -1, 0)
        try:
            self._window_base = _mmap(None, self._window_size, PROT_NONE, _RESERVE_FLAGS, -1, 0)
        except OSError:
            _munmap(self._phys_base, self._phys_size)
            raise

    @property
    def mapped_slabs(self) -> int:
        return len(self._slabs)

    def attach_slab(self, slab_index: int, fd: int, *, readonly: bool = False, populate: bool = False) -> None:
        """Map the slab behind ``fd`` at its place in the physical view.

        Args:
            slab_index: must be ``mapped_slabs`` (slabs attach in order).
            fd: a memfd of at least ``slab_size`` bytes; the caller keeps it and may close it.
            readonly: map with PROT_READ only (and its window pages too).
            populate: fill this process's page tables for the whole slab now (MAP_POPULATE),
                so later touches take no page faults; about 4x cheaper in all than faulting
                the pages in one by one (ops/bench/bench_host_populate.py).

        Raises:
            ValueError: out-of-order index, the arena is full, or the fd is too small.
            OSError: ``dup`` or ``mmap`` failed.
        """
        self._check_attach_index(slab_index)
        g = self.geometry
        size = os.fstat(fd).st_size
        if size < g.slab_size:
            # Touching a mapping past the file's end raises SIGBUS; refuse it here instead.
            raise ValueError(f"slab {slab_index} fd {fd} holds {size} bytes; a slab needs {g.slab_size}")
        own_fd = os.dup(fd)  # non-inheritable, so close-on-exec
        try:
            prot = PROT_READ if readonly else PROT_READ | PROT_WRITE
            flags = MAP_SHARED | MAP_FIXED | (MAP_POPULATE if populate else 0)
            _mmap(self._phys_base + slab_index * g.slab_size, g.slab_size, prot, flags, own_fd, 0)
        except OSError:
            os.close(own_fd)
            raise
        self._slabs.append(_AttachedSlab(own_fd, readonly))

    def slab_fd(self, slab_index: int) -> int:
        """This view's fd of an attached slab (the view keeps and closes it), e.g. to map one
        of its pages elsewhere (clients/kv_arena.py); -1 for another pool's slab."""
        return self._slabs[slab_index].fd

    def attach_hole(self, slab_index: int) -> None:
        """Slab ``slab_index`` exists but is not this process's to map (another tenant pool's,
        ``security.tenants``): its place in the physical view stays reserved and inaccessible,
        and any use of its pages is refused (``_page_problem``).

        Raises:
            ValueError: out-of-order index, or the arena is full.
        """
        self._check_attach_index(slab_index)
        self._slabs.append(_AttachedSlab(-1, True))

    def _range_usable(self, first: int, last: int) -> bool:
        # Another pool's slab (fd -1) anywhere: page by page.
        return super()._range_usable(first, last) and all(s.fd >= 0 for s in self._slabs)

    def _page_problem(self, page: int) -> str | None:
        why = super()._page_problem(page)
        if why is None and self._slabs[page // self.geometry.pages_per_slab].fd < 0:
            slab = page // self.geometry.pages_per_slab
            return f"in slab {slab}, which is another pool's: this process is not sent it (security.tenants)"
        return why

    def map_window(self, window_page: int, phys_pages: Sequence[int], *, readonly: bool = False) -> None:
        """Map ``phys_pages`` back to back at window pages ``window_page, window_page+1, ...``.

        Runs of consecutive pages within one slab become one mapping. Pages of a slab
        attached read-only, and pages ``set_page_access`` made read-only, are mapped
        read-only whatever ``readonly`` says.

        Raises:
            ValueError: the window range or a page is out of bounds (nothing is mapped).
            OSError: ``mmap`` failed; the range is left reserved and inaccessible.
        """
        self._check_open()
        pages = list(phys_pages)
        g = self.geometry
        self._check_window_range(window_page, len(pages))
        self._check_window_pages(pages)
        self._forget_window(window_page, len(pages))
        ro_pages = self._readonly_pages
        try:
            # One mapping per run of pages that follow each other in one slab file with one access.
            for start, first, n in page_runs(pages, g.pages_per_slab, key=ro_pages.__contains__):
                s = self._slabs[first // g.pages_per_slab]
                prot = PROT_READ if readonly or first in ro_pages or s.readonly else PROT_READ | PROT_WRITE
                _mmap(
                    self._window_base + (window_page + start) * g.page_size,
                    n * g.page_size,
                    prot,
                    MAP_SHARED | MAP_FIXED,
                    s.fd,
                    (first % g.pages_per_slab) * g.page_size,
                )
        except OSError:
            self._forget_window(window_page, len(pages))
            # A half-mapped range would alias pages nobody placed there; leave it inaccessible.
            try:
                self._reserve(self._window_base + window_page * g.page_size, len(pages) * g.page_size)
            except OSError:
                pass
            raise
        for i, p in enumerate(pages):
            self._window_phys[window_page + i] = p
            self._phys_windows.setdefault(p, set()).add(window_page + i)

    def reads_only(self, pages: Sequence[int]) -> bool:
        # One C call (no lock: a set read whole under the GIL), what ``set_page_access``
        # looks at first: a lookup of another session's objects usually finds them read-only.
        return self._readonly_pages.issuperset(pages)

    def set_page_access(self, pages: Sequence[int], readonly: bool) -> None:
        """Make physical ``pages`` read-only (PROT_READ) or writable again in this view: the
        physical view's pages and every window page mapping them (now, or later through
        ``map_window``). Pages already in the asked state cost nothing, so callers may pass
        every page they learn. Pages of a slab attached read-only stay read-only.

        Raises:
            ValueError: a page is outside the mapped slabs (nothing changed).
            OSError: ``mprotect`` failed.
        """
        self._check_open()
        ro = self._readonly_pages
        if readonly and ro.issuperset(pages):
            # Already read-only (a host slab attaches read-only: what a lookup of another
            # session's objects usually finds): no sort, check or mprotect.
            return
        g = self.geometry
        pages = self._access_pages(pages)
        if readonly:
            change = [p for p in pages if p not in ro]
        else:
            change = [p for p in pages if p in ro and not self._slabs[p // g.pages_per_slab].readonly]
        if not change:
            return
        prot = PROT_READ if readonly else PROT_READ | PROT_WRITE
        ps = g.page_size
        for _, first, count in page_runs(change):
            _mprotect(self._phys_base + first * ps, count * ps, prot)
        windows = sorted({w for p in change for w in self._phys_windows.get(p, ())})
        for _, first, count in page_runs(windows):
            _mprotect(self._window_base + first * ps, count * ps, prot)
        if readonly:
            ro.update(change)
        else:
            ro.difference_update(change)

    def readonly_pages(self) -> frozenset[int]:
        """Physical pages ``set_page_access`` made read-only (for checks and tests)."""
        return frozenset(self._readonly_pages)

    def _forget_window(self, window_page: int, count: int) -> None:
        for w in range(window_page, window_page + count):
            p = self._window_phys.pop(w, None)
            if p is not None:
                ws = self._phys_windows.get(p)
                if ws is not None:
                    ws.discard(w)
                    if not ws:
                        del self._phys_windows[p]

    def unmap_window(self, window_page: int, count: int) -> None:
        """Return window pages to reserved, inaccessible address space.

        Raises:
            ValueError: the range is outside the window.
        """
        self._check_open()
        self._check_window_range(window_page, count)
        if count:
            ps = self.geometry.page_size
            self._forget_window(window_page, count)
            self._reserve(self._window_base + window_page * ps, count * ps)

    def tensor(self, address: int, nbytes: int, dtype=None):
        import torch

        t = torch.frombuffer(host_buffer(address, nbytes), dtype=torch.uint8)
        return t if dtype is None or dtype == torch.uint8 else t.view(dtype)

    def close(self) -> None:
        """Unmap both ranges and close this view's slab fds. Idempotent.

        Buffers and tensors made over these addresses must be dropped first: touching them
        afterwards faults.
        """
        if self._closed:
            return
        self._closed = True
        _munmap(self._window_base, self._window_size)
        _munmap(self._phys_base, self._phys_size)
        for s in self._slabs:
            if s.fd >= 0:
                os.close(s.fd)
        self._slabs.clear()
        self._readonly_pages.clear()
        self._window_phys.clear()
        self._phys_windows.clear()

    # ------------------------------------------------------------- internals

    def detach_from(self, first_slab: int) -> None:
        """Unmap slabs ``first_slab..`` (their window pages must already be gone); for a failed grow."""
        g = self.geometry
        for slab in range(len(self._slabs) - 1, first_slab - 1, -1):
            self._reserve(self._phys_base + slab * g.slab_size, g.slab_size)
            fd = self._slabs.pop().fd
            if fd >= 0:
                os.close(fd)
            # Its pages are no longer this view's (set_page_access refuses them again).
            pps = g.pages_per_slab
            self._readonly_pages.difference_update(range(slab * pps, (slab + 1) * pps))

    def _reserve(self, addr: int, length: int) -> None:
        # MAP_FIXED over the range replaces whatever was there and keeps the addresses ours;
        # munmap would hand them back to the process for any other mmap to take.
        _mmap(addr, length, PROT_NONE, _RESERVE_FLAGS | MAP_FIXED, -1, 0)


__all__ = ["HostArenaView", "host_buffer"]
