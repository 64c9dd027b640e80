"""A process's view of a CUDA arena: VMM slabs (``cuMemCreate``) imported from POSIX fds.

This module owns what every process (client or broker) does with a CUDA arena's slab fds,
through the driver API of ``cuda-python`` (``cuda.bindings.driver``, loaded here): address
reservations, imported slab handles, mappings, page access and the tensors over them
(``CudaArenaView``). Creating and exporting slabs is the broker's
(``memory_broker.broker.arena.cuda``); checked driver calls and devices are
``cuda_driver``'s. It knows nothing of objects or owners and must not import the daemon.

The call sequence follows NVIDIA's memMapIPCDrv sample (see FIELD-NOTES "CUDA VMM from
Python"):

* broker: ``cuMemCreate`` (pinned device memory, ``requestedHandleTypes`` POSIX fd) ->
  ``cuMemExportToShareableHandle`` -> an fd that the fd channel sends with SCM_RIGHTS;
* every process: ``cuMemAddressReserve`` for the physical view and for the window;
  ``cuMemImportFromShareableHandle(fd)`` -> ``cuMemMap`` at ``phys_base + i * slab_size`` ->
  ``cuMemSetAccess`` (new mappings have no access, and the importer must grant it itself).

Design choices:

* **Handle retention.** A view keeps each slab's allocation handle (the imported one, or in
  the broker the created one) until ``close``, instead of releasing it right after the
  physical-view mapping. The window maps page-sized sub-ranges of a slab later
  (``cuMemMap(va, size, offset, handle, 0)`` with a non-zero offset), which needs a handle;
  keeping it costs nothing in memory lifetime (the physical-view mapping pins the allocation
  until ``close`` anyway) and saves an import per window mapping. The fd a slab arrived on
  is the caller's and may be closed as soon as ``attach_slab`` returns.
* **Unmap only whole mappings.** ``cuMemUnmap`` cannot unmap part of a mapping, so the view
  records every window mapping (a run of consecutive physical pages of one slab) as a
  segment. Unmapping or re-mapping part of a segment unmaps the whole segment and maps its
  remainders again, from the same handle and offsets.
* **Lifetimes.** Every tensor from ``tensor`` holds a lease (the ``__cuda_array_interface__``
  object torch keeps until the tensor's storage dies; slices and ``.view(dtype)`` share it).
  While a lease is alive nothing it covers is unmapped: replacing or unmapping window pages
  that a live tensor covers raises ``MappingInUse`` and changes nothing (after one
  ``gc.collect()`` for tensors held only by cycles); ``close`` closes the view at once but
  unmaps its memory only when the last lease goes. A use of memory the view cannot see (a raw address handed to another library)
  is the caller's to finish before the pages are freed.
* **Synchronization, scoped.** ``cuMemUnmap`` does not wait for the GPU, and a kernel still
  reading an unmapped range faults with a sticky ``CUDA_ERROR_ILLEGAL_ADDRESS``. The view
  keeps, per window mapping, the streams that used it: the stream each tensor over it was
  made on (torch's current stream) and any stream named with ``record_stream``. Unmapping window pages synchronizes exactly those streams of
  the mappings it removes (``cuStreamSynchronize``), and nothing when no tensor ever covered
  them; it never synchronizes the whole device (``cuCtxSynchronize`` stalls every stream and
  fails during another thread's graph capture), so the client's allocation path and event
  thread stay clear of other streams. Only ``close`` (teardown) synchronizes the context.
  Mapping calls switch the calling thread to ``CU_STREAM_CAPTURE_MODE_RELAXED`` for their
  duration, so they do not invalidate a graph another thread is capturing.
* **CUDA graphs.** (1) A graph that captured kernels over arena tensors must keep those
  tensors (or one tensor over the same range) alive for as long as it may be replayed: the
  lease is what stops the range being unmapped under a replay. (2) Capture on the stream the
  tensor was made on, or name the capture stream with ``record_stream``. (3) Do not free or
  replace objects whose window pages a stream is capturing over: the unmap refuses with
  ``MappingInUse`` (it cannot synchronize a capturing stream) rather than break the capture.
  (4) Mapping new slabs and window pages during a capture is allowed (relaxed mode above).
* **Read-only pages.** ``set_page_access`` makes physical pages read-only (or writable again)
  in this process: ``cuMemSetAccess`` on their ranges in the physical view and in every window
  mapping that covers them, now and when they are mapped into the window later. A kernel
  writing them faults (sticky, like any illegal address), so a client cannot overwrite shared
  adapter pages.
* **Host-only helpers.** The addresses are device addresses: code that dereferences arena
  addresses on the host (``ctypes``/``numpy`` over ``page_address``) must refuse a view whose
  ``host_addressable`` is False, as this one's is.
* **Primary context.** Views retain the device's primary context (the one the CUDA runtime
  and torch use) and make it current in the calling thread on every entry point, because
  the current context is per thread (the client maps new slabs from its event thread).
* **Devices** are chosen by index or by UUID (``GPU-...`` as nvidia-smi prints it); an
  index is the process's own (``CUDA_VISIBLE_DEVICES`` renumbers), so long-lived state
  should name the UUID (``CudaArena.device_id``).

Not thread-safe, like the host views: callers serialize attach/map/unmap/close (a lease may
die in any thread; that only drops it from a weak set).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from memory_broker.proto.wire.mapping import geometry as _geometry
from memory_broker.proto.wire.mapping.cuda_driver import (
    CUDA_ERROR_DEINITIALIZED,
    CUDA_ERROR_INVALID_VALUE,
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
from memory_broker.proto.wire.mapping.cuda_mappings import CudaArrayInterface as _CudaArrayInterface  # noqa: F401
from memory_broker.proto.wire.mapping.cuda_mappings import CudaTensors, Leases, Segment, WindowSegments
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
    """One process's physical view and window over CUDA VMM slabs, at addresses it reserved.

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
            self.make_current()
            self.granularity = self._check(
                f"cuMemGetAllocationGranularity(device {d.ordinal}, MINIMUM)",
                drv.cuMemGetAllocationGranularity(
                    self.allocation_prop(), drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
            )
            check_geometry(geometry, int(self.granularity), d.describe())
            self._phys_size = geometry.max_pages * geometry.page_size
            self._window_size = geometry.window_pages * geometry.page_size
            self._phys_base = int(
                self._check(
                    f"cuMemAddressReserve({self._phys_size} bytes, physical view)",
                    drv.cuMemAddressReserve(self._phys_size, 0, 0, 0),
                )
            )
            self._window_base = int(
                self._check(
                    f"cuMemAddressReserve({self._window_size} bytes, window)",
                    drv.cuMemAddressReserve(self._window_size, 0, 0, 0),
                )
            )
        except BaseException:
            if self._phys_base:
                drv.cuMemAddressFree(self._phys_base, self._phys_size)
            drv.cuDevicePrimaryCtxRelease(d.handle)
            raise
        # Per attached slab: its allocation handle (owned by this view) and read-only flag.
        self._handles: list[Any] = []
        self._slab_readonly: list[bool] = []
        # Window mappings and the streams that used them.
        self._window = WindowSegments()
        # Live tensors' leases.
        self._leases = Leases()
        # Physical pages made read-only with set_page_access.
        self._page_readonly: set[int] = set()
        self._closed = False

    # ------------------------------------------------------------- properties

    @property
    def mapped_slabs(self) -> int:
        return len(self._handles)

    # ------------------------------------------------------------- mapping

    def attach_slab(self, slab_index: int, fd: int, *, readonly: bool = False) -> None:
        """Import the slab behind ``fd`` and map it at its place in the physical view.

        Args:
            slab_index: must be ``mapped_slabs`` (slabs attach in order).
            fd: a POSIX fd exported by ``cuMemExportToShareableHandle``; the caller keeps it
                and may close it once this returns (the view keeps the imported handle).
            readonly: grant read access only (and to its window pages too).

        Raises:
            ValueError: out-of-order index, or the arena is full.
            CudaError: import, map or access failed (nothing is left mapped or imported).
        """
        self._check_attach_index(slab_index)
        self.make_current()
        with self._relaxed_capture():
            handle = self._check(
                f"cuMemImportFromShareableHandle(fd {fd}, slab {slab_index})",
                self._drv.cuMemImportFromShareableHandle(fd, self.fd_handle_type),
            )
            try:
                self.attach_handle(slab_index, handle, readonly=readonly)
            except BaseException:
                self._drv.cuMemRelease(handle)
                raise

    def map_window(self, window_page: int, phys_pages: Sequence[int], *, readonly: bool = False) -> None:
        """Map ``phys_pages`` back to back at window pages ``window_page, window_page+1, ...``.

        Runs of consecutive pages within one slab become one ``cuMemMap`` (at the run's offset
        into the slab's allocation) and one ``cuMemSetAccess``. Window pages mapped before are
        replaced, after synchronizing the streams that used them (see the module notes). Pages
        of a read-only slab, and pages made read-only with ``set_page_access``, map read-only.

        Raises:
            ValueError: the window range or a page is out of bounds (nothing is changed).
            MappingInUse: a live tensor covers a mapping this would replace, or a stream that
                used one is capturing a graph (nothing is changed).
            CudaError: a driver call failed; the range is left unmapped (reserved).
        """
        self._check_open()
        pages = list(phys_pages)
        g = self.geometry
        self._check_window_range(window_page, len(pages))
        self._check_window_pages(pages)
        if not pages:
            return
        self.make_current()
        with self._relaxed_capture():
            self._clear_window(window_page, len(pages))
            added: list[int] = []
            try:
                for off, first, n in page_runs(pages, g.pages_per_slab):
                    slab, slab_page = divmod(first, g.pages_per_slab)
                    ro = readonly or self._slab_readonly[slab]
                    start = window_page + off
                    seg = Segment(n, slab, slab_page, ro)
                    self._map(
                        self._window_base + start * g.page_size,
                        n * g.page_size,
                        slab_page * g.page_size,
                        self._handles[slab],
                        ro,
                        f"window pages {start}..{start + n} <- slab {slab} page {slab_page}",
                    )
                    self._window.add(start, seg)
                    added.append(start)
                    self._protect_segment(start, seg)
            except BaseException:
                # Nothing mapped by this call was handed out yet: undo it without a synchronize.
                for start in added:
                    seg = self._window.remove(start)
                    self._drv.cuMemUnmap(self._window_base + start * g.page_size, seg.count * g.page_size)
                raise

    def unmap_window(self, window_page: int, count: int) -> None:
        """Return window pages to reserved, inaccessible address space.

        Synchronizes first the streams that used the mappings it removes (none when no
        tensor ever covered them): ``cuMemUnmap`` does not wait for the GPU.

        Raises:
            ValueError: the range is outside the window.
            MappingInUse: a live tensor covers a mapping in the range, or a stream that used
                one is capturing a graph (nothing is changed).
            CudaError: a driver call failed.
        """
        self._check_open()
        self._check_window_range(window_page, count)
        if count:
            self.make_current()
            with self._relaxed_capture():
                self._clear_window(window_page, count)

    def set_page_access(self, pages: Sequence[int], readonly: bool) -> None:
        """Make physical ``pages`` read-only (or writable again) in this process.

        Applies ``cuMemSetAccess`` to the pages' ranges in the physical view and in every
        window mapping that covers them, and remembers the pages so later window mappings of
        them are read-only too. A page of a slab attached read-only, or in a window mapped
        read-only, stays read-only when ``readonly`` is False.

        Raises:
            ValueError: a page is not in a mapped slab (nothing is changed).
            CudaError: a driver call failed.
        """
        self._check_open()
        want = self._access_pages(pages)
        g = self.geometry
        if not want:
            return
        self.make_current()
        ps, pps = g.page_size, g.pages_per_slab
        with self._relaxed_capture():
            for _, first, n in page_runs(want, pps):
                if readonly or not self._slab_readonly[first // pps]:
                    try:
                        self._set_access(self._phys_base + first * ps, n * ps, readonly, f"pages {first}..{first + n}")
                    except CudaError as e:
                        if e.code != CUDA_ERROR_INVALID_VALUE or n == pps:
                            raise
                        # Not yet seen on a GPU: whether the driver takes access flags for
                        # part of a mapping (the physical view maps each slab whole).
                        raise CudaError(f"{e.call} (part of slab {first // pps}'s mapping)", e.code, e.name) from None
            if readonly:
                self._page_readonly.update(want)
            else:
                self._page_readonly.difference_update(want)
            chosen = set(want)
            for start, seg in self._window:
                if seg.readonly:
                    continue
                base = seg.slab * pps + seg.slab_page
                hit = [start + i for i in range(seg.count) if base + i in chosen]
                for _, w, n in page_runs(hit):
                    self._set_access(self._window_base + w * ps, n * ps, readonly, f"window pages {w}..{w + n}")

    def window_segments(self) -> list[tuple[int, int, int, int]]:
        """The window's mappings as ``(window_page, count, slab, slab_page)``, in order (diagnostics)."""
        return [(s, seg.count, seg.slab, seg.slab_page) for s, seg in self._window]

    def close(self) -> None:
        """Synchronize, unmap the window and the slabs, release the handles and both
        reservations, and release the primary context. Idempotent.

        The view is closed at once (every later call is refused), but its memory is unmapped
        only when nothing references it: while tensors from ``tensor`` live, the teardown
        waits and runs when the last of them is dropped (in the thread that drops it;
        errors then are logged). Without live tensors it runs now, best effort: every step
        is tried; the first error (other than a driver already torn down at exit) is
        raised at the end. This teardown is the one place that synchronizes the whole
        context.
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
        drv, g = self._drv, self.geometry
        errors: list[CudaError] = []

        def attempt(call: str, fn, *args) -> None:
            try:
                self._check(call, fn(*args))
            except CudaError as e:
                if e.code not in (CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_NOT_INITIALIZED):
                    errors.append(e)

        attempt("cuCtxSetCurrent(primary context)", drv.cuCtxSetCurrent, self._ctx)
        attempt("cuCtxSynchronize() before closing the arena view", drv.cuCtxSynchronize)
        for start, seg in self._window:
            attempt(
                f"cuMemUnmap(window pages {start}..{start + seg.count})",
                drv.cuMemUnmap,
                self._window_base + start * g.page_size,
                seg.count * g.page_size,
            )
        self._window.clear()
        for i in range(len(self._handles)):
            attempt(f"cuMemUnmap(slab {i})", drv.cuMemUnmap, self._phys_base + i * g.slab_size, g.slab_size)
        for i, h in enumerate(self._handles):
            attempt(f"cuMemRelease(slab {i})", drv.cuMemRelease, h)
        self._handles.clear()
        self._slab_readonly.clear()
        attempt("cuMemAddressFree(window)", drv.cuMemAddressFree, self._window_base, self._window_size)
        attempt("cuMemAddressFree(physical view)", drv.cuMemAddressFree, self._phys_base, self._phys_size)
        attempt(
            f"cuDevicePrimaryCtxRelease(device {self.device.ordinal})",
            drv.cuDevicePrimaryCtxRelease,
            self.device.handle,
        )
        if errors:
            raise errors[0]

    # ------------------------------------------------------------- internals

    def _protect_segment(self, start: int, seg: Segment) -> None:
        """Make the pages of a (read-write) window mapping that ``set_page_access`` made
        read-only read-only here too."""
        if seg.readonly or not self._page_readonly:
            return
        g = self.geometry
        base = seg.slab * g.pages_per_slab + seg.slab_page
        hit = [start + i for i in range(seg.count) if base + i in self._page_readonly]
        for _, w, n in page_runs(hit):
            self._set_access(self._window_base + w * g.page_size, n * g.page_size, True, f"window pages {w}..{w + n}")

    def _clear_window(self, window_page: int, count: int) -> None:
        """Unmap whatever is mapped in ``[window_page, window_page + count)``, keeping (by
        mapping them again) the parts of cut segments that lie outside it."""
        hit = self._window.overlapping(window_page, count)
        if not hit:
            return
        g = self.geometry
        ps = g.page_size
        lo, hi = hit[0], hit[-1] + self._window[hit[-1]].count
        live = self._leases.live(self._window_base + lo * ps, self._window_base + hi * ps)
        if live:
            raise MappingInUse(
                f"cannot unmap window pages {window_page}..{window_page + count}: {self._describe_leases(live)} "
                f"still alive over the mappings there (window pages {lo}..{hi}); drop them first (a tensor over a "
                "freed object must not outlive it); nothing was changed"
            )
        streams = self._window.streams(hit)
        if streams:
            self._sync_streams(streams, f"unmapping window pages {window_page}..{window_page + count}")
        end = window_page + count
        keep: list[tuple[int, Segment]] = []
        for start in hit:
            seg = self._window[start]
            self._check(
                f"cuMemUnmap(window pages {start}..{start + seg.count})",
                self._drv.cuMemUnmap(self._window_base + start * g.page_size, seg.count * g.page_size),
            )
            self._window.remove(start)
            if start < window_page:
                keep.append((start, Segment(window_page - start, seg.slab, seg.slab_page, seg.readonly)))
            seg_end = start + seg.count
            if seg_end > end:
                keep.append((end, Segment(seg_end - end, seg.slab, seg.slab_page + (end - start), seg.readonly)))
        for start, seg in keep:
            self._map(
                self._window_base + start * g.page_size,
                seg.count * g.page_size,
                seg.slab_page * g.page_size,
                self._handles[seg.slab],
                seg.readonly,
                f"window pages {start}..{start + seg.count} (kept)",
            )
            self._window.add(start, seg)
            self._protect_segment(start, seg)

    # ------------------------------------------------------------- for the broker's arena (owner side)

    def attach_handle(self, slab_index: int, handle, *, readonly: bool = False) -> None:
        """Map an allocation handle as slab ``slab_index``; on success the view owns it
        (released at close), on failure the caller still does."""
        self._check_attach_index(slab_index)
        self.make_current()
        g = self.geometry
        self._map(self._phys_base + slab_index * g.slab_size, g.slab_size, 0, handle, readonly, f"slab {slab_index}")
        self._handles.append(handle)
        self._slab_readonly.append(readonly)

    def detach_from(self, first_slab: int) -> None:
        """Unmap and release slabs ``first_slab..`` (for a failed grow; they have no window pages)."""
        g = self.geometry
        for slab in range(len(self._handles) - 1, first_slab - 1, -1):
            self._drv.cuMemUnmap(self._phys_base + slab * g.slab_size, g.slab_size)
            self._drv.cuMemRelease(self._handles.pop())
            self._slab_readonly.pop()


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
