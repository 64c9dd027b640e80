"""Physical memory and mappings: one interface (``base``), one backend per kind of memory.

``make_arena`` picks the backend: ``host`` (memfd slabs, the default where no GPU is
present) or ``cuda`` (CUDA VMM). ``auto`` chooses CUDA only where a CUDA backend is built
and a device supports it.
"""

from __future__ import annotations

from broker.arena.base import Arena, ArenaGeometry, ArenaView

BACKENDS = ("auto", "host", "cuda")


def cuda_unavailable_reason() -> str:
    """Why ``auto`` does not pick CUDA on this build and machine."""
    # The CUDA VMM backend is a separate piece of work (issue 3); until it lands every
    # machine, GPU or not, runs the host arena.
    return "this build has no CUDA arena backend yet"


def make_arena(backend: str, geometry: ArenaGeometry, name: str = "memory-broker") -> tuple[Arena, str]:
    """Build an arena; returns it and a sentence saying why this backend was chosen."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown arena backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "cuda":
        raise ValueError(f"--arena cuda is not available: {cuda_unavailable_reason()}; use --arena host")
    from broker.arena.host import HostArena

    why = "asked for host" if backend == "host" else f"auto: {cuda_unavailable_reason()}, using host memory"
    return HostArena(geometry, name=name), why


def open_view(backend: str, geometry: ArenaGeometry, device: str = "") -> ArenaView:
    """A client's (empty) view of a broker's arena, to attach the slabs it is sent."""
    if backend == "host":
        from broker.arena.host import HostArenaView

        return HostArenaView(geometry)
    raise ValueError(f"this client has no view for a {backend!r} arena ({cuda_unavailable_reason()})")


__all__ = ["Arena", "ArenaGeometry", "ArenaView", "make_arena", "open_view", "BACKENDS"]
