"""A session's step calls: one calls object per session, and the give-backs it posts.

``StepSession`` sits between the session's asking RPCs (``queries.py``) and ``BrokerClient``
(``client.py``): it keeps the current session's calls object (``calls.choose_calls``:
``ChannelCalls`` or ``GrpcCalls``), chosen on first use and again for a new
session or a broken step channel. A call over another channel (gRPC, the fd channel) first
reads a begun step's reply (``BrokerSession._settle``, through ``_calls``).
"""

from __future__ import annotations

import logging
import os
import threading

from memory_broker.clients.queries import BrokerQueries
from memory_broker.clients.step.calls import choose_calls
from memory_broker.clients.step.channel import ChannelCalls
from memory_broker.clients.step.grpc_calls import GrpcCalls
from memory_broker.clients.step.path import StepPath

log = logging.getLogger(__name__)
# Whether ``hold_s`` was said to be ignored (once a process).
_said_hold_s = False


class StepSession(BrokerQueries):
    """A session's step calls (``BrokerClient`` is one; its ``connect`` says what the
    keywords do)."""

    def __init__(self, *args, fast_path: bool = True, hold_s: float = 0.0, post_give_backs: bool = True, **kwargs):
        # Step calls over the step channel when the broker has one.
        self.fast_path = fast_path
        if hold_s > 0:
            _ignore_hold_s(hold_s)
        # (``post_give_backs`` is no longer used: every give-back waits for its answer.)
        # The current session's calls (ChannelCalls or GrpcCalls), made on first use.
        self._calls: ChannelCalls | GrpcCalls | None = None
        self._calls_lock = threading.Lock()
        # Why the step channel could not be used the last time a session fell back to gRPC
        # (None: it never did); the first fallback is logged at WARNING.
        self.step_fallback: str | None = None
        super().__init__(*args, **kwargs)

    def _step_calls(self, wait_sent: bool = True) -> ChannelCalls | GrpcCalls:
        """The current session's step calls (``calls.choose_calls``: chosen on first use,
        again for a new session or a broken step channel). First waits for the changes a
        background step batch queued (``wait_sent``; its own worker does not)."""
        if wait_sent and self._unsent:
            self._wait_sent()
        calls = self._calls
        if calls is None or not calls.current(self.epoch):
            calls = choose_calls(self)
        return calls

    def _step_path(self, wait_sent: bool = True) -> StepPath | None:
        """The current session's step path (None: its step calls go over gRPC)."""
        return self._step_calls(wait_sent).path

    def _step_socket(self) -> str:
        fd = self.arena.fd_socket_path
        if fd.endswith(".fds"):
            return fd[: -len(".fds")] + ".step"
        return os.path.abspath(self.socket_path) + ".step"

    def flush(self) -> None:
        """Wait until the broker has answered everything this session sent on its step
        channel (a begun step's reply is read, kept for its ``result()``). Every give-back
        waits for its own answer, so there is nothing else to wait for."""
        self._settle()

    def _end_session(self) -> None:
        if self._calls is not None:
            self._calls.close()  # reads a begun step's reply first
        super()._end_session()


def _ignore_hold_s(hold_s: float) -> None:
    global _said_hold_s
    if not _said_hold_s:
        _said_hold_s = True
        log.warning(
            "connect(hold_s=%s) is ignored: the step path's holdings cache was removed (each step call is one "
            "frame to the broker; the cache's gain did not show in an engine's step)",
            hold_s,
        )
