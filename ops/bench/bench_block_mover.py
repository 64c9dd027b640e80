#!/usr/bin/env python3
"""The KV block mover's bandwidth as a share of a device-to-device copy, in the same run.

A step of ``--step`` bytes of KV blocks (default 1 GiB: 512 blocks of 32 layers x 64 KiB,
bfloat16, 16 tokens x 8 KV heads x 128) is copied by ``BlockMover`` between a KV cache twice
that size and arena pages (``--page`` bytes, default 2 MiB, shuffled over an arena of twice
the step) in vLLM's layouts (FlashAttention, FlashInfer NHD and HND), both ways, with the
Triton backend (one launch per layer) and the torch backend (index_select + index_copy_, two
launches per layer). The baseline is ``dst.copy_(src)`` of the same bytes, contiguous, on
the same device. Times are CUDA-event medians of ``--reps``; bandwidth counts the step's
bytes once. Target (issue 29): the mover at >= 80% of the copy's bandwidth.

    python ops/bench/bench_block_mover.py [--step 1GiB] [--reps 10]
    python ops/bench/bench_block_mover.py --quick     # CPU smoke: small sizes, torch backend

On a machine without CUDA it runs the CPU smoke (small sizes; the figure says nothing about
a GPU) and says so.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from memory_broker.clients.vllm.block_mover import BlockMover  # noqa: E402

MiB = 1 << 20


def layers_for(layout: str, n_layers: int, num_blocks: int, bs: int, heads: int, head: int, device) -> tuple[list, int]:
    dt = torch.bfloat16
    if layout == "flash_attn":
        return [torch.randn(2, num_blocks, bs, heads, head, dtype=dt, device=device) for _ in range(n_layers)], 1
    if layout == "flashinfer_nhd":
        return [torch.randn(num_blocks, 2, bs, heads, head, dtype=dt, device=device) for _ in range(n_layers)], 0
    if layout == "flashinfer_hnd":
        return [
            torch.randn(num_blocks, 2, heads, bs, head, dtype=dt, device=device).permute(0, 1, 3, 2, 4)
            for _ in range(n_layers)
        ], 0
    raise ValueError(layout)


def timed(fn, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn`` over ``reps`` (after one warm-up)."""
    fn()
    out = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(out)


def copy_time(nbytes: int, device, reps: int, cuda: bool) -> float:
    """The baseline: one contiguous device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), reps, cuda)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", type=int, default=1 << 30, help="bytes of blocks per step (default 1 GiB)")
    ap.add_argument("--page", type=int, default=2 * MiB)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="CPU smoke sizes (4 MiB step, 4 layers, 3 reps)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if a.quick or not cuda:
        a.step, a.layers, a.reps, a.page = 4 * MiB, 4, 3, 64 * 1024
    device = torch.device("cuda" if cuda else "cpu")
    bs, heads, head = 16, 8, 128
    layer_block = 2 * bs * heads * head * 2
    n = max(1, a.step // (layer_block * a.layers))
    step = n * layer_block * a.layers
    num_blocks = 2 * n
    pages_per_block = -(-layer_block * a.layers // a.page)
    total_pages = 2 * n * pages_per_block
    phys = torch.zeros(total_pages * a.page, dtype=torch.uint8, device=device)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(total_pages, generator=gen).tolist()
    pages = [order[i * pages_per_block : (i + 1) * pages_per_block] for i in range(n)]
    block_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    name = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()})"
    print(
        f"# KV block mover vs a device copy ({time.strftime('%Y-%m-%d')}, {platform.node()}, {name}, torch {torch.__version__})"
    )
    if not cuda:
        print("\nNo CUDA device: a CPU smoke at small sizes (torch backend); it says nothing of a GPU's figure.")
    print(
        f"\nStep: {n} blocks of {a.layers} layers x {layer_block // 1024} KiB = {step / MiB:.0f} MiB, "
        f"pages of {a.page // 1024} KiB shuffled over {total_pages}; median of {a.reps}.\n"
    )
    t_copy = copy_time(step, device, a.reps, cuda)
    print(f"device copy of {step / MiB:.0f} MiB: {t_copy * 1e3:.3f} ms, {step / t_copy / 1e9:.1f} GB/s\n")
    print("| layout | backend | direction | ms | GB/s | share of the copy | launches per layer | unit (B) |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    backends = ("triton", "torch") if cuda else ("torch",)
    for layout in ("flash_attn", "flashinfer_nhd", "flashinfer_hnd"):
        layers, dim = layers_for(layout, a.layers, num_blocks, bs, heads, head, device)
        for backend in backends:
            m = BlockMover(layers, dim, a.page, backend=backend)
            for direction, fn in (
                ("pages -> KV", lambda m=m: m.load(phys, block_ids, pages)),
                ("KV -> pages", lambda m=m: m.save(phys, block_ids, pages)),
            ):
                before = m.launches
                fn()
                per_layer = (m.launches - before) / a.layers
                t = timed(fn, a.reps, cuda)
                print(
                    f"| {layout} | {backend} | {direction} | {t * 1e3:.3f} | {step / t / 1e9:.1f} | "
                    f"{t_copy / t:.0%} | {per_layer:g} | {m.unit} |",
                    flush=True,
                )
        del layers
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
