"""Which adapter leaves a tier first: the victim order of the hot and warm tiers.

A policy only orders the adapters resident in one tier. The manager tells it when an adapter
enters the tier, is used, or leaves, and walks ``victims()`` skipping those it may not
demote (acquired, loading). It never demotes anything itself. ``adaptive`` (the default:
frequency with aging, whose memory length adapts to the traffic) is measured against Belady
by ``ops/bench/bench_policy.py``; ``lru`` is the baseline, ``lfu`` (frequency with full
history) and ``gdsf`` (GreedyDual-Size-Frequency) are the alternatives it compares.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol

from memory_broker.broker.adapters import hotcore


class TierPolicy(Protocol):
    name: str

    def insert(self, key: str, size: int) -> None:
        """``key`` entered the tier, occupying ``size`` units (pages or bytes)."""

    def access(self, key: str) -> None:
        """``key`` was used (an acquire or a prefetch named it)."""

    def access_counts(self, uses: Sequence[tuple[str, int]]) -> None:
        """Each key used ``count`` times, keys in the order of their last use, nothing else
        happening in between (``BatchedAccess``'s flush)."""

    def remove(self, key: str) -> None:
        """``key`` left the tier (demoted, evicted or unregistered)."""

    def victims(self) -> Iterator[str]:
        """Resident keys, first victim first; a snapshot, safe to remove while iterating."""

    def __contains__(self, key: str) -> bool: ...

    def __len__(self) -> int: ...

    def forget(self, key: str) -> None:
        """Drop everything known about ``key`` (the adapter was unregistered)."""


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

    def access_counts(self, uses: Sequence[tuple[str, int]]) -> None:
        # Only the last use of each key counts: exact.
        for key, _ in uses:
            self.access(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    forget = remove

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
            self._halve()

    def access_counts(self, uses: Sequence[tuple[str, int]]) -> None:
        # Counts and recency exact; a halving falls after the key whose uses cross its mark.
        count, last, every = self._count, self._last, self.halve_every
        for key, n in uses:
            count[key] = count.get(key, 0) + n
            last[key] = next(self._tick)
            before = self._uses
            self._uses += n
            if every and self._uses // every > before // every:
                self._halve()
                count = self._count

    def _halve(self) -> None:
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

    def access_counts(self, uses: Sequence[tuple[str, int]]) -> None:
        # The clock moves only on removal, never within a batch: exact.
        for key, n in uses:
            if key in self._size:
                self._freq[key] += n
                self._touch(key)

    def _touch(self, key: str) -> None:
        self._prio[key] = self._clock + self._freq[key] / self._size[key]
        self._last[key] = next(self._tick)

    def remove(self, key: str) -> None:
        if key in self._size:
            self._clock = max(self._clock, self._prio[key])
            for d in (self._size, self._freq, self._prio, self._last):
                d.pop(key, None)

    forget = remove

    def victims(self) -> Iterator[str]:
        p, last = self._prio, self._last
        return iter(sorted(self._size, key=lambda k: (p[k], last[k])))

    def __contains__(self, key: str) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)


class _AgedFrequency:
    """Use counts that halve every ``half_life`` ticks of a clock that advances on misses.

    A count is kept as ``log2(count) + clock / half_life`` at its last update: two adapters'
    order never changes while neither is used, so the order can live in a heap.
    """

    __slots__ = ("half_life", "clock", "key")

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self.clock = 0
        self.key: dict[str, float] = {}

    def bump(self, k: str) -> float:
        old = self.key.get(k)
        now = self.clock / self.half_life
        count = 2.0 ** (old - now) if old is not None else 0.0
        self.key[k] = new = math.log2(count + 1.0) + now
        return new


# A ghost's hit rate is a moving average over about 500 uses: what one use keeps of it.
_KEEP = 1.0 - 1.0 / 500.0


class _Ghost:
    """The keys a tier of the same size would hold if it evicted by one ``_AgedFrequency``.

    Holds names only (no memory of the adapters); its recent hit rate says how well that
    memory length suits the traffic now.
    """

    __slots__ = ("freq", "held", "heap", "hit_rate")

    def __init__(self, freq: _AgedFrequency) -> None:
        self.freq = freq
        self.held: set[str] = set()
        self.heap: list[tuple[float, str]] = []  # (key, name); stale entries are skipped
        self.hit_rate = 0.5

    def use(self, k: str, capacity: int, new_key: float, n: int = 1) -> None:
        """``k`` used ``n`` times in a row (its key now ``new_key``): the first use a hit or
        a miss, the others hits."""
        hit = k in self.held
        if not hit:
            while len(self.held) >= max(1, capacity) and self.heap:
                key, victim = heapq.heappop(self.heap)
                if victim in self.held and victim != k and self.freq.key.get(victim) == key:
                    self.held.discard(victim)
            self.held.add(k)
        heapq.heappush(self.heap, (new_key, k))
        if len(self.heap) > 4 * len(self.held) + 64:  # drop stale entries now and then
            self.heap = [(self.freq.key[n], n) for n in self.held]
            heapq.heapify(self.heap)
        rate = self.hit_rate + (float(hit) - self.hit_rate) / 500.0
        if n > 1:
            rate = 1.0 - (1.0 - rate) * _KEEP ** (n - 1)
        self.hit_rate = rate

    def forget(self, k: str) -> None:
        self.held.discard(k)


class AdaptivePolicy:
    """Least frequently used first, with counts that age, and the aging rate chosen by the
    traffic: the default of both tiers.

    Plain LFU keeps stale popularity forever (it fails when popularity shifts); plain LRU
    forgets frequency (it loses on skewed traffic). Here each use adds one to a count that
    halves every ``half_lives[i]`` misses of the tier (misses, not uses: steady traffic ages
    nothing, a shift in popularity ages fast). One ghost tier per half-life (names only, the
    same size as the real tier) tracks how each would have done lately, and victims come in
    the order of whichever is ahead. The least recent goes first among equal counts.

    Args:
        half_lives: the memory lengths to choose between, in misses (one short, one as good
            as unbounded by default).
    """

    name = "adaptive"

    def __init__(self, half_lives: tuple[float, ...] = (300.0, 1e6)) -> None:
        self._freqs = [_AgedFrequency(h) for h in half_lives]
        self._ghosts = [_Ghost(f) for f in self._freqs]
        self._resident: set[str] = set()
        self._last: dict[str, int] = {}
        self._tick = itertools.count()

    def insert(self, key: str, size: int) -> None:
        if key not in self._resident:
            self._resident.add(key)
            for f in self._freqs:
                f.clock += 1
        self._last[key] = next(self._tick)

    def access(self, key: str) -> None:
        self._last[key] = next(self._tick)
        capacity = len(self._resident)
        for f, g in zip(self._freqs, self._ghosts):
            # f.bump(key), inline (an acquire accesses every adapter on both tiers)
            fk = f.key
            old = fk.get(key)
            now = f.clock / f.half_life
            fk[key] = new = math.log2((2.0 ** (old - now) if old is not None else 0.0) + 1.0) + now
            g.use(key, capacity, new)

    def access_counts(self, uses: Sequence[tuple[str, int]]) -> None:
        # Counts and recency exact (the clock moves only on insert, never within a batch);
        # each ghost sees a key's uses in a row at its last use (see ``BatchedAccess``).
        capacity = len(self._resident)
        last, tick = self._last, self._tick
        for key, _ in uses:
            last[key] = next(tick)
        log2 = math.log2
        for f, g in zip(self._freqs, self._ghosts):
            fk = f.key
            now = f.clock / f.half_life
            for key, n in uses:
                old = fk.get(key)
                fk[key] = new = log2((2.0 ** (old - now) if old is not None else 0.0) + n) + now
                g.use(key, capacity, new, n)

    def remove(self, key: str) -> None:
        self._resident.discard(key)

    def forget(self, key: str) -> None:
        self._resident.discard(key)
        self._last.pop(key, None)
        for f, g in zip(self._freqs, self._ghosts):
            f.key.pop(key, None)
            g.forget(key)

    @property
    def half_life(self) -> float:
        """The memory length in force now (misses)."""
        return self._leader().half_life

    def _leader(self) -> _AgedFrequency:
        return max(zip(self._ghosts, self._freqs), key=lambda gf: gf[0].hit_rate)[1]

    def victims(self) -> Iterator[str]:
        key, last = self._leader().key, self._last
        return iter(sorted(self._resident, key=lambda k: (key.get(k, -math.inf), last.get(k, 0))))

    def __contains__(self, key: str) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)


def _count_run(run: tuple[str, ...], n: int, at: int, counts: Counter, order: dict[str, int]) -> None:
    """``n`` uses of ``run``, the last from position ``at``: into its keys' counts and positions."""
    for i, k in enumerate(run):
        counts[k] += n
        order[k] = at + i


def _record_run(run: tuple[str, ...], at: int, last: list, counts: Counter, order: dict[str, int]) -> int:
    """``_hotcore.record_run`` for one tier, in Python: one use of each key of ``run`` from
    position ``at``; returns the next position. ``last``: [the last run recorded or None, its
    uses since it was counted, the position of the last one]."""
    if last[0] == run:  # these keys in this order again: counted with the run
        last[1] += 1
        last[2] = at
        return at + len(run)
    if last[1]:
        _count_run(last[0], last[1], last[2], counts, order)
    _count_run(run, 1, at, counts, order)
    last[:] = [run, 0, at]
    return at + len(run)


class _Batch:
    """``BatchedAccess``'s record of the uses not yet handed over."""

    __slots__ = ("max_pending", "counts", "order", "seq", "last", "core")

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.counts: Counter[str] = Counter()
        self.order: dict[str, int] = {}  # key -> the position of its last use
        self.seq = 0  # the next use's position
        # The last run recorded (its keys are counted in ``counts`` and ``order``), its uses
        # since, and the position of the last of them.
        self.last: list = [None, 0, 0]
        # The native core records a run in one C pass (``_hotcore.record_run``); None: Python.
        self.core = hotcore.load()

    def fold(self) -> None:
        """The last run's uses since it was counted, into its keys' counts and positions."""
        run, n, at = self.last
        if n:
            _count_run(run, n, at, self.counts, self.order)
        self.last = [None, 0, 0]


class BatchedAccess:
    """A tier policy whose uses are counted in batch: what the manager holds for each tier.

    An acquire of n adapters records them in one C pass for both tiers (in Python, a count
    and a position per key), not n calls into the policy; an acquire of the same keys in the
    same order as the last one (a steady step) is one comparison: the run's uses are counted
    into its keys when another run comes, or at the batch's end. The policy hears of them
    (``access_counts``: each key once, with its count, in the order of its last use) before
    anything else reaches it (insert, remove, forget, victims, a read), or when
    ``max_pending`` distinct keys wait. The order of events between batches is kept exactly;
    within a batch, a key's uses reach the policy together at its last use: exact for LRU,
    GDSF and the counts and recency of LFU and adaptive; LFU's periodic halving and the
    adaptive policy's ghosts (which pick its memory length) see them in that order.

    Args:
        inner: the policy.
        max_pending: distinct keys recorded before they are handed over regardless.
    """

    def __init__(self, inner: TierPolicy, max_pending: int = 4096) -> None:
        self.inner = inner
        self.name = inner.name
        # The batch, read and written per acquire: a slotted record (this class's
        # ``__getattr__`` makes each of its own attribute reads several times slower).
        self._b = _Batch(max_pending)

    @property
    def max_pending(self) -> int:
        """Distinct keys recorded before they are handed over regardless."""
        return self._b.max_pending

    @max_pending.setter
    def max_pending(self, n: int) -> None:
        self._b.max_pending = n

    @property
    def _core(self):
        return self._b.core

    def access_many(self, keys: Sequence[str]) -> None:
        """Each of ``keys`` used once, in this order."""
        b = self._b
        run = keys if keys.__class__ is tuple else tuple(keys)
        record = _record_run if b.core is None else b.core.record_run
        b.seq = record(run, b.seq, b.last, b.counts, b.order)
        if len(b.order) > b.max_pending:
            self.flush()

    def access_with(self, other: BatchedAccess, keys: Sequence[str]) -> None:
        """``access_many(keys)`` here and in ``other`` (the other tier's policy), in one C pass
        with the native core: both record the same positions (each its own counts), which
        keeps each one's order of uses, the only thing its positions say."""
        a, b = self._b, other._b
        run = keys if keys.__class__ is tuple else tuple(keys)
        seq = a.seq if a.seq > b.seq else b.seq
        core = a.core
        if core is None or b.core is None:
            a.seq = b.seq = seq
            self.access_many(run)
            other.access_many(run)
            return
        a.seq = b.seq = core.record_run(run, seq, a.last, a.counts, a.order, b.last, b.counts, b.order)
        if len(a.order) > a.max_pending:
            self.flush()
        if len(b.order) > b.max_pending:
            other.flush()

    def access(self, key: str) -> None:
        self.access_many((key,))

    def flush(self) -> None:
        """Hand the recorded uses to the policy."""
        b = self._b
        if not b.order:
            return
        b.fold()
        counts, order = b.counts, b.order
        b.counts, b.order = Counter(), {}
        self.inner.access_counts([(k, counts[k]) for k in sorted(order, key=order.__getitem__)])

    @property
    def pending(self) -> int:
        """Distinct keys recorded and not yet handed over."""
        return len(self._b.order)

    def insert(self, key: str, size: int) -> None:
        self.flush()
        self.inner.insert(key, size)

    def remove(self, key: str) -> None:
        self.flush()
        self.inner.remove(key)

    def forget(self, key: str) -> None:
        self.flush()
        self.inner.forget(key)

    def victims(self) -> Iterator[str]:
        self.flush()
        return self.inner.victims()

    def __contains__(self, key: str) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str):
        # Anything else the policy has (``half_life``): read once the uses reached it.
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        self.flush()
        return getattr(self.inner, name)


POLICIES = {
    AdaptivePolicy.name: AdaptivePolicy,
    LRUPolicy.name: LRUPolicy,
    LFUPolicy.name: LFUPolicy,
    GDSFPolicy.name: GDSFPolicy,
}
DEFAULT_POLICY = AdaptivePolicy.name


def make_tier_policy(name: str) -> TierPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown adapter tier policy {name!r}; choose one of {', '.join(POLICIES)}") from None
