"""The CUDA arena: slabs are VMM allocations (``cuMemCreate``) shared as POSIX fds.

This module owns the CUDA backend's device selection, address reservations, slab handles
and mappings (``CudaArenaView`` in every process, ``CudaArena`` in the broker), through the
driver API of ``cuda-python`` (``cuda.bindings.driver``). Like the host backend it knows
nothing of objects or owners: the page pool decides which page goes where.

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

import bisect
import contextlib
import fcntl
import gc
import logging
import math
import os
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memory_broker.broker.arena.base import Arena, ArenaGeometry, ArenaView

log = logging.getLogger(__name__)
_LEASE_LOCK = threading.Lock()

# Result codes this module treats specially (values are the driver's ABI).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_DEINITIALIZED = 4
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CU_STREAM_CAPTURE_STATUS_NONE = 0

_UUID_RE = re.compile(r"^(?:GPU-|MIG-)?([0-9a-fA-F]{8})-?([0-9a-fA-F]{4})-?([0-9a-fA-F]{4})-?([0-9a-fA-F]{4})-?([0-9a-fA-F]{12})$")


class CudaError(RuntimeError):
    """A driver call returned an error: names the call and the error (``cuGetErrorName``)."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name}")
        self.call = call
        self.code = code
        self.name = name


class CudaUnavailable(RuntimeError):
    """This process cannot run the CUDA arena here; the message says why, as a sentence."""


class MappingInUse(RuntimeError):
    """Memory a live tensor (or a capturing stream) still uses was to be unmapped; nothing was
    changed. The message names the range and what holds it."""


# ----------------------------------------------------------------- driver access


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


def _error_name(drv, err) -> str:
    """``cuGetErrorName`` of a result, or the enum's own name where the driver cannot say."""
    try:
        res, name = drv.cuGetErrorName(err)
        if int(res) == CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # no driver library loaded, or a fake result
        pass
    name = getattr(err, "name", None)
    return name if isinstance(name, str) and name else f"CUresult {int(err)}"


def check(call: str, result, drv=None) -> Any:
    """Check one driver call's result tuple; return its values.

    Every ``cuda.bindings.driver`` function returns a tuple whose first element is a
    ``CUresult``; the rest are outputs. Returns None for no outputs, the value for one, the
    tuple of values for several.

    Args:
        call: what to name in the error, e.g. ``"cuMemCreate(67108864 bytes)"``.
        result: the tuple the call returned.
        drv: the driver module, to ask ``cuGetErrorName``; None: the enum's name.

    Raises:
        CudaError: the result is not CUDA_SUCCESS.
    """
    if not isinstance(result, tuple) or not result:
        raise TypeError(f"{call}: expected a (CUresult, ...) tuple, got {result!r}")
    err, *values = result
    if int(err) != CUDA_SUCCESS:
        raise CudaError(call, int(err), _error_name(drv, err))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _init_driver(drv) -> None:
    """``cuInit(0)``; raises CudaUnavailable with the reason a driver is not usable."""
    try:
        result = drv.cuInit(0)
    except Exception as e:  # cuda-python raises when libcuda.so cannot be loaded
        raise CudaUnavailable(f"no CUDA driver (cuInit: {type(e).__name__}: {e})") from None
    try:
        check("cuInit(0)", result, drv)
    except CudaError as e:
        if e.code == CUDA_ERROR_NO_DEVICE:
            raise CudaUnavailable(f"no CUDA device (cuInit: {e.name})") from None
        raise CudaUnavailable(f"no usable CUDA driver (cuInit: {e.name})") from None


# ----------------------------------------------------------------- devices


def parse_device_spec(spec: str | int | None) -> int | str:
    """An ordinal (``0``, ``"1"``, ``"cuda:1"``) or a normalized UUID (``"GPU-xxxxxxxx-..."``).

    ``None`` and ``""`` mean device 0. UUIDs may be given as nvidia-smi prints them
    (``GPU-`` or ``MIG-`` prefix) or bare; they come back lower-case with a ``GPU-`` prefix.

    Raises:
        ValueError: neither an index nor a UUID.
    """
    if spec is None:
        return 0
    if isinstance(spec, bool):
        raise ValueError(f"device {spec!r} is neither an index nor a GPU UUID")
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"device index {spec} is negative")
        return spec
    s = str(spec).strip()
    if s == "":
        return 0
    low = s.lower()
    if low.startswith("cuda:"):
        s = s[5:]
    if s.isdigit():
        return int(s)
    m = _UUID_RE.match(s)
    if m:
        return "GPU-" + "-".join(g.lower() for g in m.groups())
    raise ValueError(
        f"device {spec!r} is neither an index (0, 1, cuda:0) nor a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
    )


def format_uuid(raw: bytes | str) -> str:
    """The 16 bytes of a ``CUuuid`` as nvidia-smi prints them: ``GPU-8-4-4-4-12`` hex."""
    b = raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)
    if len(b) != 16:
        raise ValueError(f"a UUID has 16 bytes, got {len(b)}")
    h = b.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclass(frozen=True, slots=True)
class CudaDevice:
    """One CUDA device as this process numbers it."""

    ordinal: int
    # The driver's CUdevice (an object of the bindings; int() of it is the ordinal).
    handle: Any
    name: str
    uuid: str
    # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    vmm: bool
    # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
    posix_fd: bool

    def describe(self) -> str:
        return f"CUDA device {self.ordinal} ({self.name}, {self.uuid})"

    def unsupported_reason(self) -> str | None:
        """Why the arena cannot use this device, or None."""
        if not self.vmm:
            return (
                f"{self.describe()} does not support virtual memory management "
                "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)"
            )
        if not self.posix_fd:
            return (
                f"{self.describe()} cannot share memory as POSIX file descriptors "
                "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)"
            )
        return None


def _vmm_attribute(drv):
    attrs = drv.CUdevice_attribute
    # VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED is the older (deprecated) name of the same attribute.
    return getattr(attrs, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", None) or getattr(
        attrs, "CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED"
    )


def _device_info(drv, ordinal: int) -> CudaDevice:
    dev = check(f"cuDeviceGet({ordinal})", drv.cuDeviceGet(ordinal), drv)
    raw_name = check(f"cuDeviceGetName(device {ordinal})", drv.cuDeviceGetName(256, dev), drv)
    if isinstance(raw_name, bytes):
        raw_name = raw_name.split(b"\0", 1)[0].decode(errors="replace")
    uuid = check(f"cuDeviceGetUuid(device {ordinal})", drv.cuDeviceGetUuid(dev), drv)
    vmm = check(f"cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device {ordinal})",
                drv.cuDeviceGetAttribute(_vmm_attribute(drv), dev), drv)  # fmt: skip
    fd_attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
    posix = check(f"cuDeviceGetAttribute(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device {ordinal})",
                  drv.cuDeviceGetAttribute(fd_attr, dev), drv)  # fmt: skip
    return CudaDevice(ordinal, dev, str(raw_name).strip(), format_uuid(uuid.bytes), bool(vmm), bool(posix))


def resolve_device(drv, spec: str | int | None) -> CudaDevice:
    """Find the device named by ``spec`` (index or UUID); the driver must be initialized.

    Raises:
        ValueError: ``spec`` is malformed.
        CudaUnavailable: no such device here, or no device at all.
        CudaError: a query failed.
    """
    want = parse_device_spec(spec)
    count = check("cuDeviceGetCount()", drv.cuDeviceGetCount(), drv)
    if count == 0:
        raise CudaUnavailable("no CUDA device (cuDeviceGetCount: 0)")
    if isinstance(want, int):
        if want >= count:
            raise CudaUnavailable(f"no CUDA device {want}: this process sees {count} device(s) (0..{count - 1})")
        return _device_info(drv, want)
    for i in range(count):
        info = _device_info(drv, i)
        if info.uuid == want:
            return info
    raise CudaUnavailable(f"no CUDA device has UUID {want} among the {count} this process sees")


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


def _format_bytes(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n} B"


def check_geometry(geometry: ArenaGeometry, granularity: int, where: str = "this device") -> None:
    """Refuse sizes the device cannot map: pages and slabs must be multiples of the granularity.

    Raises:
        ValueError: naming the size, the granularity and the nearest usable page size.
    """
    g = geometry
    if g.pages_per_slab <= 0 or g.max_slabs <= 0 or g.window_pages <= 0:
        raise ValueError(
            f"geometry needs positive sizes: {g.pages_per_slab} pages per slab, "
            f"{g.max_slabs} slabs, {g.window_pages} window pages"
        )
    if granularity <= 0:
        raise ValueError(f"allocation granularity {granularity} of {where} is not positive")
    if g.page_size <= 0 or g.page_size % granularity:
        up = max(granularity, -(-g.page_size // granularity) * granularity)
        raise ValueError(
            f"page size {g.page_size} bytes ({_format_bytes(max(g.page_size, 0))}) is not a multiple of the CUDA "
            f"allocation granularity of {where}, {granularity} bytes ({_format_bytes(granularity)}); "
            f"use a page size of {_format_bytes(up)}"
        )
    if g.slab_size % granularity:  # implied by the page size; kept for a direct message
        raise ValueError(
            f"slab size {g.slab_size} bytes is not a multiple of the CUDA allocation granularity of "
            f"{where}, {granularity} bytes"
        )


# ----------------------------------------------------------------- views


class _CudaArrayInterface:
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


class _Lease(_CudaArrayInterface):
    """What a tensor over a view holds: torch keeps this object (it is the tensor's
    ``__cuda_array_interface__`` source) until the tensor's storage dies. The view keeps only
    weak references, so a live lease means a live tensor over ``[address, address + nbytes)``."""

    __slots__ = ("view", "address", "nbytes")

    def __init__(self, view: "CudaArenaView", address: int, nbytes: int) -> None:
        super().__init__(address, nbytes)
        self.view = view  # keeps the view object (and so its mappings' bookkeeping) alive
        self.address = address
        self.nbytes = nbytes

    def overlaps(self, start: int, end: int) -> bool:
        return self.address < end and start < self.address + self.nbytes


@dataclass(slots=True)
class _Segment:
    """One window mapping: ``count`` pages from page ``slab_page`` of slab ``slab``."""

    count: int
    slab: int
    slab_page: int
    readonly: bool


class CudaArenaView(ArenaView):
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
        self._drv = drv
        self.geometry = geometry
        self._closed = True  # until everything below is in place
        _init_driver(drv)
        self.device = resolve_device(drv, device)
        why = self.device.unsupported_reason()
        if why:
            raise CudaUnavailable(why)
        self._fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        d = self.device
        self._ctx = self._check(f"cuDevicePrimaryCtxRetain(device {d.ordinal})", drv.cuDevicePrimaryCtxRetain(d.handle))
        self._phys_base = self._window_base = 0
        try:
            self._make_current()
            self.granularity = self._check(
                f"cuMemGetAllocationGranularity(device {d.ordinal}, MINIMUM)",
                drv.cuMemGetAllocationGranularity(
                    self._allocation_prop(), drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
            )
            check_geometry(geometry, int(self.granularity), d.describe())
            self._phys_size = geometry.max_pages * geometry.page_size
            self._window_size = geometry.window_pages * geometry.page_size
            self._phys_base = int(self._check(
                f"cuMemAddressReserve({self._phys_size} bytes, physical view)",
                drv.cuMemAddressReserve(self._phys_size, 0, 0, 0),
            ))  # fmt: skip
            self._window_base = int(self._check(
                f"cuMemAddressReserve({self._window_size} bytes, window)",
                drv.cuMemAddressReserve(self._window_size, 0, 0, 0),
            ))  # fmt: skip
        except BaseException:
            if self._phys_base:
                drv.cuMemAddressFree(self._phys_base, self._phys_size)
            drv.cuDevicePrimaryCtxRelease(d.handle)
            raise
        self._access = {ro: self._access_desc(ro) for ro in (False, True)}
        # Per attached slab: its allocation handle (owned by this view) and read-only flag.
        self._handles: list[Any] = []
        self._slab_readonly: list[bool] = []
        # Window mappings by first window page, and their starts in order.
        self._segments: dict[int, _Segment] = {}
        self._starts: list[int] = []
        # Live tensors' leases (weak: a lease goes when its tensor does).
        self._leases: weakref.WeakSet[_Lease] = weakref.WeakSet()
        # Streams that used each window mapping, by its first page. (The physical view is
        # unmapped only by close, which synchronizes the context.)
        self._seg_streams: dict[int, set[int]] = {}
        # Physical pages made read-only with set_page_access.
        self._page_readonly: set[int] = set()
        self._closed = False

    # ------------------------------------------------------------- properties

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
        return len(self._handles)

    @property
    def ordinal(self) -> int:
        return self.device.ordinal

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
        self._check_slab_index(slab_index)
        self._make_current()
        with self._relaxed_capture():
            handle = self._check(
                f"cuMemImportFromShareableHandle(fd {fd}, slab {slab_index})",
                self._drv.cuMemImportFromShareableHandle(fd, self._fd_type),
            )
            try:
                self._attach_handle(slab_index, handle, readonly=readonly)
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
        mapped_pages = len(self._handles) * g.pages_per_slab
        for i, p in enumerate(pages):
            if not 0 <= p < mapped_pages:
                raise ValueError(
                    f"physical page {p} (index {i}) is outside the {mapped_pages} pages of the "
                    f"{len(self._handles)} mapped slabs"
                )
        if not pages:
            return
        self._make_current()
        with self._relaxed_capture():
            self._clear_window(window_page, len(pages))
            added: list[int] = []
            try:
                for off, first, n in _runs(pages, g.pages_per_slab):
                    slab, slab_page = divmod(first, g.pages_per_slab)
                    ro = readonly or self._slab_readonly[slab]
                    start = window_page + off
                    seg = _Segment(n, slab, slab_page, ro)
                    self._map(self._window_base + start * g.page_size, n * g.page_size, slab_page * g.page_size,
                              self._handles[slab], ro, f"window pages {start}..{start + n} <- slab {slab} page {slab_page}")  # fmt: skip
                    self._add_segment(start, seg)
                    added.append(start)
                    self._protect_segment(start, seg)
            except BaseException:
                # Nothing mapped by this call was handed out yet: undo it without a synchronize.
                for start in added:
                    seg = self._remove_segment(start)
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
            self._make_current()
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
        want = sorted(set(int(p) for p in pages))
        g = self.geometry
        mapped_pages = len(self._handles) * g.pages_per_slab
        bad = [p for p in want if not 0 <= p < mapped_pages]
        if bad:
            raise ValueError(
                f"page(s) {', '.join(map(str, bad[:5]))} are outside the {mapped_pages} pages of the "
                f"{len(self._handles)} mapped slabs"
            )
        if not want:
            return
        self._make_current()
        ps, pps = g.page_size, g.pages_per_slab
        with self._relaxed_capture():
            for _, first, n in _runs(want, pps):
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
            for start in self._starts:
                seg = self._segments[start]
                if seg.readonly:
                    continue
                base = seg.slab * pps + seg.slab_page
                hit = [start + i for i in range(seg.count) if base + i in chosen]
                for _, w, n in _runs(hit, g.window_pages):
                    self._set_access(self._window_base + w * ps, n * ps, readonly, f"window pages {w}..{w + n}")

    def window_segments(self) -> list[tuple[int, int, int, int]]:
        """The window's mappings as ``(window_page, count, slab, slab_page)``, in order (diagnostics)."""
        return [(s, self._segments[s].count, self._segments[s].slab, self._segments[s].slab_page) for s in self._starts]

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
        self._check_open()
        self._check_mapped(address, nbytes)
        import torch

        dev = torch.device("cuda", self.device.ordinal)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8 if dtype is None else dtype, device=dev)
        lease = _Lease(self, address, nbytes)
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
        return sorted((lease.address, lease.nbytes) for lease in self._leases)

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
        live = self._live_leases(0, 1 << 64)
        if live:
            self._waiting_for = len(live)
            log.info("arena view close deferred: %s still alive", self._describe_leases(live))
            for lease in live:
                weakref.finalize(lease, self._lease_gone)
            return
        self._teardown()

    def _lease_gone(self) -> None:
        with _LEASE_LOCK:  # leases may die in several threads at once
            self._waiting_for -= 1
            last = self._waiting_for == 0
        if last:
            try:
                self._teardown()
            except Exception:
                log.exception("deferred teardown of a CUDA arena view failed")

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
        for start in self._starts:
            seg = self._segments[start]
            attempt(f"cuMemUnmap(window pages {start}..{start + seg.count})", drv.cuMemUnmap,
                    self._window_base + start * g.page_size, seg.count * g.page_size)  # fmt: skip
        self._starts.clear()
        self._segments.clear()
        for i in range(len(self._handles)):
            attempt(f"cuMemUnmap(slab {i})", drv.cuMemUnmap, self._phys_base + i * g.slab_size, g.slab_size)
        for i, h in enumerate(self._handles):
            attempt(f"cuMemRelease(slab {i})", drv.cuMemRelease, h)
        self._handles.clear()
        self._slab_readonly.clear()
        attempt("cuMemAddressFree(window)", drv.cuMemAddressFree, self._window_base, self._window_size)
        attempt("cuMemAddressFree(physical view)", drv.cuMemAddressFree, self._phys_base, self._phys_size)
        attempt(f"cuDevicePrimaryCtxRelease(device {self.device.ordinal})", drv.cuDevicePrimaryCtxRelease,
                self.device.handle)  # fmt: skip
        if errors:
            raise errors[0]

    # ------------------------------------------------------------- internals

    def _check(self, call: str, result) -> Any:
        return check(call, result, self._drv)

    def _make_current(self) -> None:
        # The current context is per thread; set it on every entry point (cheap).
        self._check("cuCtxSetCurrent(primary context)", self._drv.cuCtxSetCurrent(self._ctx))

    @contextlib.contextmanager
    def _relaxed_capture(self):
        """This thread in ``CU_STREAM_CAPTURE_MODE_RELAXED`` for the block: its driver calls
        then cannot invalidate a global-mode capture running in another thread."""
        drv = self._drv
        old = self._check("cuThreadExchangeStreamCaptureMode(RELAXED)", drv.cuThreadExchangeStreamCaptureMode(
            drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))  # fmt: skip
        try:
            yield
        finally:
            drv.cuThreadExchangeStreamCaptureMode(old)

    def _current_stream(self) -> int:
        """torch's current stream on this device in this thread (0, the legacy default
        stream, where torch cannot say)."""
        try:
            import torch

            return int(torch.cuda.current_stream(self.device.ordinal).cuda_stream)
        except Exception:
            return 0

    def _note_streams(self, address: int, nbytes: int, streams: set[int]) -> None:
        """Remember that ``streams`` use ``[address, address + nbytes)``."""
        g = self.geometry
        if not self._window_base <= address < self._window_base + self._window_size:
            return  # the physical view: only close unmaps it
        first = (address - self._window_base) // g.page_size
        last = (address + max(nbytes, 1) - 1 - self._window_base) // g.page_size
        for start in self._overlapping(first, last - first + 1):
            self._seg_streams.setdefault(start, set()).update(streams)

    def _live_leases(self, start: int, end: int) -> list[_Lease]:
        """Live leases overlapping addresses ``[start, end)``; collects cycles once before
        reporting any (a tensor held only by a cycle is not in use)."""
        live = [lease for lease in list(self._leases) if lease.overlaps(start, end)]
        if live:
            del live
            gc.collect()
            live = [lease for lease in list(self._leases) if lease.overlaps(start, end)]
        return live

    def _describe_leases(self, live: list[_Lease]) -> str:
        ps = self.geometry.page_size
        parts = []
        for lease in sorted(live, key=lambda x: x.address)[:3]:
            if self._window_base <= lease.address < self._window_base + self._window_size:
                w = (lease.address - self._window_base) // ps
                where = f"window pages {w}..{-(-(lease.address + lease.nbytes - self._window_base) // ps)}"
            else:
                p = (lease.address - self._phys_base) // ps
                where = f"physical pages {p}..{-(-(lease.address + lease.nbytes - self._phys_base) // ps)}"
            parts.append(f"{lease.nbytes} bytes at {lease.address:#x} ({where})")
        more = f" and {len(live) - 3} more" if len(live) > 3 else ""
        return f"{len(live)} tensor(s) over this view ({'; '.join(parts)}{more}) are"

    def _sync_streams(self, streams: set[int], why: str) -> None:
        """Wait for the work queued on ``streams`` (never the whole device). Refuses, before
        waiting on any, if one of them is capturing a graph (syncing it would break it)."""
        drv = self._drv
        handles = sorted(streams)
        for h in handles:
            status = self._check(f"cuStreamIsCapturing(stream {h:#x})", drv.cuStreamIsCapturing(drv.CUstream(h)))
            if int(status) != CU_STREAM_CAPTURE_STATUS_NONE:
                raise MappingInUse(
                    f"stream {h:#x}, which used {why.split(' ', 1)[1]}, is capturing a CUDA graph: "
                    f"{why} must wait until the capture ends; nothing was changed"
                )
        for h in handles:
            self._check(f"cuStreamSynchronize(stream {h:#x}) before {why}", drv.cuStreamSynchronize(drv.CUstream(h)))

    def _set_access(self, va: int, size: int, readonly: bool, what: str) -> None:
        mode = "read" if readonly else "read-write"
        self._check(f"cuMemSetAccess({what}, {size} bytes, {mode})",
                    self._drv.cuMemSetAccess(va, size, [self._access[readonly]], 1))  # fmt: skip

    def _protect_segment(self, start: int, seg: _Segment) -> None:
        """Make the pages of a (read-write) window mapping that ``set_page_access`` made
        read-only read-only here too."""
        if seg.readonly or not self._page_readonly:
            return
        g = self.geometry
        base = seg.slab * g.pages_per_slab + seg.slab_page
        hit = [start + i for i in range(seg.count) if base + i in self._page_readonly]
        for _, w, n in _runs(hit, g.window_pages):
            self._set_access(self._window_base + w * g.page_size, n * g.page_size, True, f"window pages {w}..{w + n}")

    def _allocation_prop(self):
        drv = self._drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.ordinal
        prop.requestedHandleTypes = self._fd_type
        return prop

    def _access_desc(self, readonly: bool):
        drv = self._drv
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device.ordinal
        flags = drv.CUmemAccess_flags
        desc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ if readonly else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def _map(self, va: int, size: int, offset: int, handle, readonly: bool, what: str) -> None:
        """cuMemMap + cuMemSetAccess of one range; unmaps it again if access fails."""
        drv = self._drv
        self._check(f"cuMemMap({what}, {size} bytes at offset {offset})", drv.cuMemMap(va, size, offset, handle, 0))
        try:
            self._set_access(va, size, readonly, what)
        except BaseException:
            drv.cuMemUnmap(va, size)
            raise

    def _attach_handle(self, slab_index: int, handle, *, readonly: bool = False) -> None:
        """Map an allocation handle as slab ``slab_index``; on success the view owns it
        (released at close), on failure the caller still does."""
        self._check_slab_index(slab_index)
        self._make_current()
        g = self.geometry
        self._map(self._phys_base + slab_index * g.slab_size, g.slab_size, 0, handle, readonly, f"slab {slab_index}")
        self._handles.append(handle)
        self._slab_readonly.append(readonly)

    def _detach_from(self, first_slab: int) -> None:
        """Unmap and release slabs ``first_slab..`` (for a failed grow; they have no window pages)."""
        g = self.geometry
        for slab in range(len(self._handles) - 1, first_slab - 1, -1):
            self._drv.cuMemUnmap(self._phys_base + slab * g.slab_size, g.slab_size)
            self._drv.cuMemRelease(self._handles.pop())
            self._slab_readonly.pop()

    def _overlapping(self, window_page: int, count: int) -> list[int]:
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

    def _clear_window(self, window_page: int, count: int) -> None:
        """Unmap whatever is mapped in ``[window_page, window_page + count)``, keeping (by
        mapping them again) the parts of cut segments that lie outside it."""
        hit = self._overlapping(window_page, count)
        if not hit:
            return
        g = self.geometry
        ps = g.page_size
        lo, hi = hit[0], hit[-1] + self._segments[hit[-1]].count
        live = self._live_leases(self._window_base + lo * ps, self._window_base + hi * ps)
        if live:
            raise MappingInUse(
                f"cannot unmap window pages {window_page}..{window_page + count}: {self._describe_leases(live)} "
                f"still alive over the mappings there (window pages {lo}..{hi}); drop them first (a tensor over a "
                "freed object must not outlive it); nothing was changed"
            )
        streams = set().union(*(self._seg_streams.get(start, ()) for start in hit))
        if streams:
            self._sync_streams(streams, f"unmapping window pages {window_page}..{window_page + count}")
        end = window_page + count
        keep: list[tuple[int, _Segment]] = []
        for start in hit:
            seg = self._segments[start]
            self._check(f"cuMemUnmap(window pages {start}..{start + seg.count})",
                        self._drv.cuMemUnmap(self._window_base + start * g.page_size, seg.count * g.page_size))  # fmt: skip
            self._remove_segment(start)
            if start < window_page:
                keep.append((start, _Segment(window_page - start, seg.slab, seg.slab_page, seg.readonly)))
            seg_end = start + seg.count
            if seg_end > end:
                keep.append((end, _Segment(seg_end - end, seg.slab, seg.slab_page + (end - start), seg.readonly)))
        for start, seg in keep:
            self._map(self._window_base + start * g.page_size, seg.count * g.page_size, seg.slab_page * g.page_size,
                      self._handles[seg.slab], seg.readonly, f"window pages {start}..{start + seg.count} (kept)")  # fmt: skip
            self._add_segment(start, seg)
            self._protect_segment(start, seg)

    def _add_segment(self, start: int, seg: _Segment) -> None:
        bisect.insort(self._starts, start)
        self._segments[start] = seg

    def _remove_segment(self, start: int) -> _Segment:
        del self._starts[bisect.bisect_left(self._starts, start)]
        self._seg_streams.pop(start, None)
        return self._segments.pop(start)

    def _check_mapped(self, address: int, nbytes: int) -> None:
        """Refuse a range this view has not mapped (a kernel touching it would fault the context)."""
        g = self.geometry
        if nbytes < 0:
            raise ValueError(f"negative size {nbytes}")
        end = address + nbytes
        phys_end = self._phys_base + len(self._handles) * g.slab_size
        if self._phys_base <= address and end <= phys_end:
            return
        wb, ps = self._window_base, g.page_size
        if wb <= address and end <= wb + self._window_size:
            page = (address - wb) // ps
            last = (end - 1 - wb) // ps if nbytes else page
            while page <= last:
                hit = self._overlapping(page, 1)
                if not hit:
                    raise ValueError(f"window page {page} (address {wb + page * ps:#x}) is not mapped in this view")
                page = hit[0] + self._segments[hit[0]].count
            return
        raise ValueError(
            f"{nbytes} bytes at {address:#x} are outside this view's mapped memory (physical view "
            f"{self._phys_base:#x}..{phys_end:#x}, window {wb:#x}..{wb + self._window_size:#x})"
        )

    def _check_slab_index(self, slab_index: int) -> None:
        self._check_open()
        if slab_index != len(self._handles):
            raise ValueError(f"slab {slab_index} attached out of order: {len(self._handles)} slabs are mapped")
        if slab_index >= self.geometry.max_slabs:
            raise ValueError(f"slab {slab_index} is past the arena's maximum of {self.geometry.max_slabs} slabs")

    def _check_window_range(self, window_page: int, count: int) -> None:
        n = self.geometry.window_pages
        if window_page < 0 or count < 0 or window_page + count > n:
            raise ValueError(
                f"window pages {window_page}..{window_page + count} (count {count}) are outside the window of {n} pages"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this arena view is closed")


def _runs(pages: Sequence[int], pages_per_slab: int) -> list[tuple[int, int, int]]:
    """Split ``pages`` into runs of consecutive pages within one slab: ``(index, first, count)``."""
    out = []
    start = 0
    while start < len(pages):
        first = pages[start]
        slab = first // pages_per_slab
        end = start + 1
        while end < len(pages) and pages[end] == pages[end - 1] + 1 and pages[end] // pages_per_slab == slab:
            end += 1
        out.append((start, first, end - start))
        start = end
    return out


# ----------------------------------------------------------------- the broker's arena


class CudaArena(Arena):
    """The broker's CUDA arena: creates exportable VMM slabs and maps them into its own view.

    Args:
        geometry: sizes (page size a multiple of the device's granularity, usually 2 MiB).
        device: index or UUID of the device.
        name: shown in messages.
    """

    backend = "cuda"

    def __init__(self, geometry: ArenaGeometry, device: str | int | None = "0", name: str = "memory-broker") -> None:
        self.geometry = geometry
        self.name = name
        self._closed = True
        self.view = CudaArenaView(geometry, device)
        self._drv = self.view._drv
        # The broker's exported slab fds (close-on-exec); sent to clients with SCM_RIGHTS.
        self._fds: list[int] = []
        self._closed = False

    @property
    def device(self) -> CudaDevice:
        return self.view.device

    @property
    def device_id(self) -> str:
        """The device's UUID, for ``ArenaInfo.device``: clients find the same GPU by it."""
        return self.view.device.uuid

    @property
    def num_slabs(self) -> int:
        return len(self._fds)

    def memory_info(self) -> tuple[int, int]:
        """The device's (free, total) bytes, from ``cuMemGetInfo``."""
        self._check_open()
        self.view._make_current()
        free, total = check("cuMemGetInfo()", self._drv.cuMemGetInfo(), self._drv)
        return int(free), int(total)

    def grow(self, slabs: int) -> None:
        """Create ``slabs`` more slabs (``cuMemCreate`` + export as fd) and map them.

        Raises:
            MemoryError: past ``geometry.max_slabs``, or a driver call failed (the device is
                out of memory, typically); names the sizes and the device's free memory.
                Nothing this call created is left behind.
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
        drv, view = self._drv, self.view
        created_fds: list[int] = []
        try:
            view._make_current()
            prop = view._allocation_prop()
            for idx in range(have, have + slabs):
                handle = None
                try:
                    handle = check(f"cuMemCreate({g.slab_size} bytes)", drv.cuMemCreate(g.slab_size, prop, 0), drv)
                    fd = int(check(f"cuMemExportToShareableHandle(slab {idx}, POSIX_FILE_DESCRIPTOR)",
                                   drv.cuMemExportToShareableHandle(handle, view._fd_type, 0), drv))  # fmt: skip
                    created_fds.append(fd)
                    fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
                    view._attach_handle(idx, handle)  # the view owns the handle from here
                    handle = None
                except (CudaError, OSError) as e:
                    raise MemoryError(self._growth_message(have, slabs, idx, e)) from e
                finally:
                    if handle is not None:
                        drv.cuMemRelease(handle)
        except BaseException:
            try:
                view._detach_from(have)
            finally:
                for fd in created_fds:
                    os.close(fd)
            raise
        self._fds.extend(created_fds)

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

    def slab_fd(self, slab_index: int) -> int:
        """The broker-held fd of a slab; callers duplicate it and never close it."""
        self._check_open()
        if not 0 <= slab_index < len(self._fds):
            raise ValueError(f"slab {slab_index} does not exist; the arena has {len(self._fds)} slabs")
        return self._fds[slab_index]

    def close(self) -> None:
        """Unmap the broker's view and release its handles (once no tensor over it lives, as
        ``CudaArenaView.close``), then close every slab fd. Idempotent.

        Memory goes back to the device once every client has unmapped too.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.view.close()
        finally:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()

    def _growth_message(self, have: int, slabs: int, idx: int, e: Exception) -> str:
        g = self.geometry
        free = ""
        try:
            f, t = check("cuMemGetInfo()", self._drv.cuMemGetInfo(), self._drv)
            free = f"; {self.device.describe()} has {_format_bytes(int(f))} free of {_format_bytes(int(t))}"
        except Exception:
            pass
        return (
            f"{e} creating slab {idx} ({_format_bytes(g.slab_size)}) while growing the CUDA arena from "
            f"{have} to {have + slabs} slabs ({_format_bytes(have * g.slab_size)} -> "
            f"{_format_bytes((have + slabs) * g.slab_size)} of at most {_format_bytes(g.max_slabs * g.slab_size)}){free}"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this arena is closed")


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
