"""The client's step path: one compact round trip per engine step, none when nothing changed.

``StepTransport`` is a blocking Unix socket to the broker's step channel (the frames of
``step_wire``, authenticated by the session token and this process's credentials).
``StepPath`` sits on it for one session: it sends batches of ops and, when asked to
(``hold_s > 0``), keeps a cache of the adapters and pins this process holds, with local
reference counts. A release to count 0 is not sent at once: the broker keeps that pin (so
nothing of it can be evicted) until the release rides along with the next frame, and an
acquire or lookup of something still held costs no round trip. Idle holdings are released
after ``hold_s`` or when more than ``max_idle`` are idle. This module knows nothing of gRPC,
mappings or tensors (``BrokerClient`` turns its records into leases and objects).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from memory_broker.broker.errors import BrokerError, Code
from memory_broker.broker.sessions import step_wire as w

# Idle holdings kept at most (beyond this the oldest are released with the next frame).
DEFAULT_MAX_IDLE = 4096


class StepUnavailable(Exception):
    """The step channel cannot be used (absent, refused the handshake, or broke): use gRPC."""


class StepTransport:
    """A connected, authenticated step socket; one call at a time (the caller locks)."""

    def __init__(self, path: str, token: str, timeout: float):
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            raise StepUnavailable(f"no step channel at {path}: {e}") from None
        self._sock = sock
        self._hdr = bytearray(w.HEADER.size)
        try:
            reply = self.request(w.frame(w.HELLO, token.encode()))
        except BaseException:
            sock.close()
            raise
        if reply.error is not None:
            sock.close()
            raise StepUnavailable(f"the step channel refused this session: {reply.error}")
        self.arena_slabs = reply.arena_slabs

    def request(self, data: bytes) -> w.StepReply:
        """Send one frame and read its reply. Raises StepUnavailable when the socket breaks."""
        sock = self._sock
        try:
            sock.sendall(data)
            hdr = self._hdr
            got = sock.recv_into(hdr)
            while got < 5:
                n = sock.recv_into(memoryview(hdr)[got:])
                if not n:
                    raise ConnectionResetError("the broker closed the step channel")
                got += n
            size, kind = w.HEADER.unpack(hdr)
            if size > w.MAX_FRAME_BYTES:
                raise ConnectionResetError(f"reply of {size} bytes")
            body = bytearray(size)
            view = memoryview(body)
            got = 0
            while got < size:
                n = sock.recv_into(view[got:])
                if not n:
                    raise ConnectionResetError("the broker closed the step channel")
                got += n
        except OSError as e:
            self.close()
            raise StepUnavailable(f"the step channel at {self.path} broke: {e}") from None
        try:
            return w.decode_step_reply(kind, bytes(body))
        except w.WireError as e:
            self.close()
            raise StepUnavailable(f"the step channel at {self.path} sent a malformed reply: {e}") from None

    def close(self) -> None:
        self._sock.close()

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0


@dataclass(slots=True)
class HeldAdapter:
    generation: int
    object_id: int
    pages: tuple[int, ...]
    # References this process's leases hold now.
    refs: int = 0
    # When refs last dropped to 0 (monotonic seconds).
    idle_since: float = 0.0


@dataclass(slots=True)
class HeldPin:
    record: w.ObjectRecord
    refs: int = 0
    # Pins the broker holds for this entry (each lookup or pin sent adds one).
    broker_pins: int = 1
    idle_since: float = 0.0


@dataclass(slots=True)
class StepOutcome:
    """What one ``StepPath.step`` got: records the client turns into a lease and objects."""

    # Admitted adapter ids, in request order, with their records; None when no acquire was
    # asked. ``acquire_hot`` False: the broker would have to load one; ask over gRPC.
    adapters: list[tuple[str, w.AcquiredRecord]] | None = None
    deferred: list[str] = field(default_factory=list)
    acquire_hot: bool = True
    txn_id: int = 0
    objects: list[w.ObjectRecord] | None = None
    arena_slabs: int = 0
    # Round trips this step took (0: all from the cache).
    round_trips: int = 0


class StepPath:
    """Batched step ops for one session, with an optional holdings cache (``hold_s > 0``)."""

    def __init__(self, transport: StepTransport, *, hold_s: float = 0.0, max_idle: int = DEFAULT_MAX_IDLE):
        self.transport = transport
        self.hold_s = hold_s
        self.max_idle = max_idle
        self.lock = threading.Lock()
        self.adapters: dict[str, HeldAdapter] = {}
        self.pins: dict[int, HeldPin] = {}
        self._by_key: dict[bytes, int] = {}
        self._idle = 0
        self._next_sweep = 0.0
        # Frames sent (what tests and the benchmark count round trips by).
        self.frames = 0

    @property
    def caching(self) -> bool:
        return self.hold_s > 0

    # ------------------------------------------------------------ one round trip

    def send(self, ops: list[w.Op]) -> w.StepReply:
        """One frame; raises BrokerError for a refused op (after applying the ones that ran)."""
        self.frames += 1
        return self.transport.request(w.encode_step(ops))

    @staticmethod
    def raise_error(reply: w.StepReply) -> None:
        if reply.error is not None:
            raise reply.error

    # ------------------------------------------------------------ the step

    def step(
        self,
        adapter_ids: Sequence[str] = (),
        keys: Sequence[bytes] = (),
        *,
        max_adapters: int = 0,
        prepare: bool = False,
        lease_ms: int = 0,
        commit: Sequence[int] = (),
        abort: Sequence[int] = (),
        release: Sequence[str] = (),
        unpin: Sequence[int] = (),
        acquire: bool = True,
        lookup: bool = True,
        pin_keys: bool = True,
    ) -> StepOutcome:
        """Release and unpin, commit or abort prepared acquires, acquire adapters, look up
        (and pin) keys: at most one round trip, none when the cache has everything.

        With the cache, ``release`` and ``unpin`` drop local references (the broker is told
        with a later frame) and a held adapter or key costs nothing. Raises BrokerError for a
        refused op; ops before it in the frame took effect and are accounted for."""
        with self.lock:
            return self._step(
                list(adapter_ids) if acquire else None, list(keys) if lookup else None, max_adapters, prepare,
                lease_ms, commit, abort, release, unpin, pin_keys,
            )  # fmt: skip

    def _step(self, ids, keys, cap, prepare, lease_ms, commit, abort, release, unpin, pin_keys) -> StepOutcome:
        out = StepOutcome()
        ops: list[w.Op] = []
        caching = self.caching and not prepare
        now = time.monotonic()
        # Releases first: what the step gives back makes room for what it takes.
        if release:
            if self.caching:
                direct_ids = self._drop_adapter_refs(release, now)
                if direct_ids:
                    ops.append(w.Op(w.OP_RELEASE, tuple(direct_ids)))
            else:
                ops.append(w.Op(w.OP_RELEASE, tuple(release)))
        if unpin:
            if self.caching:
                direct = self._drop_pin_refs(unpin, now)
                if direct:
                    ops.append(w.Op(w.OP_UNPIN, tuple(direct)))
            else:
                ops.append(w.Op(w.OP_UNPIN, tuple(unpin)))
        if commit:
            ops.append(w.Op(w.OP_COMMIT, tuple(commit)))
        if abort:
            ops.append(w.Op(w.OP_ABORT, tuple(abort)))
        # Idle holdings past their time ride along with this frame, or get one of their own
        # when there is none (at most once per hold_s).
        flush = self._flush_ops(now, force=False) if self.caching else []
        ops[:0] = flush
        acq_index = look_index = -1
        admitted: list[str] = []
        missing_ids: list[str] = []
        if ids is not None:
            distinct = list(dict.fromkeys(ids))
            n = cap or len(distinct)
            admitted, out.deferred = distinct[:n], distinct[n:]
            missing_ids = [a for a in admitted if a not in self.adapters] if caching else admitted
            if missing_ids or not caching:
                acq_index = len(ops)
                # Cached: only the missing ones, each admitted already (no cap needed).
                ops.append(
                    w.Op(w.OP_ACQUIRE, tuple(missing_ids) if caching else tuple(ids),
                         w.ACQUIRE_PREPARE if prepare else 0, 0 if caching else cap, lease_ms)
                )  # fmt: skip
        cached_objs: list[w.ObjectRecord] = []
        tail_keys: list[bytes] = []
        if keys is not None:
            if self.caching and pin_keys:
                i = 0
                for k in keys:
                    oid = self._by_key.get(k)
                    if oid is None:
                        break
                    cached_objs.append(self.pins[oid].record)
                    i += 1
                tail_keys = list(keys[i:])
            else:
                tail_keys = list(keys)
            if tail_keys:
                look_index = len(ops)
                ops.append(w.Op(w.OP_LOOKUP, tuple(tail_keys), 1 if pin_keys else 0))
        reply = None
        if ops:
            reply = self.send(ops)
            out.round_trips = 1
            out.arena_slabs = reply.arena_slabs
        results = reply.results if reply is not None else []
        ok = reply is None or reply.error is None
        # Adapters.
        if ids is not None:
            got: dict[str, w.AcquiredRecord] = {}
            if 0 <= acq_index < len(results):
                r: w.AcquireOutcome = results[acq_index]
                out.acquire_hot = r.hot
                out.txn_id = r.txn_id
                if r.hot:
                    names = missing_ids if caching else admitted
                    for aid, rec in zip(names, r.adapters):
                        got[aid] = rec
                        if caching:
                            # Held from now on; idle until a lease takes it below.
                            self.adapters[aid] = HeldAdapter(rec.generation, rec.object_id, rec.pages, 0, now)
                            self._idle += 1
                    if not ok and not caching:
                        self._undo_acquire(admitted, r)
            if ok and out.acquire_hot:
                if caching:
                    out.adapters = [(aid, self._lease_record(aid)) for aid in admitted]
                else:
                    out.adapters = [(aid, got[aid]) for aid in admitted]
        # Keys.
        if keys is not None:
            new: list[w.ObjectRecord] = results[look_index] if 0 <= look_index < len(results) else []
            if self.caching and pin_keys:
                for rec in new:
                    self._add_pin(rec, now)
                if ok:
                    for rec in cached_objs:
                        self._ref_pin(rec.object_id)
                    for rec in new:
                        self._ref_pin(rec.object_id)
            out.objects = cached_objs + list(new)
        if reply is not None:
            self.raise_error(reply)
        return out

    def _undo_acquire(self, admitted: list[str], r: w.AcquireOutcome) -> None:
        """A later op of the frame failed: give back what its acquire took (the caller gets
        the error, not a lease)."""
        op = w.Op(w.OP_ABORT, (r.txn_id,)) if r.txn_id else w.Op(w.OP_RELEASE, tuple(admitted))
        try:
            self.send([op])
        except (BrokerError, StepUnavailable):
            pass  # the session is gone, and its pins with it

    # ------------------------------------------------------------ the cache

    def _lease_record(self, aid: str) -> w.AcquiredRecord:
        h = self.adapters[aid]
        if h.refs == 0:
            self._idle -= 1
        h.refs += 1
        h.idle_since = 0.0
        return w.AcquiredRecord(h.generation, h.object_id, w.TIER_HOT, h.pages)

    def _drop_adapter_refs(self, ids: Sequence[str], now: float) -> list[str]:
        """Drop local references; the ids this cache holds no reference on (acquired over
        gRPC, or prepared), to release at the broker now."""
        direct = []
        for aid in ids:
            h = self.adapters.get(aid)
            if h is None or h.refs <= 0:
                direct.append(aid)
                continue
            h.refs -= 1
            if h.refs == 0:
                h.idle_since = now
                self._idle += 1
        return direct

    def _add_pin(self, rec: w.ObjectRecord, now: float) -> None:
        """Account one broker pin; the entry is idle until a reference is taken."""
        h = self.pins.get(rec.object_id)
        if h is None:
            self.pins[rec.object_id] = HeldPin(rec, 0, 1, now)
            self._idle += 1
            if rec.key:
                self._by_key[rec.key] = rec.object_id
        else:
            h.broker_pins += 1

    def _ref_pin(self, oid: int) -> None:
        h = self.pins[oid]
        if h.refs == 0:
            self._idle -= 1
        h.refs += 1
        h.idle_since = 0.0

    def _drop_pin_refs(self, oids: Sequence[int], now: float) -> list[int]:
        """Drop local references; the ids this cache does not hold, to unpin at the broker."""
        direct = []
        for oid in oids:
            h = self.pins.get(oid)
            if h is None or h.refs <= 0:
                direct.append(oid)
                continue
            h.refs -= 1
            if h.refs == 0:
                h.idle_since = now
                self._idle += 1
        return direct

    def add_pins(self, recs: Sequence[w.ObjectRecord]) -> None:
        """Account pins a frame's PIN op took (one reference each)."""
        with self.lock:
            now = time.monotonic()
            for rec in recs:
                self._add_pin(rec, now)
                self._ref_pin(rec.object_id)

    def held_pin(self, oid: int) -> bool:
        h = self.pins.get(oid)
        return h is not None

    def ref_pins(self, oids: Sequence[int]) -> list[w.ObjectRecord] | None:
        """Take a reference on each held object (all or none); None when one is not held."""
        with self.lock:
            if any(oid not in self.pins for oid in oids):
                return None
            for oid in oids:
                self._ref_pin(oid)
            return [self.pins[oid].record for oid in oids]

    def _flush_ops(self, now: float, force: bool) -> list[w.Op]:
        """Release and unpin ops for idle holdings that are due (all of them with ``force``),
        removed from the cache."""
        if not self._idle or (not force and now < self._next_sweep and self._idle <= self.max_idle):
            return []
        self._next_sweep = now + self.hold_s / 2
        cutoff = now - self.hold_s
        over = self._idle - self.max_idle
        rel: list[str] = []
        for aid, h in list(self.adapters.items()):
            if h.refs == 0 and (force or h.idle_since <= cutoff or over > 0):
                rel.append(aid)
                over -= 1
                del self.adapters[aid]
        unp: list[int] = []
        for oid, h in list(self.pins.items()):
            if h.refs == 0 and (force or h.idle_since <= cutoff or over > 0):
                unp.extend([oid] * h.broker_pins)
                over -= 1
                del self.pins[oid]
                if h.record.key:
                    self._by_key.pop(h.record.key, None)
        self._idle -= len(rel) + len({*unp})
        ops = []
        if rel:
            ops.append(w.Op(w.OP_RELEASE, tuple(rel)))
        if unp:
            ops.append(w.Op(w.OP_UNPIN, tuple(unp)))
        return ops

    def flush(self) -> int:
        """Release every idle holding now (one round trip if there are any); returns how many."""
        with self.lock:
            ops = self._flush_ops(time.monotonic(), force=True)
            if not ops:
                return 0
            n = sum(len(op.items) for op in ops)
            self.raise_error(self.send(ops))
            return n

    def idle(self) -> int:
        return self._idle
