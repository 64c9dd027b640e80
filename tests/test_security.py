"""Issue 11, the broker side: each behaviour seen as an attacker or a careless client would
cause it, now a clear refusal that changes nothing (adapter reads, authorization, session
ownership, object visibility, connection and session bounds, file modes)."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
import time

import grpc
import pytest
from adapter_fixtures import AdapterHarness, copy_adapter, peft_dirs  # noqa: F401 - fixture
from conftest import ROOT, short_tmpdir

from memory_broker.broker.adapters.access import Caller, open_for
from memory_broker.broker.adapters.registry import AdapterRegistry
from memory_broker.broker.doors.fd_channel import FdChannelServer
from memory_broker.broker.doors.service import POLICY
from memory_broker.clients import BrokerClient, Spec
from memory_broker.clients.fd_channel import FdChannelError, fetch_slab_fds
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc

S = grpc.StatusCode
NOBODY = Caller(65534, frozenset({65534}))
KV = pb.CONTENT_TYPE_KV_CACHE


def md(client) -> tuple:
    """The call metadata of ``client``'s session: its token and the proof key it took on the
    fd channel (a raw stub in the client's own process may act for the session)."""
    return client.metadata


def config_file(text: str) -> str:
    path = os.path.join(short_tmpdir(), "broker.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path


def adapter_snapshot(stub, client) -> tuple:
    st = stub.GetStats(pb.GetStatsRequest())
    listing = stub.ListAdapters(pb.ListAdaptersRequest(), metadata=md(client))
    return (st.adapters.registered, st.objects, st.used_pages, sorted(a.adapter_id for a in listing.adapters))


@pytest.fixture
def abroker(broker_factory):
    return broker_factory("--pool-size", "64MiB", "--slab-size", "4MiB", "--adapter-dtype", "float32")


@pytest.fixture
def rig(abroker):
    c = BrokerClient.connect(abroker.socket)
    ch = grpc.insecure_channel(f"unix:{abroker.socket}")
    yield abroker, c, broker_pb2_grpc.MemoryBrokerStub(ch)
    ch.close()
    c.close()


# ----------------------------------------------------------- bounded, typed adapter reads


def _adapter_with_config(peft_dirs, make_config) -> str:  # noqa: F811
    d = copy_adapter(peft_dirs["r4"], os.path.join(short_tmpdir(), "evil"))
    cfg = os.path.join(d, "adapter_config.json")
    os.unlink(cfg)
    make_config(cfg)
    return d


@pytest.mark.parametrize(
    "kind,make,words",
    [
        ("symlink to /dev/zero", lambda p: os.symlink("/dev/zero", p), "character device"),
        ("300 MB file", lambda p: os.truncate(open(p, "w").name, 300 << 20), "over the limit"),
        ("FIFO", lambda p: os.mkfifo(p), "FIFO"),
        ("directory", lambda p: os.mkdir(p), "not a regular file"),
    ],
)
def test_register_refuses_a_config_that_is_not_a_small_regular_file_quickly(rig, peft_dirs, kind, make, words):  # noqa: F811
    _, c, stub = rig
    path = _adapter_with_config(peft_dirs, make)
    before = adapter_snapshot(stub, c)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterAdapter(pb.RegisterAdapterRequest(adapter_id="evil", path=path), metadata=md(c), timeout=10)
    assert time.monotonic() - t0 < 5
    assert e.value.code() == S.INVALID_ARGUMENT, e.value.details()
    assert words in e.value.details() and "adapter_config.json" in e.value.details()
    assert adapter_snapshot(stub, c) == before


def test_nul_byte_in_the_path_is_invalid_argument(rig, peft_dirs):  # noqa: F811
    _, c, stub = rig
    before = adapter_snapshot(stub, c)
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterAdapter(
            pb.RegisterAdapterRequest(adapter_id="x", path=peft_dirs["r4"] + "\x00/etc"), metadata=md(c)
        )
    assert e.value.code() == S.INVALID_ARGUMENT and "NUL" in e.value.details()
    assert adapter_snapshot(stub, c) == before


def test_relative_path_is_invalid_argument(rig):
    _, c, stub = rig
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterAdapter(pb.RegisterAdapterRequest(adapter_id="x", path="adapters/r4"), metadata=md(c))
    assert e.value.code() == S.INVALID_ARGUMENT and "absolute" in e.value.details()


def _private_tree(peft_dirs, dir_mode: int, file_mode: int) -> str:  # noqa: F811
    top = short_tmpdir()
    os.chmod(top, 0o755)
    d = copy_adapter(peft_dirs["r4"], os.path.join(top, "adapter"))
    os.chmod(d, dir_mode)
    for name in os.listdir(d):
        os.chmod(os.path.join(d, name), file_mode)
    return d


def test_open_for_checks_the_callers_mode_bits_not_the_brokers(peft_dirs):  # noqa: F811
    readable = _private_tree(peft_dirs, 0o755, 0o644)
    with open_for(os.path.join(readable, "adapter_config.json"), NOBODY) as f:
        assert stat.S_ISREG(f.st.st_mode)
    closed_dir = _private_tree(peft_dirs, 0o700, 0o644)
    with pytest.raises(BrokerError) as e:
        open_for(os.path.join(closed_dir, "adapter_config.json"), NOBODY)
    assert e.value.code == Code.PERMISSION_DENIED and "may not search" in e.value.message
    closed_file = _private_tree(peft_dirs, 0o755, 0o600)
    with pytest.raises(BrokerError) as e:
        open_for(os.path.join(closed_file, "adapter_config.json"), NOBODY)
    assert e.value.code == Code.PERMISSION_DENIED and "may not read" in e.value.message
    # Group bits count for a caller in the file's group; ownership for its owner.
    os.chown(os.path.join(closed_file, "adapter_config.json"), 0, 4242)
    os.chmod(os.path.join(closed_file, "adapter_config.json"), 0o640)
    with open_for(os.path.join(closed_file, "adapter_config.json"), Caller(65534, frozenset({65534, 4242}))):
        pass
    os.chown(os.path.join(closed_file, "adapter_config.json"), 65534, 0)
    os.chmod(os.path.join(closed_file, "adapter_config.json"), 0o400)
    with open_for(os.path.join(closed_file, "adapter_config.json"), NOBODY):
        pass


def test_a_symlink_is_followed_with_the_callers_rights_on_the_way(peft_dirs):  # noqa: F811
    closed_dir = _private_tree(peft_dirs, 0o700, 0o644)
    link = os.path.join(short_tmpdir(), "link.json")
    os.chmod(os.path.dirname(link), 0o755)
    os.symlink(os.path.join(closed_dir, "adapter_config.json"), link)
    with pytest.raises(BrokerError) as e:
        open_for(link, NOBODY)
    assert e.value.code == Code.PERMISSION_DENIED
    with open_for(link, None) as f:  # the broker's own read follows it
        assert f.path == os.path.realpath(link)


def test_manager_registers_with_the_callers_rights(peft_dirs):  # noqa: F811
    closed = _private_tree(peft_dirs, 0o700, 0o644)
    open_tree = _private_tree(peft_dirs, 0o755, 0o644)

    async def main():
        h = AdapterHarness(short_tmpdir())
        with pytest.raises(BrokerError) as e:
            await h.manager.register("closed", closed, caller=NOBODY)
        assert e.value.code == Code.PERMISSION_DENIED and "uid 65534" in e.value.message
        assert len(h.registry) == 0
        meta = await h.manager.register("open", open_tree, caller=NOBODY)
        assert meta.source == os.path.realpath(open_tree)
        # The same directory, cached, is still checked against the next caller.
        with pytest.raises(BrokerError):
            os.chmod(open_tree, 0o700)
            await h.manager.register("again", open_tree, caller=NOBODY)
        assert len(h.registry) == 1
        await h.manager.close()

    asyncio.run(main())


def test_a_symlink_put_in_after_registration_is_not_followed_when_the_adapter_loads(peft_dirs):  # noqa: F811
    # Registered with the caller's rights on its files; then the caller swaps its weights for a
    # symlink to another tenant's adapter that it may not read. The load must not follow it.
    from memory_broker.broker.adapters.config import AdapterConfig

    mine = _private_tree(peft_dirs, 0o755, 0o644)
    theirs = _private_tree(peft_dirs, 0o700, 0o644)

    async def main():
        h = AdapterHarness(short_tmpdir(), config=AdapterConfig(image_cache=False, convert_ahead=False))
        await h.manager.register("mine", mine, caller=NOBODY)
        weights = os.path.join(mine, "adapter_model.safetensors")
        os.unlink(weights)
        os.symlink(os.path.join(theirs, "adapter_model.safetensors"), weights)
        s = h.store.open_session()
        with pytest.raises(BrokerError) as e:
            await h.manager.acquire(s, ["mine"])
        assert e.value.code == Code.FAILED_PRECONDITION and "symlink" in e.value.message, e.value.message
        assert h.store.stats().pinned_pages == 0
        await h.manager.close()

    asyncio.run(main())


def test_allowed_roots_confine_registration_and_refuse_symlink_escapes(broker_factory, peft_dirs):  # noqa: F811
    root = os.path.realpath(short_tmpdir())
    inside = copy_adapter(peft_dirs["r4"], os.path.join(root, "ok"))
    outside = copy_adapter(peft_dirs["r4"], os.path.join(short_tmpdir(), "outside"))
    os.symlink(outside, os.path.join(root, "escape"))
    # A file symlinked out of the root is refused too.
    sneaky = copy_adapter(peft_dirs["r4"], os.path.join(root, "sneaky"))
    os.unlink(os.path.join(sneaky, "adapter_model.safetensors"))
    os.symlink(os.path.join(outside, "adapter_model.safetensors"), os.path.join(sneaky, "adapter_model.safetensors"))
    cfg = config_file(f"adapters:\n  allowed_roots: [{root}]\n  dtype: float32\n")
    b = broker_factory("--config", cfg, "--pool-size", "64MiB", "--slab-size", "4MiB")
    with BrokerClient.connect(b.socket) as c:
        for path in (outside, os.path.join(root, "escape"), sneaky, os.path.join(root, "ok", "..", "..")):
            with pytest.raises(BrokerError) as e:
                c.register_adapter("x", path)
            assert e.value.code in (Code.PERMISSION_DENIED, Code.INVALID_ARGUMENT), e.value
            if path != os.path.join(root, "ok", "..", ".."):
                assert e.value.code == Code.PERMISSION_DENIED and "allowed_roots" in e.value.message, e.value
        assert c.register_adapter("ok", inside).path == inside
        assert c.list_adapters().total == 1


def test_registry_database_and_state_dir_are_private(peft_dirs):  # noqa: F811
    state = os.path.join(short_tmpdir(), "state")
    os.makedirs(state, mode=0o755)
    os.chmod(state, 0o755)
    old = os.umask(0o022)
    try:
        reg = AdapterRegistry(state)
        reg.register("r4", peft_dirs["r4"])
    finally:
        os.umask(old)
    for name in ("adapters.sqlite3", "adapters.sqlite3-wal", "adapters.sqlite3-shm"):
        p = os.path.join(state, name)
        if os.path.exists(p):
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, name
    reg.close()


def test_broker_creates_its_state_dir_0700_and_sockets_per_socket_mode(broker_factory):
    d = short_tmpdir()
    state = os.path.join(d, "state")
    old = os.umask(0o022)
    try:
        b = broker_factory("--state-dir", state, "--socket-mode", "0660")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(state, "adapters.sqlite3")).st_mode) == 0o600
    for path in (b.socket, b.socket + ".fds"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660


# ------------------------------------------------------------------ authorization table


def test_every_rpc_of_the_service_has_a_rule():
    methods = set(pb.DESCRIPTOR.services_by_name["MemoryBroker"].methods_by_name)
    assert methods == set(POLICY)
    assert {m for m, r in POLICY.items() if r.manage} == {"RegisterAdapter", "UnregisterAdapter", "PrefetchAdapters"}
    assert {m for m, r in POLICY.items() if r.tcp} == {"GetArena", "GetStats"}


@pytest.mark.parametrize(
    "method,request_",
    [
        ("RegisterAdapter", pb.RegisterAdapterRequest(adapter_id="x", path="/tmp")),
        ("UnregisterAdapter", pb.UnregisterAdapterRequest(adapter_ids=["r4"])),
        ("ListAdapters", pb.ListAdaptersRequest()),
        ("PrefetchAdapters", pb.PrefetchAdaptersRequest(adapter_ids=["r4"])),
        ("GetAdapterLayout", pb.GetAdapterLayoutRequest(adapter_id="r4")),
    ],
)
def test_adapter_rpcs_need_a_session(rig, peft_dirs, method, request_):  # noqa: F811
    _, c, stub = rig
    c.register_adapter("r4", peft_dirs["r4"])
    before = adapter_snapshot(stub, c)
    with pytest.raises(grpc.RpcError) as e:
        getattr(stub, method)(request_)
    assert e.value.code() == S.PERMISSION_DENIED and "x-broker-session" in e.value.details()
    assert adapter_snapshot(stub, c) == before


def test_a_session_that_never_used_the_fd_channel_can_do_nothing(rig, peft_dirs):  # noqa: F811
    _, c, stub = rig
    stream = stub.Attach(iter([pb.AttachRequest(hello=pb.Hello(client_name="bare"))]))
    token = next(stream).opened.token
    for call in (
        lambda md: stub.RegisterAdapter(pb.RegisterAdapterRequest(adapter_id="r4", path=peft_dirs["r4"]), metadata=md),
        lambda md: stub.ListAdapters(pb.ListAdaptersRequest(), metadata=md),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call((("x-broker-session", token),))
        assert e.value.code() == S.PERMISSION_DENIED and "fd channel" in e.value.details()
    stream.cancel()


def test_a_uid_outside_manager_uids_may_list_and_acquire_but_not_manage(broker_factory, peft_dirs):  # noqa: F811
    state = os.path.join(short_tmpdir(), "state")
    # First a broker that lets this uid register, to have an adapter in the registry.
    b1 = broker_factory(
        "--state-dir", state, "--pool-size", "64MiB", "--slab-size", "4MiB", "--adapter-dtype", "float32"
    )
    with BrokerClient.connect(b1.socket) as c:
        c.register_adapter("r4", peft_dirs["r4"])
    b1.stop()
    cfg = config_file("adapters:\n  manager_uids: [4242]\n  dtype: float32\n")
    b = broker_factory("--config", cfg, "--state-dir", state, "--pool-size", "64MiB", "--slab-size", "4MiB")
    with BrokerClient.connect(b.socket) as c:
        for call in (
            lambda: c.register_adapter("r8", peft_dirs["r8"]),
            lambda: c.unregister_adapters(["r4"]),
            lambda: c.prefetch_adapters(["r4"]),
        ):
            with pytest.raises(BrokerError) as e:
                call()
            assert e.value.code == Code.PERMISSION_DENIED and "manager_uids" in e.value.message
        assert [a.adapter_id for a in c.list_adapters().adapters] == ["r4"]
        with c.acquire_adapters(["r4"]) as lease:
            assert lease["r4"].generation > 0


def test_tcp_listener_serves_only_what_needs_no_credentials(broker_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = broker_factory("--tcp-port", str(port))
    with BrokerClient.connect(b.socket) as c, grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = broker_pb2_grpc.MemoryBrokerStub(ch)
        assert stub.GetStats(pb.GetStatsRequest(), timeout=5).sessions == 1
        assert stub.GetArena(pb.GetArenaRequest(), timeout=5).page_size == 512 << 10
        for method, req in (
            ("Allocate", pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=KV)])),
            ("ListAdapters", pb.ListAdaptersRequest()),
            ("Lookup", pb.LookupRequest(keys=[b"k"])),
        ):
            with pytest.raises(grpc.RpcError) as e:
                getattr(stub, method)(req, metadata=md(c), timeout=5)
            assert e.value.code() == S.PERMISSION_DENIED and "TCP" in e.value.details(), method
        with pytest.raises(grpc.RpcError) as e:
            next(stub.Attach(iter([pb.AttachRequest(hello=pb.Hello(client_name="tcp"))]), timeout=5))
        assert e.value.code() == S.PERMISSION_DENIED
        assert stub.GetStats(pb.GetStatsRequest(), timeout=5).sessions == 1 and c.stats().objects == 0


# ------------------------------------------------------------- session ownership


def test_a_foreign_process_presenting_a_token_is_refused_and_cannot_end_the_session(broker):
    with BrokerClient.connect(broker.socket) as owner:
        obj = owner.allocate([Spec(1)])[0]
        code = (
            "from memory_broker.clients.fd_channel import FdChannelError, fetch_slab_fds\n"
            f"try:\n    fetch_slab_fds({owner.arena.fd_socket_path!r}, {owner.token!r}, 0)\n    print('GOT FDS')\n"
            "except FdChannelError as e:\n    print(e.code, e.message)\n"
        )
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.stdout.startswith("PERMISSION_DENIED") and "belongs to process" in r.stdout, r.stdout + r.stderr
        time.sleep(0.5)  # the foreign process is gone; before, its exit closed the owner's session
        assert not owner.session_ended.is_set()
        assert owner.stats().sessions == 1 and owner.stats().objects == 1
        owner.free([obj])


def test_each_worker_process_gets_its_own_session_and_its_own_lifetime(broker):
    body = """
c = BrokerClient.connect(SOCKET)
c.allocate([Spec(1, key=b"shared", content_type="kv_cache")])
out(session=c.session_id)
time.sleep(0.3)
os._exit(0)
"""
    from conftest import run_child

    with BrokerClient.connect(broker.socket) as main:
        anon = main.allocate([Spec(1)])[0]
        worker = run_child(broker.socket, body)[0]["session"]
        assert worker != main.session_id
        time.sleep(0.5)
        # The worker's death ended its session only: its keyed object stays for everyone.
        assert main.stats().sessions == 1
        assert [o.key for o in main.lookup([b"shared"])] == [b"shared"]
        assert main.pin([anon])[0].object_id == anon.object_id


# ------------------------------------------------------------- object visibility


def test_pin_by_id_of_another_sessions_anonymous_object_is_not_found(rig):
    _, a, stub = rig
    with BrokerClient.connect(rig[0].socket) as b:
        anon = a.allocate([Spec(1)])[0]
        keyed = a.allocate([Spec(1, key=b"k", content_type="kv_cache")])[0]
        st = a.stats()
        for method, req in (
            ("Pin", pb.PinRequest(object_ids=[anon.object_id])),
            ("Prepare", pb.PrepareRequest(pin_object_ids=[anon.object_id])),
        ):
            with pytest.raises(grpc.RpcError) as e:
                getattr(stub, method)(req, metadata=md(b))
            assert e.value.code() == S.NOT_FOUND and e.value.details() == f"no object {anon.object_id}", method
        after = a.stats()
        assert (after.pinned_pages, after.objects, after.open_transactions) == (st.pinned_pages, st.objects, 0)
        # Keyed committed objects are anyone's; the owner still pins its own.
        assert b.pin([keyed])[0].total_pins == 1
        assert a.pin([anon])[0].session_pins == 1


# ------------------------------------------------------------- bounds and hygiene


def test_sessions_are_bounded_in_all_and_per_uid(broker_factory):
    cfg = config_file("security:\n  max_sessions: 2\n  max_sessions_per_uid: 2\n")
    b = broker_factory("--config", cfg)
    c1, c2 = BrokerClient.connect(b.socket), BrokerClient.connect(b.socket)
    try:
        with pytest.raises(BrokerError) as e:
            BrokerClient.connect(b.socket)
        # Two proven sessions: the limit in all, refused at Attach (and the uid's limit too).
        assert e.value.code == Code.RESOURCE_EXHAUSTED and "max_sessions" in e.value.message
        with grpc.insecure_channel(f"unix:{b.socket}") as ch:
            stub = broker_pb2_grpc.MemoryBrokerStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                next(stub.Attach(iter([pb.AttachRequest(hello=pb.Hello(client_name="third"))])))
            assert e.value.code() == S.RESOURCE_EXHAUSTED and "max_sessions" in e.value.details()
        c2.close()
        time.sleep(0.3)
        with BrokerClient.connect(b.socket) as c3:  # room again
            assert c3.stats().sessions == 2
    finally:
        c1.close()
        c2.close()


def test_idle_connections_are_closed(broker_factory):
    cfg = config_file("listeners:\n  idle_timeout: 1s\n")
    b = broker_factory("--config", cfg)
    states: list = []
    with grpc.insecure_channel(f"unix:{b.socket}") as ch:
        ch.subscribe(states.append, try_to_connect=False)
        broker_pb2_grpc.MemoryBrokerStub(ch).GetStats(pb.GetStatsRequest(), timeout=5)
        ready, idle = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.IDLE

        def closed_after_ready() -> bool:
            seen = list(states)  # the callbacks arrive on another thread
            return ready in seen and idle in seen[seen.index(ready) :]

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not closed_after_ready():
            time.sleep(0.1)
        assert closed_after_ready(), states


def test_fd_channel_bounds_connections_per_uid():
    async def main():
        path = os.path.join(short_tmpdir(), "fds.sock")
        srv = FdChannelServer(
            path, allowed_uids=None, authorize=lambda t, p: None, slab_fds=lambda k: [], max_connections_per_uid=2
        )
        await srv.start()
        loop = asyncio.get_running_loop()
        held = []
        try:
            for _ in range(2):  # two connections that never send their request
                s = socket.socket(socket.AF_UNIX)
                s.connect(path)
                held.append(s)
            await asyncio.sleep(0.2)
            try:
                await loop.run_in_executor(None, lambda: fetch_slab_fds(path, "t", 0, timeout=3))
            except FdChannelError as e:
                return e
            return None
        finally:
            for s in held:
                s.close()
            await srv.close()

    err = asyncio.run(main())
    assert err is not None and err.code == "RESOURCE_EXHAUSTED" and "uid" in err.message


def test_a_fetch_refused_only_for_busy_connections_is_retried_within_its_timeout():
    async def main():
        path = os.path.join(short_tmpdir(), "fds.sock")
        slab = os.memfd_create("slab", os.MFD_CLOEXEC)
        srv = FdChannelServer(
            path, allowed_uids=None, authorize=lambda t, p: None, slab_fds=lambda k: [slab], max_connections_per_uid=2
        )
        await srv.start()
        loop = asyncio.get_running_loop()
        held = []
        try:
            for _ in range(2):  # the uid's cap, held by connections that never send a request
                s = socket.socket(socket.AF_UNIX)
                s.connect(path)
                held.append(s)
            await asyncio.sleep(0.2)
            fetch = loop.run_in_executor(None, lambda: fetch_slab_fds(path, "t", 0, timeout=5))
            await asyncio.sleep(0.5)  # refused as busy meanwhile, then a slot frees
            held.pop().close()
            fds = await fetch
            for fd in fds:
                os.close(fd)
            return len(fds)
        finally:
            for s in held:
                s.close()
            await srv.close()
            os.close(slab)

    assert asyncio.run(main()) == 1
