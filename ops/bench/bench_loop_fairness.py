#!/usr/bin/env python3
"""A bystander's gRPC latency under a saturating step load (issue 48, item 4).

    python ops/bench/bench_loop_fairness.py [--clients 8] [--seconds 8] [--rounds 2] [--baseline-tree DIR]

For each broker (this tree's, ``current``; with ``--baseline-tree``, also one run from another
checkout of the project, ``baseline``, e.g. ``git worktree add /tmp/base e384307``: the last
commit with the step channel's own thread; its native modules are copied from this tree), in
rounds that alternate between them, a fresh broker on the host arena; a bystander session calls ``stats()`` over gRPC
every 5 ms, first with nothing else running (``idle``), then while ``--clients`` processes send
step frames (a 16-key lookup each, no pin, one frame in flight per process) as fast as the
broker answers (``load``), then idle again (``idle2``: the A/A control). Prints the bystander's
p50/p99/max per phase, the load's frames per second, and the ratio of the load's p99 to the
first idle phase's, beside the same ratio for the second idle phase.
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
    sock = os.path.join(d, name + ".sock")
    old = os.environ.get("PYTHONPATH")
    if pythonpath:
        os.environ["PYTHONPATH"] = pythonpath
    try:
        p = start_broker(sock, os.path.join(d, name + "-state"), page_size="512KiB", pool="1GiB")
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    try:
        setup = BrokerClient.connect(sock, client_name="setup")
        setup.allocate([Spec(1, content_type="kv_cache", key=k) for k in KEYS])
        by = BrokerClient.connect(sock, client_name="bystander", fast_path=False)
        bystand(by, 1.0)  # warm
        res = {"idle": bystand(by, a.seconds)}
        outs = [os.path.join(d, f"{name}-load-{i}") for i in range(a.clients)]
        procs = [
            subprocess.Popen([sys.executable, __file__, "--load-child", sock, str(a.seconds + 1.5), o]) for o in outs
        ]
        time.sleep(1.0)  # the load's processes start and connect
        c0, t0 = cpu_s(p.pid), time.monotonic()
        res["load"] = bystand(by, a.seconds)
        res["broker_cpu"] = (cpu_s(p.pid) - c0) / (time.monotonic() - t0)
        for q in procs:
            q.wait(timeout=60)
        res["frames_s"] = sum(int(open(o).read()) for o in outs) / (a.seconds + 1.5)
        res["idle2"] = bystand(by, a.seconds)
        by.close()
        setup.close()
        return res
    finally:
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
    print("| mode | round | phase | calls | p50 ms | p99 ms | max ms | load frames/s | broker CPU | p99 / idle p99 |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    pooled: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="mb-fair-") as d:
        modes = {"current": ""}
        if a.baseline_tree:
            modes["baseline"] = baseline_path(a.baseline_tree, d)
        for r in range(a.rounds):
            for m in list(modes) if r % 2 == 0 else list(modes)[::-1]:
                res = one_mode(d, f"{m}-{r}", modes[m], a)
                base = pct(res["idle"], 0.99)
                for ph in ("idle", "load", "idle2"):
                    xs = res[ph]
                    pooled.setdefault(m, {}).setdefault(ph, []).extend(xs)
                    fr = f"{res['frames_s']:,.0f} | {res['broker_cpu']:.0%}" if ph == "load" else " | "
                    print(
                        f"| {m} | {r} | {ph} | {len(xs)} | {statistics.median(xs):.2f} | {pct(xs, 0.99):.2f} "
                        f"| {max(xs):.2f} | {fr} | {pct(xs, 0.99) / base:.2f} |"
                    )
    print("\n| mode | pooled idle p99 | pooled load p99 | load / idle | idle2 / idle (A/A) |")
    print("|---|---:|---:|---:|---:|")
    for m, ph in pooled.items():
        i, lo, i2 = (pct(ph[k], 0.99) for k in ("idle", "load", "idle2"))
        print(f"| {m} | {i:.2f} | {lo:.2f} | {lo / i:.2f} | {i2 / i:.2f} |")


if __name__ == "__main__":
    main()
