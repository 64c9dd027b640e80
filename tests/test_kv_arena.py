"""An engine's KV range over broker pages on a host arena: groups mapped where the KV layout puts
them, growth in the background, a retired group unmapped and given back only after the steps that
could read it, and an unmapped group faulting instead of reading stale memory."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import ROOT

from memory_broker.clients import BrokerClient
from memory_broker.clients.engine_kv import EngineKvSession
from memory_broker.clients.kv_arena import RETIRE_STEPS, HostKvRange, KvGroups, host_place

PAGE = 512 * 1024  # the conftest broker's
LAYERS, GROUPS = 3, 4


def groups_for(c) -> KvGroups:
    kv = EngineKvSession(c, "test-engine", LAYERS)
    rng = HostKvRange(LAYERS * GROUPS * PAGE, GROUPS * PAGE, PAGE)
    g = c.arena
    return KvGroups(kv, rng, host_place(c.view, g.page_size, g.pages_per_slab))


def perms(addr: int) -> str:
    for line in open("/proc/self/maps"):
        span, mode = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            return mode
    return ""


def test_a_groups_pages_sit_where_the_kv_layout_puts_each_layer(broker):
    with BrokerClient.connect(broker.socket) as c:
        g = groups_for(c)
        try:
            slots = g.grow_now(2)
            assert slots == [0, 1]
            t = g.rng.tensor()
            (info,) = [i for i in c.stats().by_owner if i.session_id == c.session_id]
            assert info.pages == 2 * LAYERS
            # Layer 2, group 1 in the engine's view is the group's third page in the broker's.
            (obj,) = c.pin([g.backed[1]])  # the engine's own group: its pages, per layer
            obj_pages = list(obj.pages)
            c.unpin([g.backed[1]])
            at = 2 * GROUPS * PAGE + 1 * PAGE
            t[at : at + PAGE].fill_(7)
            phys = c.physical_view()
            p = obj_pages[2]
            assert bool((phys[p * PAGE : (p + 1) * PAGE] == 7).all())
            assert perms(g.rng.base + 2 * PAGE) == "---p"  # group 2: not mapped
        finally:
            g.close()
            g.rng.close()


def test_a_retired_group_is_given_back_after_the_steps_that_could_read_it(broker):
    with BrokerClient.connect(broker.socket) as c:
        g = groups_for(c)
        try:
            g.grow_now(2)
            g.retire([0])
            for _ in range(RETIRE_STEPS - 1):
                assert g.step_done() == 0
                assert perms(g.rng.base).startswith("rw")
            assert g.step_done() == LAYERS * PAGE // PAGE
            assert perms(g.rng.base) == "---p" and 0 not in g.backed
            assert g.kv.stats().held_pages == LAYERS
        finally:
            g.close()
            g.rng.close()


def test_growth_asked_ahead_arrives_off_the_callers_thread(broker):
    with BrokerClient.connect(broker.socket) as c:
        g = groups_for(c)
        try:
            g.want(3)
            deadline = time.monotonic() + 5
            ready: list[int] = []
            while len(ready) < 3 and time.monotonic() < deadline:
                ready += g.take_ready()
                time.sleep(0.01)
            assert sorted(ready) == [0, 1, 2]
            assert g.kv.stats().held_pages == 3 * LAYERS
        finally:
            g.close()
            g.rng.close()


TOUCH = """
import sys
from memory_broker.clients.kv_arena import HostKvRange
r = HostKvRange(2 * 4 * 524288, 4 * 524288, 524288)
print("reserved", flush=True)
r.tensor()[int(sys.argv[1])].item()
print("read", flush=True)
"""


def test_reading_an_unmapped_group_faults_instead_of_reading_stale_memory():
    p = subprocess.run([sys.executable, "-c", TOUCH, str(524288 + 5)], capture_output=True, text=True, cwd=ROOT)
    assert "reserved" in p.stdout and "read" not in p.stdout
    assert p.returncode == -11  # SIGSEGV
