"""Multi-LoRA in an engine: each step's batch metadata, built from an adapter lease, and a
wrapper for a model's linear layers that adds every token's adapter delta with the batched
kernels, reading the weights straight out of the arena's pages.

``LoraBatch`` owns one step's metadata (each token's slot, the slot -> adapter list, the
kernels' plan, the arena view); ``LoRALinear`` owns only its base ``nn.Linear`` and its
(layer, modules) address; ``wrap_model`` installs LoRALinear layers in a decoder model and
returns the ``LoraModel`` handle through which an engine runs a step (or a whole greedy
decode, ``LoraModel.generate``). The deltas run where ``kernels.dispatch`` says: the Triton
kernels for an arena on a GPU, the torch path for one on the CPU. This module never
talks to the broker: leases come from ``BrokerClient.acquire_adapters``, offset tables from
``AdapterTables``, and the delta is inference-only (the kernels record no autograd graph).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from memory_broker.clients.step.adapters import AdapterTables, LeasedAdapter
from memory_broker.kernels.batch_plan import DEFAULT_BLOCK_M, BatchPlan, PathChoice, plan_batch
from memory_broker.kernels.devices import same_device
from memory_broker.kernels.dispatch import Backend, BackendChoice, choose_backend, lora_apply
from memory_broker.kernels.records import LoraStep, LoraTables

if TYPE_CHECKING:
    from memory_broker.clients.client import BrokerClient
    from memory_broker.clients.step.adapters import AdapterLease

# The linear layers of a Llama-style decoder layer that PEFT adapters target.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# One launch's tables: a_offsets, b_offsets [S, J, R] int64, ranks [S] int32, scalings [S] fp32.
Tables = LoraTables


@dataclass(frozen=True, slots=True)
class Segment:
    """A maximal run of consecutive tokens served by one slot."""

    # First token of the run.
    start: int
    # One past its last token.
    end: int
    # Slot of the run's adapter; -1 for base-only tokens.
    slot: int


def admitted_sequences(seq_adapters: Sequence[str | None], lease: AdapterLease) -> list[int]:
    """Indices of the sequences a step can run under ``lease``: base-only ones, and those
    whose adapter it holds. Sequences of deferred adapters (over the lease's cap) are left out;
    run them in a later step."""
    held = set(lease.ids)
    return [i for i, a in enumerate(seq_adapters) if a is None or a in held]


def _check_sequences(seq_adapters: Sequence[str | None], seq_lens: Sequence[int], lease: AdapterLease) -> None:
    """``LoraBatch.build``'s checks of the sequences against each other and the lease."""
    if len(seq_adapters) != len(seq_lens):
        raise ValueError(f"{len(seq_adapters)} sequence adapters but {len(seq_lens)} sequence lengths")
    short = [i for i, n in enumerate(seq_lens) if n < 1]
    if short:
        raise ValueError(f"sequences {short} have lengths {[seq_lens[i] for i in short]}; each needs >= 1 token")
    if lease.released:
        raise RuntimeError("the lease was released: its adapters' pages may already hold something else")
    deferred = set(lease.deferred)
    late = [i for i, a in enumerate(seq_adapters) if a is not None and a in deferred]
    if late:
        ids = sorted({seq_adapters[i] for i in late})
        raise ValueError(
            f"sequences {late} use adapters {ids} that the lease deferred (over its cap of "
            f"{len(lease.adapters)} adapters); leave them out of this step (admitted_sequences) "
            "and acquire them for a later one"
        )


def _assign_slots(seq_adapters: Sequence[str | None], lease: AdapterLease) -> tuple[list[LeasedAdapter], list[int]]:
    """A slot per distinct adapter in order of first use: (the leased adapter per slot, the slot
    per sequence, -1 for the base model alone)."""
    held = {a.adapter_id: a for a in lease.adapters}
    slot_of: dict[str, int] = {}
    slots: list[LeasedAdapter] = []
    seq_slots: list[int] = []
    for i, aid in enumerate(seq_adapters):
        if aid is None:
            seq_slots.append(-1)
            continue
        if aid not in slot_of:
            if aid not in held:
                raise RuntimeError(
                    f"sequence {i} uses adapter {aid!r}, which the lease does not hold "
                    f"(it holds {sorted(held)}); acquire it first"
                )
            slot_of[aid] = len(slots)
            slots.append(held[aid])
        seq_slots.append(slot_of[aid])
    return slots, seq_slots


def _arena_view(
    source: BrokerClient | torch.Tensor, slots: Sequence[LeasedAdapter], tables: AdapterTables
) -> tuple[torch.Tensor | None, int]:
    """The arena as a 1-D tensor of the slots' dtype (None with no slots), checked to reach
    their pages, and the row alignment they share."""
    arena, row_align = None, 1
    if slots:
        kinds = {a.layout.dtype for a in slots}
        if len(kinds) > 1:
            raise ValueError(
                f"the batch's adapters are stored in different dtypes {sorted(kinds)}; one launch reads one"
            )
        dtype = TORCH_DTYPES[kinds.pop()]
        if isinstance(source, torch.Tensor):
            arena = source if source.dtype == dtype else source.view(dtype)
        else:
            arena = source.arena_tensor(dtype)
        if not same_device(arena.device, tables.device):
            raise ValueError(f"the offset tables live on {tables.device} but the arena on {arena.device}")
        reach = max((max(a.pages) + 1) * a.layout.page_size for a in slots)
        covered = arena.numel() * arena.element_size()
        if reach > covered:
            raise ValueError(
                f"the adapters' pages reach byte {reach} but the arena view covers {covered}; "
                "build the batch after acquiring (the lease maps new slabs)"
            )
        row_align = math.gcd(*(a.layout.row_align_elems for a in slots))
    return arena, row_align


def _segments(seq_slots: Sequence[int], seq_lens: Sequence[int]) -> list[Segment]:
    """Maximal runs of one slot in token order."""
    segments: list[Segment] = []
    start = 0
    for slot, n in zip(seq_slots, seq_lens):
        if segments and segments[-1].slot == slot:
            segments[-1] = Segment(segments[-1].start, start + n, slot)
        else:
            segments.append(Segment(start, start + n, slot))
        start += n
    return segments


def _prompt_rows(
    prompts: Sequence[Sequence[int] | torch.Tensor], seq_adapters: Sequence[str | None], max_new_tokens: int
) -> list[list[int]]:
    """``generate``'s checks: each prompt as a list of token ids."""
    if len(prompts) != len(seq_adapters):
        raise ValueError(f"{len(prompts)} prompts but {len(seq_adapters)} sequence adapters")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    rows = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
    empty = [i for i, p in enumerate(rows) if not p]
    if empty:
        raise ValueError(f"prompts {empty} are empty; each needs at least one token")
    return rows


def _left_padded(rows: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts left-padded to one length on ``device``: token ids, attention mask, and
    position ids."""
    num_seqs = len(rows)
    width = max(len(p) for p in rows)
    ids = torch.full((num_seqs, width), pad, dtype=torch.long)
    mask = torch.zeros((num_seqs, width), dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    # Positions count real tokens only, as HF's generate derives them from the mask.
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """One step's LoRA metadata, shared by every LoRALinear of the model for that step.

    Valid while the lease it was built from holds its adapters: after a release their pages
    may be evicted and reused.
    """

    # The step's token metadata (the kernels' record): token_slot, int32 [T] on the arena's
    # device, each token's slot (-1 for base-only, sequences in order), and the kernels' plan
    # for this step (path, segment tiles), built once for all layers.
    step: LoraStep
    # Per sequence, its slot (-1: base only).
    seq_slots: tuple[int, ...]
    # Maximal runs of one slot in token order (adjacent sequences of one adapter share a run).
    segments: tuple[Segment, ...]
    # slot -> the leased adapter there: the batch's distinct adapters in order of first use.
    slots: tuple[LeasedAdapter, ...]
    # The arena's physical view as a 1-D tensor of the adapters' dtype; None with no slots.
    arena: torch.Tensor | None
    # Every row offset is a multiple of this many elements (the kernels' row_align).
    row_align: int
    # Builds offset tables and caches them per (adapters, generations, layer, modules).
    table_cache: AdapterTables
    # What computes the deltas: "triton" (the kernels, arena on a GPU) or "torch" (a CPU arena).
    backend: Backend = "triton"
    # (layer, modules) -> this step's launches; see ``launches``.
    _launches: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        source: BrokerClient | torch.Tensor,
        seq_adapters: Sequence[str | None],
        seq_lens: Sequence[int],
        lease: AdapterLease,
        tables: AdapterTables,
        *,
        path: PathChoice = "auto",
        block_m: int = DEFAULT_BLOCK_M,
        backend: BackendChoice = "auto",
    ) -> LoraBatch:
        """The metadata for one step whose tokens are the sequences' tokens back to back.

        A padded ``[B, S]`` batch is served by passing ``seq_lens=[S] * B`` (padding tokens
        then carry their sequence's adapter; their outputs are discarded anyway).

        Args:
            source: the client whose arena holds the lease's pages (its ``arena_tensor`` is
                taken), or that arena as a 1-D tensor (viewed as the adapters' dtype).
            seq_adapters: per sequence, the adapter id, or None for the base model alone.
            seq_lens: per sequence, its number of tokens in this step (>= 1).
            lease: the step's adapters, from ``acquire_adapters``.
            tables: where offset tables are built and cached; on the arena's device.
            path, block_m: for ``plan_batch`` ("auto" picks from tokens per adapter).
            backend: for ``kernels.dispatch.choose_backend``: "auto" runs the Triton kernels
                for an arena on a GPU and the torch path for one on the CPU (logged once).

        Raises:
            ValueError: mismatched lengths, a length below 1, a sequence whose adapter the
                lease deferred (leave it out: see ``admitted_sequences``), adapters of
                different dtypes, a table cache on another device than the arena, an
                arena tensor that does not reach an adapter's pages, or a backend that
                cannot run on the arena's device.
            RuntimeError: an adapter the lease does not hold (never acquired), or a released lease.
        """
        _check_sequences(seq_adapters, seq_lens, lease)
        slots, seq_slots = _assign_slots(seq_adapters, lease)
        arena, row_align = _arena_view(source, slots, tables)
        slot_per_seq = torch.tensor(seq_slots, dtype=torch.int32)
        on = tables.device if arena is None else arena.device  # the arena's own device
        token_slot = torch.repeat_interleave(slot_per_seq, torch.tensor(list(seq_lens))).to(on)
        segments = _segments(seq_slots, seq_lens)
        plan = plan_batch(token_slot, len(slots), path=path, active_slots=len(slots), block_m=block_m)
        chosen = choose_backend(token_slot.device, backend)
        step = LoraStep(token_slot, plan)
        return cls(step, tuple(seq_slots), tuple(segments), tuple(slots), arena, row_align, tables, chosen)

    @property
    def token_slot(self) -> torch.Tensor:
        return self.step.token_slot

    @property
    def plan(self) -> BatchPlan:
        return self.step.plan

    @property
    def num_tokens(self) -> int:
        return self.token_slot.shape[0]

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def active(self) -> bool:
        """Whether the layers launch the kernels: some token has an adapter."""
        return bool(self.slots)

    def tables(self, layer: int, modules: Sequence[str]) -> Tables:
        """The tables (a ``LoraTables``) for one launch over ``modules`` fused slices.

        A slot whose adapter adapts none of the slices has rank 0 (its tokens are untouched).

        Raises:
            ValueError: a slot adapts only some of the slices, or with different ranks or
                scalings (launch the slices separately).
        """
        return self.table_cache.tables(self.slots, layer, modules)

    def launches(self, layer: int, modules: Sequence[str]) -> list[tuple[tuple[int, ...], Tables]]:
        """The kernel launches that serve ``modules`` of ``layer`` this step, cached for the step.

        Each is (slice indices, tables): one fused launch when every slot can fuse the slices,
        otherwise one per slice; launches no slot has rows for are dropped.
        """
        key = (layer, tuple(modules))
        hit = self._launches.get(key)
        if hit is None:
            try:
                hit = [(tuple(range(len(modules))), self.tables(layer, modules))]
            except ValueError:
                if len(modules) == 1:
                    raise
                # An adapter adapts some of the fused slices, or with different ranks or
                # scalings: the kernels take one rank and scaling per slot and launch.
                hit = [((j,), self.tables(layer, [m])) for j, m in enumerate(modules)]
            # A rank dimension of 0: no slot adapts these slices (shapes are host-side, no sync).
            hit = [h for h in hit if h[1].max_rank > 0]
            self._launches[key] = hit
        return hit


class StaticLoraBatch:
    """A decode batch that a CUDA graph can capture: sized once, refreshed each step by copies.

    Its token map (``step``: ``num_tokens`` tokens, one per sequence, the rest base-only) and
    every launch's tables (``max_slots`` slots, rank dimension ``max_rank``) are allocated
    once, on a layer's first use (run one step before capturing); ``update`` assigns the
    step's sequences to slots on the host and ``copy_``s the token map and the slots' tables
    (built once per adapter generation by ``AdapterTables``) into those tensors. A graph
    captured over the model's forward then replays with the new map and adapters. Its path is
    the token path (decode: no plan); every launch is one fused launch over its modules.

    Args:
        num_tokens: the graph's token count (pad shorter steps' inputs to it).
        max_slots: distinct adapters per step, at most.
        max_rank: the tables' rank dimension; every adapter's rank must fit it.
        arena: the arena as a 1-D tensor of the adapters' dtype; every step's adapters must be
            in this very tensor (the graph reads its address).
        tables: the table cache, on the arena's device.
        row_align: the alignment every adapter's rows promise (the kernels' hint, fixed in the graph).
        backend: as for ``LoraBatch.build``; only "triton" can be captured.
    """

    def __init__(
        self,
        num_tokens: int,
        max_slots: int,
        max_rank: int,
        arena: torch.Tensor,
        tables: AdapterTables,
        *,
        row_align: int = 1,
        backend: BackendChoice = "auto",
    ):
        if not same_device(arena.device, tables.device):
            raise ValueError(f"the offset tables live on {tables.device} but the arena on {arena.device}")
        plan = BatchPlan(path="token", num_tokens=num_tokens, num_slots=max_slots)
        self.step = LoraStep.empty(num_tokens, arena.device, plan)
        self.max_slots, self.max_rank, self.row_align = max_slots, max_rank, row_align
        self.arena = arena
        self.table_cache = tables
        self.backend = choose_backend(arena.device, backend)
        # The step's adapters, by slot.
        self.slots: tuple[LeasedAdapter, ...] = ()
        self._launches: dict[tuple[int, tuple[str, ...]], list[tuple[tuple[int, ...], LoraTables]]] = {}

    @property
    def num_tokens(self) -> int:
        return self.step.num_tokens

    @property
    def token_slot(self) -> torch.Tensor:
        return self.step.token_slot

    @property
    def active(self) -> bool:
        # Always: a graph captured without the kernels could not serve a later step with adapters.
        return True

    def update(
        self, source: BrokerClient | torch.Tensor, seq_adapters: Sequence[str | None], lease: AdapterLease
    ) -> StaticLoraBatch:
        """Loads the next decode step (one token per sequence) into the same tensors.

        Raises:
            ValueError: more sequences than tokens, more adapters than slots, an adapter whose
                rank exceeds max_rank or that adapts only some of a launch's modules, an arena
                view other than the one given, or rows less aligned than row_align; and what
                ``LoraBatch.build`` refuses.
            RuntimeError: an adapter the lease does not hold, or a released lease.
        """
        _check_sequences(seq_adapters, [1] * len(seq_adapters), lease)
        if len(seq_adapters) > self.num_tokens:
            raise ValueError(f"{len(seq_adapters)} sequences do not fit a static batch of {self.num_tokens} tokens")
        slots, seq_slots = _assign_slots(seq_adapters, lease)
        if len(slots) > self.max_slots:
            raise ValueError(f"the step uses {len(slots)} adapters; the static batch has {self.max_slots} slots")
        arena, row_align = _arena_view(source, slots, self.table_cache)
        if arena is not None and (arena.data_ptr() != self.arena.data_ptr() or arena.dtype != self.arena.dtype):
            raise ValueError("the step's arena view is not the static batch's (another address or dtype): capture anew")
        if row_align % self.row_align:
            raise ValueError(f"the adapters' rows are aligned to {row_align} elements, not {self.row_align}")
        self.slots = tuple(slots)
        for key, hit in self._launches.items():
            self._load(key, hit[0][1])
        self.step.load_(torch.tensor(seq_slots, dtype=torch.int32))
        return self

    def launches(self, layer: int, modules: Sequence[str]) -> list[tuple[tuple[int, ...], LoraTables]]:
        """One fused launch over ``modules`` on this batch's tables for them (allocated and
        loaded on first use: run a step before capturing)."""
        key = (layer, tuple(modules))
        hit = self._launches.get(key)
        if hit is None:
            tables = LoraTables.empty(self.max_slots, len(modules), self.max_rank, self.arena.device)
            self._load(key, tables)
            hit = self._launches[key] = [(tuple(range(len(modules))), tables)]
        return hit

    def _load(self, key: tuple[int, tuple[str, ...]], into: LoraTables) -> None:
        layer, modules = key
        try:
            into.load_(self.table_cache.tables(self.slots, layer, modules, max_rank=self.max_rank))
        except ValueError as e:
            raise ValueError(f"a static batch cannot serve layer {layer} {'+'.join(modules)} this step: {e}") from e


class LoraContext:
    """The step in force for a set of LoRALinear layers (one per wrapped model)."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        # The active step's batch; None runs the base model alone.
        self.batch: LoraBatch | StaticLoraBatch | None = None

    @contextlib.contextmanager
    def step(self, batch: LoraBatch | StaticLoraBatch | None) -> Iterator[LoraBatch | StaticLoraBatch | None]:
        """Make ``batch`` the step in force inside the block (None: base model only)."""
        previous, self.batch = self.batch, batch
        try:
            yield batch
        finally:
            self.batch = previous


class LoRALinear(nn.Module):
    """A base ``nn.Linear`` plus, for each token, the delta of that token's adapter.

    The base runs unchanged in its own dtype; its output is the kernels' ``out``, updated in
    place. x is cast to the adapters' weight dtype for the kernels (which accumulate in
    fp32 and round once to the base output's dtype). Tokens are x's rows after flattening
    all leading dimensions and must line up with the step's ``token_slot``; base-only tokens,
    and tokens whose adapter adapts none of this layer's modules, get exactly the base
    output. With no step in force the layer is the base layer.

    Args:
        base_layer: the layer to wrap (kept, not copied).
        layer: the decoder layer's index, as in the adapters' layouts.
        modules: the module name(s) of the output's slices, e.g. "q_proj", or
            ("q_proj", "k_proj", "v_proj") for a fused layer.
        slice_sizes: each slice's width (they add up to out_features); default: one slice.
        context: the holder of the step in force; a fresh one by default.
    """

    def __init__(
        self,
        base_layer: nn.Linear,
        layer: int,
        modules: str | Sequence[str],
        *,
        slice_sizes: Sequence[int] | None = None,
        context: LoraContext | None = None,
    ):
        super().__init__()
        self.base_layer = base_layer
        self.layer = layer
        self.module_names = (modules,) if isinstance(modules, str) else tuple(modules)
        sizes = (base_layer.out_features,) if slice_sizes is None else tuple(slice_sizes)
        if len(sizes) != len(self.module_names) or sum(sizes) != base_layer.out_features:
            raise ValueError(
                f"slice sizes {list(sizes)} must be one per module {list(self.module_names)} "
                f"and add up to out_features {base_layer.out_features}"
            )
        self.slice_sizes = sizes
        self.slice_offsets = tuple(sum(sizes[:j]) for j in range(len(sizes)))
        self.context = context or LoraContext()

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def extra_repr(self) -> str:
        return f"layer={self.layer}, modules={list(self.module_names)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        batch = self.context.batch
        if batch is None or not batch.active:
            return out
        launches = batch.launches(self.layer, self.module_names)
        if not launches:
            return out
        tokens = x.reshape(-1, self.in_features)
        if tokens.shape[0] != batch.num_tokens:
            raise RuntimeError(
                f"layer {self.layer} {'+'.join(self.module_names)} got {tokens.shape[0]} tokens "
                f"(input shape {tuple(x.shape)}) but the step's batch has {batch.num_tokens}"
            )
        xk = tokens.to(batch.arena.dtype)
        flat = out.view(-1, self.out_features)
        for slices, tables in launches:
            lora_apply(
                xk,
                flat,
                batch.arena,
                tables,
                batch.step,
                [self.slice_offsets[j] for j in slices],
                [self.slice_sizes[j] for j in slices],
                row_align=batch.row_align,
                backend=batch.backend,
            )
        return out


def layer_index(name: str) -> int | None:
    """'model.layers.3.self_attn.q_proj' -> 3: the first numbered segment after the first,
    the rule the broker's registry reads PEFT module names with."""
    parts = name.split(".")
    for p in parts[1:-1]:
        if p.isdigit():
            return int(p)
    return None


class LoraModel:
    """What ``wrap_model`` returns: the model, its LoRALinear layers, and how to run a step."""

    def __init__(self, model: nn.Module, layers: dict[str, LoRALinear], context: LoraContext, tables: AdapterTables):
        self.model = model
        # Full module name -> its LoRALinear.
        self.layers = layers
        self.context = context
        # Offset tables for this model's batches, cached per adapter generation.
        self.tables = tables

    def batch(
        self,
        source: BrokerClient | torch.Tensor,
        seq_adapters: Sequence[str | None],
        seq_lens: Sequence[int],
        lease: AdapterLease,
        **kw,
    ) -> LoraBatch:
        """``LoraBatch.build`` with this model's table cache."""
        return LoraBatch.build(source, seq_adapters, seq_lens, lease, self.tables, **kw)

    def static_batch(
        self, num_tokens: int, max_slots: int, max_rank: int, arena: torch.Tensor, **kw
    ) -> StaticLoraBatch:
        """A ``StaticLoraBatch`` (a decode step a CUDA graph can capture) with this model's table cache."""
        return StaticLoraBatch(num_tokens, max_slots, max_rank, arena, self.tables, **kw)

    def step(self, batch: LoraBatch | StaticLoraBatch | None):
        """``with lora.step(batch): model(...)`` runs the model with each token's adapter."""
        return self.context.step(batch)

    def generate(
        self,
        source: BrokerClient | torch.Tensor,
        lease: AdapterLease,
        prompts: Sequence[Sequence[int] | torch.Tensor],
        seq_adapters: Sequence[str | None],
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        output_logits: bool = False,
        path: PathChoice = "auto",
    ) -> Generation:
        """Greedy decoding of a batch whose sequences use different adapters (or none).

        HF's ``model.generate()`` cannot run under ``step``: a step's batch is sized for one
        forward, and generate runs many. This is the loop that does work, the way an engine
        runs it: one prefill of the prompts, left-padded to one length (attention mask and
        position ids as HF's generate builds them, padding tokens carry their sequence's
        adapter and are masked out), then one token per sequence per step through the model's
        KV cache, each step under one decode batch built once: a ``StaticLoraBatch`` when some
        sequence has an adapter and ``path`` allows the token path (its tensors keep their
        addresses, so a CUDA graph can capture the decode steps), else a ``LoraBatch`` of
        ``seq_lens`` 1.

        Args:
            source, lease: as for ``batch``; the lease must hold every adapter used until
                this returns.
            prompts: per sequence, its token ids (at least one).
            seq_adapters: per sequence, the adapter id, or None for the base model.
            max_new_tokens: tokens to generate per sequence (0: none, nothing runs).
            eos_token_id: a sequence that emits it stops (its list ends with it); the batch
                stops when all have.
            pad_token_id: the left padding, and what finished sequences are fed; default
                eos_token_id, else 0 (masked out either way).
            output_logits: also return every step's logits (fp32 [B, steps, vocab]).
            path: for ``plan_batch``, every step ("auto": segment for long prefills).

        Returns:
            A ``Generation``: per sequence, the new tokens, as HF's greedy ``generate`` would
            give them for that sequence alone with its adapter (up to floating-point order).

        Raises:
            ValueError: mismatched lengths, an empty prompt, a negative max_new_tokens, or
                what ``LoraBatch.build`` refuses (e.g. a sequence of a deferred adapter).
        """
        rows = _prompt_rows(prompts, seq_adapters, max_new_tokens)
        num_seqs = len(rows)
        if max_new_tokens == 0 or num_seqs == 0:
            return Generation([[] for _ in rows], None)
        pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)
        device = next(self.model.parameters()).device
        ids, mask, positions = _left_padded(rows, pad, device)
        prefill = self.batch(source, seq_adapters, [ids.shape[1]] * num_seqs, lease, path=path)
        decode = self._decode_batch(source, seq_adapters, lease, path)
        extra = {}
        if "logits_to_keep" in inspect.signature(self.model.forward).parameters:
            extra["logits_to_keep"] = 1  # the last position's logits only
        return self._greedy(
            prefill, decode, ids, mask, positions, max_new_tokens, eos_token_id, pad, output_logits, extra
        )

    def _decode_batch(
        self, source: BrokerClient | torch.Tensor, seq_adapters: Sequence[str | None], lease: AdapterLease, path
    ) -> LoraBatch | StaticLoraBatch:
        """``generate``'s decode batch: one token per sequence, on a ``StaticLoraBatch`` sized for
        these sequences, their adapters and the largest rank among them (the token path);
        the ordinary ``LoraBatch`` when no sequence has an adapter or ``path`` is "segment"."""
        ordinary = self.batch(source, seq_adapters, [1] * len(seq_adapters), lease, path=path)
        if not ordinary.active or path == "segment":
            return ordinary
        max_rank = max(m.rank for a in ordinary.slots for m in a.layout.modules)
        static = self.static_batch(
            len(seq_adapters),
            len(ordinary.slots),
            max_rank,
            ordinary.arena,
            row_align=ordinary.row_align,
            backend=ordinary.backend,
        )
        return static.update(source, seq_adapters, lease)

    def _greedy(
        self,
        prefill: LoraBatch,
        decode: LoraBatch | StaticLoraBatch,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | None,
        pad: int,
        output_logits: bool,
        extra: dict,
    ) -> Generation:
        """``generate``'s loop: the prefill under ``prefill``, then one token per sequence per
        step under ``decode`` through the model's KV cache."""
        num_seqs = ids.shape[0]
        device = ids.device
        new: list[list[int]] = [[] for _ in range(num_seqs)]
        steps: list[torch.Tensor] = []
        done = torch.zeros(num_seqs, dtype=torch.bool, device=device)
        with torch.inference_mode():
            with self.step(prefill):
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
            for n in range(max_new_tokens):
                logits = out.logits[:, -1, :].float()
                if output_logits:
                    steps.append(logits)
                token = logits.argmax(-1)
                if eos_token_id is not None:
                    token = torch.where(done, torch.full_like(token, pad), token)
                for i, (t, finished) in enumerate(zip(token.tolist(), done.tolist())):
                    if not finished:
                        new[i].append(t)
                if eos_token_id is not None:
                    done |= token == eos_token_id
                if n == max_new_tokens - 1 or bool(done.all()):
                    break
                mask = torch.cat([mask, torch.ones((num_seqs, 1), dtype=mask.dtype, device=device)], dim=1)
                positions = positions[:, -1:] + 1
                with self.step(decode):
                    out = self.model(
                        input_ids=token[:, None],
                        attention_mask=mask,
                        position_ids=positions,
                        past_key_values=out.past_key_values,
                        use_cache=True,
                        **extra,
                    )
        return Generation(new, torch.stack(steps, dim=1) if output_logits else None)


@dataclass(frozen=True, slots=True)
class Generation:
    """What ``LoraModel.generate`` returns."""

    # Per sequence, its new tokens in order (ending with eos_token_id if it emitted it).
    tokens: list[list[int]]
    # fp32 [B, steps, vocab]: each step's logits (rows of finished sequences included); None
    # unless output_logits was asked for.
    logits: torch.Tensor | None


def wrap_model(
    model: nn.Module,
    target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
    *,
    device: torch.device | str | None = None,
) -> LoraModel:
    """Replace every ``nn.Linear`` named in ``target_modules`` inside a numbered decoder layer
    (``model.layers.3.self_attn.q_proj``) with a LoRALinear for (3, "q_proj"), in place.

    Layers outside numbered layers (lm_head) stay as they are: adapters cannot adapt them.

    Args:
        model: a Hugging Face decoder model (or anything named like one).
        target_modules: short names of the layers to wrap.
        device: where offset tables live (the arena's device); default: the model's.

    Raises:
        ValueError: no layer matched.
        RuntimeError: the model is already wrapped.
    """
    targets = set(target_modules)
    found: list[tuple[str, nn.Linear, int, str]] = []
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            raise RuntimeError(f"{type(model).__name__} is already wrapped ({name} is a LoRALinear)")
        short = name.rsplit(".", 1)[-1]
        if short in targets and isinstance(module, nn.Linear):
            layer = layer_index(name)
            if layer is not None:
                found.append((name, module, layer, short))
    if not found:
        raise ValueError(f"{type(model).__name__} has no nn.Linear named {sorted(targets)} inside a numbered layer")
    context = LoraContext()
    layers: dict[str, LoRALinear] = {}
    for name, module, layer, short in found:
        parent, _, attr = name.rpartition(".")
        wrapped = LoRALinear(module, layer, short, context=context)
        setattr(model.get_submodule(parent), attr, wrapped)
        layers[name] = wrapped
    if device is None:
        device = found[0][1].weight.device
    return LoraModel(model, layers, context, AdapterTables(device))
