"""The client's step path: one session's step socket, one caller at a time, one frame a call.

``StepTransport`` (``transport.py``) is a blocking Unix socket to the broker's step channel
(the frames of ``memory_broker.proto.wire.step``, authenticated by the session token and this
process's credentials). ``StepPath`` sits on it for one session: it sends frames of ops (tuples
of an ``Op``'s fields, or ``Op``s) and reads their replies: awaited (``send``), or begun and
read later (``begin``: at most one at a time, read before the next frame). Every step call is
one frame to the broker: nothing is kept here between calls. This module knows nothing of gRPC, mappings or tensors
(``channel.py``'s ``ChannelCalls`` turns records into leases and objects).
"""

from __future__ import annotations

import threading

from memory_broker.clients.step.transport import StepTransport, StepUnavailable
from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.errors import BrokerError, Code

__all__ = ["SentFrame", "StepPath", "StepTransport", "StepUnavailable", "not_answered"]


def not_answered() -> BrokerError:
    """An acquire answered "not hot" (a broker older than this client: it loads over gRPC only)."""
    return BrokerError(
        Code.FAILED_PRECONDITION,
        "the broker answered an acquire on its step channel without acquiring (a broker older than this "
        "client); upgrade the broker, or connect with fast_path=False",
    )


class StepPath:
    """One session's step socket and the frames on it (``lock``: one caller at a time)."""

    def __init__(self, transport: StepTransport):
        self.transport = transport
        # Reentrant: a call holds it while it sends; one caller at a time on the socket.
        self.lock = threading.RLock()
        # Frames sent (what tests and the benchmark count round trips by).
        self.frames = 0
        # A frame sent by ``begin`` (or a batch's change) whose reply is not read yet (at most one).
        self._pending = None

    def send(self, ops: list) -> w.StepReply:
        """One frame and its reply (after the reply of a frame begun earlier)."""
        data = w.encode_step(ops)
        with self.lock:
            if self._pending is not None:
                self._pending._collect()
            self.frames += 1
            return self.transport.request(data)

    def begin(self, ops: list, pending: SentFrame | None = None) -> SentFrame:
        """A frame sent now, its reply read by ``SentFrame.reply()`` (or before the session's
        next frame): the round trip overlaps what the caller does in between."""
        data = w.encode_step(ops)
        sent = pending if pending is not None else SentFrame(self)
        with self.lock:
            if self._pending is not None:
                self._pending._collect()
            self.frames += 1
            self.transport.send(data)
            self._pending = sent
        return sent

    def settle(self) -> None:
        """Read a begun frame's reply now (kept for it)."""
        with self.lock:
            if self._pending is not None:
                self._pending._collect()

    def undo_acquire(self, admitted: list[str], r: w.AcquireOutcome) -> None:
        """A later op of the frame failed: give back what its acquire took (the caller gets
        the error, not a lease)."""
        op = (w.OP_ABORT, (r.txn_id,)) if r.txn_id else (w.OP_RELEASE, tuple(admitted))
        try:
            self.send([op])
        except (BrokerError, StepUnavailable):
            pass  # the session is gone, and its pins with it


class SentFrame:
    """A frame ``StepPath.begin`` sent: its reply read once, by ``reply()`` or before the
    session's next frame (the path's ``_pending``, whose ``_collect`` this has)."""

    __slots__ = ("_path", "_reply", "_error", "_done")

    def __init__(self, path: StepPath):
        self._path = path
        self._reply: w.StepReply | None = None
        self._error: BaseException | None = None
        self._done = False

    def _collect(self) -> None:
        """Read the reply off the socket (the path's lock is held)."""
        self._path._pending = None
        self._done = True
        try:
            self._reply = self._path.transport.reply()
        except BaseException as e:
            self._error = e

    def reply(self) -> w.StepReply:
        with self._path.lock:
            if not self._done:
                self._collect()
        if self._error is not None:
            raise self._error
        return self._reply
