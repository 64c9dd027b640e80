#!/usr/bin/env python3
"""Batched multi-LoRA kernels (kernels/) against two baselines, on one CUDA device.

Two batches, each fused q/k/v (3 slices) over hidden 4096: decode (64 tokens of 64 distinct
rank-16 adapters) and prefill (8192 tokens in runs of 8 adapters). Methods:

  kernels auto / token / segment   lora_apply over a paged arena (2 MiB pages, rows shuffled)
  torch per-adapter GEMMs          a loop over adapters: index_select, x @ Aᵀ, y @ Bᵀ, index_add_
  stacked slots, padded            the same kernels over contiguous [slots, max_rank, hidden]
                                   buffers with every rank set to --stacked-rank (the padded
                                   rows computed, as fixed-slot engines do)

Times are medians of CUDA-event timings of single calls, L2 flushed before each. Bandwidth is
the batch's compulsory traffic (x, the adapters' rows once, y, out read and written) over the
time, shown as a share of a large device-to-device copy measured in the same run. The plan
(token sort and tiles) is built once per step and timed on its own row.

    python ops/bench/bench_lora_kernels.py [--reps 50] [--stacked-rank 64]

Without a CUDA device it prints one line and exits 0: there is nothing honest to report.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

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


def run_case(case: Case, args, copy_bw: float, rows: list[tuple[str, str, float, float, float]]) -> None:
    from memory_broker.kernels import lora_ops
    from memory_broker.kernels.batch_plan import plan_batch
    from memory_broker.kernels.testing import pack_adapters, random_adapter

    dtype = torch.float16
    g = torch.Generator().manual_seed(args.seed)
    slice_sizes = (case.hidden,) * case.num_slices
    adapters = [random_adapter(case.rank, case.hidden, slice_sizes, g) for _ in range(case.num_adapters)]
    packed = pack_adapters(
        adapters, dtype=dtype, generator=g, device=DEVICE, page_elems=PAGE_BYTES // 2, row_align=8, spare_pages=4
    )
    slots = token_slots(case, g).to(DEVICE)
    x = torch.randn(case.num_tokens, case.hidden, generator=g).to(dtype).to(DEVICE)
    out = torch.randn(case.num_tokens, sum(slice_sizes), generator=g).to(dtype).to(DEVICE)
    y = torch.empty(case.num_slices, case.num_tokens, packed.a_offsets.shape[2], device=DEVICE)
    nbytes = compulsory_bytes(case, x.element_size())

    def record(method: str, ms: float) -> None:
        bw = nbytes / (ms / 1e3)
        rows.append((case.name, method, ms * 1e3, bw / 1e9, 100 * bw / copy_bw))

    p = packed
    for path in ("auto", "token", "segment"):
        plan = plan_batch(slots, case.num_adapters, path=path, active_slots=case.num_adapters)

        def ours(plan=plan):
            lora_ops.lora_apply(x, out, p.arena, p.a_offsets, p.b_offsets, p.ranks, p.scalings, slots,
                                p.slice_offsets, p.slice_sizes, plan=plan, y=y, row_align=8)  # fmt: skip

        label = f"kernels {path}" + (f" ({plan.path})" if path == "auto" else "")
        record(label, median_ms(ours, args.reps, args.warmup))

    ms = median_ms(lambda: plan_batch(slots, case.num_adapters, path="segment"), args.reps, args.warmup)
    rows.append((case.name, "plan build, segment (once per step)", ms * 1e3, float("nan"), float("nan")))

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

    record("torch per-adapter GEMMs", median_ms(torch_loop, args.reps, args.warmup))

    # Baseline 2: fixed slots padded to a max rank, contiguous, padded rows computed.
    sa, sa_off, sb_off, s_ranks, s_scal = stacked_tables(adapters, case.hidden, args.stacked_rank, dtype)
    s_y = torch.empty(case.num_slices, case.num_tokens, args.stacked_rank, device=DEVICE)
    s_plan = plan_batch(slots, case.num_adapters, active_slots=case.num_adapters)

    def stacked():
        lora_ops.lora_apply(x, out, sa, sa_off, sb_off, s_ranks, s_scal, slots, p.slice_offsets, p.slice_sizes,
                            plan=s_plan, y=s_y, row_align=8)  # fmt: skip

    label = f"stacked slots, padded to rank {args.stacked_rank} ({s_plan.path})"
    record(label, median_ms(stacked, args.reps, args.warmup))

    # One correctness check on the device: the kernels against the torch loop, same base.
    base = out.clone()
    lora_ops.lora_apply(x, out, p.arena, p.a_offsets, p.b_offsets, p.ranks, p.scalings, slots, p.slice_offsets,
                        p.slice_sizes, row_align=8)  # fmt: skip
    ours_out = out.clone()
    out.copy_(base)
    torch_loop()
    err = (ours_out.float() - out.float()).abs().max().item()
    print(f"{case.name}: max |kernels - torch loop| = {err:.3g} (max |out| = {out.float().abs().max().item():.3g})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--stacked-rank", type=int, default=64, help="max rank the stacked-slot baseline pads to")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_lora_kernels: no CUDA device here; these timings need a GPU, so nothing was measured.")
        return 0

    copy_bw = copy_bandwidth(args.reps)
    print(f"device: {torch.cuda.get_device_name()}; 1 GiB device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    rows: list[tuple[str, str, float, float, float]] = []
    for case in CASES:
        run_case(case, args, copy_bw, rows)

    print()
    print(f"{'case':8} {'method':48} {'median us':>10} {'GB/s':>8} {'% copy':>7}")
    for name, method, us, gbs, share in rows:
        bw = f"{gbs:8.0f} {share:6.1f}%" if gbs == gbs else f"{'-':>8} {'-':>7}"
        print(f"{name:8} {method:48} {us:10.1f} {bw}")
    print()
    for case in CASES:
        print(
            f"{case.name}: {case.num_tokens} tokens, {case.num_adapters} adapters, rank {case.rank}, hidden "
            f"{case.hidden}, {case.num_slices} slices; compulsory traffic {compulsory_bytes(case, 2) / 1e6:.1f} MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
