#!/usr/bin/env python3
"""Adapter tiers: load bandwidth next to bare baselines, and hit rates of the tier policies.

    python ops/bench/bench_adapters.py [--runs 15] [--quick]

1. Load bandwidth, one rank-16 adapter over hidden 4096 x 32 layers x q/k/v/o (k/v 1024 wide,
   GQA), bf16 (27 MB), written as a PEFT directory. cold->warm (file -> host image in the
   page layout, Bᵀ included) runs next to ``safetensors.torch.load_file`` of the same file;
   warm->hot (image -> arena pages, one copy per page) next to one ``memmove`` of the same
   bytes into the same arena; interleaved runs, medians, the file in the page cache. Then
   the same loads end to end through ``AdapterManager.acquire``, and with int8 warm storage.
2. The adapter-slot scenario of the lab seed: 16 adapters, 4 hot slots, 80/20 traffic.
3. A Zipf(1.0) trace over 1,000 adapters of mixed ranks (hot budget in pages, a warm budget).
4. Registering 10,000 adapters and listing them.

Everything runs on the host arena (CPU). Hit rates go through the real manager, arena and
store: every miss is a real load.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import random
import statistics
import sys
import tempfile
import time

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from memory_broker.broker.adapters import AdapterConfig, AdapterManager, AdapterRegistry, plan_layout  # noqa: E402
from memory_broker.broker.adapters.image_cache import ImageCache  # noqa: E402
from memory_broker.broker.adapters.page_writers import HostPageWriter  # noqa: E402
from memory_broker.broker.adapters.policy import POLICIES  # noqa: E402
from memory_broker.broker.adapters.warm_image import build_warm_image  # noqa: E402
from memory_broker.broker.arena.base import ArenaGeometry  # noqa: E402
from memory_broker.broker.arena.host import HostArena  # noqa: E402
from memory_broker.broker.store.objects import ObjectStore, StoreConfig  # noqa: E402
from memory_broker.broker.store.pool import PagePool, WindowSpace  # noqa: E402

MiB = 1 << 20


def write_peft_dir(path: str, rank: int, hidden: int, kv: int, layers: int, seed: int, dtype=torch.bfloat16) -> str:
    """A PEFT-shaped LoRA directory (config + safetensors) with random weights."""
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    mods = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
    }
    tensors = {}
    for layer in range(layers):
        for p, (i, o) in mods.items():
            k = f"base_model.model.model.layers.{layer}.{p}"
            tensors[f"{k}.lora_A.weight"] = (torch.randn(rank, i, generator=g) * 0.02).to(dtype)
            tensors[f"{k}.lora_B.weight"] = (torch.randn(o, rank, generator=g) * 0.02).to(dtype)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "target_modules": [p.rsplit(".", 1)[1] for p in mods],
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return path


class Rig:
    """A host arena + pool + store + registry + manager, with store events routed."""

    def __init__(self, state_dir: str, page_size: int, pages: int, config: AdapterConfig, pages_per_slab: int = 16):
        slabs = -(-pages // pages_per_slab)
        self.geometry = ArenaGeometry(page_size, pages_per_slab, slabs, pages_per_slab * slabs * 2)
        self.arena = HostArena(self.geometry, name="bench-adapters")
        self.arena.grow(slabs)
        pool = PagePool(self.geometry.max_pages, pages_per_slab, self.arena.capacity_pages, grow=self.arena.grow)
        self.manager: AdapterManager | None = None
        self.store = ObjectStore(
            pool,
            WindowSpace(self.geometry.window_pages),
            config=StoreConfig(high_watermark=1.0, low_watermark=1.0),
            notify=lambda sid, ev: self.manager.handle_store_event(sid, ev) if self.manager else None,
        )
        self.registry = AdapterRegistry(state_dir)
        self.manager = AdapterManager(self.store, self.arena, self.registry, config)

    async def close(self) -> None:
        await self.manager.close()
        self.registry.close()
        self.arena.close()


def med_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def table(title: str, header: list[str], rows: list[list], widths: list[int]) -> None:
    print(f"\n{title}")
    print("".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, w) in enumerate(zip(header, widths))))
    for r in rows:
        print("".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(r, widths))))


# ------------------------------------------------------------------ bandwidth


def bench_bandwidth(root: str, runs: int, quick: bool) -> None:
    layers = 8 if quick else 32
    src = write_peft_dir(os.path.join(root, "big"), rank=16, hidden=4096, kv=1024, layers=layers, seed=1)
    page = 2 * MiB
    reg = AdapterRegistry(os.path.join(root, "state-bw"))
    meta = reg.register("big", src)
    layout = plan_layout(meta.weights, page, "bfloat16")
    n = layout.num_pages
    geometry = ArenaGeometry(page, 16, 4, 128)
    arena = HostArena(geometry, name="bench-bw")
    arena.grow(-(-2 * n // 16))
    writer = HostPageWriter(arena.view)
    ours_pages = list(range(n))
    base_dst = arena.view.page_address(n)  # the next n pages, contiguous
    weight_bytes = layout.weight_bytes
    used = layout.used_bytes
    load_file(meta.weights_path)  # page cache
    image = build_warm_image(meta, layout)
    writer.write(image, ours_pages)  # fault the pages in
    ctypes.memmove(base_dst, image.packed.ctypes.data, used)
    # The converted-image cache the manager keeps in <state_dir>/images.
    cache = ImageCache(os.path.join(root, "state-bw", "images"))
    cache.store(meta, image)
    cached_img, why = cache.load(meta, layout)
    assert cached_img is not None and np.array_equal(cached_img.packed, image.packed), why
    del cached_img
    cold1, cold2, cached, cached2, stores, st_load, st_t, hot, memcpy = [], [], [], [], [], [], [], [], []
    b_keys = [meta.weight_key(w.layer, w.module, "B") for w in meta.weights]
    for _ in range(runs):
        t0 = time.perf_counter()
        img = build_warm_image(meta, layout, threads=1)
        cold1.append(time.perf_counter() - t0)
        del img
        t0 = time.perf_counter()
        img = build_warm_image(meta, layout, threads=2)
        cold2.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cache.store(meta, img)
        stores.append(time.perf_counter() - t0)
        del img
        t0 = time.perf_counter()
        img, _why = cache.load(meta, layout, threads=1)
        cached.append(time.perf_counter() - t0)
        assert img is not None
        del img
        t0 = time.perf_counter()
        img, _why = cache.load(meta, layout, threads=2)
        cached2.append(time.perf_counter() - t0)
        assert img is not None
        del img
        t0 = time.perf_counter()
        d = load_file(meta.weights_path)
        st_load.append(time.perf_counter() - t0)
        del d
        # The library's path to the same rows: load, then Bᵀ of every B (numpy, as bits).
        t0 = time.perf_counter()
        d = load_file(meta.weights_path)
        for k in b_keys:
            np.ascontiguousarray(d[k].view(torch.int16).numpy().T)
        st_t.append(time.perf_counter() - t0)
        del d
        t0 = time.perf_counter()
        writer.write(image, ours_pages)
        hot.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ctypes.memmove(base_dst, image.packed.ctypes.data, used)
        memcpy.append(time.perf_counter() - t0)
    file_bytes = os.path.getsize(meta.weights_path)
    gbps = lambda nbytes, xs: nbytes / statistics.median(xs) / 1e9  # noqa: E731
    vs = lambda base, xs: f"{statistics.median(base) / statistics.median(xs):.2f}"  # noqa: E731
    rows = [
        [
            "cold->warm  first, convert, 1 thread",
            f"{med_ms(cold1):.2f}",
            f"{gbps(weight_bytes, cold1):.2f}",
            vs(st_load, cold1),
        ],
        [
            "cold->warm  first, convert, 2 threads",
            f"{med_ms(cold2):.2f}",
            f"{gbps(weight_bytes, cold2):.2f}",
            vs(st_load, cold2),
        ],
        [
            "cold->warm  cached, read image, 1 thread",
            f"{med_ms(cached):.2f}",
            f"{gbps(weight_bytes, cached):.2f}",
            vs(st_load, cached),
        ],
        [
            "cold->warm  cached, read image, 2 threads",
            f"{med_ms(cached2):.2f}",
            f"{gbps(weight_bytes, cached2):.2f}",
            vs(st_load, cached2),
        ],
        ["  image write (once, after the first)", f"{med_ms(stores):.2f}", f"{gbps(used, stores):.2f}", ""],
        ["  bare safetensors load_file", f"{med_ms(st_load):.2f}", f"{gbps(weight_bytes, st_load):.2f}", "1.00"],
        [
            "  load_file + numpy Bᵀ (same rows)",
            f"{med_ms(st_t):.2f}",
            f"{gbps(weight_bytes, st_t):.2f}",
            vs(st_load, st_t),
        ],
        ["warm->hot   HostPageWriter.write", f"{med_ms(hot):.2f}", f"{gbps(used, hot):.2f}", vs(memcpy, hot)],
        ["  bare memmove, same bytes", f"{med_ms(memcpy):.2f}", f"{gbps(used, memcpy):.2f}", "1.00"],
    ]
    table(
        f"1. load bandwidth: rank 16, hidden 4096, {layers} layers, q/k/v/o, bf16: {weight_bytes / MiB:.1f} MiB of weights "
        f"({file_bytes / MiB:.1f} MiB file) in {n} pages of 2 MiB; median of {runs} interleaved runs",
        ["path", "ms", "GB/s", "vs bare"],
        rows,
        [42, 10, 10, 10],
    )
    print("   (vs bare = bandwidth / the bare baseline's, same run, target >= 0.80. GB/s of cold->warm rows count")
    print("    weight bytes. 'first, convert' = build_warm_image: the first-ever cold->warm load of an adapter, from")
    print("    its safetensors, moving every byte once like load_file and also transposing every B into Bᵀ rows,")
    print("    which load_file does not do. 'cached, read image' = every later cold->warm load with the image cache")
    print("    on (ImageCache.load): a plain read of <state_dir>/images/<id>.img into the warm buffer, as one")
    print("    sequential read or as two halves side by side (the manager uses copy_threads, default 2).")
    print("    'image write' = ImageCache.store (temp file + rename, no fsync), done once in the executor after the")
    print("    first load, off the load's path; GB/s over the image bytes)")
    arena.close()
    reg.close()

    async def end_to_end() -> list[list]:
        out = []
        for int8 in (False, True):
            rig = Rig(
                os.path.join(root, f"state-e2e-{int8}"),
                page,
                2 * n + 16,
                AdapterConfig(dtype="bfloat16", warm_int8=int8),
            )
            rig.registry.register("big", src)
            s = rig.store.open_session()
            to_hot, from_warm = [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                await rig.manager.acquire(s, ["big"])
                to_hot.append(time.perf_counter() - t0)
                rig.manager.release(s, ["big"])
                # The image write the first load starts runs after it, not inside the next timing.
                await rig.manager.wait_image_writes()
                rig.manager.unregister("big")
                rig.registry.register("big", src)
            await rig.manager.prefetch(["big"], "warm")
            for _ in range(runs):
                t0 = time.perf_counter()
                await rig.manager.acquire(s, ["big"])
                from_warm.append(time.perf_counter() - t0)
                rig.manager.release(s, ["big"])
                rig.manager.demote("big")
            warm = rig.manager.stats().as_dict()["warm_bytes"]
            out.append(
                [
                    f"acquire cold->hot{' (int8 warm)' if int8 else ''}",
                    f"{med_ms(to_hot):.2f}",
                    f"{weight_bytes / statistics.median(to_hot) / 1e9:.2f}",
                    "",
                ]
            )
            out.append(
                [
                    f"acquire warm->hot{' (int8 warm)' if int8 else ''}",
                    f"{med_ms(from_warm):.2f}",
                    f"{used / statistics.median(from_warm) / 1e9:.2f}",
                    f"{warm / MiB:.1f}",
                ]
            )
            await rig.close()
        # Cold again after each acquire (no warm tier): every acquire after the first reads the image.
        rig = Rig(
            os.path.join(root, "state-e2e-cached"), page, 2 * n + 16, AdapterConfig(dtype="bfloat16", warm_tier_bytes=0)
        )
        rig.registry.register("big", src)
        s = rig.store.open_session()
        await rig.manager.acquire(s, ["big"])
        rig.manager.release(s, ["big"])
        rig.manager.demote("big")
        await rig.manager.wait_image_writes()
        cached = []
        for _ in range(runs):
            t0 = time.perf_counter()
            await rig.manager.acquire(s, ["big"])
            cached.append(time.perf_counter() - t0)
            rig.manager.release(s, ["big"])
            rig.manager.demote("big")
        assert rig.manager.stats().as_dict()["images"]["hits"] == runs
        out.insert(
            1,
            [
                "acquire cold->hot (cached image)",
                f"{med_ms(cached):.2f}",
                f"{weight_bytes / statistics.median(cached) / 1e9:.2f}",
                "",
            ],
        )
        # The first acquire after RegisterAdapter: the manager converted the adapter ahead of
        # use (in its background thread, timed apart), so even this acquire reads an image.
        first, convert = [], []
        misses = rig.manager.stats().as_dict()["images"]["misses"]
        for _ in range(runs):
            rig.manager.unregister("big")
            t0 = time.perf_counter()
            await rig.manager.register("big", src)
            await rig.manager.wait_conversions()
            convert.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await rig.manager.acquire(s, ["big"])
            first.append(time.perf_counter() - t0)
            rig.manager.release(s, ["big"])
            rig.manager.demote("big")
        im = rig.manager.stats().as_dict()["images"]
        assert im["converted_ahead"] == runs and im["misses"] == misses, im
        out.insert(
            2,
            [
                "acquire cold->hot, first after register",
                f"{med_ms(first):.2f}",
                f"{weight_bytes / statistics.median(first) / 1e9:.2f}",
                "",
            ],
        )
        out.insert(
            3,
            [
                "  register + convert ahead (background)",
                f"{med_ms(convert):.2f}",
                f"{weight_bytes / statistics.median(convert) / 1e9:.2f}",
                "",
            ],
        )
        await rig.close()
        return out

    table(
        "   end to end through AdapterManager.acquire (executor + event loop)",
        ["path", "ms", "GB/s", "warm MiB"],
        asyncio.run(end_to_end()),
        [42, 10, 10, 10],
    )
    print("   ('acquire cold->hot' registers behind the manager's back, so the acquire converts the file itself;")
    print("    'first after register' registers through the manager, which converts the adapter into its image")
    print("    in a background thread (convert_ahead, on by default), so the first acquire reads the image.")
    print("    'register + convert ahead' = validation + conversion + image write, off any acquire's path)")


# ------------------------------------------------------------------ hit rates


async def replay(rig: Rig, trace: list[str]) -> dict:
    s = rig.store.open_session()
    acquire, release = rig.manager.acquire, rig.manager.release
    for aid in trace:
        await acquire(s, [aid])
        release(s, [aid])
    return rig.manager.stats().as_dict()


def bench_slots(root: str, src: str, requests: int) -> None:
    ids = [f"tenant-{i:02d}" for i in range(16)]
    rows = []
    for reading, pick in (
        ("20% over all 16", lambda r: r.choice(ids[:3]) if r.random() < 0.8 else r.choice(ids)),
        ("20% over the other 13", lambda r: r.choice(ids[:3]) if r.random() < 0.8 else r.choice(ids[3:])),
    ):
        rng = random.Random(0)
        trace = [pick(rng) for _ in range(requests)]
        for policy in POLICIES:
            cfg = AdapterConfig(dtype="bfloat16", hot_tier_adapters=4, hot_policy=policy, warm_policy=policy)
            rig = Rig(os.path.join(root, f"state-slots-{policy}-{len(rows)}"), 64 * 1024, 256, cfg)
            meta = rig.registry.inspect(src)
            rig.registry.add_many([(aid, meta) for aid in ids])

            async def go(rig=rig, trace=trace):
                st = await replay(rig, trace)
                await rig.close()
                return st

            st = asyncio.run(go())
            target = "" if policy != "lru" or "13" in reading else ("MET" if st["hit_rate"] > 0.75 else "NOT MET")
            rows.append([reading, policy, f"{st['hit_rate']:.3f}", st["loads"]["hot"], st["loads"]["warm"], target])
    table(
        f"2. adapter slots (lab seed): 16 adapters, 4 hot slots, {requests} requests, 80% to the hottest 20% (3)",
        ["remaining 20% drawn", "policy", "hot hit", "hot loads", "warm loads", "LRU > 0.75"],
        rows,
        [26, 8, 10, 11, 11, 12],
    )
    print("   (the lab's target reads the 80/20 split as 80% to the hot 3 plus 20% uniform over all 16;")
    print(
        "    with the 20% over the other 13 only, LRU with 4 slots tops out near 0.71, as a plain LRU simulation gives)"
    )


def bench_zipf(root: str, srcs: dict[int, str], adapters: int, requests: int, s: float) -> None:
    rng = np.random.default_rng(0)
    ids = [f"t{i:04d}" for i in range(adapters)]
    popularity = rng.permutation(adapters)  # popularity rank -> adapter (independent of size)
    weights = 1.0 / np.arange(1, adapters + 1) ** s
    trace = [ids[popularity[k]] for k in rng.choice(adapters, size=requests, p=weights / weights.sum())]
    ranks = [4, 8, 16]
    probe = AdapterRegistry(os.path.join(root, "state-zipf-probe"))
    metas = {r: probe.inspect(srcs[r]) for r in ranks}
    page = 64 * 1024
    sizes = {r: plan_layout(metas[r].weights, page, "bfloat16").num_pages for r in ranks}
    image = {r: plan_layout(metas[r].weights, page, "bfloat16").used_bytes for r in ranks}
    probe.close()
    avg_pages = sum(sizes.values()) / 3
    hot_pages = int(avg_pages * adapters * 0.05)
    warm_bytes = int(sum(image.values()) / 3 * adapters * 0.20)
    rows = []
    for policy in POLICIES:
        cfg = AdapterConfig(
            dtype="bfloat16",
            hot_tier_pages=hot_pages,
            warm_tier_bytes=warm_bytes,
            hot_policy=policy,
            warm_policy=policy,
        )
        rig = Rig(os.path.join(root, f"state-zipf-{policy}"), page, hot_pages + 64, cfg, pages_per_slab=64)
        rig.registry.add_many([(aid, metas[ranks[i % 3]]) for i, aid in enumerate(ids)])

        async def go(rig=rig):
            st = await replay(rig, trace)
            await rig.close()
            return st

        t0 = time.perf_counter()
        st = asyncio.run(go())
        dt = time.perf_counter() - t0
        served_warm = st["hits"]["warm"] / max(1, st["misses"]["hot"])
        rows.append(
            [
                policy,
                f"{st['hit_rate']:.3f}",
                f"{served_warm:.3f}",
                st["loads"]["warm"],
                st["loads"]["hot"],
                f"{st['bytes_loaded']['hot'] / MiB:.0f}",
                f"{dt:.1f}",
            ]
        )
    table(
        f"3. Zipf(s={s}) over {adapters} adapters (ranks 4/8/16 mixed: {sizes[4]}/{sizes[8]}/{sizes[16]} pages of 64 KiB), "
        f"{requests} requests; hot budget {hot_pages} pages (~5% of adapters), warm budget {warm_bytes / MiB:.0f} MiB (~20%)",
        ["policy", "hot hit", "warm|miss", "cold loads", "hot loads", "MiB to hot", "seconds"],
        rows,
        [10, 10, 11, 12, 11, 12, 10],
    )
    print("   (warm|miss = share of hot misses served from the warm tier; cold loads = file reads)")


def bench_registry(root: str, src: str, count: int) -> None:
    reg = AdapterRegistry(os.path.join(root, "state-registry"))
    t0 = time.perf_counter()
    for i in range(count):
        reg.register(f"tenant-{i:05d}", src)
    t_reg = time.perf_counter() - t0
    t0 = time.perf_counter()
    n, token = 0, ""
    while True:
        page = reg.list(limit=1000, page_token=token)
        n += len(page.adapters)
        token = page.next_page_token
        if not token:
            break
    t_list = time.perf_counter() - t0
    t0 = time.perf_counter()
    prefixed = reg.list(prefix="tenant-0123", limit=100)
    t_prefix = time.perf_counter() - t0
    reg.close()
    t0 = time.perf_counter()
    reopened = AdapterRegistry(os.path.join(root, "state-registry"))
    total = len(reopened)
    t_open = time.perf_counter() - t0
    reopened.close()
    table(
        f"4. registry: {count} adapters (one validated PEFT directory under {count} ids), SQLite WAL",
        ["operation", "seconds"],
        [
            [f"register {count}", f"{t_reg:.2f}"],
            [f"list all {n} (pages of 1000)", f"{t_list:.3f}"],
            [f"list prefix ({len(prefixed.adapters)} found)", f"{t_prefix:.4f}"],
            [f"reopen + count ({total})", f"{t_open:.3f}"],
        ],
        [40, 10],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15, help="timed runs per bandwidth figure")
    ap.add_argument("--quick", action="store_true", help="smaller adapter and traces (a smoke run)")
    a = ap.parse_args()
    print(
        f"adapter tiers benchmark (python {sys.version.split()[0]}, numpy {np.__version__}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs)"
    )
    with tempfile.TemporaryDirectory(prefix="bench-adapters-") as root:
        bench_bandwidth(root, a.runs, a.quick)
        small = {
            r: write_peft_dir(os.path.join(root, f"small-r{r}"), rank=r, hidden=1024, kv=256, layers=4, seed=r)
            for r in (4, 8, 16)
        }
        bench_slots(root, small[8], 1000 if a.quick else 5000)
        bench_zipf(root, small, 1000, 3000 if a.quick else 20000, 1.0)
        bench_registry(root, small[8], 1000 if a.quick else 10_000)


if __name__ == "__main__":
    main()
