"""Stands in for a tensor-parallel vLLM engine of size 2 over two per-GPU brokers: each run is
one process playing one part (a rank's worker half, or the engine core's scheduler half), as
vLLM runs them, driven without an engine. Run by tests/test_vllm_kv_tp.py in the vLLM
environment's Python; the device (CUDA_VISIBLE_DEVICES, the stand-in device table) and
MEMORY_BROKER_SOCKET come from the environment, so each process finds its brokers as the
connector does (``store.worker_broker`` / ``store.rank_brokers``).

    python vllm_tp_harness.py save RANK          # store PROMPT's blocks (and, rank 0 only, HALF's)
    python vllm_tp_harness.py schedule META_OUT  # look both prompts up; pickle PROMPT's load order
    python vllm_tp_harness.py load RANK META_IN  # a fresh worker loads them; check the bytes

Each prints one JSON line.
"""

from __future__ import annotations

import json
import pickle
import sys
from types import SimpleNamespace

import torch

from memory_broker.clients.vllm import identity, store
from memory_broker.clients.vllm.kv_records import BrokerKVMetadata, BrokerKVStats, SaveRequest
from memory_broker.clients.vllm.kv_scheduler import BrokerKVScheduler
from memory_broker.clients.vllm.kv_worker import BrokerKVWorker

BS = 16
NUM_BLOCKS = 8
LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]
FP = b"tp-harness-engine"
# Four full blocks and a partial one: vLLM computes the last token, so four blocks can load.
PROMPT = list(range(1000, 1000 + 4 * BS + 5))
# Stored by rank 0 only: a prefix one rank's broker lacks.
HALF = list(range(5000, 5000 + 4 * BS + 5))
SAVED_AT = [1, 2, 3, 4]  # the first pair's blocks of PROMPT in its KV cache
LOAD_AT = [5, 6, 7, 0]  # the second pair's


def chain(tokens: list[int]) -> list[bytes]:
    return identity.chain_hashes(identity.chain_root(FP), tokens, BS)


def kv_caches(rank: int, fill: bool) -> dict[str, torch.Tensor]:
    """vLLM's layout per layer, (2, blocks, block size, heads, head dim); each rank's shard
    differs from the other's (a block landing on the wrong rank shows)."""
    g = torch.Generator().manual_seed(100 + rank)
    out = {}
    for name in LAYERS:
        t = torch.zeros(2, NUM_BLOCKS, BS, 2, 8, dtype=torch.float16)
        if fill:
            t.copy_(torch.randn(t.shape, generator=g).to(torch.float16))
        out[name] = t
    return out


def request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=tokens,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
        cache_salt=None,
    )


def worker(rank: int) -> BrokerKVWorker:
    w = BrokerKVWorker(
        store.worker_broker(None, rank, client_name=f"tp-harness-{rank}"), rank, NUM_BLOCKS, BrokerKVStats()
    )
    return w


def save(rank: int) -> dict:
    w = worker(rank)
    w.register_kv_caches(kv_caches(rank, fill=True))
    saves = [SaveRequest("p", SAVED_AT, chain(PROMPT)[:4])]
    if rank == 0:
        saves.append(SaveRequest("h", [5, 6, 7, 0], chain(HALF)[:4]))
    meta = BrokerKVMetadata(saves=saves)
    for name in LAYERS:
        w.save_kv_layer(meta, name)
    w.wait_for_save()
    w.shutdown()  # the saver's thread commits what the step staged
    return {"socket": w.broker.socket, "gpu": w.broker.gpu_uuid, "stats": dict(w.stats.data)}


def schedule(meta_out: str) -> dict:
    brokers = store.rank_brokers(None, 2, client_name="tp-harness-scheduler")
    s = BrokerKVScheduler(brokers, FP, BS, 2, BrokerKVStats())
    half = s.get_num_new_matched_tokens(request("h", HALF), 0)
    hit = s.get_num_new_matched_tokens(request("p", PROMPT), 0)
    s.update_state_after_alloc(request("p", PROMPT), None, hit[0])
    out = SimpleNamespace(
        num_scheduled_tokens={"p": len(PROMPT) - hit[0]},
        scheduled_new_reqs=[SimpleNamespace(req_id="p", num_computed_tokens=hit[0])],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    )
    meta = s.build_connector_meta(out, SimpleNamespace(get_block_ids=lambda rid: (LOAD_AT + [3],)))
    with open(meta_out, "wb") as f:
        pickle.dump(meta, f)
    s.shutdown()
    return {"sockets": [b.socket for b in brokers], "hit": list(hit), "half": list(half), "loads": len(meta.loads)}


def load(rank: int, meta_in: str) -> dict:
    with open(meta_in, "rb") as f:
        meta = pickle.load(f)
    w = worker(rank)
    caches = kv_caches(rank, fill=False)
    w.register_kv_caches(caches)
    w.start_load_kv(meta)
    errors = sorted(w.get_block_ids_with_load_errors())
    mine, other = kv_caches(rank, fill=True), kv_caches(1 - rank, fill=True)
    same = all(
        torch.equal(caches[n][:, LOAD_AT].view(torch.uint8), mine[n][:, SAVED_AT].view(torch.uint8)) for n in LAYERS
    )
    other_rank = any(torch.equal(caches[n][:, LOAD_AT], other[n][:, SAVED_AT]) for n in LAYERS)
    untouched = all(not caches[n][:, [1, 2, 3, 4]].any() for n in LAYERS)
    return {
        "socket": w.broker.socket,
        "errors": errors,
        "bytes_equal": same,
        "other_rank_bytes": other_rank,
        "untouched": untouched,
        "stats": dict(w.stats.data),
    }


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "save":
        result = save(int(sys.argv[2]))
    elif mode == "schedule":
        result = schedule(sys.argv[2])
    else:
        result = load(int(sys.argv[2]), sys.argv[3])
    print(json.dumps(result))
