"""What the step calls hand out: leases and objects made from records, and a step's lease.

``SessionRecords`` is the one place where one session's records become what the caller holds:
a gRPC ``pb.AcquiredAdapter`` or a step channel's ``AcquiredRecord`` becomes a
``LeasedAdapter`` (its pages made read-only here, its layout fetched once per adapter), and a
step channel's ``ObjectRecord`` a ``BrokerObject`` (through ``BrokerClient._object``, as a gRPC
``ObjectInfo`` does). A record handed out again (the same record object: the step cache's, or
the step transport's decoder's for the same bytes, ``ReplyDecoder``) gets what was built from
it before, so a step that gets back what an earlier one got builds nothing.
Both calls objects of a session (``grpc_calls.py``, ``channel.py``) share one.

``StepLease`` is what one ``BrokerClient.step`` holds; ``PendingStepLease`` one sent by
``step_begin``.
"""

from __future__ import annotations

from collections.abc import Callable

from memory_broker.clients.step.adapters import AdapterLease, LeasedAdapter
from memory_broker.proto.wire import step as _w
from memory_broker.proto.wire.layout import parse_shards
from memory_broker.proto.wire.messages import TIER_NAMES, layout_from_proto
from memory_broker.proto.wire.v1 import broker_pb2 as pb


class SessionRecords:
    """Records of one session made into leases and objects (``client``: a ``BrokerClient``)."""

    def __init__(self, client):
        self.client = client
        self.epoch = client.epoch
        # (adapter id, generation, object id) -> LeasedAdapter, and adapter id -> (the step
        # cache's record, its LeasedAdapter).
        self._leased: dict = {}
        # The arena view a step's lease last made sure of, and its slabs mapped then (a
        # step whose reply says no more needs no look at the view).
        self._view = None
        self._mapped = 0
        # What was built from a step record is kept on the record (``made``: an object
        # record's BrokerObject, a hot adapter record's LeasedAdapter). The step transport's
        # decoder (one per session's channel, as this) hands out the record it made before for
        # the same bytes, so a step that gets back what an earlier one got finds everything
        # in one pass of C (``map`` of an attribute getter); what it built lives as long as the
        # decoder's memo or the step cache keeps the record.

    def objects(self, recs) -> list:
        """BrokerObjects for step records; the same record object gets the same BrokerObject."""
        # (Comprehensions: their attribute loads specialize to the slot; a getter's do not,
        # and cost twice as much.)
        out = [r.made for r in recs]
        if all(out):  # truth in C (no __eq__ of an object per item, as ``None in`` would call)
            return out
        if not any(out):  # none built yet (a running batch's fresh keys): all together
            return self._fresh(recs)
        new = [(i, r) for i, (r, o) in enumerate(zip(recs, out)) if o is None]
        # Built together: one mapping check and one page-access change for all of them.
        for (i, r), obj in zip(new, self.client._read_objects([r for _, r in new])):
            r.made = out[i] = obj
        return out

    def _fresh(self, recs) -> list:
        """BrokerObjects for records nothing was built from yet, kept on them (``made``): the
        client's ``_read_objects``, which builds them together (one mapping check, one
        page-access change)."""
        out = self.client._read_objects(recs)
        for r, obj in zip(recs, out):
            r.made = obj
        return out

    def step_lease(
        self, ids: list[str], out: _w.AcquireOutcome, deferred, arena_slabs: int, dtype: str = "", shard: str = ""
    ) -> AdapterLease:
        """The lease of a step channel's acquire ``out``: adapter ``ids[i]`` has its record
        ``i`` (copies in ``dtype`` of the shards ``shard``, where the acquire asked for those)."""
        recs, layouts = out.adapters, out.layouts or [b""] * len(out.adapters)
        client = self.client
        if arena_slabs > self._mapped or client.view is not self._view:
            client._ensure_slabs(arena_slabs)
            self._view, self._mapped = client.view, arena_slabs
        # A hot record's LeasedAdapter, checked against the ids (records in another order, or
        # under other ids, are not taken for the leases they made).
        leased = [r.made for r in recs]
        if not all(leased) or [la.adapter_id for la in leased] != ids:
            leased = [self.leased_step(a, rec, dtype, shard, raw) for a, rec, raw in zip(ids, recs, layouts)]
            for rec, la in zip(recs, leased):
                if rec.found_in == _w.TIER_HOT:
                    rec.made = la
        return AdapterLease(client, leased, deferred, out.txn_id, client.session_id, dtype)

    def leased_step(self, aid: str, rec, dtype: str = "", shard: str = "", layout: bytes = b"") -> LeasedAdapter:
        """The LeasedAdapter of a step channel's record (the caller mapped the reply's slabs),
        with its ``layout`` where the reply carried one (an ``AdapterLayout`` message)."""
        cache = self._leased
        hit = cache.get(aid)
        if hit is not None and hit[0] is rec:
            # The step cache's own record again: the lease entry built from it stands.
            return hit[1]
        k = (aid, rec.generation, rec.object_id)
        la = cache.get(k)
        if la is None:
            # First sight of this placement: its pages read-only here, its layout fetched once
            # (a load's reply brings it).
            self.client._set_access(rec.pages, True)
            if layout:
                got = layout_from_proto(pb.AdapterLayout.FromString(layout))
                self.client._layout_cache[aid + _suffix(dtype, shard)] = (rec.generation, got)
            la = cache[k] = LeasedAdapter(
                aid,
                rec.generation,
                rec.object_id,
                tuple(rec.pages),
                self.layout(aid, rec.generation, dtype, shard),
                "hot",  # what it is from now on; this record's own tier is said below
            )
        if rec.found_in != _w.TIER_HOT:
            la = LeasedAdapter(aid, la.generation, la.object_id, la.pages, la.layout, _w.TIER_NAMES[rec.found_in])
        else:
            cache[aid] = (rec, la)
        return la

    def grpc_lease(self, resp, dtype: str = "", shard: str = "") -> AdapterLease:
        """The lease of a gRPC ``AcquireAdaptersResponse`` (its adapters asked in ``dtype``, of
        the tensor-parallel shards ``shard``)."""
        client = self.client
        leased = [self.leased_grpc(a, dtype, shard) for a in resp.adapters]
        return AdapterLease(client, leased, resp.deferred, resp.transaction_id, client.session_id, dtype)

    def leased_grpc(self, a, dtype: str = "", shard: str = "") -> LeasedAdapter:
        """A gRPC-acquired adapter mapped read-only here, with its layout (cached per adapter id and
        asked dtype and shards)."""
        client = self.client
        client._ensure_slabs(a.arena_slabs)
        # Shared weights: read-only in this mapping before anyone here can touch them.
        client._set_access(a.pages, True)
        if a.HasField("layout"):
            client._layout_cache[a.adapter_id + _suffix(dtype, shard)] = (a.generation, layout_from_proto(a.layout))
        layout = self.layout(a.adapter_id, a.generation, dtype, shard)
        return LeasedAdapter(a.adapter_id, a.generation, a.object_id, tuple(a.pages), layout, TIER_NAMES[a.found_in])

    def layout(self, aid: str, generation: int, dtype: str = "", shard: str = ""):
        """An adapter's layout of ``generation`` (its copy's in ``dtype`` of the shards ``shard``):
        cached per adapter id (and asked dtype and shards) with the generation it came with,
        else asked for (once per generation: an id unregistered and registered again, by any
        process, names another adapter, maybe of other ranks)."""
        client = self.client
        suffix = _suffix(dtype, shard)
        hit = client._layout_cache.get(aid + suffix)
        if hit is not None and hit[0] == generation:
            return hit[1]
        # Not seen yet, another generation, or the cache was cleared under the request (a reconnect).
        # (The lease held meanwhile keeps the id from being unregistered: it is this one's.)
        layout = layout_from_proto(client.adapter_layout(aid, dtype, parse_shards(shard)))
        client._layout_cache[aid + suffix] = (generation, layout)
        return layout


def _suffix(dtype: str, shard: str) -> str:
    """The layout cache's key suffix of a copy asked in ``dtype``, of the shards ``shard``."""
    return (f"#{dtype}" if dtype else "") + (f"#{shard}" if shard else "")


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

    def __init__(self, client, adapters, objects: list):
        self.client = client
        self.epoch = client.epoch
        # AdapterLease of the step's adapters, or None when it asked for none.
        self.adapters = adapters
        # The longest present prefix of the step's keys, pinned for this session.
        self.objects = objects
        self.released = False

    def release(self) -> None:
        """Release the adapters and unpin the objects (once)."""
        if self.released:
            return
        self.released = True
        try:
            if self.adapters is not None:
                self.adapters.release()
        finally:
            # Even when the release raised (refused): the pins go back too.
            if self.objects and self.epoch == self.client.epoch and not self.client.closed:
                self.client.unpin(self.objects)

    def __enter__(self) -> StepLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
