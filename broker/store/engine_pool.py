"""Engines' own KV cache on broker pages: one budget shared by engines and everything else the
pool holds (DESIGN.md §11, docs/engine-pool.md).

``EnginePool`` owns the engines' records: each engine's session, name, group size (pages per
group of blocks: one page per layer), floor, ceiling and weight, and the groups it holds. A
group is an anonymous ``KV_CACHE`` object of ``group_pages`` pages, owned and pinned by the
engine's session: the store never evicts it, and the session's end (a dead process included)
frees it as it frees any anonymous object. A grow asks the store for groups (which evicts
unpinned content first: shared prefix KV, cold adapters; never a pinned one); what the store
cannot give is asked back from engines above their floor (``EngineKvReclaim``, an event with a
deadline, largest weighted excess first), and refused past that. Pages are zeroed before the
engine sees them (``zero``, run by the door off the loop). Nothing here touches gRPC or memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from memory_broker.broker.store.eviction import ContentType
from memory_broker.broker.store.objects import Allocation, ObjectStore, Spec
from memory_broker.proto.wire.errors import BrokerError, Code, exhausted, invalid, not_found, precondition

# Longest engine name (shown in status lines and metric labels).
MAX_NAME = 64


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What configuration allows an engine (``engine_pool.engines``), in pages."""

    # Pages the engine keeps however others grow (never asked back below it).
    floor: int = 0
    # Most pages it may hold (0: the whole pool).
    ceiling: int = 0
    # Its share when pages are asked back: engines with the most pages above their floor per
    # unit of weight are asked first.
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class EngineKvReclaim:
    """An event for an engine: give back up to ``pages`` (whole free groups) before
    ``deadline_unix`` (wall-clock seconds); another engine waits for them."""

    pages: int
    deadline_unix: float


@dataclass(slots=True, eq=False)
class Engine:
    # The engine's session (its groups' owner).
    session: int
    name: str
    # Pages per group (one per layer).
    group_pages: int
    floor: int
    ceiling: int
    weight: float
    # The session's pool (0: shared; 1..: a tenant's).
    pool: int
    # Its groups by object id.
    groups: dict[int, Allocation] = field(default_factory=dict)
    held_pages: int = 0
    # Figures: grow calls granted, pages granted, give-back calls and pages, grows refused,
    # reclaim events sent to it and the pages they asked for, time spent in granted grows.
    grows: int = 0
    grown_pages: int = 0
    give_backs: int = 0
    given_pages: int = 0
    refusals: int = 0
    asked: int = 0
    asked_pages: int = 0
    grow_seconds: float = 0.0
    grow_seconds_max: float = 0.0


class EnginePool:
    """The engines' KV groups in one store.

    Args:
        store: the object store whose pages the groups take.
        limits: configured limits by engine name or tenant pool name (pages).
        clock: wall-clock seconds, for the deadlines events carry.
    """

    def __init__(
        self,
        store: ObjectStore,
        limits: dict[str, EngineLimits] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.store = store
        self.limits = dict(limits or {})
        self._clock = clock
        self.engines: dict[int, Engine] = {}
        # Called whenever engines' pages return (a give-back, an engine's end): a grow waiting
        # for pages retries (the door sets it).
        self.on_change: Callable[[], None] | None = None

    # ------------------------------------------------------------ engines

    def register(
        self, session: int, name: str, group_pages: int, floor: int = 0, ceiling: int = 0, weight: float = 0.0
    ) -> Engine:
        """Make the session an engine, or change its floor, ceiling and weight (the group size
        stays). The request is bounded by the configuration for ``name`` (or the session's
        tenant pool): a floor or ceiling above the configured one is cut to it, and 0 (floor,
        ceiling or weight) takes the configured one. Refused if the floors of the pool's engines would not fit."""
        s = self.store.sessions.get(session)
        if s is None or s.pool < 0:
            raise precondition(f"session {session} is not open or not yet placed in a pool; prove it first")
        max_pages = self.store.pools[s.pool].max_pages
        if not name or len(name) > MAX_NAME or not name.isprintable():
            raise invalid(f"engine name must be 1-{MAX_NAME} printable characters, got {name!r}")
        if group_pages < 1 or group_pages > max_pages:
            raise invalid(f"group_pages must be 1..{max_pages} (the pool's pages), got {group_pages}")
        if floor < 0 or ceiling < 0 or weight < 0 or weight != weight:
            raise invalid(f"floor, ceiling and weight must be >= 0; got {floor}, {ceiling}, {weight}")
        conf = self._configured(name, s.pool)
        ceil = min(x for x in (ceiling, conf.ceiling, max_pages) if x > 0)
        flo = min(floor or conf.floor, conf.floor) if conf.floor else floor
        if flo > ceil:
            raise invalid(f"engine {name!r}: floor {flo} pages is above its ceiling {ceil}")
        old = self.engines.get(session)
        if old is not None and old.group_pages != group_pages:
            raise precondition(
                f"engine {old.name!r} registered with {old.group_pages} pages a group; a session keeps its group size"
            )
        others = sum(e.floor for e in self.engines.values() if e.pool == s.pool and e.session != session)
        if others + flo > max_pages:
            raise exhausted(
                f"engine {name!r}: floor {flo} pages does not fit: the pool's other engines keep {others} of "
                f"{max_pages} pages as their floors"
            )
        w = weight or conf.weight
        if old is not None:
            old.name, old.floor, old.ceiling, old.weight = name, flo, ceil, w
            return old
        eng = Engine(session, name, group_pages, flo, ceil, w, s.pool)
        self.engines[session] = eng
        return eng

    def _configured(self, name: str, pool: int) -> EngineLimits:
        conf = self.limits.get(name)
        if conf is None and self.store.tenancy is not None and pool > 0:
            conf = self.limits.get(self.store.tenancy.name(pool))
        return conf or EngineLimits()

    def engine(self, session: int) -> Engine:
        eng = self.engines.get(session)
        if eng is None:
            raise precondition(f"session {session} is not an engine; call EngineKvRegister first")
        self._prune(eng)
        return eng

    def _prune(self, eng: Engine) -> None:
        """Forget groups freed another way (a plain Free of one): the figures stay true."""
        gone = [oid for oid, obj in eng.groups.items() if not self.store.is_live(obj)]
        for oid in gone:
            eng.held_pages -= eng.groups.pop(oid).num_pages

    def session_ended(self, session: int) -> None:
        """The engine's session ended: the store frees its groups; waiting grows retry."""
        if self.engines.pop(session, None) is not None and self.on_change is not None:
            self.on_change()

    # ------------------------------------------------------------ growth

    def check_groups(self, session: int, groups: int) -> Engine:
        """The engine, if ``groups`` new groups are a valid request within its ceiling."""
        eng = self.engine(session)
        if groups < 1 or groups > self.store.config.max_batch:
            raise invalid(f"groups must be 1..{self.store.config.max_batch}, got {groups}")
        need = groups * eng.group_pages
        if eng.held_pages + need > eng.ceiling:
            eng.refusals += 1
            raise exhausted(
                f"engine {eng.name!r}: {need} more pages would pass its ceiling ({eng.held_pages} held of "
                f"{eng.ceiling}); preempt, or raise engine_pool.engines[{eng.name}].ceiling"
            )
        return eng

    def fitting(self, session: int, groups: int) -> int:
        """How many of ``groups`` new groups the store can grant now, within the ceiling."""
        eng = self.engine(session)
        gp = eng.group_pages
        short = self.shortfall(session, groups)
        fit = groups - -(-short // gp)
        return max(0, min(fit, (eng.ceiling - eng.held_pages) // gp))

    def shortfall(self, session: int, groups: int) -> int:
        """Pages a grow of ``groups`` lacks after every unpinned object were evicted, keeping
        the floors other engines have not taken yet (0: the store can grant it now)."""
        eng = self.engine(session)
        pool = self.store.pools[eng.pool]
        room = self.store.rooms[eng.pool]
        reserved = sum(
            max(0, e.floor - e.held_pages) for e in self.engines.values() if e.pool == eng.pool and e is not eng
        )
        available = pool.free_pages + room.policy.evictable_pages - reserved
        return max(0, groups * eng.group_pages - available)

    def grow(self, session: int, groups: int) -> list[Allocation]:
        """Take ``groups`` new groups for the engine now (evicting unpinned objects, growing
        the arena), or raise RESOURCE_EXHAUSTED with nothing changed."""
        eng = self.check_groups(session, groups)
        short = self.shortfall(session, groups)
        if short:
            raise exhausted(self._short_message(eng, groups, short))
        objs = self.store.allocate(session, [Spec(eng.group_pages, ContentType.KV_CACHE, pin=True)] * groups)
        out = []
        for obj, _ in objs:
            eng.groups[obj.object_id] = obj
            eng.held_pages += obj.num_pages
            out.append(obj)
        return out

    def granted(self, session: int, objs: Sequence[Allocation], seconds: float) -> None:
        """Count a granted grow and the time it took (asking back and zeroing included)."""
        eng = self.engines.get(session)
        if eng is None:
            return
        eng.grows += 1
        eng.grown_pages += sum(o.num_pages for o in objs)
        eng.grow_seconds += seconds
        eng.grow_seconds_max = max(eng.grow_seconds_max, seconds)

    def refused(self, session: int, groups: int, waited_s: float) -> BrokerError:
        """Count a refused grow; the error to answer it with."""
        eng = self.engine(session)
        eng.refusals += 1
        short = self.shortfall(session, groups) or groups * eng.group_pages
        return exhausted(f"{self._short_message(eng, groups, short)}; waited {waited_s * 1e3:.0f} ms for give-backs")

    def _short_message(self, eng: Engine, groups: int, short: int) -> str:
        pool = self.store.pools[eng.pool]
        others = ", ".join(
            f"{e.name} {e.held_pages} (floor {e.floor})"
            for e in self.engines.values()
            if e.pool == eng.pool and e is not eng
        )
        return (
            f"engine {eng.name!r}: need {groups * eng.group_pages} pages ({groups} groups), {short} short: "
            f"{pool.free_pages} free, {self.store.rooms[eng.pool].policy.evictable_pages} evictable of "
            f"{pool.max_pages}; engines hold: {others or 'none other'}; the engine preempts"
        )

    def ask_back(self, session: int, pages: int, within_s: float) -> int:
        """Ask engines above their floor (not ``session``) to give back ``pages`` in all,
        those with the most pages above their floor per weight first. Returns pages asked."""
        eng = self.engine(session)
        donors = [e for e in self.engines.values() if e.pool == eng.pool and e is not eng and e.held_pages > e.floor]
        donors.sort(key=lambda e: (e.held_pages - e.floor) / max(e.weight, 1e-9), reverse=True)
        deadline = self._clock() + within_s
        asked = 0
        for d in donors:
            if asked >= pages:
                break
            n = min(d.held_pages - d.floor, pages - asked)
            d.asked += 1
            d.asked_pages += n
            asked += n
            self.store.notify(d.session, EngineKvReclaim(n, deadline))
        return asked

    # ------------------------------------------------------------ give-back

    def give_back(self, session: int, object_ids: Sequence[int]) -> int:
        """Free groups the engine holds; returns pages freed. Nothing changes if an id is not
        one of its groups."""
        eng = self.engine(session)
        if len(object_ids) > self.store.config.max_batch:
            raise invalid(f"at most {self.store.config.max_batch} object_ids, got {len(object_ids)}")
        if len(set(object_ids)) != len(object_ids):
            raise invalid("object_ids lists a group twice")
        for oid in object_ids:
            obj = eng.groups.get(oid)
            if obj is None or not self.store.is_live(obj):
                raise not_found(f"object {oid} is not a KV group of engine {eng.name!r}")
        freed, _ = self.store.free(session, list(object_ids))
        for oid in object_ids:
            eng.held_pages -= eng.groups.pop(oid).num_pages
        eng.give_backs += 1
        eng.given_pages += freed
        if freed and self.on_change is not None:
            self.on_change()
        return freed

    # ------------------------------------------------------------ figures

    def stats(self) -> list[Engine]:
        """Each engine's figures at one instant (GetStats, status, metrics): copies of the
        records, without their groups."""
        for e in self.engines.values():
            self._prune(e)
        return [replace(e, groups={}) for e in self.engines.values()]

    def held_pages(self) -> int:
        return sum(e.held_pages for e in self.engines.values())


def is_room_error(e: BrokerError) -> bool:
    return e.code == Code.RESOURCE_EXHAUSTED
