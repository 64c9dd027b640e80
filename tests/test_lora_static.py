"""A decode batch a CUDA graph can capture (``clients.lora.StaticLoraBatch``): LoRALinear over
it equals LoRALinear over an ordinary ``LoraBatch`` of the same sequences, step after step, as
adapters come and go, while the tensors the kernels read keep their addresses.

Without a CUDA device the Triton kernels run in Triton's interpreter (the path a graph captures);
with one, a real CUDA graph of the layers is captured once and replayed across the steps.
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
from test_lora_batch import DEVICE, KV, Q, build, linear, pack, tokens  # noqa: E402

from memory_broker.clients.lora import LoraContext, LoRALinear, StaticLoraBatch  # noqa: E402
from memory_broker.clients.step.adapters import AdapterTables  # noqa: E402

# Decode steps of up to 6 sequences; adapters come and go between them.
STEPS = [
    ["a", "b", None, "a"],
    ["c", "c", "b"],
    [None, None],
    ["b", "a", "c", "a", "b", "c"],
    ["a"],
]


@pytest.fixture(scope="module")
def packed():
    return pack("float16")


def layers(context: LoraContext) -> list[LoRALinear]:
    return [
        LoRALinear(linear(Q, seed=3), 0, "q_proj", context=context),
        LoRALinear(linear(KV, seed=4), 0, "k_proj", context=context),
    ]


def want(packed, seqs, num_tokens: int, x: torch.Tensor) -> list[torch.Tensor]:
    """The layers' outputs under an ordinary LoraBatch (the torch path), padding base-only."""
    context = LoraContext()
    padded = list(seqs) + [None] * (num_tokens - len(seqs))
    with torch.no_grad(), context.step(build(packed, padded, [1] * num_tokens, backend="torch")):
        return [layer(x) for layer in layers(context)]


def static(packed, **kw) -> StaticLoraBatch:
    kw.setdefault("backend", "triton")
    return StaticLoraBatch(6, 3, 16, packed.arena, AdapterTables(DEVICE), **kw)


def update(batch: StaticLoraBatch, packed, seqs) -> None:
    ids = list(dict.fromkeys(a for a in seqs if a is not None))
    batch.update(packed.arena, seqs, packed.lease(*ids))


def addresses(batch: StaticLoraBatch) -> list[int]:
    out = [batch.token_slot.data_ptr()]
    for hit in batch._launches.values():
        out += [t.data_ptr() for t in hit[0][1]]
    return out


def test_a_static_batch_follows_each_step_in_the_same_tensors(packed):
    batch = static(packed)
    context = LoraContext()
    mods = layers(context)
    first = None
    for i, seqs in enumerate(STEPS):
        update(batch, packed, seqs)
        x = tokens(6, seed=10 + i)
        with torch.no_grad(), context.step(batch):
            got = [layer(x) for layer in mods]
        first = first or addresses(batch)
        assert addresses(batch) == first, f"step {i}: a tensor moved"
        for g, w in zip(got, want(packed, seqs, 6, x)):
            torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-3)
            assert torch.equal(g[len(seqs) :], w[len(seqs) :]), "padding tokens changed"


def test_a_static_batch_refuses_what_it_cannot_hold(packed):
    batch = static(packed)
    with pytest.raises(ValueError, match="7 sequences do not fit a static batch of 6"):
        update(batch, packed, ["a"] * 7)
    small = StaticLoraBatch(6, 2, 16, packed.arena, AdapterTables(DEVICE), backend="triton")
    with pytest.raises(ValueError, match="uses 3 adapters; the static batch has 2 slots"):
        update(small, packed, ["a", "b", "c"])
    low = StaticLoraBatch(6, 3, 8, packed.arena, AdapterTables(DEVICE), backend="triton")
    low.launches(0, ["k_proj"])
    with pytest.raises(ValueError, match="cannot serve layer 0 k_proj"):
        update(low, packed, ["c"])  # c's k_proj has rank 16
    moved = StaticLoraBatch(6, 3, 16, packed.arena.clone(), AdapterTables(DEVICE), backend="triton")
    with pytest.raises(ValueError, match="not the static batch's"):
        update(moved, packed, ["a"])


@pytest.mark.skipif(not CUDA, reason="CUDA graph capture needs a CUDA device; the test above checks the logic")
def test_a_captured_forward_replays_each_step(packed):
    batch = static(packed)
    context = LoraContext()
    mods = layers(context)
    x = tokens(6, seed=9)
    outs: list[torch.Tensor] = []

    def forward():
        with torch.no_grad(), context.step(batch):
            outs[:] = [layer(x) for layer in mods]

    update(batch, packed, STEPS[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for seqs in STEPS:
        update(batch, packed, seqs)
        graph.replay()
        torch.cuda.synchronize()
        for g, w in zip(outs, want(packed, seqs, 6, x)):
            torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-3)
