"""Which unpinned committed object goes first when the pool needs room.

The policy only orders candidates: the object store tells it when an object becomes
evictable (committed, no pins), stops being evictable, or is used, and asks it for victims.
It never frees anything itself. ``PriorityLRU`` is the baseline (ARCHITECTURE.md, "Invariants"):
content priority first (TEMP_BUFFER before KV_CACHE), then least recently used, with a
size-aware step that takes one object covering the remaining need instead of many small ones.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from enum import IntEnum
from typing import Protocol

from memory_broker.proto.wire import native

# The store's native core: a step's per-key loops in C (``_storecore.c``; ``records.store_core``).
STORE_CORE = native.STORECORE


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
    # def touch_all(self, objs: Sequence[Evictable]) -> None: ...  (``touch`` of each, in order)
    def touch(self, obj: Evictable) -> None: ...
    def select(self, need_pages: int, limit: int | None = None) -> list[Evictable]: ...
    def __len__(self) -> int: ...


SEGMENT = 4096


# Segment numbers, unique across queues (an object names its segment by number).
_SEGMENT_NUMBERS = itertools.count(1)


class ObjectQueue:
    """Objects in the order they were added or moved to the end, oldest first.

    Like ``shards.RecencyQueue`` (segments of at most ``SEGMENT`` entries: no million-entry
    table rebuilt inside a call), but each object records the number of the segment it is in
    (its ``queue_seg`` attribute) instead of a sharded table doing so: finding an object's
    entry is an attribute read and one small lookup, so the batch forms (``PriorityLRU``'s
    ``add_all`` and ``remove_all``: a step pins and unpins hundreds) are one short loop. A
    number, not the segment itself, so that an object and its segment make no reference
    cycle (the daemon frees its state by reference counting: ``app.quiet_gc``). An object is
    in at most one queue at a time (its class's, of its pool's policy).

    Args:
        registry: segment number -> segment, shared by the queues of one policy."""

    __slots__ = ("_segs", "_nums", "_registry")

    def __init__(self, registry: dict[int, dict] | None = None) -> None:
        self._registry: dict[int, dict] = {} if registry is None else registry
        self._segs: deque[dict] = deque()
        self._nums: deque[int] = deque()
        self.new_segment()

    def new_segment(self) -> tuple[int, dict]:
        """Start a new newest segment: (its number, it)."""
        num, seg = next(_SEGMENT_NUMBERS), {}
        self._segs.append(seg)
        self._nums.append(num)
        self._registry[num] = seg
        return num, seg

    def last(self) -> tuple[int, dict]:
        """The newest segment: (its number, it)."""
        return self._nums[-1], self._segs[-1]

    def add(self, obj) -> None:
        """Add as the newest entry (one already in is moved to the end)."""
        self.remove(obj)
        num, last = self.last()
        if len(last) >= SEGMENT:
            num, last = self.new_segment()
        last[obj.object_id] = obj
        obj.queue_seg = num

    def _segment_of(self, obj) -> dict | None:
        num = getattr(obj, "queue_seg", None)
        seg = None if num is None else self._registry.get(num)
        return seg if seg is not None and seg.get(obj.object_id) is obj else None

    def remove(self, obj) -> bool:
        """Take ``obj`` out; False if it was not in."""
        seg = self._segment_of(obj)
        if seg is None:
            return False
        del seg[obj.object_id]
        num, obj.queue_seg = obj.queue_seg, None
        if not seg and seg is not self._segs[-1]:
            self.drop(num)
        return True

    def __contains__(self, obj) -> bool:
        return self._segment_of(obj) is not None

    def drop(self, num: int) -> None:
        """Forget an emptied segment (at most ``len/SEGMENT`` of them are looked at)."""
        del self._registry[num]
        segs, nums = self._segs, self._nums
        if nums[0] == num:
            segs.popleft()
            nums.popleft()
            return
        i = nums.index(num)
        del segs[i]
        del nums[i]

    def __len__(self) -> int:
        return sum(map(len, self._segs))

    def values(self) -> Iterator:
        for seg in self._segs:
            yield from seg.values()


class PriorityLRU:
    """Content priority, then recency, then size.

    Args:
        size_window: how many of the oldest candidates of the lowest non-empty class are
            looked at for one that covers the remaining need by itself.

    Candidates need a writable ``queue_seg`` attribute (``ObjectQueue``; the store's
    ``Allocation`` has the slot)."""

    name = "lru_size_aware"

    def __init__(self, size_window: int = 8):
        self.size_window = size_window
        # One LRU queue per priority rank; insertion order is recency (oldest first).
        # Recency queues per content class, in segments (no million-entry table rebuilt inside a call).
        self._segments: dict[int, dict] = {}  # every queue's segments, by number
        self._queues: list[ObjectQueue] = [ObjectQueue(self._segments) for _ in EVICTION_ORDER]
        # The queue of each content type, by its number.
        self._rank: list[int | None] = [PRIORITY.get(ct) for ct in range(max(ContentType) + 1)]
        self.evictable_pages = 0
        # The batch forms' loops in C, or None (the Python loops below).
        self._core = native.load(STORE_CORE)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)

    def add(self, obj: Evictable) -> None:
        self._queues[self._rank[obj.content_type]].add(obj)
        self.evictable_pages += obj.num_pages

    def remove(self, obj: Evictable) -> None:
        if self._queues[self._rank[obj.content_type]].remove(obj):
            self.evictable_pages -= obj.num_pages

    def add_all(self, objs: Sequence[Evictable]) -> None:
        """``add`` for each of ``objs`` in order (a step unpins hundreds): one loop."""
        if self._core is not None and objs.__class__ is list:
            self._add_all_native(objs)
            return
        queues, rank = self._queues, self._rank
        pages = room = num = 0
        ct = q = last = None
        for obj in objs:
            if obj.queue_seg is not None:  # in a queue already (the store adds an object once)
                self.add(obj)
                ct = None
                continue
            if obj.content_type is not ct:
                ct = obj.content_type
                q = queues[rank[ct]]
                num, last = q.last()
                room = SEGMENT - len(last)
            if room <= 0:
                num, last = q.new_segment()
                room = SEGMENT
            last[obj.object_id] = obj
            obj.queue_seg = num
            room -= 1
            pages += obj.num_pages
        self.evictable_pages += pages

    def _add_all_native(self, objs: list) -> None:
        """``add_all`` with each run of one content type placed by the native core's ``fill``."""
        fill, queues, rank = self._core.fill, self._queues, self._rank
        i, n, pages = 0, len(objs), 0
        while i < n:
            obj = objs[i]
            if obj.queue_seg is not None:  # in a queue already (the store adds an object once)
                self.add(obj)
                i += 1
                continue
            ct = obj.content_type
            q = queues[rank[ct]]
            num, last = q._nums[-1], q._segs[-1]  # ``q.last()``, inline
            if len(last) >= SEGMENT:
                num, last = q.new_segment()
            stop, got = fill(objs, i, ct, last, num, SEGMENT - len(last))
            if stop == i:  # a content type that is not the same object twice: one at a time
                self.add(obj)
                stop += 1
            i, pages = stop, pages + got
        self.evictable_pages += pages

    def remove_all(self, objs: Sequence[Evictable]) -> None:
        """``remove`` for each of ``objs`` (a step pins hundreds): one loop. An object's
        ``queue_seg`` is set and cleared by the queues alone, so it is trusted here."""
        if self._core is not None and objs.__class__ is list:
            pages, emptied = self._core.remove_all(objs, self._segments)
            self.evictable_pages -= pages
            for num, obj in emptied:  # segments left empty: forgotten, but for each queue's newest
                q = self._queues[self._rank[obj.content_type]]
                if self._segments[num] is not q._segs[-1]:
                    q.drop(num)
            return
        segments = self._segments
        pages = 0
        for obj in objs:
            num = obj.queue_seg
            if num is None:
                continue
            seg = segments[num]
            del seg[obj.object_id]
            obj.queue_seg = None
            pages += obj.num_pages
            if not seg:
                q = self._queues[self._rank[obj.content_type]]
                if seg is not q._segs[-1]:
                    q.drop(num)
        self.evictable_pages -= pages

    def touch(self, obj: Evictable) -> None:
        q = self._queues[self._rank[obj.content_type]]
        if obj in q:
            q.add(obj)

    def touch_all(self, objs: Sequence[Evictable]) -> None:
        """``touch`` for each of ``objs`` in order (a lookup without pins: hundreds): each run
        of one content type moved by the native core's ``touch_run`` where it is built."""
        core = self._core
        if core is None or objs.__class__ is not list:
            for obj in objs:
                self.touch(obj)
            return
        i, n = 0, len(objs)
        while i < n:
            ct = objs[i].content_type
            q = self._queues[self._rank[ct]]
            num, last = q.last()
            stop, emptied = core.touch_run(objs, i, ct, self._segments, last, num, SEGMENT - len(last))
            for e in emptied:
                q.drop(e)
            if stop == i:
                if len(last) >= SEGMENT:
                    q.new_segment()  # then the run goes on into it
                else:  # a content type that is not the same object twice: one at a time
                    self.touch(objs[i])
                    stop += 1
            i = stop

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
        self._rank = [0 for _ in self._rank]


POLICIES = {PriorityLRU.name: PriorityLRU, PlainLRU.name: PlainLRU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
