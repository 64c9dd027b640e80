"""The two records every LoRA launch takes, as vLLM's punica wrapper keeps its metadata: the
batch's tables (``LoraTables``: where each slot's rows are, its rank and scaling) and the step
(``LoraStep``: each token's slot, and the plan built for them once for all layers).

Both can be preallocated at their largest size (``LoraTables.empty``, ``LoraStep.empty``) and
refreshed in place (``LoraTables.load_``, ``LoraStep.load_``: ``copy_`` only, no allocation,
no host sync), so their tensors keep their addresses from step to step and a CUDA graph
captured over them replays with the new contents. It imports only torch and ``batch_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch_plan import BatchPlan


@dataclass(frozen=True, slots=True)
class LoraTables:
    """One launch's tables: ``a_offsets``/``b_offsets`` int64 [S, J, R] (element offset of each
    row of A and of Bᵀ in the arena), ``ranks`` int32 [S], ``scalings`` float32 [S]."""

    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.a_offsets.shape[0]

    @property
    def num_slices(self) -> int:
        return self.a_offsets.shape[1]

    @property
    def max_rank(self) -> int:
        return self.a_offsets.shape[2]

    @property
    def device(self) -> torch.device:
        return self.a_offsets.device

    def __iter__(self):
        # (a_offsets, b_offsets, ranks, scalings): the order the tables were passed in before.
        return iter((self.a_offsets, self.b_offsets, self.ranks, self.scalings))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)

    @classmethod
    def empty(cls, num_slots: int, num_slices: int, max_rank: int, device: torch.device | str) -> LoraTables:
        """Tables for up to ``num_slots`` slots, every slot rank 0 (its tokens untouched)."""
        offsets = torch.zeros((num_slots, num_slices, max_rank), dtype=torch.int64, device=device)
        return cls(
            offsets,
            offsets.clone(),
            torch.zeros(num_slots, dtype=torch.int32, device=device),
            torch.zeros(num_slots, dtype=torch.float32, device=device),
        )

    def load_(self, other: LoraTables) -> LoraTables:
        """Copies ``other`` (fewer or as many slots, a rank bound up to this one's) into these
        tensors in place; the slots past ``other``'s get rank 0. Returns self.

        Raises:
            ValueError: ``other`` has more slots, another slice count, or a larger rank bound.
        """
        s, j, r = other.a_offsets.shape
        if s > self.num_slots or j != self.num_slices or r > self.max_rank:
            raise ValueError(
                f"tables of {s} slots x {j} slices x rank {r} do not fit preallocated ones of "
                f"{self.num_slots} x {self.num_slices} x {self.max_rank}"
            )
        self.a_offsets[:s, :, :r].copy_(other.a_offsets)
        self.b_offsets[:s, :, :r].copy_(other.b_offsets)
        self.ranks[:s].copy_(other.ranks)
        self.ranks[s:].zero_()
        self.scalings[:s].copy_(other.scalings)
        self.scalings[s:].zero_()
        return self


@dataclass(frozen=True, slots=True)
class LoraStep:
    """One step's token metadata, the same for every layer: ``token_slot`` int32 [T] (-1 for
    base-only tokens) and, optionally, the plan built for it (else each launch plans)."""

    token_slot: torch.Tensor
    plan: BatchPlan | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_slot.shape[0]

    @classmethod
    def empty(cls, num_tokens: int, device: torch.device | str, plan: BatchPlan | None = None) -> LoraStep:
        """A step of ``num_tokens`` tokens, all base-only until ``load_``."""
        return cls(torch.full((num_tokens,), -1, dtype=torch.int32, device=device), plan)

    def load_(self, token_slot: torch.Tensor) -> LoraStep:
        """Copies a new token -> slot map into ``token_slot`` in place (tokens past the new
        map's length become base-only). Returns self.

        Raises:
            ValueError: the map is longer than this step, or not 1-D.
        """
        n = token_slot.shape[0] if token_slot.dim() == 1 else -1
        if n < 0 or n > self.num_tokens:
            raise ValueError(f"a token map of shape {tuple(token_slot.shape)} does not fit a step of {self.num_tokens}")
        self.token_slot[:n].copy_(token_slot)
        self.token_slot[n:].fill_(-1)
        return self


__all__ = ["LoraStep", "LoraTables"]
