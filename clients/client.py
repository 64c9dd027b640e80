"""The engine-side client: calls on objects, transactions, pins and adapters, and zero-copy tensors.

``BrokerClient.connect`` opens a session (``clients.session``: the Attach stream, this
process's mapping of the arena, reconnects). Every call takes a batch and is one RPC;
objects come back as ``BrokerObject``s whose tensors are views of this process's own
mapping, so data never crosses the gRPC socket.

Tensors are valid while the client is open and the object is allocated (free, eviction
and ``close()`` end that; the broker says which objects were evicted through ``on_event``).
Pages of shared content (adapters, other sessions' objects) are read-only in this mapping.
When the broker restarts, the client opens a new session and says so with a ``reconnected``
event: everything of the old session is gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

from memory_broker.clients.discovery import check_device, find_socket
from memory_broker.clients.session import CHANNEL_OPTIONS, LOST
from memory_broker.clients.step.adapters import AdapterLease
from memory_broker.clients.step.batch import StepBatch
from memory_broker.clients.step.lease import PendingStepLease, StepLease
from memory_broker.clients.step_session import StepSession
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.layout import AdapterLayout, ModuleShard
from memory_broker.proto.wire.messages import spec_to_proto
from memory_broker.proto.wire.spec import Spec
from memory_broker.proto.wire.v1 import broker_pb2 as pb

__all__ = [
    "BrokerClient",
    "BrokerObject",
    "Spec",
    "Transaction",
    "StepLease",
    "PendingStepLease",
    "CHANNEL_OPTIONS",
    "LOST",
]


class BrokerObject:
    """An allocation as this process sees it: ids, pages, and tensors over its own mapping."""

    __slots__ = (
        "client",
        "object_id",
        "pages",
        "window_page",
        "key",
        "content_type",
        "state",
        "deduplicated",
        "owned",
        "session_pins",
        "total_pins",
        "session_id",
        "epoch",
    )

    def __init__(self, client: BrokerClient, info: pb.ObjectInfo):
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
        return (
            f"BrokerObject(id={self.object_id}, pages={len(self.pages)}, window_page={self.window_page}, "
            f"key={self.key!r}, deduplicated={self.deduplicated})"
        )


class Transaction:
    """A prepared batch: write into ``objects``, then commit (or abort)."""

    def __init__(self, client: BrokerClient, resp: pb.PrepareResponse):
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

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if self.committed is None:
                self.commit()
        else:
            with contextlib.suppress(BrokerError):
                self.abort()


class BrokerClient(StepSession):
    """A session with the broker on ``socket_path``. Use ``connect``; close when done.

    The step calls (acquire and release adapters, lookup, pin, unpin, ``step``,
    ``step_begin``, a step batch's changes) go through one calls object per session, chosen
    when the session first makes one: ``ChannelCalls`` (clients/step/channel.py) over the
    broker's step channel, or ``GrpcCalls`` (clients/step/grpc_calls.py); same methods, same results."""

    def __init__(self, *args, **kwargs):
        # Adapter id -> its layout (the same for every generation; pages change). Set before
        # the session opens, which clears it.
        self._layout_cache: dict[str, tuple[int, AdapterLayout]] = {}  # id (+#dtype, #shard) -> (generation, layout)
        super().__init__(*args, **kwargs)

    @classmethod
    def connect(
        cls,
        socket_path: str | None = None,
        *,
        client_name: str | None = None,
        on_event: Callable[[pb.SessionEvent], None] | None = None,
        timeout: float = 30.0,
        wait_s: float = 5.0,
        reconnect_s: float = 300.0,
        fast_path: bool = True,
        hold_s: float = 0.0,
        post_give_backs: bool = True,
    ) -> BrokerClient:
        """Open a session and map the arena.

        Args:
            socket_path: the broker's gRPC Unix socket, or a directory of per-GPU brokers
                (``<gpu-uuid>/broker.sock``). None: ``$MEMORY_BROKER_SOCKET``, else the broker of
                this process's GPU under ``/run/memory-broker`` (found by UUID: torch's current
                device or ``CUDA_VISIBLE_DEVICES``), else ``/tmp/memory-broker.sock``
                (``clients/discovery.py``).
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
            hold_s: no longer used (the step path's holdings cache is gone: its gain did not
                show in an engine's step); a value above 0 is logged once and ignored.
            post_give_backs: no longer used: every give-back (``unpin``, ``release_adapters``,
                a lease's ``release()``) waits for the broker's answer and raises its own
                refusal (posting them saved a round trip that no engine's step showed).
        """
        socket_path, gpu_uuid = find_socket(socket_path)
        client = cls(
            socket_path,
            client_name or f"pid-{os.getpid()}",
            on_event,
            timeout,
            wait_s,
            reconnect_s,
            fast_path=fast_path,
            hold_s=hold_s,
            post_give_backs=post_give_backs,
        )
        try:
            check_device(client.arena.device, gpu_uuid, socket_path)
        except BrokerError:
            client.close()
            raise
        return client

    def _session_opened(self) -> None:
        super()._session_opened()
        # A new broker may lay adapters out differently (another dtype or page size).
        self._layout_cache.clear()

    # ------------------------------------------------------------- objects

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
        else:
            self._import_pages(obj.pages, True)
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
                    self._mapped_windows.put(obj.window_page, pages)
                    self.mappings.mapped()
        return obj

    def _read_objects(self, infos: Sequence) -> list[BrokerObject]:
        """``_object`` for many objects this process was not given to write (lookups, pins;
        ``pb.ObjectInfo``s or step records), the mapping work done once for all of them: one
        slab check, one page-access change for the read-only ones (not one per object)."""
        if not infos:
            return []
        self._slabs_for(infos)
        shared: list[int] = []
        own: list[int] = []
        for i in infos:
            (shared if i.deduplicated or not i.owned else own).extend(i.pages)
        self._read_access(shared, own)
        # Windowed objects also map their window (``_object``; their pages' access is set already).
        return [BrokerObject(self, i) if i.window_page < 0 else self._object(i) for i in infos]

    def _slabs_for(self, infos: Sequence) -> None:
        """Map the arena's slabs that ``infos`` (records or ``pb.ObjectInfo``s) say exist."""
        slabs = infos[0].arena_slabs if len(infos) == 1 else max(i.arena_slabs for i in infos)
        if self.view.mapped_slabs < slabs:
            self._ensure_slabs(slabs)

    def _read_access(self, shared: list[int], own: list[int]) -> None:
        """Pages read through this process's mapping, not written: ``shared`` (another
        session's, or deduplicated) read-only; ``own`` imported read-only where pages are
        imported one by one (a CUDA arena)."""
        if self.view.fd_unit != "page":
            # A slab-mapped view (the host arena) imports nothing: ``_set_access`` reduced to
            # its page-access change (what a running batch's fresh keys take, every change).
            if shared and self._page_access and not self.view.reads_only(shared):
                self._set_access(shared, True)
            return
        if shared:
            self._set_access(shared, True)
        if own:
            self._import_pages(own, True)

    def _check_current(self, item: BrokerObject | Transaction, what: str, again: str) -> None:
        """Refuse an object or transaction of a session that ended with a broker restart."""
        if item.client is self and item.epoch != self.epoch:
            raise BrokerError(
                Code.FAILED_PRECONDITION,
                f"{what} came from session {item.session_id}, which ended when the broker restarted "
                f"(this client is on a new session now): {LOST}; {again}",
            )

    def _ids(self, objs: Iterable[BrokerObject | int]) -> list[int]:
        if isinstance(objs, (list, tuple)) and objs:
            # The usual call: this session's objects (what a step or lookup returned), checked in
            # one comprehension (its attribute loads specialize to the slots, where getters'
            # do not); anything else item by item.
            epoch = self.epoch
            out = [o.object_id for o in objs if type(o) is BrokerObject and o.epoch == epoch]
            if len(out) == len(objs):
                return out
        out = []
        for o in objs:
            if isinstance(o, BrokerObject):
                self._check_current(o, f"object {o.object_id}", "allocate or look it up again")
                out.append(o.object_id)
            else:
                out.append(int(o))
        return out

    def allocate(self, specs: Sequence[Spec]) -> list[BrokerObject]:
        """Allocate and commit a batch in one RPC. A key that already exists returns the
        existing object with ``deduplicated=True`` (do not write into it)."""
        contiguous = sum(1 for s in specs if s.contiguous)
        if contiguous:  # only contiguous objects take memory mappings
            self.mappings.check(contiguous, "allocate")
        resp = self._call(
            self._stub.Allocate, pb.AllocateRequest(objects=[spec_to_proto(s) for s in specs]), retry=True
        )
        return [self._object(i, writer=True) for i in resp.objects]

    def allocate_one(self, num_pages: int, **kw) -> BrokerObject:
        return self.allocate([Spec(num_pages, **kw)])[0]

    def prepare(
        self, specs: Sequence[Spec] = (), pin: Iterable[BrokerObject | int] = (), lease_s: float = 0.0
    ) -> Transaction:
        """Reserve a batch under a lease; use as a context manager to commit on success."""
        pin_ids = self._ids(pin)
        contiguous = sum(1 for s in specs if s.contiguous)
        if contiguous:  # only contiguous objects take memory mappings
            self.mappings.check(contiguous, "prepare")
        resp = self._call(
            self._stub.Prepare,
            pb.PrepareRequest(
                objects=[spec_to_proto(s) for s in specs], pin_object_ids=pin_ids, lease_ms=int(lease_s * 1000)
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
        # A committed keyed object is shared content: its creator loses write access too, so
        # a stray write after the commit faults here instead of changing what others read (a
        # deduplicated key's existing object is read-only already).
        out = [[self._object(i) for i in t.objects] for t in resp.transactions]
        sealed = [p for t in resp.transactions for i in t.objects if i.key and not i.deduplicated for p in i.pages]
        if sealed:
            self._set_access(sealed, True)
        return out

    def abort(self, txns: Sequence[Transaction | int]) -> int:
        ids = self._txn_ids(txns)
        return self._call(self._stub.Abort, pb.AbortRequest(transaction_ids=ids)).freed_pages

    def free(self, objs: Iterable[BrokerObject | int]) -> tuple[int, int]:
        """Free owned objects; returns (pages freed now, pages freed when others unpin)."""
        ids = self._ids(objs)
        resp = self._call(self._stub.Free, pb.FreeRequest(object_ids=ids))
        return resp.freed_pages, resp.deferred_pages

    def pin(self, objs: Iterable[BrokerObject | int]) -> list[BrokerObject]:
        return self._step_calls().pin(self._ids(objs))

    def unpin(self, objs: Iterable[BrokerObject | int]) -> None:
        """Drop this session's pin on each object."""
        self._step_calls().unpin(self._ids(objs))

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
        """The longest prefix of ``keys`` present (pinned for this session unless pin=False).
        A key listed twice is refused (INVALID_ARGUMENT: docs/python-client.md, "Replies are
        bounded like requests")."""
        return self._step_calls().lookup(keys, pin)

    def lookup_many(
        self, key_lists: Sequence[Sequence[bytes]], pin: bool = False, unpin: Iterable[BrokerObject | int] = ()
    ) -> list[list[BrokerObject]]:
        """Unpin ``unpin``, then look up each list of keys (its longest present prefix, pinned
        for this session if ``pin``), all in one round trip on the step channel (an engine's
        step: every waiting request's chain at once; 63 lookups a frame, more take more
        frames, as do replies past the broker's reply bound). Over gRPC, one call each. On a
        refusal nothing stays pinned by it. One list may not name a key twice (INVALID_ARGUMENT);
        two lists may name the same key (each lookup pins it once)."""
        return self._step_calls().lookup_many([list(k) for k in key_lists], pin, self._ids(unpin))

    @contextlib.contextmanager
    def lookup_pinned(self, keys: Sequence[bytes]) -> Iterator[list[BrokerObject]]:
        """Look up and pin, unpinning at the end of the ``with`` block."""
        got = self.lookup(keys, pin=True)
        try:
            yield got
        finally:
            if got and not self.closed:
                self.unpin(got)

    # ------------------------------------------------------------- steps

    def step(
        self,
        adapter_ids: Sequence[str] = (),
        keys: Sequence[bytes] = (),
        *,
        max_adapters: int = 0,
        prepare: bool = False,
        lease_s: float = 0.0,
        commit: AdapterLease | None = None,
        release: StepLease | None = None,
    ) -> StepLease:
        """An engine step's changes in one round trip (none when it asks for nothing).

        Releases what ``release`` holds (a previous step), commits ``commit`` (a prepared
        lease: prepare the next step's adapters while this one runs, commit it here),
        acquires ``adapter_ids`` (prepared under a lease with ``prepare``; the cap
        ``max_adapters`` defers the overflow, as ``acquire_adapters`` does) and looks up and
        pins the longest present prefix of ``keys``. Returns a ``StepLease`` holding both;
        release it (or pass it as the next step's ``release``). Without the step channel
        this is the same calls over gRPC.
        """
        calls = self._step_calls()
        return calls.step(list(adapter_ids), list(keys), max_adapters, prepare, lease_s, commit, release)

    def step_begin(
        self,
        adapter_ids: Sequence[str] = (),
        keys: Sequence[bytes] = (),
        *,
        max_adapters: int = 0,
        prepare: bool = False,
        lease_s: float = 0.0,
        commit: AdapterLease | None = None,
        release: StepLease | None = None,
    ) -> PendingStepLease:
        """``step`` in two halves: the frame goes out now, ``result()`` collects the reply.

        Call it as soon as the next step's batch is known and collect it after the current
        step's model work: the round trip overlaps that work. Without the step channel,
        ``result()`` makes the calls over gRPC."""
        calls = self._step_calls()
        return calls.step_begin(list(adapter_ids), list(keys), max_adapters, prepare, lease_s, commit, release)

    def step_batch(self, background: bool = False, poll_s: float | None = None) -> StepBatch:
        """An empty ``StepBatch``: the engine's running batch, changed by its arrivals and
        completions (a change costs what changed, not the batch's size). ``background``: a
        thread of the batch runs each ``begin``'s change while the caller goes on.
        ``poll_s`` is no longer used (the worker sleeps until a change comes)."""
        if poll_s is not None and poll_s < 0:
            raise ValueError(f"poll_s must be >= 0 seconds, not {poll_s!r}")
        return StepBatch(self, background)

    # ------------------------------------------------------------- adapters

    def acquire_adapters(
        self,
        adapter_ids: Sequence[str],
        max_adapters: int = 0,
        *,
        prepare: bool = False,
        lease_s: float = 0.0,
        dtype: str = "",
        shards: Sequence[ModuleShard] = (),
    ):
        """Pin adapters for this session (the broker loads them if needed); one RPC.

        Returns an ``AdapterLease`` (a context manager that releases them). With
        ``max_adapters`` N, the first N distinct ids are acquired and the rest come back in
        ``lease.deferred``. Layouts are fetched only for adapters this client has not seen.
        With ``prepare``, the pins hold under a lease until ``lease.commit()``. With ``dtype``
        ("float32", "float16", "bfloat16"), the adapters' copies in that dtype (the broker makes
        them from the adapters' files on first use); empty: the broker's ``--adapter-dtype``.
        With ``shards`` (a tensor-parallel rank's ``ModuleShard`` per split module), the copies
        holding only that rank's slice of those modules (the layouts' ``shard`` says which).

        Raises:
            BrokerError: as the broker refuses; FAILED_PRECONDITION when ``dtype`` or ``shards``
                were asked and the broker returned another dtype or the whole adapter (a broker
                too old for them), after releasing what it pinned.
        """
        return self._step_calls().acquire_adapters(adapter_ids, max_adapters, prepare, lease_s, dtype, tuple(shards))

    def release_adapters(self, adapter_ids: Sequence[str], dtype: str = "") -> None:
        """Drop one pin per listed id; ``dtype``: the acquire's (only that copy's pins).
        One frame on the step channel, its refusal raised here."""
        self._step_calls().release_adapters(adapter_ids, dtype)

    def commit_acquire(self, transaction_id: int) -> None:
        """Keep a prepared adapter acquire's pins (``AdapterLease.commit``)."""
        self._step_calls().commit_acquire(transaction_id)

    def abort_acquire(self, transaction_id: int) -> None:
        """Drop a prepared adapter acquire's pins (FAILED_PRECONDITION once committed)."""
        self._step_calls().abort_acquire(transaction_id)

    def arena_tensor(self, dtype=None):
        """The physical view as a 1-D tensor of ``dtype``: what the LoRA kernels index into."""
        return self.physical_view(dtype)
