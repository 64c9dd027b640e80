"""The step channel's wire format: one definition of its frames, used by the daemon and the client.

This module owns the byte layout of the fast path (``broker/doors/step_channel.py`` serves
it, ``clients/step/path.py`` speaks it): frame headers, operation and result records, limits and
error codes. It is plain ``struct`` code with no I/O and no state; it must not import gRPC
or anything of the daemon (it belongs with the shared wire types).

A frame is ``<IB`` (body length, kind) then the body; little-endian throughout. Requests:
``HELLO`` (body: the session token), ``STEP`` (``<H`` op count, then ops), ``PING`` (empty).
Every request gets exactly one reply frame of kind ``OK`` or ``ERROR``. A STEP reply body is
``<IH`` (arena slabs, results) then one result record per op that ran, in order; an ERROR
reply carries those records too, then ``<BHH`` (code, index of the failed op, message
length) and the message. A frame that cannot be parsed runs no op at all.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from memory_broker.proto.wire import native
from memory_broker.proto.wire.errors import BrokerError, Code

# Frame header: body length, kind.
HEADER = struct.Struct("<IB")
# Larger frames are not a client of ours: refused and the connection closed (its stream
# cannot be resynchronized).
MAX_FRAME_BYTES = 4 << 20
# The largest frame a connection may send before its HELLO is accepted: a HELLO carries only
# the session token (43 characters from secrets.token_urlsafe(32)). A larger frame before
# HELLO is refused at its header, so an unauthenticated connection never holds more.
MAX_HELLO_BYTES = 1024
# Ops in one STEP frame (one per kind is the usual step; a few more for batching).
MAX_OPS = 64
# A reply is bounded like a request: one frame's (or one gRPC Lookup's or Pin's) object
# records, at most MAX_REPLY_RECORDS of them and MAX_REPLY_BYTES by the broker's estimate
# (``REPLY_RECORD_BYTES`` per record, its key, 5 bytes per page: above what either encoding
# takes). An engine's step asks a few hundred; a lookup of max_batch (65,536) keys of 32
# bytes with a page each fits. Past either, the op is RESOURCE_EXHAUSTED before it changes
# anything and before any reply is encoded.
MAX_REPLY_RECORDS = 1 << 17
MAX_REPLY_BYTES = 8 << 20
REPLY_RECORD_BYTES = 64


def reply_estimate(records: int, pages: int, key_bytes: int) -> int:
    """The bytes the broker counts for a reply of ``records`` object records holding ``pages``
    pages and ``key_bytes`` of keys (its ``ReplyRoom``; the client's ``lookup_many`` plans its
    frames by it)."""
    return records * REPLY_RECORD_BYTES + 5 * pages + key_bytes


# Request kinds.
HELLO, STEP, PING = 1, 2, 3
# Reply kinds.
OK, ERROR = 0x80, 0x81

# Op kinds, each with its arguments:
OP_RELEASE = 1  # adapter ids (one pin dropped per listed id)
OP_UNPIN = 2  # object ids
OP_PIN = 3  # object ids
OP_COMMIT = 4  # adapter acquire transaction ids
OP_ABORT = 5  # adapter acquire transaction ids
OP_ACQUIRE = 6  # flags, max_adapters, lease_ms, adapter ids
OP_LOOKUP = 7  # pin flag, keys
# Adapter ids, released from their copies in a dtype: the dtype, then the ids (the release of
# an acquire that asked for one: ``OP_RELEASE`` drops the broker's own copy's pins first).
OP_RELEASE_IN = 8
OP_NAMES = {
    OP_RELEASE: "release",
    OP_UNPIN: "unpin",
    OP_PIN: "pin",
    OP_COMMIT: "commit",
    OP_ABORT: "abort",
    OP_ACQUIRE: "acquire",
    OP_LOOKUP: "lookup",
    OP_RELEASE_IN: "release in a dtype",
}
ACQUIRE_PREPARE = 1
# An acquire of copies in another dtype or of a tensor-parallel rank's shards: its ids are
# followed by the dtype and the shards' text (``layout.shards_text``), each a str16.
ACQUIRE_SHAPED = 2

# Error codes on the wire (index into this tuple).
CODES: tuple[Code, ...] = tuple(Code)
_CODE_INDEX = {c: i for i, c in enumerate(CODES)}

# An acquire result's flags byte: the adapters were acquired (0: by a broker older than this
# client, nothing was done); each record's layout follows the records (where the broker loaded
# adapters for the acquire: the client has no layout of their new generation yet).
ACQUIRED, WITH_LAYOUTS = 1, 2

# Adapter tiers in acquire results (the proto's order).
TIER_HOT, TIER_WARM, TIER_COLD = 1, 2, 3
TIER_NAMES = {TIER_HOT: "hot", TIER_WARM: "warm", TIER_COLD: "cold"}

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_COUNT_OPS = _U16
_ACQ_HEAD = struct.Struct("<BHIH")
_LOOKUP_HEAD = struct.Struct("<BH")
_STEP_REPLY_HEAD = struct.Struct("<IH")
# An OK reply's frame header and reply head together.
_OK_REPLY_HEAD = struct.Struct("<IBIH")
_ERR_TRAILER = struct.Struct("<BHH")
_ACQ_RESULT_HEAD = struct.Struct("<BBQdH")
_ACQ_ADAPTER = struct.Struct("<QQBI")
_OBJ_HEAD = struct.Struct("<QqBBBIII")
_OBJS_HEAD = struct.Struct("<BH")
OBJ_OWNED, OBJ_DEDUP = 1, 2


# The native core (``_stepcore.c``): the per-item passes below in C, or None (not built, or
# ``MEMORY_BROKER_NATIVE=0``). Each C pass returns what its Python pass returns, or None for
# anything it does not take, and the Python pass then runs: it gives the result or raises the
# error that names the fault, so errors are always the Python ones. Tests switch it off here.
_core = native.load(native.STEPCORE)
_CORE_PASSES = (
    "decode_step",
    "encode_allocations",
    "encode_step",
    "decode_ok",
    "decode_frame",
    "encode_ok_reply",
    "object_record",
    # A step batch's counts (``clients/step/batch.py``), which its module reads as ``_core`` here.
    "batch_take",
    "batch_account",
)
if _core is not None and not all(hasattr(_core, f) for f in _CORE_PASSES):
    # Built from an older _stepcore.c (a tree pulled without reinstalling): not used.
    native.log.warning(
        "native step core %s predates this step.py (no %s): the pure-Python path runs; "
        "reinstall (pip install -e .) to rebuild it",
        getattr(_core, "__file__", _core.__name__),
        ", ".join(f for f in _CORE_PASSES if not hasattr(_core, f)),
    )
    _core = None
# The attribute names the C passes read (interned once).
_OP_ATTRS = ("kind", "items", "flags", "max_adapters", "lease_ms")
_OBJ_ATTRS = ("wire_head", "wire_tail", "owner", "pins", "pin_count")


# The records below are plain (not frozen) slotted dataclasses: a frozen one costs several
# times more to build, and a step builds dozens; treat them as read-only all the same.


class WireError(ValueError):
    """A frame that does not parse; the message says where."""


@dataclass(slots=True)
class Op:
    kind: int
    # Adapter ids (release, acquire), object or transaction ids (unpin, pin, commit,
    # abort), or keys (lookup).
    items: tuple
    # Acquire: ACQUIRE_PREPARE or 0; lookup: 1 to pin.
    flags: int = 0
    max_adapters: int = 0
    lease_ms: int = 0
    # Acquire with ACQUIRE_SHAPED: the copies' dtype ("": the broker's) and shards' text;
    # release in a dtype: the dtype.
    dtype: str = ""
    shard: str = ""


@dataclass(slots=True)
class AcquiredRecord:
    generation: int
    object_id: int
    found_in: int
    pages: tuple[int, ...]
    # Not on the wire: what the client built from this record (its LeasedAdapter; the
    # client's ``SessionRecords``), found again with the record.
    made: object = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class AcquireOutcome:
    # False: an admitted adapter was not hot; nothing was pinned; ask over gRPC (it loads).
    hot: bool
    txn_id: int = 0
    deadline_unix: float = 0.0
    # Admitted adapters in request order (the first ``max_adapters`` distinct ids).
    adapters: tuple[AcquiredRecord, ...] = ()
    # Each adapter's layout (an ``AdapterLayout`` message's bytes; empty: none sent), where
    # the broker sent them (``WITH_LAYOUTS``); else ().
    layouts: tuple[bytes, ...] = ()


@dataclass(slots=True)
class ObjectRecord:
    """What ``pb.ObjectInfo`` says of an object, in the fields a client reads."""

    object_id: int
    window_page: int
    state: int
    content_type: int
    owned: bool
    deduplicated: bool
    session_pins: int
    total_pins: int
    pages: list[int]
    key: bytes
    arena_slabs: int = 0
    # Not on the wire: what the client built from this record (its BrokerObject).
    made: object = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class StepReply:
    arena_slabs: int
    # One per op that ran: None (release, unpin, commit, abort), AcquireOutcome, or a list
    # of ObjectRecord (pin, lookup).
    results: list
    # The refusal of op ``failed_index`` (the ops before it ran), or None.
    error: BrokerError | None = None
    failed_index: int = -1


# ------------------------------------------------------------------ framing


def frame(kind: int, body: bytes = b"") -> bytes:
    return HEADER.pack(len(body), kind) + body


def _str16(b: bytes, what: str) -> bytes:
    if len(b) > 0xFFFF:
        raise WireError(f"{what} is {len(b)} bytes; at most 65535")
    return _U16.pack(len(b)) + b


def _strs16_out(parts: list, raw: list[bytes], what: str) -> None:
    """Append each of ``raw`` length-prefixed (``_str16``'s)."""
    parts.append(b"".join([_str16(b, what) for b in raw]))


# Adapter id -> its UTF-8, length-prefixed (an engine names the same adapters step after step).
_ID16: dict[str, bytes] = {}
_ID16_LIMIT = 4096


def _ids16(ids: Sequence[str]) -> bytes:
    """Adapter ids, each length-prefixed UTF-8 (``_strs16_out`` of ``_utf8``), remembered."""
    try:
        return b"".join(map(_ID16.__getitem__, ids))
    except (KeyError, TypeError):
        pass  # one not seen yet (or not a string: encoded below, which raises what it raises)
    raw = _utf8(ids)
    parts: list = []
    _strs16_out(parts, raw, "an adapter id")
    if len(_ID16) + len(raw) > _ID16_LIMIT:
        _ID16.clear()
    pack = _U16.pack
    for a, b in zip(ids, raw):
        if type(a) is str:
            _ID16[a] = pack(len(b)) + b
    return parts[0] if parts else b""


def _utf8(ids: Sequence[str]) -> list[bytes]:
    """Adapter ids as UTF-8 (all of them encoded at once where none holds a NUL)."""
    try:
        out = "\0".join(ids).encode().split(b"\0")
    except (TypeError, UnicodeError):
        out = []
    if len(out) != len(ids) or not ids:
        out = [a.encode() for a in ids]  # one by one (raises what a bad id raises)
    return out


def _ids(ids: Sequence[int]) -> bytes:
    n = len(ids)
    if n > 0xFFFF:
        raise WireError(f"{n} ids in one op; at most 65535")
    try:
        return _U16.pack(n) + struct.pack(f"<{n}Q", *ids)
    except struct.error:
        raise WireError(f"object and transaction ids are integers in 0..2**64-1; got {list(ids)[:8]}") from None


def encode_step(ops: Sequence[Op | tuple]) -> bytes:
    """A STEP request frame. An op is an ``Op`` or a tuple of its fields in order (kind, items,
    and as many of flags, max_adapters, lease_ms as it sets: a client's one-off ops, which
    need no object)."""
    if _core is not None:
        out = _core.encode_step(ops, _OP_ATTRS)
        if out is not None:
            return out
    return _encode_step(ops)


def _encode_step(ops: Sequence[Op | tuple]) -> bytes:
    ops = [Op(*op) if type(op) is tuple else op for op in ops]
    if len(ops) > MAX_OPS:
        raise WireError(f"{len(ops)} ops in one step; at most {MAX_OPS}")
    parts = [_COUNT_OPS.pack(len(ops))]
    for op in ops:
        k = op.kind
        parts.append(bytes((k,)))
        if k in (OP_RELEASE, OP_RELEASE_IN, OP_LOOKUP) and len(op.items) > 0xFFFF:
            raise WireError(f"{len(op.items)} items in one op; at most 65535")
        if k in (OP_RELEASE, OP_RELEASE_IN):
            if k == OP_RELEASE_IN:
                _strs16_out(parts, _utf8([op.dtype]), "a dtype")
            parts.append(_U16.pack(len(op.items)))
            parts.append(_ids16(op.items))
        elif k in (OP_UNPIN, OP_PIN, OP_COMMIT, OP_ABORT):
            parts.append(_ids(op.items))
        elif k == OP_ACQUIRE:
            if not (0 <= op.max_adapters <= 0xFFFF and 0 <= op.lease_ms <= 0xFFFFFFFF and len(op.items) <= 0xFFFF):
                raise WireError(
                    f"acquire: max_adapters {op.max_adapters} (0..65535), lease {op.lease_ms} ms (0..4294967295) "
                    f"or {len(op.items)} ids (at most 65535) out of range"
                )
            parts.append(_ACQ_HEAD.pack(op.flags, op.max_adapters, op.lease_ms, len(op.items)))
            parts.append(_ids16(op.items))
            if op.flags & ACQUIRE_SHAPED:
                _strs16_out(parts, _utf8([op.dtype, op.shard]), "a dtype or shards")
        elif k == OP_LOOKUP:
            parts.append(_LOOKUP_HEAD.pack(op.flags, len(op.items)))
            _strs16_out(parts, list(map(bytes, op.items)), "a key")
        else:
            raise WireError(f"unknown op kind {k}")
    body = b"".join(parts)
    return HEADER.pack(len(body), STEP) + body


class _Reader:
    """A cursor over a frame body; every short read is a WireError naming what was cut."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes):
        self.buf = buf
        self.pos = 0

    def unpack(self, st: struct.Struct, what: str) -> tuple:
        end = self.pos + st.size
        if end > len(self.buf):
            raise WireError(f"frame ends inside {what} (byte {self.pos} of {len(self.buf)})")
        out = st.unpack_from(self.buf, self.pos)
        self.pos = end
        return out

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise WireError(f"frame ends inside {what}: {n} bytes announced, {len(self.buf) - self.pos} left")
        out = bytes(self.buf[self.pos : end])
        self.pos = end
        return out

    def u16(self, what: str) -> int:
        return self.unpack(_U16, what)[0]

    def str16(self, what: str) -> bytes:
        return self.take(self.u16(what), what)

    def ids(self, what: str) -> tuple[int, ...]:
        n = self.u16(what)
        return struct.unpack("<%dQ" % n, self.take(8 * n, what))

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise WireError(f"{len(self.buf) - self.pos} bytes after the last op")


def _text(b: bytes, what: str) -> str:
    try:
        return b.decode()
    except UnicodeDecodeError:
        raise WireError(f"{what} is not UTF-8") from None


def decode_step(body: bytes) -> list[Op]:
    """The ops of a STEP body. Raises WireError (nothing may run then).

    The native core reads a well-formed body in one pass; anything it does not take (and
    every body, without it) is read field by field, which says what is wrong and where."""
    if _core is not None:
        ops = _core.decode_step(body, Op)
        if ops is not None:
            return ops
    return _decode_step_checked(body)


def _decode_step_checked(body: bytes) -> list[Op]:
    """``decode_step`` field by field, every fault a WireError that names it."""
    r = _Reader(body)
    n = r.u16("the op count")
    if n > MAX_OPS:
        raise WireError(f"{n} ops in one step; at most {MAX_OPS}")
    ops = []
    for i in range(n):
        (k,) = r.unpack(_U8, f"op {i}'s kind")
        where = f"op {i} ({OP_NAMES.get(k, k)})"
        if k in (OP_RELEASE, OP_RELEASE_IN):
            dtype = _text(r.str16(where), where + "'s dtype") if k == OP_RELEASE_IN else ""
            count = r.u16(where)
            ids = tuple(_text(r.str16(where), where + "'s adapter id") for _ in range(count))
            ops.append(Op(k, ids, dtype=dtype))
        elif k in (OP_UNPIN, OP_PIN, OP_COMMIT, OP_ABORT):
            ops.append(Op(k, r.ids(where)))
        elif k == OP_ACQUIRE:
            flags, cap, lease_ms, count = r.unpack(_ACQ_HEAD, where)
            if flags & ~(ACQUIRE_PREPARE | ACQUIRE_SHAPED):
                raise WireError(f"{where}: unknown flags {flags:#x}")
            ids = tuple(_text(r.str16(where), where + "'s adapter id") for _ in range(count))
            dtype = shard = ""
            if flags & ACQUIRE_SHAPED:
                dtype, shard = (_text(r.str16(where), f"{where}'s {what}") for what in ("dtype", "shards"))
            ops.append(Op(k, ids, flags, cap, lease_ms, dtype, shard))
        elif k == OP_LOOKUP:
            pin, count = r.unpack(_LOOKUP_HEAD, where)
            if pin > 1:
                raise WireError(f"{where}: pin flag must be 0 or 1, got {pin}")
            ops.append(Op(k, tuple(r.str16(where) for _ in range(count)), pin))
        else:
            raise WireError(f"op {i} has unknown kind {k}; known: {sorted(OP_NAMES)}")
    r.done()
    return ops


_U8 = struct.Struct("<B")


# ------------------------------------------------------------------ replies


# An object record's parts: what never changes once it is committed (id, window page,
# state, content type), what may change from one reply to the next (flags, session and
# total pins), and what never changes at all (page count, pages, key).
_OBJ_FIXED_HEAD = struct.Struct("<QqBB")
_OBJ_CHANGING = struct.Struct("<BII")
assert _OBJ_FIXED_HEAD.size + _OBJ_CHANGING.size + 4 == _OBJ_HEAD.size
_COMMITTED = 2  # ObjectState.COMMITTED: from then on, an object's head never changes


def _wire_parts(o) -> tuple[bytes, bytes]:
    """``o``'s fixed record parts (head, tail), kept on it (``wire_head``, ``wire_tail``)
    once it is committed."""
    pages, key = o.pages, o.key or b""
    n = len(pages)
    head = _OBJ_FIXED_HEAD.pack(o.object_id, o.window_page, o.state, o.content_type)
    tail = struct.pack("<I%dIH" % n, n, *pages, len(key)) + key
    if o.state == _COMMITTED:
        o.wire_head, o.wire_tail = head, tail
    return head, tail


def encode_allocations(kind: int, sid: int, objs: Sequence) -> bytes:
    """An OP_PIN or OP_LOOKUP result of the store's objects as session ``sid`` sees them
    (anything with ``object_id``, ``window_page``, ``state``, ``content_type``, ``owner``,
    ``pins``, ``pin_count``, ``pages`` and ``key``; never deduplicated).

    Objects with ``wire_head`` and ``wire_tail`` slots (the store's) keep their fixed parts
    there once committed: a record is then those two around its changing fields."""
    if objs and hasattr(objs[0], "wire_tail"):
        if _core is not None:
            out = _core.encode_allocations(kind, sid, objs, _wire_parts, _OBJ_ATTRS)
            if out is not None:
                return out
        parts = [_OBJS_HEAD.pack(kind, len(objs))]
        append, pack = parts.append, _OBJ_CHANGING.pack
        for o in objs:
            head = o.wire_head
            if head is None:
                head, tail = _wire_parts(o)
            else:
                tail = o.wire_tail
            append(head)
            append(pack(o.owner == sid, o.pins.get(sid, 0), o.pin_count))
            append(tail)
        return b"".join(parts)
    parts = [_OBJS_HEAD.pack(kind, len(objs))]
    append, head, u16, pack = parts.append, _OBJ_HEAD.pack, _U16.pack, struct.pack
    for o in objs:
        pages, key = o.pages, o.key or b""
        n = len(pages)
        append(
            head(
                o.object_id,
                o.window_page,
                o.state,
                o.content_type,
                OBJ_OWNED if o.owner == sid else 0,
                o.pins.get(sid, 0),
                o.pin_count,
                n,
            )
        )
        append(pack("<%dI" % n, *pages))
        append(u16(len(key)) + key)
    return b"".join(parts)


def encode_acquire(out: AcquireOutcome) -> bytes:
    if not out.hot:
        return _ACQ_RESULT_HEAD.pack(OP_ACQUIRE, 0, 0, 0.0, 0)
    rows = [(a.generation, a.object_id, a.found_in, a.pages) for a in out.adapters]
    return encode_acquire_rows(out.txn_id, out.deadline_unix, rows, out.layouts)


def encode_acquire_rows(
    txn_id: int, deadline_unix: float, rows: Sequence[tuple], layouts: Sequence[bytes] = ()
) -> bytes:
    """An ``encode_acquire`` from tuples in ``AcquiredRecord``'s field order (no records
    built), with a layout per row where ``layouts`` are given."""
    if layouts and len(layouts) != len(rows):
        raise WireError(f"{len(layouts)} layouts for {len(rows)} acquired adapters")
    flags = ACQUIRED | (WITH_LAYOUTS if layouts else 0)
    parts = [_ACQ_RESULT_HEAD.pack(OP_ACQUIRE, flags, txn_id, deadline_unix, len(rows))]
    head = _ACQ_ADAPTER.pack
    for gen, oid, tier, pages in rows:
        parts.append(head(gen, oid, tier, len(pages)))
        parts.append(struct.pack("<%dI" % len(pages), *pages))
    for raw in layouts:
        parts.append(_U32.pack(len(raw)) + raw)
    return b"".join(parts)


def acquire_row(generation: int, object_id: int, tier: int, pages: Sequence[int]) -> bytes:
    """One acquired adapter's row of a hot ``encode_acquire`` (what ``encode_acquire_rows``
    writes per row): the step channel keeps each hot object's row and joins them."""
    return _ACQ_ADAPTER.pack(generation, object_id, tier, len(pages)) + struct.pack("<%dI" % len(pages), *pages)


def acquire_head(n: int) -> bytes:
    """What a hot ``encode_acquire`` of a one-phase acquire of ``n`` adapters writes before its rows."""
    return _ACQ_RESULT_HEAD.pack(OP_ACQUIRE, 1, 0, 0.0, n)


def encode_acquire_joined(rows: Sequence[bytes]) -> bytes:
    """A hot ``encode_acquire`` of a one-phase acquire (no transaction) from ``acquire_row``s."""
    return acquire_head(len(rows)) + b"".join(rows)


def encode_step_reply(
    arena_slabs: int, results: Sequence[bytes], error: BrokerError | None = None, index: int = 0
) -> bytes:
    """A STEP reply frame from already-encoded result records."""
    if error is None:
        if _core is not None:
            out = _core.encode_ok_reply(arena_slabs, results)
            if out is not None:
                return out
        # Header, reply head and records in one join (one copy of each record).
        n = len(results)
        size = _STEP_REPLY_HEAD.size + (len(results[0]) if n == 1 else sum(map(len, results)) if n else 0)
        return b"".join((_OK_REPLY_HEAD.pack(size, OK, arena_slabs, n), *results))
    body = _STEP_REPLY_HEAD.pack(arena_slabs, len(results)) + b"".join(results)
    body += error_trailer(error, index)
    return HEADER.pack(len(body), ERROR) + body


def error_trailer(error: BrokerError, index: int = 0) -> bytes:
    msg = error.message.encode()[:4000]
    return _ERR_TRAILER.pack(_CODE_INDEX.get(error.code, _CODE_INDEX[Code.INTERNAL]), index, len(msg)) + msg


def error_frame(error: BrokerError) -> bytes:
    """An ERROR reply to a frame that ran nothing (a STEP error reply with no results)."""
    return encode_step_reply(0, (), error, 0)


def _decode_error(r: _Reader) -> tuple[BrokerError, int]:
    code, index, n = r.unpack(_ERR_TRAILER, "the error")
    msg = r.take(n, "the error message").decode(errors="replace")
    return BrokerError(CODES[code] if code < len(CODES) else Code.INTERNAL, msg), index


def _read_acquire(body: bytes, pos: int, append) -> int:
    """The acquire result at ``pos`` of a reply's body, ``append``ed; returns where it ends."""
    end = len(body)
    _, hot, txn, deadline, count = _ACQ_RESULT_HEAD.unpack_from(body, pos)
    pos += _ACQ_RESULT_HEAD.size
    ads = []
    for _ in range(count):
        gen, oid, tier, npages = _ACQ_ADAPTER.unpack_from(body, pos)
        pos += _ACQ_ADAPTER.size
        if pos + 4 * npages > end:
            raise WireError(f"frame ends inside an adapter's pages (byte {pos} of {end})")
        ads.append(AcquiredRecord(gen, oid, tier, struct.unpack_from("<%dI" % npages, body, pos)))
        pos += 4 * npages
    layouts = []
    for _ in range(count if hot & WITH_LAYOUTS else 0):
        (size,) = _U32.unpack_from(body, pos)
        pos += 4
        if pos + size > end:
            raise WireError(f"frame ends inside an adapter's layout (byte {pos} of {end})")
        layouts.append(bytes(body[pos : pos + size]))
        pos += size
    append(AcquireOutcome(bool(hot & ACQUIRED), txn, deadline, tuple(ads), tuple(layouts)))
    return pos


def decode_step_reply(kind: int, body: bytes) -> StepReply:
    """A STEP (or refused HELLO/PING) reply. Raises WireError on a malformed one.

    Read with precompiled structs at a running offset (a reply is decoded on every step of
    an engine; the cursor object's per-field calls cost more than the rest of it)."""
    if kind not in (OK, ERROR):
        raise WireError(f"reply of unknown kind {kind}")
    end = len(body)
    pos = 0
    try:
        slabs, n = _STEP_REPLY_HEAD.unpack_from(body, 0)
        pos = _STEP_REPLY_HEAD.size
        results: list = []
        append = results.append
        for _ in range(n):
            k = body[pos]
            if k == OP_ACQUIRE:
                pos = _read_acquire(body, pos, append)
            elif k == OP_PIN or k == OP_LOOKUP:
                (count,) = _U16.unpack_from(body, pos + 1)
                pos += 3
                objs = []
                for _ in range(count):
                    oid, wp, state, ct, flags, sp, tp, npages = _OBJ_HEAD.unpack_from(body, pos)
                    pos += _OBJ_HEAD.size
                    if pos + 4 * npages > end:
                        raise WireError(f"frame ends inside an object's pages (byte {pos} of {end})")
                    pages = list(struct.unpack_from("<%dI" % npages, body, pos))
                    pos += 4 * npages
                    (klen,) = _U16.unpack_from(body, pos)
                    pos += 2
                    if pos + klen > end:
                        raise WireError(f"frame ends inside a key: {klen} bytes announced, {end - pos} left")
                    key = bytes(body[pos : pos + klen])
                    pos += klen
                    objs.append(
                        ObjectRecord(
                            oid,
                            wp,
                            state,
                            ct,
                            bool(flags & OBJ_OWNED),
                            bool(flags & OBJ_DEDUP),
                            sp,
                            tp,
                            pages,
                            key,
                            slabs,
                        )
                    )
                append(objs)
            elif k in OP_NAMES:
                pos += 1
                append(None)
            else:
                raise WireError(f"result of unknown kind {k}")
    except (struct.error, IndexError):
        raise WireError(f"frame ends inside the reply (byte {pos} of {end})") from None
    if kind == ERROR:
        r = _Reader(body)
        r.pos = pos
        err, index = _decode_error(r)
        r.done()
        return StepReply(slabs, results, err, index)
    if pos != end:
        raise WireError(f"{end - pos} bytes after the last result")
    return StepReply(slabs, results)


# ------------------------------------------------------------------ the client's decode
#
# ``decode_step_reply`` builds a record per adapter and per object, every reply. An engine's
# steps mostly get back what the last ones got: ``ReplyDecoder`` (one per step connection)
# hands back, through the native core, the record it made before from the same bytes (records
# are read-only), so the client's caches of what it built from a record
# (``clients/step/lease.py``) hit. Anything the core does not take (an ERROR reply, a cut or
# malformed one), and every reply without it, is decoded by ``decode_step_reply``, which says
# what is wrong.

# Records kept per decoder (cleared beyond this: they are made again on demand).
_MEMO_LIMIT = 16384


def _object_record(raw: bytes, slabs: int) -> ObjectRecord:
    oid, wp, state, ct, flags, sp, tp, npages = _OBJ_HEAD.unpack_from(raw)
    at = _OBJ_HEAD.size + 4 * npages
    pages = list(struct.unpack_from("<%dI" % npages, raw, _OBJ_HEAD.size))
    return ObjectRecord(
        oid, wp, state, ct, bool(flags & OBJ_OWNED), bool(flags & OBJ_DEDUP), sp, tp, pages, raw[at + 2 :], slabs
    )


def _object_maker(slabs: int):
    """``_object_record`` of an arena of ``slabs`` slabs, as one call of ``raw``: the native
    core's (which reads the record's fields in C and calls ``ObjectRecord`` with them: a fresh
    key's record is made on every step that looks it up) where it is there, else the Python one."""
    if _core is not None:
        return functools.partial(_core.object_record, ObjectRecord, slabs)
    return lambda raw: _object_record(raw, slabs)


def _adapter_record(raw: bytes) -> AcquiredRecord:
    gen, oid, tier, npages = _ACQ_ADAPTER.unpack_from(raw)
    return AcquiredRecord(gen, oid, tier, struct.unpack_from("<%dI" % npages, raw, _ACQ_ADAPTER.size))


class ReplyDecoder:
    """``decode_step_reply`` for one client connection, with equal results; a record is the
    one it made before from the same bytes (and the same arena size), not a new one."""

    __slots__ = ("_objects", "_adapters", "_slabs", "_make_object", "_last_objects", "_last_adapters")

    def __init__(self):
        # A record's bytes -> the record made from them.
        self._objects: dict[bytes, ObjectRecord] = {}
        self._adapters: dict[bytes, AcquiredRecord] = {}
        # (bytes, record) of the object and adapter records of the last reply ``frame``
        # decoded, in reply order: a record at the same place with the same bytes is found
        # by comparing them (an engine's steps get much the same reply step after step).
        self._last_objects: list[tuple[bytes, ObjectRecord]] = []
        self._last_adapters: list[tuple[bytes, AcquiredRecord]] = []
        self._slabs = -1
        self._make_object = _object_record

    def __call__(self, kind: int, body: bytes) -> StepReply:
        if kind == OK and _core is not None:
            try:
                # The native pass, inline (one call a frame less on every round trip).
                slabs, n = _STEP_REPLY_HEAD.unpack_from(body)
                if slabs != self._slabs and n:
                    self._new_arena(slabs)
                got = _core.decode_ok(
                    body, self._objects, self._make_object, self._adapters, _adapter_record, AcquireOutcome, _MEMO_LIMIT
                )
                if got is not None:
                    return StepReply(got[0], got[1])
            except Exception:  # noqa: BLE001 (malformed: the reference decoder names the fault)
                pass
        return decode_step_reply(kind, body)

    def frame(self, buf, got: int) -> StepReply | None:
        """The reply of the whole OK frame in ``buf[:got]`` (its header included), decoded by
        the native core in one call, records as ``__call__`` makes them; or None where the
        core is not there or does not take it (not one whole OK frame, a new arena's size, or
        malformed): the caller then reads it whole and calls ``__call__``, which says why."""
        if _core is None:
            return None
        return _core.decode_frame(
            self._objects,
            self._make_object,
            self._adapters,
            _adapter_record,
            AcquireOutcome,
            _MEMO_LIMIT,
            StepReply,
            self._slabs,
            buf,
            got,
            self._last_objects,
            self._last_adapters,
        )

    def _new_arena(self, slabs: int) -> None:
        """An object record carries the arena's size: records are made again for a new one
        (a reply with no results, as a PING's, makes none and changes nothing; brokers before this
        one said 0 slabs in a PING's reply)."""
        self._objects.clear()
        self._last_objects.clear()
        self._slabs = slabs
        self._make_object = _object_maker(slabs)
