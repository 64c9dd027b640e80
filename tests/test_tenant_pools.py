"""Tenant pools (security.tenants): separate pools per tenant group within one broker, with no
fds of one group's pages sent to another (issue 26, item 9; docs/security.md, "Per-tenant pools").

In-process, the store with tenant pools: each tenant allocates, evicts and looks keys up in its
own pages only, a full pool is RESOURCE_EXHAUSTED naming the tenant and its setting, and the
pool map refuses fds outside a session's pool. End to end (root only: it needs processes of
other uids), a broker with two tenants and real client processes of uids 1001 and 1002.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from store_invariants import check_invariants

from memory_broker.broker.store.eviction import ContentType
from memory_broker.broker.store.objects import ObjectStore, Spec
from memory_broker.broker.store.pool import PagePool, WindowSpace
from memory_broker.broker.store.pools import PoolMap, TenantPool
from memory_broker.proto.wire.errors import BrokerError, Code

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

KV = ContentType.KV_CACHE
PPS = 4  # pages per slab


def _no_grow(slabs: int) -> None:
    raise MemoryError("no growth in this test")


def pooled_store(shared_slabs: int = 2, tenant_slabs: tuple[int, ...] = (1, 1)) -> ObjectStore:
    """Tenants' slabs first (tenant i: slabs of ``tenant_slabs[i]``), then the shared pool's."""
    tenants, base = [], 0
    for i, n in enumerate(tenant_slabs):
        pool = PagePool(n * PPS, PPS, n * PPS, _no_grow, base=base)
        tenants.append(TenantPool(f"team{'AB'[i]}", pool, f"security.tenants[team{'AB'[i]}].bytes = {n}MiB"))
        base += n * PPS
    shared = PagePool(shared_slabs * PPS, PPS, shared_slabs * PPS, _no_grow, base=base)
    return ObjectStore(shared, WindowSpace(64), tenants=tenants)


def sessions(store: ObjectStore) -> tuple[int, int, int]:
    """A session placed in tenant A's pool, one in B's, one in the shared pool."""
    a, b, s = store.open_session(), store.open_session(), store.open_session()
    store.assign_pool(a, 1)
    store.assign_pool(b, 2)
    store.assign_pool(s, 0)
    return a, b, s


def test_a_tenant_that_fills_its_pool_is_refused_naming_it_while_the_others_still_allocate():
    store = pooled_store()
    a, b, s = sessions(store)
    got = store.allocate(a, [Spec(4, pin=True)])
    assert set(got[0][0].pages) <= set(range(0, 4))  # tenant A's slab
    with pytest.raises(BrokerError) as e:
        store.allocate(a, [Spec(1)])
    assert e.value.code == Code.RESOURCE_EXHAUSTED
    assert "tenant 'teamA'" in e.value.message and "security.tenants[teamA].bytes" in e.value.message
    ((bobj, _),) = store.allocate(b, [Spec(4, pin=True)])
    assert set(bobj.pages) == set(range(4, 8))  # tenant B's slab, untouched by A
    ((sobj, _),) = store.allocate(s, [Spec(8, pin=True)])
    assert set(sobj.pages) == set(range(8, 16))  # the shared pool never takes a tenant's pages
    st = store.stats()
    assert st.max_pages == 16 and st.used_pages == 16 and st.free_pages == 0
    check_invariants(store)


def test_a_tenant_evicts_only_its_own_cached_objects():
    store = pooled_store()
    a, b, s = sessions(store)
    olds = [o for o, _ in store.allocate(a, [Spec(1, content_type=KV, key=b"a%d" % i) for i in range(4)])]
    ((bobj, _),) = store.allocate(b, [Spec(2, content_type=KV, key=b"b0")])
    ((sobj, _),) = store.allocate(s, [Spec(2, content_type=KV, key=b"s0")])
    # A's pool is full of its own unpinned objects: a new one evicts one of them, never B's or
    # the shared pool's (which have free pages A may not take).
    ((new, _),) = store.allocate(a, [Spec(1, content_type=KV, key=b"a9")])
    assert new.pages[0] in range(0, 4)
    # (down to the low watermark of A's own pool: 80% of 4 pages)
    assert sum(store.is_live(o) for o in olds) == 2
    assert store.counters.evicted_objects == 2
    assert store.is_live(bobj) and store.is_live(sobj)
    assert store.lookup(b, [b"b0"], False)[0] is bobj
    check_invariants(store)


def test_keys_and_ids_are_per_pool():
    store = pooled_store()
    a, b, s = sessions(store)
    ((aobj, _),) = store.allocate(a, [Spec(1, content_type=KV, key=b"k")])
    assert store.lookup(b, [b"k"], False) == []  # another tenant's key misses
    assert store.lookup(s, [b"k"], False) == []  # and so it does from the shared pool
    ((bobj, dedup),) = store.allocate(b, [Spec(1, content_type=KV, key=b"k")])
    assert not dedup and bobj is not aobj and bobj.pages[0] in range(4, 8)
    assert store.lookup(a, [b"k"], True)[0] is aobj and store.lookup(b, [b"k"], False)[0] is bobj
    # Another pool's object by id is as unknown as an id never given.
    for sid in (b, s):
        with pytest.raises(BrokerError) as e:
            store.pin(sid, [aobj.object_id])
        assert e.value.code == Code.NOT_FOUND
        with pytest.raises(BrokerError) as e:
            store.check_visible(sid, [aobj.object_id])
        assert e.value.code == Code.NOT_FOUND
    store.check_visible(a, [aobj.object_id])
    # A keyed object freed in A leaves B's key alone.
    store.free(a, [aobj.object_id])
    assert store.lookup(b, [b"k"], False)[0] is bobj and store.lookup(a, [b"k"], False) == []
    check_invariants(store)


def test_broker_owned_objects_stay_visible_to_every_pool():
    store = pooled_store()
    a, _, _ = sessions(store)
    wing = store.open_session()
    store.mark_internal(wing)  # the adapter wing's session: the shared pool
    ((adapter, _),) = store.allocate(wing, [Spec(1, content_type=ContentType.LORA_WEIGHT, key=b"lora")])
    assert adapter.pages[0] >= 8
    store.check_visible(a, [adapter.object_id])
    store.pin(a, [adapter.object_id])


def test_a_session_in_no_pool_yet_can_do_nothing():
    store = pooled_store()
    sid = store.open_session()
    with pytest.raises(BrokerError) as e:
        store.allocate(sid, [Spec(1)])
    assert e.value.code == Code.FAILED_PRECONDITION and "fd channel" in e.value.message
    store.assign_pool(sid, 2)
    store.allocate(sid, [Spec(1)])
    store.assign_pool(sid, 1)  # placed once: a later proof does not move it
    assert store.sessions[sid].pool == 2


def test_without_tenants_a_session_is_in_the_shared_pool_at_once():
    store = ObjectStore(PagePool(8, PPS, 8, _no_grow), WindowSpace(16))
    assert store.tenancy is None
    sid = store.open_session()
    ((obj, _),) = store.allocate(sid, [Spec(2, key=b"k")])
    assert obj.pool == 0 and store.keys.get(b"k") is obj  # keys as they always were


def test_the_pool_map_sends_a_session_its_own_pool_only():
    store = pooled_store()
    m = store.tenancy

    def never(page):
        return False

    # Host arena: one unit per slab. Slabs: 0 = A, 1 = B, 2..3 = shared.
    assert m.scope(1, 0, None, 4, PPS, never) == (0, 1)
    assert m.scope(2, 0, None, 4, PPS, never) == (1, 1)
    assert m.scope(0, 0, None, 4, PPS, never) == (2, 2)
    assert m.scope(1, 1, None, 4, PPS, never) == (1, 0)  # nothing of A's from slab 1 on
    assert m.scope(1, 0, 1, 4, PPS, never) == (0, 1)
    for pool, first, count in ((1, 1, 1), (2, 0, 2), (0, 0, 1), (1, 0, 3)):
        with pytest.raises(BrokerError) as e:
            m.scope(pool, first, count, 4, PPS, never)
        assert e.value.code == Code.PERMISSION_DENIED and "security.tenants" in e.value.message
    # CUDA arena: one unit per page; a tenant may import broker-owned shared pages (adapters).
    assert m.scope(2, 4, 4, 16, 1, never) == (4, 4)
    with pytest.raises(BrokerError, match="pages 0..3"):
        m.scope(2, 0, 5, 16, 1, never)
    assert m.scope(1, 9, 2, 16, 1, lambda p: p in (9, 10)) == (9, 2)
    with pytest.raises(BrokerError, match="pages 11..11"):
        m.scope(1, 9, 3, 16, 1, lambda p: p in (9, 10))
    with pytest.raises(BrokerError, match="pages 4..4"):
        m.scope(1, 4, 1, 16, 1, lambda p: True)  # never another tenant's page
    assert isinstance(m, PoolMap)


# ----------------------------------------------------------------- settings


def test_tenant_settings_are_read_from_yaml_and_flags_and_checked():
    from memory_broker.broker.server.config import build_options
    from memory_broker.broker.server.options import tenant_of
    from memory_broker.broker.server.values import ConfigError, read

    t = read("tenants", [{"name": "teamA", "uids": [1001], "bytes": "4MiB"}], "security.tenants")
    assert t == (("teamA", (1001,), (), 4 << 20),)
    assert read("tenants", ["teamB:gids=7,8:bytes=2MiB"], "--tenant") == (("teamB", (), (7, 8), 2 << 20),)
    for bad, msg in (
        ([{"name": "x"}], "give uids or gids"),
        ([{"name": "x", "uids": [1]}], "bytes: missing"),
        ([{"name": "a b", "uids": [1], "bytes": 1}], "name"),
        ([{"name": "x", "uids": [1], "bytes": "1MiB", "color": 1}], "unknown keys"),
        (["x:uids=1:bytes=1MiB", "x:uids=2:bytes=1MiB"], "named twice"),
        (["x:users=1"], "NAME:uids="),
    ):
        with pytest.raises(ConfigError, match=msg):
            read("tenants", bad, "security.tenants")
    over = {"slab_size": 2 << 20, "page_size": 512 << 10, "pool_size": 8 << 20}
    with pytest.raises(ConfigError, match=r"tenants\[a\].bytes = 3MiB must be a positive multiple of slab_size"):
        build_options(None, {**over, "tenants": (("a", (1,), (), 3 << 20),)})
    with pytest.raises(ConfigError, match="by a slab at least"):
        build_options(None, {**over, "tenants": (("a", (1,), (), 8 << 20),)})
    tenants = (("a", (1001,), (), 1), ("b", (), (50,), 1))
    assert (
        tenant_of(tenants, 1001, {50}) == 1 and tenant_of(tenants, 7, {9, 50}) == 2 and tenant_of(tenants, 7, {9}) == 0
    )


# ----------------------------------------------------------------- end to end

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENANT_A, TENANT_B = 1001, 1002
# teamB is matched by a supplementary group of its processes (read from /proc/PID/status).
TEAM_B_GROUP = 3000

CHILD = """
import json, os, sys
import torch
from memory_broker.clients import BrokerClient, Spec, BrokerError
from memory_broker.clients.fd_channel import FdChannelError, fetch_fds, fetch_slab_range
# Everything is imported (this machine's Python may be unreadable to other uids): now become
# the tenant's process, with its uid, its gid and the supplementary groups given.
os.setgroups({groups}); os.setgid({uid}); os.setuid({uid})
SOCKET = {socket!r}
def out(**kw):
    print(json.dumps(kw), flush=True)
def code(fn):
    try:
        fn()
        return "OK"
    except (BrokerError, FdChannelError) as e:
        return [str(getattr(e.code, "value", e.code)), e.message]
"""


def run_as(uid: int, socket: str, body: str, groups: tuple[int, ...] = ()) -> dict:
    """``body`` in a fresh process of ``uid`` (gid ``uid``, supplementary ``groups``); its
    printed JSON lines, merged."""
    code = CHILD.format(uid=uid, socket=socket, groups=list(groups)) + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"child of uid {uid} failed:\n{r.stdout}\n{r.stderr}"
    got: dict = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            got.update(json.loads(line))
    return got


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs processes of other uids (run as root)")


@needs_root
def test_two_tenants_end_to_end_with_real_processes_of_their_uids(broker_factory):
    # 32 MiB pool of 2 MiB slabs (4 pages of 512 KiB): teamA = slabs 0-1, teamB = slabs 2-3,
    # the shared pool slabs 4 and on.
    b = broker_factory(
        "--tenant",
        f"teamA:uids={TENANT_A}:bytes=4MiB",
        "--tenant",
        f"teamB:gids={TEAM_B_GROUP}:bytes=4MiB",
        "--preallocate",
        "2MiB",  # the shared pool's first slab, slab 4
        "--socket-mode",
        "0666",
        *[a for uid in (0, TENANT_A, TENANT_B) for a in ("--allow-uid", str(uid))],
    )
    os.chmod(os.path.dirname(b.socket), 0o755)
    fds = b.socket + ".fds"
    a = run_as(
        TENANT_A,
        b.socket,
        f"""
        c = BrokerClient.connect(SOCKET, client_name="a")
        objs = c.allocate([Spec(4, pin=True, key=b"secret"), Spec(4, pin=True, contiguous=True)])
        out(pages=sorted(p for o in objs for p in o.pages))
        t = objs[1].tensor()  # a window over its own contiguous object
        t[:] = 7
        out(window_sum=int(t.sum()) == 7 * t.numel())
        out(full=code(lambda: c.allocate_one(1)))
        # Raw fd requests: its own slabs, then teamB's and the shared pool's.
        out(own=fetch_fds({fds!r}, c.token, 0, 2, lambda fds: [os.close(f) for f in fds]))
        out(to_end=list(fetch_slab_range({fds!r}, c.token, 0)[0:1]))
        out(b_slabs=code(lambda: fetch_fds({fds!r}, c.token, 2, 1, lambda fds: [os.close(f) for f in fds])))
        out(shared=code(lambda: fetch_fds({fds!r}, c.token, 4, 1, lambda fds: [os.close(f) for f in fds])))
        out(mapped=c.view.mapped_slabs)
        c.close()
        """,
    )
    assert a["pages"] == list(range(0, 8)) and a["window_sum"]
    assert a["full"][0] == "RESOURCE_EXHAUSTED" and "tenant 'teamA'" in a["full"][1]
    assert "security.tenants[teamA].bytes = 4MiB" in a["full"][1]
    assert a["own"] == 2 and a["to_end"] == [0]
    for k in ("b_slabs", "shared"):
        assert a[k][0] == "PERMISSION_DENIED" and "teamA" in a[k][1] and "nothing was sent" in a[k][1], a[k]
    assert a["mapped"] == 5  # every slab known (5); only its own two are mapped
    bb = run_as(
        TENANT_B,
        b.socket,
        f"""
        c = BrokerClient.connect(SOCKET, client_name="b")
        out(lookup=[o.object_id for o in c.lookup([b"secret"])])
        o = c.allocate_one(8, pin=True, key=b"secret", contiguous=True)
        out(pages=sorted(o.pages))
        o.tensor()[:] = 1
        out(to_end=fetch_slab_range({fds!r}, c.token, 0)[0], a_slabs=code(
            lambda: fetch_fds({fds!r}, c.token, 0, 1, lambda fds: [os.close(f) for f in fds])))
        c.close()
        """,
        groups=(TEAM_B_GROUP,),
    )
    assert bb["lookup"] == [] and bb["pages"] == list(range(8, 16)) and bb["to_end"] == 2
    assert bb["a_slabs"][0] == "PERMISSION_DENIED"
    # Root is in no tenant: the shared pool, which maps neither tenant's slabs.
    shared = run_as(
        0,
        b.socket,
        f"""
        c = BrokerClient.connect(SOCKET, client_name="root")
        out(lookup=[o.object_id for o in c.lookup([b"secret"])])
        o = c.allocate_one(6, contiguous=True)  # more than slab 4: the shared pool grows
        o.tensor()[:] = 3
        out(pages=sorted(o.pages), to_end=fetch_slab_range({fds!r}, c.token, 0)[0])
        out(a_slabs=code(lambda: fetch_fds({fds!r}, c.token, 0, 1, lambda fds: [os.close(f) for f in fds])))
        c.close()
        """,
    )
    assert shared["lookup"] == [] and min(shared["pages"]) >= 16 and shared["to_end"] == 4
    assert shared["a_slabs"][0] == "PERMISSION_DENIED"
    assert b.stop(signal.SIGTERM) == 0


# ----------------------------------------------------------------- random operations

ops = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "free", "pin", "unpin", "lookup", "end"]),
        st.integers(0, 2),  # which session (pool 1, 2 or the shared pool)
        st.integers(1, 5),  # pages
        st.sampled_from([None, b"x", b"y"]),  # key
        st.booleans(),  # pin / contiguous
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_operations_keep_every_pool_to_itself(seq):
    store = pooled_store()
    sids = list(sessions(store))
    for op, who, n, key, flag in seq:
        sid = sids[who]
        pool = store.sessions[sid].pool
        others = {oid for oid, o in store.objects.items() if o.pool != pool}
        try:
            if op == "allocate":
                for obj, _ in store.allocate(sid, [Spec(n, content_type=KV, key=key, pin=flag, contiguous=flag)]):
                    assert obj.pool == pool
            elif op in ("free", "pin", "unpin"):
                mine = [oid for oid in store.sessions[sid].owned if not store.objects[oid].freed][:1]
                getattr(store, op)(sid, mine or sorted(others)[:1])
            elif op == "lookup":
                assert all(o.pool == pool for o in store.lookup(sid, [key or b"x"], flag))
            else:
                store.end_session(sid)
                sids[who] = store.open_session()
                store.assign_pool(sids[who], pool)
        except BrokerError as e:
            assert e.code != Code.INTERNAL, e
        # Nothing one pool's session did removed another pool's object.
        assert others <= set(store.objects)
        check_invariants(store)
