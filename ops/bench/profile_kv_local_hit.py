#!/usr/bin/env python3
"""Where the broker KV connector's time goes on a local prefix-cache hit, call by call.

Replays what the connector does for one request of ``bench_vllm_kv.py``'s workload whose
prefix vLLM's own cache holds (1,088 tokens: 34 full blocks of 32, the last 2 new), against a
broker with the benchmark's geometry (host arena, 512 KiB pages, 64 MiB slabs), with
``tiny_model.SMALL``'s KV (8 layers, 4 KV heads x 64, float32, 32-token blocks: 64 KiB per
layer and block): the scheduler's lookup (one, without pins: ``kv_scheduler.py``; and the
old pinned lookup + unpin beside it), the worker's prepare of the 2 new blocks, the 8 layer
copies into their pages (``BlockMover.save``), and the commit. Medians over ``--n`` requests,
each with new keys, so the pages are the arena's next free ones, as in the benchmark.

    .venv/bin/python ops/bench/profile_kv_local_hit.py [--n 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from memory_broker.clients import BrokerClient  # noqa: E402
from memory_broker.clients.vllm import store  # noqa: E402
from memory_broker.clients.vllm.block_mover import BlockMover  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="mb-prof-kv-", dir="/tmp")
    sock = os.path.join(tmp, "b.sock")
    broker = subprocess.Popen(
        [sys.executable, "-m", "memory_broker.broker.cli", "serve", "--socket", sock, "--arena", "host",
         "--state-dir", os.path.join(tmp, "state"), "--pool-size", "2GiB", "--page-size", "512KiB",
         "--slab-size", "64MiB"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if broker.poll() is not None or time.monotonic() > deadline:
                sys.exit("the broker did not start")
            time.sleep(0.1)
        c = BrokerClient.connect(sock, client_name="prof-kv")
        layers = [torch.randn(400, 2, 32, 4, 64) for _ in range(8)]  # FlashInfer-like, 400 blocks
        mover = BlockMover(layers, 0, c.geometry.page_size)
        stored = [os.urandom(32) for _ in range(32)]  # the shared prefix, stored once
        txn = c.prepare(store.kv_specs(stored, mover.block_nbytes, c.geometry.page_size))
        txn.commit()
        times: dict[str, list[float]] = {k: [] for k in ("lookup", "lookup+unpin (old)", "prepare", "copy", "commit")}
        for i in range(a.n):
            keys = stored + [os.urandom(32), os.urandom(32)]
            t0 = time.perf_counter()
            c.lookup(keys, pin=False)
            t1 = time.perf_counter()
            got = c.lookup(keys, pin=True)
            c.unpin(got)
            t2 = time.perf_counter()
            txn = c.prepare(store.kv_specs(keys[32:], mover.block_nbytes, c.geometry.page_size))
            t3 = time.perf_counter()
            phys = c.physical_view()
            for li in range(len(layers)):
                mover.save(phys, [2 * i % 400, (2 * i + 1) % 400], [o.pages for o in txn.objects], layer=li)
            t4 = time.perf_counter()
            txn.commit()
            t5 = time.perf_counter()
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                times[k].append(dt * 1e3)
        c.close()
    finally:
        broker.terminate()
        broker.wait(30)
    print(f"# a local prefix-cache hit's connector calls, median of {a.n} (ms); load average {os.getloadavg()[0]:.1f}")
    print()
    print("| call | median (ms) | p90 (ms) |")
    print("|---|---:|---:|")
    for k, v in times.items():
        v = sorted(v)
        print(f"| {k} | {statistics.median(v):.2f} | {v[int(0.9 * (len(v) - 1))]:.2f} |")
    new = sum(statistics.median(times[k]) for k in ("lookup", "prepare", "copy", "commit"))
    print(f"\nper request now (lookup, prepare, copy, commit): {new:.2f} ms")


if __name__ == "__main__":
    main()
