"""A LoRA step that a CUDA graph can capture: every tensor the kernels read or write is
allocated once, and each step's host work is ``copy_`` into them.

``StaticStep`` holds the token -> slot map (``LoraStep``, sized for the graph's token count),
the plan (token path: none; segment path: the one-launch plan's buffers, rebuilt on the device
by ``replan``), one ``LoraTables`` per launch (layer and modules, sized for the most slots and
the largest rank) and one shrink output per launch shape. A decode step captured as
``replan()`` plus every layer's ``apply`` replays with whatever the buffers hold: change the
token map (``load_tokens``) or a launch's adapters (``load_tables``: adapters coming and going,
outside the graph) and replay. Only the Triton kernels run here (the torch path reads values
back to the host, which a graph cannot capture).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from . import lora_ops
from .batch_plan import DEFAULT_BLOCK_M, BatchPlan, Path
from .plan_kernel import SegmentPlanner
from .records import LoraStep, LoraTables


class StaticStep:
    """One captured step's buffers: the token map, its plan, and per-launch tables.

    Args:
        num_tokens: the graph's token count (a smaller batch is padded with base-only tokens).
        max_slots: slots every launch's tables have room for.
        device: where everything lives (a GPU to capture; the CPU under Triton's interpreter).
        path: the kernels' path, fixed for the graph: "token" for decode (no plan at all),
            "segment" for long runs per adapter (plan rebuilt on the device each step).
        block_m: tokens per segment tile.
        split_k: token path: the shrink's split over the hidden dimension (``plan_batch``).
        fuse_shrink_slices, fuse_expand_slices: token path: every slice in one shrink program,
            the expand fused over slices (``plan_batch``); fixed for the graph.
    """

    def __init__(
        self,
        num_tokens: int,
        max_slots: int,
        device: torch.device | str,
        *,
        path: Path = "token",
        block_m: int = DEFAULT_BLOCK_M,
        split_k: int = 1,
        fuse_shrink_slices: bool = False,
        fuse_expand_slices: bool = False,
    ):
        if path not in ("token", "segment"):
            raise ValueError(f"a static step's path must be 'token' or 'segment', got {path!r}")
        self.device = torch.device(device)
        self.max_slots = max_slots
        token_slot = torch.full((num_tokens,), -1, dtype=torch.int32, device=self.device)
        self._planner = None
        if path == "segment":
            self._planner = SegmentPlanner(block_m, self.device)
            plan = self._planner.plan(token_slot, max_slots)
        else:
            plan = BatchPlan(
                path="token",
                num_tokens=num_tokens,
                num_slots=max_slots,
                split_k=split_k,
                fuse_shrink_slices=fuse_shrink_slices,
                fuse_expand_slices=fuse_expand_slices,
            )
        self.step = LoraStep(token_slot, plan)
        self._tables: dict[Hashable, LoraTables] = {}
        self._y: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def num_tokens(self) -> int:
        return self.step.num_tokens

    @property
    def path(self) -> Path:
        return self.step.plan.path

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the step's launches read or write (their addresses must not change)."""
        out = [self.step.token_slot, *self._y.values()]
        seg = self.step.plan.segments
        if seg is not None:
            out += [seg.order, seg.tile_slot, seg.tile_start, seg.tile_end]
        for t in self._tables.values():
            out += list(t)
        return out

    def add_launch(self, key: Hashable, num_slices: int, max_rank: int) -> LoraTables:
        """Allocates the tables of one launch (e.g. key (layer, modules)); all slots rank 0."""
        if key in self._tables:
            raise ValueError(f"launch {key!r} already has tables")
        tables = LoraTables.empty(self.max_slots, num_slices, max_rank, self.device)
        self._tables[key] = tables
        if (num_slices, max_rank) not in self._y:
            self._y[(num_slices, max_rank)] = torch.empty(
                (num_slices, self.num_tokens, max_rank), dtype=torch.float32, device=self.device
            )
        return tables

    def tables(self, key: Hashable) -> LoraTables:
        return self._tables[key]

    def load_tables(self, key: Hashable, tables: LoraTables) -> None:
        """Copies a launch's new tables (adapters coming and going) into its buffers, in place.
        Slots past ``tables``'s get rank 0: their tokens are left untouched."""
        self._tables[key].load_(tables)

    def load_tokens(self, token_slot: torch.Tensor) -> None:
        """Copies the step's token -> slot map in place (tokens past it become base-only).

        Every slot it names must be below ``max_slots`` and hold tables of the adapter meant:
        the kernels read the tables at that slot, whatever they hold."""
        self.step.load_(token_slot)

    def replan(self) -> None:
        """Rebuilds the segment plan from the token map on the device (one launch; nothing on
        the token path). Part of the captured step: call it before the layers."""
        if self._planner is not None:
            self._planner.plan(self.step.token_slot, self.max_slots)

    def apply(
        self,
        key: Hashable,
        x: torch.Tensor,
        out: torch.Tensor,
        arena: torch.Tensor,
        slice_offsets: Sequence[int],
        slice_sizes: Sequence[int],
        *,
        row_align: int = 1,
    ) -> torch.Tensor:
        """out += LoRA(x) for launch ``key`` with the Triton kernels on this step's buffers."""
        tables = self._tables[key]
        y = self._y[(tables.num_slices, tables.max_rank)]
        return lora_ops.lora_apply(
            x, out, arena, tables, self.step, slice_offsets, slice_sizes, y=y, row_align=row_align
        )


__all__ = ["StaticStep"]
