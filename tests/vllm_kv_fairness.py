"""What makes ops/bench/bench_vllm_kv.py's comparison fair, and its report: every engine's CPU
setup alike, the modes' names and their order per request, the CPU of an engine's whole process
tree, each mode's ratios to ``none`` with the A/A control's verdict.

It lives in tests/ so that tests/test_benchmarks.py checks it without importing a benchmark;
the benchmark imports it from here (it puts tests/ on sys.path). Standard library only: the
benchmark runs under the vLLM environment's Python.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

BASE_MODES = ("none", "file", "noop", "broker")


SPIN_ENV = "MB_BENCH_VLLM_SPIN_S"


def base_mode(name: str) -> str:
    """``none2`` is ``none`` again on its own two engines (the A/A control); any base mode may
    be repeated so, with a number after it."""
    base = name.rstrip("0123456789")
    if base not in BASE_MODES:
        raise SystemExit(f"unknown mode {name!r}: one of {', '.join(BASE_MODES)}, optionally numbered (none2)")
    return base


def engine_env(a: argparse.Namespace) -> dict[str, str]:
    """The same CPU setup for every engine of every mode (``--vllm-defaults``: vLLM's own).

    * vLLM 0.32's CPU backend binds an engine's OpenMP threads to all CPUs less one it keeps
      for the engine core, and one more when a KV connector is configured; on 2 CPUs an engine
      without a connector gets 1 thread on CPU 0, one with a connector 2 threads on both. Here
      every engine gets the same ``--omp-cpus``.
    * Idle OpenMP threads sleep at once (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning.
    * vLLM's engine-core/worker queues spin ``--queue-spin-s`` (0.05 s) after a message, not
      1 s, before they sleep (``vllm_engine_site/sitecustomize.py``). Not 0: a reader that
      sleeps between the messages of one step misses notifications and waits vLLM's 5 s
      recheck (measured: 5.5 s stalls at 0, none at 0.05 s).
    """
    if a.vllm_defaults:
        return {}
    cpus = a.omp_cpus or f"0-{(os.cpu_count() or 1) - 1}"
    return {"VLLM_CPU_OMP_THREADS_BIND": cpus, "OMP_WAIT_POLICY": "PASSIVE", SPIN_ENV: str(a.queue_spin_s)}


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds used) of a live process, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (an engine: its front end, engine core and worker)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            parents[int(d)] = st[0]
    tree, grew = {root}, True
    while grew:
        new = {p for p, pp in parents.items() if pp in tree and p not in tree}
        tree |= new
        grew = bool(new)
    return sorted(tree)


def cpu_seconds(pids: list[int]) -> float:
    return sum(st[1] for p in pids if (st := _stat(p)) is not None)


KINDS = ("local", "cross", "miss")


def mode_orders(modes: list[str], n: int, order: str, seed: int = 1) -> list[list[str]]:
    """The order the modes get request ``i`` in: ``rotate`` (each request starts one mode later)
    or ``random`` (a new shuffle per request, seeded), so no mode always follows the same one."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if order == "rotate":
            out.append(modes[i % len(modes) :] + modes[: i % len(modes)])
        else:
            out.append(rng.sample(modes, len(modes)))
    return out


def ratio_lines(rows: list[dict]) -> list[str]:
    """Every mode's median and p90 over ``none``'s, per kind; the A/A verdict when a second
    ``none`` ran (the benchmark is fair when it is 1.00 within 5%, local median and p90)."""
    by = {r["mode"]: r for r in rows}
    if "none" not in by:
        return []
    n = by["none"]
    lines = ["", "| mode / none | local median | local p90 | cross median | cross p90 | miss median | miss p90 |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if r["mode"] == "none":
            continue
        cells = []
        for kind in KINDS:
            for q in ("median_ms", "p90_ms"):
                cells.append(f"{r[kind][q] / n[kind][q]:.3f}" if r[kind] and n[kind] else "-")
        lines.append(f"| {r['mode']} | " + " | ".join(cells) + " |")
    controls = [r for r in rows if r["mode"] != "none" and base_mode(r["mode"]) == "none"]
    for c in controls:
        med, hi = (c["local"][q] / n["local"][q] for q in ("median_ms", "p90_ms"))
        fair = abs(med - 1) <= 0.05 and abs(hi - 1) <= 0.05
        lines += ["", f"A/A control ({c['mode']}, no connector on its own engines) / none, local hits: median "
                  f"{med:.3f}, p90 {hi:.3f}: {'fair' if fair else 'NOT FAIR'} (fair when both are within 5% of 1)."]  # fmt: skip
    if not controls:
        lines += ["", "No A/A control ran (add none2 to --modes): the ratios above cannot be told from unfairness."]
    return lines


def cpu_lines(ledger, results: dict[str, list[dict]]) -> list[str]:
    """The CPU table of a run's ``CpuLedger`` (ops/bench/bench_vllm_kv.py): per mode, serving and idle."""
    lines = ["", "| mode | CPU per request served (ms) | CPU of its idle engines while other modes serve (% of a CPU) |",
             "|---|---:|---:|"]  # fmt: skip
    for m in ledger.engines:
        share = 100 * ledger.idle[m] / ledger.idle_wall[m] if ledger.idle_wall[m] else 0.0
        lines.append(f"| {m} | {1000 * ledger.busy[m] / max(1, len(results[m])):.0f} | {share:.1f} |")
    return lines


def report(a, rows: list[dict], same: bool, wall_s: float, ledger=None, results=None) -> str:
    modes = [r["mode"] for r in rows]
    setup = "vLLM's own CPU setup" if a.vllm_defaults else (
        f"every engine alike: OpenMP on CPUs {engine_env(a)['VLLM_CPU_OMP_THREADS_BIND']}, idle OpenMP threads "
        f"sleeping at once, vLLM's queues spinning {a.queue_spin_s:g} s after a message")  # fmt: skip
    lines = [
        f"### vLLM shared-prefix workload, modes interleaved ({time.strftime('%Y-%m-%d')}, "
        f"{platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, vLLM CPU backend)",
        "",
        f"{a.groups} groups of a {a.prefix}-token system prompt: per group 1 miss (engine 1), 1 cross-engine request "
        f"(engine 2) and {a.hits} local prefix-cache hits (alternating engines), {a.tail}-token tails; each request "
        f"sent to every mode ({', '.join(modes)}) in a {a.order} order, after {a.warmup_groups} untimed warm-up "
        f"group(s); {setup}; model tiny_model.SMALL float32; {wall_s:.0f} s of requests, load average "
        f"{os.getloadavg()[0]:.1f} at the end. Greedy first tokens identical across modes, request by request: {same}."
        + (f" **Stopped early**: {a.stopped_early}." if getattr(a, "stopped_early", "") else ""),
        "",
        "| mode | local hits n | local median (ms) | local p90 (ms) | cross-engine n | cross median (ms) | cross p90 (ms) "
        "| misses n | miss median (ms) | miss p90 (ms) | prefill tokens computed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [r["mode"]]
        for kind in KINDS:
            k = r[kind]
            cells += [str(k["n"]), f"{k['median_ms']:.0f}", f"{k['p90_ms']:.0f}"] if k else ["0", "-", "-"]
        cells.append(str(r["prefill_computed"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ratio_lines(rows)
    if ledger is not None:
        lines += cpu_lines(ledger, results)
    by = {r["mode"]: r for r in rows}
    if "broker" in by and "none" in by:
        b, n = by["broker"], by["none"]
        lines += [
            "",
            f"Targets: local hits, broker / none: median {b['local']['median_ms'] / n['local']['median_ms']:.3f}, "
            f"p90 {b['local']['p90_ms'] / n['local']['p90_ms']:.3f} (target <= 1.05); cross-engine, none / broker: "
            f"median {n['cross']['median_ms'] / b['cross']['median_ms']:.2f}x, p90 "
            f"{n['cross']['p90_ms'] / b['cross']['p90_ms']:.2f}x (target >= 3x).",
        ]
    return "\n".join(lines) + "\n"
