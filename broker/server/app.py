"""Process wiring: the arena, the core, the gRPC server, the fd channel, and their lifecycle.

``BrokerServer`` builds everything from ``ServeOptions`` on one asyncio event loop (which
owns all core state), serves until SIGTERM/SIGINT, then drains: health NOT_SERVING, new
calls refused with UNAVAILABLE, sessions told on their streams, in-flight calls given the
grace period, everything released, the socket lock dropped.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import grp
import os
import resource
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from memory_broker.broker.adapters import AdapterManager, AdapterRegistry
from memory_broker.broker.adapters.layout import DTYPE_SIZES
from memory_broker.broker.arena import make_arena
from memory_broker.broker.doors.fd_channel import FD_BUDGET, FdChannelServer
from memory_broker.broker.doors.messages import ArenaGrown, ShuttingDown
from memory_broker.broker.doors.service import EchoService, MemoryBrokerService, RequestGate, add_to_server
from memory_broker.broker.doors.step_channel import StepChannelServer
from memory_broker.broker.server.config import ConfigError, build_options, deprecation_notes, reload_changes
from memory_broker.broker.server.gpu_layout import link_instance, serving_gpu
from memory_broker.broker.server.lock import SocketLock
from memory_broker.broker.server.metrics import BrokerMetrics
from memory_broker.broker.server.notify import Notifier
from memory_broker.broker.server.options import (
    ServeOptions,
    adapter_config,
    adapter_size_limit,
    engine_limits,
    lmcache_chunk_bytes,
    socket_mode,
)
from memory_broker.broker.server.tenancy import fd_authorize, fd_scope, make_pools
from memory_broker.broker.sessions.liveness import PidWatcher
from memory_broker.broker.sessions.manager import MAX_UNPROVEN, SessionManager
from memory_broker.broker.store.digests import KeyDigests
from memory_broker.broker.store.engine_pool import EnginePool
from memory_broker.broker.store.eviction import make_policy
from memory_broker.broker.store.growth import Growth
from memory_broker.broker.store.objects import ObjectStore, StoreConfig, StoreStats
from memory_broker.broker.store.pool import WindowSpace
from memory_broker.broker.store.tiering import LMCacheFleet, TierLink
from memory_broker.proto.wire import native
from memory_broker.proto.wire.errors import BrokerError
from memory_broker.proto.wire.mapping import ArenaGeometry, format_size
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import echo_pb2, echo_pb2_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MemoryBroker"].full_name
# Unary calls served at once beyond one Attach stream per session (more wait: RESOURCE_EXHAUSTED).
MAX_CALLS_IN_FLIGHT = 1024
# The server pings a connection silent this long, and drops it if the ping goes unanswered
# within the timeout: a vanished peer (its host or network gone) is noticed in under a minute.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
# Clients may ping (BrokerClient does not by default); not more often than this.
MIN_CLIENT_PING_INTERVAL_MS = 10_000


def step_socket_path(socket_path: str) -> str:
    """Where the step channel listens: beside the gRPC socket, as the fd channel is."""
    return socket_path + ".step"


# The largest reply gRPC sends: a backstop above every bounded one (a Pin's or Lookup's
# records stop at MAX_REPLY_BYTES, 8 MiB, before they are encoded; an Allocate's, Prepare's or
# Commit's are those of objects its own requests made). Larger, the call ends RESOURCE_EXHAUSTED.
MAX_SEND_BYTES = 64 << 20
# Streams one connection may have open: each session's Attach stream is one (one process's
# clients share a connection), so this stays high; what a connection's unread replies hold is
# bounded per session instead (``ReplyBacklog``, 16 MiB).
MAX_STREAMS = 1024


def server_options(opts: ServeOptions) -> list[tuple[str, int]]:
    """gRPC server settings: message sizes, keepalive, and the idle limit.

    A connection with no call open for ``idle_timeout_s`` is closed (an Attach stream is a
    call, so a live session's connection is never idle). There is no maximum connection
    age: ending a connection would end the session streamed over it."""
    return [
        # Larger requests are refused by gRPC at their header, before it reads them.
        ("grpc.max_receive_message_length", opts.max_request_size),
        ("grpc.max_send_message_length", MAX_SEND_BYTES),
        ("grpc.max_connection_idle_ms", int(opts.idle_timeout_s * 1000)),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.max_concurrent_streams", MAX_STREAMS),
    ]


def make_private_dir(path: str) -> None:
    """Create ``path`` 0700, or make an existing one of ours 0700 (it holds the registry)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(path, 0o700)


# How often open transactions are checked for expired leases.
EXPIRY_TICK_S = 0.1


def quiet_gc() -> None:
    """Keep Python's full garbage collections off the event loop's path.

    A full collection walks every tracked object: about a second at 1M objects, during which
    no RPC is served. The broker's state is freed by reference counting (objects, pins,
    sessions hold no cycles), so the daemon freezes what startup built and stops automatic
    full collections; the young generations are still collected as usual, which is where
    short-lived cycles (exceptions, tracebacks) die.
    """
    gc.collect()
    gc.freeze()
    t0, t1, _ = gc.get_threshold()
    gc.set_threshold(t0, t1, 1 << 30)


# Seconds between two batches of the store's deferred work (see _schedule_store_work).
STORE_WORK_GAP_S = 0.001


class BrokerServer:
    def __init__(self, opts: ServeOptions, log, overrides: dict | None = None):
        opts.validate()
        self.opts = opts
        self.log = log
        # Flags given on the command line: a reload rereads the file but keeps these.
        self.overrides = dict(overrides or {})
        self.notifier = Notifier()
        self.metrics: BrokerMetrics | None = None
        # The tier past one host and its link to the store (tier.backend), or None.
        self.tier: TierLink | None = None
        self._stopped = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        opts = self.opts
        loop = asyncio.get_running_loop()
        self.lock = SocketLock(opts.socket)
        self.lock.acquire()
        self.fd_limit = "{} (hard {})".format(*raise_fd_limit())
        try:
            await self._start(loop)
        except BaseException:
            await self._release()
            raise
        quiet_gc()
        self.notifier.ready(self.status_line())

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        opts = self.opts
        for path in (opts.socket, opts.fd_socket, step_socket_path(opts.socket)):
            # Stale sockets of a dead broker: the lock says no live broker owns them.
            if os.path.exists(path):
                os.unlink(path)
        make_private_dir(opts.state_dir)
        why = self._build_core(loop)
        self.gpu, self.gpu_uuid = serving_gpu(self.opts, getattr(self.arena, "device_id", ""))
        await self._open_doors(loop)
        self._tasks.append(asyncio.ensure_future(self._expire_leases()))
        self._tasks.append(asyncio.ensure_future(self._status_loop()))
        try:
            # Prune images of unregistered adapters; queue conversions ahead of use.
            await self.adapters.start()
        except (OSError, BrokerError) as err:
            self.log.warning("adapter_images_census_failed", error=str(err))
        if self.notifier.watchdog_interval_s:
            self._tasks.append(asyncio.ensure_future(self._watchdog_loop()))
        self.log_serving(why, link_instance(opts, self.gpu))

    def _build_core(self, loop: asyncio.AbstractEventLoop) -> str:
        """The arena, pool, store, adapter wing and sessions; returns why this arena backend."""
        opts = self.opts
        pages_per_slab = opts.slab_size // opts.page_size
        max_slabs = opts.pool_size // opts.slab_size
        self.geometry = ArenaGeometry(
            page_size=opts.page_size,
            pages_per_slab=pages_per_slab,
            max_slabs=max_slabs,
            window_pages=pages_per_slab * max_slabs * opts.window_factor,
        )
        self.arena, why = make_arena(opts.arena, self.geometry, name=f"memory-broker-{os.getpid()}", device=opts.device)
        # The shared pool grows off the loop for Allocate, Prepare and adapter loads (the
        # tenants' slabs and preallocate are made here, in place, before serving).
        self.growth = Growth(self.arena.grow, self._grown)
        pool, tenants = make_pools(opts, self.arena, grow=self.growth)
        self.growth.pool = pool
        self.store = ObjectStore(
            pool,
            WindowSpace(self.geometry.window_pages, opts.placement),
            make_policy(opts.eviction_policy),
            StoreConfig(
                high_watermark=opts.high_watermark,
                low_watermark=opts.low_watermark,
                default_lease_s=opts.default_lease_s,
                max_pins_per_session=opts.max_pins_per_session,
            ),
            notify=self._route_event,
            tenants=tenants,
        )
        self.store.growth = self.growth
        # Eviction to the low watermark and the release of a large ended session run in
        # batches between other callbacks of this loop, never as one long stall.
        self._store_work_scheduled = False
        self.store.background = lambda: self._schedule_store_work(loop)
        self.registry = open_registry(opts)
        self.adapters = AdapterManager(
            self.store,
            self.arena,
            self.registry,
            adapter_config(opts),
            log=self.log,
        )
        self.digests = make_digests(opts, self.store, self.arena, self.log, self._tasks)
        # After the digests: the link chains its write-behind after theirs on commit.
        self.tier = make_tier(opts, self.store, self.arena, self.geometry, self.log, self._tier_latency)
        if self.tier is not None and opts.tier_adapters:
            from memory_broker.broker.adapters.tier_images import TierImages

            images = TierImages(self.tier.tier, opts.tier_key_prefix, self.log)
            self.adapters.image_service.tier = self.tier.images = images
        # Engines' own KV cache on the pool's pages (docs/engine-pool.md).
        self.engine_pool = EnginePool(self.store, engine_limits(opts))
        self.store.on_session_end = self.engine_pool.session_ended
        # The adapter manager holds one pin per acquire in flight: no per-session limit for it.
        self.store.mark_internal(self.adapters.system_session)
        self.watcher = PidWatcher(loop)
        self.sessions = SessionManager(
            self.store,
            self.watcher,
            log=self._log_event,
            max_sessions=opts.max_sessions,
            max_sessions_per_uid=opts.max_sessions_per_uid,
            allowed_uids=opts.effective_uids(),
        )
        return why

    async def _open_doors(self, loop: asyncio.AbstractEventLoop) -> None:
        """Metrics, the service, the fd and step channels and the gRPC server (serving, healthy)."""
        opts = self.opts
        if opts.metrics_port:
            self.metrics = BrokerMetrics(self.arena.backend, self.gpu_uuid)
            self.metrics_port = self.metrics.serve(opts.metrics_port, opts.metrics_address)
        self.service = MemoryBrokerService(
            self.store, self.sessions, self.arena, self.arena_info, self.log, self.metrics, self.adapters
        )
        self.service.digests = self.digests
        self.service.engine_pool = self.engine_pool
        self.service.engine_reclaim_wait_s = opts.engine_reclaim_wait_s
        self.engine_pool.on_change = self.service.engine_changes.fire
        self.service.tier = self.tier
        self.service.manager_uids = opts.manager_uids()
        self.service.debug_rpcs = opts.log_level == "debug"

        self.fd_server = FdChannelServer(
            opts.fd_socket,
            allowed_uids=opts.effective_uids(),
            authorize=fd_authorize(self),
            scope=fd_scope(self),
            export_fds=self.arena.export_fds,
            units=self.arena.fd_units,
            log=self._log_event,
        )
        await self.fd_server.start()
        self._start_step_channel(loop)

        self.server = grpc.aio.server(
            options=server_options(opts),
            # Attach streams count: room for every session (and those waiting to be proven)
            # plus calls in flight.
            maximum_concurrent_rpcs=(opts.max_sessions + MAX_UNPROVEN + MAX_CALLS_IN_FLIGHT)
            if opts.max_sessions
            else None,
        )
        trim = MemoryReturner(loop, lambda: self.gate.large)
        self.service.replies.on_large = trim.soon  # and once large replies are sent
        self.gate = RequestGate(opts.request_bytes_in_flight, opts.large_requests, trim.soon)
        add_to_server(self.service, self.server, self.gate)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        if opts.enable_echo:
            echo_pb2_grpc.add_EchoServicer_to_server(EchoService(), self.server)
            names.append(echo_pb2.DESCRIPTOR.services_by_name["Echo"].full_name)
        reflection.enable_server_reflection(names, self.server)
        self.server.add_insecure_port(f"unix:{opts.socket}")
        if opts.tcp_port:
            self.server.add_insecure_port(f"127.0.0.1:{opts.tcp_port}")
        await self.server.start()
        set_socket_permissions(self.opts)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    def _start_step_channel(self, loop: asyncio.AbstractEventLoop) -> None:
        """The engines' per-step fast path (issue 16), beside the fd channel; clients find it
        at the gRPC socket's path plus ".step" and fall back to gRPC where it is absent."""
        self.step_server = None
        path = step_socket_path(self.opts.socket)
        if len(path.encode()) > 107:
            self.log.warning("step_channel_off", reason=f"socket path {path!r} is too long for a Unix socket")
            return
        metrics = self.metrics
        self.step_server = StepChannelServer(
            path,
            loop=loop,
            store=self.store,
            sessions=self.sessions,
            adapters=self.adapters,
            allowed_uids=self.opts.effective_uids(),
            num_slabs=self.arena.count_slabs,
            record=metrics.rpc_latency.record if metrics is not None else None,
            log=self._log_event,
        )
        self.step_server.start()

    def arena_info(self) -> pb.ArenaInfo:
        return arena_message(self.arena, self.geometry, self.opts, self.gpu_uuid)

    def _set_uids(self, opts: ServeOptions) -> None:
        """Who may prove a session (at every door) and who may manage adapters."""
        allowed = opts.effective_uids()
        self.fd_server.allowed_uids = allowed
        if self.step_server is not None:
            self.step_server.allowed_uids = allowed
        # The sessions of a uid no longer allowed end here, their pins with them (issue 48, item 6).
        ended = self.sessions.set_allowed_uids(allowed)
        if ended:
            self.log.warning("sessions_revoked", sessions=ended, allowed_uids=sorted(allowed))
        self.service.manager_uids = opts.manager_uids()

    def _schedule_store_work(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._store_work_scheduled:
            self._store_work_scheduled = True
            # A pause between batches: one RPC spans several loop iterations, and a batch
            # in every one of them would add up to several milliseconds for it.
            loop.call_later(STORE_WORK_GAP_S, self._store_work, loop)

    def _store_work(self, loop: asyncio.AbstractEventLoop) -> None:
        self._store_work_scheduled = False
        try:
            more = self.store.work()
        except Exception as e:  # never leave the loop's callback with an exception
            self.log.error("store_work_failed", error=repr(e))
            return
        if more:
            self._schedule_store_work(loop)

    def status_line(self, st: StoreStats | None = None) -> str:
        """One line on the pool for systemd's STATUS (``st``: a store.stats() already taken)."""
        st = self.store.stats() if st is None else st
        line = (
            f"{st.used_pages}/{st.max_pages} pages used ({st.utilization:.0%}), "
            f"{st.pinned_pages} pinned, {st.sessions} sessions, {st.evicted_pages} pages evicted"
        )
        if self.tier is not None:
            t = self.tier.stats()
            line += f"; tier {'up' if t['up'] else 'DOWN'}, {t['hits']} hits, {t['written']} written"
        engines = getattr(self, "engine_pool", None)
        if engines is not None and engines.engines:
            line += f"; {len(engines.engines)} engines hold {engines.held_pages()} KV pages"
        return line

    def _refresh(self) -> StoreStats:
        """One reading of the store per tick: metric snapshots, and the stats for STATUS."""
        st = self.store.stats()
        if self.metrics is not None:
            self.metrics.snapshot = st
            self.metrics.adapter_snapshot = self.adapters.stats()
            self.metrics.tier_snapshot = self.tier.stats() if self.tier is not None else None
            self.metrics.engine_snapshot = self.engine_pool.stats()
        return st

    async def _status_loop(self) -> None:
        """STATUS lines for systemd and fresh metric snapshots, every status_interval_s."""
        last = ""
        while True:
            try:
                line = self.status_line(self._refresh())
                if line != last:
                    self.notifier.status(line)
                    last = line
            except Exception as e:
                self.log.error("status_refresh_failed", error=repr(e))
            await asyncio.sleep(self.opts.status_interval_s)

    async def _watchdog_loop(self) -> None:
        # Pinged from the loop itself: if the loop wedges, the pings stop.
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(self.notifier.watchdog_interval_s)

    async def reload(self) -> None:
        """SIGHUP: reread the config file, apply what can change at run time."""
        self.notifier.reloading()
        try:
            new = build_options(self.opts.config_path, self.overrides)
            new.config_path = self.opts.config_path
        except ConfigError as e:
            self.log.error("reload_refused", error=str(e))
            self.notifier.send("READY=1", f"STATUS=reload refused: {e}")
            return
        for note in deprecation_notes():  # an old spelling new in the file: said once
            self.log.warning("deprecated_setting", detail=note)
        apply, restart = reload_changes(self.opts, new)
        if "high_watermark" in apply or "low_watermark" in apply:
            self.store.set_watermarks(new.high_watermark, new.low_watermark)
        if "default_lease_s" in apply or "max_pins_per_session" in apply:
            self.store.reconfigure(
                default_lease_s=new.default_lease_s if "default_lease_s" in apply else None,
                max_pins_per_session=new.max_pins_per_session if "max_pins_per_session" in apply else None,
            )
        if "allowed_uids" in apply or "adapter_manager_uids" in apply:
            self._set_uids(new)
        if {"request_bytes_in_flight", "large_requests"} & apply.keys():
            self.gate.max_bytes, self.gate.max_large = new.request_bytes_in_flight, new.large_requests
        if "max_sessions" in apply:
            self.sessions.max_sessions = new.max_sessions
        if "max_sessions_per_uid" in apply:
            self.sessions.max_sessions_per_uid = new.max_sessions_per_uid
        if "log_level" in apply:
            from memory_broker.broker.server.logs import configure

            self.log = configure(new.log_level)
            self.service.log = self.log
            self.service.debug_rpcs = new.log_level == "debug"
        kept = {f: getattr(self.opts, f) for f in restart}
        self.opts = new.model_copy(update=kept)
        self.log.info("reloaded", applied=apply, needs_restart=restart)
        self.notifier.send("READY=1", f"STATUS=reloaded; {self.status_line()}")

    def _route_event(self, session_id: int, event: object) -> None:
        """Store events: the adapter manager's own session, else the session's stream."""
        adapters = getattr(self, "adapters", None)
        if adapters is not None and adapters.handle_store_event(session_id, event):
            return
        self.sessions.notify(session_id, event)

    def _grown(self, slabs: int, seconds: float) -> None:
        """The shared pool gained ``slabs`` slabs (mapped in the broker's view): say so."""
        self.log.info("arena_grown", slabs=self.arena.num_slabs, added=slabs, ms=round(seconds * 1e3, 3))
        self.sessions.broadcast(ArenaGrown(self.arena.num_slabs))

    def _log_event(self, event: str, **kw) -> None:
        self.log.info(event, **kw)

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            try:
                expired = self.store.expire()
                if expired:
                    self.log.info("transactions_expired", transactions=expired)
            except Exception as e:  # never let the timer die silently
                self.log.error("lease_expiry_failed", error=repr(e))

    # ------------------------------------------------------------------ stop

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: asyncio.ensure_future(self.stop(f"signal {s.name}")))
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self._logged(self.reload(), "reload")))

    async def _logged(self, coro, what: str) -> None:
        try:
            await coro
        except Exception as e:  # a failed reload must not go unnoticed, nor stop the broker
            self.log.error(f"{what}_failed", error=repr(e), exc_info=True)

    async def stop(self, reason: str = "stop") -> None:
        """Drain and release everything. Idempotent."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        self.notifier.stopping(f"draining: {reason}")
        self.log.info("draining", reason=reason, grace_s=self.opts.grace_s)
        self.service.draining = True
        await self.health.enter_graceful_shutdown()
        self.sessions.broadcast(ShuttingDown(reason))
        # Let in-flight unary calls finish within the grace period; streams end below.
        deadline = time.monotonic() + self.opts.grace_s
        while self.service.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # let the ShuttingDown events reach the streams
        self.sessions.close_all("broker shutting down")
        await self.server.stop(max(0.0, deadline - time.monotonic()))
        await self.adapters.close()
        await self._release()
        self.log.info("stopped", reason=reason)
        self._stopped.set()

    def _tier_latency(self, op: str, seconds: float) -> None:
        """Each tier call's time, from the tier's thread (its only recorder) into the metrics."""
        if self.metrics is not None:
            self.metrics.tier_latency.record(seconds, op)

    async def _release(self) -> None:
        for t in self._tasks:
            t.cancel()
        if getattr(self, "tier", None) is not None:
            await self.tier.close()
            await asyncio.get_running_loop().run_in_executor(None, self.tier.tier.close)
        if getattr(self, "fd_server", None) is not None:
            await self.fd_server.close()
        if getattr(self, "step_server", None) is not None:
            self.step_server.close()
        if getattr(self, "watcher", None) is not None:
            self.watcher.close()
        if getattr(self, "registry", None) is not None:
            self.registry.close()  # every registration is already committed; this closes the file
        if getattr(self, "growth", None) is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.growth.close)  # a grow in flight ends first
        if getattr(self, "arena", None) is not None:
            self.arena.close()
        if self.metrics is not None:
            self.metrics.close()
        self.notifier.close()
        if os.path.exists(self.opts.socket):
            try:
                os.unlink(self.opts.socket)
            except OSError:
                pass
        self.lock.release()

    async def wait(self) -> None:
        await self._stopped.wait()

    def log_serving(self, why: str, links: list[str]) -> None:
        """The ``serving`` line: everything an operator checks first, once the broker serves."""
        opts = self.opts
        self.log.info(
            "serving",
            instance=opts.instance or None,
            gpu_uuid=self.gpu_uuid or None,
            socket=opts.socket,
            metrics=f"{opts.metrics_address}:{self.metrics_port}" if self.metrics else None,
            config=opts.config_path,
            fd_socket=opts.fd_socket,
            links=links or None,
            tcp_port=opts.tcp_port or None,
            arena=self.arena.backend,
            arena_reason=why,
            native_cores=native.cores(),
            pool=format_size(opts.pool_size),
            page_size=format_size(opts.page_size),
            slab_size=format_size(opts.slab_size),
            slabs=self.arena.num_slabs,
            fds=f"one per {self.arena.fd_unit}, made on demand, at most {FD_BUDGET} open; RLIMIT_NOFILE {self.fd_limit}",
            allowed_uids=sorted(opts.effective_uids()),
            adapters_registered=len(self.registry),
            pid=os.getpid(),
        )


def set_socket_permissions(opts: ServeOptions) -> None:
    """Give the sockets that exist their group and mode (``socket_mode``: 0660 with a group)."""
    gid = grp.getgrnam(opts.socket_group).gr_gid if opts.socket_group else -1
    mode = socket_mode(opts)
    for path in (opts.socket, opts.fd_socket, step_socket_path(opts.socket)):
        if not os.path.exists(path):
            continue
        if gid != -1:
            os.chown(path, -1, gid)
        if mode is not None:
            os.chmod(path, mode)


# Quiet time after the last large request before freed memory is handed back to the system.
TRIM_AFTER_S = 0.25
TRIM_AGAIN_S = 1.5
# How often the anonymous RSS is looked at, and the growth since the last trim that starts one.
WATCH_S = 1.0
TRIM_GROWTH = 8 << 20


class MemoryReturner:
    """Hands memory freed by bursts back to the system (glibc keeps it otherwise).

    After large requests: once the burst is over (``TRIM_AFTER_S`` without another, none in
    flight), a ``malloc_trim`` in a thread off the loop, and once more ``TRIM_AGAIN_S`` later
    (gRPC frees the last buffers of refused calls late). Requests gRPC refuses at their
    header never reach the broker, so every ``WATCH_S`` it also looks at its anonymous RSS:
    grown by ``TRIM_GROWTH`` since the last trim, it trims (live memory is trimmed once)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, in_flight):
        self.loop = loop
        self.in_flight = in_flight
        self.pending = False
        self.at = 0.0
        self.base = anon_rss()
        loop.call_later(WATCH_S, self._watch)

    def soon(self) -> None:
        self.at = time.monotonic() + TRIM_AFTER_S
        if not self.pending:
            self.pending = True
            self.loop.call_later(TRIM_AFTER_S, self._trim)

    def _watch(self) -> None:
        if anon_rss() > self.base + TRIM_GROWTH:
            self.soon()
        self.loop.call_later(WATCH_S, self._watch)

    def _trimmed(self, _fut) -> None:
        self.base = anon_rss()

    def _trim(self) -> None:
        wait = self.at - time.monotonic()
        if wait > 0 or self.in_flight():
            self.loop.call_later(max(wait, TRIM_AFTER_S / 4), self._trim)
            return
        self.pending = False
        self.loop.run_in_executor(None, malloc_trim).add_done_callback(self._trimmed)
        self.loop.call_later(
            TRIM_AGAIN_S,
            lambda: self.pending or self.loop.run_in_executor(None, malloc_trim).add_done_callback(self._trimmed),
        )


def anon_rss() -> int:
    """This process's resident memory that is not shared (the arena's pages are), in bytes."""
    try:
        with open("/proc/self/statm") as f:
            _, resident, shared = f.read().split()[:3]
        return (int(resident) - int(shared)) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def malloc_trim() -> None:
    """glibc keeps memory freed by many small blocks (gRPC's buffers of a large request) in
    its arenas; ``malloc_trim`` returns it to the system. Elsewhere nothing is done."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def arena_message(arena, g: ArenaGeometry, opts: ServeOptions, gpu_uuid: str) -> pb.ArenaInfo:
    return pb.ArenaInfo(
        backend=arena.backend,
        page_size=g.page_size,
        pages_per_slab=g.pages_per_slab,
        max_slabs=g.max_slabs,
        num_slabs=arena.num_slabs,
        window_pages=g.window_pages,
        fd_socket_path=os.path.abspath(opts.fd_socket),
        placement=opts.placement,
        device=gpu_uuid,
    )


def make_digests(opts: ServeOptions, store: ObjectStore, arena, log, tasks: list) -> KeyDigests | None:
    """With ``memory_pool.integrity.kv_digest``, the digests of committed keyed objects (their
    background checks' task joins ``tasks``); else None."""
    if not opts.kv_digest:
        return None
    digests = KeyDigests(store, arena.view, opts.page_size, log, opts.kv_verify_interval_s)
    task = digests.start()
    if task is not None:
        tasks.append(task)
    return digests


def make_tier(opts: ServeOptions, store: ObjectStore, arena, geometry, log, observe) -> TierLink | None:
    """With ``tier.backend``, the tier past one host and its link to the store (docs/tier.md);
    else None. ``observe(op, seconds)``: each tier call's time. A CUDA arena's blocks go
    through host buffers (``TierLink``'s ``host``)."""
    if opts.tier_backend == "none":
        return None
    from memory_broker.broker.tier.tier import Tier, open_backend

    backend = open_backend(
        opts.tier_backend,
        valkey_url=opts.tier_valkey_url,
        mooncake_master=opts.tier_mooncake_master,
        mooncake_metadata=opts.tier_mooncake_metadata,
        segment_size=opts.tier_mooncake_segment_size,
        deadline_s=opts.tier_deadline_s,
        mooncake_tenants=opts.tier_mooncake_tenants,
    )
    tier = Tier(backend, opts.tier_deadline_s, opts.tier_queue_depth, observe=observe)
    names = store.tenancy.names if store.tenancy is not None else [""]
    host = arena.backend == "host"
    fleet = None
    if opts.tier_lmcache_model:
        fleet = LMCacheFleet(opts.tier_lmcache_model, opts.tier_lmcache_kv_rank, lmcache_chunk_bytes(opts))
    return TierLink(
        store, tier, arena.view, geometry, opts.tier_key_prefix, opts.tier_write, names, log, host=host, lmcache=fleet
    )


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; returns (soft, hard) now.

    The broker holds few fds of its own (exports are made on demand and closed once sent, at
    most ``FD_BUDGET`` at once), but every client connection and adapter file costs one too.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft, hard


async def serve(opts: ServeOptions, log, overrides: dict | None = None) -> None:
    """Run a broker until a signal stops it."""
    server = BrokerServer(opts, log, overrides)
    await server.start()
    server.install_signal_handlers()
    await server.wait()


def open_registry(opts: ServeOptions) -> AdapterRegistry:
    """The adapter registry in the state directory, with the options' limits."""
    return AdapterRegistry(
        opts.state_dir,
        max_rank=opts.adapter_max_rank,
        allowed_roots=opts.adapter_allowed_roots,
        max_adapter_bytes=adapter_size_limit(opts),
        stored_elem_size=DTYPE_SIZES[opts.adapter_dtype],
    )
