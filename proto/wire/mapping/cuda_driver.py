"""CUDA driver calls checked one way, and CUDA devices found by index or UUID.

This module owns the errors of the CUDA arena (``CudaError``, ``CudaUnavailable``,
``MappingInUse``), the one checker of a driver call's result (``check``), ``cuInit`` and the
device queries (``resolve_device``), and ``DeviceContext``: one device's retained primary
context with the checked calls a view makes in it. The driver module is always passed in:
loading it, and the view's mapping state, are ``memory_broker.proto.wire.mapping.cuda``'s. It must not
import the daemon or the client library.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memory_broker.proto.wire.gpus import normalize_uuid

# Result codes this module treats specially (values are the driver's ABI).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_DEINITIALIZED = 4
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CU_STREAM_CAPTURE_STATUS_NONE = 0


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


# ----------------------------------------------------------------- driver calls


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
    uuid = normalize_uuid(s)
    if uuid is not None:
        return uuid
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
    return (
        getattr(attrs, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", None)
        or attrs.CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED
    )


def _device_info(drv, ordinal: int) -> CudaDevice:
    dev = check(f"cuDeviceGet({ordinal})", drv.cuDeviceGet(ordinal), drv)
    raw_name = check(f"cuDeviceGetName(device {ordinal})", drv.cuDeviceGetName(256, dev), drv)
    if isinstance(raw_name, bytes):
        raw_name = raw_name.split(b"\0", 1)[0].decode(errors="replace")
    uuid = check(f"cuDeviceGetUuid(device {ordinal})", drv.cuDeviceGetUuid(dev), drv)
    vmm = check(
        f"cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device {ordinal})",
        drv.cuDeviceGetAttribute(_vmm_attribute(drv), dev),
        drv,
    )
    fd_attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
    posix = check(
        f"cuDeviceGetAttribute(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device {ordinal})",
        drv.cuDeviceGetAttribute(fd_attr, dev),
        drv,
    )
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


# ----------------------------------------------------------------- one device's context


class DeviceContext:
    """One device's primary context, retained, and the checked driver calls made in it.

    The base of ``CudaArenaView``: opening the device, its context current in the calling
    thread for the span of a call (``current``; the thread's own again afterwards), the
    stream-capture mode, the mapping and access calls, and waiting on streams. It keeps no
    mapping state of its own.
    """

    _drv: Any
    device: CudaDevice
    _ctx: Any
    # The handle type pages are exported and imported as (POSIX file descriptors).
    fd_handle_type: Any
    _access: dict[bool, Any]

    def _open_device(self, drv: Any, device: str | int | None) -> None:
        """``cuInit``, find ``device`` and retain its primary context (released by the caller).

        Raises:
            CudaUnavailable: no driver, no such device, or no VMM / POSIX-fd support.
            ValueError: a malformed device.
            CudaError: a driver call failed.
        """
        self._drv = drv
        _init_driver(drv)
        self.device = resolve_device(drv, device)
        why = self.device.unsupported_reason()
        if why:
            raise CudaUnavailable(why)
        self.fd_handle_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._access = {ro: self._access_desc(ro) for ro in (False, True)}
        d = self.device
        self._ctx = self._check(f"cuDevicePrimaryCtxRetain(device {d.ordinal})", drv.cuDevicePrimaryCtxRetain(d.handle))

    @property
    def ordinal(self) -> int:
        return self.device.ordinal

    @property
    def driver(self) -> Any:
        """The driver module this view calls; the broker's arena creates its pages with it."""
        return self._drv

    def _check(self, call: str, result) -> Any:
        return check(call, result, self._drv)

    @contextlib.contextmanager
    def current(self):
        """The device's primary context current in this thread for the block, and the thread's
        own current context (or none) again after it, whatever the block raised.

        Every entry point that calls the driver runs in one (the broker's arena too, to create
        and export pages). The current context is per thread, and the CUDA runtime adopts
        whatever context the driver leaves current: a context set and left behind would move
        the thread's current device (torch's too) to this view's device, and the caller's
        later ``device="cuda"`` work with it. Push and pop cost next to nothing; they nest.
        Mapping calls enter it inside ``_relaxed_capture``, so the push and the pop too run in
        relaxed capture mode (whether the driver counts them unsafe during a global-mode
        capture in another thread is not documented; relaxed mode makes it moot).

        Raises:
            CudaError: the push or the pop failed (a pop's error only where the block raised none).
        """
        drv = self._drv
        self._check("cuCtxPushCurrent(primary context)", drv.cuCtxPushCurrent(self._ctx))
        try:
            yield
        except BaseException:
            drv.cuCtxPopCurrent()
            raise
        self._check("cuCtxPopCurrent(primary context)", drv.cuCtxPopCurrent())

    @contextlib.contextmanager
    def _relaxed_capture(self):
        """This thread in ``CU_STREAM_CAPTURE_MODE_RELAXED`` for the block: its driver calls
        then cannot invalidate a global-mode capture running in another thread."""
        drv = self._drv
        old = self._check(
            "cuThreadExchangeStreamCaptureMode(RELAXED)",
            drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
        )
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
        self._check(
            f"cuMemSetAccess({what}, {size} bytes, {mode})",
            self._drv.cuMemSetAccess(va, size, [self._access[readonly]], 1),
        )

    def allocation_prop(self):
        """``CUmemAllocationProp`` of a page on this device, exportable as a POSIX fd."""
        drv = self._drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.ordinal
        prop.requestedHandleTypes = self.fd_handle_type
        return prop

    _allocation_prop = allocation_prop  # its former name, which tests/test_arena_cuda.py calls

    def _access_desc(self, readonly: bool):
        drv = self._drv
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device.ordinal
        flags = drv.CUmemAccess_flags
        desc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ if readonly else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def _map_run(self, va: int, handles: Sequence[Any], page_size: int, readonly: bool, what: str) -> None:
        """Map each allocation in ``handles`` whole (offset 0, its full size: the only
        ``cuMemMap`` the driver takes) back to back from ``va``, then grant access with one
        ``cuMemSetAccess`` over the run (one call may span many adjacent whole mappings).
        Unmaps what it mapped if a call fails."""
        drv = self._drv
        done = 0
        try:
            for i, h in enumerate(handles):
                at = va + i * page_size
                self._check(f"cuMemMap({what}: page {i}, {page_size} bytes)", drv.cuMemMap(at, page_size, 0, h, 0))
                done += 1
            self._set_access(va, len(handles) * page_size, readonly, what)
        except BaseException:
            for i in range(done):
                drv.cuMemUnmap(va + i * page_size, page_size)
            raise


__all__ = [
    "CudaDevice",
    "DeviceContext",
    "CudaError",
    "CudaUnavailable",
    "MappingInUse",
    "check",
    "format_uuid",
    "parse_device_spec",
    "resolve_device",
]
