#!/usr/bin/env python3
"""A bystander's gRPC latency under a saturating step load (issue 48, item 4).

    python ops/bench/bench_loop_fairness.py [--clients 8] [--seconds 8] [--rounds 2] [--baseline-tree DIR]

For each broker tree (this one, ``current``; with ``--baseline-tree``, also another checkout of
the project, ``baseline``, e.g. ``git worktree add /tmp/base e384307``: the last commit with the
step channel's own thread; native modules it lacks are copied from this tree), in rounds that
alternate between them: two fresh brokers of that tree on the host arena. A bystander session of
the first calls ``stats()`` over gRPC every 5 ms: with nothing else running (``idle``); while
``--clients`` processes send step frames to its broker (a 16-key lookup each, no pin, one frame
in flight per process) as fast as it answers (``load``); while the same load goes to the second
broker instead (``elsewhere``: what the machine's load alone does to the bystander, its broker
idle); then idle again (``idle2``: the A/A control). Prints the bystander's p50/p99/max per phase,
the load's frames per second and its broker's CPU (100% is one core: the event loop saturated),
and the pooled p99 ratios: load / idle, load / elsewhere (what serving the load costs the
bystander beyond the machine's own contention) and idle2 / idle.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rpc import start_broker  # noqa: E402

from memory_broker.clients import BrokerClient, Spec  # noqa: E402

KEYS = [b"fair-%d" % i for i in range(16)]


def load_main(socket: str, seconds: float, out: str) -> None:
    """One load process: lookups over the step channel until ``seconds`` pass."""
    c = BrokerClient.connect(socket, client_name="load")
    c.lookup(KEYS, pin=False)
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(50):
            c.lookup(KEYS, pin=False)
        n += 50
    with open(out, "w") as f:
        f.write(str(n))
    c.close()


def cpu_s(pid: int) -> float:
    """The process's CPU seconds so far (every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bystand(c: BrokerClient, seconds: float, every: float = 0.005) -> list[float]:
    xs: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        c.stats()
        xs.append((time.perf_counter() - t) * 1e3)
        time.sleep(max(0.0, every - (time.perf_counter() - t)))
    return xs


def baseline_path(tree: str, d: str) -> str:
    """A folder to put first on PYTHONPATH so that ``memory_broker`` is ``tree``'s (with this
    tree's built native modules where ``tree`` has none)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for so in glob.glob(os.path.join(here, "**", "*.so"), recursive=True):
        rel = os.path.relpath(so, here)
        if not rel.startswith(".") and not os.path.exists(os.path.join(tree, rel)):
            shutil.copy2(so, os.path.join(tree, rel))
    top = os.path.join(d, "baseline-path")
    os.makedirs(top, exist_ok=True)
    link = os.path.join(top, "memory_broker")
    if not os.path.islink(link):
        os.symlink(os.path.abspath(tree), link)
    return top


def one_mode(d: str, name: str, pythonpath: str, a) -> dict:
    old = os.environ.get("PYTHONPATH")
    if pythonpath:
        os.environ["PYTHONPATH"] = pythonpath
    try:
        socks = [os.path.join(d, f"{name}-{i}.sock") for i in range(2)]
        brokers = [
            start_broker(s, os.path.join(d, f"{name}-{i}-state"), page_size="512KiB", pool="1GiB")
            for i, s in enumerate(socks)
        ]
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    try:
        setups = [BrokerClient.connect(s, client_name="setup") for s in socks]
        for setup in setups:
            setup.allocate([Spec(1, content_type="kv_cache", key=k) for k in KEYS])
        by = BrokerClient.connect(socks[0], client_name="bystander", fast_path=False)
        bystand(by, 1.0)  # warm
        res = {"idle": bystand(by, a.seconds)}
        for phase, target in (("load", 0), ("elsewhere", 1)):
            outs = [os.path.join(d, f"{name}-{phase}-{i}") for i in range(a.clients)]
            cmd = [sys.executable, __file__, "--load-child", socks[target], str(a.seconds + 1.5)]
            procs = [subprocess.Popen([*cmd, o]) for o in outs]
            time.sleep(1.0)  # the load's processes start and connect
            pid = brokers[target].pid
            c0, t0 = cpu_s(pid), time.monotonic()
            res[phase] = bystand(by, a.seconds)
            res[phase + "_cpu"] = (cpu_s(pid) - c0) / (time.monotonic() - t0)
            for q in procs:
                q.wait(timeout=60)
            res[phase + "_frames_s"] = sum(int(open(o).read()) for o in outs) / (a.seconds + 1.5)
        res["idle2"] = bystand(by, a.seconds)
        by.close()
        for setup in setups:
            setup.close()
        return res
    finally:
        for p in brokers:
            p.terminate()
            p.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline-tree", default="", help="another checkout of the project to run as 'baseline'")
    ap.add_argument("--load-child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.load_child:
        load_main(a.load_child[0], float(a.load_child[1]), a.load_child[2])
        return
    print(f"# {a.clients} load processes, {a.seconds:g} s a phase, {a.rounds} rounds, {os.cpu_count()} CPUs")
    print(
        "| mode | round | phase | calls | p50 ms | p99 ms | max ms | load frames/s | its broker's CPU | p99 / idle p99 |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    pooled: dict[str, dict[str, list[float]]] = {}
    phases = ("idle", "load", "elsewhere", "idle2")
    with tempfile.TemporaryDirectory(prefix="mb-fair-") as d:
        modes = {"current": ""}
        if a.baseline_tree:
            modes["baseline"] = baseline_path(a.baseline_tree, d)
        for r in range(a.rounds):
            for m in list(modes) if r % 2 == 0 else list(modes)[::-1]:
                res = one_mode(d, f"{m}-{r}", modes[m], a)
                base = pct(res["idle"], 0.99)
                for ph in phases:
                    xs = res[ph]
                    pooled.setdefault(m, {}).setdefault(ph, []).extend(xs)
                    fr = f"{res[ph + '_frames_s']:,.0f} | {res[ph + '_cpu']:.0%}" if ph + "_cpu" in res else " | "
                    print(
                        f"| {m} | {r} | {ph} | {len(xs)} | {statistics.median(xs):.2f} | {pct(xs, 0.99):.2f} "
                        f"| {max(xs):.2f} | {fr} | {pct(xs, 0.99) / base:.2f} |"
                    )
    print(
        "\n| mode | pooled p99 ms: idle | load | elsewhere | idle2 | load / idle | load / elsewhere | idle2 / idle (A/A) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for m, ph in pooled.items():
        i, lo, el, i2 = (pct(ph[k], 0.99) for k in phases)
        print(f"| {m} | {i:.2f} | {lo:.2f} | {el:.2f} | {i2:.2f} | {lo / i:.2f} | {lo / el:.2f} | {i2 / i:.2f} |")


if __name__ == "__main__":
    main()
