"""Maps, sets and recency queues that stay cheap per call at a million entries.

CPython rebuilds a dict's whole table in one step once churn (delete one, insert one) has
used it up: on a 1M-entry dict that is a 200 ms stall every million inserts (measured:
ops/bench/results/2026-11-23-cpu-scale.md). The store's object map, key index, a session's
owned set and the eviction queues see exactly that churn, so they are built here from many
small tables: ``ShardedMap`` and ``ShardedSet`` spread entries over 256 dicts/sets (a rebuild
then touches ~1/256 of the entries), ``RecencyQueue`` keeps insertion order in segments of
at most 4,096 entries. They hold no knowledge of objects, pins or sessions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

BITS = 8
MASK = (1 << BITS) - 1
# ShardedSet: consecutive ints per shard.
RUN_BITS = 12
_MISSING = object()


class ShardedMap:
    """A dict for int or hashable keys, in 256 shards. Iteration order is by shard."""

    __slots__ = ("_shards", "_len")

    def __init__(self) -> None:
        self._shards: list[dict] = [{} for _ in range(MASK + 1)]
        self._len = 0

    @property
    def shards(self) -> list[dict]:
        """The shard dicts: an int key ``k`` is in ``shards[k & MASK]``, any other in
        ``shards[hash(k) & MASK]`` (for callers that read many keys in one loop)."""
        return self._shards

    def _shard(self, key) -> dict:
        return self._shards[(key if key.__class__ is int else hash(key)) & MASK]

    def __getitem__(self, key):
        return self._shards[(key if key.__class__ is int else hash(key)) & MASK][key]

    def get(self, key, default=None):
        return self._shards[(key if key.__class__ is int else hash(key)) & MASK].get(key, default)

    def __setitem__(self, key, value) -> None:
        d = self._shards[(key if key.__class__ is int else hash(key)) & MASK]
        n = len(d)
        d[key] = value
        self._len += len(d) - n

    def __delitem__(self, key) -> None:
        del self._shards[(key if key.__class__ is int else hash(key)) & MASK][key]
        self._len -= 1

    def pop(self, key, default=_MISSING):
        d = self._shards[(key if key.__class__ is int else hash(key)) & MASK]
        v = d.pop(key, _MISSING)
        if v is _MISSING:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self._len -= 1
        return v

    def __contains__(self, key) -> bool:
        return key in self._shards[(key if key.__class__ is int else hash(key)) & MASK]

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator:
        for d in self._shards:
            yield from d

    def keys(self) -> Iterator:
        return iter(self)

    def shard_values(self, i: int) -> Iterator:
        """The values of shard ``i % 256`` alone (a bounded look, for sampling)."""
        return iter(self._shards[i & MASK].values())

    def values(self) -> Iterator:
        for d in self._shards:
            yield from d.values()

    def items(self) -> Iterator[tuple[Any, Any]]:
        for d in self._shards:
            yield from d.items()


class ShardedSet:
    """A set of ints in up to 256 shards, each made on first use (cheap when small).

    A shard holds runs of 4,096 consecutive ints, so ``pop`` gives ids roughly in order:
    objects made together are released together, and the allocator returns their memory
    as it goes instead of all of it in the last few batches.
    """

    __slots__ = ("_shards", "_len", "_first")

    def __init__(self, items=()) -> None:
        self._shards: list[set | None] = [None] * (MASK + 1)
        self._len = 0
        # No shard below this index holds anything (pop starts here).
        self._first = MASK + 1
        for x in items:
            self.add(x)

    def add(self, x: int) -> None:
        i = (x >> RUN_BITS) & MASK
        s = self._shards[i]
        if s is None:
            s = self._shards[i] = set()
        if i < self._first:
            self._first = i
        n = len(s)
        s.add(x)
        self._len += len(s) - n

    def discard(self, x: int) -> None:
        i = (x >> RUN_BITS) & MASK
        s = self._shards[i]
        if s is not None and x in s:
            s.remove(x)
            self._len -= 1
            if not s:
                self._shards[i] = None  # its table goes now, not all at once later

    def pop(self) -> int:
        shards, i = self._shards, self._first
        while i <= MASK:
            s = shards[i]
            if s:
                self._first = i
                self._len -= 1
                x = s.pop()
                if not s:
                    shards[i] = None
                return x
            i += 1
        self._first = i
        raise KeyError("pop from an empty set")

    def __contains__(self, x: int) -> bool:
        s = self._shards[(x >> RUN_BITS) & MASK]
        return s is not None and x in s

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[int]:
        for s in self._shards:
            if s:
                yield from s

    def __eq__(self, other) -> bool:
        return set(self) == set(other)


SEGMENT = 4096


class RecencyQueue:
    """Entries in the order they were added or moved to the end, oldest first.

    An OrderedDict cut into segments of at most ``SEGMENT`` entries (plain dicts keep
    insertion order); ``_where`` finds an entry's segment. Removing or moving one entry
    touches one small dict; a segment is dropped when its last entry goes.
    """

    __slots__ = ("_segs", "_where")

    def __init__(self) -> None:
        self._segs: deque[dict] = deque([{}])
        self._where = ShardedMap()

    def __setitem__(self, key: int, value) -> None:
        """Add as the newest entry (an existing one is moved to the end)."""
        if key in self._where:
            self.pop(key)
        last = self._segs[-1]
        if len(last) >= SEGMENT:
            last = {}
            self._segs.append(last)
        last[key] = value
        self._where[key] = last

    def pop(self, key: int, default=None):
        seg = self._where.pop(key, None)
        if seg is None:
            return default
        v = seg.pop(key)
        if not seg and seg is not self._segs[-1]:
            self._drop(seg)
        return v

    def move_to_end(self, key: int) -> None:
        v = self.pop(key, _MISSING)
        if v is not _MISSING:
            self[key] = v

    def _drop(self, seg: dict) -> None:
        """Forget an emptied segment (at most ``len/SEGMENT`` of them are looked at)."""
        segs = self._segs
        if segs[0] is seg:
            segs.popleft()
            return
        for i, s in enumerate(segs):
            if s is seg:
                del segs[i]
                return

    def __contains__(self, key: int) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def values(self) -> Iterator:
        for seg in self._segs:
            yield from seg.values()
