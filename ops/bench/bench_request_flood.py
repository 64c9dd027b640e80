#!/usr/bin/env python3
"""Large gRPC requests in flight: the broker's memory and a bystander's latency (issue 26, item 8).

Starts a broker (host arena, 256 MiB pool), lets a bystander (one session over gRPC, the step
channel off) time small Lookups, and reads the broker's RSS when idle. Then ``--senders``
connections (each its own HTTP/2 connection, spread over two sender processes) each send
``--per-sender`` Lookup requests of ``--size-mib`` MiB (1 KiB keys, no session token, so the
old broker refused them after parsing them) at once, while the bystander keeps timing. Prints
the broker's RSS idle, at its peak during the burst, just after it and after ``--settle``
seconds; the bystander's p50/p99/max before and during the burst; and the status codes the
senders got.

    python ops/bench/bench_request_flood.py [--senders 16] [--size-mib 60] [--per-sender 2]
        [--settle 3] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rpc import start_broker  # noqa: E402  (this folder is on sys.path above)

from memory_broker.proto.wire.v1 import broker_pb2 as pb  # noqa: E402

LOOKUP = "/broker.v1.MemoryBroker/Lookup"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def big_request(size_mib: int) -> bytes:
    n = (size_mib << 20) // (1024 + 3)
    return pb.LookupRequest(keys=[b"k" * 1024] * n).SerializeToString()


def sender_main(socket: str, threads: int, per_sender: int, size_mib: int) -> None:
    """One sender process: ``threads`` connections, each sending its requests one after another;
    prints a JSON count of the status codes when done."""
    body = big_request(size_mib)
    codes: collections.Counter = collections.Counter()
    lock = threading.Lock()
    opts = [("grpc.max_send_message_length", 256 << 20), ("grpc.use_local_subchannel_pool", 1)]
    go = threading.Event()

    def one(i: int) -> None:
        with grpc.insecure_channel(f"unix:{socket}", options=[*opts, ("mb.sender", i)]) as ch:
            call = ch.unary_unary(LOOKUP, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            go.wait()
            for _ in range(per_sender):
                try:
                    call(body, timeout=60)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                    if code == "RESOURCE_EXHAUSTED":
                        code += f" ({e.details()[:60]})"
                with lock:
                    codes[code] += 1

    ts = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    for t in ts:
        t.join()
    print(json.dumps(dict(codes)), flush=True)


class Bystander(threading.Thread):
    """Times one small gRPC Lookup after another, recording (start, seconds)."""

    def __init__(self, socket: str):
        super().__init__(daemon=True)
        from memory_broker.clients.client import BrokerClient

        self.client = BrokerClient.connect(socket, client_name="bystander", fast_path=False)
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            self.client.lookup([b"bystander-key"], pin=False)
            self.samples.append((t0, time.perf_counter() - t0))
            time.sleep(0.002)

    def between(self, a: float, b: float) -> list[float]:
        return [s for t, s in self.samples if a <= t <= b]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--senders", type=int, default=16)
    ap.add_argument("--size-mib", type=int, default=60)
    ap.add_argument("--per-sender", type=int, default=2)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--sender-child", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("serve_flags", nargs="*", help="extra flags for memory-broker serve (after --)")
    a = ap.parse_args()
    if a.sender_child:
        sock, threads, per, size = a.sender_child
        sender_main(sock, int(threads), int(per), int(size))
        return
    d = tempfile.mkdtemp(prefix="mb-flood-", dir="/tmp")
    socket = os.path.join(d, "b.sock")
    proc = start_broker(socket, os.path.join(d, "state"), pool="256MiB", slab="64MiB", extra=a.serve_flags)
    try:
        report(a, socket, proc)
    finally:
        proc.terminate()
        proc.wait(15)


def report(a, socket: str, proc: subprocess.Popen) -> None:
    by = Bystander(socket)
    by.start()
    time.sleep(1.0)
    idle = rss_mib(proc.pid)
    t_idle0 = time.perf_counter()
    time.sleep(1.0)
    t_idle1 = time.perf_counter()
    halves = [a.senders // 2, a.senders - a.senders // 2]
    kids = [
        subprocess.Popen(
            [sys.executable, __file__, "--sender-child", socket, str(n), str(a.per_sender), str(a.size_mib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in halves
        if n
    ]
    for k in kids:
        assert k.stdout.readline().strip() == "ready"
    peak = [idle]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], rss_mib(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    for k in kids:
        k.stdin.write("go\n")
        k.stdin.flush()
    codes: collections.Counter = collections.Counter()
    for k in kids:
        codes.update(json.loads(k.stdout.readline()))
        k.wait()
    t1 = time.perf_counter()
    sampling.set()
    sampler.join()
    after = rss_mib(proc.pid)
    time.sleep(a.settle)
    settled = rss_mib(proc.pid)
    by.stop.set()
    by.join()
    quiet, burst = by.between(t_idle0, t_idle1), by.between(t0, t1)
    print(f"{a.senders} senders x {a.per_sender} Lookups of {a.size_mib} MiB; burst {t1 - t0:.2f} s")
    print("| broker RSS (MiB) | idle | peak in burst | just after | after settle |")
    print("|---|---|---|---|---|")
    print(f"| | {idle:.0f} | {peak[0]:.0f} | {after:.0f} | {settled:.0f} |")
    print(f"settled / idle: {settled / idle:.2f}")
    print()
    print("| bystander Lookup (ms) | calls | p50 | p99 | max |")
    print("|---|---|---|---|---|")
    for name, xs in (("before the burst", quiet), ("during the burst", burst)):
        print(f"| {name} | {len(xs)} | {pct(xs, 0.5):.2f} | {pct(xs, 0.99):.2f} | {max(xs, default=0) * 1e3:.2f} |")
    print()
    print("senders' answers: " + ", ".join(f"{k}: {v}" for k, v in sorted(codes.items())))
    by.client.close()


if __name__ == "__main__":
    main()
