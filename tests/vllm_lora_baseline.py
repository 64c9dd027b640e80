"""vLLM's own Triton LoRA kernels (lora_shrink / lora_expand) as a baseline for the kernel
benchmark: loading them from the folder ops/gpu/extract_vllm_lora_ops.py writes, and calling
them the way vLLM's PunicaWrapperGPU.add_lora_linear does, with vLLM's LoRAKernelMeta.

It owns only that calling convention (stacked weights, metadata, shrink then expand); the
benchmark (ops/bench/bench_lora_kernels.py, which puts tests/ on sys.path for it) and
tests/test_vllm_lora_baseline.py share it, so it lives here, beside the test. It must not edit
or reimplement vLLM's kernels, and it never imports a real vLLM install: the extracted folder
is the source.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / "ops" / "gpu" / "vllm_lora_ops"


@dataclass
class VllmLoraOps:
    lora_shrink: Any
    lora_expand: Any
    LoRAKernelMeta: Any
    version: str
    folder: Path


@dataclass
class VllmLoraWeights:
    """vLLM's layout of one fused module's adapters: per slice, lora_a_stacked
    [max_loras, 1, max_rank, in] and lora_b_stacked [max_loras, 1, out_j, max_rank], each one
    contiguous tensor (as BaseLinearLayerWithLoRA allocates them), scaling folded into B (as
    LoRALayerWeights.optimize does before vLLM loads an adapter into its slot)."""

    a: tuple[torch.Tensor, ...]
    b: tuple[torch.Tensor, ...]
    output_slices: tuple[int, ...]


def load(folder: Path | str | None = None) -> VllmLoraOps:
    """Imports vllm.lora.ops.triton_ops from ``folder`` (default ops/gpu/vllm_lora_ops).

    Raises:
        FileNotFoundError: the folder holds no extraction (no MANIFEST.json).
        ImportError: another ``vllm`` is already imported, or the import failed.
    """
    folder = Path(folder or DEFAULT_DIR).resolve()
    manifest = folder / "MANIFEST.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"no extracted vLLM LoRA ops in {folder} (run ops/gpu/extract_vllm_lora_ops.py)")
    loaded = sys.modules.get("vllm")
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve().parent != folder / "vllm":
        raise ImportError(f"a different vllm is already imported ({getattr(loaded, '__file__', '?')})")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    ops: ModuleType = importlib.import_module("vllm.lora.ops.triton_ops")
    where = Path(ops.__file__).resolve()
    if folder not in where.parents:
        raise ImportError(f"vllm.lora.ops.triton_ops came from {where}, not from {folder}")
    version = json.loads(manifest.read_text()).get("vllm_version", "unknown")
    return VllmLoraOps(ops.lora_shrink, ops.lora_expand, ops.LoRAKernelMeta, version, folder)


def stack_weights(adapters: Sequence[Any], dtype: torch.dtype, device: torch.device | str) -> VllmLoraWeights:
    """Slot i holds adapters[i] (kernels.testing.LoraWeights: a[j] [r, in], b[j] [out_j, r],
    scaling); ranks below the largest are zero-padded, as vLLM pads to max_lora_rank."""
    num_slots, num_slices = len(adapters), len(adapters[0].a)
    max_rank = max(ad.rank for ad in adapters)
    hidden = adapters[0].a[0].shape[1]
    outs = tuple(bj.shape[0] for bj in adapters[0].b)
    a = [torch.zeros(num_slots, 1, max_rank, hidden, dtype=torch.float32) for _ in range(num_slices)]
    b = [torch.zeros(num_slots, 1, n, max_rank, dtype=torch.float32) for n in outs]
    for s, ad in enumerate(adapters):
        for j in range(num_slices):
            a[j][s, 0, : ad.rank] = ad.a[j]
            b[j][s, 0, :, : ad.rank] = ad.b[j] * ad.scaling
    return VllmLoraWeights(
        a=tuple(t.to(dtype).to(device).contiguous() for t in a),
        b=tuple(t.to(dtype).to(device).contiguous() for t in b),
        output_slices=outs,
    )


def make_metadata(ops: VllmLoraOps, token_slots: torch.Tensor, max_loras: int, device: torch.device | str) -> Any:
    """vLLM's LoRAKernelMeta for one step, as PunicaWrapperGPU builds it: sized for max_loras
    and the batch, filled by prepare_tensors from the token -> slot mapping (-1: no LoRA)."""
    meta = ops.LoRAKernelMeta.make(max_loras, token_slots.shape[0], device=device)
    meta.prepare_tensors(token_slots.to(device))
    return meta


def lora_apply(ops: VllmLoraOps, x: torch.Tensor, out: torch.Tensor, w: VllmLoraWeights, meta: Any) -> None:
    """out += LoRA(x), as PunicaWrapperGPU.add_lora_linear with scale 1.0 (vLLM's linear layers
    pass 1.0: the scaling is in B): an fp32 buffer, lora_shrink into it, lora_expand adding
    into out. Default LoRA config: specialize_active_lora off, so the grid covers max_loras + 1."""
    num_tokens = x.shape[0]
    buffer = torch.empty((len(w.output_slices), num_tokens, w.b[0].shape[-1]), dtype=torch.float32, device=x.device)
    args = meta.meta_args(num_tokens, False)
    ops.lora_shrink(x, w.a, buffer, *args, 1.0)
    ops.lora_expand(buffer, w.b, out, *args, offset_start=0, add_inputs=True)
