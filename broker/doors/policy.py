"""Who may call what, through either front door: the ``POLICY`` table.

This module owns the access rules as data, one ``Rule`` per RPC: whether it needs a session,
which request fields name objects the session must see, whether it changes state, needs an
adapter-manager uid, or is served on the TCP listener. ``SessionManager.authorize`` (in
``broker.sessions.manager``) enforces a rule, transport-neutral: the gRPC servicer calls it for
every call and the step channel for every op of a frame (each op under the RPC it stands for),
so a rule added here holds at both doors. What is the transport's own stays there: the gRPC
door reads the token from the metadata and refuses the TCP listener's calls; the step channel
binds its session once, at HELLO.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


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
    "VerifyObjects": Rule(session=True, writes=True),
    # Engines' own KV cache (engine_rpcs.py): the engine's own groups only.
    "EngineKvRegister": Rule(session=True, writes=True),
    "EngineKvGrow": Rule(session=True, writes=True),
    "EngineKvShrink": Rule(session=True, writes=True, owns="groups (its own)"),
}


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
