"""vLLM's LoRA linear layers computed straight from the broker's pages: per step, the slot ->
leased adapter list and each token's slot; per layer, one ``kernels.dispatch.lora_apply``
launch (or one per slice) over the offset tables of the slots' adapters.

``ZeroCopyStep`` owns one step's metadata (built when vLLM sets a new adapter mapping) and the
launches cached for it; ``StepHolder`` is the step in force for one vLLM LoRA manager (with
``StaticStepBuffers``, which the plugin gives every zero-copy manager so that its decode steps
can be captured in CUDA graphs: the token map and every
launch's tables then live in tensors allocated once, which each step's build, vLLM's
per-step metadata update outside the graph, refreshes by ``copy_``; the kernels inside read them);
``LayerAddress`` is what a layer knows of itself (decoder layer, module names of its output
slices, their widths). Nothing here copies adapter weights or imports vLLM: vLLM's slot
buffers are not read, and "no adapter" (slot -1) stays the base model whatever the slots hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from memory_broker.clients.step.adapters import AdapterTables, LeasedAdapter
from memory_broker.kernels import reference
from memory_broker.kernels.batch_plan import BatchPlan
from memory_broker.kernels.dispatch import choose_backend, lora_apply
from memory_broker.kernels.records import LoraStep, LoraTables

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


class StaticStepBuffers:
    """What a captured zero-copy step reads, allocated once: the token map for batches of up to
    ``max_tokens`` tokens (vLLM's largest captured batch), a token-path plan per batch size,
    and per launch (layer, modules) tables of ``max_slots`` slots by rank ``max_rank``.

    ``load`` (run by ``ZeroCopyStep.build``, i.e. when vLLM sets a new mapping, outside any
    graph) copies the step's token map and every known launch's tables into them; a launch
    first seen in a forward (vLLM's warm-up, before capture) allocates its tables then. Every
    launch is one fused launch over its slices, whatever the step's adapters.

    Args:
        max_tokens, max_slots, max_rank: vLLM's largest captured batch, ``max_loras`` and
            ``max_lora_rank``.
        arena: the arena tensor every step's adapters live in (a graph reads its address).
        row_align: the row alignment every adapter promises (the kernels' hint, fixed in a graph).
        captured: whether graphs are captured over them. True: what they cannot hold raises.
            False (an engine that runs eagerly): such a step runs the ordinary path instead.
    """

    def __init__(
        self,
        max_tokens: int,
        max_slots: int,
        max_rank: int,
        arena: torch.Tensor,
        row_align: int = 1,
        captured: bool = True,
    ):
        self.max_tokens, self.max_slots, self.max_rank = max_tokens, max_slots, max_rank
        self.arena, self.row_align, self.captured = arena, row_align, captured
        self.token_slot = torch.full((max_tokens,), -1, dtype=torch.int32, device=arena.device)
        # Layer launches run on these buffers (counted when traced: a replay runs no Python).
        self.applies = 0
        self._plans: dict[int, LoraStep] = {}
        self._tables: dict[tuple[int, tuple[str, ...]], LoraTables] = {}

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a captured step reads (their addresses never change)."""
        return [self.token_slot, *(t for tables in self._tables.values() for t in tables)]

    def for_arena(self, arena: torch.Tensor) -> StaticStepBuffers:
        """These buffers for the arena of a new broker session: themselves for the same mapping,
        new ones of the same sizes when nothing is captured.

        Raises:
            RuntimeError: graphs were captured over them (they read the old arena's address).
        """
        if arena.data_ptr() == self.arena.data_ptr() and arena.numel() == self.arena.numel():
            return self
        if self.captured:
            raise RuntimeError(
                "the broker restarted under an engine whose CUDA graphs read the old session's arena: restart "
                "the engine (an engine run with enforce_eager=True serves on across broker restarts)"
            )
        return StaticStepBuffers(self.max_tokens, self.max_slots, self.max_rank, arena, self.row_align, False)

    def bytes(self) -> int:
        """Bytes the buffers hold (the token map and every launch's tables)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def step_for(self, num_tokens: int) -> LoraStep:
        """The step record of a batch of ``num_tokens`` (<= max_tokens): a view of the token map
        (tokens past vLLM's map are -1: padding rows stay base) and the token path's plan."""
        hit = self._plans.get(num_tokens)
        if hit is None:
            plan = BatchPlan(path="token", num_tokens=num_tokens, num_slots=self.max_slots)
            hit = self._plans[num_tokens] = LoraStep(self.token_slot[:num_tokens], plan)
        return hit

    def load(self, step: ZeroCopyStep) -> None:
        """Copies ``step``'s token map and every known launch's tables in place.

        Raises:
            ValueError: more slots than max_slots, an adapter of rank over max_rank or one that
                adapts only some of a launch's slices, an arena other than this one, or rows
                less aligned than row_align.
        """
        if len(step.slots) > self.max_slots:
            raise ValueError(f"{len(step.slots)} LoRA slots do not fit static buffers of {self.max_slots}")
        if step.arena is not None and step.arena.data_ptr() != self.arena.data_ptr():
            raise ValueError("the step's arena is not the one the static buffers were made for: capture anew")
        if step.arena is not None and step.row_align % self.row_align:
            raise ValueError(f"the adapters' rows are aligned to {step.row_align} elements, not {self.row_align}")
        n = min(step.token_slot.shape[0], self.max_tokens)
        self.token_slot[:n].copy_(step.token_slot[:n])
        self.token_slot[n:].fill_(-1)
        for key, into in self._tables.items():
            self._load_tables(step, key, into)

    def tables(self, step: ZeroCopyStep, address: LayerAddress) -> LoraTables:
        """The launch's static tables (allocated and loaded on first use)."""
        key = (address.layer, address.modules)
        hit = self._tables.get(key)
        if hit is None:
            hit = LoraTables.empty(self.max_slots, len(address.modules), self.max_rank, self.arena.device)
            self._load_tables(step, key, hit)
            self._tables[key] = hit
        return hit

    def _load_tables(self, step: ZeroCopyStep, key: tuple[int, tuple[str, ...]], into: LoraTables) -> None:
        layer, modules = key
        try:
            into.load_(step.tables.tables(step.slots, layer, modules, max_rank=self.max_rank))
        except ValueError as e:
            raise ValueError(
                f"a captured LoRA step cannot serve layer {layer} {'+'.join(modules)}: {e} (run vLLM with "
                "enforce_eager=True for such adapters)"
            ) from e


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
    # The buffers a captured step reads, refreshed by ``build``; None: nothing is captured.
    static: StaticStepBuffers | None = None

    @classmethod
    def build(
        cls,
        slots: Sequence[LeasedAdapter | None],
        token_slot: torch.Tensor,
        tables: AdapterTables,
        arena_of: Callable[[str], torch.Tensor],
        rounding: str = "vllm",
        static: StaticStepBuffers | None = None,
    ) -> ZeroCopyStep:
        """The step for ``slots`` and vLLM's per-token slot indices ``token_slot``.

        With ``static`` the step's token map and tables are also copied into its buffers (the
        per-step metadata update, outside any graph) and batches of up to its ``max_tokens``
        run on them, so a forward captured in a CUDA graph replays with this step's adapters.

        Raises:
            ValueError: the slots' adapters are stored in different dtypes (one launch reads
                one), an unknown rounding, or what ``StaticStepBuffers.load`` refuses.
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
        step = cls(tuple(slots), token_slot, tables, arena, row_align, rounding, static=static)
        if static is not None:
            try:
                static.load(step)
            except ValueError:
                if static.captured:
                    raise
                step.static = None  # nothing captured: this step runs the ordinary path
        return step

    @property
    def active(self) -> bool:
        # Static buffers: always, since a graph captured without the kernels could not serve a
        # later step with adapters (a step without any runs them over rank-0 tables).
        return self.arena is not None or self.static is not None

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
        static = self.static
        if static is not None and x.shape[0] <= static.max_tokens and self._kernels_round(out):
            return self._apply_static(x, out, address, static)
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

    def _kernels_round(self, out: torch.Tensor) -> bool:
        """Whether the kernels' single rounding serves ``out`` (vLLM's rounding points are kept
        only on the torch path, which a graph cannot capture anyway)."""
        return self.rounding == "once" or out.dtype == torch.float32 or choose_backend(out.device) != "torch"

    def _apply_static(self, x, out, address: LayerAddress, static: StaticStepBuffers) -> torch.Tensor:
        # Capturable: only the static buffers, one fused launch, the token path, no host reads.
        try:
            tables = static.tables(self, address)
        except ValueError:
            if static.captured:
                raise
            self.static = None  # nothing captured: this step runs the ordinary path
            return self.apply(x, out, address)
        static.applies += 1
        xk = x if x.dtype == static.arena.dtype else x.to(static.arena.dtype)
        lora_apply(
            xk,
            out,
            static.arena,
            tables,
            static.step_for(x.shape[0]),
            address.slice_offsets,
            address.slice_sizes,
            row_align=static.row_align,
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

    __slots__ = ("step", "tables", "builds", "epoch", "static", "widths")

    def __init__(self, device: torch.device | str, static: StaticStepBuffers | None = None):
        self.step: ZeroCopyStep | None = None
        # Buffers for captured decode steps (pass them to ``ZeroCopyStep.build``); None: eager only.
        self.static = static
        self.tables = AdapterTables(device)
        # The broker session (client epoch) the step's pages belong to.
        self.epoch = 0
        # Steps built (vLLM set a new mapping or slot layout).
        self.builds = 0
        # (layer, module) -> (in, out) widths of this rank's zero-copy layer (an adapter's copy
        # must match: this rank's slice).
        self.widths: dict[tuple[int, str], tuple[int, int]] = {}


def check_backend(device: torch.device | str) -> str:
    """The implementation zero-copy layers will use for an arena on ``device`` (logged once)."""
    return choose_backend(device)
