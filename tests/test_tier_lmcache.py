"""Brokers and LMCache nodes sharing chunks through one Valkey (docs/tier.md, "Sharing with
LMCache"): an LMCache node's chunks, stored by LMCache 0.5.6's own code (its token hasher, key
serde and RESP L2 adapter, run from its own environment by tests/lmcache_peer.py), are read by a
broker in the LMCache-compatible mode with bytes equal, and what a broker writes in that mode
LMCache loads with bytes equal. A value of another size is a miss; keys of engines not
declared equal, and requests with an adapter, never use LMCache's format."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time

import pytest
import torch
from conftest import ROOT, start_broker
from tier_servers import start_tier_server
from valkey import Valkey

from memory_broker.broker.server.config import build_options
from memory_broker.broker.server.options import ServeOptions, SettingError, lmcache_chunk_bytes
from memory_broker.clients import BrokerClient, Spec
from memory_broker.proto.wire import lmcache

LMCACHE_PY = os.environ.get("MEMORY_BROKER_LMCACHE_PYTHON") or os.path.join(ROOT, ".venv-lmcache", "bin", "python")
PEER = os.path.join(ROOT, "tests", "lmcache_peer.py")

# The fleet: a 3-layer model's chunk, 2 x 3 x 256 x 64 bfloat16 (192 KiB: one 512 KiB page, the
# rest of it zero on a read), world size 1, rank 0.
MODEL = "tiny-llama"
SHAPE = [2, 3, 256, 64]
CHUNK_BYTES = 2 * 3 * 256 * 64 * 2
RANK = lmcache.kv_rank()
FLEET = ["--tier-lmcache-model", MODEL, "--tier-lmcache-chunk-shape", "x".join(map(str, SHAPE))]
TIER = ["--tier-deadline", "2s", "--kv-digest"]


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 32000, (n,), generator=g).tolist()


def need_lmcache() -> None:
    if os.path.exists(LMCACHE_PY):
        return
    if os.environ.get("MEMORY_BROKER_REQUIRE_LMCACHE"):
        raise RuntimeError(f"LMCache's environment's python {LMCACHE_PY} is missing: run `make lmcache-venv`")
    pytest.skip(f"no LMCache environment at {LMCACHE_PY} (`make lmcache-venv` builds it; `make test-all` does)")


def peer(op: str, **args) -> dict:
    """LMCache's side (tests/lmcache_peer.py, in LMCache's own environment): its JSON answer."""
    need_lmcache()
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    p = subprocess.run(
        [LMCACHE_PY, PEER, op, json.dumps({"model": MODEL, "kv_rank": RANK, **args})],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd="/",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def valkey():
    s = start_tier_server("valkey")
    yield s
    s.stop()


def broker(tier, *extra):
    b = start_broker(*tier.flags(), *TIER, *extra)
    return b, BrokerClient.connect(b.socket, client_name="host")


def chunk_bytes(c: BrokerClient, obj) -> bytes:
    return b"".join(bytes(t.view(-1).numpy()) for t in obj.page_tensors())


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def wait_found(c: BrokerClient, keys: list[bytes], timeout: float = 15.0):
    """Look up (unpinned) until all ``keys`` are found or ``timeout``; the objects found last."""
    end = time.monotonic() + timeout
    while len(got := c.lookup(keys, pin=False)) < len(keys) and time.monotonic() < end:
        time.sleep(0.05)
    return got


def written(c: BrokerClient, n: int, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while c.stats().tier.written < n:
        assert time.monotonic() < end, c.stats().tier
        time.sleep(0.05)


def test_a_broker_reads_the_chunks_an_lmcache_node_wrote_with_bytes_equal(valkey):
    toks = tokens(3 * 256 + 100, seed=1)  # three full chunks and a partial one, which neither side shares
    theirs = peer("put", port=valkey.port, tokens=toks, shape=SHAPE, dtype="bfloat16", seed=1)
    assert theirs["stored"] and len(theirs["keys"]) == 3
    keys = lmcache.chunk_keys(toks, MODEL, RANK)
    assert [k[len(lmcache.PREFIX) :].decode() for k in keys] == theirs["keys"]  # the same keys
    b, cb = broker(valkey, *FLEET)
    try:
        assert cb.lookup(keys, pin=False) == []  # the miss answers now; the tier fills behind it
        got = wait_found(cb, keys)
        assert len(got) == 3
        values = [chunk_bytes(cb, o) for o in got]
        assert [sha(v[:CHUNK_BYTES]) for v in values] == theirs["sha256"]
        assert all(not any(v[CHUNK_BYTES:]) for v in values)  # the page's rest: zeroes
        st = cb.stats().tier
        assert st.hits == 3 and st.corrupt == 0 and st.lmcache_model == MODEL
        # The broker took its own digest of each (LMCache's values carry none).
        assert all(c.ok and c.digest for c in cb.verify_objects(keys).checks)
    finally:
        cb.close()
        b.stop()


def test_an_lmcache_node_loads_what_a_broker_wrote_in_its_format_with_bytes_equal(valkey):
    toks = tokens(2 * 256 + 17, seed=2)
    keys = lmcache.chunk_keys(toks, MODEL, RANK)
    assert len(keys) == 2
    a, ca = broker(valkey, *FLEET)
    try:
        mine = []
        with ca.prepare([Spec(1, "kv_cache", key=k) for k in keys]) as txn:
            for i, obj in enumerate(txn.objects):
                g = torch.Generator().manual_seed(50 + i)
                value = torch.randn(SHAPE, generator=g).to(torch.bfloat16).view(torch.uint8).view(-1)
                obj.page_tensors()[0].view(-1)[:CHUNK_BYTES].copy_(value)
                mine.append(sha(bytes(value.numpy())))
        written(ca, 2)
    finally:
        ca.close()
        a.stop()
    theirs = peer("get", port=valkey.port, tokens=toks, shape=SHAPE, dtype="bfloat16")
    assert theirs["found"] == theirs["loaded"] == [True, True]
    assert theirs["sha256"] == mine
    # Written in LMCache's format instead of the broker's: the chunk bytes alone, no record.
    v = Valkey(port=valkey.port)
    assert sorted(k.decode() for k in v.keys("*")) == sorted(theirs["keys"])
    assert all(v.strlen(k) == CHUNK_BYTES for k in theirs["keys"])


def test_a_value_of_another_size_under_an_lmcache_key_is_a_miss(valkey):
    toks = tokens(3 * 256, seed=3)
    keys = lmcache.chunk_keys(toks, MODEL, RANK)
    wires = [k[len(lmcache.PREFIX) :].decode() for k in keys]
    v = Valkey(port=valkey.port)
    v.set(wires[0], os.urandom(CHUNK_BYTES - 1))  # short
    v.set(wires[1], os.urandom(CHUNK_BYTES))
    v.set(wires[2], os.urandom(CHUNK_BYTES + 2))  # long
    b, cb = broker(valkey, *FLEET)
    try:
        # The chain's head is short: nothing of it is read. From the good second chunk on,
        # that one is read, and the long third is not.
        end = time.monotonic() + 2.5  # past the broker's second before it asks again
        while time.monotonic() < end:
            assert cb.lookup(keys, pin=False) == []
            time.sleep(0.1)
        assert len(wait_found(cb, keys[1:2])) == 1
        assert len(cb.lookup(keys[1:], pin=False)) == 1
        st = cb.stats().tier
        assert st.hits == 1 and st.misses >= 3 and st.corrupt == 0
    finally:
        cb.close()
        b.stop()


def test_keys_of_engines_not_declared_equal_never_use_lmcache_s_format(valkey):
    toks = tokens(256, seed=4)
    other_rank = lmcache.kv_rank(2, 1, 2, 1)  # another parallel setup than the fleet's
    key_same = lmcache.chunk_keys(toks, MODEL, RANK)
    key_rank = lmcache.chunk_keys(toks, MODEL, other_rank)
    key_model = lmcache.chunk_keys(toks, "another-model", RANK)
    a, ca = broker(valkey, *FLEET)
    plain, cp = broker(valkey, "--tier-key-prefix", "plain")  # no LMCache fleet declared at all
    try:
        with ca.prepare([Spec(1, "kv_cache", key=k[0]) for k in (key_rank, key_model)]):
            pass
        with ca.prepare([Spec(2, "kv_cache", key=key_same[0])]):  # not a chunk's pages: 2 pages
            pass
        with cp.prepare([Spec(1, "kv_cache", key=key_same[0])]):
            pass
        written(ca, 3)
        written(cp, 1)
    finally:
        for c, b in ((ca, a), (cp, plain)):
            c.close()
            b.stop()
    # All four went in the broker's own format (under its prefix, each with its record):
    # nothing under any LMCache key.
    names = sorted(k.decode() for k in Valkey(port=valkey.port).keys("*"))
    assert len(names) == 8 and all(n.startswith(("mb/shared/", "plain/shared/")) for n in names), names
    theirs = peer("get", port=valkey.port, tokens=toks, shape=SHAPE, dtype="bfloat16")
    assert theirs["found"] == [False] and theirs["loaded"] == []


def test_lmcache_keys_match_lmcache_s_own_and_refuse_an_adapter():
    toks = tokens(5 * 256 + 255, seed=5)
    mine = [k[len(lmcache.PREFIX) :].decode() for k in lmcache.chunk_keys(toks, MODEL, RANK, salt="")]
    assert mine == peer("keys", tokens=toks)["keys"]
    assert len(mine) == 5  # the partial chunk has no key
    assert lmcache.chunk_keys(toks[:255], MODEL, RANK) == []
    with pytest.raises(ValueError, match="adapter"):
        lmcache.chunk_keys(toks, MODEL, RANK, lora_request=("sql", 1, "/adapters/sql"))


def test_lmcache_key_format_and_its_parse():
    assert lmcache.kv_rank() == 0x01000100
    assert lmcache.kv_rank(8, 5, 4, 1) == 0x08050401
    h = bytes(range(32))
    w = lmcache.wire_key("m/x", 0x01000100, h)
    assert w == "m/x@01000100@0@" + h.hex()
    assert lmcache.parse(lmcache.broker_key(w)) == ("m/x", 0x01000100, w)
    assert lmcache.parse(lmcache.broker_key(w + "@user7")) == ("m/x", 0x01000100, w + "@user7")
    for bad in (w.encode(), b"lmcache:m@1@0@00", b"lmcache:m@0100010z@0@00", b"lmcache:\xff@01000100@0@00"):
        assert lmcache.parse(bad) is None
    for model, salt in (("a@b", ""), ("", ""), ("m", "a/b")):
        with pytest.raises(ValueError):
            lmcache.wire_key(model, 1, h, salt=salt)
    with pytest.raises(ValueError):
        lmcache.kv_rank(2, 2, 1, 0)


def test_the_lmcache_fleet_s_settings_are_checked():
    base = {"tier_backend": "valkey", "tier_valkey_url": "valkey://127.0.0.1:1/0", "tier_lmcache_model": "m"}
    ok = ServeOptions(**base, tier_lmcache_chunk_shape="2x4x256x128", tier_lmcache_dtype="float16")
    assert lmcache_chunk_bytes(ok) == 2 * 4 * 256 * 128 * 2
    for bad in (
        {**base, "tier_lmcache_chunk_shape": "2x0x256"},
        {**base, "tier_lmcache_chunk_shape": "big"},
        {**base, "tier_lmcache_chunk_shape": "2x4", "tier_lmcache_model": "a@b"},
        {"tier_backend": "mooncake", "tier_mooncake_master": "h:1", "tier_lmcache_model": "m"},
    ):
        with pytest.raises(SettingError):
            ServeOptions(**bad).validate()


def test_the_docs_lmcache_declaration_is_a_valid_configuration(tmp_path):
    with open(os.path.join(ROOT, "docs", "tier.md")) as f:
        section = f.read().split("## Sharing with LMCache", 1)[1]
    (block,) = re.findall(r"```yaml\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    path = tmp_path / "broker.yaml"
    path.write_text(block)
    opts = build_options(str(path), {})
    opts.validate()
    assert opts.tier_lmcache_kv_rank == lmcache.kv_rank()
    assert lmcache_chunk_bytes(opts) == 2 * 32 * 256 * 1024 * 2
