"""The table of live objects: by id, by key, and why a recent id is gone; where an object's
pages and window range come from and go back to.

``ObjectTable`` places contiguous objects in the window, creates PREPARED objects on pages
the pool hands out, answers "may this session see object N", and drops objects (pages, window
range, key, owner's set, running figures). It never decides whether there is room (the
``RoomMaker`` does, before ``create``) and never changes pins.

Before the store changes anything, the ``check_*`` functions below validate one request's
batch: its length, duplicate ids, key sizes, and each ``Spec`` (pages, content type, key).
They are pure functions of the request and the limits: they raise ``BrokerError``
(INVALID_ARGUMENT or RESOURCE_EXHAUSTED) with the numbers that explain the refusal, and never
read or change the store's objects, sessions or pages. A ``ReplyRoom`` bounds the reply of a
client's pins and lookups (no id or key twice; records and bytes per frame or call): the
table's ``pinnable_all`` and ``find`` admit and take from the one they are given.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter

from memory_broker.broker.store.eviction import ContentType, EvictionPolicy
from memory_broker.broker.store.pool import PagePool, WindowSpace
from memory_broker.broker.store.records import (
    CONTENT_BY_NUMBER,
    VALID_CONTENT,
    Allocation,
    ObjectState,
    Recent,
    SessionState,
    store_core,
)
from memory_broker.broker.store.shards import MASK, ShardedMap
from memory_broker.broker.store.stats import Tally
from memory_broker.proto.wire.errors import exhausted, invalid, not_found, precondition
from memory_broker.proto.wire.spec import Spec
from memory_broker.proto.wire.step import MAX_REPLY_BYTES, MAX_REPLY_RECORDS, reply_estimate

_NUM_PAGES, _KEY = attrgetter("num_pages"), attrgetter("key")


class ObjectTable:
    """Objects of one arena by id and key.

    Args:
        pool: physical pages and the page table.
        window: placement of contiguous objects.
        policy: eviction candidates (a freed object leaves them).
        tally: running figures, kept as objects come and go.
        remember: how many gone object ids keep their reason, for messages.
        owner_state: the open or ending session record of an owner id, or None.
    """

    def __init__(
        self,
        pool: PagePool,
        window: WindowSpace,
        policy: EvictionPolicy,
        tally: Tally,
        remember: int,
        owner_state: Callable[[int], SessionState | None],
    ):
        self._pool = pool
        # Every pool's pages, by ``Allocation.pool`` (the store sets tenant pools'), and the
        # broker's own sessions, whose objects (adapters) every pool may see.
        self.pools: list[PagePool] = [pool]
        self.internal: set[int] = set()
        self._window = window
        self._policy = policy
        self._tally = tally
        self._owner_state = owner_state
        # Sharded: a million-entry dict rebuilds its table inside one call under churn.
        self.objects: ShardedMap = ShardedMap()
        # Committed, not freed objects by key.
        self.keys: ShardedMap = ShardedMap()
        # Why an object id is gone ("evicted" / "freed"), for messages; oldest forgotten first.
        self._gone: Recent = Recent(remember)
        self._ids = itertools.count(1)
        # The batch loops in C (``_storecore.c``), or None: the Python loops below.
        self.core = store_core()

    def place(self, specs: Sequence[Spec]) -> list[int]:
        """Window ranges for the contiguous specs, in order; all or none.

        Raises:
            BrokerError: RESOURCE_EXHAUSTED when a range does not fit (nothing stays placed).
        """
        window = self._window
        window_pages: list[int] = []
        for sp in specs:
            if sp.contiguous:
                w = window.place(sp.num_pages)
                if w < 0:
                    self.unplace(window_pages, specs)
                    raise exhausted(
                        f"no free range of {sp.num_pages} pages in the virtual window "
                        f"({window.free_pages} free in {window.free_extents} extents, largest "
                        f"{window.largest_free}); free contiguous objects or raise window_factor"
                    )
                window_pages.append(w)
        return window_pages

    def unplace(self, window_pages: list[int], specs: Sequence[Spec]) -> None:
        """Give back ranges ``place`` returned (for the first ``len(window_pages)`` contiguous specs)."""
        for w, sp in zip(window_pages, (x for x in specs if x.contiguous)):
            self._window.release(w, sp.num_pages)

    def create(self, s: SessionState, specs: Sequence[Spec], window_pages: list[int]) -> list[Allocation]:
        """PREPARED objects owned by ``s`` on pages taken now (the room was made first)."""
        next_id = self._ids.__next__
        ids = [next_id() for _ in specs]
        pool = s.pool
        page_lists = self.pools[pool].take(ids, [sp.num_pages for sp in specs])
        wit = iter(window_pages)
        out = []
        objects = self.objects
        account = self._tally.account
        sid = s.session_id
        for oid, sp, pages in zip(ids, specs, page_lists):
            obj = Allocation(
                oid,
                sid,
                CONTENT_BY_NUMBER[sp.content_type],
                sp.key,
                pages,
                next(wit) if sp.contiguous else -1,
                ObjectState.PREPARED,
                sp.num_pages,
                pool=pool,
            )
            objects[oid] = obj
            account(obj, 1)
            s.owned.add(oid)
            out.append(obj)
        return out

    def visible(self, session: int, oid: int) -> Allocation:
        """The object if ``session`` may see it (not freed; PREPARED only to its owner)."""
        obj = self.objects.get(oid)
        if obj is not None and len(self.pools) > 1 and self.foreign(session, obj):
            raise not_found(f"no object {oid}")
        if obj is None or obj.freed or (obj.state == ObjectState.PREPARED and obj.owner != session):
            if obj is not None and obj.freed:
                raise not_found(f"object {oid} was freed (its pages return when its last pin goes)")
            raise not_found(self.gone_message(oid) if obj is None else f"no object {oid}")
        return obj

    def check_visible(self, session: int, ids: Sequence[int]) -> None:
        """NOT_FOUND for an id this session may not name, as for an unknown id (so ids
        cannot be probed): another session's anonymous object that it does not pin, or any
        object of another pool. Keyed committed objects of its pool are anyone's there, and
        broker-owned ones (adapter pages) everyone's."""
        objects, pooled, internal = self.objects, len(self.pools) > 1, self.internal
        for oid in ids:
            obj = objects.get(oid)
            if obj is not None and pooled and self.foreign(session, obj):
                raise not_found(f"no object {oid}")  # another pool's object, keyed or not
            if obj is None or obj.key is not None or obj.owner == session or obj.owner in internal:
                continue
            if obj.pins.get(session):
                continue
            raise not_found(f"no object {oid}")

    def foreign(self, session: int, obj: Allocation) -> bool:
        """True when ``obj`` is in another pool than ``session``'s and not the broker's own:
        it does not exist for the session (tenant pools only)."""
        s = self._owner_state(session)
        return obj.pool != (s.pool if s is not None else 0) and obj.owner not in self.internal

    def pinnable(self, session: int, oid: int) -> Allocation:
        """The object if ``session`` may pin it now (visible and committed)."""
        obj = self.visible(session, oid)
        if obj.state == ObjectState.PREPARED:
            raise precondition(
                f"object {oid} is prepared in open transaction {obj.txn_id}; pin it at commit (ObjectSpec.pin)"
            )
        return obj

    def pinnable_all(self, session: int, object_ids: Sequence[int], reply: ReplyRoom | None = None) -> list[Allocation]:
        """``pinnable`` of each id, in order: with one pool, the usual case's checks in one C loop.
        ``reply``: a client's (``ReplyRoom``): the ids distinct, their records taken from it."""
        if reply is not None:
            reply.admit(object_ids, "object_ids")
        objs = None
        if self.core is not None and len(self.pools) == 1:
            objs = self.core.pinnable_all(self.objects.shards, object_ids, ObjectState.COMMITTED)
        if objs is None:
            pinnable = self.pinnable  # each id checked, saying what is wrong
            objs = [pinnable(session, oid) for oid in object_ids]
        if reply is not None:
            reply.take(objs, "pin", self.core)
        return objs

    def find(self, pool: int, keys: Sequence[bytes], most: int, reply: ReplyRoom | None = None) -> list[Allocation]:
        """The objects of the longest prefix of ``keys`` in ``pool``'s key index, each key
        checked first (1..``most`` bytes: INVALID_ARGUMENT naming the first that is not).
        ``reply``: a client's (``ReplyRoom``): the keys distinct, the records taken from it."""
        if reply is not None:
            reply.admit(keys, "keys")
        found = self._find(pool, keys, most)
        if reply is not None:
            reply.take(found, "lookup", self.core)
        return found

    def _find(self, pool: int, keys: Sequence[bytes], most: int) -> list[Allocation]:
        if self.core is not None:
            found = self.core.find_keys(self.keys.shards, keys, most, pool)
            if found is not None:  # else a key it leaves to the checks below
                return found
        try:
            bad = bool(keys) and (not min(map(len, keys)) or max(map(len, keys)) > most)
        except TypeError:  # a key without a length: check_key says what is wrong
            bad = True
        if bad:
            for i, k in enumerate(keys):
                check_key(k, f"keys[{i}]", most)  # raises, saying why
        found = []
        append, shards = found.append, self.keys.shards
        for k in [map_key(pool, k) for k in keys] if pool else keys:
            obj = shards[hash(k) & MASK].get(k)  # ShardedMap.get of a bytes key
            if obj is None:
                break
            append(obj)
        return found

    def held_once(self, session: int, object_ids: Sequence[int]) -> list[Allocation] | None:
        """The objects of ``object_ids`` when each is named once and holds a pin of
        ``session`` (the usual unpin), in one loop; None otherwise
        (the caller then checks id by id and says what is wrong)."""
        if self.core is not None:
            return self.core.held_once(self.objects.shards, object_ids, session)
        if len(set(object_ids)) != len(object_ids):
            return None
        shards = self.objects.shards
        objs = []
        append = objs.append
        try:
            for oid in object_ids:
                obj = shards[oid & MASK].get(oid)  # ShardedMap.get of an int id
                # (a PREPARED object holds no pins: this also leaves those to the caller)
                if obj is None or session not in obj.pins:
                    return None
                append(obj)
        except TypeError:  # an id that is not an int
            return None
        return objs

    def gone_message(self, oid: int) -> str:
        why = self._gone.get(oid)
        if why == "evicted":
            return f"object {oid} was evicted; allocate it again"
        if why:
            return f"object {oid} was {why}"
        return f"no object {oid}"

    def free_one(self, obj: Allocation) -> bool:
        """Free an object now, or when its last pin goes. True if freed now."""
        if obj.key is not None and self.keys.get(key := map_key(obj.pool, obj.key)) is obj:
            del self.keys[key]
        if obj.pin_count:
            obj.freed = True
            return False
        self._policy.remove(obj)
        self.drop(obj, "freed")
        return True

    def disown(self, s: SessionState, budget: int | None) -> None:
        """Release up to ``budget`` of an ended session's objects: anonymous ones are freed
        (or marked freed while pinned), keyed ones stay, ownerless."""
        owned, objects, work = s.owned, self.objects, 0
        while owned and (budget is None or work < budget):
            obj = objects.get(owned.pop())
            work += 1
            if obj is None:
                continue
            self._tally.set_owner(obj, 0)
            if obj.key is None:
                self.free_one(obj)

    def drop(self, obj: Allocation, why: str) -> None:
        """Forget an object and return its pages and window range."""
        oid = obj.object_id
        del self.objects[oid]
        self._tally.account(obj, -1)
        if obj.key is not None and self.keys.get(key := map_key(obj.pool, obj.key)) is obj:
            del self.keys[key]
        if obj.owner:
            s = self._owner_state(obj.owner)
            if s is not None:
                s.owned.discard(oid)
        if obj.window_page >= 0:
            self._window.release(obj.window_page, obj.num_pages)
        self.pools[obj.pool].give_back(obj.pages)
        self._gone[oid] = why


def map_key(pool: int, key: bytes) -> bytes | tuple[int, bytes]:
    """The table's key for ``key`` in ``pool``: the key itself in the shared pool, and
    ``(pool, key)`` in a tenant's, so one tenant's keys never meet another's."""
    return (pool, key) if pool else key


# ----------------------------------------------------------------- a request's batch


def check_batch(n: int, what: str, max_batch: int) -> None:
    if n > max_batch:
        raise invalid(f"{what} has {n} items; at most {max_batch} per call")


def check_unique(ids: Iterable[int], what: str) -> None:
    seen = set()
    for i in ids:
        if i in seen:
            raise invalid(f"{what} lists {i} twice")
        seen.add(i)


class ReplyRoom:
    """What is left of one reply: the object records a step frame, or one gRPC Pin or Lookup,
    may still answer, by count and by the broker's estimate of their bytes
    (``REPLY_RECORD_BYTES`` a record, its key, 5 bytes a page: above what either encoding
    takes), from ``MAX_REPLY_RECORDS`` and ``MAX_REPLY_BYTES`` (``proto/wire/step.py``).

    A client's pin or lookup is ``admit``ted before anything is found or pinned (an id or key
    named twice is refused: each copy would answer the object's whole record again) and
    ``take``s its records before any is encoded (past the room: RESOURCE_EXHAUSTED). The
    broker's own pins pass no room (an adapter's waiters may pin one object once each)."""

    __slots__ = ("records", "size")

    def __init__(self) -> None:
        self.records, self.size = MAX_REPLY_RECORDS, MAX_REPLY_BYTES

    def reset(self) -> None:
        """A new reply (the step channel keeps one room and resets it per frame)."""
        self.records, self.size = MAX_REPLY_RECORDS, MAX_REPLY_BYTES

    @staticmethod
    def admit(items: Sequence, what: str) -> None:
        """Refuse (INVALID_ARGUMENT, naming the first repeat) ``items`` that name one twice."""
        try:
            if len(set(items)) == len(items):
                return
        except TypeError:
            return  # an item without a hash: the request's own checks say what is wrong
        seen: set = set()
        for i, x in enumerate(items):
            if x in seen:
                raise invalid(f"{what}[{i}] repeats {x!r}: list each at most once per call")
            seen.add(x)

    def take(self, objs: Sequence[Allocation], what: str, core=None) -> None:
        """Take a reply of ``objs`` from the room, or refuse it (RESOURCE_EXHAUSTED) past it
        (``core``: the store's native core, which sums their pages and keys in one C loop)."""
        n = len(objs)
        if not n:
            return
        sums = core.reply_size(objs) if core is not None else None
        if sums is None:
            sums = sum(map(_NUM_PAGES, objs)), sum(map(len, filter(None, map(_KEY, objs))))
        pages = sums[0]
        size = reply_estimate(n, pages, sums[1])
        if n > self.records or size > self.size:
            raise exhausted(
                f"this {what} would answer {n} object records ({pages} pages, about {size} bytes); "
                f"{self.records} records and {self.size} bytes are left of this reply's {MAX_REPLY_RECORDS} "
                f"and {MAX_REPLY_BYTES}: ask for fewer objects per call"
            )
        self.records -= n
        self.size -= size


def check_key(key: bytes | None, where: str, max_key_bytes: int) -> None:
    if not key:
        raise invalid(f"{where} is empty; keys must be 1..{max_key_bytes} bytes")
    if len(key) > max_key_bytes:
        raise invalid(f"{where} is {len(key)} bytes; keys are at most {max_key_bytes}")


def check_specs(specs: Sequence[Spec], max_pages: int, max_key_bytes: int) -> tuple[int, bool]:
    """Validate a batch of specs; returns (total pages, whether any spec has a key)."""
    total = 0
    keys: set[bytes] = set()
    for i, sp in enumerate(specs):
        n = sp.num_pages
        if n.__class__ is not int or not 1 <= n <= max_pages:
            raise invalid(f"objects[{i}].num_pages is {n}; must be 1..{max_pages} (the arena's size)")
        if sp.content_type not in VALID_CONTENT:
            raise invalid(
                f"objects[{i}].content_type is {sp.content_type}; give one of "
                + ", ".join(f"{c.name}={c.value}" for c in ContentType)
            )
        if sp.key is not None:
            check_key(sp.key, f"objects[{i}].key", max_key_bytes)
            if sp.key in keys:
                raise invalid(f"objects[{i}].key appears twice in one batch")
            keys.add(sp.key)
        total += n
    if total > max_pages:
        raise exhausted(f"batch needs {total} pages; the arena holds at most {max_pages}")
    return total, bool(keys)
