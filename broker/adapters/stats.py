"""The adapter wing's figures: running counters, and the typed record ``stats()`` returns.

``AdapterCounters`` is bumped by the manager's parts as things happen; ``AdapterStats`` is
a snapshot built from the counters, the settings and ``TierFigures`` (what the tiers hold,
read by the manager from its parts), read by the service (GetStats), the metrics and tests.
Records only: building one changes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Generic, TypeVar

from memory_broker.broker.adapters.config import AdapterConfig

T = TypeVar("T")


@dataclass(slots=True)
class AdapterCounters:
    acquires: int = 0
    acquired_adapters: int = 0
    deferred: int = 0
    # Per admitted adapter of an acquire: found hot, or not; when not, found warm or not.
    hot_hits: int = 0
    hot_misses: int = 0
    warm_hits: int = 0
    warm_misses: int = 0
    # Acquires that joined a load already in flight instead of starting one.
    shared_loads: int = 0
    loads_hot: int = 0
    loads_warm: int = 0
    bytes_loaded_hot: int = 0
    bytes_loaded_warm: int = 0
    seconds_hot: float = 0.0
    seconds_warm: float = 0.0
    load_failures: int = 0
    # Hot adapters freed to fit the hot budget / evicted by the store; warm images dropped.
    demotions: int = 0
    evictions: int = 0
    warm_drops: int = 0
    unregistered: int = 0
    # The converted-image cache: cold loads served from an image / built from the file with
    # the cache on; images found unusable (stale, corrupt, short); images written; failed writes.
    image_hits: int = 0
    image_misses: int = 0
    image_rejects: int = 0
    image_writes: int = 0
    image_write_failures: int = 0
    # Conversions ahead of use: images written; adapters passed over (image already there,
    # no room in the image budget, or already loading); failures (logged, the load retries).
    converted_ahead: int = 0
    convert_skipped: int = 0
    convert_failures: int = 0
    # Checksum checks of resident copies (hot, warm, image files) and the corrupt ones found.
    verifications: int = 0
    corruptions: int = 0


@dataclass(frozen=True, slots=True)
class ByTier:
    """One count per tier."""

    hot: int
    warm: int
    cold: int


@dataclass(frozen=True, slots=True)
class HotWarm(Generic[T]):
    """One figure for each of the two resident tiers."""

    hot: T
    warm: T


@dataclass(frozen=True, slots=True)
class ImageStats:
    """The converted-image cache and conversion ahead of use."""

    enabled: bool
    # Cold loads served from an image / built from the file; images refused; writes.
    hits: int
    misses: int
    rejected: int
    writes: int
    write_failures: int
    # Images on disk now, their bytes, the budget (0: no limit), images pushed out for room.
    count: int
    bytes: int
    budget_bytes: int
    evictions: int
    converted_ahead: int
    convert_skipped: int
    convert_failures: int
    # Adapters waiting for conversion ahead of use (the one converting included).
    convert_queued: int


@dataclass(frozen=True, slots=True)
class ChecksumStats:
    verifications: int
    corruptions: int
    # Image files found corrupt by the cache (on load or check).
    image_corruptions: int
    # Hot copies found corrupt that sessions still pin.
    retired_copies: int
    interval_s: float


@dataclass(frozen=True, slots=True)
class AdapterStats:
    """A snapshot of the adapter wing (``AdapterManager.stats``)."""

    registered: int
    resident: ByTier
    hot_pages: int
    hot_bytes: int
    # Bytes of the hot pages that hold weights (the rest is page tails and row padding).
    hot_used_bytes: int
    # Hot adapters some client session pins.
    hot_pinned_adapters: int
    loading_pages: int
    warm_bytes: int
    hot_tier_pages: int
    hot_tier_adapters: int
    warm_tier_bytes: int
    # Where admitted adapters were found: hot (a hit), warm, or cold (files).
    hits: ByTier
    misses: HotWarm[int]
    loads: HotWarm[int]
    bytes_loaded: HotWarm[int]
    load_seconds: HotWarm[float]
    hit_rate: float
    warm_hit_rate: float
    acquires: int
    acquired_adapters: int
    deferred: int
    shared_loads: int
    load_failures: int
    demotions: int
    evictions: int
    warm_drops: int
    unregistered: int
    images: ImageStats
    policies: HotWarm[str]
    checksums: ChecksumStats

    def as_dict(self) -> dict:
        """The same figures as nested plain dicts (for logs, JSON and tests)."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class CacheFigures:
    """The converted-image cache now: images on disk, their bytes, images pushed out for room,
    image files found corrupt."""

    count: int
    bytes: int
    evictions: int
    corrupt: int


@dataclass(frozen=True, slots=True)
class TierFigures:
    """What the tiers hold at one instant, read from the wing's parts for ``snapshot``."""

    registered: int
    hot_adapters: int
    warm_adapters: int
    # Adapters hot or warm (or both).
    resident_adapters: int
    hot_pages: int
    hot_bytes: int
    hot_used_bytes: int
    # Hot adapters some client session pins.
    hot_pinned_adapters: int
    loading_pages: int
    warm_bytes: int
    policies: HotWarm[str]
    # None: the image cache is off.
    cache: CacheFigures | None
    # Adapters waiting for conversion ahead of use (the one converting included).
    convert_queued: int
    # Hot copies found corrupt that sessions still pin.
    retired_copies: int


def snapshot(c: AdapterCounters, cfg: AdapterConfig, t: TierFigures) -> AdapterStats:
    """The wing's figures from its counters, its settings and what its tiers hold now."""
    lookups = c.hot_hits + c.hot_misses
    warm_lookups = c.warm_hits + c.warm_misses
    cache = t.cache
    return AdapterStats(
        registered=t.registered,
        resident=ByTier(t.hot_adapters, t.warm_adapters, max(0, t.registered - t.resident_adapters)),
        hot_pages=t.hot_pages,
        hot_bytes=t.hot_bytes,
        hot_used_bytes=t.hot_used_bytes,
        hot_pinned_adapters=t.hot_pinned_adapters,
        loading_pages=t.loading_pages,
        warm_bytes=t.warm_bytes,
        hot_tier_pages=cfg.hot_tier_pages,
        hot_tier_adapters=cfg.hot_tier_adapters,
        warm_tier_bytes=cfg.warm_tier_bytes,
        hits=ByTier(c.hot_hits, c.warm_hits, c.warm_misses),
        misses=HotWarm(c.hot_misses, c.warm_misses),
        loads=HotWarm(c.loads_hot, c.loads_warm),
        bytes_loaded=HotWarm(c.bytes_loaded_hot, c.bytes_loaded_warm),
        load_seconds=HotWarm(c.seconds_hot, c.seconds_warm),
        hit_rate=c.hot_hits / lookups if lookups else 0.0,
        warm_hit_rate=c.warm_hits / warm_lookups if warm_lookups else 0.0,
        acquires=c.acquires,
        acquired_adapters=c.acquired_adapters,
        deferred=c.deferred,
        shared_loads=c.shared_loads,
        load_failures=c.load_failures,
        demotions=c.demotions,
        evictions=c.evictions,
        warm_drops=c.warm_drops,
        unregistered=c.unregistered,
        images=ImageStats(
            enabled=cache is not None,
            hits=c.image_hits,
            misses=c.image_misses,
            rejected=c.image_rejects,
            writes=c.image_writes,
            write_failures=c.image_write_failures,
            count=cache.count if cache else 0,
            bytes=cache.bytes if cache else 0,
            budget_bytes=cfg.image_budget,
            evictions=cache.evictions if cache else 0,
            converted_ahead=c.converted_ahead,
            convert_skipped=c.convert_skipped,
            convert_failures=c.convert_failures,
            convert_queued=t.convert_queued,
        ),
        policies=t.policies,
        checksums=ChecksumStats(
            verifications=c.verifications,
            corruptions=c.corruptions,
            image_corruptions=cache.corrupt if cache else 0,
            retired_copies=t.retired_copies,
            interval_s=cfg.verify_interval_s,
        ),
    )


def tier_figures(m) -> TierFigures:
    """What an ``AdapterManager``'s (``m``) tiers hold now. Reads only: an adapter evicted
    without notice counts as not hot here, and is demoted the next time a writer looks at it."""
    entries, hot, sys = m.entries.values(), m.hot.live(), m.system_session
    warm = [e.adapter_id for e in entries if e.warm is not None]
    hot_pages = sum(e.obj.num_pages for e in hot)
    cache = m.image_service.cache
    return TierFigures(
        registered=len(m.registry),
        hot_adapters=len(hot),
        warm_adapters=len(warm),
        resident_adapters=len({*(e.adapter_id for e in hot), *warm}),
        hot_pages=hot_pages,
        hot_bytes=hot_pages * m.ctx.page_size,
        hot_used_bytes=sum(e.layout.used_bytes for e in hot),
        hot_pinned_adapters=sum(1 for e in hot if any(s != sys for s in e.obj.pins)),
        loading_pages=m.hot.loading_pages,
        warm_bytes=m.warm.bytes,
        policies=HotWarm(m.hot.policy.name, m.warm.policy.name),
        cache=CacheFigures(cache.count, cache.used_bytes, cache.evictions, cache.corrupt) if cache else None,
        convert_queued=m.image_service.queued,
        retired_copies=m.checker.retired_copies,
    )
