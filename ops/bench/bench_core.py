#!/usr/bin/env python3
"""In-process cost of the core's hot calls (no gRPC): allocate/free, pin/unpin, lookup.

Prints medians over repeated chunks (these machines are noisy: medians, not means).
Target from the issue: allocate+free of one page under 5 us median.

    python ops/bench/bench_core.py [--chunks 40] [--per-chunk 2000] [--tenant]

``--tenant``: the same calls by a session of a tenant pool (security.tenants: one tenant pool
and the shared pool, each of the same size), to compare with the one-pool store.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from memory_broker.broker.store.eviction import ContentType  # noqa: E402
from memory_broker.broker.store.objects import ObjectStore, Spec, StoreConfig  # noqa: E402
from memory_broker.broker.store.pool import PagePool, WindowSpace  # noqa: E402

# The invariant checker is test support (tests/store_invariants.py), not product code.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from store_invariants import check_invariants  # noqa: E402

MAX_PAGES = 65536


def make_store(tenant: bool = False) -> tuple[ObjectStore, int]:
    # Capacity preallocated: growth is a one-time cost measured elsewhere (arena benchmarks).
    if not tenant:
        pool = PagePool(MAX_PAGES, 512, MAX_PAGES, grow=lambda n: None)
        store = ObjectStore(pool, WindowSpace(4 * MAX_PAGES), config=StoreConfig())
        return store, store.open_session()
    from memory_broker.broker.store.pools import TenantPool

    own = TenantPool("bench", PagePool(MAX_PAGES, 512, MAX_PAGES, grow=lambda n: None), "bench")
    shared = PagePool(MAX_PAGES, 512, MAX_PAGES, grow=lambda n: None, base=MAX_PAGES)
    store = ObjectStore(shared, WindowSpace(8 * MAX_PAGES), config=StoreConfig(), tenants=[own])
    sid = store.open_session()
    store.assign_pool(sid, 1)
    return store, sid


def median_us(fn, chunks: int, per_chunk: int) -> float:
    samples = []
    for _ in range(chunks):
        t0 = time.perf_counter_ns()
        fn(per_chunk)
        samples.append((time.perf_counter_ns() - t0) / per_chunk / 1000)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--per-chunk", type=int, default=2000)
    ap.add_argument("--tenant", action="store_true", help="a session of a tenant pool (security.tenants)")
    a = ap.parse_args()
    store, sid = make_store(a.tenant)
    kv = ContentType.KV_CACHE

    def alloc_free(n_pages: int, contiguous: bool = False):
        spec = [Spec(n_pages, kv, contiguous=contiguous)]

        def run(k: int) -> None:
            allocate, free = store.allocate, store.free
            for _ in range(k):
                obj = allocate(sid, spec)[0][0]
                free(sid, (obj.object_id,))

        return run

    def batch_alloc_free(n_objects: int):
        specs = [Spec(1, kv) for _ in range(n_objects)]

        def run(k: int) -> None:
            for _ in range(k):
                ids = [o.object_id for o, _ in store.allocate(sid, specs)]
                store.free(sid, ids)

        return run

    pinned = store.allocate(sid, [Spec(1, kv, key=b"pin-me")])[0][0]
    hundred = [o.object_id for o, _ in store.allocate(sid, [Spec(1, kv) for _ in range(100)])]

    def pin_unpin(ids):
        def run(k: int) -> None:
            for _ in range(k):
                store.pin(sid, ids)
                store.unpin(sid, ids)

        return run

    def lookup_unpin(k: int) -> None:
        keys = [b"pin-me"]
        for _ in range(k):
            store.lookup(sid, keys, True)
            store.unpin(sid, (pinned.object_id,))

    rows = [
        ("allocate+free, 1 page", alloc_free(1), 1),
        ("allocate+free, 1 page contiguous", alloc_free(1, True), 1),
        ("allocate+free, 100 pages (one object)", alloc_free(100), 1),
        ("allocate+free, 100 pages contiguous", alloc_free(100, True), 1),
        ("allocate+free, 100 objects of 1 page (batch)", batch_alloc_free(100), 10),
        ("pin+unpin, 1 object", pin_unpin([pinned.object_id]), 1),
        ("pin+unpin, 100 objects (batch)", pin_unpin(hundred), 10),
        ("lookup(pin)+unpin, 1 key", lookup_unpin, 1),
    ]
    where = "a tenant pool's session" if a.tenant else "one pool"
    print(f"core in-process costs, {where} (median of {a.chunks} chunks; python {sys.version.split()[0]})")
    print(f"{'operation':<48}{'median us/op':>14}")
    for name, fn, div in rows:
        fn(200)  # warm up
        us = median_us(fn, a.chunks, max(1, a.per_chunk // div))
        print(f"{name:<48}{us:>14.2f}")
    check_invariants(store)
    # By now far more objects than StoreConfig.remember have come and gone: the steady state
    # of a long-running broker, which the target is measured in.
    assert store.counters.allocations_total > store.config.remember, "run more iterations for the steady state"
    target = median_us(alloc_free(1), a.chunks, a.per_chunk)
    print(f"\nsteady state ({store.counters.allocations_total:,} allocations so far)")
    print(f"target: allocate+free of 1 page < 5 us median: {target:.2f} us -> {'MET' if target < 5 else 'NOT MET'}")


if __name__ == "__main__":
    main()
