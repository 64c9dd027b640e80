#!/usr/bin/env python3
"""Does a call cost the same at 1k and 1M objects? (issue 13: flat at any size)

In-process (the core, no gRPC), for each size: a stats read (what GetStats, the status line
and the metrics read), a contiguous placement among F free holes, the allocation that
crosses the high watermark, and the end of a session that owns N objects (its longest
single stall: the inline part or one background batch). Then a real daemon (host arena,
--enable-echo) holding N objects: the max and p99 latency of Echo RPCs over a period, and
the same while a session that owns N objects ends. Also memory per object (RSS growth),
and the adapter tier policies' hit rates next to Belady's (``bench_policy.py``).
Sections from ``bench_scale_adapters.py`` (registry pages, conversion backlog) are added
when that script is present.

Prints median and p99 per size and the ratio largest/smallest median. Targets: per-call
operations within 2x from smallest to largest; stalls and Echo max under 5 ms.

    python ops/bench/bench_scale.py [--quick] [--echo-seconds 60]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memory_broker.broker.store.objects import ObjectStore, Spec, StoreConfig  # noqa: E402
from memory_broker.broker.store.pool import PagePool, WindowSpace  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_store(max_pages: int, **config) -> ObjectStore:
    config.setdefault("high_watermark", 1.0)
    config.setdefault("low_watermark", 1.0)
    config.setdefault("max_batch", 1 << 20)
    pool = PagePool(max_pages, max_pages, max_pages, grow=lambda n: None)
    store = ObjectStore(pool, WindowSpace(2 * max_pages), config=StoreConfig(**config))
    # As in the daemon: deferred work runs between calls (here: right after, untimed).
    store.background = lambda: None
    return store


def fill(store: ObjectStore, sid: int, n: int, **spec) -> None:
    batch = [Spec(1, **spec)] * 65536
    while n > 0:
        k = min(n, 65536)
        store.allocate(sid, batch[:k])
        n -= k


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def row(table: list, op: str, size: str, samples: list[float]) -> None:
    table.append({"operation": op, "size": size, "median_ms": statistics.median(samples), "p99_ms": pct(samples, 0.99)})


def bench_stats_and_memory(sizes: list[int], table: list, memory: list) -> None:
    for n in sizes:
        gc.collect()
        r0 = rss_bytes()
        store = make_store(n + 1024)
        sid = store.open_session()
        fill(store, sid, n, content_type=3)
        memory.append((n, (rss_bytes() - r0) / n))

        def read(store=store):
            store.stats()
            store.objects_by_owner()

        row(table, "stats read (GetStats, status, metrics)", f"{n:,} objects", timed(read, 200))
        del store
        gc.collect()


def bench_placement(holes: list[int], table: list) -> None:
    for placement in ("best_fit", "first_fit"):
        for f in holes:
            w = WindowSpace(8 * f + 4096, placement)
            starts = [w.place(2) for _ in range(2 * f)]
            rng = random.Random(1)
            for s in starts[::2]:  # every other range: f holes of 2 pages between used ranges
                w.release(s, 2)
            assert w.free_extents >= f
            sizes = [rng.choice((1, 2, 3)) for _ in range(1000)]
            samples = []
            for k in sizes:
                t0 = time.perf_counter_ns()
                s = w.place(k)
                w.release(s, k)
                samples.append((time.perf_counter_ns() - t0) / 1e6)
            row(table, f"contiguous place + release ({placement.replace('_', ' ')})", f"{f:,} holes", samples)


def bench_crossing(sizes: list[int], table: list, trials: int) -> None:
    for n in sizes:
        # n objects of one page fill the pool to just under the high watermark (0.9).
        max_pages = int(n / 0.899)
        store = make_store(max_pages, high_watermark=0.9, low_watermark=0.8)
        sid = store.open_session()
        fill(store, sid, n)
        samples, plain = [], []
        while not store.eviction_active:  # cross once (untimed) and drain to the low watermark
            store.allocate(sid, [Spec(1)] * 8)
        while store.work():
            pass
        for _ in range(trials):
            # Fill to 15 pages under the high watermark; then an 8-object batch that stays
            # under it (also the reference row: the first call after a large fill pays for
            # cold caches either way), then the 8-object batch that crosses it.
            gap = store.room.high_pages - store.pool.used_pages
            fill(store, sid, gap - 15)
            t0 = time.perf_counter_ns()
            store.allocate(sid, [Spec(1)] * 8)
            plain.append((time.perf_counter_ns() - t0) / 1e6)
            assert not store.eviction_active
            t0 = time.perf_counter_ns()
            store.allocate(sid, [Spec(1)] * 8)
            samples.append((time.perf_counter_ns() - t0) / 1e6)
            assert store.eviction_active
            while store.work():  # the background drain (off the request path; untimed)
                pass
        row(table, "allocation crossing the high watermark", f"{n:,} objects", samples)
        row(table, "allocation just before it (same batch, below)", f"{n:,} objects", plain)
        del store
        gc.collect()


def bench_churn(sizes: list[int], table: list) -> None:
    """Free one object, allocate one, 1.5 N times: every table the store keeps sees a full
    turnover, which is when CPython rebuilds a dict's table in one step."""
    for n in sizes:
        store = make_store(n + 4096)
        sid = store.open_session()
        fill(store, sid, n)
        ids = list(store.objects)
        ids.sort()
        spec = [Spec(1)]
        samples = []
        for i in range(n + n // 2):
            t0 = time.perf_counter_ns()
            ((o, _),) = store.allocate(sid, spec)
            store.free(sid, (ids[i],))
            samples.append((time.perf_counter_ns() - t0) / 1e6)
            ids.append(o.object_id)
        row(table, "allocate + free under full turnover", f"{n:,} objects", samples)
        table[-1]["max_ms"] = max(samples)
        del store, ids
        gc.collect()


def bench_teardown(sizes: list[int], table: list) -> None:
    for n in sizes:
        store = make_store(n + 1024)
        sid = store.open_session()
        fill(store, sid, n)
        stalls = []
        t0 = time.perf_counter_ns()
        store.end_session(sid)
        stalls.append((time.perf_counter_ns() - t0) / 1e6)
        while True:
            t0 = time.perf_counter_ns()
            more = store.work()
            stalls.append((time.perf_counter_ns() - t0) / 1e6)
            if not more:
                break
        assert not store.objects
        table.append(
            {
                "operation": "session end: longest single stall",
                "size": f"{n:,} objects",
                "median_ms": max(stalls),
                "p99_ms": max(stalls),
                "total_ms": sum(stalls),
            }
        )
        del store
        gc.collect()


# ------------------------------------------------------------------ the daemon


def start_broker(socket: str, state: str, pages: int) -> subprocess.Popen:
    import grpc

    from memory_broker.proto.wire.v1 import broker_pb2 as pb
    from memory_broker.proto.wire.v1 import broker_pb2_grpc

    # The smallest page the broker allows (512 KiB): host slabs are sparse memfds and
    # nothing here touches a page, so a large pool costs address space, not memory.
    size_gib = 4 * (-(-pages * 512 // (4 << 20)) + 1)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memory_broker.broker.cli",
            "serve",
            "--socket",
            socket,
            "--arena",
            "host",
            "--enable-echo",
            "--pool-size",
            f"{size_gib}GiB",
            "--page-size",
            "512KiB",
            "--slab-size",
            "4GiB",
            "--state-dir",
            state,
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("broker exited: " + proc.stderr.read().decode()[-2000:])
        if os.path.exists(socket):
            try:
                with grpc.insecure_channel(f"unix:{socket}") as ch:
                    broker_pb2_grpc.MemoryBrokerStub(ch).GetArena(pb.GetArenaRequest(), timeout=1)
                return proc
            except grpc.RpcError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("broker did not start")


ECHO_CHILD = """
import json, sys, time, grpc
from memory_broker.proto.wire.v1 import echo_pb2, echo_pb2_grpc
echo = echo_pb2_grpc.EchoStub(grpc.insecure_channel("unix:" + sys.argv[1]))
req = echo_pb2.EchoRequest(payload=b"x")
echo.Echo(req)
print("ready", flush=True)
out, end = [], time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    t0 = time.perf_counter_ns()
    echo.Echo(req)
    out.append((time.perf_counter_ns() - t0) / 1e6)
    time.sleep(0.002)
print(json.dumps(out))
"""


def echo_child(socket: str, seconds: float) -> subprocess.Popen:
    """Echo RPCs from a process of its own (threads here would share this one's GIL)."""
    p = subprocess.Popen([sys.executable, "-c", ECHO_CHILD, socket, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def echo_result(p: subprocess.Popen) -> list[float]:
    """The child's Echo latencies (ms). Raises ChildFailed when it printed none."""
    import json

    # Read through the same buffered stream ``echo_child`` read "ready" from: ``communicate``
    # with a timeout reads the pipe's fd directly and misses whatever that buffer already holds.
    out = p.stdout.read()
    p.wait(timeout=600)
    try:
        return json.loads(out)
    except ValueError:
        raise ChildFailed(f"the Echo child exited {p.returncode} without a result (stdout {out[-200:]!r})") from None


class ChildFailed(RuntimeError):
    pass


def measure_echo(socket: str, seconds: float) -> list[float]:
    """``echo_result`` of a new child, measured again (said on stderr) should a child exit
    without a result."""
    for attempt in range(3):
        try:
            return echo_result(echo_child(socket, seconds))
        except ChildFailed as e:
            print(f"{e}; measuring again ({attempt + 1} of 3)", file=sys.stderr, flush=True)
    raise SystemExit("three Echo children in a row exited without a result")


def bench_daemon(n: int, seconds: float, table: list) -> None:
    import grpc

    from memory_broker.clients import BrokerClient
    from memory_broker.proto.wire.v1 import broker_pb2 as pb
    from memory_broker.proto.wire.v1 import broker_pb2_grpc

    d = tempfile.mkdtemp(prefix="mb-scale-", dir="/tmp")
    socket = os.path.join(d, "b.sock")
    # Room for n one-page objects below the high watermark (0.9): nothing is evicted.
    proc = start_broker(socket, os.path.join(d, "state"), int(n / 0.85) + 4096)
    try:
        idle = measure_echo(socket, seconds)
        row(table, f"Echo RPC over {seconds:g} s, broker holding nothing", "0 objects", idle)
        table[-1]["max_ms"] = max(idle)
        holder = BrokerClient.connect(socket, client_name="scale-holder")
        ch = grpc.insecure_channel(f"unix:{socket}")
        stub = broker_pb2_grpc.MemoryBrokerStub(ch)
        md = holder.metadata
        left = n
        while left:
            k = min(left, 65536)
            stub.Allocate(
                pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=pb.CONTENT_TYPE_TEMP_BUFFER)] * k),
                metadata=md,
                timeout=600,
            )
            left -= k
        st = stub.GetStats(pb.GetStatsRequest(), metadata=md)
        assert st.objects >= n, st.objects
        lat = measure_echo(socket, seconds)
        row(table, f"Echo RPC over {seconds:g} s, broker holding N objects", f"{n:,} objects", lat)
        table[-1]["max_ms"] = max(lat)
        # Other clients during the end of a session that owns all of them.
        child = echo_child(socket, 3.0 + n / 100_000)
        time.sleep(0.3)
        t0 = time.monotonic()
        holder.close()
        while stub.GetStats(pb.GetStatsRequest()).objects and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        released_s = time.monotonic() - t0
        during = echo_result(child)
        row(table, "Echo RPC while a session owning N objects ends", f"{n:,} objects", during)
        table[-1]["max_ms"] = max(during)
        print(f"(a session owning {n:,} objects released in {released_s:.2f} s)")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def print_table(table: list) -> None:
    print(f"{'operation':<52} {'size':>16} {'median ms':>10} {'p99 ms':>9} {'max ms':>9}")
    by_op: dict[str, list[dict]] = {}
    for r in table:
        by_op.setdefault(r["operation"], []).append(r)
        extra = f"{r['max_ms']:9.3f}" if "max_ms" in r else f"{'':>9}"
        print(f"{r['operation']:<52} {r['size']:>16} {r['median_ms']:10.4f} {r['p99_ms']:9.4f} {extra}")
    print()
    print("largest / smallest median:")
    for op, rs in by_op.items():
        if len(rs) > 1 and rs[0]["median_ms"] > 0:
            print(f"  {op:<52} {rs[-1]['median_ms'] / rs[0]['median_ms']:6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes and short periods (a smoke run)")
    ap.add_argument("--echo-seconds", type=float, default=60.0)
    ap.add_argument("--skip-daemon", action="store_true")
    a = ap.parse_args()
    sizes = [1_000, 10_000] if a.quick else [1_000, 10_000, 100_000, 1_000_000]
    holes = [1_000, 10_000] if a.quick else [1_000, 10_000, 100_000]
    table: list[dict] = []
    memory: list[tuple[int, float]] = []
    from memory_broker.broker.server.app import quiet_gc

    quiet_gc()  # as the daemon does at startup
    bench_stats_and_memory(sizes, table, memory)
    bench_placement(holes, table)
    bench_crossing(sizes, table, trials=3 if a.quick else 20)
    bench_teardown(sizes, table)
    bench_churn(sizes, table)
    if not a.skip_daemon:
        bench_daemon(sizes[-1], 2.0 if a.quick else a.echo_seconds, table)
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_scale_adapters  # noqa: E402
    except ImportError:
        bench_scale_adapters = None
    if bench_scale_adapters is not None:
        table.extend(bench_scale_adapters.rows(a.quick))
    print_table(table)
    print()
    print("memory per object (RSS growth / objects):")
    for n, b in memory:
        print(f"  {n:>10,} objects: {b:6.0f} bytes")
    print()
    import bench_policy

    bench_policy.hit_rate_table(a.quick)


if __name__ == "__main__":
    main()
