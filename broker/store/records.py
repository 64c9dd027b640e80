"""The object store's records: allocation and transaction states, the request ``Spec``, the
per-object, per-transaction and per-session records, the events sent to sessions, the
store's configuration and its read-only limits.

Plain data with no behaviour beyond validation, plus ``Recent`` (the bounded memory of recent
ids): the store (``objects.py``) and its parts change these records; nothing here touches
pages, the policy or gRPC.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum

from memory_broker.broker.store.eviction import STORE_CORE, ContentType
from memory_broker.broker.store.shards import ShardedSet
from memory_broker.proto.wire import native

# One allocation request, shared with the client (a positional Spec means the same on both sides).

VALID_CONTENT = frozenset(int(c) for c in ContentType)
# int -> ContentType without the enum constructor's cost on the hot path.
CONTENT_BY_NUMBER = {int(c): c for c in ContentType}


class ObjectState(IntEnum):
    """Numbers match broker.v1.ObjectState."""

    PREPARED = 1
    COMMITTED = 2


class TxnState(IntEnum):
    OPEN = 1
    COMMITTED = 2
    ABORTED = 3
    EXPIRED = 4


@dataclass(slots=True, eq=False)
class Allocation:
    # Unique for the broker's lifetime, starting at 1.
    object_id: int
    # Owning session id; 0 once the owner is gone (keyed objects outlive their owner).
    owner: int
    content_type: ContentType
    # Content key, or None.
    key: bytes | None
    # Physical pages in order.
    pages: list[int]
    # First window page of a contiguous object, or -1.
    window_page: int
    state: ObjectState
    # len(pages): read on every policy update, so stored rather than computed.
    num_pages: int
    # Open transaction holding the object while PREPARED, else 0.
    txn_id: int = 0
    # Pin counts per session id; pin_count is their sum.
    pins: dict[int, int] = field(default_factory=dict)
    pin_count: int = 0
    # Freed by its owner while other sessions pinned it: pages return with the last pin.
    freed: bool = False
    # Digest of its bytes taken after its transaction committed ("blake2b:<hex>"), "" if none
    # (memory_pool.kv_digest; broker/store/digests.py).
    digest: str = ""
    # The pool its pages come from: 0 the shared pool, 1.. a tenant's (ARCHITECTURE.md, "Pools").
    pool: int = 0
    # Its step-channel reply record's fixed parts (id and window page; pages and key), made
    # when first sent (proto/wire/step.py, encode_allocations): its id, pages and key never change.
    wire_head: bytes | None = field(default=None, repr=False)
    wire_tail: bytes | None = field(default=None, repr=False)
    # The number of the eviction queue segment it is in while a candidate, else None
    # (eviction.ObjectQueue).
    queue_seg: int | None = field(default=None, repr=False)


@dataclass(slots=True, eq=False)
class Transaction:
    txn_id: int
    session: int
    # Monotonic-clock deadline of the lease.
    deadline: float
    # Wall-clock deadline, for clients.
    deadline_unix: float
    objects: list[Allocation]
    # Per prepared object: pin it when committing.
    pin_on_commit: list[bool]
    # Object ids pinned at prepare (one pin each).
    pinned: list[int]
    state: TxnState = TxnState.OPEN
    # After commit: (object, deduplicated) per prepared object.
    result: list[tuple[Allocation, bool]] = field(default_factory=list)


@dataclass(slots=True)
class SessionState:
    session_id: int
    # Objects the session owns (may free).
    owned: ShardedSet = field(default_factory=ShardedSet)
    # Pins the session holds: object id -> count (mirrors Allocation.pins).
    pins: dict[int, int] = field(default_factory=dict)
    # Open transactions.
    txns: set[int] = field(default_factory=set)
    # Sum of ``pins`` (checked against max_pins_per_session).
    pin_total: int = 0
    # Its pool: 0 the shared pool, 1.. a tenant's; UNASSIGNED until the broker knows the
    # session's process (with tenant pools only: such a session can do nothing yet).
    pool: int = 0


# ``SessionState.pool`` of a session not yet placed in a pool.
UNASSIGNED = -1


@dataclass(frozen=True, slots=True)
class ObjectsEvicted:
    object_ids: list[int]
    keys: list[bytes]


@dataclass(frozen=True, slots=True)
class TransactionsExpired:
    transaction_ids: list[int]


@dataclass(slots=True)
class StoreConfig:
    # Start evicting when used/max crosses high; stop at low (hysteresis).
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    # Lease of a prepared transaction when the request gives none, and the most allowed.
    default_lease_s: float = 30.0
    max_lease_s: float = 600.0
    max_key_bytes: int = 1024
    # Most pins one session may hold at once (0 = no limit).
    max_pins_per_session: int = 0
    # Most items in one batch.
    max_batch: int = 65536
    # How many finished transactions (for idempotent commit/abort) and gone objects
    # (for "was evicted" messages) are remembered.
    remember: int = 65536

    def validate(self) -> None:
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(
                f"watermarks must satisfy 0 < low <= high <= 1; got low={self.low_watermark}, "
                f"high={self.high_watermark}"
            )
        if not 0 < self.default_lease_s <= self.max_lease_s:
            raise ValueError("default_lease_s must be positive and at most max_lease_s")


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """The limits a caller of the store checks against (read-only; ``reconfigure`` replaces it)."""

    # Longest lease a prepared transaction may ask for.
    max_lease_s: float
    # Most items in one batch.
    max_batch: int
    # Lease when a request gives none.
    default_lease_s: float
    # Most pins one session may hold at once (0 = no limit).
    max_pins_per_session: int

    @classmethod
    def of(cls, config: StoreConfig) -> StoreLimits:
        return cls(config.max_lease_s, config.max_batch, config.default_lease_s, config.max_pins_per_session)


class Recent:
    """The last ``remember * 7/8 .. remember`` entries added (by weight: ``add``), for
    messages and idempotent retries.

    Eight plain dicts of ``remember/8`` entries: new entries go to the newest; when it is full
    the oldest dict is dropped whole. Unlike trimming an OrderedDict entry by entry, nothing
    here rebuilds a table of ``remember`` entries inside one call (that rebuild stalled a call
    for milliseconds every few ten thousand drops), and one drop frees only 1/8 of them.

    An entry may weigh more than one (``add``): a generation is full when its entries' weights
    reach ``remember/8``, so what is kept is bounded by weight (e.g. a finished transaction's
    objects), not only by the number of entries: at most ``remember`` plus, per generation,
    the weight of its last entry.
    """

    __slots__ = ("part", "gens", "weight")

    def __init__(self, remember: int, generations: int = 8):
        self.part = max(1, remember // generations)
        self.gens: deque[dict] = deque([{}], maxlen=generations)
        # The newest generation's weight.
        self.weight = 0

    def __setitem__(self, key, value) -> None:
        self.add(key, value, 1)

    def add(self, key, value, weight: int) -> None:
        """Remember ``key`` -> ``value``, weighing ``weight`` (at least 1)."""
        self.gens[-1][key] = value
        self.weight += weight
        if self.weight >= self.part:
            self.gens.append({})  # the deque drops the oldest generation
            self.weight = 0

    def get(self, key, default=None):
        for g in reversed(self.gens):
            v = g.get(key, self)
            if v is not self:
                return v
        return default

    def __len__(self) -> int:
        return sum(len(g) for g in self.gens)


def store_core():
    """The store's native core, or None (not built, or ``MEMORY_BROKER_NATIVE=0``): the
    store's parts then run their Python loops.

    Each part asks once, when it is made, so a store keeps the path it started with."""
    return native.load(STORE_CORE)


def pages_at(fraction: float, max_pages: int) -> int:
    """Pages at a watermark; the epsilon keeps 0.57 * 100 at 57, not 56.99... -> 56."""
    return int(fraction * max_pages + 1e-9)
