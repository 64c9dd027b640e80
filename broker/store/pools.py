"""Tenant pools: one broker's arena split into pools of whole slabs (ARCHITECTURE.md, "Pools").

Without tenants the store has one pool and none of this runs. With them, pool 0 is the shared
pool (sessions of no tenant, and the adapter wing) and pool ``i`` is tenant ``i``'s: its own
``PagePool`` over whole slabs reserved at start, its own eviction policy and room maker, its
own keys. This module holds what only tenant pools need: the eviction policy that sends each
object to its pool's (``PooledPolicy``), the room makers of the pools (``pool_rooms``), and
which fd units (slabs, or pages on a CUDA arena) a session of a pool may be sent
(``PoolMap.scope``). It never imports gRPC or the doors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from memory_broker.broker.store.context import StoreContext
from memory_broker.broker.store.eviction import Evictable, EvictionPolicy
from memory_broker.broker.store.pool import PagePool
from memory_broker.broker.store.room import RoomMaker
from memory_broker.proto.wire.errors import denied


@dataclass(frozen=True)
class TenantPool:
    """One tenant's pool: its name, its pages (whole slabs, all backed at start) and the
    setting that sized it, named in RESOURCE_EXHAUSTED (``tenants[teamA].bytes = 64MiB``)."""

    name: str
    pool: PagePool
    setting: str


class PooledPolicy:
    """The store's one eviction policy over one policy per pool: each object is a candidate
    in its own pool's (``Allocation.pool``), and each pool's room maker selects from its own."""

    def __init__(self, policies: Sequence[EvictionPolicy]):
        self.policies = list(policies)

    @property
    def evictable_pages(self) -> int:
        return sum(p.evictable_pages for p in self.policies)

    def __len__(self) -> int:
        return sum(len(p) for p in self.policies)

    def __iter__(self) -> Iterator[Evictable]:
        for p in self.policies:
            yield from p  # type: ignore[misc]

    def add(self, obj) -> None:
        self.policies[obj.pool].add(obj)

    def remove(self, obj) -> None:
        self.policies[obj.pool].remove(obj)

    def add_all(self, objs) -> None:
        for obj in objs:
            self.policies[obj.pool].add(obj)

    def remove_all(self, objs) -> None:
        for obj in objs:
            self.policies[obj.pool].remove(obj)

    def touch(self, obj) -> None:
        self.policies[obj.pool].touch(obj)

    def touch_all(self, objs) -> None:
        for obj in objs:
            self.policies[obj.pool].touch(obj)

    def select(self, need_pages: int, limit: int | None = None) -> list[Evictable]:
        """The shared pool's candidates (each pool's room maker holds its own policy)."""
        return self.policies[0].select(need_pages, limit)


def pool_rooms(ctx: StoreContext, tenants: Sequence[TenantPool]) -> list[RoomMaker]:
    """A room maker per pool: the shared pool's over ``ctx``'s pool, then each tenant's over
    its own pages and its own policy (so it evicts only its own objects and never grows)."""
    policy = ctx.policy
    if not tenants:
        return [RoomMaker(ctx)]
    assert isinstance(policy, PooledPolicy)
    rooms = [RoomMaker(dataclasses.replace(ctx, policy=policy.policies[0]))]
    for i, t in enumerate(tenants, 1):
        room = RoomMaker(dataclasses.replace(ctx, pool=t.pool, policy=policy.policies[i]))
        room.label = f"the pool of tenant {t.name!r} ({t.setting}) is full: "
        rooms.append(room)
    return rooms


class PoolMap:
    """Which fd units each pool's sessions may be sent: a tenant's own slabs (or their pages),
    and for shared-pool sessions every slab from the shared pool's first on (tenants' slabs
    come first in the arena). On a CUDA arena, a tenant session may also import single pages
    of the shared pool that hold broker-owned objects (adapters: mapped read-only, checked by
    their checksums), never a slab or page of another tenant or of a shared-pool session."""

    def __init__(self, pools: Sequence[PagePool], names: Sequence[str]):
        self.pools = list(pools)
        self.names = list(names)
        # Whether a tenant's session may be sent adapters' pages: on a CUDA arena (one fd per
        # page) yes; on a host arena (one fd per slab of the shared pool) no. Set by the host.
        self.adapters_for_tenants = True

    def name(self, pool: int) -> str:
        return "the shared pool" if pool == 0 else f"the pool of tenant {self.names[pool]!r}"

    def scope(
        self, pool: int, first: int, count: int | None, have: int, unit_pages: int, shared_page: Callable[[int], bool]
    ) -> tuple[int, int]:
        """The units ``(first, count)`` to send a session of ``pool`` for its request.

        ``count`` None (to the end) is answered with the part of ``first..have-1`` the pool's
        sessions may map (the reply's ``first`` says where it starts; units before it and
        after its end are not this session's). An explicit range must lie in the pool, or
        (tenants, CUDA pages) be broker-owned shared pages (``shared_page``).

        Raises:
            BrokerError: PERMISSION_DENIED naming the units and the pool.
        """
        p = self.pools[pool]
        lo = p.base // unit_pages
        hi = have if pool == 0 else (p.base + p.max_pages) // unit_pages
        if count is None:
            start, end = max(first, lo), min(have, hi)
            return (start, end - start) if start < end else (first, 0)
        outside = [u for u in range(first, first + count) if not lo <= u < hi]
        if pool and unit_pages == 1:
            shared_lo = self.pools[0].base
            outside = [u for u in outside if not (u >= shared_lo and shared_page(u))]
        if outside:
            unit = "page" if unit_pages == 1 else "slab"
            raise denied(
                f"{unit}s {outside[0]}..{outside[-1]} ({len(outside)} of those asked for) are outside "
                f"{self.name(pool)} ({unit}s {lo}..{hi - 1}); a session is sent fds of its own pool only "
                "(security.tenants): nothing was sent"
            )
        return first, count


def pool_totals(pools: Sequence[PagePool]) -> tuple[int, int, int, int]:
    """(max, capacity, free, used) pages over all pools."""
    return (
        sum(p.max_pages for p in pools),
        sum(p.capacity_pages for p in pools),
        sum(p.free_pages for p in pools),
        sum(p.used_pages for p in pools),
    )
