"""Many client processes against one broker: killed at random moments, or doing random
operations side by side. Afterwards nothing leaks (every page is free or an unpinned cache
entry) and the broker's books agree with each other; while they run, no page is ever handed
to two objects at once (each process checks the bytes it wrote are still its own)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from adapter_fixtures import peft_dirs  # noqa: F401  (a fixture)
from conftest import ROOT, start_broker

from memory_broker.clients import BrokerClient

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

# The operations both tests draw from. ``work(c, rng, adapters, steps, tick)`` runs ``steps``
# random operations (forever when None), calling ``tick()`` after each; it returns how many
# times each kind ran, and raises AssertionError when bytes a process wrote changed under it.
WORKER = r"""
import ctypes, os, random, struct
from memory_broker.clients import BrokerClient, BrokerError, Spec

KEYS = [b"churn-key-%d" % i for i in range(12)]


def key_pattern(key: bytes) -> bytes:
    return (key.ljust(16, b".") * 4)[:64]


def fill(c, obj, tag: bytes) -> bytes:
    # The first 64 bytes of every page: the writer's tag and the page's place in the object.
    data = b""
    for i, a in enumerate(obj.page_addresses()):
        head = (tag + struct.pack("<I", i) * 4).ljust(64, b"#")[:64]
        ctypes.memmove(a, head, 64)
        data += head
    return data


def heads(obj) -> bytes:
    return b"".join(ctypes.string_at(a, 64) for a in obj.page_addresses())


def expect(obj, data: bytes, what: str) -> None:
    assert heads(obj) == data, f"{what}: object {obj.object_id} pages {obj.pages} changed under its holder"


def work(c, rng, adapters, steps=None, tick=lambda: None):
    me = struct.pack("<Q", os.getpid() ^ rng.getrandbits(32))
    mine = {}        # object id -> (object, the bytes written): pinned at allocation, never evicted
    loose = []       # unpinned objects of this session: a cache, may be evicted under others
    pinned = []      # extra pins taken on loose objects
    open_txns = []
    leases = []
    counts = {}
    # An engine's running batch (its changes run by a worker thread half the time), whose
    # sequences (adapter, key) arrive and complete at random.
    batch = c.step_batch(background=rng.random() < 0.5)
    seqs = []
    n = 0
    while steps is None or n < steps:
        n += 1
        op = rng.choice(["alloc", "alloc_pin", "alloc_pin", "keyed", "prepare", "commit", "abort", "pin", "unpin",
                         "lookup", "free", "free", "acquire", "release", "batch"])
        if len(mine) > 4:
            op = "free"
        elif len(leases) > 2:
            op = "release"
        try:
            if op in ("alloc", "alloc_pin"):
                for o in c.allocate([Spec(rng.randint(1, 3), contiguous=rng.random() < 0.3, pin=op == "alloc_pin")]):
                    if op == "alloc_pin":
                        mine[o.object_id] = (o, fill(c, o, me + struct.pack("<Q", o.object_id)))
                    else:
                        loose.append(o)
            elif op == "keyed":
                key = rng.choice(KEYS)
                t = c.prepare([Spec(1, content_type="kv_cache", key=key)])
                ctypes.memmove(t.objects[0].page_addresses()[0], key_pattern(key), 64)
                (got,) = t.commit()
            elif op == "prepare":
                t = c.prepare([Spec(rng.randint(1, 2))], pin=[o for o, _ in list(mine.values())[:1]])
                open_txns.append(t)
            elif op == "commit" and open_txns:
                loose.extend(c.commit([open_txns.pop(rng.randrange(len(open_txns)))])[0])
            elif op == "abort" and open_txns:
                c.abort([open_txns.pop(rng.randrange(len(open_txns)))])
            elif op == "pin" and loose:
                o = rng.choice(loose)
                c.pin([o])
                pinned.append(o)
            elif op == "unpin" and pinned:
                c.unpin([pinned.pop(rng.randrange(len(pinned)))])
            elif op == "lookup":
                keys = rng.sample(KEYS, 3)
                found = c.lookup(keys, pin=True)
                for k, o in zip(keys, found):
                    assert heads(o) == key_pattern(k), f"key {k!r}: object {o.object_id} holds other bytes"
                if found:
                    c.unpin(found)
            elif op == "free" and (mine or loose):
                if mine and (not loose or rng.random() < 0.6):
                    oid = rng.choice(list(mine))
                    o, data = mine.pop(oid)
                    expect(o, data, "own pinned object")
                else:
                    o = loose.pop(rng.randrange(len(loose)))
                    pinned = [p for p in pinned if p.object_id != o.object_id]
                c.free([o])
            elif op == "acquire" and adapters:
                leases.append(c.acquire_adapters(rng.sample(adapters, rng.randint(1, len(adapters)))))
            elif op == "release" and leases:
                leases.pop(rng.randrange(len(leases))).release()
            elif op == "batch" and adapters:
                done = rng.sample(seqs, rng.randint(0, min(2, len(seqs))))
                for q in done:
                    seqs.remove(q)
                new = [(rng.choice(adapters), rng.choice(KEYS)) for _ in range(rng.randint(0, 2))]
                d = batch.begin([a for a, _ in new], [a for a, _ in done], [k for _, k in new], [k for _, k in done])
                d = d.result()  # refused: its drops took effect, its adds did not
                seqs += new
                for k, o in zip([k for _, k in new], d.objects):
                    assert heads(o) == key_pattern(k), f"batch key {k!r}: object {o.object_id} holds other bytes"
            else:
                op = "skip"
        except BrokerError as e:
            # Pool full, evicted, lease ended: refusals a busy broker gives; nothing changed.
            if e.code.value not in ("RESOURCE_EXHAUSTED", "NOT_FOUND", "FAILED_PRECONDITION"):
                raise
            op = op + ":" + e.code.value
        counts[op] = counts.get(op, 0) + 1
        tick()
    for o, data in mine.values():
        expect(o, data, "own pinned object at the end")
    batch.release()
    return counts
"""


def _stats_consistent(st) -> None:
    """What GetStats must say with no client left: every used page is an unpinned cache
    entry (a keyed object or a hot adapter), and the books add up."""
    assert st.sessions == 0, st
    assert st.open_transactions == 0 and st.prepared_pages == 0 and st.pinned_pages == 0, st
    assert st.free_pages + st.used_pages == st.max_pages and st.used_pages <= st.capacity_pages, st
    assert st.used_pages == st.evictable_pages, st
    assert st.objects == st.keyed_objects + st.adapters.hot, st
    by_content = {c.content_type: c.pages for c in st.by_content}
    assert sum(by_content.values()) == st.used_pages, st


def _settled_stats(socket: str, timeout: float = 15.0):
    """GetStats over a bare channel (no session of its own) once every session is gone and
    no load or transaction is in flight (or the timeout passed)."""
    import grpc

    from memory_broker.proto.wire.v1 import broker_pb2 as pb
    from memory_broker.proto.wire.v1 import broker_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"unix:{socket}") as ch:
        stub = broker_pb2_grpc.MemoryBrokerStub(ch)
        while True:
            st = stub.GetStats(pb.GetStatsRequest(), timeout=10)
            settled = st.sessions == 0 and st.open_transactions == 0 and st.prepared_pages == 0
            if settled or time.monotonic() > deadline:
                return st
            time.sleep(0.05)


def _register(c: BrokerClient, dirs: dict) -> list[str]:
    ids = []
    for name in ("r4", "r8", "r16"):
        c.register_adapter(name, dirs[name])
        ids.append(name)
    return ids


# Forks every client from one process that imported the library once: 50 Python start-ups
# would take most of a minute on two cores. gRPC is not started in the parent before it forks.
LAUNCHER = r"""
import json, os, random, select, signal, sys, time
sys.setswitchinterval(0.001)
from memory_broker.clients import BrokerClient
exec(compile(WORKER, "worker", "exec"))
SOCKET, N, PARALLEL, SEED, ADAPTERS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
CONNECT = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
rng = random.Random(SEED)
live = {}     # pid -> (read end, kill-after seconds from its first operation, first-op time)
started = killed = ops_seen = 0
signals = {}


def child(seed, w):
    try:
        c = BrokerClient.connect(SOCKET, reconnect_s=0, **CONNECT)
        first = [True]

        def tick():
            if first[0]:
                os.write(w, b"o")
                first[0] = False
        work(c, random.Random(seed), ADAPTERS, None, tick)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        os._exit(3)


while started < N or live:
    while started < N and len(live) < PARALLEL:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child(SEED * 1000 + started, w)
        os.close(w)
        # Some die before their first operation (while connecting), most mid-work.
        live[pid] = (r, rng.choice([0.0] + [rng.uniform(0.0, 0.6)] * 9), None)
        started += 1
    for pid, (r, after, t0) in list(live.items()):
        if t0 is None:
            ready, _, _ = select.select([r], [], [], 0)
            if ready and os.read(r, 1):
                live[pid] = (r, after, time.monotonic())
                ops_seen += 1
                continue
            if after == 0.0:
                t0 = time.monotonic()  # kill while still connecting
            else:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    raise SystemExit(f"client {pid} exited on its own ({status}) before any operation")
                continue
        if time.monotonic() - t0 >= after:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            signals[os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)] = (
                signals.get(os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status), 0) + 1)
            os.close(r)
            del live[pid]
            killed += 1
    time.sleep(0.005)
print(json.dumps({"started": started, "killed": killed, "ops_seen": ops_seen, "signals": signals}))
"""


# How the clients reach the broker: gRPC only, the step channel (the default), and the step
# channel with its holdings cache (releases held back, sent with later frames).
PATHS = pytest.mark.parametrize("connect", [{"fast_path": False}, {}], ids=["grpc", "step"])


@PATHS
def test_fifty_clients_killed_at_random_moments_leak_no_pages(peft_dirs, connect):
    b = start_broker()
    try:
        with BrokerClient.connect(b.socket) as c:
            adapters = _register(c, peft_dirs)
        t0 = time.monotonic()
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                f"WORKER = {WORKER!r}\n" + LAUNCHER,
                b.socket,
                "50",
                "5",
                "11",
                json.dumps(adapters),
                json.dumps(connect),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        # Every client was killed by SIGKILL (none crashed or quit on its own) ...
        assert out["started"] == out["killed"] == 50 and out["signals"] == {"9": 50}, out
        # ... most of them in the middle of their work.
        assert out["ops_seen"] >= 35, out
        st = _settled_stats(b.socket)
        _stats_consistent(st)
        assert st.allocations_total > 50, st
        assert time.monotonic() - t0 < 120
    finally:
        b.stop()


RANDOM_OPS = """
import random
exec(compile(WORKER, "worker", "exec"))
seed, steps, adapters, connect = {seed}, {steps}, {adapters!r}, {connect!r}
with BrokerClient.connect(SOCKET, **connect) as c:
    counts = work(c, random.Random(seed), adapters, steps)
out(counts=counts)
"""


@PATHS
def test_random_operations_from_several_processes_keep_the_books_straight(peft_dirs, connect):
    from conftest import child_code

    b = start_broker()
    try:
        with BrokerClient.connect(b.socket) as c:
            adapters = _register(c, peft_dirs)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"WORKER = {WORKER!r}\n"
                    + child_code(b.socket, RANDOM_OPS.format(seed=seed, steps=400, adapters=adapters, connect=connect)),
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed in range(4)
        ]
        # While they run, the pool's books must balance at every look.
        import grpc

        from memory_broker.proto.wire.v1 import broker_pb2 as pb
        from memory_broker.proto.wire.v1 import broker_pb2_grpc

        looks = 0
        with grpc.insecure_channel(f"unix:{b.socket}") as ch:
            stub = broker_pb2_grpc.MemoryBrokerStub(ch)
            while any(p.poll() is None for p in procs):
                st = stub.GetStats(pb.GetStatsRequest(), timeout=10)
                assert st.free_pages + st.used_pages == st.max_pages and st.used_pages <= st.capacity_pages, st
                assert st.pinned_pages + st.prepared_pages + st.evictable_pages <= st.used_pages, st
                assert sum(c.pages for c in st.by_content) == st.used_pages, st
                looks += 1
                time.sleep(0.05)
            results = []
            for p in procs:
                stdout, stderr = p.communicate(timeout=60)
                assert p.returncode == 0, stdout + stderr
                results.append(json.loads(stdout.strip().splitlines()[-1])["counts"])
        _stats_consistent(_settled_stats(b.socket))
        assert looks > 0
        # Every kind of operation ran, and mostly succeeded.
        total: dict[str, int] = {}
        for counts in results:
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
        for kind in (
            "alloc",
            "alloc_pin",
            "keyed",
            "prepare",
            "commit",
            "pin",
            "unpin",
            "lookup",
            "free",
            "acquire",
            "release",
            "batch",
        ):
            assert total.get(kind, 0) > 0, total
    finally:
        b.stop()
