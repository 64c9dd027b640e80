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

# broker-sync: the broker's connector with each step waiting for its stores (store_in_step),
# as it did before the stores moved off the request's path; lmcache: LMCache's own connector
# and multiprocess server (the peer); noop-defer: a connector doing nothing but answering each
# request's first ask "not yet", as LMCache's does (ops/bench/noop_kv_connector.py).
BROKER_MODES = ("broker", "broker-sync")
BASE_MODES = ("none", "file", "noop", "noop-defer", *BROKER_MODES, "lmcache")


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


def pss_bytes(pids: list[int]) -> int:
    """Proportional set size of the processes (pages shared between them, such as the broker's
    arena mapped by its engines, counted once in all)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


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


def report(a, rows: list[dict], same: bool, wall_s: float, ledger=None, results=None, extra=()) -> str:
    modes = [r["mode"] for r in rows]
    setup = "vLLM's own CPU setup" if a.vllm_defaults else (
        f"every engine alike: OpenMP on CPUs {engine_env(a)['VLLM_CPU_OMP_THREADS_BIND']}, idle OpenMP threads "
        f"sleeping at once, vLLM's queues spinning {a.queue_spin_s:g} s after a message")  # fmt: skip
    lines = [
        f"### vLLM shared-prefix workload, modes interleaved ({time.strftime('%Y-%m-%d')}, "
        f"{platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, vLLM CPU backend)",
        "",
        f"{a.groups} groups of a {a.prefix}-token system prompt: per group 1 miss (engine 1), 1 cross-engine request "
        f"(engine 2) and {a.hits} local prefix-cache hits (alternating engines), {a.tail}-token tails; each request "
        f"sent to every mode ({', '.join(modes)}) in a {a.order} order"
        + (f", {a.settle_s:g} s apart" if getattr(a, "settle_s", 0) else "")
        + f", after {a.warmup_groups} untimed warm-up group(s); {setup}; model tiny_model.SMALL float32; {wall_s:.0f} s of requests, load average "
        f"{os.getloadavg()[0]:.1f} at the end. Greedy first tokens identical across modes, request by request: {same}."
        + (f" **Stopped early**: {a.stopped_early}." if getattr(a, "stopped_early", "") else "")
        + (
            f" The engines of {a.peer_env_modes} ran from LMCache's environment, as lmcache's do."
            if getattr(a, "peer_env_modes", "")
            else ""
        ),
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
    lines += list(extra)
    if results is not None:
        lines += paired_lines(results)
    lines += target_lines(rows)
    return "\n".join(lines) + "\n"


def target_lines(rows: list[dict]) -> list[str]:
    """Issue 49's targets, each met or not, and whether its ratio lies inside the A/A
    control's spread at the same statistic (|ratio - 1| within |none2 / none - 1|)."""
    by = {r["mode"]: r for r in rows}
    if "broker" not in by or "none" not in by:
        return []

    def ratio(m: str, p: str, kind: str, q: str) -> float | None:
        a, b = by.get(m, {}).get(kind), by.get(p, {}).get(kind)
        return a[q] / b[q] if a and b else None

    checks = []
    for kind in ("miss", "local"):
        for q in ("median_ms", "p90_ms"):
            checks.append((f"broker / none, {kind} {q[:-3]}", ratio("broker", "none", kind, q), "<=", 1.05, kind, q))
    for q in ("median_ms", "p90_ms"):
        r = ratio("broker", "none", "cross", q)
        checks.append((f"none / broker, cross {q[:-3]}", 1 / r if r else None, ">=", 3.0, None, q))
    if "lmcache" in by:
        for kind in KINDS:
            for q in ("median_ms", "p90_ms"):
                checks.append((f"broker / lmcache, {kind} {q[:-3]}", ratio("broker", "lmcache", kind, q), "<=", 1.0, kind, q))  # fmt: skip
    lines = ["", "Targets (issue 49):", ""]
    for name, v, op, limit, kind, q in checks:
        if v is None:
            continue
        met = v <= limit if op == "<=" else v >= limit
        aa = ratio("none2", "none", kind, q) if kind else None
        spread = (
            f"; the A/A control is {aa:.3f}" + (", inside its spread" if abs(v - 1) <= abs(aa - 1) else "")
            if aa
            else ""
        )
        lines.append(f"* {name}: {v:.3f} (target {op} {limit:g}): {'met' if met else 'NOT met'}{spread}")
    return lines


PHASES = ("front end to engine core", "queued", "the step", "back to the front end")


def phase_lines(results: dict[str, list[dict]]) -> list[str]:
    """Where each mode's time goes (``--phases``), per kind: the median of each phase of a
    request's time (vLLM's own timestamps), in ms; nothing when no request has them."""
    lines = ["", "Where the time goes (`--phases`: medians, ms; vLLM's timestamps):", "",
             "| mode | kind | n | " + " | ".join(PHASES) + " | whole |", "|---|---|---:|" + "---:|" * (len(PHASES) + 1)]  # fmt: skip
    for m, rs in results.items():
        for kind in KINDS:
            got = [r for r in rs if r["kind"] == kind and r.get("phases_s")]
            if not got:
                continue
            cells = [f"{1000 * _median([r['phases_s'][i] for r in got]):.1f}" for i in range(len(PHASES))]
            cells.append(f"{1000 * _median([r['ttft_s'] for r in got]):.1f}")
            lines.append(f"| {m} | {kind} | {len(got)} | " + " | ".join(cells) + " |")
    return lines if len(lines) > 5 else []


# ------------------------------------------------------------- paired ratios


def bootstrap(pairs: list[tuple[float, float]], stat, n: int = 2000, seed: int = 7) -> tuple[float, float, float]:
    """``stat(pairs)`` and its 95% interval, resampling the pairs (requests) with replacement."""
    rng = random.Random(seed)
    got = sorted(stat([pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(n))
    return stat(pairs), got[int(0.025 * (n - 1))], got[int(0.975 * (n - 1))]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def paired(results: dict[str, list[dict]], mode: str, peer: str, kind: str) -> dict | None:
    """Request by request (each request ran in every mode), ``mode`` against ``peer``: the
    median of the per-request ratios, and the ratios of the medians and of the p90s, each with
    its bootstrap interval; None when either mode lacks the kind."""
    pairs = [
        (a["ttft_s"], b["ttft_s"]) for a, b in zip(results.get(mode, []), results.get(peer, [])) if a["kind"] == kind
    ]
    if not pairs:
        return None
    return {
        "n": len(pairs),
        "per_request": bootstrap(pairs, lambda ps: _median([x / y for x, y in ps])),
        "median": bootstrap(pairs, lambda ps: _median([x for x, _ in ps]) / _median([y for _, y in ps])),
        "p90": bootstrap(pairs, lambda ps: _p90([x for x, _ in ps]) / _p90([y for _, y in ps])),
    }


PAIRS = (("none2", "none"), ("broker", "none"), ("lmcache", "none"), ("broker-sync", "none"), ("noop-defer", "none"),
         ("broker", "lmcache"), ("broker", "broker-sync"), ("lmcache", "noop-defer"))  # fmt: skip


def _ci(t: tuple[float, float, float]) -> str:
    return f"{t[0]:.3f} [{t[1]:.2f}-{t[2]:.2f}]"


def paired_lines(results: dict[str, list[dict]]) -> list[str]:
    """The paired table (see ``paired``) for every pair of ``PAIRS`` that ran, and where the A/A
    control ran, whether each ratio lies inside its spread (|ratio - 1| within the A/A's)."""
    lines = ["", "Paired, request by request (95% bootstrap intervals over requests):", "",
             "| mode / peer | kind | n | median of per-request ratios | ratio of medians | ratio of p90s |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    ran = [(m, p) for m, p in PAIRS if results.get(m) and results.get(p)]
    aa = {k: paired(results, "none2", "none", k) for k in KINDS} if ("none2", "none") in ran else {}
    for m, p in ran:
        for kind in KINDS:
            r = paired(results, m, p, kind)
            if r is None:
                continue
            cells = []
            for q in ("per_request", "median", "p90"):
                cell = _ci(r[q])
                if aa.get(kind) and (m, p) != ("none2", "none") and abs(r[q][0] - 1) <= abs(aa[kind][q][0] - 1):
                    cell += " (inside A/A)"
                cells.append(cell)
            lines.append(f"| {m} / {p} | {kind} | {r['n']} | " + " | ".join(cells) + " |")
    return lines if ran else []
