"""What makes two engines' KV for the same tokens interchangeable, as bytes a key can carry.

The KV connector keys every full token block with a chained hash that starts from a root
covering the engine (model, weights' config, dtype, KV layout, block size, tensor-parallel
size), the LoRA adapter and the cache salt; this module owns that root and the chain, and
the LoRA identity that the engine's adapter integration shares. It imports neither vLLM nor
torch: it reads vLLM's objects by attribute.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

# Bump when the meaning of a key or the byte layout of a stored block changes: old objects
# then stop matching instead of being read wrongly. 2: a block's layer holds its elements in
# the KV cache's memory order (``BlockMover``), no longer in ``select(block_dim, block)``'s
# logical order (they differ for FlashInfer's HND strides and vLLM 0.32's permuted views).
KEY_VERSION = 2
KEY_PREFIX = b"vllm-kv1:"


def _digest(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def lora_identity(lora_request: Any) -> bytes:
    """The adapter a request runs with, as bytes; ``b""`` for the base model.

    Covers the adapter's name, its integer id and its path: the same name served from
    another directory, or another id, is another adapter (never shares KV). An adapter
    served from the broker (``broker://<adapter_id>``) is its name and broker id alone. Accepts a
    ``vllm.lora.request.LoRARequest`` or anything with ``lora_name``/``lora_int_id``/
    ``lora_path``, or a plain ``(name, int_id, path)`` tuple.
    """
    if lora_request is None:
        return b""
    if isinstance(lora_request, tuple):
        name, int_id, path = lora_request
    else:
        name = lora_request.lora_name
        int_id = lora_request.lora_int_id
        path = getattr(lora_request, "lora_path", "") or ""
    if not name:
        raise ValueError("a LoRA identity needs the adapter's name")
    if str(path).startswith(BROKER_SCHEME):
        # An adapter from the broker is its broker id, whatever integer id the engine gave it
        # (the OpenAI server numbers adapters in the order it resolves them): every engine
        # serving it from the broker shares its KV.
        return _canonical({"lora": str(name), "broker": str(path)[len(BROKER_SCHEME) :]})
    return _canonical({"lora": str(name), "id": int(int_id), "path": str(path)})


def engine_identity(vllm_config: Any, kv_cache_config: Any, vllm_version: str, device_type: str) -> dict:
    """Everything about an engine that changes the bytes of a token's KV, as plain data.

    Model (name or path, revision, a digest of its config, quantization, dtype), the KV
    cache's dtype and layout (per group: spec type, block size, heads, head size, dtype,
    layer names), tensor-parallel size, the vLLM version and the device type. Raises
    ``ValueError`` for what the connector cannot key safely (several KV cache groups).
    """
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    hf = getattr(mc, "hf_config", None)
    hf_json = hf.to_json_string(use_diff=False) if hf is not None and hasattr(hf, "to_json_string") else ""
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        groups.append(
            {
                "type": type(spec).__name__,
                "block_size": getattr(spec, "block_size", None),
                "num_kv_heads": getattr(spec, "num_kv_heads", None),
                "head_size": getattr(spec, "head_size", None),
                "dtype": str(getattr(spec, "dtype", None)),
                "layers": list(g.layer_names),
            }
        )
    if len(groups) != 1:
        raise ValueError(
            f"the memory-broker KV connector handles models with one KV cache group; this one has "
            f"{len(groups)} ({[g['type'] for g in groups]}): run it without the connector"
        )
    attn = getattr(vllm_config, "attention_config", None)
    return {
        "key_version": KEY_VERSION,
        "model": str(mc.model),
        "revision": getattr(mc, "revision", None),
        "hf_config": hashlib.sha256(hf_json.encode()).hexdigest(),
        "quantization": getattr(mc, "quantization", None),
        "dtype": str(mc.dtype),
        "cache_dtype": str(cc.cache_dtype),
        "block_size": cc.block_size,
        "groups": groups,
        "attention_backend": str(getattr(attn, "backend", None)),
        "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", None)),
        "tensor_parallel_size": pc.tensor_parallel_size,
        "pipeline_parallel_size": pc.pipeline_parallel_size,
        "vllm": vllm_version,
        "device": device_type,
    }


def engine_fingerprint(identity: dict) -> bytes:
    return _digest(b"memory-broker vllm engine", _canonical(identity))


def chain_root(engine_fp: bytes, lora: bytes = b"", cache_salt: str | None = None) -> bytes:
    """The hash every request's block chain starts from."""
    return _digest(b"root", engine_fp, lora, (cache_salt or "").encode())


def chain_hashes(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """One hash per full block of ``token_ids``: block i's hash covers blocks 0..i and the root."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(token_ids) // block_size
    toks = np.asarray(token_ids[: n * block_size], dtype="<i8").reshape(n, block_size) if n else None
    out: list[bytes] = []
    prev = root
    for i in range(n):
        prev = _digest(prev, toks[i].tobytes())
        out.append(prev)
    return out


def block_key(chain_hash: bytes, tp_rank: int = 0) -> bytes:
    """The broker key of one block's KV as tensor-parallel rank ``tp_rank`` holds it."""
    return KEY_PREFIX + _digest(chain_hash, tp_rank.to_bytes(4, "little"))


# A LoRARequest whose lora_path has this prefix names an adapter registered in the broker;
# the worker-side loader (lora_patches) takes it from the broker's pages, never from a path.
BROKER_SCHEME = "broker://"


def broker_adapter_id(lora_path: str | None) -> str | None:
    """The broker adapter id a ``broker://<adapter_id>`` LoRA path names, else None."""
    if lora_path and lora_path.startswith(BROKER_SCHEME):
        aid = lora_path[len(BROKER_SCHEME) :]
        if not aid:
            raise ValueError(f"{lora_path!r} names no adapter: use {BROKER_SCHEME}<adapter_id>")
        return aid
    return None


def broker_lora_int_id(adapter_id: str) -> int:
    """A stable positive 31-bit integer id for an adapter id (vLLM's ``lora_int_id``): every
    engine and every restart gives one adapter the same number, so KV keys and LoRA slots agree."""
    n = int.from_bytes(hashlib.sha256(b"memory-broker lora " + adapter_id.encode()).digest()[:4], "little")
    return (n & 0x7FFFFFFF) or 1


def broker_lora_request(adapter_id: str, lora_int_id: int | None = None):
    """A ``vllm.lora.request.LoRARequest`` for an adapter registered in the broker (imports vLLM)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter_id, lora_int_id or broker_lora_int_id(adapter_id), BROKER_SCHEME + adapter_id)
