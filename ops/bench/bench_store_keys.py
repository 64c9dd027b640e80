#!/usr/bin/env python3
"""The broker's per-KV-key cost with the store's native core and without, interleaved.

    python ops/bench/bench_store_keys.py [--rounds 4] [--frames 300]

Two brokers in this process (host arena, served by threads, as ``bench_step.py --keys-only``
does): one whose store and step channel took the native core (``native/_storecore.c``),
one made with ``MEMORY_BROKER_NATIVE=0`` (the Python loops). Each round measures both, one
after the other, at 64 and 512 keys: the loop thread's CPU time for one STEP frame that unpins
the previous step's n keys and looks up + pins n others (decode, checks, pins, eviction queues,
reply), the handler called directly (``bench_step.broker_side``). Printed per round: each
path's median CPU us per frame and its slope between 64 and 512 keys (issue 28's target: under
0.5 us a key), and the ratio; then the same for a lookup without pins (the store's ``lookup``
alone, which touches the eviction queues), the store called directly.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_step as b  # noqa: E402  (this folder is on sys.path above)

from memory_broker.clients import BrokerClient, Spec  # noqa: E402
from memory_broker.proto.wire import native  # noqa: E402

SIZES = (64, 512)


def broker(d: str, name: str, on: bool) -> dict:
    """An in-process broker whose store took the native core (``on``) or not, with 1,024 keys
    and a client: {"box", "client", "setup", "key"}."""
    native._loaded.clear()
    if on:
        os.environ.pop(native.ENV, None)
    else:
        os.environ[native.ENV] = "0"
    sock = os.path.join(d, f"{name}.sock")
    box = b.inprocess_broker(os.path.join(d, name), sock)
    os.environ.pop(native.ENV, None)
    native._loaded.clear()
    store = box["server"].step_server.store
    assert (store.table.core is not None) == on, "the native core is not built: pip install -e ."
    setup = BrokerClient.connect(sock, client_name=f"keys-setup-{name}")
    setup.allocate([Spec(1, content_type="kv_cache", key=b.item_key(i)) for i in range(2 * max(SIZES))])
    c = BrokerClient.connect(sock, client_name=f"keys-{name}")
    return {"box": box, "client": c, "setup": setup, "key": dict(c.metadata)[b.KEY_METADATA]}


def frame_cpu(br: dict, frames: int) -> dict[int, float]:
    """Median CPU us of one keys-only STEP frame at each size."""
    c = br["client"]
    return {n: b.broker_side(br["box"], c.token, br["key"], n, frames)[1] for n in SIZES}


def lookup_cpu(br: dict, frames: int) -> dict[int, float]:
    """Median CPU us of the store's lookup without pins of n keys (touching the queues)."""
    box = br["box"]
    store = box["server"].step_server.store
    keys = [b.item_key(i) for i in range(max(SIZES))]

    async def run() -> dict[int, float]:
        sid = store.open_session()
        out = {}
        for n in SIZES:
            ks, xs = keys[:n], []
            for _ in range(frames):
                c0 = time.thread_time_ns()
                store.lookup(sid, ks, False)
                xs.append((time.thread_time_ns() - c0) / 1000)
            out[n] = statistics.median(xs[len(xs) // 10 :])
        store.end_session(sid)
        return out

    return asyncio.run_coroutine_threadsafe(run(), box["loop"]).result(600)


def slope(cpu: dict[int, float]) -> float:
    return (cpu[SIZES[1]] - cpu[SIZES[0]]) / (SIZES[1] - SIZES[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="rounds, each measuring both paths")
    ap.add_argument("--frames", type=int, default=300, help="frames per size and path in a round")
    a = ap.parse_args()
    b.ITEM_MIX = "keys"
    d = tempfile.mkdtemp(prefix="bsk-", dir="/tmp")
    brokers = {"native": broker(d, "native", True), "python": broker(d, "python", False)}
    print(f"Broker per-KV-key CPU, native core vs Python loops, interleaved ({time.strftime('%Y-%m-%d %H:%M')})")
    print(f"load average {os.getloadavg()[0]:.1f}; {a.frames} frames per size, path and round; medians of CPU time")
    head = f"{'round':>5} {'what':<22}" + "".join(f"{p + ' ' + str(n):>14}" for p in brokers for n in SIZES)
    print(head + f"{'native us/key':>15}{'python us/key':>15}{'ratio':>7}")
    slopes: dict[str, dict[str, list[float]]] = {"frame": {}, "lookup": {}}
    for r in range(a.rounds):
        order = list(brokers) if r % 2 == 0 else list(reversed(brokers))
        for what, measure in (("frame", frame_cpu), ("lookup", lookup_cpu)):
            got = {p: measure(brokers[p], a.frames) for p in order}
            s = {p: slope(got[p]) for p in brokers}
            for p in brokers:
                slopes[what].setdefault(p, []).append(s[p])
            label = "unpin n + lookup-pin n" if what == "frame" else "lookup n, no pin"
            cells = "".join(f"{got[p][n]:>14.1f}" for p in brokers for n in SIZES)
            print(f"{r:>5} {label:<22}{cells}{s['native']:>15.3f}{s['python']:>15.3f}{s['python'] / s['native']:>7.2f}")
    for what, label in (("frame", "a step frame's keys"), ("lookup", "a lookup without pins")):
        nat, py = statistics.median(slopes[what]["native"]), statistics.median(slopes[what]["python"])
        print(f"median slope 64..512, {label}: native {nat:.3f} us/key, Python {py:.3f} us/key ({py / nat:.1f}x)")
    s = statistics.median(slopes["frame"]["native"])
    print(
        f"target issue 28, broker per KV key (native): CPU slope 64..512 < 0.5 us/key: {s:.3f} -> {'MET' if s < 0.5 else 'NOT MET'}"
    )
    for br in brokers.values():
        br["client"].close()
        br["setup"].close()
        box = br["box"]
        asyncio.run_coroutine_threadsafe(box["server"].stop(), box["loop"]).result(60)


if __name__ == "__main__":
    main()
