"""Batched multi-LoRA kernels over the arena's pages (ARCHITECTURE.md, the kernels), with a torch
reference and a fake-arena builder for tests and benchmarks.

``records`` holds the two records a launch takes (a batch's tables, a step's token slots and
plan), ``lora_ops`` the Triton shrink/expand kernels, ``batch_plan`` the per-step metadata
and path choice, ``plan_kernel`` the segment plan in one Triton launch, ``graph_step`` a
step a CUDA graph can capture (buffers allocated once), ``reference`` the torch reference, ``dispatch`` the choice between them
(``lora_apply`` here: Triton for an arena on a GPU, the torch path on a CPU), ``testing`` the
fake paged arena, and ``compile_check`` compiles the kernels for a GPU target where no GPU is
present. Triton is imported only when a Triton kernel is first used, so the torch path,
``kernels.reference`` and ``kernels.batch_plan`` work without it (and TRITON_INTERPRET can be
set before it loads).
"""

from __future__ import annotations

from typing import Any

from .batch_plan import BatchPlan, SegmentTiles, choose_path, plan_batch
from .dispatch import choose_backend, lora_apply
from .records import LoraStep, LoraTables

# Names served by the Triton module itself (imported on first use).
_KERNEL_NAMES = frozenset({"shrink", "expand", "RANK_BLOCK"})

__all__ = [
    "BatchPlan",
    "LoraStep",
    "LoraTables",
    "SegmentTiles",
    "choose_backend",
    "choose_path",
    "lora_apply",
    "plan_batch",
    *sorted(_KERNEL_NAMES),
]


def __getattr__(name: str) -> Any:
    if name in _KERNEL_NAMES:
        from . import lora_ops

        return getattr(lora_ops, name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
