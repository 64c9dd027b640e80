"""The step channel end to end: the client's step calls go over it with gRPC's semantics, the
broker's books (GetStats) see them, and the channel
refuses strangers and malformed frames without changing anything."""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
from conftest import ROOT, read_line, spawn_child, start_broker
from conftest import step_frames as frames
from rigs import recv_exact

from memory_broker.clients import BrokerClient, BrokerError, Code, Spec
from memory_broker.proto.wire import step as w

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores


def books(c: BrokerClient) -> tuple:
    st = c.stats()
    return (st.sessions, st.objects, st.pinned_pages, st.open_transactions, st.used_pages, st.adapters.hot)


# ------------------------------------------------------------------ the calls


def test_step_calls_go_over_the_channel_and_getstats_sees_them(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    with BrokerClient.connect(b.socket) as c:
        n = frames(c)
        base = c.stats().pinned_pages
        lease = c.acquire_adapters(["a0", "a1"])
        assert frames(c) == n + 1 and lease.ids == ["a0", "a1"] and {a.found_in for a in lease.adapters} == {"hot"}
        assert c.stats().pinned_pages == base + 2
        objs = c.lookup([b"k0", b"k1", b"nope", b"k2"])
        assert [o.key for o in objs] == [b"k0", b"k1"] and all(o.session_pins == 1 for o in objs)
        assert c.stats().pinned_pages == base + 4
        c.unpin(objs)
        lease.release()
        assert frames(c) == n + 4
        assert c.stats().pinned_pages == base
        # Pin by id and a pinned() block take the same path.
        with c.pinned(objs) as again:
            assert [o.object_id for o in again] == [o.object_id for o in objs]
            assert c.stats().pinned_pages == base + 2
        assert c.stats().pinned_pages == base and frames(c) == n + 6


def test_calls_act_in_the_order_issued_across_both_paths(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        (obj,) = setup.allocate([Spec(2)])  # gRPC, another session
        (mine,) = c.allocate([Spec(1)])  # gRPC
        c.pin([mine])  # step channel
        assert c.stats().pinned_pages == 1  # gRPC sees it at once
        c.unpin([mine])
        assert c.stats().pinned_pages == 0
        (held,) = c.lookup([b"k3"])  # step channel
        assert setup.free([obj]) == (2, 0)
        (k3,) = setup.lookup([b"k3"], pin=False)
        assert setup.free([k3]) == (0, 1)  # gRPC: the step channel's pin defers the free
        c.unpin([held])  # step channel: the deferred free happens now
        assert c.stats().objects == 6


def test_an_adapter_that_is_not_hot_is_loaded_on_the_channel_with_grpcs_deferral(step_rig, monkeypatch):
    """A cold acquire is one frame: the broker loads and answers it (no second transport),
    admitting and deferring as gRPC does."""
    from memory_broker.clients.step.grpc_calls import GrpcCalls

    b, _ = step_rig
    with BrokerClient.connect(b.socket) as fast, BrokerClient.connect(b.socket, fast_path=False) as slow:
        n = frames(fast)
        with monkeypatch.context() as mp:
            mp.setattr(GrpcCalls, "acquire_adapters", lambda *a, **kw: pytest.fail("acquired over gRPC"))
            lease = fast.acquire_adapters(["a0", "a1", "a2"], max_adapters=2)
        assert frames(fast) == n + 1  # one frame: the broker loaded them before it answered
        assert lease.ids == ["a0", "a1"] and lease.deferred == ["a2"]
        assert [a.found_in for a in lease.adapters] == ["cold", "cold"]
        other = slow.acquire_adapters(["a0", "a1", "a2"], max_adapters=2)
        assert (other.ids, other.deferred) == (lease.ids, lease.deferred)
        # Now hot: the step channel admits the same way without a load.
        again = fast.acquire_adapters(["a1", "a0", "a1", "a2"], max_adapters=2)
        assert frames(fast) == n + 2 and again.ids == ["a1", "a0"] and again.deferred == ["a2"]
        assert [a.generation for a in again.adapters] == [lease["a1"].generation, lease["a0"].generation]
        assert [a.found_in for a in again.adapters] == ["hot", "hot"]
        for x in (lease, other, again):
            x.release()
        assert fast.stats().pinned_pages == 0


def test_unknown_adapters_and_bad_ids_are_refused_as_over_grpc(step_rig):
    """As over gRPC: a give-back's refusal is raised by the call itself."""
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        before = books(c)
        with pytest.raises(BrokerError) as e:
            c.acquire_adapters(["no-such"])
        assert e.value.code == Code.NOT_FOUND
        with pytest.raises(BrokerError) as e:
            c.release_adapters(["a0"])
        assert e.value.code in (Code.FAILED_PRECONDITION, Code.NOT_FOUND)
        with pytest.raises(BrokerError) as e:
            c.unpin([999])
        assert e.value.code == Code.NOT_FOUND
        anon = setup.allocate([Spec(1)])[0]
        with pytest.raises(BrokerError) as e:
            c.pin([anon.object_id])
        assert e.value.code == Code.NOT_FOUND and e.value.message == f"no object {anon.object_id}"
        with pytest.raises(BrokerError) as e:
            c.commit_acquire(12345)
        assert e.value.code == Code.NOT_FOUND
        setup.free([anon])
        assert books(c) == before


def test_two_phase_acquire_prepares_the_next_step_and_commits_it_in_one_call(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1", "a2"], "hot")
    with BrokerClient.connect(b.socket) as c:
        n = frames(c)
        nxt = c.step(["a1", "a2"], prepare=True, lease_s=0.3)
        assert nxt.adapters.transaction_id and frames(c) == n + 1
        assert c.stats().open_transactions == 1
        cur = c.step(["a0"], [b"k0"], commit=nxt.adapters)  # commit + acquire + lookup: one frame
        assert frames(c) == n + 2 and c.stats().open_transactions == 0
        time.sleep(0.5)  # past the lease: committed pins stay
        assert c.stats().pinned_pages == 4
        nxt.release()
        cur.release()
        assert c.stats().pinned_pages == 0
        # An uncommitted prepare ends with its lease.
        c.step(["a0"], prepare=True, lease_s=0.2)
        time.sleep(0.6)
        assert c.stats().pinned_pages == 0 and c.stats().open_transactions == 0


def test_a_dead_process_loses_its_pins_and_leases_within_a_second(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    body = """
c = BrokerClient.connect(SOCKET)
s = c.step(["a0", "a1"], [b"k0", b"k1", b"k2"])
out(held=len(s.objects))
time.sleep(60)
"""
    p = spawn_child(b.socket, body)
    try:
        assert read_line(p)["held"] == 3
        assert setup.stats().pinned_pages == 5
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 1.0
        while setup.stats().pinned_pages and time.monotonic() < deadline:
            time.sleep(0.02)
        st = setup.stats()
        assert st.pinned_pages == 0 and st.sessions == 1, st
    finally:
        if p.poll() is None:
            p.kill()


# ------------------------------------------------------------------ strangers and garbage


def raw_conn(c: BrokerClient, token: str | None = None) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(c._step_socket())
    if token is not None:
        kind, r = call(s, w.frame(w.HELLO, token.encode()))
        assert kind == w.OK, r.error
    return s


def call(s: socket.socket, data: bytes) -> tuple[int, w.StepReply]:
    s.sendall(data)
    hdr = recv_exact(s, 5)
    n, kind = w.HEADER.unpack(hdr)
    return kind, w.decode_step_reply(kind, recv_exact(s, n))


def test_a_wrong_token_or_a_step_before_hello_is_refused_and_the_connection_closed(step_rig):
    b, _ = step_rig
    with BrokerClient.connect(b.socket) as c:
        for first in (w.frame(w.HELLO, b"not-a-token"), w.encode_step([w.Op(w.OP_UNPIN, (1,))]), w.frame(w.PING)):
            s = raw_conn(c)
            kind, r = call(s, first)
            assert kind == w.ERROR and r.error.code == Code.PERMISSION_DENIED, r.error
            assert s.recv(1) == b""  # closed
            s.close()


def test_another_process_presenting_the_token_is_refused(step_rig):
    b, _ = step_rig
    with BrokerClient.connect(b.socket) as owner:
        code = (
            "import socket, struct\n"
            f"s = socket.socket(socket.AF_UNIX); s.connect({owner._step_socket()!r})\n"
            f"t = {owner.token!r}.encode(); s.sendall(struct.pack('<IB', len(t), 1) + t)\n"
            "print(s.recv(65536))\n"
        )
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert "belongs to process" in r.stdout, r.stdout + r.stderr
        time.sleep(0.3)
        assert not owner.session_ended.is_set() and owner.stats().sessions == 2


def test_malformed_frames_get_an_error_frame_and_change_nothing(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        c.acquire_adapters(["a0"])  # something held, so a bad release could take it
        c.lookup([b"k0"])
        before = books(c)
        s = raw_conn(c, c.token)
        good = w.encode_step([w.Op(w.OP_RELEASE, ("a0",)), w.Op(w.OP_UNPIN, (1,))])[5:]
        bad = [
            good[:-3],  # truncated inside an op
            good + b"\x01",  # trailing bytes
            struct.pack("<HB", 1, 200),  # unknown op
            struct.pack("<H", 65535),  # a count with nothing behind it
            b"",  # no op count at all
        ]
        rng = random.Random(5)
        for _ in range(300):  # corrupted copies of a valid frame that would change state
            x = bytearray(good)
            for _ in range(rng.randint(1, 4)):
                x[rng.randrange(len(x))] = rng.randrange(256)
            bad.append(bytes(x[: rng.randint(0, len(x))]))
        refused = 0
        for body in bad:
            kind, r = call(s, struct.pack("<IB", len(body), w.STEP) + body)
            if kind == w.ERROR:
                refused += 1
                assert r.error.code in (
                    Code.INVALID_ARGUMENT,
                    Code.NOT_FOUND,
                    Code.FAILED_PRECONDITION,
                    Code.PERMISSION_DENIED,
                ), r.error
                assert r.results == []  # nothing ran before the refusal
            else:
                # A corruption that still parses as something harmless (e.g. an empty step).
                assert all(x is None for x in r.results), r
        assert refused >= 250
        # Unknown frame kinds: an error, the connection lives on.
        kind, r = call(s, struct.pack("<IB", 0, 77))
        assert kind == w.ERROR and r.error.code == Code.INVALID_ARGUMENT and "unknown frame kind" in r.error.message
        assert call(s, w.frame(w.PING))[0] == w.OK
        assert books(c) == before
        # A length no client sends: refused and closed (the stream cannot be resynchronized).
        kind, r = call(s, struct.pack("<IB", w.MAX_FRAME_BYTES + 1, w.STEP))
        assert kind == w.ERROR and r.error.code == Code.INVALID_ARGUMENT and "at most" in r.error.message
        assert s.recv(1) == b""
        assert books(c) == before


def test_a_broker_without_the_channel_is_served_over_grpc(step_rig, monkeypatch):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    monkeypatch.setattr(BrokerClient, "_step_socket", lambda self: "/nonexistent/step")
    with BrokerClient.connect(b.socket) as c:
        assert c._step_path() is None
        with c.step(["a0"], [b"k0"]) as s:
            assert s.adapters.ids == ["a0"] and [o.key for o in s.objects] == [b"k0"]
            assert c.stats().pinned_pages == 2
        assert c.stats().pinned_pages == 0


def test_random_steps_keep_the_counts_straight_and_give_everything_back(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")  # a2, a3 start cold: the step loads them
    keys = [b"k%d" % i for i in range(6)] + [b"absent"]
    rng = random.Random(9)
    with BrokerClient.connect(b.socket) as c:
        prev = None
        pending = None
        for _ in range(120):
            ids = rng.sample(["a0", "a1", "a2", "a3"], rng.randint(0, 3))
            ks = rng.sample(keys, rng.randint(0, 4))  # distinct: a key named twice is refused (test_reply_bounds)
            if rng.random() < 0.4:
                pending = c.step_begin(ids, ks, max_adapters=2, release=prev)
                cur = pending.result()
            else:
                cur = c.step(ids, ks, max_adapters=2, release=prev)
            want = list(dict.fromkeys(ids))[:2]
            assert (cur.adapters.ids if cur.adapters else []) == want
            found = [o.key for o in cur.objects]
            assert found == ks[: len(found)] and (len(found) == len(ks) or ks[len(found)] == b"absent")
            # The broker pins at least what the current step holds.
            assert c.stats().pinned_pages >= len(want) + len(set(found))
            prev = cur
        prev.release()
        assert c.stats().pinned_pages == 0


def test_arguments_the_frame_cannot_carry_are_invalid_and_change_nothing(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        before = books(c)
        for call_ in (
            lambda: c.unpin([-1]),
            lambda: c.acquire_adapters(["a0"], max_adapters=70000),
            lambda: c.step(["a0"], prepare=True, lease_s=1e9),
        ):
            with pytest.raises(BrokerError) as e:
                call_()
            assert e.value.code == Code.INVALID_ARGUMENT
        assert books(c) == before


def test_the_step_socket_follows_socket_mode_and_goes_with_the_broker(broker_factory):
    import stat

    b = broker_factory("--socket-mode", "0660")
    assert stat.S_IMODE(os.stat(b.socket + ".step").st_mode) == 0o660
    b.stop()
    assert not os.path.exists(b.socket + ".step")


def test_threads_sharing_a_client_each_get_their_own_answers(step_rig):
    import threading

    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    with BrokerClient.connect(b.socket) as c:
        errors = []

        def worker(i: int) -> None:
            try:
                for n in range(150):
                    key = b"k%d" % ((i + n) % 6)
                    with c.step([f"a{(i + n) % 2}"], [key]) as s:
                        assert [o.key for o in s.objects] == [key] and s.adapters.ids == [f"a{(i + n) % 2}"]
                    c.unpin(c.pin([s.objects[0]]))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert c.stats().pinned_pages == 0


def test_a_lookup_whose_channel_breaks_is_answered_by_the_next_session_on_its_step_channel(monkeypatch):
    """The broker killed under a lookup: the call waits for the client's reconnect and is sent
    once more on the new session's step channel (never over gRPC), as gRPC's retry does."""
    import threading

    from conftest import short_tmpdir

    from memory_broker.clients.step.grpc_calls import GrpcCalls

    def no_grpc(*a, **k):
        raise AssertionError("a step call went over gRPC")

    monkeypatch.setattr(GrpcCalls, "lookup", no_grpc)
    sock = os.path.join(short_tmpdir(), "b.sock")
    b1 = start_broker(socket=sock)
    started: list = []
    c = BrokerClient.connect(sock, timeout=20)
    try:
        c.allocate([Spec(1, content_type="kv_cache", key=b"r")])
        assert [o.key for o in c.lookup([b"r"])] == [b"r"]
        b1.stop(signal.SIGKILL)
        later = threading.Timer(0.5, lambda: started.append(start_broker(socket=sock)))
        later.start()
        assert c.lookup([b"r"]) == []  # the new broker's answer: it holds nothing
        later.join()
        assert c.reconnects == 1 and frames(c) >= 1
    finally:
        c.close()
        for b in (b1, *started):
            b.stop(signal.SIGKILL)


def test_the_step_path_follows_the_client_across_a_broker_restart():
    from conftest import short_tmpdir

    sock = os.path.join(short_tmpdir(), "b.sock")
    b1 = start_broker(socket=sock)
    b2 = None
    c = BrokerClient.connect(sock, timeout=10)
    try:
        c.allocate([Spec(1, content_type="kv_cache", key=b"r")])
        assert [o.key for o in c.lookup([b"r"])] == [b"r"]
        first = c._step_path()
        b1.stop(signal.SIGKILL)
        assert c.session_ended.wait(10)
        b2 = start_broker(socket=sock)
        deadline = time.monotonic() + 20
        while c.reconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        # The old session's pins are gone with it; the new session gets a step path of its own.
        assert c.lookup([b"r"]) == []
        assert c._step_path() is not first
        c.allocate([Spec(1, content_type="kv_cache", key=b"r")])
        n = frames(c)
        assert [o.key for o in c.lookup([b"r"])] == [b"r"] and frames(c) == n + 1
        assert c.stats().pinned_pages == 1
    finally:
        c.close()
        for b in (b1, b2):
            if b is not None:
                b.stop(signal.SIGKILL)


def test_a_call_made_between_begin_and_result_reads_the_begun_reply_first(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        n = frames(c)
        pending = c.step_begin(["a0"], [b"k0", b"k1"])
        assert frames(c) == n + 1  # sent at begin
        assert [o.key for o in c.lookup([b"k2"])] == [b"k2"]  # its own reply, not the begun one's
        s = pending.result()
        assert s.adapters.ids == ["a0"] and [o.key for o in s.objects] == [b"k0", b"k1"]
        assert pending.result() is s
        s.release()
        assert c.stats().pinned_pages == 1  # k2, still the caller's


def test_a_reply_larger_than_one_read_arrives_whole(step_rig):
    b, setup = step_rig
    keys = [b"big-%04d-" % i + b"x" * 100 for i in range(40)]
    setup.allocate([Spec(1, content_type="kv_cache", key=k) for k in keys])
    with BrokerClient.connect(b.socket) as c:
        # 40 objects x (40 B + a 109 B key), looked up by 12 ops of one frame: ~70 KiB in one
        # reply (one op may not name a key twice).
        kind, r = call(raw_conn(c, c.token), w.encode_step([w.Op(w.OP_LOOKUP, tuple(keys), 0)] * 12))
        assert kind == w.OK and [[o.key for o in objs] for objs in r.results] == [keys] * 12


def test_an_acquire_of_an_adapter_a_begun_step_is_acquiring_leaks_no_pin(step_rig):
    # Step 2 is sent while step 1's acquire of a0 is in flight: each gets its own reply, and
    # each pin it took goes back with its lease.
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    with BrokerClient.connect(b.socket) as c:
        pending = c.step_begin(["a0"], [b"k0"])
        both = c.step(["a0", "a1"], [b"k0", b"k1"])
        first = pending.result()
        assert first.adapters.ids == ["a0"] and both.adapters.ids == ["a0", "a1"]
        first.release()
        both.release()
        assert c.stats().pinned_pages == 0
        batch = c.step_batch()
        p = batch.begin(["a0"], (), [b"k2"])
        with c.lookup_pinned([b"k2"]) as objs:  # a lookup of what the begun change pins
            assert [o.key for o in objs] == [b"k2"]
        p.result()
        batch.release()
        assert c.stats().pinned_pages == 0


# ------------------------------------------------------------------ before HELLO

ATTACKER = (
    "import os, socket, struct, sys, time\n"
    "os.setgid(65534); os.setuid(65534)\n"
    "path, n = sys.argv[1], int(sys.argv[2])\n"
    "frame = struct.pack('<IB', 4 << 20, 2) + b'x' * (256 << 10)\n"
    "conns = []\n"
    "for _ in range(n):\n"
    "    s = socket.socket(socket.AF_UNIX); s.setblocking(False)\n"
    "    try:\n"
    "        s.connect(path); s.send(frame)\n"
    "    except OSError:\n"
    "        pass\n"
    "    conns.append(s)\n"
    "print('sent', flush=True)\n"
    "time.sleep(float(sys.argv[3]))\n"
    "def is_closed(s):\n"
    "    s.setblocking(True); s.settimeout(0.5)\n"
    "    try:\n"
    "        while s.recv(1 << 16):\n"
    "            pass\n"
    "        return True\n"
    "    except TimeoutError:\n"
    "        return False\n"
    "    except OSError:\n"
    "        return True\n"
    "print('closed', sum(map(is_closed, conns)), flush=True)\n"
)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(os.geteuid() != 0, reason="the attacker runs as another uid (65534), which needs root to become")
def test_connections_without_hello_hold_no_memory_and_go_at_the_deadline(broker_factory):
    from memory_broker.broker.doors.step_channel import HELLO_DEADLINE_S

    b = broker_factory("--socket-mode", "0666")
    os.chmod(os.path.dirname(b.socket), 0o755)
    step_sock = b.socket + ".step"
    with BrokerClient.connect(b.socket) as c:
        c.pin(c.allocate([Spec(1)]))  # warm: the step path is up before the attack
        idle = _rss(b.proc.pid)
        attacker = subprocess.Popen(
            [sys.executable, "-c", ATTACKER, step_sock, "1000", str(HELLO_DEADLINE_S + 1.5)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert attacker.stdout.readline().strip() == "sent"
            # Another uid's engine (this process, root) is served over the step channel meanwhile.
            n = frames(c)
            (obj,) = c.allocate([Spec(1, key=b"during-the-attack")])
            c.pin([obj])
            c.unpin([obj])
            assert frames(c) >= n + 2
            with BrokerClient.connect(b.socket) as late:  # a new step client connects and HELLOs
                late.pin([obj])
                assert frames(late) >= 1
            grown = _rss(b.proc.pid) - idle
            assert grown < 64 << 20, f"the broker grew {grown >> 20} MiB under the attack"
            out, _ = attacker.communicate(timeout=60)
        finally:
            attacker.kill()
        # Every attacking connection was refused at once (oversized frame before HELLO, or
        # over the per-uid cap) or closed at the deadline: none is left open.
        assert out.strip().splitlines()[-1] == "closed 1000", out
        assert _rss(b.proc.pid) - idle < 64 << 20


def test_one_session_holds_at_most_its_cap_and_another_client_still_gets_the_channel(step_rig, caplog):
    from memory_broker.broker.doors.step_channel import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_SESSION
    from memory_broker.clients.step import calls as step_calls

    b, _ = step_rig
    held: list[socket.socket] = []
    with BrokerClient.connect(b.socket) as hog:
        try:
            for _ in range(MAX_CONNECTIONS // 2 + 1):  # as many as it is let, past half the channel
                s = raw_conn(hog)
                kind, r = call(s, w.frame(w.HELLO, hog.token.encode()))
                if kind != w.OK:
                    break
                held.append(s)
            assert len(held) <= MAX_CONNECTIONS // 2, f"one session holds {len(held)} of {MAX_CONNECTIONS}"
            assert len(held) == MAX_CONNECTIONS_PER_SESSION
            assert r.error.code == Code.RESOURCE_EXHAUSTED and "the most one session may hold" in r.error.message
            assert s.recv(1) == b""  # the refused connection is closed
            s.close()
            with BrokerClient.connect(b.socket) as other:  # another engine: the step channel, as ever
                objs = other.allocate([Spec(1)])
                other.pin(objs)
                other.unpin(objs)
                assert other._step_path() is not None and frames(other) >= 2 and other.step_fallback is None
            # The hog's own client falls back to gRPC, and says so once, with the reason.
            with caplog.at_level(logging.INFO, logger=step_calls.__name__):
                objs = hog.allocate([Spec(1)])
                for _ in range(3):
                    hog.pin(objs)
                    hog.unpin(objs)
            assert hog._step_path() is None and "the most one session may hold" in hog.step_fallback
            warned = [x.getMessage() for x in caplog.records if x.levelno == logging.WARNING]
            assert len(warned) == 1 and "gRPC" in warned[0] and "the most one session may hold" in warned[0], warned
        finally:
            for s in held:
                s.close()


def test_past_hello_one_uid_holds_at_most_half_the_channel():
    from memory_broker.broker.doors.step_channel import StepChannelServer

    server = StepChannelServer("unused", loop=None, store=None, sessions=None, adapters=None, allowed_uids=None)
    held = server._held
    assert held.per_uid == server.max_connections // 2 and held.per_session <= held.per_uid
    for sid in range(held.per_uid // held.per_session):  # one uid's sessions fill its share
        for _ in range(held.per_session):
            assert held.over_limit(1000, sid) == ""
            held.start(1000, sid)
        assert "the most one session may hold" in held.over_limit(1000, sid)
    assert "the most one uid may hold" in held.over_limit(1000, 10_000)  # a new session of that uid
    assert held.over_limit(1001, 10_001) == ""  # another uid's engine still gets one
    held.stop(1000, 0)
    assert held.over_limit(1000, 0) == "" and held.over_limit(1000, 10_000) == ""


# ------------------------------------------------------------------ one calls object per session


def test_both_transports_calls_objects_offer_the_same_calls():
    """The client picks one calls object per session and never asks which it has: both have
    the same public methods, with the same parameters."""
    import inspect

    from memory_broker.clients.step.channel import ChannelCalls
    from memory_broker.clients.step.grpc_calls import GrpcCalls

    def calls(cls) -> dict:
        return {
            n: list(inspect.signature(f).parameters)
            for n, f in inspect.getmembers(cls, inspect.isfunction)
            if not n.startswith("_")
        }

    assert calls(ChannelCalls) == calls(GrpcCalls)
    assert {"lookup", "pin", "unpin", "acquire_adapters", "release_adapters", "step", "change"} <= set(calls(GrpcCalls))


@pytest.mark.parametrize("fast_path", [True, False], ids=["step-channel", "grpc"])
def test_a_session_chooses_its_calls_once_and_again_after_its_channel_breaks(step_rig, fast_path):
    b, _ = step_rig
    with BrokerClient.connect(b.socket, fast_path=fast_path) as c:
        first = c._step_calls()
        assert type(first).__name__ == ("ChannelCalls" if fast_path else "GrpcCalls")
        assert c._step_calls() is first and [o.key for o in c.lookup([b"k0"])] == [b"k0"]
        if fast_path:
            first.path.transport.close()  # the channel broke: the next call chooses again
            assert [o.key for o in c.lookup([b"k1"])] == [b"k1"]
            assert c._step_calls() is not first and c._step_path() is not first.path


@pytest.mark.parametrize("fast_path", [True, False], ids=["step-channel", "grpc"])
def test_a_lookup_changes_page_access_once_for_all_its_objects(step_rig, fast_path):
    """The objects of one lookup are mapped together: one look at their page access and at
    most one change of it, for all of them, not one per object (what a step of many keys
    pays per item). Another session's pages on the host arena are read-only here already
    (``reads_only``): then nothing is changed at all."""
    b, _ = step_rig
    with BrokerClient.connect(b.socket, fast_path=fast_path) as c:
        looks, calls = [], []
        real, real_look = c.view.set_page_access, c.view.reads_only
        c.view.set_page_access = lambda pages, ro: (calls.append((sorted(pages), ro)), real(pages, ro))[1]
        c.view.reads_only = lambda pages: (looks.append(sorted(pages)), real_look(pages))[1]
        objs = c.lookup([b"k%d" % i for i in range(6)])
        assert [o.key for o in objs] == [b"k%d" % i for i in range(6)]
        pages = sorted(p for o in objs for p in o.pages)
        assert looks == [pages] and calls in ([], [(pages, True)])
        assert c.view.reads_only(pages)  # read-only here, whichever way it came to be
        c.unpin(objs)


def test_a_generic_call_is_one_frame_of_its_own_items(step_rig, monkeypatch):
    """acquire_adapters, lookup, pin, unpin and release cost what one frame of their items
    costs: one frame each, one op in it."""
    from memory_broker.clients.step.transport import StepTransport

    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    with BrokerClient.connect(b.socket) as c:
        c.acquire_adapters(["a0"]).release()  # the session's channel, and a0's layout, once
        sent: list[list[int]] = []
        real_request = StepTransport.request
        monkeypatch.setattr(  # what went on the wire, op by op
            StepTransport,
            "request",
            lambda self, data: (sent.append([o.kind for o in w.decode_step(data[5:])]), real_request(self, data))[1],
        )
        n = frames(c)
        base = c.stats().pinned_pages
        lease = c.acquire_adapters(["a0", "a1", "a0"], max_adapters=1)
        assert lease.ids == ["a0"] and lease.deferred == ["a1"] and frames(c) == n + 1
        objs = c.lookup([b"k0", b"k1", b"nope"])
        assert [o.key for o in objs] == [b"k0", b"k1"] and frames(c) == n + 2
        again = c.pin(objs)
        assert [o.session_pins for o in again] == [2, 2] and frames(c) == n + 3
        c.unpin(objs + again)
        lease.release()
        assert frames(c) == n + 5 and c.stats().pinned_pages == base
        assert sent == [[w.OP_ACQUIRE], [w.OP_LOOKUP], [w.OP_PIN], [w.OP_UNPIN], [w.OP_RELEASE]]
        # Nothing to send: no frame.
        assert c.lookup([]) == [] and c.unpin([]) is None and frames(c) == n + 5
        # A refusal is the broker's, as before, raised by the call's one frame.
        with pytest.raises(BrokerError) as e:
            c.unpin([objs[0]])
        assert e.value.code == Code.FAILED_PRECONDITION and frames(c) == n + 6


def test_a_step_is_one_frame_of_its_ops_and_a_refusal_gives_its_acquire_back(step_rig, monkeypatch):
    """``client.step`` sends what the previous step gives back, the acquire and the lookup in one
    frame, in that order; an op refused after the acquire leaves nothing of the step pinned,
    and the error is the broker's."""
    from memory_broker.clients.step.transport import StepTransport

    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    with BrokerClient.connect(b.socket) as c:
        c.acquire_adapters(["a0", "a1"]).release()  # the session's channel, and the layouts, once
        sent: list[list[tuple[int, int]]] = []
        real_request = StepTransport.request
        monkeypatch.setattr(  # what went on the wire, op by op
            StepTransport,
            "request",
            lambda self, data: (
                sent.append([(o.kind, len(o.items)) for o in w.decode_step(data[5:])]),
                real_request(self, data),
            )[1],
        )
        n, base = frames(c), books(c)
        one = c.step(["a0", "a1", "a0"], [b"k0", b"k1", b"nope"], max_adapters=1)
        assert one.adapters.ids == ["a0"] and one.adapters.deferred == ["a1"]
        assert [o.key for o in one.objects] == [b"k0", b"k1"]
        two = c.step(["a1"], [b"k1"], release=one)
        assert two.adapters.ids == ["a1"] and [o.key for o in two.objects] == [b"k1"] and one.released
        assert frames(c) == n + 2 and sent == [
            [(w.OP_ACQUIRE, 3), (w.OP_LOOKUP, 3)],
            [(w.OP_RELEASE, 1), (w.OP_UNPIN, 2), (w.OP_ACQUIRE, 1), (w.OP_LOOKUP, 1)],
        ]
        held = books(c)
        # The lookup (after the acquire) is refused: the acquire is given back in a frame of its own.
        with pytest.raises(BrokerError) as e:
            c.step(["a0"], [b"k0", b""])
        assert e.value.code == Code.INVALID_ARGUMENT and "empty" in e.value.message
        assert sent[2:] == [[(w.OP_ACQUIRE, 1), (w.OP_LOOKUP, 2)], [(w.OP_RELEASE, 1)]]
        assert books(c) == held
        two.release()
        assert books(c) == base


@pytest.mark.parametrize("fast_path", [True, False], ids=["step-channel", "grpc"])
def test_lookup_many_answers_each_list_and_unpins_in_one_frame(step_rig, fast_path):
    """``lookup_many`` is ``unpin`` then one ``lookup`` per list, in one frame on the step
    channel (an engine's step looks up all its requests at once); over gRPC, one call each."""
    b, _ = step_rig
    with BrokerClient.connect(b.socket, fast_path=fast_path) as c:
        held = c.lookup([b"k0", b"k1"])
        n = frames(c) if fast_path else 0
        # k5 in two lists: two lookups, each pinning it once (one list may not name it twice:
        # test_reply_bounds).
        lists = [[b"k0", b"k1", b"nope", b"k2"], [], [b"nope"], [b"k3", b"k4"], [b"k5"], [b"k5"]]
        got = c.lookup_many(lists, pin=True, unpin=held)
        if fast_path:
            assert frames(c) == n + 1
        assert [[o.key for o in g] for g in got] == [[b"k0", b"k1"], [], [], [b"k3", b"k4"], [b"k5"], [b"k5"]]
        pins = {o.key: o.session_pins for o in c.lookup([b"k%d" % i for i in range(6)], pin=False)}
        # k0 and k1: the old pins went, the new ones hold; k5: looked up twice, pinned twice.
        assert pins == {b"k0": 1, b"k1": 1, b"k2": 0, b"k3": 1, b"k4": 1, b"k5": 2}
        unpinned = c.lookup_many([[b"k0"], [b"k3"]], pin=False, unpin=[o for g in got for o in g])
        assert [[o.key for o in g] for g in unpinned] == [[b"k0"], [b"k3"]]
        assert all(o.session_pins == 0 for o in c.lookup([b"k%d" % i for i in range(6)], pin=False))


def test_lookup_many_past_one_frame_and_a_refusal_leave_nothing_pinned(step_rig):
    b, _ = step_rig
    with BrokerClient.connect(b.socket) as c:
        n = frames(c)
        got = c.lookup_many([[b"k%d" % (i % 6)] for i in range(100)], pin=True)  # 64 ops a frame
        assert frames(c) == n + 2 and [g[0].key for g in got] == [b"k%d" % (i % 6) for i in range(100)]
        c.unpin([o for g in got for o in g])
        with pytest.raises(BrokerError) as e:
            c.lookup_many([[b"k0"]] * 70 + [[b"x" * 70000]], pin=True)  # the last key is too long
        assert e.value.code == Code.INVALID_ARGUMENT
        assert all(o.session_pins == 0 for o in c.lookup([b"k%d" % i for i in range(6)], pin=False))


def test_transport_times_out_a_silent_broker_in_the_kernel_with_a_clear_error(tmp_path):
    """The client's step socket is a blocking socket the kernel times out (SO_RCVTIMEO; no
    poll before each call): a broker that takes the frame and never answers gives
    StepUnavailable naming the wait, within about the timeout, not a hang."""
    import threading

    from memory_broker.clients.step.transport import StepTransport, StepUnavailable

    path = str(tmp_path / "silent.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    held = []

    def serve():
        conn, _ = srv.accept()
        held.append(conn)
        head = conn.recv(5)
        n, _kind = w.HEADER.unpack_from(head)
        while n:
            n -= len(conn.recv(n))
        conn.sendall(w.encode_step_reply(0, ()))  # HELLO accepted; then silence

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    t = StepTransport(path, "token", 0.3)
    th.join(5)
    assert t._sock.gettimeout() is None  # blocking: no poll before each call
    t0 = time.monotonic()
    with pytest.raises(StepUnavailable, match=r"did not answer within 0\.3 s"):
        t.request(w.frame(w.PING))
    assert 0.25 <= time.monotonic() - t0 < 3.0
    assert t.closed
    srv.close()
    for c in held:
        c.close()


def test_transport_without_a_timeout_blocks_with_no_kernel_deadline(step_rig):
    """``timeout=None`` (no deadline, as the client's RPCs take it) leaves the socket blocking
    with no SO_RCVTIMEO, and the channel works."""
    from memory_broker.clients.step.transport import StepTransport

    b, _setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        t = StepTransport(c._step_socket(), c.token, None)
        try:
            assert t._sock.gettimeout() is None
            assert t._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16) == bytes(16)
            pong = t.request(w.frame(w.PING))
            # A PING's reply carries the arena's slab count, as every reply does.
            assert pong.error is None and pong.arena_slabs == t.arena_slabs >= 1
        finally:
            t.close()


def test_a_lease_says_where_an_adapter_was_found_when_the_channel_loaded_it(step_rig):
    """An adapter the broker loads for a frame is "cold" in that lease (acquire, step and a
    running batch's change alike), and "hot" after."""
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        lease = c.acquire_adapters(["a0"])
        assert [a.found_in for a in lease.adapters] == ["cold"]
        lease.release()
        s = c.step(["a0", "a1"])
        assert [a.found_in for a in s.adapters.adapters] == ["hot", "cold"]
        s.release()
        batch = c.step_batch()
        batch.update(add=["a2"])
        assert batch.adapters["a2"].found_in == "cold"
        batch.update(add=["a0"], drop=["a2"])
        assert batch.adapters["a0"].found_in == "hot"
        batch.release()
        again = c.acquire_adapters(["a2"])
        assert [a.found_in for a in again.adapters] == ["hot"]
        again.release()


def test_hold_s_is_said_once_to_be_ignored_and_every_call_is_a_frame(step_rig, caplog, monkeypatch):
    """``connect(hold_s=...)`` of a client from before the holdings cache went: it still
    connects, says once (a WARNING) that it is ignored, and each give-back is a frame."""
    from memory_broker.clients import step_session

    monkeypatch.setattr(step_session, "_said_hold_s", False)
    b, setup = step_rig
    with caplog.at_level(logging.WARNING, logger="memory_broker.clients.step_session"):
        with BrokerClient.connect(b.socket, hold_s=5.0) as c, BrokerClient.connect(b.socket, hold_s=5.0):
            objs = c.lookup([b"k0"])
            n = frames(c)
            c.unpin(objs)
            assert frames(c) == n + 1 and c.stats().pinned_pages == 0
    said = [r for r in caplog.records if "hold_s" in r.getMessage()]
    assert len(said) == 1 and "ignored" in said[0].getMessage()
