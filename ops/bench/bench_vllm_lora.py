"""Mixed multi-adapter workload on vLLM: throughput and time-to-first-token with vLLM's own
file-loaded LoRA and with adapters served zero-copy from the broker's pages, in one run.

Each mode is one engine on ``tiny_model.SMALL`` (random, ~26M parameters) with the same
``max_loras``/``max_lora_rank``. Throughput: all requests (base rows and ``--adapters``
adapters, round robin; prompts of 32..256 tokens) in one ``generate`` call, output tokens per
second of wall time. TTFT: requests one at a time with one output token, mean and median.
Also reported: each engine's LoRA weight memory (vLLM's slot buffers and adapter cache; the
zero-copy path's offset tables and token map) and whether greedy tokens agree across modes.

Run with the vLLM environment's Python:
    .venv-vllm/bin/python ops/bench/bench_vllm_lora.py --broker-python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "ops", "bench"))

from bench_vllm_kv import Engine as _KVEngine  # noqa: E402

MODES = ("vllm", "broker")


# ------------------------------------------------------------- engine process


def engine_main(a: argparse.Namespace) -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from memory_broker.clients.vllm.identity import broker_lora_request
    from memory_broker.clients.vllm.lora_patches import lora_memory

    names = a.lora_names.split(",")
    if a.mode == "broker":
        loras = {n: broker_lora_request(n) for n in names}
    else:
        loras = {n: LoRARequest(n, i + 1, os.path.join(a.lora_dir, n)) for i, n in enumerate(names)}
    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        enforce_eager=True,
        block_size=32,
        max_model_len=2048,
        max_num_seqs=32,
        seed=0,
        enable_prefix_caching=False,
        enable_lora=True,
        max_loras=a.max_loras,
        max_lora_rank=8,
    )
    # Warm-up with every adapter (loads them; the broker path acquires them).
    warm = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(
        [TokensPrompt(prompt_token_ids=[5] * 40)] * len(names), warm, lora_request=list(loras.values()), use_tqdm=False
    )
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        if cmd.get("op") == "memory":
            answers.write(json.dumps({"memory": llm.collective_rpc(lora_memory)[0]}) + "\n")
            continue
        reqs = [loras[n] if n else None for n in cmd["lora"]]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
        if cmd["op"] == "throughput":
            sp = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, lora_request=reqs, use_tqdm=False)
            wall = time.perf_counter() - t
            answers.write(json.dumps({"wall_s": wall, "tokens": [list(o.outputs[0].token_ids) for o in outs]}) + "\n")
        else:  # ttft
            sp = SamplingParams(temperature=0.0, max_tokens=1)
            ttft = []
            for p, r in zip(prompts, reqs):
                t = time.perf_counter()
                llm.generate([p], sp, lora_request=[r], use_tqdm=False)
                ttft.append(time.perf_counter() - t)
            answers.write(json.dumps({"ttft_s": ttft}) + "\n")


# ------------------------------------------------------------- driver


class Engine(_KVEngine):
    def __init__(self, args: list[str], log_path: str, extra_env: dict):
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="2",
            PYTHONUNBUFFERED="1",
            VLLM_ALLOW_INSECURE_SERIALIZATION="1",
            **extra_env,
        )
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

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.line()


def start_broker(python: str, tmp: str, adapter_dtype: str) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(tmp, "b.sock")
    logf = open(os.path.join(tmp, "broker.log"), "w")
    # Adapters stored in the engine's dtype: the kernels read x in the adapters' dtype.
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
            "512MiB",
            "--slab-size",
            "64MiB",
            "--adapter-dtype",
            adapter_dtype,
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


def run_mode(mode: str, a, model: str, tmp: str, names: list[str], sock: str, work) -> dict:
    args = [
        "--model",
        model,
        "--mode",
        mode,
        "--lora-dir",
        tmp,
        "--lora-names",
        ",".join(names),
        "--max-loras",
        str(a.max_loras),
        "--dtype",
        a.dtype,
    ]
    extra = {"MEMORY_BROKER_SOCKET": sock} if mode == "broker" else {}
    e = Engine(args, os.path.join(tmp, f"{mode}.log"), extra)
    try:
        t0 = time.monotonic()
        e.line()
        start_s = time.monotonic() - t0
        thr = e.ask(op="throughput", **work["throughput"])
        ttft = e.ask(op="ttft", **work["ttft"])["ttft_s"]
        mem = e.ask(op="memory")["memory"]
    finally:
        e.stop()
    out_tokens = sum(len(t) for t in thr["tokens"])
    return {
        "mode": mode,
        "start_s": start_s,
        "tokens_per_s": out_tokens / thr["wall_s"],
        "wall_s": thr["wall_s"],
        "ttft_mean_ms": 1000 * statistics.mean(ttft),
        "ttft_median_ms": 1000 * statistics.median(ttft),
        "memory": mem,
        "tokens": thr["tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="")
    ap.add_argument("--mode", default="vllm")
    ap.add_argument("--lora-dir", default="")
    ap.add_argument("--lora-names", default="")
    ap.add_argument("--broker-python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--max-loras", type=int, default=5, help="default: adapters + 1 (vLLM's CPU path is right then)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ttft-requests", type=int, default=10)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default="", help="append a markdown table to this file")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (engine and broker logs)")
    a = ap.parse_args()
    if a.engine:
        engine_main(a)
        return
    tmp = tempfile.mkdtemp(prefix="mb-bench-lora-", dir="/tmp")
    from memory_broker.clients.vllm import tiny_model

    model = tiny_model.build(os.path.join(tmp, "model"), config=tiny_model.SMALL)
    names = [f"a{i + 1}" for i in range(a.adapters)]
    for i, n in enumerate(names):
        tiny_model.build_lora(os.path.join(tmp, n), i + 1, config=tiny_model.SMALL)
    rng = random.Random(0)
    cycle = [None, *names]
    mix = [cycle[i % len(cycle)] for i in range(a.requests)]
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(32, 257))] for _ in range(a.requests)]
    work = {
        "throughput": {"prompts": prompts, "lora": mix, "max_tokens": a.max_tokens},
        "ttft": {"prompts": prompts[: a.ttft_requests], "lora": mix[: a.ttft_requests]},
    }
    broker, sock = start_broker(a.broker_python, tmp, a.dtype)
    rows = []
    try:
        reg = subprocess.run(
            [
                a.broker_python,
                "-c",
                "import sys; from memory_broker.clients import BrokerClient\n"
                "with BrokerClient.connect(sys.argv[1]) as c:\n"
                "    [c.register_adapter(n, p) for n, p in zip(sys.argv[2::2], sys.argv[3::2])]",
                sock,
                *[x for n in names for x in (n, os.path.join(tmp, n))],
            ],
            capture_output=True,
            text=True,
        )
        if reg.returncode:
            raise RuntimeError(f"registering the adapters failed: {reg.stderr}")
        for mode in a.modes.split(","):
            row = run_mode(mode, a, model, tmp, names, sock, work)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(30)
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    # Per request, where each mode's greedy tokens first leave the first mode's (None: never).
    diverge = {
        r["mode"]: [
            next((i for i, (x, y) in enumerate(zip(t, t0)) if x != y), None)
            for t, t0 in zip(r["tokens"], rows[0]["tokens"])
        ]
        for r in rows[1:]
    }
    agree = "; ".join(
        f"{m}: {sum(d is None for d in ds)} of {len(ds)} requests identical"
        + (
            f", the others first differ at output token {sorted(d for d in ds if d is not None)}"
            if not all(d is None for d in ds)
            else ""
        )
        for m, ds in diverge.items()
    )
    lines = [
        f"### vLLM mixed multi-adapter workload ({time.strftime('%Y-%m-%d')}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, vLLM CPU backend)",
        "",
        f"{a.requests} requests, {a.adapters} adapters (rank 8, q/k/v/o) and base rows round robin, prompts of "
        f"32..256 tokens, {a.max_tokens} output tokens each, one `generate` call; TTFT over the first "
        f"{a.ttft_requests} requests one at a time. Model tiny_model.SMALL {a.dtype}, max_loras {a.max_loras}, "
        f"max_lora_rank 8; modes in the order {a.modes}. Greedy tokens against {rows[0]['mode']}'s: {agree}.",
        "",
        "| LoRA path | output tokens/s | TTFT mean (ms) | TTFT median (ms) | slot buffers (bytes) | "
        "adapter cache (bytes) | zero-copy tables + token map (bytes) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r["memory"]
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:.0f} | {r['ttft_mean_ms']:.0f} | {r['ttft_median_ms']:.0f} | "
            f"{m['slot_buffer_bytes']} | {m['adapter_cache_bytes']} | {m['zero_copy_extra_bytes']} |"
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
        print(f"greedy tokens differ between modes ({agree})")


if __name__ == "__main__":
    main()
