#!/usr/bin/env python3
"""Replies bounded like requests (issue 48, item 2): what replies a client leaves unread hold.

Starts a broker (host arena, 512 KiB pages, ``--pool-size``) with one keyed object ``k0`` (a
``--key-bytes`` key: 393, a record of about 433 bytes as in the issue's probe) and ``--objects``
more with 1 KiB keys, and a bystander timing ``stats()`` over gRPC. Then:

1. **Step frames**: ``--frames`` STEP frames of just under ``MAX_FRAME_BYTES`` that name ``k0``'s
   id over and over (64 PIN ops of 7,600 copies each, 3.9 MB), each on a step connection of its
   own that never reads a reply; then as many frames of LOOKUP ops of the ``--objects`` keys
   (distinct keys, as many ops as fit: what a reply may still carry). The broker's RSS idle, at
   its peak and once it settles (what the unread frames hold); the bystander's worst
   ``stats()`` meanwhile.
2. **A 65,535-fold PIN**: one STEP frame with a PIN op naming ``k0``'s id 65,535 times, and one
   gRPC Pin doing the same: request and reply bytes, the answer, the pins it added.
3. **gRPC, unread**: a child process sends ``--lookups`` Lookups naming ``k0``'s key as many
   times as a 4 MiB request holds (10,527 with a 393-byte key) and ``--pins`` Pins of the
   ``--objects`` ids (distinct), then stops itself (SIGSTOP) without reading a reply. The
   broker's RSS while it is stopped (settled); then it is let go on (SIGCONT), reads its
   answers, prints how many of each kind it got and exits: the broker's RSS 1 s and
   ``--after`` seconds after that.

    python ops/bench/bench_reply_bounds.py [--objects 400] [--pool-size 256MiB] [--frames 2]
        [--lookups 20] [--pins 300] [--after 30] [--key-bytes 393] [--parts 123]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket as so
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpc  # noqa: E402
from bench_rpc import start_broker  # noqa: E402  (this folder is on sys.path above)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from rigs import recv_exact as recv  # noqa: E402  (the test helpers in tests/rigs.py)

from memory_broker.clients import BrokerClient, Spec  # noqa: E402
from memory_broker.proto.wire import step as w  # noqa: E402
from memory_broker.proto.wire.v1 import broker_pb2 as pb  # noqa: E402
from memory_broker.proto.wire.v1 import broker_pb2_grpc  # noqa: E402

FOLD = 65535


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:")), 0.0)


def big_keys(n: int) -> list[bytes]:
    return [b"%05d-" % i + b"x" * 1018 for i in range(n)]


class Watch:
    """The broker's RSS sampled every 20 ms (its peak), and a bystander timing ``stats()``."""

    def __init__(self, socket: str, pid: int):
        self.pid, self.peak, self.worst = pid, 0.0, 0.0
        self.client = BrokerClient.connect(socket, client_name="bystander", fast_path=False)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._sample, self._stats)]
        for t in self.threads:
            t.start()

    def reset(self) -> None:
        self.peak, self.worst = rss_mib(self.pid), 0.0

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(0.02)

    def _stats(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            self.client.stats()
            self.worst = max(self.worst, time.perf_counter() - t0)
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        self.client.close()


def step_conn(c: BrokerClient) -> so.socket:
    s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    s.settimeout(30)
    s.connect(c._step_socket())
    s.sendall(w.frame(w.HELLO, c.token.encode()))
    n, kind = w.HEADER.unpack(recv(s, 5))
    recv(s, n)
    assert kind == w.OK, kind
    return s


def held(watch: Watch, idle: float, settle: float = 3.0) -> tuple[float, float]:
    """(peak, held) above ``idle``, in MiB: held once the RSS has not moved by 2 MiB for a
    second, after at least ``settle`` s (at most 120 s)."""
    time.sleep(settle)
    deadline, last = time.monotonic() + 120, rss_mib(watch.pid)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = rss_mib(watch.pid)
        if abs(now - last) < 2:
            break
        last = now
    return watch.peak - idle, rss_mib(watch.pid) - idle


def part_frames(c: BrokerClient, watch: Watch, k0, keys: list[bytes], frames: int) -> None:
    print("## 1. Unread amplifying STEP frames\n")
    print(
        "| frames (each on its own connection, never read) | frame bytes | RSS idle MiB | peak + | held + (settled) "
        "| bystander's slowest stats() |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    kinds = [
        ("64 PIN ops x 7,600 copies of one id", [w.Op(w.OP_PIN, (k0.object_id,) * 7600)] * 64),
        (f"64 LOOKUP ops x {len(keys)} distinct 1 KiB keys", [w.Op(w.OP_LOOKUP, tuple(keys), 0)] * 64),
    ]
    for name, ops in kinds:
        frame = w.encode_step(ops)
        if len(frame) > w.MAX_FRAME_BYTES:  # the lookups: as many ops as fit
            per = len(w.encode_step(ops[:1]))
            frame = w.encode_step(ops[: max(1, (w.MAX_FRAME_BYTES - 64) // per)])
            name = name.replace("64 LOOKUP", f"{(w.MAX_FRAME_BYTES - 64) // per} LOOKUP")
        time.sleep(1.0)
        idle = rss_mib(watch.pid)
        watch.reset()
        conns = [step_conn(c) for _ in range(frames)]
        for s in conns:
            s.sendall(frame)
        peak, kept = held(watch, idle)
        print(
            f"| {frames} x {name} | {len(frame):,} | {idle:.0f} | {peak:.0f} | {kept:.0f} | {watch.worst * 1e3:.0f} ms |"
        )
        for s in conns:
            s.close()
    print()


def part_pin(c: BrokerClient, k0) -> None:
    print("## 2. A PIN naming one id 65,535 times\n")
    print("| path | request bytes | reply bytes | reply / request | answer | pins added |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    before = k0_pins(c, k0)
    s = step_conn(c)
    request = w.encode_step([w.Op(w.OP_PIN, (k0.object_id,) * FOLD)])
    s.sendall(request)
    n, kind = w.HEADER.unpack(recv(s, 5))
    body = recv(s, n)
    r = w.decode_step_reply(kind, body)
    answer = "OK" if r.error is None else f"{r.error.code.name}: {r.error.message[:60]}"
    print(
        f"| step frame | {len(request):,} | {5 + n:,} | {(5 + n) / len(request):.2f} | {answer} | "
        f"{k0_pins(c, k0) - before:,} |"
    )
    s.close()
    req = pb.PinRequest(object_ids=[k0.object_id] * FOLD)
    before_g = k0_pins(c, k0)
    with grpc.insecure_channel(f"unix:{c.socket_path}", options=[("grpc.max_receive_message_length", 1 << 30)]) as ch:
        try:
            reply = broker_pb2_grpc.MemoryBrokerStub(ch).Pin(req, metadata=c.metadata, timeout=120)
            size, answer = reply.ByteSize(), "OK"
        except grpc.RpcError as e:
            size, answer = len(e.details().encode()), f"{e.code().name}: {e.details()[:60]}"
    print(
        f"| gRPC Pin | {req.ByteSize():,} | {size:,} (message) | {size / req.ByteSize():.2f} | {answer} | "
        f"{k0_pins(c, k0) - before_g:,} |\n"
    )


def k0_pins(c: BrokerClient, k0) -> int:
    (o,) = c.lookup([k0.key], pin=False)
    return o.total_pins


CHILD = r"""
import json, os, signal, sys, time
import grpc
from memory_broker.clients import BrokerClient
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc
sock, lookups, pins, key, ids = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].encode(), json.loads(sys.argv[5])
c = BrokerClient.connect(sock, client_name="unread", fast_path=False)
ch = grpc.insecure_channel(f"unix:{sock}", options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.use_local_subchannel_pool", 1)])
stub = broker_pb2_grpc.MemoryBrokerStub(ch)
look = pb.LookupRequest(keys=[key] * ((4 << 20) // (len(key) + 3) - 64), pin=False)  # within a 4 MiB request
futs = [stub.Lookup.future(look, metadata=c.metadata, timeout=600) for _ in range(lookups)]
futs += [stub.Pin.future(pb.PinRequest(object_ids=ids), metadata=c.metadata, timeout=600) for _ in range(pins)]
time.sleep(0.3)
print("sent", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
codes = {}
for f in futs:
    try:
        f.result()
        code = "OK"
    except grpc.RpcError as e:
        code = e.code().name
    codes[code] = codes.get(code, 0) + 1
print(json.dumps(codes), flush=True)
"""


def part_grpc(socket: str, watch: Watch, k0, ids: list[int], lookups: int, pins: int, after: float) -> None:
    print("## 3. gRPC replies left unread (the client stopped with SIGSTOP)\n")
    args = [sys.executable, "-c", CHILD, socket, str(lookups), str(pins), k0.key.decode(), json.dumps(ids)]
    time.sleep(1.0)
    idle = rss_mib(watch.pid)
    watch.reset()
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "sent"
    peak, during = held(watch, idle, 5.0)
    child.send_signal(signal.SIGCONT)  # it reads its answers now, and exits
    codes = json.loads(child.stdout.readline())
    child.wait()
    time.sleep(1.0)
    gone1 = rss_mib(watch.pid) - idle
    time.sleep(max(0.0, after - 1.0))
    gone = rss_mib(watch.pid) - idle
    copies = (4 << 20) // (len(k0.key) + 3) - 64
    print(
        f"{lookups} Lookups naming k0 {copies:,} times and {pins} Pins of {len(ids)} distinct ids (1 KiB keys), unread\n"
    )
    print(f"| RSS idle MiB | peak + | held + (stopped, settled) | 1 s after it exited | {after:.0f} s after |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    print(f"| {idle:.0f} | {peak:.0f} | {during:.0f} | {gone1:.0f} | {gone:.0f} |\n")
    print("its answers, read after SIGCONT: " + ", ".join(f"{k}: {v}" for k, v in sorted(codes.items())))
    print(f"bystander's slowest stats() over part 3: {watch.worst * 1e3:.0f} ms\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=400)
    ap.add_argument("--pool-size", default="256MiB")
    ap.add_argument("--frames", type=int, default=2)
    ap.add_argument("--lookups", type=int, default=20)
    ap.add_argument("--pins", type=int, default=300)
    ap.add_argument("--after", type=float, default=30.0)
    ap.add_argument("--key-bytes", type=int, default=393)
    ap.add_argument("--parts", default="123")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="mb-replies-", dir="/tmp")
    socket = os.path.join(d, "b.sock")
    proc = start_broker(socket, os.path.join(d, "state"), page_size="512KiB", pool=a.pool_size, slab="32MiB")
    try:
        c = BrokerClient.connect(socket, client_name="setup")
        (k0,) = c.allocate([Spec(1, content_type="kv_cache", key=b"k0-" + b"x" * (a.key_bytes - 3))])
        keys = big_keys(a.objects)
        objs = c.allocate([Spec(1, content_type="kv_cache", key=k) for k in keys])
        watch = Watch(socket, proc.pid)
        print(f"broker pid {proc.pid}: {a.objects + 1} objects; RSS {rss_mib(proc.pid):.0f} MiB\n")
        if "1" in a.parts:
            part_frames(c, watch, k0, keys, a.frames)
        if "2" in a.parts:
            part_pin(c, k0)
        if "3" in a.parts:
            watch.worst = 0.0
            part_grpc(socket, watch, k0, [o.object_id for o in objs], a.lookups, a.pins, a.after)
        watch.close()
        c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
