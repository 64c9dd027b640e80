"""The broker daemon end to end: real processes, real sockets, real shared mappings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from conftest import ROOT, read_line, run_child, spawn_child

from memory_broker.clients import BrokerClient, Spec
from memory_broker.proto.wire.errors import BrokerError, Code


class ByteCounter(grpc.UnaryUnaryClientInterceptor):
    """Counts the serialized bytes of every unary request and response."""

    def __init__(self):
        self.sent = 0
        self.received = 0

    def intercept_unary_unary(self, continuation, details, request):
        self.sent += request.ByteSize()
        outcome = continuation(details, request)
        if outcome.exception() is None:
            self.received += outcome.result().ByteSize()
        return outcome


def test_two_processes_share_a_keyed_object_without_copying(broker):
    counter = ByteCounter()
    with BrokerClient.connect(broker.socket, client_name="writer") as c:
        c._stub = __import__("memory_broker.proto.wire.v1.broker_pb2_grpc", fromlist=["x"]).MemoryBrokerStub(
            grpc.intercept_channel(c._channel, counter)
        )
        obj = c.allocate([Spec(4, contiguous=True, content_type="kv_cache", key=b"chunk-0")])[0]
        t = obj.tensor()
        pattern = (torch.arange(t.numel(), dtype=torch.int64) * 7 % 251).to(torch.uint8)
        t.copy_(pattern)
        expected = int(pattern.to(torch.int64).sum())
        lines = run_child(
            broker.socket,
            """
            import torch
            with BrokerClient.connect(SOCKET, client_name="reader") as c:
                with c.lookup_pinned([b"chunk-0"]) as objs:
                    o = objs[0]
                    t = o.tensor()
                    pages = torch.cat(o.page_tensors())
                    out(id=o.object_id, n=t.numel(), sum=int(t.to(torch.int64).sum()),
                        same_as_pages=bool(torch.equal(t, pages)), head=t[:8].tolist())
            """,
        )
    r = lines[0]
    assert r["id"] == obj.object_id
    assert r["n"] == obj.nbytes == 4 * (512 << 10)
    assert r["sum"] == expected
    assert r["head"] == pattern[:8].tolist()
    assert r["same_as_pages"]
    # 2 MiB of data moved between the processes; the writer's RPCs carried under 1 KiB.
    assert counter.received + counter.sent < 1024


def test_contiguous_allocation_over_scattered_free_pages_is_one_tensor_in_both_processes(broker):
    with BrokerClient.connect(broker.socket) as c:
        total = c.stats().max_pages
        singles = c.allocate([Spec(1) for _ in range(total)])
        c.free(singles[::2])  # every other page free: the free pages are scattered
        free = c.stats().free_pages
        assert free == total // 2
        big = c.allocate([Spec(free, contiguous=True, key=b"big")])[0]
        phys = sorted(big.pages)
        assert any(b - a > 1 for a, b in zip(phys, phys[1:])), "pages should be physically scattered"
        t = big.tensor(torch.int32)
        t.copy_(torch.arange(t.numel(), dtype=torch.int32))
        lines = run_child(
            broker.socket,
            """
            import torch
            with BrokerClient.connect(SOCKET) as c:
                o = c.lookup([b"big"])[0]
                t = o.tensor(torch.int32)
                ok = bool(torch.equal(t, torch.arange(t.numel(), dtype=torch.int32)))
                # page i of the contiguous tensor is physical page o.pages[i]
                ps = len(t) // len(o.pages)
                per_page = all(torch.equal(t[i*ps:(i+1)*ps], pt) for i, pt in enumerate(o.page_tensors(torch.int32)))
                out(ok=ok, per_page=per_page, contiguous=t.is_contiguous(), n=len(o.pages))
                c.unpin([o])
            """,
        )
    assert lines[0] == {"ok": True, "per_page": True, "contiguous": True, "n": free}


def test_prepared_objects_are_invisible_until_commit_and_commit_is_idempotent(broker):
    with BrokerClient.connect(broker.socket) as a, BrokerClient.connect(broker.socket) as b:
        txn = a.prepare([Spec(2, key=b"k", content_type="kv_cache")])
        assert b.lookup([b"k"]) == []
        with pytest.raises(BrokerError) as e:
            b.pin([txn.objects[0]])
        assert e.value.code == Code.NOT_FOUND
        first = txn.commit()
        again = a.commit([txn])[0]
        assert [o.object_id for o in first] == [o.object_id for o in again]
        assert [o.object_id for o in b.lookup([b"k"], pin=False)] == [first[0].object_id]


def test_abort_and_lease_expiry_return_pages(broker):
    events = []
    with BrokerClient.connect(broker.socket, on_event=events.append) as c:
        free0 = c.stats().free_pages
        txn = c.prepare([Spec(3)])
        assert c.stats().free_pages == free0 - 3
        assert txn.abort() == 3
        assert c.stats().free_pages == free0
        txn2 = c.prepare([Spec(5)], lease_s=0.2)
        assert c.stats().free_pages == free0 - 5
        deadline = time.monotonic() + 5
        while c.stats().free_pages != free0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats().free_pages == free0
        with pytest.raises(BrokerError) as e:
            txn2.commit()
        assert e.value.code == Code.FAILED_PRECONDITION and "expired" in e.value.message
        assert any(ev.WhichOneof("event") == "transactions_expired" for ev in events)


def test_committing_an_existing_key_returns_the_existing_object_and_frees_new_pages(broker):
    with BrokerClient.connect(broker.socket) as a, BrokerClient.connect(broker.socket) as b:
        orig = a.allocate([Spec(2, key=b"dup", content_type="kv_cache")])[0]
        free0 = a.stats().free_pages
        txn = b.prepare([Spec(2, key=b"dup", content_type="kv_cache")])
        assert a.stats().free_pages == free0 - 2
        got = txn.commit()[0]
        assert got.deduplicated and got.object_id == orig.object_id and not got.owned
        assert a.stats().free_pages == free0


def test_eviction_follows_priority_then_lru_and_never_touches_pinned(broker):
    evicted: list[int] = []
    with BrokerClient.connect(
        broker.socket, on_event=lambda ev: evicted.extend(ev.evicted.object_ids) if ev.HasField("evicted") else None
    ) as c:
        total = c.stats().max_pages  # 64
        kv = c.allocate([Spec(8, content_type="kv_cache") for _ in range(2)])
        pinned = c.allocate([Spec(8, content_type="temp_buffer", pin=True)])[0]
        temp_old, temp_new = c.allocate([Spec(8, content_type="temp_buffer") for _ in range(2)])
        act = c.allocate([Spec(8, content_type="activation")])[0]
        # 48 of 64 pages used; 20 more crosses the 0.90 watermark (57.6) and must come
        # out of the temp buffers first (oldest first), then activations; never the pinned one.
        c.allocate([Spec(14, content_type="kv_cache")])
        st = c.stats()
        assert st.eviction_runs >= 1
        assert st.used_pages <= int(0.80 * total)
        deadline = time.monotonic() + 2
        while len(evicted) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert evicted == [temp_old.object_id, temp_new.object_id]
        # Everything else is still there: pinning would fail with NOT_FOUND otherwise.
        survivors = c.pin([pinned, act, *kv])
        assert len(survivors) == 4
        with pytest.raises(BrokerError) as e:
            c.pin([temp_old])
        assert e.value.code == Code.NOT_FOUND and "evicted" in e.value.message


def test_pool_full_of_pinned_objects_refuses_with_numbers_and_changes_nothing(broker):
    with BrokerClient.connect(broker.socket) as c:
        c.allocate([Spec(60, pin=True)])
        before = c.stats()
        with pytest.raises(BrokerError) as e:
            c.allocate([Spec(8)])
        assert e.value.code == Code.RESOURCE_EXHAUSTED
        assert "need 8 pages, 4 free, 0 evictable" in e.value.message
        after = c.stats()
        for f in ("used_pages", "free_pages", "objects", "evicted_objects", "pinned_pages"):
            assert getattr(after, f) == getattr(before, f), f


def _settled_stats(c: BrokerClient, within_s: float = 5.0):
    """Stats once eviction is no longer active: the daemon drains down to the low watermark
    off the request path (in batches on its loop), so the answer to the allocation that
    crossed the high watermark may come before the drain has run."""
    deadline = time.monotonic() + within_s
    st = c.stats()
    while st.eviction_active and time.monotonic() < deadline:
        time.sleep(0.005)
        st = c.stats()
    return st


def test_hysteresis_is_observable_in_stats(broker):
    with BrokerClient.connect(broker.socket) as c:
        c.allocate([Spec(8) for _ in range(7)])  # 56 of 64: under 0.90
        s0 = c.stats()
        assert s0.eviction_runs == 0 and not s0.eviction_active
        c.allocate([Spec(4)])  # 60 > 57.6: evict down to <= 51.2
        s1 = _settled_stats(c)
        assert s1.eviction_runs == 1 and s1.used_pages <= 51 and not s1.eviction_active
        c.allocate([Spec(4)])  # between low and high: no eviction
        s2 = c.stats()
        assert s2.eviction_runs == 1 and s2.evicted_objects == s1.evicted_objects
        high = int(0.90 * s2.max_pages)
        c.allocate([Spec(high + 1 - s2.used_pages)])  # crosses high again
        assert c.stats().eviction_runs == 2


def test_killed_client_releases_pins_transactions_and_anonymous_pages_within_a_second(broker):
    with BrokerClient.connect(broker.socket) as watcher:
        free0 = watcher.stats().free_pages
        child = spawn_child(
            broker.socket,
            """
            import torch
            c = BrokerClient.connect(SOCKET)
            keyed = c.allocate([Spec(2, key=b"survivor", content_type="kv_cache", contiguous=True)])[0]
            keyed.tensor().fill_(0x5A)
            c.pin([keyed])
            anon = c.allocate([Spec(3, pin=True)])
            txn = c.prepare([Spec(4)], pin=[keyed])
            out(ready=True)
            time.sleep(600)
            """,
        )
        try:
            assert read_line(child)["ready"]
            st = watcher.stats()
            assert st.sessions == 2 and st.open_transactions == 1 and st.pinned_pages == 5
            assert st.free_pages == free0 - 9
            child.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.0:
                st = watcher.stats()
                if st.sessions == 1:
                    break
                time.sleep(0.01)
            assert st.sessions == 1, "session not ended within 1 s of SIGKILL"
            assert st.open_transactions == 0 and st.pinned_pages == 0
            assert st.free_pages == free0 - 2  # only the keyed object remains
            with watcher.lookup_pinned([b"survivor"]) as objs:
                assert objs and bool((objs[0].tensor() == 0x5A).all())
        finally:
            child.kill()
            child.wait()


def test_sessions_cannot_free_or_unpin_what_they_do_not_own(broker):
    with BrokerClient.connect(broker.socket) as a, BrokerClient.connect(broker.socket) as b:
        o = a.allocate([Spec(1, pin=True)])[0]
        with pytest.raises(BrokerError) as e:
            b.free([o])
        assert e.value.code == Code.PERMISSION_DENIED
        with pytest.raises(BrokerError) as e:
            b.unpin([o])
        assert e.value.code == Code.PERMISSION_DENIED
        a.unpin([o])
        with pytest.raises(BrokerError) as e:
            a.unpin([o])
        assert e.value.code == Code.FAILED_PRECONDITION


def test_fd_channel_refuses_a_wrong_token(broker):
    from memory_broker.clients.fd_channel import FdChannelError, fetch_slab_fds

    with BrokerClient.connect(broker.socket) as c:
        with pytest.raises(FdChannelError) as e:
            fetch_slab_fds(c.arena.fd_socket_path, "0" * 32, 0)
        assert e.value.code == "PERMISSION_DENIED"


def test_allow_uid_adds_a_uid_and_keeps_the_brokers_own(broker_factory):
    # Issue 26: --allow-uid used to replace the broker's own uid, refusing its own client.
    # Refusing a uid outside the set: tests/test_session_proof.py (a client run as another uid).
    b = broker_factory("--allow-uid", str(os.getuid() + 4242))
    with BrokerClient.connect(b.socket) as c:
        c.free(c.allocate([Spec(1)]))


def test_arena_grows_on_demand_and_clients_map_new_slabs(broker):
    with BrokerClient.connect(broker.socket) as a, BrokerClient.connect(broker.socket) as b:
        assert a.stats().num_slabs == 0
        objs = a.allocate([Spec(4, contiguous=True, key=f"g{i}".encode()) for i in range(5)])
        assert a.stats().num_slabs == 5
        for i, o in enumerate(objs):
            o.tensor().fill_(i + 1)
        found = b.lookup([f"g{i}".encode() for i in range(5)])
        assert [int(o.tensor()[0]) for o in found] == [1, 2, 3, 4, 5]


def test_a_second_broker_cannot_take_a_live_socket(broker):
    r = subprocess.run(
        [sys.executable, "-m", "memory_broker.broker.cli", "serve", "--socket", broker.socket, "--arena", "host"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1
    assert f"pid {broker.proc.pid}" in r.stderr
    with BrokerClient.connect(broker.socket) as c:  # the first still serves
        assert c.stats().sessions == 1


def test_sigterm_drains_tells_sessions_and_exits_zero(broker):
    events = []
    c = BrokerClient.connect(broker.socket, on_event=events.append)
    c.allocate([Spec(1)])
    assert broker.stop(signal.SIGTERM) == 0
    assert c.session_ended.wait(5)
    assert any(ev.HasField("shutting_down") for ev in events)
    assert not os.path.exists(broker.socket)
    assert not os.path.exists(broker.socket + ".lock")
    names = [e.get("event") for e in broker.log_events()]
    assert "draining" in names and "stopped" in names
    c.close()


def test_health_and_reflection_list_the_services(broker):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"unix:{broker.socket}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
    assert {"broker.v1.MemoryBroker", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_status_command_prints_the_pool_for_a_person_and_as_json(broker):
    import json

    with BrokerClient.connect(broker.socket) as c:
        c.allocate([Spec(3, content_type="kv_cache", pin=True)])
        human = subprocess.run(
            [sys.executable, "-m", "memory_broker.broker.cli", "status", "--socket", broker.socket],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        js = subprocess.run(
            [sys.executable, "-m", "memory_broker.broker.cli", "status", "--socket", broker.socket, "--json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert human.returncode == 0, human.stderr
    assert "3/64 pages used" in human.stdout and "pinned 3" in human.stdout and "kv_cache" in human.stdout
    data = json.loads(js.stdout)
    assert data["arena"]["backend"] == "host"
    assert int(data["stats"]["used_pages"]) == 3


def test_status_without_a_broker_says_so():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "memory_broker.broker.cli",
            "status",
            "--socket",
            "/tmp/no-such-broker.sock",
            "--timeout",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1 and "no broker answered" in r.stderr


def test_bad_serve_flags_are_refused_naming_the_setting():
    r = subprocess.run(
        [sys.executable, "-m", "memory_broker.broker.cli", "serve", "--socket", "/tmp/x.sock", "--page-size", "3MiB"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "page_size" in r.stderr


def test_broker_death_leaves_client_mappings_readable(broker):
    with BrokerClient.connect(broker.socket) as c:
        o = c.allocate([Spec(2, contiguous=True)])[0]
        o.tensor().fill_(9)
        broker.stop(signal.SIGKILL)
        assert c.session_ended.wait(5)
        assert bool((o.tensor() == 9).all())
