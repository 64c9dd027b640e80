#!/usr/bin/env python3
"""Compiles vLLM's copied Triton LoRA kernels (the folder ops/gpu/extract_vllm_lora_ops.py
writes) for an NVIDIA target on a machine without a GPU, with the tile configs vLLM's own
get_lora_op_configs picks for the benchmark's cases, so an incompatibility with the GPU
machine's Triton shows up before the GPU run rather than in it.

It owns nothing but this check: it runs no kernel, checks no number, and never edits the
copied files. Run it under the GPU machine's Triton (3.6), TRITON_INTERPRET unset:

    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 .venv/bin/python ops/gpu/compile_vllm_lora_ops.py [--ops DIR] [--arch 90]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
META_PTRS = {
    n: "*i32" for n in ("token_indices_sorted_by_lora_ids", "num_tokens_per_lora", "lora_token_start_loc", "lora_ids")
}


def _compile(
    fn,
    pointers: dict[str, str],
    floats: set[str],
    constexprs: dict,
    num_warps: int,
    num_stages: int,
    arch: int,
    dtype: str,
) -> int:
    """Compiles ``fn`` (pointer arguments 16-byte aligned, other ints i32) and returns its shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name].replace("DT", dtype)
        else:
            signature[name] = "fp32" if name in floats else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if signature[name].startswith("*")}
    source = ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    return int(compiled.metadata.shared)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=Path, default=REPO / "ops" / "gpu" / "vllm_lora_ops")
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an integer")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_vllm_lora_ops: run with TRITON_INTERPRET unset", file=sys.stderr)
        return 1
    if not (args.ops / "MANIFEST.json").is_file():
        print(
            f"compile_vllm_lora_ops: no extraction in {args.ops} (run ops/gpu/extract_vllm_lora_ops.py)",
            file=sys.stderr,
        )
        return 1
    sys.path.insert(0, str(args.ops))
    sys.path.insert(0, str(REPO / "ops" / "bench"))
    import triton
    from bench_lora_kernels import CASES
    from vllm.lora.ops.triton_ops.lora_expand_op import _lora_expand_kernel
    from vllm.lora.ops.triton_ops.lora_shrink_op import _lora_shrink_kernel
    from vllm.lora.ops.triton_ops.utils import get_lora_op_configs

    for case in CASES:
        # As _lora_shrink / _lora_expand compute them: max_loras is lora_ids' length (slots + 1).
        loras, m, k, r, s = case.num_adapters + 1, case.num_tokens, case.hidden, case.rank, case.num_slices
        c = get_lora_op_configs("shrink", max_loras=loras, batch=m, hidden_size=k, rank=r, num_slices=s)
        e = get_lora_op_configs(
            "expand", max_loras=loras, batch=m, hidden_size=k, rank=r, num_slices=s, add_inputs=True
        )
        for dtype in ("fp16", "bf16"):
            shrink = _compile(
                _lora_shrink_kernel,
                {"input_ptr": "*DT", "lora_ptr": "*u64", "out_ptr": "*fp32", **META_PTRS},
                {"scaling"},
                {
                    "BLOCK_M": c["block_m"],
                    "BLOCK_N": c["block_n"],
                    "BLOCK_K": c["block_k"],
                    "EVEN_K": k % (c["block_k"] * c["split_k"]) == 0,
                    "SPLIT_K": c["split_k"],
                    "GROUP_SIZE_M": c.get("group_size_m", 8),
                    "SLICE_NUM": s,
                    "USE_GDC": False,
                    "launch_pdl": False,
                    "STORE_PARTIALS": False,
                    "PARTIAL_N": 0,
                    "PARTIAL_K": 0,
                },
                c["num_warps"],
                c["num_stages"],
                args.arch,
                dtype,
            )
            expand = _compile(
                _lora_expand_kernel,
                {
                    "input_ptr": "*fp32",
                    "lora_ptr": "*u64",
                    "out_ptr": "*DT",
                    "slice_start_loc": "*u64",
                    "output_hs_ptr": "*i64",
                    **META_PTRS,
                },
                set(),
                {
                    "BLOCK_M": e["block_m"],
                    "BLOCK_N": e["block_n"],
                    "BLOCK_K": e["block_k"],
                    "EVEN_K": r % e["block_k"] == 0,
                    "ADD_INPUTS": True,
                    "CAST_TYPE": True,
                    "SLICE_NUM": s,
                    "SAME_STRIDE": True,
                    "USE_GDC": False,
                    "launch_pdl": False,
                },
                e["num_warps"],
                e["num_stages"],
                args.arch,
                dtype,
            )
            print(
                f"{case.name} {dtype}: shrink block {c['block_m']}x{c['block_n']}x{c['block_k']} split_k {c['split_k']} "
                f"shared {shrink}; expand block {e['block_m']}x{e['block_n']}x{e['block_k']} shared {expand}"
            )
    print(
        f"compiled vLLM's lora_shrink / lora_expand for sm_{args.arch} with triton {triton.__version__} "
        "(PDL off: vLLM uses it only with VLLM_LORA_ENABLE_DUAL_STREAM)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
