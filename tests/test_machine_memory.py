"""The machine bounds the host arena: a pool it could never back is refused at start, with the
numbers; a grow it cannot back now is RESOURCE_EXHAUSTED before any page is made."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, short_tmpdir, start_broker

from memory_broker.broker.arena.base import ArenaGeometry
from memory_broker.broker.arena.host import HostArena
from memory_broker.broker.arena.machine import ENV, MachineMemory
from memory_broker.clients import BrokerClient, Spec
from memory_broker.proto.wire.errors import BrokerError, Code

GIB = 1 << 30
MIB = 1 << 20
# 1 MiB slabs of 16 pages.
PAGE = 64 * 1024


def geometry(max_slabs: int) -> ArenaGeometry:
    return ArenaGeometry(page_size=PAGE, pages_per_slab=16, max_slabs=max_slabs, window_pages=16 * max_slabs)


def test_a_host_arena_larger_than_the_machine_is_refused_with_both_sizes(monkeypatch):
    monkeypatch.setenv(ENV, str(GIB))
    with pytest.raises(ValueError) as e:
        HostArena(geometry(2048), name="too-big")
    assert "pool_size 2 GiB is more than this machine can give" in str(e.value)
    assert "MemTotal 1 GiB" in str(e.value) and "at most 1 GiB" in str(e.value)


def test_a_host_arena_the_machine_can_hold_starts(monkeypatch):
    monkeypatch.setenv(ENV, str(GIB))
    HostArena(geometry(1024), name="fits").close()


def test_a_grow_the_machine_cannot_back_now_is_refused_before_a_slab_is_made(monkeypatch):
    monkeypatch.setenv(ENV, f"{GIB}:{3 * MIB}")
    arena = HostArena(geometry(8), name="short", populate=False)
    try:
        arena.grow(2)
        with pytest.raises(MemoryError) as e:
            arena.grow(2)
        assert "from 2 MiB by 2 MiB needs more than the machine can give now (3 MiB" in str(e.value)
        assert arena.num_slabs == 2
        arena.grow(1)
    finally:
        arena.close()


def test_the_cgroup_limit_bounds_the_pool_and_its_room_bounds_a_grow():
    m = MachineMemory(total=64 * GIB, available=60 * GIB, cgroup_max=8 * GIB, cgroup_current=7 * GIB, cgroup="/x")
    assert m.limit == 8 * GIB and m.headroom == GIB
    with pytest.raises(ValueError, match=r"cgroup /x memory.max 8 GiB"):
        m.check_pool(9 * GIB)
    with pytest.raises(MemoryError, match=r"needs more than the machine can give now \(1 GiB"):
        m.check_grow(2 * GIB, 0, 0)


def test_slabs_grown_but_not_yet_populated_count_against_the_room_of_a_grow():
    m = MachineMemory(total=4 * GIB, available=GIB)
    m.check_grow(GIB // 2, GIB, GIB)  # the arena's 1 GiB is populated: MemAvailable has it
    with pytest.raises(MemoryError, match=r"512 MiB of the arena not yet backed"):
        m.check_grow(GIB // 2 + 1, GIB, GIB // 2)


def test_the_reading_of_this_machine_is_its_meminfo(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    m = MachineMemory.read()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert m.total == total and 0 < m.available <= m.total and 0 < m.limit <= total


@pytest.mark.parametrize("text", ["lots", "1:2", "0"])
def test_a_stated_machine_that_cannot_be_read_is_refused(text):
    with pytest.raises(ValueError, match=ENV):
        MachineMemory.stated(text)


def serve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    d = short_tmpdir()
    cmd = [sys.executable, "-m", "memory_broker.broker.cli", "serve", "--socket", os.path.join(d, "b.sock")]
    cmd += ["--arena", "host", "--state-dir", os.path.join(d, "state"), "--log-format", "json", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_a_pool_of_64_tib_is_refused_at_start_on_this_machine():
    env = {k: v for k, v in os.environ.items() if k != ENV}
    r = serve("--pool-size", "64TiB", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith("memory-broker: cannot start: pool_size 64 TiB is more than this machine can give")
    assert "MemTotal" in r.stderr and "MemAvailable" in r.stderr
    assert '"event": "start_failed"' in r.stdout and '"event": "serving"' not in r.stdout


def test_a_pool_one_gib_past_this_machines_memory_is_refused_at_start():
    env = {k: v for k, v in os.environ.items() if k != ENV}
    pool = MachineMemory.read().total // GIB + 1
    r = serve("--pool-size", f"{pool}GiB", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"cannot start: pool_size {pool} GiB is more than this machine can give" in r.stderr


def test_a_pool_larger_than_a_stated_1_gib_machine_is_refused_at_start():
    r = serve("--pool-size", "2GiB", env={**os.environ, ENV: str(GIB)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "pool_size 2 GiB is more than this machine can give the host arena: MemTotal 1 GiB" in r.stderr


def test_a_grow_past_available_memory_is_resource_exhausted_and_the_broker_serves_on(monkeypatch):
    # 2 MiB slabs of 512 KiB pages, 32 MiB pool; the machine has 5 MiB to give before the arena.
    monkeypatch.setenv(ENV, f"{GIB}:{5 * MIB}")
    b = start_broker()
    try:
        with BrokerClient.connect(b.socket) as c:
            c.allocate([Spec(4, pin=True)])
            with pytest.raises(BrokerError) as e:
                c.allocate([Spec(8)])  # 2 more slabs: 4 MiB, with 2 MiB grown
            assert e.value.code == Code.RESOURCE_EXHAUSTED
            assert "needs more than the machine can give now (5 MiB" in e.value.message
            assert c.stats().used_pages == 4
    finally:
        b.stop()
