"""The tier's contract, run against both real backends: a Valkey and a Mooncake Store master
started on free loopback ports (tests/tier_servers.py), the broker's side of each backend
(broker/tier/) in this process, and an anonymous mapping standing in for the arena."""

from __future__ import annotations

import ctypes
import mmap
import time

import pytest
from tier_servers import KINDS, start_tier_server

from memory_broker.broker.tier.base import Block, tier_key
from memory_broker.broker.tier.tier import Tier, open_backend

PAGE = 64 << 10
DEADLINE = 1.0
# What a test waits for an answer due within DEADLINE, on a shared 2-core machine.
SLACK = 3 * DEADLINE + 2


class Memory:
    """Pages of an anonymous mapping, registered with the tier like the arena's slabs."""

    def __init__(self, pages: int = 32):
        self.map = mmap.mmap(-1, pages * PAGE)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def block(self, key: str, pages: list[int]) -> Block:
        return Block(key, tuple((self.base + p * PAGE, PAGE) for p in pages))

    def fill(self, pages: list[int], seed: int) -> None:
        for i, p in enumerate(pages):
            self.map[p * PAGE : (p + 1) * PAGE] = bytes([(seed + i) % 251]) * PAGE

    def read(self, pages: list[int]) -> bytes:
        return b"".join(self.map[p * PAGE : (p + 1) * PAGE] for p in pages)


@pytest.fixture(params=sorted(KINDS))
def server(request):
    s = start_tier_server(request.param)
    yield s
    s.stop()


def make_tier(server, queue_depth: int = 64) -> Tier:
    backend = open_backend(
        server.kind,
        valkey_url=f"valkey://{server.address}/0",
        mooncake_master=server.address,
        mooncake_metadata="P2PHANDSHAKE",
        segment_size=16 << 20,
        deadline_s=DEADLINE,
    )
    return Tier(backend, DEADLINE, queue_depth)


@pytest.fixture
def rig(server):
    mem = Memory()
    tier = make_tier(server)
    tier.register(mem.base, len(mem.map)).result(10)
    yield server, tier, mem
    tier.close()


def keys(n: int, tag: str = "chain") -> list[str]:
    return [tier_key("fleet", "shared", f"{tag}-{i}".encode()) for i in range(n)]


def put_chain(tier: Tier, mem: Memory, names: list[str]) -> None:
    """Each name's block: 2 pages (3 and 1, out of order), each filled by its own seed."""
    blocks = []
    for i, k in enumerate(names):
        pages = [2 * i + 1, 2 * i]
        mem.fill(pages, 7 * i + 1)
        blocks.append(mem.block(k, pages))
    assert tier.put(blocks).result(10) == [True] * len(names)


def test_put_find_get_round_trip_gives_the_bytes_back(rig):
    _, tier, mem = rig
    names = keys(3)
    put_chain(tier, mem, names)
    metas = tier.find([*names, *keys(1, "absent")]).result(10)
    assert [m.num_pages for m in metas] == [2, 2, 2]
    dest = [[16 + 2 * i, 17 + 2 * i] for i in range(3)]
    got = tier.get([mem.block(k, d) for k, d in zip(names, dest)], metas).result(10)
    assert got == [True, True, True]
    for i, d in enumerate(dest):
        assert mem.read(d) == mem.read([2 * i + 1, 2 * i])
    assert tier.counts.hits == 3 and tier.counts.bytes_read == 3 * 2 * PAGE


def test_find_counts_only_the_leading_hits_of_a_chain(rig):
    _, tier, mem = rig
    names = keys(4, "gap")
    put_chain(tier, mem, [names[0], names[1], names[3]])
    assert len(tier.find(names).result(10)) == 2


def corrupt(server, tier: Tier, key: str, value: bytes) -> None:
    """Change a stored value behind the tier's back (same length)."""
    if server.kind == "valkey":
        tier.backend._client.set(key, value)
    else:
        assert tier.backend._store.upsert(key, value) == 0


def test_a_corrupted_value_is_a_miss(rig):
    server, tier, mem = rig
    (name,) = keys(1, "bad")
    put_chain(tier, mem, [name])
    corrupt(server, tier, name, b"\x55" * (2 * PAGE))
    metas = tier.find([name]).result(10)
    assert len(metas) == 1  # the record is there: only the digest can tell
    assert tier.get([mem.block(name, [20, 21])], metas).result(10) == [False]
    assert tier.counts.corrupt == 1 and tier.counts.hits == 0


def test_a_value_without_its_record_is_a_miss(rig):
    # A writer killed between a value and its record (the record goes second) leaves a miss.
    server, tier, mem = rig
    (name,) = keys(1, "orphan")
    mem.fill([0, 1], 5)
    if server.kind == "valkey":
        tier.backend._client.set(name, mem.read([0, 1]))
    else:
        assert tier.backend._connected().put(name, mem.read([0, 1])) == 0
    assert tier.find([name]).result(10) == []


def test_a_stopped_server_is_a_miss_within_the_deadline_and_later_calls_recover(rig):
    server, tier, mem = rig
    names = keys(2, "down")
    put_chain(tier, mem, names[:1])
    metas = tier.find(names[:1]).result(10)
    server.stop()
    t0 = time.monotonic()
    # Each answers within its deadline; the bound below leaves room for a busy 2-core machine
    # (each call's own time is what the backends bound: Mooncake's RPC timeout is set to it).
    assert tier.find(names).result(SLACK) == []
    assert tier.put([mem.block(names[1], [4])]).result(SLACK) == [False]
    assert tier.get([mem.block(names[0], [5, 6])], metas).result(SLACK) == [False]
    assert time.monotonic() - t0 < SLACK
    assert tier.counts.errors >= 1 and tier.last_error
    server.start()  # the same port: an operator's restart
    end = time.monotonic() + 15
    while time.monotonic() < end:
        if tier.put([mem.block(names[1], [4])]).result(10) == [True]:
            break
        time.sleep(0.2)
    assert tier.find([names[1]]).result(10), tier.last_error
    assert tier.up


POLICY = """version: 1

tenants:
  - name: "default"
    quota: 268435456
  - name: "teamA"
    quota: 1048576
  - name: "teamB"
    quota: 268435456
"""


def test_mooncake_tenants_keep_pools_apart_each_under_its_own_quota(tmp_path):
    from memory_broker.broker.tier.mooncake import MooncakeBackend

    policy = tmp_path / "quota.yaml"
    policy.write_text(POLICY)
    flags = ("-enable_multi_tenants", "-tenant_quota_connector_type=file", f"-tenant_quota_connector_uri={policy}")
    server = start_tier_server("mooncake", extra=flags)
    mem = Memory(96)
    tier = Tier(MooncakeBackend(server.address, "P2PHANDSHAKE", 64 << 20, DEADLINE, tenants=True), DEADLINE, 64)
    plain = Tier(MooncakeBackend(server.address, "P2PHANDSHAKE", 16 << 20, DEADLINE), DEADLINE, 64)
    try:
        for t in (tier, plain):
            t.register(mem.base, len(mem.map))
        # One block key in the shared pool, teamA and teamB: three values under three tenants.
        keys = {pool: tier_key("mb", pool, b"k") for pool in ("", "teamA", "teamB")}
        for i in range(len(keys)):
            mem.fill([i], 40 + i)
        assert tier.put([mem.block(k, [i]) for i, k in enumerate(keys.values())]).result(SLACK) == [True] * 3
        for i, k in enumerate(keys.values()):
            metas = tier.find([k]).result(SLACK)
            assert tier.get([mem.block(k, [10 + i])], metas).result(SLACK) == [True]
            assert mem.read([10 + i]) == mem.read([i])
        # A client of the default tenant sees the shared pool's value and none of the teams'.
        assert [len(plain.find([k]).result(SLACK)) for k in keys.values()] == [1, 0, 0]
        # 1.5 MiB for each team: teamA's quota is 1 MiB, teamB's 256 MiB. Mooncake refuses
        # teamA's puts past its quota (failed writes, a miss later); teamB's all go in.
        held = {}
        for pool, first in (("teamA", 20), ("teamB", 50)):
            blocks = [mem.block(tier_key("mb", pool, b"q%d" % i), [first + i]) for i in range(24)]
            ok = tier.put(blocks).result(SLACK)
            held[pool] = sum(1 for b in blocks if tier.find([b.key]).result(SLACK))
            assert held[pool] == ok.count(True)
        assert held["teamB"] == 24 and held["teamA"] * PAGE <= 1 << 20
        assert tier.counts.write_failed == 24 - held["teamA"] and tier.counts.errors == 0
    finally:
        tier.close(10)
        plain.close(10)
        server.stop()
