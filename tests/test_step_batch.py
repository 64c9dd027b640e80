"""StepBatch: an engine's running batch changed by its arrivals and completions. A change
costs a round trip only for what the batch (and the step cache) does not hold, the broker's
books follow every change, bad drops change nothing, and releasing gives everything back."""

from __future__ import annotations

import gc
import random
import threading
import time
from collections import Counter

import pytest
from conftest import step_frames as frames

from memory_broker.clients import BrokerClient, BrokerError, Code


def test_a_change_asks_the_broker_only_for_what_the_batch_does_not_hold(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1", "a2"], "hot")
    with BrokerClient.connect(b.socket, hold_s=30.0) as c:
        batch = c.step_batch()
        n = frames(c)
        d = batch.update(["a0", "a1", "a0"], (), [b"k0", b"k1"])
        assert frames(c) == n + 1 and d.round_trips == 1
        assert [a.adapter_id for a in d.adapters] == ["a0", "a1", "a0"] and [o.key for o in d.objects] == [b"k0", b"k1"]
        assert set(batch.adapters) == {"a0", "a1"} and set(batch.objects) == {b"k0", b"k1"}
        assert c.stats().pinned_pages == 4
        # Another sequence of a0 on k0 arrives, one of a0 on k1 completes: nothing to ask.
        d = batch.update(["a0"], ["a0"], [b"k0"], [b"k1"])
        assert frames(c) == n + 1 and d.round_trips == 0 and [o.key for o in d.objects] == [b"k0"]
        assert set(batch.objects) == {b"k0"}  # k1's last sequence completed
        # A new adapter and key: one frame carrying only them.
        d = batch.update(["a2"], ["a1"], [b"k2"])
        assert frames(c) == n + 2 and d.adapters[0].adapter_id == "a2"
        assert set(batch.adapters) == {"a0", "a2"} and set(batch.objects) == {b"k0", b"k2"}
        # What was dropped stays pinned in the cache (eviction cannot take it) until flushed.
        assert c.stats().pinned_pages == 6
        batch.release()
        assert c.flush_holdings() == 6 and c.stats().pinned_pages == 0


def test_a_bad_drop_is_refused_and_changes_nothing(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        batch = c.step_batch()
        batch.update(["a0"], (), [b"k0"])
        n, pinned = frames(c), c.stats().pinned_pages
        for args in ((["a1"], ["a0", "a0"]), ((), (), (), [b"k1"]), ((), ["a0"], (), [b"k0", b"k0"])):
            with pytest.raises(ValueError, match="the batch holds it"):
                batch.update(*args)
        assert frames(c) == n and c.stats().pinned_pages == pinned
        assert set(batch.adapters) == {"a0"} and set(batch.objects) == {b"k0"}
        batch.release()
        assert c.stats().pinned_pages == 0


def test_a_background_batchs_bad_drop_is_refused_by_result_and_changes_nothing(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        batch = c.step_batch(background=True)
        batch.begin(["a0"], (), [b"k0"]).result()
        n, pinned = frames(c), c.stats().pinned_pages
        p = batch.begin(["a1"], ["a0", "a0"])  # the worker checks it
        with pytest.raises(ValueError, match="the batch holds it"):
            p.result()
        assert frames(c) == n and c.stats().pinned_pages == pinned
        assert set(batch.adapters) == {"a0"} and set(batch.objects) == {b"k0"}
        d = batch.begin((), ["a0"], (), [b"k0"]).result()  # the worker goes on
        assert d.adapters == [] and batch.adapters == {} and batch.objects == {}
        batch.release()
        assert c.stats().pinned_pages == 0


def _workers() -> int:
    return sum(t.name == "step-batch-worker" for t in threading.enumerate())


def test_a_background_batchs_worker_ends_with_the_batch_released_or_dropped(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        before = _workers()
        for drop in (False, True):
            batch = c.step_batch(background=True)
            batch.begin(["a0"], (), [b"k0"]).result()
            assert _workers() == before + 1
            if drop:
                del batch  # never released: its pins go with the session, its thread now
                gc.collect()
            else:
                batch.release()
            deadline = time.monotonic() + 5
            while _workers() > before and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _workers() == before


def test_a_refused_change_keeps_its_drops_and_takes_none_of_its_adds(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    with BrokerClient.connect(b.socket) as c:
        batch = c.step_batch()
        batch.update(["a0"], (), [b"k0"])
        with pytest.raises(BrokerError) as e:
            batch.update(["nope"], ["a0"], [b"k1"], [b"k0"])
        assert e.value.code == Code.NOT_FOUND
        assert batch.adapters == {} and batch.objects == {}
        assert c.stats().pinned_pages == 0
        batch.update(["a1"], (), [b"k1"])  # the batch goes on
        assert set(batch.adapters) == {"a1"} and c.stats().pinned_pages == 2
        batch.release()
        assert c.stats().pinned_pages == 0


@pytest.mark.parametrize("background", [False, True], ids=["caller", "worker-thread"])
def test_begin_overlaps_and_the_next_change_collects_an_uncollected_one(step_rig, background):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    with BrokerClient.connect(b.socket, hold_s=30.0) as c:
        batch = c.step_batch(background=background)
        p1 = batch.begin(["a0"], (), [b"k0"])
        assert c.stats().pinned_pages == 2  # a gRPC call between begin and result: in order
        p2 = batch.begin(["a1"], (), [b"k1"])  # p1 is read first
        assert [o.key for o in p2.result().objects] == [b"k1"]
        assert [a.adapter_id for a in p1.result().adapters] == ["a0"]
        assert set(batch.adapters) == {"a0", "a1"} and set(batch.objects) == {b"k0", b"k1"}
        batch.release()
        with pytest.raises(BrokerError, match="released"):
            batch.update(["a0"])
        c.flush_holdings()
        assert c.stats().pinned_pages == 0


@pytest.mark.parametrize(
    "mode", ["no-cache", "cache", "grpc", "cache-worker-thread", "no-cache-worker-thread", "grpc-worker-thread"]
)
def test_random_changes_keep_the_counts_straight_and_give_everything_back(step_rig, mode, monkeypatch):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")  # a2, a3 start cold: gRPC loads them
    if mode.startswith("grpc"):
        monkeypatch.setattr(BrokerClient, "_step_socket", lambda self: "/nonexistent/step")
    keys = [b"k%d" % i for i in range(6)] + [b"absent"]
    rng = random.Random(11)
    with BrokerClient.connect(b.socket, hold_s=30.0 if mode.startswith("cache") else 0.0) as c:
        batch = c.step_batch(background="thread" in mode)
        seqs: list[tuple[str, bytes]] = []
        for _ in range(150):
            done = rng.sample(seqs, rng.randint(0, min(3, len(seqs))))
            for s in done:
                seqs.remove(s)
            new = [(rng.choice(["a0", "a1", "a2", "a3"]), rng.choice(keys)) for _ in range(rng.randint(0, 3))]
            args = ([a for a, _ in new], [a for a, _ in done], [k for _, k in new], [k for _, k in done])
            if rng.random() < 0.5:
                d = batch.begin(*args).result()
            else:
                d = batch.update(*args)
            seqs += new
            assert [a.adapter_id for a in d.adapters] == args[0]
            assert set(batch.adapters) == {a for a, _ in seqs}
            held = Counter(k for _, k in seqs)
            assert set(batch.objects) <= set(held) and b"absent" not in batch.objects
            assert all(batch.objects[k].key == k for k in batch.objects)
            # The broker pins at least what the batch holds.
            assert c.stats().pinned_pages >= len(batch.adapters) + len(batch.objects)
        batch.release()
        c.flush_holdings()
        assert c.stats().pinned_pages == 0


def test_a_worker_thread_runs_the_change_while_the_caller_waits_and_calls_in_between_stay_in_order(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    with BrokerClient.connect(b.socket, hold_s=30.0) as c:
        batch = c.step_batch(background=True)
        p = batch.begin(["a0"], (), [b"k0", b"k1"])
        deadline = time.monotonic() + 5
        while b"k1" not in batch.objects and time.monotonic() < deadline:
            time.sleep(0.001)  # the model's work: the worker runs the change meanwhile
        assert set(batch.objects) == {b"k0", b"k1"} and set(batch.adapters) == {"a0"}
        # A step-path call of this client after begin: answered after the begun change.
        with c.lookup_pinned([b"k2"]) as objs:
            assert [o.key for o in objs] == [b"k2"]
        assert [o.key for o in p.result().objects] == [b"k0", b"k1"]
        with pytest.raises(BrokerError) as e:
            batch.begin(["nope"]).result()  # a refused change raises from result()
        assert e.value.code == Code.NOT_FOUND
        batch.release()
        c.flush_holdings()
        assert c.stats().pinned_pages == 0


def test_a_background_change_is_what_begin_was_given_though_the_caller_reuses_its_lists(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        batch = c.step_batch(background=True)
        add, keys = ["a0"], [b"k0"]
        p = batch.begin(add, (), keys)
        add[0] = "nope"  # before the worker has (likely) read them
        keys.append(b"k1")
        d = p.result()
        assert [a.adapter_id for a in d.adapters] == ["a0"] and [o.key for o in d.objects] == [b"k0"]
        assert set(batch.objects) == {b"k0"}
        batch.release()
        assert c.stats().pinned_pages == 0


def _settle(p, s: float = 5.0) -> None:
    """Wait (the model's work) until the worker has ended the change ``p``."""
    deadline = time.monotonic() + s
    while not p.settled and time.monotonic() < deadline:
        time.sleep(0.001)


def test_a_sent_change_is_ended_by_the_worker_woken_by_the_reply_alone(step_rig, monkeypatch):
    # begin() sends the change itself and arms the worker's wait on the step socket: the
    # engine thread wakes no thread, and the worker reads the reply and accounts it before
    # result() is called.
    from memory_broker.clients import batch as batch_mod

    puts, ran_on = [], []
    put, end = batch_mod._Jobs.put, batch_mod.StepBatch._end_change
    monkeypatch.setattr(batch_mod._Jobs, "put", lambda self, item: (puts.append(item), put(self, item)))

    def end_change(self, *a):
        ran_on.append(threading.current_thread().name)
        return end(self, *a)

    monkeypatch.setattr(batch_mod.StepBatch, "_end_change", end_change)
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket, hold_s=30.0) as c:
        batch = c.step_batch(background=True)
        n = frames(c)
        for i in range(6):  # the rig's keys
            p = batch.begin(["a0"], ["a0"] if i else (), [b"k%d" % i], [b"k%d" % (i - 1)] if i else ())
            _settle(p)
            assert p.settled and set(batch.objects) == {b"k%d" % i}
            assert [o.key for o in p.result().objects] == [b"k%d" % i]
        assert frames(c) == n + 6 and puts == [] and ran_on == ["step-batch-worker"] * 6
        batch.release()
        c.flush_holdings()
        assert c.stats().pinned_pages == 0


def test_the_replies_of_calls_between_changes_do_not_wake_the_worker(step_rig, monkeypatch):
    # The step socket is armed once per change (EPOLLONESHOT): the session's other calls on
    # the step channel, made while no change is in flight, cost the worker no wake-up.
    from memory_broker.clients import batch as batch_mod

    wakes = [0]
    wait = batch_mod._Jobs.wait
    monkeypatch.setattr(batch_mod._Jobs, "wait", lambda self: (wait(self), wakes.__setitem__(0, wakes[0] + 1)))
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        batch = c.step_batch(background=True)
        p = batch.begin(["a0"], (), [b"k0"])
        _settle(p)
        p.result()
        time.sleep(0.05)
        before = wakes[0]
        for _ in range(10):
            with c.lookup_pinned([b"k1"]) as objs:  # a frame and its reply each
                assert [o.key for o in objs] == [b"k1"]
        time.sleep(0.05)
        assert wakes[0] - before <= 1, f"{wakes[0] - before} wake-ups of the worker for 10 calls"
        d = batch.begin((), ["a0"], (), [b"k0"]).result()  # the next change is still ended
        assert d.adapters == [] and batch.objects == {}
        batch.release()
        assert c.stats().pinned_pages == 0


def test_the_worker_ends_every_change_once_in_order_and_follows_a_new_step_socket():
    # Changes queued with put() (over gRPC) and armed on a socket (the step channel), with
    # that socket replaced by another (a new step channel may reuse the descriptor's number):
    # none may be lost, run twice or out of order.
    import socket

    from memory_broker.clients import batch as batch_mod

    jobs = batch_mod._Jobs()
    t = threading.Thread(target=batch_mod._worker, args=(jobs,), daemon=True)
    t.start()
    ran: list[int] = []

    def settle(n: int) -> None:
        deadline = time.monotonic() + 5
        while len(ran) < n and time.monotonic() < deadline:
            time.sleep(0.001)

    rng = random.Random(3)
    pair = socket.socketpair()
    for i in range(300):
        if i % 50 == 49:  # a new step channel: the old socket closed first
            for s in pair:
                s.close()
            pair = socket.socketpair()
        if rng.random() < 0.5:
            jobs.put([lambda i=i: ran.append(i)])
        else:
            here, broker = pair
            jobs.arm([lambda i=i, s=here: (s.recv(16), ran.append(i))], here.fileno())
            time.sleep(rng.choice([0, 0.0001, 0.001]))
            broker.send(b"r")  # the reply wakes the worker
        settle(i + 1)
    assert ran == list(range(300))
    stolen = [1]
    box = [lambda: stolen.append(2)]
    assert box.pop()  # what a result() does with a change the worker has not begun
    jobs.put(box)  # an emptied box: the worker skips it
    jobs.stop()
    t.join(10)
    assert not t.is_alive() and stolen == [1]


def test_result_gives_up_on_a_worker_that_does_not_finish(step_rig, monkeypatch):
    from memory_broker.clients import batch as batch_mod

    stuck = threading.Event()
    finish = batch_mod.StepBatch._finish
    monkeypatch.setattr(batch_mod.StepBatch, "_finish", lambda self, *a: (stuck.wait(10), finish(self, *a))[1])
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        batch = c.step_batch(background=True)
        p = batch.begin(["a0"], (), [b"k0"])
        time.sleep(0.05)  # the worker has it (and is stuck in it)
        p._wait_s = 0.2
        with pytest.raises(BrokerError) as e:
            p.result()
        assert e.value.code == Code.UNAVAILABLE and "did not finish this change within" in str(e.value)
        stuck.set()
        assert [o.key for o in p.result().objects] == [b"k0"]
        batch.release()
        assert c.stats().pinned_pages == 0
