"""One adapter's way through the tiers: its entry and the state machine that says what may happen to it.

An ``AdapterEntry`` exists while an adapter is warm, hot or on its way; its state is derived
from the facts it holds (the hot object, the warm image, the loads in flight, whether it was
unregistered), never stored beside them. Every change of those facts goes through an event
of ``TRANSITIONS`` (in the style of Dynamo GMS's ``fsm.py``): an event from a state the table
does not list raises ``InvalidTransition`` and changes nothing. This module does no I/O and
touches neither the store nor the tiers' budgets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from memory_broker.broker.adapters.layout import AdapterLayout
from memory_broker.broker.adapters.peft import AdapterMeta
from memory_broker.broker.adapters.warm_image import WarmImage
from memory_broker.broker.store.objects import Allocation

# Separates an adapter id from the dtype of one of its copies in an entry's key ("sql#float32"),
# and that from a tensor-parallel rank's shards ("sql#float32#o_proj:i1/2,q_proj:o1/2"). Adapter
# ids cannot contain it (peft.ADAPTER_ID_RE), so keys of copies never meet real ids.
COPY_SEP = "#"


def copy_key(adapter_id: str, dtype: str | None, stored: str, shard: str = "") -> str:
    """The entry key of ``adapter_id``'s copy in ``dtype``: the id itself for the stored dtype
    (or no dtype), ``id#dtype`` for a copy in another one; ``id#dtype#shard`` for a copy holding
    the shards ``shard`` (``layout.shards_text``; dtype "" there for the stored one)."""
    dtype = "" if not dtype or dtype == stored else dtype
    if shard:
        return f"{adapter_id}{COPY_SEP}{dtype}{COPY_SEP}{shard}"
    return f"{adapter_id}{COPY_SEP}{dtype}" if dtype else adapter_id


def split_key(key: str) -> tuple[str, str, str]:
    """(adapter id, dtype, shard) of an entry key; dtype is "" for the stored dtype and shard
    "" for the whole adapter."""
    aid, _, rest = key.partition(COPY_SEP)
    dtype, _, shard = rest.partition(COPY_SEP)
    return aid, dtype, shard


class EntryState(str, Enum):
    """Where an adapter is, as far as the manager is concerned (highest tier first)."""

    # Unregistered while a load was in flight: the load aborts; nothing new starts.
    REMOVED = "removed"
    # A committed hot object (a warm image may be kept beside it).
    HOT = "hot"
    # Being promoted to hot (it may be waiting for its warm image).
    LOADING = "loading"
    # Being read from its files (or image) into a warm image.
    WARMING = "warming"
    WARM = "warm"
    # Nothing resident and nothing in flight: the entry can be forgotten once no acquire holds it.
    COLD = "cold"


class EntryEvent(str, Enum):
    WARM_START = "warm_start"
    WARM_DONE = "warm_done"
    WARM_FAILED = "warm_failed"
    LOAD_START = "load_start"
    LOAD_DONE = "load_done"
    LOAD_FAILED = "load_failed"
    HOT_DROPPED = "hot_dropped"
    WARM_DROPPED = "warm_dropped"
    REMOVE = "remove"


class InvalidTransition(RuntimeError):
    """An event the table does not allow from the entry's state (a bug in the caller)."""


@dataclass(frozen=True, slots=True)
class Transition:
    # States the event may happen in.
    from_states: frozenset[EntryState]
    event: EntryEvent
    # States the entry may be in afterwards (derived from the facts the event changed).
    to_states: frozenset[EntryState]


def _s(*states: EntryState) -> frozenset[EntryState]:
    return frozenset(states)


S = EntryState
# What may happen to an adapter, and where it may end up. A warm image can be built while the
# adapter is hot (a prefetch to warm after the warm tier dropped it) or loading (the hot load
# waits for it); loads in flight end (failed) even after the adapter was unregistered.
TRANSITIONS: tuple[Transition, ...] = (
    Transition(_s(S.COLD, S.LOADING, S.HOT), EntryEvent.WARM_START, _s(S.WARMING, S.LOADING, S.HOT)),
    Transition(_s(S.WARMING, S.LOADING, S.HOT), EntryEvent.WARM_DONE, _s(S.WARM, S.LOADING, S.HOT)),
    Transition(
        _s(S.WARMING, S.LOADING, S.HOT, S.REMOVED), EntryEvent.WARM_FAILED, _s(S.COLD, S.LOADING, S.HOT, S.REMOVED)
    ),
    Transition(_s(S.COLD, S.WARMING, S.WARM), EntryEvent.LOAD_START, _s(S.LOADING)),
    Transition(_s(S.LOADING), EntryEvent.LOAD_DONE, _s(S.HOT)),
    Transition(_s(S.LOADING, S.REMOVED), EntryEvent.LOAD_FAILED, _s(S.COLD, S.WARMING, S.WARM, S.REMOVED)),
    Transition(_s(S.HOT), EntryEvent.HOT_DROPPED, _s(S.COLD, S.WARMING, S.WARM)),
    Transition(_s(S.WARM, S.LOADING, S.HOT), EntryEvent.WARM_DROPPED, _s(S.COLD, S.LOADING, S.HOT)),
    Transition(_s(S.COLD, S.WARMING, S.LOADING), EntryEvent.REMOVE, _s(S.REMOVED)),
)
_BY_EVENT = {t.event: t for t in TRANSITIONS}
assert len(_BY_EVENT) == len(TRANSITIONS), "one transition per event"


@dataclass(slots=True, eq=False)
class AdapterEntry:
    """An adapter that is warm, hot or on its way (cold adapters have none).

    Read the facts freely; change them only through the methods below (each one event).
    ``waiters``, ``holds`` and ``stale_holds`` are counts, not state: they only keep an entry
    that is cold from being forgotten while an acquire still needs it.
    """

    meta: AdapterMeta
    layout: AdapterLayout
    warm: WarmImage | None = None
    # The committed hot object, or None.
    obj: Allocation | None = None
    generation: int = 0
    # What the hot object's pages hash to as loaded (its warm image's checksum).
    hot_checksum: str = ""
    # In-flight loads: warm -> hot and cold -> warm.
    loading: asyncio.Future | None = None
    warming: asyncio.Future | None = None
    # Unregistered while a load was in flight: the load aborts.
    removed: bool = False
    # Acquires waiting on ``loading`` that want a hold once it commits.
    waiters: int = 0
    # System-session pins held for acquires between load and the caller's own pin.
    holds: int = 0
    # Holds taken on a hot copy that was then found corrupt and freed (its system pins went
    # with it): the next unholds give back nothing.
    stale_holds: int = 0
    # The dtype of an extra copy an engine asked for ("float32"), or "" for the adapter's
    # copy in the broker's own dtype. Each copy is an entry of its own (``key``).
    copy_dtype: str = ""
    # The shards of a tensor-parallel rank this copy holds (``layout.shard``), or "".
    copy_shard: str = ""

    @property
    def adapter_id(self) -> str:
        return self.meta.adapter_id

    @property
    def key(self) -> str:
        """What the tiers and the entry table know this copy by (``copy_key``)."""
        return copy_key(self.meta.adapter_id, self.copy_dtype, "", self.copy_shard)

    @property
    def derived(self) -> bool:
        """A copy made from the files for an engine (another dtype, or a rank's shards), not
        the broker's own: never cached as an image nor kept as int8."""
        return bool(self.copy_dtype or self.copy_shard)

    @property
    def state(self) -> EntryState:
        """Derived from the facts, highest tier first."""
        if self.removed:
            return EntryState.REMOVED
        if self.obj is not None:
            return EntryState.HOT
        if self.loading is not None:
            return EntryState.LOADING
        if self.warming is not None:
            return EntryState.WARMING
        if self.warm is not None:
            return EntryState.WARM
        return EntryState.COLD

    @property
    def idle(self) -> bool:
        """Cold and held by no acquire: nothing is lost by forgetting the entry."""
        return self.state is EntryState.COLD and not (self.waiters or self.holds or self.stale_holds)

    def _check(self, event: EntryEvent) -> EntryState:
        state = self.state
        if state not in _BY_EVENT[event].from_states:
            raise InvalidTransition(f"adapter {self.adapter_id!r}: {event.value} is not allowed when {state.value}")
        return state

    def _arrived(self, event: EntryEvent, before: EntryState) -> None:
        after = self.state
        if after not in _BY_EVENT[event].to_states:
            raise InvalidTransition(
                f"adapter {self.adapter_id!r}: {event.value} went from {before.value} to {after.value}, "
                f"which the table does not allow"
            )

    # ------------------------------------------------------------------- events

    def start_warming(self, start: Callable[[], asyncio.Future]) -> asyncio.Future:
        """Start the cold -> warm load ``start()`` makes (only once the event is allowed)."""
        before = self._check(EntryEvent.WARM_START)
        if self.warm is not None or self.warming is not None:
            raise InvalidTransition(f"adapter {self.adapter_id!r}: warm_start with a warm image or one on its way")
        self.warming = start()
        self._arrived(EntryEvent.WARM_START, before)
        return self.warming

    def warmed(self, image: WarmImage) -> None:
        before = self._check(EntryEvent.WARM_DONE)
        if self.warming is None:
            raise InvalidTransition(f"adapter {self.adapter_id!r}: warm_done with no warm load in flight")
        self.warm, self.warming = image, None
        self._arrived(EntryEvent.WARM_DONE, before)

    def warming_failed(self) -> None:
        before = self._check(EntryEvent.WARM_FAILED)
        if self.warming is None:
            raise InvalidTransition(f"adapter {self.adapter_id!r}: warm_failed with no warm load in flight")
        self.warming = None
        self._arrived(EntryEvent.WARM_FAILED, before)

    def start_loading(self, start: Callable[[], asyncio.Future]) -> asyncio.Future:
        """Start the warm -> hot load ``start()`` makes (only once the event is allowed)."""
        before = self._check(EntryEvent.LOAD_START)
        self.loading = start()
        self._arrived(EntryEvent.LOAD_START, before)
        return self.loading

    def loaded(self, obj: Allocation, checksum: str, generation: int) -> None:
        before = self._check(EntryEvent.LOAD_DONE)
        self.obj, self.hot_checksum, self.generation, self.loading = obj, checksum, generation, None
        self._arrived(EntryEvent.LOAD_DONE, before)

    def loading_failed(self) -> None:
        before = self._check(EntryEvent.LOAD_FAILED)
        self.loading = None
        self._arrived(EntryEvent.LOAD_FAILED, before)

    def drop_hot(self) -> Allocation:
        """Forget the hot object (freed or evicted); returns it."""
        before = self._check(EntryEvent.HOT_DROPPED)
        obj, self.obj = self.obj, None
        self._arrived(EntryEvent.HOT_DROPPED, before)
        return obj

    def drop_warm(self) -> WarmImage:
        """Forget the warm image; returns it."""
        before = self._check(EntryEvent.WARM_DROPPED)
        if self.warm is None:
            raise InvalidTransition(f"adapter {self.adapter_id!r}: warm_dropped with no warm image")
        image, self.warm = self.warm, None
        self._arrived(EntryEvent.WARM_DROPPED, before)
        return image

    def remove(self) -> None:
        """Unregistered: loads in flight abort when they next look."""
        before = self._check(EntryEvent.REMOVE)
        self.removed = True
        self._arrived(EntryEvent.REMOVE, before)


class EntryTable:
    """Every entry by key (the adapter id, or ``id#dtype`` for a copy in another dtype, or
    ``id#dtype#shard`` for a rank's shards); an entry is forgotten as soon as it is idle (cold,
    unheld).

    Args:
        make: builds the entry of a key of a registered adapter (raises BrokerError NOT_FOUND
            or INVALID_ARGUMENT for one that is not registered or cannot be placed).
    """

    def __init__(self, make: Callable[[str], AdapterEntry]):
        self._make = make
        self._entries: dict[str, AdapterEntry] = {}
        # adapter id -> keys of its sharded copies that have entries (``copies`` finds them).
        self._sharded: dict[str, set[str]] = {}

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, adapter_id: str) -> AdapterEntry | None:
        return self._entries.get(adapter_id)

    def values(self) -> list[AdapterEntry]:
        return list(self._entries.values())

    def entry(self, adapter_id: str) -> AdapterEntry:
        """The adapter's entry, made (cold) if it has none."""
        e = self._entries.get(adapter_id)
        if e is None:
            e = self._entries[adapter_id] = self._make(adapter_id)
            self._index(e)
        return e

    def _index(self, e: AdapterEntry) -> None:
        if e.copy_shard:
            self._sharded.setdefault(e.adapter_id, set()).add(e.key)

    def _unindex(self, key: str) -> None:
        aid, _, shard = split_key(key)
        keys = self._sharded.get(aid) if shard else None
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._sharded[aid]

    def entries_for(self, ids: Sequence[str]) -> dict[str, AdapterEntry]:
        """Entries for every id, or the first id's error before any is made."""
        new = {}
        for aid in ids:
            if aid not in self._entries and aid not in new:
                new[aid] = self._make(aid)
        self._entries.update(new)
        for e in new.values():
            self._index(e)
        return {aid: self._entries[aid] for aid in ids}

    def forget_if_idle(self, e: AdapterEntry) -> None:
        """Forget ``e`` when it is idle (nothing resident, nothing in flight, no holds)."""
        if e.idle and self._entries.get(e.key) is e:
            del self._entries[e.key]
            self._unindex(e.key)

    def copies(self, adapter_id: str, dtypes) -> list[AdapterEntry]:
        """The entries of ``adapter_id``'s copies: its own, then one per dtype in ``dtypes``,
        then its tensor-parallel ranks' sharded copies (any dtype)."""
        keys = [adapter_id, *(f"{adapter_id}{COPY_SEP}{d}" for d in dtypes)]
        keys += sorted(self._sharded.get(adapter_id, ()))
        return [e for e in (self._entries.get(k) for k in keys) if e is not None]

    def pop(self, adapter_id: str) -> AdapterEntry | None:
        self._unindex(adapter_id)
        return self._entries.pop(adapter_id, None)

    def clear(self) -> None:
        self._entries.clear()
        self._sharded.clear()
