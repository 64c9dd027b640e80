"""The client's step batch: an engine's running batch, told only its arrivals and completions.

``StepBatch`` (made by ``BrokerClient.step_batch()``) keeps per-adapter and per-key counts of
the batch's sequences and sends the step path (``clients/step/path.py``'s ``StepPath.delta``) only
the first hold and the last drop of each, so a change costs what changed, not the batch's
size; ``begin``/``result`` overlap the round trip with the model's work, and a background
batch's worker thread runs each change while the engine waits. It owns no session state beyond its
counts and never talks gRPC itself (its fallbacks are ``BrokerClient``'s calls).
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable, Sequence

from memory_broker.clients.step.adapters import AdapterLease, LeasedAdapter
from memory_broker.proto.wire import step as _wire
from memory_broker.proto.wire.errors import BrokerError, Code

log = logging.getLogger(__name__)


class BatchDelta:
    """What one ``StepBatch`` change added: the leased adapters of its ``add`` (one per
    listed id, in order) and the objects of its ``add_keys`` (the longest present prefix)."""

    __slots__ = ("adapters", "objects", "round_trips")

    def __init__(self, adapters: list, objects: list, round_trips: int):
        self.adapters: list[LeasedAdapter] = adapters
        self.objects: list = objects
        # Frames this change took (0: it asked nothing of the broker).
        self.round_trips = round_trips


class PendingBatchStep:
    """A change begun by ``StepBatch.begin``; ``result()`` returns its ``BatchDelta`` (once;
    the batch's next change collects it first if the caller has not). With a background
    batch, the batch's worker thread sends the change, reads the reply and accounts it, and
    ``result()`` waits for that, or runs the change itself if the worker has not started it
    (it had no GIL: the engine thread ran Python all along)."""

    __slots__ = ("_finish", "_delta", "_error", "_done", "_wait_s", "_box")

    def __init__(
        self, finish: Callable[[], BatchDelta] | None, done: threading.Lock | None = None, wait_s: float = 0.0
    ):
        # Run by the caller of ``result()`` (None: the worker runs the change).
        self._finish = finish
        self._delta: BatchDelta | None = None
        self._error: BaseException | None = None
        # Held until the worker has run the change; ``wait_s`` bounds the wait for it.
        self._done = done
        self._wait_s = wait_s
        # The queued change (a one-item list) while nobody has taken it.
        self._box: list | None = None

    @property
    def settled(self) -> bool:
        """Whether the change has run to its end (``result()`` will not wait or run it)."""
        return self._finish is None and (self._done is None or not self._done.locked())

    def result(self) -> BatchDelta:
        done = self._done
        if done is not None:
            box = self._box
            if box:
                try:
                    job = box.pop()
                except IndexError:
                    pass  # the worker has it
                else:
                    job()  # not begun by the worker (it had no GIL): run it here
            if not done.acquire(timeout=self._wait_s):
                raise BrokerError(
                    Code.UNAVAILABLE,
                    f"the step batch's worker did not finish this change within {self._wait_s:g} s; "
                    "the broker may be stuck: check `memory-broker status`",
                )
            done.release()
        else:
            fn, self._finish = self._finish, None
            if fn is not None:
                try:
                    self._delta = fn()
                except BaseException as e:
                    self._error = e
        if self._error is not None:
            raise self._error
        return self._delta


def _worker(jobs: queue.SimpleQueue) -> None:
    """A background batch's thread: run each begun change (send, read the reply, account
    it) while the engine thread waits for its model; asleep until the next one comes. Its
    queue holds changes (one-item lists, taken by ``pop``: this worker or a ``result()`` that
    finds it not begun) and None to stop (the batch released or collected). Holds the queue
    only, not the batch."""
    get = jobs.get
    while (box := get()) is not None:
        try:
            job = box.pop()
        except IndexError:  # a result() ran it
            continue
        job()
        del job, box  # they hold the batch: not past the change


class StepBatch:
    """An engine's running batch, changed by its arrivals and completions only.

    ``client.step_batch()`` makes one. Each change (``update``, or ``begin`` then ``result``
    to overlap the round trip with the model's work) names what arrives (``add`` adapter ids,
    ``add_keys`` KV keys) and what completes (``drop``, ``drop_keys``); the batch keeps
    per-id and per-key counts, so an id or key already held costs a dict update, and only
    the first hold and the last drop of one reach the broker. The cost of a change is proportional to the change, not to the batch.

    ``add_keys`` is looked up like ``lookup``: the longest present prefix (keys the batch
    holds count as present) is pinned; the keys after it are counted but hold nothing.
    A drop takes effect when sent (``begin``; a background batch's worker sends it soon
    after), so drop only what the running step no longer reads. Between a background
    batch's ``begin`` and ``result`` its ``adapters`` and ``objects`` are the worker's.
    A refused change (e.g. an unknown adapter) raises BrokerError: its drops took
    effect, its adds did not. Bad arguments (dropping what the batch does not hold) raise
    ValueError and change nothing.
    """

    def __init__(self, client, background: bool = False):
        """``client``: the ``BrokerClient`` whose session holds the batch (not imported here:
        the client module imports this one)."""
        self.client = client
        self.epoch = client.epoch
        # Background: ``begin`` only queues the change for a thread of this batch, which
        # checks and counts it, sends it, reads the reply and accounts it (leases,
        # objects) while the engine thread waits for its model; ``result()`` then finds it
        # done. The work moves to that thread (it takes the GIL when the engine thread is
        # not running Python); it is not removed.
        self.background = background
        self._jobs: queue.SimpleQueue | None = None
        # Adapter id -> its LeasedAdapter, for every id the batch holds (what kernels read).
        self.adapters: dict[str, LeasedAdapter] = {}
        # Key -> BrokerObject, for every key the batch holds pinned.
        self.objects: dict[bytes, object] = {}
        self._acount: dict[str, int] = {}
        self._kcount: dict[bytes, int] = {}
        # Adapters held by an AdapterLease of their own (acquired over gRPC: a session without
        # a step channel), released through it.
        self._own: dict[str, AdapterLease] = {}
        self._pending: PendingBatchStep | None = None
        self.released = False

    # ------------------------------------------------------------ changes

    def update(
        self,
        add: Sequence[str] = (),
        drop: Sequence[str] = (),
        add_keys: Sequence[bytes] = (),
        drop_keys: Sequence[bytes] = (),
    ) -> BatchDelta:
        """Apply one change in one round trip (none when the batch holds all
        of it: keys new to the batch always go to the broker)."""
        return self.begin(add, drop, add_keys, drop_keys, _inline=True).result()

    def begin(
        self,
        add: Sequence[str] = (),
        drop: Sequence[str] = (),
        add_keys: Sequence[bytes] = (),
        drop_keys: Sequence[bytes] = (),
        *,
        _inline: bool = False,
    ) -> PendingBatchStep:
        """Send one change now; ``result()`` reads the reply (after the model's work). A
        background batch hands the change to its worker thread instead, which checks, sends
        and accounts it while the caller goes on (a bad drop's ValueError then comes from
        ``result()``, still having changed nothing)."""
        p = self._pending
        if p is not None:
            self._pending = None
            if not p.settled:
                try:
                    p.result()
                except Exception:
                    pass  # its caller gets it from its own result()
        client = self.client
        if self.released:
            raise BrokerError(Code.FAILED_PRECONDITION, "this step batch was released; make a new one")
        if self.epoch != client.epoch:
            raise BrokerError(
                Code.FAILED_PRECONDITION,
                "the session this batch held its pins in ended (the broker restarted); make a new step batch",
            )
        if self.background and not _inline and (add or drop or add_keys or drop_keys):
            # Copies: the caller may reuse its lists before the worker reads them.
            pending = self._hand_over(tuple(add), tuple(drop), tuple(add_keys), tuple(drop_keys))
        else:
            rel, unpin, new_ids, new_keys, own = self._take_drops(add, drop, add_keys, drop_keys)
            for lease in own:
                lease.release()
            sent = client._step_calls().change(new_ids, rel, new_keys, unpin)
            pending = PendingBatchStep(lambda: self._finish(sent.result(), add, new_ids, add_keys, new_keys))
        self._pending = pending
        return pending

    def _take_drops(self, add, drop, add_keys, drop_keys):
        """Check the change's drops and count them out (ValueError: nothing changed); returns
        what the step path must hear of: (adapters to release, objects to unpin, adapter ids
        and keys the batch does not hold yet), and the gRPC leases to release. One pass per
        list (a background batch's worker runs it first after waking, when every bytecode
        costs 2-3x); in one call of the native core (``_stepcore.c``'s ``batch_take``) where
        it is there and takes the change (every drop held, none repeated)."""
        acount, kcount = self._acount, self._kcount
        core = _wire._core
        if core is not None:
            got = core.batch_take(
                acount, kcount, self.adapters, self._own, self.objects, add, drop, add_keys, drop_keys
            )
            if got is not None:
                return got
        # Check every drop before changing anything.
        if drop:
            self._check_drops(drop, acount, "adapter id")
        if drop_keys:
            self._check_drops(drop_keys, kcount, "key")
        rel: list[str] = []
        own: list[AdapterLease] = []
        if drop:
            adapters, owned = self.adapters, self._own
            for a in drop:
                n = acount[a] - 1
                if n:
                    acount[a] = n
                    continue
                del acount[a], adapters[a]
                if a in owned:
                    own.append(owned.pop(a))
                else:
                    rel.append(a)
        unpin: list[int] = []
        objects = self.objects
        if drop_keys:
            for k in drop_keys:
                n = kcount[k] - 1
                if n:
                    kcount[k] = n
                    continue
                del kcount[k]
                o = objects.pop(k, None)
                if o is not None:
                    unpin.append(o.object_id)
        new_ids = [a for a in dict.fromkeys(add) if a not in acount] if add else []
        # Each key once: the batch holds one pin per key, whatever its count.
        new_keys = [k for k in dict.fromkeys(add_keys) if k not in objects] if add_keys else []
        return rel, unpin, new_ids, new_keys, own

    def _hand_over(self, add, drop, add_keys, drop_keys) -> PendingBatchStep:
        """Queue the change for the batch's worker thread (started on first use): the
        caller's part of a background change is this, nothing more. Until the worker has
        the broker's reply, the client's other calls wait (``_unsent``), so the broker sees
        the session's calls in the order they were made."""
        client = self.client
        jobs = self._jobs
        if jobs is None:
            jobs = self._jobs = queue.SimpleQueue()
            threading.Thread(target=_worker, args=(jobs,), name="step-batch-worker", daemon=True).start()
            # A batch dropped without release() still ends its thread.
            weakref.finalize(self, jobs.put, None)
        done = threading.Lock()
        done.acquire()
        pending = PendingBatchStep(None, done, client.timeout + 1.0)
        gate = threading.Lock()  # held until the change is answered
        gate.acquire()
        client._unsent.append(gate)
        # Whoever pops it runs it: the worker, or result() if the worker has not begun it.
        box = [lambda: self._run_change(pending, gate, add, drop, add_keys, drop_keys)]
        pending._box = box
        jobs.put(box)
        return pending

    def _run_change(self, pending: PendingBatchStep, gate: threading.Lock, add, drop, add_keys, drop_keys) -> None:
        """The worker's part of a background change: check and count it, send it, read the
        reply, open the client's other calls (``gate``), account the reply."""
        client = self.client
        try:
            try:
                rel, unpin, new_ids, new_keys, own = self._take_drops(add, drop, add_keys, drop_keys)
                sent = client._step_calls(wait_sent=False).change(new_ids, rel, new_keys, unpin)
                if sent.sent:
                    sent.collect()  # the broker has it: the session's other calls may follow
            finally:
                # The session's other calls may go now (this thread's own gRPC calls below
                # would otherwise wait for this very gate).
                client._unsent.remove(gate)
                gate.release()
            for lease in own:  # over gRPC: after the gate, or this thread would wait for itself
                lease.release()
            # Over gRPC the change's calls are made here (after the gate, or they would wait for it).
            pending._delta = self._finish(sent.result(), add, new_ids, add_keys, new_keys)
        except BaseException as e:
            pending._error = e
        finally:
            pending._done.release()

    @staticmethod
    def _check_drops(items: Sequence, counts: dict, what: str) -> None:
        get = counts.get
        for x in items:
            if get(x, 0) < 1:
                break
        else:
            if len(items) == 1 or len(set(items)) == len(items):
                return  # each held, each once: the usual drop
        need: dict = {}
        for x in items:
            need[x] = need.get(x, 0) + 1
        for x, n in need.items():
            if counts.get(x, 0) < n:
                raise ValueError(f"drop of {what} {x!r} x{n}: the batch holds it {counts.get(x, 0)} times")

    def _finish(self, got, add, new_ids, add_keys, new_keys) -> BatchDelta:
        """Count a change's result (the calls object's ``change(...).result()``: the new
        adapters' leases, or None when they must be acquired over gRPC; the found objects;
        round trips)."""
        leased, found, rts = got
        if new_ids:
            if leased is not None:
                adapters = self.adapters
                for aid, la in leased:
                    adapters[aid] = la
            else:
                self._acquire_own(new_ids, found)
        return self._account(add, add_keys, new_keys, found, rts)

    def _acquire_own(self, ids: list[str], pinned) -> None:
        """Adapters of a session without a step channel: over gRPC, each under a lease of its
        own so that each can be released when its last sequence completes."""
        client = self.client
        try:
            lease = client.acquire_adapters(ids)
        except BaseException:
            if pinned:
                client.unpin(pinned)
            raise
        for la in lease.adapters:
            self.adapters[la.adapter_id] = la
            self._own[la.adapter_id] = AdapterLease(client, [la], (), 0, lease.session_id)

    def _account(self, add, add_keys, new_keys, found: list, rts: int) -> BatchDelta:
        """Count a change's adds in (its new keys' objects held) and say what it got; in one
        call of the native core (``batch_account``) where it is there."""
        acount, kcount, objects = self._acount, self._kcount, self.objects
        core = _wire._core
        if core is not None:
            got = core.batch_account(acount, kcount, objects, self.adapters, add, add_keys, new_keys, found)
            if got is not None:
                return BatchDelta(got[0], got[1], rts)
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
            except Exception:
                pass  # its caller gets it from its own result()
        self.released = True
        if self._jobs is not None:
            self._jobs.put(None)  # the worker ends
        client = self.client
        own, self._own = self._own, {}
        rel = [a for a in self.adapters if a not in own]
        unpin = [o.object_id for o in self.objects.values()]
        self.adapters, self.objects, self._acount, self._kcount = {}, {}, {}, {}
        if self.epoch != client.epoch or client.closed:
            return  # the pins ended with the session
        for lease in own.values():
            lease.release()
        client._step_calls().give_back(rel, unpin)

    def __enter__(self) -> StepBatch:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
