"""A LoRA step that a CUDA graph can capture (``kernels.graph_step.StaticStep``): per-step host
work is ``copy_`` into buffers allocated once, and the kernels read only those buffers.

On a CPU the capture logic is checked under Triton's interpreter: across steps whose token
map changes and whose adapters come and go, every buffer keeps its address and the outputs
equal the torch reference. On a GPU the same steps run through a real ``torch.cuda.CUDAGraph``
captured once and replayed (``ops/gpu/run_gpu_checks.sh`` runs this file).
"""

from __future__ import annotations

import os
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

from memory_broker.kernels import reference  # noqa: E402
from memory_broker.kernels.graph_step import StaticStep  # noqa: E402
from memory_broker.kernels.records import LoraStep, LoraTables  # noqa: E402
from memory_broker.kernels.testing import PackedArena, pack_adapters, random_adapter  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
HIDDEN = 320  # two 256-column blocks: a split-K shrink has two parts
SLICES = (32, 16)
# (layer, module) launches of the "model"; each packs the pool's adapters in its own arena.
LAUNCHES = [(0, "qk"), (1, "qk")]
POOL_RANKS = (4, 16, 8, 1, 12, 16)


@dataclass
class Model:
    packs: dict[tuple[int, str], PackedArena]
    x: torch.Tensor
    out: torch.Tensor


def make_model(num_tokens: int, g: torch.Generator) -> Model:
    packs = {}
    for key in LAUNCHES:
        adapters = [random_adapter(r, HIDDEN, SLICES, g) for r in POOL_RANKS]
        packs[key] = pack_adapters(adapters, dtype=torch.float16, generator=g, device=DEVICE, max_rank=16)
    x = torch.randn(num_tokens, HIDDEN, generator=g).half().to(DEVICE)
    out = torch.empty(num_tokens, sum(SLICES), dtype=torch.float16, device=DEVICE)
    return Model(packs, x, out)


def subset(p: PackedArena, pool_ids: list[int]) -> LoraTables:
    """The tables of a step whose slot s holds pool adapter pool_ids[s]."""
    idx = torch.tensor(pool_ids, dtype=torch.long, device=DEVICE)
    return LoraTables(p.a_offsets[idx], p.b_offsets[idx], p.ranks[idx], p.scalings[idx])


def run_step(step: StaticStep, m: Model) -> None:
    """The captured work: the plan, then every launch, into the static output."""
    step.replan()
    for key in LAUNCHES:
        p = m.packs[key]
        step.apply(key, m.x, m.out, p.arena, p.slice_offsets, p.slice_sizes)


def draws(g: torch.Generator, num_tokens: int, max_slots: int, steps: int):
    """Per step: which pool adapters sit in the slots (a changing set: adapters come and go),
    and a token map over those slots, base-only tokens and, on some steps, fewer tokens."""
    for i in range(steps):
        active = int(torch.randint(1, max_slots + 1, (), generator=g))
        pool_ids = torch.randperm(len(POOL_RANKS), generator=g)[:active].tolist()
        n = num_tokens if i % 2 == 0 else int(torch.randint(1, num_tokens, (), generator=g))
        if i % 3 == 1:  # prefill-like runs
            token_slot = torch.repeat_interleave(torch.randint(-1, active, (4,), generator=g), -(-n // 4))[:n]
        else:
            token_slot = torch.randint(-1, active, (n,), generator=g)
        yield pool_ids, token_slot.to(torch.int32).to(DEVICE)


def expected(m: Model, base: torch.Tensor, pool_ids: list[int], token_slot: torch.Tensor) -> torch.Tensor:
    want = base.clone()
    full = torch.full((m.x.shape[0],), -1, dtype=torch.int32, device=DEVICE)
    full[: token_slot.shape[0]] = token_slot
    for key in LAUNCHES:
        p = m.packs[key]
        reference.lora_apply(m.x, want, p.arena, subset(p, pool_ids), LoraStep(full), p.slice_offsets, p.slice_sizes)
    return want


def static_step(path: str, num_tokens: int, max_slots: int, split_k: int = 1, fuse: bool = False) -> StaticStep:
    step = StaticStep(
        num_tokens,
        max_slots,
        DEVICE,
        path=path,
        block_m=16,
        split_k=split_k,
        fuse_shrink_slices=fuse,
        fuse_expand_slices=fuse,
    )
    for key in LAUNCHES:
        step.add_launch(key, len(SLICES), 16)
    return step


def load(step: StaticStep, m: Model, pool_ids: list[int], token_slot: torch.Tensor) -> None:
    """The per-step host work: copies only."""
    for key in LAUNCHES:
        step.load_tables(key, subset(m.packs[key], pool_ids))
    step.load_tokens(token_slot)


@pytest.mark.parametrize(
    "path,split_k,fuse", [("token", 1, False), ("token", 2, False), ("token", 2, True), ("segment", 1, False)]
)
def test_a_static_step_follows_changing_maps_and_adapters_in_the_same_buffers(path: str, split_k: int, fuse: bool):
    g = torch.Generator().manual_seed(23)
    m = make_model(40, g)
    step = static_step(path, 40, max_slots=4, split_k=split_k, fuse=fuse)
    ptrs = [t.data_ptr() for t in step.buffers()]
    for pool_ids, token_slot in draws(g, 40, 4, steps=4):
        load(step, m, pool_ids, token_slot)
        base = torch.randn(m.out.shape, generator=g).half().to(DEVICE)
        m.out.copy_(base)
        run_step(step, m)
        want = expected(m, base, pool_ids, token_slot)
        torch.testing.assert_close(m.out.float(), want.float(), atol=2e-2, rtol=1e-2)
        untouched = torch.ones(40, dtype=torch.bool, device=DEVICE)
        untouched[: token_slot.shape[0]] = token_slot < 0
        assert torch.equal(m.out[untouched], base[untouched]), "base-only or padding tokens changed"
        assert [t.data_ptr() for t in step.buffers()] == ptrs, "a step moved a buffer"


def test_a_slot_whose_adapter_left_is_rank_zero_and_changes_nothing():
    g = torch.Generator().manual_seed(4)
    m = make_model(16, g)
    step = static_step("token", 16, max_slots=3)
    load(step, m, [0, 1, 2], torch.zeros(16, dtype=torch.int32, device=DEVICE))
    load(step, m, [5], torch.full((16,), 2, dtype=torch.int32, device=DEVICE))  # slot 2's adapter left
    assert step.tables(LAUNCHES[0]).ranks.tolist() == [POOL_RANKS[5], 0, 0]
    base = torch.randn(m.out.shape, generator=g).half().to(DEVICE)
    m.out.copy_(base)
    run_step(step, m)
    assert torch.equal(m.out, base)


def test_tables_and_maps_that_do_not_fit_are_refused():
    step = static_step("token", 8, max_slots=2)
    p = make_model(8, torch.Generator().manual_seed(1)).packs[LAUNCHES[0]]
    with pytest.raises(ValueError, match="do not fit preallocated"):
        step.load_tables(LAUNCHES[0], subset(p, [0, 1, 2]))
    with pytest.raises(ValueError, match="does not fit a step of 8"):
        step.load_tokens(torch.zeros(9, dtype=torch.int32))
    with pytest.raises(ValueError, match="already has tables"):
        step.add_launch(LAUNCHES[0], 2, 16)
    with pytest.raises(ValueError, match="'token' or 'segment'"):
        StaticStep(8, 2, DEVICE, path="auto")


@pytest.mark.skipif(not CUDA, reason="CUDA graph capture needs a CUDA device; the CPU tests above check the logic")
@pytest.mark.parametrize("path,fuse", [("token", False), ("token", True), ("segment", False)])
def test_a_captured_step_replays_right_across_changing_maps_and_adapters(path: str, fuse: bool):
    g = torch.Generator().manual_seed(29)
    m = make_model(64, g)
    step = static_step(path, 64, max_slots=4, split_k=2 if fuse else 1, fuse=fuse)
    first = next(draws(g, 64, 4, steps=1))
    load(step, m, *first)
    m.out.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_step(step, m)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_step(step, m)
    for pool_ids, token_slot in draws(g, 64, 4, steps=6):
        load(step, m, pool_ids, token_slot)
        base = torch.randn(m.out.shape, generator=g).half().to(DEVICE)
        m.out.copy_(base)
        graph.replay()
        torch.cuda.synchronize()
        want = expected(m, base, pool_ids, token_slot)
        torch.testing.assert_close(m.out.float(), want.float(), atol=2e-2, rtol=1e-2)
