"""Which adapter leaves a tier first: the victim order of the hot and warm tiers.

A policy only orders the adapters resident in one tier. The manager tells it when an adapter
enters the tier, is used, or leaves, and walks ``victims()`` skipping those it may not
demote (acquired, loading). It never demotes anything itself. ``lru`` is the baseline;
``lfu`` (frequency with history, recency breaking ties) and ``gdsf`` (GreedyDual-Size-
Frequency: rarely used, large adapters go first) are the alternatives the benchmark compares.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol


class TierPolicy(Protocol):
    name: str

    def insert(self, key: str, size: int) -> None:
        """``key`` entered the tier, occupying ``size`` units (pages or bytes)."""

    def access(self, key: str) -> None:
        """``key`` was used (an acquire or a prefetch named it)."""

    def remove(self, key: str) -> None:
        """``key`` left the tier (demoted, evicted or unregistered)."""

    def victims(self) -> Iterator[str]:
        """Resident keys, first victim first; a snapshot, safe to remove while iterating."""

    def __contains__(self, key: str) -> bool: ...

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()

    def insert(self, key: str, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def access(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[str]:
        return iter(list(self._order))

    def __contains__(self, key: str) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class LFUPolicy:
    """Least frequently used first, counting uses since the broker started (the count
    survives a demotion, so a popular adapter that was pushed out comes back strong);
    the least recent goes first among equals.

    Args:
        halve_every: halve every count after this many uses, so that old popularity fades
            (0 = never).
    """

    name = "lfu"

    def __init__(self, halve_every: int = 0) -> None:
        self.halve_every = halve_every
        self._count: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._resident: set[str] = set()
        self._tick = itertools.count()
        self._uses = 0

    def insert(self, key: str, size: int) -> None:
        self._resident.add(key)
        self._last[key] = next(self._tick)
        self._count.setdefault(key, 0)

    def access(self, key: str) -> None:
        self._count[key] = self._count.get(key, 0) + 1
        self._last[key] = next(self._tick)
        self._uses += 1
        if self.halve_every and self._uses % self.halve_every == 0:
            self._count = {k: v >> 1 for k, v in self._count.items() if v > 1 or k in self._resident}

    def remove(self, key: str) -> None:
        self._resident.discard(key)

    def forget(self, key: str) -> None:
        """Drop the history of an adapter that no longer exists."""
        self._resident.discard(key)
        self._count.pop(key, None)
        self._last.pop(key, None)

    def victims(self) -> Iterator[str]:
        c, last = self._count, self._last
        return iter(sorted(self._resident, key=lambda k: (c.get(k, 0), last.get(k, 0))))

    def __contains__(self, key: str) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)


class GDSFPolicy:
    """GreedyDual-Size-Frequency: priority = clock + uses / size, lowest first; the clock
    rises to each victim's priority, so adapters not used for a while age out. Among adapters
    used equally often, the larger goes first (it frees more for one future load)."""

    name = "gdsf"

    def __init__(self) -> None:
        self._clock = 0.0
        self._size: dict[str, int] = {}
        self._freq: dict[str, int] = {}
        self._prio: dict[str, float] = {}
        self._last: dict[str, int] = {}
        self._tick = itertools.count()

    def insert(self, key: str, size: int) -> None:
        self._size[key] = max(1, size)
        self._freq[key] = max(1, self._freq.get(key, 0))
        self._touch(key)

    def access(self, key: str) -> None:
        if key in self._size:
            self._freq[key] += 1
            self._touch(key)

    def _touch(self, key: str) -> None:
        self._prio[key] = self._clock + self._freq[key] / self._size[key]
        self._last[key] = next(self._tick)

    def remove(self, key: str) -> None:
        if key in self._size:
            self._clock = max(self._clock, self._prio[key])
            for d in (self._size, self._freq, self._prio, self._last):
                d.pop(key, None)

    def victims(self) -> Iterator[str]:
        p, last = self._prio, self._last
        return iter(sorted(self._size, key=lambda k: (p[k], last[k])))

    def __contains__(self, key: str) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)


POLICIES = {LRUPolicy.name: LRUPolicy, LFUPolicy.name: LFUPolicy, GDSFPolicy.name: GDSFPolicy}


def make_tier_policy(name: str) -> TierPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown adapter tier policy {name!r}; choose one of {', '.join(POLICIES)}") from None
