"""The LoRA kernels compile for a Hopper GPU with the launchers' choices, checked without a GPU.

The interpreter accepts code the compiler rejects (and ignores alignment hints), so this
compiles every variant through Triton's bundled ptxas in a subprocess with TRITON_INTERPRET
unset, and reads the PTX for the vectorised gathers that ``row_align`` exists to allow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
from conftest import run_side_by_side

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_nvidia_backend() -> bool:
    # Looks at files only: importing triton here, before tests/test_kernels.py sets
    # TRITON_INTERPRET, would leave triton's own helpers compiled-only for the interpreter.
    spec = importlib.util.find_spec("triton")
    return spec is not None and any(
        os.path.isdir(os.path.join(p, "backends", "nvidia")) for p in spec.submodule_search_locations or ()
    )


pytestmark = [
    pytest.mark.skipif(not _has_nvidia_backend(), reason="needs Triton with its NVIDIA backend"),
    # A cold Triton cache compiles every variant (84) here: minutes on a shared 2-core machine.
    pytest.mark.timeout(600),
]

_PROGRAM = """
import json, sys
from memory_broker.kernels import plan_kernel
from memory_broker.kernels.compile_check import compile_all
align = int(sys.argv[1])
slots = (8,) if align == 1 else (64, plan_kernel.MAX_PLAN_SLOTS)
print(json.dumps([
    {"kernel": v.kernel, "dtype": v.dtype, "row_align": v.constexprs.get("ROW_ALIGN"),
     "forms": sorted(v.global_access_forms()), "block_m": v.constexprs.get("BLOCK_M"),
     "split_k": v.constexprs.get("SPLIT_K", 1),
     "slice_block": v.constexprs.get("SLICE_BLOCK", 1), "fuse": v.constexprs.get("FUSE_SLICES", False),
     "shared": v.shared, "fits": v.fits(90)}
    for v in compile_all(90, aligns=(align,), plan_slots=slots)
]))
"""


@pytest.fixture(scope="module")
def variants() -> list[dict]:
    # Two processes, one row alignment and some of the plans' slot counts each (about half
    # the time each): ptxas runs on one core, and with a cold cache all of them took 186 s in
    # one process on the 2-core VM.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = [
        (f"compiling the kernels for sm_90 (row alignment {a})", [sys.executable, "-c", _PROGRAM, str(a)], env)
        for a in (1, 8)
    ]
    out: list[dict] = []
    for stdout in run_side_by_side(jobs, 540):
        out += json.loads(stdout.strip().splitlines()[-1])
    return out


def test_every_kernel_variant_compiles_for_hopper(variants: list[dict]):
    kernels = {v["kernel"] for v in variants}
    assert kernels == {
        "_shrink_token_kernel",
        "_expand_token_kernel",
        "_shrink_segment_kernel",
        "_expand_segment_kernel",
        "_segment_plan_kernel",
        "_zero_rank_rows_kernel",
    }
    assert {v["split_k"] for v in variants if v["kernel"] == "_shrink_token_kernel"} == {1, 8}
    lora = [v for v in variants if v["kernel"] != "_segment_plan_kernel"]
    assert {v["dtype"] for v in lora} == {"fp16", "bf16", "fp32"}


def test_the_one_launch_plan_compiles_for_every_tile_height_within_shared_memory(variants: list[dict]):
    from memory_broker.kernels.batch_plan import BLOCK_M_CHOICES

    plans = [v for v in variants if v["kernel"] == "_segment_plan_kernel"]
    assert {v["block_m"] for v in plans} == set(BLOCK_M_CHOICES)
    assert all(v["fits"] for v in plans), [(v["block_m"], v["shared"]) for v in plans if not v["fits"]]


@pytest.mark.parametrize("kernel", ["_shrink_token_kernel", "_expand_token_kernel"])
def test_row_align_8_turns_token_path_gathers_into_16_byte_loads(variants: list[dict], kernel: str):
    forms = {
        v["row_align"]: set(v["forms"])
        for v in variants
        if v["kernel"] == kernel
        and v["dtype"] == "fp16"
        and v["split_k"] == 1
        and v["slice_block"] == 1
        and not v["fuse"]
    }
    assert "ld.global.v4.b32" in forms[8], f"{kernel} with row_align=8: {sorted(forms[8])}"
    # Without the promise the gathers are 2-byte loads: the reason row_align exists.
    assert "ld.global.b16" in forms[1], f"{kernel} with row_align=1: {sorted(forms[1])}"


def test_the_slice_fused_token_kernels_compile_with_16_byte_gathers(variants: list[dict]):
    # Several slices per shrink program (SLICE_BLOCK 4: three slices), with and without split-K,
    # and the expand fused over slices, in every dtype; row_align 8 still vectorises the gathers.
    for dtype in ("fp16", "bf16", "fp32"):
        shrink = {
            (v["split_k"], v["row_align"]): v
            for v in variants
            if v["kernel"] == "_shrink_token_kernel" and v["dtype"] == dtype and v["slice_block"] == 4
        }
        assert set(shrink) == {(1, 1), (1, 8), (8, 1), (8, 8)}, f"{dtype}: {sorted(shrink)}"
        expand = {
            v["row_align"]: v
            for v in variants
            if v["kernel"] == "_expand_token_kernel" and v["dtype"] == dtype and v["fuse"]
        }
        assert set(expand) == {1, 8}, f"{dtype}: {sorted(expand)}"
        for v in (shrink[(1, 8)], expand[8]):
            assert "ld.global.v4.b32" in v["forms"], f"{v['kernel']} {dtype} fused: {v['forms']}"
            assert v["fits"]


def test_every_block_size_the_planner_accepts_is_compiled_and_fits_in_shared_memory(variants: list[dict]):
    from memory_broker.kernels.batch_plan import BLOCK_M_CHOICES

    for kernel in ("_shrink_segment_kernel", "_expand_segment_kernel"):
        for dtype in ("fp16", "bf16", "fp32"):
            got = {v["block_m"] for v in variants if v["kernel"] == kernel and v["dtype"] == dtype}
            assert got == set(BLOCK_M_CHOICES), f"{kernel} {dtype}: compiled {sorted(got)}"
    too_big = [(v["kernel"], v["dtype"], v["block_m"], v["shared"]) for v in variants if not v["fits"]]
    assert too_big == [], f"past sm_90's 227 KiB of shared memory: {too_big}"


def test_the_planner_refuses_a_block_size_the_compile_check_does_not_build():
    import torch

    from memory_broker.kernels.batch_plan import build_segment_tiles

    slots = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_m must be one of 16, 32, 64, 128 .* got 256"):
        build_segment_tiles(slots, 1, 256)
    assert build_segment_tiles(slots, 1, 128).block_m == 128
