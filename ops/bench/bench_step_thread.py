#!/usr/bin/env python3
"""The step thread's A/B (issue 28): two brokers at once, every process on one CPU, one serving
the step channel from its event loop (``--no-step-thread``), the other from the step thread
under the loop's core gate; rounds interleaved between them.

    python ops/bench/bench_step_thread.py [--rounds 10] [--metrics]

Per round and broker: 400 PINGs and 400 steady ``client.step()`` calls (8 hot adapters, 16 KV
keys, the previous step released), their medians, and the broker process's CPU per frame
(``/proc/PID/task/*/schedstat``, every thread). ``--metrics`` serves Prometheus metrics on both
(every STEP frame then records its ops' latencies with a ``call_soon`` on the loop).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step as B  # noqa: E402
from bench_rpc import start_broker  # noqa: E402

from memory_broker.clients import BrokerClient, Spec  # noqa: E402


def cpu_ns(pid: int) -> int:
    t = 0
    for f in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(f) as fh:
                t += int(fh.read().split()[0])
        except OSError:
            pass
    return t


def start(d: str, name: str, flags: list[str]):
    sock = os.path.join(d, name + ".sock")
    p = start_broker(sock, os.path.join(d, name + "-state"), page_size="512KiB", extra=flags)
    setup = BrokerClient.connect(sock, client_name="setup")
    ids = [f"ad{i}" for i in range(8)]
    for i, aid in enumerate(ids):
        setup.register_adapter(aid, B.write_adapter(os.path.join(d, name + "-ad", aid), i))
    setup.prefetch_adapters(ids, "hot")
    setup.allocate([Spec(1, content_type="kv_cache", key=b"kv-%d" % i) for i in range(16)])
    return p, setup, BrokerClient.connect(sock, client_name="bench")


def one_round(p, c, work, out: dict) -> None:
    t = c._step_path().transport
    ping = B.step_wire.frame(B.step_wire.PING)
    for _ in range(100):
        t.request(ping)
    xs = []
    c0 = cpu_ns(p.pid)
    for _ in range(400):
        t0 = time.perf_counter_ns()
        t.request(ping)
        xs.append((time.perf_counter_ns() - t0) / 1e3)
    out["ping_cpu"].append((cpu_ns(p.pid) - c0) / 400 / 1e3)
    out["ping"].append(statistics.median(xs))
    list(B.step_api(c, work[:50]))
    c0 = cpu_ns(p.pid)
    xs = list(B.step_api(c, work))
    out["step_cpu"].append((cpu_ns(p.pid) - c0) / len(work) / 1e3)
    out["step"].append(statistics.median(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--metrics", action="store_true", help="serve metrics on both brokers (ports 19101, 19102)")
    a = ap.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    d = tempfile.mkdtemp(prefix="mb-ab-", dir="/tmp")
    flags = {"loop": ["--no-step-thread"], "thread": []}
    if a.metrics:
        flags["loop"] += ["--metrics-port", "19101"]
        flags["thread"] += ["--metrics-port", "19102"]
    brokers = {name: start(d, name, f) for name, f in flags.items()}
    work = B.steady(400)
    res = {n: {"ping": [], "step": [], "ping_cpu": [], "step_cpu": []} for n in brokers}
    try:
        for _ in range(a.rounds):
            for name, (p, _, c) in brokers.items():
                one_round(p, c, work, res[name])
    finally:
        for p, setup, c in brokers.values():
            c.close()
            setup.close()
            p.terminate()
            p.wait(30)
    print(f"{a.rounds} rounds, interleaved; every process on one CPU; metrics {'on' if a.metrics else 'off'}")
    print(f"{'broker':<8}{'PING us':>9}{'PING CPU':>10}{'step() us':>11}{'step() CPU':>12}  (medians of the rounds)")
    for name, r in res.items():
        m = {k: statistics.median(v) for k, v in r.items()}
        print(f"{name:<8}{m['ping']:>9.1f}{m['ping_cpu']:>10.1f}{m['step']:>11.1f}{m['step_cpu']:>12.1f}")


if __name__ == "__main__":
    main()
