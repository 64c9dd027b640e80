"""Shared-prefix workload over two vLLM engines: TTFT and prefill tokens computed with no KV
connector, with vLLM's file-based example connector, and with the memory-broker connector,
in one run.

32 requests (by default) share a 1,024-token system prompt and differ in a 64-token tail;
engine 1 serves the first half one request at a time, then engine 2 the second half (so
engine 2 can find engine 1's prefix). TTFT is the time of a one-token ``generate`` of one
request; prefill computed is the prompt length minus vLLM's ``num_cached_tokens``. The model
is ``tiny_model.SMALL`` (random, ~26M parameters, float32), built offline.

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
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2", PYTHONUNBUFFERED="1")
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


def run_mode(mode: str, a, model: str, tmp: str, halves, broker_sock: str) -> dict:
    args = ["--model", model, "--mode", mode, "--socket", broker_sock, "--storage", os.path.join(tmp, f"kv-{mode}")]
    os.makedirs(os.path.join(tmp, f"kv-{mode}"), exist_ok=True)
    engines = [Engine(args, os.path.join(tmp, f"{mode}-{i}.log")) for i in (1, 2)]
    try:
        for e in engines:
            e.line()
        results = []
        for e, prompts in zip(engines, halves):
            results.append(e.run(prompts))
    finally:
        for e in engines:
            e.stop()
    flat = [r for half in results for r in half]
    ttft = [r["ttft_s"] for r in flat]
    return {
        "mode": mode,
        "requests": len(flat),
        "ttft_mean_ms": 1000 * statistics.mean(ttft),
        "ttft_median_ms": 1000 * statistics.median(ttft),
        "ttft_engine2_first_ms": 1000 * results[1][0]["ttft_s"],
        "prefill_computed": sum(r["prompt"] - r["cached"] for r in flat),
        "prompt_tokens": sum(r["prompt"] for r in flat),
        "cached_engine2": sum(r["cached"] for r in results[1]),
        "tokens": [r["token"] for r in flat],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="")
    ap.add_argument("--mode", default="none")
    ap.add_argument("--socket", default="")
    ap.add_argument("--storage", default="")
    ap.add_argument("--broker-python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--modes", default="none,file,broker")
    ap.add_argument("--out", default="", help="append a markdown table to this file")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (engine and broker logs)")
    a = ap.parse_args()
    if a.engine:
        engine_main(a)
        return
    tmp = tempfile.mkdtemp(prefix="mb-bench-vllm-", dir="/tmp")
    from memory_broker.clients.vllm import tiny_model

    model = tiny_model.build(os.path.join(tmp, "model"), config=tiny_model.SMALL)
    rng = random.Random(0)
    system = [rng.randrange(3, 512) for _ in range(a.prefix)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(a.tail)] for _ in range(a.requests)]
    halves = [prompts[: a.requests // 2], prompts[a.requests // 2 :]]
    broker, sock = start_broker(a.broker_python, tmp)
    rows = []
    try:
        for mode in a.modes.split(","):
            t = time.monotonic()
            row = run_mode(mode, a, model, tmp, halves, sock)
            row["wall_s"] = time.monotonic() - t
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(30)
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    lines = [
        f"### vLLM shared-prefix workload ({time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, vLLM CPU backend)",
        "",
        f"{a.requests} requests, a {a.prefix}-token shared system prompt + {a.tail}-token tails, two engines "
        f"(engine 1 serves the first half, then engine 2 the rest), one request at a time, model tiny_model.SMALL "
        f"float32; modes in the order {a.modes}. Greedy first tokens identical across modes: {same}.",
        "",
        "| connector | TTFT mean (ms) | TTFT median (ms) | engine 2's first TTFT (ms) | prefill tokens computed | of prompt tokens |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['ttft_mean_ms']:.0f} | {r['ttft_median_ms']:.0f} | "
            f"{r['ttft_engine2_first_ms']:.0f} | {r['prefill_computed']} | {r['prompt_tokens']} |"
        )
    text = "\n".join(lines) + "\n"
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
