"""The core's records as protobuf messages: GetStats, the adapter figures, a registered adapter,
and the events a session's stream carries.

Pure translation for the service layer: each function takes what the core (the object store,
the adapter wing, the session events) already produced and builds the message; none of them
reads or changes broker state itself.
"""

from __future__ import annotations

from memory_broker.broker.adapters.peft import AdapterInfo
from memory_broker.broker.adapters.records import AdapterCorrupted
from memory_broker.broker.adapters.stats import AdapterStats
from memory_broker.broker.store.engine_pool import EngineKvReclaim
from memory_broker.broker.store.objects import ObjectsEvicted, TransactionsExpired
from memory_broker.broker.store.stats import StoreStats
from memory_broker.proto.wire.messages import TIERS
from memory_broker.proto.wire.v1 import broker_pb2 as pb


class ArenaGrown:
    """Core-side event: the arena has more slabs (broadcast to every session)."""

    __slots__ = ("num_slabs",)

    def __init__(self, num_slabs: int):
        self.num_slabs = num_slabs


class ShuttingDown:
    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def tier_stats_message(t: dict) -> pb.TierStats:
    """The tier's figures (``TierLink.stats``) as GetStats carries them."""
    return pb.TierStats(**{f.name: t[f.name] for f in pb.TierStats.DESCRIPTOR.fields})


def stats_message(
    st: StoreStats,
    backend: str,
    page_size: int,
    num_slabs: int,
    adapters: pb.AdapterStats | None,
    by_owner: list[pb.OwnerStats],
) -> pb.Stats:
    """GetStats' answer from one reading of the store (and the adapter figures, if enabled)."""
    return pb.Stats(
        backend=backend,
        page_size=page_size,
        num_slabs=num_slabs,
        max_pages=st.max_pages,
        capacity_pages=st.capacity_pages,
        free_pages=st.free_pages,
        used_pages=st.used_pages,
        prepared_pages=st.prepared_pages,
        pinned_pages=st.pinned_pages,
        evictable_pages=st.evictable_pages,
        utilization=st.utilization,
        high_watermark=st.high_watermark,
        low_watermark=st.low_watermark,
        eviction_active=st.eviction_active,
        eviction_runs=st.eviction_runs,
        evicted_objects=st.evicted_objects,
        evicted_pages=st.evicted_pages,
        objects=st.objects,
        keyed_objects=st.keyed_objects,
        sessions=st.sessions,
        open_transactions=st.open_transactions,
        by_content=[pb.ContentStats(content_type=ct, objects=n, pages=p) for ct, (n, p) in st.by_content.items()],
        window_free_pages=st.window_free_pages,
        window_free_extents=st.window_free_extents,
        window_largest_free=st.window_largest_free,
        window_fragmentation=st.window_fragmentation,
        allocations_total=st.allocations_total,
        deduplicated_total=st.deduplicated_total,
        allocation_failures=st.allocation_failures,
        adapters=adapters,
        by_owner=by_owner,
    )


def adapter_stats_message(a: AdapterStats) -> pb.AdapterStats:
    res, hits, loads, loaded, im = a.resident, a.hits, a.loads, a.bytes_loaded, a.images
    return pb.AdapterStats(
        registered=a.registered,
        hot=res.hot,
        warm=res.warm,
        cold=res.cold,
        hot_pages=a.hot_pages,
        warm_bytes=a.warm_bytes,
        found_hot=hits.hot,
        found_warm=hits.warm,
        found_cold=hits.cold,
        loads_hot=loads.hot,
        loads_warm=loads.warm,
        bytes_loaded_hot=loaded.hot,
        bytes_loaded_warm=loaded.warm,
        hit_rate=a.hit_rate,
        deferred=a.deferred,
        shared_loads=a.shared_loads,
        load_failures=a.load_failures,
        evictions=a.evictions,
        demotions=a.demotions,
        image_count=im.count,
        image_bytes=im.bytes,
        image_budget_bytes=im.budget_bytes,
        image_hits=im.hits,
        image_misses=im.misses,
        converted_ahead=im.converted_ahead,
        convert_queued=im.convert_queued,
    )


def adapter_message(info: AdapterInfo, resident, image_state: str) -> pb.Adapter:
    """A registered adapter (its one record, ``AdapterInfo``) plus where it is now
    (``resident``: the adapter wing's residency record, None when cold)."""
    st = resident
    return pb.Adapter(
        adapter_id=info.adapter_id,
        path=info.source,
        rank=info.rank,
        lora_alpha=info.lora_alpha,
        use_rslora=info.use_rslora,
        target_modules=list(info.target_modules),
        num_layers=info.num_layers,
        file_bytes=info.file_bytes,
        registered_at=info.registered_at,
        tier=TIERS[st.tier] if st is not None else pb.ADAPTER_TIER_COLD,
        generation=st.generation if st is not None else 0,
        pin_count=st.pin_count if st is not None else 0,
        num_pages=st.num_pages if st is not None else 0,
        image_state=pb.AdapterImageState.Value(f"ADAPTER_IMAGE_STATE_{image_state.upper()}"),
    )


def event_message(ev) -> pb.SessionEvent | None:
    """A core event as the session stream carries it (None: not for the stream)."""
    if isinstance(ev, ObjectsEvicted):
        return pb.SessionEvent(evicted=pb.ObjectsEvicted(object_ids=ev.object_ids, keys=ev.keys))
    if isinstance(ev, TransactionsExpired):
        return pb.SessionEvent(transactions_expired=pb.TransactionsExpired(transaction_ids=ev.transaction_ids))
    if isinstance(ev, ArenaGrown):
        return pb.SessionEvent(arena_grown=pb.ArenaGrown(num_slabs=ev.num_slabs))
    if isinstance(ev, ShuttingDown):
        return pb.SessionEvent(shutting_down=pb.ShuttingDown(reason=ev.reason))
    if isinstance(ev, EngineKvReclaim):
        return pb.SessionEvent(
            engine_kv_reclaim=pb.EngineKvReclaim(pages=ev.pages, deadline_unix_ms=int(ev.deadline_unix * 1000))
        )
    if isinstance(ev, AdapterCorrupted):
        return pb.SessionEvent(
            adapter_corrupted=pb.AdapterCorrupted(
                adapter_id=ev.adapter_id, object_id=ev.object_id, generation=ev.generation, detail=ev.detail
            )
        )
    return None
