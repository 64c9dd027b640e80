"""Which implementation serves a LoRA launch, chosen from where the arena lives: the Triton
kernels (``lora_ops``) for an arena on a GPU, the torch path (``reference``: fp32
accumulation, right in float32, float16 and bfloat16) for one on the CPU.

This module owns that choice and says it once per process in the log; engines call
``lora_apply`` here (``LoRALinear`` does) and never need TRITON_INTERPRET. Triton is imported
only when the Triton backend is chosen.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import torch

from . import reference
from .batch_plan import PathChoice
from .devices import same_device
from .records import LoraStep, LoraTables

log = logging.getLogger(__name__)

Backend = Literal["triton", "torch"]
BackendChoice = Literal["auto", "triton", "torch"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Devices whose choice has been logged in this process.
_announced: set[str] = set()


def triton_interpreted() -> bool:
    """True when the Triton kernels load as interpreter objects (TRITON_INTERPRET=1 was set
    before triton was first imported). Imports triton."""
    from . import lora_ops

    return lora_ops.INTERPRETED


def choose_backend(device: torch.device | str, backend: BackendChoice = "auto") -> Backend:
    """The implementation for an arena on ``device``.

    "auto" is "triton" on a CUDA device and "torch" anywhere else (no GPU: Triton has no
    driver there, and its interpreter is slow); the first "torch" choice for a device type is
    logged once. "triton" on a CPU needs Triton's interpreter; "torch" runs anywhere.

    Raises:
        ValueError: an unknown backend, or "triton" for a CPU arena without the interpreter.
    """
    device = torch.device(device)
    if backend == "auto":
        chosen: Backend = "triton" if device.type == "cuda" else "torch"
    elif backend in ("triton", "torch"):
        chosen = backend
    else:
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if chosen == "triton" and device.type != "cuda" and not triton_interpreted():
        raise ValueError(
            f"the Triton LoRA kernels cannot run on {device} tensors: Triton has no driver for it. Use "
            "backend='torch' (what 'auto' picks without a GPU), or set TRITON_INTERPRET=1 before "
            "triton is first imported to run the kernels in Triton's interpreter"
        )
    if chosen == "torch" and device.type not in _announced:
        _announced.add(device.type)
        log.info(
            "multi-LoRA: the adapters' arena is on %s, not a GPU, so adapter deltas run on the torch "
            "path (memory_broker.kernels.reference, fp32 accumulation), not the Triton kernels",
            device.type,
        )
    return chosen


def _check_tables(arena, tables: LoraTables) -> tuple[int, int]:
    """The arena's and the offset tables' shapes and dtypes (``_check_torch_args``): the
    tables' (num_slots, num_slices)."""
    a_offsets, b_offsets, ranks, scalings = tables
    if arena.dim() != 1:
        raise ValueError(f"arena must be a 1-D tensor, got shape {tuple(arena.shape)}")
    if arena.dtype not in DTYPES:
        raise ValueError(f"arena dtype must be float16, bfloat16 or float32, got {arena.dtype}")
    if a_offsets.dim() != 3 or a_offsets.dtype != torch.int64 or a_offsets.shape != b_offsets.shape:
        raise ValueError(
            f"a_offsets and b_offsets must be int64 [num_slots, num_slices, max_rank] of one shape, got "
            f"{a_offsets.dtype} {tuple(a_offsets.shape)} and {b_offsets.dtype} {tuple(b_offsets.shape)}"
        )
    num_slots, num_slices, _ = a_offsets.shape
    if ranks.dtype != torch.int32 or ranks.shape != (num_slots,):
        raise ValueError(f"ranks must be int32 [{num_slots}], got {ranks.dtype} shape {tuple(ranks.shape)}")
    if scalings.dtype != torch.float32 or scalings.shape != (num_slots,):
        raise ValueError(f"scalings must be float32 [{num_slots}], got {scalings.dtype} {tuple(scalings.shape)}")
    return num_slots, num_slices


def _check_torch_args(x, out, arena, tables: LoraTables, step: LoraStep, slice_offsets, slice_sizes):
    # The Triton launchers check their own arguments; the torch path gets the same refusals
    # for what would otherwise fail deep inside an index or silently compute something else.
    num_slots, num_slices = _check_tables(arena, tables)
    a_offsets, b_offsets, ranks, scalings = tables
    token_slot = step.token_slot
    if token_slot.dtype != torch.int32 or token_slot.dim() != 1:
        raise ValueError(f"token_slot must be int32 [T], got {token_slot.dtype} shape {tuple(token_slot.shape)}")
    num_tokens = token_slot.shape[0]
    if x.dim() != 2 or x.shape[0] != num_tokens or x.dtype != arena.dtype:
        raise ValueError(
            f"x must be [T={num_tokens}, K] in the arena's dtype {arena.dtype}, got {x.dtype} {tuple(x.shape)}"
        )
    if out.dim() != 2 or out.shape[0] != num_tokens or not out.is_floating_point():
        raise ValueError(f"out must be a float [T={num_tokens}, N] tensor, got {out.dtype} shape {tuple(out.shape)}")
    if len(slice_offsets) != num_slices or len(slice_sizes) != num_slices:
        raise ValueError(f"need {num_slices} slice offsets and sizes, got {len(slice_offsets)} and {len(slice_sizes)}")
    for j, (first, width) in enumerate(zip(slice_offsets, slice_sizes)):
        if first < 0 or width < 0 or first + width > out.shape[1]:
            raise ValueError(f"slice {j} spans columns [{first}, {first + width}) outside out's {out.shape[1]} columns")
    for t in (x, out, a_offsets, b_offsets, ranks, scalings, token_slot):
        if not same_device(t.device, arena.device):
            raise ValueError(f"all tensors must be on the arena's device {arena.device}, found one on {t.device}")
    if num_slots and num_tokens:
        high = int(token_slot.max())
        if high >= num_slots:
            raise ValueError(f"token_slot names slot {high} but the tables have {num_slots} slots")


def lora_apply(
    x: torch.Tensor,
    out: torch.Tensor,
    arena: torch.Tensor,
    tables: LoraTables,
    step: LoraStep,
    slice_offsets: Sequence[int],
    slice_sizes: Sequence[int],
    *,
    path: PathChoice = "auto",
    row_align: int = 1,
    backend: BackendChoice = "auto",
) -> torch.Tensor:
    """out += LoRA(x) for every token's adapter, on the backend ``choose_backend`` picks.

    The contract is ``lora_ops.lora_apply``'s (see there for the arguments); the step's plan,
    ``path`` and ``row_align`` only steer the Triton kernels. Both backends accumulate in fp32
    and round once to out's dtype; base-only tokens and rank-0 slots are left bit-identical.

    Returns:
        out, updated in place.

    Raises:
        ValueError: arguments that do not fit together, or a backend that cannot run here.
    """
    if choose_backend(arena.device, backend) == "triton":
        from . import lora_ops

        return lora_ops.lora_apply(
            x, out, arena, tables, step, slice_offsets, slice_sizes, path=path, row_align=row_align
        )
    _check_torch_args(x, out, arena, tables, step, slice_offsets, slice_sizes)
    return reference.lora_apply(x, out, arena, tables, step, slice_offsets, slice_sizes)
