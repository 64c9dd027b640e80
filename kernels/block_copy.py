"""One Triton launch that copies fixed-size units between two buffers by index.

``copy_units(src, dst, src_idx, dst_idx)`` copies unit ``src_idx[i]`` of ``src`` (a 2-D
tensor of units, one row each) to unit ``dst_idx[i]`` of ``dst``, for every ``i``, in one
launch: the KV block mover's data path (``clients/vllm/block_mover.py``) between the arena's
pages and vLLM's KV cache, a gather and a scatter in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Words per program along a unit.
BLOCK = 1024


@triton.jit
def _copy_units_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, unit, BLOCK: tl.constexpr):
    u = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(src_idx_ptr + u).to(tl.int64)
    d = tl.load(dst_idx_ptr + u).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < unit
    x = tl.load(src_ptr + s * unit + offs, mask=mask)
    tl.store(dst_ptr + d * unit + offs, x, mask=mask)


def copy_units(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for rows of two contiguous-row 2-D tensors of one
    dtype and row length, in one launch (the indices: int64, on the tensors' device)."""
    n = src_idx.numel()
    if n == 0:
        return
    unit = src.shape[1]
    if dst.shape[1] != unit or src.dtype != dst.dtype or src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError(f"units differ: {tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype}")
    if src.stride(0) != unit or dst.stride(0) != unit:
        raise ValueError("units must lie back to back (row stride = row length)")
    block = min(BLOCK, triton.next_power_of_2(unit))
    _copy_units_kernel[(n, triton.cdiv(unit, block))](src, dst, src_idx, dst_idx, unit, BLOCK=block)
