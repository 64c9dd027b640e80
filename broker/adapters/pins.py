"""The pins acquiring sessions hold on adapters: acquire (one-phase or two-phase), release.

``AdapterPins`` admits an acquire (ids, cap, lease, session), counts where each adapter was
found, has the loader bring the missing ones up (holding each fresh hot object until the
session's own pin is in place), then pins them all or none; it remembers which session owns
each two-phase acquire, and releases pins (copies found corrupt first). It never loads,
frees or demotes anything itself.

An acquire may ask for another dtype than the broker's (an engine computing in float32 from a
bfloat16 broker): each adapter's copy in that dtype is an entry of its own (key ``id#dtype``),
converted from the adapter's files on its first acquire, as vLLM casts a file's weights, then
kept hot like any adapter (its pages count against the hot tier's budget) and shared by every
engine asking for that dtype. Likewise an acquire may ask for a tensor-parallel rank's shards
(``ModuleShard``: which modules split their output or input, part ``index`` of ``count``): each
adapter's copy holding only that rank's slice is an entry of its own (key ``id#dtype#shard``),
cut from the files. A release by id finds whichever copies the session pins.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Sequence
from operator import attrgetter

from memory_broker.broker.adapters import hotcore
from memory_broker.broker.adapters.checks import ChecksumChecker
from memory_broker.broker.adapters.context import AdapterContext
from memory_broker.broker.adapters.entry import AdapterEntry, copy_key
from memory_broker.broker.adapters.hot_budget import HotBudget
from memory_broker.broker.adapters.layout import DTYPE_SIZES, ModuleShard, shards_text
from memory_broker.broker.adapters.loader import TierLoader
from memory_broker.broker.adapters.peft import check_adapter_id
from memory_broker.broker.adapters.records import AcquiredAdapter, AcquireResult, Tier
from memory_broker.broker.adapters.warm_budget import WarmBudget
from memory_broker.broker.store.records import ObjectState
from memory_broker.proto.wire.errors import BrokerError, denied, invalid, not_found, precondition, unavailable

COMMITTED = ObjectState.COMMITTED

# An entry's hot object, its id, and an object's id (C-level, over a list of entries).
_OBJECT, _OBJECT_ID, _OID = attrgetter("obj"), attrgetter("obj.object_id"), attrgetter("object_id")


class AdapterPins:
    """Acquires and releases of adapters by client sessions.

    Args:
        ctx: the wing's shared record; its store pins (or prepares a pin transaction) for the
            acquiring session; its system session is never a client; its config has
            ``remember_txns``; acquires are counted in its counters.
        hot, warm, loader, checker: the wing's other parts.
    """

    def __init__(
        self, ctx: AdapterContext, hot: HotBudget, warm: WarmBudget, loader: TierLoader, checker: ChecksumChecker
    ):
        self.store = ctx.store
        self.system_session = ctx.system_session
        self.entries = ctx.entries
        self.hot = hot
        self.warm = warm
        self.loader = loader
        self.checker = checker
        self.registry = ctx.registry
        self.config = ctx.config
        self.counters = ctx.counters
        # Two-phase acquires: transaction id -> session.
        self._txns: OrderedDict[int, int] = OrderedDict()
        self._core = hotcore.load()
        # What the hot paths read per call, found once: the hot tier's own entries and the
        # store's object shards (neither is ever replaced), both tiers' policies.
        self._hot_own = hot.own
        self._obj_shards = self.store.objects.shards
        self._hot_policy, self._warm_policy = hot.policy, warm.policy

    def check_ids(self, adapter_ids: Sequence[str]) -> list[str]:
        if isinstance(adapter_ids, str):
            raise invalid("adapter_ids must be a list of adapter ids, not one string")
        ids = list(adapter_ids)
        max_batch = self.store.limits.max_batch
        if len(ids) > max_batch:
            raise invalid(f"adapter_ids has {len(ids)} items; at most {max_batch} per call")
        for i, aid in enumerate(ids):
            check_adapter_id(aid, f"adapter_ids[{i}]")
        return ids

    def check_session(self, session: int) -> None:
        if not self.store.has_session(session) or session == self.system_session:
            raise denied(f"session {session} is not open")
        tenancy = self.store.tenancy
        if tenancy is not None and not tenancy.adapters_for_tenants and self.store.sessions[session].pool > 0:
            raise precondition(
                f"session {session} is in {tenancy.name(self.store.sessions[session].pool)}, and adapters live in "
                "the shared pool, whose slabs also hold other sessions' objects: on a host arena a tenant's "
                "session is never sent them (security.tenants). Serve LoRA to tenants from a CUDA arena (adapter "
                "pages one by one, read-only) or from a broker without tenant pools"
            )

    async def acquire(
        self,
        session: int,
        adapter_ids: Sequence[str],
        max_adapters: int | None,
        with_layout: bool,
        lease_s: float | None,
        dtype: str = "",
        shards: Sequence[ModuleShard] = (),
    ) -> AcquireResult:
        """Load (if needed) and pin adapters for ``session``; with ``lease_s`` (not None) the
        pins are a store transaction under that lease (0: the store's default). With ``dtype``
        other than the broker's, each adapter's copy in that dtype is loaded and pinned (an
        entry of its own, converted from the adapter's files); with ``shards``, each adapter's
        copy holding those shards of its modules (modules it does not adapt are ignored)."""
        ids = self.check_ids(adapter_ids)
        shard = self._check_request(dtype, shards, max_adapters, lease_s)
        distinct = list(dict.fromkeys(ids))
        cap = max_adapters or len(distinct)
        admitted, deferred = distinct[:cap], distinct[cap:]
        self.check_session(session)
        keys = {aid: copy_key(aid, dtype, self.config.dtype, shard) for aid in admitted}
        by_key = self.entries.entries_for(list(keys.values()))
        entries = {aid: by_key[keys[aid]] for aid in admitted}
        found = {aid: self._classify(e) for aid, e in entries.items()}
        held: dict[str, AdapterEntry] = {}

        async def one(aid: str) -> None:
            e, _ = await self.loader.ensure_hot(keys[aid], hold=True)
            held[aid] = e

        txn = None
        try:
            if all(f == Tier.HOT for f in found.values()):
                # All hot: pin below without yielding to the loop, so nothing can evict them
                # in between and no holds are needed (the common, cheap case).
                held_now = entries
            else:
                results = await asyncio.gather(*(one(a) for a in admitted), return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors:
                    raise next((r for r in errors if not isinstance(r, BrokerError)), errors[0])
                held_now = held
                for aid in admitted:
                    if self.hot.current(held_now[aid]) is None:
                        # Found corrupt (and dropped) between its load and this pin.
                        raise unavailable(
                            f"adapter {aid!r} was found corrupt as it loaded and is being reloaded; acquire again"
                        )
            objs = [held_now[aid].obj for aid in admitted]
            oids = [o.object_id for o in objs]
            self.check_session(session)
            if lease_s is None:
                self.store.pin(session, oids)
            else:
                txn = self.store.prepare(session, [], pin_ids=oids, lease_s=lease_s)
                self._txns[txn.txn_id] = session
                if len(self._txns) > self.config.remember_txns:
                    self._txns.popitem(last=False)
        finally:
            for e in held.values():
                self.loader.unhold(e)
        c = self.counters
        c.acquires += 1
        c.acquired_adapters += len(admitted)
        c.deferred += len(deferred)
        self._used([held_now[aid].key for aid in admitted])
        out = []
        for aid, obj in zip(admitted, objs):
            e = held_now[aid]
            out.append(
                AcquiredAdapter(
                    aid, e.generation, obj.object_id, tuple(obj.pages), e.layout if with_layout else None, found[aid]
                )
            )
        return AcquireResult(tuple(out), tuple(deferred), txn.txn_id if txn else 0, txn.deadline_unix if txn else 0.0)

    def pin_hot(self, session: int, adapter_ids: Sequence[str], max_adapters: int = 0) -> list | None:
        """``acquire``'s common case, in one pass and without a coroutine: every admitted id
        names a hot adapter in the broker's own dtype, nothing is deferred. Pins them for
        ``session`` (one pin each), counts and records their use as ``acquire`` does, and
        returns their objects in order; the admitted entries are ``hot.own[id]``. None,
        having done nothing: not that case (or the store refused the pins): take ``acquire``,
        which says why or loads. Raises what ``check_session`` raises.

        With the native core (``_hotcore``) the pass that finds and checks the objects is C
        and the store's ledger pins them directly; otherwise ``store.pin`` by object id."""
        store = self.store
        if len(adapter_ids) > store.config.max_batch:
            return None
        core = self._core
        if core is None:
            distinct = list(dict.fromkeys(adapter_ids))
            if max_adapters and max_adapters < len(distinct):
                return None
            entries = list(map(self.hot.own.get, distinct))
            if None in entries:
                return None
            objs, live = list(map(_OBJECT, entries)), None  # None: the store's pin checks them
        else:
            plan = core.pin_plan(self._hot_own, adapter_ids, max_adapters, self._obj_shards, COMMITTED)
            if plan is None:
                return None
            distinct, objs, live = plan
        s = store.sessions.get(session)
        if s is None or session == self.system_session or (s.pool and store.tenancy is not None):
            self.check_session(session)  # raises, saying why (or passes: a tenant's session allowed)
        if s is not None and live is not None and not s.pool:
            # ``_pin``'s common case, inline: a native pass found them all pinnable, or not.
            if not live:
                return None
            ledger = store.ledger
            if store.config.max_pins_per_session:  # else ``check_limit`` has nothing to check
                try:
                    ledger.check_limit(s, len(objs))
                except BrokerError:
                    return None
            ledger.pin_all(s, objs)
        elif not self._pin(session, objs, live):
            return None
        c, n = self.counters, len(distinct)
        c.acquires += 1
        c.acquired_adapters += n
        c.hot_hits += n
        self._hot_policy.access_with(self._warm_policy, distinct)  # ``_used``
        return objs

    def _pin(self, session: int, objs: list, live: bool | None) -> bool:
        """One pin of each of ``objs`` for ``session``; False (nothing pinned) where the store
        refuses. ``live``: whether the native pass found them all pinnable (None: not asked)."""
        store = self.store
        s = store.sessions[session]
        try:
            if live is None or s.pool:  # a tenant's session: the store's own checks
                store.pin(session, list(map(_OID, objs)))
                return True
            if not live:
                return False  # what store.pin refuses (NOT_FOUND, or PREPARED)
            store.ledger.check_limit(s, len(objs))
        except BrokerError:
            return False
        store.ledger.pin_all(s, objs)
        return True

    def _used(self, keys: list[str]) -> None:
        """An acquire used these entries: both tiers' policies hear of it (in batch)."""
        self.hot.policy.access_with(self.warm.policy, keys)

    def release_hot(self, session: int, adapter_ids: Sequence[str]) -> bool:
        """``release``'s common case, in one pass: every listed id an adapter hot in the
        broker's own dtype, no copy in another dtype hot, none found corrupt, and ``session``
        holding the pins (the store checks). Unpins and returns True; False, having done
        nothing: take ``release``, which says why. With the native core the pass that finds
        the objects and checks the session's pins is C, and the store's ledger unpins them."""
        store, core = self.store, self._core
        if self.hot.other_copies or self.checker.retired or len(adapter_ids) > store.config.max_batch:
            return False
        s = store.sessions.get(session)
        if s is None or session == self.system_session or (s.pool and store.tenancy is not None):
            self.check_session(session)  # raises, saying why (or passes: a tenant's session allowed)
        if core is not None and not s.pool:
            plan = core.release_plan(self._hot_own, adapter_ids, session, self._obj_shards)
            if plan is None:
                return False
            objs, counts = plan
            if counts is None:
                store.ledger.unpin_once(s, objs)
            else:
                store.ledger.unpin_all(s, list(zip(objs, counts)))
            return True
        counts = Counter(adapter_ids)
        entries = list(map(self.hot.own.get, counts))
        if None in entries:
            return False
        oids = list(map(_OBJECT_ID, entries))
        if len(oids) != len(adapter_ids):  # ids listed more than once: one pin each time
            oids = [oid for oid, n in zip(oids, counts.values()) for _ in range(n)]
        try:
            store.unpin(session, oids)  # all or nothing: a pin the session lacks refuses
        except BrokerError:
            return False
        return True

    def _check_dtype(self, dtype: str) -> None:
        if dtype and dtype not in DTYPE_SIZES:
            raise invalid(
                f"dtype {dtype!r} is not one of {', '.join(DTYPE_SIZES)} (empty: the broker's own, {self.config.dtype})"
            )

    def _check_request(
        self, dtype: str, shards: Sequence[ModuleShard], max_adapters: int | None, lease_s: float | None
    ) -> str:
        """Refuse a bad acquire (INVALID_ARGUMENT); returns the shards' text (``shards_text``)."""
        shard = self.check_shape(dtype, shards)
        if max_adapters is not None and (not isinstance(max_adapters, int) or max_adapters < 0):
            raise invalid(f"max_adapters is {max_adapters!r}; give a count >= 1, or 0/None for no cap")
        max_lease_s = self.store.limits.max_lease_s
        if lease_s and not 0 < lease_s <= max_lease_s:
            raise invalid(f"lease of {lease_s:g} s is out of range; allowed 0 < lease <= {max_lease_s:g} s")
        return shard

    def check_shape(self, dtype: str, shards: Sequence[ModuleShard]) -> str:
        """Refuse a bad dtype or shards of a copy (INVALID_ARGUMENT); returns the shards' text."""
        self._check_dtype(dtype)
        try:
            return shards_text(shards)
        except ValueError as e:
            raise invalid(f"shards: {e}") from None

    def _classify(self, e: AdapterEntry) -> Tier:
        """Count one lookup of an admitted adapter; returns where it was found."""
        c = self.counters
        if self.hot.current(e) is not None:
            c.hot_hits += 1
            return Tier.HOT
        c.hot_misses += 1
        if e.warm is not None:
            c.warm_hits += 1
            return Tier.WARM
        c.warm_misses += 1
        return Tier.COLD

    def commit(self, session: int, txn_id: int) -> None:
        self._own(session, txn_id)
        self.store.commit(session, [txn_id])

    def abort(self, session: int, txn_id: int) -> None:
        self._own(session, txn_id)
        self.store.abort(session, [txn_id])

    def _own(self, session: int, txn_id: int) -> None:
        owner = self._txns.get(txn_id)
        if owner is None:
            raise not_found(f"no adapter acquire transaction {txn_id} (unknown, or finished too long ago to remember)")
        if owner != session:
            raise denied(f"adapter acquire transaction {txn_id} belongs to another session")

    def check_unregistrable(self, adapter_id: str) -> None:
        """Refuse (FAILED_PRECONDITION) while any session holds the adapter, is acquiring it,
        or still pins a copy of it that was found corrupt."""
        self.checker.prune_retired()
        if self.checker.retired.get(adapter_id):
            raise precondition(
                f"adapter {adapter_id!r}: sessions still pin a copy of it that was found corrupt; "
                "they must release it before it can be unregistered"
            )
        for e in self.copies(adapter_id):
            obj = self.hot.current(e)
            if e.waiters or e.holds or e.stale_holds:
                raise precondition(f"adapter {adapter_id!r} is being acquired right now; release it, then unregister")
            if obj is not None and obj.pin_count:
                raise precondition(
                    f"adapter {adapter_id!r} is acquired: {obj.pin_count} pin(s) by {len(obj.pins)} session(s); "
                    "they must release it before it can be unregistered"
                )

    def copies(self, adapter_id: str) -> list[AdapterEntry]:
        """The entries of the adapter's copies: in the broker's dtype, then in each other one."""
        return self.entries.copies(adapter_id, [d for d in DTYPE_SIZES if d != self.config.dtype])

    def release(self, session: int, adapter_ids: Sequence[str], dtype: str = "") -> None:
        """Drop one of the session's pins per listed id; nothing when any id is refused. With
        ``dtype``, on the copies in that dtype only; without, the broker's own copy first."""
        self.check_session(session)
        self._check_dtype(dtype)
        self.checker.prune_retired()
        oids: list[int] = []
        others = [d for d in DTYPE_SIZES if d != self.config.dtype]  # ``copies``'s, once
        entry_copies = self.entries.copies
        for aid, count in Counter(self.check_ids(adapter_ids)).items():
            # The hot copies it may release: in ``dtype``, or every one (the broker's own first).
            copies = entry_copies(aid, others)
            if dtype:  # that dtype's copies, whole or a rank's shards
                copies = [e for e in copies if (e.copy_dtype or self.config.dtype) == dtype]
            hot = [o for o in (self.hot.current(e) for e in copies) if o is not None]
            # Copies found corrupt that this session still pins: released first.
            objs = [*self.checker.retired_pinned_by(aid, session), *hot]
            if not objs:
                if aid not in self.registry:
                    raise not_found(f"no adapter {aid!r} is registered")
                raise precondition(f"session {session} holds no pin on adapter {aid!r} (it is not loaded)")
            held = sum(o.pins.get(session, 0) for o in objs)
            if held < count:
                if held == 0 and any(s != self.system_session for o in hot for s in o.pins):
                    raise denied(
                        f"adapter {aid!r} is acquired only by other sessions; session {session} holds no pin on it"
                    )
                raise precondition(f"adapter {aid!r}: asked to release {count}, session {session} holds {held} pin(s)")
            left = count
            for o in objs:
                k = min(left, o.pins.get(session, 0))
                oids.extend([o.object_id] * k)
                left -= k
        self.store.unpin(session, oids)
        self.checker.prune_retired()
