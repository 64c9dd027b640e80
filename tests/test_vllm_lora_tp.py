"""The LoRA plugin with tensor parallelism 2, zero-copy, over per-GPU brokers: vLLM's CPU build
runs ``--tensor-parallel-size 2`` (workers in processes, one CPU each); two host-arena brokers
with test UUIDs stand in for the two GPUs (as in test_vllm_kv_tp.py). The adapters are
registered once on every broker (``memory-broker adapters register --all``, what a TP user
does); each rank acquires them from its own GPU's broker, which lays out only that rank's slice
(q/k/v split by output rows, o_proj by input columns), and computes from those pages. Greedy
tokens of a mixed batch (base rows and three adapters) equal vLLM's own file-loaded LoRA with
TP 2. One reference engine and one broker engine, one after the other (~2-4 min on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, short_tmpdir
from test_multi_gpu import A, B, start_gpu_broker, table  # noqa: F401  (table: a fixture)
from test_vllm_kv import VLLM_PY, _toks
from test_vllm_lora import LoraEngine

from memory_broker.clients import BrokerClient
from memory_broker.clients.vllm import tiny_model
from memory_broker.proto.wire.layout import ModuleShard, shards_text

pytestmark = [
    pytest.mark.skipif(not os.path.exists(VLLM_PY), reason=f"no vLLM environment at {VLLM_PY} (`make vllm-venv`)"),
    pytest.mark.timeout(1800),
]

ADAPTERS = ("l1", "l2", "l3")
PROMPTS = [_toks(20), _toks(45), _toks(33), _toks(70), _toks(12), _toks(50), _toks(27)]
MIXED = [None, "l1", "l2", None, "l3", "l1", None]


def _rank_shard(rank: int) -> str:
    # Every LoRA module of vLLM's Llama (the adapters adapt q/k/v/o): q/k/v in the column-parallel
    # qkv_proj (2 KV heads: no replication at TP 2), gate/up in gate_up_proj, o/down row-parallel.
    mods = [("q_proj", False), ("k_proj", False), ("v_proj", False), ("o_proj", True)]
    mods += [("gate_proj", False), ("up_proj", False), ("down_proj", True)]
    return shards_text(ModuleShard(m, split, rank, 2) for m, split in mods)


def test_tp2_zero_copy_lora_gives_vllm_s_tokens_from_each_rank_s_broker(table, monkeypatch):  # noqa: F811
    tmp = short_tmpdir()
    model = os.path.join(tmp, "model")
    dirs = {n: os.path.join(tmp, n) for n in ADAPTERS}
    subprocess.run(
        [
            VLLM_PY,
            "-c",
            "import sys; from memory_broker.clients.vllm import tiny_model as t; t.build(sys.argv[1]); "
            "[t.build_lora(p, i + 1) for i, p in enumerate(sys.argv[2:])]",
            model,
            *dirs.values(),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    run_dir = short_tmpdir()
    brokers = [
        start_gpu_broker(run_dir, "0", "0", "--pool-size", "64MiB"),
        start_gpu_broker(run_dir, B, B, "--pool-size", "64MiB"),
    ]
    socks = [b.socket for b in brokers]
    engines: list = []
    try:
        # Registered once on every broker of the host, as a TP user does.
        for n, d in dirs.items():
            cli = [sys.executable, "-m", "memory_broker.broker.cli", "adapters", "register", n, d, "--all"]
            r = subprocess.run([*cli, "--run-dir", run_dir], cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0 and f"{A}: " in r.stdout and f"{B}: " in r.stdout, r.stdout + r.stderr
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"))
        files = [a for n in ADAPTERS for a in ("--lora", f"{n}={dirs[n]}")]
        ref = LoraEngine("ref-lora-tp2", tmp, model, *files, "--tp", "2")
        engines.append(ref)
        want = [o["tokens"] for o in ref.wait_ready().generate(PROMPTS, lora=MIXED)]
        base = [o["tokens"] for o in ref.generate(PROMPTS)]
        ref.stop()
        changed = [i for i, a in enumerate(MIXED) if a is not None and want[i] != base[i]]
        assert len(changed) >= 3, "the adapters do not change the tokens: the test would prove nothing"

        for s in socks:  # the arenas hold a slab before the engine maps them (its static buffers need one)
            with BrokerClient.connect(s, client_name="t") as c:
                c.acquire_adapters(["l1"]).release()
        brokered = [a for n in ADAPTERS for a in ("--broker-lora", n)]
        zc = LoraEngine("zc-lora-tp2", tmp, model, *brokered, "--tp", "2", socket=run_dir)
        engines.append(zc)
        got = [o["tokens"] for o in zc.wait_ready().generate(PROMPTS, lora=MIXED)]
        assert got == want
        assert [o["tokens"] for o in zc.generate(PROMPTS)] == base
        ranks = zc.op(op="lora_memory")["ranks"]
        assert len(ranks) == 2
        for r, mem in enumerate(ranks):
            assert mem["mode"] == "zero-copy" and mem["socket"] == socks[r], mem
            assert mem["shard"] == _rank_shard(r) and sorted(mem["held"]) == list(ADAPTERS), mem
            assert mem["slot_buffer_bytes"] == 0 and mem["adapter_cache_bytes"] == 0, mem
            # Decode steps ran on the static buffers a captured step reads.
            assert mem["static_max_tokens"] == 16 and mem["static_applies"] > 0, mem
            # Each rank holds its slice only: q/k/v's B and o_proj's A halved (float32 copies).
            cfg = tiny_model.LLAMA
            h, kv, rank = cfg["hidden_size"], cfg["hidden_size"] // cfg["num_attention_heads"] * 2, 8
            per_layer = rank * ((h + h // 2) + 2 * (h + kv // 2) + (h // 2 + h)) * 4
            assert mem["weight_bytes"] == len(ADAPTERS) * cfg["num_hidden_layers"] * per_layer, mem
        for s in socks:  # each broker's hot tier: the three copies of its rank's slice, and l1's own
            with BrokerClient.connect(s, client_name="t") as c:
                assert c.stats().adapters.hot == len(ADAPTERS) + 1
        log = open(zc.log_path).read()
        assert "zero-copy LoRA off" not in log
        assert (
            f"(tp rank 1) from the broker at {socks[1]}" in log and f"(tp rank 0) from the broker at {socks[0]}" in log
        )
    finally:
        for e in engines:
            e.stop()
        for b in brokers:
            b.stop()


def test_the_resolver_finds_a_name_registered_on_every_visible_gpu_s_broker(table, monkeypatch):  # noqa: F811
    """The OpenAI server's resolver with a directory of per-GPU brokers: a name resolves only
    when every running broker of the visible GPUs has it (one missing: not served, and said)."""
    tmp = short_tmpdir()
    d = os.path.join(tmp, "l1")
    subprocess.run(
        [
            VLLM_PY,
            "-c",
            "import sys; from memory_broker.clients.vllm import tiny_model as t; t.build_lora(sys.argv[1], 1)",
            d,
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    run_dir = short_tmpdir()
    brokers = [start_gpu_broker(run_dir, "0", "0"), start_gpu_broker(run_dir, B, B)]
    try:
        for i, b in enumerate(brokers):
            with BrokerClient.connect(b.socket, client_name="t") as c:
                c.register_adapter("both", d)
                if i == 0:
                    c.register_adapter("only-a", d)
        code = (
            "import sys, json; from memory_broker.clients.vllm.lora_resolver import broker_sockets, "
            "registered_everywhere as r; print(json.dumps([broker_sockets(sys.argv[1]), "
            "r(sys.argv[1], 'both'), r(sys.argv[1], 'only-a'), r(sys.argv[1], 'none')]))"
        )
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1")
        out = subprocess.run([VLLM_PY, "-c", code, run_dir], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        socks, both, only_a, none = json.loads(out.stdout.strip().splitlines()[-1])
        assert socks == [b.socket for b in brokers]
        assert (both, only_a, none) == (True, False, False)
        assert "registered on some brokers but not on" in out.stderr and "register --all" in out.stderr
        env["CUDA_VISIBLE_DEVICES"] = "0"  # an engine on GPU A only: A's broker is all it needs
        out = subprocess.run([VLLM_PY, "-c", code, run_dir], env=env, capture_output=True, text=True, timeout=300)
        assert json.loads(out.stdout.strip().splitlines()[-1])[1:] == [True, True, False], out.stderr[-3000:]
    finally:
        for b in brokers:
            b.stop()
