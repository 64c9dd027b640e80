"""A session with a broker as this process holds it: the Attach stream, the mapped arena, reconnects.

``BrokerSession`` opens the stream (stating this client's protocol version and checking the
broker's), proves the session on the fd channel (taking its proof key), fetches slab fds there
and maps the physical view and the virtual window; it delivers the broker's events, replaces a
session lost to a broker restart (proving the new one), and sends every call with the
session's metadata: its token and its key. It knows no RPC but Attach: the calls on
objects, transactions and adapters are ``BrokerClient``'s (``clients.client``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Self

import grpc

from memory_broker.clients import arena_fds
from memory_broker.clients.mappings import MappedWindows, MappingBudget
from memory_broker.proto.wire import session as wire_session
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.mapping import ArenaGeometry
from memory_broker.proto.wire.session import session_metadata, version_mismatch
from memory_broker.proto.wire.status import error_from_rpc
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc

log = logging.getLogger(__name__)

# Reconnect quickly once a (re)starting broker's socket answers: gRPC's default backoff
# starts at a second, which made a connect() right after the broker came up fail.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
)

# What a caller loses with its session (said in errors and in the reconnected event).
LOST = "its anonymous objects, pins, open transactions and adapter leases are gone"


class BrokerSession:
    """The session half of ``BrokerClient``: open, mapped, kept alive, ended. Use ``BrokerClient.connect``."""

    # The current session's step calls (``StepSession`` keeps them; none here).
    _calls = None

    def __init__(
        self,
        socket_path: str,
        client_name: str,
        on_event: Callable | None,
        timeout: float,
        wait_s: float = 5.0,
        reconnect_s: float = 300.0,
    ):
        self.socket_path = socket_path
        self.client_name = client_name
        self.timeout = timeout
        self.on_event = on_event
        self.reconnect_s = reconnect_s
        self._channel = grpc.insecure_channel(f"unix:{socket_path}", options=CHANNEL_OPTIONS)
        self._stub = broker_pb2_grpc.MemoryBrokerStub(self._channel)
        self._map_lock = threading.Lock()
        self._mapped_windows = MappedWindows()
        # The process's mapping limit (vm.max_map_count), checked before asking for
        # contiguous objects; tests may replace it with a smaller one.
        self.mappings = MappingBudget()
        self.closed = False
        # Set when the current session's stream ended from the broker's side (cleared when a
        # reconnect opens a new session); ``_live`` is set while a session is open.
        self.session_ended = threading.Event()
        self._live = threading.Event()
        self._end_reason = ""
        # Sessions opened after the first (broker restarts survived).
        self.reconnects = 0
        self.session_id = 0
        # Sessions opened by this client (1 for the first): what objects and leases are checked by.
        self.epoch = 0
        self.view = None
        # Views of a previous broker's arena: kept mapped (stale tensors read old bytes
        # instead of faulting) until close().
        self._stale_views: list = []
        # False once the arena backend said it cannot make pages read-only (logged once).
        self._page_access = True
        # Changes a background step batch has queued whose reply is not in yet (one lock
        # each, held until it is): the session's other calls wait for them, so the broker
        # sees the calls in the order they were made (clients/step/batch.py).
        self._unsent: list[threading.Lock] = []
        self._requests: queue.Queue | None = None
        self._stream = None
        try:
            self._open_session(wait_s)
        except BaseException:
            self._channel.close()
            raise
        self._events = threading.Thread(target=self._event_loop, name="broker-events", daemon=True)
        self._events.start()

    # ------------------------------------------------------------- session

    def _open_session(self, wait_s: float) -> None:
        """Wait (at most ``wait_s``) for the broker, open a session, map its arena, publish it."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=max(wait_s, 0.001))
        except grpc.FutureTimeoutError:
            raise BrokerError(
                Code.UNAVAILABLE,
                f"no broker answered at {self.socket_path} within {wait_s:g} s; start it "
                f"(memory-broker serve --socket {self.socket_path}) or check the path",
            ) from None
        requests: queue.Queue = queue.Queue()
        hello = pb.Hello(client_name=self.client_name, pid=os.getpid(), protocol_version=wire_session.PROTOCOL_VERSION)
        requests.put(pb.AttachRequest(hello=hello))
        try:
            stream = self._stub.Attach(self._request_iter(requests), wait_for_ready=True)
            first = next(stream)
        except grpc.RpcError as e:
            requests.put(None)
            raise error_from_rpc(e, self.socket_path, self.timeout) from None
        except StopIteration:
            requests.put(None)
            raise BrokerError(
                Code.UNAVAILABLE, f"the broker at {self.socket_path} ended the session as it opened; retry"
            ) from None
        opened = first.opened
        mismatch = version_mismatch(
            opened.protocol_version, peer=f"the broker at {self.socket_path}", mine="this client"
        )
        if mismatch is not None:
            requests.put(pb.AttachRequest(detach=pb.Detach()))
            requests.put(None)
            with contextlib.suppress(Exception):
                stream.cancel()
            raise BrokerError(Code.FAILED_PRECONDITION, mismatch)
        arena = opened.arena
        geometry = ArenaGeometry(
            page_size=arena.page_size,
            pages_per_slab=arena.pages_per_slab,
            max_slabs=arena.max_slabs,
            window_pages=arena.window_pages,
        )
        view = None
        try:
            view = self._make_view(arena, geometry)
            # Prove the session first, even with no slabs yet: the broker checks this
            # process's uid there, starts watching its pid, and hands over the key every
            # call needs (the session can do nothing before, and is closed if it never does).
            key = arena_fds.prove(arena.fd_socket_path, opened.token, self.timeout)
            self._attach_slabs(view, arena.fd_socket_path, opened.token, arena.num_slabs)
        except BaseException:
            requests.put(pb.AttachRequest(detach=pb.Detach()))
            requests.put(None)
            with contextlib.suppress(Exception):
                stream.cancel()
            if view is not None:
                view.close()
            raise
        with self._map_lock:
            old_view = self.view
            self.view = view
            self.arena: pb.ArenaInfo = arena
            self.geometry = geometry
            self.session_id = opened.session_id
            self.epoch += 1
            self.token: str = opened.token
            self._metadata = session_metadata(self.token, key)
            self._requests = requests
            self._stream = stream
            self._mapped_windows = MappedWindows()
            self._page_access = True
        self._session_opened()
        if old_view is not None:
            self._stale_views.append(old_view)
        self.session_ended.clear()
        self._live.set()

    def _reconnect(self, reason: str) -> bool:
        """Open a new session after the old one was lost; True once one is open and the
        ``reconnected`` event was delivered, False when the client closed or gave up."""
        old = self.session_id
        t0 = time.monotonic()
        deadline = t0 + self.reconnect_s
        last = ""
        while not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                self._end_reason = (
                    f"{reason}; no broker answered within {self.reconnect_s:g} s of reconnecting ({last})"
                )
                log.warning("broker session %d lost and not replaced: %s", old, self._end_reason)
                return False
            try:
                self._open_session(min(1.0, left))
            except BrokerError as e:
                last = e.message
                if e.code != Code.UNAVAILABLE:
                    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
                continue
            except Exception as e:  # noqa: BLE001  (a half-started broker: try again)
                last = repr(e)
                time.sleep(0.1)
                continue
            if self.closed:  # closed while it opened: end the new session and unmap it too
                self._end_session()
                with self._map_lock:
                    if self.view is not None:
                        self.view.close()
                return False
            self.reconnects += 1
            waited = time.monotonic() - t0
            log.warning(
                "broker session %d lost (%s); session %d opened after %.2f s", old, reason, self.session_id, waited
            )
            self._deliver(
                pb.SessionEvent(
                    reconnected=pb.Reconnected(
                        old_session_id=old,
                        new_session_id=self.session_id,
                        reason=reason,
                        waited_s=waited,
                        lost=f"session {old} ended: {LOST}; allocate, acquire and look up again",
                    )
                )
            )
            return True
        return False

    def _wait_live(self) -> None:
        """Block (at most ``timeout``) while a reconnect is under way; UNAVAILABLE if none opens."""
        if self._live.is_set():
            return
        if self.reconnect_s > 0 and not self._end_reason and self._live.wait(self.timeout):
            return
        why = self._end_reason or "the broker ended the session"
        raise BrokerError(
            Code.UNAVAILABLE,
            f"no session with the broker at {self.socket_path}: {why}; "
            + (
                "the client keeps reconnecting, retry"
                if self.reconnect_s > 0 and not self._end_reason
                else "connect again"
            ),
        )

    def _wait_sent(self) -> None:
        """Wait (at most ``timeout`` each) for the changes a background step batch queued
        before this call to be answered by the broker."""
        for gate in list(self._unsent):
            if gate.acquire(timeout=self.timeout):
                gate.release()

    # ------------------------------------------------------------- mapping

    def _make_view(self, arena: pb.ArenaInfo | None = None, geometry: ArenaGeometry | None = None):
        """An empty view of ``arena`` (default: the current session's)."""
        from memory_broker.proto.wire.mapping import open_view

        arena = arena if arena is not None else self.arena
        geometry = geometry if geometry is not None else self.geometry
        try:
            return open_view(arena.backend, geometry, arena.device)
        except (ValueError, RuntimeError, OSError) as e:
            raise BrokerError(Code.FAILED_PRECONDITION, f"cannot map the broker's {arena.backend} arena: {e}") from None

    def _attach_slabs(self, view, fd_socket_path: str, token: str, num_slabs: int) -> None:
        """Map slabs ``view.mapped_slabs..num_slabs`` (``arena_fds.attach_slabs``; caller holds
        the map lock or owns ``view``)."""
        arena_fds.attach_slabs(view, fd_socket_path, token, num_slabs, self.timeout)

    def _ensure_slabs(self, num_slabs: int) -> None:
        """Map slabs up to ``num_slabs`` (fetching their fds) if this process lacks them."""
        if self.view.mapped_slabs >= num_slabs:
            return
        self._settle()
        with self._map_lock:
            if self.view.mapped_slabs >= num_slabs:
                return
            self._attach_slabs(self.view, self.arena.fd_socket_path, self.token, num_slabs)

    def _import_pages(self, pages: Sequence[int], readonly: bool) -> None:
        """On a CUDA arena, import and map the pages of ``pages`` this process lacks, with the
        access asked for from the start (nothing on a host arena: its slabs map whole)."""
        if self.view.fd_unit != "page" or not arena_fds.missing_pages(self.view, pages):
            return
        self._settle()
        with self._map_lock:
            arena_fds.import_pages(self.view, self.arena.fd_socket_path, self.token, pages, readonly, self.timeout)

    def map_arena(self, readonly: bool = True) -> int:
        """Import and map every page of the arena that this process lacks (a CUDA arena maps
        pages lazily, as they are given; this maps them ahead, e.g. to keep first-time costs
        off later calls). Returns how many pages were mapped; nothing on a host arena."""
        view = self.view
        if view.fd_unit != "page":
            return 0
        before = view.attached_pages
        self._import_pages(range(view.mapped_slabs * self.geometry.pages_per_slab), readonly)
        return view.attached_pages - before

    def _set_access(self, pages: Sequence[int], readonly: bool) -> None:
        """Keep this mapping's page access in step with what the pages hold now (importing
        pages this process lacks with that access from the start)."""
        if not pages:
            return
        self._import_pages(pages, readonly)
        if not self._page_access:
            return
        with self._map_lock:
            try:
                self.view.set_page_access(pages, readonly)
            except NotImplementedError as e:
                self._page_access = False
                log.warning("shared pages stay writable in this process: %s", e)

    def _tensor(self, address: int, nbytes: int, dtype):
        return self.view.tensor(address, nbytes, dtype)

    def physical_view(self, dtype=None):
        """The physical view mapped so far as one tensor (page p at p * page_size); on CUDA it spans pages not
        imported (index only pages given), its base page 0 imported first: torch may refuse an unmapped base."""
        self._import_pages([0] if self.view.mapped_slabs else [], True)
        return self.view.physical_tensor(dtype)

    # ------------------------------------------------------------- events

    @staticmethod
    def _request_iter(requests: queue.Queue) -> Iterator[pb.AttachRequest]:
        while True:
            msg = requests.get()
            if msg is None:
                return
            yield msg

    def _deliver(self, ev: pb.SessionEvent) -> None:
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:  # a callback's bug must not end the session
                log.exception("on_event callback failed for %s", ev.WhichOneof("event"))

    def _event_loop(self) -> None:
        while not self.closed:
            reason = "the broker closed the session"
            try:
                for ev in self._stream:
                    kind = ev.WhichOneof("event")
                    if kind == "arena_grown":
                        with contextlib.suppress(BrokerError):
                            self._ensure_slabs(ev.arena_grown.num_slabs)
                    elif kind == "shutting_down":
                        reason = f"the broker shut down ({ev.shutting_down.reason})"
                    self._deliver(ev)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED or not self.closed:
                    reason = "the connection to the broker broke (it exited or restarted)"
            self._live.clear()
            self._end_reason = ""
            self.session_ended.set()
            if self.closed or self.reconnect_s <= 0:
                self._end_reason = self._end_reason or reason
                return
            if not self._reconnect(reason):
                return

    # ------------------------------------------------------------- calls

    def _call(self, method, request, retry: bool = False):
        """One RPC on the current session. ``retry``: the request names nothing of the
        session (no object or transaction ids), so it is sent once more on a new session
        when the broker went away during the call."""
        if self.closed:
            raise BrokerError(Code.FAILED_PRECONDITION, "the client is closed; connect again")
        if self._unsent:
            self._wait_sent()
        self._settle()
        self._wait_live()
        epoch = self.epoch
        try:
            return method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            err = error_from_rpc(e, self.socket_path, self.timeout)
        if retry and err.code == Code.UNAVAILABLE and self.reconnect_s > 0 and not self.closed:
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline and not self.closed and not self._end_reason:
                if self.epoch != epoch and self._live.is_set():
                    try:
                        return method(request, metadata=self._metadata, timeout=self.timeout)
                    except grpc.RpcError as e:
                        raise error_from_rpc(e, self.socket_path, self.timeout) from None
                time.sleep(0.02)
        raise err

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The current session's call metadata (its token and proof key), for a raw
        ``broker_pb2_grpc`` stub in this process (the broker refuses it from any other)."""
        return self._metadata

    def _session_opened(self) -> None:
        """Called once a new session is published (the first, and each reconnect)."""

    def _settle(self) -> None:
        """Called before a call goes over gRPC or the fd channel: a step the session began on
        its step channel is answered first (the broker has run it, so the call sees what it
        gave back). ``_calls``: the session's step calls (``step_session.py``);
        with nothing unread (``unread``, a deque's truth), no call into the step path at all."""
        calls = self._calls
        if calls is not None and calls.unread and calls.epoch == self.epoch:
            calls.settle()

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """End the session (the broker releases its pins and anonymous objects) and unmap.
        Tensors from this client must not be used afterwards."""
        if self.closed:
            return
        self.closed = True
        self._live.clear()
        self._end_session()
        self._channel.close()
        with self._map_lock:
            for view in [*self._stale_views, self.view]:
                if view is not None:
                    view.close()
            self._stale_views.clear()

    def _end_session(self) -> None:
        requests, stream = self._requests, self._stream
        if requests is not None:
            requests.put(pb.AttachRequest(detach=pb.Detach()))
            requests.put(None)
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.cancel()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
