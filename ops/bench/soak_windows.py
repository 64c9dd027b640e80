#!/usr/bin/env python3
"""Do contiguous objects' windows ever show another object's pages? A soak of the client's
mapping caches against a live broker (issue 48, item 1).

A broker on the host arena (small pages, a small pool and window space, so pages and windows
are reused all the time) and two sessions of this process churning objects at random: each
operation frees a live object or allocates a new one of 1-4 pages, contiguous or paged. A new
object is written through its own tensor (the window, for a contiguous one; its page tensors
otherwise) with a byte of its own, and then every live object's pages are read back through
the physical view: an object whose bytes are not its own byte is counted wrong (once). At the
end a fresh process, which never mapped a window, reads every byte of the surviving objects'
pages.

    python ops/bench/soak_windows.py [--ops 10000] [--most-live 4] [--seed 0]

Prints the operations run, the objects made (and how many were contiguous) and the wrong
objects, seen here and from the fresh process; exits 1 if any object was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test helpers in tests/rigs.py
from bench_rpc import start_broker  # noqa: E402  (this folder is on sys.path above)
from rigs import churn_once, fill, wrong  # noqa: E402

from memory_broker.clients import BrokerClient  # noqa: E402

# The fresh process: connects, maps the arena's slabs, and prints the ids of the objects in
# argv[2] (a JSON list of [object id, pages, byte]) whose pages do not hold their byte.
FRESH = """
import json, sys
from memory_broker.clients import BrokerClient
survivors, slabs = json.loads(sys.argv[2]), int(sys.argv[3])
with BrokerClient.connect(sys.argv[1], client_name="soak-fresh") as c:
    c._ensure_slabs(slabs)
    ps = c.geometry.page_size
    whole = c.physical_view()
    bad = [oid for oid, pages, v in survivors if any(bool((whole[p * ps : (p + 1) * ps] != v).any()) for p in pages)]
print(json.dumps(bad))
"""


def churn(sock: str, ops: int, most_live: int, seed: int) -> dict:
    rng = random.Random(seed)
    clients = [BrokerClient.connect(sock, client_name=f"soak-{i}") for i in range(2)]
    live: list[tuple[BrokerClient, object, int]] = []
    made = contiguous = full = 0
    bad: set[int] = set()
    slabs = 0
    try:
        for op in range(ops):
            before = len(live)
            if (got := churn_once(rng, clients, live, most_live)) is None:
                full += len(live) == before  # nothing freed: the pool or the window space was full
                continue
            c, obj = got
            # A byte no live object has (at most most_live of 255 are taken).
            taken = {v for _, _, v in live}
            value = next(v for v in range(1 + op % 255, 1 + op % 255 + 256) if (v - 1) % 255 + 1 not in taken)
            value = (value - 1) % 255 + 1
            made += 1
            contiguous += obj.window_page >= 0
            fill(obj, value)
            live.append((c, obj, value))
            bad.update(o.object_id for _, o, v in live if o.object_id not in bad and wrong(o, v))
            slabs = max(slabs, c.view.mapped_slabs)
        survivors = [[o.object_id, list(o.pages), v] for _, o, v in live]
        fresh = subprocess.run(
            [sys.executable, "-c", FRESH, sock, json.dumps(survivors), str(slabs)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if fresh.returncode != 0:
            raise SystemExit(f"FAIL: the fresh process failed: {fresh.stderr[-2000:]}")
        fresh_bad = json.loads(fresh.stdout.strip().splitlines()[-1])
    finally:
        for c in clients:
            c.close()
    return {
        "made": made,
        "contiguous": contiguous,
        "full": full,
        "wrong": sorted(bad),
        "survivors": len(survivors),
        "fresh_wrong": fresh_bad,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=10_000, help="operations (a free or an allocation each)")
    ap.add_argument("--most-live", type=int, default=4, help="live objects at most (past it, every operation frees)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mb-soak-windows-") as d:
        sock = os.path.join(d, "b.sock")
        # 64 pages of 512 KiB (the smallest) in 2 MiB slabs: pages and windows are reused every
        # few operations.
        proc = start_broker(sock, os.path.join(d, "state"), page_size="512KiB", pool="32MiB", slab="2MiB")
        try:
            t0 = time.perf_counter()
            r = churn(sock, a.ops, a.most_live, a.seed)
            took = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"soak_windows: {a.ops:,} operations, two sessions, at most {a.most_live} live objects (seed {a.seed})")
    print(
        f"objects made: {r['made']:,} ({r['contiguous']:,} contiguous); allocations refused (pool full): {r['full']:,}"
    )
    print(f"wrong objects: {len(r['wrong'])} (checked after every allocation)")
    print(f"wrong survivors from a fresh process: {len(r['fresh_wrong'])} of {r['survivors']}")
    print(f"took {took:.1f} s")
    if r["wrong"] or r["fresh_wrong"]:
        print(f"FAIL: wrong objects {r['wrong'][:20]}, wrong from the fresh process {r['fresh_wrong'][:20]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
