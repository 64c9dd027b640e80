"""The KV connector with tensor parallelism over per-GPU brokers: two host-arena brokers with
test UUIDs stand in for two GPUs (as in test_multi_gpu.py), and tests/vllm_tp_harness.py plays
a TP-2 engine's processes without a vLLM engine (tokens need an engine; this checks bytes):
two worker halves (ranks 0 and 1, each its own process and CUDA_VISIBLE_DEVICES) store a
prompt's blocks; the scheduler half (its own process, seeing both GPUs) finds the prefix on
both ranks' brokers and misses one that only rank 0 stored; a second pair of workers loads the
first pair's blocks, each rank from its own broker, byte for byte. Then vLLM's CPU build with
``--tensor-parallel-size 2`` runs the connector for real: identical tokens, and a second engine
loads the first one's prefix across both ranks."""

from __future__ import annotations

import json
import os

import pytest
from conftest import ROOT, run_side_by_side, short_tmpdir
from test_multi_gpu import A, B, start_gpu_broker, table  # noqa: F401  (table: a fixture)

from memory_broker.clients.client import BrokerClient
from memory_broker.clients.vllm import identity
from memory_broker.clients.vllm.store import BrokerKV, rank_socket
from memory_broker.proto.wire.gpus import rank_gpu_uuid, visible_gpu_uuids

VLLM_PY = os.environ.get("MEMORY_BROKER_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")
HARNESS = os.path.join(ROOT, "tests", "vllm_tp_harness.py")
BS = 16
FP = b"tp-harness-engine"
PROMPT = list(range(1000, 1000 + 4 * BS + 5))
HALF = list(range(5000, 5000 + 4 * BS + 5))


def keys(tokens: list[int], rank: int) -> list[bytes]:
    return [identity.block_key(h, rank) for h in identity.chain_hashes(identity.chain_root(FP), tokens, BS)[:4]]


def test_visible_gpus_apply_cuda_visible_devices_to_the_table(table, monkeypatch):  # noqa: F811
    assert visible_gpu_uuids() == [A, B]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"1,{A}")
    assert visible_gpu_uuids() == [B, A]
    assert rank_gpu_uuid(0) == B and rank_gpu_uuid(1) == A and rank_gpu_uuid(2) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # a launcher that gives each rank one GPU
    assert rank_gpu_uuid(1) == B
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,1")  # CUDA stops at an invalid entry
    assert visible_gpu_uuids() == [A]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpu_uuids() == [] and rank_gpu_uuid(0) is None


def test_rank_sockets_name_each_rank_s_broker_or_the_one_socket(table, tmp_path, monkeypatch):  # noqa: F811
    run_dir = tmp_path / "run"
    (run_dir / A).mkdir(parents=True)
    assert rank_socket(str(run_dir), B, 1) == (str(run_dir / B / "broker.sock"), B)
    monkeypatch.setenv("MEMORY_BROKER_SOCKET", str(run_dir))
    assert rank_socket(None, A, 0) == (str(run_dir / A / "broker.sock"), A)
    with pytest.raises(ValueError, match="rank 1's GPU is unknown"):
        rank_socket(None, None, 1)
    plain = str(tmp_path / "one.sock")
    assert rank_socket(plain, B, 1) == (plain, None)  # one socket: every rank, today's behaviour
    monkeypatch.setenv("MEMORY_BROKER_SOCKET", plain)
    assert rank_socket(None, B, 1) == (plain, None)


def test_a_broker_of_another_gpu_is_refused(table):  # noqa: F811
    run_dir = short_tmpdir()
    b = start_gpu_broker(run_dir, "0", "0")
    try:
        wrong = BrokerKV(b.socket, gpu_uuid=B, retry_s=60)
        assert wrong.client() is None and wrong.errors == 1  # a misnamed directory: no session
        right = BrokerKV(b.socket, gpu_uuid=A)
        assert right.client() is not None
        right.close()
    finally:
        b.stop()


def start_pair(run_dir: str, *extra: str) -> list:
    """GPU 0's and GPU B's brokers; if the second will not start, the first is stopped too."""
    first = start_gpu_broker(run_dir, "0", "0", *extra)
    try:
        return [first, start_gpu_broker(run_dir, B, B, *extra)]
    except BaseException:
        first.stop()
        raise


@pytest.mark.skipif(not os.path.exists(VLLM_PY), reason=f"no vLLM environment at {VLLM_PY} (`make vllm-venv`)")
@pytest.mark.timeout(900)  # five processes importing vLLM (two pairs side by side): 20-40 s each, loaded
def test_tp2_ranks_store_and_load_through_their_own_gpu_brokers(table, tmp_path):  # noqa: F811
    run_dir = short_tmpdir()
    brokers = start_pair(run_dir)
    socks = [os.path.join(run_dir, A, "broker.sock"), os.path.join(run_dir, B, "broker.sock")]
    base = dict(os.environ, MEMORY_BROKER_SOCKET=run_dir)

    def run(*jobs: tuple[list[str], str]) -> list[dict]:
        """Each (harness arguments, CUDA_VISIBLE_DEVICES) side by side (each imports vLLM:
        20-40 s); their answers (each one's last line), in order."""
        outs = run_side_by_side(
            [(str(args), [VLLM_PY, HARNESS, *args], dict(base, CUDA_VISIBLE_DEVICES=v)) for args, v in jobs], 300
        )
        return [json.loads(out.strip().splitlines()[-1]) for out in outs]

    try:
        # Each rank's worker sees only its own GPU (as device 0).
        saved = run((["save", "0"], "0"), (["save", "1"], "1"))
        assert [s["socket"] for s in saved] == socks and [s["gpu"] for s in saved] == [A, B]
        assert saved[0]["stats"]["stored_blocks"] == 8 and saved[1]["stats"]["stored_blocks"] == 4
        c0, c1 = BrokerClient.connect(socks[0]), BrokerClient.connect(socks[1])
        try:
            # Rank r's blocks landed only in broker r.
            assert len(c0.lookup(keys(PROMPT, 0), pin=False)) == 4
            assert len(c1.lookup(keys(PROMPT, 1), pin=False)) == 4
            assert c0.lookup(keys(PROMPT, 1), pin=False) == [] and c1.lookup(keys(PROMPT, 0), pin=False) == []
            # HALF is on rank 0's broker only.
            assert len(c0.lookup(keys(HALF, 0), pin=False)) == 4 and c1.lookup(keys(HALF, 1), pin=False) == []
        finally:
            c0.close()
            c1.close()

        # The scheduler (engine core) sees both GPUs; rank r's broker is the r-th visible one's.
        meta = str(tmp_path / "meta.pkl")
        (sched,) = run((["schedule", meta], "0,1"))
        assert sched["sockets"] == socks
        assert sched["hit"] == [4 * BS, False]  # stored by both ranks: a hit
        assert sched["half"] == [0, False]  # missing on rank 1's broker: a miss
        assert sched["loads"] == 1

        # A second pair of workers (seeing both GPUs, each on its rank's device) loads the blocks.
        loads = run((["load", "0", meta], "0,1"), (["load", "1", meta], "0,1"))
        for rank, got in enumerate(loads):
            assert got["socket"] == socks[rank]
            assert got["errors"] == [] and got["stats"]["loaded_blocks"] == 4, got
            assert got["bytes_equal"] and not got["other_rank_bytes"] and got["untouched"], got
    finally:
        for b in brokers:
            b.stop()


@pytest.mark.skipif(not os.path.exists(VLLM_PY), reason=f"no vLLM environment at {VLLM_PY} (`make vllm-venv`)")
@pytest.mark.timeout(1800)
def test_a_tp2_vllm_engine_gives_identical_tokens_and_a_second_one_loads_both_ranks(table, monkeypatch, vllm_shared):  # noqa: F811
    """vLLM's CPU build with ``--tensor-parallel-size 2`` (workers in processes, one CPU each):
    tokens as without the connector, and a second engine loads the first one's prefix, each
    rank from its own broker."""
    from test_vllm_kv import Engine

    tmp = short_tmpdir()
    model = vllm_shared.build().model
    run_dir = short_tmpdir()
    brokers = start_pair(run_dir, "--pool-size", "32MiB")
    socks = [b.socket for b in brokers]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("MEMORY_BROKER_SOCKET", run_dir)
    # vLLM's CPU workers bind their threads to NUMA nodes; on a one-node machine, one CPU each.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"))
    prompts = [[(i * 7) % 400 + 5 for i in range(140)], [(i * 11) % 400 + 5 for i in range(100)]]
    engines: list = []
    try:
        ref = Engine("ref-tp2", tmp, model, "--tp", "2")
        a = Engine("a-tp2", tmp, model, "--tp", "2", "--connector", "broker")
        engines += [ref, a]
        want = [o["tokens"] for o in ref.wait_ready().generate(prompts)]
        ref.stop()
        out_a = a.wait_ready().generate(prompts)
        assert [o["tokens"] for o in out_a] == want and [o["cached"] for o in out_a] == [0, 0]
        a.stop()
        stored = []
        for s in socks:
            c = BrokerClient.connect(s)
            try:
                stored.append(sum(x.objects for x in c.stats().by_content if x.content_type == 1))
            finally:
                c.close()
        assert stored == [7, 7], stored  # 4 + 3 full blocks, each rank's in its own broker
        b = Engine("b-tp2", tmp, model, "--tp", "2", "--connector", "broker")
        engines.append(b)
        out_b = b.wait_ready().generate(prompts)
        assert [o["tokens"] for o in out_b] == want
        assert [o["cached"] for o in out_b] == [128, 96], out_b  # every full block below the last token
        log = open(b.log_path).read()
        assert f"tp rank 1) on broker {socks[1]}" in log and f"tp rank 0) on broker {socks[0]}" in log
    finally:
        for e in engines:
            e.stop()
        for br in brokers:
            br.stop()
