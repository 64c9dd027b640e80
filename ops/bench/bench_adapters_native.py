"""A step's hot adapters on the broker, per adapter: the adapter wing's native core against its fallback.

    python ops/bench/bench_adapters_native.py [--frames 200] [--rounds 3] [--sizes 64,512]

Two in-process brokers (host arena, as ``bench_step.py --adapters-only``'s broker row), the
first with the native core (``native/_hotcore.c``; the store's and the wire's too,
where built), the second made with ``MEMORY_BROKER_NATIVE=0`` (every path in Python). Each
has 2n hot adapters and takes a frame that gives back the previous step's n (RELEASE) and
acquires n others (ACQUIRE), the step channel's handler called directly on its loop. The two
run interleaved, size by size and round by round, on the same machine at the same time, and
each row is the thread's CPU time per frame (p10 and median after the first 10% of frames), so
a loaded machine's preemption inflates neither. The slope, (CPU at the largest size minus at
the smallest) / (their difference), is what one more adapter taken and given back costs:
issue 28's target is under 0.5 us.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step as b  # noqa: E402

_median = statistics.median  # broker_side's median is swapped below to keep its samples


def _p10(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 10]


def _broker(d: str, hot: int, fallback: bool):
    from memory_broker.clients import BrokerClient
    from memory_broker.proto.wire import native
    from memory_broker.proto.wire.session import KEY_METADATA

    saved = dict(native._loaded), os.environ.get(native.ENV)
    if fallback:  # what the broker's parts load at construction: nothing native
        native._loaded.clear()
        os.environ[native.ENV] = "0"
    try:
        sock = os.path.join(d, "s.sock")
        box = b.inprocess_broker(d, sock)
    finally:
        native._loaded.clear()
        native._loaded.update(saved[0])
        if saved[1] is None:
            os.environ.pop(native.ENV, None)
        else:
            os.environ[native.ENV] = saved[1]
    setup = BrokerClient.connect(sock, client_name="setup")
    ids = [f"it{i}" for i in range(hot)]
    for i, aid in enumerate(ids):
        setup.register_adapter(aid, b.write_adapter(os.path.join(d, "ad", aid), i))
    setup.prefetch_adapters(ids, "hot")
    c = BrokerClient.connect(sock, client_name="engine")
    core = box["server"].step_server.ops._core
    return box, c.token, dict(c.metadata)[KEY_METADATA], core is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="64,512")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    b.ITEM_MIX = "adapters"
    d = tempfile.mkdtemp(prefix="bench-adapters-native-")
    brokers = {}
    for name, fallback in (("native", False), ("fallback", True)):
        os.mkdir(os.path.join(d, name))
        box, token, key, native_on = _broker(os.path.join(d, name), 2 * max(sizes), fallback)
        assert native_on != fallback, f"the {name} broker's adapter core is {'on' if native_on else 'off'}"
        brokers[name] = (box, token, key)
    print(f"A step's hot adapters on the broker: CPU us per frame (release n + acquire n), {a.frames} frames a row")
    print(
        f"{'round':>5} {'path':<9} " + " ".join(f"{f'n={n} p10':>10} {'med':>7}" for n in sizes) + "   slope p10    med"
    )
    slopes: dict[str, list[float]] = {name: [] for name in brokers}
    for r in range(a.rounds):
        for name, (box, token, key) in brokers.items():
            row = []
            for n in sizes:
                cpu = []
                statistics.median = lambda xs, cpu=cpu: cpu.append(list(xs)) or 0.0  # keep the samples
                try:
                    b.broker_side(box, token, key, n, a.frames)
                finally:
                    statistics.median = _median
                samples = cpu[-1]  # the CPU times (after the wall-clock ones), first 10% dropped
                row.append((_p10(samples), _median(samples)))
            span = sizes[-1] - sizes[0]
            sp = (row[-1][0] - row[0][0]) / span
            sm = (row[-1][1] - row[0][1]) / span
            slopes[name].append(sp)
            cells = " ".join(f"{p:>10.0f} {m:>7.0f}" for p, m in row)
            print(f"{r + 1:>5} {name:<9} {cells}   {sp:>9.2f} {sm:>6.2f}", flush=True)
    for name, xs in slopes.items():
        print(f"slope p10 {name}: median of rounds {_median(xs):.2f} us per adapter (target < 0.5)")
    os._exit(0)  # the brokers' threads and their sockets go with the process


if __name__ == "__main__":
    main()
