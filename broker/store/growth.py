"""Growing the arena off the event loop: the store sees new pages only once they are mapped.

The store is synchronous and runs on the broker's event loop, but on the CUDA
arena a grow creates, maps and first grants access to every new page, milliseconds per slab
(the costs per page: FIELD-NOTES "CUDA VMM on a real GPU"), which on the
loop would stall every session. ``Growth`` is the shared pool's grow callback.
Inside ``Growth.run`` a store call that needs more slabs stops with ``GrowthDeferred`` at the
point where it would have grown (before anything it does not undo, as RESOURCE_EXHAUSTED
would); ``run`` has the arena grow on a thread of its own (its pages created, mapped and
granted in the broker's view), then, back on the loop, adds the pages to the pool and calls
again. One grow runs at a time; callers that wait on it share it. A call made outside ``run``
(the broker's start, tests that drive the store directly) grows in place, as before.

It knows nothing of arenas or sessions: it is given the blocking grow and what to do once
slabs are added (log, tell the sessions).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")

# What a grow asked for inside ``Growth.run`` does: False (outside run): grow in place;
# True: defer (raise GrowthDeferred); a MemoryError: the deferred grow failed, raise it (the
# store then makes room inside the capacity it has, or refuses).
_MODE: ContextVar[bool | MemoryError] = ContextVar("growth_mode", default=False)
# Deferred grows one call waits for before it is told the arena cannot grow for it (others
# took the new pages each time).
MAX_GROWS_PER_CALL = 8


class GrowthDeferred(Exception):
    """A store call inside ``Growth.run`` needs ``slabs`` more slabs; nothing it did stays."""

    def __init__(self, slabs: int, generation: int) -> None:
        super().__init__(f"the arena must grow by {slabs} slabs first")
        self.slabs = slabs
        # ``Growth.generation`` when asked: a grow finished since means: call again first.
        self.generation = generation


class Growth:
    """The shared pool's grow callback, growing the arena on its own thread for ``run``'s calls.

    Args:
        grow_arena: blocking; creates and maps ``slabs`` more slabs (``Arena.grow``), or
            raises MemoryError.
        grown: called on the loop (or in place) after slabs were added to the pool, with how
            many and the seconds the grow took.
    """

    def __init__(self, grow_arena: Callable[[int], None], grown: Callable[[int, float], None]) -> None:
        self._grow_arena = grow_arena
        self._grown = grown
        # The pool whose capacity grows (set once it is built: it takes this as its callback).
        self.pool: Any = None
        # Grows finished, counted: a deferred call compares it to know it may try again.
        self.generation = 0
        self._executor: ThreadPoolExecutor | None = None
        # The grow in flight, shared by every call waiting for it.
        self._inflight: asyncio.Future | None = None

    def __call__(self, slabs: int) -> None:
        """The pool's grow callback: in place, deferred, or the deferred grow's failure."""
        mode = _MODE.get()
        if mode is True:
            raise GrowthDeferred(slabs, self.generation)
        if mode is not False:
            raise mode
        t0 = time.perf_counter()
        self._grow_arena(slabs)
        self.generation += 1
        self._grown(slabs, time.perf_counter() - t0)

    async def run(self, call: Callable[[], T]) -> T:
        """``call()`` (a store call on the loop), with any grow it needs made off the loop.

        Raises:
            whatever ``call`` raises; a grow that failed reaches it as the MemoryError its
            pool's grow raises (the store makes room inside its capacity, or refuses).
        """
        failure: bool | MemoryError = True
        for _ in range(MAX_GROWS_PER_CALL):
            token = _MODE.set(failure)
            try:
                return call()
            except GrowthDeferred as d:
                deferred = d
            finally:
                _MODE.reset(token)
            failure = await self.grow(deferred.slabs, deferred.generation) or True
        token = _MODE.set(MemoryError(f"the arena grew {MAX_GROWS_PER_CALL} times while this call waited"))
        try:
            return call()
        finally:
            _MODE.reset(token)

    async def grow(self, slabs: int, generation: int) -> MemoryError | None:
        """Grow by ``slabs`` on the grow thread unless a grow finished since ``generation``
        (or one is in flight: wait for it); the pool gains the pages once they are mapped.
        Returns the grow's MemoryError, or None. A cancelled caller does not cancel the grow."""
        while self._inflight is not None:
            failed = await asyncio.shield(self._inflight)
            if failed is not None and self.generation == generation:
                return failed  # the grow this call would make has just failed
        if self.generation != generation:
            return None
        self._inflight = asyncio.ensure_future(self._grow(slabs))
        return await asyncio.shield(self._inflight)

    async def _grow(self, slabs: int) -> MemoryError | None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="arena-grow")
        t0 = time.perf_counter()
        try:
            try:
                await asyncio.get_running_loop().run_in_executor(self._executor, self._grow_arena, slabs)
            except MemoryError as e:
                return e
            self.generation += 1
            self.pool.add_slabs(slabs)
            self._grown(slabs, time.perf_counter() - t0)
            return None
        finally:
            self._inflight = None

    def close(self) -> None:
        """Let the grow thread go (a grow in flight finishes first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


__all__ = ["Growth", "GrowthDeferred", "MAX_GROWS_PER_CALL"]
