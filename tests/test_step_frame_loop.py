"""The step channel's frame loop, in a broker served by a thread of this process: a frame's
session and proof are checked once (Pin's visibility still per op), and each op's latency
reaches the metric after the reply, not before it."""

from __future__ import annotations

import asyncio
import itertools
import os
import tempfile
import time

import pytest

from memory_broker.broker.doors import step_channel, step_ops
from memory_broker.clients import BrokerClient, Spec
from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.session import KEY_METADATA


@pytest.fixture(scope="module")
def rig():
    from rigs import inprocess_broker

    d = tempfile.mkdtemp(prefix="mb-fl-", dir="/tmp")
    box = inprocess_broker(d, os.path.join(d, "b.sock"))
    owner = BrokerClient.connect(os.path.join(d, "b.sock"), client_name="owner")
    (anon,) = owner.allocate([Spec(1)])  # anonymous: no other session may see it
    c = BrokerClient.connect(os.path.join(d, "b.sock"), client_name="c")
    c.allocate([Spec(1, content_type="kv_cache", key=b"fl-k")])
    yield box, c, anon.object_id
    c.close()
    owner.close()
    asyncio.run_coroutine_threadsafe(box["server"].stop(), box["loop"]).result(60)


def on_loop(box, fn):
    async def run():
        return await fn()

    return asyncio.run_coroutine_threadsafe(run(), box["loop"]).result(60)


def conn_of(server, c):
    conn = step_channel._Conn(None, None)
    conn.session = server.sessions.from_token(c.token)
    conn.key = dict(c.metadata)[KEY_METADATA]
    return conn


def reply(data: bytes) -> w.StepReply:
    return w.decode_step_reply(data[4], data[5:])


def test_a_frame_checks_its_session_once_and_each_pin_its_ids(rig, monkeypatch):
    box, c, anon = rig
    server = box["server"].step_server
    calls = []
    # The frame's first op takes ``authorize_open`` (its session was checked for the frame),
    # the others ``authorize``: both are counted.
    for name in ("authorize", "authorize_open"):
        real = getattr(server.sessions, name)
        monkeypatch.setattr(
            server.sessions,
            name,
            lambda method, *a, real=real, **kw: (calls.append(method), real(method, *a, **kw))[1],
        )

    async def run():
        conn = conn_of(server, c)
        r = reply(server.ops.step(conn, w.encode_step([w.Op(w.OP_UNPIN, ()), w.Op(w.OP_LOOKUP, (b"fl-k",), 1)])[5:]))
        assert r.error is None
        oid = r.results[1][0].object_id
        checked_plain = list(calls)
        calls.clear()
        ops = [w.Op(w.OP_UNPIN, (oid,)), w.Op(w.OP_PIN, (oid,)), w.Op(w.OP_UNPIN, (oid,)), w.Op(w.OP_PIN, (anon,))]
        r = reply(server.ops.step(conn, w.encode_step(ops)[5:]))
        return checked_plain, list(calls), r

    plain, pins, r = on_loop(box, run)
    assert plain == ["Unpin"]  # the first op's rule checks the session and proof for the frame
    assert pins == ["Unpin", "Pin", "Pin"]  # Pin's visibility is its own ids', op by op
    # Another session's anonymous object stays invisible from a frame's fourth op.
    assert r.error is not None and r.error.code.name == "NOT_FOUND" and r.failed_index == 3


def test_each_ops_latency_is_recorded_after_the_reply(rig, monkeypatch):
    box, c, _ = rig
    server = box["server"].step_server
    got = []
    monkeypatch.setattr(server.ops, "_record", lambda s, method, code: got.append((method, code, s >= 0)))

    async def run():
        conn = conn_of(server, c)
        ops = [w.Op(w.OP_UNPIN, ()), w.Op(w.OP_LOOKUP, (b"none",), 0), w.Op(w.OP_COMMIT, (12345,))]
        r = reply(server.ops.step(conn, w.encode_step(ops)[5:]))
        before = list(got)
        await asyncio.sleep(0)
        return r, before, list(got)

    r, before, after = on_loop(box, run)
    assert r.failed_index == 2 and r.error is not None
    assert before == []  # nothing recorded while the reply is being made
    assert after == [("Unpin", "OK", True), ("Lookup", "OK", True), ("Commit", r.error.code.value, True)]


def test_every_op_kind_has_a_handler_and_ops_are_timed_only_for_a_recorder(rig, monkeypatch):
    """The frame loop dispatches by a table of handlers: one for every op kind the wire
    decodes (``_op`` refuses a kind it lacks). Ops are timed for the latency metric only:
    with a recorder each op's seconds are counted under its kind, without one no op is timed."""
    from memory_broker.proto.wire.errors import BrokerError

    box, c, _ = rig
    server = box["server"].step_server
    assert set(step_ops.HANDLERS) == set(w.OP_NAMES)
    body = w.encode_step([w.Op(w.OP_UNPIN, ()), w.Op(w.OP_LOOKUP, (b"fl-k",), 0)])[5:]

    async def run(record):
        monkeypatch.setattr(server.ops, "_record", record)
        conn = conn_of(server, c)
        spent = dict(server.counters.op_seconds)
        r = reply(server.ops.step(conn, body))
        await asyncio.sleep(0)
        grew = {k for k, t in server.counters.op_seconds.items() if t > spent.get(k, 0.0)}
        try:
            server.ops.op(conn.session.session_id, w.Op(99, ()))
        except BrokerError as e:
            return r, grew, e
        return r, grew, None

    got = []
    r, grew, refused = on_loop(box, lambda: run(lambda s, method, code: got.append(method)))
    assert r.error is None and r.results[0] is None and [o.key for o in r.results[1]] == [b"fl-k"]
    assert grew == {w.OP_UNPIN, w.OP_LOOKUP} and got == ["Unpin", "Lookup"]
    assert refused is not None and refused.code.name == "INVALID_ARGUMENT" and "unknown op kind 99" in refused.message
    r, grew, _ = on_loop(box, lambda: run(None))
    assert r.error is None and grew == set()


@pytest.mark.parametrize("codec", ["native", "python"])
def test_a_whole_step_or_ping_frame_skips_the_dispatch_and_answers_as_it_would(rig, monkeypatch, codec):
    """A STEP or PING frame that arrives whole on a connection past HELLO, with no recorder
    set, is answered straight from the readable callback (``_frame``'s dispatch not run),
    with the bytes ``_frame`` gives for it: a good frame, a refused op (its index and the
    results before it), a malformed body; with either codec, and the frame counted."""
    box, c, _ = rig
    server = box["server"].step_server
    if codec == "python":
        monkeypatch.setattr(w, "_core", None)
    monkeypatch.setattr(server.ops, "_record", None)
    t = c._step_path().transport
    assert t.request(w.frame(w.PING)).error is None  # connected: HELLO sent
    dispatched = []
    real_frame = server._frame
    monkeypatch.setattr(server, "_frame", lambda *a: (dispatched.append(a[1]), real_frame(*a))[1])
    frames0 = server.counters.frames
    r = t.request(w.encode_step([w.Op(w.OP_LOOKUP, (b"fl-k",), 1)]))
    oid = r.results[0][0].object_id
    assert t.request(w.frame(w.PING)).error is None
    r = t.request(w.encode_step([w.Op(w.OP_UNPIN, (oid,)), w.Op(w.OP_UNPIN, (oid,))]))
    assert r.failed_index == 1 and r.error.code.name == "FAILED_PRECONDITION"
    assert dispatched == [] and server.counters.frames == frames0 + 3

    bodies = [
        w.encode_step([w.Op(w.OP_LOOKUP, (b"fl-k",), 0), w.Op(w.OP_UNPIN, ())])[5:],
        w.encode_step([w.Op(w.OP_UNPIN, (oid,))])[5:],  # not held: refused at index 0
        b"\x07\x00\x01",  # malformed
    ]

    async def run():
        conn = conn_of(server, c)
        return [
            (server.ops.step_frame(conn, memoryview(b)), real_frame(conn, w.STEP, len(b), memoryview(b)))
            for b in bodies
        ]

    for fast, slow in on_loop(box, run):
        assert fast == slow


def _read_frames(sock, k: int, alone: bool = True) -> list[bytes]:
    """``k`` whole frames off a blocking socket (``alone``: and nothing after them)."""
    out, buf = [], b""
    while len(out) < k:
        while len(buf) < 5 or len(buf) < 5 + w.HEADER.unpack_from(buf)[0]:
            got = sock.recv(1 << 16)
            assert got, "the broker closed the connection"
            buf += got
        n = 5 + w.HEADER.unpack_from(buf)[0]
        out.append(buf[:n])
        buf = buf[n:]
    assert buf == b"" or not alone
    return out


@pytest.mark.parametrize("codec", ["native", "python"])
def test_frames_arriving_together_are_each_answered_as_alone_and_in_one_send(rig, monkeypatch, codec):
    """Several frames in one read (a client that posts frames without waiting) get, in order,
    the replies each gets alone, sent together; STEP and PING frames skip ``_frame``'s
    dispatch there too; a frame cut between two reads is answered once it is whole."""
    import socket

    box, c, _ = rig
    server = box["server"].step_server
    if codec == "python":
        monkeypatch.setattr(w, "_core", None)
    monkeypatch.setattr(server.ops, "_record", None)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(server.path)
    s.sendall(w.frame(w.HELLO, c.token.encode()))
    assert reply(_read_frames(s, 1)[0]).error is None
    (found,) = c.lookup([b"fl-k"], pin=False)
    oid = found.object_id
    frames = [
        w.encode_step([w.Op(w.OP_LOOKUP, (b"fl-k",), 1)]),
        w.frame(w.PING),
        w.encode_step([w.Op(w.OP_UNPIN, (oid,))]),
        w.encode_step([w.Op(w.OP_UNPIN, (oid,))]),  # not held any more: refused
        w.frame(w.STEP, b"\x07\x00\x01"),  # malformed
        w.frame(9),  # no such kind
        w.encode_step([w.Op(w.OP_LOOKUP, (b"fl-k",), 0)]),
    ]
    dispatched, sends = [], []
    real_frame, real_reply = server._frame, server._reply
    monkeypatch.setattr(server, "_frame", lambda *a: (dispatched.append(a[1]), real_frame(*a))[1])
    monkeypatch.setattr(server, "_reply", lambda conn, data: (sends.append(data), real_reply(conn, data))[1])
    frames0 = server.counters.frames
    alone = []
    for f in frames:
        s.sendall(f)
        alone += _read_frames(s, 1)
    assert len(sends) == len(frames) and dispatched == [9]
    sends.clear()
    s.sendall(b"".join(frames))
    assert _read_frames(s, len(frames)) == alone
    assert sends == [b"".join(alone)] and dispatched == [9, 9]
    whole = b"".join(frames)
    for cut in (3, len(frames[0]) + 2, len(whole) - 4):
        s.sendall(whole[:cut])
        time.sleep(0.05)  # the broker reads the first part alone
        s.sendall(whole[cut:])
        assert _read_frames(s, len(frames)) == alone
    assert server.counters.frames == frames0 + 5 * len(frames)
    assert reply(alone[3]).failed_index == 0 and reply(alone[4]).error.code.name == "INVALID_ARGUMENT"
    s.close()


def test_step_frames_are_callbacks_of_the_event_loop_in_turn_with_grpc(rig, monkeypatch):
    """Issue 48 item 4: a step frame is served by the loop's own thread (one more callback in
    its queue, in turn with gRPC's calls), not by a thread that takes the core from it (a thread
    of its own starved a bystander's gRPC: ops/bench/bench_loop_fairness.py)."""
    import threading

    box, _, _ = rig
    seen: list[int] = []
    readable = step_channel.StepChannelServer._readable

    def spy(self, conn):
        seen.append(threading.get_ident())
        return readable(self, conn)

    monkeypatch.setattr(step_channel.StepChannelServer, "_readable", spy)
    with BrokerClient.connect(box["server"].opts.socket, client_name="spy") as s:  # a new connection: the spy serves it
        for _ in range(5):
            assert [o.key for o in s.lookup([b"fl-k"], pin=False)] == [b"fl-k"]
        s.stats()
    loop_thread = on_loop(box, lambda: asyncio.sleep(0, threading.get_ident()))
    assert len(seen) >= 5 and set(seen) == {loop_thread}, (set(seen), loop_thread)


def test_serve_runs_the_broker_on_asyncios_own_loop_and_still_accepts_no_step_thread(monkeypatch, tmp_path):
    """``memory-broker serve`` serves on a plain asyncio loop (no lock around the core that a
    thread could hold against the loop); ``--no-step-thread``, which chose that before, still
    starts, so command lines and files naming it keep working."""
    from memory_broker.broker import cli
    from memory_broker.broker.server import app

    loops = []

    async def fake_serve(opts, log, overrides):
        loops.append(type(asyncio.get_running_loop()))

    monkeypatch.setattr(app, "serve", fake_serve)
    base = ["serve", "--socket", str(tmp_path / "b.sock"), "--arena", "host", "--pool-size", "64MiB"]
    base += ["--state-dir", str(tmp_path / "state"), "--log-level", "warning"]
    assert cli.main(base) == 0
    assert cli.main([*base, "--no-step-thread"]) == 0
    plain = type(asyncio.new_event_loop())
    assert loops == [plain, plain]


# ------------------------------------------------------------------ a frame that waits for a load


@pytest.fixture
def gated_load(rig, monkeypatch):
    """The rig's broker with an adapter ``gate-N`` registered (cold) and its manager's loads
    held at a gate: (box, client, adapter id, the gate, the acquires that reached it)."""
    import threading

    from rigs import write_adapter

    box, c, _ = rig
    server = box["server"]
    aid = f"gate-{next(_GATES)}"
    c.register_adapter(aid, write_adapter(os.path.join(tempfile.mkdtemp(dir="/tmp"), aid), 7))
    m = server.step_server.ops.adapters
    gate, reached = threading.Event(), []
    real = m.acquire

    async def held(*a, **kw):
        reached.append(a[1])
        while not gate.is_set():
            await asyncio.sleep(0.005)
        return await real(*a, **kw)

    monkeypatch.setattr(m, "acquire", held)
    yield box, c, aid, gate, reached
    gate.set()


_GATES = itertools.count()


def _pinned(c) -> int:
    return c.stats().pinned_pages


def test_a_cold_acquire_is_answered_on_the_channel_and_holds_up_no_other_session(gated_load):
    """An acquire that needs a load is one frame: the broker loads and answers when it is
    done; meanwhile another session's frames (and gRPC) are answered as usual."""
    import threading

    box, c, aid, gate, reached = gated_load
    server = box["server"].step_server
    other = BrokerClient.connect(c.socket_path, client_name="other")
    try:
        n, loads, base = c._step_path().frames, server.counters.loads, _pinned(other)
        got: list = []
        t = threading.Thread(target=lambda: got.append(c.acquire_adapters([aid])))
        t.start()
        deadline = time.monotonic() + 10
        while not reached and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reached == [[aid]] and not got  # waiting at the gate, on the broker
        for _ in range(3):  # another session's step frames and a gRPC call, answered meanwhile
            assert [o.key for o in other.lookup([b"fl-k"], pin=False)] == [b"fl-k"]
            assert other.stats().pinned_pages == base
        assert not got
        gate.set()
        t.join(30)
        (lease,) = got
        assert lease.ids == [aid] and lease.adapters[0].found_in in ("cold", "warm")
        assert c._step_path().frames == n + 1 and server.counters.loads == loads + 1
        assert _pinned(other) > base
        lease.release()
        c.flush()
        assert _pinned(other) == base
    finally:
        other.close()


def test_frames_behind_a_waiting_frame_are_answered_after_it_in_order(gated_load):
    """A connection's frames sent behind one that waits for a load get their replies after
    its reply, in the order sent; nothing is answered on that connection before the load."""
    import select

    from memory_broker.clients.step.transport import StepTransport

    box, c, aid, gate, reached = gated_load
    t = StepTransport(c._step_socket(), c.token, None)
    try:
        assert t.request(w.frame(w.PING)).error is None
        t._sock.sendall(
            w.encode_step([w.Op(w.OP_ACQUIRE, (aid,), 0, 0, 0)])
            + w.encode_step([w.Op(w.OP_LOOKUP, (b"fl-k",), 0)])
            + w.frame(w.PING)
        )
        deadline = time.monotonic() + 10
        while not reached and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reached and select.select([t._sock], [], [], 0.3)[0] == []  # nothing answered yet
        gate.set()
        t._sock.settimeout(30)
        first, second, third = (reply(f) for f in _read_frames(t._sock, 3, alone=False))
        assert first.error is None and first.results[0].hot and first.results[0].adapters
        assert second.error is None and [o.key for o in second.results[0]] == [b"fl-k"]
        assert third.error is None
        t.request(w.encode_step([w.Op(w.OP_RELEASE, (aid,))]))
    finally:
        t.close()


def test_a_connection_that_goes_during_a_load_leaves_nothing_pinned(gated_load):
    """What a load acquires for a connection closed before its reply is given back."""
    from memory_broker.clients.step.transport import StepTransport

    box, c, aid, gate, reached = gated_load
    base = _pinned(c)
    t = StepTransport(c._step_socket(), c.token, None)
    assert t.request(w.frame(w.PING)).error is None
    t._sock.sendall(w.encode_step([w.Op(w.OP_ACQUIRE, (aid,), 0, 0, 0)]))
    deadline = time.monotonic() + 10
    while not reached and time.monotonic() < deadline:
        time.sleep(0.01)
    t.close()
    time.sleep(0.1)
    gate.set()
    deadline = time.monotonic() + 10
    while box["server"].step_server.ops._tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not box["server"].step_server.ops._tasks
    assert _pinned(c) == base and c.stats().adapters.hot >= 1  # loaded, kept as a cache, unpinned
