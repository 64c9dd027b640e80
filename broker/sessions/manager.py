"""Client sessions: tokens, event queues, the process each belongs to, and how it ends.

A session is opened by the Attach stream; the first process to present its token on the fd
channel becomes its owner (uid, gids and pid by SO_PEERCRED) and any other process
presenting it is refused, so one process's exit never ends another's session. The session
ends when the stream ends or the owner dies (its pidfd fires); the object store then
releases what it held. Sessions are bounded in all and per uid. No allocation state here.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from memory_broker.broker.adapters.access import Caller
from memory_broker.broker.sessions.liveness import PidWatcher
from memory_broker.broker.sessions.peer import FdRequestRefused, PeerCred
from memory_broker.broker.store.objects import ObjectStore
from memory_broker.proto.wire.errors import BrokerError, Code, denied, unavailable
from memory_broker.proto.wire.session import SESSION_METADATA

# Placed on a session's queue to end its stream.
CLOSED = object()
# ``ids`` for a call that names no objects in a rule's ``visible`` fields.
NO_FIELDS: Callable[[str], Sequence[int]] = lambda field: ()  # noqa: E731 (a constant)


class Rule(Protocol):
    """What ``authorize`` reads of a door's rule (``broker.doors.policy.Rule``)."""

    session: bool
    manage: bool
    visible: tuple[str, ...]


@dataclass(slots=True, eq=False)
class Session:
    session_id: int
    # Secret presented as gRPC metadata and to the fd channel.
    token: str
    client_name: str
    # Pid the client claimed in Hello (advisory).
    claimed_pid: int
    opened_at: float
    # Events for the Attach stream (core events, or CLOSED).
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Processes (by SO_PEERCRED) that fetched fds for this session; watched by pidfd.
    peer_pids: set[int] = field(default_factory=set)
    uid: int | None = None
    # The owning process, set when it first presents the token on the fd channel (its
    # uid/gids bound what the broker reads for it); None until then.
    caller: Caller | None = None
    closed: bool = False


class SessionManager:
    """Open sessions by token and by id; ends them exactly once."""

    def __init__(
        self,
        store: ObjectStore,
        watcher: PidWatcher | None,
        log: Callable[..., None] | None = None,
        *,
        max_sessions: int = 0,
        max_sessions_per_uid: int = 0,
    ):
        """``max_sessions``: open sessions in all (0: no limit), checked at Attach;
        ``max_sessions_per_uid``: sessions one uid may own, checked when the owner first
        presents the token (the uid is not known before)."""
        self.max_sessions = max_sessions
        self.max_sessions_per_uid = max_sessions_per_uid
        self.store = store
        self.watcher = watcher
        self._log = log or (lambda event, **kw: None)
        self.by_id: dict[int, Session] = {}
        self._by_token: dict[str, Session] = {}
        # Set on SIGTERM: every call and step is refused UNAVAILABLE from then on.
        self.draining = False
        # Uids whose sessions may register, unregister and prefetch adapters (None: any).
        self.manager_uids: frozenset[int] | None = frozenset({os.getuid()})

    # ------------------------------------------------------------ what a session may call
    # One policy for both front doors: the gRPC servicer asks for every call, the step channel
    # for every op of a frame (as the RPC the op stands for), each with the door's rule.

    def check_open(self) -> None:
        """UNAVAILABLE once the broker is draining."""
        if self.draining:
            raise unavailable("the broker is shutting down; retry on its successor")

    def check_session(self, session: Session | None, what: str) -> None:
        """What every session-bearing call needs: an open broker, and a session that has not
        ended (the step channel checks a whole frame with this, then each op)."""
        self.check_open()
        if session is None:
            raise denied(f"{what} needs a session: Attach first and present its token")
        if session.closed:
            raise denied(f"session {session.session_id} has ended; open a new session with Attach")

    def authorize(
        self, method: str, rule: Rule, session: Session | None, ids: Callable[[str], Sequence[int]] = NO_FIELDS
    ) -> None:
        """Enforce a door's ``rule`` for ``method`` and ``session`` (None: the call has none).

        ``ids(field)`` gives the object ids the request names in one of the rule's
        ``visible`` fields. Raises BrokerError: UNAVAILABLE while draining, PERMISSION_DENIED
        without a session, for an ended one or a uid that may not manage adapters, NOT_FOUND
        for an id the session may not see (a store query, ``ObjectStore.check_visible``)."""
        if not rule.session:
            self.check_open()
            return
        self.check_session(session, method)
        if rule.manage:
            self._check_manager(session, method)
        for field_name in rule.visible:
            self.store.check_visible(session.session_id, ids(field_name))

    def _check_manager(self, s: Session, method: str) -> None:
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

    # ------------------------------------------------------------ sessions

    def open(self, client_name: str, claimed_pid: int) -> Session:
        """Raises BrokerError(RESOURCE_EXHAUSTED) at the session limit."""
        if self.max_sessions and len(self.by_id) >= self.max_sessions:
            raise BrokerError(
                Code.RESOURCE_EXHAUSTED,
                f"the broker has {len(self.by_id)} open sessions, its limit (security.max_sessions); "
                "close unused clients or raise the limit",
            )
        sid = self.store.open_session()
        s = Session(sid, secrets.token_hex(16), client_name[:200], claimed_pid, time.time())
        self.by_id[sid] = s
        self._by_token[s.token] = s
        self._log("session_opened", session=sid, client=s.client_name, pid=claimed_pid)
        return s

    def from_metadata(self, metadata) -> Session:
        """The open session whose token a call carries among its ``(key, value)`` metadata
        pairs (the first ``SESSION_METADATA`` pair), or PERMISSION_DENIED."""
        for k, v in metadata or ():
            if k == SESSION_METADATA:
                return self.from_token(v)
        return self.from_token(None)

    def from_token(self, token: str | None) -> Session:
        """The open session behind a token, or PERMISSION_DENIED."""
        if not token:
            raise denied(f"this call needs a session: open Attach and send its token as metadata {SESSION_METADATA!r}")
        s = self._by_token.get(token)
        if s is None:
            raise denied("unknown or ended session token; open a new session with Attach")
        return s

    def close(self, session_id: int, reason: str) -> None:
        """End a session: release its core state, stop its pid watches, end its stream."""
        s = self.by_id.pop(session_id, None)
        if s is None:
            return
        s.closed = True
        self._by_token.pop(s.token, None)
        self.store.end_session(session_id)
        if self.watcher is not None:
            # One process may hold several sessions: stop watching a pid with the last one.
            for pid in s.peer_pids:
                if not any(pid in other.peer_pids for other in self.by_id.values()):
                    self.watcher.unwatch(pid)
        s.events.put_nowait(CLOSED)
        self._log("session_closed", session=session_id, reason=reason)

    def notify(self, session_id: int, event: object) -> None:
        """Queue a core event for one session's stream (the store's notify callback)."""
        s = self.by_id.get(session_id)
        if s is not None:
            s.events.put_nowait(event)

    def broadcast(self, event: object) -> None:
        for s in self.by_id.values():
            s.events.put_nowait(event)

    def authorize_fd_request(self, token: str, peer: PeerCred) -> None:
        """The fd channel's check: a live session's token, presented by its owner.

        The first process to present a token owns the session from then on (its pid is
        watched: its exit ends the session); a token presented by any other process is
        refused, so a stolen or shared token can neither map the arena nor tie the session's
        life to a stranger. Engines with several processes open one session per process."""
        s = self._by_token.get(token)
        if s is None:
            raise FdRequestRefused("PERMISSION_DENIED", "unknown or ended session token")
        if s.caller is not None:
            if peer.uid != s.caller.uid or peer.pid != s.caller.pid:
                raise FdRequestRefused(
                    "PERMISSION_DENIED",
                    f"session {s.session_id} belongs to process {s.caller.pid} (uid {s.caller.uid}); process "
                    f"{peer.pid} (uid {peer.uid}) may not use its token: open a session of its own in each process",
                )
            return
        limit = self.max_sessions_per_uid
        if limit:
            owned = sum(1 for o in self.by_id.values() if o.caller is not None and o.caller.uid == peer.uid)
            if owned >= limit:
                raise FdRequestRefused(
                    "RESOURCE_EXHAUSTED",
                    f"uid {peer.uid} already owns {owned} sessions, the limit (security.max_sessions_per_uid); "
                    "close unused clients or raise the limit",
                )
        s.caller = Caller.of_process(peer.pid, peer.uid, peer.gid)
        s.uid = peer.uid
        if peer.pid <= 0:
            # A peer in a pid namespace we cannot see reports pid 0: nothing to watch, so
            # the Attach stream alone tells when the session ends.
            self._log("fd_peer_pid_unknown", session=s.session_id, uid=peer.uid)
            return
        s.peer_pids.add(peer.pid)
        if self.watcher is not None:
            sid = s.session_id
            alive = self.watcher.watch(peer.pid, lambda pid: self._peer_died(sid, pid))
            if not alive:
                self._peer_died(sid, peer.pid)
                raise FdRequestRefused("PERMISSION_DENIED", f"process {peer.pid} exited")

    def _peer_died(self, session_id: int, pid: int) -> None:
        if session_id in self.by_id:
            self.close(session_id, f"process {pid} exited")

    def close_all(self, reason: str) -> None:
        for sid in list(self.by_id):
            self.close(sid, reason)
