"""Shared-prefix workload over two vLLM engines per mode, the modes interleaved request by
request in one run: TTFT of local prefix-cache hits, of cross-engine hits and of misses with
no KV connector, with vLLM's file-based example connector, and with the memory-broker
connector.

Every mode has its own two engines, all started at once. The workload is ``--groups`` groups;
a group has its own 1,024-token system prompt and, per request, a new 64-token tail:

* engine 1 serves the group's first request: a **miss** (nothing holds the prefix);
* engine 2 serves the second: a **cross-engine** request (engine 1 computed the prefix; with
  the broker, engine 2 loads it; without a connector, engine 2 computes it again);
* then ``--hits`` requests, alternating engines: **local prefix-cache hits** (the engine's
  own prefix cache holds the prefix; a connector can only cost here).

Each request is sent to every mode before the next one, the order of the modes rotating
request by request, so load drifts on a shared machine hit every mode alike. TTFT is the
time of a one-token ``generate``; prefill computed is the prompt length minus vLLM's
``num_cached_tokens``. The model is ``tiny_model.SMALL`` (random, ~26M parameters, float32),
built offline. Prints, per mode and kind, the request count, median and p90 TTFT, and the
targets (local hits with the broker within 5% of none, median and p90; cross-engine hits at
least 3x faster than none).

Run with the vLLM environment's Python (``make bench-vllm``):
    .venv-vllm/bin/python ops/bench/bench_vllm_kv.py --broker-python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------- engine process


def engine_main(a: argparse.Namespace) -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if a.mode == "broker":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="MemoryBrokerConnector",
            kv_connector_module_path="memory_broker.clients.vllm.kv_connector",
            kv_role="kv_both",
            kv_connector_extra_config={"socket": a.socket},
            kv_load_failure_policy="recompute",
        )
    elif a.mode == "noop":  # vLLM's connector machinery alone (ops/bench/noop_kv_connector.py)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NoopConnector",
            kv_connector_module_path="noop_kv_connector",
            kv_role="kv_both",
        )
    elif a.mode == "file":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": a.storage},
        )
    llm = LLM(
        model=a.model,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=2048,
        max_num_seqs=8,
        seed=0,
        disable_hybrid_kv_cache_manager=True,
        # Six engines run at once: 256 MiB of KV each (16,384 tokens) holds a group's prefix.
        kv_cache_memory_bytes=256 << 20,
        **kw,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    # Warm-up on a prompt outside the workload.
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 40)], sp, use_tqdm=False)
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        out = []
        for p in cmd["prompts"]:
            t = time.perf_counter()
            o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
            out.append(
                {
                    "ttft_s": time.perf_counter() - t,
                    "prompt": len(p),
                    "cached": o.num_cached_tokens or 0,
                    "token": o.outputs[0].token_ids[0],
                }
            )
        answers.write(json.dumps({"results": out}) + "\n")


# ------------------------------------------------------------- driver


class Engine:
    def __init__(self, args: list[str], log_path: str):
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        here = os.path.dirname(os.path.abspath(__file__))  # for --modes ...,noop
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(log_path, "w") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--engine", *args],
                env=env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                start_new_session=True,
            )
        self.log_path = log_path

    def line(self, timeout: float = 1800) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                s = self.proc.stdout.readline()
                if s:
                    return json.loads(s)
                break
            if self.proc.poll() is not None:
                break
        raise RuntimeError(f"engine failed; see {self.log_path}")

    def run(self, prompts: list[list[int]]) -> list[dict]:
        self.proc.stdin.write(json.dumps({"prompts": prompts}) + "\n")
        self.proc.stdin.flush()
        return self.line()["results"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_broker(python: str, tmp: str) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(tmp, "b.sock")
    logf = open(os.path.join(tmp, "broker.log"), "w")
    proc = subprocess.Popen(
        [
            python,
            "-m",
            "memory_broker.broker.cli",
            "serve",
            "--socket",
            sock,
            "--arena",
            "host",
            "--state-dir",
            os.path.join(tmp, "state"),
            "--pool-size",
            "2GiB",
            "--page-size",
            "512KiB",
            "--slab-size",
            "64MiB",
        ],
        stdout=logf,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"broker did not start; see {tmp}/broker.log")
        time.sleep(0.1)
    time.sleep(1.0)
    return proc, sock


KINDS = ("local", "cross", "miss")


def workload(a: argparse.Namespace) -> list[tuple[int, str, list[int]]]:
    """(engine 0 or 1, kind, prompt) in order (see the module docstring)."""
    rng = random.Random(0)
    out = []
    for _ in range(a.groups):
        system = [rng.randrange(3, 512) for _ in range(a.prefix)]

        kinds = [(0, "miss"), (1, "cross")] + [(i % 2, "local") for i in range(a.hits)]
        for eng, kind in kinds:
            out.append((eng, kind, system + [rng.randrange(3, 512) for _ in range(a.tail)]))
    return out


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def run_interleaved(a, model: str, tmp: str, modes: list[str], broker_sock: str) -> dict[str, list[dict]]:
    """Every mode's two engines up at once; each request sent to every mode in turn."""
    engines: dict[str, list[Engine]] = {}
    try:
        for mode in modes:
            args = [
                "--model",
                model,
                "--mode",
                mode,
                "--socket",
                broker_sock,
                "--storage",
                os.path.join(tmp, f"kv-{mode}"),
            ]
            os.makedirs(os.path.join(tmp, f"kv-{mode}"), exist_ok=True)
            engines[mode] = [Engine(args, os.path.join(tmp, f"{mode}-{i}.log")) for i in (1, 2)]
        for es in engines.values():
            for e in es:
                e.line()
        results: dict[str, list[dict]] = {m: [] for m in modes}
        t0 = time.monotonic()
        for i, (eng, kind, prompt) in enumerate(workload(a)):
            for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                r = engines[mode][eng].run([prompt])[0]
                r.update(kind=kind, engine=eng + 1)
                results[mode].append(r)
            if i % 20 == 19:
                print(f"  {i + 1} requests per mode, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        return results
    finally:
        for es in engines.values():
            for e in es:
                e.stop()


def summary(mode: str, rs: list[dict]) -> dict:
    row = {"mode": mode, "prefill_computed": sum(r["prompt"] - r["cached"] for r in rs)}
    for kind in KINDS:
        ttft = [1000 * r["ttft_s"] for r in rs if r["kind"] == kind]
        row[kind] = {"n": len(ttft), "median_ms": statistics.median(ttft), "p90_ms": p90(ttft)} if ttft else None
    return row


def report(a, rows: list[dict], same: bool, wall_s: float) -> str:
    modes = [r["mode"] for r in rows]
    lines = [
        f"### vLLM shared-prefix workload, modes interleaved ({time.strftime('%Y-%m-%d')}, "
        f"{platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, vLLM CPU backend)",
        "",
        f"{a.groups} groups of a {a.prefix}-token system prompt: per group 1 miss (engine 1), 1 cross-engine request "
        f"(engine 2) and {a.hits} local prefix-cache hits (alternating engines), {a.tail}-token tails; each request "
        f"sent to every mode ({', '.join(modes)}) in a rotating order; model tiny_model.SMALL float32; "
        f"{wall_s:.0f} s of requests. Greedy first tokens identical across modes, request by request: {same}.",
        "",
        "| mode | local hits n | local median (ms) | local p90 (ms) | cross-engine n | cross median (ms) | cross p90 (ms) "
        "| misses n | miss median (ms) | miss p90 (ms) | prefill tokens computed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [r["mode"]]
        for kind in KINDS:
            k = r[kind]
            cells += [str(k["n"]), f"{k['median_ms']:.0f}", f"{k['p90_ms']:.0f}"] if k else ["0", "-", "-"]
        cells.append(str(r["prefill_computed"]))
        lines.append("| " + " | ".join(cells) + " |")
    by = {r["mode"]: r for r in rows}
    if "broker" in by and "none" in by:
        b, n = by["broker"], by["none"]
        lines += [
            "",
            f"Targets: local hits, broker / none: median {b['local']['median_ms'] / n['local']['median_ms']:.3f}, "
            f"p90 {b['local']['p90_ms'] / n['local']['p90_ms']:.3f} (target <= 1.05); cross-engine, none / broker: "
            f"median {n['cross']['median_ms'] / b['cross']['median_ms']:.2f}x, p90 "
            f"{n['cross']['p90_ms'] / b['cross']['p90_ms']:.2f}x (target >= 3x).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="")
    ap.add_argument("--mode", default="none")
    ap.add_argument("--socket", default="")
    ap.add_argument("--storage", default="")
    ap.add_argument("--broker-python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--groups", type=int, default=10, help="system prompts (a miss and a cross-engine request each)")
    ap.add_argument("--hits", type=int, default=20, help="local prefix-cache hits per group")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument(
        "--modes", default="none,file,broker", help="of none, file, broker, noop (a connector doing nothing)"
    )
    ap.add_argument("--out", default="", help="append a markdown table to this file")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (engine and broker logs)")
    a = ap.parse_args()
    if a.engine:
        engine_main(a)
        return
    tmp = tempfile.mkdtemp(prefix="mb-bench-vllm-", dir="/tmp")
    from memory_broker.clients.vllm import tiny_model

    model = tiny_model.build(os.path.join(tmp, "model"), config=tiny_model.SMALL)
    modes = a.modes.split(",")
    broker, sock = start_broker(a.broker_python, tmp)
    try:
        t = time.monotonic()
        results = run_interleaved(a, model, tmp, modes, sock)
        wall = time.monotonic() - t
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(30)
    rows = [summary(m, results[m]) for m in modes]
    for r in rows:
        print(json.dumps(r), flush=True)
    tokens = [[r["token"] for r in results[m]] for m in modes]
    same = all(t == tokens[0] for t in tokens)
    text = report(a, rows, same, wall)
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text)
    if a.keep:
        print(f"logs in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    if not same:
        sys.exit("greedy tokens differ between modes")


if __name__ == "__main__":
    main()
