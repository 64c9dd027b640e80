"""The hot tier's book-keeping: which adapters are hot, the pages they take, and the budget.

An adapter's copy in a dtype other than the broker's (made for an engine that asked for that
dtype) is a hot entry of its own, under its entry key (``id#dtype``): its pages count against
the same budget.

``HotBudget`` knows every hot entry (by adapter id and by object id), the pages hot and
being loaded, and the hot policy's victim order; ``make_room`` demotes idle hot adapters
until a load fits ``hot_tier_pages`` / ``hot_tier_adapters``, or refuses with the numbers.
It frees objects through the store's system session and nothing else: loads, warm images
and pins belong to the other parts of the wing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from memory_broker.broker.adapters.config import SETTING_NAMES
from memory_broker.broker.adapters.context import AdapterContext
from memory_broker.broker.adapters.entry import AdapterEntry
from memory_broker.broker.adapters.policy import BatchedAccess, make_tier_policy
from memory_broker.broker.store.objects import Allocation
from memory_broker.proto.wire.errors import exhausted


class HotBudget:
    """Hot adapters and their budget.

    Args:
        ctx: the wing's shared record. Its store frees demoted objects (``free`` as the
            system session, which owns every hot object) and says which are live; its config
            has the budgets and the hot tier's policy; demotions and evictions are counted in
            its counters; an entry whose hot object was just dropped goes to
            ``entries.forget_if_idle``.
    """

    def __init__(self, ctx: AdapterContext):
        self.store = ctx.store
        self.system_session = ctx.system_session
        self.config = ctx.config
        self.policy = BatchedAccess(make_tier_policy(ctx.config.hot_policy))
        self.counters = ctx.counters
        self.log = ctx.log
        self._on_drop = ctx.entries.forget_if_idle
        self._hot: dict[str, AdapterEntry] = {}
        # The hot entries of adapters' copies in the broker's own dtype, by adapter id (what a
        # step's acquire and release look up), and how many other hot copies exist (another dtype's,
        # or a tensor-parallel rank's shards).
        self.own: dict[str, AdapterEntry] = {}
        self.other_copies = 0
        self._by_object: dict[int, AdapterEntry] = {}
        self.pages = 0
        # Reserved by loads between prepare and commit (count against the budget).
        self.loading_pages = 0
        self.loading_count = 0

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._hot)

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._hot

    def entries(self) -> Iterator[AdapterEntry]:
        return iter(list(self._hot.values()))

    def ids(self) -> list[str]:
        return list(self._hot)

    def peek(self, e: AdapterEntry) -> Allocation | None:
        """The entry's hot object if the store still has it; changes nothing (for readers)."""
        obj = e.obj
        return obj if obj is not None and self.store.is_live(obj) else None

    def live(self) -> list[AdapterEntry]:
        """Hot entries whose objects the store still has (for readers)."""
        return [e for e in self._hot.values() if self.peek(e) is not None]

    # ------------------------------------------------------------------ writing

    def current(self, e: AdapterEntry) -> Allocation | None:
        """The entry's hot object if the store still has it; an eviction nobody reported is
        noticed (and the entry demoted) here."""
        obj = e.obj
        if obj is None:
            return None
        if not self.store.is_live(obj):
            self.drop(e, evicted=True)
            return None
        return obj

    def reconcile(self) -> None:
        for e in list(self._hot.values()):
            self.current(e)

    def reserve(self, n: int) -> None:
        """A load of ``n`` pages is between prepare and commit."""
        self.loading_pages += n
        self.loading_count += 1

    def unreserve(self, n: int) -> None:
        self.loading_pages -= n
        self.loading_count -= 1

    def publish(self, e: AdapterEntry, obj: Allocation, checksum: str, generation: int) -> None:
        """A load committed ``obj`` for ``e``: it is hot now."""
        e.loaded(obj, checksum, generation)
        aid = e.key
        if self._hot.get(aid) is not None:  # a stale entry of the same key: replaced
            self.other_copies -= e.derived
        self._hot[aid] = e
        if e.derived:  # another dtype's copy, or a rank's shards: never the adapter's own
            self.other_copies += 1
        else:
            self.own[aid] = e
        self._by_object[obj.object_id] = e
        self.pages += obj.num_pages
        self.policy.insert(aid, obj.num_pages)

    def drop(self, e: AdapterEntry, evicted: bool) -> None:
        """Forget ``e``'s hot object (already freed or evicted)."""
        if e.obj is None:
            return
        obj = e.drop_hot()
        aid = e.key
        gone = self._hot.pop(aid, None)
        if gone is not None:
            if gone.derived:
                self.other_copies -= 1
            else:
                del self.own[aid]
        self._by_object.pop(obj.object_id, None)
        self.pages -= obj.num_pages
        self.policy.remove(aid)
        if evicted:
            self.counters.evictions += 1
        self.log.info("adapter_demoted", adapter=aid, object_id=obj.object_id, evicted=evicted, warm=e.warm is not None)
        self._on_drop(e)

    def evicted(self, object_ids: Iterable[int]) -> None:
        """The store evicted these objects: their adapters are no longer hot."""
        for oid in object_ids:
            e = self._by_object.get(oid)
            if e is not None and e.obj is not None and e.obj.object_id == oid:
                self.drop(e, evicted=True)

    def free(self, e: AdapterEntry) -> None:
        """Free ``e``'s hot object in the store and forget it (not counted as a demotion)."""
        self.store.free(self.system_session, [e.obj.object_id])
        self.drop(e, evicted=False)

    def demote(self, e: AdapterEntry) -> None:
        """Free an idle hot adapter's pages to make room (counted as a demotion)."""
        self.free(e)
        self.counters.demotions += 1

    def make_room(self, e: AdapterEntry, n: int) -> None:
        """Demote idle hot adapters (policy order) until ``n`` more pages and one more adapter
        fit the budget; refuse, demoting nothing, when they cannot. Every copy of an adapter
        (one per dtype engines asked for) counts as one adapter."""
        aid = e.key
        max_pages = self.store.max_pages
        if n > max_pages:
            raise exhausted(f"adapter {aid!r} needs {n} pages; the arena holds at most {max_pages}")
        bp, ba = self.config.hot_tier_pages, self.config.hot_tier_adapters
        if not bp and not ba:
            return
        if bp and n > bp:
            raise exhausted(
                f"adapter {aid!r} needs {n} pages; the hot tier budget is {bp} pages ({SETTING_NAMES['hot_tier_pages']})"
            )
        self.reconcile()
        over_p = self.pages + self.loading_pages + n - bp if bp else 0
        over_a = len(self._hot) + self.loading_count + 1 - ba if ba else 0
        if over_p <= 0 and over_a <= 0:
            return
        victims: list[AdapterEntry] = []
        freed_p = freed_a = 0
        for vid in self.policy.victims():
            if freed_p >= over_p and freed_a >= over_a:
                break
            v = self._hot.get(vid)
            if v is None or v is e or v.obj.pin_count:
                continue
            victims.append(v)
            freed_p += v.obj.num_pages
            freed_a += 1
        if freed_p < over_p or freed_a < over_a:
            pinned = [v for v in self._hot.values() if v.obj.pin_count]
            pinned_pages = sum(v.obj.num_pages for v in pinned)
            idle_pages = self.pages - pinned_pages
            budget = " and ".join(x for x in (f"{bp} pages" if bp else "", f"{ba} adapters" if ba else "") if x)
            raise exhausted(
                f"adapter {aid!r} needs {n} pages but the adapter hot tier is full: budget {budget}; "
                f"{self.pages} pages in {len(self._hot)} hot adapters, {pinned_pages} pages pinned by acquires "
                f"in {len(pinned)}, {idle_pages} evictable, {self.loading_pages} pages loading; "
                f"release adapters or raise {SETTING_NAMES['hot_tier_pages']} or {SETTING_NAMES['hot_tier_adapters']}"
            )
        for v in victims:
            self.demote(v)
