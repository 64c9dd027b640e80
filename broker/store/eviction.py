"""Which unpinned committed object goes first when the pool needs room.

The policy only orders candidates: the object store tells it when an object becomes
evictable (committed, no pins), stops being evictable, or is used, and asks it for victims.
It never frees anything itself. ``PriorityLRU`` is the baseline (ARCHITECTURE.md, "Invariants"):
content priority first (TEMP_BUFFER before KV_CACHE), then least recently used, with a
size-aware step that takes one object covering the remaining need instead of many small ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import IntEnum
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Protocol

from memory_broker.broker.store.shards import RecencyQueue


class ContentType(IntEnum):
    """Numbers match broker.v1.ContentType."""

    KV_CACHE = 1
    LORA_WEIGHT = 2
    TEMP_BUFFER = 3
    ACTIVATION = 4
    GRADIENT = 5


# Eviction order of content types: first listed, evicted first (the ADR's table, with
# GRADIENT, which it does not list, between activations and adapter weights).
EVICTION_ORDER = (
    ContentType.TEMP_BUFFER,
    ContentType.ACTIVATION,
    ContentType.GRADIENT,
    ContentType.LORA_WEIGHT,
    ContentType.KV_CACHE,
)
PRIORITY = {ct: rank for rank, ct in enumerate(EVICTION_ORDER)}


class Evictable(Protocol):
    object_id: int
    content_type: ContentType
    num_pages: int


class EvictionPolicy(Protocol):
    evictable_pages: int

    def add(self, obj: Evictable) -> None: ...
    def remove(self, obj: Evictable) -> None: ...
    # Optional: ``add``/``remove`` of many distinct objects at once (PinLedger uses them when present).
    # def add_all(self, objs: Sequence[Evictable]) -> None: ...
    # def remove_all(self, objs: Sequence[Evictable]) -> None: ...
    def touch(self, obj: Evictable) -> None: ...
    def select(self, need_pages: int, limit: int | None = None) -> list[Evictable]: ...
    def __len__(self) -> int: ...


_OID, _PAGES, _TYPE = attrgetter("object_id"), attrgetter("num_pages"), attrgetter("content_type")


class PriorityLRU:
    """Content priority, then recency, then size.

    Args:
        size_window: how many of the oldest candidates of the lowest non-empty class are
            looked at for one that covers the remaining need by itself.
    """

    name = "lru_size_aware"

    def __init__(self, size_window: int = 8):
        self.size_window = size_window
        # One LRU queue per priority rank; insertion order is recency (oldest first).
        # Recency queues per content class, in segments (no million-entry table rebuilt inside a call).
        self._queues: list[RecencyQueue] = [RecencyQueue() for _ in EVICTION_ORDER]
        self.evictable_pages = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)

    def add(self, obj: Evictable) -> None:
        self._queues[PRIORITY[obj.content_type]][obj.object_id] = obj
        self.evictable_pages += obj.num_pages

    def remove(self, obj: Evictable) -> None:
        if self._queues[PRIORITY[obj.content_type]].pop(obj.object_id, None) is not None:
            self.evictable_pages -= obj.num_pages

    def add_all(self, objs: Sequence[Evictable]) -> None:
        """``add`` for each of ``objs`` in order (distinct objects; a step unpins hundreds)."""
        q = self._queue_of(objs)
        if q is None:
            for obj in objs:
                self.add(obj)
            return
        q.add_many(list(map(_OID, objs)), objs)
        self.evictable_pages += sum(map(_PAGES, objs))

    def remove_all(self, objs: Sequence[Evictable]) -> None:
        """``remove`` for each of ``objs`` (distinct objects; a step pins hundreds)."""
        q = self._queue_of(objs)
        if q is None:
            for obj in objs:
                self.remove(obj)
            return
        gone = q.pop_many(list(map(_OID, objs)))
        self.evictable_pages -= sum(map(_PAGES, compress(objs, map(is_not, gone, repeat(None)))))

    def _queue_of(self, objs: Sequence[Evictable]) -> RecencyQueue | None:
        """The one queue all of ``objs`` belong in, or None if they span several."""
        types = set(map(_TYPE, objs))
        return self._queues[PRIORITY[types.pop()]] if len(types) == 1 else None

    def touch(self, obj: Evictable) -> None:
        q = self._queues[PRIORITY[obj.content_type]]
        if obj.object_id in q:
            q.move_to_end(obj.object_id)

    def __iter__(self) -> Iterator[Evictable]:
        """Candidates in plain priority-then-LRU order."""
        for q in self._queues:
            yield from q.values()

    def select(self, need_pages: int, limit: int | None = None) -> list[Evictable]:
        """Victims whose pages add up to at least ``need_pages`` (all candidates if fewer),
        at most ``limit`` of them when given (bounded work per call).

        Does not remove them: the caller evicts each and calls ``remove``.
        """
        chosen: list[Evictable] = []
        remaining = need_pages
        lookahead = max(1, self.size_window)
        for q in self._queues:
            it = iter(q.values())
            buf: list[Evictable] = []
            while remaining > 0 and (limit is None or len(chosen) < limit):
                while len(buf) < lookahead:
                    o = next(it, None)
                    if o is None:
                        break
                    buf.append(o)
                if not buf:
                    break
                # Size-aware step: among the next few oldest, the smallest object that
                # covers the rest by itself beats evicting several.
                cover = [o for o in buf[: self.size_window] if o.num_pages >= remaining]
                if cover:
                    victim = min(cover, key=lambda o: o.num_pages)
                    buf.remove(victim)
                else:
                    victim = buf.pop(0)
                chosen.append(victim)
                remaining -= victim.num_pages
            if remaining <= 0 or (limit is not None and len(chosen) >= limit):
                break
        return chosen


class PlainLRU(PriorityLRU):
    """Recency only: every content type in one queue (the baseline to compare against)."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__(size_window=0)

    def add(self, obj: Evictable) -> None:
        self._queues[0][obj.object_id] = obj
        self.evictable_pages += obj.num_pages

    def remove(self, obj: Evictable) -> None:
        if self._queues[0].pop(obj.object_id, None) is not None:
            self.evictable_pages -= obj.num_pages

    def _queue_of(self, objs: Sequence[Evictable]) -> RecencyQueue | None:
        return self._queues[0]

    def touch(self, obj: Evictable) -> None:
        q = self._queues[0]
        if obj.object_id in q:
            q.move_to_end(obj.object_id)


POLICIES = {PriorityLRU.name: PriorityLRU, PlainLRU.name: PlainLRU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
