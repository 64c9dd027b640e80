"""Who may call what, through either front door (the ``POLICY`` table and ``DoorPolicy``).

This module owns the access rules as data, one ``Rule`` per RPC: whether it needs a session,
which request fields name objects the session must see, whether it changes state, needs an
adapter-manager uid, or is served on the TCP listener. ``DoorPolicy.authorize`` enforces them,
transport-neutral: the gRPC servicer calls it for every call and the step channel for every
op of a frame (each op under the RPC it stands for), so a rule added here holds at both doors.
What is the transport's own stays there: the gRPC door reads the token from the metadata and
refuses the TCP listener's calls; the step channel binds its session once, at HELLO.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from memory_broker.proto.wire.errors import BrokerError, Code, denied, unavailable


@dataclass(frozen=True, slots=True)
class Rule:
    """Who may call one RPC."""

    # Needs a session token ("x-broker-session"); the handler gets the Session.
    session: bool
    # Changes broker state (False: read-only, as any session may).
    writes: bool
    # Request fields naming objects the session must be able to see: keyed committed objects
    # are anyone's, anonymous ones only their owner's (and those the session already pins,
    # and broker-owned ones such as adapter pages). Invisible ids answer NOT_FOUND, as
    # unknown ids do, so ids cannot be probed.
    visible: tuple[str, ...] = ()
    # What else the core checks against the session (documentation: enforced there).
    owns: str = ""
    # Needs a session owned by a uid in adapters.manager_uids.
    manage: bool = False
    # Served on the TCP listener, which has no peer credentials.
    tcp: bool = False


POLICY: dict[str, Rule] = {
    "Attach": Rule(session=False, writes=True),
    "GetArena": Rule(session=False, writes=False, tcp=True),
    "GetStats": Rule(session=False, writes=False, tcp=True),
    "Allocate": Rule(session=True, writes=True),
    "Prepare": Rule(session=True, writes=True, visible=("pin_object_ids",)),
    "Commit": Rule(session=True, writes=True, owns="transactions"),
    "Abort": Rule(session=True, writes=True, owns="transactions"),
    "Free": Rule(session=True, writes=True, owns="objects"),
    "Pin": Rule(session=True, writes=True, visible=("object_ids",)),
    "Unpin": Rule(session=True, writes=True, owns="pins"),
    "Lookup": Rule(session=True, writes=True),
    "RegisterAdapter": Rule(session=True, writes=True, manage=True),
    "UnregisterAdapter": Rule(session=True, writes=True, manage=True),
    "PrefetchAdapters": Rule(session=True, writes=True, manage=True),
    "ListAdapters": Rule(session=True, writes=False),
    "GetAdapterLayout": Rule(session=True, writes=False),
    "AcquireAdapters": Rule(session=True, writes=True, owns="pins (its own)"),
    "ReleaseAdapters": Rule(session=True, writes=True, owns="pins"),
    # Any session: it only drops copies that fail their checksum (reloaded on next acquire).
    "VerifyAdapters": Rule(session=True, writes=True),
}


class _Caller(Protocol):
    uid: int


class _Session(Protocol):
    """What the policy reads of a session (``broker.sessions.manager.Session``)."""

    session_id: int
    closed: bool
    # The peer proven on the fd or step channel; None until then.
    caller: _Caller | None


class _Store(Protocol):
    def check_visible(self, session_id: int, ids: Sequence[int]) -> None: ...


NO_FIELDS: Callable[[str], Sequence[int]] = lambda field: ()  # noqa: E731 (a constant)


class DoorPolicy:
    """The access policy of both front doors: one ``authorize`` per call or step op.

    It holds the facts the rules read that are not the store's: whether the broker is
    draining, and which uids may manage adapters. It never changes the core."""

    def __init__(self, store: _Store, manager_uids: frozenset[int] | None = None):
        self.store = store
        # Set on SIGTERM: every call and step is refused UNAVAILABLE from then on.
        self.draining = False
        # Uids whose sessions may register, unregister and prefetch adapters (None: any).
        self.manager_uids: frozenset[int] | None = frozenset({os.getuid()}) if manager_uids is None else manager_uids

    def check_open(self) -> None:
        """UNAVAILABLE once the broker is draining."""
        if self.draining:
            raise unavailable("the broker is shutting down; retry on its successor")

    def check_session(self, session: _Session | None, what: str) -> None:
        """What every session-bearing call needs: an open broker, and a session that has not
        ended (the step channel checks a whole frame with this, then each op)."""
        self.check_open()
        if session is None:
            raise denied(f"{what} needs a session: Attach first and present its token")
        if session.closed:
            raise denied(f"session {session.session_id} has ended; open a new session with Attach")

    def authorize(self, method: str, session: _Session | None, ids: Callable[[str], Sequence[int]] = NO_FIELDS) -> None:
        """Enforce ``POLICY[method]`` for ``session`` (None: the call presented none).

        ``ids(field)`` gives the object ids the request names in one of the rule's
        ``visible`` fields. Raises BrokerError: UNAVAILABLE while draining, PERMISSION_DENIED
        without a session, for an ended one or a uid that may not manage adapters, NOT_FOUND
        for an id the session may not see."""
        rule = POLICY[method]
        if not rule.session:
            self.check_open()
            return
        self.check_session(session, method)
        if rule.manage:
            self._check_manager(session, method)
        for field in rule.visible:
            self.store.check_visible(session.session_id, ids(field))

    def _check_manager(self, s: _Session, method: str) -> None:
        if s.caller is None:
            raise BrokerError(
                Code.PERMISSION_DENIED,
                f"{method} needs to know the caller's uid, and session {s.session_id} has not presented its token "
                "on the fd channel yet (BrokerClient.connect does it); connect with the client library",
            )
        if self.manager_uids is not None and s.caller.uid not in self.manager_uids:
            raise BrokerError(
                Code.PERMISSION_DENIED,
                f"uid {s.caller.uid} may not manage adapters (adapters.manager_uids: {sorted(self.manager_uids)}); "
                "it may list and acquire them",
            )


# The call being served, for its log lines: (rpc name, session id or None). One ContextVar
# set per call (cheaper than binding structlog context vars key by key); ``merge_call``,
# a structlog processor installed by broker.server.logs, adds it to every event.
CALL: ContextVar[tuple[str, int | None] | None] = ContextVar("memory_broker_call", default=None)


def merge_call(logger, method_name, event: dict) -> dict:
    call = CALL.get()
    if call is not None:
        event.setdefault("rpc", call[0])
        if call[1] is not None:
            event.setdefault("session", call[1])
    return event
