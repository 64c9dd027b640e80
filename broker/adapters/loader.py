"""Loads up the tiers: cold files (or images) to warm host images, warm images to hot pages.

``TierLoader`` runs one load per adapter and tier however many callers ask at once (later
callers join the load in flight), reserves the pages as a PREPARED object of the system
session, writes them in the executor and commits; the holds it gives acquires keep a fresh
hot object from being evicted before the acquiring session pins it. It changes entries only
through their state machine and the budgets' methods, and decides nothing about admission.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from memory_broker.broker.adapters.context import AdapterContext
from memory_broker.broker.adapters.entry import AdapterEntry
from memory_broker.broker.adapters.hot_budget import HotBudget
from memory_broker.broker.adapters.image_service import ImageService
from memory_broker.broker.adapters.warm_budget import WarmBudget
from memory_broker.broker.adapters.warm_image import WarmImage
from memory_broker.broker.store.eviction import ContentType
from memory_broker.broker.store.objects import Allocation, Spec, TxnState
from memory_broker.proto.wire.errors import BrokerError, Code, exhausted, not_found, unavailable


def _consume(task: asyncio.Future) -> None:
    # Loads are awaited through shields; a load nobody awaits any more must not log
    # "exception was never retrieved".
    if not task.cancelled():
        task.exception()


class TierLoader:
    """Shared loads of adapters into the warm and hot tiers.

    Args:
        ctx: the wing's shared record; its store reserves (prepare), commits, pins and frees
            the hot objects, owned by its system session; its executor runs file reads and
            page writes; loads are counted in its counters.
        hot, warm, images: the wing's other parts.
        writer: copies warm images into pages (``write(image, pages) -> bytes``).

    A prepared object's lease while a load writes it is the config's ``load_lease_s``, at
    most the store's ``max_lease_s``.
    """

    def __init__(self, ctx: AdapterContext, hot: HotBudget, warm: WarmBudget, images: ImageService, writer):
        self.store = store = ctx.store
        self.system_session = ctx.system_session
        self.entries = ctx.entries
        self.hot = hot
        self.warm = warm
        self.images = images
        self.writer = writer
        self._executor = ctx.executor
        self.config = config = ctx.config
        self.counters = ctx.counters
        self.log = ctx.log
        self._load_lease_s = min(config.load_lease_s, store.limits.max_lease_s)
        self._generations = itertools.count(1)
        # Set when the manager shuts down: loads in flight abort when they next look.
        self.closed = False

    def check_alive(self, e: AdapterEntry) -> None:
        if self.closed:
            raise unavailable("the adapter manager is shutting down")
        if e.removed:
            raise not_found(f"adapter {e.adapter_id!r} was unregistered while it loaded")

    def in_flight(self) -> list[asyncio.Future]:
        return [t for e in self.entries.values() for t in (e.loading, e.warming) if t is not None]

    # -------------------------------------------------------------------- holds

    def hold(self, e: AdapterEntry, obj: Allocation) -> None:
        self.store.pin(self.system_session, [obj.object_id])
        e.holds += 1

    def unhold(self, e: AdapterEntry) -> None:
        if e.stale_holds:
            e.stale_holds -= 1
            self.entries.forget_if_idle(e)
            return
        e.holds -= 1
        obj = e.obj
        if obj is not None and obj.pins.get(self.system_session, 0) > 0 and self.store.has_session(self.system_session):
            self.store.unpin(self.system_session, [obj.object_id])
        self.entries.forget_if_idle(e)

    # ---------------------------------------------------------------------- hot

    async def ensure_hot(self, key: str, hold: bool) -> tuple[AdapterEntry, Allocation]:
        """The committed hot object of the adapter copy ``key`` (an adapter id, or ``id#dtype``),
        loading it if needed; with ``hold``, one system-session pin is taken for the caller
        (``unhold`` gives it back), so nothing evicts it before the caller pins it for its own
        session."""
        e = self.entries.entry(key)
        obj = self.hot.current(e)
        if obj is not None:
            if hold:
                self.hold(e, obj)
            return e, obj
        task = e.loading
        if task is None:
            task = e.start_loading(lambda: asyncio.ensure_future(self._load_hot(e)))
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
                    self.unhold(e)
                else:
                    e.waiters -= 1
                    self.entries.forget_if_idle(e)
            raise
        return e, obj

    async def _prepare(self, n: int):
        """Reserve ``n`` pages for a load (any grow of the arena it needs made off the loop)."""
        store = self.store

        def prepare():
            return store.prepare(self.system_session, [Spec(n, ContentType.LORA_WEIGHT)], lease_s=self._load_lease_s)

        return prepare() if store.growth is None else await store.growth.run(prepare)

    async def _load_hot(self, e: AdapterEntry) -> Allocation:
        """Warm -> hot: reserve pages (PREPARED, invisible), write them in the executor,
        commit. Shared by every acquire waiting on ``e.loading``."""
        aid = e.adapter_id
        ok = False
        try:
            image = await self.ensure_warm(e)
            self.check_alive(e)
            n = e.layout.num_pages
            self.hot.make_room(e, n)
            try:
                txn = await self._prepare(n)
            except BrokerError as err:
                if err.code == Code.RESOURCE_EXHAUSTED:
                    raise exhausted(f"adapter {aid!r} needs {n} pages: {err.message}") from None
                raise
            obj = txn.objects[0]
            self.hot.reserve(n)
            loop = asyncio.get_running_loop()
            t0 = time.perf_counter()
            cf = self._executor.submit(self.writer.write, image, list(obj.pages))
            try:
                written = await asyncio.wrap_future(cf)
                self.check_alive(e)
                self.store.commit(self.system_session, [txn.txn_id])
            except BaseException:
                if cf.done():
                    self._abort_load(txn)
                else:
                    # Never free pages a copy is still writing: abort once it finishes.
                    cf.add_done_callback(lambda _f: loop.call_soon_threadsafe(self._abort_load, txn))
                raise
            finally:
                self.hot.unreserve(n)
            dt = time.perf_counter() - t0
            # Publish: nothing below awaits or fails.
            self.hot.publish(e, obj, image.checksum, next(self._generations))
            c = self.counters
            c.loads_hot += 1
            c.bytes_loaded_hot += written
            c.seconds_hot += dt
            if e.waiters:
                self.store.pin(self.system_session, [obj.object_id] * e.waiters)
                e.holds += e.waiters
                e.waiters = 0
            self.log.info(
                "adapter_loaded",
                adapter=aid,
                tier="hot",
                generation=e.generation,
                object_id=obj.object_id,
                pages=n,
                bytes=written,
                ms=round(dt * 1e3, 3),
            )
            ok = True
            return obj
        except BaseException as err:
            self.counters.load_failures += 1
            self.log.info("adapter_load_failed", adapter=aid, tier="hot", error=str(err))
            raise
        finally:
            if ok:
                self.warm.trim()
            else:
                if e.loading is not None:
                    e.loading_failed()
                self.entries.forget_if_idle(e)

    def _abort_load(self, txn) -> None:
        if txn.state == TxnState.OPEN and self.store.has_session(self.system_session):
            self.store.abort(self.system_session, [txn.txn_id])

    # --------------------------------------------------------------------- warm

    async def ensure_warm(self, e: AdapterEntry) -> WarmImage:
        if e.warm is not None:
            return e.warm
        task = e.warming
        if task is None:
            task = e.start_warming(lambda: asyncio.ensure_future(self._load_warm(e)))
            task.add_done_callback(_consume)
        return await asyncio.shield(task)

    async def _load_warm(self, e: AdapterEntry) -> WarmImage:
        """Cold -> warm: read and lay out the file (or its image) in the executor."""
        aid = e.key
        # A copy in another dtype, or of a rank's shards, is converted from the files each time
        # it goes warm: the image cache holds the broker's own dtype, whole.
        use_cache = not e.derived
        ok = False
        try:
            loop = asyncio.get_running_loop()
            t0 = time.perf_counter()
            conv = self.images.converting(aid) if use_cache else None
            if conv is not None:
                # Being converted ahead of use right now: its image is the quickest way in
                # (if the conversion fails, this load converts the file and says why).
                try:
                    await asyncio.shield(asyncio.wrap_future(conv))
                except Exception:  # noqa: BLE001
                    pass
            image, cached, rejected = await loop.run_in_executor(
                self._executor, self.images.cold_to_warm, e.meta, e.layout, use_cache
            )
            dt = time.perf_counter() - t0
            c = self.counters
            if rejected:
                c.image_rejects += 1
                if " is corrupt: " in rejected:  # ImageCache.load's words for a checksum mismatch
                    c.verifications += 1
                    c.corruptions += 1
                    self.log.warning("adapter_corrupted", adapter=aid, tier="cold", copy="image file", reason=rejected)
                self.log.warning("adapter_image_rejected", adapter=aid, reason=rejected)
            self.check_alive(e)
            self.warm.add(e, image)
            c.loads_warm += 1
            c.bytes_loaded_warm += image.source_bytes
            c.seconds_warm += dt
            if self.images.cache is not None and use_cache:
                if cached:
                    c.image_hits += 1
                else:
                    c.image_misses += 1
                    self.images.write(e.meta, image)
            self.log.info(
                "adapter_loaded",
                adapter=aid,
                tier="warm",
                bytes=image.nbytes,
                int8=image.int8,
                ms=round(dt * 1e3, 3),
                from_image=cached,
            )
            ok = True
            return image
        finally:
            if ok:
                self.warm.trim(keep=e)
            else:
                if e.warming is not None:
                    e.warming_failed()
                self.entries.forget_if_idle(e)
