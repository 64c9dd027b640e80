"""The client's step batch: an engine's running batch, told only its arrivals and completions.

``StepBatch`` (made by ``BrokerClient.step_batch()``) keeps per-adapter and per-key counts of
the batch's sequences and sends the step path (``clients/step.py``'s ``StepPath.delta``) only
the first hold and the last drop of each, so a change costs what changed, not the batch's
size; ``begin``/``result`` overlap the round trip with the model's work, and a background
batch's collector thread reads each reply as it arrives. It owns no session state beyond its
counts and never talks gRPC itself (its fallbacks are ``BrokerClient``'s calls).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from typing import Callable, Sequence

from memory_broker.clients.adapters import AdapterLease, LeasedAdapter
from memory_broker.clients.step import StepPath
from memory_broker.wire.errors import BrokerError, Code

log = logging.getLogger(__name__)


class BatchDelta:
    """What one ``StepBatch`` change added: the leased adapters of its ``add`` (one per
    listed id, in order) and the objects of its ``add_keys`` (the longest present prefix)."""

    __slots__ = ("adapters", "objects", "round_trips")

    def __init__(self, adapters: list, objects: list, round_trips: int):
        self.adapters: list[LeasedAdapter] = adapters
        self.objects: list = objects
        # Frames this change took (0: the step cache had all of it).
        self.round_trips = round_trips


class PendingBatchStep:
    """A change sent by ``StepBatch.begin``; ``result()`` returns its ``BatchDelta`` (once;
    the batch's next change collects it first if the caller has not). With a background
    batch, the thread that reads the reply (the batch's collector, as soon as it arrives)
    also accounts it, and ``result()`` waits for that."""

    __slots__ = ("_finish", "_delta", "_error", "_done", "_swap", "_wait_s")

    def __init__(self, finish: "Callable[[], BatchDelta] | None", done: "threading.Lock | None" = None,
                 wait_s: float = 0.0):  # fmt: skip
        self._finish = finish
        self._delta: BatchDelta | None = None
        self._error: BaseException | None = None
        # Held until the reply is read and accounted by another thread (None: the caller
        # reads it); ``wait_s`` bounds that wait (then the caller reads it itself).
        self._done = done
        self._wait_s = wait_s
        self._swap = threading.Lock()

    def _run(self) -> None:
        with self._swap:  # one thread runs it, once
            fn, self._finish = self._finish, None
        if fn is not None:
            try:
                self._delta = fn()
            except BaseException as e:
                self._error = e

    def _collected(self) -> None:
        """The reply was read (by the collector, or by any caller of the step path): account
        it now, unless ``begin`` has not finished setting this up (then ``result()`` does)."""
        try:
            self._run()
        finally:
            self._done.release()

    def result(self) -> BatchDelta:
        done = self._done
        if done is not None:
            if done.acquire(timeout=self._wait_s):
                done.release()
        self._run()
        if self._error is not None:
            raise self._error
        return self._delta


def _collector(st: StepPath, stop: threading.Event) -> None:
    """A background batch's thread: wait on the step socket and read a begun change's reply
    as soon as it arrives (the engine thread is waiting for its model meanwhile)."""
    poller = select.poll()
    fd = st.transport.fileno()
    if fd < 0:
        return
    poller.register(fd, select.POLLIN)
    while not stop.is_set():
        try:
            if not poller.poll(100):
                continue
            if st.transport.closed:
                return
            if not st.collect_ready():
                # Another caller's reply, or one not begun by the batch: that caller reads it.
                time.sleep(0.0002)
        except Exception as e:  # the engine thread reads its replies itself from now on
            log.warning("step batch collector stopped: %r", e)
            return


class StepBatch:
    """An engine's running batch, changed by its arrivals and completions only.

    ``client.step_batch()`` makes one. Each change (``update``, or ``begin`` then ``result``
    to overlap the round trip with the model's work) names what arrives (``add`` adapter ids,
    ``add_keys`` KV keys) and what completes (``drop``, ``drop_keys``); the batch keeps
    per-id and per-key counts, so an id or key already held costs a dict update, and only
    the first hold and the last drop of one reach the step path (and, through its cache,
    the broker). The cost of a change is proportional to the change, not to the batch.

    ``add_keys`` is looked up like ``lookup``: the longest present prefix (keys the batch
    holds count as present) is pinned; the keys after it are counted but hold nothing.
    A drop takes effect when sent (``begin``), so drop only what the running step no longer
    reads. A refused change (e.g. an unknown adapter) raises BrokerError: its drops took
    effect, its adds did not. Bad arguments (dropping what the batch does not hold) raise
    ValueError and change nothing.
    """

    def __init__(self, client, background: bool = False):
        """``client``: the ``BrokerClient`` whose session holds the batch (not imported here:
        the client module imports this one)."""
        self.client = client
        self.epoch = client.epoch
        # Background: a thread of this batch reads each begun change's reply as soon as it
        # arrives and accounts it (cache, leases, objects), while the engine thread waits for
        # its model; ``result()`` then finds it done. The work moves to that thread (it takes
        # the GIL when the engine thread is not running Python); it is not removed.
        self.background = background
        self._stop: threading.Event | None = None
        # Adapter id -> its LeasedAdapter, for every id the batch holds (what kernels read).
        self.adapters: dict[str, LeasedAdapter] = {}
        # Key -> BrokerObject, for every key the batch holds pinned.
        self.objects: dict[bytes, object] = {}
        self._acount: dict[str, int] = {}
        self._kcount: dict[bytes, int] = {}
        # Adapters held by an AdapterLease of their own (acquired over gRPC: not hot, or no
        # step channel), released through it.
        self._own: dict[str, AdapterLease] = {}
        self._pending: PendingBatchStep | None = None
        self.released = False

    # ------------------------------------------------------------ changes

    def update(self, add: Sequence[str] = (), drop: Sequence[str] = (), add_keys: Sequence[bytes] = (),
               drop_keys: Sequence[bytes] = ()) -> BatchDelta:  # fmt: skip
        """Apply one change in one round trip (none when the step cache has all of it)."""
        return self.begin(add, drop, add_keys, drop_keys, _inline=True).result()

    def begin(self, add: Sequence[str] = (), drop: Sequence[str] = (), add_keys: Sequence[bytes] = (),
              drop_keys: Sequence[bytes] = (), *, _inline: bool = False) -> PendingBatchStep:  # fmt: skip
        """Send one change now; ``result()`` reads the reply (after the model's work), or
        the collector thread does as soon as it arrives (a background batch)."""
        if self._pending is not None:
            p, self._pending = self._pending, None
            try:
                p.result()
            except BrokerError:
                pass  # its caller gets it from its own result()
        client = self.client
        if self.released:
            raise BrokerError(Code.FAILED_PRECONDITION, "this step batch was released; make a new one")
        if self.epoch != client.epoch:
            raise BrokerError(
                Code.FAILED_PRECONDITION,
                "the session this batch held its pins in ended (the broker restarted); make a new step batch",
            )
        acount, kcount = self._acount, self._kcount
        # Check every drop before changing anything.
        if drop:
            self._check_drops(drop, acount, "adapter id")
        if drop_keys:
            self._check_drops(drop_keys, kcount, "key")
        rel: list[str] = []
        for a in drop:
            n = acount[a] - 1
            if n:
                acount[a] = n
            else:
                del acount[a]
                del self.adapters[a]
                if a in self._own:
                    self._own.pop(a).release()
                else:
                    rel.append(a)
        unpin: list[int] = []
        objects = self.objects
        for k in drop_keys:
            n = kcount[k] - 1
            if n:
                kcount[k] = n
            else:
                del kcount[k]
                o = objects.pop(k, None)
                if o is not None:
                    unpin.append(o.object_id)
        new_ids = [a for a in dict.fromkeys(add) if a not in acount]
        # Each key once: the batch holds one pin per key, whatever its count.
        new_keys = [k for k in dict.fromkeys(add_keys) if k not in objects]
        st = client._step_path()
        if st is None:
            pending = PendingBatchStep(lambda: self._grpc(rel, unpin, add, new_ids, add_keys, new_keys))
        else:
            if self.background and not _inline:
                if self._stop is None:
                    self._stop = threading.Event()
                    threading.Thread(target=_collector, args=(st, self._stop), name="step-batch-collector",
                                     daemon=True).start()  # fmt: skip
                done = threading.Lock()
                done.acquire()
                pending = PendingBatchStep(None, done, client.timeout + 1.0)
                sent = client._fast(st.delta, new_ids, rel, new_keys, unpin, pending._collected)
                if not sent.sent:
                    done.release()
            else:
                pending = PendingBatchStep(None)
                sent = client._fast(st.delta, new_ids, rel, new_keys, unpin)
            pending._finish = lambda: self._finish(sent, add, new_ids, add_keys, new_keys)
        self._pending = pending
        return pending

    @staticmethod
    def _check_drops(items: Sequence, counts: dict, what: str) -> None:
        need: dict = {}
        for x in items:
            need[x] = need.get(x, 0) + 1
        for x, n in need.items():
            if counts.get(x, 0) < n:
                raise ValueError(f"drop of {what} {x!r} x{n}: the batch holds it {counts.get(x, 0)} times")

    def _finish(self, sent, add, new_ids, add_keys, new_keys) -> BatchDelta:
        client = self.client
        recs, objs, slabs = client._fast(sent.result)
        if slabs:
            client._ensure_slabs(slabs)
        if new_ids:
            if recs is not None:
                adapters, leased = self.adapters, client._leased_step
                for aid, rec in recs:
                    adapters[aid] = leased(aid, rec)
            else:
                self._acquire_own(new_ids, objs)
        found = client._objects(objs) if objs else []
        return self._account(add, add_keys, new_keys, found, 1 if sent.sent else 0)

    def _grpc(self, rel, unpin, add, new_ids, add_keys, new_keys) -> BatchDelta:
        client = self.client
        if rel:
            client.release_adapters(rel)
        if unpin:
            client.unpin(unpin)
        if new_ids:
            self._acquire_own(new_ids, None)
        found = client.lookup(new_keys) if new_keys else []
        return self._account(add, add_keys, new_keys, found, 0)

    def _acquire_own(self, ids: list[str], pinned) -> None:
        """Adapters the step channel cannot give (one needs a load): over gRPC, each under a
        lease of its own so that each can be released when its last sequence completes."""
        client = self.client
        try:
            lease = client.acquire_adapters(ids)
        except BaseException:
            if pinned:
                client.unpin(client._objects(pinned))
            raise
        for la in lease.adapters:
            self.adapters[la.adapter_id] = la
            self._own[la.adapter_id] = AdapterLease(client, [la], (), 0, lease.session_id)

    def _account(self, add, add_keys, new_keys, found: list, rts: int) -> BatchDelta:
        acount, kcount, objects = self._acount, self._kcount, self.objects
        for a in add:
            acount[a] = acount.get(a, 0) + 1
        for k, o in zip(new_keys, found):
            objects[k] = o
        got = []
        for k in add_keys:
            kcount[k] = kcount.get(k, 0) + 1
            if got is not None:
                o = objects.get(k)
                if o is None:
                    got = None  # the end of the present prefix
                else:
                    got.append(o)
        adapters = self.adapters
        return BatchDelta([adapters[a] for a in add], got or [], rts)

    # ------------------------------------------------------------ the end

    def release(self) -> None:
        """Give back everything the batch holds (once; a change not collected is first)."""
        if self.released:
            return
        if self._pending is not None:
            p, self._pending = self._pending, None
            try:
                p.result()
            except BrokerError:
                pass
        self.released = True
        if self._stop is not None:
            self._stop.set()  # the collector ends
        client = self.client
        own, self._own = self._own, {}
        rel = [a for a in self.adapters if a not in own]
        unpin = [o.object_id for o in self.objects.values()]
        self.adapters, self.objects, self._acount, self._kcount = {}, {}, {}, {}
        if self.epoch != client.epoch or client.closed:
            return  # the pins ended with the session
        for lease in own.values():
            lease.release()
        st = client._step_path()
        if st is None:
            if unpin:
                client.unpin(unpin)
            return
        if rel or unpin:
            client._fast(st.step, release=rel, unpin=unpin, acquire=False, lookup=False)

    def __enter__(self) -> "StepBatch":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
