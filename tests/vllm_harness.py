"""A vLLM engine in its own process, driven over stdin/stdout by tests/test_vllm_kv.py.

Runs under the vLLM environment's Python (.venv-vllm), not the main one: it builds an
offline ``LLM`` on the tiny model (with or without the memory-broker connector) and
answers one JSON line per command. vLLM's own output goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def drain_kv_stores(worker) -> bool:
    """In a worker (``LLM.collective_rpc``): wait until the connector's saver has committed
    every staged block (the stores run after the step, on their own thread)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker._saver.drain(120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--connector", default="none", help="none | broker | file:DIR")
    ap.add_argument("--socket", default="")
    ap.add_argument("--lora", action="append", default=[], help="NAME=PATH (repeat)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--broker-lora", action="append", default=[], help="ADAPTER_ID served from the broker (repeat)")
    ap.add_argument("--max-loras", type=int, default=0, help="default: one more than the adapters named")
    ap.add_argument("--max-lora-rank", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (workers in processes)")
    ap.add_argument("--kv-bytes", type=int, default=0, help="kv_cache_memory_bytes (0: VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument(
        "--engine-pool", default="", help="the connector's engine_pool config, JSON (needs --connector broker)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument(
        "--uni", action="store_true", help="engine core and worker in this process (the engine pool's need)"
    )
    ap.add_argument("--no-share-prefixes", action="store_true", help="the connector's engine pool only")
    ap.add_argument("--stats", action="store_true", help="keep vLLM's stats: per-request TTFT, the 'metrics' op")
    a = ap.parse_args()

    # Answers go to the real stdout; everything vLLM prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The "drain" and "lora_memory" ops send a function to the workers (LLM.collective_rpc).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    kw: dict = {}
    if a.connector == "broker":
        extra = {"socket": a.socket} if a.socket else {}
        if a.engine_pool:
            extra["engine_pool"] = json.loads(a.engine_pool)
        if a.no_share_prefixes:
            extra["share_prefixes"] = False
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="MemoryBrokerConnector",
            kv_connector_module_path="memory_broker.clients.vllm.kv_connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
    elif a.connector.startswith("file:"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": a.connector[5:]},
        )
    loras = {}
    for i, item in enumerate(a.lora):
        name, path = item.split("=", 1)
        loras[name] = LoRARequest(name, i + 1, path)
    if a.broker_lora:
        from memory_broker.clients.vllm.identity import broker_lora_request

        for aid in a.broker_lora:
            loras[aid] = broker_lora_request(aid)
    if loras:
        # By default one slot more than needed: the CPU backend gives base rows the last slot's
        # adapter when every slot is taken (FIELD-NOTES).
        kw.update(enable_lora=True, max_loras=a.max_loras or len(loras) + 1, max_lora_rank=a.max_lora_rank)
    if a.kv_bytes:
        kw["kv_cache_memory_bytes"] = a.kv_bytes
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would replace kv_cache_memory_bytes on the CPU
    if a.uni:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.monotonic()
    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        enforce_eager=True,
        block_size=32,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        disable_log_stats=not a.stats,
        seed=0,
        enable_prefix_caching=not a.no_prefix_caching,
        disable_hybrid_kv_cache_manager=True,
        tensor_parallel_size=a.tp,
        distributed_executor_backend="mp" if a.tp > 1 else ("uni" if a.uni else None),
        **kw,
    )
    answers.write(json.dumps({"ready": True, "start_s": time.monotonic() - t0, "pid": os.getpid()}) + "\n")

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        if cmd.get("op") == "lora_memory":
            from memory_broker.clients.vllm.lora_patches import lora_memory

            every = llm.collective_rpc(lora_memory)  # one per worker (tensor-parallel rank)
            answers.write(json.dumps({"memory": every[0], "ranks": every}) + "\n")
            continue
        if cmd.get("op") == "metrics":
            found = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if hasattr(m, "value")}
            answers.write(json.dumps({"metrics": found}) + "\n")
            continue
        if cmd.get("op") == "drain":
            answers.write(json.dumps({"drained": llm.collective_rpc(drain_kv_stores)}) + "\n")
            continue
        if cmd.get("op") == "remove_lora":
            ok = llm.llm_engine.remove_lora(loras[cmd["name"]].lora_int_id)
            answers.write(json.dumps({"removed": bool(ok)}) + "\n")
            continue
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
        names = cmd.get("lora") or [None] * len(prompts)
        sp = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 8), ignore_eos=True)
        t = time.monotonic()
        outs = llm.generate(prompts, sp, lora_request=[loras[n] if n else None for n in names], use_tqdm=False)
        res = [
            {
                "tokens": list(o.outputs[0].token_ids),
                "cached": o.num_cached_tokens or 0,
                "ttft_s": getattr(o.metrics, "first_token_latency", None) if o.metrics is not None else None,
            }
            for o in outs
        ]
        answers.write(json.dumps({"outputs": res, "s": time.monotonic() - t}) + "\n")
    answers.write(json.dumps({"bye": True}) + "\n")


if __name__ == "__main__":
    main()
