"""Seeded fuzzing of every RPC against one live broker: malformed and out-of-range fields,
missing, forged and foreign session tokens, and a token without its proof key. Every answer must be a deliberate status (never
INTERNAL or UNKNOWN), come within a bound, and a refused call must leave the pool and the
adapter registry exactly as they were."""

from __future__ import annotations

import os
import random
import time

import grpc
import pytest
from adapter_fixtures import copy_adapter, peft_dirs  # noqa: F401 - fixture
from conftest import short_tmpdir
from google.protobuf.descriptor import FieldDescriptor as FD

from memory_broker.broker.doors.service import POLICY
from memory_broker.clients import BrokerClient, Spec
from memory_broker.proto.wire.session import SESSION_METADATA
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

SEED = int(os.environ.get("FUZZ_SEED", "1107"))
REQUESTS = int(os.environ.get("FUZZ_REQUESTS", "2400"))
# Slowest answer accepted for one call (a hang or a read of /dev/zero would blow it).
BOUND_S = 5.0
SERVICE = pb.DESCRIPTOR.services_by_name["MemoryBroker"]
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}

U32, U64, I64 = (1 << 32) - 1, (1 << 64) - 1, (1 << 63) - 1
UINT_TYPES = {FD.TYPE_UINT32: U32, FD.TYPE_FIXED32: U32, FD.TYPE_UINT64: U64, FD.TYPE_FIXED64: U64}
INT_TYPES = {
    FD.TYPE_INT32: (1 << 31) - 1,
    FD.TYPE_SINT32: (1 << 31) - 1,
    FD.TYPE_SFIXED32: (1 << 31) - 1,
    FD.TYPE_INT64: I64,
    FD.TYPE_SINT64: I64,
    FD.TYPE_SFIXED64: I64,
}


class Gen:
    """Random field values, biased towards edges and towards ids and names that exist."""

    def __init__(self, rng: random.Random, world: dict):
        self.rng = rng
        self.world = world

    def uint(self, top: int) -> int:
        r = self.rng.random()
        ids = self.world["ids"]
        if r < 0.3 and ids:
            return self.rng.choice(ids) & top
        if r < 0.6:
            return self.rng.choice([0, 1, 2, 3, 4, 63, 64, 65, 1000, top, top - 1, 1 << 31, 1 << 20]) & top
        return self.rng.randint(0, top)

    def sint(self, top: int) -> int:
        return self.rng.choice([0, -1, 1, -top - 1, top, self.rng.randint(-top - 1, top)])

    def text(self, name: str) -> str:
        rng = self.rng
        pool = [
            "",
            "\x00",
            "a\x00b",
            "r4",
            "missing",
            "x" * 300,
            "é🙂",
            "../../etc",
            "/",
            ".",
            "-",
            "a" * 5000,
            "r4\x00",
            " ",
            "%s%n",
            "\n",
            "*",
        ]
        if "path" in name:
            pool += self.world["paths"]
        if "adapter" in name or name == "prefix":
            pool += ["r4", "r4", "r8", "nope", "r4/" * 90]
        return rng.choice(pool)

    def data(self) -> bytes:
        return self.rng.choice([b"", b"\x00", b"k", b"present", os.urandom(8), b"k" * 5000, b"\xff" * 64])

    def scalar(self, f):
        t = f.type
        if t in UINT_TYPES:
            return self.uint(UINT_TYPES[t])
        if t in INT_TYPES:
            return self.sint(INT_TYPES[t])
        if t == FD.TYPE_BOOL:
            return self.rng.random() < 0.5
        if t == FD.TYPE_STRING:
            return self.text(f.name)
        if t == FD.TYPE_BYTES:
            return self.data()
        if t == FD.TYPE_ENUM:
            return self.rng.choice([0, 1, 2, 3, 4, 5, 99, (1 << 31) - 1, -1] + [v.number for v in f.enum_type.values])
        if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
            return self.rng.choice([0.0, -1.0, 1e300, float("nan"), float("inf")])
        raise AssertionError(f"unhandled field type {t} of {f.full_name}")

    def fill(self, msg, depth: int = 0):
        for f in msg.DESCRIPTOR.fields:
            if self.rng.random() < 0.3:
                continue  # left at its default
            repeated = f.is_repeated
            if f.type == FD.TYPE_MESSAGE:
                if depth > 2:
                    continue
                n = self.rng.choice([0, 1, 1, 2, 3, 17]) if repeated else 1
                for _ in range(n):
                    sub = getattr(msg, f.name).add() if repeated else getattr(msg, f.name)
                    self.fill(sub, depth + 1)
                    if not repeated:
                        sub.SetInParent()
                continue
            if repeated:
                r = self.rng.random()
                n = 70_000 if r < 0.01 else self.rng.choice([0, 1, 1, 2, 3, 5, 65])
                if n == 70_000:
                    v = self.scalar(f)
                    getattr(msg, f.name).extend([v] * n)
                else:
                    getattr(msg, f.name).extend(self.scalar(f) for _ in range(n))
            else:
                setattr(msg, f.name, self.scalar(f))
        return msg


def snapshot(stub, metadata: tuple) -> tuple:
    st = stub.GetStats(pb.GetStatsRequest(), timeout=BOUND_S)
    keep = (
        "used_pages",
        "free_pages",
        "prepared_pages",
        "pinned_pages",
        "objects",
        "keyed_objects",
        "open_transactions",
        "window_free_pages",
        "sessions",
    )
    listing = stub.ListAdapters(pb.ListAdaptersRequest(limit=1000), metadata=metadata, timeout=BOUND_S)
    adapters = tuple((a.adapter_id, a.tier, a.pin_count, a.generation) for a in listing.adapters)
    return tuple(getattr(st, k) for k in keep) + (st.adapters.registered, adapters)


@pytest.fixture
def fuzz_world(broker_factory, peft_dirs):  # noqa: F811
    b = broker_factory("--pool-size", "64MiB", "--slab-size", "4MiB", "--adapter-dtype", "float32")
    owner = BrokerClient.connect(b.socket, client_name="fuzz-owner")
    other = BrokerClient.connect(b.socket, client_name="fuzz-other")
    owner.register_adapter("r4", peft_dirs["r4"])
    kept = owner.allocate([Spec(2, content_type="kv_cache", key=b"present", pin=True), Spec(1)])
    txn = owner.prepare([Spec(1)], lease_s=590)
    evil = copy_adapter(peft_dirs["r4"], os.path.join(short_tmpdir(), "evil"))
    os.unlink(os.path.join(evil, "adapter_config.json"))
    os.symlink("/dev/zero", os.path.join(evil, "adapter_config.json"))
    world = {
        "ids": [o.object_id for o in kept] + [o.object_id for o in txn.objects] + [txn.transaction_id],
        "paths": [
            peft_dirs["r8"],
            peft_dirs["r4"],
            evil,
            "/dev/zero",
            "/proc/self/mem",
            "/etc",
            "/nonexistent",
            peft_dirs["r4"] + "/adapter_config.json",
            b.socket,
        ],
        "metadata": {"owner": owner.metadata, "other": other.metadata},
        "deadlines": [txn.deadline_unix_ms / 1000],
    }
    ch = grpc.insecure_channel(f"unix:{b.socket}", options=[("grpc.max_send_message_length", 64 << 20)])
    yield b, broker_pb2_grpc.MemoryBrokerStub(ch), world
    ch.close()
    other.close()
    owner.close()


def test_fuzz_every_rpc_gets_a_deliberate_status_in_bounded_time_and_refusals_change_nothing(fuzz_world):
    b, stub, world = fuzz_world
    rng = random.Random(SEED)
    gen = Gen(rng, world)
    unary = [m for m in SERVICE.methods if not m.client_streaming and not m.server_streaming]
    assert {m.name for m in unary} | {"Attach"} == set(POLICY)
    owner, other = world["metadata"]["owner"], world["metadata"]["other"]
    token_only = ((SESSION_METADATA, dict(owner)[SESSION_METADATA]),)  # the owner's token, no key
    tokens = [(), *(((SESSION_METADATA, t),) for t in ("", "f" * 32, "not a token", "a" * 8000)), other, token_only]
    tokens += [owner] * 4
    counts: dict[str, dict[str, int]] = {}
    slowest = 0.0
    history: list[str] = []
    # Lease deadlines (unix s) of transactions calls opened: their expiry changes the pool on
    # its own, so a refusal whose window holds one is not compared (counted, and bounded).
    deadlines: list[float] = world["deadlines"]
    refused = unchecked = 0
    t_start = time.monotonic()
    for i in range(REQUESTS):
        m = unary[i % len(unary)] if i < 2 * len(unary) else rng.choice(unary)
        req = gen.fill(getattr(pb, m.input_type.name)())
        metadata = rng.choice(tokens)
        before = snapshot(stub, owner)
        u0 = time.time()
        t0 = time.monotonic()
        try:
            resp = getattr(stub, m.name)(req, metadata=metadata, timeout=BOUND_S)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            detail = e.details()
        took = time.monotonic() - t0
        slowest = max(slowest, took)
        counts.setdefault(m.name, {}).setdefault(code.name, 0)
        counts[m.name][code.name] += 1
        where = f"request {i} (seed {SEED}): {m.name}({str(req)[:300]!r}) metadata={str(metadata)[:80]}"
        history.append(f"{m.name} -> {code.name}")
        where += f"; before it: {history[-4:-1]}"
        assert code not in BAD, f"{where} -> {code.name}: {detail}"
        assert took < BOUND_S, f"{where} took {took:.2f} s"
        if code != grpc.StatusCode.OK:
            assert detail, f"{where} -> {code.name} with no message"
            after = snapshot(stub, owner)
            refused += 1
            if any(u0 - 0.5 <= d <= time.time() + 0.5 for d in deadlines):
                unchecked += 1
            else:
                assert after == before, f"{where} -> {code.name} changed state"
        else:
            # Keep ids that calls hand out in the pool, so later calls name real objects.
            for f in resp.DESCRIPTOR.fields:
                if f.is_repeated and f.type == FD.TYPE_MESSAGE and "object_id" in f.message_type.fields_by_name:
                    world["ids"].extend(o.object_id for o in getattr(resp, f.name) if o.object_id)
            if hasattr(resp, "transaction_id") and resp.transaction_id:
                world["ids"].append(resp.transaction_id)
            if getattr(resp, "deadline_unix_ms", 0):
                deadline = resp.deadline_unix_ms / 1000
                if deadline < time.time() + 300:
                    # It would expire during the run, changing the pool on its own: end it now.
                    stub.Abort(
                        pb.AbortRequest(transaction_ids=[resp.transaction_id]), metadata=metadata, timeout=BOUND_S
                    )
                else:
                    deadlines.append(deadline)
            del world["ids"][:-64]
    # Malformed session streams: no hello, detach first, an empty stream, an oversized name.
    sessions = stub.GetStats(pb.GetStatsRequest()).sessions
    for msgs in ([], [pb.AttachRequest(detach=pb.Detach())], [pb.AttachRequest()]):
        stream = stub.Attach(iter(msgs), timeout=BOUND_S)
        try:
            for _ in stream:
                pass
        except grpc.RpcError as e:
            assert e.code() not in BAD, (msgs, e.code(), e.details())
    stream = stub.Attach(iter([pb.AttachRequest(hello=pb.Hello(client_name="n" * 100_000, pid=U32))]), timeout=BOUND_S)
    assert next(stream).opened.token
    stream.cancel()
    time.sleep(0.3)
    assert stub.GetStats(pb.GetStatsRequest()).sessions == sessions
    elapsed = time.monotonic() - t_start
    assert b.proc.poll() is None
    total = sum(sum(c.values()) for c in counts.values())
    assert total == REQUESTS >= 2000
    assert set(counts) == {m.name for m in unary}, counts
    assert unchecked <= refused // 20, (unchecked, refused)
    print(
        f"fuzz: {total} requests ({refused} refused, {unchecked} of them beside a lease expiry) in {elapsed:.1f} s, "
        f"slowest {slowest * 1e3:.0f} ms; {counts}"
    )
