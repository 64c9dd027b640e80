"""Posted give-backs on the step channel (``post_give_backs``, the default): a release or an
unpin goes out without waiting for its reply; replies come in order, so the transport reads
the posted ones before the next awaited one (several may come in one read), never more than
``POST_LIMIT`` wait unread, a refusal is logged and raised later (never lost), and a call over
another channel (gRPC) sees every posted give-back applied."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time

import pytest
from conftest import short_tmpdir
from conftest import step_frames as frames

from memory_broker.clients import BrokerClient, BrokerError, Code, Spec
from memory_broker.clients.step.path import StepPath
from memory_broker.clients.step.transport import BUFFER_BYTES, POST_LIMIT, StepTransport, StepUnavailable
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
    return _ok(w.encode_objects(w.OP_LOOKUP, recs))


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


def _post(t: StepTransport, kind: int, items) -> None:
    t.post(w.encode_step([(kind, items)]), [(kind, items)])


def test_replies_that_come_in_one_read_are_each_taken_and_a_refused_post_is_kept(fake, caplog):
    t = fake.transport
    _post(t, w.OP_UNPIN, [7])
    _post(t, w.OP_RELEASE, ("a0",))
    assert t.unread() == 2 and fake.frames_in(2) == [[w.Op(w.OP_UNPIN, (7,))], [w.Op(w.OP_RELEASE, ("a0",))]]
    # Both posted replies and the next request's, in one write before the request is read.
    want = _lookup_reply(5)
    fake.peer.sendall(_ok(bytes((w.OP_UNPIN,))) + _refused(Code.NOT_FOUND, "no pin on 'a0'") + want)
    reads = fake.sock.reads
    with caplog.at_level(logging.WARNING):
        reply = t.request(w.encode_step([(w.OP_LOOKUP, (b"k",), 1)]))
    assert fake.sock.reads == reads + 1  # one read took all three
    ref = w.decode_step_reply(want[4], want[5:])
    assert (reply.arena_slabs, reply.results, reply.error) == (ref.arena_slabs, ref.results, None)
    assert t.unread() == 0 and len(t.refused) == 1
    err = t.refused[0]
    assert err.code == Code.NOT_FOUND and err.message == "a posted release of ['a0'] was refused: no pin on 'a0'"
    assert "a posted release of ['a0'] was refused" in caplog.text


def test_replies_cut_anywhere_are_read_to_their_ends(fake):
    t = fake.transport
    for i in range(3):
        _post(t, w.OP_UNPIN, [i])
    fake.frames_in(3)
    want = _lookup_reply(40)
    data = _ok(bytes((w.OP_UNPIN,))) + _refused(Code.FAILED_PRECONDITION, "not pinned") + _ok(bytes((w.OP_UNPIN,)))
    data += want

    def dribble():  # a few bytes at a time: headers and bodies cut at every place
        for i in range(0, len(data), 3):
            fake.peer.sendall(data[i : i + 3])
            if i % 60 == 0:
                time.sleep(0.001)

    th = threading.Thread(target=dribble)
    th.start()
    reply = t.request(w.encode_step([(w.OP_LOOKUP, (b"k",), 1)]))
    th.join()
    assert reply.results == w.decode_step_reply(want[4], want[5:]).results
    assert t.unread() == 0 and [e.message for e in t.refused] == ["a posted unpin of [1] was refused: not pinned"]


def test_a_step_begun_and_posts_around_it_share_one_ordered_queue(fake):
    t = fake.transport
    _post(t, w.OP_UNPIN, [1])
    t.send(w.encode_step([(w.OP_LOOKUP, (b"k",), 1)]))  # awaited (a step begun)
    _post(t, w.OP_RELEASE, ("a1",))  # posted after it: its reply comes after the step's
    assert t.unread() == 3
    fake.frames_in(3)
    want = _lookup_reply(3)
    fake.peer.sendall(_refused(Code.NOT_FOUND, "no object 1") + want + _ok(bytes((w.OP_RELEASE,))))
    reply = t.reply()
    assert reply.results == w.decode_step_reply(want[4], want[5:]).results
    assert t.unread() == 1 and [e.code for e in t.refused] == [Code.NOT_FOUND]
    reads = fake.sock.reads
    t.settle()  # the last one came with the others: read from the buffer
    assert t.unread() == 0 and fake.sock.reads == reads and len(t.refused) == 1


def test_a_reply_larger_than_the_buffer_after_posted_ones(fake):
    t = fake.transport
    _post(t, w.OP_UNPIN, [1])
    fake.frames_in(1)
    want = _lookup_reply(3000)
    assert len(want) > BUFFER_BYTES
    threading.Thread(target=fake.peer.sendall, args=(_ok(bytes((w.OP_UNPIN,))) + want,)).start()
    reply = t.request(w.encode_step([(w.OP_LOOKUP, (b"k",), 1)]))
    assert reply.results == w.decode_step_reply(want[4], want[5:]).results
    assert t.unread() == 0 and not t.refused and len(t._buf) == BUFFER_BYTES


def test_a_reply_that_ends_past_the_buffer_s_end_is_moved_to_its_front(fake):
    t = fake.transport

    def reply(pad: int) -> bytes:
        recs = [
            w.ObjectRecord(100 + i, -1, 2, 1, True, False, 1, 1, [i], b"k%05d" % i + (b"x" * pad if i == 0 else b""), 3)
            for i in range(1500)
        ]
        return _ok(w.encode_objects(w.OP_LOOKUP, recs))

    # A reply that fits the buffer, but not behind the posted reply's 12 bytes.
    want = reply(BUFFER_BYTES - 4 - len(reply(0)))
    assert BUFFER_BYTES - 12 < len(want) <= BUFFER_BYTES
    _post(t, w.OP_UNPIN, [1])
    fake.frames_in(1)
    threading.Thread(target=fake.peer.sendall, args=(_ok(bytes((w.OP_UNPIN,))) + want,)).start()
    reply_got = t.request(w.encode_step([(w.OP_LOOKUP, (b"k",), 1)]))
    assert reply_got.results == w.decode_step_reply(want[4], want[5:]).results
    assert t.unread() == 0 and len(t._buf) == BUFFER_BYTES


def test_bytes_after_the_last_reply_asked_for_break_the_channel(fake):
    t = fake.transport
    fake.peer.sendall(_ok() + _ok())
    with pytest.raises(StepUnavailable):
        t.request(w.encode_step([(w.OP_UNPIN, (1,))]))
    assert t.closed


def test_a_channel_that_breaks_with_posts_unanswered_reports_each(fake):
    t = fake.transport
    _post(t, w.OP_UNPIN, [1, 2])
    _post(t, w.OP_RELEASE, ("a0",))
    fake.frames_in(2)
    fake.peer.sendall(_ok(bytes((w.OP_UNPIN,))))  # the first answered, then the broker goes
    fake.peer.close()
    with pytest.raises(StepUnavailable):
        t.settle()
    assert t.closed and t.unread() == 0
    assert [(e.code, e.message) for e in t.refused] == [
        (
            Code.UNAVAILABLE,
            "the step channel broke before the broker answered a posted release of ['a0']: it may not have run",
        )
    ]


def test_at_the_bound_the_oldest_reply_is_read_first_a_begun_step_s_for_it(fake):
    t = fake.transport
    path = StepPath(t)
    answered = threading.Event()

    def answer():  # an OK reply per frame, as the broker does
        for _ in range(2 * POST_LIMIT + 1):
            ops = fake.frames_in(1)[0]
            fake.peer.sendall(_ok(bytes((ops[0].kind,))))
        answered.set()

    threading.Thread(target=answer, daemon=True).start()
    sent = path.begin([(w.OP_RELEASE, ("a0",))])  # awaited, first in the queue
    most = 0
    for i in range(2 * POST_LIMIT):
        path.post([(w.OP_UNPIN, [i])])
        most = max(most, t.unread())
    assert most == POST_LIMIT and path.frames == 2 * POST_LIMIT + 1
    # The step's reply was read at the bound, for it: result() reads nothing more.
    assert sent._done and sent.reply().results == [None]
    answered.wait(5)
    path.settle()
    assert t.unread() == 0 and not t.refused


# ------------------------------------------------------------------ end to end, with a broker


def test_a_posted_unpin_is_applied_before_a_later_grpc_call(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        obj = c.allocate([Spec(1)])[0]
        got = c.pin([obj])
        n = frames(c)
        c.unpin(got)
        t = c._step_path().transport
        assert frames(c) == n + 1 and t.unread() == 1  # posted: its reply not read yet
        assert c.free([obj]) == (1, 0)  # over gRPC: no pin of this session held it back
        assert t.unread() == 0


def test_a_refused_posted_give_back_is_logged_then_raised_once_by_the_next_give_back(step_rig, caplog):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        k0 = c.lookup([b"k0"])
        with caplog.at_level(logging.WARNING):
            c.unpin([999])  # not this session's: refused, later
            t = c._step_path().transport
            assert t.unread() == 1
            k1 = c.lookup([b"k1"])  # reads the refusal; a call that takes never raises it
            assert len(k1) == 1 and t.unread() == 0
        assert "a posted unpin of [999] was refused" in caplog.text
        with pytest.raises(BrokerError) as e:
            c.unpin(k0)  # its own frame goes out, then the earlier refusal is raised
        assert e.value.code == Code.NOT_FOUND and e.value.message.startswith("a posted unpin of [999] was refused")
        c.flush()  # raised once
        assert c.lookup([b"k0", b"k1"], pin=False)[0].session_pins == 0  # k0's unpin ran
        c.unpin(k1)
        c.flush()
        assert c.stats().pinned_pages == setup.stats().pinned_pages == 0


def test_flush_raises_a_refusal_and_close_logs_one(step_rig, caplog):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        c.unpin([998])
        c.unpin([999])
        with pytest.raises(BrokerError) as e:
            c.flush()
        assert e.value.code == Code.NOT_FOUND
        assert e.value.message == (
            "a posted unpin of [998] was refused: no object 998 (and 1 more posted give-backs refused: see the log)"
        )
        c.flush()
        c.unpin([997])
        with caplog.at_level(logging.WARNING):
            c.close()  # reads it, says so, and closes
        assert "a posted unpin of [997] was refused" in caplog.text


def test_more_posted_than_the_bound_each_applied_in_order(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        (obj,) = c.lookup([b"k2"])
        n = 2 * POST_LIMIT + 3
        for _ in range(n - 1):
            c.pin([obj])
        t = c._step_path().transport
        most = 0
        for _ in range(n):
            c.unpin([obj])
            most = max(most, t.unread())
        assert most == POST_LIMIT
        c.flush()
        assert c.lookup([b"k2"], pin=False)[0].session_pins == 0


def test_a_step_begun_then_a_posted_unpin_then_its_result(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        c.acquire_adapters(["a0"]).release()  # a0's layout (fetched over gRPC) once
        c.flush()
        k3 = c.lookup([b"k3"])
        pending = c.step_begin(["a0"], [b"k0"])
        c.unpin(k3)  # posted behind the step's frame: nothing waits for the step's reply
        t = c._step_path().transport
        assert t.unread() == 2
        lease = pending.result()
        assert lease.adapters.ids == ["a0"] and [o.key for o in lease.objects] == [b"k0"] and t.unread() == 1
        lease.release()
        c.flush()
        assert t.unread() == 0 and c.stats().pinned_pages == 0


def test_a_lease_released_when_an_earlier_refusal_is_raised_gives_everything_back(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        lease = c.step(["a0"], [b"k0", b"k1"])
        c.unpin([999])
        c.lookup([b"k4"], pin=False)  # reads the refusal
        with pytest.raises(BrokerError) as e:
            lease.release()  # the adapters' release raises it: the objects' unpin goes too
        assert e.value.code == Code.NOT_FOUND
        c.flush()
        assert c.stats().pinned_pages == 0


def test_blocking_give_backs_wait_and_raise_their_own_refusal(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket, post_give_backs=False) as c:
        objs = c.lookup([b"k0"])
        t = c._step_path().transport
        n = frames(c)
        c.unpin(objs)
        assert t.unread() == 0 and frames(c) == n + 1
        with pytest.raises(BrokerError) as e:
            c.unpin([999])
        assert e.value.code == Code.NOT_FOUND and e.value.message == "no object 999"
        assert t.unread() == 0 and not c._refused


def test_bad_input_to_a_posted_give_back_is_refused_at_once_and_sends_nothing(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        c.lookup([])  # the session's channel
        n = frames(c)
        with pytest.raises(BrokerError) as e:
            c.release_adapters(["x" * 70000])
        assert e.value.code == Code.INVALID_ARGUMENT and frames(c) == n
        assert c._step_path().transport.unread() == 0


# ------------------------------------------------------------------ what else is posted


def test_a_posted_frame_of_several_ops_names_the_refused_one_and_keeps_only_its_own(fake, caplog):
    t = fake.transport
    ops = [(w.OP_RELEASE, ("a0",)), (w.OP_UNPIN, (5, 6))]
    t.post(w.encode_step(ops), ops)  # both the caller's: a refusal is kept
    t.post(w.encode_step(ops), ops, own=1)  # the unpin rides along (nobody asked for it): logged only
    fake.frames_in(2)
    refused_at_1 = w.encode_step_reply(3, [bytes((w.OP_RELEASE,))], BrokerError(Code.NOT_FOUND, "no object 5"), 1)
    fake.peer.sendall(refused_at_1 + refused_at_1)
    with caplog.at_level(logging.WARNING):
        t.settle()
    assert [e.message for e in t.refused] == ["a posted unpin of [5, 6] was refused: no object 5"]
    assert "not raised: nobody asked for it" in caplog.text
    # A channel that breaks: each op of each unanswered frame is reported, its own ones kept.
    del t.refused[:]
    t.post(w.encode_step(ops), ops, own=1)
    fake.peer.close()
    t.close()
    assert [e.message for e in t.refused] == [
        "the step channel broke before the broker answered a posted release of ['a0']: it may not have run"
    ]


def test_lookup_many_s_cleanup_unpin_is_posted_and_runs_before_a_grpc_call(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        c.lookup([])  # the session's channel
        n = frames(c)
        with pytest.raises(BrokerError) as e:
            c.lookup_many([[b"k0"], [b"k" * 2000]], pin=True)  # the broker refuses the second
        assert e.value.code == Code.INVALID_ARGUMENT
        t = c._step_path().transport
        assert frames(c) == n + 2 and t.unread() == 1  # k0's unpin: posted
        assert c.stats().pinned_pages == setup.stats().pinned_pages == 0  # gRPC: after it ran
        assert t.unread() == 0
        c.flush()


def test_lookup_many_s_cleanup_unpin_waits_without_posting(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket, post_give_backs=False) as c:
        with pytest.raises(BrokerError):
            c.lookup_many([[b"k0"], [b"k" * 2000]], pin=True)
        assert c._step_path().transport.unread() == 0
        assert c.lookup([b"k0"], pin=False)[0].session_pins == 0


# ------------------------------------------------------------------ the fd channel's fetches


def test_the_fd_channel_s_slab_and_page_fetches_read_posted_replies_first(step_rig, monkeypatch):
    """A slab's or page's fds are fetched over the fd channel (``session._ensure_slabs``,
    ``_import_pages``) only once every posted give-back was answered: the broker has run
    what the session gave back before it serves the fetch."""
    from types import SimpleNamespace

    from memory_broker.clients import arena_fds

    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        objs = c.lookup([b"k0"])
        t = c._step_path().transport
        unread_at_fetch: list[int] = []
        monkeypatch.setattr(arena_fds, "attach_slabs", lambda *a, **kw: unread_at_fetch.append(t.unread()))
        c.unpin(objs)
        assert t.unread() == 1
        c._ensure_slabs(c.view.mapped_slabs + 1)  # a slab this process lacks: fetched
        assert unread_at_fetch == [0]

        # A CUDA arena's pages (one fd each), fetched as they are given.
        monkeypatch.setattr(arena_fds, "missing_pages", lambda view, pages: list(pages))
        monkeypatch.setattr(arena_fds, "import_pages", lambda *a, **kw: unread_at_fetch.append(t.unread()))
        c.unpin(c.lookup([b"k1"]))
        assert t.unread() == 1
        real_view = c.view
        c.view = SimpleNamespace(fd_unit="page", mapped_slabs=real_view.mapped_slabs)
        try:
            c._import_pages([0, 1], readonly=True)
        finally:
            c.view = real_view
        assert unread_at_fetch == [0, 0]
        c.flush()
        assert c.stats().pinned_pages == 0


# ------------------------------------------------------------------ a posted reply's slab count


def test_a_posted_reply_s_slab_count_is_not_needed_the_next_awaited_reply_carries_it(fake, step_rig):
    """A posted give-back's OK reply is only header-checked, so the arena's slab count it
    carries is not read. Nothing is lost: a give-back returns nothing to map, and every
    awaited reply carries the count at its own time (never less: slabs are only added) in
    the reply and in each record, which is what the client maps by."""
    t = fake.transport
    _post(t, w.OP_UNPIN, [1])
    fake.frames_in(1)
    fake.peer.sendall(_ok(bytes((w.OP_UNPIN,)), slabs=5) + _lookup_reply(2))  # the posted one: 5
    assert t.request(w.encode_step([(w.OP_LOOKUP, (b"k",), 1)])).arena_slabs == 3  # the awaited one's own

    b, setup = step_rig
    with BrokerClient.connect(b.socket) as c:
        objs = c.lookup([b"k0"])
        slabs = c.view.mapped_slabs
        assert slabs == setup.stats().num_slabs
        c.unpin(objs)  # posted: its reply, read later, carries the count at its time
        t = c._step_path().transport
        assert t.unread() == 1
        # The arena grows meanwhile (a slab is 4 pages here): a new object lives past it.
        (big,) = setup.allocate([Spec(4, content_type="kv_cache", key=b"past-the-slabs")])
        big.page_tensors()[-1][:8] = 7
        assert setup.stats().num_slabs > slabs
        (got,) = c.lookup([b"past-the-slabs"])  # reads the posted reply, then its own
        assert t.unread() == 0 and c.view.mapped_slabs == setup.stats().num_slabs
        assert int(got.page_tensors()[-1][:8].sum()) == 56
        c.unpin([got])
        c.flush()
