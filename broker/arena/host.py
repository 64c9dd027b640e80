"""The host arena: slabs are sealed memfds, mapped at fixed addresses with libc ``mmap``.

This module owns the host backend's address-space reservations, slab fds and page mappings
(``HostArenaView`` in every process, ``HostArena`` in the broker). It knows nothing of
objects, owners or which page is free; the page pool decides that, and it must not import
torch (clients wrap addresses themselves, see ``host_buffer``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

from memory_broker.broker.arena.base import Arena, ArenaGeometry, ArenaView

PROT_NONE = 0x0
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
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
MAP_FAILED: int = ctypes.c_void_p(-1).value  # type: ignore[assignment]


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


def _runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct pages as (first, count) runs of consecutive pages."""
    out: list[tuple[int, int]] = []
    for p in sorted(set(pages)):
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def host_buffer(address: int, nbytes: int) -> ctypes.Array[ctypes.c_uint8]:
    """A zero-copy, writable buffer over ``nbytes`` at ``address`` (``torch.frombuffer`` takes it).

    The buffer does not keep the mapping alive: once the view is closed or the range
    unmapped, touching it faults (SIGSEGV), so drop it first.
    """
    return (ctypes.c_uint8 * nbytes).from_address(address)


def _format_bytes(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n} B"


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
        os_page = mmap.PAGESIZE
        if geometry.page_size <= 0 or geometry.page_size % os_page:
            raise ValueError(f"page size {geometry.page_size} is not a positive multiple of the OS page size {os_page}")
        if geometry.pages_per_slab <= 0 or geometry.max_slabs <= 0 or geometry.window_pages <= 0:
            raise ValueError(
                f"geometry needs positive sizes: {geometry.pages_per_slab} pages per slab, "
                f"{geometry.max_slabs} slabs, {geometry.window_pages} window pages"
            )
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
    def phys_base(self) -> int:
        self._check_open()
        return self._phys_base

    @property
    def window_base(self) -> int:
        self._check_open()
        return self._window_base

    @property
    def mapped_slabs(self) -> int:
        return len(self._slabs)

    def attach_slab(self, slab_index: int, fd: int, *, readonly: bool = False) -> None:
        """Map the slab behind ``fd`` at its place in the physical view.

        Args:
            slab_index: must be ``mapped_slabs`` (slabs attach in order).
            fd: a memfd of at least ``slab_size`` bytes; the caller keeps it and may close it.
            readonly: map with PROT_READ only (and its window pages too).

        Raises:
            ValueError: out-of-order index, the arena is full, or the fd is too small.
            OSError: ``dup`` or ``mmap`` failed.
        """
        self._check_open()
        g = self.geometry
        if slab_index != len(self._slabs):
            raise ValueError(f"slab {slab_index} attached out of order: {len(self._slabs)} slabs are mapped")
        if slab_index >= g.max_slabs:
            raise ValueError(f"slab {slab_index} is past the arena's maximum of {g.max_slabs} slabs")
        size = os.fstat(fd).st_size
        if size < g.slab_size:
            # Touching a mapping past the file's end raises SIGBUS; refuse it here instead.
            raise ValueError(f"slab {slab_index} fd {fd} holds {size} bytes; a slab needs {g.slab_size}")
        own_fd = os.dup(fd)  # non-inheritable, so close-on-exec
        try:
            prot = PROT_READ if readonly else PROT_READ | PROT_WRITE
            _mmap(self._phys_base + slab_index * g.slab_size, g.slab_size, prot, MAP_SHARED | MAP_FIXED, own_fd, 0)
        except OSError:
            os.close(own_fd)
            raise
        self._slabs.append(_AttachedSlab(own_fd, readonly))

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
        mapped_pages = len(self._slabs) * g.pages_per_slab
        for i, p in enumerate(pages):
            if not 0 <= p < mapped_pages:
                raise ValueError(
                    f"physical page {p} (index {i}) is outside the {mapped_pages} pages of the "
                    f"{len(self._slabs)} mapped slabs"
                )
        self._forget_window(window_page, len(pages))
        ro_pages = self._readonly_pages
        try:
            start = 0
            while start < len(pages):
                first = pages[start]
                slab = first // g.pages_per_slab
                ro = first in ro_pages
                end = start + 1
                # Extend the run while the next page follows in the same slab file (with the same access).
                while (
                    end < len(pages) and pages[end] == pages[end - 1] + 1 and pages[end] // g.pages_per_slab == slab
                    and (pages[end] in ro_pages) == ro
                ):  # fmt: skip
                    end += 1
                s = self._slabs[slab]
                prot = PROT_READ if readonly or ro or s.readonly else PROT_READ | PROT_WRITE
                _mmap(
                    self._window_base + (window_page + start) * g.page_size,
                    (end - start) * g.page_size,
                    prot,
                    MAP_SHARED | MAP_FIXED,
                    s.fd,
                    (first % g.pages_per_slab) * g.page_size,
                )
                start = end
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
        g = self.geometry
        mapped_pages = len(self._slabs) * g.pages_per_slab
        for i, p in enumerate(pages):
            if not 0 <= p < mapped_pages:
                raise ValueError(
                    f"physical page {p} (index {i}) is outside the {mapped_pages} pages of the "
                    f"{len(self._slabs)} mapped slabs"
                )
        ro = self._readonly_pages
        if readonly:
            change = [p for p in pages if p not in ro]
        else:
            change = [p for p in pages if p in ro and not self._slabs[p // g.pages_per_slab].readonly]
        if not change:
            return
        prot = PROT_READ if readonly else PROT_READ | PROT_WRITE
        ps = g.page_size
        for first, count in _runs(change):
            _mprotect(self._phys_base + first * ps, count * ps, prot)
        windows = [w for p in set(change) for w in self._phys_windows.get(p, ())]
        for first, count in _runs(windows):
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
            os.close(s.fd)
        self._slabs.clear()
        self._readonly_pages.clear()
        self._window_phys.clear()
        self._phys_windows.clear()

    # ------------------------------------------------------------- internals

    def _detach_from(self, first_slab: int) -> None:
        """Unmap slabs ``first_slab..`` (their window pages must already be gone); for a failed grow."""
        g = self.geometry
        for slab in range(len(self._slabs) - 1, first_slab - 1, -1):
            self._reserve(self._phys_base + slab * g.slab_size, g.slab_size)
            os.close(self._slabs.pop().fd)

    def _reserve(self, addr: int, length: int) -> None:
        # MAP_FIXED over the range replaces whatever was there and keeps the addresses ours;
        # munmap would hand them back to the process for any other mmap to take.
        _mmap(addr, length, PROT_NONE, _RESERVE_FLAGS | MAP_FIXED, -1, 0)

    def _check_window_range(self, window_page: int, count: int) -> None:
        n = self.geometry.window_pages
        if window_page < 0 or count < 0 or window_page + count > n:
            raise ValueError(
                f"window pages {window_page}..{window_page + count} (count {count}) are outside the window of {n} pages"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this arena view is closed")


class HostArena(Arena):
    """The broker's host arena: creates sealed memfd slabs and maps them into its own view."""

    backend = "host"

    def __init__(self, geometry: ArenaGeometry, name: str = "memory-broker") -> None:
        self.geometry = geometry
        self.name = name
        self.view = HostArenaView(geometry)
        # The broker's slab fds, close-on-exec; shared with clients over SCM_RIGHTS.
        self._fds: list[int] = []
        self._closed = False

    @property
    def num_slabs(self) -> int:
        return len(self._fds)

    def grow(self, slabs: int) -> None:
        """Create ``slabs`` more sealed memfd slabs and map them into the broker's view.

        Raises:
            MemoryError: the arena would exceed ``geometry.max_slabs``, or an OS call failed
                (nothing this call created is left behind).
            ValueError: ``slabs`` is negative.
        """
        self._check_open()
        g = self.geometry
        if slabs < 0:
            raise ValueError(f"cannot grow by {slabs} slabs")
        have = len(self._fds)
        if have + slabs > g.max_slabs:
            raise MemoryError(
                f"arena at {have} of {g.max_slabs} slabs ({_format_bytes(have * g.slab_size)}); cannot grow by {slabs}"
            )
        created: list[int] = []
        try:
            for idx in range(have, have + slabs):
                label = f"{self.name}-slab{idx}"
                call = f"memfd_create({label!r})"
                try:
                    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                    created.append(fd)
                    call = f"ftruncate(slab {idx}, {g.slab_size})"
                    os.ftruncate(fd, g.slab_size)
                    # Sealed so no holder of the fd can shrink it under another's mapping (SIGBUS).
                    call = f"fcntl(slab {idx}, F_ADD_SEALS)"
                    fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
                    call = f"mmap(slab {idx} into the physical view)"
                    self.view.attach_slab(idx, fd)
                except OSError as e:
                    err = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
                    raise MemoryError(
                        f"{call} failed growing the arena from {have} to {have + slabs} slabs: {err}"
                    ) from e
        except BaseException:
            try:
                self.view._detach_from(have)
            finally:
                for fd in created:
                    os.close(fd)
            raise
        self._fds.extend(created)

    def slab_fd(self, slab_index: int) -> int:
        """The broker-held fd of a slab; callers duplicate it and never close it."""
        self._check_open()
        if not 0 <= slab_index < len(self._fds):
            raise ValueError(f"slab {slab_index} does not exist; the arena has {len(self._fds)} slabs")
        return self._fds[slab_index]

    def close(self) -> None:
        """Unmap the broker's view and close every slab fd. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.view.close()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this arena is closed")


__all__ = ["HostArena", "HostArenaView", "host_buffer"]
