"""Prepare/commit transactions: the book of their records (ids, open ones with their lease
deadlines, recently finished ones so a retried commit or abort finds its answer) and the
two-phase operations on them (prepare, commit, abort, lease expiry).

``TransactionBook`` only records and looks up. ``Transactions`` drives a transaction through
its states using the store's allocation steps (``reserve``, ``publish``), the object table
and the pin ledger; it never checks sessions or batch sizes (the store does, first) and
never makes room itself.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from memory_broker.broker.store.object_table import check_specs
from memory_broker.broker.store.records import (
    Allocation,
    Recent,
    SessionState,
    Spec,
    StoreConfig,
    Transaction,
    TransactionsExpired,
    TxnState,
)
from memory_broker.proto.wire.errors import denied, invalid, not_found, precondition

if TYPE_CHECKING:
    from memory_broker.broker.store.object_table import ObjectTable
    from memory_broker.broker.store.pins import PinLedger


class TransactionBook:
    """Open and recently finished transactions.

    Args:
        remember: how many finished transactions are kept for idempotent commit/abort.
    """

    def __init__(self, remember: int):
        self.open: dict[int, Transaction] = {}
        # (deadline, txn id) of open transactions, so expiry and the next deadline cost
        # O(log n) instead of a walk of every open transaction; entries of transactions that
        # ended early are skipped when they surface.
        self._deadlines: list[tuple[float, int]] = []
        self._finished: Recent = Recent(remember)
        self._ids = itertools.count(1)

    def begin(
        self,
        session: int,
        objects: list[Allocation],
        pin_on_commit: list[bool],
        pinned: list[int],
        deadline: float,
        deadline_unix: float,
    ) -> Transaction:
        """Open a transaction holding ``objects`` (marked with its id) until ``deadline``."""
        txn_id = next(self._ids)
        for obj in objects:
            obj.txn_id = txn_id
        txn = Transaction(
            txn_id=txn_id,
            session=session,
            deadline=deadline,
            deadline_unix=deadline_unix,
            objects=objects,
            pin_on_commit=pin_on_commit,
            pinned=pinned,
        )
        self.open[txn_id] = txn
        heapq.heappush(self._deadlines, (deadline, txn_id))
        return txn

    def finish(self, t: Transaction) -> None:
        """Close a transaction (its state already set) and remember it."""
        self.open.pop(t.txn_id, None)
        self._finished[t.txn_id] = t

    def owned(self, session: int, txn_id: int) -> Transaction:
        """The session's transaction, open or recently finished.

        Raises:
            BrokerError: NOT_FOUND if unknown or forgotten, PERMISSION_DENIED if another
                session's.
        """
        t = self.open.get(txn_id) or self._finished.get(txn_id)
        if t is None:
            raise not_found(f"no transaction {txn_id} (unknown, or finished too long ago to remember)")
        if t.session != session:
            raise denied(f"transaction {txn_id} belongs to another session")
        return t

    def due(self, now: float) -> list[Transaction]:
        """Open transactions whose lease has ended by ``now``, by id (still open: the caller
        ends them)."""
        heap, open_txns = self._deadlines, self.open
        late = []
        while heap and heap[0][0] <= now:
            _, tid = heapq.heappop(heap)
            t = open_txns.get(tid)
            if t is not None and t.deadline <= now:
                late.append(t)
        late.sort(key=lambda t: t.txn_id)
        return late

    def next_deadline(self) -> float | None:
        heap, open_txns = self._deadlines, self.open
        while heap and heap[0][1] not in open_txns:
            heapq.heappop(heap)  # finished before its lease ended
        return heap[0][0] if heap else None

    def promised_pins(self, txn_ids: set[int]) -> int:
        """Pins these open transactions will take at commit (ObjectSpec.pin)."""
        return sum(sum(self.open[t].pin_on_commit) for t in txn_ids)


Reserve = Callable[[SessionState, Sequence[Spec], Collection[int], int], list[Allocation]]
Publish = Callable[[SessionState, Allocation, bool], tuple[Allocation, bool]]


class Transactions:
    """Prepare under a lease, then commit or abort; expiry when the lease ends.

    The store checks the session and the batch size and hands the rest here; allocation
    itself stays the store's (``reserve`` takes pages for PREPARED objects, ``publish``
    commits one), so that a one-step Allocate and a commit publish the same way.

    Args:
        book: the transaction records.
        table: the store's objects (drops prepared objects on rollback).
        ledger: pins (prepare-time pins, and their release on rollback).
        sessions: the store's open sessions by id.
        config: leases, key size (read at each call: it may be reconfigured).
        max_pages: most pages the arena may hold (a batch's bound).
        reserve, publish: the store's allocation steps.
        notify: ``notify(session_id, event)`` for TransactionsExpired.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        book: TransactionBook,
        table: ObjectTable,
        ledger: PinLedger,
        sessions: dict[int, SessionState],
        config: StoreConfig,
        max_pages: int,
        reserve: Reserve,
        publish: Publish,
        notify: Callable[[int, object], None],
        clock: Callable[[], float],
    ):
        self.book = book
        self._table = table
        self._ledger = ledger
        self._sessions = sessions
        self._config = config
        self._max_pages = max_pages
        self._reserve = reserve
        self._publish = publish
        self._notify = notify
        self._clock = clock

    def prepare(
        self, s: SessionState, specs: Sequence[Spec], pin_ids: Sequence[int], lease_s: float | None
    ) -> Transaction:
        """Reserve a batch (PREPARED objects, pins on committed objects) under a lease."""
        config = self._config
        if lease_s is None or lease_s == 0:
            lease_s = config.default_lease_s
        if not 0 < lease_s <= config.max_lease_s:
            raise invalid(f"lease of {lease_s:g} s is out of range; allowed 0 < lease <= {config.max_lease_s:g} s")
        total, _ = check_specs(specs, self._max_pages, config.max_key_bytes)
        session = s.session_id
        to_pin = [self._table.pinnable(session, oid) for oid in pin_ids]
        self._ledger.check_limit(s, len(to_pin) + sum(1 for sp in specs if sp.pin))
        new = self._reserve(s, specs, {o.object_id for o in to_pin}, total)
        for obj in to_pin:
            self._ledger.pin(s, obj)
        txn = self.book.begin(
            session,
            new,
            pin_on_commit=[sp.pin for sp in specs],
            pinned=[o.object_id for o in to_pin],
            deadline=self._clock() + lease_s,
            deadline_unix=time.time() + lease_s,
        )
        s.txns.add(txn.txn_id)
        return txn

    def commit(self, s: SessionState, txn_ids: Sequence[int]) -> list[Transaction]:
        """Make prepared batches visible. Committing a committed transaction is a no-op
        that returns the same result."""
        txns = [self.book.owned(s.session_id, t) for t in txn_ids]
        now = self._clock()
        late = [t for t in txns if t.state == TxnState.OPEN and t.deadline <= now]
        if late:
            self.expire(now)
            raise precondition(f"transaction {late[0].txn_id} expired before commit (its lease ended); prepare again")
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
        txns = [self.book.owned(session, t) for t in txn_ids]
        for t in txns:
            if t.state == TxnState.COMMITTED:
                raise precondition(f"transaction {t.txn_id} is already committed; free its objects instead")
        freed = 0
        for t in txns:
            if t.state == TxnState.OPEN:
                freed += self.rollback(t, TxnState.ABORTED)
        return freed

    def expire(self, now: float | None = None) -> list[int]:
        """Abort every open transaction whose lease has ended; tell their sessions."""
        now = self._clock() if now is None else now
        late = self.book.due(now)
        by_session: dict[int, list[int]] = {}
        for t in late:
            self.book.open.pop(t.txn_id)
            self.rollback(t, TxnState.EXPIRED)
            by_session.setdefault(t.session, []).append(t.txn_id)
        for sid, ids in by_session.items():
            self._notify(sid, TransactionsExpired(ids))
        return [t.txn_id for t in late]

    def rollback(self, t: Transaction, state: TxnState) -> int:
        """Drop a transaction's prepared objects and prepare-time pins; returns pages freed."""
        s = self._sessions.get(t.session)
        freed = 0
        for obj in t.objects:
            if s is not None:
                s.owned.discard(obj.object_id)
            freed += obj.num_pages
            self._table.drop(obj, "aborted")
        for oid in t.pinned:
            # The session may have dropped the prepare-time pin itself already.
            if s is not None and s.pins.get(oid, 0) > 0:
                self._ledger.unpin(s, self._table.objects[oid], 1)
        if s is not None:
            s.txns.discard(t.txn_id)
        t.state = state
        self._finish(t)
        return freed

    def _finish(self, t: Transaction) -> None:
        self.book.finish(t)
        s = self._sessions.get(t.session)
        if s is not None:
            s.txns.discard(t.txn_id)
