"""Converted images for the adapter wing: the disk cache, conversion ahead of use, and image writes.

``ImageService`` owns the ``ImageCache`` (``<state_dir>/images``), the queue of adapters to
convert ahead of use (one background thread, rate-limited to ``convert_duty``), the image
writes that follow a cold load, and the cold -> warm read that prefers an image to the
safetensors file: its own, else the fleet's in the tier (``tier_images``, with
``tier.adapters``), which it writes there after converting the files. It reads the registry and the entries it is shown; it never touches the
store, the tiers' budgets or pins.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from memory_broker.broker.adapters.context import AdapterContext
from memory_broker.broker.adapters.image_cache import ImageCache
from memory_broker.broker.adapters.layout import AdapterLayout
from memory_broker.broker.adapters.peft import AdapterMeta
from memory_broker.broker.adapters.warm_image import WarmImage, build_packed_into, build_warm_image
from memory_broker.proto.wire.errors import BrokerError


class ImageService:
    """The image cache and the work around it.

    Args:
        ctx: the wing's shared record: its registry (what to convert, what is orphaned), its
            config (``image_cache``, ``image_budget``, ``convert_ahead``, ``convert_duty`` ...),
            its counters (image hits, writes and conversions), its logger, its executor (image
            writes and the start-up census), its entry table and ``plan`` (an adapter's layout).
    """

    def __init__(self, ctx: AdapterContext):
        self.registry = registry = ctx.registry
        self.config = config = ctx.config
        self.counters = ctx.counters
        self.log = log = ctx.log
        self._executor = ctx.executor
        self._entry_of = ctx.entries.get
        self._plan = ctx.plan
        # The cache (None: off, no state dir, or int8 warm storage).
        self.cache: ImageCache | None = None
        state_dir = getattr(registry, "state_dir", None)
        if config.image_cache and state_dir and not config.warm_int8:
            try:
                self.cache = ImageCache(
                    os.path.join(state_dir, "images"),
                    fsync=config.image_fsync,
                    max_bytes=config.image_budget,
                    verify=config.verify_images,
                    min_free=config.image_min_free,
                )
            except OSError as err:
                log.warning("adapter_image_cache_off", error=str(err))
        # Image writes in flight by adapter id.
        self._writes: dict[str, Future] = {}
        # Adapters' images in the tier past one host (``tier_images.TierImages``), or None.
        self.tier = None
        # Conversions ahead of use: adapter ids waiting (in order), the one being converted
        # and its future, and the task that works through them (in its own thread, so a
        # burst of registrations never queues in front of loads).
        self._queue: OrderedDict[str, None] = OrderedDict()
        self._converting: tuple[str, Future] | None = None
        self._task: asyncio.Task | None = None
        self._convert_executor: ThreadPoolExecutor | None = None
        self._closed = False

    # ------------------------------------------------------------------ reading

    def state(self, adapter_id: str) -> str:
        """off, none, queued, converting or ready. In memory only (no disk access)."""
        if self.cache is None:
            return "off"
        if self._converting is not None and self._converting[0] == adapter_id:
            return "converting"
        if adapter_id in self._queue:
            return "queued"
        return "ready" if self.cache.has(adapter_id) else "none"

    @property
    def queued(self) -> int:
        """Adapters waiting for conversion ahead of use, the one converting included."""
        return len(self._queue) + (self._converting is not None)

    def converting(self, adapter_id: str) -> Future | None:
        """The conversion of ``adapter_id`` running now, if it is."""
        conv = self._converting
        return conv[1] if conv is not None and conv[0] == adapter_id else None

    # ------------------------------------------------------------ start and stop

    async def start(self) -> None:
        """Delete images of adapters no longer registered; queue every registered adapter
        without an image for conversion ahead of use."""
        if self.cache is None:
            return
        loop = asyncio.get_running_loop()
        missing, orphans = await loop.run_in_executor(self._executor, self._census)
        for path in orphans:
            self.cache.remove_path(path)
        if orphans:
            self.log.info("adapter_images_pruned", images=len(orphans))
        self.schedule(missing)

    def _census(self) -> tuple[list[str], list[str]]:
        """(registered ids without an image file, image files of no registered adapter). Executor."""
        expected: dict[str, str] = {}
        token = ""
        while True:
            page = self.registry.list(limit=10_000, page_token=token)
            for info in page.adapters:
                expected[self.cache.path(info.adapter_id)] = info.adapter_id
            token = page.next_page_token
            if not token:
                break
        have = set(self.cache.paths())
        missing = [aid for path, aid in expected.items() if path not in have]
        return missing, [path for path in have if path not in expected]

    async def close(self) -> None:
        """Let the conversion running now and the image writes finish (the next start finds
        them); the conversions still queued are left for the next start."""
        self._closed = True
        self._queue.clear()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._convert_executor is not None:
            self._convert_executor.shutdown(wait=True)
        await self.wait_writes()

    # ------------------------------------------------------ conversion ahead of use

    def schedule(self, adapter_ids: Sequence[str]) -> int:
        """Queue adapters for conversion ahead of use (no-op with the cache or
        ``convert_ahead`` off); returns how many were queued."""
        if self.cache is None or not self.config.convert_ahead or self._closed:
            return 0
        n = 0
        for aid in adapter_ids:
            if aid not in self._queue:
                self._queue[aid] = None
                n += 1
        if self._queue and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._convert_loop())
        return n

    async def wait_conversions(self) -> None:
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _convert_loop(self) -> None:
        if self._convert_executor is None:
            self._convert_executor = ThreadPoolExecutor(1, thread_name_prefix="adapter-convert")
        while self._queue and not self._closed:
            aid, _ = self._queue.popitem(last=False)
            try:
                meta = self.registry.find(aid)
            except BrokerError:
                return  # the registry is closed: the broker is stopping
            e = self._entry_of(aid)
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
            fut = self._convert_executor.submit(self.convert_one, meta, layout)
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
            if self.drop_orphan(aid):
                continue
            self.counters.converted_ahead += 1
            self.counters.image_writes += 1
            self.log.info("adapter_converted", adapter=aid, bytes=written, ms=ms)
            await self._pause(ms / 1e3)

    async def _pause(self, spent_s: float) -> None:
        """Rate-limit conversion ahead of use to ``convert_duty`` of the wall time."""
        duty = self.config.convert_duty
        if 0 < duty < 1:
            await asyncio.sleep(spent_s * (1 - duty) / duty)

    def convert_one(self, meta: AdapterMeta, layout: AdapterLayout) -> tuple[int, float]:
        """Build and store one adapter's image unless it has one or there is no room:
        (bytes written, ms). The convert thread."""
        images = self.cache
        if not images.fits(layout) and not images.has(meta.adapter_id):
            return 0, 0.0
        if images.has(meta.adapter_id) and images.valid(meta, layout):
            return 0, 0.0
        t0 = time.perf_counter()
        shared = self.tier.fetch(meta, layout) if self.tier is not None else None
        if shared is not None:  # the fleet's image, kept here as if converted
            written = images.store(meta, shared)
        else:
            # Straight into the image file: no copy of the whole image in anonymous memory.
            written = images.store_built(meta, layout, lambda buf: build_packed_into(meta, layout, buf))
        return written, round((time.perf_counter() - t0) * 1e3, 3)

    # ------------------------------------------------------------ reads and writes

    def cold_to_warm(
        self, meta: AdapterMeta, layout: AdapterLayout, use_cache: bool = True
    ) -> tuple[WarmImage, bool, str]:
        """(image, read from the cache?, why a cached image was rejected). Executor. Without
        ``use_cache`` (a copy in another dtype than the cached images') the files are converted."""
        rejected = ""
        # The fleet's images (``tier``) are the broker's own dtype, whole, never int8.
        shared = self.tier is not None and use_cache and not self.config.warm_int8
        if self.cache is not None and use_cache:
            image, rejected = self.cache.load(meta, layout, self.config.copy_threads)
            if image is not None:
                if shared:
                    self.tier.store(meta, image)  # (once: what came from the tier is not sent back)
                return image, True, ""
        if shared and (image := self.tier.fetch(meta, layout)) is not None:
            return image, False, rejected  # (not from this broker's cache: it stores the image)
        # A copy in another dtype is made for exact tokens: never int8.
        image = build_warm_image(meta, layout, self.config.warm_int8 and use_cache, self.config.copy_threads)
        if shared:
            self.tier.store(meta, image)
        return image, False, rejected

    def write(self, meta: AdapterMeta, image: WarmImage) -> None:
        """Store a freshly built image in the cache, in the executor, off the load's path."""
        aid = meta.adapter_id
        if aid in self._writes:
            return  # one write at a time per adapter; the next miss writes again
        loop = asyncio.get_running_loop()
        fut = self._executor.submit(self.cache.store, meta, image)
        self._writes[aid] = fut

        def done(f) -> None:
            if self._writes.get(aid) is f:
                del self._writes[aid]
            err = f.exception()
            if err is not None:
                self.counters.image_write_failures += 1
                self.log.warning("adapter_image_write_failed", adapter=aid, error=str(err))
            elif f.result():
                self.counters.image_writes += 1
            self.drop_orphan(aid)

        def report(f) -> None:
            try:
                loop.call_soon_threadsafe(done, f)
            except RuntimeError:
                pass  # the loop is gone: nothing left to count or log

        fut.add_done_callback(report)

    async def wait_writes(self) -> None:
        """Wait until the images being written are on disk."""
        while self._writes:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in list(self._writes.values())), return_exceptions=True)
            # The done callbacks run on the loop: let them clear the finished writes.
            await asyncio.sleep(0)

    def drop_orphan(self, adapter_id: str) -> bool:
        """After an image write: remove the image if the adapter was unregistered meanwhile (it
        must not outlive the adapter); True when it was. A closed registry (the broker is
        stopping) keeps the image for the next start."""
        try:
            gone = adapter_id not in self.registry
        except BrokerError:
            return False
        if gone:
            self.remove(adapter_id)
        return gone

    def remove(self, adapter_id: str) -> None:
        if self.cache is None:
            return
        try:
            self.cache.remove(adapter_id)
        except OSError as err:
            self.log.warning("adapter_image_remove_failed", adapter=adapter_id, error=str(err))
