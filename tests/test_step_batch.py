"""StepBatch: an engine's running batch changed by its arrivals and completions. A change
costs a round trip only for what the batch does not hold, the broker's
books follow every change, bad drops change nothing, and releasing gives everything back."""

from __future__ import annotations

import gc
import queue
import random
import threading
import time
from collections import Counter

import pytest
from conftest import step_frames as frames

from memory_broker.clients import BrokerClient, BrokerError, Code

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores


def test_a_change_asks_the_broker_only_for_what_the_batch_does_not_hold(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1", "a2"], "hot")
    with BrokerClient.connect(b.socket) as c:
        batch = c.step_batch()
        n = frames(c)
        d = batch.update(["a0", "a1", "a0"], (), [b"k0", b"k1"])
        assert frames(c) == n + 1 and d.round_trips == 1
        assert [a.adapter_id for a in d.adapters] == ["a0", "a1", "a0"] and [o.key for o in d.objects] == [b"k0", b"k1"]
        assert set(batch.adapters) == {"a0", "a1"} and set(batch.objects) == {b"k0", b"k1"}
        assert c.stats().pinned_pages == 4
        # Another sequence of a0 on k0 arrives: nothing to ask.
        d = batch.update(["a0"], (), [b"k0"])
        assert frames(c) == n + 1 and d.round_trips == 0 and [o.key for o in d.objects] == [b"k0"]
        # One of a0 on k1 completes: k1's last sequence, unpinned in one frame.
        d = batch.update((), ["a0"], (), [b"k1"])
        assert frames(c) == n + 2 and d.round_trips == 1
        assert set(batch.objects) == {b"k0"}
        # A new adapter and key: one frame carrying only them and a1's release.
        d = batch.update(["a2"], ["a1"], [b"k2"])
        assert frames(c) == n + 3 and d.adapters[0].adapter_id == "a2"
        assert set(batch.adapters) == {"a0", "a2"} and set(batch.objects) == {b"k0", b"k2"}
        # What was dropped went back with the change that dropped it.
        assert c.stats().pinned_pages == 4
        batch.release()
        assert c.stats().pinned_pages == 0


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
        p = batch.begin(["nope"], ["a0"], [b"k1"], [b"k0"])
        with pytest.raises(BrokerError) as e:
            p.result()
        assert e.value.code == Code.NOT_FOUND
        with pytest.raises(BrokerError) as again:  # once read, the same error again
            p.result()
        assert again.value is e.value
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
    with BrokerClient.connect(b.socket) as c:
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
        assert c.stats().pinned_pages == 0


@pytest.mark.parametrize("mode", ["step", "grpc", "worker-thread"])
def test_random_changes_keep_the_counts_straight_and_give_everything_back(step_rig, mode, monkeypatch):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")  # a2, a3 start cold: gRPC loads them
    if mode == "grpc":
        monkeypatch.setattr(BrokerClient, "_step_socket", lambda self: "/nonexistent/step")
    keys = [b"k%d" % i for i in range(6)] + [b"absent"]
    rng = random.Random(11)
    with BrokerClient.connect(b.socket) as c:
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
        assert c.stats().pinned_pages == 0


def test_a_worker_thread_runs_the_change_while_the_caller_waits_and_calls_in_between_stay_in_order(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    with BrokerClient.connect(b.socket) as c:
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


def test_a_background_worker_that_went_to_sleep_is_woken_by_the_next_change(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        batch = c.step_batch(background=True, poll_s=0.0002)  # poll_s: accepted, unused
        for i in range(3):
            batch.begin(["a0"], (), [b"k%d" % i]).result()
            time.sleep(0.05)  # the worker sleeps
            d = batch.begin((), ["a0"], (), [b"k%d" % i]).result()
            assert d.adapters == [] and batch.objects == {}
        batch.release()
        assert c.stats().pinned_pages == 0
        with pytest.raises(ValueError, match="poll_s"):
            c.step_batch(background=True, poll_s=-1)


def test_the_worker_runs_every_queued_change_once_in_order_however_the_puts_fall():
    # Puts land while the worker runs and while it sleeps; none may be lost, run twice or
    # out of order.
    from memory_broker.clients.step import batch as batch_mod

    jobs = queue.SimpleQueue()
    t = threading.Thread(target=batch_mod._worker, args=(jobs,), daemon=True)
    t.start()
    ran: list[int] = []
    rng = random.Random(3)
    for i in range(400):
        jobs.put([lambda i=i: ran.append(i)])
        time.sleep(rng.choice([0, 0, 0.0001, 0.0015, 0.0025, 0.004]))
    deadline = time.monotonic() + 5
    while len(ran) < 400 and time.monotonic() < deadline:
        time.sleep(0.001)
    # All ran before the stop (whose own wake-up would hide a lost one), once each, in order.
    assert ran == list(range(400))
    stolen = [1]
    box = [lambda: stolen.append(2)]
    assert box.pop()  # what a result() does with a change the worker has not begun
    jobs.put(box)  # an emptied box: the worker skips it
    jobs.put(None)  # stop
    t.join(10)
    assert not t.is_alive() and stolen == [1]


def test_result_gives_up_on_a_worker_that_does_not_finish(step_rig, monkeypatch):
    # The worker is stuck in a change (a broker that does not answer): result() says so
    # after its wait (it used to raise AttributeError: a status code that does not exist).
    from memory_broker.clients.step import batch as batch_mod

    stuck = threading.Event()
    finish = batch_mod.StepBatch._finish
    monkeypatch.setattr(batch_mod.StepBatch, "_finish", lambda self, *a: (stuck.wait(10), finish(self, *a))[1])
    b, setup = step_rig
    setup.prefetch_adapters(["a0"], "hot")
    with BrokerClient.connect(b.socket) as c:
        batch = c.step_batch(background=True)
        p = batch.begin(["a0"], (), [b"k0"])
        deadline = time.monotonic() + 5
        while p._box and time.monotonic() < deadline:
            time.sleep(0.001)  # until the worker has taken it (and is stuck in it)
        p._wait_s = 0.2
        with pytest.raises(BrokerError) as e:
            p.result()
        assert e.value.code == Code.UNAVAILABLE and "did not finish this change within 0.2 s" in str(e.value)
        stuck.set()
        assert [o.key for o in p.result().objects] == [b"k0"]  # it finished after all
        batch.release()
        assert c.stats().pinned_pages == 0
