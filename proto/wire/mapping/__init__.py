"""The arena as every process sees it: its geometry, and views that map a broker's memory.

This package owns what a client process does with a broker's arena (``open_view``: import
the fds it is sent and map them: memfd slabs on the host, one allocation per page on CUDA,
imported lazily) and the sizes both sides agree on (``ArenaGeometry``, ``check_sizes``,
``format_size``). Creating and exporting them is the daemon's (``memory_broker.broker.arena``); nothing here imports the daemon, torch or the CUDA
bindings until a view needs them.
"""

from __future__ import annotations

from memory_broker.proto.wire.mapping.geometry import ArenaGeometry, check_geometry, check_sizes, format_size
from memory_broker.proto.wire.mapping.view import ArenaView

# The CUDA device a view maps when the broker names none ("" in ArenaInfo.device).
DEFAULT_DEVICE = "0"


def open_view(backend: str, geometry: ArenaGeometry, device: str = "") -> ArenaView:
    """A client's (empty) view of a broker's arena, to attach the slabs or pages it is sent.

    ``device`` is the broker's ``ArenaInfo.device`` (a GPU UUID, or an index; "" means
    device 0). Raises ValueError or RuntimeError (``CudaUnavailable``, ``CudaError``) when
    this process cannot map it.
    """
    if backend == "host":
        from memory_broker.proto.wire.mapping.host import HostArenaView

        return HostArenaView(geometry)
    if backend == "cuda":
        from memory_broker.proto.wire.mapping.cuda import CudaArenaView

        return CudaArenaView(geometry, device or DEFAULT_DEVICE)
    raise ValueError(f"this client has no view for a {backend!r} arena")


__all__ = ["DEFAULT_DEVICE", "ArenaGeometry", "ArenaView", "check_geometry", "check_sizes", "format_size", "open_view"]
