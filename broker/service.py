"""The gRPC servicer: who may call what (the ``POLICY`` table), RPCs to core calls, errors to statuses.

``POLICY`` says per RPC whether it needs a session, which targets the session must own or
see, whether it changes state, whether it needs an adapter-manager uid, and whether the TCP
listener (which has no peer credentials) serves it; ``_unary`` enforces it in one place
before any handler runs. Handlers convert requests into core calls on the event loop that
owns the core; ``BrokerError`` codes map onto gRPC statuses, anything else is a bug and
becomes INTERNAL.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc

from memory_broker.broker.adapters.access import check_path_text
from memory_broker.broker.adapters.peft import AdapterInfo
from memory_broker.broker.adapters.records import AdapterCorrupted
from memory_broker.broker.arena.base import Arena
from memory_broker.broker.errors import BrokerError, Code
from memory_broker.broker.objects import Allocation, ObjectsEvicted, ObjectStore, Spec, TransactionsExpired
from memory_broker.broker.sessions.manager import CLOSED, Session, SessionManager
from memory_broker.wire import session as wire_session
from memory_broker.wire.messages import TIERS, layout_to_proto, spec_from_proto
from memory_broker.wire.session import SESSION_METADATA, token_from_metadata, version_mismatch
from memory_broker.wire.status import STATUS
from memory_broker.wire.v1 import broker_pb2 as pb
from memory_broker.wire.v1 import broker_pb2_grpc, echo_pb2, echo_pb2_grpc


class ArenaGrown:
    """Core-side event: the arena has more slabs (broadcast to every session)."""

    __slots__ = ("num_slabs",)

    def __init__(self, num_slabs: int):
        self.num_slabs = num_slabs


class ShuttingDown:
    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


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


def is_tcp(context) -> bool:
    """Whether the call came over the TCP listener (the Unix socket's peers are "unix:...")."""
    try:
        peer = context.peer() or ""
    except Exception:
        return False
    return peer.startswith(("ipv4:", "ipv6:"))


def _unary(fn):
    """Wrap a handler: refuse while draining, enforce ``POLICY``, map BrokerError to a
    status, time and log it. The handler is called as ``fn(self, request, context, session)``."""
    method = fn.__name__
    rule = POLICY[method]
    is_async = inspect.iscoroutinefunction(fn)
    # The fixed cost of every call matters (issue 13: a few microseconds): nothing here
    # builds a log line that the level filters out, and the logger is only touched to log.

    async def handler(self: "MemoryBrokerService", request, context):
        t0 = time.perf_counter()
        code = "OK"
        call = CALL.set((method, None))
        self.inflight += 1
        try:
            if self.draining:
                code = "UNAVAILABLE"
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the broker is shutting down; retry on its successor")
            session = self._authorize(rule, method, request, context)
            if session is not None:
                CALL.set((method, session.session_id))
            result = fn(self, request, context, session)
            if is_async:
                result = await result
            return result
        except BrokerError as e:
            code = e.code.value
            self.log.info("rpc_refused", code=code, message=e.message)
            await context.abort(STATUS[e.code], e.message)
        except Exception as e:
            if isinstance(e, asyncio.CancelledError) or type(e).__name__ == "AbortError":
                raise
            # A bug: say so instead of dropping the connection.
            code = "INTERNAL"
            self.log.error("rpc_internal_error", error=repr(e), exc_info=True)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {e!r}")
        finally:
            self.inflight -= 1
            elapsed = time.perf_counter() - t0
            if self.metrics is not None:
                self.metrics.rpc_latency.record(elapsed, {"method": method, "code": code})
            if self.debug_rpcs:
                self.log.debug("rpc", code=code, ms=round(elapsed * 1e3, 3))
            CALL.reset(call)

    handler.__name__ = method
    return handler


class MemoryBrokerService(broker_pb2_grpc.MemoryBrokerServicer):
    def __init__(
        self,
        store: ObjectStore,
        sessions: SessionManager,
        arena: Arena,
        arena_info: Callable[[], pb.ArenaInfo],
        log,
        metrics=None,
        adapters=None,
    ):
        self.store = store
        # Log every call at debug level (the server sets it from log_level, and on reload).
        self.debug_rpcs = False
        self.sessions = sessions
        self.arena = arena
        self.arena_info = arena_info
        # A structlog logger; the RPC name and session are bound per call.
        self.log = log
        # BrokerMetrics, or None when metrics are off.
        self.metrics = metrics
        # AdapterManager (broker.adapters), or None when adapters are off.
        self.adapters = adapters
        # Set on SIGTERM: new calls are refused with UNAVAILABLE.
        self.draining = False
        # Calls being handled now (the drain waits for them).
        self.inflight = 0
        # Uids whose sessions may register, unregister and prefetch adapters (None: any).
        self.manager_uids: frozenset[int] | None = frozenset({os.getuid()})

    # ------------------------------------------------------------- helpers

    def _session(self, context) -> Session:
        return self.sessions.from_token(token_from_metadata(context.invocation_metadata()))

    def _authorize(self, rule: Rule, method: str, request, context) -> Session | None:
        """Enforce one ``POLICY`` rule; the caller's session (None where none is needed)."""
        if not rule.tcp and is_tcp(context):
            raise BrokerError(
                Code.PERMISSION_DENIED,
                f"{method} is not served on the TCP listener, which cannot tell who is calling; "
                "use the broker's Unix socket (TCP serves GetArena, GetStats and health only)",
            )
        if not rule.session:
            return None
        s = self._session(context)
        if rule.manage:
            self._check_manager(s, method)
        for field in rule.visible:
            self._check_visible(s.session_id, getattr(request, field))
        return s

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

    def _check_visible(self, sid: int, ids) -> None:
        """NOT_FOUND for an anonymous object of another session (as for an unknown id)."""
        store = self.store
        if len(ids) > store.limits.max_batch:
            return  # the core refuses the batch as a whole
        for oid in ids:
            obj = store.get(oid)
            if obj is None or obj.key is not None or obj.owner == sid or store.is_internal(obj.owner):
                continue
            if obj.pins.get(sid):
                continue
            raise BrokerError(Code.NOT_FOUND, f"no object {oid}")

    def _timed_alloc(self, fn, *args):
        if self.metrics is None:
            return fn(*args)
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.metrics.allocation_latency.record(time.perf_counter() - t0)

    def _info(self, obj: Allocation, sid: int, dedup: bool = False) -> pb.ObjectInfo:
        return pb.ObjectInfo(
            object_id=obj.object_id,
            content_type=int(obj.content_type),
            state=int(obj.state),
            key=obj.key or b"",
            pages=obj.pages,
            window_page=obj.window_page,
            session_pins=obj.pins.get(sid, 0),
            total_pins=obj.pin_count,
            deduplicated=dedup,
            owned=obj.owner == sid,
            arena_slabs=self.arena.num_slabs,
        )

    @staticmethod
    def _specs(objects) -> list[Spec]:
        return [spec_from_proto(o) for o in objects]

    # ------------------------------------------------------------- session

    async def Attach(self, request_iterator, context) -> AsyncIterator[pb.SessionEvent]:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the broker is shutting down; retry on its successor")
        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("msg") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first Attach message must be hello")
        try:
            self._authorize(POLICY["Attach"], "Attach", first, context)
            self._check_protocol(first.hello.protocol_version)
            s = self.sessions.open(first.hello.client_name, first.hello.pid)
        except BrokerError as e:
            self.log.info("rpc_refused", rpc="Attach", code=e.code.value, message=e.message)
            await context.abort(STATUS[e.code], e.message)
        CALL.set(("Attach", s.session_id))
        reader = asyncio.ensure_future(self._read_client(request_iterator, s.session_id))
        try:
            yield pb.SessionEvent(
                opened=pb.SessionOpened(
                    session_id=s.session_id,
                    token=s.token,
                    arena=self.arena_info(),
                    protocol_version=wire_session.PROTOCOL_VERSION,
                )
            )
            while True:
                ev = await s.events.get()
                if ev is CLOSED:
                    return
                msg = self._event(ev)
                if msg is not None:
                    yield msg
        finally:
            reader.cancel()
            self.sessions.close(s.session_id, "stream ended")

    @staticmethod
    def _check_protocol(version: int) -> None:
        """Refuse a client that states another protocol version (0, not stated, is served)."""
        if version:
            why = version_mismatch(version, peer="this client", mine="the broker")
            if why is not None:
                raise BrokerError(Code.FAILED_PRECONDITION, why)

    async def _read_client(self, request_iterator, session_id: int) -> None:
        """Detach ends the session; other messages are ignored."""
        detached = False
        try:
            async for msg in request_iterator:
                if msg.WhichOneof("msg") == "detach":
                    detached = True
                    break
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            return
        except Exception:
            return
        else:
            # A half-closed stream (grpcurl does this) keeps the session: only Detach or
            # the stream's end closes it.
            if not detached:
                return
        self.sessions.close(session_id, "client detached")

    @staticmethod
    def _event(ev) -> pb.SessionEvent | None:
        if isinstance(ev, ObjectsEvicted):
            return pb.SessionEvent(evicted=pb.ObjectsEvicted(object_ids=ev.object_ids, keys=ev.keys))
        if isinstance(ev, TransactionsExpired):
            return pb.SessionEvent(transactions_expired=pb.TransactionsExpired(transaction_ids=ev.transaction_ids))
        if isinstance(ev, ArenaGrown):
            return pb.SessionEvent(arena_grown=pb.ArenaGrown(num_slabs=ev.num_slabs))
        if isinstance(ev, ShuttingDown):
            return pb.SessionEvent(shutting_down=pb.ShuttingDown(reason=ev.reason))
        if isinstance(ev, AdapterCorrupted):
            return pb.SessionEvent(
                adapter_corrupted=pb.AdapterCorrupted(
                    adapter_id=ev.adapter_id, object_id=ev.object_id, generation=ev.generation, detail=ev.detail
                )
            )
        return None

    # ------------------------------------------------------------- unary calls

    @_unary
    def GetArena(self, request, context, session):
        return self.arena_info()

    @_unary
    def Allocate(self, request, context, session):
        sid = session.session_id
        out = self._timed_alloc(self.store.allocate, sid, self._specs(request.objects))
        return pb.AllocateResponse(objects=[self._info(o, sid, d) for o, d in out])

    @_unary
    def Prepare(self, request, context, session):
        sid = session.session_id
        t = self._timed_alloc(
            self.store.prepare, sid, self._specs(request.objects), list(request.pin_object_ids), request.lease_ms / 1000.0
        )
        return pb.PrepareResponse(
            transaction_id=t.txn_id,
            deadline_unix_ms=int(t.deadline_unix * 1000),
            objects=[self._info(o, sid) for o in t.objects],
            pinned=[self._info(self.store.get(oid), sid) for oid in t.pinned],
        )

    @_unary
    def Commit(self, request, context, session):
        sid = session.session_id
        txns = self.store.commit(sid, list(request.transaction_ids))
        return pb.CommitResponse(
            transactions=[
                pb.CommittedTransaction(
                    transaction_id=t.txn_id, objects=[self._info(o, sid, d) for o, d in t.result]
                )
                for t in txns
            ]
        )

    @_unary
    def Abort(self, request, context, session):
        sid = session.session_id
        return pb.AbortResponse(freed_pages=self.store.abort(sid, list(request.transaction_ids)))

    @_unary
    def Free(self, request, context, session):
        sid = session.session_id
        freed, deferred = self.store.free(sid, list(request.object_ids))
        return pb.FreeResponse(freed_pages=freed, deferred_pages=deferred)

    @_unary
    def Pin(self, request, context, session):
        sid = session.session_id
        objs = self.store.pin(sid, list(request.object_ids))
        return pb.PinResponse(objects=[self._info(o, sid) for o in objs])

    @_unary
    def Unpin(self, request, context, session):
        sid = session.session_id
        self.store.unpin(sid, list(request.object_ids))
        return pb.UnpinResponse()

    @_unary
    def Lookup(self, request, context, session):
        sid = session.session_id
        objs = self.store.lookup(sid, list(request.keys), request.pin)
        return pb.LookupResponse(objects=[self._info(o, sid) for o in objs])

    @_unary
    def GetStats(self, request, context, session):
        st = self.store.stats()
        return pb.Stats(
            backend=self.arena.backend,
            page_size=self.arena.geometry.page_size,
            num_slabs=self.arena.num_slabs,
            max_pages=st.max_pages,
            capacity_pages=st.capacity_pages,
            free_pages=st.free_pages,
            used_pages=st.used_pages,
            prepared_pages=st.prepared_pages,
            pinned_pages=st.pinned_pages,
            evictable_pages=st.evictable_pages,
            utilization=st.utilization,
            high_watermark=st.high_watermark,
            low_watermark=st.low_watermark,
            eviction_active=st.eviction_active,
            eviction_runs=st.eviction_runs,
            evicted_objects=st.evicted_objects,
            evicted_pages=st.evicted_pages,
            objects=st.objects,
            keyed_objects=st.keyed_objects,
            sessions=st.sessions,
            open_transactions=st.open_transactions,
            by_content=[pb.ContentStats(content_type=ct, objects=n, pages=p) for ct, (n, p) in st.by_content.items()],
            window_free_pages=st.window_free_pages,
            window_free_extents=st.window_free_extents,
            window_largest_free=st.window_largest_free,
            window_fragmentation=st.window_fragmentation,
            allocations_total=st.allocations_total,
            deduplicated_total=st.deduplicated_total,
            allocation_failures=st.allocation_failures,
            adapters=self._adapter_stats() if self.adapters is not None else None,
            by_owner=[self._owner_stats(sid, ct, n, p) for (sid, ct), (n, p) in self.store.objects_by_owner().items()],
        )

    def _owner_stats(self, sid: int, ct: int, n: int, p: int) -> pb.OwnerStats:
        s = self.sessions.by_id.get(sid)
        name, pid = (s.client_name, s.claimed_pid) if s is not None else ("", 0)
        if self.store.is_internal(sid):
            name = "broker (internal)"
        return pb.OwnerStats(session_id=sid, client_name=name, pid=pid, content_type=ct, objects=n, pages=p)

    # ------------------------------------------------------------- adapters

    def _manager(self):
        if self.adapters is None:
            raise BrokerError(Code.FAILED_PRECONDITION, "adapters are not enabled on this broker")
        return self.adapters

    def _adapter_stats(self) -> pb.AdapterStats:
        a = self.adapters.stats()
        res, hits, loads, loaded, im = a.resident, a.hits, a.loads, a.bytes_loaded, a.images
        return pb.AdapterStats(
            registered=a.registered, hot=res.hot, warm=res.warm, cold=res.cold,
            hot_pages=a.hot_pages, warm_bytes=a.warm_bytes,
            found_hot=hits.hot, found_warm=hits.warm, found_cold=hits.cold,
            loads_hot=loads.hot, loads_warm=loads.warm,
            bytes_loaded_hot=loaded.hot, bytes_loaded_warm=loaded.warm,
            hit_rate=a.hit_rate, deferred=a.deferred, shared_loads=a.shared_loads,
            load_failures=a.load_failures, evictions=a.evictions, demotions=a.demotions,
            image_count=im.count, image_bytes=im.bytes, image_budget_bytes=im.budget_bytes,
            image_hits=im.hits, image_misses=im.misses, converted_ahead=im.converted_ahead,
            convert_queued=im.convert_queued,
        )  # fmt: skip

    def _adapter_msg(self, info: AdapterInfo) -> pb.Adapter:
        """A registered adapter (its one record, ``AdapterInfo``) plus where it is now."""
        st = self.adapters.resident(info.adapter_id)
        return pb.Adapter(
            adapter_id=info.adapter_id,
            path=info.source,
            rank=info.rank,
            lora_alpha=info.lora_alpha,
            use_rslora=info.use_rslora,
            target_modules=list(info.target_modules),
            num_layers=info.num_layers,
            file_bytes=info.file_bytes,
            registered_at=info.registered_at,
            tier=TIERS[st.tier] if st is not None else pb.ADAPTER_TIER_COLD,
            generation=st.generation if st is not None else 0,
            pin_count=st.pin_count if st is not None else 0,
            num_pages=st.num_pages if st is not None else 0,
            image_state=pb.AdapterImageState.Value(f"ADAPTER_IMAGE_STATE_{self.adapters.image_state(info.adapter_id).upper()}"),
        )

    def _layout_msg(self, adapter_id: str, layout, generation: int, object_id: int, pages) -> pb.AdapterLayout:
        return layout_to_proto(adapter_id, layout, generation, object_id, pages, self.arena.num_slabs)

    @_unary
    async def RegisterAdapter(self, request, context, session):
        m = self._manager()
        path = check_path_text(request.path)
        meta = await m.register(request.adapter_id, path, caller=session.caller)
        self.log.info("adapter_registered", adapter=meta.adapter_id, path=meta.source, rank=meta.rank)
        return pb.RegisterAdapterResponse(adapter=self._adapter_msg(meta.info))

    @_unary
    def UnregisterAdapter(self, request, context, session):
        metas = self._manager().unregister_many(list(request.adapter_ids))
        self.log.info("adapters_unregistered", adapters=[m.adapter_id for m in metas])
        return pb.UnregisterAdapterResponse()

    @_unary
    def ListAdapters(self, request, context, session):
        m = self._manager()
        page = m.registry.list(request.prefix, request.limit or 100, request.page_token)
        return pb.ListAdaptersResponse(
            adapters=[self._adapter_msg(a) for a in page.adapters],
            next_page_token=page.next_page_token,
            total=m.registry.count(request.prefix),
        )

    @_unary
    def GetAdapterLayout(self, request, context, session):
        m = self._manager()
        layout = m.layout(request.adapter_id)
        st = m.describe(request.adapter_id)
        return self._layout_msg(request.adapter_id, layout, st.generation, st.object_id, st.pages)

    @_unary
    async def AcquireAdapters(self, request, context, session):
        m = self._manager()
        sid = session.session_id
        ids = list(request.adapter_ids)
        cap = request.max_adapters or None
        if request.prepare:
            r = await m.prepare_acquire(sid, ids, cap, request.with_layout, (request.lease_ms / 1000.0) or None)
        else:
            r = await m.acquire(sid, ids, cap, request.with_layout)
        slabs = self.arena.num_slabs
        return pb.AcquireAdaptersResponse(
            adapters=[
                pb.AcquiredAdapter(
                    adapter_id=a.adapter_id,
                    generation=a.generation,
                    object_id=a.object_id,
                    pages=list(a.pages),
                    layout=self._layout_msg(a.adapter_id, a.layout, a.generation, a.object_id, a.pages)
                    if a.layout is not None
                    else None,
                    found_in=TIERS[a.found_in],
                    arena_slabs=slabs,
                )
                for a in r.adapters
            ],
            deferred=list(r.deferred),
            transaction_id=r.txn_id,
            deadline_unix_ms=int(r.deadline_unix * 1000),
        )

    @_unary
    def ReleaseAdapters(self, request, context, session):
        self._manager().release(session.session_id, list(request.adapter_ids))
        return pb.ReleaseAdaptersResponse()

    @_unary
    async def PrefetchAdapters(self, request, context, session):
        tier = {pb.ADAPTER_TIER_UNSPECIFIED: "hot", pb.ADAPTER_TIER_HOT: "hot", pb.ADAPTER_TIER_WARM: "warm"}.get(
            request.tier
        )
        if tier is None:
            raise BrokerError(Code.INVALID_ARGUMENT, "tier must be ADAPTER_TIER_WARM or ADAPTER_TIER_HOT")
        r = await self._manager().prefetch(list(request.adapter_ids), tier)
        return pb.PrefetchAdaptersResponse(
            loaded={k: TIERS[v] for k, v in r.loaded.items()},
            failed={k: f"{e.code.value}: {e.message}" for k, e in r.failed.items()},
        )

    @_unary
    async def VerifyAdapters(self, request, context, session):
        checks = await self._manager().verify(list(request.adapter_ids))
        return pb.VerifyAdaptersResponse(
            checks=[
                pb.AdapterCheck(
                    adapter_id=c.adapter_id, tier=TIERS[c.tier], checked=c.checked, ok=c.ok, checksum=c.checksum,
                    detail=c.detail,
                )
                for c in checks
            ],
            corrupt=sum(1 for c in checks if not c.ok),
        )


class EchoService(echo_pb2_grpc.EchoServicer):
    """The floor for RPC benchmarks: same server, same socket, no work."""

    async def Echo(self, request, context):
        return echo_pb2.EchoResponse(payload=request.payload)


__all__ = ["MemoryBrokerService", "EchoService", "ArenaGrown", "ShuttingDown", "SESSION_METADATA", "POLICY", "Rule"]
