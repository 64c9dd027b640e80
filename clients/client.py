"""The engine-side client: a session, this process's mapping of the arena, zero-copy tensors.

``BrokerClient.connect`` opens a session (the Attach stream), fetches the slab fds over the
fd channel, and maps the physical view and the virtual window in this process. Every call
takes a batch and is one RPC; objects come back as ``BrokerObject``s whose tensors are
views of this process's own mapping, so data never crosses the gRPC socket.

Tensors are valid while the client is open and the object is allocated (free, eviction
and ``close()`` end that; the broker says which objects were evicted through ``on_event``).
Pages of shared content (adapters, other sessions' objects) are read-only in this mapping.
When the broker restarts, the client opens a new session and says so with a ``reconnected``
event: everything of the old session is gone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import grpc

from memory_broker.broker.arena.base import ArenaGeometry
from memory_broker.broker.errors import BrokerError, Code
from memory_broker.broker.v1 import broker_pb2 as pb
from memory_broker.broker.v1 import broker_pb2_grpc
from memory_broker.clients.fd_channel import FdChannelError, fetch_slab_fds
from memory_broker.clients.mappings import MappingBudget
from memory_broker.broker.sessions import step_wire as _w
from memory_broker.clients.fastpath import PendingStepLease, StepCalls, StepLease

SESSION_METADATA = "x-broker-session"

log = logging.getLogger(__name__)

CONTENT_TYPES = {
    "kv_cache": pb.CONTENT_TYPE_KV_CACHE,
    "lora_weight": pb.CONTENT_TYPE_LORA_WEIGHT,
    "temp_buffer": pb.CONTENT_TYPE_TEMP_BUFFER,
    "activation": pb.CONTENT_TYPE_ACTIVATION,
    "gradient": pb.CONTENT_TYPE_GRADIENT,
}


@dataclass(slots=True)
class Spec:
    """One allocation to ask for."""

    num_pages: int
    contiguous: bool = False
    # "kv_cache", "lora_weight", "temp_buffer", "activation", "gradient" (or the proto enum).
    content_type: str | int = "temp_buffer"
    # Content key (shared, findable by lookup once committed); None for anonymous.
    key: bytes | None = None
    # Pin for this session once committed.
    pin: bool = False

    def to_proto(self) -> pb.ObjectSpec:
        ct = self.content_type
        if isinstance(ct, str):
            try:
                ct = CONTENT_TYPES[ct]
            except KeyError:
                raise ValueError(f"unknown content type {ct!r}; use one of {sorted(CONTENT_TYPES)}") from None
        return pb.ObjectSpec(
            num_pages=self.num_pages, contiguous=self.contiguous, content_type=ct, key=self.key or b"", pin=self.pin
        )


# Reconnect quickly once a (re)starting broker's socket answers: gRPC's default backoff
# starts at a second, which made a connect() right after the broker came up fail.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
)

# What a caller loses with its session (said in errors and in the reconnected event).
LOST = "its anonymous objects, pins, open transactions and adapter leases are gone"


# Words of gRPC's own transport failures (the broker's UNAVAILABLE refusals say what to do).
_TRANSPORT_TEXT = (
    "failed to connect", "Socket closed", "Connection reset", "Connection refused", "Broken pipe",
    "No such file", "recvmsg", "sendmsg", "unix:", "ipv4:", "ipv6:", "GOAWAY", "Stream removed", "keepalive",
    "connections to all backends failing", "Transport closed",
)  # fmt: skip


def _error(e: grpc.RpcError, socket_path: str = "", timeout: float = 0.0) -> BrokerError:
    """A gRPC failure as a BrokerError naming the status and what to do, without transport text.

    Statuses the broker sends keep its message (it says what to do). Failures of the
    transport (no broker on the socket, the connection dropped, no answer in time) carry
    gRPC's internal text in ``details()``; they become UNAVAILABLE with a plain sentence.
    """
    code = e.code()
    details = e.details() or ""
    where = f"the broker at {socket_path}" if socket_path else "the broker"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return BrokerError(
            Code.UNAVAILABLE,
            f"{where} did not answer within {timeout:g} s (busy or stuck); retry, or raise the client's timeout",
        )
    if code == grpc.StatusCode.UNAVAILABLE and (not details or any(w in details for w in _TRANSPORT_TEXT)):
        return BrokerError(
            Code.UNAVAILABLE,
            f"{where} is not reachable (not running, restarting, or the socket path is wrong); "
            "start it or wait for it, then retry",
        )
    if code == grpc.StatusCode.CANCELLED:
        return BrokerError(Code.UNAVAILABLE, f"the call to {where} was cancelled (the connection closed); retry")
    name = code.name if code is not None else "INTERNAL"
    if name not in Code.__members__:
        return BrokerError(Code.INTERNAL, f"{where} failed the call with {name}; see the broker's log")
    return BrokerError(Code[name], details or name)


class BrokerObject:
    """An allocation as this process sees it: ids, pages, and tensors over its own mapping."""

    __slots__ = ("client", "object_id", "pages", "window_page", "key", "content_type", "state",
                 "deduplicated", "owned", "session_pins", "total_pins", "session_id", "epoch")  # fmt: skip

    def __init__(self, client: "BrokerClient", info: pb.ObjectInfo):
        self.client = client
        self.object_id: int = info.object_id
        self.pages: list[int] = list(info.pages)
        self.window_page: int = info.window_page
        self.key: bytes | None = info.key or None
        self.content_type: int = info.content_type
        self.state: int = info.state
        # True when a commit found the key already present: this is the existing object.
        self.deduplicated: bool = info.deduplicated
        self.owned: bool = info.owned
        self.session_pins: int = info.session_pins
        self.total_pins: int = info.total_pins
        # The session that got it (and the client's count of sessions so far, which a
        # restarted broker's reused session ids cannot confuse): after a reconnect, objects
        # of the old session are gone.
        self.session_id: int = client.session_id
        self.epoch: int = client.epoch

    @property
    def contiguous(self) -> bool:
        return self.window_page >= 0

    @property
    def nbytes(self) -> int:
        return len(self.pages) * self.client.geometry.page_size

    @property
    def address(self) -> int:
        """Address of a contiguous object's first byte in this process's window."""
        if not self.contiguous:
            raise ValueError(f"object {self.object_id} is not contiguous; use page_addresses() or page_tensors()")
        return self.client.view.window_address(self.window_page)

    def page_addresses(self) -> list[int]:
        view = self.client.view
        return [view.page_address(p) for p in self.pages]

    def tensor(self, dtype=None):
        """One zero-copy tensor over the whole object (contiguous objects only)."""
        return self.client._tensor(self.address, self.nbytes, dtype)

    def page_tensors(self, dtype=None) -> list:
        """One zero-copy tensor per page, through the physical view."""
        ps = self.client.geometry.page_size
        return [self.client._tensor(a, ps, dtype) for a in self.page_addresses()]

    def __repr__(self) -> str:
        return (f"BrokerObject(id={self.object_id}, pages={len(self.pages)}, window_page={self.window_page}, "
                f"key={self.key!r}, deduplicated={self.deduplicated})")  # fmt: skip


class Transaction:
    """A prepared batch: write into ``objects``, then commit (or abort)."""

    def __init__(self, client: "BrokerClient", resp: pb.PrepareResponse):
        self.client = client
        self.transaction_id: int = resp.transaction_id
        self.deadline_unix_ms: int = resp.deadline_unix_ms
        self.session_id: int = client.session_id
        self.epoch: int = client.epoch
        self.objects = [client._object(i, writer=True) for i in resp.objects]
        self.pinned = [client._object(i) for i in resp.pinned]
        # After commit: the objects as committed (existing ones where keys were deduplicated).
        self.committed: list[BrokerObject] | None = None

    def commit(self) -> list[BrokerObject]:
        self.committed = self.client.commit([self])[0]
        return self.committed

    def abort(self) -> int:
        return self.client.abort([self])

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if self.committed is None:
                self.commit()
        else:
            with contextlib.suppress(BrokerError):
                self.abort()


class BrokerClient(StepCalls):
    """A session with the broker on ``socket_path``. Use ``connect``; close when done.

    The step calls (``step``, ``step_begin`` and the fast path under acquire, lookup, pin
    and unpin) come from ``StepCalls`` (clients/fastpath.py)."""

    def __init__(
        self,
        socket_path: str,
        client_name: str,
        on_event: Callable | None,
        timeout: float,
        wait_s: float = 5.0,
        reconnect_s: float = 300.0,
        fast_path: bool = True,
        hold_s: float = 0.0,
    ):
        self.socket_path = socket_path
        self._init_step_calls(fast_path, hold_s)
        self.client_name = client_name
        self.timeout = timeout
        self.on_event = on_event
        self.reconnect_s = reconnect_s
        self._channel = grpc.insecure_channel(f"unix:{socket_path}", options=CHANNEL_OPTIONS)
        self._stub = broker_pb2_grpc.MemoryBrokerStub(self._channel)
        self._map_lock = threading.Lock()
        self._mapped_windows: dict[int, tuple[int, ...]] = {}
        # The process's mapping limit (vm.max_map_count), checked before asking for
        # contiguous objects; tests may replace it with a smaller one.
        self.mappings = MappingBudget()
        # Adapter id -> its layout (the same for every generation; pages change).
        self._layout_cache: dict = {}
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
        self._requests: queue.Queue | None = None
        self._stream = None
        try:
            self._open_session(wait_s)
        except BaseException:
            self._channel.close()
            raise
        self._events = threading.Thread(target=self._event_loop, name="broker-events", daemon=True)
        self._events.start()

    @classmethod
    def connect(
        cls,
        socket_path: str,
        *,
        client_name: str | None = None,
        on_event: Callable[[pb.SessionEvent], None] | None = None,
        timeout: float = 30.0,
        wait_s: float = 5.0,
        reconnect_s: float = 300.0,
        fast_path: bool = True,
        hold_s: float = 0.0,
    ) -> "BrokerClient":
        """Open a session and map the arena.

        Args:
            socket_path: the broker's gRPC Unix socket.
            client_name: shown in the broker's logs.
            on_event: called from a background thread with each SessionEvent (evictions,
                expired transactions, arena growth, shutdown, and ``reconnected``, which the
                client makes itself when it replaced a lost session).
            timeout: seconds per RPC.
            wait_s: how long to wait for a broker that is starting (no socket yet, or not
                answering yet) before UNAVAILABLE.
            reconnect_s: after the broker restarts, how long to keep trying to open a new
                session (0: never; the client then stays ended, as ``session_ended`` says).
            fast_path: send the step calls (acquire and release adapters, lookup, pin,
                unpin, commit/abort of adapter acquires) over the broker's step channel, a
                compact binary protocol on a Unix socket, instead of gRPC; same semantics.
                Falls back to gRPC where the broker has no step channel.
            hold_s: with the fast path, keep what this process releases (adapter leases,
                pins) held at the broker for up to this long, so acquiring or looking it up
                again costs no round trip; releases are sent with a later call. 0 (the
                default): every release is sent at once, as over gRPC.
        """
        return cls(
            socket_path, client_name or f"pid-{os.getpid()}", on_event, timeout, wait_s, reconnect_s, fast_path, hold_s
        )

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
        requests.put(pb.AttachRequest(hello=pb.Hello(client_name=self.client_name, pid=os.getpid())))
        try:
            stream = self._stub.Attach(self._request_iter(requests), wait_for_ready=True)
            first = next(stream)
        except grpc.RpcError as e:
            requests.put(None)
            raise _error(e, self.socket_path, self.timeout) from None
        except StopIteration:
            requests.put(None)
            raise BrokerError(Code.UNAVAILABLE, f"the broker at {self.socket_path} ended the session as it opened; retry") from None
        opened = first.opened
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
            # Always shake hands on the fd channel, even with no slabs yet: the broker checks
            # this process's uid there and starts watching its pid.
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
            self._metadata = ((SESSION_METADATA, self.token),)
            self._requests = requests
            self._stream = stream
            self._mapped_windows = {}
            self._page_access = True
        # A new broker may lay adapters out differently (another dtype or page size).
        self._layout_cache.clear()
        self._forget_step_objects()
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
                self._end_reason = f"{reason}; no broker answered within {self.reconnect_s:g} s of reconnecting ({last})"
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
            log.warning("broker session %d lost (%s); session %d opened after %.2f s", old, reason, self.session_id, waited)
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
            + ("the client keeps reconnecting, retry" if self.reconnect_s > 0 and not self._end_reason else "connect again"),
        )

    # ------------------------------------------------------------- mapping

    def _make_view(self, arena: pb.ArenaInfo | None = None, geometry: ArenaGeometry | None = None):
        """An empty view of ``arena`` (default: the current session's)."""
        from memory_broker.broker.arena import open_view

        arena = arena if arena is not None else self.arena
        geometry = geometry if geometry is not None else self.geometry
        try:
            return open_view(arena.backend, geometry, arena.device)
        except (ValueError, RuntimeError, OSError) as e:
            raise BrokerError(Code.FAILED_PRECONDITION, f"cannot map the broker's {arena.backend} arena: {e}") from None

    def _attach_slabs(self, view, fd_socket_path: str, token: str, num_slabs: int) -> None:
        """Fetch and map slabs ``view.mapped_slabs..num_slabs`` (caller holds the map lock or owns ``view``)."""
        first = view.mapped_slabs
        try:
            fds = fetch_slab_fds(fd_socket_path, token, first, timeout=self.timeout)
        except FdChannelError as e:
            code = Code[e.code] if e.code in Code.__members__ else Code.INTERNAL
            raise BrokerError(code, f"fd channel {fd_socket_path}: {e}") from None
        try:
            for i, fd in enumerate(fds):
                view.attach_slab(first + i, fd)
        finally:
            for fd in fds:
                os.close(fd)

    def _ensure_slabs(self, num_slabs: int) -> None:
        """Map slabs up to ``num_slabs`` (fetching their fds) if this process lacks them."""
        if self.view.mapped_slabs >= num_slabs:
            return
        with self._map_lock:
            if self.view.mapped_slabs >= num_slabs:
                return
            self._attach_slabs(self.view, self.arena.fd_socket_path, self.token, num_slabs)

    def _set_access(self, pages: Sequence[int], readonly: bool) -> None:
        """Keep this mapping's page access in step with what the pages hold now."""
        if not self._page_access or not pages:
            return
        with self._map_lock:
            try:
                self.view.set_page_access(pages, readonly)
            except NotImplementedError as e:
                self._page_access = False
                log.warning("shared pages stay writable in this process: %s", e)

    def _object(self, info: pb.ObjectInfo, writer: bool = False) -> BrokerObject:
        """A BrokerObject for ``info``; ``writer``: this process was given it to write
        (allocate, prepare). Pages of anything else it did not create (another session's
        objects, a deduplicated key's existing object) are mapped read-only."""
        self._ensure_slabs(info.arena_slabs)
        obj = BrokerObject(self, info)
        if info.deduplicated or not info.owned:
            self._set_access(obj.pages, True)
        elif writer:
            self._set_access(obj.pages, False)
        if obj.window_page >= 0:
            # Mirror the broker's window placement; skip if this exact mapping is in place.
            pages = tuple(obj.pages)
            with self._map_lock:
                if self._mapped_windows.get(obj.window_page) != pages:
                    try:
                        self.view.map_window(obj.window_page, obj.pages)
                    except OSError as e:
                        if e.errno == errno.ENOMEM:
                            raise self.mappings.exhausted_error(e, f"object {obj.object_id}") from None
                        raise
                    self._mapped_windows[obj.window_page] = pages
                    self.mappings.mapped()
        return obj

    def _check_current(self, item: BrokerObject | Transaction, what: str, again: str) -> None:
        """Refuse an object or transaction of a session that ended with a broker restart."""
        if item.client is self and item.epoch != self.epoch:
            raise BrokerError(
                Code.FAILED_PRECONDITION,
                f"{what} came from session {item.session_id}, which ended when the broker restarted "
                f"(this client is on a new session now): {LOST}; {again}",
            )

    def _ids(self, objs: Iterable[BrokerObject | int]) -> list[int]:
        out = []
        for o in objs:
            if isinstance(o, BrokerObject):
                self._check_current(o, f"object {o.object_id}", "allocate or look it up again")
                out.append(o.object_id)
            else:
                out.append(int(o))
        return out

    def _tensor(self, address: int, nbytes: int, dtype):
        return self.view.tensor(address, nbytes, dtype)

    def physical_view(self, dtype=None):
        """The whole physical view mapped so far, as one tensor (page p at p * page_size)."""
        n = self.view.mapped_slabs * self.geometry.slab_size
        return self._tensor(self.view.phys_base, n, dtype)

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
        self._wait_live()
        epoch = self.epoch
        try:
            return method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            err = _error(e, self.socket_path, self.timeout)
        if retry and err.code == Code.UNAVAILABLE and self.reconnect_s > 0 and not self.closed:
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline and not self.closed and not self._end_reason:
                if self.epoch != epoch and self._live.is_set():
                    try:
                        return method(request, metadata=self._metadata, timeout=self.timeout)
                    except grpc.RpcError as e:
                        raise _error(e, self.socket_path, self.timeout) from None
                time.sleep(0.02)
        raise err

    def allocate(self, specs: Sequence[Spec]) -> list[BrokerObject]:
        """Allocate and commit a batch in one RPC. A key that already exists returns the
        existing object with ``deduplicated=True`` (do not write into it)."""
        self.mappings.check(sum(1 for s in specs if s.contiguous), "allocate")
        resp = self._call(self._stub.Allocate, pb.AllocateRequest(objects=[s.to_proto() for s in specs]), retry=True)
        return [self._object(i, writer=True) for i in resp.objects]

    def allocate_one(self, num_pages: int, **kw) -> BrokerObject:
        return self.allocate([Spec(num_pages, **kw)])[0]

    def prepare(
        self, specs: Sequence[Spec] = (), pin: Iterable[BrokerObject | int] = (), lease_s: float = 0.0
    ) -> Transaction:
        """Reserve a batch under a lease; use as a context manager to commit on success."""
        pin_ids = self._ids(pin)
        self.mappings.check(sum(1 for s in specs if s.contiguous), "prepare")
        resp = self._call(
            self._stub.Prepare,
            pb.PrepareRequest(
                objects=[s.to_proto() for s in specs], pin_object_ids=pin_ids, lease_ms=int(lease_s * 1000)
            ),
            retry=not pin_ids,
        )
        return Transaction(self, resp)

    def transaction(self, specs: Sequence[Spec] = (), pin: Iterable[BrokerObject | int] = (), lease_s: float = 0.0):
        return self.prepare(specs, pin, lease_s)

    def _txn_ids(self, txns: Sequence[Transaction | int]) -> list[int]:
        out = []
        for t in txns:
            if isinstance(t, Transaction):
                self._check_current(t, f"transaction {t.transaction_id}", "prepare again")
                out.append(t.transaction_id)
            else:
                out.append(int(t))
        return out

    def commit(self, txns: Sequence[Transaction | int]) -> list[list[BrokerObject]]:
        ids = self._txn_ids(txns)
        resp = self._call(self._stub.Commit, pb.CommitRequest(transaction_ids=ids))
        return [[self._object(i) for i in t.objects] for t in resp.transactions]

    def abort(self, txns: Sequence[Transaction | int]) -> int:
        ids = self._txn_ids(txns)
        return self._call(self._stub.Abort, pb.AbortRequest(transaction_ids=ids)).freed_pages

    def free(self, objs: Iterable[BrokerObject | int]) -> tuple[int, int]:
        """Free owned objects; returns (pages freed now, pages freed when others unpin)."""
        ids = self._ids(objs)
        resp = self._call(self._stub.Free, pb.FreeRequest(object_ids=ids))
        st = self._step
        if st is not None and st.caching and self._step_epoch == self.epoch:
            st.forget_pins(ids)
        return resp.freed_pages, resp.deferred_pages

    def pin(self, objs: Iterable[BrokerObject | int]) -> list[BrokerObject]:
        ids = self._ids(objs)
        st = self._step_path()
        if st is not None:
            if st.caching:
                held = st.ref_pins(ids)
                if held is not None:
                    return [self._object(r) for r in held]
            reply = self._fast(st.send, [_w.Op(_w.OP_PIN, tuple(ids))])
            st.raise_error(reply)
            recs = reply.results[0]
            if st.caching:
                st.add_pins(recs)
            return [self._object(r) for r in recs]
        resp = self._call(self._stub.Pin, pb.PinRequest(object_ids=ids))
        return [self._object(i) for i in resp.objects]

    def unpin(self, objs: Iterable[BrokerObject | int]) -> None:
        ids = self._ids(objs)
        st = self._step_path()
        if st is not None:
            self._fast(st.step, unpin=ids, acquire=False, lookup=False)
            return
        self._call(self._stub.Unpin, pb.UnpinRequest(object_ids=ids))

    @contextlib.contextmanager
    def pinned(self, objs: Iterable[BrokerObject | int]) -> Iterator[list[BrokerObject]]:
        """Pin for the duration of a ``with`` block."""
        got = self.pin(objs)
        try:
            yield got
        finally:
            if not self.closed:
                self.unpin(got)

    def lookup(self, keys: Sequence[bytes], pin: bool = True) -> list[BrokerObject]:
        """The longest prefix of ``keys`` present (pinned for this session unless pin=False)."""
        st = self._step_path()
        if st is not None:
            # A step channel that broke (the broker restarting) is not retried here: the
            # gRPC call below waits for the new session and retries, as it always did.
            out = self._fast_or_none(st.step, keys=keys, acquire=False, pin_keys=pin)
            if out is not None:
                return self._objects(out.objects)
        resp = self._call(self._stub.Lookup, pb.LookupRequest(keys=list(keys), pin=pin), retry=True)
        return [self._object(i) for i in resp.objects]

    @contextlib.contextmanager
    def lookup_pinned(self, keys: Sequence[bytes]) -> Iterator[list[BrokerObject]]:
        """Look up and pin, unpinning at the end of the ``with`` block."""
        got = self.lookup(keys, pin=True)
        try:
            yield got
        finally:
            if got and not self.closed:
                self.unpin(got)

    # ------------------------------------------------------------- adapters

    def register_adapter(self, adapter_id: str, path: str) -> pb.Adapter:
        """Register a PEFT directory (readable by the broker) under ``adapter_id``."""
        req = pb.RegisterAdapterRequest(adapter_id=adapter_id, path=os.path.abspath(path))
        return self._call(self._stub.RegisterAdapter, req, retry=True).adapter

    def unregister_adapters(self, adapter_ids: Sequence[str]) -> None:
        self._call(self._stub.UnregisterAdapter, pb.UnregisterAdapterRequest(adapter_ids=list(adapter_ids)))
        for aid in adapter_ids:
            self._layout_cache.pop(aid, None)

    def list_adapters(self, prefix: str = "", limit: int = 100, page_token: str = "") -> pb.ListAdaptersResponse:
        return self._call(
            self._stub.ListAdapters, pb.ListAdaptersRequest(prefix=prefix, limit=limit, page_token=page_token), retry=True
        )

    def adapter_layout(self, adapter_id: str) -> pb.AdapterLayout:
        return self._call(self._stub.GetAdapterLayout, pb.GetAdapterLayoutRequest(adapter_id=adapter_id), retry=True)

    def acquire_adapters(
        self,
        adapter_ids: Sequence[str],
        max_adapters: int = 0,
        *,
        prepare: bool = False,
        lease_s: float = 0.0,
    ):
        """Pin adapters for this session (the broker loads them if needed); one RPC.

        Returns an ``AdapterLease`` (a context manager that releases them). With
        ``max_adapters`` N, the first N distinct ids are acquired and the rest come back in
        ``lease.deferred``. Layouts are fetched only for adapters this client has not seen.
        With ``prepare``, the pins hold under a lease until ``lease.commit()``.
        """
        from memory_broker.clients.adapters import AdapterLease

        st = self._step_path()
        if st is not None:
            out = self._fast_or_none(
                st.step, adapter_ids, max_adapters=max_adapters, prepare=prepare, lease_ms=int(lease_s * 1000), lookup=False
            )
            if out is not None and out.acquire_hot:
                return self._lease(out)
        with_layout = any(aid not in self._layout_cache for aid in adapter_ids)
        req = pb.AcquireAdaptersRequest(
            adapter_ids=list(adapter_ids),
            max_adapters=max_adapters,
            with_layout=with_layout,
            prepare=prepare,
            lease_ms=int(lease_s * 1000),
        )
        return AdapterLease(self, self._call(self._stub.AcquireAdapters, req, retry=True))

    def release_adapters(self, adapter_ids: Sequence[str]) -> None:
        st = self._step_path()
        if st is not None:
            self._fast(st.step, release=list(adapter_ids), acquire=False, lookup=False)
            return
        self._call(self._stub.ReleaseAdapters, pb.ReleaseAdaptersRequest(adapter_ids=list(adapter_ids)))

    def prefetch_adapters(self, adapter_ids: Sequence[str], tier: str = "hot") -> pb.PrefetchAdaptersResponse:
        """Bring adapters to the warm or hot tier ahead of use, without pinning them."""
        t = {"hot": pb.ADAPTER_TIER_HOT, "warm": pb.ADAPTER_TIER_WARM}[tier]
        return self._call(
            self._stub.PrefetchAdapters, pb.PrefetchAdaptersRequest(adapter_ids=list(adapter_ids), tier=t), retry=True
        )

    def verify_adapters(self, adapter_ids: Sequence[str] = ()) -> pb.VerifyAdaptersResponse:
        """Have the broker check adapters' resident copies against their checksums (no ids:
        every resident adapter). A corrupt copy is dropped and reloaded from its source on
        the next acquire; ``response.corrupt`` counts them."""
        return self._call(self._stub.VerifyAdapters, pb.VerifyAdaptersRequest(adapter_ids=list(adapter_ids)), retry=True)

    def arena_tensor(self, dtype=None):
        """The physical view as a 1-D tensor of ``dtype``: what the LoRA kernels index into."""
        return self.physical_view(dtype)

    def stats(self) -> pb.Stats:
        return self._call(self._stub.GetStats, pb.GetStatsRequest(), retry=True)

    def get_arena(self) -> pb.ArenaInfo:
        return self._call(self._stub.GetArena, pb.GetArenaRequest(), retry=True)

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
        if self._step is not None:
            self._step.transport.close()
        requests, stream = self._requests, self._stream
        if requests is not None:
            requests.put(pb.AttachRequest(detach=pb.Detach()))
            requests.put(None)
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.cancel()

    def __enter__(self) -> "BrokerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

