"""Page writers: warm images copied into an object's pages, and matrices read back out.

``HostPageWriter`` copies through the broker's own mapping of a host arena (one ``memmove``
per page); ``TensorPageWriter`` through the view's torch tensors (host-to-device on a CUDA
arena). Blocking, for executor threads; they write the pages they are told to and nothing else.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from memory_broker.broker.adapters.dtypes import RAW
from memory_broker.broker.adapters.layout import AdapterLayout
from memory_broker.broker.adapters.warm_image import WarmImage, dequantize
from memory_broker.proto.wire.mapping import ArenaView


class HostPageWriter:
    """Writes warm images into pages through the broker's own mapping of a host arena:
    one ``memmove`` per page. (A device arena uses ``TensorPageWriter``; the manager only
    calls ``write``.)"""

    def __init__(self, view: ArenaView):
        _require_host_memory(view, "HostPageWriter", "use TensorPageWriter")
        self.view = view

    def write(self, image: WarmImage, pages: Sequence[int]) -> int:
        """Copy ``image`` into the physical ``pages`` of its object (in layout page order);
        returns bytes written. Blocking."""
        layout = image.layout
        if len(pages) != layout.num_pages:
            raise ValueError(f"the layout spans {layout.num_pages} pages; {len(pages)} were given")
        if image.packed is not None:
            return self._copy(image.packed, layout, pages)
        # int8: dequantize into a page image first (one more copy; the warm tier traded it
        # for a quarter of the memory).
        return self._copy(dequantize(image), layout, pages)

    def _copy(self, packed: np.ndarray, layout: AdapterLayout, pages: Sequence[int]) -> int:
        addr = self.view.page_address
        src = packed.ctypes.data
        pos = 0
        for p, used in zip(pages, layout.page_used):
            # ctypes releases the GIL for the copy, so loads overlap with the event loop.
            ctypes.memmove(addr(p), src + pos, used)
            pos += used
        return pos


class TensorPageWriter:
    """Writes warm images into pages through the view's zero-copy torch tensors
    (``ArenaView.tensor``): a host-to-device copy per page on a CUDA arena.

    Works on any backend; on the host arena ``HostPageWriter`` does the same with less
    overhead. Not yet run on a GPU: the copies are synchronous (pageable host memory), so
    the pages hold the image when ``write`` returns and the object can be committed.
    """

    def __init__(self, view: ArenaView):
        self.view = view

    def write(self, image: WarmImage, pages: Sequence[int]) -> int:
        import torch

        layout = image.layout
        if len(pages) != layout.num_pages:
            raise ValueError(f"the layout spans {layout.num_pages} pages; {len(pages)} were given")
        src = torch.from_numpy(image.packed if image.packed is not None else dequantize(image))
        pos = 0
        for p, used in zip(pages, layout.page_used):
            self.view.tensor(self.view.page_address(p), used).copy_(src[pos : pos + used])
            pos += used
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return pos


def _require_host_memory(view: ArenaView, what: str, instead: str) -> None:
    """Refuse a view whose addresses are not host memory (the CUDA arena's): dereferencing
    them on the host would crash the process."""
    if getattr(view, "host_addressable", True) is False:
        raise ValueError(
            f"{what} reads and writes arena addresses on the host, but this {type(view).__name__}'s "
            f"memory is on a GPU; {instead}"
        )


def read_matrix(
    view: ArenaView, layout: AdapterLayout, pages: Sequence[int], layer: int, module: str, kind: str
) -> np.ndarray:
    """A copy of one stored matrix (A, or Bᵀ) from an arena mapping, as raw ``layout.dtype``
    elements [rank, row_elems]. For checks and tools; any process's host-memory view works
    (a CUDA view is refused with ValueError: copy its pages to the host with ``view.tensor``)."""
    _require_host_memory(view, "read_matrix", "copy the pages to the host with view.tensor(...).cpu() first")
    mp = layout.matrix(layer, module, kind)
    raw, es = RAW[layout.dtype], layout.elem_size
    out = np.empty((mp.rows, mp.row_elems), dtype=raw)
    i = 0
    for c in mp.chunks:
        span = (c.rows - 1) * mp.row_stride + mp.row_elems * es
        buf = (ctypes.c_uint8 * span).from_address(view.page_address(pages[c.page]) + c.offset)
        out[i : i + c.rows] = np.ndarray((c.rows, mp.row_elems), dtype=raw, buffer=buf, strides=(mp.row_stride, es))
        i += c.rows
    return out
