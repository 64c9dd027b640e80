"""The step channel's frames: every op and result survives a round trip through the codec,
and anything cut short, oversized or unknown is a WireError naming the place (no op runs)."""

from __future__ import annotations

import random
import struct

import pytest
from rigs import encode_objects

from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.errors import BrokerError, Code

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

OPS = [
    w.Op(w.OP_RELEASE, ("a", "b", "é")),
    w.Op(w.OP_UNPIN, (1, 2, 2**63)),
    w.Op(w.OP_PIN, (7,)),
    w.Op(w.OP_COMMIT, (9,)),
    w.Op(w.OP_ABORT, ()),
    w.Op(w.OP_ACQUIRE, ("x", "y"), w.ACQUIRE_PREPARE, 3, 2500),
    w.Op(w.OP_LOOKUP, (b"k1", b"", b"\x00\xff"), 1),
]


def body(frame: bytes) -> bytes:
    n, kind = w.HEADER.unpack_from(frame)
    assert kind == w.STEP and len(frame) == 5 + n
    return frame[5:]


def test_every_op_round_trips():
    assert w.decode_step(body(w.encode_step(OPS))) == OPS


def test_acquire_rows_encode_as_the_records_do():
    """The broker encodes an acquire's adapters from tuples (no record objects): same bytes."""
    recs = (w.AcquiredRecord(2, 6, w.TIER_HOT, (1, 2, 3)), w.AcquiredRecord(9, 7, w.TIER_WARM, ()))
    rows = [(r.generation, r.object_id, r.found_in, r.pages) for r in recs]
    assert w.encode_acquire_rows(11, 1234.5, rows) == w.encode_acquire(w.AcquireOutcome(True, 11, 1234.5, recs))


def test_every_result_and_the_error_round_trip():
    obj = w.ObjectRecord(5, -1, 2, 1, True, False, 1, 3, [4, 9], b"key", 0)
    acq = w.AcquireOutcome(True, 11, 1234.5, (w.AcquiredRecord(2, 6, w.TIER_WARM, (1, 2, 3)),))
    results = [
        bytes((w.OP_RELEASE,)),
        w.encode_acquire(acq),
        w.encode_acquire(w.AcquireOutcome(False)),
        encode_objects(w.OP_LOOKUP, [obj]),
    ]
    frame = w.encode_step_reply(4, results, BrokerError(Code.NOT_FOUND, "no object 3"), 4)
    n, kind = w.HEADER.unpack_from(frame)
    r = w.decode_step_reply(kind, frame[5:])
    assert r.arena_slabs == 4 and r.failed_index == 4
    assert r.error.code == Code.NOT_FOUND and r.error.message == "no object 3"
    assert r.results[0] is None and r.results[1] == acq and r.results[2] == w.AcquireOutcome(False)
    assert r.results[3] == [w.ObjectRecord(5, -1, 2, 1, True, False, 1, 3, [4, 9], b"key", 4)]


@pytest.mark.parametrize("cut", range(1, 40))
def test_a_frame_cut_anywhere_is_a_wire_error(cut):
    b = body(w.encode_step(OPS))
    with pytest.raises(w.WireError):
        w.decode_step(b[: len(b) - cut])


@pytest.mark.parametrize(
    "raw, words",
    [
        (struct.pack("<HB", 1, 99), "unknown kind 99"),
        (struct.pack("<H", w.MAX_OPS + 1), "at most"),
        (body(w.encode_step([w.Op(w.OP_PIN, (1,))])) + b"\x00", "after the last op"),
        (struct.pack("<HBBHIH", 1, w.OP_ACQUIRE, 0x80, 0, 0, 0), "unknown flags"),
        (struct.pack("<HBBH", 1, w.OP_LOOKUP, 2, 0), "pin flag"),
        (struct.pack("<HBHH", 1, w.OP_RELEASE, 1, 2) + b"\xff\xfe", "not UTF-8"),
        (struct.pack("<HBH", 1, w.OP_UNPIN, 5) + b"\x00" * 8, "frame ends inside"),
    ],
)
def test_malformed_bodies_say_what_is_wrong(raw, words):
    with pytest.raises(w.WireError, match=words):
        w.decode_step(raw)


def _mutants(good: bytes, seed: int, n: int = 3000):
    """``n`` copies of ``good`` with 1-6 bytes changed, a third of them also cut short."""
    rng = random.Random(seed)
    for _ in range(n):
        b = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        if rng.random() < 0.3:
            b = b[: rng.randrange(len(b))]
        yield rng, bytes(b)


def test_random_bytes_never_escape_as_anything_but_a_wire_error():
    for _, b in _mutants(body(w.encode_step(OPS)), 3):
        try:
            w.decode_step(b)
        except w.WireError:
            pass  # decoded or refused as a wire error: both fine; anything else fails the test


def test_store_objects_encode_as_their_records_do():
    """The broker encodes a lookup's or pin's objects straight from the store's: the bytes
    are those of the records a client decodes (owned for the owner, its own pin count)."""
    from memory_broker.broker.store.records import Allocation, ContentType, ObjectState

    objs = [
        Allocation(5, 7, ContentType.KV_CACHE, b"key", [4, 9], -1, ObjectState.COMMITTED, 2, pins={7: 1, 8: 2}),
        Allocation(6, 8, ContentType.KV_CACHE, None, [3], 12, ObjectState.COMMITTED, 1, pins={8: 1}),
    ]
    for o in objs:
        o.pin_count = sum(o.pins.values())
    recs = [
        w.ObjectRecord(5, -1, int(ObjectState.COMMITTED), int(ContentType.KV_CACHE), True, False, 1, 3, [4, 9], b"key"),
        w.ObjectRecord(6, 12, int(ObjectState.COMMITTED), int(ContentType.KV_CACHE), False, False, 0, 1, [3], b""),
    ]
    assert w.encode_allocations(w.OP_LOOKUP, 7, objs) == encode_objects(w.OP_LOOKUP, recs)


def test_an_oversize_key_or_id_is_named_however_many_ride_with_it():
    ok = b"k" * 10
    with pytest.raises(w.WireError, match="a key is 65536 bytes"):
        w.encode_step([w.Op(w.OP_LOOKUP, (ok, b"x" * 65536, ok), 1)])
    with pytest.raises(w.WireError, match="an adapter id is 70000 bytes"):
        w.encode_step([w.Op(w.OP_ACQUIRE, ("a", "b" * 70000))])


def _reply_body() -> tuple[int, bytes]:
    obj = w.ObjectRecord(5, -1, 2, 1, True, False, 1, 3, [4, 9], b"key", 0)
    acq = w.AcquireOutcome(True, 11, 1234.5, (w.AcquiredRecord(2, 6, w.TIER_HOT, (1, 2, 3)),))
    results = [bytes((w.OP_UNPIN,)), w.encode_acquire(acq), encode_objects(w.OP_LOOKUP, [obj, obj])]
    frame = w.encode_step_reply(2, results)
    return frame[4], frame[5:]


@pytest.mark.parametrize("cut", range(1, 60))
def test_a_reply_cut_anywhere_is_a_wire_error(cut):
    kind, b = _reply_body()
    with pytest.raises(w.WireError):
        w.decode_step_reply(kind, b[: len(b) - cut])


def test_a_reply_with_bytes_after_its_results_is_a_wire_error():
    kind, b = _reply_body()
    assert len(w.decode_step_reply(kind, b).results) == 3
    with pytest.raises(w.WireError, match="after the last result"):
        w.decode_step_reply(kind, b + b"\x00")


def test_random_reply_bytes_never_escape_as_anything_but_a_wire_error():
    _, good = _reply_body()
    for rng, b in _mutants(good, 5):
        try:
            w.decode_step_reply(rng.choice((w.OK, w.ERROR)), b)
        except w.WireError:
            pass  # decoded or refused as a wire error: both fine; anything else fails the test
