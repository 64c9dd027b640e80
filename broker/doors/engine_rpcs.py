"""The gRPC door's engine-pool calls: EngineKvRegister, EngineKvGrow, EngineKvShrink.

Translation only, as the rest of the servicer (``service.py`` wraps these with ``_unary``,
under ``POLICY``): the decisions are ``broker/store/engine_pool.py``'s. What belongs to the
door is the waiting: a grow the store cannot grant at once asks other engines back and waits,
on the loop, without blocking it, for their give-backs until its deadline; the granted pages
are zeroed off the loop before the engine hears of them.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Sequence

from memory_broker.broker.store.engine_pool import Engine, EnginePool
from memory_broker.proto.wire.errors import BrokerError, Code, invalid, precondition
from memory_broker.proto.wire.v1 import broker_pb2 as pb

# A grow waits at most this long for give-backs, whatever it asks.
MAX_WAIT_S = 10.0
# A waiting grow looks again at least this often (an ended engine's groups are released in
# batches between other callbacks, with no event at the end).
POLL_S = 0.02


class Changes:
    """Wakes every waiter when engines' pages return (``EnginePool.on_change``)."""

    def __init__(self) -> None:
        self._fut: asyncio.Future | None = None

    def fire(self) -> None:
        fut, self._fut = self._fut, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait(self, timeout: float) -> None:
        if self._fut is None:
            self._fut = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._fut), timeout)
        except TimeoutError:
            pass


def zero_pages(backend: str, view, pages: Sequence[int], page_size: int) -> None:
    """Write zeros over ``pages`` in the broker's view (an executor thread: 2 MiB each)."""
    if backend == "host":
        for p in pages:
            ctypes.memset(view.page_address(p), 0, page_size)
        return
    for p in pages:  # CUDA: UNRUN on a GPU
        view.tensor(view.page_address(p), page_size).zero_()
    if pages:
        # The zeroing is queued on this thread's stream: it must have run before the engine
        # hears of the pages (another process: nothing orders its writes after this one's).
        with view.current():
            view._sync_streams({view._current_stream()}, "granting zeroed engine KV pages")


def engine_stats_message(e: Engine) -> pb.EngineKvStats:
    return pb.EngineKvStats(
        session_id=e.session,
        name=e.name,
        group_pages=e.group_pages,
        floor_pages=e.floor,
        ceiling_pages=e.ceiling,
        weight=e.weight,
        held_pages=e.held_pages,
        grows=e.grows,
        grown_pages=e.grown_pages,
        give_backs=e.give_backs,
        given_pages=e.given_pages,
        refusals=e.refusals,
        asked=e.asked,
        asked_pages=e.asked_pages,
        grow_seconds=e.grow_seconds,
        grow_seconds_max=e.grow_seconds_max,
    )


def _pool(service) -> EnginePool:
    pool = getattr(service, "engine_pool", None)
    if pool is None:
        raise precondition("this broker serves no engine pool")
    return pool


def EngineKvRegister(self, request, context, session):  # noqa: N802 - the RPC's name
    pool = _pool(self)
    eng = pool.register(
        session.session_id,
        request.name,
        request.group_pages,
        request.floor_pages,
        request.ceiling_pages,
        request.weight,
    )
    return engine_stats_message(next(e for e in pool.stats() if e.session == eng.session))


async def EngineKvGrow(self, request, context, session):  # noqa: N802 - the RPC's name
    pool = _pool(self)
    sid, groups, least = session.session_id, request.groups, request.min_groups
    t0 = time.perf_counter()
    if least > groups:
        raise invalid(f"min_groups must be 0..groups ({groups}), got {least}")
    if least:
        if groups > pool.store.config.max_batch:
            raise invalid(f"groups must be 1..{pool.store.config.max_batch}, got {groups}")
        pool.check_groups(sid, least)  # the ceiling holds the least
        groups = max(least, pool.fitting(sid, groups))  # what fits now; else the least, waited for
    else:
        pool.check_groups(sid, groups)
    wait_s = min(request.wait_ms / 1000.0, MAX_WAIT_S) if request.wait_ms else self.engine_reclaim_wait_s
    objs = await _take(self, pool, sid, groups, t0 + wait_s)
    if objs is None:
        raise pool.refused(sid, groups, time.perf_counter() - t0)
    arena = self.arena
    pages = [p for o in objs for p in o.pages]
    await asyncio.get_running_loop().run_in_executor(
        None, zero_pages, arena.backend, arena.view, pages, arena.geometry.page_size
    )
    elapsed = time.perf_counter() - t0
    pool.granted(sid, objs, elapsed)
    if self.metrics is not None:
        self.metrics.engine_grow_latency.record(elapsed)
    return pb.EngineKvGrowResponse(groups=[self._info(o, sid) for o in objs])


async def _take(self, pool: EnginePool, sid: int, groups: int, deadline: float):
    """The groups, taken as soon as the store can give them, asking other engines back once;
    None at the deadline (or at once when no engine can give any back)."""
    changes: Changes = self.engine_changes
    asked = False
    while True:
        pool.check_groups(sid, groups)  # the ceiling, and the engine still there
        short = pool.shortfall(sid, groups)
        if not short:
            try:
                return await self._timed_alloc(pool.grow, sid, groups)
            except BrokerError as e:
                if e.code != Code.RESOURCE_EXHAUSTED:
                    raise
                short = groups  # the arena could not grow: ask back as if nothing were free
        left = deadline - time.perf_counter()
        if left <= 0:
            return None
        if not asked:
            asked = True
            if not pool.ask_back(sid, short, left):
                return None
        await changes.wait(min(left, POLL_S))


def EngineKvShrink(self, request, context, session):  # noqa: N802 - the RPC's name
    freed = _pool(self).give_back(session.session_id, list(request.object_ids))
    return pb.EngineKvShrinkResponse(freed_pages=freed)
