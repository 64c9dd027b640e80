"""The step calls over the step channel: what an engine does every step, in one compact frame.

``ChannelCalls`` has the methods and results of ``grpc_calls.py``'s ``GrpcCalls`` (acquire and
release adapters, commit or abort an acquire, lookup, pin, unpin, ``step``, ``step_begin``, a
running batch's ``change``) and sends them over one session's ``StepPath`` (``path.py``).
``BrokerClient`` picks one of the two per session (``_step_calls``). The channel answers every
acquire itself (one that needs a load waits on the broker for it); only what the wire has no
field for (an acquire in another dtype or of a rank's shards) and a lookup or an acquire whose
channel broke (gRPC waits for the reconnect) go to the session's ``GrpcCalls``. Records become leases and objects through the
session's ``SessionRecords`` (``lease.py``), once per placement: later steps reuse them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from operator import attrgetter, itemgetter

from memory_broker.clients.step.delta import send_delta
from memory_broker.clients.step.grpc_calls import GrpcCalls
from memory_broker.clients.step.lease import PendingStepLease, StepLease
from memory_broker.clients.step.path import StepOutcome, StepPath, StepUnavailable
from memory_broker.clients.step.transport import raise_refused
from memory_broker.proto.wire import step as _w
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.layout import ModuleShard

log = logging.getLogger(__name__)

_OBJECT_ID = attrgetter("object_id")
_first, _second = itemgetter(0), itemgetter(1)


def not_answered() -> BrokerError:
    """An acquire answered "not hot" (a broker older than this client: it loads over gRPC only)."""
    return BrokerError(
        Code.FAILED_PRECONDITION,
        "the broker answered an acquire on its step channel without acquiring (a broker older than this "
        "client); upgrade the broker, or connect with fast_path=False",
    )


def _admitted(ids: list[str], max_adapters: int) -> tuple[list[str], list[str]]:
    """An acquire's distinct ids split at the cap: (admitted, deferred)."""
    distinct = list(dict.fromkeys(ids))
    n = max_adapters or len(distinct)
    return distinct[:n], distinct[n:]


def _frame_of_lookups(key_lists: list[list[bytes]], todo: list[int], most: int) -> list[int]:
    """The lists of ``todo`` (indices into ``key_lists``) that go in one frame of ``lookup_many``,
    at most ``most`` of them: past the first, no more once the frame's keys take half
    ``MAX_FRAME_BYTES``, or once its reply, were each key found with one page, would pass the
    broker's ``MAX_REPLY_RECORDS`` or ``MAX_REPLY_BYTES`` (``ReplyRoom``'s estimate)."""
    batch: list[int] = []
    size = records = reply = 0
    for i in todo[:most]:
        keys = key_lists[i]
        n, key_bytes = len(keys), sum(map(len, keys))
        grown = reply + _w.reply_estimate(n, n, key_bytes)
        if batch and (
            size >= _w.MAX_FRAME_BYTES // 2 or records + n > _w.MAX_REPLY_RECORDS or grown > _w.MAX_REPLY_BYTES
        ):
            break
        batch.append(i)
        size, records, reply = size + 8 + key_bytes + 2 * n, records + n, grown
    return batch


def _pairs(adapters: list) -> tuple[list, list]:
    """[(adapter id, record)] as (ids, records)."""
    return list(map(_first, adapters)), list(map(_second, adapters))


class ChannelCalls:
    """The step calls of one session over its step channel (``client``: a ``BrokerClient``),
    planned against its holdings cache (``hold_s``; without it, ``direct.DirectCalls``)."""

    def __init__(self, client, path: StepPath, grpc: GrpcCalls):
        self.client = client
        self.path = path
        # Where a call the channel cannot serve goes; its records are this session's.
        self.grpc = grpc
        self.records = grpc.records
        self.epoch = grpc.epoch
        # The transport's frames whose replies are unread (a deque: its truth says whether
        # ``settle`` has anything to read, without a call).
        self.unread = path.transport.unread_frames
        # Whether a give-back's frame is posted (its reply read later) or waited for
        # (``connect``'s ``post_give_backs``).
        self.posting: bool = client.post_give_backs
        # Whether a step batch's change may take the short lane (``delta.lane_begin``):
        # on a caching path (without one, ``DirectCalls``' own ``change``).
        self.lane: bool = path.caching

    def current(self, epoch: int) -> bool:
        """Whether these are the calls of session ``epoch`` still (and its channel is open)."""
        return self.epoch == epoch and not self.path.transport.closed

    def _fast(self, fn, *args, _or_none: bool = False, **kw):
        """A step-path call, its transport failures as UNAVAILABLE (as gRPC's are); with
        ``_or_none`` (``_fast_or_none``: a call that asks nothing of the old session), None
        instead, and the caller retries over gRPC, which waits for a reconnect."""
        try:
            return fn(*args, **kw)
        except (_w.WireError, StepUnavailable) as e:
            if _or_none and isinstance(e, StepUnavailable):
                return None
            raise self._error_of(e) from None

    def _fast_or_none(self, fn, *args, **kw):
        return self._fast(fn, *args, _or_none=True, **kw)

    def _error_of(self, e: _w.WireError | StepUnavailable) -> BrokerError:
        """What a step-channel call raises for ``e``: bad input (a frame that cannot be
        encoded) as INVALID_ARGUMENT, a channel that cannot be used as UNAVAILABLE."""
        if isinstance(e, _w.WireError):
            return BrokerError(Code.INVALID_ARGUMENT, str(e))
        return self._unavailable(e)

    def _unavailable(self, e: StepUnavailable) -> BrokerError:
        return BrokerError(
            Code.UNAVAILABLE, f"the broker at {self.client.socket_path} did not answer on its step channel ({e}); retry"
        )

    # ------------------------------------------------------------ adapters

    def acquire_adapters(
        self,
        adapter_ids: Sequence[str],
        max_adapters: int,
        prepare: bool,
        lease_s: float,
        dtype: str = "",
        shards: Sequence[ModuleShard] = (),
    ):
        if dtype or shards:  # the step channel acquires whole copies in the broker's dtype; others are gRPC's
            return self.grpc.acquire_adapters(adapter_ids, max_adapters, prepare, lease_s, dtype, shards)
        out = self._fast_or_none(
            self.path.step,
            adapter_ids,
            max_adapters=max_adapters,
            prepare=prepare,
            lease_ms=int(lease_s * 1000),
            lookup=False,
        )
        if out is None:  # the channel broke: gRPC waits for a reconnect
            return self.grpc.acquire_adapters(adapter_ids, max_adapters, prepare, lease_s)
        if not out.acquire_hot:
            raise not_answered()
        ids, recs = _pairs(out.adapters)
        return self.records.step_lease(ids, recs, out.deferred, out.txn_id, out.arena_slabs)

    def release_adapters(self, adapter_ids: Sequence[str], dtype: str = "") -> None:
        if dtype:
            self.grpc.release_adapters(adapter_ids, dtype)
            return
        self._giving(list(adapter_ids), ())

    def _giving(self, release: list[str], unpin: Sequence[int]) -> None:
        """``StepPath.give_back`` (its frame posted, unless ``posting`` is off); then the
        refusal of an earlier posted give-back, if one was read, is raised (as
        ``DirectCalls._give_back`` does: what this one gives back is given back first)."""
        path = self.path
        try:
            path.give_back(release, unpin, self.posting)
        except (_w.WireError, StepUnavailable) as e:
            raise self._error_of(e) from None
        if path.transport.refused:
            raise_refused(path.transport.refused)

    def _frame(self, ops: list, or_none: bool = False, check: bool = True) -> _w.StepReply | None:
        """One frame of ``ops`` (``Op``s or tuples of their fields) and its reply, its refusal
        raised (with ``check``; else the caller reads ``reply.error``): ``_fast`` around
        ``StepPath.send``, both inlined (the fixed cost of every frame of the generic calls
        and of a step without the cache; ``or_none``: None when the channel broke)."""
        path = self.path
        try:
            with path.lock:
                if path._pending is not None:
                    path._pending._collect()  # a step begun earlier: its reply first
                data = _w.encode_step(ops)
                path.frames += 1
                reply = path.transport.request(data)
        except (_w.WireError, StepUnavailable) as e:
            if or_none and isinstance(e, StepUnavailable):
                return None
            raise self._error_of(e) from None
        if check and reply.error is not None:
            raise reply.error
        return reply

    def commit_acquire(self, transaction_id: int) -> None:
        self._frame([(_w.OP_COMMIT, (transaction_id,))])

    def abort_acquire(self, transaction_id: int) -> None:
        # Waited for, not posted: its answer is what ``AdapterLease.release`` decides by (a
        # transaction committed meanwhile is refused FAILED_PRECONDITION, and then its
        # adapters are released instead), and a caller's own abort refused is raised to it.
        self._frame([(_w.OP_ABORT, (transaction_id,))])

    # ------------------------------------------------------------ objects

    def lookup(self, keys: Sequence[bytes], pin: bool) -> list:
        # A step channel that broke (the broker restarting) is not retried here: the gRPC
        # call waits for the new session and retries, as it always did.
        out = self._fast_or_none(self.path.step, keys=keys, acquire=False, pin_keys=pin)
        if out is not None:
            return self.records.objects(out.objects)
        return self.grpc.lookup(keys, pin)

    def lookup_many(self, key_lists: list[list[bytes]], pin: bool, unpin_ids: list[int]) -> list[list]:
        """``BrokerClient.lookup_many``: the unpin and every lookup in one frame (more only past
        ``MAX_OPS`` ops, half ``MAX_FRAME_BYTES``, or a reply the broker would refuse were each
        key found with one page: ``_frame_of_lookups``); with the holdings cache, its calls one
        by one. A frame whose reply the broker still finds too large (objects of more pages:
        RESOURCE_EXHAUSTED at one of its lookups) goes on from that lookup in the next frame."""
        if self.path.caching:  # the cache plans a step's one lookup: no frames of many here
            if unpin_ids:
                self.unpin(unpin_ids)
            return [self.lookup(k, pin) if k else [] for k in key_lists]
        out: list[list] = [[] for _ in key_lists]
        todo = [i for i, k in enumerate(key_lists) if k]
        ops = [_w.Op(_w.OP_UNPIN, tuple(unpin_ids))] if unpin_ids else []
        pinned: list[int] = []
        while ops or todo:
            batch = _frame_of_lookups(key_lists, todo, _w.MAX_OPS - len(ops))
            del todo[: len(batch)]
            ops += [_w.Op(_w.OP_LOOKUP, tuple(key_lists[i]), 1 if pin else 0) for i in batch]
            try:
                reply = self._fast(self.path.send, ops)
            except BrokerError:
                self._unpin_quietly(pinned)  # what earlier frames pinned
                raise
            base = len(ops) - len(batch)
            answered = reply.results[base:]
            for j, recs in enumerate(answered):
                out[batch[j]] = self.records.objects(recs)
                pinned += [r.object_id for r in recs] if pin else []
            ops = []
            error = reply.error
            if error is not None:
                if error.code == Code.RESOURCE_EXHAUSTED and reply.failed_index >= base and (answered or base):
                    todo[:0] = batch[len(answered) :]  # this frame's reply was full: on in the next
                    continue
                self._unpin_quietly(pinned)  # nothing the caller sees stays pinned
                raise error
        return out

    def _unpin_quietly(self, ids: list[int]) -> None:
        """Unpin what a failed ``lookup_many`` pinned: posted (``posting``), its refusal only
        logged (nobody asked for this unpin: the caller gets the lookup's error), or waited."""
        if not ids:
            return
        try:
            if self.posting:
                self.path.post([(_w.OP_UNPIN, tuple(ids))], own=0)
            else:
                self._frame([(_w.OP_UNPIN, tuple(ids))], True)
        except (BrokerError, StepUnavailable) as e:
            log.debug("unpinning after a failed lookup: %s", e)

    def pin(self, ids: list[int]) -> list:
        st = self.path
        make = self.client._read_objects
        if st.caching:
            held = st.held.ref_pins(ids)
            if held is not None:
                return make(held)
        reply = self._frame([(_w.OP_PIN, tuple(ids))])
        recs = reply.results[0]
        if st.caching:
            st.held.add_pins(recs)
        return make(recs)

    def unpin(self, ids: list[int]) -> None:
        self._giving([], ids)

    def forget_pins(self, ids: Sequence[int]) -> None:
        """Objects this session freed: their pins went with them at the broker."""
        if self.path.caching:
            self.path.held.forget_pins(ids)

    def flush(self) -> int:
        """Release every idle holding now (posted, unless ``posting`` is off: a refusal is
        raised by the next give-back or ``client.flush()``); returns how many."""
        n = self._fast(self.path.flush, self.posting)
        if self.path.transport.refused:
            raise_refused(self.path.transport.refused)
        return n

    # ------------------------------------------------------------ steps

    def step(self, ids: list[str], keys: list[bytes], max_adapters, prepare, lease_s, commit, release) -> StepLease:
        """``BrokerClient.step``: at most one frame (none when the cache has every adapter and
        there are no keys)."""
        st = self.path
        same = self._take_over(st, release, ids, keys, max_adapters, prepare, commit)
        if same is not None:
            return same
        out = self._step_frame(st, st.step, ids, keys, max_adapters, prepare, lease_s, commit, release)
        return self._step_lease(out, ids, max_adapters, prepare, lease_s, keys, st)

    def step_begin(self, ids, keys, max_adapters, prepare, lease_s, commit, release) -> PendingStepLease:
        """The frame goes out now; ``result()`` reads the reply."""
        st = self.path
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
        """The steady state: a step asking for the adapters ``release`` holds, and no keys,
        takes it over (the cache's references pass from one lease to the next; nothing to
        tell the broker). A step with keys looks them up: a key may name another object now."""
        if (
            release is None
            or not st.caching
            or keys
            or prepare
            or commit is not None
            or not release.same_as(ids, keys, max_adapters)
            or st.sweep_due()
        ):
            return None
        release.released = True
        sl = StepLease(self.client, release.adapters, release.objects, ids, keys, max_adapters)
        sl.cache, sl.cached = release.cache, release.cached
        return sl

    def _giving_back(self, release: StepLease | None, st: StepPath) -> tuple[list[str], tuple, bool]:
        """What a step gives back of a previous step's lease: (adapter ids, object ids,
        whether its adapters hold references of ``st``'s cache, which can pass over)."""
        rel_ids: list[str] = []
        unpins: tuple = ()
        carry = False
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
                unpins = tuple(map(_OBJECT_ID, release.objects))
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
        records = self.records
        objs = records.objects(out.objects) if out.objects is not None else []
        if not ids:
            lease = None
        elif out.acquire_hot:
            lease = records.step_lease(*_pairs(out.adapters), out.deferred, out.txn_id, out.arena_slabs)
        else:
            if objs:
                self.client.unpin(objs)
            raise not_answered()
        sl = StepLease(self.client, lease, objs, ids, list(keys), max_adapters)
        if st is not None and st.caching:
            # What this lease holds are references of st's cache (adapters: unless they are
            # prepared): a next step may carry its adapters over.
            sl.cache = st
            sl.cached = bool(ids) and out.acquire_hot and not prepare
        return sl

    def change(self, new_ids: list[str], rel: list[str], new_keys: list[bytes], unpin: list[int]):
        """A running batch's change (``StepBatch``): its frame (if any) goes out now
        (``delta.send_delta`` called directly, its failures mapped by ``_error_of`` as
        ``_fast`` maps them: one layer fewer on a path a background batch runs cold every step)."""
        try:
            return _ChannelChange(self, send_delta(self.path, new_ids, rel, new_keys, unpin))
        except (_w.WireError, StepUnavailable) as e:
            raise self._error_of(e) from None

    def give_back(self, rel: list[str], unpin: list[int]) -> None:
        """A batch's end: release and unpin what it holds (one frame)."""
        if rel or unpin:
            self._giving(rel, unpin)

    def settle(self) -> None:
        """Read every unread reply of the channel (a call over another channel first does:
        what was posted before it has run). A channel that breaks meanwhile has reported
        its unanswered give-backs (``StepTransport.refused``); nothing is raised here."""
        if self.path.transport.unread():
            try:
                self.path.settle()
            except StepUnavailable as e:
                log.debug("the step channel broke while its replies were read: %s", e)

    def close(self) -> None:
        """Read what is unread (posted give-backs: a refusal is logged), then close; a
        session that ended (a reconnect replaced it) took its pins with it: nothing to read."""
        if not self.path.transport.closed and self.epoch == self.client.epoch:
            self.settle()
        self.path.transport.close()


class _ChannelChange:
    """A batch change sent on the step channel: ``collect()`` reads its reply (a background
    batch's worker does that before the session's other calls may go), ``result()`` makes
    leases and objects of it."""

    __slots__ = ("_calls", "_pending", "sent", "_got")

    def __init__(self, calls: ChannelCalls, pending):
        self._calls = calls
        self._pending = pending
        # Whether a frame went out (False: the cache had all of it).
        self.sent: bool = pending.sent
        self._got = None

    def collect(self) -> None:
        if self._got is None:
            try:
                self._got = self._pending.result()
            except (_w.WireError, StepUnavailable) as e:
                raise self._calls._error_of(e) from None

    def result(self):
        """(the new adapters as [(id, LeasedAdapter)], or None when one needs a load: acquire
        them yourself; the found prefix's objects; round trips)."""
        got = self._got
        if got is None:
            self.collect()
            got = self._got
        recs, objs, slabs = got
        calls = self._calls
        client = calls.client
        if slabs and client.view.mapped_slabs < slabs:
            client._ensure_slabs(slabs)
        records = calls.records
        leased = None if recs is None else [(aid, records.leased_step(aid, rec)) for aid, rec in recs]
        return leased, (records.objects(objs) if objs else []), 1 if self.sent else 0
