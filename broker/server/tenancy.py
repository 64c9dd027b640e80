"""Tenant pools, as the process wires them (docs/security.md, "Per-tenant pools").

This module turns ``security.tenants`` into pools of whole slabs (``make_pools``: every
tenant's slabs are created at start, first in the arena, so each tenant's pool is one fixed
run of slabs; the shared pool grows after them), places a session in its tenant's pool when
its process is proven on the fd channel (``fd_authorize``: by the uid and gids the kernel
reports for that process), and limits what fds the fd channel sends it (``fd_scope``).
Without tenants the store gets one pool and the fd channel no scope: today's behaviour.
"""

from __future__ import annotations

from collections.abc import Callable

from memory_broker.broker.server.options import tenant_of
from memory_broker.broker.server.values import show
from memory_broker.broker.sessions.peer import FdRequestRefused, PeerCred
from memory_broker.broker.store.pool import PagePool
from memory_broker.broker.store.pools import TenantPool
from memory_broker.broker.store.records import ObjectState
from memory_broker.proto.wire.errors import BrokerError


def make_pools(opts, arena, grow: Callable[[int], None]) -> tuple[PagePool, list[TenantPool]]:
    """The shared pool and the tenant pools of a new arena: tenants' slabs created first (all
    of them, at start), then ``preallocate``; the shared pool is every slab after the tenants'."""
    pps = opts.slab_size // opts.page_size
    tenants: list[TenantPool] = []
    for name, _, _, size in opts.tenants:
        slabs = size // opts.slab_size
        base = arena.capacity_pages
        arena.grow(slabs)
        pages = slabs * pps
        pool = PagePool(pages, pps, pages, grow=_cannot_grow, base=base)
        tenants.append(TenantPool(name, pool, f"security.tenants[{name}].bytes = {show('size', size)}"))
    if opts.preallocate:
        arena.grow(-(-opts.preallocate // opts.slab_size))
    base = sum(t.pool.max_pages for t in tenants)
    shared = PagePool(arena.geometry.max_pages - base, pps, arena.capacity_pages - base, grow=grow, base=base)
    return shared, tenants


def _cannot_grow(slabs: int) -> None:
    raise MemoryError("a tenant pool is all its slabs from the start")


def process_gids(peer: PeerCred) -> set[int]:
    """The peer's gid and its supplementary groups (``/proc/PID/status``; the gid alone where
    that cannot be read: a pid namespace the broker cannot see)."""
    gids = {peer.gid}
    try:
        with open(f"/proc/{peer.pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    gids.update(int(g) for g in line.split()[1:])
                    break
    except (OSError, ValueError):
        pass
    return gids


def fd_authorize(server) -> Callable[[str, PeerCred], str]:
    """The fd channel's ``authorize``: the session manager's check (which returns the session's
    proof key), then (tenant pools) the session placed in the pool of the process that proved it."""
    tenants = server.opts.tenants

    def authorize(token: str, peer: PeerCred) -> str:
        key = server.sessions.authorize_fd_request(token, peer)
        if tenants:
            sid = server.sessions.from_token(token).session_id
            server.store.assign_pool(sid, tenant_of(tenants, peer.uid, process_gids(peer)))
        return key

    return authorize


def fd_scope(server) -> Callable[[str, int, int | None, int], tuple[int, int]] | None:
    """The fd channel's ``scope`` with tenant pools (``PoolMap.scope`` for the session's pool),
    else None. Called on the event loop after ``authorize``."""
    if not server.opts.tenants:
        return None
    store, arena = server.store, server.arena
    unit_pages = 1 if arena.fd_unit == "page" else arena.geometry.pages_per_slab
    # A host arena's shared slabs hold other sessions' pages too: no adapters for tenants there.
    store.tenancy.adapters_for_tenants = unit_pages == 1

    def broker_page(page: int) -> bool:
        # A page of the shared pool that holds a committed broker-owned object (an adapter).
        owner = store.pool.owner
        obj = store.objects.get(owner[page]) if page < len(owner) else None
        return obj is not None and obj.state == ObjectState.COMMITTED and obj.owner in store.internal_sessions

    def scope(token: str, first: int, count: int | None, have: int) -> tuple[int, int]:
        try:
            s = store.sessions.get(server.sessions.from_token(token).session_id)
            if s is None or s.pool < 0:
                raise FdRequestRefused("PERMISSION_DENIED", "the session is in no pool; open a new session")
            return store.tenancy.scope(s.pool, first, count, have, unit_pages, broker_page)
        except BrokerError as e:
            raise FdRequestRefused(e.code.value, e.message) from None

    return scope
