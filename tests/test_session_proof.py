"""Issue 26, items 6, 7 and 9 (defaults): a session acts only for the process that proved it.

The token from Attach is not a credential on its own: every session-bearing call must also
carry the session's proof key, which the broker hands only to the owner process, on the fd
channel. Sessions never proven are closed at a deadline and capped, so a flood of Attach
streams keeps no client out; the per-uid cap counts every session that can act. Defaults:
the broker's own uid is always allowed, adapters are managed by the broker's uid and root,
and a socket group makes the sockets 0660.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys

import grpc
import pytest
from adapter_fixtures import peft_dirs  # noqa: F401 - fixture
from conftest import ROOT, child_code, short_tmpdir

from memory_broker.broker.doors.policy import POLICY
from memory_broker.broker.server.options import ServeOptions, socket_mode
from memory_broker.broker.sessions.manager import SessionManager
from memory_broker.broker.sessions.peer import FdRequestRefused, PeerCred
from memory_broker.clients import BrokerClient, BrokerError, Code, Spec
from memory_broker.proto.wire.session import KEY_METADATA, SESSION_METADATA
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc

S = grpc.StatusCode
KV = pb.CONTENT_TYPE_KV_CACHE
SERVICE = pb.DESCRIPTOR.services_by_name["MemoryBroker"]
SESSION_METHODS = sorted(m for m, r in POLICY.items() if r.session)


def _requests(anon: int, keyed: int, txn: int, adapter_path: str) -> dict[str, object]:
    """For each session-bearing RPC, a request that the victim itself could make and that
    would touch the victim's objects, transaction, lease or adapters."""
    return {
        "Allocate": pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=KV)]),
        "Prepare": pb.PrepareRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=KV)], pin_object_ids=[keyed]),
        "Commit": pb.CommitRequest(transaction_ids=[txn]),
        "Abort": pb.AbortRequest(transaction_ids=[txn]),
        "Free": pb.FreeRequest(object_ids=[anon, keyed]),
        "Pin": pb.PinRequest(object_ids=[anon]),
        "Unpin": pb.UnpinRequest(object_ids=[keyed]),
        "Lookup": pb.LookupRequest(keys=[b"victim"], pin=True),
        "RegisterAdapter": pb.RegisterAdapterRequest(adapter_id="squat", path=adapter_path),
        "UnregisterAdapter": pb.UnregisterAdapterRequest(adapter_ids=["r4"]),
        "PrefetchAdapters": pb.PrefetchAdaptersRequest(adapter_ids=["r4"]),
        "ListAdapters": pb.ListAdaptersRequest(),
        "GetAdapterLayout": pb.GetAdapterLayoutRequest(adapter_id="r4"),
        "AcquireAdapters": pb.AcquireAdaptersRequest(adapter_ids=["r4"]),
        "ReleaseAdapters": pb.ReleaseAdaptersRequest(adapter_ids=["r4"]),
        "VerifyAdapters": pb.VerifyAdaptersRequest(adapter_ids=["r4"]),
        "VerifyObjects": pb.VerifyObjectsRequest(keys=[b"victim"]),
        "EngineKvRegister": pb.EngineKvRegisterRequest(name="squat", group_pages=1),
        "EngineKvGrow": pb.EngineKvGrowRequest(groups=1),
        "EngineKvShrink": pb.EngineKvShrinkRequest(object_ids=[anon]),
    }


# The thief: another process, given the victim's token (as if read from its environment or
# memory). It tries the token alone, with a made-up key, and after presenting the token on
# the fd channel itself (refused: the session is another process's), every session-bearing
# RPC, and prints each outcome.
THIEF = """
import grpc
from memory_broker.clients.fd_channel import FdChannelError, prove_session
from memory_broker.proto.wire.session import KEY_METADATA, SESSION_METADATA
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc
loot = json.loads(sys.stdin.read())
try:
    prove_session(loot["fd_socket"], loot["token"], timeout=5)
    out(fd="served")
except FdChannelError as e:
    out(fd=e.code, message=e.message)
stub = broker_pb2_grpc.MemoryBrokerStub(grpc.insecure_channel("unix:" + SOCKET))
service = pb.DESCRIPTOR.services_by_name["MemoryBroker"]
for method, raw in loot["requests"].items():
    req = getattr(pb, service.methods_by_name[method].input_type.name).FromString(bytes.fromhex(raw))
    for how, md in (
        ("token", ((SESSION_METADATA, loot["token"]),)),
        ("token+guess", ((SESSION_METADATA, loot["token"]), (KEY_METADATA, "0" * 32))),
    ):
        try:
            getattr(stub, method)(req, metadata=md, timeout=10)
            out(method=method, how=how, code="OK")
        except grpc.RpcError as e:
            out(method=method, how=how, code=e.code().name, message=e.details())
"""


def _victim_state(c: BrokerClient) -> tuple:
    st = c.stats()
    listing = c.list_adapters()
    return (
        st.objects,
        st.used_pages,
        st.pinned_pages,
        st.open_transactions,
        st.adapters.registered,
        sorted((a.adapter_id, a.pin_count) for a in listing.adapters),
    )


def test_a_foreign_process_holding_the_token_is_refused_on_every_session_call(broker_factory, peft_dirs):  # noqa: F811
    b = broker_factory("--pool-size", "64MiB", "--slab-size", "4MiB", "--adapter-dtype", "float32")
    with BrokerClient.connect(b.socket, client_name="victim", fast_path=False) as victim:
        victim.register_adapter("r4", peft_dirs["r4"])
        (anon,) = victim.allocate([Spec(1)])
        (keyed,) = victim.allocate([Spec(1, key=b"victim", pin=True)])
        txn = victim.prepare([Spec(1, key=b"pending")])
        lease = victim.acquire_adapters(["r4"])
        requests = _requests(anon.object_id, keyed.object_id, txn.transaction_id, peft_dirs["r4"])
        assert sorted(requests) == SESSION_METHODS, "a session-bearing RPC without a theft case"
        before = _victim_state(victim)
        loot = {
            "token": victim.token,
            "fd_socket": victim.arena.fd_socket_path,
            "requests": {m: r.SerializeToString().hex() for m, r in requests.items()},
        }
        r = subprocess.run(
            [sys.executable, "-c", child_code(b.socket, THIEF)],
            cwd=ROOT,
            input=json.dumps(loot),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        assert lines[0]["fd"] == "PERMISSION_DENIED", lines[0]
        outcomes = {(x["method"], x["how"]): x for x in lines[1:]}
        assert {m for m, _ in outcomes} == set(SESSION_METHODS)
        for (method, how), x in outcomes.items():
            assert x["code"] == "PERMISSION_DENIED", (method, how, x)
            assert "key" in x["message"] and KEY_METADATA in x["message"], (method, how, x["message"])
        # Nothing of the victim's changed, and all of it still works for the victim.
        assert _victim_state(victim) == before
        assert victim.lookup([b"victim"], pin=False)[0].object_id == keyed.object_id
        victim.commit([txn])
        victim.release_adapters(["r4"])
        del lease
        victim.free([anon, keyed])


def test_an_unproven_session_can_do_nothing_but_prove_itself(broker_factory):
    b = broker_factory()
    with grpc.insecure_channel(f"unix:{b.socket}") as ch:
        stub = broker_pb2_grpc.MemoryBrokerStub(ch)
        # What grpcurl does: Attach, then calls with the token, never touching the fd channel.
        stream = stub.Attach(iter([pb.AttachRequest(hello=pb.Hello(client_name="bare"))]))
        token = next(stream).opened.token
        for method in SESSION_METHODS:
            req = getattr(pb, SERVICE.methods_by_name[method].input_type.name)()
            with pytest.raises(grpc.RpcError) as e:
                getattr(stub, method)(req, metadata=((SESSION_METADATA, token),), timeout=10)
            assert e.value.code() == S.PERMISSION_DENIED and "not proven" in e.value.details(), method
        stats = stub.GetStats(pb.GetStatsRequest())  # sessionless calls are served
        assert stats.sessions == 1 and stats.used_pages == 0
        stream.cancel()


class _Store:
    """The two calls SessionManager makes on the store for a session's life."""

    def __init__(self):
        self.next, self.ended = 0, []

    def open_session(self) -> int:
        self.next += 1
        return self.next

    def end_session(self, sid: int) -> None:
        self.ended.append(sid)


ME = PeerCred(os.getpid(), os.getuid(), os.getgid())


def test_an_unproven_session_is_closed_at_its_deadline_and_a_proven_one_is_not():
    async def main():
        store = _Store()
        m = SessionManager(store, None, unproven_deadline_s=0.05)
        idle, proven = m.open("idle", 1), m.open("engine", 2)
        key = m.authorize_fd_request(proven.token, ME)
        assert key == proven.key and len(key) == 32 and key != proven.token
        await asyncio.sleep(0.2)
        assert idle.closed and store.ended == [idle.session_id] and idle.events.get_nowait() is not None
        assert not proven.closed and m.unproven == 0
        # The owner asks again (more fds): the same key; nobody else gets it.
        assert m.authorize_fd_request(proven.token, ME) == key
        with pytest.raises(FdRequestRefused) as e:
            m.authorize_fd_request(proven.token, PeerCred(ME.pid + 1, ME.uid, ME.gid))
        assert e.value.code == "PERMISSION_DENIED"

    asyncio.run(main())


def test_unproven_sessions_are_capped_in_all_and_do_not_count_against_proven_ones():
    async def main():
        m = SessionManager(_Store(), None, max_sessions=2, max_sessions_per_uid=1, max_unproven=4)
        flood = [m.open("flood", 1) for _ in range(50)]
        assert m.unproven == 4 and sum(not s.closed for s in flood) == 4  # the oldest were closed
        a = m.open("a", 2)
        m.authorize_fd_request(a.token, ME)
        # One uid owns one session (the per-uid cap, at proof) ...
        extra = m.open("extra", 2)
        with pytest.raises(FdRequestRefused) as e:
            m.authorize_fd_request(extra.token, ME)
        assert e.value.code == "RESOURCE_EXHAUSTED" and "max_sessions_per_uid" in e.value.message
        # ... and another uid still gets in, despite the flood.
        other = m.open("b", 3)
        m.authorize_fd_request(other.token, PeerCred(ME.pid + 1, ME.uid + 1, ME.gid))
        # Two proven sessions: the broker's limit, at Attach.
        with pytest.raises(BrokerError) as e2:
            m.open("c", 4)
        assert e2.value.code == Code.RESOURCE_EXHAUSTED and "max_sessions" in e2.value.message

    asyncio.run(main())


def test_a_uid_not_allowed_cannot_prove_a_session():
    async def main():
        m = SessionManager(_Store(), None, allowed_uids=frozenset({ME.uid}))
        s = m.open("stranger", 1)
        with pytest.raises(FdRequestRefused) as e:
            m.authorize_fd_request(s.token, PeerCred(ME.pid, ME.uid + 1000, ME.gid))
        assert e.value.code == "PERMISSION_DENIED" and "allowed_uids" in e.value.message
        assert s.caller is None

    asyncio.run(main())


def _attach(stub) -> grpc.Call | None:
    """An Attach stream that never proves itself (None: refused)."""
    stream = stub.Attach(iter([pb.AttachRequest(hello=pb.Hello(client_name="flood"))]))
    try:
        next(stream)
    except grpc.RpcError:
        return None
    return stream


def test_a_flood_of_unproven_sessions_keeps_no_client_out_and_a_uid_owns_at_most_its_cap(broker_factory):
    b = broker_factory("--max-sessions", "64", "--max-sessions-per-uid", "8")
    channels = [grpc.insecure_channel(f"unix:{b.socket}") for _ in range(4)]
    streams = []
    clients: list[BrokerClient] = []
    try:
        # One uid opens 128 Attach streams that never touch the fd channel.
        for i in range(128):
            streams.append(_attach(broker_pb2_grpc.MemoryBrokerStub(channels[i % 4])))
        assert all(s is not None for s in streams), "an Attach was refused during the flood"
        # A legitimate client of the same uid connects during the flood, and works.
        for _ in range(8):
            c = BrokerClient.connect(b.socket, fast_path=False)
            clients.append(c)
            c.free(c.allocate([Spec(1)]))
        # The flood holds at most 64 sessions (the oldest were closed as new ones came).
        assert clients[0].stats().sessions <= 64 + len(clients)
        # A uid owns at most max_sessions_per_uid sessions that can act.
        with pytest.raises(BrokerError) as e:
            BrokerClient.connect(b.socket, fast_path=False)
        assert e.value.code == Code.RESOURCE_EXHAUSTED and "max_sessions_per_uid" in e.value.message
    finally:
        for c in clients:
            c.close()
        for s in streams:
            if s is not None:
                s.cancel()
        for ch in channels:
            ch.close()


# ------------------------------------------------------------------ defaults that fit a host


def test_the_brokers_own_uid_is_always_allowed_and_manages_adapters_with_root():
    opts = ServeOptions(allowed_uids=(4242,))
    assert opts.effective_uids() == {4242, os.getuid(), 0}
    assert ServeOptions().effective_uids() == {os.getuid(), 0}
    # Managing adapters: the broker's uid and root, not every allowed (engine) uid.
    assert opts.manager_uids() == {os.getuid(), 0}
    # A uid that manages adapters may use the broker.
    managed = ServeOptions(adapter_manager_uids=(7,))
    assert managed.manager_uids() == {7} and managed.effective_uids() == {os.getuid(), 7}


def test_a_socket_group_without_a_mode_makes_the_sockets_0660(broker_factory):
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    assert socket_mode(ServeOptions(socket_group=group)) == 0o660
    assert socket_mode(ServeOptions()) is None
    assert socket_mode(ServeOptions(socket_group=group, socket_mode=0o600)) == 0o600
    old = os.umask(0o022)
    try:
        b = broker_factory("--socket-group", group)
    finally:
        os.umask(old)
    for path in (b.socket, b.socket + ".fds", b.socket + ".step"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660, path


NOBODY = 65534
# A client as another uid (the test runs as root): it may reach the sockets (0666), open a
# session, and read GetStats, but proves nothing unless the broker allows its uid.
STRANGER = """
os.setgid(65534)
os.setuid(65534)
import grpc
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc
stub = broker_pb2_grpc.MemoryBrokerStub(grpc.insecure_channel("unix:" + SOCKET))
out(stats_sessions=stub.GetStats(pb.GetStatsRequest()).sessions)
try:
    c = BrokerClient.connect(SOCKET)
    c.allocate([Spec(1)])
    out(connect="OK")
except BrokerError as e:
    out(connect=e.code.name, message=e.message)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="runs a client as another uid: needs root")
def test_allowed_uids_gate_the_proof_and_the_brokers_uid_stays_allowed(broker_factory):
    from conftest import run_child

    b = broker_factory("--allow-uid", "4242", "--socket-mode", "0666")
    os.chmod(os.path.dirname(b.socket), 0o711)  # the stranger may reach the sockets
    # The broker's own uid (root here) is allowed although --allow-uid names another.
    with BrokerClient.connect(b.socket) as mine:
        mine.free(mine.allocate([Spec(1)]))
    (stats, refused) = run_child(b.socket, STRANGER)
    assert stats["stats_sessions"] == 0  # sessionless calls: the socket's mode decides
    assert refused["connect"] == "PERMISSION_DENIED" and "allowed" in refused["message"], refused
    b2 = broker_factory("--allow-uid", str(NOBODY), "--socket-mode", "0666")
    os.chmod(os.path.dirname(b2.socket), 0o711)
    assert run_child(b2.socket, STRANGER)[1]["connect"] == "OK"


def test_a_session_lost_to_a_broker_restart_is_proven_again(broker_factory):
    d = short_tmpdir()
    sock = os.path.join(d, "b.sock")
    b = broker_factory(socket=sock)
    with BrokerClient.connect(sock, reconnect_s=30, fast_path=False) as c:
        first = c.metadata
        b.stop()
        broker_factory(socket=sock)
        # The first call after the restart waits for the new session, proven with a new key.
        (obj,) = c.allocate([Spec(1)])
        assert c.reconnects == 1 and c.metadata != first and dict(c.metadata)[KEY_METADATA]
        c.free([obj])


def test_a_process_that_keeps_one_session_and_cycles_others_leaves_one_watch_behind():
    """Each proven session watches its process; one that ends while the process lives on
    takes its callback with it (they used to pile up until the process exited: memory that
    grew with every session a long-lived client opened), and the process's exit still ends
    the sessions it holds."""

    async def main():
        from memory_broker.broker.sessions.liveness import PidWatcher

        watcher = PidWatcher(asyncio.get_running_loop())
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            m = SessionManager(_Store(), watcher)
            peer = PeerCred(p.pid, ME.uid, ME.gid)
            kept = m.open("kept", 1)
            m.authorize_fd_request(kept.token, peer)
            for i in range(200):
                s = m.open(f"short-{i}", 2)
                m.authorize_fd_request(s.token, peer)
                m.close(s.session_id, "client closed")
            assert watcher.callbacks(p.pid) == 1
            last = m.open("last", 3)
            m.authorize_fd_request(last.token, peer)
            assert watcher.callbacks(p.pid) == 2
            p.kill()
            for _ in range(100):
                if kept.closed and last.closed:
                    break
                await asyncio.sleep(0.01)
            assert kept.closed and last.closed and not watcher.watching(p.pid)
        finally:
            watcher.close()
            p.kill()
            p.wait()

    asyncio.run(main())


def test_a_reload_that_removes_a_uid_ends_its_sessions_and_their_pins_go():
    """Issue 48, item 6, the manager's part: proven sessions of a uid the reload dropped are
    closed (the store releases what each held), the others and unproven ones are not."""

    async def main():
        store = _Store()
        m = SessionManager(store, None, allowed_uids=frozenset({ME.uid, ME.uid + 1000}))
        kept, gone, waiting = m.open("kept", 1), m.open("gone", 2), m.open("waiting", 3)
        m.authorize_fd_request(kept.token, ME)
        m.authorize_fd_request(gone.token, PeerCred(ME.pid, ME.uid + 1000, ME.gid))
        assert m.set_allowed_uids(frozenset({ME.uid})) == [gone.session_id]
        assert gone.closed and store.ended == [gone.session_id] and not kept.closed and not waiting.closed
        assert gone.session_id not in m.by_id
        with pytest.raises(BrokerError) as e:
            m.from_token(gone.token)
        assert e.value.code == Code.PERMISSION_DENIED
        assert m.set_allowed_uids(None) == [] and not kept.closed

    asyncio.run(main())


# A process of a uid the broker allows by its config file: it pins pages (one keyed object),
# writes them, and after the test's reload tries a call and reads its pages again.
REVOKED = """
import torch  # before the uid changes: this machine's Python may be unreadable to nobody
os.setgid(65534)
os.setuid(65534)
c = BrokerClient.connect(SOCKET, reconnect_s=0)
anon, kv = c.allocate([Spec(2, pin=True), Spec(1, pin=True, key=b"revoked-kv")])
for o in (anon, kv):
    for t in o.page_tensors(torch.uint8):
        t.fill_(0x5A)
out(ready=True)
sys.stdin.readline()
try:
    c.allocate([Spec(1)])
    out(after="OK")
except BrokerError as e:
    out(after=e.code.name, message=e.message)
out(still_reads=all(bool((t == 0x5A).all()) for o in (anon, kv) for t in o.page_tensors(torch.uint8)))
"""


@pytest.mark.skipif(os.getuid() != 0, reason="runs a client as another uid: needs root")
def test_a_uid_removed_by_a_reload_loses_its_sessions_and_pins_at_once(broker_factory, tmp_path):
    import signal
    import time

    cfg = tmp_path / "broker.yaml"
    cfg.write_text(f"security:\n  allowed_uids: [{NOBODY}]\n")
    b = broker_factory("--config", str(cfg), "--socket-mode", "0666")
    os.chmod(os.path.dirname(b.socket), 0o711)
    child = subprocess.Popen(
        [sys.executable, "-c", child_code(b.socket, REVOKED)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert line.startswith("{"), child.stderr.read()
        assert json.loads(line) == {"ready": True}
        with BrokerClient.connect(b.socket) as mine:
            st = mine.stats()
            assert st.sessions == 2 and st.pinned_pages == 3
            cfg.write_text("security:\n  allowed_uids: []\n")
            b.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 5
            while mine.stats().sessions != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            st = mine.stats()
            assert st.sessions == 1 and st.pinned_pages == 0, st
            # Its keyed committed object stays for others (ownerless, as when a process exits).
            assert [o.key for o in mine.lookup([b"revoked-kv"])] == [b"revoked-kv"]
        (revoked,) = [e for e in b.log_events() if e.get("event") == "sessions_revoked"]
        assert len(revoked["sessions"]) == 1 and NOBODY not in revoked["allowed_uids"]
        out, err = child.communicate("go\n", timeout=60)
        got = {k: v for line in out.splitlines() if line.startswith("{") for k, v in json.loads(line).items()}
        assert got["after"] in ("UNAVAILABLE", "PERMISSION_DENIED"), got  # its session is gone
        # What the broker cannot take back: the pages the process had mapped (docs/security.md).
        assert got["still_reads"] is True, (got, err)
    finally:
        child.kill()
        child.wait()
