"""The broker's physical memory: one owner interface (``base``), one backend per kind of memory.

``make_arena`` picks the backend: ``host`` (memfd slabs, the default where no GPU is
present) or ``cuda`` (one CUDA VMM allocation per page, created a slab at a time,
``broker.arena.cuda``). ``auto`` chooses CUDA where
cuda-python, a driver and a device with VMM and POSIX-fd handles are present, and host
memory otherwise; either way it says why. The geometry and the views that map the arena are
shared with clients in ``memory_broker.proto.wire.mapping`` (clients open theirs with its
``open_view``); the client must not import this package.
"""

from __future__ import annotations

from memory_broker.broker.arena.base import Arena
from memory_broker.proto.wire.mapping import DEFAULT_DEVICE, ArenaGeometry, ArenaView

BACKENDS = ("auto", "host", "cuda")


def _probe(device: str) -> tuple[bool, str]:
    """``broker.arena.cuda.cuda_available``: at most ``cuInit``, nothing allocated."""
    from memory_broker.broker.arena.cuda import cuda_available

    return cuda_available(device)


def cuda_unavailable_reason(device: str = DEFAULT_DEVICE) -> str:
    """Why ``auto`` does not pick CUDA for ``device`` on this machine ("" where it would)."""
    ok, why = _probe(device or DEFAULT_DEVICE)
    return "" if ok else why


def make_arena(
    backend: str, geometry: ArenaGeometry, name: str = "memory-broker", device: str = DEFAULT_DEVICE
) -> tuple[Arena, str]:
    """Build an arena; returns it and a sentence saying why this backend was chosen.

    Args:
        backend: ``auto``, ``host`` or ``cuda``.
        geometry: the arena's sizes.
        name: shown in slab names and messages.
        device: CUDA device index or UUID (``GPU-...``); ignored by the host backend.

    Raises:
        ValueError: an unknown backend, ``cuda`` where CUDA cannot run (with the reason), or
            a geometry the device cannot map.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown arena backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    device = device or DEFAULT_DEVICE
    if backend in ("auto", "cuda"):
        ok, why = _probe(device)
        if ok:
            from memory_broker.broker.arena.cuda import CudaArena

            try:
                # A geometry the device cannot map raises ValueError here, for auto too: it
                # is a setting to fix, not a reason to run a GPU's broker on host memory.
                arena = CudaArena(geometry, device=device, name=name)
            except RuntimeError as e:  # CudaUnavailable or CudaError: a driver call failed
                if backend == "cuda":
                    raise ValueError(f"--arena cuda is not available: {e}; use --arena host") from None
                why = f"the CUDA arena failed to start ({e})"
            else:
                return arena, ("asked for cuda: " if backend == "cuda" else "auto: ") + why
        if backend == "cuda":
            raise ValueError(f"--arena cuda is not available: {why}; use --arena host")
        from memory_broker.broker.arena.host import HostArena

        return HostArena(geometry, name=name), f"auto: {why}, using host memory"
    from memory_broker.broker.arena.host import HostArena

    return HostArena(geometry, name=name), "asked for host"


__all__ = [
    "Arena",
    "ArenaGeometry",
    "ArenaView",
    "BACKENDS",
    "cuda_unavailable_reason",
    "make_arena",
]
