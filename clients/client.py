"""The engine-side client: a session, this process's mapping of the arena, zero-copy tensors.

``BrokerClient.connect`` opens a session (the Attach stream), fetches the slab fds over the
fd channel, and maps the physical view and the virtual window in this process. Every call
takes a batch and is one RPC; objects come back as ``BrokerObject``s whose tensors are
views of this process's own mapping, so data never crosses the gRPC socket.

Tensors are valid while the client is open and the object is allocated (free, eviction
and ``close()`` end that; the broker says which objects were evicted through ``on_event``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import grpc

from memory_broker.broker.arena.base import ArenaGeometry
from memory_broker.broker.errors import BrokerError, Code
from memory_broker.broker.v1 import broker_pb2 as pb
from memory_broker.broker.v1 import broker_pb2_grpc
from memory_broker.clients.fd_channel import FdChannelError, fetch_slab_fds

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


def _error(e: grpc.RpcError) -> BrokerError:
    code = e.code()
    name = code.name if code is not None else "INTERNAL"
    return BrokerError(Code[name] if name in Code.__members__ else Code.INTERNAL, e.details() or name)


class BrokerObject:
    """An allocation as this process sees it: ids, pages, and tensors over its own mapping."""

    __slots__ = ("client", "object_id", "pages", "window_page", "key", "content_type", "state",
                 "deduplicated", "owned", "session_pins", "total_pins")  # fmt: skip

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
        self.objects = [client._object(i) for i in resp.objects]
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


def _ids(objs: Iterable[BrokerObject | int]) -> list[int]:
    return [o.object_id if isinstance(o, BrokerObject) else int(o) for o in objs]


class BrokerClient:
    """A session with the broker on ``socket_path``. Use ``connect``; close when done."""

    def __init__(self, socket_path: str, client_name: str, on_event: Callable | None, timeout: float):
        self.socket_path = socket_path
        self.timeout = timeout
        self.on_event = on_event
        self._channel = grpc.insecure_channel(f"unix:{socket_path}")
        self._stub = broker_pb2_grpc.MemoryBrokerStub(self._channel)
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(pb.AttachRequest(hello=pb.Hello(client_name=client_name, pid=os.getpid())))
        self._map_lock = threading.Lock()
        self._mapped_windows: dict[int, tuple[int, ...]] = {}
        # Adapter id -> its layout (the same for every generation; pages change).
        self._layout_cache: dict = {}
        self.closed = False
        # Set when the session stream ended from the broker's side.
        self.session_ended = threading.Event()
        self.view = None
        try:
            self._stream = self._stub.Attach(self._request_iter())
            first = next(self._stream)
        except grpc.RpcError as e:
            self._channel.close()
            raise _error(e) from None
        opened = first.opened
        self.session_id: int = opened.session_id
        self.token: str = opened.token
        self.arena: pb.ArenaInfo = opened.arena
        self.geometry = ArenaGeometry(
            page_size=opened.arena.page_size,
            pages_per_slab=opened.arena.pages_per_slab,
            max_slabs=opened.arena.max_slabs,
            window_pages=opened.arena.window_pages,
        )
        self._metadata = ((SESSION_METADATA, self.token),)
        self.view = self._make_view()
        try:
            # Always shake hands on the fd channel, even with no slabs yet: the broker checks
            # this process's uid there and starts watching its pid.
            self._ensure_slabs(opened.arena.num_slabs, handshake=True)
        except BaseException:
            self.close()
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
    ) -> "BrokerClient":
        """Open a session and map the arena.

        Args:
            socket_path: the broker's gRPC Unix socket.
            client_name: shown in the broker's logs.
            on_event: called from a background thread with each SessionEvent (evictions,
                expired transactions, arena growth, shutdown).
            timeout: seconds per RPC.
        """
        return cls(socket_path, client_name or f"pid-{os.getpid()}", on_event, timeout)

    # ------------------------------------------------------------- mapping

    def _make_view(self):
        from memory_broker.broker.arena import open_view

        try:
            return open_view(self.arena.backend, self.geometry, self.arena.device)
        except (ValueError, RuntimeError, OSError) as e:
            raise BrokerError(Code.FAILED_PRECONDITION, f"cannot map the broker's {self.arena.backend} arena: {e}") from None

    def _ensure_slabs(self, num_slabs: int, handshake: bool = False) -> None:
        """Map slabs up to ``num_slabs`` (fetching their fds) if this process lacks them."""
        if self.view.mapped_slabs >= num_slabs and not handshake:
            return
        with self._map_lock:
            first = self.view.mapped_slabs
            if first >= num_slabs and not handshake:
                return
            try:
                fds = fetch_slab_fds(self.arena.fd_socket_path, self.token, first, timeout=self.timeout)
            except FdChannelError as e:
                code = Code[e.code] if e.code in Code.__members__ else Code.INTERNAL
                raise BrokerError(code, f"fd channel {self.arena.fd_socket_path}: {e}") from None
            try:
                for i, fd in enumerate(fds):
                    self.view.attach_slab(first + i, fd)
            finally:
                for fd in fds:
                    os.close(fd)

    def _object(self, info: pb.ObjectInfo) -> BrokerObject:
        self._ensure_slabs(info.arena_slabs)
        obj = BrokerObject(self, info)
        if obj.window_page >= 0:
            # Mirror the broker's window placement; skip if this exact mapping is in place.
            pages = tuple(obj.pages)
            with self._map_lock:
                if self._mapped_windows.get(obj.window_page) != pages:
                    self.view.map_window(obj.window_page, obj.pages)
                    self._mapped_windows[obj.window_page] = pages
        return obj

    def _tensor(self, address: int, nbytes: int, dtype):
        return self.view.tensor(address, nbytes, dtype)

    def physical_view(self, dtype=None):
        """The whole physical view mapped so far, as one tensor (page p at p * page_size)."""
        n = self.view.mapped_slabs * self.geometry.slab_size
        return self._tensor(self.view.phys_base, n, dtype)

    # ------------------------------------------------------------- events

    def _request_iter(self) -> Iterator[pb.AttachRequest]:
        while True:
            msg = self._requests.get()
            if msg is None:
                return
            yield msg

    def _event_loop(self) -> None:
        try:
            for ev in self._stream:
                if ev.WhichOneof("event") == "arena_grown":
                    with contextlib.suppress(BrokerError):
                        self._ensure_slabs(ev.arena_grown.num_slabs)
                if self.on_event is not None:
                    try:
                        self.on_event(ev)
                    except Exception:  # a callback's bug must not end the session
                        log.exception("on_event callback failed for %s", ev.WhichOneof("event"))
        except grpc.RpcError:
            pass
        finally:
            self.session_ended.set()

    # ------------------------------------------------------------- calls

    def _call(self, method, request):
        if self.closed:
            raise BrokerError(Code.FAILED_PRECONDITION, "the client is closed")
        try:
            return method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _error(e) from None

    def allocate(self, specs: Sequence[Spec]) -> list[BrokerObject]:
        """Allocate and commit a batch in one RPC. A key that already exists returns the
        existing object with ``deduplicated=True`` (do not write into it)."""
        resp = self._call(self._stub.Allocate, pb.AllocateRequest(objects=[s.to_proto() for s in specs]))
        return [self._object(i) for i in resp.objects]

    def allocate_one(self, num_pages: int, **kw) -> BrokerObject:
        return self.allocate([Spec(num_pages, **kw)])[0]

    def prepare(
        self, specs: Sequence[Spec] = (), pin: Iterable[BrokerObject | int] = (), lease_s: float = 0.0
    ) -> Transaction:
        """Reserve a batch under a lease; use as a context manager to commit on success."""
        resp = self._call(
            self._stub.Prepare,
            pb.PrepareRequest(
                objects=[s.to_proto() for s in specs], pin_object_ids=_ids(pin), lease_ms=int(lease_s * 1000)
            ),
        )
        return Transaction(self, resp)

    def transaction(self, specs: Sequence[Spec] = (), pin: Iterable[BrokerObject | int] = (), lease_s: float = 0.0):
        return self.prepare(specs, pin, lease_s)

    def commit(self, txns: Sequence[Transaction | int]) -> list[list[BrokerObject]]:
        ids = [t.transaction_id if isinstance(t, Transaction) else int(t) for t in txns]
        resp = self._call(self._stub.Commit, pb.CommitRequest(transaction_ids=ids))
        return [[self._object(i) for i in t.objects] for t in resp.transactions]

    def abort(self, txns: Sequence[Transaction | int]) -> int:
        ids = [t.transaction_id if isinstance(t, Transaction) else int(t) for t in txns]
        return self._call(self._stub.Abort, pb.AbortRequest(transaction_ids=ids)).freed_pages

    def free(self, objs: Iterable[BrokerObject | int]) -> tuple[int, int]:
        """Free owned objects; returns (pages freed now, pages freed when others unpin)."""
        resp = self._call(self._stub.Free, pb.FreeRequest(object_ids=_ids(objs)))
        return resp.freed_pages, resp.deferred_pages

    def pin(self, objs: Iterable[BrokerObject | int]) -> list[BrokerObject]:
        resp = self._call(self._stub.Pin, pb.PinRequest(object_ids=_ids(objs)))
        return [self._object(i) for i in resp.objects]

    def unpin(self, objs: Iterable[BrokerObject | int]) -> None:
        self._call(self._stub.Unpin, pb.UnpinRequest(object_ids=_ids(objs)))

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
        resp = self._call(self._stub.Lookup, pb.LookupRequest(keys=list(keys), pin=pin))
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
        return self._call(self._stub.RegisterAdapter, req).adapter

    def unregister_adapters(self, adapter_ids: Sequence[str]) -> None:
        self._call(self._stub.UnregisterAdapter, pb.UnregisterAdapterRequest(adapter_ids=list(adapter_ids)))
        for aid in adapter_ids:
            self._layout_cache.pop(aid, None)

    def list_adapters(self, prefix: str = "", limit: int = 100, page_token: str = "") -> pb.ListAdaptersResponse:
        return self._call(
            self._stub.ListAdapters, pb.ListAdaptersRequest(prefix=prefix, limit=limit, page_token=page_token)
        )

    def adapter_layout(self, adapter_id: str) -> pb.AdapterLayout:
        return self._call(self._stub.GetAdapterLayout, pb.GetAdapterLayoutRequest(adapter_id=adapter_id))

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

        with_layout = any(aid not in self._layout_cache for aid in adapter_ids)
        req = pb.AcquireAdaptersRequest(
            adapter_ids=list(adapter_ids),
            max_adapters=max_adapters,
            with_layout=with_layout,
            prepare=prepare,
            lease_ms=int(lease_s * 1000),
        )
        return AdapterLease(self, self._call(self._stub.AcquireAdapters, req))

    def release_adapters(self, adapter_ids: Sequence[str]) -> None:
        self._call(self._stub.ReleaseAdapters, pb.ReleaseAdaptersRequest(adapter_ids=list(adapter_ids)))

    def prefetch_adapters(self, adapter_ids: Sequence[str], tier: str = "hot") -> pb.PrefetchAdaptersResponse:
        """Bring adapters to the warm or hot tier ahead of use, without pinning them."""
        t = {"hot": pb.ADAPTER_TIER_HOT, "warm": pb.ADAPTER_TIER_WARM}[tier]
        return self._call(self._stub.PrefetchAdapters, pb.PrefetchAdaptersRequest(adapter_ids=list(adapter_ids), tier=t))

    def arena_tensor(self, dtype=None):
        """The physical view as a 1-D tensor of ``dtype``: what the LoRA kernels index into."""
        return self.physical_view(dtype)

    def stats(self) -> pb.Stats:
        return self._call(self._stub.GetStats, pb.GetStatsRequest())

    def get_arena(self) -> pb.ArenaInfo:
        return self._call(self._stub.GetArena, pb.GetArenaRequest())

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """End the session (the broker releases its pins and anonymous objects) and unmap.
        Tensors from this client must not be used afterwards."""
        if self.closed:
            return
        self.closed = True
        self._requests.put(pb.AttachRequest(detach=pb.Detach()))
        self._requests.put(None)
        with contextlib.suppress(Exception):
            self._stream.cancel()
        self._channel.close()
        if self.view is not None:
            self.view.close()

    def __enter__(self) -> "BrokerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
