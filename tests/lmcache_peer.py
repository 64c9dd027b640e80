"""An LMCache node's storage side, for tests/test_tier_lmcache.py: run by the python of
LMCache's own environment (``make lmcache-venv``), never the product's; it imports nothing of
the broker. It drives LMCache 0.5.6's own code: its ``TokenHasher`` (the chunk hashes), its
``ObjectKey`` and RESP L2 adapter (the key's serde, and the native Redis/Valkey connector that
stores and loads a chunk's bytes), and prints one JSON line.

    python lmcache_peer.py keys  '<json: model, kv_rank, tokens>'
    python lmcache_peer.py put   '<json: port, model, kv_rank, tokens, shape, dtype, seed>'
    python lmcache_peer.py get   '<json: port, model, kv_rank, tokens, shape, dtype>'

``put`` stores one chunk per full 256 tokens, each a tensor of ``shape``/``dtype`` from a
generator seeded with ``seed`` and the chunk's index, and prints the keys and each value's
sha256; ``get`` looks them up and loads those found (as LMCache's server does), and prints
which were found, which of those loaded, and their sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import _object_key_to_string  # noqa: E402
from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import (  # noqa: E402
    RESPL2AdapterConfig,
    _create_resp_l2_adapter,
)
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402
from lmcache.v1.multiprocess.token_hasher import TokenHasher  # noqa: E402


def object_keys(a: dict) -> list[ObjectKey]:
    hashes = TokenHasher(chunk_size=256, hash_algorithm="blake3").compute_chunk_hashes(a["tokens"])
    return [ObjectKey(chunk_hash=h, model_name=a["model"], kv_rank=a["kv_rank"]) for h in hashes]


def memory_obj(t: torch.Tensor) -> TensorMemoryObj:
    flat = t.contiguous().view(torch.uint8).view(-1)
    meta = MemoryObjMetadata(
        shape=t.shape,
        dtype=t.dtype,
        address=0,
        phy_size=flat.numel(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
        shapes=[t.shape],
        dtypes=[t.dtype],
    )
    return TensorMemoryObj(flat, meta, None)


def chunk(a: dict, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(a["seed"] * 1000 + i)
    return torch.randn(a["shape"], generator=g, dtype=torch.float32).to(getattr(torch, a["dtype"]))


def wait(poll, task, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = poll(task)
        if got is not None:
            return got
        time.sleep(0.01)
    raise TimeoutError("LMCache's RESP adapter did not answer")


def main() -> None:
    op, a = sys.argv[1], json.loads(sys.argv[2])
    keys = object_keys(a)
    out: dict = {"keys": [_object_key_to_string(k) for k in keys]}
    if op != "keys":
        adapter = _create_resp_l2_adapter(RESPL2AdapterConfig(host="127.0.0.1", port=a["port"], num_workers=2))
        try:
            if op == "put":
                values = [chunk(a, i) for i in range(len(keys))]
                task = adapter.submit_store_task(keys, [memory_obj(v) for v in values])
                done = wait(lambda t: adapter.pop_completed_store_tasks().get(t), task)
                out["stored"] = bool(done)
                out["sha256"] = [hashlib.sha256(v.view(torch.uint8).numpy().tobytes()).hexdigest() for v in values]
            else:
                # As LMCache's server does: look the keys up, then load those found.
                found = wait(adapter.query_lookup_and_lock_result, adapter.submit_lookup_and_lock_task(keys, {}))
                have = [k for i, k in enumerate(keys) if found.test(i)]
                bufs = [torch.zeros(a["shape"], dtype=getattr(torch, a["dtype"])) for _ in have]
                loaded = []
                if have:
                    bitmap = wait(
                        adapter.query_load_result, adapter.submit_load_task(have, [memory_obj(b) for b in bufs])
                    )
                    loaded = [bool(bitmap.test(i)) for i in range(len(have))]
                    adapter.submit_unlock(have)
                out["found"] = [bool(found.test(i)) for i in range(len(keys))]
                out["loaded"] = loaded
                out["sha256"] = [hashlib.sha256(b.view(torch.uint8).numpy().tobytes()).hexdigest() for b in bufs]
        finally:
            adapter.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
