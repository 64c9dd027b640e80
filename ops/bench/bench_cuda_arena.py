#!/usr/bin/env python3
"""The CUDA arena's costs on one device: mapping a new slab, and copying into arena pages.

1. Slab growth and mapping: the broker's side (``CudaArena.grow(1)``: cuMemCreate + export
   as fd + map into its view) and a client's side (``CudaArenaView.attach_slab(fd)``:
   cuMemImportFromShareableHandle + cuMemMap + cuMemSetAccess), per slab, median and max.
   The client view lives in this process (a second view, importing the exported fd as a
   client would after SCM_RIGHTS), so no socket time is included.
2. Host-to-device bandwidth into arena memory, next to a bare torch copy of the same size
   into a ``torch.empty`` device buffer, measured in the same run: pinned and pageable host
   sources; arena targets are the physical view and a window mapping over scattered pages
   (one contiguous tensor). Target from the issue: the arena within 10% of the bare copy.

Times are medians of CUDA-event timings (copies) or wall-clock (mapping calls).

    python ops/bench/bench_cuda_arena.py [--slab-size 64MiB] [--slabs 8] [--copy-size 256MiB] [--reps 20]

Without a usable CUDA device it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

MiB = 1 << 20


def _size(text: str) -> int:
    from memory_broker.broker.server.options import parse_size

    return parse_size(text, "size")


def _usable() -> tuple[bool, str]:
    from memory_broker.broker.arena.cuda import cuda_available

    ok, why = cuda_available("0")
    if not ok:
        return False, why
    try:
        import torch
    except ImportError as e:
        return False, f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return False, f"this torch ({torch.__version__}) has no CUDA device"
    return True, why


def bench_mapping(args, torch) -> list[str]:
    from memory_broker.broker.arena import ArenaGeometry
    from memory_broker.broker.arena.cuda import CudaArena, CudaArenaView

    ps, slab = args.page_size, args.slab_size
    g = ArenaGeometry(
        page_size=ps, pages_per_slab=slab // ps, max_slabs=args.slabs, window_pages=4 * args.slabs * (slab // ps)
    )
    arena = CudaArena(g, "0", name="bench")
    view = CudaArenaView(g, arena.device_id)
    grow_s, attach_s = [], []
    try:
        for i in range(args.slabs):
            t0 = time.perf_counter()
            arena.grow(1)
            grow_s.append(time.perf_counter() - t0)
            fd = os.dup(arena.slab_fd(i))
            try:
                t0 = time.perf_counter()
                view.attach_slab(i, fd)
                attach_s.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
        # Mapping a window over scattered pages (one cuMemMap + cuMemSetAccess per page here).
        pages = list(range(g.max_pages))
        random.Random(0).shuffle(pages)
        n = min(len(pages), 64)
        t0 = time.perf_counter()
        view.map_window(0, pages[:n])
        map_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        view.unmap_window(0, n)
        unmap_s = time.perf_counter() - t0
    finally:
        view.close()
        arena.close()

    def ms(xs):
        return f"{statistics.median(xs) * 1e3:.3f} | {max(xs) * 1e3:.3f}"

    return [
        f"### Mapping ({args.slabs} slabs of {slab // MiB} MiB, {ps // MiB} MiB pages)",
        "",
        "| step | median ms | max ms |",
        "| --- | ---: | ---: |",
        f"| broker: grow by one slab (create + export + map) | {ms(grow_s)} |",
        f"| client: attach one slab from its fd (import + map + access) | {ms(attach_s)} |",
        f"| client: map {n} scattered pages into the window | {map_s * 1e3:.3f} | - |",
        f"| client: unmap them (sync + unmap) | {unmap_s * 1e3:.3f} | - |",
        "",
    ]


def _time_copy(torch, dst, src, reps: int, warmup: int = 3) -> float:
    """Median seconds of ``dst.copy_(src)`` (CUDA events around each call)."""
    for _ in range(warmup):
        dst.copy_(src, non_blocking=False)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=False)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def bench_copy(args, torch) -> list[str]:
    from memory_broker.broker.arena import ArenaGeometry
    from memory_broker.broker.arena.cuda import CudaArena

    n, ps = args.copy_size, args.page_size
    slab = args.slab_size
    slabs = -(-2 * n // slab)  # twice the copy size, so a window can take every other page
    g = ArenaGeometry(page_size=ps, pages_per_slab=slab // ps, max_slabs=slabs, window_pages=slabs * (slab // ps))
    arena = CudaArena(g, "0", name="bench")
    rows = []
    try:
        arena.grow(slabs)
        v = arena.view
        phys = v.tensor(v.phys_base, n)
        npages = n // ps
        scattered = list(range(0, 2 * npages, 2))  # every other page: no two adjacent
        random.Random(1).shuffle(scattered)
        v.map_window(0, scattered)
        window = v.tensor(v.window_address(0), n)
        assert window.data_ptr() == v.window_address(0) and window.is_contiguous()
        bare = torch.empty(n, dtype=torch.uint8, device=f"cuda:{v.ordinal}")
        sources = {
            "pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True),
            "pageable": torch.empty(n, dtype=torch.uint8),
        }
        for src in sources.values():
            src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
        for kind, src in sources.items():
            t_bare = _time_copy(torch, bare, src, args.reps)
            t_phys = _time_copy(torch, phys, src, args.reps)
            t_win = _time_copy(torch, window, src, args.reps)
            torch.cuda.synchronize()
            assert torch.equal(window[:4096].cpu(), src[:4096]) and torch.equal(phys[:4096].cpu(), src[:4096])
            for target, t in (
                ("torch.empty (bare)", t_bare),
                ("arena physical view", t_phys),
                ("arena window, scattered pages", t_win),
            ):
                ratio = t_bare / t
                flag = "" if target.startswith("torch") else (" ok" if ratio >= 0.9 else " BELOW TARGET")
                rows.append(f"| {kind} | {target} | {n / t / 1e9:.2f} | {ratio * 100:.1f}%{flag} |")
        del phys, window, bare
        torch.cuda.synchronize()
    finally:
        arena.close()
    return [
        f"### Host-to-device copy of {n // MiB} MiB (median of {args.reps})",
        "",
        "| host memory | target | GB/s | vs bare copy (target >= 90%) |",
        "| --- | --- | ---: | ---: |",
        *rows,
        "",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-size", type=_size, default=2 * MiB)
    ap.add_argument("--slab-size", type=_size, default=64 * MiB)
    ap.add_argument("--slabs", type=int, default=8, help="slabs to grow and map in the mapping benchmark")
    ap.add_argument("--copy-size", type=_size, default=256 * MiB)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    ok, why = _usable()
    if not ok:
        print(f"bench_cuda_arena: no usable CUDA device here ({why}); nothing measured")
        return 0
    import torch

    if args.slab_size % args.page_size or args.copy_size % args.page_size:
        ap.error("--slab-size and --copy-size must be multiples of --page-size")
    print(f"device: {torch.cuda.get_device_name(0)}; {why}; torch {torch.__version__}")
    print()
    for line in bench_mapping(args, torch) + bench_copy(args, torch):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
