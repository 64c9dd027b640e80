"""Multi-LoRA in an engine without a broker: a step's batch metadata, and LoRALinear against
the torch reference on an arena packed here with the broker's own layout code.

Without a CUDA device the deltas run on the torch path that ``kernels.dispatch`` picks for a
CPU arena (no TRITON_INTERPRET needed); with one, the same tests run the Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from memory_broker.broker.adapters.layout import LoraModuleSpec, plan_layout, row_offsets
from memory_broker.clients.lora import LoraBatch, LoraContext, LoRALinear, Segment, admitted_sequences, wrap_model
from memory_broker.clients.step.adapters import AdapterTables, LeasedAdapter
from memory_broker.kernels import reference

CUDA = torch.cuda.is_available()

DEVICE = torch.device("cuda" if CUDA else "cpu")
IN, Q, KV = 32, 48, 16
PAGE_SIZE = 1024  # bytes: a few rows per page, so every matrix spans pages
# adapter id -> {(layer, module): (rank, scaling)}
ADAPTERS = {
    "a": {(0, "q_proj"): (4, 2.0), (0, "v_proj"): (4, 2.0)},
    "b": {(0, "q_proj"): (8, 0.5), (0, "k_proj"): (8, 0.5), (0, "v_proj"): (8, 0.5)},
    "c": {(0, "k_proj"): (16, 1.5)},
}
WIDTH = {"q_proj": Q, "k_proj": KV, "v_proj": KV}


@dataclass
class FakeLease:
    """What LoraBatch reads from an AdapterLease."""

    adapters: list[LeasedAdapter]
    deferred: list[str] = field(default_factory=list)
    released: bool = False

    @property
    def ids(self) -> list[str]:
        return [a.adapter_id for a in self.adapters]


@dataclass
class Packed:
    arena: torch.Tensor
    leased: dict[str, LeasedAdapter]
    # (adapter, layer, module) -> (A [r, in], B [out, r], scaling), fp32 on the host
    weights: dict

    def lease(self, *ids: str, deferred=()) -> FakeLease:
        return FakeLease([self.leased[i] for i in ids], list(deferred))


def pack(dtype: str = "float32", seed: int = 0) -> Packed:
    """ADAPTERS laid out by the broker's planner on shuffled physical pages; the rest is NaN."""
    g = torch.Generator().manual_seed(seed)
    es = 4 if dtype == "float32" else 2
    layouts, weights = {}, {}
    for aid, mods in ADAPTERS.items():
        specs = []
        for (layer, module), (rank, scaling) in mods.items():
            out = WIDTH[module]
            a = torch.randn(rank, IN, generator=g) / IN**0.5
            b = torch.randn(out, rank, generator=g) / rank**0.5
            weights[(aid, layer, module)] = (a, b, scaling)
            specs.append(LoraModuleSpec(layer, module, rank, IN, out, scaling))
        layouts[aid] = plan_layout(specs, PAGE_SIZE, dtype)
    total = sum(lay.num_pages for lay in layouts.values()) + 3
    free = (1 + torch.randperm(total - 1, generator=g)).tolist()  # page 0 stays spare
    arena = torch.full((total * PAGE_SIZE // es,), float("nan"), dtype=getattr(torch, dtype))
    leased = {}
    for generation, (aid, layout) in enumerate(layouts.items(), start=1):
        pages = tuple(free.pop() for _ in range(layout.num_pages))
        for (layer, module, kind), offs in row_offsets(layout, pages).items():
            a, b, _ = weights[(aid, layer, module)]
            rows = a if kind == "A" else b.t()
            for off, row in zip(offs.tolist(), rows):
                arena[off : off + row.shape[0]] = row.to(arena.dtype)
        leased[aid] = LeasedAdapter(aid, generation, generation, pages, layout, "hot")
    return Packed(arena.to(DEVICE), leased, weights)


@pytest.fixture(scope="module")
def packed() -> Packed:
    return pack()


def linear(out_features: int, seed: int = 1, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(IN, out_features, bias=True).to(DEVICE, dtype)


def tokens(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(n, IN, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def build(packed: Packed, seq_adapters, seq_lens, tables=None, **kw) -> LoraBatch:
    ids = list(dict.fromkeys(a for a in seq_adapters if a is not None))
    return LoraBatch.build(
        packed.arena, seq_adapters, seq_lens, packed.lease(*ids), tables or AdapterTables(DEVICE), **kw
    )


# ----------------------------------------------------------------------- batch metadata


def test_tokens_carry_their_sequence_slot_and_slots_follow_first_use(packed):
    batch = build(packed, ["b", None, "a", "a", "b", None, None], [2, 1, 3, 1, 2, 1, 2])
    assert [a.adapter_id for a in batch.slots] == ["b", "a"]
    assert batch.seq_slots == (0, -1, 1, 1, 0, -1, -1)
    assert batch.token_slot.dtype == torch.int32
    assert batch.token_slot.tolist() == [0, 0, -1, 1, 1, 1, 1, 0, 0, -1, -1, -1]
    assert batch.num_tokens == 12 and batch.num_slots == 2


def test_segments_are_maximal_runs_of_one_slot(packed):
    batch = build(packed, ["b", None, "a", "a", "b", None, None], [2, 1, 3, 1, 2, 1, 2])
    assert batch.segments == (
        Segment(0, 2, 0),
        Segment(2, 3, -1),
        Segment(3, 7, 1),
        Segment(7, 9, 0),
        Segment(9, 12, -1),
    )


def test_the_plan_counts_the_batch_adapters_and_picks_the_path_from_tokens_per_adapter(packed):
    decode = build(packed, ["a", "b", None, "a"], [1, 1, 1, 1])
    assert decode.plan.num_slots == 2 and decode.plan.path == "token"
    prefill = build(packed, ["a", "b", None], [40, 24, 5])
    assert prefill.plan.path == "segment" and prefill.plan.segments is not None


def test_row_align_is_the_layouts_alignment_in_elements(packed):
    assert build(packed, ["a"], [1]).row_align == 4  # 16-byte rows of float32


def test_a_base_only_batch_has_no_slots_and_no_arena(packed):
    batch = build(packed, [None, None], [3, 2])
    assert batch.slots == () and batch.arena is None
    assert batch.token_slot.tolist() == [-1] * 5


def test_sequences_of_deferred_adapters_are_refused_with_their_indices(packed):
    lease = packed.lease("a", "b", deferred=["c"])
    with pytest.raises(ValueError, match=r"sequences \[1, 3\] use adapters \['c'\] that the lease deferred"):
        LoraBatch.build(packed.arena, ["a", "c", None, "c"], [1, 1, 1, 1], lease, AdapterTables(DEVICE))


def test_admitted_sequences_leave_out_deferred_adapters(packed):
    lease = packed.lease("a", "b", deferred=["c"])
    seqs = ["a", "c", None, "b", "c"]
    keep = admitted_sequences(seqs, lease)
    assert keep == [0, 2, 3]
    batch = LoraBatch.build(packed.arena, [seqs[i] for i in keep], [1] * len(keep), lease, AdapterTables(DEVICE))
    assert [a.adapter_id for a in batch.slots] == ["a", "b"]


def test_an_adapter_the_lease_does_not_hold_is_misuse(packed):
    with pytest.raises(RuntimeError, match="'c', which the lease does not hold"):
        LoraBatch.build(packed.arena, ["a", "c"], [1, 1], packed.lease("a"), AdapterTables(DEVICE))


def test_a_released_lease_is_refused(packed):
    lease = packed.lease("a")
    lease.released = True
    with pytest.raises(RuntimeError, match="released"):
        LoraBatch.build(packed.arena, ["a"], [1], lease, AdapterTables(DEVICE))


def test_lengths_must_match_and_be_positive(packed):
    with pytest.raises(ValueError, match="2 sequence adapters but 1"):
        build(packed, ["a", None], [1])
    with pytest.raises(ValueError, match=r"sequences \[1\] have lengths \[0\]"):
        build(packed, ["a", None], [1, 0])


def test_an_arena_that_does_not_reach_the_pages_is_refused(packed):
    with pytest.raises(ValueError, match="arena view covers"):
        LoraBatch.build(packed.arena[:256], ["a"], [1], packed.lease("a"), AdapterTables(DEVICE))


def test_tables_are_built_once_for_steps_with_the_same_adapters(packed):
    tables = AdapterTables(DEVICE)
    layer = LoRALinear(linear(Q), 0, "q_proj")
    x = tokens(4)
    for lens in ([2, 2], [1, 3]):
        with layer.context.step(build(packed, ["a", "b"], lens, tables)):
            layer(x)
    assert tables.builds == 1


# ----------------------------------------------------------------------- LoRALinear


@pytest.mark.parametrize("path", ["token", "segment"])
def test_lora_linear_matches_the_reference_and_leaves_base_tokens_bit_identical(packed, path):
    seqs, lens = ["b", None, "a", "b", None], [3, 2, 4, 1, 2]
    batch = build(packed, seqs, lens, path=path)
    layer = LoRALinear(linear(Q), 0, "q_proj")
    x = tokens(batch.num_tokens)
    with torch.no_grad(), layer.context.step(batch):
        got = layer(x)
        base = layer.base_layer(x)
    want = reference.lora_apply(x, base.clone(), packed.arena, batch.tables(0, ["q_proj"]), batch.step, [0], [Q])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    base_only = batch.token_slot == -1
    assert torch.equal(got[base_only], base[base_only])
    assert (got[~base_only] - base[~base_only]).abs().min() > 0


def test_each_sequence_gets_its_own_adapters_delta(packed):
    seqs, lens = ["a", "b", "a"], [2, 3, 2]
    batch = build(packed, seqs, lens)
    layer = LoRALinear(linear(Q), 0, "q_proj")
    x = tokens(batch.num_tokens)
    with torch.no_grad(), layer.context.step(batch):
        got = layer(x)
        base = layer.base_layer(x)
    start = 0
    for aid, n in zip(seqs, lens):
        a, b, s = packed.weights[(aid, 0, "q_proj")]
        a, b = a.to(DEVICE), b.to(DEVICE)
        rows = slice(start, start + n)
        torch.testing.assert_close(got[rows], base[rows] + s * (x[rows] @ a.t() @ b.t()), atol=1e-5, rtol=1e-5)
        start += n


def test_a_batched_input_is_flattened_in_sequence_order(packed):
    batch = build(packed, ["a", None, "b"], [5, 5, 5])
    layer = LoRALinear(linear(Q), 0, "q_proj")
    x = tokens(15)
    with torch.no_grad(), layer.context.step(batch):
        flat = layer(x)
        batched = layer(x.view(3, 5, IN))
    assert batched.shape == (3, 5, Q)
    torch.testing.assert_close(batched.view(15, Q), flat, atol=0, rtol=0)


def test_tokens_of_an_adapter_that_does_not_adapt_the_module_are_untouched(packed):
    # "a" adapts q_proj and v_proj only; in k_proj its tokens must keep the base output.
    batch = build(packed, ["a", "c", "a", "b"], [3, 2, 1, 2])
    layer = LoRALinear(linear(KV), 0, "k_proj")
    x = tokens(batch.num_tokens)
    with torch.no_grad(), layer.context.step(batch):
        got = layer(x)
        base = layer.base_layer(x)
    slot_a = [a.adapter_id for a in batch.slots].index("a")
    of_a = batch.token_slot == slot_a
    assert batch.tables(0, ["k_proj"]).ranks[slot_a] == 0
    assert torch.equal(got[of_a], base[of_a])
    assert (got[~of_a] - base[~of_a]).abs().min() > 0


def test_a_module_no_adapter_in_the_batch_adapts_launches_nothing(packed):
    batch = build(packed, ["a"], [3])
    assert batch.launches(0, ["k_proj"]) == [] and batch.launches(1, ["q_proj"]) == []
    layer = LoRALinear(linear(KV), 0, "k_proj")
    x = tokens(3)
    with torch.no_grad(), layer.context.step(batch):
        assert torch.equal(layer(x), layer.base_layer(x))


def test_fused_slices_launch_once_when_every_slot_can_fuse_them(packed):
    batch = build(packed, ["a", "b"], [2, 2])
    assert [slices for slices, _ in batch.launches(0, ["q_proj", "v_proj"])] == [(0, 1)]


def test_fused_slices_an_adapter_only_partly_adapts_fall_back_to_one_launch_per_slice(packed):
    # "a" adapts q and v but not k: the kernels take one rank per slot, so each slice launches alone.
    batch = build(packed, ["a", None, "b", "c"], [2, 1, 3, 2])
    assert [slices for slices, _ in batch.launches(0, ["q_proj", "k_proj", "v_proj"])] == [(0,), (1,), (2,)]
    qkv = linear(Q + 2 * KV)
    fused = LoRALinear(qkv, 0, ("q_proj", "k_proj", "v_proj"), slice_sizes=(Q, KV, KV))
    x = tokens(batch.num_tokens)
    with torch.no_grad(), fused.context.step(batch):
        got = fused(x)
        base = qkv(x)
    want = base.clone()
    for module, first, width in (("q_proj", 0, Q), ("k_proj", Q, KV), ("v_proj", Q + KV, KV)):
        reference.lora_apply(x, want, packed.arena, batch.tables(0, [module]), batch.step, [first], [width])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp16_adapters_take_x_cast_to_fp16_and_the_output_keeps_the_base_dtype():
    half = pack("float16", seed=3)
    batch = build(half, ["b", None, "a"], [2, 2, 2])
    layer = LoRALinear(linear(Q), 0, "q_proj")
    x = tokens(batch.num_tokens)
    with torch.no_grad(), layer.context.step(batch):
        got = layer(x)
        base = layer.base_layer(x)
    assert got.dtype == torch.float32
    want = reference.lora_apply(x.half(), base.clone(), half.arena, batch.tables(0, ["q_proj"]), batch.step, [0], [Q])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_token_count_unlike_the_batch_is_refused(packed):
    batch = build(packed, ["a"], [4])
    layer = LoRALinear(linear(Q), 0, "q_proj")
    with layer.context.step(batch), pytest.raises(RuntimeError, match="got 3 tokens .* the step's batch has 4"):
        layer(tokens(3))


def test_without_a_step_the_layer_is_its_base(packed):
    layer = LoRALinear(linear(Q), 0, "q_proj")
    x = tokens(3)
    with torch.no_grad():
        assert torch.equal(layer(x), layer.base_layer(x))


def test_slice_sizes_must_cover_the_output():
    with pytest.raises(ValueError, match="add up to out_features 80"):
        LoRALinear(linear(Q + 2 * KV), 0, ("q_proj", "k_proj"), slice_sizes=(Q, KV))


# ----------------------------------------------------------------------- wrap_model


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.ModuleDict({m: nn.Linear(IN, IN) for m in ("q_proj", "k_proj", "v_proj", "o_proj")})


class TinyDecoder(nn.Module):
    """Named like a Hugging Face decoder: model.layers.N.self_attn.q_proj, and an lm_head."""

    def __init__(self, num_layers: int = 3):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Block() for _ in range(num_layers))
        self.lm_head = nn.Linear(IN, IN)

    def forward(self, x):
        for block in self.model.layers:
            x = sum(lin(x) for lin in block.self_attn.values())
        return self.lm_head(x)


def test_wrap_model_wraps_the_target_layers_with_their_layer_and_name():
    model = TinyDecoder()
    lora = wrap_model(model, target_modules=("q_proj", "v_proj", "lm_head"))
    assert sorted(lora.layers) == sorted(
        f"model.layers.{i}.self_attn.{m}" for i in range(3) for m in ("q_proj", "v_proj")
    )
    q2 = model.model.layers[2].self_attn["q_proj"]
    assert isinstance(q2, LoRALinear) and (q2.layer, q2.module_names) == (2, ("q_proj",))
    assert type(model.model.layers[2].self_attn["k_proj"]) is nn.Linear
    assert type(model.lm_head) is nn.Linear  # outside the numbered layers: adapters never adapt it
    assert all(layer.context is lora.context for layer in lora.layers.values())


def test_wrap_model_keeps_the_model_output_without_a_step():
    model = TinyDecoder()
    x = tokens(4)
    with torch.no_grad():
        before = model(x)
        wrap_model(model)
        assert torch.equal(model(x), before)


def test_wrap_model_refuses_a_wrapped_model_and_one_with_nothing_to_wrap():
    model = TinyDecoder()
    wrap_model(model)
    with pytest.raises(RuntimeError, match="already wrapped"):
        wrap_model(model)
    with pytest.raises(ValueError, match="no nn.Linear named"):
        wrap_model(TinyDecoder(), target_modules=("gate_proj",))


def test_a_step_is_in_force_only_inside_its_block(packed):
    lora = wrap_model(TinyDecoder().to(DEVICE))
    batch = lora.batch(packed.arena, ["a"], [1], packed.lease("a"))
    with lora.step(batch):
        assert lora.context.batch is batch
        with lora.step(None):
            assert lora.context.batch is None
        assert lora.context.batch is batch
    assert lora.context.batch is None
    assert isinstance(lora.context, LoraContext)


def test_the_batch_names_its_backend_from_the_arenas_device(packed):
    assert build(packed, ["a"], [3]).backend == ("triton" if CUDA else "torch")
    assert build(packed, ["a"], [3], backend="torch").backend == "torch"
    with pytest.raises(ValueError, match="backend must be"):
        build(packed, ["a"], [3], backend="cuda")


# ------------------------------------------------------------------------- generate


def test_generate_refuses_bad_arguments_before_running_anything(packed):
    lora = wrap_model(TinyDecoder().to(DEVICE))
    lease = packed.lease("a")
    with pytest.raises(ValueError, match="2 prompts but 1 sequence adapters"):
        lora.generate(packed.arena, lease, [[1], [2]], ["a"], 4)
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        lora.generate(packed.arena, lease, [[1], []], ["a", None], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        lora.generate(packed.arena, lease, [[1]], ["a"], -1)
    # Nothing to generate: no forward at all (TinyDecoder would fail on token ids).
    assert lora.generate(packed.arena, lease, [[1, 2], [3]], ["a", None], 0).tokens == [[], []]


# ----------------------------------------------------------------------- devices


def test_cuda_without_an_index_is_the_current_device(monkeypatch):
    """The 17 GPU failures "the offset tables live on cuda but the arena on cuda:0": tables
    made for ``cuda`` and an arena tensor on ``cuda:0`` are one device, and compare so."""
    from memory_broker.clients.step.adapters import AdapterTables
    from memory_broker.kernels.devices import device_key, same_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert device_key("cuda") == torch.device("cuda", 1) and device_key(torch.device("cuda")) == torch.device("cuda:1")
    assert device_key("cuda:0") == torch.device("cuda:0") and device_key("cpu") == torch.device("cpu")
    assert same_device("cuda", torch.device("cuda:1")) and same_device(torch.device("cuda"), "cuda:1")
    assert not same_device("cuda", "cuda:0") and not same_device("cuda", "cpu") and not same_device("cpu", "cuda:1")
    assert AdapterTables("cuda").device == torch.device("cuda:1")

    def no_cuda():
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    assert device_key("cuda") == torch.device("cuda") and not same_device("cuda", "cpu")


def test_the_batch_runs_on_the_arena_tensors_device(packed):
    # token_slot and the backend follow the arena's own device, not the name the tables gave.
    batch = build(packed, ["a", None], [2, 1])
    assert batch.token_slot.device == packed.arena.device
    assert batch.backend == ("triton" if packed.arena.device.type == "cuda" else "torch")
