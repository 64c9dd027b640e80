"""Allocations and their lifecycle: states, owners, keys, per-session pins, transactions.

``ObjectStore`` is the broker's core state machine (DESIGN.md section 3). It decides which
pages an allocation gets (through the page pool and the window), when an object is visible,
who may free or unpin it, and what a session's end releases; it asks the eviction policy
for victims and frees them. It never touches memory, sockets or gRPC: the arena maps, the
service translates, and events leave through the ``notify`` callback.

Every public method validates its whole batch before changing anything and raises
``BrokerError`` on refusal.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable, Iterable, Sequence

from memory_broker.broker.errors import denied, exhausted, invalid, not_found, precondition
from memory_broker.broker.eviction import ContentType, EvictionPolicy, PriorityLRU
from memory_broker.broker.pool import FREE, PagePool, WindowSpace
from memory_broker.broker.shards import ShardedMap, ShardedSet
# One allocation request, shared with the client (a positional Spec means the same on both sides).
from memory_broker.wire.spec import Spec

VALID_CONTENT = frozenset(int(c) for c in ContentType)
# int -> ContentType without the enum constructor's cost on the hot path.
_CONTENT = {int(c): c for c in ContentType}


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


@dataclass(slots=True)
class Counters:
    allocations_total: int = 0
    deduplicated_total: int = 0
    allocation_failures: int = 0
    eviction_runs: int = 0
    evicted_objects: int = 0
    evicted_pages: int = 0
    # Pins taken on objects another session already pinned (shared use of hot objects).
    pin_contention: int = 0


Notify = Callable[[int, object], None]


class Recent:
    """The last ``remember * 7/8 .. remember`` entries added, for messages and idempotent
    retries.

    Eight plain dicts of ``remember/8`` entries: new entries go to the newest; when it is full
    the oldest dict is dropped whole. Unlike trimming an OrderedDict entry by entry, nothing
    here rebuilds a table of ``remember`` entries inside one call (that rebuild stalled a call
    for milliseconds every few ten thousand drops), and one drop frees only 1/8 of them.
    """

    __slots__ = ("part", "gens")

    def __init__(self, remember: int, generations: int = 8):
        self.part = max(1, remember // generations)
        self.gens: deque[dict] = deque([{}], maxlen=generations)

    def __setitem__(self, key, value) -> None:
        cur = self.gens[-1]
        cur[key] = value
        if len(cur) >= self.part:
            self.gens.append({})  # the deque drops the oldest generation

    def get(self, key, default=None):
        for g in reversed(self.gens):
            v = g.get(key, self)
            if v is not self:
                return v
        return default

    def __len__(self) -> int:
        return sum(len(g) for g in self.gens)


def _pages_at(fraction: float, max_pages: int) -> int:
    """Pages at a watermark; the epsilon keeps 0.57 * 100 at 57, not 56.99... -> 56."""
    return int(fraction * max_pages + 1e-9)


class ObjectStore:
    """All allocations of one arena.

    Args:
        pool: free pages and the page table.
        window: placement of contiguous objects in the virtual window.
        policy: orders eviction candidates.
        config: watermarks, leases, limits.
        notify: ``notify(session_id, event)`` for ObjectsEvicted / TransactionsExpired.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        pool: PagePool,
        window: WindowSpace,
        policy: EvictionPolicy | None = None,
        config: StoreConfig | None = None,
        notify: Notify | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool = pool
        self.window = window
        self.policy: EvictionPolicy = policy if policy is not None else PriorityLRU()
        self.config = config or StoreConfig()
        self.config.validate()
        self._notify = notify or (lambda session, event: None)
        self._clock = clock
        # Sharded: a million-entry dict rebuilds its table inside one call under churn.
        self.objects: ShardedMap = ShardedMap()
        # Committed, not freed objects by key.
        self.keys: ShardedMap = ShardedMap()
        self.sessions: dict[int, SessionState] = {}
        # Sessions the broker opened for itself (the adapter manager's): no pin limit, and
        # not counted as client sessions in stats.
        self.internal_sessions: set[int] = set()
        self.open_txns: dict[int, Transaction] = {}
        # (deadline, txn id) of open transactions, so expiry and the next deadline cost
        # O(log n) instead of a walk of every open transaction; entries of transactions that
        # ended early are skipped when they surface.
        self._deadlines: list[tuple[float, int]] = []
        self._finished_txns: Recent = Recent(self.config.remember)
        # Why an object id is gone ("evicted" / "freed"), for messages; oldest forgotten first.
        self._gone: Recent = Recent(self.config.remember)
        self._object_ids = itertools.count(1)
        self._txn_ids = itertools.count(1)
        self._session_ids = itertools.count(1)
        # Hysteresis state: set when usage crosses the high watermark, cleared at the low.
        self.eviction_active = False
        self.counters = Counters()
        # Running figures for stats(), so reading them is O(1) at any size (kept by
        # _account, _set_owner and the pin zero crossings; check_invariants re-derives them).
        self._by_content: dict[int, list[int]] = {}
        self._by_owner: dict[tuple[int, int], list[int]] = {}
        self._prepared_pages = 0
        self._pinned_pages = 0
        self._pinned_objects = 0
        # Bounded work (DESIGN.md section 4): when a host sets ``background`` (a callback
        # that arranges for ``work()`` to be called soon, off the request path), eviction
        # down to the low watermark and the release of an ended session's holdings run in
        # batches of ``work_batch`` objects instead of all at once inside one call.
        self.background: Callable[[], None] | None = None
        self.work_batch = 128
        # Sessions ended whose pins and objects are still being released.
        self._ending: dict[int, SessionState] = {}
        self._high_pages = _pages_at(self.config.high_watermark, pool.max_pages)
        self._low_pages = _pages_at(self.config.low_watermark, pool.max_pages)

    # ----------------------------------------------------------------- sessions

    def open_session(self) -> int:
        sid = next(self._session_ids)
        self.sessions[sid] = SessionState(sid)
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
            self._rollback(self.open_txns.pop(txn_id), TxnState.ABORTED)
        self._ending[session] = s
        bounded = self.background is not None
        if not self._release_holdings(s, self.work_batch if bounded else None):
            self.background()

    def _release_holdings(self, s: SessionState, budget: int | None) -> bool:
        """Drop up to ``budget`` of an ended session's pins and objects; True when done."""
        sid = s.session_id
        pins, owned, objects = s.pins, s.owned, self.objects
        work = 0
        while pins and (budget is None or work < budget):
            oid, count = pins.popitem()
            obj = objects[oid]
            del obj.pins[sid]
            obj.pin_count -= count
            s.pin_total -= count
            if obj.pin_count == 0:
                self._became_unpinned(obj)
            work += 1
        while owned and (budget is None or work < budget):
            obj = objects.get(owned.pop())
            work += 1
            if obj is None:
                continue
            self._set_owner(obj, 0)
            if obj.key is None:
                self._free_one(obj)
        if pins or owned:
            return False
        del self._ending[sid]
        return True

    def work(self, budget: int | None = None) -> bool:
        """Do up to ``budget`` objects of deferred work (ended sessions first, then eviction
        down to the low watermark); True if more remains. Hosts call it from their loop."""
        budget = self.work_batch if budget is None else budget
        for s in list(self._ending.values()):
            if not self._release_holdings(s, budget):
                return True
        return self._drain(budget)

    def _drain(self, budget: int) -> bool:
        """One bounded batch of watermark eviction; True if more is needed."""
        if not self.eviction_active:
            return False
        over = self.pool.used_pages - self._low_pages
        if over <= 0:
            self.eviction_active = False
            return False
        if not self.policy.evictable_pages:
            return False  # all pinned: allocations retry as pins go
        self._evict(self.policy.select(over, budget), over, ())
        if self.pool.used_pages <= self._low_pages:
            self.eviction_active = False
            return False
        return bool(self.policy.evictable_pages)

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
        self._check_batch(len(specs), "objects")
        total, has_keys = self._check_specs(specs)
        if self.config.max_pins_per_session:
            self._check_pin_limit(s, sum(1 for sp in specs if sp.pin))
        if not has_keys:
            # The common case: nothing to deduplicate.
            new = self._reserve(s, specs, (), total)
            publish = self._publish
            return [publish(s, obj, sp.pin) for obj, sp in zip(new, specs)]
        # Keys already committed need no pages: they resolve to the existing object,
        # which must not be evicted to make room for the rest of the batch.
        existing = [self.keys.get(sp.key) if sp.key is not None else None for sp in specs]
        fresh = [sp for sp, e in zip(specs, existing) if e is None]
        new = self._reserve(
            s, fresh, {e.object_id for e in existing if e is not None}, sum(sp.num_pages for sp in fresh)
        )
        it = iter(new)
        out: list[tuple[Allocation, bool]] = []
        for sp, e in zip(specs, existing):
            if e is None:
                out.append(self._publish(s, next(it), sp.pin))
                continue
            self.counters.deduplicated_total += 1
            if sp.pin:
                self._pin(s, e)
            else:
                self.policy.touch(e)
            out.append((e, True))
        return out

    def prepare(
        self,
        session: int,
        specs: Sequence[Spec],
        pin_ids: Sequence[int] = (),
        lease_s: float | None = None,
    ) -> Transaction:
        """Reserve a batch (PREPARED objects, pins on committed objects) under a lease."""
        s = self._session(session)
        self._check_batch(len(specs) + len(pin_ids), "objects + pin_object_ids")
        if lease_s is None or lease_s == 0:
            lease_s = self.config.default_lease_s
        if not 0 < lease_s <= self.config.max_lease_s:
            raise invalid(f"lease of {lease_s:g} s is out of range; allowed 0 < lease <= {self.config.max_lease_s:g} s")
        total, _ = self._check_specs(specs)
        to_pin = [self._pinnable(session, oid) for oid in pin_ids]
        self._check_pin_limit(s, len(to_pin) + sum(1 for sp in specs if sp.pin))
        new = self._reserve(s, specs, {o.object_id for o in to_pin}, total)
        for obj in to_pin:
            self._pin(s, obj)
        txn_id = next(self._txn_ids)
        for obj in new:
            obj.txn_id = txn_id
        txn = Transaction(
            txn_id=txn_id,
            session=session,
            deadline=self._clock() + lease_s,
            deadline_unix=time.time() + lease_s,
            objects=new,
            pin_on_commit=[sp.pin for sp in specs],
            pinned=[o.object_id for o in to_pin],
        )
        self.open_txns[txn_id] = txn
        heapq.heappush(self._deadlines, (txn.deadline, txn_id))
        s.txns.add(txn_id)
        return txn

    def commit(self, session: int, txn_ids: Sequence[int]) -> list[Transaction]:
        """Make prepared batches visible. Committing a committed transaction is a no-op
        that returns the same result."""
        s = self._session(session)
        self._check_batch(len(txn_ids), "transaction_ids")
        txns = [self._own_txn(session, t) for t in txn_ids]
        now = self._clock()
        late = [t for t in txns if t.state == TxnState.OPEN and t.deadline <= now]
        if late:
            self.expire(now)
            raise precondition(
                f"transaction {late[0].txn_id} expired before commit (its lease ended); prepare again"
            )
        for t in txns:
            if t.state in (TxnState.ABORTED, TxnState.EXPIRED):
                raise precondition(
                    f"transaction {t.txn_id} was {t.state.name.lower()}; it cannot be committed, prepare again"
                )
        for t in txns:
            if t.state != TxnState.OPEN:
                continue
            t.result = [self._publish(s, obj, pin) for obj, pin in zip(t.objects, t.pin_on_commit)]
            t.state = TxnState.COMMITTED
            self._finish(t)
        return txns

    def abort(self, session: int, txn_ids: Sequence[int]) -> int:
        """Roll prepared batches back; returns pages freed. Aborting an aborted or expired
        transaction is a no-op."""
        self._session(session)
        self._check_batch(len(txn_ids), "transaction_ids")
        txns = [self._own_txn(session, t) for t in txn_ids]
        for t in txns:
            if t.state == TxnState.COMMITTED:
                raise precondition(f"transaction {t.txn_id} is already committed; free its objects instead")
        freed = 0
        for t in txns:
            if t.state == TxnState.OPEN:
                freed += self._rollback(t, TxnState.ABORTED)
        return freed

    def expire(self, now: float | None = None) -> list[int]:
        """Abort every open transaction whose lease has ended; tell their sessions."""
        now = self._clock() if now is None else now
        heap, open_txns = self._deadlines, self.open_txns
        late = []
        while heap and heap[0][0] <= now:
            _, tid = heapq.heappop(heap)
            t = open_txns.get(tid)
            if t is not None and t.deadline <= now:
                late.append(t)
        late.sort(key=lambda t: t.txn_id)
        by_session: dict[int, list[int]] = {}
        for t in late:
            self.open_txns.pop(t.txn_id)
            self._rollback(t, TxnState.EXPIRED)
            by_session.setdefault(t.session, []).append(t.txn_id)
        for sid, ids in by_session.items():
            self._notify(sid, TransactionsExpired(ids))
        return [t.txn_id for t in late]

    def next_deadline(self) -> float | None:
        heap, open_txns = self._deadlines, self.open_txns
        while heap and heap[0][1] not in open_txns:
            heapq.heappop(heap)  # finished before its lease ended
        return heap[0][0] if heap else None

    # ------------------------------------------------------------- free / pins

    def free(self, session: int, object_ids: Sequence[int]) -> tuple[int, int]:
        """Free objects the session owns. Returns (pages freed now, pages deferred until
        other sessions' pins go)."""
        s = self._session(session)
        self._check_batch(len(object_ids), "object_ids")
        if len(object_ids) > 1:
            self._check_unique(object_ids, "object_ids")
        objs = []
        for oid in object_ids:
            obj = self._visible(session, oid)
            if obj.owner != session:
                raise denied(f"object {oid} is not owned by session {session}; only its owner may free it")
            if obj.state == ObjectState.PREPARED:
                raise precondition(
                    f"object {oid} belongs to open transaction {obj.txn_id}; commit or abort it first"
                )
            objs.append(obj)
        freed = deferred = 0
        for obj in objs:
            own = s.pins.pop(obj.object_id, 0)
            if own:
                del obj.pins[session]
                obj.pin_count -= own
                s.pin_total -= own
                if obj.pin_count == 0:
                    self._pinned_pages -= obj.num_pages
                    self._pinned_objects -= 1
            s.owned.discard(obj.object_id)
            self._set_owner(obj, 0)
            n = obj.num_pages
            if self._free_one(obj):
                freed += n
            else:
                deferred += n
        return freed, deferred

    def pin(self, session: int, object_ids: Sequence[int]) -> list[Allocation]:
        """Pin committed objects for the session (counts add up)."""
        s = self._session(session)
        self._check_batch(len(object_ids), "object_ids")
        objs = [self._pinnable(session, oid) for oid in object_ids]
        self._check_pin_limit(s, len(objs))
        for obj in objs:
            self._pin(s, obj)
        return objs

    def unpin(self, session: int, object_ids: Sequence[int]) -> None:
        """Drop pins the session holds; never another session's."""
        s = self._session(session)
        self._check_batch(len(object_ids), "object_ids")
        wanted = Counter(object_ids)
        objs = []
        for oid, count in wanted.items():
            obj = self.objects.get(oid)
            if obj is None:
                raise not_found(self._gone_message(oid))
            if obj.state == ObjectState.PREPARED and obj.owner != session:
                raise not_found(f"no object {oid}")  # invisible until commit, as for pin and free
            held = obj.pins.get(session, 0)
            if held < count:
                if held == 0 and obj.pin_count > 0:
                    raise denied(
                        f"object {oid} is pinned only by other sessions; session {session} holds no pin on it"
                    )
                raise precondition(
                    f"object {oid}: asked to unpin {count}, session {session} holds {held} pin(s)"
                )
            objs.append((obj, count))
        for obj, count in objs:
            self._unpin(s, obj, count)

    def lookup(self, session: int, keys: Sequence[bytes], pin: bool) -> list[Allocation]:
        """The longest prefix of ``keys`` that exist, pinned for the session if asked."""
        s = self._session(session)
        self._check_batch(len(keys), "keys")
        for i, k in enumerate(keys):
            self._check_key(k, f"keys[{i}]")
        found = []
        for k in keys:
            obj = self.keys.get(k)
            if obj is None:
                break
            found.append(obj)
        if pin:
            self._check_pin_limit(s, len(found))
        for obj in found:
            if pin:
                self._pin(s, obj)
            else:
                self.policy.touch(obj)
        return found

    # ---------------------------------------------------------------- reading

    def describe_gone(self, object_id: int) -> str:
        return self._gone_message(object_id)

    def objects_by_owner(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(owning session, content type) -> (objects, pages); session 0: owner gone."""
        return {k: (v[0], v[1]) for k, v in sorted(self._by_owner.items())}

    def stats(self) -> dict:
        pool = self.pool
        by_content = self._by_content
        prepared, pinned = self._prepared_pages, self._pinned_pages
        used = pool.used_pages
        w = self.window
        largest = w.largest_free
        wfree = w.free_pages
        return {
            "max_pages": pool.max_pages,
            "capacity_pages": pool.capacity_pages,
            "free_pages": pool.free_pages,
            "used_pages": used,
            "prepared_pages": prepared,
            "pinned_pages": pinned,
            "evictable_pages": self.policy.evictable_pages,
            "utilization": used / pool.max_pages,
            "high_watermark": self.config.high_watermark,
            "low_watermark": self.config.low_watermark,
            "eviction_active": self.eviction_active,
            "objects": len(self.objects),
            "keyed_objects": len(self.keys),
            "sessions": len(self.sessions) - len(self.internal_sessions),
            "open_transactions": len(self.open_txns),
            "by_content": {ct: tuple(v) for ct, v in sorted(by_content.items())},
            "window_free_pages": wfree,
            "window_free_extents": w.free_extents,
            "window_largest_free": largest,
            "window_fragmentation": (1.0 - largest / wfree) if wfree else 0.0,
            "allocations_total": self.counters.allocations_total,
            "deduplicated_total": self.counters.deduplicated_total,
            "allocation_failures": self.counters.allocation_failures,
            "eviction_runs": self.counters.eviction_runs,
            "evicted_objects": self.counters.evicted_objects,
            "evicted_pages": self.counters.evicted_pages,
        }

    def check_invariants(self) -> None:
        """Assert the pool's invariants (tests call this after every step)."""
        pool = self.pool
        free = pool.free_page_list()
        assert len(free) == len(set(free)), "a page is on the free list twice"
        assert pool.used_pages + len(free) == pool.capacity_pages, "free + used != capacity"
        seen: dict[int, int] = {}
        every = {**self._ending, **self.sessions}
        assert not set(self._ending) & set(self.sessions), "a session is both open and ending"
        evictable_pages = 0
        evictable_ids = set()
        for oid, obj in self.objects.items():
            assert obj.object_id == oid
            for p in obj.pages:
                assert p not in seen, f"page {p} belongs to objects {seen[p]} and {oid}"
                seen[p] = oid
                assert pool.owner[p] == oid, f"page table says page {p} is {pool.owner[p]}, not {oid}"
            assert obj.pin_count == sum(obj.pins.values()) and obj.pin_count >= 0
            assert all(c > 0 for c in obj.pins.values()), "a zero or negative pin count is stored"
            for sid, c in obj.pins.items():
                assert every[sid].pins.get(oid) == c, "session pin mirror disagrees"
            if obj.state == ObjectState.PREPARED:
                t = self.open_txns[obj.txn_id]
                assert obj in t.objects and not obj.pins
            if obj.state == ObjectState.COMMITTED and obj.pin_count == 0:
                assert not obj.freed, "a freed object without pins was kept"
                evictable_pages += obj.num_pages
                evictable_ids.add(oid)
            if obj.key is not None and obj.state == ObjectState.COMMITTED and not obj.freed:
                assert self.keys.get(obj.key) is obj, "committed keyed object missing from the key index"
            if obj.owner:
                assert oid in every[obj.owner].owned
        for p in free:
            assert p not in seen and pool.owner[p] == FREE, f"free page {p} is owned"
        assert len(seen) == pool.used_pages, "pages in objects != used pages"
        assert self.policy.evictable_pages == evictable_pages, "evictable page count drifted"
        assert {o.object_id for o in self.policy} == evictable_ids, "eviction candidates drifted"
        for k, obj in self.keys.items():
            assert obj.key == k and self.objects.get(obj.object_id) is obj
        for sid, s in every.items():
            assert s.pin_total == sum(s.pins.values()), "session pin total drifted"
            for oid in s.owned:
                assert self.objects[oid].owner == sid
            for oid, c in s.pins.items():
                assert self.objects[oid].pins.get(sid) == c
        by_content: dict[int, list[int]] = {}
        by_owner: dict[tuple[int, int], list[int]] = {}
        prepared = pinned = pinned_objs = 0
        for obj in self.objects.values():
            for d, k in ((by_content, int(obj.content_type)), (by_owner, (obj.owner, int(obj.content_type)))):
                c = d.setdefault(k, [0, 0])
                c[0] += 1
                c[1] += obj.num_pages
            if obj.state == ObjectState.PREPARED:
                prepared += obj.num_pages
            elif obj.pin_count:
                pinned += obj.num_pages
                pinned_objs += 1
        assert by_content == self._by_content, "running per-content figures drifted"
        assert by_owner == self._by_owner, "running per-owner figures drifted"
        assert (prepared, pinned, pinned_objs) == (
            self._prepared_pages, self._pinned_pages, self._pinned_objects
        ), "running prepared/pinned figures drifted"
        placed = sorted((o.window_page, o.num_pages) for o in self.objects.values() if o.window_page >= 0)
        ranges = sorted(placed + self.window.extents())
        pos = 0
        for start, length in ranges:
            assert start == pos, f"window ranges overlap or leave a hole at {pos}"
            pos = start + length
        assert pos == self.window.window_pages

    # ---------------------------------------------------------------- internals

    def _session(self, session: int) -> SessionState:
        s = self.sessions.get(session)
        if s is None:
            raise denied(f"session {session} is not open")
        return s

    def _check_batch(self, n: int, what: str) -> None:
        if n > self.config.max_batch:
            raise invalid(f"{what} has {n} items; at most {self.config.max_batch} per call")

    @staticmethod
    def _check_unique(ids: Iterable[int], what: str) -> None:
        seen = set()
        for i in ids:
            if i in seen:
                raise invalid(f"{what} lists {i} twice")
            seen.add(i)

    def _check_key(self, key: bytes | None, where: str) -> None:
        if not key:
            raise invalid(f"{where} is empty; keys must be 1..{self.config.max_key_bytes} bytes")
        if len(key) > self.config.max_key_bytes:
            raise invalid(f"{where} is {len(key)} bytes; keys are at most {self.config.max_key_bytes}")

    def _check_specs(self, specs: Sequence[Spec]) -> tuple[int, bool]:
        """Validate a batch of specs; returns (total pages, whether any spec has a key)."""
        max_pages = self.pool.max_pages
        total = 0
        keys: set[bytes] = set()
        for i, sp in enumerate(specs):
            n = sp.num_pages
            if n.__class__ is not int or not 1 <= n <= max_pages:
                raise invalid(f"objects[{i}].num_pages is {n}; must be 1..{max_pages} (the arena's size)")
            if sp.content_type not in VALID_CONTENT:
                raise invalid(
                    f"objects[{i}].content_type is {sp.content_type}; give one of "
                    + ", ".join(f"{c.name}={c.value}" for c in ContentType)
                )
            if sp.key is not None:
                self._check_key(sp.key, f"objects[{i}].key")
                if sp.key in keys:
                    raise invalid(f"objects[{i}].key appears twice in one batch")
                keys.add(sp.key)
            total += n
        if total > max_pages:
            raise exhausted(f"batch needs {total} pages; the arena holds at most {max_pages}")
        return total, bool(keys)

    def _reserve(self, s: SessionState, specs: Sequence[Spec], exclude, total: int) -> list[Allocation]:
        """Place and take ``total`` pages for specs as PREPARED objects owned by ``s``."""
        if not specs:
            return []
        # Window placement first: it can be undone without a trace.
        window_pages: list[int] = []
        for sp in specs:
            if sp.contiguous:
                w = self.window.place(sp.num_pages)
                if w < 0:
                    for done, spd in zip(window_pages, (x for x in specs if x.contiguous)):
                        self.window.release(done, spd.num_pages)
                    self.counters.allocation_failures += 1
                    raise exhausted(
                        f"no free range of {sp.num_pages} pages in the virtual window "
                        f"({self.window.free_pages} free in {self.window.free_extents} extents, largest "
                        f"{self.window.largest_free}); free contiguous objects or raise window_factor"
                    )
                window_pages.append(w)
        try:
            self._make_room(total, exclude)
        except Exception:
            for w, sp in zip(window_pages, (x for x in specs if x.contiguous)):
                self.window.release(w, sp.num_pages)
            self.counters.allocation_failures += 1
            raise
        next_id = self._object_ids.__next__
        ids = [next_id() for _ in specs]
        page_lists = self.pool.take(ids, [sp.num_pages for sp in specs])
        wit = iter(window_pages)
        out = []
        objects = self.objects
        sid = s.session_id
        for oid, sp, pages in zip(ids, specs, page_lists):
            obj = Allocation(
                oid,
                sid,
                _CONTENT[sp.content_type],
                sp.key,
                pages,
                next(wit) if sp.contiguous else -1,
                ObjectState.PREPARED,
                sp.num_pages,
            )
            objects[oid] = obj
            self._account(obj, 1)
            s.owned.add(oid)
            out.append(obj)
        self.counters.allocations_total += len(out)
        return out

    def _make_room(self, total: int, exclude) -> None:
        """Ensure ``total`` free pages within the arena's capacity, evicting and growing.

        Watermark eviction runs first (best effort, down to the low watermark, counting
        the pages about to be taken), then whatever the request itself still needs.
        """
        pool = self.pool
        if (
            not exclude
            and not self.eviction_active
            and total <= pool.free_in_capacity
            and pool.used_pages + total <= self._high_pages
        ):
            return  # fast path: room within capacity and under the high watermark
        policy = self.policy
        excluded_pages = sum(
            self.objects[o].num_pages for o in exclude if self._is_evictable(self.objects[o])
        )
        evictable = policy.evictable_pages - excluded_pages
        if pool.free_pages + evictable < total:
            raise exhausted(self._exhausted_message(total, evictable))
        # Growth the request needs even if every candidate were evicted: ask for it before
        # evicting anything or starting hysteresis, so that a backend that cannot grow
        # refuses the request without side effects. (Eviction moves pages from evictable
        # to free within capacity, so once this holds the fallback below always succeeds.)
        unavoidable = total - (pool.free_in_capacity + evictable)
        if unavoidable > 0:
            try:
                pool.grow(-(-unavoidable // pool.pages_per_slab))
            except MemoryError as e:
                raise exhausted(
                    f"the arena could not grow ({e}); need {total} pages, {pool.free_in_capacity} free in "
                    f"{pool.capacity_pages} backed pages, {evictable} evictable"
                ) from None
        used_after = pool.used_pages + total
        if used_after > self._high_pages:
            self.eviction_active = True
        if self.eviction_active:
            over = used_after - self._low_pages
            if over > 0 and evictable > 0:
                self.counters.eviction_runs += 1
                if self.background is not None:
                    # The way down to the low watermark is drained by work(), off this
                    # request; inline it evicts only what it needs itself (below).
                    self.background()
                else:
                    self._evict(policy.select(over + excluded_pages), over, exclude)
            if pool.used_pages + total <= self._low_pages:
                self.eviction_active = False
        if pool.free_pages < total:
            need = total - pool.free_pages
            self._evict(policy.select(need + excluded_pages), need, exclude)
        short = total - (pool.capacity_pages - pool.used_pages)
        if short > 0:
            try:
                pool.grow(-(-short // pool.pages_per_slab))
            except MemoryError as e:
                # The backend could not grow (device memory taken by others): make room
                # inside the capacity we have instead, if the cache allows.
                inside = pool.capacity_pages - pool.used_pages
                need = total - inside
                if policy.evictable_pages - excluded_pages < need:
                    raise exhausted(
                        f"the arena could not grow ({e}); need {total} pages, {inside} free in "
                        f"{pool.capacity_pages} backed pages, {policy.evictable_pages - excluded_pages} evictable"
                    ) from None
                self._evict(policy.select(need + excluded_pages), need, exclude)

    def _exhausted_message(self, total: int, evictable: int) -> str:
        pinned_objs, pinned_pages, prepared = self._pinned_objects, self._pinned_pages, self._prepared_pages
        return (
            f"need {total} pages, {self.pool.free_pages} free, {evictable} evictable "
            f"(of {self.pool.max_pages}: {pinned_pages} pinned in {pinned_objs} objects, "
            f"{prepared} prepared); unpin or free objects, or raise the pool size"
        )

    def _evict(self, victims: list, need: int, exclude) -> None:
        freed = 0
        told: dict[int, tuple[list[int], list[bytes]]] = {}
        for obj in victims:
            if freed >= need:
                break
            if obj.object_id in exclude:
                continue
            self.policy.remove(obj)
            freed += obj.num_pages
            if obj.owner:
                ids, keys = told.setdefault(obj.owner, ([], []))
                ids.append(obj.object_id)
                if obj.key is not None:
                    keys.append(obj.key)
            self._drop(obj, "evicted")
            self.counters.evicted_objects += 1
            self.counters.evicted_pages += obj.num_pages
        for sid, (ids, keys) in told.items():
            self._notify(sid, ObjectsEvicted(ids, keys))

    @staticmethod
    def _is_evictable(obj: Allocation) -> bool:
        return obj.state == ObjectState.COMMITTED and obj.pin_count == 0 and not obj.freed

    def _publish(self, s: SessionState, obj: Allocation, pin: bool) -> tuple[Allocation, bool]:
        """Commit one prepared object; a key already present resolves to that object."""
        if obj.key is not None:
            existing = self.keys.get(obj.key)
            if existing is not None:
                s.owned.discard(obj.object_id)
                self._drop(obj, "deduplicated")
                self.counters.deduplicated_total += 1
                if pin:
                    self._pin(s, existing)
                else:
                    self.policy.touch(existing)
                return existing, True
            self.keys[obj.key] = obj
        self._prepared_pages -= obj.num_pages
        obj.state = ObjectState.COMMITTED
        obj.txn_id = 0
        if pin:
            self._pin(s, obj)
        else:
            self.policy.add(obj)
        return obj, False

    def _pinnable(self, session: int, oid: int) -> Allocation:
        obj = self._visible(session, oid)
        if obj.state == ObjectState.PREPARED:
            raise precondition(
                f"object {oid} is prepared in open transaction {obj.txn_id}; pin it at commit (ObjectSpec.pin)"
            )
        return obj

    def _visible(self, session: int, oid: int) -> Allocation:
        obj = self.objects.get(oid)
        if obj is None or obj.freed or (obj.state == ObjectState.PREPARED and obj.owner != session):
            if obj is not None and obj.freed:
                raise not_found(f"object {oid} was freed (its pages return when its last pin goes)")
            raise not_found(self._gone_message(oid) if obj is None else f"no object {oid}")
        return obj

    def _gone_message(self, oid: int) -> str:
        why = self._gone.get(oid)
        if why == "evicted":
            return f"object {oid} was evicted; allocate it again"
        if why:
            return f"object {oid} was {why}"
        return f"no object {oid}"

    def _check_pin_limit(self, s: SessionState, adding: int) -> None:
        limit = self.config.max_pins_per_session
        if not (limit and adding) or s.session_id in self.internal_sessions:
            return
        # Pins promised to open transactions (ObjectSpec.pin) are taken at commit, which does
        # not check the limit again: they count as held until the transaction ends.
        promised = sum(sum(self.open_txns[t].pin_on_commit) for t in s.txns)
        if s.pin_total + promised + adding > limit:
            held = f"{s.pin_total} pins" + (f" (and {promised} promised to open transactions)" if promised else "")
            raise exhausted(
                f"session {s.session_id} holds {held} and this call adds {adding}; "
                f"the limit is {limit} (max_pins_per_session): unpin first"
            )

    def set_watermarks(self, high: float, low: float) -> None:
        """Change the eviction watermarks of a running store (SIGHUP reload)."""
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"watermarks must satisfy 0 < low <= high <= 1; got low={low}, high={high}")
        self.config.high_watermark, self.config.low_watermark = high, low
        self._high_pages = _pages_at(high, self.pool.max_pages)
        self._low_pages = _pages_at(low, self.pool.max_pages)

    def _pin(self, s: SessionState, obj: Allocation) -> None:
        if obj.pin_count == 0:
            self.policy.remove(obj)
            self._pinned_pages += obj.num_pages
            self._pinned_objects += 1
        elif s.session_id not in obj.pins:
            self.counters.pin_contention += 1
        s.pin_total += 1
        obj.pin_count += 1
        sid = s.session_id
        obj.pins[sid] = obj.pins.get(sid, 0) + 1
        s.pins[obj.object_id] = s.pins.get(obj.object_id, 0) + 1

    def _unpin(self, s: SessionState, obj: Allocation, count: int) -> None:
        sid = s.session_id
        left = obj.pins[sid] - count
        if left:
            obj.pins[sid] = left
            s.pins[obj.object_id] = left
        else:
            del obj.pins[sid]
            del s.pins[obj.object_id]
        obj.pin_count -= count
        s.pin_total -= count
        if obj.pin_count == 0:
            self._became_unpinned(obj)

    def _became_unpinned(self, obj: Allocation) -> None:
        self._pinned_pages -= obj.num_pages
        self._pinned_objects -= 1
        if obj.freed:
            self._drop(obj, "freed")
        else:
            self.policy.add(obj)

    def _free_one(self, obj: Allocation) -> bool:
        """Free an object now, or when its last pin goes. True if freed now."""
        if obj.key is not None and self.keys.get(obj.key) is obj:
            del self.keys[obj.key]
        if obj.pin_count:
            obj.freed = True
            return False
        self.policy.remove(obj)
        self._drop(obj, "freed")
        return True

    def _account(self, obj: Allocation, sign: int) -> None:
        """Add (sign 1) or take away (sign -1) an object's share of the running figures."""
        n = sign * obj.num_pages
        ct = int(obj.content_type)
        c = self._by_content.get(ct)
        if c is None:
            c = self._by_content[ct] = [0, 0]
        c[0] += sign
        c[1] += n
        if not c[0]:
            del self._by_content[ct]
        key = (obj.owner, ct)
        o = self._by_owner.get(key)
        if o is None:
            o = self._by_owner[key] = [0, 0]
        o[0] += sign
        o[1] += n
        if not o[0]:
            del self._by_owner[key]
        if obj.state == ObjectState.PREPARED:
            self._prepared_pages += n
        elif obj.pin_count:
            self._pinned_pages += n
            self._pinned_objects += sign

    def _set_owner(self, obj: Allocation, owner: int) -> None:
        ct = int(obj.content_type)
        o = self._by_owner[(obj.owner, ct)]
        o[0] -= 1
        o[1] -= obj.num_pages
        if not o[0]:
            del self._by_owner[(obj.owner, ct)]
        obj.owner = owner
        o = self._by_owner.get((owner, ct))
        if o is None:
            o = self._by_owner[(owner, ct)] = [0, 0]
        o[0] += 1
        o[1] += obj.num_pages

    def _drop(self, obj: Allocation, why: str) -> None:
        """Forget an object and return its pages and window range."""
        oid = obj.object_id
        del self.objects[oid]
        self._account(obj, -1)
        if obj.key is not None and self.keys.get(obj.key) is obj:
            del self.keys[obj.key]
        if obj.owner:
            s = self.sessions.get(obj.owner) or self._ending.get(obj.owner)
            if s is not None:
                s.owned.discard(oid)
        if obj.window_page >= 0:
            self.window.release(obj.window_page, obj.num_pages)
        self.pool.give_back(obj.pages)
        self._gone[oid] = why

    def _rollback(self, t: Transaction, state: TxnState) -> int:
        s = self.sessions.get(t.session)
        freed = 0
        for obj in t.objects:
            if s is not None:
                s.owned.discard(obj.object_id)
            freed += obj.num_pages
            self._drop(obj, "aborted")
        for oid in t.pinned:
            # The session may have dropped the prepare-time pin itself already.
            if s is not None and s.pins.get(oid, 0) > 0:
                self._unpin(s, self.objects[oid], 1)
        if s is not None:
            s.txns.discard(t.txn_id)
        t.state = state
        self._finish(t)
        return freed

    def _finish(self, t: Transaction) -> None:
        self.open_txns.pop(t.txn_id, None)
        s = self.sessions.get(t.session)
        if s is not None:
            s.txns.discard(t.txn_id)
        self._finished_txns[t.txn_id] = t

    def _own_txn(self, session: int, txn_id: int) -> Transaction:
        t = self.open_txns.get(txn_id) or self._finished_txns.get(txn_id)
        if t is None:
            raise not_found(f"no transaction {txn_id} (unknown, or finished too long ago to remember)")
        if t.session != session:
            raise denied(f"transaction {txn_id} belongs to another session")
        return t
