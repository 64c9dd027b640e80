"""What the adapter wing's parts share: one record the manager builds and hands to each part.

Every part of the wing (the hot and warm budgets, the image service, the loader, the checksum
checker, the pins) works on the same store and system session, reads the same configuration,
bumps the same counters, logs to the same logger, runs its blocking work in the same executor
and looks adapters up in the same entry table. ``AdapterContext`` carries those; a part's
constructor takes it and, besides it, only the other parts it calls.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from memory_broker.broker.adapters.config import AdapterConfig
from memory_broker.broker.adapters.entry import AdapterEntry, EntryTable, split_key
from memory_broker.broker.adapters.layout import DTYPE_SIZES, AdapterLayout, parse_shards, plan_layout, shard_specs
from memory_broker.broker.adapters.peft import AdapterMeta
from memory_broker.broker.adapters.registry import AdapterRegistry
from memory_broker.broker.adapters.stats import AdapterCounters
from memory_broker.broker.store.objects import ObjectStore
from memory_broker.proto.wire.errors import invalid


@dataclass(eq=False)
class AdapterContext:
    """The wing's shared state and services (built once by ``AdapterManager``).

    Args:
        store: the object store.
        system_session: the manager's own session on it; it owns every hot adapter's object.
        registry: registered adapters.
        config: dtype, budgets, policies (validated).
        page_size: the arena's page size in bytes.
        executor: runs file reads and page copies.
        log: a structlog-style logger (``log.info(event, **fields)``).
        counters: the running figures every part bumps.

    ``entries`` (every adapter's entry, made on first use from the registry and ``plan``) is
    built here, so that every part sees the one table.
    """

    store: ObjectStore
    system_session: int
    registry: AdapterRegistry
    config: AdapterConfig
    page_size: int
    executor: Executor
    log: Any
    counters: AdapterCounters = field(default_factory=AdapterCounters)
    entries: EntryTable = field(init=False)

    def __post_init__(self) -> None:
        self.entries = EntryTable(self.new_entry)

    def plan(self, meta: AdapterMeta, dtype: str = "", shard: str = "") -> AdapterLayout:
        """The adapter's placement within pages, in ``dtype`` (default: the broker's), of the
        shards ``shard`` (``layout.shards_text``; "": the whole adapter).

        Raises:
            BrokerError: INVALID_ARGUMENT when it cannot be placed or cut into those shards.
        """
        cfg = self.config
        dtype = dtype or cfg.dtype
        # Rows stay aligned as the stored dtype's are, and at least to the element size.
        align = max(cfg.row_align, DTYPE_SIZES[dtype])
        try:
            specs = shard_specs(meta.weights, parse_shards(shard)) if shard else meta.weights
            return plan_layout(specs, self.page_size, dtype, align, shard)
        except ValueError as err:
            raise invalid(f"adapter {meta.adapter_id!r} cannot be placed in pages: {err}") from None

    def new_entry(self, key: str) -> AdapterEntry:
        """A cold entry for a key of a registered adapter: its id, ``id#dtype`` for its copy
        in another dtype, ``id#dtype#shard`` for a rank's shards (raises BrokerError NOT_FOUND
        otherwise)."""
        adapter_id, dtype, shard = split_key(key)
        meta = self.registry.get(adapter_id)
        dtype = "" if dtype == self.config.dtype else dtype
        return AdapterEntry(meta, self.plan(meta, dtype, shard), copy_dtype=dtype, copy_shard=shard)
