"""The step calls over gRPC: one RPC per call, for a session without a usable step channel.

``GrpcCalls`` has the methods and results of ``channel.py``'s ``ChannelCalls`` (acquire and
release adapters, commit or abort an acquire, lookup, pin, unpin, ``step``, ``step_begin``, a
running batch's ``change``), so ``BrokerClient`` picks one of the two per session and never
asks which it has: a session has these when it has no step channel (``fast_path=False``, the
channel's connection cap, a broker without one). Records become leases and objects through the
session's ``SessionRecords`` (``lease.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from memory_broker.clients.step.lease import PendingStepLease, SessionRecords, StepLease
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.layout import ModuleShard, shards_text
from memory_broker.proto.wire.messages import shard_msg
from memory_broker.proto.wire.v1 import broker_pb2 as pb


class GrpcCalls:
    """The step calls of one session over gRPC (``client``: a ``BrokerClient``)."""

    # No step channel: nothing to count frames on.
    path = None

    # Frames whose replies are unread (``ChannelCalls.unread``): none without a channel.
    unread = ()

    def __init__(self, client, records: SessionRecords):
        self.client = client
        self.records = records
        self.epoch = records.epoch

    def current(self, epoch: int) -> bool:
        """Whether these are the calls of session ``epoch`` still."""
        return self.epoch == epoch

    def _rpc(self, name: str, request, retry: bool = False):
        client = self.client
        return client._call(getattr(client._stub, name), request, retry=retry)

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
        layouts = self.client._layout_cache
        shard = shards_text(shards)
        req = pb.AcquireAdaptersRequest(
            adapter_ids=list(adapter_ids),
            max_adapters=max_adapters,
            with_layout=bool(dtype or shard) or any(aid not in layouts for aid in adapter_ids),
            prepare=prepare,
            lease_ms=int(lease_s * 1000),
            dtype=dtype,
            shards=[shard_msg(s) for s in shards],
        )
        resp = self._rpc("AcquireAdapters", req, retry=True)
        lease = self.records.grpc_lease(resp, dtype, shard)
        wrong = [a.adapter_id for a in lease.adapters if dtype and a.layout.dtype != dtype]
        if wrong:
            got = lease[wrong[0]].layout.dtype
            lease.dtype = ""  # the broker ignored the dtype: it pinned its own copies
            lease.release()
            raise BrokerError(
                Code.FAILED_PRECONDITION,
                f"asked for adapters {wrong} in {dtype}; the broker at {self.client.socket_path} returned them in "
                f"{got} (a broker older than copies per dtype): upgrade it, or start it with --adapter-dtype {dtype}",
            )
        whole = [a.adapter_id for a in resp.adapters if a.layout.shard != shard]
        if whole:
            lease.release()
            raise BrokerError(
                Code.FAILED_PRECONDITION,
                f"asked for adapters {whole} as tensor-parallel shards {shard}; the broker at "
                f"{self.client.socket_path} returned other copies (a broker older than sharded copies): upgrade it",
            )
        return lease

    def release_adapters(self, adapter_ids: Sequence[str], dtype: str = "") -> None:
        self._rpc("ReleaseAdapters", pb.ReleaseAdaptersRequest(adapter_ids=list(adapter_ids), dtype=dtype))

    def commit_acquire(self, transaction_id: int) -> None:
        self.client.commit([transaction_id])

    def abort_acquire(self, transaction_id: int) -> None:
        self.client.abort([transaction_id])

    # ------------------------------------------------------------ objects

    def lookup(self, keys: Sequence[bytes], pin: bool) -> list:
        resp = self._rpc("Lookup", pb.LookupRequest(keys=list(keys), pin=pin), retry=True)
        return self.client._read_objects(resp.objects)

    def lookup_many(self, key_lists: list[list[bytes]], pin: bool, unpin_ids: list[int]) -> list[list]:
        """``BrokerClient.lookup_many``: an Unpin and a Lookup per list (gRPC has no batch of
        them); a refused lookup has the earlier ones' pins given back, as on the step channel."""
        if unpin_ids:
            self.unpin(unpin_ids)
        out: list[list] = []
        try:
            for k in key_lists:
                out.append(self.lookup(k, pin) if k else [])
        except BrokerError:
            pinned = [o.object_id for g in out for o in g] if pin else []
            if pinned:
                try:
                    self.unpin(pinned)
                except BrokerError:  # the caller gets the lookup's error
                    pass
            raise
        return out

    def pin(self, ids: list[int]) -> list:
        resp = self._rpc("Pin", pb.PinRequest(object_ids=ids))
        return self.client._read_objects(resp.objects)

    def unpin(self, ids: list[int]) -> None:
        self._rpc("Unpin", pb.UnpinRequest(object_ids=ids))

    def settle(self) -> None:
        """Nothing is begun over gRPC: every call waited for its answer."""

    # ------------------------------------------------------------ steps

    def step(self, ids: list[str], keys: list[bytes], max_adapters, prepare, lease_s, commit, release) -> StepLease:
        """``BrokerClient.step`` as the calls it stands for."""
        if release is not None:
            release.release()
        if commit is not None:
            commit.commit()
        client = self.client
        lease = self.acquire_adapters(ids, max_adapters, prepare, lease_s) if ids else None
        objs = self.lookup(keys, True) if keys else []
        return StepLease(client, lease, objs)

    def step_begin(self, ids, keys, max_adapters, prepare, lease_s, commit, release) -> PendingStepLease:
        """Nothing goes out until ``result()``, which makes the calls."""
        return PendingStepLease(lambda: self.step(ids, keys, max_adapters, prepare, lease_s, commit, release))

    def change(self, new_ids: list[str], rel: list[str], new_keys: list[bytes], unpin: list[int]):
        """A running batch's change (``StepBatch``): the calls are made by ``result()``; its
        adapters come back None (the batch acquires them under leases of their own)."""
        return _GrpcChange(self, new_keys, rel, unpin)

    def give_back(self, rel: list[str], unpin: list[int]) -> None:
        """A batch's end: release and unpin what it holds."""
        if rel:
            self.release_adapters(rel)
        if unpin:
            self.unpin(unpin)

    def close(self) -> None:
        """Nothing of its own to close (the session's gRPC channel is the client's)."""


class _GrpcChange:
    """A batch change over gRPC: nothing is sent before ``result()`` (``sent`` False)."""

    sent = False

    def __init__(self, calls: GrpcCalls, keys, rel, unpin):
        self._calls, self._keys, self._rel, self._unpin = calls, keys, rel, unpin

    def collect(self) -> None:
        """Nothing was sent: nothing to read."""

    def result(self):
        """(None: acquire the new adapters yourself, the found prefix's objects, round trips 0)."""
        calls = self._calls
        calls.give_back(self._rel, self._unpin)
        return None, (calls.lookup(self._keys, True) if self._keys else []), 0
