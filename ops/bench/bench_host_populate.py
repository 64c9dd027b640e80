"""What a first touch of a host arena page costs a client, and what populating saves.

A "client" maps a fresh memfd slab (as ``HostArenaView.attach_slab`` does) and writes it
through with ``memmove`` (as a KV save does), in five setups, each on a new slab:

* ``fresh``: nothing populated (the old broker): the write allocates, zeroes and maps each page;
* ``fallocate``: the memfd fallocated (for reference: shmem defers zeroing to first touch);
* ``populated``: the broker populated the slab when it grew (``HostArena``:
  MADV_POPULATE_WRITE on its own mapping): the client's write pays page-table faults only;
* ``populated + MAP_POPULATE``: and the client's mmap populates its page tables;
* ``populated + MADV_POPULATE_WRITE``: and the client populates them after mapping.

It reports the median over ``--repeats`` of the write's ms per MiB, the populate step's own
ms per MiB, and their sum (what a client pays once per slab), to decide whether clients
should populate their own page tables too.

    .venv/bin/python ops/bench/bench_host_populate.py [--mib 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import statistics
import time
from datetime import UTC, datetime

from memory_broker.proto.wire.mapping.host import (
    MAP_SHARED,
    PROT_READ,
    PROT_WRITE,
    _mmap,
    _munmap,
    madvise_populate_write,
)

MAP_POPULATE = 0x8000


def one(size: int, src: ctypes.Array, mode: str) -> tuple[float, float]:
    """(populate s, write s) of one setup on a new memfd of ``size`` bytes."""
    fd = os.memfd_create("bench-populate", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        if mode == "fallocate":
            os.posix_fallocate(fd, 0, size)
        elif mode != "fresh":  # the broker's populate: MADV_POPULATE_WRITE on its own mapping
            broker = _mmap(None, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            madvise_populate_write(broker, size)
            _munmap(broker, size)
        t0 = time.perf_counter()
        flags = MAP_SHARED | (MAP_POPULATE if mode == "map_populate" else 0)
        addr = _mmap(None, size, PROT_READ | PROT_WRITE, flags, fd, 0)
        if mode == "madv_populate":
            madvise_populate_write(addr, size)
        t1 = time.perf_counter()
        ctypes.memmove(addr, src, size)
        t2 = time.perf_counter()
        _munmap(addr, size)
        return t1 - t0, t2 - t1
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="slab size in MiB (default 64, the broker's default slab)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    size = args.mib << 20
    src = (ctypes.c_uint8 * size).from_buffer(bytearray(os.urandom(1 << 20) * args.mib))
    modes = {
        "fresh": "fresh (nothing populated)",
        "fallocate": "broker fallocate (not used: shmem zeroes on first touch)",
        "populated": "broker populated (HostArena: MADV_POPULATE_WRITE)",
        "map_populate": "broker populated + client MAP_POPULATE",
        "madv_populate": "broker populated + client MADV_POPULATE_WRITE",
    }
    res: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:  # interleaved, so load drifts hit every setup alike
            res[m].append(one(size, src, m))
    print(f"# host first-touch cost, {args.mib} MiB slab, median of {args.repeats}")
    print(
        f"date: {datetime.now(UTC).isoformat(timespec='seconds')}, machine: {platform.node()}, "
        f"{os.cpu_count()} CPUs, kernel {platform.release()}, OS page {mmap.PAGESIZE} B"
    )
    print()
    print("| setup | client populate ms/MiB | write ms/MiB | total ms/MiB | write vs fresh |")
    print("|---|---:|---:|---:|---:|")
    fresh_w = statistics.median(w for _, w in res["fresh"])
    for m, label in modes.items():
        p = statistics.median(p for p, _ in res[m]) * 1e3 / args.mib
        w = statistics.median(w for _, w in res[m])
        tot = statistics.median(p + w for p, w in res[m]) * 1e3 / args.mib
        print(f"| {label} | {p:.3f} | {w * 1e3 / args.mib:.3f} | {tot:.3f} | {w / fresh_w:.2f}x |")


if __name__ == "__main__":
    main()
