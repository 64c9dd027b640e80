"""The segment plan (``batch_plan.SegmentTiles``: tokens in slot order, tiles of one slot) built
by one Triton launch of one program, into buffers sized once for the largest batch.

``batch_plan.build_segment_tiles`` builds the same plan from about twenty small torch ops, each
its own launch; this kernel is a counting sort in three passes over the tokens (count per slot,
place each token, cut each slot's run into tiles), with no host synchronisation and no
allocation per step (``SegmentPlanner``), so a step that plans can be captured in a CUDA graph.
Its result equals ``build_segment_tiles``'s entry for entry (tested under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .batch_plan import BLOCK_M_CHOICES, BatchPlan, SegmentTiles

# Slots one launch can plan: the kernel keeps one counter per slot in registers.
MAX_PLAN_SLOTS = 4095
# Elements of the [tokens, slots] one-hot block each pass works on.
_BLOCK_ELEMS = 8192


@triton.jit
def _segment_plan_kernel(
    token_slot_ptr,
    order_ptr,
    tile_slot_ptr,
    tile_start_ptr,
    tile_end_ptr,
    num_tokens,
    num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    KEYS: tl.constexpr,
):
    """One program. Key k = slot + 1 (key 0: base-only tokens, which sort first)."""
    keys = tl.arange(0, KEYS)
    lane = tl.arange(0, BLOCK_T)
    # Pass 1: tokens per key.
    counts = tl.zeros([KEYS], dtype=tl.int32)
    for t0 in range(0, num_tokens, BLOCK_T):
        ts = t0 + lane
        key = tl.load(token_slot_ptr + ts, mask=ts < num_tokens, other=-2) + 1
        counts += tl.sum((key[:, None] == keys[None, :]).to(tl.int32), axis=0)
    ends = tl.cumsum(counts, axis=0)
    starts = ends - counts
    # Pass 2: each token's place, stable: its key's cursor plus the earlier tokens of its key
    # in this block.
    cursor = starts
    for t0 in range(0, num_tokens, BLOCK_T):
        ts = t0 + lane
        t_ok = ts < num_tokens
        key = tl.load(token_slot_ptr + ts, mask=t_ok, other=-2) + 1
        onehot = key[:, None] == keys[None, :]
        base = tl.sum(tl.where(onehot, cursor[None, :], 0), axis=1)
        earlier = (key[:, None] == key[None, :]) & (lane[None, :] < lane[:, None])
        tl.store(order_ptr + base + tl.sum(earlier.to(tl.int32), axis=1), ts, mask=t_ok)
        cursor += tl.sum(onehot.to(tl.int32), axis=0)
    # Pass 3: each slot's run cut into tiles of BLOCK_M; tiles past the real ones get slot -1.
    tiles = tl.where(keys >= 1, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    tiles_end = tl.cumsum(tiles, axis=0)
    total = tl.sum(tiles, axis=0)
    for i0 in range(0, num_tiles, BLOCK_T):
        ti = i0 + lane
        # The owner is the first slot whose tiles end past ti (searchsorted, right).
        owner = tl.sum(((tiles_end[None, :] <= ti[:, None]) & (keys[None, :] >= 1)).to(tl.int32), axis=1)
        sel = keys[None, :] == (owner + 1)[:, None]
        first_tile = tl.sum(tl.where(sel, (tiles_end - tiles)[None, :], 0), axis=1)
        start = tl.sum(tl.where(sel, starts[None, :], 0), axis=1) + (ti - first_tile) * BLOCK_M
        end = tl.sum(tl.where(sel, ends[None, :], 0), axis=1)
        valid = ti < total
        ti_ok = ti < num_tiles
        tl.store(tile_slot_ptr + ti, tl.where(valid, owner, -1), mask=ti_ok)
        tl.store(tile_start_ptr + ti, tl.where(valid, start, 0), mask=ti_ok)
        tl.store(tile_end_ptr + ti, tl.where(valid, end, 0), mask=ti_ok)


def tile_bound(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Tiles a plan has room for: ``ceil(T / block_m) + min(num_slots, T)`` (each non-empty
    slot wastes at most one partial tile), as ``build_segment_tiles`` sizes them."""
    return -(-num_tokens // block_m) + min(num_slots, num_tokens)


def _launch_shape(num_slots: int) -> tuple[int, int]:
    keys = max(16, triton.next_power_of_2(num_slots + 1))
    return keys, max(16, min(128, _BLOCK_ELEMS // keys))


def build_segment_tiles_into(token_slot: torch.Tensor, num_slots: int, out: SegmentTiles) -> SegmentTiles:
    """Writes the plan of ``token_slot`` into ``out``'s tensors (one launch) and returns ``out``.

    ``out.order`` must hold T entries and the tile tensors ``tile_bound(T, num_slots, block_m)``.

    Raises:
        ValueError: buffers of the wrong size or dtype, a token_slot that is not int32 [T],
            a block_m the kernels are not built for, or more than ``MAX_PLAN_SLOTS`` slots.
    """
    num_tokens = token_slot.shape[0]
    bound = tile_bound(num_tokens, num_slots, out.block_m)
    if token_slot.dtype != torch.int32 or token_slot.dim() != 1:
        raise ValueError(f"token_slot must be int32 [T], got {token_slot.dtype} shape {tuple(token_slot.shape)}")
    if out.block_m not in BLOCK_M_CHOICES:
        raise ValueError(f"block_m must be one of {BLOCK_M_CHOICES}, got {out.block_m}")
    if not 0 <= num_slots <= MAX_PLAN_SLOTS:
        raise ValueError(
            f"the one-launch plan handles up to {MAX_PLAN_SLOTS} slots, got {num_slots}; "
            "use batch_plan.build_segment_tiles"
        )
    sizes = (out.order.shape[0], out.tile_slot.shape[0], out.tile_start.shape[0], out.tile_end.shape[0])
    if sizes != (num_tokens, bound, bound, bound):
        raise ValueError(f"plan buffers of {sizes} entries; need ({num_tokens}, {bound}, {bound}, {bound})")
    for t in (out.order, out.tile_slot, out.tile_start, out.tile_end):
        if t.dtype != torch.int32 or t.stride(0) != 1 or t.device != token_slot.device:
            raise ValueError(f"plan buffers must be contiguous int32 on {token_slot.device}, got {t.dtype} {t.device}")
    if num_tokens == 0:
        return out
    keys, block_t = _launch_shape(num_slots)
    _segment_plan_kernel[(1,)](
        token_slot,
        out.order,
        out.tile_slot,
        out.tile_start,
        out.tile_end,
        num_tokens,
        bound,
        BLOCK_M=out.block_m,
        BLOCK_T=block_t,
        KEYS=keys,
    )
    return out


def empty_tiles(num_tokens: int, num_slots: int, block_m: int, device: torch.device | str) -> SegmentTiles:
    """Buffers for the plan of ``num_tokens`` tokens over ``num_slots`` slots."""
    bound = tile_bound(num_tokens, num_slots, block_m)
    zeros = [torch.zeros(n, dtype=torch.int32, device=device) for n in (num_tokens, bound, bound, bound)]
    return SegmentTiles(*zeros, block_m=block_m)


def build_segment_tiles(token_slot: torch.Tensor, num_slots: int, block_m: int) -> SegmentTiles:
    """``batch_plan.build_segment_tiles`` in one launch (its buffers allocated here)."""
    return build_segment_tiles_into(
        token_slot, num_slots, empty_tiles(token_slot.shape[0], num_slots, block_m, token_slot.device)
    )


class SegmentPlanner:
    """A segment plan per (tokens, slots) shape, its buffers allocated on first use and then
    rewritten in place each step: the same tensors (same addresses) every step of a shape, as
    a CUDA graph replaying the plan and the kernels needs."""

    def __init__(self, block_m: int, device: torch.device | str):
        if block_m not in BLOCK_M_CHOICES:
            raise ValueError(f"block_m must be one of {BLOCK_M_CHOICES}, got {block_m}")
        self.block_m = block_m
        self.device = torch.device(device)
        self._plans: dict[tuple[int, int], BatchPlan] = {}

    def plan(self, token_slot: torch.Tensor, num_slots: int) -> BatchPlan:
        """The segment plan of ``token_slot`` over ``num_slots`` slots, written in one launch
        into this shape's buffers (allocated the first time the shape is seen)."""
        key = (token_slot.shape[0], num_slots)
        plan = self._plans.get(key)
        if plan is None:
            tiles = empty_tiles(key[0], num_slots, self.block_m, token_slot.device)
            plan = BatchPlan(path="segment", num_tokens=key[0], num_slots=num_slots, segments=tiles)
            self._plans[key] = plan
        if key[0] and num_slots:
            build_segment_tiles_into(token_slot, num_slots, plan.segments)
        return plan


__all__ = ["MAX_PLAN_SLOTS", "SegmentPlanner", "build_segment_tiles", "build_segment_tiles_into", "tile_bound"]
