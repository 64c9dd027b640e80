#!/usr/bin/env python3
"""RPC cost of each broker call next to a bare echo RPC over the same socket, same run.

Starts a broker (host arena, --enable-echo) in a subprocess, then times each call with the
raw gRPC stub (what the wire and the servicer cost) and through the client library (what an
engine pays, including building its objects). Prints medians and the ratio to the median of
the Echo calls alternated with each call in the same loop (drift hits both sides alike).
Also: pages per second for one batched allocate of 1,000 pages.
Target from the issue: a broker RPC within 1.3x of the echo RPC at the median.

    python ops/bench/bench_rpc.py [--n 400]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from memory_broker.clients import BrokerClient, Spec  # noqa: E402
from memory_broker.proto.wire.v1 import broker_pb2 as pb  # noqa: E402
from memory_broker.proto.wire.v1 import broker_pb2_grpc, echo_pb2, echo_pb2_grpc  # noqa: E402


def start_broker(
    socket: str,
    state: str,
    page_size: str = "2MiB",
    pool: str = "8GiB",
    slab: str = "256MiB",
    extra: tuple[str, ...] | list[str] = (),
) -> subprocess.Popen:
    """A broker on the host arena with the bare Echo service (``pool`` of ``page_size`` pages
    in ``slab`` slabs, then the flags ``extra``); returns once it answers. Also used by
    bench_step.py (512 KiB pages: KV blocks) and bench_request_flood.py."""
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
            pool,
            "--page-size",
            page_size,
            "--slab-size",
            slab,
            "--state-dir",
            state,
            "--log-level",
            "warning",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400, help="calls per measurement")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="mb-bench-", dir="/tmp")
    socket = os.path.join(d, "b.sock")
    proc = start_broker(socket, os.path.join(d, "state"))
    try:
        run(socket, a.n)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def run(socket: str, n: int) -> None:
    client = BrokerClient.connect(socket, client_name="bench")
    md = client.metadata
    ch = grpc.insecure_channel(f"unix:{socket}")
    stub = broker_pb2_grpc.MemoryBrokerStub(ch)
    echo = echo_pb2_grpc.EchoStub(ch)
    kv = pb.CONTENT_TYPE_KV_CACHE

    keyed = client.allocate([Spec(1, content_type="kv_cache", key=b"bench-key")])[0]
    one = pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=kv)])
    pin_req = pb.PinRequest(object_ids=[keyed.object_id])
    unpin_req = pb.UnpinRequest(object_ids=[keyed.object_id])

    def alloc_then_free():
        o = stub.Allocate(one, metadata=md).objects[0]
        stub.Free(pb.FreeRequest(object_ids=[o.object_id]), metadata=md)

    def prepare_commit():
        t = stub.Prepare(pb.PrepareRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=kv)]), metadata=md)
        stub.Commit(pb.CommitRequest(transaction_ids=[t.transaction_id]), metadata=md)

    # Free/Commit/Unpin need a prior call; they are timed as pairs and compared to 2 echoes.
    echo_req = echo_pb2.EchoRequest(payload=b"x" * 16)
    for _ in range(200):  # warm up both paths
        echo.Echo(echo_req)
        stub.GetStats(pb.GetStatsRequest())
    # Every measurement alternates its call with an Echo call and is compared with the echoes
    # of its own loop, so drift on a shared machine (other jobs, the broker's status tick)
    # hits both sides of each ratio alike.
    echo_all: list[float] = []

    def paired(fn) -> tuple[float, float]:
        """(median us of fn(), median us of the Echo calls alternated with it)."""
        mine, echoes = [], []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            echo.Echo(echo_req)
            t1 = time.perf_counter_ns()
            fn()
            echoes.append((t1 - t0) / 1000)
            mine.append((time.perf_counter_ns() - t1) / 1000)
        echo_all.extend(echoes)
        return statistics.median(mine), statistics.median(echoes)

    rows = [
        ("GetArena", *paired(lambda: stub.GetArena(pb.GetArenaRequest())), 1),
        ("GetStats", *paired(lambda: stub.GetStats(pb.GetStatsRequest())), 1),
        ("Allocate 1 page", None, None, 1),
        ("Pin 1 object", None, None, 1),
        ("Unpin 1 object", None, None, 1),
        ("Lookup 1 key (no pin)", *paired(lambda: stub.Lookup(pb.LookupRequest(keys=[b"bench-key"]), metadata=md)), 1),
        ("Allocate + Free (2 RPCs)", *paired(alloc_then_free), 2),
        ("Prepare + Commit (2 RPCs)", *paired(prepare_commit), 2),
    ]
    # Single-call timings for Allocate / Pin / Unpin, interleaved with their undo (not timed).
    alloc_s, pin_s, unpin_s, echo_s = [], [], [], []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        echo.Echo(echo_req)
        echo_s.append((time.perf_counter_ns() - t0) / 1000)
        t0 = time.perf_counter_ns()
        o = stub.Allocate(one, metadata=md).objects[0]
        alloc_s.append((time.perf_counter_ns() - t0) / 1000)
        stub.Free(pb.FreeRequest(object_ids=[o.object_id]), metadata=md)
        t0 = time.perf_counter_ns()
        stub.Pin(pin_req, metadata=md)
        pin_s.append((time.perf_counter_ns() - t0) / 1000)
        t0 = time.perf_counter_ns()
        stub.Unpin(unpin_req, metadata=md)
        unpin_s.append((time.perf_counter_ns() - t0) / 1000)
    echo_all.extend(echo_s)
    e = statistics.median(echo_s)
    rows[2] = ("Allocate 1 page", statistics.median(alloc_s), e, 1)
    rows[3] = ("Pin 1 object", statistics.median(pin_s), e, 1)
    rows[4] = ("Unpin 1 object", statistics.median(unpin_s), e, 1)
    lib_alloc, e_alloc = paired(lambda: client.free(client.allocate([Spec(1, content_type="kv_cache")])))
    lib_lookup, e_lookup = paired(lambda: client.lookup([b"bench-key"], pin=False))
    echo_us = statistics.median(echo_all)

    print(f"RPC costs over a Unix socket (median of {n} calls; grpcio {grpc.__version__})")
    print(f"{'call':<40}{'median us':>12}{'x echo':>10}")
    print(f"{'Echo (bare, same server and socket)':<40}{echo_us:>12.1f}{1.0:>10.2f}")
    worst = 0.0
    for name, us, e, calls in rows:
        ratio = us / (e * calls)
        worst = max(worst, ratio)
        print(f"{name:<40}{us:>12.1f}{ratio:>10.2f}")
    print(f"{'client lib: allocate + free (2 RPCs)':<40}{lib_alloc:>12.1f}{lib_alloc / (2 * e_alloc):>10.2f}")
    print(f"{'client lib: lookup 1 key':<40}{lib_lookup:>12.1f}{lib_lookup / e_lookup:>10.2f}")
    print("(x echo = the call's median / the median of the Echo calls alternated with it in the same loop)")
    print(
        f"\ntarget: every broker RPC within 1.3x of echo at the median: worst {worst:.2f}x -> "
        f"{'MET' if worst <= 1.3 else 'NOT MET'}"
    )

    # Batched allocate of 1,000 pages: one RPC, two shapes.
    print(f"\n{'batched allocate of 1,000 pages':<40}{'median ms':>12}{'pages/s':>14}")
    for name, req in (
        ("1,000 objects of 1 page", pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1, content_type=kv)] * 1000)),
        ("1 object of 1,000 pages", pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1000, content_type=kv)])),
        (
            "1 contiguous object of 1,000 pages",
            pb.AllocateRequest(objects=[pb.ObjectSpec(num_pages=1000, content_type=kv, contiguous=True)]),
        ),
    ):
        samples = []
        for _ in range(max(5, n // 20)):
            t0 = time.perf_counter_ns()
            resp = stub.Allocate(req, metadata=md)
            samples.append((time.perf_counter_ns() - t0) / 1e6)
            stub.Free(pb.FreeRequest(object_ids=[o.object_id for o in resp.objects]), metadata=md)
        ms = statistics.median(samples)
        print(f"{name:<40}{ms:>12.2f}{1000 / (ms / 1000):>14,.0f}")
    client.close()
    ch.close()


if __name__ == "__main__":
    main()
