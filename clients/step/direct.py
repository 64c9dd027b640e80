"""The step channel's calls without the holdings cache (``hold_s`` 0, the default): each call is
one frame of its own items, sent straight (no plan against a cache there is not).

``DirectCalls`` is ``ChannelCalls`` (``channel.py``) for such a session: ``calls.choose_calls`` picks
it. Its calls are the engine's every step (``step``: what the previous step gives back, a
commit, the acquire and the lookup in one frame; or the generic calls, a frame each), so their
fixed cost per frame is what this module is about: ops are tuples (the native encoder takes
them as they are), the frame goes out and its reply comes back in one call of the transport
(one native decode), and an engine asking for the same batch again finds its split at the
cap (admitted, deferred) from the last call.
"""

from __future__ import annotations

from collections.abc import Sequence

from memory_broker.clients.step.channel import ChannelCalls, _admitted, not_answered
from memory_broker.clients.step.lease import PendingStepLease, StepLease
from memory_broker.clients.step.path import StepUnavailable
from memory_broker.clients.step.transport import raise_refused
from memory_broker.proto.wire import step as _w
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.layout import ModuleShard

_RELEASE, _UNPIN, _COMMIT, _ACQUIRE, _LOOKUP = _w.OP_RELEASE, _w.OP_UNPIN, _w.OP_COMMIT, _w.OP_ACQUIRE, _w.OP_LOOKUP


class DirectCalls(ChannelCalls):
    """The step calls of one session over its step channel, without the holdings cache."""

    def __init__(self, client, path, grpc):
        super().__init__(client, path, grpc)
        # The last acquire's ids (a copy), its cap and their split (admitted, deferred): the
        # lists are shared by the leases made from them and never changed.
        self._split: tuple[list[str], int, tuple[list[str], list[str]]] = ([], -1, ([], []))

    def _admitted(self, ids: list[str], cap: int) -> tuple[list[str], list[str]]:
        """``_admitted(ids, cap)``, the last call's when it asked the same."""
        last, last_cap, split = self._split
        if cap == last_cap and ids == last:
            return split
        split = _admitted(ids, cap)
        self._split = (list(ids), cap, split)
        return split

    # ------------------------------------------------------------ the generic calls

    def acquire_adapters(
        self,
        adapter_ids: Sequence[str],
        max_adapters: int,
        prepare: bool,
        lease_s: float,
        dtype: str = "",
        shards: Sequence[ModuleShard] = (),
    ):
        # The step channel acquires whole copies in the broker's dtype (loading them if need
        # be); others are gRPC's, as is an acquire whose channel broke (gRPC waits for a reconnect).
        if not (dtype or shards) and not isinstance(adapter_ids, str):  # gRPC refuses a str, saying why
            # (The caller's list as it is: it is encoded now, and ``_admitted`` keeps a copy.)
            ids = adapter_ids if type(adapter_ids) is list else list(adapter_ids)
            op = (_ACQUIRE, ids, _w.ACQUIRE_PREPARE if prepare else 0, max_adapters, int(lease_s * 1000))
            reply = self._frame([op], True)
            if reply is not None:
                r: _w.AcquireOutcome = reply.results[0]
                if not r.hot:
                    raise not_answered()
                admitted, deferred = self._admitted(ids, max_adapters)
                return self.records.step_lease(admitted, r.adapters, deferred, r.txn_id, reply.arena_slabs)
        return self.grpc.acquire_adapters(adapter_ids, max_adapters, prepare, lease_s, dtype, shards)

    def release_adapters(self, adapter_ids: Sequence[str], dtype: str = "") -> None:
        if dtype:
            self.grpc.release_adapters(adapter_ids, dtype)
        elif adapter_ids:
            self._give_back((_RELEASE, tuple(adapter_ids)))

    def lookup(self, keys: Sequence[bytes], pin: bool) -> list:
        if not keys:
            return []
        reply = self._frame([(_LOOKUP, tuple(keys), 1 if pin else 0)], True)
        if reply is not None:
            return self.records.objects(reply.results[0])
        # A step channel that broke (the broker restarting) is not retried here: the gRPC
        # call waits for the new session and retries, as it always did.
        return self.grpc.lookup(keys, pin)

    def unpin(self, ids: list[int]) -> None:
        if ids:
            self._give_back((_UNPIN, ids))

    def _give_back(self, op: tuple) -> None:
        """A give-back (a release or an unpin) in a frame of its own: posted (``StepPath.post``:
        sent, its reply read later; ``connect``'s ``post_give_backs``), or sent and waited for.
        Bad input is refused here, before anything is sent. Then the refusal of an earlier
        posted give-back, if one was read, is raised (this one's frame went out)."""
        if not self.posting:
            self._frame([op])
            return
        path = self.path
        try:
            path.post([op])
        except (_w.WireError, StepUnavailable) as e:
            raise self._error_of(e) from None
        if path.transport.refused:
            raise_refused(path.transport.refused)

    # ------------------------------------------------------------ steps

    def step(self, ids, keys, max_adapters, prepare, lease_s, commit, release) -> StepLease:
        """``BrokerClient.step``: its ops straight into one frame (what ``release`` gives back,
        ``commit``, the acquire, the lookup), the reply made into the lease here. The one step
        every engine makes per batch: its fixed cost is this."""
        ops, acq = self._step_ops(ids, keys, max_adapters, prepare, lease_s, commit, release)
        if not ops:
            return StepLease(self.client, None, [], ids, keys, max_adapters)
        reply = self._frame(ops, check=False)
        return self._step_lease_of(reply, acq, len(ops), ids, keys, max_adapters, prepare, lease_s)

    def step_begin(self, ids, keys, max_adapters, prepare, lease_s, commit, release) -> PendingStepLease:
        """``step``'s frame sent now; ``result()`` reads the reply (if nothing read it before
        the session's next frame) and makes it into the lease."""
        ops, acq = self._step_ops(ids, keys, max_adapters, prepare, lease_s, commit, release)
        if not ops:
            return PendingStepLease(lambda: StepLease(self.client, None, [], ids, keys, max_adapters))
        sent = _SentStep(self.path)
        try:
            sent.send(ops)
        except (_w.WireError, StepUnavailable) as e:
            raise self._error_of(e) from None

        def finish() -> StepLease:
            try:
                reply = sent.reply()
            except StepUnavailable as e:
                raise self._unavailable(e) from None
            return self._step_lease_of(reply, acq, len(ops), ids, keys, max_adapters, prepare, lease_s)

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

    def _step_lease_of(
        self, reply: _w.StepReply, acq: int, nops: int, ids, keys, max_adapters, prepare, lease_s
    ) -> StepLease:
        """The StepLease of a step's reply (``acq``: its acquire's index of its ``nops`` ops);
        its refusal raised, after what its acquire took is given back."""
        results = reply.results
        r = results[acq] if ids and acq < len(results) else None
        if reply.error is not None:
            if r is not None and r.hot:
                # A later op failed: what the acquire took goes back (the caller gets the error).
                self.path._undo_acquire(self._admitted(ids, max_adapters)[0], r)
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
            lease = self.records.step_lease(admitted, got, deferred, r.txn_id, reply.arena_slabs)
        else:
            if objs:
                self.client.unpin(objs)
            raise not_answered()
        return StepLease(self.client, lease, objs, ids, keys, max_adapters)


class _SentStep:
    """A frame ``DirectCalls.step_begin`` sent: its reply read once, by ``reply()`` or before
    the session's next frame (``StepPath``'s ``_pending``, whose ``_collect`` this has)."""

    __slots__ = ("_path", "_reply", "_error", "_done")

    def __init__(self, path):
        self._path = path
        self._reply: _w.StepReply | None = None
        self._error: BaseException | None = None
        self._done = False

    def send(self, ops: list[tuple]) -> None:
        path = self._path
        with path.lock:
            if path._pending is not None:
                path._pending._collect()
            data = _w.encode_step(ops)
            path.frames += 1
            path.transport.send(data)
            path._pending = self

    def _collect(self) -> None:
        """Read the reply off the socket (the path's lock is held)."""
        self._path._pending = None
        self._done = True
        try:
            self._reply = self._path.transport.reply()
        except BaseException as e:
            self._error = e

    def reply(self) -> _w.StepReply:
        with self._path.lock:
            if not self._done:
                self._collect()
        if self._error is not None:
            raise self._error
        return self._reply
