"""The step channel's transport and its give-backs: a reply is read to its end however it
arrives, bytes nobody asked for break the channel, a begun step's reply is read before any
other call (over any channel), and a give-back waits for its answer and raises its own
refusal."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time

import pytest
from conftest import short_tmpdir
from conftest import step_frames as frames
from rigs import encode_objects

from memory_broker.clients import BrokerClient, BrokerError, Code, Spec
from memory_broker.clients.step.transport import BUFFER_BYTES, StepTransport, StepUnavailable
from memory_broker.proto.wire import step as w

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

# ------------------------------------------------------------------ the transport, against a fake broker


def _ok(*results: bytes, slabs: int = 3) -> bytes:
    return w.encode_step_reply(slabs, list(results))


def _refused(code: Code, message: str) -> bytes:
    return w.encode_step_reply(3, [], BrokerError(code, message), 0)


def _lookup_reply(n: int) -> bytes:
    recs = [w.ObjectRecord(100 + i, -1, 2, 1, True, False, 1, 1, [i, i + 1], b"key-%06d" % i, 3) for i in range(n)]
    return _ok(encode_objects(w.OP_LOOKUP, recs))


class _Counting:
    """A socket whose reads are counted."""

    def __init__(self, sock):
        self._sock = sock
        self.reads = 0

    def recv_into(self, *a):
        self.reads += 1
        return self._sock.recv_into(*a)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class _Fake:
    """A step channel that answers HELLO, then only what the test writes (``peer``)."""

    def __init__(self):
        self.dir = short_tmpdir()
        path = os.path.join(self.dir, "b.step")
        lis = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lis.bind(path)
        lis.listen(1)
        got: list = []

        def serve():
            conn, _ = lis.accept()
            self._read_frame(conn)
            conn.sendall(_ok())
            got.append(conn)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        self.transport = StepTransport(path, "token", 5.0)
        t.join(5)
        lis.close()
        self.peer: socket.socket = got[0]
        self.sock = self.transport._sock = _Counting(self.transport._sock)

    @staticmethod
    def _read_frame(conn) -> tuple[int, bytes]:
        head = b""
        while len(head) < 5:
            head += conn.recv(5 - len(head))
        size, kind = w.HEADER.unpack(head)
        body = b""
        while len(body) < size:
            body += conn.recv(size - len(body))
        return kind, body

    def frames_in(self, n: int) -> list[list[w.Op]]:
        return [w.decode_step(self._read_frame(self.peer)[1]) for _ in range(n)]

    def close(self):
        self.transport.close()
        self.peer.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def fake():
    f = _Fake()
    yield f
    f.close()


def test_a_reply_cut_anywhere_is_read_to_its_end(fake):
    t = fake.transport
    want = _lookup_reply(40)

    def dribble():  # a few bytes at a time: the header and body cut at every place
        fake.frames_in(1)
        for i in range(0, len(want), 3):
            fake.peer.sendall(want[i : i + 3])
            if i % 60 == 0:
                time.sleep(0.001)

    th = threading.Thread(target=dribble)
    th.start()
    reply = t.request(w.encode_step([(w.OP_LOOKUP, (b"k",), 1)]))
    th.join()
    assert reply.results == w.decode_step_reply(want[4], want[5:]).results
    assert t.unread() == 0


def test_a_reply_larger_than_the_buffer_grows_it_for_a_while(fake):
    t = fake.transport
    want = _lookup_reply(3000)
    assert len(want) > BUFFER_BYTES

    def answer():
        fake.frames_in(1)
        fake.peer.sendall(want)

    threading.Thread(target=answer).start()
    reply = t.request(w.encode_step([(w.OP_LOOKUP, (b"k",), 1)]))
    assert reply.results == w.decode_step_reply(want[4], want[5:]).results
    assert t.unread() == 0 and len(t._buf) == BUFFER_BYTES


def test_a_begun_frame_s_reply_is_read_by_reply(fake):
    t = fake.transport
    t.send(w.encode_step([(w.OP_LOOKUP, (b"k",), 1)]))
    assert t.unread() == 1
    fake.frames_in(1)
    want = _lookup_reply(3)
    fake.peer.sendall(want)
    assert t.reply().results == w.decode_step_reply(want[4], want[5:]).results and t.unread() == 0


def test_bytes_after_the_last_reply_asked_for_break_the_channel(fake):
    t = fake.transport
    fake.peer.sendall(_ok() + _ok())
    with pytest.raises(StepUnavailable):
        t.request(w.encode_step([(w.OP_UNPIN, (1,))]))
    assert t.closed


def test_a_malformed_reply_breaks_the_channel_saying_so(fake):
    t = fake.transport
    fake.peer.sendall(w.HEADER.pack(3, w.OK) + b"xyz")
    with pytest.raises(StepUnavailable, match="malformed reply"):
        t.request(w.encode_step([(w.OP_UNPIN, (1,))]))
    assert t.closed


# ------------------------------------------------------------------ end to end, with a broker


def test_a_give_back_waits_and_raises_its_own_refusal(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        objs = c.lookup([b"k0"])
        t = c._step_path().transport
        n = frames(c)
        c.unpin(objs)
        assert t.unread() == 0 and frames(c) == n + 1
        with pytest.raises(BrokerError) as e:
            c.unpin([999])
        assert e.value.code == Code.NOT_FOUND and e.value.message == "no object 999"
        assert t.unread() == 0 and c.stats().pinned_pages == 0


def test_an_unpin_then_a_grpc_call_sees_it_applied(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        obj = c.allocate([Spec(1)])[0]
        c.unpin(c.pin([obj]))
        assert c.free([obj]) == (1, 0)  # over gRPC: no pin of this session held it back


def test_a_lease_whose_release_is_refused_still_gives_its_objects_back(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        lease = c.step(["a0"], [b"k0", b"k1"])
        c.release_adapters(["a0"])  # behind the lease's back: its own release is then refused
        with pytest.raises(BrokerError) as e:
            lease.release()
        assert e.value.code == Code.FAILED_PRECONDITION
        assert c.stats().pinned_pages == 0


def test_bad_input_to_a_give_back_is_refused_at_once_and_sends_nothing(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        c.lookup([])  # the session's channel
        n = frames(c)
        with pytest.raises(BrokerError) as e:
            c.release_adapters(["x" * 70000])
        assert e.value.code == Code.INVALID_ARGUMENT and frames(c) == n
        assert c._step_path().transport.unread() == 0


def test_lookup_many_s_cleanup_unpin_runs_before_it_raises(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        c.lookup([])  # the session's channel
        n = frames(c)
        with pytest.raises(BrokerError) as e:
            c.lookup_many([[b"k0"], [b"k" * 2000]], pin=True)  # the broker refuses the second
        assert e.value.code == Code.INVALID_ARGUMENT
        assert frames(c) == n + 2 and c._step_path().transport.unread() == 0  # k0's unpin, waited for
        assert c.lookup([b"k0"], pin=False)[0].session_pins == 0


# ------------------------------------------------------------------ a begun step and the other channels


def test_a_begun_step_is_read_before_a_grpc_call_and_kept_for_its_result(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        c.acquire_adapters(["a0"]).release()  # a0's layout (fetched over gRPC) once
        pending = c.step_begin(["a0"], [b"k0"])
        t = c._step_path().transport
        assert t.unread() == 1
        assert c.stats().pinned_pages == 2  # over gRPC: the begun step ran first
        assert t.unread() == 0
        lease = pending.result()
        assert lease.adapters.ids == ["a0"] and [o.key for o in lease.objects] == [b"k0"]
        lease.release()
        assert c.stats().pinned_pages == 0


def test_the_fd_channel_s_slab_and_page_fetches_read_a_begun_reply_first(step_rig, monkeypatch):
    """A slab's or page's fds are fetched over the fd channel (``session._ensure_slabs``,
    ``_import_pages``) only once a begun step was answered: the broker has run it before it
    serves the fetch."""
    from types import SimpleNamespace

    from memory_broker.clients import arena_fds

    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        c.lookup([])  # the session's channel
        t = c._step_path().transport
        unread_at_fetch: list[int] = []
        monkeypatch.setattr(arena_fds, "attach_slabs", lambda *a, **kw: unread_at_fetch.append(t.unread()))
        pending = c.step_begin((), [b"k0"])
        assert t.unread() == 1
        c._ensure_slabs(c.view.mapped_slabs + 1)  # a slab this process lacks: fetched
        assert unread_at_fetch == [0]

        # A CUDA arena's pages (one fd each), fetched as they are given.
        monkeypatch.setattr(arena_fds, "missing_pages", lambda view, pages: list(pages))
        monkeypatch.setattr(arena_fds, "import_pages", lambda *a, **kw: unread_at_fetch.append(t.unread()))
        second = c.step_begin((), [b"k1"], release=pending.result())
        assert t.unread() == 1
        real_view = c.view
        c.view = SimpleNamespace(fd_unit="page", mapped_slabs=real_view.mapped_slabs)
        try:
            c._import_pages([0, 1], readonly=True)
        finally:
            c.view = real_view
        assert unread_at_fetch == [0, 0]
        second.result().release()
        assert c.stats().pinned_pages == 0
