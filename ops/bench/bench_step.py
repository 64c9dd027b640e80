#!/usr/bin/env python3
"""An engine step's control-plane cost at the client: gRPC and the step channel.

    python ops/bench/bench_step.py [--steps 2000] [--quick] [--only TEXT]
    python ops/bench/bench_step.py --per-item | --keys-only | --adapters-only [--steps N]

Starts a broker (host arena, --enable-echo) in a subprocess, registers 200 tiny adapters and
makes them hot, and allocates keyed KV blocks. Two workloads, each step holding the batch's
adapters and pinning one KV block key per sequence, and giving back the previous step's:
* steady: the same 16 sequences (8 adapters, 16 keys) every step (issue 16's example step);
* trace: requests arrive and complete every step (Zipf(1.0) over the 200 adapters, batch
  size drifting within 8..32 sequences, at least one arrival and one completion per step,
  a KV key per arrival never seen before in the run, so every step has something to ask).
Each runs through every client path: gRPC (the old path, 4 RPCs per step), the step channel
with the same four calls (four frames, each waited for), one ``client.step()`` call, and
pipelined (``step_begin`` sent when the next batch is known,
the reply collected after a simulated 2 ms of model work (a sleep, as a CPU waiting on
its GPU; a tenth of a 20 ms decode step), which is not counted). The ``StepBatch`` rows
tell the broker only each step's arrivals and completions (``client.step_batch()``):
blocking (``update``), overlapped (``begin`` before the model work, ``result`` after; the
engine thread's time in both is counted, its CPU time printed too), and overlapped with a
background batch (``begin`` queues the change; the batch's worker thread runs it during the
model work; the client process's CPU per step, every thread and the model's wait excluded,
is printed under the table: the work moved, it was not removed). ``BENCH_STEP_WAIT=spin``
makes the model work a busy wait in C (the GIL released), ``pyspin`` one in Python (the GIL
held), instead of a sleep; ``--only TEXT`` runs the paths whose name contains TEXT. Per-step
client-side cost: median and p99, in us and as a multiple of a raw Unix-socket ping-pong
(a bare echo process, 32-byte messages) measured in the same run, next to the step channel's
own PING and a bare gRPC Echo, and the same raw ping-pong made after the model's wait (what
this VM charges code that runs after an idle spell: read the overlapped rows against both).
Targets (issue 16): steady median <= 2x raw; trace median <= 2x raw and p99 <= 10x (raw:
the back-to-back ping-pong).

``--one-cpu`` holds every process of the run (this client, the broker and its threads, the echo
processes) on one CPU, so no row pays a wake-up across CPUs (on this VM it costs more than the
round trip itself): the step rows are then like for like with the raw one-CPU row.

``--per-item`` prints instead each side's cost of a step of 1, 8, 64 and 512 items (a third
adapters, the rest KV keys; issue 28's target: a CPU slope between 64 and 512 items under
0.5 us per item per side); ``--keys-only`` and ``--adapters-only`` make every item a KV key
(41-byte digests, as the vLLM connector's) or an adapter, so each kind's slope shows alone.
``--codec both`` runs each per-item size with the step wire's native codec and then its
pure-Python fallback (``--codec python``: the fallback alone); the broker runs in this process,
so the switch is both sides'. The other rows follow ``MEMORY_BROKER_NATIVE`` (``0``: the
fallback, in the broker it starts too): run them once each way for an A/B.
``BENCH_STEP_BROKER_FLAGS`` adds flags to the broker's command line.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test helpers in tests/rigs.py

import grpc  # noqa: E402
from bench_rpc import start_broker  # noqa: E402  (this folder is on sys.path above)
from rigs import inprocess_broker, write_adapter  # noqa: E402  (other benchmarks use them from here)

from memory_broker.clients import BrokerClient, Spec  # noqa: E402
from memory_broker.proto.wire import step as step_wire  # noqa: E402
from memory_broker.proto.wire.session import KEY_METADATA  # noqa: E402
from memory_broker.proto.wire.v1 import echo_pb2, echo_pb2_grpc  # noqa: E402

ADAPTERS = 200
# KV blocks (one 512 KiB page each): enough that no arrival's key was seen before.
KEYS = int(os.environ.get("BENCH_STEP_KEYS", 12000))
# The model's work per step in the pipelined path: a tenth of a 20 ms decode step.
MODEL_WORK_S = 2e-3

ECHO_SERVER = r"""
import os, socket, sys
path = sys.argv[1]
if len(sys.argv) > 2:
    os.sched_setaffinity(0, {int(sys.argv[2])})
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.bind(path); s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
while True:
    b = c.recv(4096)
    if not b:
        break
    c.sendall(b)
"""

# The same echo served as the broker serves its step channel: a non-blocking socket read by an
# ``add_reader`` callback of an asyncio loop, so its row is the loop's own floor per frame.
ASYNC_ECHO_SERVER = r"""
import asyncio, os, socket, sys
path = sys.argv[1]
if len(sys.argv) > 2:
    os.sched_setaffinity(0, {int(sys.argv[2])})
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.bind(path); s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
c.setblocking(False)
loop = asyncio.new_event_loop()
def readable():
    b = c.recv(4096)
    if not b:
        loop.stop()
        return
    c.send(b)
loop.add_reader(c.fileno(), readable)
loop.run_forever()
"""


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# ------------------------------------------------------------------ workloads


def steady(steps: int) -> list[tuple[list[str], list[bytes]]]:
    ids = [f"ad{i % 8}" for i in range(16)]
    keys = [b"kv-%d" % i for i in range(16)]
    return [(ids, keys)] * steps


def trace(steps: int, seed: int = 7) -> list[tuple[list[str], list[bytes]]]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(ADAPTERS)]
    nxt = [16]

    def arrival() -> tuple[str, bytes]:
        a = rng.choices(range(ADAPTERS), weights)[0]
        k = b"kv-%d" % (nxt[0] % KEYS)  # fresh: KEYS exceeds the arrivals of a run
        nxt[0] += 1
        return f"ad{a}", k

    batch = [arrival() for _ in range(16)]
    target = 16
    out = []
    for _ in range(steps):
        target = max(8, min(32, target + rng.choice((-1, 0, 1))))
        kept = [s for s in batch if rng.random() > 1 / 20]
        if len(kept) == len(batch):
            kept.pop(rng.randrange(len(kept)))  # at least one completion
        kept += [arrival() for _ in range(max(1, target - len(kept)))]  # at least one arrival
        batch = kept
        out.append(([a for a, _ in batch], [k for _, k in batch]))
    if nxt[0] > KEYS:
        raise SystemExit(f"{steps} trace steps need {nxt[0]} fresh KV keys; the benchmark allocates {KEYS}")
    return out


# ------------------------------------------------------------------ client paths


def old_api(c: BrokerClient, work):
    """The four calls an engine written against the client library makes."""
    prev = None
    for ids, keys in work:
        t0 = time.perf_counter_ns()
        lease = c.acquire_adapters(ids)
        objs = c.lookup(keys, pin=True)
        if prev is not None:
            prev[0].release()
            c.unpin(prev[1])
        yield (time.perf_counter_ns() - t0) / 1000
        prev = (lease, objs)
    prev[0].release()
    c.unpin(prev[1])


def step_api(c: BrokerClient, work):
    prev = None
    for ids, keys in work:
        t0 = time.perf_counter_ns()
        prev = c.step(ids, keys, release=prev)
        yield (time.perf_counter_ns() - t0) / 1000
    prev.release()


def pipelined(c: BrokerClient, work):
    """Send step i+1's changes (with step i-1's releases) as step i starts, run step i's
    model work, then collect them: the round trip overlaps the work."""
    before = None  # step i-1's lease
    t0 = time.perf_counter_ns()
    pending = c.step_begin(*work[0])
    for i in range(len(work)):
        cur = pending.result()
        if i + 1 < len(work):
            pending = c.step_begin(*work[i + 1], release=before)
        elif before is not None:
            before.release()
        yield (time.perf_counter_ns() - t0) / 1000
        # The model's work for step i (not counted): on an engine the GPU runs it while
        # the CPU waits, so this thread sleeps rather than spins.
        time.sleep(MODEL_WORK_S)
        t0 = time.perf_counter_ns()
        before = cur
    before.release()


def deltas(work):
    """Each step's arrivals and completions against the step before (what a scheduler
    knows without computing anything): (add ids, drop ids, add keys, drop keys). Made
    before the timing starts; a sequence is its (adapter, key) pair."""
    out = []
    prev: dict = {}
    for ids, keys in work:
        cur = dict.fromkeys(zip(ids, keys))
        arr = [s for s in cur if s not in prev]
        done = [s for s in prev if s not in cur]
        out.append(([a for a, _ in arr], [a for a, _ in done], [k for _, k in arr], [k for _, k in done]))
        prev = cur
    return out


def batch_api(c: BrokerClient, work):
    """Blocking: one ``StepBatch.update`` per step with its arrivals and completions."""
    b = c.step_batch()
    for add, drop, add_keys, drop_keys in deltas(work):
        t0 = time.perf_counter_ns()
        b.update(add, drop, add_keys, drop_keys)
        yield (time.perf_counter_ns() - t0) / 1000
    b.release()


# How the engine thread waits for its model work: "sleep" (a blocking wait on the GPU: the
# CPU idles), "spin" (a busy wait in C with the GIL released, as CUDA's default synchronize
# spins under torch.cuda.synchronize: here hashing a buffer, which releases the GIL), or
# "pyspin" (a busy wait in Python holding the GIL: an engine thread running Python all
# through the model's work, so other threads get the GIL only every switch interval).
MODEL_WAIT = os.environ.get("BENCH_STEP_WAIT", "sleep")
_SPIN_BUF = b"\0" * 16384


def model_work() -> None:
    if MODEL_WAIT == "spin":
        end = time.perf_counter() + MODEL_WORK_S
        while time.perf_counter() < end:
            hashlib.sha256(_SPIN_BUF)
    elif MODEL_WAIT == "pyspin":
        end = time.perf_counter() + MODEL_WORK_S
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(MODEL_WORK_S)


# The engine thread's CPU time in begin + result per overlapped step (the wall time less
# what the thread waited or was preempted for), and the whole client process's CPU time per
# step (every thread: a background batch's worker too), by workload run.
OVERLAP_CPU: list[float] = []
PROCESS_CPU: list[float] = []


def batch_overlapped(c: BrokerClient, work, background: bool = False):
    """The engine's loop with the round trip overlapping the model: while step i's model
    work runs (a sleep, as a CPU waiting on its GPU), step i+1's arrivals are sent with the
    completions of step i-1 (what step i no longer reads); the reply is collected after the
    work. Counted: the time this thread spends in ``begin`` and ``result`` (not the work)."""
    d = deltas(work)
    b = c.step_batch(background=background)
    b.update(d[0][0], (), d[0][2], ())
    for i in range(len(d)):
        nxt = d[i + 1] if i + 1 < len(d) else ((), (), (), ())
        p0 = time.process_time_ns()
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        p = b.begin(nxt[0], d[i][1], nxt[2], d[i][3])
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        model_work()  # step i's model work (not counted)
        c2, t2 = time.thread_time_ns(), time.perf_counter_ns()
        p.result()
        t3, c3 = time.perf_counter_ns(), time.thread_time_ns()
        PROCESS_CPU.append((time.process_time_ns() - p0 - (c2 - c1)) / 1000)
        OVERLAP_CPU.append((c1 - c0 + c3 - c2) / 1000)
        yield (t1 - t0 + t3 - t2) / 1000
    b.release()


def batch_background(c: BrokerClient, work):
    """``batch_overlapped`` with a background batch: ``begin`` only queues the change, the
    batch's worker thread sends it, reads the reply and accounts it during the model work,
    so ``result()`` finds it done."""
    return batch_overlapped(c, work, background=True)


PATHS = [
    ("gRPC, 4 calls (old path)", dict(fast_path=False), old_api),
    ("step channel, same 4 calls", dict(), old_api),
    ("step channel, client.step()", dict(), step_api),
    ("step channel, step_begin (pipelined)", dict(), pipelined),
    ("step channel, StepBatch.update()", dict(), batch_api),
    ("step channel, StepBatch begin+result (overlap)", dict(), batch_overlapped),
    ("step channel, StepBatch background (overlap)", dict(), batch_background),
]


def measure(socket_path: str, kw: dict, fn, work, warm: int) -> tuple[list[float], float, float]:
    """(per-step us, round trips per step, the client process's CPU us per step, every
    thread, the model's wait included where it spins) over ``work`` after ``warm`` untimed steps."""
    c = BrokerClient.connect(socket_path, client_name="bench-step", **kw)
    try:
        # An engine that has run a while has every adapter's layout (fetched once per
        # adapter, over gRPC); so does this client before it is timed.
        c.acquire_adapters([f"ad{i}" for i in range(ADAPTERS)]).release()
        for _ in fn(c, work[:warm]):
            pass
        st = c._step_path()
        f0 = st.frames if st is not None else 0
        p0 = time.process_time_ns()
        xs = list(fn(c, work[warm:]))
        cpu = (time.process_time_ns() - p0) / 1000 / len(xs)
        rts = ((st.frames - f0) / len(xs)) if st is not None else 4.0
        return xs, rts, cpu
    finally:
        c.close()


def raw_pingpong(d: str, n: int, idle: bool = False, one_cpu: bool = False, server: str = ECHO_SERVER) -> list[float]:
    """A raw Unix-socket round trip to a bare echo process, back to back (or, ``idle``,
    each after the model's work, as the overlapped rows' ``result()`` is; ``one_cpu``: both
    processes on this process's first CPU, the fastest case on this VM; ``server``: the echo
    process's code, ``ASYNC_ECHO_SERVER`` for the asyncio loop's floor)."""
    path = os.path.join(d, "echo.sock")
    if os.path.exists(path):
        os.unlink(path)
    mask = os.sched_getaffinity(0)
    cpu = min(mask)
    p = subprocess.Popen(
        [sys.executable, "-c", server, path] + ([str(cpu)] if one_cpu else []), stdout=subprocess.PIPE, text=True
    )
    if one_cpu:
        os.sched_setaffinity(0, {cpu})
    try:
        p.stdout.readline()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        msg = b"x" * 32
        out = []
        for _ in range(n + 200):
            if idle:
                model_work()
            t0 = time.perf_counter_ns()
            s.sendall(msg)
            s.recv(4096)
            out.append((time.perf_counter_ns() - t0) / 1000)
        s.close()
        return out[200:]
    finally:
        if one_cpu:
            os.sched_setaffinity(0, mask)
        p.wait(10)


def worker_floor(d: str, n: int) -> list[tuple[float, float, float]]:
    """What a background batch's worker pays per change before any Python of its own, on
    this machine: its thread's CPU for a timed wait of the model's work (the worker sleeps
    between changes), then for a 32-byte send and a blocking receive from a bare echo
    process (it waits for the broker's reply); and, beside it, what a round trip costs with
    no worker at all: the send before the model's wait and the receive after it, on one
    thread (the reply is there by then: ``begin``/``result`` without a background batch).
    [(wait us, send + receive us, no-worker us)]."""
    import queue

    path = os.path.join(d, "floor.sock")
    if os.path.exists(path):
        os.unlink(path)
    p = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, path], stdout=subprocess.PIPE, text=True)
    try:
        p.stdout.readline()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        q: queue.SimpleQueue = queue.SimpleQueue()
        msg, buf, out = b"x" * 32, bytearray(4096), []
        for i in range(n + 50):
            c0 = time.thread_time_ns()
            try:
                q.get(timeout=MODEL_WORK_S)
            except queue.Empty:
                pass
            c1 = time.thread_time_ns()
            s.sendall(msg)
            s.recv_into(buf)
            c2 = time.thread_time_ns()
            s.sendall(msg)
            c3 = time.thread_time_ns()
            time.sleep(MODEL_WORK_S)
            c4 = time.thread_time_ns()
            s.recv_into(buf)
            c5 = time.thread_time_ns()
            if i >= 50:
                out.append(((c1 - c0) / 1000, (c2 - c1) / 1000, (c3 - c2 + c5 - c4) / 1000))
        s.close()
        return out
    finally:
        p.wait(10)


def step_ping(socket_path: str, n: int) -> list[float]:
    c = BrokerClient.connect(socket_path, client_name="bench-ping")
    try:
        t = c._step_path().transport
        ping = step_wire.frame(step_wire.PING)
        out = []
        for _ in range(n + 200):
            t0 = time.perf_counter_ns()
            t.request(ping)
            out.append((time.perf_counter_ns() - t0) / 1000)
        return out[200:]
    finally:
        c.close()


def grpc_echo(socket_path: str, n: int) -> list[float]:
    with grpc.insecure_channel(f"unix:{socket_path}") as ch:
        echo = echo_pb2_grpc.EchoStub(ch)
        req = echo_pb2.EchoRequest(payload=b"x" * 32)
        out = []
        for _ in range(n + 200):
            t0 = time.perf_counter_ns()
            echo.Echo(req)
            out.append((time.perf_counter_ns() - t0) / 1000)
        return out[200:]


# ------------------------------------------------------------------ per-item cost, each side

# Items per step for the per-item rows: a third adapters, the rest KV keys (the issue's example
# step is 8 adapters and 16 keys).
ITEM_SIZES = (1, 8, 64, 512)
# Which items a per-item step holds: "mixed" (the above), "keys" (KV keys only: the store's
# pin/unpin path) or "adapters" (adapters only: the adapter tiers' path); --keys-only and
# --adapters-only show each side's slope apart.
ITEM_MIX = "mixed"
# The step wire codecs the per-item rows run (``--codec``): the native core (``_stepcore.c``,
# where built) and its pure-Python fallback, interleaved size by size.
ITEM_CODECS: tuple[str, ...] = ("native",)


def split_items(n: int) -> tuple[int, int]:
    """(adapters, keys) of a step of ``n`` items."""
    if ITEM_MIX == "keys":
        return 0, n
    if ITEM_MIX == "adapters":
        return n, 0
    return n // 3, n - n // 3


def item_key(i: int) -> bytes:
    """The per-item rows' KV key ``i``: 41 bytes, as the vLLM connector's (a prefix and a
    SHA-256 digest; every key one size, as an engine's are)."""
    return b"vllm-kv1:" + hashlib.sha256(b"item-%d" % i).digest()


def item_sets(n: int) -> tuple[tuple[list[str], list[bytes]], tuple[list[str], list[bytes]]]:
    """Two disjoint steps of ``n`` items each (A and B): steps alternate between them, so
    each frame gives back ``n`` items and takes ``n``."""
    na, nk = split_items(n)
    a = ([f"it{i}" for i in range(na)], [item_key(i) for i in range(nk)])
    b = ([f"it{i}" for i in range(na, 2 * na)], [item_key(i) for i in range(nk, 2 * nk)])
    return a, b


def broker_side(box: dict, token: str, key: str, n: int, cycles: int) -> tuple[float, float]:
    """Median us, and the loop thread's CPU us, the broker spends on one STEP frame that gives back one step of ``n``
    items and takes another (decode, checks, pins, leases, reply), the handler called
    directly on the loop that owns the core (no socket)."""
    import asyncio

    from memory_broker.broker.doors.step_channel import _Conn

    w = step_wire
    (ia, ka), (ib, kb) = item_sets(n)
    server = box["server"].step_server

    async def run() -> tuple[list[float], list[float]]:
        conn = _Conn(None, None)
        conn.session = server.sessions.from_token(token)
        conn.key = key  # what the step channel's HELLO took from the session's proof

        def frame(ops) -> tuple[int, list]:
            reply = server.ops.step(conn, w.encode_step(ops)[5:])
            size, kind = w.HEADER.unpack_from(reply)
            r = w.decode_step_reply(kind, reply[5:])
            if r.error is not None:
                raise SystemExit(f"per-item broker frame refused: {r.error}")
            return r

        def take(ids, keys):
            ops = ([w.Op(w.OP_ACQUIRE, tuple(ids))] if ids else []) + [w.Op(w.OP_LOOKUP, tuple(keys), 1)]
            return ops if keys else ops[:1]

        def give(ids, oids):
            ops = ([w.Op(w.OP_RELEASE, tuple(ids))] if ids else []) + [w.Op(w.OP_UNPIN, tuple(oids))]
            return ops if oids else ops[:1]

        def objects(r) -> list[int]:
            return [o.object_id for o in r.results[-1]] if ka else []

        oa = objects(frame(take(ia, ka)))
        ob = objects(frame(give(ia, oa) + take(ib, kb)))
        to_a = w.encode_step(give(ib, ob) + take(ia, ka))[5:]
        to_b = w.encode_step(give(ia, oa) + take(ib, kb))[5:]
        out, cpu = [], []
        for i in range(cycles):
            body = to_a if i % 2 == 0 else to_b
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            server.ops.step(conn, body)
            out.append((time.perf_counter_ns() - t0) / 1000)
            cpu.append((time.thread_time_ns() - c0) / 1000)
        # Held now: A if cycles is odd, else B. Give it back.
        frame(give(ia, oa) if cycles % 2 else give(ib, ob))
        return out, cpu

    xs, cpu = asyncio.run_coroutine_threadsafe(run(), box["loop"]).result(600)
    skip = len(xs) // 10
    return statistics.median(xs[skip:]), statistics.median(cpu[skip:])


class _Replay:
    """A step transport that sends nothing: each request gets the next of the replies
    recorded from the broker, decoded anew as the socket's would be: the whole frame from a
    kept buffer in one native call (``ReplyDecoder.frame``, the transport's usual path), the
    reference way where that does not take it."""

    closed = False

    def __init__(self, replies: list[tuple[int, bytes]], decode):
        self.replies = [(kind, body, bytearray(step_wire.frame(kind, body))) for kind, body in replies]
        self.i = 0
        # The real transport's decoder (``ReplyDecoder``), which the replay goes through.
        self.decode = decode
        self.whole = getattr(decode, "frame", None)

    def request(self, data: bytes):
        kind, body, buf = self.replies[self.i % len(self.replies)]
        self.i += 1
        if self.whole is not None:
            reply = self.whole(buf, len(buf))
            if reply is not None:
                return reply
        return self.decode(kind, body)

    def unread(self) -> int:
        return 0

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Recording:
    """The transport's decoder, keeping a copy of each reply it decodes (both of its ways)."""

    def __init__(self, decode, out: list[tuple[int, bytes]]):
        self.decode, self.out = decode, out

    def __call__(self, kind, body):
        self.out.append((kind, bytes(body)))
        return self.decode(kind, body)

    def frame(self, buf, got: int):
        whole = getattr(self.decode, "frame", None)
        reply = None if whole is None else whole(buf, got)
        if reply is not None:
            n, kind = step_wire.HEADER.unpack_from(buf)
            self.out.append((kind, bytes(buf[5 : 5 + n])))
        return reply


def _generic_step(c: BrokerClient, ids, keys, release):
    """The generic calls' step (``old_api``): acquire, look up + pin, give back the previous
    step's lease and objects (4 frames)."""
    lease = c.acquire_adapters(ids)
    objs = c.lookup(keys, pin=True)
    if release is not None:
        release[0].release()
        c.unpin(release[1])
    return (lease, objs)


def client_side(c: BrokerClient, n: int, cycles: int, generic: bool = False) -> tuple[float, float]:
    """Median us, and CPU us, the client spends on one ``client.step()`` that gives back the
    previous step of ``n`` items and takes another: planning, encoding, decoding and
    accounting the reply, leases and objects made from it; no socket (the broker's replies
    to the same frames are recorded once and replayed). ``generic``: the same step made of
    the generic calls (``_generic_step``: 4 frames)."""
    (ia, ka), (ib, kb) = item_sets(n)
    path = c._step_path()
    real = path.transport
    recorded: list[tuple[int, bytes]] = []
    # The transport's own decoder (a package without one decodes with the module's function).
    owner = real if hasattr(real, "decode") else step_wire
    decode = real.decode if owner is real else step_wire.decode_step_reply
    one = _generic_step if generic else (lambda c, ids, keys, release: c.step(ids, keys, release=release))

    recording = _Recording(decode, recorded)
    prev = one(c, ia, ka, None)
    setattr(owner, "decode" if owner is real else "decode_step_reply", recording)
    try:
        prev = one(c, ib, kb, prev)
        prev = one(c, ia, ka, prev)
    finally:
        if owner is real:
            real.decode = decode
        else:
            step_wire.decode_step_reply = decode
    # Held: A. The replay takes B, A, B, A, ... and ends an even number of steps later on A.
    path.transport = _Replay(recorded, decode)
    out, cpu = [], []
    try:
        for i in range(cycles - cycles % 2):
            ids, keys = (ib, kb) if i % 2 == 0 else (ia, ka)
            p0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            prev = one(c, ids, keys, prev)
            out.append((time.perf_counter_ns() - t0) / 1000)
            cpu.append((time.thread_time_ns() - p0) / 1000)
    finally:
        path.transport = real
    if generic:
        prev[0].release()
        c.unpin(prev[1])
    else:
        prev.release()
    skip = len(out) // 10
    return statistics.median(out[skip:]), statistics.median(cpu[skip:])


def per_item(d: str, cycles: int) -> None:
    """The per-item rows: each side's cost of a step of 1, 8, 64 and 512 items, and the
    slope between 64 and 512 (the target: under 0.5 us per item per side)."""
    sock = os.path.join(d, "items.sock")
    box = inprocess_broker(d, sock)
    setup = BrokerClient.connect(sock, client_name="bench-items-setup")
    na, nk = split_items(max(ITEM_SIZES))
    ids = [f"it{i}" for i in range(2 * na)]
    for i, aid in enumerate(ids):
        setup.register_adapter(aid, write_adapter(os.path.join(d, "item-adapters", aid), i))
    r = setup.prefetch_adapters(ids, "hot")
    if r.failed:
        raise SystemExit(f"could not make the adapters hot: {dict(r.failed)}")
    if nk:
        setup.allocate([Spec(1, content_type="kv_cache", key=item_key(i)) for i in range(2 * nk)])
    c = BrokerClient.connect(sock, client_name="bench-items")
    if ids:
        c.acquire_adapters(ids).release()  # every layout fetched once, as an engine that has run a while
    raw_us = min(statistics.median(raw_pingpong(d, 300, one_cpu=True)), statistics.median(raw_pingpong(d, 300)))
    rows = []
    native_core = step_wire._core
    for n in ITEM_SIZES:
        for codec in ITEM_CODECS:
            # The broker runs in this process: the codec switch is both sides' (interleaved by size).
            step_wire._core = native_core if codec == "native" else None
            try:
                b_us, b_cpu = broker_side(box, c.token, dict(c.metadata)[KEY_METADATA], n, cycles)
                c_us, c_cpu = client_side(c, n, cycles)
                g_us, g_cpu = client_side(c, n, cycles, generic=True)
            finally:
                step_wire._core = native_core
            rows.append((n, codec, b_us, b_cpu, c_us, c_cpu, g_cpu))
    c.close()
    setup.close()
    import asyncio

    asyncio.run_coroutine_threadsafe(box["server"].stop(), box["loop"]).result(60)
    print(f"\nPer-item cost of a step, each side apart ({cycles} frames per row; {time.strftime('%Y-%m-%d')})")
    what = {
        "mixed": "n//3 adapters and the rest KV keys, acquired and looked up + pinned",
        "keys": "n KV keys, looked up + pinned",
        "adapters": "n adapters, acquired",
    }[ITEM_MIX]
    print(f"(a step of n items: {what}; each frame")
    print(" also gives back the previous step's n items: release + unpin)")
    print(f"{'raw Unix-socket ping-pong (32 B), fastest':<44}{raw_us:>10.1f} us")
    print(
        f"{'items':>6}{'codec':>8}{'broker us/frame':>17}{'x raw':>8}{'broker CPU us':>15}"
        f"{'client us/step':>16}{'x raw':>8}{'client CPU us':>15}{'generic CPU us':>16}"
    )
    for n, codec, b_us, b_cpu, c_us, c_cpu, g_cpu in rows:
        print(
            f"{n:>6}{codec:>8}{b_us:>17.1f}{b_us / raw_us:>8.2f}{b_cpu:>15.1f}{c_us:>16.1f}{c_us / raw_us:>8.2f}"
            f"{c_cpu:>15.1f}{g_cpu:>16.1f}"
        )
    print("(CPU us: the thread's CPU time for the same frame or step, median: what a loaded machine's preemption")
    print(" does not inflate; the slopes below are of CPU time; generic: the client's CPU for the same step made")
    print(" of the generic calls, acquire_adapters + lookup + release + unpin, 4 frames)")
    for codec in ITEM_CODECS:
        by = {n: (b_cpu, c_cpu) for n, cd, _, b_cpu, _, c_cpu, _ in rows if cd == codec}
        if 64 in by and 512 in by:
            for side, i in (("broker", 0), ("client", 1)):
                s = (by[512][i] - by[64][i]) / (512 - 64)
                ok = "MET" if s < 0.5 else "NOT MET"
                mix = "" if ITEM_MIX == "mixed" else f" ({ITEM_MIX} only)"
                what = f"target per-item, {side}{mix}, {codec} codec"
                print(f"{what}: CPU slope 64..512 items < 0.5 us/item: {s:.2f} us/item -> {ok}")


def issue_targets(results: dict, raw_us: float, ping_us: float, loop_us: float) -> None:
    """Issue 28's blocking targets, on the steady workload (8 adapters, 16 keys a step):
    one ``client.step()`` frame under 5x raw, the generic calls under 8x; each beside its
    floor in this run: as many round trips to the bare asyncio loop (the broker's loop with
    no Python of its own) and as many step-channel PINGs (a frame with no ops) as the row
    waits for."""
    rows = (
        ("step channel, client.step()", 5, 1),
        ("step channel, same 4 calls", 8, 4),
    )
    for name, limit, frames in rows:
        got = results.get((name, "steady"))
        if got is None:
            continue
        x = statistics.median(got[0]) / raw_us
        print(
            f"target issue 28, {name}, steady: median < {limit}x raw: {x:.2f}x -> {'MET' if x < limit else 'NOT MET'}"
            f" (floors, the {frames} round trip{'s' if frames > 1 else ''} it waits for: {frames} x the bare asyncio "
            f"loop {frames * loop_us / raw_us:.2f}x, {frames} x PING {frames * ping_us / raw_us:.2f}x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per path and workload")
    ap.add_argument("--quick", action="store_true", help="at most 200 steps (a smoke run)")
    ap.add_argument("--only", default="", help="run only the paths whose name contains this (a quick look)")
    ap.add_argument(
        "--per-item", action="store_true", help="only the per-item rows: each side's cost at 1, 8, 64, 512 items"
    )
    mix = ap.add_mutually_exclusive_group()
    mix.add_argument("--keys-only", action="store_true", help="per-item rows of KV keys alone (no adapters)")
    mix.add_argument("--adapters-only", action="store_true", help="per-item rows of adapters alone (no keys)")
    ap.add_argument(
        "--codec",
        choices=("native", "python", "both"),
        default="native",
        help="per-item rows: the step wire codec, native (default; the Python one where it is not built), "
        "its pure-Python fallback, or both interleaved (the A/B)",
    )
    ap.add_argument(
        "--one-cpu",
        action="store_true",
        help="run everything (this client, the broker, the echo processes) on this process's first CPU: "
        "every row, raw and step alike, then pays no wake-up across CPUs (like for like with the raw "
        "ping-pong's one-CPU row)",
    )
    a = ap.parse_args()
    if a.one_cpu:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    global ITEM_CODECS
    if step_wire._core is None or a.codec == "python":
        ITEM_CODECS = ("python",)
    elif a.codec == "both":
        ITEM_CODECS = ("native", "python")
    if a.keys_only or a.adapters_only:
        global ITEM_MIX
        ITEM_MIX = "keys" if a.keys_only else "adapters"
        a.per_item = True
    if a.only:
        PATHS[:] = [p for p in PATHS if a.only in p[0]]
    steps = min(a.steps, 200) if a.quick else a.steps
    d = tempfile.mkdtemp(prefix="mb-bench-", dir="/tmp")
    if a.per_item:
        per_item(d, max(20, steps // 4) if a.quick else max(200, steps // 4))
        return
    sock = os.path.join(d, "b.sock")
    flags = shlex.split(os.environ.get("BENCH_STEP_BROKER_FLAGS", ""))
    proc = start_broker(sock, os.path.join(d, "state"), page_size="512KiB", extra=flags)  # KV blocks
    try:
        run(d, sock, steps)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def run(d: str, sock: str, steps: int) -> None:
    setup = BrokerClient.connect(sock, client_name="bench-setup")
    ids = [f"ad{i}" for i in range(ADAPTERS)]
    for i, aid in enumerate(ids):
        setup.register_adapter(aid, write_adapter(os.path.join(d, "adapters", aid), i))
    r = setup.prefetch_adapters(ids, "hot")
    if r.failed:
        raise SystemExit(f"could not make the adapters hot: {dict(r.failed)}")
    # The KV blocks stay allocated (owned by the setup session) while the paths run.
    for first in range(0, KEYS, 1000):
        setup.allocate(
            [Spec(1, content_type="kv_cache", key=b"kv-%d" % i) for i in range(first, min(KEYS, first + 1000))]
        )
    warm = max(50, steps // 10)
    workloads = {"steady": steady(steps + warm), "trace": trace(steps + warm)}

    raw, raw_idle, ping, echo = [], [], [], []
    raw_chunks: list[float] = []  # each echo process's median
    raw_one: list[float] = []
    loop_echo: list[float] = []  # the asyncio loop's floor, placed as the broker is
    floor: list[tuple[float, float, float]] = []  # worker_floor's, beside the background rows
    cpu: dict[str, tuple[list[float], list[float]]] = {}
    results: dict[tuple[str, str], tuple[list[float], float, float]] = {}
    # Baselines between the paths, so drift on a shared machine hits both.
    for name, kw, fn in PATHS:
        chunk = raw_pingpong(d, max(200, steps // 2))
        raw += chunk
        raw_chunks.append(statistics.median(chunk))
        raw_one += raw_pingpong(d, 300, one_cpu=True)
        raw_idle += raw_pingpong(d, 200, idle=True)
        one = len(os.sched_getaffinity(0)) == 1
        loop_echo += raw_pingpong(d, 300, one_cpu=one, server=ASYNC_ECHO_SERVER)
        if "background" in name:
            floor += worker_floor(d, min(300, max(50, steps)))
        ping += step_ping(sock, max(200, steps // 2))
        echo += grpc_echo(sock, max(200, steps // 4))
        for wl, work in workloads.items():
            del OVERLAP_CPU[:], PROCESS_CPU[:]
            results[(name, wl)] = measure(sock, kw, fn, work, warm)
            if OVERLAP_CPU:
                cpu[f"{name}, {wl}"] = (OVERLAP_CPU[warm:], PROCESS_CPU[warm:])
    # The ratios' denominator: the fastest raw round trip measured, the median of both
    # processes held on one CPU or of the fastest echo process left to the scheduler. On this
    # VM a round trip between two CPUs costs 2-4x one on the same CPU, and where the
    # scheduler puts a fresh echo process varies; the fastest is the strictest yardstick.
    raw_us = min(min(raw_chunks), statistics.median(raw_one))
    print(
        f"Engine step control plane, per step at the client ({steps} steps per row; "
        f"{os.cpu_count()} CPUs{', every process on one' if len(os.sched_getaffinity(0)) == 1 else ''}; "
        f"{time.strftime('%Y-%m-%d')}"
        f"{'; broker flags: ' + os.environ['BENCH_STEP_BROKER_FLAGS'] if os.environ.get('BENCH_STEP_BROKER_FLAGS') else ''})"
    )
    print(f"{'baseline':<44}{'median us':>10}{'p99 us':>10}{'x raw':>8}")
    print(f"{'raw Unix-socket ping-pong (32 B), fastest':<44}{raw_us:>10.1f}{'':>10}{1.0:>8.2f}")
    for name, xs in (
        ("raw ping-pong, both processes on one CPU", raw_one),
        ("raw ping-pong, all echo processes", raw),
        ("raw ping-pong, each after the model's wait", raw_idle),
        ("raw ping-pong to a bare asyncio loop", loop_echo),
        ("step channel PING (broker, same socket kind)", ping),
        ("gRPC Echo (bare, same broker)", echo),
    ):
        print(f"{name:<44}{statistics.median(xs):>10.1f}{pct(xs, 0.99):>10.1f}{statistics.median(xs) / raw_us:>8.2f}")
    print()
    print(
        f"{'path':<48}{'workload':<9}{'median us':>10}{'p99 us':>10}{'x raw':>8}{'p99 x raw':>10}{'RT/step':>9}"
        f"{'CPU us':>8}"
    )
    for (name, wl), (xs, rts, pcpu) in results.items():
        med, p99 = statistics.median(xs), pct(xs, 0.99)
        print(
            f"{name:<48}{wl:<9}{med:>10.1f}{p99:>10.1f}{med / raw_us:>8.2f}{p99 / raw_us:>10.2f}{rts:>9.2f}{pcpu:>8.1f}"
        )
    print(
        "(x raw = per-step median or p99 / the fastest raw ping-pong median of this run: on one CPU, or of "
        f"the echo processes left to the scheduler ({', '.join(f'{x:.1f}' for x in raw_chunks)} us); "
        "RT/step = frames sent; CPU us = the client process's CPU per step, every thread, mean)"
    )
    issue_targets(results, raw_us, statistics.median(ping), statistics.median(loop_echo))
    for wl, (xs, ps) in cpu.items():
        print(
            f"{wl}: CPU per step: the engine thread's in begin + result, median {statistics.median(xs):.1f} us "
            f"(p99 {pct(xs, 0.99):.1f}); the client process's, every thread, median {statistics.median(ps):.1f} us "
            f"(p99 {pct(ps, 0.99):.1f})"
        )
    for wl, (_, ps) in cpu.items():
        if "background" in wl and wl.endswith("trace"):
            x = statistics.median(ps)
            print(
                f"target issue 28, background batch: the process's CPU per changed step < 30 us: {x:.1f} us -> "
                f"{'MET' if x < 30 else 'NOT MET'}"
            )
            if floor:
                w, r, o = (statistics.median(f[i] for f in floor) for i in range(3))
                print(
                    f"  the floor on this machine, no Python: a thread's timed wait of {MODEL_WORK_S * 1e3:.0f} ms "
                    f"{w:.1f} us of its CPU, then a raw send + blocking receive {r:.1f} us: {w + r:.1f} us "
                    f"(a worker that sleeps between changes and waits for the reply pays both); with no worker, "
                    f"a raw send before the model's wait and the receive after it, one thread: {o:.1f} us "
                    f"(the least a changed step's round trip costs the process here, in any design)"
                )
    channel = [n for n, _, _ in PATHS if n.startswith("step channel") and (n, "steady") in results]
    if not channel:
        setup.close()
        return
    best_steady = min(statistics.median(results[(n, "steady")][0]) for n in channel)
    ok1 = best_steady <= 2 * raw_us
    print(f"\ntarget steady: median <= 2x raw: {best_steady / raw_us:.2f}x -> {'MET' if ok1 else 'NOT MET'}")
    # The trace target, for the best blocking path and for the overlapped one apart: the
    # overlapped row counts only the engine thread's time in the client (the round trip
    # runs during the model's work), so it is not a round trip's latency.
    blocking = [n for n in channel if "overlap" not in n and "pipelined" not in n]
    for label, names in (("blocking", blocking), ("overlapped", [n for n in channel if "overlap" in n])):
        if not names:
            continue
        best = min(names, key=lambda n: statistics.median(results[(n, "trace")][0]))
        tr = results[(best, "trace")][0]
        ok2 = statistics.median(tr) <= 2 * raw_us and pct(tr, 0.99) <= 10 * raw_us
        print(
            f"target trace, {label} ({best}): median <= 2x raw, p99 <= 10x: "
            f"{statistics.median(tr) / raw_us:.2f}x, {pct(tr, 0.99) / raw_us:.2f}x -> {'MET' if ok2 else 'NOT MET'}"
        )
    setup.close()


if __name__ == "__main__":
    main()
