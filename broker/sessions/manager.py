"""Client sessions: tokens, event queues, the process each belongs to, and how it ends.

A session is opened by the Attach stream; the first process to present its token on the fd
channel becomes its owner (uid, gids and pid by SO_PEERCRED), is *proven*, and takes the
session's proof key there; any other process presenting the token is refused, so one
process's exit never ends another's session. Every session-bearing call must carry the key
(``authorize``): the token alone acts for nothing. A session not proven within
``UNPROVEN_DEADLINE_S`` is closed, and at most ``MAX_UNPROVEN`` wait at once (a new one
closes the oldest), so Attach streams that never prove themselves hold neither memory nor a
slot for long. The session ends when the stream ends or the owner dies (its pidfd fires);
the object store then releases what it held. Proven sessions are bounded in all and per uid.
No allocation state here.
"""

from __future__ import annotations

import asyncio
import hmac
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
from memory_broker.proto.wire.session import KEY_METADATA, SESSION_METADATA

# Placed on a session's queue to end its stream.
CLOSED = object()
# A session must be proven (its token presented on the fd channel by its process) within this
# many seconds of Attach, or it is closed; BrokerClient.connect proves it in milliseconds.
UNPROVEN_DEADLINE_S = 10.0
# Sessions waiting to be proven at once, over all uids (their uid is not known yet): one more
# closes the oldest waiting one, so a flood of Attach streams cannot keep a client out.
MAX_UNPROVEN = 64
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
    # The proof key: sent only to the owner process, on the fd channel; every session-bearing
    # call carries it as metadata (KEY_METADATA).
    key: str
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
    # uid/gids bound what the broker reads for it); None until then: the session is unproven
    # and may do nothing.
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
        allowed_uids: frozenset[int] | None = None,
        max_unproven: int = MAX_UNPROVEN,
        unproven_deadline_s: float = UNPROVEN_DEADLINE_S,
    ):
        """``max_sessions``: proven sessions in all (0: no limit), checked at Attach and at
        proof; ``max_sessions_per_uid``: sessions one uid may own, checked at proof (the uid
        is not known before); ``allowed_uids``: uids whose processes may prove a session and
        call through one (None: any); ``max_unproven``, ``unproven_deadline_s``: sessions
        waiting to be proven at once, and for how long each may wait."""
        self.max_sessions = max_sessions
        self.max_sessions_per_uid = max_sessions_per_uid
        self.allowed_uids = allowed_uids
        self.max_unproven = max_unproven
        self.unproven_deadline_s = unproven_deadline_s
        # Sessions not proven yet, oldest first, with the timer that closes each at its deadline.
        self._unproven: dict[int, asyncio.TimerHandle] = {}
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
        self,
        method: str,
        rule: Rule,
        session: Session | None,
        ids: Callable[[str], Sequence[int]] = NO_FIELDS,
        *,
        key: str | None = None,
    ) -> None:
        """Enforce a door's ``rule`` for ``method`` and ``session`` (None: the call has none).

        ``ids(field)`` gives the object ids the request names in one of the rule's
        ``visible`` fields. ``key``: the proof key the call carries (the gRPC door reads it
        from the metadata; the step channel passes the one its HELLO's proof returned).
        Raises BrokerError: UNAVAILABLE while draining; PERMISSION_DENIED without a session,
        for an ended one, one not proven yet, a call without the session's key, an owner uid
        no longer in ``allowed_uids`` or one that may not manage adapters; NOT_FOUND for an id
        the session may not see (a store query, ``ObjectStore.check_visible``)."""
        if not rule.session:
            self.check_open()
            return
        self.check_session(session, method)
        self._check_proof(session, key, method)
        if rule.manage:
            self._check_manager(session, method)
        for field_name in rule.visible:
            self.store.check_visible(session.session_id, ids(field_name))

    def authorize_open(
        self, method: str, rule: Rule, session: Session, ids: Callable[[str], Sequence[int]], *, key: str | None
    ) -> None:
        """``authorize`` of a ``session`` that ``check_session`` has just passed in the same
        callback of the loop (the step channel's frame): the rest of the rule only."""
        if not rule.session:
            return
        # ``_check_proof``'s passing case, inline; anything else goes there to say why.
        caller, allowed = session.caller, self.allowed_uids
        if (
            caller is None
            or key is None
            or key.__class__ is not str
            or not key.isascii()
            or not hmac.compare_digest(key, session.key)
            or (allowed is not None and caller.uid not in allowed)
        ):
            self._check_proof(session, key, method)
        if rule.manage:
            self._check_manager(session, method)
        for field_name in rule.visible:
            self.store.check_visible(session.session_id, ids(field_name))

    def _check_proof(self, s: Session, key: str | None, method: str) -> None:
        """The call comes from the session's own process: the session is proven and the call
        carries its key; and that process's uid is still allowed."""
        caller = s.caller
        if caller is None:
            raise denied(
                f"{method}: session {s.session_id} is not proven: its process must present the token on the fd "
                f"channel within {self.unproven_deadline_s:g} s of Attach and send the key it gets there as metadata "
                f"{KEY_METADATA!r} (BrokerClient.connect does both); it can do nothing until then, and is closed "
                "if it never does"
            )
        if key is None or not _same_key(key, s.key):
            raise denied(
                f"{method}: the call does not carry session {s.session_id}'s key (metadata {KEY_METADATA!r}); the "
                f"broker gives it only to the session's own process (pid {caller.pid}), on the fd channel, so a "
                "token alone acts for no session: connect with BrokerClient.connect in the process that calls"
            )
        allowed = self.allowed_uids
        if allowed is not None and caller.uid not in allowed:
            raise denied(
                f"uid {caller.uid} may not use this broker (security.allowed_uids: {sorted(allowed)}); "
                f"session {s.session_id} can do nothing"
            )

    def _check_manager(self, s: Session, method: str) -> None:
        uid = s.caller.uid if s.caller is not None else None  # proven: _check_proof ran first
        if self.manager_uids is not None and uid not in self.manager_uids:
            raise BrokerError(
                Code.PERMISSION_DENIED,
                f"uid {uid} may not manage adapters (adapters.manager_uids: {sorted(self.manager_uids)}); "
                "it may list and acquire them; the broker's operator registers adapters (memory-broker adapters "
                "register, as a uid in adapters.manager_uids)",
            )

    # ------------------------------------------------------------ sessions

    def open(self, client_name: str, claimed_pid: int) -> Session:
        """A new, unproven session (called on the event loop: its deadline is a loop timer).
        Raises BrokerError(RESOURCE_EXHAUSTED) at the limit of proven sessions; at the limit
        of unproven ones, the oldest unproven session is closed to make room."""
        self._check_room()
        if self.max_unproven and len(self._unproven) >= self.max_unproven:
            oldest = next(iter(self._unproven))
            self.close(oldest, f"not proven on the fd channel before {self.max_unproven} newer sessions came")
        sid = self.store.open_session()
        s = Session(sid, secrets.token_hex(16), secrets.token_hex(16), client_name[:200], claimed_pid, time.time())
        self.by_id[sid] = s
        self._by_token[s.token] = s
        loop = asyncio.get_running_loop()
        self._unproven[sid] = loop.call_later(self.unproven_deadline_s, self._unproven_late, sid)
        self._log("session_opened", session=sid, client=s.client_name, pid=claimed_pid)
        return s

    def _check_room(self) -> None:
        """RESOURCE_EXHAUSTED when ``max_sessions`` proven sessions are open."""
        proven = len(self.by_id) - len(self._unproven)
        if self.max_sessions and proven >= self.max_sessions:
            raise BrokerError(
                Code.RESOURCE_EXHAUSTED,
                f"the broker has {proven} open sessions, its limit (security.max_sessions); "
                "close unused clients or raise the limit",
            )

    def _unproven_late(self, session_id: int) -> None:
        if self._unproven.pop(session_id, None) is not None:
            self.close(session_id, f"not proven on the fd channel within {self.unproven_deadline_s:g} s of Attach")

    @property
    def unproven(self) -> int:
        """Sessions open and not proven yet."""
        return len(self._unproven)

    def from_metadata(self, metadata) -> tuple[Session, str | None]:
        """The open session whose token a call carries among its ``(key, value)`` metadata
        pairs (the first ``SESSION_METADATA`` pair), or PERMISSION_DENIED; and the proof key
        the call carries (the first ``KEY_METADATA`` pair; None: none), for ``authorize``."""
        token = key = None
        for k, v in metadata or ():
            if k == SESSION_METADATA and token is None:
                token = v
            elif k == KEY_METADATA and key is None:
                key = v
        return self.from_token(token), key

    def from_token(self, token: str | None) -> Session:
        """The open session behind a token, or PERMISSION_DENIED."""
        if not token:
            raise denied(
                "this call needs a session: BrokerClient.connect opens one (Attach, then its process proves it on "
                f"the fd channel) and sends its token and key as metadata {SESSION_METADATA!r} and {KEY_METADATA!r}"
            )
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
        timer = self._unproven.pop(session_id, None)
        if timer is not None:
            timer.cancel()
        self.store.end_session(session_id)
        if self.watcher is not None:
            # One process may hold several sessions: its watch ends with the last one's
            # callback (a process that opens and closes sessions leaves none behind).
            for pid in s.peer_pids:
                self.watcher.unwatch(pid, session_id)
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

    def authorize_fd_request(self, token: str, peer: PeerCred) -> str:
        """The fd channel's check (and the step channel's HELLO): a live session's token,
        presented by its owner; returns the session's proof key, for that process only.

        The first process to present a token owns the session from then on (its pid is
        watched: its exit ends the session): the session is proven. A token presented by any
        other process is refused, so a stolen or shared token can neither map the arena, nor
        get the key every call needs, nor tie the session's life to a stranger. Engines with
        several processes open one session per process. A uid not in ``allowed_uids``, or one
        at its ``max_sessions_per_uid``, cannot prove a session."""
        s = self._by_token.get(token)
        if s is None:
            raise FdRequestRefused(
                "PERMISSION_DENIED",
                "unknown or ended session token (a session is closed if not proven here within "
                f"{self.unproven_deadline_s:g} s of Attach, or when {self.max_unproven} newer ones wait): connect again",
            )
        if self.allowed_uids is not None and peer.uid not in self.allowed_uids:
            raise FdRequestRefused(
                "PERMISSION_DENIED",
                f"uid {peer.uid} may not use this broker; allowed uids (security.allowed_uids): "
                f"{sorted(self.allowed_uids)}",
            )
        if s.caller is not None:
            if peer.uid != s.caller.uid or peer.pid != s.caller.pid:
                raise FdRequestRefused(
                    "PERMISSION_DENIED",
                    f"session {s.session_id} belongs to process {s.caller.pid} (uid {s.caller.uid}); process "
                    f"{peer.pid} (uid {peer.uid}) may not use its token: open a session of its own in each process",
                )
            return s.key
        self._check_owner_room(peer)
        self._prove(s, peer)
        return s.key

    def _check_owner_room(self, peer: PeerCred) -> None:
        """RESOURCE_EXHAUSTED (as an fd refusal) when ``peer``'s uid owns its limit of
        sessions, or the broker its limit of proven ones."""
        try:
            self._check_room()
        except BrokerError as e:
            raise FdRequestRefused("RESOURCE_EXHAUSTED", e.message) from None
        limit = self.max_sessions_per_uid
        if limit:
            owned = sum(1 for o in self.by_id.values() if o.caller is not None and o.caller.uid == peer.uid)
            if owned >= limit:
                raise FdRequestRefused(
                    "RESOURCE_EXHAUSTED",
                    f"uid {peer.uid} already owns {owned} sessions, the limit (security.max_sessions_per_uid); "
                    "close unused clients or raise the limit",
                )

    def _prove(self, s: Session, peer: PeerCred) -> None:
        """Bind ``s`` to the process ``peer`` and watch its pid."""
        s.caller = Caller.of_process(peer.pid, peer.uid, peer.gid)
        s.uid = peer.uid
        timer = self._unproven.pop(s.session_id, None)
        if timer is not None:
            timer.cancel()
        if peer.pid <= 0:
            # A peer in a pid namespace we cannot see reports pid 0: nothing to watch, so
            # the Attach stream alone tells when the session ends.
            self._log("fd_peer_pid_unknown", session=s.session_id, uid=peer.uid)
            return
        s.peer_pids.add(peer.pid)
        if self.watcher is not None:
            sid = s.session_id
            alive = self.watcher.watch(peer.pid, lambda pid: self._peer_died(sid, pid), sid)
            if not alive:
                self._peer_died(sid, peer.pid)
                raise FdRequestRefused("PERMISSION_DENIED", f"process {peer.pid} exited")

    def _peer_died(self, session_id: int, pid: int) -> None:
        if session_id in self.by_id:
            self.close(session_id, f"process {pid} exited")

    def set_allowed_uids(self, allowed: frozenset[int] | None) -> list[int]:
        """Who may prove a session from now on (a reload); every proven session whose owner's
        uid is no longer among them is ended at once, as if its process had exited (its pins,
        open transactions and anonymous objects go; its keyed committed objects stay). Returns
        the ended sessions' ids. What the process already mapped stays mapped until it exits:
        the broker cannot take a mapping back (docs/security.md)."""
        self.allowed_uids = allowed
        if allowed is None:
            return []
        gone = [s for s in self.by_id.values() if s.caller is not None and s.caller.uid not in allowed]
        for s in gone:
            self.close(s.session_id, f"uid {s.caller.uid} was removed from security.allowed_uids by a reload")
        return [s.session_id for s in gone]

    def close_all(self, reason: str) -> None:
        for sid in list(self.by_id):
            self.close(sid, reason)


def _same_key(given: str, key: str) -> bool:
    """Whether a call's key is the session's, in time independent of where they differ."""
    try:
        return hmac.compare_digest(given, key)
    except TypeError:  # a non-ASCII string cannot be the key
        return False
