"""The gRPC servicer: RPCs to core calls under the ``POLICY`` table (``policy.py``), errors to statuses.

``POLICY`` says per RPC whether it needs a session, which targets the session must own or
see, whether it changes state, whether it needs an adapter-manager uid, and whether the TCP
listener (which has no peer credentials) serves it; ``_unary`` has it enforced in one place
before any handler runs, by ``SessionManager.authorize`` (``broker/sessions/manager.py``),
which the step channel calls too. Handlers convert requests into core calls on the event loop that
owns the core; ``BrokerError`` codes map onto gRPC statuses, anything else is a bug and
becomes INTERNAL.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar

import grpc

from memory_broker.broker.adapters.access import check_path_text
from memory_broker.broker.adapters.layout import ModuleShard
from memory_broker.broker.adapters.peft import AdapterInfo
from memory_broker.broker.arena.base import Arena
from memory_broker.broker.doors import engine_rpcs
from memory_broker.broker.doors.messages import (
    adapter_message,
    adapter_stats_message,
    event_message,
    stats_message,
    tier_stats_message,
)
from memory_broker.broker.doors.policy import CALL, POLICY, Rule
from memory_broker.broker.sessions.manager import CLOSED, Session, SessionManager
from memory_broker.broker.store.object_table import ReplyRoom
from memory_broker.broker.store.objects import Allocation, ObjectStore, Spec
from memory_broker.proto.wire import session as wire_session
from memory_broker.proto.wire.errors import BrokerError, Code, invalid
from memory_broker.proto.wire.messages import TIERS, layout_to_proto, spec_from_proto
from memory_broker.proto.wire.session import SESSION_METADATA, version_mismatch
from memory_broker.proto.wire.status import STATUS
from memory_broker.proto.wire.step import MAX_REPLY_BYTES
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc, echo_pb2, echo_pb2_grpc


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

    async def handler(self: MemoryBrokerService, request, context):
        t0 = time.perf_counter()
        code = "OK"
        call = CALL.set((method, None))
        self.inflight += 1
        try:
            session = self._authorize(rule, method, request, context)
            if session is not None:
                CALL.set((method, session.session_id))
                self.replies.admit(session.session_id, method)
            result = fn(self, request, context, session)
            if is_async:
                result = await result
            return result
        except BrokerError as e:
            code = e.code.value
            self.log.info("rpc_refused", code=code, message=e.message)
            # The abort's exception keeps this one as its context, in a cycle no young
            # collection frees: its frames (which hold the request) go now.
            e.__traceback__ = None
            await context.abort(STATUS[e.code], e.message)
        except Exception as e:
            if isinstance(e, asyncio.CancelledError) or type(e).__name__ == "AbortError":
                raise
            # A bug: say so instead of dropping the connection.
            code = "INTERNAL"
            self.log.error("rpc_internal_error", error=repr(e), exc_info=True)
            e.__traceback__ = None
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {e!r}")
        finally:
            request = None  # noqa: F841  (this frame may outlive the call: see above)
            self.inflight -= 1
            elapsed = time.perf_counter() - t0
            if self.metrics is not None:
                self.metrics.rpc_latency.record(elapsed, method, code)
            if self.debug_rpcs:
                self.log.debug("rpc", code=code, ms=round(elapsed * 1e3, 3))
            CALL.reset(call)

    handler.__name__ = method
    return handler


# A request of at least this many bytes counts against ``listeners.large_requests``.
LARGE_REQUEST = 1 << 20


class Refused:
    """What the gate's deserializer hands the handler in place of a request it did not parse."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


class RequestGate:
    """The bytes of unary requests being handled, bounded (issue 26, item 8).

    gRPC refuses a request over ``listeners.max_request_size`` at its header, unread. One
    under it reaches the gate's deserializer as raw bytes; if its size would take the bytes
    being handled over ``listeners.request_bytes_in_flight``, or it is large
    (``LARGE_REQUEST``) and ``listeners.large_requests`` are already being handled, it is
    answered RESOURCE_EXHAUSTED without being parsed, which is where a burst of large
    requests spent its memory and the event loop's time. The count is released when the
    handler returns. Everything runs on the event loop: no lock.
    """

    def __init__(self, max_bytes: int, max_large: int, on_large: Callable[[], None] | None = None):
        self.max_bytes = max_bytes
        self.max_large = max_large
        # Called each time a large request is done or refused (the server hands the memory
        # a burst of them freed back to the system once the burst is over).
        self.on_large = on_large
        self.bytes = 0
        self.large = 0
        self.refused = 0

    def _admit(self, n: int) -> str | None:
        large = n >= LARGE_REQUEST
        if self.bytes + n > self.max_bytes:
            why = (
                f"{self.bytes} bytes of requests are being handled and this one is {n} bytes: over "
                f"listeners.request_bytes_in_flight ({self.max_bytes} bytes)"
            )
        elif large and self.large >= self.max_large:
            why = (
                f"{self.large} requests of {LARGE_REQUEST >> 20} MiB or more are being handled and this one is "
                f"{n} bytes: over listeners.large_requests ({self.max_large})"
            )
        else:
            self.bytes += n
            self.large += large
            return None
        self.refused += 1
        if large and self.on_large is not None:
            self.on_large()
        return f"the broker is busy: {why}; retry shortly, or send smaller batches"

    def release(self, n: int) -> None:
        self.bytes -= n
        if n >= LARGE_REQUEST:
            self.large -= 1
            if self.on_large is not None:
                self.on_large()

    def deserializer(self, parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
        def deserialize(raw: bytes):
            n = len(raw)
            why = self._admit(n)
            if why is not None:
                return Refused(why)
            try:
                return Admitted(parse(raw), n)
            except BaseException:
                self.release(n)
                raise

        return deserialize

    def handler(self, behavior):
        async def handle(held, context):
            if type(held) is Refused:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, held.message)
            try:
                return await behavior(held.request, context)
            finally:
                # A refusal leaves gRPC's frames of this call in a reference cycle (the
                # AbortError's traceback), and full collections are off (app.quiet_gc):
                # what they hold must not keep the request alive.
                held.request = None
                self.release(held.n)

        return handle


# The replies of one session that gRPC has not finished sending (its client is not reading
# them), in bytes: at this many, its next calls are refused until it reads them (issue 48,
# item 2). Room for two of the largest Pin or Lookup replies (``MAX_REPLY_BYTES`` each).
REPLY_BACKLOG_BYTES = 2 * MAX_REPLY_BYTES
# Once a session that had this many bytes of replies unsent has one more sent, the server hands
# freed memory back (``on_large``).
LARGE_REPLY = 1 << 20
# Calls that only give back: served whatever the session's unsent replies (their replies are empty).
GIVE_BACKS = frozenset({"Unpin", "Free", "Abort", "ReleaseAdapters"})
# The session of the call being served, set by ``_unary`` (in the call's task) for ``ReplyBacklog``.
REPLY_TO: ContextVar[int] = ContextVar("memory_broker_reply_to", default=0)


class ReplyBacklog:
    """The bytes of each session's gRPC replies not yet sent, bounded (issue 48, item 2).

    ``handler`` wraps each unary method's handler: its reply is encoded as soon as it returns
    (an unsent reply then holds its bytes, not the message too) and counts against the call's
    session until gRPC has sent it or the call ended with its connection (the call's done
    callback). While a session's unsent replies are at ``max_bytes`` or more, ``admit``
    refuses its calls (RESOURCE_EXHAUSTED) but those that only give back (``GIVE_BACKS``): a
    client that stops reading holds at most about ``max_bytes`` plus one reply in the broker,
    whatever it sends meanwhile (one reply is itself bounded: ``ReplyRoom``, and gRPC's
    ``max_send_message_length``). ``on_large`` (the server's ``MemoryReturner``) hands the
    memory back as a large backlog drains. Everything runs on the event loop: no lock."""

    def __init__(self, max_bytes: int = REPLY_BACKLOG_BYTES, on_large: Callable[[], None] | None = None):
        self.max_bytes = max_bytes
        self.on_large = on_large
        self.unsent: dict[int, int] = {}
        self.refused = 0

    def admit(self, sid: int, method: str) -> None:
        """Refuse a call of session ``sid`` while its unsent replies are over the bound; else
        mark the call as the session's (``REPLY_TO``), for ``handler`` to count its reply."""
        held = self.unsent.get(sid, 0)
        if held >= self.max_bytes and method not in GIVE_BACKS:
            self.refused += 1
            raise BrokerError(
                Code.RESOURCE_EXHAUSTED,
                f"session {sid} has {held} bytes of replies the broker could not send yet (its client does not "
                f"read them); at {self.max_bytes} its calls are refused until it reads them: read, then retry",
            )
        REPLY_TO.set(sid)

    def handler(self, behavior, serialize: Callable[[object], bytes]):
        """``behavior`` answering its reply encoded (register the method with no serializer)."""

        async def handle(request, context) -> bytes:
            call = behavior(request, context)
            del request  # a refusal's traceback keeps this frame alive (see ``_unary``): not the request
            data = serialize(await call)
            sid = REPLY_TO.get()
            if sid and data:
                n = len(data)
                self.unsent[sid] = self.unsent.get(sid, 0) + n
                context.add_done_callback(lambda _call: self._sent(sid, n))
            return data

        return handle

    def _sent(self, sid: int, n: int) -> None:
        held = self.unsent.pop(sid, 0)
        if held > n:
            self.unsent[sid] = held - n
        if held >= LARGE_REPLY and self.on_large is not None:
            self.on_large()


class Admitted:
    """A request the gate let in, and its size; emptied when its handler returns."""

    __slots__ = ("request", "n")

    def __init__(self, request: object, n: int):
        self.request = request
        self.n = n


class _Handlers:
    """Stands in for a server to collect the handlers the generated code registers."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def add_to_server(service: MemoryBrokerService, server, gate: RequestGate) -> None:
    """Register the servicer as the generated code would, its unary requests through ``gate``
    and their replies counted by the service's ``ReplyBacklog``."""
    got = _Handlers()
    broker_pb2_grpc.add_MemoryBrokerServicer_to_server(service, got)
    handlers = {
        name: h
        if h.request_streaming or h.response_streaming
        else h._replace(
            unary_unary=gate.handler(service.replies.handler(h.unary_unary, h.response_serializer)),
            request_deserializer=gate.deserializer(h.request_deserializer),
            response_serializer=None,
        )
        for name, h in got.handlers.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(got.service, handlers),))
    server.add_registered_method_handlers(got.service, handlers)


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
        # Who may call what: the same policy object the step channel enforces.
        # Calls being handled now (the drain waits for them).
        self.inflight = 0
        # KeyDigests (broker/store/digests.py), or None when memory_pool.integrity.kv_digest is off.
        self.digests = None
        # TierLink (broker/store/tiering.py), or None without tier.backend.
        self.tier = None
        # Each session's replies gRPC has not sent yet, bounded (``add_to_server`` counts them).
        self.replies = ReplyBacklog()
        # Engines' KV groups (broker/store/engine_pool.py), or None: no engine pool; waiting
        # grows wake on engine_changes; a grow waits engine_reclaim_wait_s for give-backs.
        self.engine_pool = None
        self.engine_changes = engine_rpcs.Changes()
        self.engine_reclaim_wait_s = 0.5

    @property
    def draining(self) -> bool:
        """Set on SIGTERM: new calls are refused with UNAVAILABLE (at both doors)."""
        return self.sessions.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.sessions.draining = value

    @property
    def manager_uids(self) -> frozenset[int] | None:
        """Uids whose sessions may register, unregister and prefetch adapters (None: any)."""
        return self.sessions.manager_uids

    @manager_uids.setter
    def manager_uids(self, value: frozenset[int] | None) -> None:
        self.sessions.manager_uids = value

    # ------------------------------------------------------------- helpers

    def _authorize(self, rule: Rule, method: str, request, context) -> Session | None:
        """The gRPC door: refuse while draining and on the TCP listener where the rule says
        so, find the session the token names and the proof key the call carries, then the
        policy both doors share (``SessionManager.authorize``)."""
        self.sessions.check_open()
        if not rule.tcp and is_tcp(context):
            raise BrokerError(
                Code.PERMISSION_DENIED,
                f"{method} is not served on the TCP listener, which cannot tell who is calling; "
                "use the broker's Unix socket (TCP serves GetArena, GetStats and health only)",
            )
        if not rule.session:
            return None
        s, key = self.sessions.from_metadata(context.invocation_metadata())
        self.sessions.authorize(method, rule, s, lambda field: getattr(request, field), key=key)
        return s

    async def _timed_alloc(self, fn, *args):
        """``fn(*args)`` (a store call that may grow the arena: the grow runs off the loop,
        ``store.growth``), timed with any grow it waited for."""
        growth = self.store.growth
        t0 = time.perf_counter()
        try:
            return fn(*args) if growth is None else await growth.run(lambda: fn(*args))
        finally:
            if self.metrics is not None:
                self.metrics.allocation_latency.record(time.perf_counter() - t0)

    def _slabs(self) -> int:
        """The slabs behind the pages the store hands out (the arena's, as its page pool
        counts them; the shared pool is the last, after any tenant pools' slabs): a client
        maps this many before it touches the pages it is told of."""
        pool = self.store.pool
        return (pool.base + pool.capacity_pages) // pool.pages_per_slab

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
            arena_slabs=self._slabs(),
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
                msg = event_message(ev)
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

    # ------------------------------------------------------------- unary calls

    @_unary
    def GetArena(self, request, context, session):
        return self.arena_info()

    @_unary
    async def Allocate(self, request, context, session):
        sid = session.session_id
        out = await self._timed_alloc(self.store.allocate, sid, self._specs(request.objects))
        return pb.AllocateResponse(objects=[self._info(o, sid, d) for o, d in out])

    @_unary
    async def Prepare(self, request, context, session):
        sid = session.session_id
        ReplyRoom.admit(request.pin_object_ids, "pin_object_ids")  # a client's pins: each once, as Pin's
        t = await self._timed_alloc(
            self.store.prepare,
            sid,
            self._specs(request.objects),
            list(request.pin_object_ids),
            request.lease_ms / 1000.0,
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
                pb.CommittedTransaction(transaction_id=t.txn_id, objects=[self._info(o, sid, d) for o, d in t.result])
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
        objs = self.store.pin(sid, list(request.object_ids), ReplyRoom())
        return pb.PinResponse(objects=[self._info(o, sid) for o in objs])

    @_unary
    def Unpin(self, request, context, session):
        sid = session.session_id
        self.store.unpin(sid, list(request.object_ids))
        return pb.UnpinResponse()

    @_unary
    def Lookup(self, request, context, session):
        sid = session.session_id
        keys = list(request.keys)
        objs = self.store.lookup(sid, keys, request.pin, ReplyRoom())
        tier = 0
        if request.tier and self.tier is not None:
            tier = self.tier.probe(self.store.sessions[sid].pool, keys, len(objs))
        return pb.LookupResponse(objects=[self._info(o, sid) for o in objs], tier_blocks=tier)

    @_unary
    def GetStats(self, request, context, session):
        adapters = adapter_stats_message(self.adapters.stats()) if self.adapters is not None else None
        by_owner = [self._owner_stats(sid, ct, n, p) for (sid, ct), (n, p) in self.store.objects_by_owner().items()]
        msg = stats_message(
            self.store.stats(),
            self.arena.backend,
            self.arena.geometry.page_size,
            self.arena.num_slabs,
            adapters,
            by_owner,
        )
        if self.tier is not None:
            msg.tier.CopyFrom(tier_stats_message(self.tier.stats()))
        if self.engine_pool is not None:
            msg.engines.extend(engine_rpcs.engine_stats_message(e) for e in self.engine_pool.stats())
        return msg

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

    def _adapter_msg(self, info: AdapterInfo) -> pb.Adapter:
        return adapter_message(
            info, self.adapters.resident(info.adapter_id), self.adapters.image_state(info.adapter_id)
        )

    def _layout_msg(self, adapter_id: str, layout, generation: int, object_id: int, pages) -> pb.AdapterLayout:
        return layout_to_proto(adapter_id, layout, generation, object_id, pages, self._slabs())

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
        layout = m.layout(request.adapter_id, request.dtype, _shards(request.shards))
        st = m.describe(request.adapter_id)
        return self._layout_msg(request.adapter_id, layout, st.generation, st.object_id, st.pages)

    @_unary
    async def AcquireAdapters(self, request, context, session):
        m = self._manager()
        sid = session.session_id
        ids = list(request.adapter_ids)
        cap = request.max_adapters or None
        dtype = request.dtype
        shards = _shards(request.shards)
        if request.prepare:
            lease_s = (request.lease_ms / 1000.0) or None
            r = await m.prepare_acquire(sid, ids, cap, request.with_layout, lease_s, dtype, shards)
        else:
            r = await m.acquire(sid, ids, cap, request.with_layout, dtype, shards)
        slabs = self._slabs()
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
        self._manager().release(session.session_id, list(request.adapter_ids), request.dtype)
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
                    adapter_id=c.adapter_id,
                    tier=TIERS[c.tier],
                    checked=c.checked,
                    ok=c.ok,
                    checksum=c.checksum,
                    detail=c.detail,
                )
                for c in checks
            ],
            corrupt=sum(1 for c in checks if not c.ok),
        )

    @_unary
    async def VerifyObjects(self, request, context, session):
        if self.digests is None:
            raise BrokerError(
                Code.FAILED_PRECONDITION,
                "object digests are off on this broker; start it with --kv-digest "
                "(memory_pool.integrity.kv_digest: true) to have committed keyed objects digested",
            )
        checks = await self.digests.verify(list(request.keys))
        return pb.VerifyObjectsResponse(
            checks=[
                pb.ObjectCheck(
                    key=c.key, object_id=c.object_id, checked=c.checked, ok=c.ok, digest=c.digest, detail=c.detail
                )
                for c in checks
            ],
            corrupt=sum(1 for c in checks if not c.ok),
        )

    # Engines' own KV cache on the pool's pages (engine_rpcs.py; docs/engine-pool.md).
    EngineKvRegister = _unary(engine_rpcs.EngineKvRegister)
    EngineKvGrow = _unary(engine_rpcs.EngineKvGrow)
    EngineKvShrink = _unary(engine_rpcs.EngineKvShrink)


class EchoService(echo_pb2_grpc.EchoServicer):
    """The floor for RPC benchmarks: same server, same socket, no work."""

    async def Echo(self, request, context):
        return echo_pb2.EchoResponse(payload=request.payload)


__all__ = ["MemoryBrokerService", "EchoService", "RequestGate", "add_to_server", "SESSION_METADATA", "POLICY", "Rule"]


def _shards(msgs) -> list[ModuleShard]:
    """AcquireAdaptersRequest.shards as the core's records (INVALID_ARGUMENT for a bad one)."""
    try:
        return [ModuleShard(m.module, m.split_input, m.index, m.count) for m in msgs]
    except ValueError as e:
        raise invalid(f"shards: {e}") from None
