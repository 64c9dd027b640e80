#!/usr/bin/env python3
"""Adapters in an engine's dtype from a broker at its defaults (bfloat16): what each way costs.

    python ops/bench/bench_adapter_dtypes.py [--runs 9] [--quick]

One rank-16 adapter over hidden 4096 x 32 layers x q/k/v/o (k/v 1024 wide, GQA), saved in
float32 as PEFT saves it (54 MB). A float32 or float16 engine needs the file's weights cast
once to its dtype (what vLLM does at load); the broker stores bfloat16. Two ways:

* **copy kept hot** (what the broker does): the first acquire in a dtype converts the files
  into a copy in that dtype; later acquires (any engine of that dtype) are hot hits. Costs
  the copy's pages while it is hot (it counts against the hot tier's budget).
* **conversion at every acquire**: no copy kept; each acquire converts the files again
  (measured as an acquire of the copy from cold: hot and warm copies dropped before each).

Next to them, the broker's own dtype: a hot hit and a cold acquire (its converted image read
back from disk). Every figure goes through ``AdapterManager.acquire`` + ``release`` on the
host arena; runs interleave the rows; medians. Memory is the copy's hot pages.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_adapters import Rig, med_ms, table, write_peft_dir  # noqa: E402

from memory_broker.broker.adapters import AdapterConfig  # noqa: E402

MiB = 1 << 20


def _drop(m, aid: str, dtype: str, warm_too: bool) -> None:
    """Make the adapter's copy in ``dtype`` cold (or warm): as if no copy were kept."""
    for e in m.pins.copies(aid):
        if e.layout.dtype != dtype:
            continue
        if m.hot.current(e) is not None:
            m.hot.demote(e)
        if warm_too and e.warm is not None:
            m.warm.drop(e)


async def _timed_acquire(m, s: int, aid: str, dtype: str) -> float:
    t0 = time.perf_counter()
    await m.acquire(s, [aid], dtype=dtype)
    dt = time.perf_counter() - t0
    m.release(s, [aid])
    return dt


async def run(root: str, runs: int, quick: bool) -> None:
    layers, hidden, kv = (4, 1024, 256) if quick else (32, 4096, 1024)
    src = write_peft_dir(os.path.join(root, "a"), 16, hidden, kv, layers, 1, dtype=torch.float32)
    file_mb = os.path.getsize(os.path.join(src, "adapter_model.safetensors")) / MiB
    rig = Rig(os.path.join(root, "state"), 2 * MiB, 512, AdapterConfig())  # defaults: bfloat16
    m = rig.manager
    try:
        rig.registry.register("a", src)
        await m.wait_conversions()
        s = m.store.open_session()
        stored = m.config.dtype
        rows = {
            ("bfloat16 (broker's own)", "hot hit"): (stored, None),
            ("bfloat16 (broker's own)", "cold (its image)"): (stored, True),
            ("float32", "copy kept hot: hit"): ("float32", None),
            ("float32", "conversion at acquire"): ("float32", True),
            ("float16", "copy kept hot: hit"): ("float16", None),
            ("float16", "conversion at acquire"): ("float16", True),
        }
        times: dict = {k: [] for k in rows}
        for dtype in ("float32", "float16", stored):  # warm up every copy once
            await _timed_acquire(m, s, "a", dtype)
        for _ in range(runs):
            for key, (dtype, cold) in rows.items():
                if cold:
                    _drop(m, "a", dtype, warm_too=True)
                else:
                    await m.acquire(s, ["a"], dtype=dtype)  # make sure it is hot
                    m.release(s, ["a"])
                times[key].append(await _timed_acquire(m, s, "a", dtype))
        pages = {}
        for dtype in (stored, "float32", "float16"):
            (a,) = (await m.acquire(s, ["a"], dtype=dtype, with_layout=True)).adapters
            pages[dtype] = (len(a.pages), a.layout.used_bytes)
        page = m.ctx.page_size
        print(f"adapter: rank 16, {layers} layers x q/k/v/o, hidden {hidden}; file {file_mb:.1f} MB float32")
        hit = {d: med_ms(times[(d, w)]) for d, w in rows if "hit" in w}
        table(
            f"acquire + release, median of {runs} (ms); host arena, 2 MiB pages",
            ["engine dtype", "way", "ms", "x its hit"],
            [[d, w, f"{med_ms(times[(d, w)]):.3f}", f"{med_ms(times[(d, w)]) / hit[d]:.1f}"] for d, w in rows],
            [26, 26, 12, 12],
        )
        table(
            "hot memory per copy",
            ["dtype", "pages", "MiB", "weights MiB"],
            [[d, n, f"{n * page / MiB:.1f}", f"{u / MiB:.1f}"] for d, (n, u) in pages.items()],
            [26, 10, 10, 14],
        )
    finally:
        await rig.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="a small adapter (smoke test)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-adapter-dtypes-") as root:
        asyncio.run(run(root, a.runs, a.quick))


if __name__ == "__main__":
    main()
