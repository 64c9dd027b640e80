"""Allocations and their lifecycle: owners, keys, per-session pins and transactions.

``ObjectStore`` is the broker's core state machine (ARCHITECTURE.md, "Invariants"), a facade over parts
with one job each: the ``ObjectTable`` (objects by id and key, their pages), the
``PinLedger`` (who pins what), the ``RoomMaker`` (evict or grow) and beside it the
``Allocator`` (reserve pages, publish objects: for Allocate and commit alike), the
``Transactions`` over the ``TransactionBook`` (open and finished transactions) and the
``Tally`` (running figures); what they share is one ``StoreContext``. The store validates each
request, decides who may free or unpin what and what a session's end releases, and drives the
parts. It never touches memory, sockets or gRPC: the arena maps, the service translates, and
events leave through the ``notify`` callback.

Every public method validates its whole batch before changing anything and raises
``BrokerError`` on refusal.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence

from memory_broker.broker.store.context import Notify, StoreContext
from memory_broker.broker.store.eviction import EvictionPolicy, PriorityLRU
from memory_broker.broker.store.growth import Growth
from memory_broker.broker.store.object_table import ObjectTable, ReplyRoom, check_batch, check_specs, check_unique
from memory_broker.broker.store.pins import PinLedger
from memory_broker.broker.store.pool import PagePool, WindowSpace
from memory_broker.broker.store.pools import PooledPolicy, PoolMap, TenantPool, pool_rooms, pool_totals
from memory_broker.broker.store.records import (
    UNASSIGNED,
    Allocation,
    ObjectsEvicted,
    ObjectState,
    SessionState,
    StoreConfig,
    StoreLimits,
    Transaction,
    TransactionsExpired,
    TxnState,
)
from memory_broker.broker.store.room import Allocator, RoomMaker
from memory_broker.broker.store.shards import ShardedMap
from memory_broker.broker.store.stats import Counters, StoreStats, Tally, Usage, read_stats
from memory_broker.broker.store.transactions import Transactions
from memory_broker.broker.store.txn_book import TransactionBook
from memory_broker.proto.wire.errors import denied, not_found, precondition
from memory_broker.proto.wire.spec import Spec

# The records callers use come from here too (one import for the store's API).
__all__ = [
    "Allocation",
    "ObjectState",
    "ObjectStore",
    "ObjectsEvicted",
    "SessionState",
    "Spec",
    "StoreConfig",
    "StoreLimits",
    "StoreStats",
    "Transaction",
    "TransactionsExpired",
    "TxnState",
]


class ObjectStore:
    """All allocations of one arena.

    Args:
        pool: free pages and the page table.
        window: placement of contiguous objects in the virtual window.
        policy: orders eviction candidates.
        config: watermarks, leases, limits.
        notify: ``notify(session_id, event)`` for ObjectsEvicted / TransactionsExpired.
        clock: monotonic seconds (tests pass a fake).
        tenants: tenant pools (``pools.TenantPool``): ``pool`` is then the shared pool, and
            each session is placed in one (``assign_pool``) before it may do anything.
    """

    def __init__(
        self,
        pool: PagePool,
        window: WindowSpace,
        policy: EvictionPolicy | None = None,
        config: StoreConfig | None = None,
        notify: Notify | None = None,
        clock: Callable[[], float] = time.monotonic,
        tenants: Sequence[TenantPool] = (),
    ):
        self.pool, self.window = pool, window
        self.growth: Growth | None = None  # grows the arena off the loop for Growth.run's calls; None: in place
        self.policy: EvictionPolicy = policy if policy is not None else PriorityLRU()
        if tenants:
            self.policy = PooledPolicy([self.policy, *(type(self.policy)() for _ in tenants)])
        # Every pool (the shared one first) and which fd units each pool's sessions may get.
        self.pools: list[PagePool] = [pool, *(t.pool for t in tenants)]
        self.tenancy = PoolMap(self.pools, ["", *(t.name for t in tenants)]) if tenants else None
        self.config = config = config or StoreConfig()
        config.validate()
        self._limits = StoreLimits.of(config)
        self._notify = notify = notify or (lambda session, event: None)
        self.sessions: dict[int, SessionState] = {}
        # Sessions ended whose pins and objects are still being released.
        self._ending: dict[int, SessionState] = {}
        # Sessions the broker opened for itself (the adapter manager's): no pin limit, and
        # not counted as client sessions in stats.
        self.internal_sessions: set[int] = set()
        self.txns = TransactionBook(config.remember)
        self._session_ids = itertools.count(1)
        self.counters = Counters()
        # Running figures for stats(), so reading them is O(1) at any size (kept by the
        # table as objects come and go, the owner changes and the pin zero crossings).
        self.tally = Tally()
        self.table = ObjectTable(pool, window, self.policy, self.tally, config.remember, self._owner_state)
        # The table's maps, by id and by key (read by the service, the adapter wing and tests).
        self.objects: ShardedMap = self.table.objects
        self.keys: ShardedMap = self.table.keys
        self.table.pools, self.table.internal = self.pools, self.internal_sessions
        ctx = StoreContext(
            pool,
            self.policy,
            config,
            self.counters,
            self.tally,
            self.table,
            self.sessions,
            self.internal_sessions,
            self.txns,
            notify,
            clock,
        )
        self.rooms = pool_rooms(ctx, tenants)
        self.room: RoomMaker = self.rooms[0]
        self.ledger = PinLedger(ctx)
        self.allocator = Allocator(ctx, self.room, self.ledger)
        self.allocator.rooms = self.rooms
        self.transactions = Transactions(ctx, self.ledger, self.allocator)
        # Bounded work (ARCHITECTURE.md, "Threads and the event loop"): with a ``background`` host (see the property),
        # eviction down to the low watermark and the release of an ended session's holdings
        # run in batches of ``work_batch`` objects instead of all at once inside one call.
        self.work_batch = 128
        # Called with the keyed objects each commit makes visible (digests.KeyDigests), or None.
        self.on_commit: Callable[[list[Allocation]], None] | None = None
        # Called by a lookup that found fewer than the keys it was given: (the session's pool,
        # the keys, how many leading ones were found); tiering.TierLink reads the rest through.
        self.on_miss: Callable[[int, Sequence[bytes], int], None] | None = None
        # Called with each ended session's id after its holdings were let go (engine_pool.EnginePool).
        self.on_session_end: Callable[[int], None] | None = None

    # ------------------------------------------------ the narrow interface

    @property
    def limits(self) -> StoreLimits:
        """Leases, batch size and pin limit, as a read-only record."""
        return self._limits

    @property
    def max_pages(self) -> int:
        """Most pages the arena may hold."""
        return self.pool.max_pages

    def get(self, object_id: int) -> Allocation | None:
        """The object with this id (prepared, committed or freed-but-pinned), or None."""
        return self.objects.get(object_id)

    def is_live(self, obj: Allocation) -> bool:
        """True while ``obj`` is the store's object for its id and not freed."""
        return self.objects.get(obj.object_id) is obj and not obj.freed

    def has_session(self, session_id: int) -> bool:
        return session_id in self.sessions

    def notify(self, session_id: int, event: object) -> None:
        """Send a core event to a session through the store's route (its stream)."""
        self._notify(session_id, event)

    def mark_internal(self, session_id: int) -> None:
        """A session the broker opened for itself: no pin limit, not counted in stats; its
        objects are in the shared pool and every pool's sessions may see them."""
        self.internal_sessions.add(session_id)
        self.sessions[session_id].pool = 0

    def assign_pool(self, session_id: int, pool: int) -> None:
        """Place a session not yet placed in a pool (tenant pools: once its process is known)."""
        s = self.sessions.get(session_id)
        if s is not None and s.pool == UNASSIGNED:
            s.pool = pool

    def is_internal(self, session_id: int) -> bool:
        return session_id in self.internal_sessions

    def check_visible(self, session_id: int, ids: Sequence[int]) -> None:
        """NOT_FOUND for an id this session may not name (``ObjectTable.check_visible``); a
        batch over the limit is left to the call itself, which refuses it whole."""
        if len(ids) <= self.limits.max_batch:
            self.table.check_visible(session_id, ids)

    def reconfigure(self, *, default_lease_s: float | None = None, max_pins_per_session: int | None = None) -> None:
        """Change limits of a running store (SIGHUP reload); bad values change nothing.

        Raises:
            ValueError: the lease is not within (0, max_lease_s], or the pin limit is negative.
        """
        lease = self.config.default_lease_s if default_lease_s is None else default_lease_s
        pins = self.config.max_pins_per_session if max_pins_per_session is None else max_pins_per_session
        if not 0 < lease <= self.config.max_lease_s:
            raise ValueError(
                f"default_lease_s {lease:g} must be positive and at most max_lease_s {self.config.max_lease_s:g}"
            )
        if pins < 0:
            raise ValueError(f"max_pins_per_session must be 0 (no limit) or more; got {pins}")
        self.config.default_lease_s, self.config.max_pins_per_session = lease, pins
        self._limits = dataclasses.replace(self._limits, default_lease_s=lease, max_pins_per_session=pins)

    def set_watermarks(self, high: float, low: float) -> None:
        """Change the eviction watermarks of a running store (SIGHUP reload)."""
        for room in self.rooms:
            room.set_watermarks(high, low)
        self.config.high_watermark, self.config.low_watermark = high, low

    @property
    def background(self) -> Callable[[], None] | None:
        """Set by a host: a callback that arranges for ``work()`` to be called soon, off the
        request path (bounded work, ARCHITECTURE.md, "Threads and the event loop")."""
        return self.room.background

    @background.setter
    def background(self, callback: Callable[[], None] | None) -> None:
        for room in self.rooms:
            room.background = callback

    @property
    def on_evict(self) -> Callable[[list[Allocation]], None] | None:
        """Set by a host: called with each eviction's victims before their pages return
        (tiering.TierLink spills the ones not yet in the tier)."""
        return self.room.on_evict

    @on_evict.setter
    def on_evict(self, callback: Callable[[list[Allocation]], None] | None) -> None:
        for room in self.rooms:
            room.on_evict = callback

    @property
    def eviction_active(self) -> bool:
        """True from crossing the high watermark until reaching the low one (in any pool)."""
        return any(room.eviction_active for room in self.rooms)

    @property
    def open_txns(self) -> dict[int, Transaction]:
        return self.txns.open

    # ----------------------------------------------------------------- sessions

    def open_session(self) -> int:
        sid = next(self._session_ids)
        self.sessions[sid] = SessionState(sid, pool=UNASSIGNED if self.tenancy else 0)
        return sid

    def end_session(self, session: int) -> None:
        """Release everything the session held: abort its open transactions, drop its
        pins, free its anonymous objects; its keyed committed objects stay (ownerless).
        Idempotent. The session is gone at once (no call can use it); with a
        ``background`` host, holdings beyond ``work_batch`` objects are released by
        ``work()`` in batches."""
        s = self.sessions.pop(session, None)
        if s is None:
            return
        for txn_id in list(s.txns):
            self.transactions.rollback(self.txns.open.pop(txn_id), TxnState.ABORTED)
        self._ending[session] = s
        background = self.room.background
        if not self._release_holdings(s, self.work_batch if background is not None else None):
            background()
        if self.on_session_end is not None:
            self.on_session_end(session)

    def _release_holdings(self, s: SessionState, budget: int | None) -> bool:
        """Drop up to ``budget`` of an ended session's pins and objects; True when done."""
        work = self.ledger.release(s, self.objects, budget)
        self.table.disown(s, None if budget is None else budget - work)
        if s.pins or s.owned:
            return False
        del self._ending[s.session_id]
        return True

    def work(self, budget: int | None = None) -> bool:
        """Do up to ``budget`` objects of deferred work (ended sessions first, then eviction
        down to the low watermark); True if more remains. Hosts call it from their loop."""
        budget = self.work_batch if budget is None else budget
        for s in list(self._ending.values()):
            if not self._release_holdings(s, budget):
                return True
        return any([room.drain(budget) for room in self.rooms])

    @property
    def ending_sessions(self) -> int:
        """Ended sessions whose holdings are still being released."""
        return len(self._ending)

    # ------------------------------------------------------------ allocation

    def allocate(self, session: int, specs: Sequence[Spec]) -> list[tuple[Allocation, bool]]:
        """Allocate and commit a batch in one step.

        Returns (object, deduplicated) per spec: where a key already exists, the existing
        object is returned and nothing is allocated for it.
        """
        s = self._session(session)
        check_batch(len(specs), "objects", self.config.max_batch)
        total, has_keys = check_specs(specs, self.pool.max_pages, self.config.max_key_bytes)
        if self.config.max_pins_per_session:
            self.ledger.check_limit(s, sum(1 for sp in specs if sp.pin))
        return self.allocator.allocate(s, specs, total, has_keys)

    def prepare(
        self,
        session: int,
        specs: Sequence[Spec],
        pin_ids: Sequence[int] = (),
        lease_s: float | None = None,
    ) -> Transaction:
        """Reserve a batch (PREPARED objects, pins on committed objects) under a lease."""
        s = self._session(session)
        check_batch(len(specs) + len(pin_ids), "objects + pin_object_ids", self.config.max_batch)
        return self.transactions.prepare(s, specs, pin_ids, lease_s)

    def commit(self, session: int, txn_ids: Sequence[int]) -> list[Transaction]:
        """Make prepared batches visible. Committing a committed transaction is a no-op
        that returns the same result."""
        s = self._session(session)
        check_batch(len(txn_ids), "transaction_ids", self.config.max_batch)
        txns = self.transactions.commit(s, txn_ids)
        if self.on_commit is not None:
            self.on_commit([o for t in txns for o, dedup in t.result if o.key is not None and not dedup])
        return txns

    def withdraw(self, obj: Allocation) -> bool:
        """Take a corrupt committed object out of service: its key stops resolving, its pages return with its last pin."""
        if self.objects.get(obj.object_id) is not obj or obj.freed or obj.state != ObjectState.COMMITTED:
            return False
        owner = self.sessions.get(obj.owner)
        if owner is not None:
            self.ledger.drop_own(owner, obj)
            owner.owned.discard(obj.object_id)
        self.tally.set_owner(obj, 0)
        self.table.free_one(obj)
        return True

    def abort(self, session: int, txn_ids: Sequence[int]) -> int:
        """Roll prepared batches back; returns pages freed. Aborting an aborted or expired
        transaction is a no-op."""
        self._session(session)
        check_batch(len(txn_ids), "transaction_ids", self.config.max_batch)
        return self.transactions.abort(session, txn_ids)

    def expire(self, now: float | None = None) -> list[int]:
        """Abort every open transaction whose lease has ended; tell their sessions."""
        return self.transactions.expire(now)

    def next_deadline(self) -> float | None:
        return self.txns.next_deadline()

    # ------------------------------------------------------------- free / pins

    def free(self, session: int, object_ids: Sequence[int]) -> tuple[int, int]:
        """Free objects the session owns. Returns (pages freed now, pages deferred until
        other sessions' pins go)."""
        s = self._session(session)
        check_batch(len(object_ids), "object_ids", self.config.max_batch)
        if len(object_ids) > 1:
            check_unique(object_ids, "object_ids")
        objs = []
        for oid in object_ids:
            obj = self.table.visible(session, oid)
            if obj.owner != session:
                raise denied(f"object {oid} is not owned by session {session}; only its owner may free it")
            if obj.state == ObjectState.PREPARED:
                raise precondition(f"object {oid} belongs to open transaction {obj.txn_id}; commit or abort it first")
            objs.append(obj)
        freed = deferred = 0
        for obj in objs:
            self.ledger.drop_own(s, obj)
            s.owned.discard(obj.object_id)
            self.tally.set_owner(obj, 0)
            n = obj.num_pages
            if self.table.free_one(obj):
                freed += n
            else:
                deferred += n
        return freed, deferred

    def pin(self, session: int, object_ids: Sequence[int], reply: ReplyRoom | None = None) -> list[Allocation]:
        """Pin committed objects for the session (counts add up); ``reply``: a client's (``ReplyRoom``)."""
        s = self._session(session)
        check_batch(len(object_ids), "object_ids", self.config.max_batch)
        objs = self.table.pinnable_all(session, object_ids, reply)
        self.ledger.check_limit(s, len(objs))
        self.ledger.pin_all(s, objs)
        return objs

    def unpin(self, session: int, object_ids: Sequence[int]) -> None:
        """Drop pins the session holds; never another session's."""
        s = self.sessions.get(session)
        if s is None or s.pool < 0:
            s = self._session(session)  # raises, saying why
        max_batch = self.config.max_batch
        if len(object_ids) > max_batch:
            check_batch(len(object_ids), "object_ids", max_batch)  # raises
        if self.ledger.fused is not None and self.ledger.unpin_held(s, object_ids):
            return  # held_once and unpin_once in one native call
        objs = self.table.held_once(session, object_ids)
        if objs is not None:
            self.ledger.unpin_once(s, objs)
            return
        wanted = Counter(object_ids)
        objs = []
        get, check_unpin, prepared = self.objects.get, self.ledger.check_unpin, ObjectState.PREPARED
        for oid, count in wanted.items():
            obj = get(oid)
            if obj is None:
                raise not_found(self.table.gone_message(oid))
            if obj.state == prepared and obj.owner != session:
                raise not_found(f"no object {oid}")  # invisible until commit, as for pin and free
            if obj.pins.get(session, 0) < count:
                check_unpin(session, obj, count)  # raises, saying why
            objs.append((obj, count))
        self.ledger.unpin_all(s, objs)

    def lookup(
        self, session: int, keys: Sequence[bytes], pin: bool, reply: ReplyRoom | None = None
    ) -> list[Allocation]:
        """The longest prefix of ``keys`` that exist, pinned for the session if asked; ``reply``: as ``pin``'s."""
        s = self.sessions.get(session)
        if s is None or s.pool < 0:
            s = self._session(session)  # raises, saying why
        config = self.config
        if len(keys) > config.max_batch:
            check_batch(len(keys), "keys", config.max_batch)  # raises
        if pin and self.ledger.fused is not None:  # find and pin_all in one native call
            if (found := self.ledger.lookup_pin(s, keys, config.max_key_bytes, reply)) is not None:
                if len(found) < len(keys) and self.on_miss is not None:
                    self.on_miss(s.pool, keys, len(found))
                return found
        found = self.table.find(s.pool, keys, config.max_key_bytes, reply)
        if pin:
            if found:
                ledger = self.ledger
                if config.max_pins_per_session:  # else ``check_limit`` has nothing to check
                    ledger.check_limit(s, len(found))
                ledger.pin_all(s, found)
        else:
            self.ledger.touch_all(found)
        if len(found) < len(keys) and self.on_miss is not None:
            self.on_miss(s.pool, keys, len(found))
        return found

    # ---------------------------------------------------------------- reading

    def describe_gone(self, object_id: int) -> str:
        return self.table.gone_message(object_id)

    def objects_by_owner(self) -> dict[tuple[int, int], Usage]:
        """(owning session, content type) -> (objects, pages); session 0: owner gone."""
        return self.tally.owner_usage()

    def stats(self) -> StoreStats:
        """One O(1) reading of the pool, the window and the counters (changes nothing)."""
        return read_stats(self, pool_totals(self.pools))

    # ---------------------------------------------------------------- internals

    def _owner_state(self, session: int) -> SessionState | None:
        return self.sessions.get(session) or self._ending.get(session)

    def _session(self, session: int) -> SessionState:
        s = self.sessions.get(session)
        if s is None:
            raise denied(f"session {session} is not open")
        if s.pool < 0:
            raise precondition(
                f"session {session} is in no pool yet: with tenant pools (security.tenants) a session must "
                "present its token on the fd channel first (the client library does at connect)"
            )
        return s
