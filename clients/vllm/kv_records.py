"""The KV connector's records: its stats (what vLLM aggregates and reports), the per-step
metadata the scheduler hands the workers, and the scheduler's per-request state.

Plain data in vLLM's connector types; ``kv_connector.py`` (``MemoryBrokerConnector``) fills
and reads them. Nothing here talks to the broker or touches KV tensors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from memory_broker.clients.vllm import check_vllm_version

check_vllm_version()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # noqa: E402

# Counters reported through vLLM's connector stats (summed over workers and the scheduler).
STAT_NAMES = (
    "lookups",  # requests looked up in the broker
    "hit_tokens",  # tokens the broker held for them (what vLLM will not compute)
    "tier_hit_tokens",  # of those, tokens its tier past the host held (loaded asynchronously)
    "loaded_blocks",  # blocks copied from the broker into vLLM's cache
    "stored_blocks",  # blocks committed by this engine
    "deduplicated_blocks",  # blocks another engine committed first (pages given back)
    "store_skipped_blocks",  # blocks not stored (broker away or full)
    "load_failed_blocks",  # blocks reported to vLLM for recompute
    "broker_errors",  # failed broker calls
)


# The worker's saver thread counts too (kv_saver.py): one lock for every stats object (a
# lock cannot travel with the stats vLLM sends between processes).
_STATS_LOCK = threading.Lock()


@dataclass
class BrokerKVStats(KVConnectorStats):
    """Counters since the last report; ``reduce`` gives the sums."""

    def __post_init__(self):
        for k in STAT_NAMES:
            self.data.setdefault(k, 0)

    def add(self, name: str, n: int = 1) -> None:
        with _STATS_LOCK:
            self.data[name] = self.data.get(name, 0) + n

    def reset(self):
        self.data = {k: 0 for k in STAT_NAMES}

    def take(self) -> BrokerKVStats | None:
        """A copy of the counters, zeroed here; None when all are zero."""
        with _STATS_LOCK:
            if self.is_empty():
                return None
            out = BrokerKVStats(data=dict(self.data))
            self.reset()
        return out

    def aggregate(self, other: KVConnectorStats) -> BrokerKVStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class LoadRequest:
    """Blocks of one request to copy into vLLM's cache this step."""

    req_id: str
    block_ids: list[int]
    # Per block, per tensor-parallel rank: (key, object id, pages) as the scheduler pinned it.
    objects: list[list[tuple[bytes, int, list[int]]]]
    # The scheduler's session that pinned them (see BrokerKV.client_for).
    incarnation: str = ""
    # Blocks of the request the broker no longer held when the step pinned them: the worker
    # reports them to vLLM, which recomputes them.
    failed_block_ids: list[int] = field(default_factory=list)
    # An asynchronous load (blocks read in from the broker's tier): the worker reports the
    # request's receive finished (``get_finished``) whether or not every block loaded.
    tier: bool = False


@dataclass
class SaveRequest:
    req_id: str
    block_ids: list[int]
    chain_hashes: list[bytes]


@dataclass
class BrokerKVMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[SaveRequest] = field(default_factory=list)
    # The engine pool (engine_pool.py): groups the worker maps ("map", slot, pages) and unmaps
    # ("unmap", slot), in order, before this step; the broker's arena slabs those pages need.
    pool_ops: list[tuple] = field(default_factory=list)
    pool_slabs: int = 0


@dataclass
class BrokerKVWorkerMetadata(KVConnectorWorkerMetadata):
    # Requests whose loads finished this step (their pins may go).
    loaded: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> BrokerKVWorkerMetadata:
        if isinstance(other, BrokerKVWorkerMetadata):
            self.loaded |= other.loaded
        return self


@dataclass
class _ReqState:
    chain: list[bytes]
    prompt_len: int
    # Pins held for the request: per rank, the objects the lookup returned, from block pin_first.
    pinned: list[list[Any]] = field(default_factory=list)
    pin_first: int = 0
    incarnation: str = ""
    # Per rank, the session (of that rank's broker) that pinned ``pinned[rank]``.
    incarnations: list[str] = field(default_factory=list)
    hit_blocks: int = 0
    local_tokens: int = 0
    # Block range to load at the request's first schedule, [start, end).
    load: tuple[int, int] | None = None
    # Of ``load``, the blocks pinned on every rank (from its start) when the step pinned them.
    load_ok: int = 0
    # First prompt block not known to be in the broker.
    next_save: int = 0
    # Blocks after the broker's hits that its tier held at the lookup (an asynchronous load).
    tier_blocks: int = 0
    # When the request began waiting on the tier (monotonic seconds; 0: not waiting), and
    # when the tier is asked about it next.
    tier_since: float = 0.0
    tier_next: float = 0.0
    # The tier was asked for this request and answered (it is not asked again: a load that
    # failed is recomputed, never retried).
    tier_tried: bool = False
