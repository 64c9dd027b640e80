"""Compiles every LoRA kernel variant the launchers can pick, for an NVIDIA target, on a machine
without a GPU (Triton's bundled ptxas), so CPU-only CI catches code that runs in the
interpreter but does not compile.

It mirrors the launchers' choices (every block size the planner accepts, ``BLOCK_M_CHOICES``;
warps; specialisation of 16-divisible ints and of unit strides) through ``lora_ops``'s own
constants, and reports each variant's shared memory against the architecture's limit (Triton
checks that only at launch). It runs nothing and checks no numbers. The GPU machines run
Triton 3.6; ``ASTSource``'s signature/constexprs/attrs forms used here are the 3.3+ ones.
Run it with TRITON_INTERPRET unset: ``python -m kernels.compile_check [--arch 90]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

# Integer arguments a real launch passes divisible by 16 (hidden sizes, strides, slice
# offsets), which Triton specialises on; the compiled code then assumes that alignment.
_DIVISIBLE_INTS = frozenset(
    {
        "K",
        "OFF0",
        "OFF1",
        "OFF2",
        "N0",
        "N1",
        "N2",
        "stride_xt",
        "stride_yj",
        "stride_yt",
        "stride_ot",
        "stride_as",
        "stride_aj",
        "stride_bs",
        "stride_bj",
        "K_PER_SPLIT",
    }
)
_TRITON_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Per-block shared memory a kernel may opt into (CUDA programming guide, compute capabilities):
# Triton checks ``metadata.shared`` against the device's at launch, so a too-big tile compiles
# here and fails only on the GPU.
MAX_SHARED_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclass(frozen=True, slots=True)
class CompiledVariant:
    """One kernel compiled with one set of launch choices."""

    # Kernel function name.
    kernel: str
    # "fp16", "bf16" or "fp32" (the arena's and x's dtype).
    dtype: str
    # Launch constexprs, for messages.
    constexprs: dict
    # The kernel's PTX.
    ptx: str
    # Shared memory the launch needs, in bytes (Triton refuses a launch past the device's limit).
    shared: int = 0
    num_warps: int = 4

    def fits(self, arch: int) -> bool:
        """Whether the shared memory fits the architecture's per-block opt-in maximum."""
        return self.shared <= MAX_SHARED_BYTES.get(arch, MAX_SHARED_BYTES[80])

    def global_access_forms(self) -> set[str]:
        """The ld.global / st.global instruction forms in the PTX (v4 means 16-byte accesses)."""
        return {w for line in self.ptx.splitlines() for w in line.split() if w.startswith(("ld.global", "st.global"))}


def _compile(fn, pointer_types: dict[str, str], constexprs: dict, num_warps: int, arch: int, dtype: str):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointer_types.get(name, "i32").replace("DT", dtype)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(names)
        if signature[name] != "constexpr" and (signature[name].startswith("*") or name in _DIVISIBLE_INTS)
    }
    source = ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return CompiledVariant(
        kernel=fn.__name__,
        dtype=dtype,
        constexprs=dict(constexprs),
        ptx=compiled.asm["ptx"],
        shared=int(compiled.metadata.shared),
        num_warps=num_warps,
    )


# Pointer arguments of each kernel family (DT: the dtype being compiled).
_SHRINK_PTRS = {"x_ptr": "*DT", "arena_ptr": "*DT", "a_off_ptr": "*i64", "ranks_ptr": "*i32", "y_ptr": "*fp32"}
_EXPAND_PTRS = {
    "y_ptr": "*fp32",
    "arena_ptr": "*DT",
    "b_off_ptr": "*i64",
    "ranks_ptr": "*i32",
    "scalings_ptr": "*fp32",
    "out_ptr": "*DT",
}
_TILES = {"order_ptr": "*i32", "tile_slot_ptr": "*i32", "tile_start_ptr": "*i32", "tile_end_ptr": "*i32"}


def _token_variants(L, align: int, arch: int, dt: str) -> list[CompiledVariant]:
    """The per-token shrink (whole K, and split over K with atomic adds; one slice per program,
    and every slice of three in one program) and expand (per slice, and fused over slices)
    kernels at one row alignment, and the zeroing a split shrink runs first."""
    shrink = [
        _compile(
            L._shrink_token_kernel,
            {**_SHRINK_PTRS, "token_slot_ptr": "*i32"},
            {
                "ROW_ALIGN": align,
                "BLOCK_R": L.RANK_BLOCK,
                "BLOCK_K": L.TOKEN_SHRINK_BLOCK_K,
                "SPLIT_K": split_k,
                "SLICE_BLOCK": slice_block,
                "stride_xk": 1,
            },
            4,
            arch,
            dt,
        )
        for split_k in (1, 8)
        for slice_block in (1, 4)
    ]
    zero = _compile(
        L._zero_rank_rows_kernel,
        {"token_slot_ptr": "*i32", "ranks_ptr": "*i32", "y_ptr": "*fp32"},
        {"BLOCK_R": L.RANK_BLOCK},
        4,
        arch,
        dt,
    )
    expand = [
        _compile(
            L._expand_token_kernel,
            {**_EXPAND_PTRS, "token_slot_ptr": "*i32"},
            {
                "ROW_ALIGN": align,
                "BLOCK_R": L.RANK_BLOCK,
                "BLOCK_N": L.TOKEN_EXPAND_BLOCK_N,
                "FUSE_SLICES": fuse,
                "stride_on": 1,
            },
            4,
            arch,
            dt,
        )
        for fuse in (False, True)
    ]
    return [*shrink, zero, *expand]


def _segment_variants(L, align: int, block_m: int, precision, arch: int, dt: str) -> list[CompiledVariant]:
    """The segment shrink kernels (one per slice count and rank bound) and the segment expand
    kernel at one row alignment and segment block height."""
    out = []
    for num_slices, max_rank in ((3, 16), (3, 128)):
        block_n = L.segment_shrink_block_n(num_slices, max_rank)
        out.append(
            _compile(
                L._shrink_segment_kernel,
                {**_SHRINK_PTRS, **_TILES},
                {
                    "ROW_ALIGN": align,
                    "DOT_PRECISION": precision,
                    "BLOCK_M": block_m,
                    "BLOCK_N": block_n,
                    "BLOCK_K": L.SEGMENT_SHRINK_BLOCK_K,
                    "stride_xk": 1,
                },
                L.segment_shrink_warps(block_m, block_n),
                arch,
                dt,
            )
        )
    out.append(
        _compile(
            L._expand_segment_kernel,
            {**_EXPAND_PTRS, **_TILES},
            {
                "ROW_ALIGN": align,
                "DOT_PRECISION": precision,
                "BLOCK_M": block_m,
                "BLOCK_N": L.SEGMENT_EXPAND_BLOCK_N,
                "BLOCK_R": L.RANK_BLOCK,
                "stride_on": 1,
            },
            L.segment_expand_warps(block_m),
            arch,
            dt,
        )
    )
    return out


def _plan_variants(arch: int, slots=None) -> list[CompiledVariant]:
    """The one-launch segment plan at every tile height, for few, some and the most slots
    (``slots``: those of them, None: all)."""
    from . import plan_kernel as P
    from .batch_plan import BLOCK_M_CHOICES

    ptrs = {n: "*i32" for n in ("token_slot_ptr", "order_ptr", "tile_slot_ptr", "tile_start_ptr", "tile_end_ptr")}
    out = []
    for num_slots in (8, 64, P.MAX_PLAN_SLOTS) if slots is None else slots:
        keys, block_t = P._launch_shape(num_slots)
        for block_m in BLOCK_M_CHOICES:
            constexprs = {"BLOCK_M": block_m, "BLOCK_T": block_t, "KEYS": keys}
            out.append(_compile(P._segment_plan_kernel, ptrs, constexprs, 4, arch, "i32"))
    return out


def compile_all(
    arch: int = 90, dtypes=(torch.float16, torch.bfloat16, torch.float32), aligns=(1, 8), plan_slots=None
) -> list[CompiledVariant]:
    """Compiles each kernel for each dtype, row alignment (``aligns``: 1, 8) and segment block
    shape used, and the one-launch segment plan (``plan_kernel``, dtype "i32") at each tile
    height for each slot count of ``plan_slots`` (None: every one it is launched with). Parts
    (some ``aligns``, some ``plan_slots``) may compile in processes side by side: ptxas runs
    on one core.

    Raises:
        RuntimeError: TRITON_INTERPRET is set (the kernels are then interpreter objects).
    """
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_check needs the compiled kernels: run it with TRITON_INTERPRET unset")
    from . import lora_ops as L
    from .batch_plan import BLOCK_M_CHOICES

    out = []
    for torch_dtype in dtypes:
        dt = _TRITON_DTYPES[torch_dtype]
        precision = L.dot_precision(torch_dtype)
        for align in aligns:
            out += _token_variants(L, align, arch, dt)
            for block_m in BLOCK_M_CHOICES:
                out += _segment_variants(L, align, block_m, precision, arch, dt)
    return out + _plan_variants(arch, plan_slots)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an integer, e.g. 80 or 90")
    args = ap.parse_args()
    variants = compile_all(args.arch)
    too_big = [v for v in variants if not v.fits(args.arch)]
    for v in variants:
        forms = " ".join(sorted(v.global_access_forms()))
        shape = " ".join(
            f"{k}={v.constexprs[k]}" for k in ("SPLIT_K", "SLICE_BLOCK", "FUSE_SLICES") if k in v.constexprs
        )
        print(
            f"{v.kernel:24} {v.dtype} {v.constexprs.get('ROW_ALIGN')} {v.constexprs.get('BLOCK_M', '-'):>3} "
            f"warps {v.num_warps} shared {v.shared}{' ' + shape if shape else ''}: {forms}"
        )
    import triton

    print(f"compiled {len(variants)} kernel variants for sm_{args.arch} with triton {triton.__version__}")
    for v in too_big:
        print(f"TOO BIG: {v.kernel} {v.dtype} {v.constexprs}: {v.shared} bytes of shared memory", file=sys.stderr)
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main())
