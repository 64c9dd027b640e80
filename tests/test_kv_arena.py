"""An engine's KV range over broker pages on a host arena: groups mapped where the KV layout puts
them (by the worker's half, from the operations the scheduler's half hands it), growth in the
background, a retired group unmapped before the next step and given back only after the steps
that could read it, and an unmapped group faulting instead of reading stale memory."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import ROOT

from memory_broker.clients import BrokerClient
from memory_broker.clients.engine_kv import EngineKvSession
from memory_broker.clients.kv_arena import RETIRE_STEPS, HostKvRange, KvGroups, KvMapper

PAGE = 512 * 1024  # the conftest broker's
LAYERS, GROUPS = 3, 4


class Halves:
    """The scheduler's half (``g``) and the worker's (``m``, its own client of the broker)."""

    def __init__(self, c, socket: str):
        kv = EngineKvSession(c, "test-engine", LAYERS)
        self.g = KvGroups(kv, GROUPS)
        self.m = KvMapper(HostKvRange(LAYERS * GROUPS * PAGE, GROUPS * PAGE, PAGE), BrokerClient.connect(socket))
        self.rng = self.m.rng

    def step(self) -> None:
        """What travels with one step: the worker carries out the scheduler's operations."""
        self.m.apply(*self.g.take_ops())

    def close(self) -> None:
        self.g.close()
        self.m.close()


def perms(addr: int) -> str:
    for line in open("/proc/self/maps"):
        span, mode = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            return mode
    return ""


def test_a_groups_pages_sit_where_the_kv_layout_puts_each_layer(broker):
    with BrokerClient.connect(broker.socket) as c:
        h = Halves(c, broker.socket)
        g = h.g
        try:
            slots = g.grow_now(2)
            assert slots == [0, 1]
            assert perms(h.rng.base) == "---p"  # not mapped until the worker hears of it
            h.step()
            t = h.rng.tensor()
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
            assert perms(h.rng.base + 2 * PAGE) == "---p"  # group 2: not mapped
        finally:
            h.close()


def test_a_retired_group_is_unmapped_before_the_next_step_and_given_back_after_the_steps_that_could_read_it(broker):
    with BrokerClient.connect(broker.socket) as c:
        h = Halves(c, broker.socket)
        g = h.g
        try:
            g.grow_now(2)
            h.step()
            assert perms(h.rng.base).startswith("rw")
            g.retire([0])
            assert perms(h.rng.base).startswith("rw")  # the step in flight may still read it
            h.step()  # the next step: the worker unmaps it first
            assert perms(h.rng.base) == "---p"
            assert g.pending()  # not given back yet
            for _ in range(RETIRE_STEPS - 1):
                assert g.step_done() == 0
                assert g.kv.stats().held_pages == 2 * LAYERS
            assert g.step_done() == LAYERS
            assert 0 not in g.backed and not g.pending()
            assert g.kv.stats().held_pages == LAYERS
            # The slot is free again: the next grow maps new pages there, after the unmap.
            assert g.grow_now(1) == [0]
            h.step()
            assert perms(h.rng.base).startswith("rw")
        finally:
            h.close()


def test_an_idle_engine_gives_back_at_once_and_the_worker_unmaps_at_its_next_step(broker):
    with BrokerClient.connect(broker.socket) as c:
        h = Halves(c, broker.socket)
        g = h.g
        try:
            g.grow_now(2)
            h.step()
            g.retire([1])
            assert g.step_done(idle=True) == LAYERS
            assert g.kv.stats().held_pages == LAYERS
            assert g.pending()  # the unmap has not travelled: vLLM is asked for one more step
            h.step()
            assert perms(h.rng.base + PAGE) == "---p" and not g.pending()
        finally:
            h.close()


def test_a_background_grow_that_lands_after_the_engine_went_idle_goes_straight_back(broker):
    with BrokerClient.connect(broker.socket) as c:
        h = Halves(c, broker.socket)
        g = h.g
        try:
            g.grow_now(1)
            h.step()
            g.step_done(idle=True)
            assert g.grow_now(2, background=True) == []  # no step will take it: back at once
            assert g.kv.stats().held_pages == LAYERS
            assert g.take_ops() == ([], g.slabs)  # nothing to map; and a step: busy again
            assert g.grow_now(1, background=True) == [1]
            assert g.kv.stats().held_pages == 2 * LAYERS
        finally:
            h.close()


def test_growth_asked_ahead_arrives_off_the_callers_thread(broker):
    with BrokerClient.connect(broker.socket) as c:
        h = Halves(c, broker.socket)
        g = h.g
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
            h.close()


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
