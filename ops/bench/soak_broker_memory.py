#!/usr/bin/env python3
"""Does the broker's memory stay bounded under a tenant that never stops? Two soaks.

* ``--store N``: one store, in this process. One transaction with a 600 s lease stays open;
  behind it, N transactions are prepared (lease 300 s, 2 pages) and each either committed and
  its objects freed, or aborted. Prints the memory Python has allocated (tracemalloc) at
  checkpoints. What the store keeps of ended transactions is bounded by count (the last
  65,536, for retried commits and aborts), so the figure levels off once that many ended.
* ``--sessions R``: a broker (host arena) in a subprocess, and this process holding one
  session throughout while it opens R more, one after another. Each sends ``--frames`` step
  frames on its own step connection, a random mix of every op kind (ids and keys that exist
  and that do not), 60% of them with 1-4 bytes changed and some cut short, then closes.
  After each session the broker's books (sessions, objects, pins, open transactions, pages)
  must be back where they were, and every refusal must be a deliberate status (never
  INTERNAL or UNKNOWN). Prints the broker's RSS at checkpoints and the answers' codes;
  exits 1 at the first broken rule.

    python ops/bench/soak_broker_memory.py [--store 300000] [--sessions 400] [--frames 200]
        [--seed 1]
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import random
import struct
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_request_flood import rss_mib  # noqa: E402  (this folder is on sys.path above)
from bench_rpc import start_broker  # noqa: E402
from bench_step import write_adapter  # noqa: E402

from memory_broker.broker.store.objects import ObjectStore, Spec, StoreConfig  # noqa: E402
from memory_broker.broker.store.pool import PagePool, WindowSpace  # noqa: E402
from memory_broker.clients import BrokerClient  # noqa: E402
from memory_broker.clients import Spec as ClientSpec  # noqa: E402
from memory_broker.clients.step.transport import StepTransport, StepUnavailable  # noqa: E402
from memory_broker.proto.wire import step as w  # noqa: E402
from memory_broker.proto.wire.errors import Code  # noqa: E402

# The refusals a step frame may get; anything else (INTERNAL, UNKNOWN, ...) breaks the rule.
DELIBERATE = {
    Code.INVALID_ARGUMENT,
    Code.NOT_FOUND,
    Code.FAILED_PRECONDITION,
    Code.PERMISSION_DENIED,
    Code.RESOURCE_EXHAUSTED,
}


def store_soak(n: int) -> None:
    now = [100.0]
    pool = PagePool(64, 64, 64, lambda slabs: None)
    store = ObjectStore(
        pool, WindowSpace(256), config=StoreConfig(high_watermark=1.0, low_watermark=1.0), clock=lambda: now[0]
    )
    sid = store.open_session()
    store.prepare(sid, [Spec(1)], lease_s=600.0)
    marks = sorted({n // 10, n // 4, n // 2, n - 1})
    tracemalloc.start()
    print(f"store: {n:,} transactions behind one open 600 s lease (half committed and freed, half aborted)")
    print(f"{'ended':>10} {'traced MiB':>11} {'deadline heap':>14}")
    t0 = time.perf_counter()
    for i in range(n):
        t = store.prepare(sid, [Spec(2)], lease_s=300.0)
        if i % 2:
            store.abort(sid, [t.txn_id])
        else:
            (done,) = store.commit(sid, [t.txn_id])
            store.free(sid, [o.object_id for o, _ in done.result])
        if i in marks:
            gc.collect()
            heap = len(store.txns._deadlines)
            print(f"{i + 1:>10,} {tracemalloc.get_traced_memory()[0] / 2**20:>11.1f} {heap:>14,}", flush=True)
    tracemalloc.stop()
    print(f"store: {time.perf_counter() - t0:.1f} s")


def books(c: BrokerClient) -> tuple:
    """What a session's end must give back. Adapters a frame's acquire loaded stay resident
    (a cache, not the session's): objects and pages count without the hot adapters'."""
    st = c.stats()
    return (
        st.sessions,
        st.objects - st.adapters.hot,
        st.pinned_pages,
        st.open_transactions,
        st.used_pages - st.adapters.hot_pages,
    )


def random_ops(rng: random.Random, ids: list[int]) -> list:
    ops = []
    adapters = ["a0", "a1", "a2", "a3", "nope"]
    for _ in range(rng.randint(1, 6)):
        k = rng.choice((w.OP_RELEASE, w.OP_UNPIN, w.OP_PIN, w.OP_COMMIT, w.OP_ABORT, w.OP_ACQUIRE, w.OP_LOOKUP))
        if k == w.OP_RELEASE:
            ops.append(w.Op(k, tuple(rng.choices(adapters, k=rng.randint(0, 3)))))
        elif k in (w.OP_UNPIN, w.OP_PIN):
            ops.append(w.Op(k, tuple(rng.choices(ids + [0, 999, 2**63], k=rng.randint(0, 3)))))
        elif k == w.OP_COMMIT:
            ops.append(w.Op(k, (rng.choice(ids + [0, 5]),)))
        elif k == w.OP_ABORT:
            ops.append(w.Op(k, ()))
        elif k == w.OP_ACQUIRE:
            mode = rng.choice((0, w.ACQUIRE_PREPARE))
            ops.append(w.Op(k, tuple(rng.choices(adapters[:4], k=rng.randint(0, 3))), mode, rng.randint(0, 4), 2500))
        else:
            keys = rng.choices([b"k0", b"k1", b"k2", b"k5", b"x", b""], k=rng.randint(0, 4))
            ops.append(w.Op(k, tuple(keys), rng.randint(0, 1)))
    return ops


def one_session(sock: str, rng: random.Random, ids: list[int], frames: int, codes: collections.Counter) -> None:
    with BrokerClient.connect(sock) as c:
        try:
            t = StepTransport(c._step_socket(), c.token, 10.0)  # a raw step connection of the session
            for _ in range(frames):
                body = w.encode_step(random_ops(rng, ids))[5:]
                if rng.random() < 0.6:
                    b = bytearray(body)
                    for _ in range(rng.randint(1, 4)):
                        b[rng.randrange(len(b))] = rng.randrange(256)
                    body = bytes(b[: rng.randint(0, len(b))] if rng.random() < 0.3 else b)
                start = time.monotonic()
                r = t.request(struct.pack("<IB", len(body), w.STEP) + body)
                if time.monotonic() - start > 2.0:
                    raise SystemExit(f"FAIL: a frame took {time.monotonic() - start:.1f} s to answer")
                if r.error is None:
                    codes["OK"] += 1
                elif r.error.code in DELIBERATE:
                    codes[r.error.code.name] += 1
                else:
                    raise SystemExit(f"FAIL: {r.error.code.name}: {r.error.message} (frame body {body.hex()})")
            t.close()
        except StepUnavailable as e:  # refused, closed mid-frame or no answer within 10 s
            raise SystemExit(f"FAIL: the step connection broke: {e}") from None


def sessions_soak(rounds: int, frames: int, seed: int) -> None:
    with tempfile.TemporaryDirectory(prefix="mb-soak-") as d:
        sock = os.path.join(d, "b.sock")
        proc = start_broker(sock, os.path.join(d, "state"), page_size="512KiB", pool="64MiB", slab="2MiB")
        try:
            setup = BrokerClient.connect(sock, client_name="soak-setup")
            for i in range(4):
                setup.register_adapter(f"a{i}", write_adapter(os.path.join(d, "adapters", f"a{i}"), i))
            objs = setup.allocate([ClientSpec(1, content_type="kv_cache", key=b"k%d" % i) for i in range(6)])
            setup.prefetch_adapters(["a0", "a1"], "hot")
            ids = [o.object_id for o in objs]
            base = books(setup)
            codes: collections.Counter = collections.Counter()
            marks = sorted({0, rounds // 4, rounds // 2, rounds - 1})
            print(f"\nsessions: {rounds} sessions of one process, {frames} step frames each (seed {seed})")
            print(f"{'sessions':>9} {'broker RSS MiB':>15} {'frames answered':>16}")
            t0 = time.perf_counter()
            for r in range(rounds):
                one_session(sock, random.Random(seed * 1_000_003 + r), ids, frames, codes)
                deadline = time.monotonic() + 5
                while books(setup) != base and time.monotonic() < deadline:
                    time.sleep(0.02)
                if books(setup) != base:
                    raise SystemExit(f"FAIL: after session {r + 1} the books are {books(setup)}, not {base}")
                if r in marks:
                    print(f"{r + 1:>9} {rss_mib(proc.pid):>15.1f} {sum(codes.values()):>16,}", flush=True)
            print("answers: " + ", ".join(f"{k} {v:,}" for k, v in codes.most_common()))
            print(f"sessions: {time.perf_counter() - t0:.1f} s; every refusal deliberate, the books restored each time")
            setup.close()
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", type=int, default=300_000, help="transactions of the store soak (0: skip it)")
    ap.add_argument("--sessions", type=int, default=400, help="sessions of the broker soak (0: skip it)")
    ap.add_argument("--frames", type=int, default=200, help="step frames per session")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.store:
        store_soak(a.store)
    if a.sessions:
        sessions_soak(a.sessions, a.frames, a.seed)


if __name__ == "__main__":
    main()
