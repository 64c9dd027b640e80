"""Per-step batch metadata for the LoRA kernels: which path serves a batch, and for the
segment path the tokens grouped by adapter slot into fixed-size tiles.

Everything here is torch on the batch's own device with no host synchronisation, so a plan
can be built once per engine step (the slot of every token is the same in every layer) and
captured in a CUDA graph. It knows nothing about weights or offsets; on a GPU ``plan_batch``
hands the segment plan to ``plan_kernel`` (one Triton launch, imported on first use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Path = Literal["token", "segment"]
PathChoice = Literal["auto", "token", "segment"]
# Who builds a segment plan: "triton" (one launch, ``plan_kernel``), "torch" (this module's
# torch ops, no Triton needed), "auto" (Triton for tokens on a GPU, torch elsewhere).
PlanBuilder = Literal["auto", "triton", "torch"]

# The segment path multiplies tiles of tokens of one adapter with tl.dot, whose smallest M
# is 16; below 16 tokens per adapter most of every tile is padding and the per-token GEMV
# path reads the same weights with less work.
SEGMENT_MIN_TOKENS_PER_ADAPTER = 16

# Tokens per segment tile (the tl.dot M dimension of the segment path).
DEFAULT_BLOCK_M = 64
# Every tile size the planner accepts; kernels/compile_check.py compiles each of them.
BLOCK_M_CHOICES = (16, 32, 64, 128)


def choose_path(num_tokens: int, num_slots: int, active_slots: int | None = None) -> Path:
    """The path for a batch: "segment" when adapters average at least 16 tokens, else "token".

    Args:
        num_tokens: tokens in the batch (base-only tokens included).
        num_slots: slots in the offset tables; the bound on distinct adapters when the caller
            does not say how many are active.
        active_slots: distinct adapters in the batch, if the caller knows (the scheduler does);
            without it a table sized for many adapters makes a prefill look like a decode.
    """
    active = min(num_tokens, num_slots) if active_slots is None else active_slots
    if active <= 0:
        return "token"
    return "segment" if num_tokens >= SEGMENT_MIN_TOKENS_PER_ADAPTER * active else "token"


@dataclass(frozen=True, slots=True)
class SegmentTiles:
    """Tokens sorted by slot and cut into tiles of at most ``block_m`` tokens of one slot."""

    # int32 [T]: token indices sorted by slot (stable); base-only tokens (-1) come first.
    order: torch.Tensor
    # int32 [num_tiles]: the slot of each tile; -1 for spare tiles past the last real one.
    tile_slot: torch.Tensor
    # int32 [num_tiles]: the tile's first position in ``order``.
    tile_start: torch.Tensor
    # int32 [num_tiles]: one past the last position in ``order`` of the tile's slot; the tile
    # covers positions [start, min(start + block_m, end)).
    tile_end: torch.Tensor
    # Tokens per tile; the kernels' M block must equal it.
    block_m: int

    @property
    def num_tiles(self) -> int:
        return self.tile_slot.shape[0]


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """How one batch is served: the path, and the segment tiles when the path needs them."""

    # "token" (one program per token, GEMV-style) or "segment" (tl.dot over tiles of one slot).
    path: Path
    # Tokens in the batch; a plan is only valid for a token_slot of this length.
    num_tokens: int
    # Slots in the offset tables the plan was built for.
    num_slots: int
    # The tiles, for the segment path only.
    segments: SegmentTiles | None = None
    # Token path: how many parts of the hidden dimension the shrink splits over (more programs
    # for a small batch, partial sums added atomically); 1 splits nothing.
    split_k: int = 1
    # Token path: one shrink program covers every slice of its token's rank block (x read once
    # for all slices: "several slices per program"); False: one program per slice.
    fuse_shrink_slices: bool = False
    # Token path: one expand program does its column block of every slice in turn (the expand
    # fused over slices: a third of the programs for three slices); False: one per slice.
    fuse_expand_slices: bool = False


def build_segment_tiles(token_slot: torch.Tensor, num_slots: int, block_m: int = DEFAULT_BLOCK_M) -> SegmentTiles:
    """Groups tokens by slot on the device and cuts each slot's run into tiles.

    The tile count is a host-side bound, ``ceil(T / block_m) + min(num_slots, T)`` (each
    non-empty slot wastes at most one partial tile), so no value is read back from the
    device; the tiles past the real ones carry slot -1 and their programs exit at once.

    Args:
        token_slot: int32 [T], the slot of each token or -1 for base-only tokens; values must
            be below ``num_slots``.
        num_slots: slots in the offset tables.
        block_m: tokens per tile, one of ``BLOCK_M_CHOICES`` (16, the smallest tl.dot M, to 128).

    Raises:
        ValueError: block_m is not one of ``BLOCK_M_CHOICES``.
    """
    if block_m not in BLOCK_M_CHOICES:
        raise ValueError(
            f"block_m must be one of {', '.join(map(str, BLOCK_M_CHOICES))} (the tile sizes the kernels are "
            f"compiled and checked for), got {block_m}"
        )
    device = token_slot.device
    num_tokens = token_slot.shape[0]
    slot = token_slot.to(torch.int64)
    order = torch.argsort(slot, stable=True)
    # counts[0] is the base-only tokens; counts[s + 1] is slot s. A scatter into a fixed size,
    # not bincount, whose output size is data-dependent (a device-to-host sync on CUDA).
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, slot + 1, torch.ones_like(slot))
    ends = torch.cumsum(counts, 0)
    slot_end = ends[1:]
    slot_start = slot_end - counts[1:]
    tiles = (counts[1:] + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles, 0)

    bound = -(-num_tokens // block_m) + min(num_slots, num_tokens)
    tile = torch.arange(bound, device=device, dtype=torch.int64)
    owner = torch.searchsorted(tiles_end, tile, right=True)
    valid = owner < num_slots
    owner = owner.clamp(max=max(num_slots - 1, 0))
    first_tile = tiles_end[owner] - tiles[owner]
    tile_start = slot_start[owner] + (tile - first_tile) * block_m
    return SegmentTiles(
        order=order.to(torch.int32),
        tile_slot=torch.where(valid, owner, -1).to(torch.int32),
        tile_start=torch.where(valid, tile_start, 0).to(torch.int32),
        tile_end=torch.where(valid, slot_end[owner], 0).to(torch.int32),
        block_m=block_m,
    )


def plan_batch(
    token_slot: torch.Tensor,
    num_slots: int,
    *,
    path: PathChoice = "auto",
    active_slots: int | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    builder: PlanBuilder = "auto",
    split_k: int = 1,
    fuse_shrink_slices: bool = False,
    fuse_expand_slices: bool = False,
) -> BatchPlan:
    """Builds the plan for one batch; build it once per step and pass it to every layer.

    Args:
        token_slot: int32 [T], the slot of each token or -1 for base-only tokens.
        num_slots: slots in the offset tables (their first dimension).
        path: "auto" (``choose_path``), or "token" / "segment" to force one.
        active_slots: distinct adapters in the batch, if known; sharpens "auto".
        block_m: tokens per segment tile.
        builder: who builds a segment plan (``PlanBuilder``); both build the same plan.
        split_k: token path: split the shrink over this many parts of the hidden dimension
            (capped at one part per 256 columns); 1 (the default) splits nothing. Which is
            faster is for a GPU's numbers to say (bench_lora_kernels.py has a row for it).
        fuse_shrink_slices, fuse_expand_slices: token path: the shrink with all slices in
            one program, the expand fused over slices (``BatchPlan``); off by default until
            a GPU's numbers (bench_lora_kernels.py's "fused" rows) say they are faster.

    Raises:
        ValueError: an unknown path or builder, a bad block_m, or split_k below 1.
    """
    if split_k < 1:
        raise ValueError(f"split_k must be at least 1, got {split_k}")
    num_tokens = token_slot.shape[0]
    if path == "auto":
        chosen = choose_path(num_tokens, num_slots, active_slots)
    elif path in ("token", "segment"):
        chosen = path
    else:
        raise ValueError(f"path must be 'auto', 'token' or 'segment', got {path!r}")
    segments = None
    if chosen == "segment" and num_tokens > 0 and num_slots > 0:
        if builder == "auto":
            builder = "triton" if token_slot.device.type == "cuda" else "torch"
        if builder == "triton":
            from . import plan_kernel

            segments = plan_kernel.build_segment_tiles(token_slot, num_slots, block_m)
        elif builder == "torch":
            segments = build_segment_tiles(token_slot, num_slots, block_m)
        else:
            raise ValueError(f"builder must be 'auto', 'triton' or 'torch', got {builder!r}")
    return BatchPlan(
        path=chosen,
        num_tokens=num_tokens,
        num_slots=num_slots,
        segments=segments,
        split_k=split_k,
        fuse_shrink_slices=fuse_shrink_slices,
        fuse_expand_slices=fuse_expand_slices,
    )
