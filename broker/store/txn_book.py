"""The book of transactions: ids, the open ones with their lease deadlines, and the recently
finished ones, so that a retried commit or abort finds its answer.

``TransactionBook`` only records and looks up; ``transactions.Transactions`` drives a
transaction through its states.
"""

from __future__ import annotations

import heapq
import itertools

from memory_broker.broker.store.records import Allocation, Recent, Transaction, TxnState
from memory_broker.proto.wire.errors import denied, not_found

# Entries of finished transactions the deadline heap may carry beyond twice the open ones.
STALE_SLACK = 1024


class TransactionBook:
    """Open and recently finished transactions.

    Args:
        remember: how many finished transactions, with a committed one's objects counted
            too, are kept for idempotent commit/abort.
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
        """Close a transaction (its state already set) and remember it; an aborted or
        expired one without its objects (they are gone: a retried abort reads its state only)."""
        self.open.pop(t.txn_id, None)
        if t.state is not TxnState.COMMITTED:
            t.objects = t.pin_on_commit = t.pinned = ()
        # Weighed by its objects (a committed one keeps its result for a retried commit): the
        # book keeps about ``remember`` transactions and objects in all, however large each.
        self._finished.add(t.txn_id, t, 1 + len(t.result))
        heap = self._deadlines
        if len(heap) > 2 * len(self.open) + STALE_SLACK:
            # Mostly entries of transactions that ended before their lease (they surface only
            # when every earlier deadline has: one long lease holds back all behind it): keep
            # the open ones' alone, at a cost the finishes since the last rebuild paid for.
            self._deadlines = heap = [(o.deadline, tid) for tid, o in self.open.items()]
            heapq.heapify(heap)

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
