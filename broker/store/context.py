"""What the store's parts share: one record ``ObjectStore`` builds and hands to each part.

The room maker, the pin ledger, the allocator and the transactions all work on the same
pool, eviction policy, object table, sessions and transaction book, read the same config
(which a reload changes in place), keep the same counters and running figures and send
events through the same ``notify``. ``StoreContext`` carries those; a part's constructor
takes it and, besides it, only the other parts it calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memory_broker.broker.store.eviction import EvictionPolicy
from memory_broker.broker.store.object_table import ObjectTable
from memory_broker.broker.store.pool import PagePool
from memory_broker.broker.store.records import SessionState, StoreConfig
from memory_broker.broker.store.stats import Counters, Tally
from memory_broker.broker.store.txn_book import TransactionBook

Notify = Callable[[int, object], None]


@dataclass(frozen=True, eq=False)
class StoreContext:
    """The store's shared state and settings (the fields never change; what they hold does).

    Args:
        pool: free pages, the page table and the arena's growth.
        policy: orders eviction candidates.
        config: watermarks, leases, limits (read at each use: a reload changes it in place).
        counters: the store's counters.
        tally: the store's running figures.
        table: the objects by id and key; ``table.drop(obj, why)`` forgets one and returns
            its pages.
        sessions: open sessions by id.
        internal_sessions: sessions the broker opened for itself (no pin limit).
        txns: open and recently finished transactions.
        notify: ``notify(session_id, event)`` for ObjectsEvicted / TransactionsExpired.
        clock: monotonic seconds (tests pass a fake).
    """

    pool: PagePool
    policy: EvictionPolicy
    config: StoreConfig
    counters: Counters
    tally: Tally
    table: ObjectTable
    sessions: dict[int, SessionState]
    internal_sessions: set[int]
    txns: TransactionBook
    notify: Notify
    clock: Callable[[], float]
