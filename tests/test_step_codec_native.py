"""The step wire's native codec (``native/_stepcore.c``) against its Python fallback:
for random and malformed frames, ops and objects, the same bytes, the same results and the
same errors (type and message); and no input makes the C crash."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import struct
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rigs import encode_objects

from memory_broker.proto.wire import native
from memory_broker.proto.wire import step as w

CORE = native.load(native.STEPCORE)
pytestmark = pytest.mark.skipif(CORE is None, reason="the native step core is not built (test_native says so)")
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def both(fn, *args):
    """``fn(*args)`` with the native core, then without: each an ('ok', result) or
    ('err', exception type, message)."""
    out = []
    for core in (CORE, None):
        saved = w._core
        w._core = core
        try:
            out.append(("ok", fn(*args)))
        except Exception as e:  # noqa: BLE001 (the error itself is compared)
            out.append(("err", type(e), str(e)))
        finally:
            w._core = saved
    return out


# ------------------------------------------------------------------ ops (the client encodes)

texts = st.text(max_size=6) | st.sampled_from(["a", "é", "\x00", "x" * 300, "\ud800"])
keys = st.binary(max_size=40) | st.sampled_from([b"", b"\x00" * 32]) | st.just(bytearray(b"ba"))
ids = st.integers(min_value=-2, max_value=2**64 + 1) | st.sampled_from([True, 0, 2**64 - 1]) | st.just(1.5)
u = st.integers(min_value=-1, max_value=2**33)


@st.composite
def ops(draw):
    kind = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 7, 6, 0, 8]))
    if kind in (w.OP_RELEASE, w.OP_ACQUIRE):
        items = draw(st.lists(texts, max_size=6))
    elif kind == w.OP_LOOKUP:
        items = draw(st.lists(keys, max_size=6))
    else:
        items = draw(st.lists(ids, max_size=6))
    items = tuple(items) if draw(st.booleans()) else list(items)
    flags = draw(st.sampled_from([0, 1, 0, 1, 2, 256]))
    return w.Op(kind, items, flags, draw(st.sampled_from([0, 3, 70000]) | u), draw(st.sampled_from([0, 2500]) | u))


@FAST
@given(st.lists(ops(), max_size=5) | st.lists(st.just(w.Op(w.OP_PIN, (1,))), min_size=65, max_size=66))
def test_encode_step_native_and_python_give_the_same_frame_or_error(op_list):
    native_out, python_out = both(w.encode_step, op_list)
    assert native_out == python_out


def _as_tuple(op: w.Op, n: int) -> tuple:
    """``op`` as a tuple of its first ``n`` fields (at least 2; more where a later one is set)."""
    fields = (op.kind, op.items, op.flags, op.max_adapters, op.lease_ms)
    last = max([i + 1 for i, v in enumerate(fields[2:], 2) if v != 0] or [2])
    return fields[: max(n, last)]


@FAST
@given(st.lists(st.tuples(ops(), st.integers(2, 5)), max_size=5))
def test_an_op_as_a_tuple_of_its_fields_encodes_as_the_op_in_both_codecs(pairs):
    """The client's one-off ops are tuples (no Op object): both codecs encode them as the Op
    of the same fields, or refuse them alike."""
    op_list = [op for op, _ in pairs]
    as_tuples = [_as_tuple(op, n) for op, n in pairs]
    native_out, python_out = both(w.encode_step, as_tuples)
    assert native_out == python_out == both(w.encode_step, op_list)[0]


def test_the_usual_tuple_ops_are_taken_by_the_c_and_a_malformed_one_is_not():
    ops_ = [
        (w.OP_RELEASE, ["a", "é"]),
        (w.OP_UNPIN, [1, 2**64 - 1]),
        (w.OP_COMMIT, (7,)),
        (w.OP_ACQUIRE, ["x"], w.ACQUIRE_PREPARE, 3, 2500),
        (w.OP_LOOKUP, [b"k" * 32, b""], 1),
    ]
    assert CORE.encode_step(ops_, w._OP_ATTRS) == w._encode_step([w.Op(*op) for op in ops_])
    for bad in ((w.OP_UNPIN,), (w.OP_UNPIN, (1,), 0, 0, 0, "", "", 0)):
        assert CORE.encode_step([bad], w._OP_ATTRS) is None
        with pytest.raises(TypeError):  # the Python encoder says what is wrong with it
            w.encode_step([bad])


def test_encode_step_native_takes_the_usual_ops():
    ops_ = [
        w.Op(w.OP_RELEASE, ("a", "é")),
        w.Op(w.OP_UNPIN, (1, 2**64 - 1)),
        w.Op(w.OP_ACQUIRE, ["x"], w.ACQUIRE_PREPARE, 3, 2500),
        w.Op(w.OP_LOOKUP, (b"k" * 32, b""), 1),
    ]
    assert CORE.encode_step(ops_, w._OP_ATTRS) == w._encode_step(ops_)


def test_a_shaped_acquire_and_a_release_in_a_dtype_are_left_to_the_python_codec():
    """An engine asks for copies in a dtype or of a rank's shards as it loads an adapter, not
    every step: the C takes neither op, the Python codec carries both, and a cut body is
    refused naming where."""
    ops_ = [
        w.Op(w.OP_ACQUIRE, ("x",), w.ACQUIRE_SHAPED | w.ACQUIRE_PREPARE, 2, 100, "float32", "q_proj:o1/2"),
        w.Op(w.OP_RELEASE_IN, ("a", "b"), dtype="float16"),
    ]
    assert CORE.encode_step(ops_, w._OP_ATTRS) is None
    body = w.encode_step(ops_)[5:]
    assert CORE.decode_step(body, w.Op) is None
    assert w.decode_step(body) == ops_
    for cut in range(len(body)):
        with pytest.raises(w.WireError, match="ends inside|op count"):
            w.decode_step(body[:cut])


# ------------------------------------------------------------------ STEP bodies (the broker decodes)

GOOD = [
    w.Op(w.OP_RELEASE, ("a", "b", "é")),
    w.Op(w.OP_UNPIN, (1, 2, 2**63)),
    w.Op(w.OP_PIN, (7,)),
    w.Op(w.OP_ACQUIRE, ("x", "y"), w.ACQUIRE_PREPARE, 3, 2500),
    w.Op(w.OP_LOOKUP, (b"k1", b"", b"\x00\xff"), 1),
    w.Op(w.OP_LOOKUP, (b"a" * 16, b"b" * 16), 0),
]
GOOD_BODY = w._encode_step(GOOD)[5:]


@st.composite
def bodies(draw):
    """A well-formed body, one with some bytes changed, cut or grown, or random bytes."""
    return _mangled(draw, GOOD_BODY, 64)


def _mangled(draw, good: bytes, random_max: int) -> bytes:
    """``good`` as it is, with some bytes changed, cut or grown, or random bytes instead."""
    how = draw(st.sampled_from(["good", "flip", "cut", "grow", "random"]))
    b = bytearray(good)
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
    elif how == "cut":
        b = b[: draw(st.integers(0, len(b) - 1))]
    elif how == "grow":
        b += draw(st.binary(min_size=1, max_size=8))
    elif how == "random":
        b = bytearray(draw(st.binary(max_size=random_max)))
    return bytes(b)


@FAST
@given(bodies())
def test_decode_step_native_and_python_give_the_same_ops_or_error(body):
    native_out, python_out = both(w.decode_step, body)
    assert native_out == python_out


def test_decode_step_native_reads_a_memoryview_as_bytes():
    assert w.decode_step(memoryview(GOOD_BODY)) == GOOD


@pytest.mark.parametrize("cut", range(len(GOOD_BODY)))
def test_decode_step_native_refuses_every_cut_and_names_it_as_python_does(cut):
    native_out, python_out = both(w.decode_step, GOOD_BODY[:cut])
    assert native_out == python_out and native_out[0] == "err"
    assert CORE.decode_step(GOOD_BODY[:cut], w.Op) is None


def test_decode_step_native_makes_each_op_by_calling_the_class_it_is_given():
    """The C calls the class per op (it knows no class's layout), so a ``__post_init__`` or
    a ``__new__`` of its own still runs."""
    import dataclasses

    seen = []

    @dataclasses.dataclass(slots=True)
    class Checked(w.Op):
        def __post_init__(self):
            seen.append(self.kind)

    class Made(w.Op):
        __slots__ = ()

        def __new__(cls, *args):
            seen.append("new")
            return super().__new__(cls)

    assert CORE.decode_step(GOOD_BODY, w.Op) == GOOD
    got = CORE.decode_step(GOOD_BODY, Checked)
    assert [o.kind for o in got] == [o.kind for o in GOOD] == seen
    assert all(type(o) is Checked for o in got)
    seen.clear()
    got = CORE.decode_step(GOOD_BODY, Made)
    assert seen == ["new"] * len(GOOD) and [o.items for o in got] == [o.items for o in GOOD]
    # A class that is not a record of Op's fields at all is still called.
    assert CORE.decode_step(GOOD_BODY, lambda *a: a) == [
        (o.kind, o.items, o.flags, o.max_adapters, o.lease_ms) for o in GOOD
    ]
    # And after those, Op is filled again, the same as Python builds it.
    assert CORE.decode_step(GOOD_BODY, w.Op) == GOOD


# ------------------------------------------------------------------ step replies (the broker encodes)

records = st.binary(max_size=40) | st.sampled_from([b"", b"\x02", bytearray(b"ab"), memoryview(b"cd")])


@FAST
@given(
    st.integers(0, 2**32 + 1) | st.sampled_from([-1, 2**64, True]),
    st.lists(records, max_size=6) | st.tuples(records, records) | st.just([b"\x02"] * 65536),
)
def test_encode_step_reply_native_and_python_give_the_same_frame_or_error(slabs, results):
    native_out, python_out = both(w.encode_step_reply, slabs, results)
    assert native_out == python_out


def test_encode_ok_reply_takes_a_list_of_bytes_and_hands_back_the_rest():
    assert CORE.encode_ok_reply(3, [b"\x02", b"ab"]) == w.HEADER.pack(9, w.OK) + struct.pack("<IH", 3, 2) + b"\x02ab"
    assert CORE.encode_ok_reply(0, []) == w.HEADER.pack(6, w.OK) + struct.pack("<IH", 0, 0)
    for slabs, results in (
        (3, (b"a",)),
        (3, [bytearray(b"a")]),
        (2**32, [b"a"]),
        (-1, []),
        (1.0, []),
        (1, [b"x"] * 65536),
    ):
        assert CORE.encode_ok_reply(slabs, results) is None


# ------------------------------------------------------------------ object records (the broker encodes)


def _allocation(oid, owner, pins, state, key, pages, head=None):
    from memory_broker.broker.store.records import Allocation, ContentType, ObjectState

    o = Allocation(oid, owner, ContentType.KV_CACHE, key, list(pages), -1, ObjectState(state), len(pages), pins=pins)
    o.pin_count = sum(pins.values()) if isinstance(pins, dict) else 0
    if head is not None:
        o.wire_head, o.wire_tail = w._wire_parts(o)
    return o


@FAST
@given(
    st.lists(
        st.tuples(
            st.integers(1, 2**40),
            st.integers(0, 4),
            st.dictionaries(st.integers(0, 4), st.integers(0, 2**32 + 5), max_size=3),
            st.sampled_from([1, 2]),
            st.none() | st.binary(max_size=20),
            st.lists(st.integers(0, 2**32 - 1), max_size=5),
            st.booleans(),
        ),
        max_size=6,
    ),
    st.integers(0, 4),
)
def test_encode_allocations_native_and_python_give_the_same_bytes_or_error(rows, sid):
    def encode(rows):
        # Fresh objects each time: the first encode keeps its parts on committed ones.
        return w.encode_allocations(w.OP_LOOKUP, sid, [_allocation(*r) for r in rows])

    native_out, python_out = both(encode, rows)
    assert native_out == python_out


# ------------------------------------------------------------------ replies (the client decodes)

OBJ = w.ObjectRecord(5, -1, 2, 1, True, False, 1, 3, [4, 9], b"key", 0)
ACQ = w.AcquireOutcome(True, 11, 1234.5, (w.AcquiredRecord(2, 6, w.TIER_HOT, (1, 2, 3)),))
REPLY = w.encode_step_reply(
    2,
    [
        bytes((w.OP_UNPIN,)),
        w.encode_acquire(ACQ),
        w.encode_acquire(w.AcquireOutcome(False)),
        encode_objects(w.OP_LOOKUP, [OBJ, OBJ, w.ObjectRecord(6, 3, 2, 1, False, True, 0, 0, [], b"", 0)]),
        encode_objects(w.OP_PIN, []),
    ],
)


@st.composite
def replies(draw):
    b = _mangled(draw, REPLY[5:], 80)
    return draw(st.sampled_from([w.OK, w.OK, w.ERROR, 7])), b


@FAST
@given(replies())
def test_reply_decoder_native_and_python_give_the_same_records_or_error(reply):
    kind, body = reply
    # A decoder per codec, each asked twice (the second time from its memo).
    decoders = {}

    def decode(kind, body):
        d = decoders.setdefault(w._core is None, w.ReplyDecoder())
        return d(kind, body), d(kind, body)

    native_out, python_out = both(decode, kind, body)
    assert native_out == python_out
    if native_out[0] == "ok":
        assert native_out[1][0] == w.decode_step_reply(kind, body)


def test_an_acquire_result_with_its_loads_layouts_is_read_by_the_python_decoder():
    """A load's reply carries the loaded adapters' layouts (an empty one for an adapter that
    was hot): the C leaves that result to the Python decoder, which reads it whole, and a
    body cut anywhere in it is a WireError."""
    recs = (w.AcquiredRecord(2, 6, w.TIER_COLD, (1, 2)), w.AcquiredRecord(3, 7, w.TIER_HOT, (4,)))
    acq = w.AcquireOutcome(True, 0, 0.0, recs, (b"\x0a\x02a0", b""))
    body = w.encode_step_reply(2, [w.encode_acquire(acq)])[5:]
    assert CORE.decode_ok(body, {}, bytes, {}, bytes, lambda *a: a, 4) is None
    assert w.ReplyDecoder()(w.OK, body).results == [acq] == w.decode_step_reply(w.OK, body).results
    for cut in range(1, len(body)):
        with pytest.raises(w.WireError):
            w.decode_step_reply(w.OK, body[:cut])
    with pytest.raises(w.WireError, match="2 layouts for 1"):
        w.encode_acquire(w.AcquireOutcome(True, 0, 0.0, recs[:1], (b"", b"")))


def test_reply_decoder_native_hands_back_the_records_it_made_before():
    assert CORE.decode_ok(REPLY[5:], {}, bytes, {}, bytes, lambda *a: a, 4) is not None  # taken by the C
    d = w.ReplyDecoder()
    a, b = d(w.OK, REPLY[5:]), d(w.OK, REPLY[5:])
    assert a == w.decode_step_reply(w.OK, REPLY[5:])
    assert a.results[3][0] is b.results[3][0] and a.results[1].adapters[0] is b.results[1].adapters[0]


def _frame_decoded(kind: int, body: bytes, room: int = 0):
    """``ReplyDecoder.frame`` of the frame of ``kind`` and ``body`` in a kept buffer (``room``
    bytes more than it), twice: (first, second); each a StepReply or None (not taken)."""
    d = w.ReplyDecoder()
    d(w.OK, REPLY[5:])  # the decoder has seen this arena (2 slabs) already
    data = w.frame(kind, body)
    buf = bytearray(len(data) + room)
    buf[: len(data)] = data
    return d.frame(buf, len(data)), d.frame(buf, len(data))


@FAST
@given(replies(), st.integers(0, 8))
def test_a_whole_reply_frame_decoded_from_the_buffer_is_what_the_reference_decoder_says(reply, room):
    """The transport's one native call per reply: a whole OK frame gives the reference
    decoder's reply (the memo's records the second time); anything else is not taken."""
    kind, body = reply
    first, second = _frame_decoded(kind, body, room)
    if first is None:
        assert second is None
        return
    assert kind == w.OK and first == w.decode_step_reply(kind, body) == second
    for a, b in zip(first.results, second.results):
        if isinstance(a, list):
            assert all(x is y for x, y in zip(a, b))


def test_decode_frame_takes_the_usual_reply_and_hands_back_the_rest():
    d = w.ReplyDecoder()
    assert d.frame(bytearray(REPLY), len(REPLY)) is None  # an arena not seen yet: __call__ first
    first = d(w.OK, REPLY[5:])
    buf = bytearray(REPLY) + bytearray(64)
    got = d.frame(buf, len(REPLY))
    assert got == first and type(got) is w.StepReply and got.results[3][0] is first.results[3][0]
    assert d.frame(buf, len(REPLY) - 1) is None  # cut: the rest is read first
    assert d.frame(buf, len(REPLY) + 1) is None  # a byte more than the header says
    assert d.frame(bytearray(w.frame(w.ERROR, REPLY[5:])), len(REPLY)) is None
    other = bytearray(w.frame(w.OK, struct.pack("<I", 3) + REPLY[9:]))
    assert d.frame(other, len(other)) is None  # another arena's size: __call__ makes the records anew
    ping = bytearray(w.encode_step_reply(3, ()))
    assert d.frame(ping, len(ping)) == w.StepReply(3, [])  # no records: any arena size
    # The reply is made by calling the class given, so what it does still happens.
    seen = []

    @dataclasses.dataclass(slots=True)
    class Checked(w.StepReply):
        def __post_init__(self):
            seen.append(self.arena_slabs)

    got = CORE.decode_frame({}, bytes, {}, bytes, w.AcquireOutcome, 4, Checked, 3, ping, len(ping), [], [])
    assert type(got) is Checked and got == Checked(3, []) and seen == [3, 3]
    got = CORE.decode_frame({}, bytes, {}, bytes, w.AcquireOutcome, 4, w.StepReply, 3, ping, len(ping), [], [])
    assert type(got) is w.StepReply and (got.error, got.failed_index) == (None, -1)
    saved, w._core = w._core, None
    try:
        assert d.frame(buf, len(REPLY)) is None  # without the core: always the reference way
    finally:
        w._core = saved


def _objs_frame(slabs: int, objs: list) -> bytearray:
    return bytearray(w.encode_step_reply(slabs, [encode_objects(w.OP_LOOKUP, objs)]))


@FAST
@given(st.lists(st.lists(st.sampled_from([0, 1, 2, 3]), max_size=4), min_size=1, max_size=6))
def test_replies_one_after_another_reuse_a_record_at_its_place_only_for_the_same_bytes(seq):
    """``frame`` finds a record at its place in the last reply by its bytes: replies that
    change (another record there, or the same object with other pin counts) decode as the
    reference decoder says, and a record comes back as the same object only for the same bytes."""
    pool = [
        w.ObjectRecord(5, -1, 2, 1, True, False, 1, 1, [4], b"a", 2),
        w.ObjectRecord(5, -1, 2, 1, True, False, 2, 2, [4], b"a", 2),  # more pins
        w.ObjectRecord(6, 3, 2, 1, False, True, 0, 0, [], b"", 2),
        w.ObjectRecord(7, 3, 2, 1, False, True, 0, 0, [1, 2], b"bb", 2),
    ]
    d = w.ReplyDecoder()
    d(w.OK, _objs_frame(2, [])[5:])  # the arena: 2 slabs
    seen: dict[bytes, object] = {}
    for picks in seq:
        data = _objs_frame(2, [pool[i] for i in picks])
        got = d.frame(data, len(data))
        assert got == w.decode_step_reply(w.OK, bytes(data[5:]))
        for i, rec in zip(picks, got.results[0]):
            raw = encode_objects(w.OP_LOOKUP, [pool[i]])[3:]
            assert seen.setdefault(raw, rec) is rec  # the same bytes: the same record, else another
    # A new arena (another slab count) makes its records anew, at every place.
    first = d.frame(_objs_frame(2, [pool[0]]), len(_objs_frame(2, [pool[0]]))).results[0][0]
    data = _objs_frame(3, [pool[0]])
    assert d.frame(data, len(data)) is None  # not taken: __call__ makes them for 3 slabs
    again = d(w.OK, bytes(data[5:])).results[0][0]
    assert again.arena_slabs == 3 and again is not first
    assert d.frame(data, len(data)).results[0][0] is again


# ------------------------------------------------------------------ the C never crashes


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_the_native_decoders_take_any_bytes_without_crashing(data):
    assert CORE.decode_step(data, w.Op) is None or isinstance(CORE.decode_step(data, w.Op), list)
    assert CORE.decode_step(GOOD_BODY[:3] + data, w.Op) is None or True
    got = CORE.decode_ok(data, {}, lambda raw: raw, {}, lambda raw: raw, lambda *a: a, 4)
    assert got is None or isinstance(got, tuple)
    whole = w.frame(w.OK, data)
    for n in (len(whole), len(data), len(whole) + 100):  # what the header says, and not
        got = CORE.decode_frame({}, bytes, {}, bytes, lambda *a: a, 4, lambda *a: a, 0, whole, n, [], [])
        assert got is None or isinstance(got, tuple)


def test_huge_announced_counts_are_refused_not_read():
    # Counts and lengths that point far past the end (and their sums past 2**31).
    for body in (
        struct.pack("<HBH", 1, w.OP_UNPIN, 0xFFFF),
        struct.pack("<HBBH", 1, w.OP_LOOKUP, 0, 0xFFFF) + b"\xff\xff",
        struct.pack("<HBBHIH", 1, w.OP_ACQUIRE, 0, 0, 0, 0xFFFF) + b"\xff\xff",
    ):
        assert CORE.decode_step(body, w.Op) is None
    obj = struct.pack("<IH", 0, 1) + struct.pack("<BH", w.OP_LOOKUP, 1) + b"\x00" * 27 + b"\xff\xff\xff\xff"
    assert CORE.decode_ok(obj, {}, bytes, {}, bytes, lambda *a: a, 4) is None
    acq = struct.pack("<IH", 0, 1) + struct.pack("<BBQdH", w.OP_ACQUIRE, 1, 0, 0.0, 1) + b"\x00" * 17 + b"\xff" * 4
    assert CORE.decode_ok(acq, {}, bytes, {}, bytes, lambda *a: a, 4) is None


def test_the_usual_frames_are_taken_by_the_c_not_handed_back():
    """The differential tests above pass trivially if the C hands everything to Python: it
    takes a well-formed body, a committed store object and a reply itself."""
    assert CORE.decode_step(GOOD_BODY, w.Op) == GOOD
    assert CORE.encode_ok_reply(1, [b"\x02"]) is not None
    objs = [_allocation(5, 1, {1: 2}, 2, b"k", [3, 4], head=True), _allocation(6, 2, {}, 2, None, [])]
    got = CORE.encode_allocations(w.OP_PIN, 1, objs, w._wire_parts, w._OBJ_ATTRS)
    saved, w._core = w._core, None
    try:
        assert got == w.encode_allocations(w.OP_PIN, 1, objs)
    finally:
        w._core = saved


def test_a_core_built_from_an_older_source_is_not_used_and_said():
    """A tree pulled without reinstalling keeps the old build: step.py runs its Python path
    then, and says why and how to rebuild, rather than fail on a pass the build lacks."""
    code = (
        "import logging, sys, types\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "old = types.ModuleType('memory_broker._native._stepcore')\n"
        "old.decode_step = lambda *a: None\n"
        "sys.modules['memory_broker._native._stepcore'] = old\n"
        "from memory_broker.proto.wire import step\n"
        "print(step._core is None, step.decode_step(step.encode_step([step.Op(2, (1,))])[5:]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.startswith("True [Op(kind=2, items=(1,)")
    assert "predates this step.py" in out.stderr and "pip install -e ." in out.stderr


@st.composite
def object_records(draw):
    """One object record's bytes as a reply carries it (head, pages, key length, key)."""
    pages = draw(st.lists(st.integers(0, 2**32 - 1), max_size=5))
    key = draw(st.binary(max_size=24))
    head = w._OBJ_HEAD.pack(
        draw(st.integers(0, 2**64 - 1)),
        draw(st.integers(-(2**63), 2**63 - 1)),
        draw(st.integers(0, 255)),
        draw(st.integers(0, 255)),
        draw(st.integers(0, 255)),
        draw(st.integers(0, 2**32 - 1)),
        draw(st.integers(0, 2**32 - 1)),
        len(pages),
    )
    return head + struct.pack(f"<{len(pages)}I", *pages) + struct.pack("<H", len(key)) + key


@FAST
@given(object_records(), st.integers(0, 1 << 20))
def test_a_native_object_record_is_the_python_one(raw, slabs):
    """``object_record`` (what the reply decoder makes a fresh key's record with) fills the
    same fields, of the same types, as ``_object_record``."""
    got, want = CORE.object_record(w.ObjectRecord, slabs, raw), w._object_record(raw, slabs)
    assert got == want and type(got) is w.ObjectRecord and got.made is None
    assert [type(getattr(got, f.name)) for f in dataclasses.fields(got)] == [
        type(getattr(want, f.name)) for f in dataclasses.fields(want)
    ]
    # The decoder's maker is the native one here, and gives the same record.
    assert w._object_maker(slabs)(raw) == want


def test_a_short_object_record_is_refused_not_read_past_its_end():
    raw = w._OBJ_HEAD.pack(1, -1, 0, 0, 1, 1, 1, 3) + b"\0" * 8  # three pages said, two there
    for n in range(len(raw) + 1):
        with pytest.raises(ValueError, match="shorter than"):
            CORE.object_record(w.ObjectRecord, 1, raw[:n])
    with pytest.raises(TypeError):
        CORE.object_record(w.ObjectRecord, 1, bytearray(raw))


def test_object_record_calls_the_record_class_it_is_given():
    """Any record class, slotted or not, is called with the record's fields (as the decoder's
    ``make``)."""

    @dataclasses.dataclass
    class Rec:
        object_id: int
        window_page: int
        state: int
        content_type: int
        owned: bool
        deduplicated: bool
        session_pins: int
        total_pins: int
        pages: list
        key: bytes
        arena_slabs: int = 0

    raw = w._OBJ_HEAD.pack(7, 3, 1, 2, 2, 4, 5, 1) + struct.pack("<I", 9) + struct.pack("<H", 2) + b"kk"
    assert CORE.object_record(Rec, 6, raw) == Rec(7, 3, 1, 2, False, True, 4, 5, [9], b"kk", 6)


# ------------------------------------------------------------------ a step batch's counts (client)


class _Obj:
    __slots__ = ("object_id", "key")

    def __init__(self, key: bytes):
        self.object_id, self.key = int.from_bytes(key.ljust(8, b"\0")[:8], "little"), key

    def __eq__(self, other):
        return isinstance(other, _Obj) and other.key == self.key

    def __repr__(self):
        return f"_Obj({self.key!r})"


def _batch(core):
    """A StepBatch with no session (its counts only), whose passes run with ``core``."""
    from types import SimpleNamespace

    from memory_broker.clients.step.batch import StepBatch

    b = StepBatch(SimpleNamespace(epoch=0))
    b.core = core
    return b


def _run(b, fn, *args):
    saved = w._core
    w._core = b.core
    try:
        return ("ok", fn(*args))
    except Exception as e:  # noqa: BLE001 (the error itself is compared)
        return ("err", type(e), str(e))
    finally:
        w._core = saved


def _state(b):
    return (b._acount, b._kcount, b.adapters, b.objects, sorted(b._own))


@FAST
@given(st.randoms(use_true_random=False), st.sampled_from([list, tuple]))
def test_a_batch_counts_its_changes_in_the_native_core_as_in_python(rng, seq):
    """``batch_take`` and ``batch_account`` (a change's drops counted out, its adds counted in)
    leave the same counts and give the same results and errors as the Python passes, for
    random changes: drops held once or more, repeated, not held; adds held, new, repeated."""
    native, python = _batch(CORE), _batch(None)
    ids, keys = ["a0", "a1", "a2", "a3"], [b"k0", b"k1", b"k2", b"", b"absent"]
    for b in (native, python):
        b._own["a3"] = "lease-a3"
    for _ in range(40):
        held_a, held_k = list(native._acount), list(native._kcount)
        drop = seq(rng.sample(held_a, rng.randint(0, len(held_a))) + rng.choice([[], [], ["a1"], ["zz"]]))
        drop_keys = seq(rng.sample(held_k, rng.randint(0, len(held_k))) + rng.choice([[], [], [b"k0"], [b"zz"]]))
        add = seq(rng.choice(ids) for _ in range(rng.randint(0, 4)))
        add_keys = seq(rng.choice(keys) for _ in range(rng.randint(0, 4)))
        took = [_run(b, b._take_drops, add, drop, add_keys, drop_keys) for b in (native, python)]
        assert took[0] == took[1] and _state(native) == _state(python)
        if took[0][0] != "ok":
            continue
        rel, unpin, new_ids, new_keys, own = took[0][1]
        found = [_Obj(k) for k in new_keys if k != b"absent"]
        found = found[: next((i for i, k in enumerate(new_keys) if k == b"absent"), len(new_keys))]
        for b in (native, python):
            for a in new_ids:
                b.adapters[a] = "leased-" + a
        got = [_run(b, b._account, add, add_keys, new_keys, found, 1) for b in (native, python)]
        assert got[0][0] == got[1][0] == "ok"
        assert (got[0][1].adapters, got[0][1].objects) == (got[1][1].adapters, got[1][1].objects)
        assert _state(native) == _state(python)


def test_the_native_batch_passes_take_no_bad_change():
    """A drop not held, or held once and dropped twice, is the Python pass's (which raises
    ValueError and changes nothing); so is a change in other than lists and tuples."""
    counts = {"a": 1}
    assert CORE.batch_take(counts, {}, {"a": 1}, {}, {}, [], ["b"], [], []) is None
    assert CORE.batch_take(counts, {}, {"a": 1}, {}, {}, [], ["a", "a"], [], []) is None
    assert CORE.batch_take(counts, {}, {"a": 1}, {}, {}, [], iter(["a"]), [], []) is None
    assert CORE.batch_take(counts, {}, {"a": 1}, {}, {}, [], [["unhashable"]], [], []) is None
    assert counts == {"a": 1}
    assert CORE.batch_take(counts, {}, {"a": 1}, {}, {}, ["a", "c", "c"], ["a"], [], []) == (
        [("a")],
        [],
        ["a", "c"],
        [],
        [],
    )
    assert counts == {}


# ------------------------------------------------------------------ the C's numbers are the wire's


def test_every_number_the_c_defines_is_step_pys():
    """``_stepcore.c``'s ``#define``s are the wire's constants and record sizes as ``step.py``
    defines them: a change on one side only fails here, not as a misread frame."""
    src = (pathlib.Path(__file__).resolve().parent.parent / "native/_stepcore.c").read_text()
    defined = {m[1]: int(m[2], 0) for m in re.finditer(r"^#define ([A-Z][A-Z0-9_]*) (0x[0-9A-Fa-f]+|\d+)\b", src, re.M)}
    want = {
        "MAX_OPS": w.MAX_OPS,
        "OP_RELEASE": w.OP_RELEASE,
        "OP_UNPIN": w.OP_UNPIN,
        "OP_PIN": w.OP_PIN,
        "OP_COMMIT": w.OP_COMMIT,
        "OP_ABORT": w.OP_ABORT,
        "OP_ACQUIRE": w.OP_ACQUIRE,
        "OP_LOOKUP": w.OP_LOOKUP,
        "ACQUIRE_PREPARE": w.ACQUIRE_PREPARE,
        "OK_KIND": w.OK,
        "STEP_KIND": w.STEP,
        "HEADER_SIZE": w.HEADER.size,
        "REPLY_HEAD_SIZE": w._STEP_REPLY_HEAD.size,
        "OBJ_HEAD_SIZE": w._OBJ_HEAD.size,
        "OBJ_NPAGES_AT": w._OBJ_HEAD.size - 4,  # the head's last field, <I>
        "OBJ_OWNED": w.OBJ_OWNED,
        "OBJ_DEDUP": w.OBJ_DEDUP,
        "ACQ_RESULT_HEAD_SIZE": w._ACQ_RESULT_HEAD.size,
        "ACQ_ADAPTER_SIZE": w._ACQ_ADAPTER.size,
        "ACQ_NPAGES_AT": w._ACQ_ADAPTER.size - 4,  # the record's last field, <I>
    }
    assert defined == want
