"""vLLM's LoRA linear layers computed straight from the broker's pages: per step, the slot ->
leased adapter list and each token's slot; per layer, one ``kernels.dispatch.lora_apply``
launch (or one per slice) over the offset tables of the slots' adapters.

``ZeroCopyStep`` owns one step's metadata (built when vLLM sets a new adapter mapping) and the
launches cached for it; ``StepHolder`` is the step in force for one vLLM LoRA manager;
``LayerAddress`` is what a layer knows of itself (decoder layer, module names of its output
slices, their widths). Nothing here copies adapter weights or imports vLLM: vLLM's slot
buffers are not read, and "no adapter" (slot -1) stays the base model whatever the slots hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from memory_broker.clients.adapters import AdapterTables, LeasedAdapter
from memory_broker.kernels import reference
from memory_broker.kernels.dispatch import choose_backend, lora_apply
from memory_broker.kernels.records import LoraStep

# "vllm": round where vLLM's own LoRA path rounds (the rank-r intermediate and the delta to the
# output's dtype, then add), so tokens equal vLLM's file-loaded LoRA in bfloat16/float16 too.
# "once": the project kernels' contract, fp32 accumulation rounded once (more precise).
ROUNDINGS = ("vllm", "once")


@dataclass(frozen=True, slots=True)
class LayerAddress:
    """Where a vLLM LoRA layer sits in the adapters' layouts."""

    # Decoder layer index, as in the broker's layouts.
    layer: int
    # Module short name per output slice (q_proj, k_proj, v_proj for a fused qkv_proj).
    modules: tuple[str, ...]
    # Width of each output slice (this rank's shard), in the same order.
    slice_sizes: tuple[int, ...]

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        return tuple(sum(self.slice_sizes[:j]) for j in range(len(self.slice_sizes)))


@dataclass(slots=True)
class ZeroCopyStep:
    """One step's LoRA metadata for every zero-copy layer of a model."""

    # vLLM slot index -> the leased adapter there (None: empty, or not from the broker).
    slots: tuple[LeasedAdapter | None, ...]
    # int32 [T]: each token's vLLM slot, -1 for the base model.
    token_slot: torch.Tensor
    # Offset tables, cached per (slot adapters and generations, layer, modules).
    tables: AdapterTables
    # The arena as a 1-D tensor of the adapters' dtype; None when no slot holds an adapter.
    arena: torch.Tensor | None
    # Every row offset is a multiple of this many elements (the Triton kernels' row_align).
    row_align: int = 1
    # Where a half-precision output is rounded (see ROUNDINGS); float32 outputs round once.
    rounding: str = "vllm"
    # (layer, modules) -> [(slice indices, tables)], built on first use in the step.
    _launches: dict = field(default_factory=dict)
    # Token count -> token_slot padded with -1 (or cut) to that many rows.
    _fitted: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        slots: Sequence[LeasedAdapter | None],
        token_slot: torch.Tensor,
        tables: AdapterTables,
        arena_of: Callable[[str], torch.Tensor],
        rounding: str = "vllm",
    ) -> ZeroCopyStep:
        """The step for ``slots`` and vLLM's per-token slot indices ``token_slot``.

        Raises:
            ValueError: the slots' adapters are stored in different dtypes (one launch reads
                one), or an unknown rounding.
        """
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        present = [a for a in slots if a is not None]
        arena, row_align = None, 1
        token_slot = token_slot.to(device=tables.device, dtype=torch.int32)
        if present and bool((token_slot >= 0).any()):
            kinds = {a.layout.dtype for a in present}
            if len(kinds) > 1:
                raise ValueError(
                    f"the step's adapters are stored in different dtypes {sorted(kinds)}; one launch reads one"
                )
            arena = arena_of(kinds.pop())
            reach = max((max(a.pages) + 1) * a.layout.page_size for a in present)
            if reach > arena.numel() * arena.element_size():
                raise ValueError(f"the adapters' pages reach byte {reach} beyond the mapped arena")
            row_align = math.gcd(*(a.layout.row_align_elems for a in present))
        return cls(tuple(slots), token_slot, tables, arena, row_align, rounding)

    @property
    def active(self) -> bool:
        return self.arena is not None

    def launches(self, address: LayerAddress) -> list:
        key = (address.layer, address.modules)
        hit = self._launches.get(key)
        if hit is None:
            try:
                hit = [
                    (tuple(range(len(address.modules))), self.tables.tables(self.slots, address.layer, address.modules))
                ]
            except ValueError:
                if len(address.modules) == 1:
                    raise
                # Slices adapted with different ranks/scalings, or only some of them: one launch each.
                hit = [
                    ((j,), self.tables.tables(self.slots, address.layer, [m])) for j, m in enumerate(address.modules)
                ]
            hit = [h for h in hit if h[1].max_rank > 0]
            self._launches[key] = hit
        return hit

    def _token_slot(self, num_tokens: int) -> torch.Tensor:
        n = self.token_slot.shape[0]
        if num_tokens == n:
            return self.token_slot
        hit = self._fitted.get(num_tokens)
        if hit is None:
            if num_tokens < n:
                hit = self.token_slot[:num_tokens]
            else:  # padding rows vLLM added: base model
                pad = torch.full((num_tokens - n,), -1, dtype=torch.int32, device=self.token_slot.device)
                hit = torch.cat([self.token_slot, pad])
            self._fitted[num_tokens] = hit
        return hit

    def apply(self, x: torch.Tensor, out: torch.Tensor, address: LayerAddress) -> torch.Tensor:
        """out[t] += the delta of token t's adapter for this layer (x, out: [T, in], [T, out])."""
        if self.arena is None:
            return out
        launches = self.launches(address)
        if not launches:
            return out
        token_slot = self._token_slot(x.shape[0])
        xk = x if x.dtype == self.arena.dtype else x.to(self.arena.dtype)
        offsets, sizes = address.slice_offsets, address.slice_sizes
        if self.rounding == "vllm" and out.dtype != torch.float32 and choose_backend(self.arena.device) == "torch":
            return self._apply_rounding_as_vllm(xk, out, token_slot, launches, offsets, sizes)
        step = LoraStep(token_slot)
        for slices, tables in launches:
            lora_apply(
                xk,
                out,
                self.arena,
                tables,
                step,
                [offsets[j] for j in slices],
                [sizes[j] for j in slices],
                row_align=self.row_align,
            )
        return out

    def _apply_rounding_as_vllm(self, xk, out, token_slot, launches, offsets, sizes) -> torch.Tensor:
        # vLLM's CPU path: shrink in fp32, the intermediate cast to the output dtype, the expand's
        # product rounded to it, then added to the output (a second rounding). The same
        # reference shrink/expand over the pages, with vLLM's rounding points.
        rows = torch.nonzero(token_slot >= 0).flatten()
        if rows.numel() == 0:
            return out
        for slices, (a_off, b_off, ranks, scalings) in launches:  # a LoraTables unpacks in this order
            y = reference.shrink(xk, self.arena, a_off, ranks, token_slot).to(out.dtype).float()
            delta = torch.zeros_like(out)
            reference.expand(
                y,
                self.arena,
                b_off,
                ranks,
                scalings,
                token_slot,
                delta,
                [offsets[j] for j in slices],
                [sizes[j] for j in slices],
            )
            out[rows] += delta[rows]
        return out

    def extra_bytes(self) -> int:
        """Bytes this step holds beyond the base model: the token map and the offset tables."""
        return self.token_slot.numel() * self.token_slot.element_size() + self.tables_bytes()

    def tables_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for entry in self.tables._tables.values() for t in entry)


class StepHolder:
    """The step in force for one vLLM LoRA manager's zero-copy layers."""

    __slots__ = ("step", "tables", "builds", "epoch")

    def __init__(self, device: torch.device | str):
        self.step: ZeroCopyStep | None = None
        self.tables = AdapterTables(device)
        # The broker session (client epoch) the step's pages belong to.
        self.epoch = 0
        # Steps built (vLLM set a new mapping or slot layout).
        self.builds = 0


def check_backend(device: torch.device | str) -> str:
    """The implementation zero-copy layers will use for an arena on ``device`` (logged once)."""
    return choose_backend(device)
