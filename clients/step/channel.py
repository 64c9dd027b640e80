"""The step calls over the step channel: what an engine does every step, in one compact frame.

``ChannelCalls`` has the methods and results of ``grpc_calls.py``'s ``GrpcCalls`` (acquire and
release adapters, commit or abort an acquire, lookup, pin, unpin, ``step``, ``step_begin``, a
running batch's ``change``) and sends them over one session's ``StepPath`` (``path.py``), a
frame a call. ``calls.choose_calls`` picks one of the two per session. The channel answers
every call itself (an acquire that needs a load or a conversion waits on the broker for it). A
lookup or an acquire whose channel broke is sent once more on the next session's calls, after
the client's reconnect, as gRPC's retry does (``_again``); every other call whose channel broke
raises UNAVAILABLE.
Ops are tuples of an ``Op``'s fields (the native encoder takes them as they are). Records
become leases and objects through the session's ``SessionRecords`` (``lease.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from memory_broker.clients.step.delta import send_delta
from memory_broker.clients.step.grpc_calls import GrpcCalls
from memory_broker.clients.step.lease import PendingStepLease, StepLease
from memory_broker.clients.step.path import StepPath, StepUnavailable, not_answered
from memory_broker.proto.wire import step as _w
from memory_broker.proto.wire.errors import BrokerError, Code, invalid
from memory_broker.proto.wire.layout import ModuleShard, shards_text

log = logging.getLogger(__name__)

_RELEASE, _UNPIN, _COMMIT, _ACQUIRE, _LOOKUP = _w.OP_RELEASE, _w.OP_UNPIN, _w.OP_COMMIT, _w.OP_ACQUIRE, _w.OP_LOOKUP


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


class ChannelCalls:
    """The step calls of one session over its step channel (``client``: a ``BrokerClient``)."""

    def __init__(self, client, path: StepPath, grpc: GrpcCalls):
        self.client = client
        self.path = path
        # The session's records (shared with its gRPC calls, which a reconnect may bring).
        self.records = grpc.records
        self.epoch = grpc.epoch
        # The transport's frames whose replies are unread (a deque: its truth says whether
        # ``settle`` has anything to read, without a call).
        self.unread = path.transport.unread_frames
        # The last acquire's ids (a copy), its cap and their split (admitted, deferred): the
        # lists are shared by the leases made from them and never changed.
        self._split: tuple[list[str], int, tuple[list[str], list[str]]] = ([], -1, ([], []))

    def current(self, epoch: int) -> bool:
        """Whether these are the calls of session ``epoch`` still (and its channel is open)."""
        return self.epoch == epoch and not self.path.transport.closed

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

    def _frame(self, ops: list, or_none: bool = False, check: bool = True) -> _w.StepReply | None:
        """One frame of ``ops`` and its reply, its refusal raised (with ``check``; else the
        caller reads ``reply.error``); ``or_none``: None when the channel broke."""
        try:
            reply = self.path.send(ops)
        except (_w.WireError, StepUnavailable) as e:
            if or_none and isinstance(e, StepUnavailable):
                return None
            raise self._error_of(e) from None
        if check and reply.error is not None:
            raise reply.error
        return reply

    def _again(self, name: str, *args):
        """A lookup or acquire whose step channel broke, sent once more on the next session's
        calls when the client has reconnected (within its ``timeout``; no session's pins are
        named in either, so nothing is done twice); UNAVAILABLE when no new session opens."""
        client = self.client
        deadline = time.monotonic() + client.timeout
        while client.reconnect_s > 0 and time.monotonic() < deadline and not client.closed and not client._end_reason:
            if client.epoch != self.epoch and client._live.is_set():
                return getattr(client._step_calls(), name)(*args)
            time.sleep(0.02)
        raise self._unavailable(StepUnavailable("no new session opened after the channel broke"))

    def _admitted(self, ids: list[str], cap: int) -> tuple[list[str], list[str]]:
        """``_admitted(ids, cap)``, the last call's when it asked the same."""
        last, last_cap, split = self._split
        if cap == last_cap and ids == last:
            return split
        split = _admitted(ids, cap)
        self._split = (list(ids), cap, split)
        return split

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
        if isinstance(adapter_ids, str):
            raise invalid("adapter_ids must be a list of adapter ids, not one string")
        # (The caller's list as it is: it is encoded now, and ``_admitted`` keeps a copy.)
        ids = adapter_ids if type(adapter_ids) is list else list(adapter_ids)
        flags, lease_ms, shard = _w.ACQUIRE_PREPARE if prepare else 0, int(lease_s * 1000), shards_text(shards)
        if dtype or shard:  # copies in another dtype or of a rank's shards
            op = (_ACQUIRE, ids, flags | _w.ACQUIRE_SHAPED, max_adapters, lease_ms, dtype, shard)
        else:
            op = (_ACQUIRE, ids, flags, max_adapters, lease_ms)
        reply = self._frame([op], True)
        if reply is None:
            return self._again("acquire_adapters", adapter_ids, max_adapters, prepare, lease_s, dtype, shards)
        r: _w.AcquireOutcome = reply.results[0]
        if not r.hot:
            raise not_answered()
        admitted, deferred = self._admitted(ids, max_adapters)
        return self.records.step_lease(admitted, r, deferred, reply.arena_slabs, dtype, shard)

    def release_adapters(self, adapter_ids: Sequence[str], dtype: str = "") -> None:
        if adapter_ids:
            ids = tuple(adapter_ids)
            self._give_back([(_w.OP_RELEASE_IN, ids, 0, 0, 0, dtype) if dtype else (_RELEASE, ids)])

    def commit_acquire(self, transaction_id: int) -> None:
        self._frame([(_COMMIT, (transaction_id,))])

    def abort_acquire(self, transaction_id: int) -> None:
        # Its answer is what ``AdapterLease.release`` decides by (a transaction committed
        # meanwhile is refused FAILED_PRECONDITION, and then its adapters are released
        # instead), and a caller's own abort refused is raised to it.
        self._frame([(_w.OP_ABORT, (transaction_id,))])

    # ------------------------------------------------------------ objects

    def lookup(self, keys: Sequence[bytes], pin: bool) -> list:
        if not keys:
            return []
        reply = self._frame([(_LOOKUP, tuple(keys), 1 if pin else 0)], True)
        if reply is None:  # the channel broke (the broker restarting)
            return self._again("lookup", keys, pin)
        return self.records.objects(reply.results[0])

    def lookup_many(self, key_lists: list[list[bytes]], pin: bool, unpin_ids: list[int]) -> list[list]:
        """``BrokerClient.lookup_many``: the unpin and every lookup in one frame (more only past
        ``MAX_OPS`` ops, half ``MAX_FRAME_BYTES``, or a reply the broker would refuse were each
        key found with one page: ``_frame_of_lookups``). A frame whose reply the broker still
        finds too large (objects of more pages: RESOURCE_EXHAUSTED at one of its lookups)
        goes on from that lookup in the next frame."""
        out: list[list] = [[] for _ in key_lists]
        todo = [i for i, k in enumerate(key_lists) if k]
        ops = [(_UNPIN, tuple(unpin_ids))] if unpin_ids else []
        pinned: list[int] = []
        while ops or todo:
            batch = _frame_of_lookups(key_lists, todo, _w.MAX_OPS - len(ops))
            del todo[: len(batch)]
            ops += [(_LOOKUP, tuple(key_lists[i]), 1 if pin else 0) for i in batch]
            try:
                reply = self._frame(ops, check=False)
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
        """Unpin what a failed ``lookup_many`` pinned, its refusal only logged (nobody asked
        for this unpin: the caller gets the lookup's error)."""
        if not ids:
            return
        try:
            self._frame([(_UNPIN, tuple(ids))], True)
        except BrokerError as e:
            log.warning("unpinning after a failed lookup was refused: %s", e)

    def pin(self, ids: list[int]) -> list:
        reply = self._frame([(_w.OP_PIN, tuple(ids))])
        return self.client._read_objects(reply.results[0])

    def unpin(self, ids: list[int]) -> None:
        if ids:
            self._give_back([(_UNPIN, tuple(ids))])

    def _give_back(self, ops: list) -> None:
        """Give-backs (releases, unpins) in a frame of their own, waited for: a refusal is
        raised here, the broker's, after the ops before it ran."""
        self._frame(ops)

    # ------------------------------------------------------------ steps

    def step(self, ids, keys, max_adapters, prepare, lease_s, commit, release) -> StepLease:
        """``BrokerClient.step``: its ops straight into one frame (what ``release`` gives back,
        ``commit``, the acquire, the lookup), the reply made into the lease here. The one step
        every engine makes per batch: its fixed cost is this."""
        ops, acq = self._step_ops(ids, keys, max_adapters, prepare, lease_s, commit, release)
        if not ops:
            return StepLease(self.client, None, [])
        reply = self._frame(ops, check=False)
        return self._step_lease_of(reply, acq, len(ops), ids, keys, max_adapters)

    def step_begin(self, ids, keys, max_adapters, prepare, lease_s, commit, release) -> PendingStepLease:
        """``step``'s frame sent now; ``result()`` reads the reply (if nothing read it before
        the session's next frame) and makes it into the lease."""
        ops, acq = self._step_ops(ids, keys, max_adapters, prepare, lease_s, commit, release)
        if not ops:
            return PendingStepLease(lambda: StepLease(self.client, None, []))
        try:
            sent = self.path.begin(ops)
        except (_w.WireError, StepUnavailable) as e:
            raise self._error_of(e) from None

        def finish() -> StepLease:
            try:
                reply = sent.reply()
            except StepUnavailable as e:
                raise self._unavailable(e) from None
            return self._step_lease_of(reply, acq, len(ops), ids, keys, max_adapters)

        return PendingStepLease(finish)

    def _step_ops(self, ids, keys, max_adapters, prepare, lease_s, commit, release) -> tuple[list[tuple], int]:
        """A step's ops (what ``release`` gives back, ``commit``, the acquire, the lookup) and
        the acquire's index among them."""
        ops: list[tuple] = []
        if release is not None and not release.released:
            release.released = True
            if release.epoch == self.epoch:
                prev = release.adapters
                if prev is not None and not prev.released:
                    if prev.transaction_id:
                        prev.release()  # a prepared lease: abort it, or release it once committed
                    else:
                        prev.released = True
                        if prev.adapters:
                            ops.append((_RELEASE, [a.adapter_id for a in prev.adapters]))
                if release.objects:
                    ops.append((_UNPIN, [o.object_id for o in release.objects]))
        if commit is not None and commit.transaction_id:
            ops.append((_COMMIT, (commit.transaction_id,)))
        acq = len(ops)
        if ids:
            ops.append((_ACQUIRE, ids, _w.ACQUIRE_PREPARE if prepare else 0, max_adapters, int(lease_s * 1000)))
        if keys:
            ops.append((_LOOKUP, keys, 1))
        return ops, acq

    def _step_lease_of(self, reply: _w.StepReply, acq: int, nops: int, ids, keys, max_adapters) -> StepLease:
        """The StepLease of a step's reply (``acq``: its acquire's index of its ``nops`` ops);
        its refusal raised, after what its acquire took is given back."""
        results = reply.results
        r = results[acq] if ids and acq < len(results) else None
        if reply.error is not None:
            if r is not None and r.hot:
                # A later op failed: what the acquire took goes back (the caller gets the error).
                self.path.undo_acquire(self._admitted(ids, max_adapters)[0], r)
            raise reply.error
        if len(results) != nops:
            raise BrokerError(Code.INTERNAL, f"the step channel answered {len(results)} ops of {nops}")
        objs = self.records.objects(results[-1]) if keys else []
        if not ids:
            lease = None
        elif r.hot:
            admitted, deferred = self._admitted(ids, max_adapters)
            got = r.adapters
            if len(got) < len(admitted):  # a record per admitted id, in order
                raise BrokerError(Code.INTERNAL, f"the step channel acquired {len(got)} of {len(admitted)} adapters")
            lease = self.records.step_lease(admitted, r, deferred, reply.arena_slabs)
        else:
            if objs:
                self.client.unpin(objs)
            raise not_answered()
        return StepLease(self.client, lease, objs)

    # ------------------------------------------------------------ a running batch

    def change(self, new_ids: list[str], rel: list[str], new_keys: list[bytes], unpin: list[int]):
        """A running batch's change (``StepBatch``): its frame (if any) goes out now."""
        try:
            return _ChannelChange(self, send_delta(self.path, new_ids, rel, new_keys, unpin))
        except (_w.WireError, StepUnavailable) as e:
            raise self._error_of(e) from None

    def give_back(self, rel: list[str], unpin: list[int]) -> None:
        """A batch's end: release and unpin what it holds (one frame)."""
        ops = []
        if rel:
            ops.append((_RELEASE, tuple(rel)))
        if unpin:
            ops.append((_UNPIN, tuple(unpin)))
        if ops:
            self._give_back(ops)

    def settle(self) -> None:
        """Read a begun step's reply now (a call over another channel first does: the broker
        has then run it), kept for its ``result()``."""
        if self.path.transport.unread():
            try:
                self.path.settle()
            except StepUnavailable as e:
                log.debug("the step channel broke while a reply was read: %s", e)

    def close(self) -> None:
        """Read what is unread (a begun step's reply), then close; a session that ended (a
        reconnect replaced it) took its pins with it: nothing to read."""
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
