#!/usr/bin/env python3
"""Batched multi-LoRA kernels (kernels/) against three baselines, on one CUDA device.

Two batches, each fused q/k/v (3 slices) over hidden 4096: decode (64 tokens of 64 distinct
rank-16 adapters) and prefill (8192 tokens in runs of 8 adapters), each in fp16 and bf16.
Methods:

  kernels auto / token / segment   lora_apply over a paged arena (2 MiB pages, rows shuffled);
                                   "token split-K N" splits the shrink over N parts of the
                                   hidden dimension (--split-k, default 8); "token slices per
                                   program" runs every slice of a token in one shrink program,
                                   "token expand fused" fuses the expand over slices, "token
                                   fused" both (with split-K too): the rows that decide whether
                                   the token path (the decode row's path) turns them on
  torch per-adapter GEMMs          a loop over adapters: index_select, x @ Aᵀ, y @ Bᵀ, index_add_
  stacked slots, padded            the same kernels over contiguous [slots, max_rank, hidden]
                                   buffers with every rank set to --stacked-rank (the padded
                                   rows computed, as fixed-slot engines do)
  vLLM Triton lora_shrink+expand   vLLM's own kernels (copied out of a vLLM install by
                                   ops/gpu/extract_vllm_lora_ops.py, never committed), called
                                   as vLLM's PunicaWrapperGPU.add_lora_linear calls them, over
                                   vLLM's contiguous stacked [slots, 1, rank, hidden] weights
                                   holding the same adapters (tests/vllm_lora_baseline.py)

Before a method is timed its output is checked against the fp32 reference (kernels/reference.py)
on the same base, with the kernel tests' tolerance; a project kernel off the reference makes
the exit status 1, a vLLM row off it is left out (said so, loudly). The last lines give, per
case and dtype, the time of the project's best kernels row over vLLM's.

The decode case also runs a whole decode step, --layers x --modules launches (32 x 4 by
default) each over its own copy of the adapters: the plan and every shrink/expand pair eagerly,
and the same step captured once in a CUDA graph (kernels/graph_step.StaticStep) and replayed;
vLLM's ops are driven the same way (prepare_tensors, then the pairs) beside them. The segment
plan's rows give its device time and its host wall time (calls issued back to back, no sync)
for the torch-op builder and the one-launch kernel (kernels/plan_kernel.py).

Times are medians of CUDA-event timings of single calls, L2 flushed before each. Bandwidth is
the batch's compulsory traffic (x, the adapters' rows once, y, out read and written) over the
time, shown as a share of a large device-to-device copy measured in the same run. The plan
(token sort and tiles; vLLM's LoRAKernelMeta) is built once per step and timed on its own row.

    python ops/bench/bench_lora_kernels.py [--reps 50] [--stacked-rank 64] [--dtypes float16,bfloat16]
        [--cases decode,prefill] [--layers 32] [--modules 4] [--vllm-ops ops/gpu/vllm_lora_ops]

Without a CUDA device it prints one line and exits 0: there is nothing honest to report.
Without the extracted vLLM folder it prints one line and runs without vLLM's rows.

``--cpu-dry-run`` (with TRITON_INTERPRET=1) runs the logic without a GPU: tiny cases on the CPU
in Triton's interpreter, every check real, each timed call run once and given 0.5 ms, so no
figure means anything (tests/test_benchmarks.py and tests/test_vllm_lora_baseline.py run it).
``--tokens decode=3,prefill=8`` sets a case's token count; ``--vllm-wrong-map`` gives vLLM the
token -> slot map rolled by one, to show that its check catches a wrong map.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

# A name rather than a literal so a CPU dry run of the logic (not of the timings) can swap it.
DEVICE = "cuda"
PAGE_BYTES = 2 << 20
L2_FLUSH_BYTES = 256 << 20


@dataclass(frozen=True)
class Case:
    name: str
    num_tokens: int
    num_adapters: int
    rank: int
    hidden: int
    num_slices: int
    # "decode": one token per adapter, shuffled; "prefill": one run of tokens per adapter.
    layout: str


CASES = [
    Case("decode", 64, 64, 16, 4096, 3, "decode"),
    Case("prefill", 8192, 8, 16, 4096, 3, "prefill"),
]


def median_ms(fn: Callable[[], object], reps: int, warmup: int) -> float:
    """Median of single-call CUDA-event timings, with L2 flushed before each call."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def copy_bandwidth(reps: int) -> float:
    """Bytes per second of a 1 GiB device-to-device copy, read plus write."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps, warmup=3)
    return 2 * n / (ms / 1e3)


def compulsory_bytes(case: Case, elem: int) -> int:
    """Traffic no implementation can avoid: x, each adapter's rows once, y (fp32, written and
    read), and the base output read and written."""
    t, h, r, j = case.num_tokens, case.hidden, case.rank, case.num_slices
    weights = case.num_adapters * j * r * (h + h) * elem
    x = t * h * elem
    y = 2 * j * t * r * 4
    out = 2 * t * j * h * elem
    return weights + x + y + out


def token_slots(case: Case, g: torch.Generator) -> torch.Tensor:
    if case.layout == "decode":
        slots = torch.arange(case.num_tokens) % case.num_adapters
        slots = slots[torch.randperm(case.num_tokens, generator=g)]
    else:
        slots = torch.arange(case.num_tokens) * case.num_adapters // case.num_tokens
    return slots.to(torch.int32)


def stacked_tables(adapters, hidden: int, stacked_rank: int, dtype: torch.dtype):
    """Contiguous [slots, slices, stacked_rank, hidden] buffers for A and Bᵀ in one arena,
    zero past each adapter's rank, and tables that claim every slot has stacked_rank rows."""
    num_slots, num_slices = len(adapters), len(adapters[0].a)
    a_stack = torch.zeros(num_slots, num_slices, stacked_rank, hidden, dtype=dtype)
    b_stack = torch.zeros_like(a_stack)
    for s, ad in enumerate(adapters):
        for j in range(num_slices):
            a_stack[s, j, : ad.rank] = ad.a[j].to(dtype)
            b_stack[s, j, : ad.rank] = ad.b[j].T.to(dtype)
    arena = torch.cat([a_stack.flatten(), b_stack.flatten()]).to(DEVICE)
    shape = (num_slots, num_slices, stacked_rank)
    rows = torch.arange(num_slots * num_slices * stacked_rank, dtype=torch.int64).view(shape)
    a_offsets = (rows * hidden).to(DEVICE)
    b_offsets = (a_stack.numel() + rows * hidden).to(DEVICE)
    ranks = torch.full((num_slots,), stacked_rank, dtype=torch.int32, device=DEVICE)
    scalings = torch.tensor([ad.scaling for ad in adapters], dtype=torch.float32, device=DEVICE)
    return arena, a_offsets, b_offsets, ranks, scalings


# Relative to the output's magnitude, as tests/test_kernels.py: fp16 keeps ~3 decimal digits, bf16 ~2.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
Row = tuple[str, str, str, float, float, float]  # case, dtype, method, us, GB/s, % copy


def check(what: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    """Prints one line: the largest difference from the fp32 reference and whether it is
    within the kernel tests' tolerance."""
    err = (actual.float() - expected.float()).abs().max().item()
    scale = max(1.0, expected.float().abs().max().item())
    ok = err <= TOLERANCE[dtype] * scale and err == err
    verdict = "ok" if ok else "MISMATCH"
    print(f"{what}: max |out - fp32 reference| = {err:.3g} (tolerance {TOLERANCE[dtype] * scale:.3g}): {verdict}")
    return ok


def kernel_variants(split_k: int) -> list[tuple[str, int, bool, bool]]:
    """The project kernels' rows: (path, split-K, every slice in one shrink program, the expand
    fused over slices). Each token-path shape beside the default one, so the GPU decides."""
    return [
        ("auto", 1, False, False),
        ("token", 1, False, False),
        ("token", split_k, False, False),
        ("token", 1, True, False),
        ("token", 1, False, True),
        ("token", 1, True, True),
        ("token", split_k, True, True),
        ("segment", 1, False, False),
    ]


def run_case(case: Case, args, copy_bw: float, rows: list[Row], dtype: torch.dtype, vllm=None) -> bool:
    """Times every method on one case in one dtype; returns False when a project kernel's output
    is off the reference. ``vllm`` (tests/vllm_lora_baseline.VllmLoraOps) adds vLLM's rows."""
    from memory_broker.kernels import lora_ops, reference
    from memory_broker.kernels.batch_plan import plan_batch
    from memory_broker.kernels.records import LoraStep, LoraTables
    from memory_broker.kernels.testing import pack_adapters, random_adapter

    dname = str(dtype).removeprefix("torch.")
    g = torch.Generator().manual_seed(args.seed)
    slice_sizes = (case.hidden,) * case.num_slices
    adapters = [random_adapter(case.rank, case.hidden, slice_sizes, g) for _ in range(case.num_adapters)]
    elem = torch.tensor([], dtype=dtype).element_size()
    packed = pack_adapters(
        adapters, dtype=dtype, generator=g, device=DEVICE, page_elems=PAGE_BYTES // elem, row_align=8, spare_pages=4
    )
    slots = token_slots(case, g).to(DEVICE)
    x = torch.randn(case.num_tokens, case.hidden, generator=g).to(dtype).to(DEVICE)
    out = torch.randn(case.num_tokens, sum(slice_sizes), generator=g).to(dtype).to(DEVICE)
    y = torch.empty(case.num_slices, case.num_tokens, packed.a_offsets.shape[2], device=DEVICE)
    nbytes = compulsory_bytes(case, x.element_size())
    p = packed
    label = f"{case.name} {dname}"

    def record(method: str, ms: float) -> None:
        bw = nbytes / (ms / 1e3)
        rows.append((case.name, dname, method, ms * 1e3, bw / 1e9, 100 * bw / copy_bw))

    # The fp32 reference (kernels/reference.py) on the same base; every check compares to it.
    base = out.clone()
    expected = reference.lora_apply(x, base.clone(), p.arena, p.tables, LoraStep(slots), p.slice_offsets, p.slice_sizes)

    ok = True
    for path, split_k, fuse_shrink, fuse_expand in kernel_variants(args.split_k):
        plan = plan_batch(
            slots,
            case.num_adapters,
            path=path,
            active_slots=case.num_adapters,
            split_k=split_k,
            fuse_shrink_slices=fuse_shrink,
            fuse_expand_slices=fuse_expand,
        )

        def ours(plan=plan):
            lora_ops.lora_apply(
                x, out, p.arena, p.tables, LoraStep(slots, plan), p.slice_offsets, p.slice_sizes, y=y, row_align=8
            )

        method = f"kernels {path}" + (f" ({plan.path})" if path == "auto" else "")
        method += {(True, False): " slices per program", (False, True): " expand fused", (True, True): " fused"}.get(
            (fuse_shrink, fuse_expand), ""
        )
        method += f" split-K {split_k}" if split_k > 1 else ""
        out.copy_(base)
        ours()
        ok &= check(f"{label}: {method}", out, expected, dtype)
        record(method, median_ms(ours, args.reps, args.warmup))

    plan_rows(case, dname, slots, args, rows)
    if case.layout == "decode" and args.layers * args.modules > 0:
        ok &= model_step_rows(case, args, dtype, p, slots, x, (expected, base), rows, label)

    # Baseline 1: a GEMM pair per adapter on contiguous weights. Token indices per adapter
    # are computed once outside the timing (a favour to the baseline).
    dense = []
    for s, ad in enumerate(adapters):
        idx = torch.nonzero(slots == s).flatten()
        a_cat = torch.cat([aj for aj in ad.a]).to(dtype).to(DEVICE)  # [slices * r, hidden]
        bts = [bj.T.contiguous().to(dtype).to(DEVICE) for bj in ad.b]  # [r, out_j]
        dense.append((idx, a_cat, bts, ad.scaling, ad.rank))

    def torch_loop():
        for idx, a_cat, bts, scaling, r in dense:
            yi = x.index_select(0, idx) @ a_cat.T
            for j, (bt, first) in enumerate(zip(bts, p.slice_offsets)):
                out[:, first : first + bt.shape[1]].index_add_(0, idx, yi[:, j * r : (j + 1) * r] @ bt, alpha=scaling)

    out.copy_(base)
    torch_loop()
    check(f"{label}: torch per-adapter GEMMs", out, expected, dtype)
    record("torch per-adapter GEMMs", median_ms(torch_loop, args.reps, args.warmup))

    # Baseline 2: fixed slots padded to a max rank, contiguous, padded rows computed.
    sa, sa_off, sb_off, s_ranks, s_scal = stacked_tables(adapters, case.hidden, args.stacked_rank, dtype)
    s_y = torch.empty(case.num_slices, case.num_tokens, args.stacked_rank, device=DEVICE)
    s_plan = plan_batch(slots, case.num_adapters, active_slots=case.num_adapters)
    s_tables = LoraTables(sa_off, sb_off, s_ranks, s_scal)

    def stacked():
        lora_ops.lora_apply(
            x, out, sa, s_tables, LoraStep(slots, s_plan), p.slice_offsets, p.slice_sizes, y=s_y, row_align=8
        )

    method = f"stacked slots, padded to rank {args.stacked_rank} ({s_plan.path})"
    out.copy_(base)
    stacked()
    ok &= check(f"{label}: {method}", out, expected, dtype)
    record(method, median_ms(stacked, args.reps, args.warmup))

    # Baseline 3: vLLM's own Triton kernels, called as its punica wrapper calls them, on the
    # same adapters in vLLM's layout (contiguous stacked slots, scaling folded into B).
    if vllm is not None:
        run_vllm(case, args, vllm, adapters, slots, x, out, base, expected, dtype, label, record, rows)
    return ok


def host_us(fn: Callable[[], object], reps: int) -> float:
    """Host wall time per call of ``fn`` issued back to back without waiting for the device
    (what a step's CPU thread spends), in microseconds; the device is drained afterwards."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    spent = time.perf_counter() - start
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return spent / reps * 1e6


def plan_rows(case: Case, dname: str, slots: torch.Tensor, args, rows: list) -> None:
    """The segment plan's host wall time and device time per step, built by torch ops and by
    the one-launch kernel (into a SegmentPlanner's buffers, as a step reuses them)."""
    from memory_broker.kernels.batch_plan import plan_batch
    from memory_broker.kernels.plan_kernel import SegmentPlanner

    planner = SegmentPlanner(64, DEVICE)
    builders = {
        "torch ops": lambda: plan_batch(slots, case.num_adapters, path="segment", builder="torch"),
        "one launch": lambda: planner.plan(slots, case.num_adapters),
    }
    nan = float("nan")
    for name, fn in builders.items():
        rows.append(
            (
                case.name,
                dname,
                f"plan build, segment, {name}: device",
                median_ms(fn, args.reps, args.warmup) * 1e3,
                nan,
                nan,
            )
        )
        rows.append((case.name, dname, f"plan build, segment, {name}: host wall", host_us(fn, args.reps), nan, nan))


def replicas(p, n: int) -> tuple[torch.Tensor, list]:
    """One arena holding ``n`` copies of a packed arena and each copy's tables: the adapters of
    ``n`` distinct launches (layers x modules), as many bytes as n real launches read."""
    from memory_broker.kernels.records import LoraTables

    size = p.arena.numel()
    arena = p.arena.repeat(n)
    tables = [LoraTables(p.a_offsets + k * size, p.b_offsets + k * size, p.ranks, p.scalings) for k in range(n)]
    return arena, tables


def captured(fn: Callable[[], object]):
    """A CUDA graph of ``fn`` (run once first on a side stream, so Triton compiles outside)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def model_step_rows(case: Case, args, dtype: torch.dtype, p, slots, x, expected, rows: list, label: str) -> bool:
    # expected: (the reference output of one launch, the base output it was added to).
    """A whole decode step, --layers x --modules launches each over its own adapters' copy: the
    plan plus every launch, eager and (on a GPU) as a replayed CUDA graph of a StaticStep."""
    from memory_broker.kernels import lora_ops
    from memory_broker.kernels.batch_plan import plan_batch
    from memory_broker.kernels.graph_step import StaticStep
    from memory_broker.kernels.records import LoraStep

    n = args.layers * args.modules
    arena, tables = replicas(p, n)
    base = expected[1]
    outs = [base.clone() for _ in range(n)]
    y = torch.empty(case.num_slices, case.num_tokens, p.a_offsets.shape[2], device=DEVICE)

    def eager():
        plan = plan_batch(slots, case.num_adapters, active_slots=case.num_adapters)
        step = LoraStep(slots, plan)
        for t, o in zip(tables, outs):
            lora_ops.lora_apply(x, o, arena, t, step, p.slice_offsets, p.slice_sizes, y=y, row_align=8)
        return plan.path

    path = eager()
    ok = all(check(f"{label}: model step launch {k}", outs[k], expected[0], dtype) for k in (0, n - 1))
    what = f"model step {args.layers}x{args.modules}: kernels"
    record_row(rows, case, dtype, f"{what} eager, plan + {n} pairs ({path})", median_ms(eager, args.reps, args.warmup))
    if DEVICE != "cuda":
        print(f"{label}: {what} captured: skipped, CUDA graphs need a GPU")
        return ok
    for fuse in (False, True) if path == "token" else (False,):
        static = StaticStep(
            case.num_tokens, case.num_adapters, DEVICE, path=path, fuse_shrink_slices=fuse, fuse_expand_slices=fuse
        )
        for k, t in enumerate(tables):
            static.add_launch(k, case.num_slices, p.a_offsets.shape[2])
            static.load_tables(k, t)
        static.load_tokens(slots)

        def replayed_step(static=static):
            static.replan()
            for k, o in enumerate(outs):
                static.apply(k, x, o, arena, p.slice_offsets, p.slice_sizes, row_align=8)

        graph = captured(replayed_step)
        for o in outs:
            o.copy_(base)
        graph.replay()
        method = f"{what} CUDA graph replay ({path}{', fused' if fuse else ''})"
        ok &= check(f"{label}: {method}", outs[n - 1], expected[0], dtype)
        record_row(rows, case, dtype, method, median_ms(graph.replay, args.reps, args.warmup))
    return ok


def vllm_model_step_rows(case: Case, args, dtype, vllm, w, slots, x, expected, rows, label) -> None:
    """vLLM's ops driven as ``model_step_rows`` drives the kernels: prepare_tensors once, then
    --layers x --modules shrink/expand pairs over distinct weight copies; eager and captured."""
    import vllm_lora_baseline as vb

    n = args.layers * args.modules
    ws = [
        vb.VllmLoraWeights(tuple(a.clone() for a in w.a), tuple(b.clone() for b in w.b), w.output_slices)
        for _ in range(n)
    ]
    _KEEP.append(ws)
    meta = vb.make_metadata(vllm, slots, case.num_adapters, DEVICE)
    outs = [expected[1].clone() for _ in range(n)]

    def eager():
        meta.prepare_tensors(slots)
        for wk, o in zip(ws, outs):
            vb.lora_apply(vllm, x, o, wk, meta)

    eager()
    if not check(f"{label}: vLLM model step", outs[n - 1], expected[0], dtype):
        print(f"{label}: vLLM model step CHECK FAILED: its rows are left out")
        return
    what = f"model step {args.layers}x{args.modules}: vLLM"
    record_row(
        rows, case, dtype, f"{what} eager, prepare_tensors + {n} pairs", median_ms(eager, args.reps, args.warmup)
    )
    if DEVICE != "cuda":
        return

    def pairs():
        for wk, o in zip(ws, outs):
            vb.lora_apply(vllm, x, o, wk, meta)

    # As vLLM runs it: the metadata is prepared outside the graph, which holds the kernels.
    try:
        graph = captured(pairs)
    except Exception as e:  # noqa: BLE001 - the row is optional
        print(f"{label}: {what} captured: skipped: {type(e).__name__}: {e}")
        return
    method = f"{what} CUDA graph replay of the pairs (prepare_tensors outside)"
    record_row(rows, case, dtype, method, median_ms(graph.replay, args.reps, args.warmup))


def record_row(rows: list, case: Case, dtype: torch.dtype, method: str, ms: float) -> None:
    """A row without a bandwidth (a whole step, or a plan)."""
    rows.append((case.name, str(dtype).removeprefix("torch."), method, ms * 1e3, float("nan"), float("nan")))


def run_vllm(case, args, vllm, adapters, slots, x, out, base, expected, dtype, label, record, rows) -> None:
    """vLLM's rows; a failure here (an exception, a wrong output) is printed, not raised: the
    project's own rows stand without them."""
    import vllm_lora_baseline as vb

    method = "vLLM Triton lora_shrink+lora_expand"
    try:
        w = vb.stack_weights(adapters, dtype, DEVICE)
        _KEEP.append(w)  # vLLM caches the weights' pointer tables by address: keep the addresses unique
        meta = vb.make_metadata(vllm, slots.roll(1) if args.vllm_wrong_map else slots, case.num_adapters, DEVICE)
        out.copy_(base)
        vb.lora_apply(vllm, x, out, w, meta)
        if not check(f"{label}: {method}", out, expected, dtype):
            print(
                f"{label}: vLLM CHECK FAILED: its output is off the reference (see the metadata and weights "
                "tests/vllm_lora_baseline.py gives it); its row is left out"
            )
            return
        record(method, median_ms(lambda: vb.lora_apply(vllm, x, out, w, meta), args.reps, args.warmup))
        ms = median_ms(lambda: meta.prepare_tensors(slots), args.reps, args.warmup)
        rows.append(
            (
                case.name,
                str(dtype).removeprefix("torch."),
                "vLLM LoRAKernelMeta.prepare_tensors (once per step)",
                ms * 1e3,
                float("nan"),
                float("nan"),
            )
        )
        if case.layout == "decode" and args.layers * args.modules > 0:
            vllm_model_step_rows(case, args, dtype, vllm, w, slots, x, (expected, base), rows, label)
    except Exception as e:  # noqa: BLE001 - vLLM's failure must not hide the project's rows
        print(f"{label}: vLLM FAILED: {type(e).__name__}: {e}")


# Stacked vLLM weights stay alive for the whole run (see run_vllm).
_KEEP: list[object] = []


def ratios(rows: list[Row]) -> list[str]:
    """One line per case and dtype: the project's best kernels row against vLLM's."""
    lines = []
    for key in dict.fromkeys((r[0], r[1]) for r in rows):
        mine = [(r[3], r[2]) for r in rows if (r[0], r[1]) == key and r[2].startswith("kernels ")]
        theirs = [r[3] for r in rows if (r[0], r[1]) == key and r[2].startswith("vLLM Triton")]
        if not mine:
            continue
        us, method = min(mine)
        if not theirs:
            lines.append(f"{key[0]} {key[1]}: kernels best ({method}) {us:.1f} us; no vLLM row")
            continue
        lines.append(
            f"{key[0]} {key[1]}: kernels best ({method}) {us:.1f} us / vLLM {theirs[0]:.1f} us = {us / theirs[0]:.2f} "
            f"({'kernels faster' if us < theirs[0] else 'vLLM faster' if us > theirs[0] else 'equal'}, "
            f"{theirs[0] / us:.2f}x)"
        )
    return lines


def load_vllm(folder: str | None):
    """vLLM's kernels from the extracted folder, or None with one line saying why not."""
    # vLLM's calling convention, shared with tests/test_vllm_lora_baseline.py, lives in tests/.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
    import vllm_lora_baseline as vb

    where = folder or str(vb.DEFAULT_DIR)
    if not os.path.isfile(os.path.join(where, "MANIFEST.json")):
        print(f"vLLM rows: skipped: no extracted vLLM LoRA ops in {where} (run ops/gpu/extract_vllm_lora_ops.py)")
        return None
    try:
        ops = vb.load(where)
    except Exception as e:  # noqa: BLE001 - the comparison is optional; the project's rows are not
        print(f"vLLM rows: skipped: {where} does not import: {type(e).__name__}: {e}")
        return None
    print(f"vLLM rows: vLLM {ops.version} Triton LoRA ops from {ops.folder}")
    return ops


# --cpu-dry-run's cases: both batches' layouts at shapes Triton's interpreter runs in seconds.
DRY_RUN_CASES = [Case("decode", 5, 3, 4, 32, 2, "decode"), Case("prefill", 40, 2, 4, 32, 2, "prefill")]


def dry_run() -> None:
    """--cpu-dry-run: the CPU, the tiny cases, and no timing (each timed call runs once, 0.5 ms)."""
    global DEVICE, CASES, median_ms, copy_bandwidth

    def once(fn: Callable[[], object], reps: int, warmup: int) -> float:
        fn()
        return 0.5

    DEVICE, CASES, median_ms = "cpu", DRY_RUN_CASES, once
    copy_bandwidth = lambda reps: 1e12  # noqa: E731 - not 2 GiB of host memory for a figure never shown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--stacked-rank", type=int, default=64, help="max rank the stacked-slot baseline pads to")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split-k", type=int, default=8, help="the token path's split-K row: parts of the hidden dim")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the whole decode step's rows")
    ap.add_argument("--modules", type=int, default=4, help="LoRA launches per layer in the whole decode step")
    ap.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated: float16, bfloat16")
    ap.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    ap.add_argument(
        "--vllm-ops", default=None, help="folder ops/gpu/extract_vllm_lora_ops.py wrote (default ops/gpu/vllm_lora_ops)"
    )
    ap.add_argument("--cpu-dry-run", action="store_true", help="the logic on the CPU, tiny cases, nothing timed")
    ap.add_argument("--tokens", default="", help="comma-separated CASE=N: a case's token count (decode=3,prefill=8)")
    ap.add_argument(
        "--vllm-wrong-map", action="store_true", help="give vLLM a wrong token -> slot map (a check's check)"
    )
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--cpu-dry-run: run with TRITON_INTERPRET=1 (Triton's interpreter runs the kernels on the CPU)")
        dry_run()
    try:
        dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    except KeyError as e:
        ap.error(f"--dtypes: unknown dtype {e} (use {', '.join(DTYPES)})")
    by_name = {c.name: c for c in CASES}
    tokens = dict(t.split("=", 1) for t in args.tokens.split(",") if t)
    unknown = [n for n in [*args.cases.split(","), *tokens] if n not in by_name]
    if unknown:
        ap.error(f"--cases, --tokens: unknown {unknown} (use {', '.join(by_name)})")
    by_name.update({n: replace(by_name[n], num_tokens=int(t)) for n, t in tokens.items()})
    cases = [by_name[n] for n in args.cases.split(",")]
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_lora_kernels: no CUDA device here; these timings need a GPU, so nothing was measured.")
        return 0

    copy_bw = copy_bandwidth(args.reps)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(f"device: {name}; 1 GiB device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    vllm = load_vllm(args.vllm_ops)
    rows: list[Row] = []
    ok = True
    for case in cases:
        for dtype in dtypes:
            ok &= run_case(case, args, copy_bw, rows, dtype, vllm)
    report(rows, cases)
    if not ok:
        print("bench_lora_kernels: a project kernel's output is off the reference (MISMATCH above)")
    return 0 if ok else 1


def report(rows: list[Row], cases: list[Case]) -> None:
    print()
    print(f"{'case':8} {'dtype':9} {'method':52} {'median us':>10} {'GB/s':>8} {'% copy':>7}")
    for name, dname, method, us, gbs, share in rows:
        bw = f"{gbs:8.0f} {share:6.1f}%" if gbs == gbs else f"{'-':>8} {'-':>7}"
        print(f"{name:8} {dname:9} {method:52} {us:10.1f} {bw}")
    print()
    for case in cases:
        print(
            f"{case.name}: {case.num_tokens} tokens, {case.num_adapters} adapters, rank {case.rank}, hidden "
            f"{case.hidden}, {case.num_slices} slices; compulsory traffic {compulsory_bytes(case, 2) / 1e6:.1f} MB"
        )
    print()
    print("kernels vs vLLM (time ratio, per case and dtype):")
    for line in ratios(rows):
        print(f"  {line}")


if __name__ == "__main__":
    sys.exit(main())
