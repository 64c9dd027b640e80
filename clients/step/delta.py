"""A running batch's change on the step path: ``send_delta`` sends it (at most one frame),
``PendingDelta`` reads its reply and makes it into records.

The work is proportional to the change (no cap, no prepare: the batch, ``batch.py``, counts
itself). The functions take the ``StepPath`` (``path.py``) the change goes through.
"""

from __future__ import annotations

from memory_broker.clients.step.path import SentFrame, not_answered
from memory_broker.proto.wire import step as w


class PendingDelta(SentFrame):
    """A change sent by ``send_delta``; ``result()`` reads its reply (once)."""

    __slots__ = ("acquire", "acq", "look", "sent", "_out")

    def __init__(self, path, acquire: list[str], acq: int, look: int, sent: bool):
        super().__init__(path)
        self.acquire, self.acq, self.look = acquire, acq, look
        # Whether a frame went out (False: the change asked nothing of the broker).
        self.sent = sent
        self._done = not sent
        self._out = None

    def collect(self) -> None:
        """Read the reply now if no call of the path has (a failure is kept: ``result()``
        raises it)."""
        with self._path.lock:
            if not self._done:
                self._collect()

    def result(self):
        """(adapter records in ``acquire`` order as [(id, record)], or None: no acquire;
        object records of the found prefix; arena slabs). Raises the change's refusal."""
        if self._out is None:
            reply = self.reply() if self.sent else None
            self._out = _finish(self, reply)
        return self._out


def send_delta(path, acquire: list[str], release: list[str], keys: list[bytes], unpin: list[int]) -> PendingDelta:
    """A running batch's change (``StepBatch``): acquire ``acquire`` (distinct ids), give back
    ``release``, look up and pin the longest present prefix of ``keys``, unpin ``unpin``.
    At most one frame, sent now; ``PendingDelta.result()`` reads its reply."""
    ops: list = []
    if release:
        ops.append((w.OP_RELEASE, tuple(release)))
    if unpin:
        ops.append((w.OP_UNPIN, tuple(unpin)))
    acq = look = -1
    if acquire:
        acq = len(ops)
        ops.append((w.OP_ACQUIRE, tuple(acquire)))
    if keys:
        look = len(ops)
        ops.append((w.OP_LOOKUP, tuple(keys), 1))
    p = PendingDelta(path, acquire, acq, look, bool(ops))
    if ops:
        path.begin(ops, p)
    return p


def _finish(p: PendingDelta, reply: w.StepReply | None):
    """``PendingDelta.result``'s records; what a refused change acquired is given back."""
    if reply is None:
        return None, [], 0
    results = reply.results
    r = results[p.acq] if 0 <= p.acq < len(results) else None
    if reply.error is not None:
        if r is not None and r.hot:
            p._path.undo_acquire(p.acquire, r)
        raise reply.error
    recs = None
    if p.acquire:
        if r is None or not r.hot:
            raise not_answered()
        recs = list(zip(p.acquire, r.adapters))
    new: list = results[p.look] if 0 <= p.look < len(results) else []
    return recs, new, reply.arena_slabs
