"""The engine pool over gRPC on a real broker: grows, give-backs on request, refusals with a
clear status, a dead engine's pages back within a second, zeroed pages, status and metrics lines.

The engines here are client sessions (one in a child process, to be killed); the vLLM engines on
the pool are tests/test_vllm_engine_pool.py's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT

from memory_broker.clients import BrokerClient
from memory_broker.clients.engine_kv import EngineKvSession
from memory_broker.proto.wire.errors import BrokerError, Code

# The conftest broker: 512 KiB pages, 32 MiB pool: 64 pages.
PAGE = 512 * 1024
GROUP = 4


def page_bytes(client, page: int):
    """A uint8 tensor over one page of the client's physical view."""
    client._set_access([page], False)
    return client.physical_view()[page * PAGE : (page + 1) * PAGE]


def engine(b, name: str, **kw) -> tuple[BrokerClient, EngineKvSession]:
    box: dict = {}
    c = BrokerClient.connect(b.socket, client_name=name, on_event=lambda ev: box["kv"].on_event(ev))
    box["kv"] = kv = EngineKvSession(c, name, GROUP, **kw)
    return c, kv


def give_back_on_request(c, kv: EngineKvSession, groups: list, stop: threading.Event) -> threading.Thread:
    """The donor engine's side: give back whole groups when asked (as an engine does off its step)."""

    def run():
        while not stop.is_set():
            r = kv.take_reclaim()
            if r is not None:
                n = min(len(groups), -(-r.pages // GROUP))
                give, groups[:] = groups[:n], groups[n:]
                kv.shrink([g.object_id for g in give])
            time.sleep(0.005)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_grow_gets_pages_another_engine_gives_back_and_they_read_zero(broker):
    a, akv = engine(broker, "a")
    b, bkv = engine(broker, "b")
    stop = threading.Event()
    try:
        held = akv.grow(12)  # 48 of 64 pages
        for g in held:
            for p in g.pages:
                page_bytes(a, p).fill_(0xAB)
        given = {p for g in held for p in g.pages}
        give_back_on_request(a, akv, held, stop)
        got = bkv.grow(8, wait_ms=3000)  # 32 pages: 16 free, 16 given back by a
        pages = [p for g in got for p in g.pages]
        assert len(pages) == 32 and given & set(pages)
        for p in pages:
            assert not page_bytes(b, p).any(), f"page {p} moved between engines without being zeroed"
        sa, sb = akv.stats(), bkv.stats()
        assert sa.held_pages + sb.held_pages <= 64
        assert sa.asked_pages >= 16 and sa.give_backs >= 1 and sb.grows == 1
    finally:
        stop.set()
        a.close()
        b.close()


def test_a_grow_no_engine_can_cover_is_refused_with_the_numbers(broker):
    a, akv = engine(broker, "a", floor_pages=48)
    b, bkv = engine(broker, "b")
    try:
        akv.grow(12)  # all within a's floor: nothing to ask back
        t0 = time.monotonic()
        with pytest.raises(BrokerError) as e:
            bkv.grow(5, wait_ms=2000)
        assert time.monotonic() - t0 < 1.0  # no donor above its floor: refused at once
        assert e.value.code == Code.RESOURCE_EXHAUSTED
        assert "need 20 pages" in e.value.message and "4 short" in e.value.message
        assert bkv.stats().refusals == 1 and bkv.stats().held_pages == 0
    finally:
        a.close()
        b.close()


def test_a_grow_with_a_least_takes_what_fits_now_in_one_call(broker):
    # The step's grow: a batch of 4 where 2 fit is answered 2 at once (no refusal, no wait);
    # with none left and no donor it is refused at once; a least above the batch is refused
    # INVALID_ARGUMENT and changes nothing.
    a, akv = engine(broker, "a", floor_pages=48)
    b, bkv = engine(broker, "b")
    try:
        akv.grow(12)  # 48 of 64 pages, all within a's floor
        bkv.grow(2)  # 8 more: 8 pages (2 groups) left
        with pytest.raises(BrokerError) as e:
            bkv.grow(2, least=3)
        assert e.value.code == Code.INVALID_ARGUMENT and "min_groups" in e.value.message
        assert bkv.stats().held_pages == 8
        t0 = time.monotonic()
        got = bkv.grow(4, wait_ms=2000, least=1)
        assert len(got) == 2 and time.monotonic() - t0 < 1.0
        assert bkv.stats().held_pages == 16 and bkv.stats().refusals == 0
        with pytest.raises(BrokerError) as e:
            bkv.grow(4, wait_ms=2000, least=1)
        assert e.value.code == Code.RESOURCE_EXHAUSTED and time.monotonic() - t0 < 1.5
        assert bkv.stats().held_pages == 16
    finally:
        a.close()
        b.close()


def test_bad_engine_calls_are_answered_with_a_clear_status_and_change_nothing(broker):
    a, akv = engine(broker, "a")
    c = BrokerClient.connect(broker.socket, client_name="not-an-engine")
    try:
        (g,) = akv.grow(1)
        with pytest.raises(BrokerError) as e:
            akv.grow(0)
        assert e.value.code == Code.INVALID_ARGUMENT
        with pytest.raises(BrokerError) as e:
            akv.shrink([g.object_id, 10**9])
        assert e.value.code == Code.NOT_FOUND
        with pytest.raises(BrokerError) as e:
            EngineKvSession(c, "x", 0)
        assert e.value.code == Code.INVALID_ARGUMENT
        with pytest.raises(BrokerError) as e:
            EngineKvSession(c, "y", GROUP).shrink([g.object_id])  # another engine's group
        assert e.value.code == Code.NOT_FOUND
        with pytest.raises(BrokerError) as e:
            akv.grow(17)  # past the pool
        assert e.value.code == Code.RESOURCE_EXHAUSTED
        assert akv.stats().held_pages == GROUP
    finally:
        a.close()
        c.close()


CHILD = """
import sys, time
from memory_broker.clients import BrokerClient
from memory_broker.clients.engine_kv import EngineKvSession
c = BrokerClient.connect(sys.argv[1], client_name="doomed")
kv = EngineKvSession(c, "doomed", 4)
kv.grow(14)
print("held", flush=True)
time.sleep(600)
"""


def test_a_dead_engines_pages_return_within_a_second_and_the_other_grows_into_them(broker):
    child = subprocess.Popen([sys.executable, "-c", CHILD, broker.socket], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    b, bkv = engine(broker, "b")
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(BrokerError):
            bkv.grow(4)  # 8 free pages: 16 is too many while the child lives
        child.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        child.wait()
        while b.stats().used_pages:
            assert time.monotonic() - t0 < 1.0, "the dead engine's pages did not return within 1 s"
            time.sleep(0.01)
        assert len(bkv.grow(16)) == 16  # the whole pool
    finally:
        if child.poll() is None:
            child.kill()
        b.close()


def test_status_and_metrics_show_each_engine(broker_factory):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = broker_factory("--metrics-port", str(port), "--engine", "llama:floor=2MiB:ceiling=16MiB:weight=2")
    c, kv = engine(b, "llama")
    try:
        assert (kv.registered.floor_pages, kv.registered.ceiling_pages, kv.registered.weight) == (4, 32, 2.0)
        kv.grow(2)
        out = subprocess.run(
            [sys.executable, "-m", "memory_broker.broker.cli", "status", "--socket", b.socket],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ},
        )
        assert out.returncode == 0, out.stderr
        line = next(x for x in out.stdout.splitlines() if x.strip().startswith("engine"))
        assert "llama" in line and "8 KV pages" in line and "floor 4" in line and "ceiling 32" in line
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        deadline = time.monotonic() + 5
        while 'memory_broker_engine_kv_pages{engine="llama"' not in text and time.monotonic() < deadline:
            time.sleep(0.2)
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'memory_broker_engine_kv_pages{engine="llama"' in text
        assert "memory_broker_engine_kv_grow_latency_seconds_count" in text
    finally:
        c.close()


def test_a_grow_evicts_the_unpinned_prefix_and_never_the_held_adapter(broker, tmp_path):
    from rigs import write_adapter

    from memory_broker.clients import Spec

    other = BrokerClient.connect(broker.socket, client_name="prefix-and-adapter")
    a, akv = engine(broker, "a")
    try:
        other.register_adapter("held", write_adapter(str(tmp_path / "held"), 1))
        with other.acquire_adapters(["held"]):
            other.allocate([Spec(8, content_type="kv_cache", key=b"prefix")])  # unpinned shared KV
            lora_pages = sum(x.pages for x in other.stats().by_content if x.content_type == 2)
            assert lora_pages >= 1
            free = 64 - 8 - lora_pages
            akv.grow(free // GROUP + 1)  # one group more than is free: the prefix goes
            assert other.lookup([b"prefix"], pin=False) == []
            st = other.stats()
            assert sum(x.pages for x in st.by_content if x.content_type == 2) == lora_pages
            with pytest.raises(BrokerError) as e:  # what is left is the held adapter's
                akv.grow(2)
            assert e.value.code == Code.RESOURCE_EXHAUSTED
            assert sum(x.pages for x in other.stats().by_content if x.content_type == 2) == lora_pages
    finally:
        a.close()
        other.close()
