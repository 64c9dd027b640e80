"""What the adapter wing hands its callers: tiers, acquire and prefetch results, an adapter's
status, checksum findings and the corruption event.

Plain frozen records: built by the manager and its parts, read by the service and tests;
they hold no references back into the wing and change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from memory_broker.broker.adapters.layout import AdapterLayout
from memory_broker.proto.wire.errors import BrokerError


class Tier(str, Enum):
    HOT = "hot"
    WARM = "warm"
    COLD = "cold"


@dataclass(frozen=True, slots=True)
class AcquiredAdapter:
    """One adapter pinned for the calling session."""

    adapter_id: str
    # Increases every time the adapter is placed anew (after an eviction and reload), and is
    # never reused by another placement of any adapter: clients cache offset tables by it.
    generation: int
    # The hot object (release goes through the manager, by adapter id).
    object_id: int
    # Physical pages of the object, in layout page order.
    pages: tuple[int, ...]
    # Placement within those pages (when asked for with_layout).
    layout: AdapterLayout | None
    # Where the adapter was found: HOT is a hit.
    found_in: Tier


@dataclass(frozen=True, slots=True)
class AcquireResult:
    # Admitted adapters, in request order (duplicates in the request appear once).
    adapters: tuple[AcquiredAdapter, ...]
    # Ids over ``max_adapters``, in request order: not loaded, not pinned; ask again later.
    deferred: tuple[str, ...]
    # Two-phase acquires: the store transaction holding the pins, and its lease's end.
    txn_id: int = 0
    deadline_unix: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    # Adapter id -> the tier it now is in (at least the one asked for).
    loaded: dict[str, Tier]
    # Adapter id -> why it could not be brought up (e.g. RESOURCE_EXHAUSTED).
    failed: dict[str, BrokerError]


@dataclass(frozen=True, slots=True)
class AdapterStatus:
    adapter_id: str
    tier: Tier
    generation: int
    object_id: int
    pages: tuple[int, ...]
    # Pins on the hot object (acquires of every session), 0 when not hot.
    pin_count: int
    # Pages the adapter takes when hot, and bytes of its warm image (0 when not warm).
    num_pages: int
    warm_bytes: int
    loading: bool


@dataclass(frozen=True, slots=True)
class AdapterCorrupted:
    """Core event for each session that pins a hot copy found corrupt (sent on its stream)."""

    adapter_id: str
    object_id: int
    generation: int
    detail: str


@dataclass(frozen=True, slots=True)
class AdapterCheck:
    """What one checksum check of an adapter found."""

    adapter_id: str
    # The copy checked: HOT (its pages), WARM (its host image) or COLD (its image file).
    tier: Tier
    # False when there was nothing to check (cold without an image file, or replaced meanwhile).
    checked: bool
    # False: the copy did not match and was dropped (the next acquire reloads it).
    ok: bool
    # What the copy must hash to ("sha256:<hex>"), "" when unknown.
    checksum: str
    detail: str
