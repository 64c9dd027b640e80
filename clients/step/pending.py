"""What a step got (``StepOutcome``), and a step the client sent and has not read the answer of yet: ``StepPath.begin``'s ``PendingStep``
(with the ``_Plan`` its reply is matched against) (a running batch's ``PendingDelta`` is ``delta.py``'s).

Each pending step reads its reply once, under the lock of the ``StepPath`` that sent it
(``path.py``, passed in as ``path``), and hands it back to that path to account; nothing here
decides what a reply means.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memory_broker.proto.wire import step as w


@dataclass(slots=True)
class StepOutcome:
    """What one ``StepPath.step`` got: records the client turns into a lease and objects."""

    # Admitted adapter ids, in request order, with their records; None when no acquire was
    # asked. ``acquire_hot`` False: a broker older than this client did not acquire them.
    adapters: list[tuple[str, w.AcquiredRecord]] | None = None
    deferred: list[str] = field(default_factory=list)
    acquire_hot: bool = True
    txn_id: int = 0
    objects: list[w.ObjectRecord] | None = None
    arena_slabs: int = 0
    # Round trips this step took (0: all from the cache).
    round_trips: int = 0


@dataclass(slots=True)
class _Plan:
    """A step's frame and what its reply is matched against."""

    out: StepOutcome
    ops: list
    now: float
    caching: bool
    acq_index: int
    look_index: int
    admitted: list
    missing_ids: list
    ids: list | None
    keys: list | None
    pin_keys: bool
    # Cached adapters this step took references on (given back if it fails).
    held: dict
    # Ops of the caller (the idle releases come after them).
    own: int


class PendingStep:
    """A step sent by ``StepPath.begin``; ``result()`` reads its reply (once)."""

    def __init__(self, path, plan: _Plan):
        self._path = path
        self._plan = plan
        self._reply: w.StepReply | None = None
        self._reply_done = False
        self._outcome: StepOutcome | None = None
        self._error: BaseException | None = None

    @property
    def sent(self) -> bool:
        """Whether this step sent a frame (False: the cache had all of it)."""
        return bool(self._plan.ops)

    def _collect(self) -> None:
        """Read this step's reply off the socket and account it in the cache at once (the
        path's lock is held), so later steps see what it took even before ``result()``."""
        path = self._path
        path._pending = None
        self._reply_done = True
        try:
            self._reply = path.transport.reply()
            self._outcome = path._finish(self._plan, self._reply)
        except BaseException as e:
            self._error = e

    def result(self) -> StepOutcome:
        """The step's outcome; raises its BrokerError as ``step`` would. Call it once for
        every ``begin`` (what the step took is the caller's until it releases it)."""
        path = self._path
        with path.lock:
            if self._outcome is None and self._error is None:
                if not self._reply_done:
                    self._collect()
                elif self._reply is None:  # nothing was sent: all from the cache
                    try:
                        self._outcome = path._finish(self._plan, None)
                    except BaseException as e:
                        self._error = e
            if self._error is not None:
                raise self._error
            return self._outcome
