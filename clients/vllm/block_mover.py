"""Copies a step's KV blocks between the broker's pages and a KV cache tensor, by index.

``BlockMover`` takes a KV cache's per-layer tensors as vLLM lays them out (any strides: the
FlashAttention layout ``(2, num_blocks, block_size, num_kv_heads, head_size)``, FlashInfer's
``(num_blocks, 2, block_size, num_kv_heads, head_size)`` in NHD or HND strides, vLLM 0.32's
``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` views in any of its physical
orders) and the dimension that indexes blocks. A stored block object holds a block's bytes
layer after layer; each layer's bytes are the block's elements in the tensor's memory order
(for a block-contiguous layout, simply the block's bytes as they lie).

A step's copy is planned as units: the largest byte run that is contiguous in the cache,
divides the page size and never crosses a page, and for each layer the mover builds one
index of source units and one of destination units (for all the step's blocks at once) and
copies them in one launch (``kernels/block_copy.py``, Triton, when pages and cache share a
GPU) or two (``index_select`` then ``index_copy_``, on a CPU or across devices: a host
arena feeding a GPU cache gathers on the host, moves once, scatters on the GPU). Never one
launch per block. It imports nothing from vLLM, so a GPU machine without vLLM can test it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

# "triton" (one launch per layer; a GPU, or TRITON_INTERPRET=1), "torch" (two), or "auto":
# Triton where pages and cache are on one CUDA device, torch otherwise.
BACKEND_ENV = "MEMORY_BROKER_KV_MOVER"


class _LayerPlan:
    """Where a layer's block image's units lie in its tensor's storage (see the module docstring)."""

    def __init__(self, t: torch.Tensor, block_dim: int):
        elt = t.element_size()
        dims = [(s, st) for d, (s, st) in enumerate(zip(t.shape, t.stride())) if d != block_dim and s != 1]
        dims.sort(key=lambda x: -x[1])
        run = 1  # elements contiguous in memory at the image's tail
        while dims and dims[-1][1] == run:
            run *= dims.pop()[0]
        outer = torch.zeros(1, dtype=torch.int64)
        for size, stride in dims:  # the runs' element offsets, in image order
            outer = (outer[:, None] + torch.arange(size, dtype=torch.int64)[None, :] * stride).reshape(-1)
        self.element_size = elt
        self.run_bytes = run * elt
        self.nbytes = outer.numel() * self.run_bytes
        self.block_stride_bytes = t.stride(block_dim) * elt
        self.base_bytes = t.storage_offset() * elt
        self.outer_bytes = outer * elt
        self.strides_bytes = [st * elt for _, st in dims]

    def alignment(self) -> int:
        """What every run's start and length in the storage is a multiple of."""
        g = math.gcd(self.run_bytes, self.block_stride_bytes, self.base_bytes)
        for s in self.strides_bytes:
            g = math.gcd(g, s)
        return g

    def unit_offsets(self, unit: int) -> torch.Tensor:
        """Byte offsets in the storage of block 0's image units (block ``b`` adds ``b * block_stride_bytes``)."""
        per_run = self.run_bytes // unit
        within = torch.arange(per_run, dtype=torch.int64) * unit
        return (self.base_bytes + self.outer_bytes[:, None] + within[None, :]).reshape(-1)


def _word_dtype(unit: int, *ptrs: int) -> torch.dtype:
    for dt, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if unit % w == 0 and all(p % w == 0 for p in ptrs):
            return dt
    return torch.uint8


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class BlockMover:
    """Copies blocks between arena pages and a KV cache's layers (see the module docstring).

    Args:
        layers: one tensor per layer, each with a dimension of ``num_blocks`` at ``block_dim``;
            every layer's block holds the same number of bytes.
        block_dim: the dimension indexing blocks (one for all layers, or one per layer).
        page_size: the arena's page size in bytes.
        backend: "auto", "triton" or "torch" (default: ``$MEMORY_BROKER_KV_MOVER``, else auto).
    """

    def __init__(
        self, layers: Sequence[torch.Tensor], block_dim: int | Sequence[int], page_size: int, backend: str | None = None
    ):
        if not layers:
            raise ValueError("a block mover needs at least one layer")
        dims = [block_dim] * len(layers) if isinstance(block_dim, int) else list(block_dim)
        self.layers = list(layers)
        self.plans = [_LayerPlan(t, d) for t, d in zip(self.layers, dims)]
        nbytes = {p.nbytes for p in self.plans}
        if len(nbytes) != 1:
            raise ValueError(f"layers differ in KV bytes per block: {sorted(nbytes)}")
        self.layer_nbytes = nbytes.pop()
        self.block_nbytes = self.layer_nbytes * len(self.layers)
        self.page_size = page_size
        unit = math.gcd(page_size, self.layer_nbytes)
        for p in self.plans:
            unit = math.gcd(unit, p.alignment())
        self.unit = unit
        self.backend = backend or os.environ.get(BACKEND_ENV, "auto")
        if self.backend not in ("auto", "triton", "torch"):
            raise ValueError(f"{BACKEND_ENV}={self.backend!r}: use auto, triton or torch")
        device = self.layers[0].device
        self._kv_units = [self._unit_offsets_on(p, device) for p in self.plans]
        self._obj_units = torch.arange(self.layer_nbytes // unit, dtype=torch.int64) * unit
        # Launches made (copies, per layer); tests count them.
        self.launches = 0

    def _unit_offsets_on(self, plan: _LayerPlan, device: torch.device) -> torch.Tensor:
        return plan.unit_offsets(self.unit).to(device)

    @property
    def pages_per_block(self) -> int:
        return max(1, -(-self.block_nbytes // self.page_size))

    # ---------------------------------------------------------------- indices

    def _page_table(self, block_pages: Sequence[Sequence[int]]) -> torch.Tensor:
        k = self.pages_per_block
        for pages in block_pages:
            if len(pages) < k:
                raise ValueError(f"an object of {len(pages)} pages is smaller than a block's {self.block_nbytes} bytes")
        return torch.tensor([list(p[:k]) for p in block_pages], dtype=torch.int64).reshape(len(block_pages), k)

    def _phys_units(self, table: torch.Tensor, layer: int) -> torch.Tensor:
        """(blocks x units) unit indices in the physical view of ``layer``'s image."""
        off = layer * self.layer_nbytes + self._obj_units.to(table.device)
        page, within = off // self.page_size, off % self.page_size
        return ((table[:, page] * self.page_size + within[None, :]) // self.unit).reshape(-1)

    def _kv_unit_index(self, block_ids: torch.Tensor, layer: int) -> torch.Tensor:
        p = self.plans[layer]
        base = self._kv_units[layer]
        return ((block_ids[:, None] * p.block_stride_bytes + base[None, :]) // self.unit).reshape(-1)

    # ---------------------------------------------------------------- copies

    def load(self, phys: torch.Tensor, block_ids: Sequence[int], block_pages: Sequence[Sequence[int]]) -> None:
        """Copy objects (``block_pages[i]``, in the flat uint8 physical view ``phys``) into
        blocks ``block_ids[i]`` of every layer."""
        if not block_ids:
            return
        table = self._page_table(block_pages).to(phys.device)
        for li in range(len(self.layers)):
            self._copy(phys, table, block_ids, li, to_kv=True)

    def save(
        self,
        phys: torch.Tensor,
        block_ids: Sequence[int],
        block_pages: Sequence[Sequence[int]],
        layer: int | None = None,
    ) -> None:
        """Copy blocks ``block_ids[i]`` of ``layer`` (every layer when None) into the objects
        ``block_pages[i]``."""
        if not block_ids:
            return
        table = self._page_table(block_pages).to(phys.device)
        for li in range(len(self.layers)) if layer is None else (layer,):
            self._copy(phys, table, block_ids, li, to_kv=False)

    def _copy(self, phys: torch.Tensor, table: torch.Tensor, block_ids: Sequence[int], li: int, to_kv: bool) -> None:
        t = self.layers[li]
        storage = _storage_bytes(t)
        wdt = _word_dtype(self.unit, storage.data_ptr(), phys.data_ptr())
        kv_units = storage[: storage.numel() - storage.numel() % self.unit].view(wdt).view(-1, self.unit // _width(wdt))
        ph_units = phys[: phys.numel() - phys.numel() % self.unit].view(wdt).view(-1, self.unit // _width(wdt))
        kv_idx = self._kv_unit_index(torch.as_tensor(block_ids, dtype=torch.int64, device=t.device), li)
        ph_idx = self._phys_units(table, li)
        src, dst, s_idx, d_idx = (ph_units, kv_units, ph_idx, kv_idx) if to_kv else (kv_units, ph_units, kv_idx, ph_idx)
        one_device = src.device == dst.device
        if one_device and self._use_triton(src.device):
            from memory_broker.kernels.block_copy import copy_units

            copy_units(src, dst, s_idx, d_idx)
            self.launches += 1
            return
        gathered = src.index_select(0, s_idx)
        if not one_device:
            gathered = gathered.to(dst.device, non_blocking=False)
            d_idx = d_idx.to(dst.device)
        dst.index_copy_(0, d_idx, gathered)
        self.launches += 2

    def _use_triton(self, device: torch.device) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "triton":
            return True
        return device.type == "cuda"


def _width(dt: torch.dtype) -> int:
    return torch.empty(0, dtype=dt).element_size()
