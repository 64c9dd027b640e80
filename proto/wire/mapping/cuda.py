"""A process's view of a CUDA arena: one VMM allocation per page, imported from POSIX fds.

This module owns what every process (client or broker) does with a CUDA arena's pages,
through the driver API of ``cuda-python`` (``cuda.bindings.driver``, loaded here): address
reservations, one allocation handle per page, mappings, page access and the tensors over them
(``CudaArenaView``). Creating and exporting pages is the broker's
(``memory_broker.broker.arena.cuda``); checked driver calls and devices are
``cuda_driver``'s. It knows nothing of objects or owners and must not import the daemon.

**The design follows what the driver does on a real GPU** (FIELD-NOTES "CUDA VMM on a real
GPU", measured on an H200 by the probes in ``shared/gpu-probes``; this module itself has not
yet run on a GPU, only against the strict fake driver of ``tests/test_arena_cuda.py``):

* **Only whole allocations map**: ``cuMemMap`` of part of an allocation (any offset, or less
  than its size) is ``CUDA_ERROR_NOT_SUPPORTED``. So every arena page is its own
  ``cuMemCreate`` allocation (the page size a multiple of the device's granularity, 2 MiB on
  an H100/H200), and a slab is only the unit in which the broker creates pages. Each page maps
  whole: once at ``phys_base + p * page_size`` (the physical view) and once per window page
  that places it (the window gives a contiguous object one address range).
* **Access is set over whole mappings**: ``cuMemSetAccess`` over part of a mapping is
  ``CUDA_ERROR_INVALID_VALUE``, but one call may span many adjacent whole mappings (512 were
  measured). The view grants access with one call per contiguous run of pages of one access,
  never per page when a run will do.
* **Granting access the first time is the costly call**: 32-39 us per page even in 512-page
  calls (measured); setting it again is cheap; read-only back to read-write costs ~30 us per
  page. So pages are mapped read-only from the start where the caller knows they will be
  (``attach_pages(..., readonly=True)``: shared pages, adapters), not mapped writable and
  switched.
* **File descriptors within limits**: a GPU's free memory is ~39,000 pages (H100) or ~70,000
  (H200), more than ``RLIMIT_NOFILE`` (20,000 on the machine measured). ``attach_pages``
  takes ownership of the fds it is given and closes each as soon as it is imported (the
  imported handle keeps the memory), and the client imports pages lazily, when it is first
  given them (``missing_pages``), so connecting maps nothing. Measured per page: export
  31-77 us (broker), import 16 us, map 1.5-2.3 us, first access 32-39 us, unmap + release
  28-34 us; a client mapping a whole H200 eagerly would take 6-7 s.

Per page the view keeps its allocation handle (the imported one, or in the broker the
created one) until ``close``: mapping the page into the window later needs it, and keeping it
costs no memory lifetime (the physical mapping pins the allocation anyway).

Other rules:

* **Lifetimes.** Every tensor from ``tensor`` holds a lease (the ``__cuda_array_interface__``
  object torch keeps until the tensor's storage dies; slices and ``.view(dtype)`` share it).
  While a lease is alive nothing it covers is unmapped: replacing or unmapping window pages
  that a live tensor covers raises ``MappingInUse`` and changes nothing (after one
  ``gc.collect()`` for tensors held only by cycles); ``close`` closes the view at once but
  unmaps its memory only when the last lease goes.
* **Synchronization, scoped.** ``cuMemUnmap`` does not wait for the GPU, and a kernel still
  reading an unmapped range faults with a sticky ``CUDA_ERROR_ILLEGAL_ADDRESS``. The view
  keeps, per window page, the streams that used it (the stream each tensor over it was made
  on, and any named with ``record_stream``); unmapping window pages synchronizes exactly
  those streams, never the whole device. Only ``close`` synchronizes the context. Mapping
  calls run in ``CU_STREAM_CAPTURE_MODE_RELAXED`` so they do not invalidate a graph another
  thread is capturing.
* **CUDA graphs.** A graph that captured kernels over arena tensors must keep those tensors
  alive while it may be replayed; capture on the tensor's stream or name it with
  ``record_stream``; freeing objects whose window pages a stream is capturing over is refused
  with ``MappingInUse``.
* **Host-only helpers** must refuse this view (``host_addressable`` is False).
* **Primary context.** Views retain the device's primary context and push it current in the
  calling thread for the span of every entry point, popping it after: the thread's own
  current context (and so the CUDA runtime's, and torch's, current device) is as it was.
* **Devices** are chosen by index or by UUID (``GPU-...``); long-lived state should name the
  UUID (``CudaArena.device_id``).

Not thread-safe, like the host views: callers serialize import/map/unmap/close (a lease may
die in any thread; that only drops it from a weak set).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from memory_broker.proto.wire.mapping import geometry as _geometry
from memory_broker.proto.wire.mapping.cuda_driver import (
    CUDA_ERROR_DEINITIALIZED,
    CUDA_ERROR_NOT_INITIALIZED,
    CudaDevice,
    CudaError,
    CudaUnavailable,
    DeviceContext,
    MappingInUse,
    _init_driver,
    check,
    format_uuid,
    parse_device_spec,
    resolve_device,
)

# The torch-facing wrapper of a device range, under the name tests/test_arena_cuda.py uses.
from memory_broker.proto.wire.mapping.cuda_mappings import CudaTensors, Leases, WindowPage, WindowPages
from memory_broker.proto.wire.mapping.geometry import ArenaGeometry
from memory_broker.proto.wire.mapping.view import ArenaView, page_runs

log = logging.getLogger(__name__)


def _load_driver():
    """The ``cuda.bindings.driver`` module (tests replace this function with a fake driver).

    Raises:
        ImportError: cuda-python is not installed.
    """
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python < 12.6 spelled it so
    return driver


def cuda_available(device: str | int | None = "0") -> tuple[bool, str]:
    """Whether the CUDA arena can run on ``device`` here, and a sentence saying why (not).

    Side effects: at most ``cuInit(0)``; no context is created and nothing is allocated.
    """
    try:
        drv = _load_driver()
    except ImportError as e:
        return False, f"cuda-python is not installed ({e})"
    try:
        _init_driver(drv)
        info = resolve_device(drv, device)
    except (CudaUnavailable, ValueError) as e:
        return False, str(e)
    except CudaError as e:
        return False, f"cannot query CUDA device {device!r} ({e})"
    why = info.unsupported_reason()
    if why:
        return False, why
    return True, f"{info.describe()} supports VMM with POSIX fds"


def check_geometry(geometry: ArenaGeometry, granularity: int, where: str = "this device") -> None:
    """Refuse sizes the device cannot map: pages must be multiples of the CUDA granularity.

    Raises:
        ValueError: naming the size, the granularity and the nearest usable page size.
    """
    _geometry.check_geometry(geometry, granularity, where, "the CUDA allocation granularity")


# ----------------------------------------------------------------- views


class CudaArenaView(DeviceContext, CudaTensors, ArenaView):
    """One process's physical view and window over a CUDA arena's page allocations, at
    addresses it reserved. Pages are attached one by one, in any order (``attach_pages`` in a
    client, ``attach_handles`` in the broker).

    Its addresses are device addresses: ``host_addressable`` is False, and host-only helpers
    (which dereference arena addresses with ctypes or numpy) refuse it.

    Args:
        geometry: the broker's sizes; page size a multiple of the device's granularity.
        device: index or UUID (``GPU-...``) of the device, as this process numbers it.

    Raises:
        CudaUnavailable: cuda-python, the driver or the device is missing or lacks VMM/fd support.
        ValueError: a malformed device or a geometry the device cannot map.
        CudaError: a driver call failed.
    """

    host_addressable = False
    fd_unit = "page"

    def __init__(self, geometry: ArenaGeometry, device: str | int | None = "0") -> None:
        try:
            drv = _load_driver()
        except ImportError as e:
            raise CudaUnavailable(f"cuda-python is not installed ({e})") from None
        self.geometry = geometry
        self._closed = True  # until everything below is in place
        self._open_device(drv, device)
        d = self.device
        self._phys_base = self._window_base = 0
        try:
            with self.current():
                self._reserve_ranges()
        except BaseException:
            drv.cuDevicePrimaryCtxRelease(d.handle)
            raise
        # Per attached page: its allocation handle (owned by this view).
        self._handles: dict[int, Any] = {}
        # Attached pages mapped read-only in the physical view now.
        self._page_readonly: set[int] = set()
        # Slabs the broker has, as far as this view knows (its pages may be attached).
        self._known_slabs = 0
        self._window = WindowPages()
        self._leases = Leases()
        self._closed = False

    def _reserve_ranges(self) -> None:
        """The device's granularity checked against the geometry, and the physical view's and
        the window's address ranges reserved (neither left reserved if this raises)."""
        drv, d, g = self._drv, self.device, self.geometry
        self.granularity = self._check(
            f"cuMemGetAllocationGranularity(device {d.ordinal}, MINIMUM)",
            drv.cuMemGetAllocationGranularity(
                self.allocation_prop(), drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
        )
        check_geometry(g, int(self.granularity), d.describe())
        self._phys_size = g.max_pages * g.page_size
        self._window_size = g.window_pages * g.page_size
        self._phys_base = self._reserve(self._phys_size, "physical view")
        try:
            self._window_base = self._reserve(self._window_size, "window")
        except BaseException:
            drv.cuMemAddressFree(self._phys_base, self._phys_size)
            self._phys_base = 0
            raise

    def _reserve(self, size: int, what: str) -> int:
        drv = self._drv
        return int(self._check(f"cuMemAddressReserve({size} bytes, {what})", drv.cuMemAddressReserve(size, 0, 0, 0)))

    # ------------------------------------------------------------- pages

    @property
    def mapped_slabs(self) -> int:
        """Slabs the arena has as far as this view knows: their pages may be attached (and
        are, lazily, as ``missing_pages`` says)."""
        return self._known_slabs

    @property
    def attached_pages(self) -> int:
        """Pages imported (or, in the broker, created) and mapped in the physical view."""
        return len(self._handles)

    def extend(self, num_slabs: int) -> None:
        """The arena has (at least) ``num_slabs`` slabs now: their pages may be attached."""
        self._check_open()
        if num_slabs > self.geometry.max_slabs:
            raise ValueError(f"{num_slabs} slabs is past the arena's maximum of {self.geometry.max_slabs} slabs")
        self._known_slabs = max(self._known_slabs, num_slabs)

    def missing_pages(self, pages: Sequence[int]) -> list[int]:
        """The pages of ``pages`` not attached here yet, sorted and distinct.

        Raises:
            ValueError: a page is outside the slabs this view knows of.
        """
        n = self._known_slabs * self.geometry.pages_per_slab
        want = sorted(set(int(p) for p in pages))
        bad = [p for p in want if not 0 <= p < n]
        if bad:
            raise ValueError(
                f"page(s) {', '.join(map(str, bad[:5]))} are outside the {n} pages of the arena's {self._known_slabs} slabs"
            )
        return [p for p in want if p not in self._handles]

    def page_handle(self, page: int):
        """The allocation handle of an attached page (the broker exports it)."""
        h = self._handles.get(page)
        if h is None:
            raise ValueError(f"page {page} is not attached in this view")
        return h

    def attach_pages(self, first_page: int, fds: Sequence[int], *, readonly: bool = False) -> None:
        """Import the allocations behind ``fds`` as pages ``first_page, first_page+1, ...`` and
        map each whole into the physical view, with one ``cuMemSetAccess`` over the run.

        Takes ownership of ``fds``: each is closed as soon as it is imported (the imported
        handle keeps the memory), and every one is closed whatever happens.

        Args:
            first_page: the first page; all must be in known slabs and not attached yet.
            fds: POSIX fds exported by ``cuMemExportToShareableHandle``, one per page.
            readonly: grant read access only from the start (pages shared with others: a first
                grant costs the same either way, a later switch costs ~30 us per page).

        Raises:
            ValueError: a page outside the known slabs or attached already (nothing changed).
            CudaError: import, map or access failed (nothing of this call is left).
        """
        fds = list(fds)
        handles: list[Any] = []
        try:
            self._check_open()
            self._check_new_pages(first_page, len(fds))
            if not fds:
                return
            with self._relaxed_capture(), self.current():
                try:
                    while fds:
                        fd = fds.pop(0)
                        try:
                            handles.append(
                                self._check(
                                    f"cuMemImportFromShareableHandle(fd {fd}, page {first_page + len(handles)})",
                                    self._drv.cuMemImportFromShareableHandle(fd, self.fd_handle_type),
                                )
                            )
                        finally:
                            os.close(fd)
                    self._attach_run(first_page, handles, readonly)
                except BaseException:
                    for h in handles:  # released in the context, which the driver needs
                        self._drv.cuMemRelease(h)
                    raise
        finally:
            for fd in fds:
                os.close(fd)

    def attach_handles(self, first_page: int, handles: Sequence[Any], *, readonly: bool = False) -> None:
        """Map allocation handles (the broker's own, from ``cuMemCreate``) as pages
        ``first_page, ...``; on success the view owns them (released at close), on failure
        the caller still does. Extends the known slabs to cover them."""
        self._check_open()
        g = self.geometry
        end = first_page + len(handles)
        if end > g.max_pages:
            raise ValueError(f"pages {first_page}..{end - 1} are past the arena's maximum of {g.max_pages} pages")
        self._known_slabs = max(self._known_slabs, -(-end // g.pages_per_slab))
        self._check_new_pages(first_page, len(handles))
        with self._relaxed_capture(), self.current():
            self._attach_run(first_page, list(handles), readonly)

    def _check_new_pages(self, first_page: int, count: int) -> None:
        n = self._known_slabs * self.geometry.pages_per_slab
        if first_page < 0 or first_page + count > n:
            raise ValueError(
                f"pages {first_page}..{first_page + count - 1} are outside the {n} pages of the arena's "
                f"{self._known_slabs} slabs known here"
            )
        again = [p for p in range(first_page, first_page + count) if p in self._handles]
        if again:
            raise ValueError(f"page(s) {', '.join(map(str, again[:5]))} are attached already")

    def _attach_run(self, first_page: int, handles: list[Any], readonly: bool) -> None:
        ps = self.geometry.page_size
        what = f"pages {first_page}..{first_page + len(handles) - 1}"
        self._map_run(self._phys_base + first_page * ps, handles, ps, readonly, what)
        for i, h in enumerate(handles):
            self._handles[first_page + i] = h
        if readonly:
            self._page_readonly.update(range(first_page, first_page + len(handles)))

    def _range_usable(self, first: int, last: int) -> bool:
        return False  # pages are attached one by one: checked page by page

    def _page_problem(self, page: int) -> str | None:
        why = super()._page_problem(page)
        if why is None and page not in self._handles:
            why = "not attached in this view yet (attach_pages first)"
        return why

    def detach_from(self, first_slab: int) -> None:
        """Unmap and release the pages of slabs ``first_slab..`` (a failed grow; they have no
        window pages)."""
        g = self.geometry
        first = first_slab * g.pages_per_slab
        with self.current():
            for p in sorted((p for p in self._handles if p >= first), reverse=True):
                self._drv.cuMemUnmap(self._phys_base + p * g.page_size, g.page_size)
                self._drv.cuMemRelease(self._handles.pop(p))
                self._page_readonly.discard(p)
        self._known_slabs = min(self._known_slabs, first_slab)

    # ------------------------------------------------------------- the window

    def map_window(self, window_page: int, phys_pages: Sequence[int], *, readonly: bool = False) -> None:
        """Map ``phys_pages`` (attached pages) back to back at window pages ``window_page, ...``.

        One ``cuMemMap`` per page (each is its own allocation) and one ``cuMemSetAccess`` per
        contiguous run of one access. Pages that are read-only here (``set_page_access`` or
        ``attach_pages(readonly=True)``) map read-only, and every page does with ``readonly``.
        Window pages mapped before are replaced, after synchronizing the streams that used them.

        Raises:
            ValueError: the window range or a page is out of bounds or not attached (nothing
                is changed).
            MappingInUse: a live tensor covers a mapping this would replace, or a stream that
                used one is capturing a graph (nothing is changed).
            CudaError: a driver call failed; the range is left unmapped (reserved).
        """
        self._check_open()
        pages = [int(p) for p in phys_pages]
        self._check_window_range(window_page, len(pages))
        self._check_window_pages(pages)
        if not pages:
            return
        ps = self.geometry.page_size
        with self._relaxed_capture(), self.current():
            self._clear_window(window_page, len(pages))
            ro = [readonly or p in self._page_readonly for p in pages]
            added: list[int] = []
            try:
                for off, _, n in page_runs(range(len(pages)), key=ro.__getitem__):
                    w = window_page + off
                    run = pages[off : off + n]
                    what = f"window pages {w}..{w + n - 1} <- pages {run[0]}.."
                    self._map_run(self._window_base + w * ps, [self._handles[p] for p in run], ps, ro[off], what)
                    for i, p in enumerate(run):
                        self._window.add(w + i, WindowPage(p, readonly, ro[off]))
                        added.append(w + i)
            except BaseException:
                # Nothing mapped by this call was handed out yet: undo it without a synchronize.
                for w in added:
                    self._window.remove(w)
                    self._drv.cuMemUnmap(self._window_base + w * ps, ps)
                raise

    def unmap_window(self, window_page: int, count: int) -> None:
        """Return window pages to reserved, inaccessible address space (one ``cuMemUnmap`` per
        mapped page), after synchronizing the streams that used them.

        Raises:
            ValueError: the range is outside the window.
            MappingInUse: a live tensor covers a page in the range, or a stream that used one
                is capturing a graph (nothing is changed).
            CudaError: a driver call failed.
        """
        self._check_open()
        self._check_window_range(window_page, count)
        if count:
            with self._relaxed_capture(), self.current():
                self._clear_window(window_page, count)

    def window_pages(self) -> list[tuple[int, int, bool]]:
        """The window's mappings as ``(window_page, physical page, read-only)``, in order."""
        return [(w, wp.phys, wp.readonly) for w, wp in self._window]

    def _clear_window(self, window_page: int, count: int) -> None:
        """Unmap whatever is mapped in ``[window_page, window_page + count)``."""
        hit = self._window.mapped_in(window_page, count)
        if not hit:
            return
        ps = self.geometry.page_size
        live = self._leases.live(self._window_base + hit[0] * ps, self._window_base + (hit[-1] + 1) * ps)
        if live:
            raise MappingInUse(
                f"cannot unmap window pages {window_page}..{window_page + count}: {self._describe_leases(live)} "
                "still alive over them; drop them first (a tensor over a freed object must not outlive it); "
                "nothing was changed"
            )
        streams = self._window.streams(hit)
        if streams:
            self._sync_streams(streams, f"unmapping window pages {window_page}..{window_page + count}")
        for w in hit:
            self._check(f"cuMemUnmap(window page {w})", self._drv.cuMemUnmap(self._window_base + w * ps, ps))
            self._window.remove(w)

    # ------------------------------------------------------------- access

    def set_page_access(self, pages: Sequence[int], readonly: bool) -> None:
        """Make attached ``pages`` read-only (or writable again) in this process: in the
        physical view and in every window page mapping them (now, and when mapped later).

        Only pages whose access changes are touched, one ``cuMemSetAccess`` per contiguous
        run of them (each page is a whole mapping; a run spans adjacent ones). Window pages
        mapped with ``map_window(readonly=True)`` stay read-only.

        Raises:
            ValueError: a page is not attached here (nothing is changed).
            CudaError: a driver call failed.
        """
        self._check_open()
        want = self._access_pages(pages)
        change = [p for p in want if (p in self._page_readonly) != readonly]
        if not change:
            return
        ps = self.geometry.page_size
        with self._relaxed_capture(), self.current():
            for _, first, n in page_runs(change):
                self._set_access(self._phys_base + first * ps, n * ps, readonly, f"pages {first}..{first + n - 1}")
                if readonly:
                    self._page_readonly.update(range(first, first + n))
                else:
                    self._page_readonly.difference_update(range(first, first + n))
            ws = [w for w in self._window.windows_of(change) if not self._window.get(w).forced_ro]
            for _, w, n in page_runs(ws):
                self._set_access(self._window_base + w * ps, n * ps, readonly, f"window pages {w}..{w + n - 1}")
                for i in range(n):
                    self._window.get(w + i).readonly = readonly

    def readonly_pages(self) -> frozenset[int]:
        """Attached pages that are read-only in the physical view (for checks and tests)."""
        return frozenset(self._page_readonly)

    # ------------------------------------------------------------- closing

    def close(self) -> None:
        """Synchronize, unmap the window and the pages, release the handles and both
        reservations, and release the primary context. Idempotent.

        The view is closed at once (every later call is refused), but its memory is unmapped
        only when nothing references it: while tensors from ``tensor`` live, the teardown
        waits and runs when the last of them is dropped (errors then are logged). Without live
        tensors it runs now, best effort: every step is tried; the first error (other than a
        driver already torn down at exit) is raised at the end.
        """
        if self._closed:
            return
        self._closed = True
        live = self._leases.live(0, 1 << 64)
        if live:
            log.info("arena view close deferred: %s still alive", self._describe_leases(live))
            self._leases.when_gone(live, self._teardown)
            return
        self._teardown()

    def _teardown(self) -> None:
        drv, ps = self._drv, self.geometry.page_size
        errors: list[CudaError] = []

        def attempt(call: str, fn, *args) -> bool:
            try:
                self._check(call, fn(*args))
                return True
            except CudaError as e:
                if e.code not in (CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_NOT_INITIALIZED):
                    errors.append(e)
                return False

        # The teardown may run in any thread (where the last lease died): its context is
        # pushed over that thread's own and popped after the last call that needs it.
        pushed = attempt("cuCtxPushCurrent(primary context)", drv.cuCtxPushCurrent, self._ctx)
        attempt("cuCtxSynchronize() before closing the arena view", drv.cuCtxSynchronize)
        for w, _ in self._window:
            attempt(f"cuMemUnmap(window page {w})", drv.cuMemUnmap, self._window_base + w * ps, ps)
        self._window.clear()
        for p in sorted(self._handles):
            attempt(f"cuMemUnmap(page {p})", drv.cuMemUnmap, self._phys_base + p * ps, ps)
        for p, h in sorted(self._handles.items()):
            attempt(f"cuMemRelease(page {p})", drv.cuMemRelease, h)
        self._handles.clear()
        self._page_readonly.clear()
        attempt("cuMemAddressFree(window)", drv.cuMemAddressFree, self._window_base, self._window_size)
        attempt("cuMemAddressFree(physical view)", drv.cuMemAddressFree, self._phys_base, self._phys_size)
        if pushed:
            attempt("cuCtxPopCurrent(primary context)", drv.cuCtxPopCurrent)
        attempt(
            f"cuDevicePrimaryCtxRelease(device {self.device.ordinal})",
            drv.cuDevicePrimaryCtxRelease,
            self.device.handle,
        )
        if errors:
            raise errors[0]


__all__ = [
    "CudaArenaView",
    "CudaDevice",
    "CudaError",
    "CudaUnavailable",
    "MappingInUse",
    "check",
    "check_geometry",
    "cuda_available",
    "format_uuid",
    "parse_device_spec",
    "resolve_device",
]
