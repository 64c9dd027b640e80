"""The client's side of a step, per item: its reply decoder reads exactly what the reference
decoder reads (and refuses what it refuses), hands back the record it made before from the
same bytes, and a step that gets back what an earlier one got builds no new objects or
leases; its request encoder writes the documented bytes however the items' sizes fall."""

from __future__ import annotations

import random
import struct

import pytest
from conftest import step_frames as frames
from rigs import encode_objects

from memory_broker.clients import BrokerClient
from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.errors import BrokerError, Code

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores


def _objects(rng: random.Random, n: int, sizes: str) -> list[w.ObjectRecord]:
    """``n`` object records whose (pages, key length) are all one (``same``), change in runs
    (``runs``), alternate (``alternate``) or are anything (``random``)."""
    out = []
    for i in range(n):
        if sizes == "same":
            npages, klen = 1, 16
        elif sizes == "runs":
            npages, klen = 1 + i // 40 % 2, 6 + i // 25
        elif sizes == "alternate":
            npages, klen = i % 2, 5 + i % 3
        else:
            npages, klen = rng.randrange(4), rng.randrange(40)
        out.append(
            w.ObjectRecord(
                rng.randrange(1, 2**40),
                rng.choice((-1, rng.randrange(1 << 20))),
                rng.randrange(4),
                rng.randrange(4),
                rng.random() < 0.5,
                rng.random() < 0.2,
                rng.randrange(3),
                rng.randrange(9),
                [rng.randrange(1 << 20) for _ in range(npages)],
                bytes(rng.randrange(256) for _ in range(klen)),
            )
        )
    return out


def _adapters(rng: random.Random, n: int, same: bool) -> tuple[w.AcquiredRecord, ...]:
    return tuple(
        w.AcquiredRecord(
            rng.randrange(1, 99),
            rng.randrange(1, 2**40),
            rng.choice((w.TIER_HOT, w.TIER_WARM)),
            tuple(rng.randrange(1 << 20) for _ in range(4 if same else rng.randrange(6))),
        )
        for _ in range(n)
    )


def _reply(rng: random.Random, sizes: str, error: bool = False, slabs: int = 3) -> tuple[int, bytes]:
    n = rng.choice((0, 1, 7, 64, 300))
    results = [
        bytes((w.OP_RELEASE,)),
        bytes((w.OP_UNPIN,)),
        w.encode_acquire(w.AcquireOutcome(True, rng.randrange(9), 12.5, _adapters(rng, n // 3, sizes == "same"))),
        encode_objects(w.OP_LOOKUP, _objects(rng, n, sizes)),
        encode_objects(w.OP_PIN, _objects(rng, rng.randrange(3), sizes)),
        w.encode_acquire(w.AcquireOutcome(False)),
    ]
    err = BrokerError(Code.NOT_FOUND, "no object 3") if error else None
    frame = w.encode_step_reply(slabs, results, err, len(results))
    return frame[4], frame[5:]


def _fields(r: w.StepReply) -> tuple:
    err = None if r.error is None else (r.error.code, r.error.message)
    return r.arena_slabs, r.results, err, r.failed_index


@pytest.mark.parametrize("sizes", ["same", "runs", "alternate", "random"])
def test_the_client_decoder_reads_what_the_reference_decoder_reads(sizes):
    rng = random.Random(sizes)
    decode = w.ReplyDecoder()
    for i in range(40):
        kind, body = _reply(rng, sizes, error=i % 5 == 4, slabs=1 + i % 3)
        assert _fields(decode(kind, body)) == _fields(w.decode_step_reply(kind, body))


def test_the_client_decoder_refuses_what_the_reference_refuses_and_reads_the_rest_alike():
    rng = random.Random(28)
    decode = w.ReplyDecoder()
    for sizes in ("same", "runs", "random"):
        kind, good = _reply(rng, sizes)
        decode(kind, good)  # its records are known: a mutant's may be handed back from the memo
        for _ in range(300):
            b = bytearray(good)
            how = rng.randrange(3)
            if how == 0:
                del b[rng.randrange(len(b)) :]
            elif how == 1:
                for _ in range(rng.randrange(1, 4)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
            else:
                b.insert(rng.randrange(len(b)), rng.randrange(256))
            b = bytes(b)
            try:
                want = w.decode_step_reply(kind, b)
            except w.WireError as e:
                with pytest.raises(w.WireError) as got:
                    decode(kind, b)
                assert str(got.value) == str(e)
            else:
                assert _fields(decode(kind, b)) == _fields(want)


@pytest.mark.native_only  # the native decoder reuses a reply's records; the Python one makes new ones
def test_a_record_is_the_one_made_before_from_the_same_bytes_and_arena():
    rng = random.Random(5)
    objs, ads = _objects(rng, 50, "runs"), _adapters(rng, 20, True)

    def reply(objs, slabs=3):
        results = [w.encode_acquire(w.AcquireOutcome(True, 0, 0.0, ads)), encode_objects(w.OP_LOOKUP, objs)]
        frame = w.encode_step_reply(slabs, results)
        return frame[4], frame[5:]

    decode = w.ReplyDecoder()
    first = decode(*reply(objs))
    again = decode(*reply(objs))
    assert all(a is b for a, b in zip(first.results[1], again.results[1], strict=True))
    assert all(a is b for a, b in zip(first.results[0].adapters, again.results[0].adapters, strict=True))
    # One object's pins changed: a new record for it, the same for the others.
    objs[7] = w.ObjectRecord(
        *[getattr(objs[7], f) for f in w.ObjectRecord.__slots__][:7], 5, objs[7].pages, objs[7].key
    )
    changed = decode(*reply(objs)).results[1]
    assert changed[7] is not first.results[1][7] and changed[7].total_pins == 5
    assert all(changed[i] is first.results[1][i] for i in range(50) if i != 7)
    # The arena grew: object records say so (made again), adapters' stay.
    grown = decode(*reply(objs, slabs=4))
    assert all(o.arena_slabs == 4 for o in grown.results[1]) and grown.results[1][0] is not first.results[1][0]
    assert grown.results[0].adapters[0] is first.results[0].adapters[0]


@pytest.mark.native_only  # the native decoder reuses a reply's records; the Python one makes new ones
def test_a_reply_without_results_keeps_the_records_made_before():
    """A PING's reply says 0 slabs and carries nothing: the records made before stay (the
    next step's reply finds them, and what the client built from them, as before)."""
    rng = random.Random(6)
    frame = w.encode_step_reply(3, [encode_objects(w.OP_LOOKUP, _objects(rng, 5, "same"))])
    pong = w.encode_step_reply(0, ())
    decode = w.ReplyDecoder()
    first = decode(frame[4], frame[5:]).results[0]
    assert decode(pong[4], pong[5:]).results == []
    again = decode(frame[4], frame[5:]).results[0]
    assert all(a is b for a, b in zip(first, again, strict=True)) and again[0].arena_slabs == 3


def _reference_encode(ops: list[w.Op]) -> bytes:
    """The documented request layout, item by item."""
    body = struct.pack("<H", len(ops))
    for op in ops:
        body += bytes((op.kind,))
        if op.kind == w.OP_ACQUIRE:
            body += struct.pack("<BHIH", op.flags, op.max_adapters, op.lease_ms, len(op.items))
        elif op.kind == w.OP_LOOKUP:
            body += struct.pack("<BH", op.flags, len(op.items))
        else:
            body += struct.pack("<H", len(op.items))
        for it in op.items:
            if op.kind in (w.OP_RELEASE, w.OP_ACQUIRE, w.OP_LOOKUP):
                b = it.encode() if isinstance(it, str) else bytes(it)
                body += struct.pack("<H", len(b)) + b
            else:
                body += struct.pack("<Q", it)
    return struct.pack("<IB", len(body), w.STEP) + body


def test_requests_encode_as_documented_however_the_items_sizes_fall():
    rng = random.Random(3)
    id_sets = [["a"] * 5, ["it1", "it22", "it333"], ["x\0y", "z"], ["é", "ü-ß", "日本"], [""], ["", ""], []]
    key_sets = [[b"k" * 16] * 9, [b"item-%d" % i for i in (1, 22, 333)], [b"", b"x"], [b"\0\0", b"\0"], []]
    for _ in range(4):
        id_sets.append(["".join(rng.choice("ab\0é") for _ in range(rng.randrange(6))) for _ in range(20)])
        key_sets.append([rng.randbytes(rng.randrange(3)) for _ in range(20)])
    for ids in id_sets:
        for keys in key_sets:
            ops = [
                w.Op(w.OP_RELEASE, tuple(ids)),
                w.Op(w.OP_UNPIN, (1, 2**63)),
                w.Op(w.OP_ACQUIRE, tuple(ids), 0, 3, 250),
                w.Op(w.OP_LOOKUP, tuple(keys), 1),
            ]
            assert w.encode_step(ops) == _reference_encode(ops)
            assert w.decode_step(w.encode_step(ops)[5:]) == ops
    with pytest.raises(UnicodeEncodeError):
        w.encode_step([w.Op(w.OP_ACQUIRE, ("ok", "\ud800"))])
    with pytest.raises(w.WireError, match="a key is 65536 bytes"):
        w.encode_step([w.Op(w.OP_LOOKUP, (b"x" * 65536, b"x" * 65536), 1)])


# ------------------------------------------------------------------ the client, end to end


@pytest.mark.native_only  # the native decoder reuses a reply's records; the Python one makes new ones
def test_a_step_that_gets_back_what_an_earlier_one_got_builds_nothing_new(step_rig):
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    with BrokerClient.connect(b.socket) as c:  # every step is a frame
        # Records built into objects: by the session's records (``_fresh``, all of a list
        # together), or by ``_read_objects`` for some of a list.
        built, inside = [], []
        records = c._step_calls().records
        read_objects, make_fresh = c._read_objects, records._fresh

        def spy_fresh(recs):
            built.extend(recs)
            inside.append(True)
            try:
                return make_fresh(recs)
            finally:
                inside.pop()

        def spy_read(infos):
            if not inside:
                built.extend(infos)
            return read_objects(infos)

        records._fresh, c._read_objects = spy_fresh, spy_read
        n = frames(c)
        s1 = c.step(["a0", "a1"], [b"k0", b"k1"])
        s2 = c.step(["a0"], [b"k2"], release=s1)
        assert len(built) == 3
        s3 = c.step(["a0", "a1"], [b"k0", b"k1"], release=s2)
        assert frames(c) == n + 3 and len(built) == 3  # a frame each, nothing built the third time
        assert [o is p for o, p in zip(s3.objects, s1.objects, strict=True)] == [True, True]
        assert [a is p for a, p in zip(s3.adapters.adapters, s1.adapters.adapters, strict=True)] == [True, True]
        assert s3.adapters is not s1.adapters and not s3.adapters.released and s1.adapters.released
        # What they are is what a fresh client gets.
        with BrokerClient.connect(b.socket) as fresh, fresh.lookup_pinned([b"k0", b"k1"]) as objs:
            for mine, theirs in zip(s3.objects, objs, strict=True):
                assert (mine.object_id, mine.pages, mine.key, mine.session_pins) == (
                    theirs.object_id,
                    theirs.pages,
                    theirs.key,
                    theirs.session_pins,
                )
            # Another session's pin changes an object's record: this client gets a new object.
            s4 = c.step(["a0", "a1"], [b"k0", b"k1"], release=s3)
            assert s4.objects[0] is not s1.objects[0] and s4.objects[0].total_pins == 2
            assert len(built) == 5
        s4.release()
        assert c.stats().pinned_pages == 0


def test_a_lease_reused_by_its_records_names_the_ids_asked(step_rig):
    """Leases are found again by their records' identity: records in another order (or under
    other ids) are not taken for the leases they made before."""
    b, setup = step_rig
    setup.prefetch_adapters(["a0", "a1"], "hot")
    with BrokerClient.connect(b.socket) as c:
        s1 = c.step(["a0", "a1"])
        records = c._step_calls().records
        r0, r1 = records._leased["a0"][0], records._leased["a1"][0]
        again = records.step_lease(["a0", "a1"], w.AcquireOutcome(True, 0, 0.0, (r0, r1)), [], 0)
        assert [a is p for a, p in zip(again.adapters, s1.adapters.adapters, strict=True)] == [True, True]
        swapped = records.step_lease(["a1", "a0"], w.AcquireOutcome(True, 0, 0.0, (r0, r1)), [], 0)
        assert swapped.ids == ["a1", "a0"] and [a.object_id for a in swapped.adapters] == [r0.object_id, r1.object_id]
        swapped.released = again.released = True  # made here, not acquired: nothing to give back
        s1.release()
        assert c.stats().pinned_pages == 0


@pytest.mark.native_only  # the native decoder reuses a reply's records; the Python one makes new ones
def test_reused_objects_read_what_the_arena_holds_now(step_rig):
    b, setup = step_rig
    (k4,) = setup.lookup([b"k4"], pin=False)
    with BrokerClient.connect(b.socket) as c:
        first = c.step([], [b"k4"])
        again = c.step([], [b"k4"], release=first)
        assert again.objects[0] is first.objects[0]
        for value in (7, 42):
            (page,) = k4.page_tensors()  # the owner writes
            page.fill_(value)
            (mine,) = again.objects[0].page_tensors()
            assert int(mine[0]) == value and int(mine[-1]) == value
        again.release()


def test_a_replys_fresh_objects_are_built_together_and_read_only_as_before(step_rig, native_core):
    """A batch's fresh keys: their objects built in one ``_read_objects`` call (one mapping
    check, one page-access change), kept on their records, their pages read-only (another
    session's objects); the same with the native core and without (``native_core``)."""
    b, setup = step_rig
    core = native_core
    if core == "native" and w._core is None:
        pytest.skip("the native step core is not built")
    with BrokerClient.connect(b.socket) as c:
        built = []
        read_objects = c._read_objects
        c._read_objects = lambda infos: built.extend(infos) or read_objects(infos)
        with c.step_batch() as batch:
            got = batch.update((), (), [b"k0", b"k1"], ())
            assert len(built) == 2  # both in one call
            theirs = setup.lookup([b"k0", b"k1"])
            assert [(o.object_id, o.pages, o.key, o.owned, o.epoch) for o in got.objects] == [
                (t.object_id, t.pages, t.key, False, c.epoch) for t in theirs
            ]
            assert all(type(o) is type(theirs[0]) for o in got.objects)
            if c.view.fd_unit != "page":
                assert set(c.view.readonly_pages()) >= {p for o in got.objects for p in o.pages}
            again = batch.update((), (), [b"k0"], ())  # held: the same object, nothing built
            assert again.objects[0] is got.objects[0] and len(built) == 2
