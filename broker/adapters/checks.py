"""Checksum checks of resident adapter copies: hot pages, warm images and image files.

``ChecksumChecker`` hashes one adapter at a time in its own thread (on demand, and one hot
adapter every ``verify_interval_s`` in the background; never on the acquire path). A copy
that does not match is reported (counter, ``adapter_corrupted`` log event, an
``AdapterCorrupted`` event to each session pinning it) and dropped, warm image included, so
the next acquire reloads the adapter from its source. It takes no pins and starts no loads.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from memory_broker.broker.adapters.context import AdapterContext
from memory_broker.broker.adapters.entry import AdapterEntry
from memory_broker.broker.adapters.hot_budget import HotBudget
from memory_broker.broker.adapters.image_service import ImageService
from memory_broker.broker.adapters.records import AdapterCheck, AdapterCorrupted, Tier
from memory_broker.broker.adapters.warm_budget import WarmBudget
from memory_broker.broker.adapters.warm_image import image_checksum, pages_checksum
from memory_broker.broker.store.objects import Allocation
from memory_broker.proto.wire.mapping import ArenaView


class ChecksumChecker:
    """Checks copies against their checksums and drops the corrupt ones.

    Args:
        ctx: the wing's shared record; its store frees a corrupt hot object, says which
            retired ones are still live and routes events; ``plan`` gives the layout for the
            image file of an adapter with no entry; checks are counted in its counters.
        view: the broker's arena view (hot pages are read through it).
        hot, warm, images: the wing's other parts.
    """

    def __init__(self, ctx: AdapterContext, view: ArenaView, hot: HotBudget, warm: WarmBudget, images: ImageService):
        self.store = ctx.store
        self.system_session = ctx.system_session
        self.view = view
        self.entries = ctx.entries
        self.hot = hot
        self.warm = warm
        self.images = images
        self.registry = ctx.registry
        self._plan = ctx.plan
        self.config = ctx.config
        self.counters = ctx.counters
        self.log = ctx.log
        # Hot objects found corrupt that sessions still pin (by adapter id): their pins are
        # released through ``release`` and their pages return with the last one.
        self.retired: dict[str, list[Allocation]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._turn = 0

    # ------------------------------------------------------------- background

    def start(self) -> None:
        if self.config.verify_interval_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def _loop(self) -> None:
        """Every ``verify_interval_s``, check one hot adapter (in turn) against its checksum."""
        while True:
            await asyncio.sleep(self.config.verify_interval_s)
            hot = sorted(self.hot.ids())
            if not hot:
                continue
            aid = hot[self._turn % len(hot)]
            self._turn += 1
            try:
                await self.check(aid)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001  (a check that fails must not end the checks)
                self.log.warning("adapter_verify_failed", adapter=aid, error=str(err))

    def _checker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="adapter-verify")
        return self._executor

    # ----------------------------------------------------------------- checks

    async def check_many(self, ids: list[str] | None) -> list[AdapterCheck]:
        """Check ``ids`` one at a time (NOT_FOUND for an unregistered one before any is
        checked); None: every hot or warm adapter."""
        if ids is None:
            ids = [e.key for e in self.entries.values() if e.obj is not None or e.warm is not None]
        else:
            for aid in ids:
                if aid not in self.entries:
                    self.registry.get(aid)
        return [await self.check(aid) for aid in ids]

    async def check(self, aid: str) -> AdapterCheck:
        """Check the adapter's highest copy: hot pages, else warm image, else image file."""
        loop = asyncio.get_running_loop()
        e = self.entries.get(aid)
        if e is not None:
            obj = self.hot.current(e)
            if obj is not None and e.hot_checksum:
                return await self._check_hot(e, obj)
            if e.warm is not None and e.warm.checksum:
                warm, want = e.warm, e.warm.checksum
                got = await loop.run_in_executor(self._checker(), image_checksum, warm)
                self.counters.verifications += 1
                if e.warm is not warm:
                    return AdapterCheck(
                        aid, Tier.WARM, False, True, want, "its warm image changed while it was checked"
                    )
                if got == want:
                    return AdapterCheck(aid, Tier.WARM, True, True, want, "warm image matches")
                self.counters.corruptions += 1
                self.log.warning("adapter_corrupted", adapter=aid, tier="warm", expected=want, found=got)
                self.warm.drop(e)
                return AdapterCheck(
                    aid,
                    Tier.WARM,
                    True,
                    False,
                    want,
                    f"warm image hashes to {got}: dropped; the next acquire reloads it from its source",
                )
        cache = self.images.cache
        if cache is not None and cache.has(aid):
            meta = self.registry.get(aid)
            layout = e.layout if e is not None else self._plan(meta)
            checked, ok, want, detail = await loop.run_in_executor(self._checker(), cache.check, meta, layout)
            if checked:
                self.counters.verifications += 1
            if not ok:
                self.counters.corruptions += 1
                self.log.warning("adapter_corrupted", adapter=aid, tier="cold", copy="image file", reason=detail)
            return AdapterCheck(aid, Tier.COLD, checked, ok, want, detail)
        return AdapterCheck(
            aid, Tier.COLD, False, True, "", "cold: nothing resident to check; its files are read on the next acquire"
        )

    async def _check_hot(self, e: AdapterEntry, obj: Allocation) -> AdapterCheck:
        aid, gen, want = e.key, e.generation, e.hot_checksum
        # No pin is taken (a check must never make an adapter look acquired): if the object
        # was freed or evicted while its pages were read, the result says nothing and is
        # dropped below; an object still the same afterwards owned its pages all along.
        got = await asyncio.get_running_loop().run_in_executor(
            self._checker(), pages_checksum, self.view, e.layout, list(obj.pages)
        )
        self.counters.verifications += 1
        if self.hot.current(e) is not obj or e.generation != gen:
            return AdapterCheck(aid, Tier.HOT, False, True, want, "placed anew while it was checked; check again")
        if got == want:
            return AdapterCheck(aid, Tier.HOT, True, True, want, f"hot copy (generation {gen}) matches")
        self._drop_corrupt_hot(e, obj, want, got)
        return AdapterCheck(
            aid,
            Tier.HOT,
            True,
            False,
            want,
            f"hot copy (object {obj.object_id}, generation {gen}) hashes to {got}: dropped; the next acquire "
            "reloads it from its source",
        )

    def _drop_corrupt_hot(self, e: AdapterEntry, obj: Allocation, want: str, got: str) -> None:
        """Report a corrupt hot copy and drop it with the warm image it came from, so no
        acquire returns it again: sessions that pin it keep their pins (released as usual),
        its pages return with the last one."""
        aid = e.adapter_id
        self.counters.corruptions += 1
        pinned_by = sorted(s for s in obj.pins if s != self.system_session)
        self.log.warning(
            "adapter_corrupted",
            adapter=aid,
            tier="hot",
            object_id=obj.object_id,
            generation=e.generation,
            expected=want,
            found=got,
            pinned_by_sessions=pinned_by,
        )
        detail = (
            f"adapter {aid!r} (object {obj.object_id}, generation {e.generation}) does not match its checksum; "
            "release it and acquire it again for a copy reloaded from its source"
        )
        for session in pinned_by:
            self.store.notify(session, AdapterCorrupted(aid, obj.object_id, e.generation, detail))
        self.store.free(self.system_session, [obj.object_id])
        if obj.pin_count:
            self.retired.setdefault(aid, []).append(obj)
        # The free dropped the system session's pins, the holds of acquires in flight too.
        e.stale_holds += e.holds
        e.holds = 0
        if e.warm is not None:
            self.warm.drop(e)
        self.hot.drop(e, evicted=False)

    # ---------------------------------------------------------- retired copies

    def prune_retired(self) -> None:
        """Forget retired copies whose last pin went (their objects are gone)."""
        for aid in [a for a, objs in self.retired.items() if not any(self.store.get(o.object_id) is o for o in objs)]:
            del self.retired[aid]
        for objs in self.retired.values():
            objs[:] = [o for o in objs if self.store.get(o.object_id) is o]

    def retired_pinned_by(self, aid: str, session: int) -> list[Allocation]:
        return [o for o in self.retired.get(aid, ()) if o.pins.get(session, 0)]

    @property
    def retired_copies(self) -> int:
        return sum(len(v) for v in self.retired.values())
