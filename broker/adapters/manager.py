"""Adapters across tiers: loading, sharing, pinning and demoting them (DESIGN.md section 5).

``AdapterManager`` keeps every registered adapter in one of three tiers: *hot* (an
object of content type LORA_WEIGHT in the arena, owned by the manager's own system
session, laid out as ``layout`` describes), *warm* (a host image of those pages, optionally
int8) or *cold* (its files). Acquiring adapters loads them up the tiers once, however many
sessions ask at the same time, and pins them for the asking session through the object
store, so the store never evicts an adapter in use; an idle hot adapter is demoted (its
object freed, its image kept warm) when the hot budget needs room or when the store evicts
it under pressure and tells the system session. The manager owns no pages and no sessions:
the store decides placement, pins and eviction; the registry knows what exists.

Every copy carries the checksum of its page bytes (``tiers.packed_checksum``): image files
are checked when read, hot copies on demand (``verify``) and one at a time in the background
(every ``verify_interval_s``, never on the acquire path). A copy that does not match is
reported (counter, ``adapter_corrupted`` log event) and dropped, warm image included, so the
next acquire reloads the adapter from its source.

All methods run on the broker's event loop; file reads and page writes run in the executor.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum

from memory_broker.broker.adapters.layout import DEFAULT_ROW_ALIGN, DTYPE_SIZES, AdapterLayout, plan_layout
from memory_broker.broker.adapters.policy import make_tier_policy
from memory_broker.broker.adapters.registry import AdapterMeta, AdapterRegistry, check_adapter_id
from memory_broker.broker.adapters.tiers import (
    HostPageWriter,
    ImageCache,
    TensorPageWriter,
    WarmImage,
    build_warm_image,
    image_checksum,
    pages_checksum,
)
from memory_broker.broker.arena.base import Arena
from memory_broker.broker.errors import BrokerError, Code, denied, exhausted, invalid, not_found, precondition, unavailable
from memory_broker.broker.eviction import ContentType
from memory_broker.broker.objects import Allocation, ObjectsEvicted, ObjectStore, Spec, TxnState


class Tier(str, Enum):
    HOT = "hot"
    WARM = "warm"
    COLD = "cold"


@dataclass(slots=True)
class AdapterConfig:
    # Element type of stored rows (hot pages, and warm images unless int8): the dtype of the
    # 1-D arena tensor the kernels read. "bfloat16", "float16" or "float32".
    dtype: str = "bfloat16"
    # Every row starts at a multiple of this many bytes (a multiple of the element size).
    row_align: int = DEFAULT_ROW_ALIGN
    # Most arena pages / adapters the hot tier may hold; 0 = bounded only by the pool.
    hot_budget_pages: int = 0
    hot_budget_adapters: int = 0
    # Host memory for warm images. 0 keeps no warm tier (an image lives only while it loads).
    warm_budget_bytes: int = 4 << 30
    # Keep warm images as int8 rows with a float32 scale per row (absmax / 127): a quarter
    # of fp32, half of bf16; promotion dequantizes, with |error| <= absmax(row) / 254.
    warm_int8: bool = False
    # Victim order of each tier: "lru", "lfu" or "gdsf" (see broker.adapters.policy).
    hot_policy: str = "lru"
    warm_policy: str = "lru"
    # Lease of the prepared object while a load writes it (capped at the store's max lease).
    load_lease_s: float = 300.0
    # Lease of prepare_acquire when the caller gives none (None: the store's default).
    acquire_lease_s: float | None = None
    # Loader threads when no executor is given.
    load_workers: int = 2
    # Threads one cold load splits its copies over (plain reads beside the Bᵀ transposes).
    copy_threads: int = 2
    # How many two-phase acquires are remembered (so commit and abort stay idempotent).
    remember_txns: int = 65536
    # Keep each adapter's converted page image in ``<state_dir>/images`` after its first
    # cold load, so later cold loads read it back in one sequential read instead of
    # converting the safetensors again (Bᵀ, dtype). Needs the registry's state_dir; not used
    # with warm_int8 (the image holds ``dtype`` elements).
    image_cache: bool = True
    # fsync each image before it is renamed into place (survives a power loss, not needed
    # for correctness: a torn image fails validation and is rebuilt).
    image_fsync: bool = False
    # Disk the images may take together; 0 = no limit. A load's image pushes out the least
    # recently used ones; a conversion ahead of use only takes room that is free.
    image_budget_bytes: int = 0
    # Convert adapters into images ahead of use, in one background thread: each adapter
    # registered through the manager, and (``start``) every registered adapter without an
    # image, so a first acquire reads an image instead of converting the safetensors.
    convert_ahead: bool = True
    # Share of wall time conversion ahead of use may take (after each conversion it sleeps
    # the rest): a backlog of thousands of registrations drains in the background without
    # starving requests of the CPU (the backlog's size: adapter stats convert_queued).
    convert_duty: float = 0.25
    # Seconds between background checks of one hot adapter's pages against its checksum
    # (each check hashes one adapter, in its own thread); 0 turns the background check off.
    verify_interval_s: float = 30.0
    # Hash every image read back from disk and refuse one whose bytes changed.
    verify_images: bool = True

    def validate(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"adapter dtype {self.dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
        if self.row_align <= 0 or self.row_align % DTYPE_SIZES[self.dtype]:
            raise ValueError(f"row_align {self.row_align} must be a positive multiple of the {self.dtype} element size")
        for name in ("hot_budget_pages", "hot_budget_adapters", "warm_budget_bytes", "image_budget_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 means no limit for hot budgets, no warm tier for warm)")
        if self.verify_interval_s < 0:
            raise ValueError(f"verify_interval_s {self.verify_interval_s} must be >= 0 (0: no background checks)")
        if self.load_lease_s <= 0 or self.load_workers < 1 or self.copy_threads < 1:
            raise ValueError("load_lease_s must be positive, load_workers and copy_threads at least 1")
        make_tier_policy(self.hot_policy)
        make_tier_policy(self.warm_policy)


@dataclass(frozen=True, slots=True)
class AcquiredAdapter:
    """One adapter pinned for the calling session."""

    adapter_id: str
    # Increases every time the adapter is placed anew (after an eviction and reload), and is
    # never reused by another placement of any adapter: clients cache offset tables by it.
    generation: int
    # The hot object (release goes through the manager, by adapter id).
    object_id: int
    # Physical pages of the object, in layout page order.
    pages: tuple[int, ...]
    # Placement within those pages (when asked for with_layout).
    layout: AdapterLayout | None
    # Where the adapter was found: HOT is a hit.
    found_in: Tier


@dataclass(frozen=True, slots=True)
class AcquireResult:
    # Admitted adapters, in request order (duplicates in the request appear once).
    adapters: tuple[AcquiredAdapter, ...]
    # Ids over ``max_adapters``, in request order: not loaded, not pinned; ask again later.
    deferred: tuple[str, ...]
    # Two-phase acquires: the store transaction holding the pins, and its lease's end.
    txn_id: int = 0
    deadline_unix: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    # Adapter id -> the tier it now is in (at least the one asked for).
    loaded: dict[str, Tier]
    # Adapter id -> why it could not be brought up (e.g. RESOURCE_EXHAUSTED).
    failed: dict[str, BrokerError]


@dataclass(frozen=True, slots=True)
class AdapterStatus:
    adapter_id: str
    tier: Tier
    generation: int
    object_id: int
    pages: tuple[int, ...]
    # Pins on the hot object (acquires of every session), 0 when not hot.
    pin_count: int
    # Pages the adapter takes when hot, and bytes of its warm image (0 when not warm).
    num_pages: int
    warm_bytes: int
    loading: bool


@dataclass(frozen=True, slots=True)
class AdapterCorrupted:
    """Core event for each session that pins a hot copy found corrupt (sent on its stream)."""

    adapter_id: str
    object_id: int
    generation: int
    detail: str


@dataclass(frozen=True, slots=True)
class AdapterCheck:
    """What one checksum check of an adapter found."""

    adapter_id: str
    # The copy checked: HOT (its pages), WARM (its host image) or COLD (its image file).
    tier: Tier
    # False when there was nothing to check (cold without an image file, or replaced meanwhile).
    checked: bool
    # False: the copy did not match and was dropped (the next acquire reloads it).
    ok: bool
    # What the copy must hash to ("sha256:<hex>"), "" when unknown.
    checksum: str
    detail: str


@dataclass(slots=True)
class AdapterCounters:
    acquires: int = 0
    acquired_adapters: int = 0
    deferred: int = 0
    # Per admitted adapter of an acquire: found hot, or not; when not, found warm or not.
    hot_hits: int = 0
    hot_misses: int = 0
    warm_hits: int = 0
    warm_misses: int = 0
    # Acquires that joined a load already in flight instead of starting one.
    shared_loads: int = 0
    loads_hot: int = 0
    loads_warm: int = 0
    bytes_loaded_hot: int = 0
    bytes_loaded_warm: int = 0
    seconds_hot: float = 0.0
    seconds_warm: float = 0.0
    load_failures: int = 0
    # Hot adapters freed to fit the hot budget / evicted by the store; warm images dropped.
    demotions: int = 0
    evictions: int = 0
    warm_drops: int = 0
    unregistered: int = 0
    # The converted-image cache: cold loads served from an image / built from the file with
    # the cache on; images found unusable (stale, corrupt, short); images written; failed writes.
    image_hits: int = 0
    image_misses: int = 0
    image_rejects: int = 0
    image_writes: int = 0
    image_write_failures: int = 0
    # Conversions ahead of use: images written; adapters passed over (image already there,
    # no room in the image budget, or already loading); failures (logged, the load retries).
    converted_ahead: int = 0
    convert_skipped: int = 0
    convert_failures: int = 0
    # Checksum checks of resident copies (hot, warm, image files) and the corrupt ones found.
    verifications: int = 0
    corruptions: int = 0


@dataclass(slots=True, eq=False)
class _Entry:
    """An adapter that is warm, hot or on its way (cold adapters have none)."""

    meta: AdapterMeta
    layout: AdapterLayout
    warm: WarmImage | None = None
    # The committed hot object, or None.
    obj: Allocation | None = None
    generation: int = 0
    # What the hot object's pages hash to as loaded (its warm image's checksum).
    hot_checksum: str = ""
    # In-flight loads: warm -> hot and cold -> warm.
    loading: asyncio.Task | None = None
    warming: asyncio.Task | None = None
    # Acquires waiting on ``loading`` that want a hold once it commits.
    waiters: int = 0
    # System-session pins held for acquires between load and the caller's own pin.
    holds: int = 0
    # Holds taken on a hot copy that was then found corrupt and freed (its system pins went
    # with it): the next unholds give back nothing.
    stale_holds: int = 0
    # Unregistered while a load was in flight: the load aborts.
    removed: bool = False

    @property
    def adapter_id(self) -> str:
        return self.meta.adapter_id


class _NoLog:
    def __getattr__(self, name):
        return lambda *a, **k: None


def _consume(task: asyncio.Task) -> None:
    # Loads are awaited through shields; a load nobody awaits any more must not log
    # "exception was never retrieved".
    if not task.cancelled():
        task.exception()


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
        self.config = config or AdapterConfig()
        self.config.validate()
        self.store = store
        self.arena = arena
        self.registry = registry
        self.page_size = arena.geometry.page_size
        if self.page_size % self.config.row_align:
            raise ValueError(f"row_align {self.config.row_align} does not divide the page size {self.page_size}")
        if page_writer is None:
            # The host arena is written through plain memory copies; any other backend
            # through its view's tensors (host-to-device copies).
            page_writer = HostPageWriter(arena.view) if arena.backend == "host" else TensorPageWriter(arena.view)
        self._writer = page_writer
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(self.config.load_workers, thread_name_prefix="adapter-load")
        self.log = log or _NoLog()
        self.system_session = store.open_session()
        # Where core events for a session go: the store's route (the server sends them on
        # to the session's stream).
        self._notify = getattr(store, "_notify", None) or (lambda session, event: None)
        self.hot_policy = make_tier_policy(self.config.hot_policy)
        self.warm_policy = make_tier_policy(self.config.warm_policy)
        self.counters = AdapterCounters()
        self._load_lease_s = min(self.config.load_lease_s, store.config.max_lease_s)
        self._entries: dict[str, _Entry] = {}
        self._hot: dict[str, _Entry] = {}
        self._by_object: dict[int, _Entry] = {}
        self._hot_pages = 0
        # Reserved by loads between prepare and commit (count against the hot budget).
        self._loading_pages = 0
        self._loading_count = 0
        self._warm_bytes = 0
        self._generations = itertools.count(1)
        # Two-phase acquires: transaction id -> session.
        self._txns: OrderedDict[int, int] = OrderedDict()
        # Converted images on disk (None: off, no state dir, or int8 warm storage), and the
        # image writes in flight by adapter id.
        self.images: ImageCache | None = None
        state_dir = getattr(registry, "state_dir", None)
        if self.config.image_cache and state_dir and not self.config.warm_int8:
            try:
                self.images = ImageCache(
                    os.path.join(state_dir, "images"), fsync=self.config.image_fsync,
                    max_bytes=self.config.image_budget_bytes, verify=self.config.verify_images,
                )  # fmt: skip
            except OSError as err:
                self.log.warning("adapter_image_cache_off", error=str(err))
        self._image_writes: dict[str, object] = {}
        # Conversions ahead of use: adapter ids waiting (in order), the one being converted
        # and its future, and the task that works through them (in its own thread, so a
        # burst of registrations never queues in front of loads).
        self._convert_queue: OrderedDict[str, None] = OrderedDict()
        self._converting: tuple[str, object] | None = None
        self._convert_task: asyncio.Task | None = None
        self._convert_executor: ThreadPoolExecutor | None = None
        # Hot objects found corrupt that sessions still pin (by adapter id): their pins are
        # released through ``release`` and their pages return with the last one.
        self._retired: dict[str, list[Allocation]] = {}
        # Checksum checks run in their own thread, off the loaders' executor.
        self._verify_executor: ThreadPoolExecutor | None = None
        self._verify_task: asyncio.Task | None = None
        self._verify_turn = 0
        self._closed = False

    async def start(self) -> None:
        """Once the loop runs: delete images of adapters no longer registered, and queue
        every registered adapter without an image for conversion ahead of use; start the
        background checksum checks."""
        self._check_open()
        if self.config.verify_interval_s > 0 and self._verify_task is None:
            self._verify_task = asyncio.get_running_loop().create_task(self._verify_loop())
        if self.images is None:
            return
        loop = asyncio.get_running_loop()
        missing, orphans = await loop.run_in_executor(self._executor, self._image_census)
        for path in orphans:
            self.images.remove_path(path)
        if orphans:
            self.log.info("adapter_images_pruned", images=len(orphans))
        self.schedule_conversions(missing)

    def _image_census(self) -> tuple[list[str], list[str]]:
        """(registered ids without an image file, image files of no registered adapter). Executor."""
        expected: dict[str, str] = {}
        token = ""
        while True:
            page = self.registry.list(limit=10_000, page_token=token)
            for info in page.adapters:
                expected[self.images.path(info.adapter_id)] = info.adapter_id
            token = page.next_page_token
            if not token:
                break
        have = set(self.images.paths())
        missing = [aid for path, aid in expected.items() if path not in have]
        return missing, [path for path in have if path not in expected]

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
        meta = await loop.run_in_executor(self._executor, self.registry.inspect, source, caller)
        meta = self.registry.add(adapter_id, meta)
        self.schedule_conversions([adapter_id])
        return meta

    # ------------------------------------------------------ conversion ahead of use

    def schedule_conversions(self, adapter_ids: Sequence[str]) -> int:
        """Queue adapters for conversion into images ahead of use (no-op with the image cache
        or ``convert_ahead`` off); returns how many were queued."""
        if self.images is None or not self.config.convert_ahead or self._closed:
            return 0
        n = 0
        for aid in adapter_ids:
            if aid not in self._convert_queue:
                self._convert_queue[aid] = None
                n += 1
        if self._convert_queue and (self._convert_task is None or self._convert_task.done()):
            self._convert_task = asyncio.get_running_loop().create_task(self._convert_loop())
        return n

    async def wait_conversions(self) -> None:
        """Wait until every queued conversion ahead of use is done (tests, benchmarks)."""
        while self._convert_task is not None and not self._convert_task.done():
            await asyncio.shield(self._convert_task)

    async def _convert_loop(self) -> None:
        if self._convert_executor is None:
            self._convert_executor = ThreadPoolExecutor(1, thread_name_prefix="adapter-convert")
        while self._convert_queue and not self._closed:
            aid, _ = self._convert_queue.popitem(last=False)
            try:
                meta = self.registry.find(aid)
            except BrokerError:
                return  # the registry is closed: the broker is stopping
            e = self._entries.get(aid)
            if meta is None:
                continue  # unregistered while queued
            if e is not None and (e.warm is not None or e.warming is not None):
                # Loaded (or loading) from the file already: that load writes the image.
                self.counters.convert_skipped += 1
                continue
            try:
                layout = e.layout if e is not None else self._plan(meta)
            except BrokerError:
                self.counters.convert_skipped += 1
                continue
            fut = self._convert_executor.submit(self._convert_one, meta, layout)
            self._converting = (aid, fut)
            try:
                written, ms = await asyncio.wrap_future(fut)
            except Exception as err:  # noqa: BLE001  (a load of it converts again, and says why)
                self.counters.convert_failures += 1
                self.log.warning("adapter_convert_failed", adapter=aid, error=str(err))
                continue
            finally:
                self._converting = None
            if not written:
                self.counters.convert_skipped += 1
                continue
            if self._drop_orphan_image(aid):
                continue
            self.counters.converted_ahead += 1
            self.counters.image_writes += 1
            self.log.info("adapter_converted", adapter=aid, bytes=written, ms=ms)
            await self._convert_pause(ms / 1e3)

    async def _convert_pause(self, spent_s: float) -> None:
        """Rate-limit conversion ahead of use to ``convert_duty`` of the wall time."""
        duty = self.config.convert_duty
        if 0 < duty < 1:
            await asyncio.sleep(spent_s * (1 - duty) / duty)

    def _convert_one(self, meta: AdapterMeta, layout: AdapterLayout) -> tuple[int, float]:
        """Build and store one adapter's image unless it has one or there is no room:
        (bytes written, ms). The convert thread."""
        images = self.images
        if not images.fits(layout) and not images.has(meta.adapter_id):
            return 0, 0.0
        if images.has(meta.adapter_id) and images.valid(meta, layout):
            return 0, 0.0
        t0 = time.perf_counter()
        image = build_warm_image(meta, layout, threads=1)
        written = images.store(meta, image, evict=False)
        return written, round((time.perf_counter() - t0) * 1e3, 3)

    def unregister(self, adapter_id: str) -> AdapterMeta:
        """Forget an adapter; its hot pages are freed and its warm image dropped.

        Raises:
            BrokerError: NOT_FOUND; FAILED_PRECONDITION while any session holds it (or an
                acquire of it is in progress).
        """
        return self.unregister_many([adapter_id])[0]

    def unregister_many(self, adapter_ids: Sequence[str]) -> list[AdapterMeta]:
        """``unregister`` for several adapters: every one is checked before any is forgotten."""
        self._check_open()
        ids = list(dict.fromkeys(self._check_ids(adapter_ids)))
        metas = [self.registry.get(aid) for aid in ids]
        for aid in ids:
            self._check_unregistrable(aid)
        for aid in ids:
            self._forget_adapter(aid)
        return metas

    def _check_unregistrable(self, adapter_id: str) -> None:
        self._prune_retired()
        if self._retired.get(adapter_id):
            raise precondition(
                f"adapter {adapter_id!r}: sessions still pin a copy of it that was found corrupt; "
                "they must release it before it can be unregistered"
            )
        e = self._entries.get(adapter_id)
        if e is None:
            return
        obj = self._hot_obj(e)
        if e.waiters or e.holds or e.stale_holds:
            raise precondition(f"adapter {adapter_id!r} is being acquired right now; release it, then unregister")
        if obj is not None and obj.pin_count:
            raise precondition(
                f"adapter {adapter_id!r} is acquired: {obj.pin_count} pin(s) by {len(obj.pins)} session(s); "
                "they must release it before it can be unregistered"
            )

    def _forget_adapter(self, adapter_id: str) -> None:
        e = self._entries.get(adapter_id)
        if e is not None:
            obj = self._hot_obj(e)
            if obj is not None:
                self.store.free(self.system_session, [obj.object_id])
                self._drop_hot(e, evicted=False)
            if e.warm is not None:
                self._drop_warm(e)
            e.removed = True
            self._entries.pop(adapter_id, None)
        self.registry.unregister(adapter_id)
        self._remove_image(adapter_id)
        forget = getattr(self.hot_policy, "forget", None)
        if forget:
            forget(adapter_id)
        forget = getattr(self.warm_policy, "forget", None)
        if forget:
            forget(adapter_id)
        self.counters.unregistered += 1
        self.log.info("adapter_unregistered", adapter=adapter_id)

    def demote(self, adapter_id: str) -> Tier:
        """Free an idle hot adapter's pages, keeping its warm image; returns its tier now.

        Raises:
            BrokerError: NOT_FOUND; FAILED_PRECONDITION while any session holds it.
        """
        self._check_open()
        e = self._entries.get(adapter_id)
        if e is None:
            self.registry.get(adapter_id)
            return Tier.COLD
        obj = self._hot_obj(e)
        if obj is not None:
            if obj.pin_count:
                raise precondition(
                    f"adapter {adapter_id!r} is acquired ({obj.pin_count} pin(s)); it can be demoted once released"
                )
            self.store.free(self.system_session, [obj.object_id])
            self._drop_hot(e, evicted=False)
            self.counters.demotions += 1
        return Tier.WARM if e.warm is not None else Tier.COLD

    # ------------------------------------------------------------------ acquire

    async def acquire(
        self,
        session: int,
        adapter_ids: Sequence[str],
        max_adapters: int | None = None,
        with_layout: bool = False,
    ) -> AcquireResult:
        """Load (if needed) and pin adapters for ``session``.

        Each admitted adapter is pinned once per call (acquiring again adds a pin; each
        ``release`` drops one). With ``max_adapters`` N, the first N distinct ids in order
        are admitted and the rest come back in ``deferred``, untouched. Concurrent acquires
        of one adapter share one load. All or nothing: when one adapter cannot be loaded,
        nothing is pinned (loads that finished stay as a cache).

        Raises:
            BrokerError: INVALID_ARGUMENT (bad ids or cap), NOT_FOUND (unregistered id),
                PERMISSION_DENIED (session not open), RESOURCE_EXHAUSTED (the hot tier or
                the pool cannot fit them with everything else pinned; the message has the
                pages needed, free, evictable and pinned), FAILED_PRECONDITION (the files
                changed since registration), UNAVAILABLE (shutting down).
        """
        return await self._acquire(session, adapter_ids, max_adapters, with_layout, None)

    async def prepare_acquire(
        self,
        session: int,
        adapter_ids: Sequence[str],
        max_adapters: int | None = None,
        with_layout: bool = False,
        lease_s: float | None = None,
    ) -> AcquireResult:
        """Phase one of a two-phase acquire: load and pin under a lease (a store transaction).

        The pins hold from now on (the adapters cannot be evicted); ``commit_acquire``
        keeps them past the lease, ``abort_acquire``, the lease's end or the session's end
        drop them. Same admission and errors as ``acquire``.
        """
        if lease_s is None:
            lease_s = self.config.acquire_lease_s
        return await self._acquire(session, adapter_ids, max_adapters, with_layout, lease_s or 0.0)

    def commit_acquire(self, session: int, txn_id: int) -> None:
        """Keep a prepared acquire's pins. Idempotent.

        Raises:
            BrokerError: NOT_FOUND (not an adapter acquire), PERMISSION_DENIED (another
                session's), FAILED_PRECONDITION (aborted, or the lease ended).
        """
        self._own_acquire_txn(session, txn_id)
        self.store.commit(session, [txn_id])

    def abort_acquire(self, session: int, txn_id: int) -> None:
        """Drop a prepared acquire's pins. Idempotent; FAILED_PRECONDITION once committed."""
        self._own_acquire_txn(session, txn_id)
        self.store.abort(session, [txn_id])

    def release(self, session: int, adapter_ids: Sequence[str]) -> None:
        """Drop one of the session's pins per listed id (an id listed twice drops two).

        Raises:
            BrokerError: NOT_FOUND (unregistered), FAILED_PRECONDITION (the session holds
                fewer pins than asked), PERMISSION_DENIED (only other sessions hold it, or
                the session is not open). Nothing is released when any id is refused.
        """
        self._check_session(session)
        self._prune_retired()
        oids: list[int] = []
        for aid, count in Counter(self._check_ids(adapter_ids)).items():
            e = self._entries.get(aid)
            obj = self._hot_obj(e) if e is not None else None
            # Copies found corrupt that this session still pins: released first.
            olds = [o for o in self._retired.get(aid, ()) if o.pins.get(session, 0)]
            if obj is None and not olds:
                if aid not in self.registry:
                    raise not_found(f"no adapter {aid!r} is registered")
                raise precondition(f"session {session} holds no pin on adapter {aid!r} (it is not loaded)")
            held = (obj.pins.get(session, 0) if obj is not None else 0) + sum(o.pins[session] for o in olds)
            if held < count:
                if held == 0 and any(s != self.system_session for s in obj.pins):
                    raise denied(f"adapter {aid!r} is acquired only by other sessions; session {session} holds no pin on it")
                raise precondition(f"adapter {aid!r}: asked to release {count}, session {session} holds {held} pin(s)")
            left = count
            for o in olds:
                k = min(left, o.pins[session])
                oids.extend([o.object_id] * k)
                left -= k
            if left:
                oids.extend([obj.object_id] * left)
        self.store.unpin(session, oids)
        self._prune_retired()

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
        ids = list(dict.fromkeys(self._check_ids(adapter_ids)))
        self._entries_for(ids)

        async def one(aid: str) -> Tier:
            if tier == Tier.WARM:
                e = self._entry(aid)
                await self._ensure_warm(e)
                # Hot already, or warm (unless the warm budget dropped it at once).
                return self._tier_of(e)
            await self._ensure_hot(aid, hold=False)
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
        """Where an adapter is now. Raises BrokerError(NOT_FOUND)."""
        e = self._entries.get(adapter_id)
        if e is None:
            meta = self.registry.get(adapter_id)
            return AdapterStatus(adapter_id, Tier.COLD, 0, 0, (), 0, self._plan(meta).num_pages, 0, False)
        obj = self._hot_obj(e)
        return AdapterStatus(
            adapter_id,
            self._tier_of(e),
            e.generation if obj is not None else 0,
            obj.object_id if obj is not None else 0,
            tuple(obj.pages) if obj is not None else (),
            sum(c for s, c in obj.pins.items() if s != self.system_session) if obj is not None else 0,
            e.layout.num_pages,
            e.warm.nbytes if e.warm is not None else 0,
            e.loading is not None or e.warming is not None,
        )

    def resident(self, adapter_id: str) -> AdapterStatus | None:
        """``describe`` for adapters that are warm, hot or loading; None (cold, or not
        registered) without touching the registry: cheap enough for every row of a listing."""
        return self.describe(adapter_id) if adapter_id in self._entries else None

    def image_state(self, adapter_id: str) -> str:
        """The adapter's converted image: off, none, queued, converting or ready. In memory only
        (no disk access): cheap enough for every row of a listing."""
        if self.images is None:
            return "off"
        if self._converting is not None and self._converting[0] == adapter_id:
            return "converting"
        if adapter_id in self._convert_queue:
            return "queued"
        return "ready" if self.images.has(adapter_id) else "none"

    def layout(self, adapter_id: str) -> AdapterLayout:
        """An adapter's placement within its pages (the same for every generation)."""
        e = self._entries.get(adapter_id)
        return e.layout if e is not None else self._plan(self.registry.get(adapter_id))

    def stats(self) -> dict:
        """Tier sizes, hits and misses per tier, loads per tier, hit rates (for metrics and tests)."""
        self._reconcile_hot()
        c = self.counters
        registered = len(self.registry)
        warm = sum(1 for e in self._entries.values() if e.warm is not None)
        resident = len({*self._hot, *(a for a, e in self._entries.items() if e.warm is not None)})
        pinned = sum(1 for e in self._hot.values() if any(s != self.system_session for s in e.obj.pins))
        lookups = c.hot_hits + c.hot_misses
        warm_lookups = c.warm_hits + c.warm_misses
        return {
            "registered": registered,
            "resident": {"hot": len(self._hot), "warm": warm, "cold": max(0, registered - resident)},
            "hot_pages": self._hot_pages,
            "hot_bytes": self._hot_pages * self.page_size,
            "hot_used_bytes": sum(e.layout.used_bytes for e in self._hot.values()),
            "hot_pinned_adapters": pinned,
            "loading_pages": self._loading_pages,
            "warm_bytes": self._warm_bytes,
            "hot_budget_pages": self.config.hot_budget_pages,
            "hot_budget_adapters": self.config.hot_budget_adapters,
            "warm_budget_bytes": self.config.warm_budget_bytes,
            # Where admitted adapters were found: hot (a hit), warm, or cold (files).
            "hits": {"hot": c.hot_hits, "warm": c.warm_hits, "cold": c.warm_misses},
            "misses": {"hot": c.hot_misses, "warm": c.warm_misses},
            "loads": {"hot": c.loads_hot, "warm": c.loads_warm},
            "bytes_loaded": {"hot": c.bytes_loaded_hot, "warm": c.bytes_loaded_warm},
            "load_seconds": {"hot": c.seconds_hot, "warm": c.seconds_warm},
            "hit_rate": c.hot_hits / lookups if lookups else 0.0,
            "warm_hit_rate": c.warm_hits / warm_lookups if warm_lookups else 0.0,
            "acquires": c.acquires,
            "acquired_adapters": c.acquired_adapters,
            "deferred": c.deferred,
            "shared_loads": c.shared_loads,
            "load_failures": c.load_failures,
            "demotions": c.demotions,
            "evictions": c.evictions,
            "warm_drops": c.warm_drops,
            "unregistered": c.unregistered,
            "images": {
                "enabled": self.images is not None, "hits": c.image_hits, "misses": c.image_misses,
                "rejected": c.image_rejects, "writes": c.image_writes, "write_failures": c.image_write_failures,
                "count": self.images.count if self.images else 0,
                "bytes": self.images.used_bytes if self.images else 0,
                "budget_bytes": self.config.image_budget_bytes,
                "evictions": self.images.evictions if self.images else 0,
                "converted_ahead": c.converted_ahead, "convert_skipped": c.convert_skipped,
                "convert_failures": c.convert_failures,
                "convert_queued": len(self._convert_queue) + (self._converting is not None),
            },
            "policies": {"hot": self.hot_policy.name, "warm": self.warm_policy.name},
            "checksums": {
                "verifications": c.verifications, "corruptions": c.corruptions,
                "image_corruptions": self.images.corrupt if self.images else 0,
                "retired_copies": sum(len(v) for v in self._retired.values()),
                "interval_s": self.config.verify_interval_s,
            },
        }

    # ---------------------------------------------------------------- checksums

    async def verify(self, adapter_ids: Sequence[str] | None = None) -> list[AdapterCheck]:
        """Check adapters' resident copies against their checksums, one adapter at a time,
        in the checksum thread: the hot pages if hot, else the warm image, else the image
        file. A corrupt copy is reported and dropped (see the module docstring).

        Args:
            adapter_ids: the adapters to check; None or empty: every hot or warm adapter.

        Raises:
            BrokerError: INVALID_ARGUMENT (bad ids), NOT_FOUND (unregistered id; nothing checked).
        """
        self._check_open()
        if adapter_ids:
            ids = list(dict.fromkeys(self._check_ids(adapter_ids)))
            for aid in ids:
                if aid not in self._entries:
                    self.registry.get(aid)
        else:
            ids = [aid for aid, e in self._entries.items() if e.obj is not None or e.warm is not None]
        return [await self._verify_one(aid) for aid in ids]

    def _checker(self) -> ThreadPoolExecutor:
        if self._verify_executor is None:
            self._verify_executor = ThreadPoolExecutor(1, thread_name_prefix="adapter-verify")
        return self._verify_executor

    async def _verify_one(self, aid: str) -> AdapterCheck:
        loop = asyncio.get_running_loop()
        e = self._entries.get(aid)
        if e is not None:
            obj = self._hot_obj(e)
            if obj is not None and e.hot_checksum:
                return await self._verify_hot(e, obj)
            if e.warm is not None and e.warm.checksum:
                warm, want = e.warm, e.warm.checksum
                got = await loop.run_in_executor(self._checker(), image_checksum, warm)
                self.counters.verifications += 1
                if e.warm is not warm:
                    return AdapterCheck(aid, Tier.WARM, False, True, want, "its warm image changed while it was checked")
                if got == want:
                    return AdapterCheck(aid, Tier.WARM, True, True, want, "warm image matches")
                self.counters.corruptions += 1
                self.log.warning("adapter_corrupted", adapter=aid, tier="warm", expected=want, found=got)
                self._drop_warm(e)
                return AdapterCheck(
                    aid, Tier.WARM, True, False, want,
                    f"warm image hashes to {got}: dropped; the next acquire reloads it from its source",
                )  # fmt: skip
        if self.images is not None and self.images.has(aid):
            meta = self.registry.get(aid)
            layout = e.layout if e is not None else self._plan(meta)
            checked, ok, want, detail = await loop.run_in_executor(self._checker(), self.images.check, meta, layout)
            if checked:
                self.counters.verifications += 1
            if not ok:
                self.counters.corruptions += 1
                self.log.warning("adapter_corrupted", adapter=aid, tier="cold", copy="image file", reason=detail)
            return AdapterCheck(aid, Tier.COLD, checked, ok, want, detail)
        return AdapterCheck(aid, Tier.COLD, False, True, "", "cold: nothing resident to check; its files are read on the next acquire")

    async def _verify_hot(self, e: _Entry, obj: Allocation) -> AdapterCheck:
        aid, gen, want = e.adapter_id, e.generation, e.hot_checksum
        # No pin is taken (a check must never make an adapter look acquired): if the object
        # was freed or evicted while its pages were read, the result says nothing and is
        # dropped below; an object still the same afterwards owned its pages all along.
        got = await asyncio.get_running_loop().run_in_executor(
            self._checker(), pages_checksum, self.arena.view, e.layout, list(obj.pages)
        )
        self.counters.verifications += 1
        if self._hot_obj(e) is not obj or e.generation != gen:
            return AdapterCheck(aid, Tier.HOT, False, True, want, "placed anew while it was checked; check again")
        if got == want:
            return AdapterCheck(aid, Tier.HOT, True, True, want, f"hot copy (generation {gen}) matches")
        self._drop_corrupt_hot(e, obj, want, got)
        return AdapterCheck(
            aid, Tier.HOT, True, False, want,
            f"hot copy (object {obj.object_id}, generation {gen}) hashes to {got}: dropped; the next acquire "
            "reloads it from its source",
        )  # fmt: skip

    def _drop_corrupt_hot(self, e: _Entry, obj: Allocation, want: str, got: str) -> None:
        """Report a corrupt hot copy and drop it with the warm image it came from, so no
        acquire returns it again: sessions that pin it keep their pins (released as usual),
        its pages return with the last one."""
        aid = e.adapter_id
        self.counters.corruptions += 1
        pinned_by = sorted(s for s in obj.pins if s != self.system_session)
        self.log.warning(
            "adapter_corrupted", adapter=aid, tier="hot", object_id=obj.object_id, generation=e.generation,
            expected=want, found=got, pinned_by_sessions=pinned_by,
        )  # fmt: skip
        detail = (
            f"adapter {aid!r} (object {obj.object_id}, generation {e.generation}) does not match its checksum; "
            "release it and acquire it again for a copy reloaded from its source"
        )
        for session in pinned_by:
            self._notify(session, AdapterCorrupted(aid, obj.object_id, e.generation, detail))
        self.store.free(self.system_session, [obj.object_id])
        if obj.pin_count:
            self._retired.setdefault(aid, []).append(obj)
        # The free dropped the system session's pins, the holds of acquires in flight too.
        e.stale_holds += e.holds
        e.holds = 0
        if e.warm is not None:
            self._drop_warm(e)
        self._drop_hot(e, evicted=False)

    def _prune_retired(self) -> None:
        for aid in [a for a, objs in self._retired.items() if not any(self.store.objects.get(o.object_id) is o for o in objs)]:
            del self._retired[aid]
        for aid, objs in self._retired.items():
            objs[:] = [o for o in objs if self.store.objects.get(o.object_id) is o]

    async def _verify_loop(self) -> None:
        """Every ``verify_interval_s``, check one hot adapter (in turn) against its checksum."""
        while not self._closed:
            await asyncio.sleep(self.config.verify_interval_s)
            hot = sorted(self._hot)
            if not hot:
                continue
            aid = hot[self._verify_turn % len(hot)]
            self._verify_turn += 1
            try:
                await self._verify_one(aid)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001  (a check that fails must not end the checks)
                self.log.warning("adapter_verify_failed", adapter=aid, error=str(err))

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
        for oid in object_ids:
            e = self._by_object.get(oid)
            if e is not None and e.obj is not None and e.obj.object_id == oid:
                self._drop_hot(e, evicted=True)

    async def close(self) -> None:
        """Stop: wait for loads in flight (they abort), free idle hot adapters, end the
        system session (objects other sessions still pin go with their last pin)."""
        if self._closed:
            return
        self._closed = True
        if self._verify_task is not None:
            self._verify_task.cancel()
            await asyncio.gather(self._verify_task, return_exceptions=True)
        tasks = [t for e in self._entries.values() for t in (e.loading, e.warming) if t is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        # Let image writes finish, so the next start finds them; the conversions still
        # queued are left for the next start.
        self._convert_queue.clear()
        if self._convert_task is not None:
            await asyncio.gather(self._convert_task, return_exceptions=True)
        if self._convert_executor is not None:
            self._convert_executor.shutdown(wait=True)
        if self._verify_executor is not None:
            self._verify_executor.shutdown(wait=True)
        await self.wait_image_writes()
        self.store.end_session(self.system_session)
        for e in list(self._hot.values()):
            self._drop_hot(e, evicted=False)
        for e in list(self._entries.values()):
            if e.warm is not None:
                self._drop_warm(e)
        self._entries.clear()
        if self._own_executor:
            self._executor.shutdown(wait=False)

    async def wait_image_writes(self) -> None:
        """Wait until the converted images being written to the image cache are on disk."""
        while self._image_writes:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in list(self._image_writes.values())), return_exceptions=True)
            # The done callbacks run on the loop: let them clear the finished writes.
            await asyncio.sleep(0)

    # ---------------------------------------------------------------- internals

    async def _acquire(self, session, adapter_ids, max_adapters, with_layout, lease_s) -> AcquireResult:
        self._check_open()
        ids = self._check_ids(adapter_ids)
        if max_adapters is not None and (not isinstance(max_adapters, int) or max_adapters < 0):
            raise invalid(f"max_adapters is {max_adapters!r}; give a count >= 1, or 0/None for no cap")
        if lease_s and not 0 < lease_s <= self.store.config.max_lease_s:
            raise invalid(f"lease of {lease_s:g} s is out of range; allowed 0 < lease <= {self.store.config.max_lease_s:g} s")
        distinct = list(dict.fromkeys(ids))
        cap = max_adapters or len(distinct)
        admitted, deferred = distinct[:cap], distinct[cap:]
        self._check_session(session)
        entries = self._entries_for(admitted)
        found = {aid: self._classify(e) for aid, e in entries.items()}
        held: dict[str, _Entry] = {}

        async def one(aid: str) -> None:
            e, _ = await self._ensure_hot(aid, hold=True)
            held[aid] = e

        txn = None
        try:
            if all(f == Tier.HOT for f in found.values()):
                # All hot: pin below without yielding to the loop, so nothing can evict them
                # in between and no holds are needed (the common, cheap case).
                held_now = entries
            else:
                results = await asyncio.gather(*(one(a) for a in admitted), return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors:
                    raise next((r for r in errors if not isinstance(r, BrokerError)), errors[0])
                held_now = held
                for aid in admitted:
                    if self._hot_obj(held_now[aid]) is None:
                        # Found corrupt (and dropped) between its load and this pin.
                        raise unavailable(f"adapter {aid!r} was found corrupt as it loaded and is being reloaded; acquire again")
            objs = [held_now[aid].obj for aid in admitted]
            oids = [o.object_id for o in objs]
            self._check_session(session)
            if lease_s is None:
                self.store.pin(session, oids)
            else:
                txn = self.store.prepare(session, [], pin_ids=oids, lease_s=lease_s)
                self._txns[txn.txn_id] = session
                if len(self._txns) > self.config.remember_txns:
                    self._txns.popitem(last=False)
        finally:
            for e in held.values():
                self._unhold(e)
        c = self.counters
        c.acquires += 1
        c.acquired_adapters += len(admitted)
        c.deferred += len(deferred)
        out = []
        for aid, obj in zip(admitted, objs):
            e = held_now[aid]
            self.hot_policy.access(aid)
            self.warm_policy.access(aid)
            out.append(
                AcquiredAdapter(aid, e.generation, obj.object_id, tuple(obj.pages), e.layout if with_layout else None, found[aid])
            )
        return AcquireResult(
            tuple(out), tuple(deferred), txn.txn_id if txn else 0, txn.deadline_unix if txn else 0.0
        )

    def _classify(self, e: _Entry) -> Tier:
        """Count one lookup of an admitted adapter; returns where it was found."""
        c = self.counters
        if self._hot_obj(e) is not None:
            c.hot_hits += 1
            return Tier.HOT
        c.hot_misses += 1
        if e.warm is not None:
            c.warm_hits += 1
            return Tier.WARM
        c.warm_misses += 1
        return Tier.COLD

    async def _ensure_hot(self, aid: str, hold: bool) -> tuple[_Entry, Allocation]:
        """The adapter's committed hot object, loading it if needed; with ``hold``, one
        system-session pin is taken for the caller (``_unhold`` gives it back), so nothing
        evicts it before the caller pins it for its own session."""
        e = self._entry(aid)
        obj = self._hot_obj(e)
        if obj is not None:
            if hold:
                self._hold(e, obj)
            return e, obj
        task = e.loading
        if task is None:
            task = e.loading = asyncio.ensure_future(self._load_hot(e))
            task.add_done_callback(_consume)
        else:
            self.counters.shared_loads += 1
        if hold:
            e.waiters += 1
        try:
            obj = await asyncio.shield(task)
        except BaseException:
            if hold:
                if task.done() and not task.cancelled() and task.exception() is None:
                    # The load committed and took our hold before we were cancelled.
                    self._unhold(e)
                else:
                    e.waiters -= 1
                    self._maybe_forget(e)
            raise
        return e, obj

    async def _load_hot(self, e: _Entry) -> Allocation:
        """Warm -> hot: reserve pages (PREPARED, invisible), write them in the executor,
        commit. Shared by every acquire waiting on ``e.loading``."""
        aid = e.adapter_id
        ok = False
        try:
            image = await self._ensure_warm(e)
            self._check_alive(e)
            n = e.layout.num_pages
            self._make_hot_room(e, n)
            try:
                txn = self.store.prepare(
                    self.system_session, [Spec(n, ContentType.LORA_WEIGHT)], lease_s=self._load_lease_s
                )
            except BrokerError as err:
                if err.code == Code.RESOURCE_EXHAUSTED:
                    raise exhausted(f"adapter {aid!r} needs {n} pages: {err.message}") from None
                raise
            obj = txn.objects[0]
            self._loading_pages += n
            self._loading_count += 1
            loop = asyncio.get_running_loop()
            t0 = time.perf_counter()
            cf = self._executor.submit(self._writer.write, image, list(obj.pages))
            try:
                written = await asyncio.wrap_future(cf)
                self._check_alive(e)
                self.store.commit(self.system_session, [txn.txn_id])
            except BaseException:
                if cf.done():
                    self._abort_load(txn)
                else:
                    # Never free pages a copy is still writing: abort once it finishes.
                    cf.add_done_callback(lambda _f: loop.call_soon_threadsafe(self._abort_load, txn))
                raise
            finally:
                self._loading_pages -= n
                self._loading_count -= 1
            dt = time.perf_counter() - t0
            # Publish: nothing below awaits or fails.
            e.obj = obj
            e.hot_checksum = image.checksum
            e.generation = next(self._generations)
            self._hot[aid] = e
            self._by_object[obj.object_id] = e
            self._hot_pages += n
            self.hot_policy.insert(aid, n)
            c = self.counters
            c.loads_hot += 1
            c.bytes_loaded_hot += written
            c.seconds_hot += dt
            if e.waiters:
                self.store.pin(self.system_session, [obj.object_id] * e.waiters)
                e.holds += e.waiters
                e.waiters = 0
            self.log.info(
                "adapter_loaded", adapter=aid, tier="hot", generation=e.generation, object_id=obj.object_id,
                pages=n, bytes=written, ms=round(dt * 1e3, 3),
            )  # fmt: skip
            ok = True
            return obj
        except BaseException as err:
            self.counters.load_failures += 1
            self.log.info("adapter_load_failed", adapter=aid, tier="hot", error=str(err))
            raise
        finally:
            e.loading = None
            if ok:
                self._trim_warm()
            else:
                self._maybe_forget(e)

    def _abort_load(self, txn) -> None:
        if txn.state == TxnState.OPEN and self.system_session in self.store.sessions:
            self.store.abort(self.system_session, [txn.txn_id])

    async def _ensure_warm(self, e: _Entry) -> WarmImage:
        if e.warm is not None:
            return e.warm
        task = e.warming
        if task is None:
            task = e.warming = asyncio.ensure_future(self._load_warm(e))
            task.add_done_callback(_consume)
        return await asyncio.shield(task)

    async def _load_warm(self, e: _Entry) -> WarmImage:
        """Cold -> warm: read and lay out the file in the executor."""
        aid = e.adapter_id
        ok = False
        try:
            loop = asyncio.get_running_loop()
            t0 = time.perf_counter()
            conv = self._converting
            if conv is not None and conv[0] == aid:
                # Being converted ahead of use right now: its image is the quickest way in
                # (if the conversion fails, this load converts the file and says why).
                try:
                    await asyncio.shield(asyncio.wrap_future(conv[1]))
                except Exception:  # noqa: BLE001
                    pass
            image, cached, rejected = await loop.run_in_executor(self._executor, self._cold_to_warm, e.meta, e.layout)
            dt = time.perf_counter() - t0
            c = self.counters
            if rejected:
                c.image_rejects += 1
                if " is corrupt: " in rejected:  # ImageCache.load's words for a checksum mismatch
                    c.verifications += 1
                    c.corruptions += 1
                    self.log.warning("adapter_corrupted", adapter=aid, tier="cold", copy="image file", reason=rejected)
                self.log.warning("adapter_image_rejected", adapter=aid, reason=rejected)
            self._check_alive(e)
            e.warm = image
            self._warm_bytes += image.nbytes
            self.warm_policy.insert(aid, image.nbytes)
            c.loads_warm += 1
            c.bytes_loaded_warm += image.source_bytes
            c.seconds_warm += dt
            if self.images is not None:
                if cached:
                    c.image_hits += 1
                else:
                    c.image_misses += 1
                    self._write_image(e.meta, image)
            self.log.info(
                "adapter_loaded", adapter=aid, tier="warm", bytes=image.nbytes, int8=image.int8, ms=round(dt * 1e3, 3),
                from_image=cached,
            )  # fmt: skip
            ok = True
            return image
        finally:
            e.warming = None
            if ok:
                self._trim_warm(keep=e)
            else:
                self._maybe_forget(e)

    def _cold_to_warm(self, meta: AdapterMeta, layout: AdapterLayout) -> tuple[WarmImage, bool, str]:
        """(image, read from the image cache?, why a cached image was rejected). Executor."""
        rejected = ""
        if self.images is not None:
            image, rejected = self.images.load(meta, layout, self.config.copy_threads)
            if image is not None:
                return image, True, ""
        image = build_warm_image(meta, layout, self.config.warm_int8, self.config.copy_threads)
        return image, False, rejected

    def _write_image(self, meta: AdapterMeta, image: WarmImage) -> None:
        """Store a freshly built image in the cache, in the executor, off the load's path."""
        aid = meta.adapter_id
        if aid in self._image_writes:
            return  # one write at a time per adapter; the next miss writes again
        loop = asyncio.get_running_loop()
        fut = self._executor.submit(self.images.store, meta, image)
        self._image_writes[aid] = fut

        def done(f) -> None:
            if self._image_writes.get(aid) is f:
                del self._image_writes[aid]
            err = f.exception()
            if err is not None:
                self.counters.image_write_failures += 1
                self.log.warning("adapter_image_write_failed", adapter=aid, error=str(err))
            elif f.result():
                self.counters.image_writes += 1
            self._drop_orphan_image(aid)

        def report(f) -> None:
            try:
                loop.call_soon_threadsafe(done, f)
            except RuntimeError:
                pass  # the loop is gone: nothing left to count or log

        fut.add_done_callback(report)

    def _drop_orphan_image(self, adapter_id: str) -> bool:
        """After an image write: remove the image if the adapter was unregistered meanwhile (it
        must not outlive the adapter); True when it was. A closed registry (the broker is
        stopping) keeps the image for the next start."""
        try:
            gone = adapter_id not in self.registry
        except BrokerError:
            return False
        if gone:
            self._remove_image(adapter_id)
        return gone

    def _remove_image(self, adapter_id: str) -> None:
        if self.images is None:
            return
        try:
            self.images.remove(adapter_id)
        except OSError as err:
            self.log.warning("adapter_image_remove_failed", adapter=adapter_id, error=str(err))

    def _make_hot_room(self, e: _Entry, n: int) -> None:
        """Demote idle hot adapters (hot policy order) until ``n`` more pages and one more
        adapter fit the hot budget; refuse, demoting nothing, when they cannot."""
        aid = e.adapter_id
        if n > self.store.pool.max_pages:
            raise exhausted(f"adapter {aid!r} needs {n} pages; the arena holds at most {self.store.pool.max_pages}")
        bp, ba = self.config.hot_budget_pages, self.config.hot_budget_adapters
        if not bp and not ba:
            return
        if bp and n > bp:
            raise exhausted(f"adapter {aid!r} needs {n} pages; the hot tier budget is {bp} pages (hot_budget_pages)")
        self._reconcile_hot()
        over_p = self._hot_pages + self._loading_pages + n - bp if bp else 0
        over_a = len(self._hot) + self._loading_count + 1 - ba if ba else 0
        if over_p <= 0 and over_a <= 0:
            return
        victims: list[_Entry] = []
        freed_p = freed_a = 0
        for vid in self.hot_policy.victims():
            if freed_p >= over_p and freed_a >= over_a:
                break
            v = self._hot.get(vid)
            if v is None or v is e or v.obj.pin_count:
                continue
            victims.append(v)
            freed_p += v.obj.num_pages
            freed_a += 1
        if freed_p < over_p or freed_a < over_a:
            pinned = [v for v in self._hot.values() if v.obj.pin_count]
            pinned_pages = sum(v.obj.num_pages for v in pinned)
            idle_pages = self._hot_pages - pinned_pages
            budget = " and ".join(
                x for x in (f"{bp} pages" if bp else "", f"{ba} adapters" if ba else "") if x
            )
            raise exhausted(
                f"adapter {aid!r} needs {n} pages but the adapter hot tier is full: budget {budget}; "
                f"{self._hot_pages} pages in {len(self._hot)} hot adapters, {pinned_pages} pages pinned by acquires "
                f"in {len(pinned)}, {idle_pages} evictable, {self._loading_pages} pages loading; "
                "release adapters or raise hot_budget_pages/hot_budget_adapters"
            )
        for v in victims:
            self.store.free(self.system_session, [v.obj.object_id])
            self._drop_hot(v, evicted=False)
            self.counters.demotions += 1

    def _hot_obj(self, e: _Entry) -> Allocation | None:
        """The entry's hot object if the store still has it (an eviction we were not told
        about is noticed here)."""
        obj = e.obj
        if obj is None:
            return None
        if self.store.objects.get(obj.object_id) is not obj or obj.freed:
            self._drop_hot(e, evicted=True)
            return None
        return obj

    def _reconcile_hot(self) -> None:
        for e in list(self._hot.values()):
            self._hot_obj(e)

    def _drop_hot(self, e: _Entry, evicted: bool) -> None:
        obj = e.obj
        if obj is None:
            return
        e.obj = None
        aid = e.adapter_id
        self._hot.pop(aid, None)
        self._by_object.pop(obj.object_id, None)
        self._hot_pages -= obj.num_pages
        self.hot_policy.remove(aid)
        if evicted:
            self.counters.evictions += 1
        self.log.info("adapter_demoted", adapter=aid, object_id=obj.object_id, evicted=evicted, warm=e.warm is not None)
        self._maybe_forget(e)

    def _trim_warm(self, keep: _Entry | None = None) -> None:
        budget = self.config.warm_budget_bytes
        if self._warm_bytes <= budget:
            return
        for vid in self.warm_policy.victims():
            if self._warm_bytes <= budget:
                break
            v = self._entries.get(vid)
            if v is None or v is keep or v.warm is None or v.loading is not None:
                continue
            self._drop_warm(v)

    def _drop_warm(self, e: _Entry) -> None:
        self._warm_bytes -= e.warm.nbytes
        e.warm = None
        self.warm_policy.remove(e.adapter_id)
        self.counters.warm_drops += 1
        self._maybe_forget(e)

    def _maybe_forget(self, e: _Entry) -> None:
        """Forget an entry with nothing left in any tier and nothing in flight (it is cold)."""
        if (
            e.obj is None and e.warm is None and e.loading is None and e.warming is None
            and not e.waiters and not e.holds and not e.stale_holds and self._entries.get(e.adapter_id) is e
        ):  # fmt: skip
            del self._entries[e.adapter_id]

    def _hold(self, e: _Entry, obj: Allocation) -> None:
        self.store.pin(self.system_session, [obj.object_id])
        e.holds += 1

    def _unhold(self, e: _Entry) -> None:
        if e.stale_holds:
            e.stale_holds -= 1
            self._maybe_forget(e)
            return
        e.holds -= 1
        obj = e.obj
        if obj is not None and obj.pins.get(self.system_session, 0) > 0 and self.system_session in self.store.sessions:
            self.store.unpin(self.system_session, [obj.object_id])
        self._maybe_forget(e)

    def _entry(self, aid: str) -> _Entry:
        e = self._entries.get(aid)
        if e is None:
            meta = self.registry.get(aid)
            e = self._entries[aid] = _Entry(meta, self._plan(meta))
        return e

    def _entries_for(self, ids: Sequence[str]) -> dict[str, _Entry]:
        """Entries for every id, or NOT_FOUND / INVALID_ARGUMENT before any is created."""
        new = {}
        for aid in ids:
            if aid not in self._entries and aid not in new:
                meta = self.registry.get(aid)
                new[aid] = _Entry(meta, self._plan(meta))
        self._entries.update(new)
        return {aid: self._entries[aid] for aid in ids}

    def _plan(self, meta: AdapterMeta) -> AdapterLayout:
        try:
            return plan_layout(meta.weights, self.page_size, self.config.dtype, self.config.row_align)
        except ValueError as err:
            raise invalid(f"adapter {meta.adapter_id!r} cannot be placed in pages: {err}") from None

    def _tier_of(self, e: _Entry) -> Tier:
        if self._hot_obj(e) is not None:
            return Tier.HOT
        return Tier.WARM if e.warm is not None else Tier.COLD

    def _check_ids(self, adapter_ids: Sequence[str]) -> list[str]:
        if isinstance(adapter_ids, str):
            raise invalid("adapter_ids must be a list of adapter ids, not one string")
        ids = list(adapter_ids)
        if len(ids) > self.store.config.max_batch:
            raise invalid(f"adapter_ids has {len(ids)} items; at most {self.store.config.max_batch} per call")
        for i, aid in enumerate(ids):
            check_adapter_id(aid, f"adapter_ids[{i}]")
        return ids

    def _check_session(self, session: int) -> None:
        if session not in self.store.sessions or session == self.system_session:
            raise denied(f"session {session} is not open")

    def _check_alive(self, e: _Entry) -> None:
        if self._closed:
            raise unavailable("the adapter manager is shutting down")
        if e.removed:
            raise not_found(f"adapter {e.adapter_id!r} was unregistered while it loaded")

    def _check_open(self) -> None:
        if self._closed:
            raise unavailable("the adapter manager is shutting down")

    def _own_acquire_txn(self, session: int, txn_id: int) -> None:
        self._check_open()
        owner = self._txns.get(txn_id)
        if owner is None:
            raise not_found(f"no adapter acquire transaction {txn_id} (unknown, or finished too long ago to remember)")
        if owner != session:
            raise denied(f"adapter acquire transaction {txn_id} belongs to another session")
