"""The choice between the Triton kernels and the torch path: a CPU arena gets the torch path
without anyone setting TRITON_INTERPRET, says so once in the log, and is right in every
adapter dtype; the Triton kernels on CPU tensors without the interpreter are refused with a
message that says what to do (not Triton's "0 active drivers").

What depends on whether triton was imported interpreted runs in a child process with
TRITON_INTERPRET unset (other test modules set it in this one).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from memory_broker.kernels import LoraStep, dispatch, reference
from memory_broker.kernels.testing import pack_adapters, random_adapter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.setattr(dispatch, "_announced", set())


def test_auto_is_triton_on_a_gpu_and_the_torch_path_elsewhere(fresh_log):
    assert dispatch.choose_backend("cuda:0") == "triton"
    assert dispatch.choose_backend("cpu") == "torch"
    assert dispatch.choose_backend("cpu", "torch") == "torch"
    assert dispatch.choose_backend("cuda", "torch") == "torch"


def test_the_torch_choice_is_logged_once_per_device_type(fresh_log, caplog):
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        for _ in range(3):
            dispatch.choose_backend("cpu")
    said = [r.getMessage() for r in caplog.records if r.name == dispatch.__name__]
    assert len(said) == 1, said
    assert "torch path" in said[0] and "cpu" in said[0]


def test_an_unknown_backend_is_refused(fresh_log):
    with pytest.raises(ValueError, match="'auto', 'triton' or 'torch'"):
        dispatch.choose_backend("cpu", "numpy")


def packed(dtype: torch.dtype, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    adapters = [random_adapter(r, 64, [48, 16], g) for r in (4, 16)]
    p = pack_adapters(adapters, dtype=dtype, generator=g, page_elems=1024)
    token_slot = torch.tensor([0] * 5 + [-1] * 3 + [1] * 6 + [0] * 2, dtype=torch.int32)
    x = torch.randn(token_slot.shape[0], 64, generator=g).to(dtype)
    out = torch.randn(token_slot.shape[0], 64, generator=g).to(dtype)
    return p, token_slot, x, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_torch_path_matches_dense_math_rounded_once(dtype, fresh_log):
    p, token_slot, x, base = packed(dtype)
    out = base.clone()
    dispatch.lora_apply(x, out, p.arena, p.tables, LoraStep(token_slot), p.slice_offsets, p.slice_sizes)
    # Dense fp32 math from the arena's own (rounded) rows, rounded once to out's dtype.
    want = base.float().clone()
    for t, slot in enumerate(token_slot.tolist()):
        if slot < 0:
            continue
        r = int(p.ranks[slot])
        for j, (first, width) in enumerate(zip(p.slice_offsets, p.slice_sizes)):
            a = reference.gather_rows(p.arena, p.a_offsets[slot, j, :r], 64)
            bt = reference.gather_rows(p.arena, p.b_offsets[slot, j, :r], width)
            want[t, first : first + width] += float(p.scalings[slot]) * (x[t].float() @ a.T @ bt)
    want = want.to(dtype)
    base_rows = token_slot < 0
    assert torch.equal(out[base_rows], base[base_rows]), "base-only tokens changed"
    ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    diff = (out.float() - want.float()).abs() / want.float().abs().clamp(min=1)
    assert diff.max().item() <= ulp, f"{dtype}: off by {diff.max().item():.3g} relative"
    if dtype != torch.float32:
        # Rounded once to nearest, not truncated: all but a few entries (fp32 sums a hair apart
        # across a rounding boundary) are exactly the dense result; truncation misses ~half.
        assert (out != want).float().mean().item() < 0.05
    assert (out != base)[~base_rows].any(), "no delta was added"


def test_the_torch_path_refuses_mismatched_input_and_changes_nothing(fresh_log):
    p, token_slot, x, base = packed(torch.bfloat16)
    args = (p.arena, p.tables)
    out = base.clone()
    with pytest.raises(ValueError, match="arena's dtype"):
        dispatch.lora_apply(x.float(), out, *args, LoraStep(token_slot), p.slice_offsets, p.slice_sizes)
    with pytest.raises(ValueError, match="slot 7 but the tables have 2"):
        dispatch.lora_apply(x, out, *args, LoraStep(torch.full_like(token_slot, 7)), p.slice_offsets, p.slice_sizes)
    with pytest.raises(ValueError, match="outside out's 64 columns"):
        dispatch.lora_apply(x, out, *args, LoraStep(token_slot), p.slice_offsets, [48, 17])
    assert torch.equal(out, base)


_CHILD = r"""
import json, sys
import torch
from memory_broker.kernels import LoraStep, dispatch
from memory_broker.kernels.testing import pack_adapters, random_adapter
from memory_broker.clients.lora import LoRALinear, LoraContext

g = torch.Generator().manual_seed(0)
p = pack_adapters([random_adapter(8, 32, [24], g)], dtype=torch.bfloat16, generator=g, page_elems=256)
slots = torch.tensor([0, 0, -1, 0], dtype=torch.int32)
x = torch.randn(4, 32, generator=g).to(torch.bfloat16)
out = torch.zeros(4, 24, dtype=torch.bfloat16)
dispatch.lora_apply(x, out, p.arena, p.tables, LoraStep(slots), p.slice_offsets,
                    p.slice_sizes)
report = {"backend": dispatch.choose_backend(p.arena.device), "delta": float(out.float().abs().sum()),
          "triton_loaded": "triton" in sys.modules}
for what, call in (
    ("choose", lambda: dispatch.choose_backend("cpu", "triton")),
    ("kernels", lambda: __import__("memory_broker.kernels.lora_ops", fromlist=["x"]).lora_apply(
        x, out, p.arena, p.tables, LoraStep(slots), p.slice_offsets, p.slice_sizes)),
):
    try:
        call()
        report[what] = None
    except Exception as e:
        report[what] = f"{type(e).__name__}: {e}"
print(json.dumps(report))
"""


def test_without_triton_interpret_a_cpu_arena_runs_the_torch_path_and_triton_is_refused_clearly():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["backend"] == "torch" and report["delta"] > 0
    # The torch path needs no Triton at all.
    assert report["triton_loaded"] is False
    for what in ("choose", "kernels"):
        assert report[what] and report[what].startswith("ValueError"), report
        assert "TRITON_INTERPRET=1" in report[what] and "0 active drivers" not in report[what], report[what]
