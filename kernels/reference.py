"""Torch reference for the LoRA kernels: the same shrink / expand / lora_apply contract on the
same inputs (arena, row-offset tables, token slots), written for obviousness, not speed.

Rows are gathered from the arena through the offset tables and multiplied in fp32, one slot
at a time. The tests compare the Triton kernels against it, and ``dispatch`` serves arenas
without a GPU with it (right in every dtype, no Triton needed); it imports no Triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .records import LoraStep, LoraTables


def gather_rows(arena: torch.Tensor, row_offsets: torch.Tensor, width: int) -> torch.Tensor:
    """The rows starting at ``row_offsets`` (int64 [r]), each ``width`` long, as fp32 [r, width]."""
    index = row_offsets[:, None] + torch.arange(width, device=arena.device, dtype=torch.int64)[None, :]
    return arena[index].float()


def _slots_in_use(token_slot: torch.Tensor) -> list[int]:
    return [int(s) for s in torch.unique(token_slot).tolist() if s >= 0]


def shrink(
    x: torch.Tensor,
    arena: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    token_slot: torch.Tensor,
    *,
    y: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[j, t, :r] = x[t] @ A_{slot(t), j}ᵀ in fp32; other entries of y untouched (zero if allocated here)."""
    num_slots, num_slices, max_rank = a_offsets.shape
    num_tokens, in_features = x.shape
    if y is None:
        y = torch.zeros((num_slices, num_tokens, max_rank), dtype=torch.float32, device=x.device)
    for slot in _slots_in_use(token_slot):
        rank = int(ranks[slot])
        tokens = torch.nonzero(token_slot == slot).flatten()
        for j in range(num_slices):
            a = gather_rows(arena, a_offsets[slot, j, :rank], in_features)
            y[j, tokens, :rank] = x[tokens].float() @ a.T
    return y


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
) -> torch.Tensor:
    """out[t, off_j : off_j + n_j] += scaling · y[j, t, :r] @ Bᵀ rows, rounded once to out's dtype.

    Base-only tokens and rank-0 slots leave out untouched.
    """
    for slot in _slots_in_use(token_slot):
        rank = int(ranks[slot])
        if rank == 0:
            continue
        scaling = float(scalings[slot])
        tokens = torch.nonzero(token_slot == slot).flatten()
        for j, (first, width) in enumerate(zip(slice_offsets, slice_sizes)):
            bt = gather_rows(arena, b_offsets[slot, j, :rank], width)
            delta = scaling * (y[j, tokens, :rank] @ bt)
            cols = slice(first, first + width)
            out[tokens, cols] = (out[tokens, cols].float() + delta).to(out.dtype)
    return out


def lora_apply(
    x: torch.Tensor,
    out: torch.Tensor,
    arena: torch.Tensor,
    tables: LoraTables,
    step: LoraStep,
    slice_offsets: Sequence[int],
    slice_sizes: Sequence[int],
) -> torch.Tensor:
    """``shrink`` then ``expand`` over ``tables`` for ``step``'s tokens; out updated in place and returned."""
    a_offsets, b_offsets, ranks, scalings = tables
    y = shrink(x, arena, a_offsets, ranks, step.token_slot)
    return expand(y, arena, b_offsets, ranks, scalings, step.token_slot, out, slice_offsets, slice_sizes)
