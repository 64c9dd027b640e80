"""Batched multi-LoRA shrink and expand as Triton kernels that gather adapter rows straight
out of the arena's physical view through per-slot int64 row-offset tables.

Two paths serve one launch of mixed adapters and base-only tokens: a per-token GEMV path for
decode-shaped batches and a segment path (tokens grouped by slot, tl.dot tiles) for
prefill-shaped ones; ``batch_plan`` chooses. This module owns the kernels and their launch
checks; it never builds offset tables or touches the arena's pages itself.

Rank granularity: rows are processed in blocks of 16 (``RANK_BLOCK``) bounded by each slot's
own rank, so a rank-r slot costs ceil(r / 16) row blocks whatever the tables' max rank; rows
past r inside the last block are masked (never loaded). The segment shrink fuses all slices'
rows into one column range of ``num_slices * r`` columns, rounded up to its column block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .batch_plan import BatchPlan, PathChoice, plan_batch
from .devices import same_device
from .records import LoraStep, LoraTables

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # a Triton without an interpreter: nothing here is interpreted
    InterpretedFunction = ()

# Rows of A or Bᵀ per block, in both paths; the unit in which a slot's rank is rounded up.
RANK_BLOCK = 16
MAX_SLICES = 3

# Launch shapes. Untuned defaults picked for hidden sizes in the thousands and ranks <= 128;
# they are constexprs, so tuning them on a GPU changes no code.
TOKEN_SHRINK_BLOCK_K = 256
TOKEN_EXPAND_BLOCK_N = 256
SEGMENT_SHRINK_BLOCK_K = 64
SEGMENT_SHRINK_MAX_BLOCK_N = 128
SEGMENT_EXPAND_BLOCK_N = 128


@triton.jit
def _slice_columns(j, OFF0, OFF1, OFF2, N0, N1, N2):
    # At most three slices: scalars select faster than a device table a launch must upload.
    first = tl.where(j == 0, OFF0, tl.where(j == 1, OFF1, OFF2))
    width = tl.where(j == 0, N0, tl.where(j == 1, N1, N2))
    return first, width


@triton.jit
def _expand_opening(slot, j, nb, ranks_ptr, scalings_ptr, OFF0, OFF1, OFF2, N0, N1, N2, BLOCK_N: tl.constexpr):
    """Both expand kernels' opening for a program of (slot, slice j, column block nb): the
    slice's first column and width, the slot's rank and scaling, and whether the program has
    nothing to do (a base-only slot, a column block past the slice, or rank 0: returning
    then keeps out bit-identical, where x + 0.0 would turn -0.0 into 0.0)."""
    first, width = _slice_columns(j, OFF0, OFF1, OFF2, N0, N1, N2)
    live = slot >= 0
    rank = tl.load(ranks_ptr + slot, mask=live, other=0)
    scaling = tl.load(scalings_ptr + slot, mask=live, other=0.0)
    idle = (slot < 0) | (nb * BLOCK_N >= width) | (rank == 0)
    return first, width, rank, scaling, idle


@triton.jit
def _shrink_token_kernel(
    x_ptr,
    arena_ptr,
    a_off_ptr,
    ranks_ptr,
    token_slot_ptr,
    y_ptr,
    K,
    NUM_SLICES,
    stride_xt,
    stride_xk,
    stride_as,
    stride_aj,
    stride_yj,
    stride_yt,
    K_PER_SPLIT,
    ROW_ALIGN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SLICE_BLOCK: tl.constexpr,
):
    """Program (token t, slice group, row block rb, K split): y[j, t, rows] = x[t] · A rows, no tl.dot.

    SLICE_BLOCK == 1: one slice per program (slice j = program_id(1)). SLICE_BLOCK > 1 (a power
    of two >= the slice count, grid dimension 1 of size 1): one program takes the row block of
    every slice at once, a [SLICE_BLOCK * BLOCK_R, BLOCK_K] tile, so each block of x[t] is
    loaded once for all slices and all their rows are in flight together.
    With SPLIT_K > 1 each program covers K_PER_SPLIT columns of K and adds its partial sums
    into y atomically (the launcher zeroes those rows first): more programs for small batches.
    """
    t = tl.program_id(0)
    j0 = tl.program_id(1)
    rb = tl.program_id(2) // SPLIT_K
    k_lo = (tl.program_id(2) % SPLIT_K) * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    slot = tl.load(token_slot_ptr + t)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if rb * BLOCK_R >= rank:
        # Row blocks past this slot's rank: the grid is sized for the largest rank.
        return
    lane = tl.arange(0, SLICE_BLOCK * BLOCK_R)
    js = j0 + lane // BLOCK_R
    rows = rb * BLOCK_R + lane % BLOCK_R
    row_ok = (rows < rank) & (js < NUM_SLICES)
    row_off = tl.load(a_off_ptr + slot.to(tl.int64) * stride_as + js * stride_aj + rows, mask=row_ok, other=0)
    if ROW_ALIGN > 1:
        row_off = tl.multiple_of(row_off, ROW_ALIGN)
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    acc = tl.zeros([SLICE_BLOCK * BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        xv = tl.load(x_row + ks * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(arena_ptr + row_off[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
    y_ptrs = y_ptr + js * stride_yj + t.to(tl.int64) * stride_yt + rows
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc, mask=row_ok)
    else:
        tl.atomic_add(y_ptrs, acc, mask=row_ok, sem="relaxed")


@triton.jit
def _zero_rank_rows_kernel(token_slot_ptr, ranks_ptr, y_ptr, stride_yj, stride_yt, BLOCK_R: tl.constexpr):
    """Program (token t, slice j, row block rb): y[j, t, rows below the rank] = 0, the rows a
    split-K shrink adds into; nothing else (base-only tokens' rows and rows past the rank stay)."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    rb = tl.program_id(2)
    slot = tl.load(token_slot_ptr + t)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < rank
    tl.store(y_ptr + j * stride_yj + t.to(tl.int64) * stride_yt + rows, tl.zeros([BLOCK_R], tl.float32), mask=row_ok)


@triton.jit
def _expand_token_slice(
    y_ptr,
    arena_ptr,
    b_off_ptr,
    ranks_ptr,
    scalings_ptr,
    out_ptr,
    t,
    j,
    nb,
    slot,
    OFF0,
    OFF1,
    OFF2,
    N0,
    N1,
    N2,
    stride_yj,
    stride_yt,
    stride_bs,
    stride_bj,
    stride_ot,
    stride_on,
    ROW_ALIGN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One token's column block nb of slice j: out[t, cols] += s · y[j, t, :r] · Bᵀ rows."""
    first, width, rank, scaling, idle = _expand_opening(
        slot, j, nb, ranks_ptr, scalings_ptr, OFF0, OFF1, OFF2, N0, N1, N2, BLOCK_N
    )
    if not idle:
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < width
        y_row = y_ptr + j * stride_yj + t.to(tl.int64) * stride_yt
        b_rows = b_off_ptr + slot.to(tl.int64) * stride_bs + j * stride_bj
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_ok = rows < rank
            yv = tl.load(y_row + rows, mask=row_ok, other=0.0)
            row_off = tl.load(b_rows + rows, mask=row_ok, other=0)
            if ROW_ALIGN > 1:
                row_off = tl.multiple_of(row_off, ROW_ALIGN)
            w = tl.load(arena_ptr + row_off[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * yv[:, None], axis=0)
        o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + (first + cols) * stride_on
        o = tl.load(o_ptrs, mask=col_ok)
        tl.store(o_ptrs, (o.to(tl.float32) + scaling * acc).to(o.dtype), mask=col_ok)


@triton.jit
def _expand_token_kernel(
    y_ptr,
    arena_ptr,
    b_off_ptr,
    ranks_ptr,
    scalings_ptr,
    token_slot_ptr,
    out_ptr,
    OFF0,
    OFF1,
    OFF2,
    N0,
    N1,
    N2,
    NUM_SLICES,
    stride_yj,
    stride_yt,
    stride_bs,
    stride_bj,
    stride_ot,
    stride_on,
    ROW_ALIGN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FUSE_SLICES: tl.constexpr,
):
    """Program (token t, slice j, column block nb): out[t, cols] += s · y[j, t, :r] · Bᵀ rows.

    FUSE_SLICES (grid dimension 1 of size 1): one program does column block nb of every
    slice in turn, so a token's slot, rank and scaling are read once and its programs are a
    third as many for three slices (the expand fused over slices).
    """
    t = tl.program_id(0)
    nb = tl.program_id(2)
    slot = tl.load(token_slot_ptr + t)
    if FUSE_SLICES:
        for j in tl.static_range(3):  # MAX_SLICES (a jit function reads no plain globals)
            if j < NUM_SLICES:
                _expand_token_slice(
                    y_ptr, arena_ptr, b_off_ptr, ranks_ptr, scalings_ptr, out_ptr, t, j, nb, slot,
                    OFF0, OFF1, OFF2, N0, N1, N2, stride_yj, stride_yt, stride_bs, stride_bj, stride_ot, stride_on,
                    ROW_ALIGN, BLOCK_R, BLOCK_N,
                )  # fmt: skip
    else:
        _expand_token_slice(
            y_ptr, arena_ptr, b_off_ptr, ranks_ptr, scalings_ptr, out_ptr, t, tl.program_id(1), nb, slot,
            OFF0, OFF1, OFF2, N0, N1, N2, stride_yj, stride_yt, stride_bs, stride_bj, stride_ot, stride_on,
            ROW_ALIGN, BLOCK_R, BLOCK_N,
        )  # fmt: skip


@triton.jit
def _shrink_segment_kernel(
    x_ptr,
    arena_ptr,
    a_off_ptr,
    ranks_ptr,
    y_ptr,
    order_ptr,
    tile_slot_ptr,
    tile_start_ptr,
    tile_end_ptr,
    K,
    NUM_SLICES,
    NUM_COL_BLOCKS,
    stride_xt,
    stride_xk,
    stride_as,
    stride_aj,
    stride_yj,
    stride_yt,
    ROW_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (tile, column block): y for up to BLOCK_M tokens of one slot, tl.dot over K.

    Columns are (slice, row) pairs, c = j * rank + i, so every slice of a low-rank adapter
    shares one pass over the tile's x (x, not the weights, dominates a prefill's traffic).
    """
    pid = tl.program_id(0)
    # A tile's column blocks are adjacent programs, so they share its x through L2.
    tile = pid // NUM_COL_BLOCKS
    nb = pid % NUM_COL_BLOCKS
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if nb * BLOCK_N >= NUM_SLICES * rank:
        return
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    pos = start + tl.arange(0, BLOCK_M)
    tok_ok = pos < end
    tok = tl.load(order_ptr + pos, mask=tok_ok, other=0).to(tl.int64)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < NUM_SLICES * rank
    col_slice = cols // rank
    col_row = cols % rank
    row_off = tl.load(a_off_ptr + slot.to(tl.int64) * stride_as + col_slice * stride_aj + col_row, mask=col_ok, other=0)
    if ROW_ALIGN > 1:
        row_off = tl.multiple_of(row_off, ROW_ALIGN)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(
            x_ptr + tok[:, None] * stride_xt + ks[None, :] * stride_xk, mask=tok_ok[:, None] & k_ok[None, :], other=0.0
        )
        # [BLOCK_N, BLOCK_K]: each row contiguous in the arena, so load rows and transpose.
        wt = tl.load(arena_ptr + row_off[:, None] + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + col_slice[None, :] * stride_yj + tok[:, None] * stride_yt + col_row[None, :]
    tl.store(y_ptrs, acc, mask=tok_ok[:, None] & col_ok[None, :])


@triton.jit
def _expand_segment_kernel(
    y_ptr,
    arena_ptr,
    b_off_ptr,
    ranks_ptr,
    scalings_ptr,
    out_ptr,
    order_ptr,
    tile_slot_ptr,
    tile_start_ptr,
    tile_end_ptr,
    OFF0,
    OFF1,
    OFF2,
    N0,
    N1,
    N2,
    stride_yj,
    stride_yt,
    stride_bs,
    stride_bj,
    stride_ot,
    stride_on,
    ROW_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (tile, slice j, column block): out tile += s · y tile · Bᵀ rows, tl.dot over rank.

    The dot runs in fp32 (tf32 on tensor cores for fp16/bf16 weights): the weights convert
    exactly and y keeps more precision than a cast to the weight dtype would leave it.
    """
    tile = tl.program_id(0)
    j = tl.program_id(1)
    nb = tl.program_id(2)
    slot = tl.load(tile_slot_ptr + tile)
    first, width, rank, scaling, idle = _expand_opening(
        slot, j, nb, ranks_ptr, scalings_ptr, OFF0, OFF1, OFF2, N0, N1, N2, BLOCK_N
    )
    if idle:
        return
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    pos = start + tl.arange(0, BLOCK_M)
    tok_ok = pos < end
    tok = tl.load(order_ptr + pos, mask=tok_ok, other=0).to(tl.int64)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    b_rows = b_off_ptr + slot.to(tl.int64) * stride_bs + j * stride_bj
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < rank
        yt = tl.load(
            y_ptr + j * stride_yj + tok[:, None] * stride_yt + rows[None, :],
            mask=tok_ok[:, None] & row_ok[None, :],
            other=0.0,
        )
        row_off = tl.load(b_rows + rows, mask=row_ok, other=0)
        if ROW_ALIGN > 1:
            row_off = tl.multiple_of(row_off, ROW_ALIGN)
        wt = tl.load(arena_ptr + row_off[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(yt, wt.to(tl.float32), acc, input_precision=DOT_PRECISION)
    o_ptrs = out_ptr + tok[:, None] * stride_ot + (first + cols)[None, :] * stride_on
    o_ok = tok_ok[:, None] & col_ok[None, :]
    o = tl.load(o_ptrs, mask=o_ok)
    tl.store(o_ptrs, (o.to(tl.float32) + scaling * acc).to(o.dtype), mask=o_ok)


# True when Triton's interpreter runs these kernels (TRITON_INTERPRET=1 was set before triton
# loaded): numpy on the host, CPU tensors allowed. Its bfloat16 differs from a GPU's in two
# ways the launchers work around (see ``shrink`` and ``expand``): tl.dot multiplies bf16 bit
# patterns as integers, and an fp32 -> bf16 cast truncates instead of rounding to nearest.
INTERPRETED = isinstance(_shrink_token_kernel, InterpretedFunction)


def segment_shrink_block_n(num_slices: int, max_rank: int) -> int:
    """Columns per segment-shrink program: all (slice, row) columns at once up to 128."""
    return min(SEGMENT_SHRINK_MAX_BLOCK_N, max(RANK_BLOCK, triton.next_power_of_2(num_slices * max_rank)))


def segment_shrink_warps(block_m: int, block_n: int) -> int:
    # A 64x128 tile with gathered 64-bit row pointers spills at 4 warps (ptxas, sm_90).
    return 8 if block_m * block_n > 64 * 64 else 4


def segment_expand_warps(block_m: int) -> int:
    # Same budget: past 64x128 the fp32 accumulator alone fills 4 warps' registers.
    return 8 if block_m * SEGMENT_EXPAND_BLOCK_N > 64 * 128 else 4


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 weights exist for reference runs: keep them exact rather than tf32 on a GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_common(
    arena: torch.Tensor, offsets: torch.Tensor, ranks: torch.Tensor, token_slot: torch.Tensor, name: str
) -> None:
    if arena.device.type != "cuda" and not INTERPRETED:
        # Triton would fail later with "0 active drivers", which says nothing about the fix.
        raise ValueError(
            f"the Triton LoRA kernels need CUDA tensors, got an arena on {arena.device}; on a machine "
            "without a GPU call memory_broker.kernels.lora_apply (it picks the torch path), or set "
            "TRITON_INTERPRET=1 before triton is first imported to run these kernels interpreted"
        )
    if arena.dim() != 1 or arena.stride(0) != 1:
        raise ValueError(
            f"arena must be a contiguous 1-D tensor, got shape {tuple(arena.shape)} stride {arena.stride()}"
        )
    if arena.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"arena dtype must be float16, bfloat16 or float32, got {arena.dtype}")
    if offsets.dim() != 3 or offsets.dtype != torch.int64 or offsets.stride(2) != 1:
        raise ValueError(
            f"{name} must be int64 [num_slots, num_slices, max_rank] with a contiguous last dimension, "
            f"got {offsets.dtype} shape {tuple(offsets.shape)}"
        )
    if not 1 <= offsets.shape[1] <= MAX_SLICES:
        raise ValueError(f"{name} has {offsets.shape[1]} slices; 1 to {MAX_SLICES} are supported")
    if ranks.dtype != torch.int32 or ranks.shape != (offsets.shape[0],):
        raise ValueError(f"ranks must be int32 [{offsets.shape[0]}], got {ranks.dtype} shape {tuple(ranks.shape)}")
    if token_slot.dtype != torch.int32 or token_slot.dim() != 1:
        raise ValueError(f"token_slot must be int32 [T], got {token_slot.dtype} shape {tuple(token_slot.shape)}")
    for t in (offsets, ranks, token_slot):
        if not same_device(t.device, arena.device):
            raise ValueError(f"all tensors must be on the arena's device {arena.device}, found one on {t.device}")


def _plan_for(plan: BatchPlan | None, token_slot: torch.Tensor, num_slots: int, path: PathChoice) -> BatchPlan:
    if plan is None:
        return plan_batch(token_slot, num_slots, path=path)
    if plan.num_tokens != token_slot.shape[0] or plan.num_slots != num_slots:
        raise ValueError(
            f"plan was built for {plan.num_tokens} tokens and {plan.num_slots} slots, "
            f"called with {token_slot.shape[0]} tokens and {num_slots} slots"
        )
    return plan


def shrink(
    x: torch.Tensor,
    arena: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    token_slot: torch.Tensor,
    *,
    y: torch.Tensor | None = None,
    plan: BatchPlan | None = None,
    path: PathChoice = "auto",
    row_align: int = 1,
) -> torch.Tensor:
    """y[j, t, :r] = x[t] @ A_{slot(t), j}ᵀ for every slice j, in fp32.

    Only rows below each token's rank are written: rows >= rank and the rows of base-only
    tokens are left untouched (uninitialised when y is allocated here); ``expand`` never
    reads them.

    Args:
        x: [T, K], the arena's dtype; K is in_features.
        arena: 1-D contiguous physical view of the pages (fp16, bf16 or fp32).
        a_offsets: int64 [num_slots, num_slices, max_rank], element offset of each row of A.
        ranks: int32 [num_slots].
        token_slot: int32 [T], slot per token, -1 for base-only.
        y: optional fp32 [num_slices, T, max_rank] output (last dimension contiguous).
        plan: from ``plan_batch``, shared with ``expand``; built here when omitted.
        path: "auto", "token" or "segment" when no plan is given.
        row_align: every row offset is a multiple of this many elements (8 for 16-byte
            aligned fp16 rows lets a GPU vectorise the gathers); 1 promises nothing.

    Returns:
        y.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit together.
    """
    _check_common(arena, a_offsets, ranks, token_slot, "a_offsets")
    num_slots, num_slices, max_rank = a_offsets.shape
    num_tokens = token_slot.shape[0]
    y = _shrink_output(x, arena, y, num_tokens, num_slices, max_rank)
    plan = _plan_for(plan, token_slot, num_slots, path)
    if num_tokens == 0 or num_slots == 0 or max_rank == 0:
        return y
    if INTERPRETED and arena.dtype == torch.bfloat16 and plan.path == "segment":
        # The interpreter's bf16 tl.dot is wrong; fp32 copies are exact and its fp32 dot is right.
        # (A copy of the whole arena: the interpreter is for tests and debugging.)
        x, arena = x.float(), arena.float()
    if plan.path == "token":
        _launch_shrink_token(
            x, arena, a_offsets, ranks, token_slot, y, row_align, plan.split_k, plan.fuse_shrink_slices
        )
    else:
        _launch_shrink_segment(x, arena, a_offsets, ranks, y, plan.segments, row_align)
    return y


def _shrink_output(
    x: torch.Tensor, arena: torch.Tensor, y: torch.Tensor | None, num_tokens: int, num_slices: int, max_rank: int
) -> torch.Tensor:
    """``shrink``'s checks of x, and its output: ``y`` checked, or a new one."""
    if x.dim() != 2 or x.shape[0] != num_tokens:
        raise ValueError(f"x must be [T={num_tokens}, K], got shape {tuple(x.shape)}")
    if x.dtype != arena.dtype:
        raise ValueError(f"x dtype {x.dtype} differs from the arena's {arena.dtype}")
    if y is None:
        return torch.empty((num_slices, num_tokens, max_rank), dtype=torch.float32, device=x.device)
    if y.shape != (num_slices, num_tokens, max_rank) or y.dtype != torch.float32 or y.stride(2) != 1:
        raise ValueError(
            f"y must be float32 [{num_slices}, {num_tokens}, {max_rank}] with a contiguous last dimension, "
            f"got {y.dtype} shape {tuple(y.shape)}"
        )
    return y


def _launch_shrink_token(
    x, arena, a_offsets, ranks, token_slot, y, row_align: int, split_k: int = 1, fuse_slices: bool = False
) -> None:
    """``shrink`` on the per-token path: one program per (token, slice, rank block, K split), or
    with ``fuse_slices`` per (token, rank block, K split) covering every slice."""
    num_tokens, in_features = x.shape
    num_slices, max_rank = a_offsets.shape[1:]
    slice_block = triton.next_power_of_2(num_slices) if fuse_slices else 1
    rank_blocks = triton.cdiv(max_rank, RANK_BLOCK)
    split_k = max(1, min(split_k, triton.cdiv(in_features, TOKEN_SHRINK_BLOCK_K)))
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), TOKEN_SHRINK_BLOCK_K) * TOKEN_SHRINK_BLOCK_K
    if split_k > 1:
        _zero_rank_rows_kernel[(num_tokens, num_slices, rank_blocks)](
            token_slot, ranks, y, y.stride(0), y.stride(1), BLOCK_R=RANK_BLOCK
        )
    _shrink_token_kernel[(num_tokens, 1 if fuse_slices else num_slices, rank_blocks * split_k)](
        x,
        arena,
        a_offsets,
        ranks,
        token_slot,
        y,
        in_features,
        num_slices,
        x.stride(0),
        x.stride(1),
        a_offsets.stride(0),
        a_offsets.stride(1),
        y.stride(0),
        y.stride(1),
        k_per_split,
        ROW_ALIGN=row_align,
        BLOCK_R=RANK_BLOCK,
        BLOCK_K=TOKEN_SHRINK_BLOCK_K,
        SPLIT_K=split_k,
        SLICE_BLOCK=slice_block,
    )


def _launch_shrink_segment(x, arena, a_offsets, ranks, y, seg, row_align: int) -> None:
    """``shrink`` on the segment path: one program per (tile of one slot's tokens, column block)."""
    in_features = x.shape[1]
    num_slices, max_rank = a_offsets.shape[1:]
    block_n = segment_shrink_block_n(num_slices, max_rank)
    col_blocks = triton.cdiv(num_slices * max_rank, block_n)
    _shrink_segment_kernel[(seg.num_tiles * col_blocks,)](
        x,
        arena,
        a_offsets,
        ranks,
        y,
        seg.order,
        seg.tile_slot,
        seg.tile_start,
        seg.tile_end,
        in_features,
        num_slices,
        col_blocks,
        x.stride(0),
        x.stride(1),
        a_offsets.stride(0),
        a_offsets.stride(1),
        y.stride(0),
        y.stride(1),
        ROW_ALIGN=row_align,
        DOT_PRECISION=dot_precision(arena.dtype),
        BLOCK_M=seg.block_m,
        BLOCK_N=block_n,
        BLOCK_K=SEGMENT_SHRINK_BLOCK_K,
        num_warps=segment_shrink_warps(seg.block_m, block_n),
    )


def expand(
    y: torch.Tensor,
    arena: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slot: torch.Tensor,
    out: torch.Tensor,
    slice_offsets: Sequence[int],
    slice_sizes: Sequence[int],
    *,
    plan: BatchPlan | None = None,
    path: PathChoice = "auto",
    row_align: int = 1,
) -> torch.Tensor:
    """out[t, off_j : off_j + n_j] += scaling_slot · y[j, t, :r] @ Bᵀ_{slot, j} rows, in place.

    Accumulates in fp32 and rounds once to out's dtype. Tokens with slot -1 or a rank-0 slot
    are not touched at all (their outputs stay bit-identical).

    Args:
        y: fp32 [num_slices, T, max_rank] from ``shrink``.
        arena: the same arena view as for ``shrink``.
        b_offsets: int64 [num_slots, num_slices, max_rank], element offset of each row of Bᵀ.
        ranks: int32 [num_slots]; scalings: fp32 [num_slots].
        token_slot: int32 [T].
        out: [T, total_out] base output (any float dtype, any strides), updated in place.
        slice_offsets, slice_sizes: per slice, its first column in out and its width.
        plan, path, row_align: as for ``shrink``.

    Returns:
        out.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit together.
    """
    _check_common(arena, b_offsets, ranks, token_slot, "b_offsets")
    num_slots, num_slices, max_rank = b_offsets.shape
    num_tokens = token_slot.shape[0]
    if (
        scalings.dtype != torch.float32
        or scalings.shape != (num_slots,)
        or not same_device(scalings.device, arena.device)
    ):
        raise ValueError(
            f"scalings must be float32 [{num_slots}] on {arena.device}, got {scalings.dtype} {tuple(scalings.shape)}"
        )
    if y.shape != (num_slices, num_tokens, max_rank) or y.dtype != torch.float32 or y.stride(2) != 1:
        raise ValueError(
            f"y must be float32 [{num_slices}, {num_tokens}, {max_rank}] with a contiguous last dimension, "
            f"got {y.dtype} shape {tuple(y.shape)}"
        )
    if out.dim() != 2 or out.shape[0] != num_tokens or not out.is_floating_point():
        raise ValueError(f"out must be a float [T={num_tokens}, N] tensor, got {out.dtype} shape {tuple(out.shape)}")
    if len(slice_offsets) != num_slices or len(slice_sizes) != num_slices:
        raise ValueError(f"need {num_slices} slice offsets and sizes, got {len(slice_offsets)} and {len(slice_sizes)}")
    for j, (first, width) in enumerate(zip(slice_offsets, slice_sizes)):
        if first < 0 or width < 0 or first + width > out.shape[1]:
            raise ValueError(f"slice {j} spans columns [{first}, {first + width}) outside out's {out.shape[1]} columns")
    plan = _plan_for(plan, token_slot, num_slots, path)
    max_width = max(slice_sizes)
    if num_tokens == 0 or num_slots == 0 or max_rank == 0 or max_width == 0:
        return out
    if INTERPRETED and out.dtype == torch.bfloat16:
        # The interpreter truncates fp32 -> bf16; a GPU rounds to nearest even. Run on an fp32
        # copy (untouched entries convert back exactly, -0.0 included) and let torch round.
        wide = out.float()
        _expand(y, arena, b_offsets, ranks, scalings, token_slot, wide, slice_offsets, slice_sizes, plan, row_align)
        return out.copy_(wide)
    return _expand(y, arena, b_offsets, ranks, scalings, token_slot, out, slice_offsets, slice_sizes, plan, row_align)


def _expand(y, arena, b_offsets, ranks, scalings, token_slot, out, slice_offsets, slice_sizes, plan, row_align):
    num_tokens = token_slot.shape[0]
    num_slices = b_offsets.shape[1]
    # Unused slice parameters repeat slice 0 so every select has a valid value.
    offs = list(slice_offsets) + [slice_offsets[0]] * (MAX_SLICES - num_slices)
    sizes = list(slice_sizes) + [slice_sizes[0]] * (MAX_SLICES - num_slices)
    if plan.path == "token":
        fuse = plan.fuse_expand_slices
        grid = (num_tokens, 1 if fuse else num_slices, triton.cdiv(max(slice_sizes), TOKEN_EXPAND_BLOCK_N))
        _expand_token_kernel[grid](
            y,
            arena,
            b_offsets,
            ranks,
            scalings,
            token_slot,
            out,
            *offs,
            *sizes,
            num_slices,
            y.stride(0),
            y.stride(1),
            b_offsets.stride(0),
            b_offsets.stride(1),
            out.stride(0),
            out.stride(1),
            ROW_ALIGN=row_align,
            BLOCK_R=RANK_BLOCK,
            BLOCK_N=TOKEN_EXPAND_BLOCK_N,
            FUSE_SLICES=fuse,
        )
    else:
        seg = plan.segments
        grid = (seg.num_tiles, num_slices, triton.cdiv(max(slice_sizes), SEGMENT_EXPAND_BLOCK_N))
        _expand_segment_kernel[grid](
            y,
            arena,
            b_offsets,
            ranks,
            scalings,
            out,
            seg.order,
            seg.tile_slot,
            seg.tile_start,
            seg.tile_end,
            *offs,
            *sizes,
            y.stride(0),
            y.stride(1),
            b_offsets.stride(0),
            b_offsets.stride(1),
            out.stride(0),
            out.stride(1),
            ROW_ALIGN=row_align,
            DOT_PRECISION=dot_precision(arena.dtype),
            BLOCK_M=seg.block_m,
            BLOCK_N=SEGMENT_EXPAND_BLOCK_N,
            BLOCK_R=RANK_BLOCK,
            num_warps=segment_expand_warps(seg.block_m),
        )
    return out


def lora_apply(
    x: torch.Tensor,
    out: torch.Tensor,
    arena: torch.Tensor,
    tables: LoraTables,
    step: LoraStep,
    slice_offsets: Sequence[int],
    slice_sizes: Sequence[int],
    *,
    path: PathChoice = "auto",
    y: torch.Tensor | None = None,
    row_align: int = 1,
) -> torch.Tensor:
    """out += LoRA(x) for every token's adapter: ``shrink`` then ``expand`` with one plan.

    Args:
        x, out, arena, slice_offsets, slice_sizes, y, row_align: as for ``shrink``/``expand``.
        tables: the launch's offset tables, ranks and scalings.
        step: each token's slot, and the step's plan (built here from ``path`` when it has none).

    Returns:
        out, updated in place.
    """
    a_offsets, b_offsets, ranks, scalings = tables
    if a_offsets.shape != b_offsets.shape:
        raise ValueError(f"a_offsets {tuple(a_offsets.shape)} and b_offsets {tuple(b_offsets.shape)} differ in shape")
    token_slot = step.token_slot
    plan = _plan_for(step.plan, token_slot, a_offsets.shape[0], path)
    y = shrink(x, arena, a_offsets, ranks, token_slot, y=y, plan=plan, row_align=row_align)
    return expand(
        y,
        arena,
        b_offsets,
        ranks,
        scalings,
        token_slot,
        out,
        slice_offsets,
        slice_sizes,
        plan=plan,
        row_align=row_align,
    )
