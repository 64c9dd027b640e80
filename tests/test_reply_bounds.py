"""Replies bounded like requests (issue 48, item 2): an op naming one id or key many times is
refused, a frame's or a call's object records are capped before they are encoded, a step
connection that does not read its replies stops being read instead of holding them, and a
session whose gRPC replies go unread has its calls refused instead of piling more up."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import step_frames as frames
from test_step_channel import _rss, raw_conn

from memory_broker.clients import BrokerClient, BrokerError, Code, Spec
from memory_broker.proto.wire import step as w

FOLD = 65535


def _pinned(c: BrokerClient) -> int:
    return c.stats().pinned_pages


@pytest.mark.both_cores
def test_a_pin_naming_one_id_65535_times_is_refused_within_16x_its_request(step_rig):
    b, setup = step_rig
    (k0,) = setup.lookup([b"k0"], pin=False)
    with BrokerClient.connect(b.socket) as c:
        before = _pinned(c)
        s = raw_conn(c, c.token)
        request = w.encode_step([w.Op(w.OP_PIN, (k0.object_id,) * FOLD)])
        s.sendall(request)
        n, kind = w.HEADER.unpack(s.recv(5, socket.MSG_WAITALL))
        assert 5 + n <= 16 * len(request)
        r = w.decode_step_reply(kind, s.recv(n, socket.MSG_WAITALL))
        assert kind == w.ERROR and r.error.code == Code.INVALID_ARGUMENT, r.error
        assert f"object_ids[1] repeats {k0.object_id}" in r.error.message
        assert _pinned(c) == before  # nothing pinned
    with BrokerClient.connect(b.socket, fast_path=False) as g:  # the same over gRPC
        with pytest.raises(BrokerError) as e:
            g.pin([k0.object_id] * FOLD)
        assert e.value.code == Code.INVALID_ARGUMENT and f"repeats {k0.object_id}" in e.value.message
        assert _pinned(g) == before


@pytest.mark.both_cores
def test_a_lookup_naming_one_key_many_times_is_refused_and_pins_nothing(step_rig):
    b, _ = step_rig
    for fast in (True, False):
        with BrokerClient.connect(b.socket, fast_path=fast) as c:
            before = _pinned(c)
            for keys in ([b"k0"] * 30000, [b"k0", b"k1", b"k0"]):
                with pytest.raises(BrokerError) as e:
                    c.lookup(keys)
                assert e.value.code == Code.INVALID_ARGUMENT and "keys[" in e.value.message, e.value
                assert "repeats b'k0'" in e.value.message
            assert _pinned(c) == before
            assert [o.key for o in c.lookup([b"k0", b"k1"])] == [b"k0", b"k1"]  # distinct keys: served


@pytest.mark.both_cores
def test_two_unread_amplifying_frames_hold_at_most_32_mib(step_rig):
    b, setup = step_rig
    (k0,) = setup.lookup([b"k0"], pin=False)
    with BrokerClient.connect(b.socket) as c:
        c.pin([k0])  # warm: the step path is up
        c.unpin([k0])
        idle = _rss(b.proc.pid)
        conns = []
        pins = [w.Op(w.OP_PIN, (k0.object_id,) * 7600)] * w.MAX_OPS  # 3.9 MB: the frames
        looks = [w.Op(w.OP_LOOKUP, (b"k0",) * 30000, 1)] * 3
        for ops in (pins, looks, [w.Op(w.OP_LOOKUP, (b"k0", b"k1", b"k2"), 0)] * w.MAX_OPS):
            s = raw_conn(c, c.token)
            frame = w.encode_step(ops)
            assert len(frame) <= w.MAX_FRAME_BYTES
            for _ in range(2):  # sent, never read
                s.sendall(frame)
            conns.append(s)
        time.sleep(1.0)
        grown = _rss(b.proc.pid) - idle
        assert grown <= 32 << 20, f"the broker grew {grown >> 20} MiB"
        # A bystander is served meanwhile.
        n = frames(c)
        assert [o.key for o in c.lookup([b"k1"])] == [b"k1"] and frames(c) == n + 1
        for s in conns:
            s.close()


def test_a_step_connection_that_reads_no_reply_stops_being_read(step_rig):
    """Frames whose replies are each small, sent without end: the broker answers about
    ``REPLY_BACKLOG_BYTES`` of them, then leaves the rest in the socket (the sender's writes
    stop going through) instead of answering every frame it is sent into memory. (Main held
    this too, by leaving the socket unread while a reply waited; this keeps the reworked
    read path, which answers what it reads in batches of that backlog, to it.)"""
    b, _ = step_rig
    with BrokerClient.connect(b.socket) as c:
        c.lookup([b"k0"], pin=False)  # warm
        idle = _settled(b.proc.pid, 5)
        s = raw_conn(c, c.token)
        frame = w.encode_step([w.Op(w.OP_LOOKUP, tuple(b"k%d" % i for i in range(6)), 0)] * w.MAX_OPS)
        data, chunks, sent = frame * 200, 20, [0]  # 4,000 frames of 64 lookups: 32 MB sent

        def send() -> None:
            s.settimeout(3.0)
            try:
                for _ in range(chunks):
                    s.sendall(data)
                    sent[0] += len(data)
            except OSError:  # socket.timeout: no byte went through for 3 s
                pass

        t = threading.Thread(target=send)
        t.start()
        t.join(60)
        assert not t.is_alive()
        grown = _settled(b.proc.pid, 20) - idle
        assert sent[0] < len(data) * chunks, "every frame went through: nothing stopped reading them"
        assert grown <= 32 << 20, f"the broker grew {grown >> 20} MiB"
        assert [o.key for o in c.lookup([b"k1"], pin=False)] == [b"k1"]  # the others are served
        s.close()


@pytest.mark.parametrize("fast_path", [True, False], ids=["step-channel", "grpc"])
def test_lookup_many_refuses_a_list_naming_a_key_twice_and_leaves_nothing_pinned(step_rig, fast_path):
    b, _ = step_rig
    with BrokerClient.connect(b.socket, fast_path=fast_path) as c:
        before = _pinned(c)
        with pytest.raises(BrokerError) as e:
            c.lookup_many([[b"k0", b"k1"], [b"k2", b"k3", b"k2"]], pin=True)
        assert e.value.code == Code.INVALID_ARGUMENT and "keys[2] repeats b'k2'" in e.value.message
        assert _pinned(c) == before
        got = c.lookup_many([[b"k0", b"k1"], [b"k1", b"k0"]], pin=False)  # in two lists: served
        assert [[o.key for o in g] for g in got] == [[b"k0", b"k1"], [b"k1", b"k0"]]


def test_lookup_many_splits_its_frames_by_the_reply_they_would_get():
    """``_frame_of_lookups``: past the first list, a frame takes no more once its reply (each
    key found with one page: ``ReplyRoom``'s estimate) would pass ``MAX_REPLY_RECORDS`` or
    ``MAX_REPLY_BYTES``, nor once its keys take half ``MAX_FRAME_BYTES``."""
    from memory_broker.clients.step.channel import _frame_of_lookups

    short = [[b"%04d" % i for i in range(2000)]] * 63  # 126,000 keys of 4 bytes: 756 KB of request
    one = w.REPLY_RECORD_BYTES + 5 + 4
    first = _frame_of_lookups(short, list(range(63)), 63)
    assert len(first) == w.MAX_REPLY_BYTES // (2000 * one) < 63
    assert _frame_of_lookups(short, list(range(63)), 10) == list(range(10))
    many = [[b"k"] * 50_000] * 4  # 3.5 MB of estimate each: two fit, not three
    assert _frame_of_lookups(many, [0, 1, 2, 3], 64) == [0, 1]
    long = [[b"x" * 1000] * 1000] * 10  # 1 MB of keys each: two lists reach half a frame
    assert _frame_of_lookups(long, list(range(10)), 64) == [0, 1, 2]
    huge = [[b"y" * 1000] * 9000]  # alone past the bound: sent alone (the broker says why)
    assert _frame_of_lookups(huge + long, [0, 1], 64) == [0]


def test_lookup_many_goes_on_in_a_new_frame_from_a_lookup_refused_for_a_full_reply(step_rig, monkeypatch):
    """A frame the broker finds too large to answer whole (objects of more pages than the
    client's estimate) is RESOURCE_EXHAUSTED at one of its lookups, the ones before it
    answered: ``lookup_many`` sends the rest in a new frame and nothing is lost or leaked.
    Stood in for here by a send that runs the frame's first ops and refuses the next."""
    b, _ = step_rig
    with BrokerClient.connect(b.socket) as c:
        path = c._step_path()
        real, sent = path.send, []

        def send(ops):
            sent.append(len(ops))
            if len(ops) <= 2:
                return real(ops)
            r = real(ops[:2])  # the first two run; the third is refused, as the broker would
            error = BrokerError(Code.RESOURCE_EXHAUSTED, "this lookup would answer ...: ask for fewer")
            return w.StepReply(r.arena_slabs, r.results, error, 2)

        monkeypatch.setattr(path, "send", send)
        lists = [[b"k%d" % (i % 6)] for i in range(5)]
        got = c.lookup_many(lists, pin=True)
        assert [g[0].key for g in got] == [b"k0", b"k1", b"k2", b"k3", b"k4"]
        assert sent == [5, 3, 1]  # 2 answered, then 2 more, then the last
        assert all(o.session_pins == 1 for g in got for o in g)
        monkeypatch.setattr(path, "send", real)
        c.unpin([o for g in got for o in g])
        assert _pinned(c) == 0


def test_the_grpc_reply_backlog_refuses_a_session_over_its_bound_until_its_replies_are_sent():
    """``ReplyBacklog`` (unit): a reply counts against its session from its encoding until
    its call is done; at ``max_bytes`` the session's calls are refused but its give-backs,
    other sessions' are not, and the count goes back as the replies are sent."""
    import asyncio

    from memory_broker.broker.doors.service import ReplyBacklog
    from memory_broker.proto.wire.errors import BrokerError as Refusal

    class Call:
        def __init__(self):
            self.done = []

        def add_done_callback(self, fn):
            self.done.append(fn)

        def end(self):
            for fn in self.done:
                fn(self)

    drained = []
    backlog = ReplyBacklog(max_bytes=1000, on_large=lambda: drained.append(1))

    async def reply(sid: int, n: int) -> Call:
        call = Call()

        async def behavior(request, context):
            backlog.admit(sid, "Lookup")
            return n

        data = await backlog.handler(behavior, lambda n: b"x" * n)(None, call)
        assert len(data) == n
        return call

    async def run():
        calls = [await reply(1, 600), await reply(1, 600)]
        assert backlog.unsent == {1: 1200}
        with pytest.raises(Refusal) as e:
            await reply(1, 10)
        assert e.value.code == Code.RESOURCE_EXHAUSTED and "1200 bytes of replies" in e.value.message
        backlog.admit(1, "Unpin")  # a give-back is served
        other = await reply(2, 10)  # another session is served
        calls[0].end()
        assert backlog.unsent == {1: 600, 2: 10}
        calls.append(await reply(1, 100))  # under the bound again
        for call in [*calls[1:], other]:
            call.end()
        assert backlog.unsent == {} and backlog.refused == 1

    asyncio.run(run())


UNREAD = r"""
import json, os, signal, sys, time
import grpc
from memory_broker.clients import BrokerClient
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc
sock, ids = sys.argv[1], json.loads(sys.argv[2])
c = BrokerClient.connect(sock, client_name="unread", fast_path=False)
opts = [("grpc.max_receive_message_length", 256 << 20), ("grpc.use_local_subchannel_pool", 1)]
stub = broker_pb2_grpc.MemoryBrokerStub(grpc.insecure_channel(f"unix:{sock}", options=opts))
# 20 Lookups naming one key 65,535 times (the issue's), then Pins of every object (distinct):
# none of their replies is read.
futs = [stub.Lookup.future(pb.LookupRequest(keys=[b"k0"] * 65535), metadata=c.metadata) for _ in range(20)]
futs += [stub.Pin.future(pb.PinRequest(object_ids=ids), metadata=c.metadata) for _ in range(400)]
time.sleep(0.2)
print("sent", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def _settled(pid: int, most_s: float) -> int:
    """The broker's RSS once it stops changing (within 2 MiB over half a second), or after ``most_s``."""
    deadline, last = time.monotonic() + most_s, _rss(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _rss(pid)
        if abs(now - last) < 2 << 20:
            return now
        last = now
    return last


def test_grpc_replies_a_stopped_client_leaves_unread_hold_a_bounded_amount_and_go_with_it(broker_factory):
    """A client process that sends 20 amplifying Lookups and 400 Pins of 100 objects with
    1 KiB keys (about 110 KB of reply each), then stops (SIGSTOP) without reading a reply: the
    broker holds at most about its session's bound (16 MiB of replies, plus one; +64 MiB of
    RSS allowed here) while it is stopped, and gives the memory back once it is killed. Main
    held +849 MiB for the 20 Lookups alone (issue 48), and would answer all 400 Pins."""
    b = broker_factory("--pool-size", "64MiB")
    keys = [b"%04d-" % i + b"x" * 1018 for i in range(100)]
    with BrokerClient.connect(b.socket, fast_path=False) as setup:
        setup.allocate([Spec(1, content_type="kv_cache", key=b"k0")])
        ids = [o.object_id for o in setup.allocate([Spec(1, content_type="kv_cache", key=k) for k in keys])]
        setup.pin(ids)  # warm: a Pin's reply has been built once
        setup.unpin(ids)
        idle = _settled(b.proc.pid, 5)
        child = subprocess.Popen(
            [sys.executable, "-c", UNREAD, b.socket, json.dumps(ids)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout.readline().strip() == "sent"
            held = _settled(b.proc.pid, 20) - idle
            assert setup.stats().sessions == 2  # the stopped client's session is still open
            assert held <= 64 << 20, f"the broker holds +{held >> 20} MiB for a stopped client's unread replies"
        finally:
            child.kill()
            child.wait()
        deadline = time.monotonic() + 15
        while _rss(b.proc.pid) - idle > 16 << 20 and time.monotonic() < deadline:
            time.sleep(0.25)
        after = _rss(b.proc.pid) - idle
        assert after <= 16 << 20, (
            f"+{after >> 20} MiB 15 s after the client was killed (+{held >> 20} while it stopped)"
        )
        assert [o.key for o in setup.lookup([b"k0"], pin=False)] == [b"k0"]
