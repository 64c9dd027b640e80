"""The one-launch segment plan (``kernels.plan_kernel``) against the torch plan it replaces.

Without a CUDA device the kernel runs in Triton's interpreter on CPU tensors; on a GPU the same
tests run compiled. Random batches come from hypothesis (failures shrink to a small batch).
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

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from memory_broker.kernels import lora_ops, plan_kernel, reference  # noqa: E402
from memory_broker.kernels.batch_plan import BLOCK_M_CHOICES, build_segment_tiles, plan_batch  # noqa: E402
from memory_broker.kernels.records import LoraStep  # noqa: E402
from memory_broker.kernels.testing import pack_adapters, random_adapter  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
FIELDS = ("order", "tile_slot", "tile_start", "tile_end")


@st.composite
def batches(draw):
    """(token_slot, num_slots, block_m): decode-like draws or prefill-like runs, base-only mixed in."""
    num_slots = draw(st.integers(1, 70))
    num_tokens = draw(st.integers(0, 300))
    if draw(st.booleans()):
        slots = draw(st.lists(st.integers(-1, num_slots - 1), min_size=num_tokens, max_size=num_tokens))
    else:
        slots = []
        while len(slots) < num_tokens:
            slots += [draw(st.integers(-1, num_slots - 1))] * draw(st.integers(1, 80))
        slots = slots[:num_tokens]
    block_m = draw(st.sampled_from(BLOCK_M_CHOICES))
    return torch.tensor(slots, dtype=torch.int32, device=DEVICE), num_slots, block_m


@settings(max_examples=60, deadline=None)
@given(batches())
def test_the_one_launch_plan_equals_the_torch_plan(batch):
    token_slot, num_slots, block_m = batch
    got = plan_kernel.build_segment_tiles(token_slot, num_slots, block_m)
    want = build_segment_tiles(token_slot, num_slots, block_m)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f"{f}: {getattr(got, f)} != {getattr(want, f)}"
    assert got.block_m == want.block_m


def test_the_planner_rewrites_the_same_buffers_every_step():
    planner = plan_kernel.SegmentPlanner(16, DEVICE)
    g = torch.Generator().manual_seed(5)
    first = None
    for _ in range(4):
        slots = torch.randint(-1, 6, (90,), generator=g, dtype=torch.int32).to(DEVICE)
        plan = planner.plan(slots, 6)
        ptrs = [getattr(plan.segments, f).data_ptr() for f in FIELDS]
        first = first or ptrs
        assert ptrs == first, "a step's plan moved to new buffers"
        want = build_segment_tiles(slots, 6, 16)
        for f in FIELDS:
            assert torch.equal(getattr(plan.segments, f), getattr(want, f)), f
    assert plan.path == "segment" and plan.num_tokens == 90 and plan.num_slots == 6


def test_plan_batch_builds_the_same_plan_with_either_builder():
    slots = torch.tensor([3, 3, -1, 0, 0, 0, 2, -1, 3] * 20, dtype=torch.int32, device=DEVICE)
    a = plan_batch(slots, 4, path="segment", block_m=32, builder="triton")
    b = plan_batch(slots, 4, path="segment", block_m=32, builder="torch")
    for f in FIELDS:
        assert torch.equal(getattr(a.segments, f), getattr(b.segments, f)), f
    with pytest.raises(ValueError, match="builder must be"):
        plan_batch(slots, 4, path="segment", builder="numpy")


# Under the interpreter on a CPU; beside a TP-2 engine test on CI's other worker (two engine
# processes bound to both CPUs) it took 150 s plus 68 s of teardown (2026-12-07), alone < 30 s.
@pytest.mark.timeout(300)
def test_kernels_on_the_one_launch_plan_match_the_reference():
    g = torch.Generator().manual_seed(11)
    p = pack_adapters(
        [random_adapter(r, 64, (48, 32), g) for r in (4, 16, 9)], dtype=torch.float16, generator=g, device=DEVICE
    )
    slots = torch.tensor([2] * 20 + [-1] * 5 + [0] * 17 + [1] * 30, dtype=torch.int32, device=DEVICE)
    x = torch.randn(slots.shape[0], 64, generator=g).half().to(DEVICE)
    base = torch.randn(slots.shape[0], 80, generator=g).half().to(DEVICE)
    plan = plan_kernel.SegmentPlanner(16, DEVICE).plan(slots, 3)
    out = lora_ops.lora_apply(x, base.clone(), p.arena, p.tables, LoraStep(slots, plan), p.slice_offsets, p.slice_sizes)
    want = reference.lora_apply(x, base.clone(), p.arena, p.tables, LoraStep(slots), p.slice_offsets, p.slice_sizes)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=1e-2)
    assert torch.equal(out[20:25], base[20:25]), "base-only tokens changed"


def test_wrong_buffers_and_too_many_slots_are_refused():
    slots = torch.zeros(40, dtype=torch.int32, device=DEVICE)
    tiles = plan_kernel.empty_tiles(40, 3, 16, DEVICE)
    with pytest.raises(ValueError, match="plan buffers of"):
        plan_kernel.build_segment_tiles_into(slots[:30], 3, tiles)
    with pytest.raises(ValueError, match="int32"):
        plan_kernel.build_segment_tiles_into(slots.long(), 3, tiles)
    with pytest.raises(ValueError, match="up to 4095 slots"):
        plan_kernel.build_segment_tiles(slots, 5000, 16)
