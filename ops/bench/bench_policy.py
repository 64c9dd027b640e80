"""Adapter tier policies against Belady on fixed-seed traces: the hit-rate table.

Each policy orders victims for a tier of K equal-size slots (``broker.adapters.policy``);
the simulator loads every requested adapter that is not resident (an acquire needs it hot)
and demotes the policy's first victim when the tier is full. Belady (evict the adapter whose
next use is furthest; equal sizes, no bypass) is computed on the same trace.

Traces (generated here, fixed seeds): ``lab`` (the lab seed: 16 adapters, 4 slots, 80% of
requests to 3), ``zipf`` (Zipf s=1.0 over 1,000 adapters), ``shift`` (the same Zipf with
popularity re-drawn every 10,000 requests).

    python ops/bench/bench_policy.py [--quick] [--requests N]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import math
import random
import time

from memory_broker.broker.adapters.policy import DEFAULT_POLICY, POLICIES

TARGETS = {"lab": 0.98, "zipf": 0.90, "shift": 0.85}  # default policy's share of Belady


def lab_trace(n: int, seed: int = 1) -> list[int]:
    r = random.Random(seed)
    return [r.choice((0, 1, 2)) if r.random() < 0.8 else r.randrange(3, 16) for _ in range(n)]


def zipf_trace(n: int, adapters: int = 1000, s: float = 1.0, shift_every: int = 0, seed: int = 2) -> list[int]:
    r = random.Random(seed)
    cum = list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(adapters)))
    rank_to_id = list(range(adapters))
    r.shuffle(rank_to_id)
    out = []
    for i in range(n):
        if shift_every and i and i % shift_every == 0:
            r.shuffle(rank_to_id)
        out.append(rank_to_id[bisect.bisect_left(cum, r.random() * cum[-1])])
    return out


def belady(trace: list[int], slots: int) -> float:
    next_use = [0.0] * len(trace)
    seen: dict[int, float] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = seen.get(trace[i], math.inf)
        seen[trace[i]] = i
    held: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    hits = 0
    for i, x in enumerate(trace):
        if x in held:
            hits += 1
        elif len(held) >= slots:
            while True:
                neg, y = heapq.heappop(heap)
                if held.get(y) == -neg:
                    break
            del held[y]
        held[x] = next_use[i]
        heapq.heappush(heap, (-next_use[i], x))
    return hits / len(trace)


def simulate(policy_name: str, trace: list[int], slots: int) -> float:
    policy = POLICIES[policy_name]()
    hits = 0
    for x in trace:
        k = str(x)
        if k in policy:
            hits += 1
        else:
            if len(policy) >= slots:
                policy.remove(next(iter(policy.victims())))
            policy.insert(k, 1)
        policy.access(k)
    return hits / len(trace)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--quick", action="store_true", help="short traces (a smoke run)")
    a.add_argument("--requests", type=int, default=0, help="requests per Zipf trace (default 100,000; quick 12,000)")
    args = a.parse_args()
    hit_rate_table(args.quick, args.requests)


def hit_rate_table(quick: bool, requests: int = 0) -> None:
    """Print each policy's hit rate next to Belady's on the three traces (bench_scale uses it)."""
    n = requests or (12_000 if quick else 100_000)
    shift = 3_000 if quick else 10_000
    cases = [
        ("lab", lab_trace(n // 5), [4]),
        ("zipf", zipf_trace(n), [50, 100, 200] if not quick else [50]),
        ("shift", zipf_trace(n, shift_every=shift), [50, 100, 200] if not quick else [50]),
    ]
    names = list(POLICIES)
    print(
        f"Hit rate per policy and its share of Belady (default: {DEFAULT_POLICY}); "
        f"lab {n // 5} requests, Zipf {n} requests over 1,000 adapters, shift every {shift}"
    )
    print("| trace | slots | Belady | " + " | ".join(names) + f" | {DEFAULT_POLICY} / Belady | target |")
    print("|---|---|---|" + "---|" * len(names) + "---|---|")
    t0 = time.perf_counter()
    for trace_name, trace, slot_list in cases:
        for slots in slot_list:
            best = belady(trace, slots)
            rates = {p: simulate(p, trace, slots) for p in names}
            ratio = rates[DEFAULT_POLICY] / best
            target = TARGETS[trace_name]
            cells = " | ".join(f"{rates[p]:.3f} ({rates[p] / best:.2f})" for p in names)
            print(
                f"| {trace_name} | {slots} | {best:.3f} | {cells} | {ratio:.3f} | "
                f"≥ {target}: {'MET' if ratio >= target else 'NOT MET'} |",
                flush=True,
            )
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
