"""Prepare/commit transactions: the two-phase operations (prepare, commit, abort, lease
expiry) on the records of the ``TransactionBook`` (``txn_book``).

``Transactions`` drives a transaction through its states using the ``Allocator``'s steps
(``reserve``, ``publish``), the object table and the pin ledger; it never checks sessions or
batch sizes (the store does, first) and never makes room itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from memory_broker.broker.store.context import StoreContext
from memory_broker.broker.store.object_table import check_specs, check_unique
from memory_broker.broker.store.pins import PinLedger
from memory_broker.broker.store.records import SessionState, Transaction, TransactionsExpired, TxnState
from memory_broker.broker.store.room import Allocator
from memory_broker.proto.wire.errors import invalid, precondition
from memory_broker.proto.wire.spec import Spec


class Transactions:
    """Prepare under a lease, then commit or abort; expiry when the lease ends.

    The store checks the session and the batch size and hands the rest here; allocation
    itself is the ``Allocator``'s (``reserve`` takes pages for PREPARED objects, ``publish``
    commits one), so that a one-step Allocate and a commit publish the same way.

    Args:
        ctx: the store's shared record: the transaction book (``txns``), the object table
            (drops prepared objects on rollback), the open sessions, the config (leases, key
            size; read at each call: it may be reconfigured), the pool (``max_pages`` bounds
            a batch), ``notify`` (for TransactionsExpired) and the clock.
        ledger: pins (prepare-time pins, and their release on rollback).
        allocator: the allocation steps.
    """

    def __init__(self, ctx: StoreContext, ledger: PinLedger, allocator: Allocator):
        self.book = ctx.txns
        self._table = ctx.table
        self._ledger = ledger
        self._sessions = ctx.sessions
        self._config = ctx.config
        self._max_pages = ctx.pool.max_pages
        self._allocator = allocator
        self._notify = ctx.notify
        self._clock = ctx.clock

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
        new = self._allocator.reserve(s, specs, {o.object_id for o in to_pin}, total)
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
        that returns the same result (in another call: one lists each transaction once)."""
        if len(txn_ids) > 1:
            check_unique(txn_ids, "transaction_ids")  # each would answer all its records again
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
            t.result = [self._allocator.publish(s, obj, pin) for obj, pin in zip(t.objects, t.pin_on_commit)]
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
