"""The client's step calls: what an engine does every step, over the step channel.

``StepCalls`` is the part of ``BrokerClient`` that routes the step calls (acquire and release
adapters, lookup, pin, unpin, commit/abort of adapter acquires, ``step``/``step_begin``) over
``clients/step.py``'s ``StepPath`` when the broker has a step channel (``step_batch()`` makes
the changes-only ``StepBatch`` of ``clients/batch.py``), and builds leases and
objects from its records (once per placement: later steps reuse what was built). It owns no
session state of its own beyond those caches and never talks gRPC itself (the methods it
falls back to are ``BrokerClient``'s).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

from memory_broker.clients.adapters import AdapterLease, LeasedAdapter
from memory_broker.clients.batch import POLL_S, StepBatch
from memory_broker.clients.step import StepOutcome, StepPath, StepTransport, StepUnavailable
from memory_broker.proto.wire import step as _w
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.messages import layout_from_proto

log = logging.getLogger(__name__)

# BrokerObjects kept for step-cache records (cleared beyond this: they are rebuilt on demand).
_MADE_LIMIT = 16384


class StepCalls:
    """Mixed into ``BrokerClient``: the step path of the current session, and the calls on it."""

    def _init_step_calls(self, fast_path: bool, hold_s: float) -> None:
        # Step calls over the step channel when the broker has one; ``hold_s`` > 0 also
        # keeps released holdings that long (see clients/step.py).
        self.fast_path = fast_path
        self.hold_s = hold_s
        self._step: StepPath | None = None
        self._step_epoch = 0
        # The session (epoch) whose step channel could not be used: gRPC only for it.
        self._step_off_epoch = 0
        self._step_lock = threading.Lock()
        self._forget_step_objects()

    def _forget_step_objects(self) -> None:
        """A new session: what was built from the old one's records is of no use."""
        # (adapter id, generation, object id) -> LeasedAdapter, and adapter id -> (the step
        # cache's record, its LeasedAdapter).
        self._step_leased: dict = {}
        # Object id -> (step record, BrokerObject made from it).
        self._made: dict = {}

    def step(
        self,
        adapter_ids: Sequence[str] = (),
        keys: Sequence[bytes] = (),
        *,
        max_adapters: int = 0,
        prepare: bool = False,
        lease_s: float = 0.0,
        commit: AdapterLease | None = None,
        release: StepLease | None = None,
    ) -> StepLease:
        """An engine step's changes in one round trip (none when ``hold_s`` keeps them all).

        Releases what ``release`` holds (a previous step), commits ``commit`` (a prepared
        lease: prepare the next step's adapters while this one runs, commit it here),
        acquires ``adapter_ids`` (prepared under a lease with ``prepare``; the cap
        ``max_adapters`` defers the overflow, as ``acquire_adapters`` does) and looks up and
        pins the longest present prefix of ``keys``. Returns a ``StepLease`` holding both;
        release it (or pass it as the next step's ``release``). Without the step channel
        this is the same calls over gRPC.
        """
        ids = list(adapter_ids)
        keys = list(keys)
        st = self._step_path()
        if st is None:
            if release is not None:
                release.release()
            if commit is not None:
                commit.commit()
            lease = self.acquire_adapters(ids, max_adapters, prepare=prepare, lease_s=lease_s) if ids else None
            objs = self.lookup(keys) if keys else []
            return StepLease(self, lease, objs, ids, list(keys), max_adapters)
        same = self._take_over(st, release, ids, keys, max_adapters, prepare, commit)
        if same is not None:
            return same
        out = self._step_frame(st, st.step, ids, keys, max_adapters, prepare, lease_s, commit, release)
        return self._step_lease(out, ids, max_adapters, prepare, lease_s, keys, st)

    def step_begin(
        self,
        adapter_ids: Sequence[str] = (),
        keys: Sequence[bytes] = (),
        *,
        max_adapters: int = 0,
        prepare: bool = False,
        lease_s: float = 0.0,
        commit: AdapterLease | None = None,
        release: StepLease | None = None,
    ) -> PendingStepLease:
        """``step`` in two halves: the frame goes out now, ``result()`` collects the reply.

        Call it as soon as the next step's batch is known and collect it after the current
        step's model work: the round trip overlaps that work. Without the step channel,
        ``result()`` makes the calls over gRPC."""
        ids = list(adapter_ids)
        keys = list(keys)
        st = self._step_path()
        if st is None:
            return PendingStepLease(
                lambda: self.step(
                    ids,
                    keys,
                    max_adapters=max_adapters,
                    prepare=prepare,
                    lease_s=lease_s,
                    commit=commit,
                    release=release,
                )
            )
        same = self._take_over(st, release, ids, keys, max_adapters, prepare, commit)
        if same is not None:
            return PendingStepLease(lambda: same)
        pending = self._step_frame(st, st.begin, ids, keys, max_adapters, prepare, lease_s, commit, release)
        return PendingStepLease(
            lambda: self._step_lease(self._fast(pending.result), ids, max_adapters, prepare, lease_s, keys, st)
        )

    def _step_frame(self, st: StepPath, send, ids, keys, max_adapters, prepare, lease_s, commit, release):
        """One step's frame through ``send`` (``st.step``: sent and read; ``st.begin``: sent,
        read later): what ``release`` gives back, ``commit``'s transaction, the acquire and lookup."""
        rel_ids, unpins, carry = self._giving_back(release, st)
        return self._fast(
            send,
            ids,
            list(keys),
            max_adapters=max_adapters,
            prepare=prepare,
            lease_ms=int(lease_s * 1000),
            commit=(commit.transaction_id,) if commit is not None and commit.transaction_id else (),
            release=rel_ids,
            unpin=unpins,
            acquire=bool(ids),
            lookup=bool(keys),
            carry=carry,
        )

    def _take_over(self, st: StepPath, release, ids, keys, max_adapters, prepare, commit) -> StepLease | None:
        """The steady state: a step asking for what ``release`` holds takes it over (the
        cache's references pass from one lease to the next; nothing to tell the broker)."""
        if (
            release is None
            or not st.caching
            or prepare
            or commit is not None
            or not release.same_as(ids, keys, max_adapters)
            or st.sweep_due()
        ):
            return None
        release.released = True
        sl = StepLease(self, release.adapters, release.objects, ids, keys, max_adapters)
        sl.cache, sl.cached = release.cache, release.cached
        return sl

    def _giving_back(self, release: StepLease | None, st: StepPath) -> tuple[list[str], list[int], tuple[bool, bool]]:
        """What a step gives back of a previous step's lease: (adapter ids, object ids,
        whether each part holds references of ``st``'s cache, which can pass over)."""
        rel_ids: list[str] = []
        unpins: list[int] = []
        carry = (False, False)
        if release is not None and not release.released:
            if release.cache is st:
                carry = release.cached
            release.released = True
            if release.epoch == self.epoch:
                prev = release.adapters
                if prev is not None and not prev.released:
                    if prev.transaction_id:
                        prev.release()  # a prepared lease: abort it, or release it once committed
                    else:
                        prev.released = True
                        rel_ids = prev.ids
                unpins = [o.object_id for o in release.objects]
        return rel_ids, unpins, carry

    def _step_lease(
        self,
        out: StepOutcome,
        ids: list[str],
        max_adapters: int,
        prepare: bool,
        lease_s: float,
        keys: Sequence[bytes] = (),
        st: StepPath | None = None,
    ) -> StepLease:
        objs = self._objects(out.objects) if out.objects is not None else []
        if not ids:
            lease = None
        elif out.acquire_hot:
            lease = self._lease(out)
        else:
            # An adapter needs a load: gRPC does it (and defers over the cap) as always.
            try:
                lease = self.acquire_adapters(ids, max_adapters, prepare=prepare, lease_s=lease_s)
            except BaseException:
                if objs:
                    self.unpin(objs)
                raise
        sl = StepLease(self, lease, objs, ids, list(keys), max_adapters)
        if st is not None and st.caching:
            # What this lease holds are references of st's cache (adapters: unless gRPC
            # acquired them, or they are prepared): a next step may carry them over.
            sl.cache = st
            sl.cached = (bool(ids) and out.acquire_hot and not prepare, True)
        return sl

    def step_batch(self, background: bool = False, poll_s: float = POLL_S) -> StepBatch:
        """An empty ``StepBatch``: the engine's running batch, changed by its arrivals and
        completions (a change costs what changed, not the batch's size). ``background``: a
        thread of the batch runs each ``begin``'s change while the caller goes on; it looks
        for the next change every ``poll_s`` for a while after one (0: never; see StepBatch)."""
        return StepBatch(self, background, poll_s)

    def flush_holdings(self) -> int:
        """Release now every holding the step cache keeps idle (``hold_s``); returns how many."""
        st = self._step if self._step is not None and self._step_epoch == self.epoch else None
        if st is None:
            return 0
        return self._fast(st.flush)

    def _step_socket(self) -> str:
        fd = self.arena.fd_socket_path
        if fd.endswith(".fds"):
            return fd[: -len(".fds")] + ".step"
        return os.path.abspath(self.socket_path) + ".step"

    def _step_path(self, wait_sent: bool = True) -> StepPath | None:
        """The step channel of the current session, connected on first use; None: use gRPC.
        First waits for the changes a background step batch queued (``wait_sent``; its own
        worker does not)."""
        if not self.fast_path:
            return None
        if wait_sent and self._unsent:
            self._wait_sent()
        st = self._step
        if st is not None and self._step_epoch == self.epoch and not st.transport.closed:
            return st
        if self.closed:
            raise BrokerError(Code.FAILED_PRECONDITION, "the client is closed; connect again")
        self._wait_live()
        with self._step_lock:
            epoch = self.epoch
            if self._step_off_epoch == epoch:
                return None
            st = self._step
            if st is not None and self._step_epoch == epoch and not st.transport.closed:
                return st
            if st is not None:
                st.transport.close()
                self._step = None
            try:
                transport = StepTransport(self._step_socket(), self.token, self.timeout)
            except StepUnavailable as e:
                log.info("using gRPC for step calls: %s", e)
                self._step_off_epoch = epoch
                return None
            self._step = StepPath(transport, hold_s=self.hold_s)
            self._step_epoch = epoch
            return self._step

    def _fast(self, fn, *args, **kw):
        """A step-path call, its transport failures as UNAVAILABLE (as gRPC's are)."""
        try:
            return fn(*args, **kw)
        except _w.WireError as e:
            raise BrokerError(Code.INVALID_ARGUMENT, str(e)) from None
        except StepUnavailable as e:
            raise BrokerError(
                Code.UNAVAILABLE, f"the broker at {self.socket_path} did not answer on its step channel ({e}); retry"
            ) from None

    def _fast_or_none(self, fn, *args, **kw):
        """A step-path call that asks nothing of the old session; None when the step channel
        broke (the caller then retries over gRPC, which waits for a reconnect)."""
        try:
            return fn(*args, **kw)
        except _w.WireError as e:
            raise BrokerError(Code.INVALID_ARGUMENT, str(e)) from None
        except StepUnavailable:
            return None

    def _objects(self, recs) -> list:  # of BrokerObject (clients/client.py, which imports this module)
        """BrokerObjects for step-path records; a record the step cache hands out again
        (the same record object) gets the same BrokerObject, built and mapped once."""
        made = self._made
        out = []
        for r in recs:
            hit = made.get(r.object_id)
            if hit is not None and hit[0] is r:
                out.append(hit[1])
                continue
            obj = self._object(r)
            if len(made) >= _MADE_LIMIT:
                made.clear()
            made[r.object_id] = (r, obj)
            out.append(obj)
        return out

    def _lease(self, out: StepOutcome):
        if out.arena_slabs:
            self._ensure_slabs(out.arena_slabs)
        leased = [self._leased_step(aid, rec) for aid, rec in out.adapters]
        return AdapterLease(self, leased, out.deferred, out.txn_id, self.session_id)

    def _leased_step(self, aid: str, rec) -> LeasedAdapter:
        """The LeasedAdapter of a step-path record (the caller mapped the reply's slabs)."""
        cache = self._step_leased
        hit = cache.get(aid)
        if hit is not None and hit[0] is rec:
            # The step cache's own record again: the lease entry built from it stands.
            return hit[1]
        k = (aid, rec.generation, rec.object_id)
        la = cache.get(k)
        if la is None:
            # First sight of this placement: its pages read-only here, its layout fetched once.
            self._set_access(rec.pages, True)
            layout = self._layout_cache.get(aid)
            if layout is None:
                layout = layout_from_proto(self.adapter_layout(aid))
                self._layout_cache[aid] = layout
            la = cache[k] = LeasedAdapter(
                aid, rec.generation, rec.object_id, tuple(rec.pages), layout, _w.TIER_NAMES.get(rec.found_in, "hot")
            )
        if rec.found_in != _w.TIER_HOT:
            la = LeasedAdapter(aid, la.generation, la.object_id, la.pages, la.layout, _w.TIER_NAMES[rec.found_in])
        else:
            cache[aid] = (rec, la)
        return la

    def commit_acquire(self, transaction_id: int) -> None:
        """Keep a prepared adapter acquire's pins (``AdapterLease.commit``)."""
        st = self._step_path()
        if st is not None:
            st.raise_error(self._fast(st.send, [_w.Op(_w.OP_COMMIT, (transaction_id,))]))
            return
        self.commit([transaction_id])

    def abort_acquire(self, transaction_id: int) -> None:
        """Drop a prepared adapter acquire's pins (FAILED_PRECONDITION once committed)."""
        st = self._step_path()
        if st is not None:
            st.raise_error(self._fast(st.send, [_w.Op(_w.OP_ABORT, (transaction_id,))]))
            return
        self.abort([transaction_id])


class PendingStepLease:
    """A step sent by ``BrokerClient.step_begin``; ``result()`` returns its StepLease (once)."""

    def __init__(self, finish: Callable[[], StepLease]):
        self._finish = finish
        self._lease: StepLease | None = None

    def result(self) -> StepLease:
        if self._lease is None:
            self._lease = self._finish()
        return self._lease


class StepLease:
    """What one ``BrokerClient.step`` holds: an adapter lease (or None) and pinned objects."""

    def __init__(
        self,
        client,
        adapters,
        objects: list,
        adapter_ids: list[str] = (),
        keys: Sequence[bytes] = (),
        max_adapters: int = 0,
    ):
        self.client = client
        self.epoch = client.epoch
        # What the step asked for (a next step asking the same may take this one's holdings over).
        self._asked = (adapter_ids, keys, max_adapters)
        # The step cache whose references this lease holds, and for which parts
        # (adapters, objects); None when it holds broker pins of its own.
        self.cache = None
        self.cached = (False, False)
        # AdapterLease of the step's adapters, or None when it asked for none.
        self.adapters = adapters
        # The longest present prefix of the step's keys, pinned for this session.
        self.objects = objects
        self.released = False

    def same_as(self, adapter_ids: list[str], keys: Sequence[bytes], max_adapters: int) -> bool:
        """Whether a step asking for this would get exactly what this lease holds (all its
        keys were found; its adapters were acquired outright, not prepared)."""
        return (
            not self.released
            and self.epoch == self.client.epoch
            and self._asked[0] == adapter_ids
            and self._asked[2] == max_adapters
            and len(self.objects) == len(keys)
            and self._asked[1] == keys
            and (self.adapters is None or not self.adapters.transaction_id)
            and (self.adapters is not None) == bool(adapter_ids)
        )

    def release(self) -> None:
        """Release the adapters and unpin the objects (once)."""
        if self.released:
            return
        self.released = True
        if self.adapters is not None:
            self.adapters.release()
        if self.objects and self.epoch == self.client.epoch and not self.client.closed:
            self.client.unpin(self.objects)

    def __enter__(self) -> StepLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
