#!/usr/bin/env python3
"""The CUDA arena's costs through a real broker and client, beside the host arena in the same run.

The broker runs in this process (its own event loop in a thread, with a heartbeat that
records the loop's longest stall), the client is the library's ``BrokerClient`` over its
sockets. Tables:

1. Attach: ``connect()`` to a first served allocation (1 page), and the time to map every page
   of the arena (``map_arena``: page fds fetched 200 per message, imported, closed, mapped,
   one access call per run), at 1k and 10k pages and at the device's free memory in pages
   (``--scales``); the broker loop's longest stall during each. Target (issue 25): a first
   allocation within 2 s on an arena of the device's free memory, no stall over 5 ms.
2. Allocate + free latency, p50 and p99, for 1 and 16 pages, contiguous and paged; cold (the
   pages' first import and access on CUDA) and warm (after ``map_arena``); CUDA beside host.
   Target: 16 contiguous pages under 1 ms at p50.
3. Copy bandwidth into an arena tensor (a contiguous object) beside a plain ``torch.empty``
   tensor of the same size, from pinned host memory and from device memory. Target: >= 0.9x.
4. Open fds of this process (broker and client together) before and after: no fd per page.

    python ops/bench/bench_cuda_arena.py [--scales 1024,10240,free] [--reps 200] [--copy-size 256MiB]
        [--tables attach,latency,copy]

Each table row prints as it is measured, so a run stopped by a time limit keeps the rows it
finished (ops/gpu/run_gpu_checks.sh runs it at 1,024 pages, then at the device's free memory).
Without a usable CUDA device the CUDA columns say why and only the host arena is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) of ``xs``, nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


class Table:
    """A Markdown table printed as it is measured: the title and header now, each row as it comes."""

    def __init__(self, title: str, header: list[str]) -> None:
        print(f"### {title}\n\n| " + " | ".join(header) + " |\n|" + " --- |" * len(header), flush=True)

    def row(self, cells: list[str]) -> None:
        print("| " + " | ".join(cells) + " |", flush=True)

    def end(self) -> None:
        print(flush=True)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def cuda_usable() -> tuple[bool, str]:
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


class Rig:
    """A broker of ``pages`` pages (all created at start) in this process, on its own loop."""

    def __init__(self, backend: str, pages: int, page_size: int, pages_per_slab: int) -> None:
        import structlog

        from memory_broker.broker.server.app import BrokerServer
        from memory_broker.broker.server.config import build_options

        def drop(*_):
            raise structlog.DropEvent

        self.dir = tempfile.mkdtemp(prefix="mb-bench-", dir="/tmp")
        self.socket = os.path.join(self.dir, "b.sock")
        slabs = -(-pages // pages_per_slab)
        size = slabs * pages_per_slab * page_size
        opts = build_options(
            None,
            {
                "socket": self.socket,
                "state_dir": os.path.join(self.dir, "state"),
                "arena": backend,
                "page_size": page_size,
                "slab_size": pages_per_slab * page_size,
                "pool_size": size,
                "preallocate": size,
            },
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.worst = 0.0
        self.server = BrokerServer(opts, structlog.wrap_logger(structlog.ReturnLogger(), processors=[drop]))
        self.call(self.server.start(), 600)
        self.call(self._beat_start())

    async def _beat_start(self) -> None:
        self._beat = self.loop.create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last - 0.001)
            last = now

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stall(self) -> float:
        """The loop's longest stall since the last call, in seconds (and reset)."""
        w, self.worst = self.worst, 0.0
        return w

    def stop(self) -> None:
        async def halt():
            self._beat.cancel()
            await self.server.stop("bench")

        self.call(halt(), 600)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def bench_attach(args, backends: list[str]) -> None:
    from memory_broker.clients.client import BrokerClient

    head = ["arena", "pages", "broker start s", "connect + 1st alloc ms", "loop stall ms"]
    head += ["map every page ms", "loop stall ms"]
    t = Table("Attach: connect() to a first allocation, and mapping every page", head)
    for backend in backends:
        for scale in args.scales:
            if scale == "free" and backend != "cuda":
                continue  # the device's free memory is the CUDA arena's scale
            pages = free_pages(args) if scale == "free" else int(scale)
            t0 = time.perf_counter()
            rig = Rig(backend, pages, args.page_size, args.pages_per_slab)
            start_s = time.perf_counter() - t0
            rig.stall()
            try:
                t0 = time.perf_counter()
                c = BrokerClient.connect(rig.socket, client_name="bench", timeout=600)
                c.allocate_one(1)
                first_s = time.perf_counter() - t0
                first_stall = rig.stall()
                t0 = time.perf_counter()
                mapped = c.map_arena(readonly=False)
                map_s = time.perf_counter() - t0
                map_stall = rig.stall()
                c.close()
            finally:
                rig.stop()
            label = f"{pages} ({scale})" if scale == "free" else str(pages)
            t.row(
                [backend, label, f"{start_s:.2f}", f"{first_s * 1e3:.1f}", f"{first_stall * 1e3:.2f}"]
                + [f"{map_s * 1e3:.1f} ({mapped} pages)" if backend == "cuda" else "- (slabs map whole)"]
                + [f"{map_stall * 1e3:.2f}"]
            )
    t.end()


def free_pages(args) -> int:
    import torch

    free, _ = torch.cuda.mem_get_info(0)
    per_slab = args.page_size * args.pages_per_slab
    return int(free * args.free_fraction) // per_slab * args.pages_per_slab


def _latencies(c, n: int, contiguous: bool, reps: int) -> tuple[list[float], list[float]]:
    alloc, free = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        o = c.allocate_one(n, contiguous=contiguous)
        t1 = time.perf_counter()
        c.free([o])
        t2 = time.perf_counter()
        alloc.append(t1 - t0)
        free.append(t2 - t1)
    return alloc, free


def bench_latency(args, backends: list[str]) -> None:
    from memory_broker.clients.client import BrokerClient

    head = ["arena", "pages seen", "object", "alloc p50 ms", "alloc p99 ms", "free p50 ms", "free p99 ms"]
    title = f"Allocate + free ({args.reps} each warm; cold: the first, pages never seen by the client)"
    t = Table(title, head)
    for backend in backends:
        rig = Rig(backend, args.latency_pages, args.page_size, args.pages_per_slab)
        try:
            with BrokerClient.connect(rig.socket, client_name="bench", timeout=60) as c:
                for phase in ("cold", "warm"):
                    if phase == "warm":
                        c.map_arena(readonly=False)
                    for n in (1, 16):
                        for contiguous in (True, False):
                            a, f = _latencies(c, n, contiguous, args.reps if phase == "warm" else 1)
                            kind = "contiguous" if contiguous else "paged"
                            t.row(
                                [backend, phase, f"{n} {kind}", *(f"{percentile(a, q) * 1e3:.3f}" for q in (50, 99))]
                                + [f"{percentile(f, q) * 1e3:.3f}" for q in (50, 99)]
                            )
        finally:
            rig.stop()
    t.end()


def _time_copy(torch, dst, src, reps: int) -> float:
    """Median seconds of ``dst.copy_(src)`` (CUDA events around each call)."""
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def bench_copy(args, backends: list[str]) -> None:
    """CUDA only (``backends`` is every table's signature)."""
    import torch

    from memory_broker.clients.client import BrokerClient

    n = args.copy_size
    head = ["source", "torch.empty GB/s", "arena tensor GB/s", "arena / plain (target >= 0.9)"]
    t = Table(f"Copy of {n // MiB} MiB into a contiguous arena object (median of {args.reps})", head)
    rig = Rig("cuda", 2 * n // args.page_size, args.page_size, args.pages_per_slab)
    try:
        with BrokerClient.connect(rig.socket, client_name="bench", timeout=60) as c:
            obj = c.allocate_one(n // args.page_size, contiguous=True)
            arena = obj.tensor()
            plain = torch.empty(n, dtype=torch.uint8, device="cuda:0")
            sources = {
                "pinned host": torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory(),
                "device": torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0"),
            }
            for kind, src in sources.items():
                t_plain = _time_copy(torch, plain, src, args.reps)
                t_arena = _time_copy(torch, arena, src, args.reps)
                assert torch.equal(arena[:4096].cpu(), src[:4096].cpu())
                ratio = t_plain / t_arena
                flag = "ok" if ratio >= 0.9 else "BELOW TARGET"
                t.row([kind, f"{n / t_plain / 1e9:.2f}", f"{n / t_arena / 1e9:.2f}", f"{ratio:.3f} {flag}"])
            del arena, plain
            torch.cuda.synchronize()
            c.free([obj])
    finally:
        rig.stop()
    t.end()


TABLES = {"attach": bench_attach, "latency": bench_latency, "copy": bench_copy}


def main(argv: list[str] | None = None) -> int:
    from memory_broker.broker.server.values import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-size", type=lambda s: parse_size(s, "page size"), default=2 * MiB)
    ap.add_argument("--pages-per-slab", type=int, default=32)
    ap.add_argument("--scales", type=lambda s: s.split(","), default=["1024", "10240", "free"])
    ap.add_argument("--free-fraction", type=float, default=0.9, help="of the device's free memory, for 'free'")
    ap.add_argument("--latency-pages", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--copy-size", type=lambda s: parse_size(s, "copy size"), default=256 * MiB)
    ap.add_argument("--tables", type=lambda s: s.split(","), default=list(TABLES), help="of " + ",".join(TABLES))
    args = ap.parse_args(argv)
    if set(args.tables) - set(TABLES):
        ap.error(
            f"--tables: {','.join(sorted(set(args.tables) - set(TABLES)))} unknown; choose from {','.join(TABLES)}"
        )
    ok, why = cuda_usable()
    backends = ["cuda", "host"] if ok else ["host"]
    if not ok:
        args.scales = [s for s in args.scales if s != "free"]
        print(f"CUDA: not measured ({why}); host arena only")
    else:
        import torch

        print(f"device: {torch.cuda.get_device_name(0)}; {why}; torch {torch.__version__}")
    fds0 = open_fds()
    print(f"open fds of this process at start: {fds0}\n")
    for name in args.tables:
        if name != "copy" or ok:
            TABLES[name](args, backends)
    print(f"open fds of this process (broker and client) at the end: {open_fds()} (start: {fds0})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
