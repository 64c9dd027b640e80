"""Every RPC answers malformed or out-of-range input with the right status and changes nothing."""

from __future__ import annotations

import grpc
import pytest

from memory_broker.clients import BrokerClient, Spec
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc

KV = pb.CONTENT_TYPE_KV_CACHE
S = grpc.StatusCode


def snapshot(stub) -> dict:
    st = stub.GetStats(pb.GetStatsRequest())
    keep = (
        "used_pages",
        "free_pages",
        "prepared_pages",
        "pinned_pages",
        "evictable_pages",
        "objects",
        "keyed_objects",
        "open_transactions",
        "evicted_objects",
        "window_free_pages",
    )
    return {k: getattr(st, k) for k in keep}


@pytest.fixture
def setup(broker):
    owner = BrokerClient.connect(broker.socket, client_name="owner")
    other = BrokerClient.connect(broker.socket, client_name="other")
    mine = owner.allocate([Spec(2, content_type="kv_cache", key=b"present", pin=True)])[0]
    txn = owner.prepare([Spec(1)])
    ch = grpc.insecure_channel(f"unix:{broker.socket}")
    stub = broker_pb2_grpc.MemoryBrokerStub(ch)
    yield stub, owner, other, mine, txn
    ch.close()
    other.close()
    owner.close()


def md(client) -> tuple:
    """The call metadata of ``client``'s session: its token and the proof key it took on the
    fd channel (a raw stub in the client's own process may act for the session)."""
    return client.metadata


CASES = [
    # (name, method, request builder(mine, txn), who: "owner"/"other"/None, expected status, words in message)
    (
        "allocate zero pages",
        "Allocate",
        lambda m, t: pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=0, content_type=KV)]),
        "owner",
        S.INVALID_ARGUMENT,
        "num_pages",
    ),
    (
        "allocate more than the arena",
        "Allocate",
        lambda m, t: pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=10**6, content_type=KV)]),
        "owner",
        S.INVALID_ARGUMENT,
        "num_pages",
    ),
    (
        "allocate without content type",
        "Allocate",
        lambda m, t: pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1)]),
        "owner",
        S.INVALID_ARGUMENT,
        "content_type",
    ),
    (
        "allocate unknown content type",
        "Allocate",
        lambda m, t: pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=99)]),
        "owner",
        S.INVALID_ARGUMENT,
        "content_type",
    ),
    (
        "allocate duplicate keys in a batch",
        "Allocate",
        lambda m, t: pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=KV, key=b"a")] * 2),
        "owner",
        S.INVALID_ARGUMENT,
        "twice",
    ),
    (
        "allocate an oversized key",
        "Allocate",
        lambda m, t: pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=KV, key=b"k" * 5000)]),
        "owner",
        S.INVALID_ARGUMENT,
        "key",
    ),
    (
        "allocate a batch over the pool",
        "Allocate",
        lambda m, t: pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=40, content_type=KV)] * 2),
        "owner",
        S.RESOURCE_EXHAUSTED,
        "80 pages",
    ),
    (
        "allocate a good spec after a bad one",
        "Allocate",
        lambda m, t: pb.AllocateRequest(
            objects=[pb.ObjectSpec(num_pages=1, content_type=KV), pb.ObjectSpec(num_pages=0, content_type=KV)]
        ),
        "owner",
        S.INVALID_ARGUMENT,
        "objects[1]",
    ),
    (
        "allocate without a session",
        "Allocate",
        lambda m, t: pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=KV)]),
        None,
        S.PERMISSION_DENIED,
        "x-broker-session",
    ),
    (
        "prepare with a lease over the maximum",
        "Prepare",
        lambda m, t: pb.PrepareRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=KV)], lease_ms=10**9),
        "owner",
        S.INVALID_ARGUMENT,
        "lease",
    ),
    (
        "prepare pinning an unknown object",
        "Prepare",
        lambda m, t: pb.PrepareRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=KV)], pin_object_ids=[9999]),
        "owner",
        S.NOT_FOUND,
        "9999",
    ),
    (
        "commit an unknown transaction",
        "Commit",
        lambda m, t: pb.CommitRequest(transaction_ids=[t.transaction_id, 9999]),
        "owner",
        S.NOT_FOUND,
        "9999",
    ),
    (
        "commit another session's transaction",
        "Commit",
        lambda m, t: pb.CommitRequest(transaction_ids=[t.transaction_id]),
        "other",
        S.PERMISSION_DENIED,
        "another session",
    ),
    (
        "abort an unknown transaction",
        "Abort",
        lambda m, t: pb.AbortRequest(transaction_ids=[9999]),
        "owner",
        S.NOT_FOUND,
        "9999",
    ),
    (
        "abort another session's transaction",
        "Abort",
        lambda m, t: pb.AbortRequest(transaction_ids=[t.transaction_id]),
        "other",
        S.PERMISSION_DENIED,
        "another session",
    ),
    (
        "free an unknown object",
        "Free",
        lambda m, t: pb.FreeRequest(object_ids=[m.object_id, 9999]),
        "owner",
        S.NOT_FOUND,
        "9999",
    ),
    (
        "free the same object twice in a batch",
        "Free",
        lambda m, t: pb.FreeRequest(object_ids=[m.object_id, m.object_id]),
        "owner",
        S.INVALID_ARGUMENT,
        "twice",
    ),
    (
        "free another session's object",
        "Free",
        lambda m, t: pb.FreeRequest(object_ids=[m.object_id]),
        "other",
        S.PERMISSION_DENIED,
        "owner",
    ),
    (
        "free a prepared object",
        "Free",
        lambda m, t: pb.FreeRequest(object_ids=[t.objects[0].object_id]),
        "owner",
        S.FAILED_PRECONDITION,
        "transaction",
    ),
    (
        "pin an unknown object",
        "Pin",
        lambda m, t: pb.PinRequest(object_ids=[m.object_id, 9999]),
        "other",
        S.NOT_FOUND,
        "9999",
    ),
    (
        "pin another session's prepared object",
        "Pin",
        lambda m, t: pb.PinRequest(object_ids=[t.objects[0].object_id]),
        "other",
        S.NOT_FOUND,
        "no object",
    ),
    (
        "unpin another session's pin",
        "Unpin",
        lambda m, t: pb.UnpinRequest(object_ids=[m.object_id]),
        "other",
        S.PERMISSION_DENIED,
        "other sessions",
    ),
    (
        "unpin more than held",
        "Unpin",
        lambda m, t: pb.UnpinRequest(object_ids=[m.object_id, m.object_id]),
        "owner",
        S.FAILED_PRECONDITION,
        "holds 1",
    ),
    (
        "lookup an empty key",
        "Lookup",
        lambda m, t: pb.LookupRequest(keys=[b"present", b""], pin=True),
        "owner",
        S.INVALID_ARGUMENT,
        "keys[1]",
    ),
    (
        "lookup with a forged token",
        "Lookup",
        lambda m, t: pb.LookupRequest(keys=[b"present"]),
        "forged",
        S.PERMISSION_DENIED,
        "token",
    ),
]


@pytest.mark.parametrize("name,method,build,who,status,words", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_is_refused_and_changes_nothing(setup, name, method, build, who, status, words):
    stub, owner, other, mine, txn = setup
    before = snapshot(stub)
    metadata = {"owner": md(owner), "other": md(other), "forged": (("x-broker-session", "f" * 32),), None: ()}[who]
    with pytest.raises(grpc.RpcError) as e:
        getattr(stub, method)(build(mine, txn), metadata=metadata)
    assert e.value.code() == status, e.value.details()
    assert words in e.value.details()
    assert snapshot(stub) == before
    # The sessions still work after the refusal.
    assert owner.lookup([b"present"], pin=False)[0].object_id == mine.object_id


def test_attach_must_start_with_hello(broker):
    with grpc.insecure_channel(f"unix:{broker.socket}") as ch:
        stub = broker_pb2_grpc.MemoryBrokerStub(ch)
        stream = stub.Attach(iter([pb.AttachRequest(detach=pb.Detach())]))
        with pytest.raises(grpc.RpcError) as e:
            next(stream)
        assert e.value.code() == S.INVALID_ARGUMENT and "hello" in e.value.details()
        assert stub.GetStats(pb.GetStatsRequest()).sessions == 0
