"""Adapters across tiers: the facade the service and server call (ARCHITECTURE.md, "Facades, parts and contexts").

``AdapterManager`` keeps every registered adapter in one of three tiers: *hot* (an object of
content type LORA_WEIGHT in the arena, owned by the manager's own system session), *warm* (a
host image of those pages, optionally int8) or *cold* (its files). It holds no tier state
itself: it composes the entry table and its state machine (``entry``), the hot and warm
budgets, the loader, the image service and the checksum checker, and answers for admission
(ids, sessions, caps, two-phase acquires) and for the pins acquiring sessions hold. What
the parts share (store, system session, registry, config, counters, log, executor, entry
table) is one ``AdapterContext`` built here and handed to each. The store decides placement, pins and eviction; the registry knows what exists. Readers
(``describe``, ``resident``, ``stats``) change nothing.

All methods run on the broker's event loop; file reads and page writes run in the executor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

from memory_broker.broker.adapters.checks import ChecksumChecker
from memory_broker.broker.adapters.config import AdapterConfig
from memory_broker.broker.adapters.context import AdapterContext
from memory_broker.broker.adapters.entry import copy_key
from memory_broker.broker.adapters.hot_budget import HotBudget
from memory_broker.broker.adapters.image_cache import ImageCache
from memory_broker.broker.adapters.image_service import ImageService
from memory_broker.broker.adapters.layout import AdapterLayout, ModuleShard
from memory_broker.broker.adapters.loader import TierLoader
from memory_broker.broker.adapters.page_writers import HostPageWriter, TensorPageWriter
from memory_broker.broker.adapters.peft import AdapterMeta, check_adapter_id
from memory_broker.broker.adapters.pins import AdapterPins
from memory_broker.broker.adapters.records import (
    AcquireResult,
    AdapterCheck,
    AdapterStatus,
    PrefetchResult,
    Tier,
)
from memory_broker.broker.adapters.registry import AdapterRegistry
from memory_broker.broker.adapters.stats import AdapterStats, snapshot, tier_figures
from memory_broker.broker.adapters.warm_budget import WarmBudget
from memory_broker.broker.arena.base import Arena
from memory_broker.broker.store.objects import ObjectsEvicted, ObjectStore
from memory_broker.proto.wire.errors import BrokerError, Code, invalid, precondition, unavailable


class _NoLog:
    def __getattr__(self, name):
        return lambda *a, **k: None


class AdapterManager:
    """Registered adapters in tiers, shared by every session.

    Args:
        store: the object store; the manager opens one system session on it.
        arena: the broker's arena; pages are written through ``arena.view``.
        registry: registered adapters.
        config: dtype, budgets, policies.
        executor: runs file reads and page copies (default: ``load_workers`` threads).
        log: a structlog-style logger (``log.info(event, **fields)``).
        page_writer: copies warm images into pages (``write(image, pages)``); default: plain
            copies on the host arena, the view's tensors on other backends.

    Wiring: route the store's events for ``system_session`` to ``handle_store_event`` (an
    ObjectsEvicted there means adapters were demoted by the store).
    """

    def __init__(
        self,
        store: ObjectStore,
        arena: Arena,
        registry: AdapterRegistry,
        config: AdapterConfig | None = None,
        executor: Executor | None = None,
        log=None,
        page_writer=None,
    ):
        config = config or AdapterConfig()
        config.validate()
        page_size = arena.geometry.page_size
        if page_size % config.row_align:
            raise ValueError(f"row_align {config.row_align} does not divide the page size {page_size}")
        if page_writer is None:
            # The host arena is written through plain memory copies; any other backend
            # through its view's tensors (host-to-device copies).
            page_writer = HostPageWriter(arena.view) if arena.backend == "host" else TensorPageWriter(arena.view)
        self._own_executor = executor is None
        executor = executor or ThreadPoolExecutor(config.load_workers, thread_name_prefix="adapter-load")
        self.ctx = ctx = AdapterContext(
            store, store.open_session(), registry, config, page_size, executor, log or _NoLog()
        )
        self.store, self.arena, self.registry, self.config, self.log = store, arena, registry, config, ctx.log
        # What the service, the server and tests read.
        self.system_session, self.counters, self.entries = ctx.system_session, ctx.counters, ctx.entries
        self.hot = HotBudget(ctx)
        self.warm = WarmBudget(ctx)
        self.image_service = ImageService(ctx)
        self.loader = TierLoader(ctx, self.hot, self.warm, self.image_service, page_writer)
        self.checker = ChecksumChecker(ctx, arena.view, self.hot, self.warm, self.image_service)
        self.pins = AdapterPins(ctx, self.hot, self.warm, self.loader, self.checker)
        self._closed = False

    @property
    def images(self) -> ImageCache | None:
        """The converted-image cache (None: off, no state dir, or int8 warm storage)."""
        return self.image_service.cache

    async def start(self) -> None:
        """Once the loop runs: delete images of adapters no longer registered, and queue
        every registered adapter without an image for conversion ahead of use; start the
        background checksum checks."""
        self._check_open()
        self.checker.start()
        await self.image_service.start()

    # ------------------------------------------------------------- registration

    async def register(self, adapter_id: str, source: str, caller=None) -> AdapterMeta:
        """Validate a PEFT directory (in the executor) and register it; ``caller`` (an
        ``access.Caller``, None for the broker itself) bounds what may be read.

        Raises:
            BrokerError: INVALID_ARGUMENT (with the file and the problem), ALREADY_EXISTS.
        """
        self._check_open()
        check_adapter_id(adapter_id)
        if adapter_id in self.registry:
            raise BrokerError(Code.ALREADY_EXISTS, f"adapter id {adapter_id!r} is already registered")
        loop = asyncio.get_running_loop()
        meta = await loop.run_in_executor(self.ctx.executor, self.registry.inspect, source, caller)
        meta = self.registry.add(adapter_id, meta)
        self.schedule_conversions([adapter_id])
        return meta

    def schedule_conversions(self, adapter_ids: Sequence[str]) -> int:
        """Queue adapters for conversion into images ahead of use (no-op with the image cache
        or ``convert_ahead`` off); returns how many were queued."""
        if self._closed:
            return 0
        return self.image_service.schedule(adapter_ids)

    async def wait_conversions(self) -> None:
        """Wait until every queued conversion ahead of use is done (tests, benchmarks)."""
        await self.image_service.wait_conversions()

    async def wait_image_writes(self) -> None:
        """Wait until the converted images being written to the image cache are on disk."""
        await self.image_service.wait_writes()

    def unregister(self, adapter_id: str) -> AdapterMeta:
        """Forget an adapter; its hot pages are freed and its warm image dropped.

        Raises:
            BrokerError: NOT_FOUND; FAILED_PRECONDITION while any session holds it (or an
                acquire of it is in progress); RESOURCE_EXHAUSTED when the registry's disk is
                full (nothing is forgotten then).
        """
        return self.unregister_many([adapter_id])[0]

    def unregister_many(self, adapter_ids: Sequence[str]) -> list[AdapterMeta]:
        """``unregister`` for several adapters: every one is checked before any is forgotten."""
        self._check_open()
        ids = list(dict.fromkeys(self.pins.check_ids(adapter_ids)))
        metas = [self.registry.get(aid) for aid in ids]
        for aid in ids:
            self.pins.check_unregistrable(aid)
        # The registry first, in one transaction: a refusal there (a full disk) forgets nothing.
        self.registry.unregister_many(ids)
        for aid in ids:
            self._forget_adapter(aid)
        return metas

    def _forget_adapter(self, adapter_id: str) -> None:
        for e in self.pins.copies(adapter_id):  # its copy in the broker's dtype and in others
            if self.hot.current(e) is not None:
                self.hot.free(e)
            if e.warm is not None:
                self.warm.drop(e)
            if self.entries.get(e.key) is e:
                self.entries.pop(e.key)
            e.remove()
            self.hot.policy.forget(e.key)
            self.warm.policy.forget(e.key)
        self.image_service.remove(adapter_id)
        self.hot.policy.forget(adapter_id)
        self.warm.policy.forget(adapter_id)
        self.counters.unregistered += 1
        self.log.info("adapter_unregistered", adapter=adapter_id)

    def demote(self, adapter_id: str) -> Tier:
        """Free an idle hot adapter's pages (its copies in other dtypes too), keeping its warm
        image; returns its tier now.

        Raises:
            BrokerError: NOT_FOUND; FAILED_PRECONDITION while any session holds it.
        """
        self._check_open()
        copies = self.pins.copies(adapter_id)
        if not copies:
            self.registry.get(adapter_id)
            return Tier.COLD
        hot = [e for e in copies if self.hot.current(e) is not None]
        if pins := sum(e.obj.pin_count for e in hot):
            raise precondition(f"adapter {adapter_id!r} is acquired ({pins} pin(s)); it can be demoted once released")
        for e in hot:
            self.hot.demote(e)
        e = self.entries.get(adapter_id)
        return Tier.WARM if e is not None and e.warm is not None else Tier.COLD

    # ------------------------------------------------------------------ acquire

    async def acquire(
        self,
        session: int,
        adapter_ids: Sequence[str],
        max_adapters: int | None = None,
        with_layout: bool = False,
        dtype: str = "",
        shards: Sequence[ModuleShard] = (),
    ) -> AcquireResult:
        """Load (if needed) and pin adapters for ``session``, in ``dtype`` (default: the
        broker's ``--adapter-dtype``), of a tensor-parallel rank's ``shards`` (default: whole).

        Each admitted adapter is pinned once per call (acquiring again adds a pin; each
        ``release`` drops one). With ``max_adapters`` N, the first N distinct ids in order
        are admitted and the rest come back in ``deferred``, untouched. Concurrent acquires
        of one adapter share one load. All or nothing: when one adapter cannot be loaded,
        nothing is pinned (loads that finished stay as a cache). In another ``dtype`` than the
        broker's, or with ``shards``, each adapter's copy made so (``AdapterPins.acquire``).

        Raises:
            BrokerError: INVALID_ARGUMENT (bad ids or cap), NOT_FOUND (unregistered id),
                PERMISSION_DENIED (session not open), RESOURCE_EXHAUSTED (the hot tier or
                the pool cannot fit them with everything else pinned; the message has the
                pages needed, free, evictable and pinned), FAILED_PRECONDITION (the files
                changed since registration), UNAVAILABLE (shutting down).
        """
        self._check_open()
        return await self.pins.acquire(session, adapter_ids, max_adapters, with_layout, None, dtype, shards)

    async def prepare_acquire(
        self,
        session: int,
        adapter_ids: Sequence[str],
        max_adapters: int | None = None,
        with_layout: bool = False,
        lease_s: float | None = None,
        dtype: str = "",
        shards: Sequence[ModuleShard] = (),
    ) -> AcquireResult:
        """Phase one of a two-phase acquire: load and pin under a lease (a store transaction).

        The pins hold from now on (the adapters cannot be evicted); ``commit_acquire``
        keeps them past the lease, ``abort_acquire``, the lease's end or the session's end
        drop them. Same admission and errors as ``acquire``.
        """
        if lease_s is None:
            lease_s = self.config.acquire_lease_s
        self._check_open()
        return await self.pins.acquire(session, adapter_ids, max_adapters, with_layout, lease_s or 0.0, dtype, shards)

    def commit_acquire(self, session: int, txn_id: int) -> None:
        """Keep a prepared acquire's pins. Idempotent.

        Raises:
            BrokerError: NOT_FOUND (not an adapter acquire), PERMISSION_DENIED (another
                session's), FAILED_PRECONDITION (aborted, or the lease ended).
        """
        self._check_open()
        self.pins.commit(session, txn_id)

    def abort_acquire(self, session: int, txn_id: int) -> None:
        """Drop a prepared acquire's pins. Idempotent; FAILED_PRECONDITION once committed."""
        self._check_open()
        self.pins.abort(session, txn_id)

    def release(self, session: int, adapter_ids: Sequence[str], dtype: str = "") -> None:
        """Drop one of the session's pins per listed id (an id listed twice drops two), on the
        copies in ``dtype`` (the acquire's; "": the broker's own copy first, then any other).

        Raises:
            BrokerError: NOT_FOUND (unregistered), FAILED_PRECONDITION (the session holds
                fewer pins than asked), PERMISSION_DENIED (only other sessions hold it, or
                the session is not open). Nothing is released when any id is refused.
        """
        self.pins.release(session, adapter_ids, dtype)

    def pin_hot(self, session: int, adapter_ids: Sequence[str], max_adapters: int = 0) -> list | None:
        """``acquire`` when every admitted adapter is hot in the broker's dtype and none is
        deferred: their objects, pinned; None (nothing done) otherwise (``AdapterPins.pin_hot``)."""
        return None if self._closed else self.pins.pin_hot(session, adapter_ids, max_adapters)

    def release_hot(self, session: int, adapter_ids: Sequence[str]) -> bool:
        """``release`` in its common case; False (nothing done) otherwise (``AdapterPins.release_hot``)."""
        return self.pins.release_hot(session, adapter_ids)

    async def prefetch(self, adapter_ids: Sequence[str], tier: Tier | str = Tier.HOT) -> PrefetchResult:
        """Bring adapters up to ``tier`` ("warm" or "hot") without pinning them.

        Best effort: adapters that cannot be brought up are reported in ``failed``.

        Raises:
            BrokerError: INVALID_ARGUMENT (tier or ids), NOT_FOUND (unregistered id).
        """
        self._check_open()
        try:
            tier = Tier(tier)
        except ValueError:
            raise invalid(f"prefetch tier {tier!r}: choose 'warm' or 'hot'") from None
        if tier == Tier.COLD:
            raise invalid("prefetch tier 'cold': choose 'warm' or 'hot' (cold is where adapters already are)")
        ids = list(dict.fromkeys(self.pins.check_ids(adapter_ids)))
        self.entries.entries_for(ids)

        async def one(aid: str) -> Tier:
            if tier == Tier.WARM:
                e = self.entries.entry(aid)
                await self.loader.ensure_warm(e)
                # Hot already, or warm (unless the warm budget dropped it at once).
                return Tier.HOT if self.hot.current(e) is not None else Tier.WARM if e.warm is not None else Tier.COLD
            await self.loader.ensure_hot(aid, hold=False)
            return Tier.HOT

        results = await asyncio.gather(*(one(a) for a in ids), return_exceptions=True)
        loaded, failed = {}, {}
        for aid, r in zip(ids, results):
            if isinstance(r, BrokerError):
                failed[aid] = r
            elif isinstance(r, BaseException):
                raise r
            else:
                loaded[aid] = r
        return PrefetchResult(loaded, failed)

    # ------------------------------------------------------------------ reading

    def describe(self, adapter_id: str) -> AdapterStatus:
        """Where an adapter is now; changes nothing. Raises BrokerError(NOT_FOUND)."""
        e = self.entries.get(adapter_id)
        # Pins count every hot copy of the adapter (one per dtype engines asked for).
        hot = [o for o in (self.hot.peek(c) for c in self.pins.copies(adapter_id)) if o is not None]
        pins = sum(c for o in hot for s, c in o.pins.items() if s != self.system_session)
        if e is None:
            meta = self.registry.get(adapter_id)
            return AdapterStatus(adapter_id, Tier.COLD, 0, 0, (), pins, self.ctx.plan(meta).num_pages, 0, False)
        obj = self.hot.peek(e)
        tier = Tier.HOT if obj is not None else Tier.WARM if e.warm is not None else Tier.COLD
        return AdapterStatus(
            adapter_id,
            tier,
            e.generation if obj is not None else 0,
            obj.object_id if obj is not None else 0,
            tuple(obj.pages) if obj is not None else (),
            pins,
            e.layout.num_pages,
            e.warm.nbytes if e.warm is not None else 0,
            e.loading is not None or e.warming is not None,
        )

    def is_hot(self, adapter_id: str) -> bool:
        """Whether the adapter is hot now (``resident(id).tier`` is HOT, without building the
        status: the step channel asks this of every adapter of a frame); changes nothing."""
        e = self.entries.get(adapter_id)
        return e is not None and self.hot.peek(e) is not None

    def resident(self, adapter_id: str) -> AdapterStatus | None:
        """``describe`` for adapters that are warm, hot or loading; None (cold, or not
        registered) without touching the registry: cheap enough for every row of a listing."""
        if adapter_id in self.entries or self.pins.copies(adapter_id):
            return self.describe(adapter_id)
        return None

    def image_state(self, adapter_id: str) -> str:
        """The adapter's converted image: off, none, queued, converting or ready. In memory only
        (no disk access): cheap enough for every row of a listing."""
        return self.image_service.state(adapter_id)

    def layout(self, adapter_id: str, dtype: str = "", shards: Sequence[ModuleShard] = ()) -> AdapterLayout:
        """An adapter's placement within its pages (the same for every generation), of its
        copy in ``dtype`` holding ``shards`` as ``acquire`` names them. Raises BrokerError:
        INVALID_ARGUMENT (dtype, shards), NOT_FOUND (unregistered)."""
        shard = self.pins.check_shape(dtype, shards)
        e = self.entries.get(copy_key(adapter_id, dtype, self.config.dtype, shard))
        return e.layout if e is not None else self.ctx.plan(self.registry.get(adapter_id), dtype, shard)

    def stats(self) -> AdapterStats:
        """Tier sizes, hits and misses per tier, loads per tier, hit rates; changes nothing."""
        return snapshot(self.counters, self.config, tier_figures(self))

    # ---------------------------------------------------------------- checksums

    async def verify(self, adapter_ids: Sequence[str] | None = None) -> list[AdapterCheck]:
        """Check adapters' resident copies against their checksums, one adapter at a time,
        in the checksum thread: the hot pages if hot, else the warm image, else the image
        file. A corrupt copy is reported and dropped (see ``checks``).

        Args:
            adapter_ids: the adapters to check; None or empty: every hot or warm adapter.

        Raises:
            BrokerError: INVALID_ARGUMENT (bad ids), NOT_FOUND (unregistered id; nothing checked).
        """
        self._check_open()
        ids = list(dict.fromkeys(self.pins.check_ids(adapter_ids))) if adapter_ids else None
        return await self.checker.check_many(ids)

    # ------------------------------------------------------------ store events

    def handle_store_event(self, session_id: int, event: object) -> bool:
        """The store's notify callback for the system session; True when the event was ours."""
        if session_id != self.system_session:
            return False
        if isinstance(event, ObjectsEvicted):
            self.on_objects_evicted(event.object_ids)
        return True

    def on_objects_evicted(self, object_ids: Sequence[int]) -> None:
        """The store evicted these objects of the system session: their adapters are warm
        now (or cold, where the warm tier dropped their image)."""
        self.hot.evicted(object_ids)

    async def close(self) -> None:
        """Stop: wait for loads in flight (they abort), free idle hot adapters, end the
        system session (objects other sessions still pin go with their last pin)."""
        if self._closed:
            return
        self._closed = self.loader.closed = True
        await self.checker.close()
        tasks = self.loader.in_flight()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.image_service.close()
        self.checker.shutdown()
        self.store.end_session(self.system_session)
        for e in list(self.hot.entries()):
            self.hot.drop(e, evicted=False)
        self.warm.drop_all(self.entries.values())
        self.entries.clear()
        if self._own_executor:
            self.ctx.executor.shutdown(wait=False)

    # ---------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise unavailable("the adapter manager is shutting down")
