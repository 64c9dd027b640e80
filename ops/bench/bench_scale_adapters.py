#!/usr/bin/env python3
"""Adapter rows of the scaling benchmark (issue 13): does an adapter call cost the same with
100 and 100,000 adapters registered, and do requests stay fast while a backlog of
conversions ahead of use drains?

* A ListAdapters page (50 ids from a quarter into the registry, and the total count that
  every page carries), at 100, 1k, 10k and 100k registered adapters; the registry's disk
  and memory per registered adapter.
* A daemon (host arena, --enable-echo) gets K adapters registered at once (one PEFT
  directory under K ids, each converted into its own image ahead of use); Echo RPC latency
  from another process before and while the backlog drains.

``rows(quick)`` returns the rows for ``bench_scale.py``; run alone it prints them.

    python ops/bench/bench_scale_adapters.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_adapters import write_peft_dir  # noqa: E402
from bench_scale import pct, rss_bytes  # noqa: E402

from memory_broker.broker.adapters import AdapterRegistry  # noqa: E402


def registry_rows(root: str, src: str, sizes: list[int], out: list, memory: list) -> None:
    for n in sizes:
        d = tempfile.mkdtemp(dir=root)
        gc.collect()
        r0 = rss_bytes()
        reg = AdapterRegistry(d)
        meta = reg.inspect(src)
        for start in range(0, n, 10_000):
            reg.add_many([(f"tenant-{i:07d}", meta) for i in range(start, min(n, start + 10_000))])
        token = f"tenant-{n // 4:07d}"  # 50 ids from a quarter in: the same page at every size
        samples = []
        for _ in range(200):
            t0 = time.perf_counter_ns()
            page = reg.list("", 50, token)
            total = reg.count("")
            samples.append((time.perf_counter_ns() - t0) / 1e6)
        assert len(page.adapters) == 50 and total == n
        out.append(
            {
                "operation": "ListAdapters page (50) + total",
                "size": f"{n:,} adapters",
                "median_ms": statistics.median(samples),
                "p99_ms": pct(samples, 0.99),
            }
        )
        disk = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if os.path.isfile(os.path.join(d, f)))
        memory.append((n, (rss_bytes() - r0) / n, disk / n))
        reg.close()


def backlog_rows(root: str, src: str, k: int, seconds: float, out: list) -> None:
    from bench_scale import echo_child, echo_result

    from memory_broker.clients import BrokerClient

    d = tempfile.mkdtemp(prefix="mb-conv-", dir="/tmp")
    socket = os.path.join(d, "b.sock")
    import subprocess

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memory_broker.broker.cli",
            "serve",
            "--socket",
            socket,
            "--arena",
            "host",
            "--enable-echo",
            "--pool-size",
            "1GiB",
            "--slab-size",
            "256MiB",
            "--state-dir",
            os.path.join(d, "state"),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(socket) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        with BrokerClient.connect(socket, client_name="registrar") as c:
            base = echo_result(echo_child(socket, min(seconds, 5.0)))
            out.append(
                {
                    "operation": "Echo RPC, no conversion backlog",
                    "size": f"{k:,} adapters",
                    "median_ms": statistics.median(base),
                    "p99_ms": pct(base, 0.99),
                    "max_ms": max(base),
                }
            )
            t0 = time.monotonic()
            for i in range(k):
                c.register_adapter(f"bulk-{i:06d}", src)
            reg_s = time.monotonic() - t0
            queued = c.stats().adapters.convert_queued
            during = echo_result(echo_child(socket, seconds))
            left = c.stats().adapters.convert_queued
            out.append(
                {
                    "operation": "Echo RPC while conversions drain",
                    "size": f"{k:,} adapters",
                    "median_ms": statistics.median(during),
                    "p99_ms": pct(during, 0.99),
                    "max_ms": max(during),
                }
            )
            print(
                f"(registered {k:,} adapters in {reg_s:.1f} s; conversion backlog {queued:,} after registering, "
                f"{left:,} after {seconds:g} s more)"
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def rows(quick: bool) -> list[dict]:
    root = tempfile.mkdtemp(prefix="mb-scale-adapters-", dir="/tmp")
    src = write_peft_dir(os.path.join(root, "a"), rank=8, hidden=256, kv=64, layers=4, seed=3)
    out: list[dict] = []
    memory: list = []
    registry_rows(root, src, [100, 1_000] if quick else [100, 1_000, 10_000, 100_000], out, memory)
    backlog_rows(root, src, 50 if quick else 10_000, 2.0 if quick else 30.0, out)
    for n, mem, disk in memory:
        print(f"(registry with {n:,} adapters: {mem:.0f} B of memory and {disk:.0f} B of disk per adapter)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    from bench_scale import print_table

    print_table(rows(a.quick))


if __name__ == "__main__":
    main()
