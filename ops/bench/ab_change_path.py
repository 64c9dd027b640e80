"""A StepBatch change's CPU, an older tree's change path against this one, in ONE process.

Separate benchmark runs on a shared VM differ by more than a change to this path does, so
this runs both, change by change: the functions of the cached change path (``send_delta``,
``ChannelCalls.change`` with its ``_ChannelChange``, ``SessionRecords.objects``,
``BrokerClient._read_objects`` and ``_read_access``, and the short lane of ``StepBatch``'s
changes, ``ChannelCalls.lane``) are swapped before every change between this tree's and those
of ``BASE`` (a ``clients/`` directory of the older tree, e.g. ``git archive <commit> clients |
tar -x -C /tmp/base``): even changes run the older ones, odd ones this tree's. The workload is
``bench_step.py``'s trace (8 hot adapters, ``hold_s=1.0``). Modes: ``cold`` (a 2 ms sleep
between ``begin`` and ``result``: an engine waiting on its GPU), ``warm`` (none), ``bg`` (a
background batch: its process's CPU per change). Prints the medians of each side and their
ratio::

    .venv/bin/python ops/bench/ab_change_path.py /tmp/base/clients 600 cold
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import statistics
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_step as b  # noqa: E402

from memory_broker.clients import (  # noqa: E402
    Spec,  # noqa: E402
    fastpath,
    step_lease,
)
from memory_broker.clients import client as clmod  # noqa: E402
from memory_broker.clients.client import BrokerClient  # noqa: E402
from memory_broker.clients.step import path as stepmod  # noqa: E402


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _method(path: str, name: str, globs: dict):
    """A method's source from ``path``, defined in ``globs`` (its module's, this tree's)."""
    src = open(path).read()
    m = re.search(rf"\n    def {name}\(.*?(?=\n    def |\n    @|\nclass |\Z)", src, re.S)
    ns: dict = {}
    exec(textwrap.dedent(m.group(0)), globs, ns)  # noqa: S102 (a benchmark's own source)
    return ns[name]


def sides(base: str) -> dict:
    sd = _load("ab_base_step_delta", os.path.join(base, "step_delta.py"))
    fp = _load("ab_base_fastpath", os.path.join(base, "fastpath.py"))
    sl = _load("ab_base_step_lease", os.path.join(base, "step_lease.py"))
    # The older tree's ChannelCalls.change calls its own send_delta (from its module's globals).
    fp.send_delta = sd.send_delta
    # A tree before the short lane (``step_delta.lane_begin``) sends every change through
    # ``ChannelCalls.change``: the base side runs with ``ChannelCalls.lane`` off.
    lane = "def lane_begin(" in open(os.path.join(base, "step_delta.py")).read()
    cl = os.path.join(base, "client.py")
    return {
        "base": (
            sd.send_delta,
            fp.ChannelCalls.change,
            sl.SessionRecords.objects,
            _method(cl, "_read_objects", clmod.__dict__),
            _method(cl, "_read_access", clmod.__dict__),
            lane,
        ),
        "new": (
            stepmod.send_delta,
            fastpath.ChannelCalls.change,
            step_lease.SessionRecords.objects,
            clmod.BrokerClient._read_objects,
            clmod.BrokerClient._read_access,
            True,
        ),
    }


def use(side: tuple, c: BrokerClient | None = None) -> None:
    stepmod.send_delta, fastpath.ChannelCalls.change, step_lease.SessionRecords.objects = side[:3]
    clmod.BrokerClient._read_objects, clmod.BrokerClient._read_access = side[3:5]
    if c is not None:
        c._step_calls().lane = side[5]


def setup_broker(d: str):
    sock = os.path.join(d, "b.sock")
    proc = b.start_broker(sock, os.path.join(d, "state"), page_size="512KiB")
    setup = BrokerClient.connect(sock, client_name="setup")
    ids = [f"ad{i}" for i in range(b.ADAPTERS)]
    for i, aid in enumerate(ids):
        setup.register_adapter(aid, b.write_adapter(os.path.join(d, "adapters", aid), i))
    setup.prefetch_adapters(ids, "hot")
    for first in range(0, b.KEYS, 1000):
        setup.allocate(
            [Spec(1, content_type="kv_cache", key=b"kv-%d" % i) for i in range(first, min(b.KEYS, first + 1000))]
        )
    return proc, sock, setup, ids


def run(c: BrokerClient, ids: list, both: dict, steps: int, mode: str) -> dict:
    dl = b.deltas(b.trace(steps + 100))
    c.acquire_adapters(ids).release()
    bt = c.step_batch(background=mode == "bg")
    bt.update(dl[0][0], (), dl[0][2], ())
    got: dict = {"base": [], "new": []}
    for i in range(len(dl)):
        which = "base" if i % 2 == 0 else "new"
        use(both[which], c)
        nxt = dl[i + 1] if i + 1 < len(dl) else ((), (), (), ())
        p0, c0 = time.process_time_ns(), time.thread_time_ns()
        pending = bt.begin(nxt[0], dl[i][1], nxt[2], dl[i][3])
        c1 = time.thread_time_ns()
        time.sleep(0 if mode == "warm" else 0.002)
        c2 = time.thread_time_ns()
        pending.result()
        c3, p3 = time.thread_time_ns(), time.process_time_ns()
        if i >= 100:
            got[which].append(((c1 - c0 + c3 - c2) / 1000, (p3 - p0) / 1000))
    use(both["new"], c)
    bt.release()
    return {w: (statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)) for w, xs in got.items()}


def main() -> None:
    base, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "cold"
    both = sides(base)
    d = tempfile.mkdtemp(prefix="mb-ab-", dir="/tmp")
    proc, sock, setup, ids = setup_broker(d)
    try:
        c = BrokerClient.connect(sock, client_name="ab", hold_s=1.0)
        out = run(c, ids, both, steps, mode)
        c.close()
        setup.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    (be, bp), (ne, np_) = out["base"], out["new"]
    print(
        f"{mode}: engine base {be:.1f} new {ne:.1f} us ({ne / be:.2f}); "
        f"process base {bp:.1f} new {np_:.1f} us ({np_ / bp:.2f})"
    )


if __name__ == "__main__":
    main()
