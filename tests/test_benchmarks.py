"""The CPU benchmark scripts still run (a smoke run each, small sizes; no timing is asserted).

Their figures are read by people (ops/bench/results/); a script broken by a change to the
code it drives would otherwise go unnoticed until the next person tries to measure.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import pytest
import vllm_kv_fairness as kv
from conftest import short_tmpdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A smoke run takes up to about a minute on a loaded 2-core machine (bench_step's quick run:
# 62 s in CI). The test's bound is the script's own (300 s, below), not pytest's default 120 s,
# which a slower machine would reach first.
pytestmark = pytest.mark.timeout(360)


def bench(script: str, *args: str, env: dict | None = None) -> str:
    """Run one benchmark script; it and every process it started (brokers of up to 8 GiB of
    pool) are killed if it runs past 300 s or the test is interrupted, so none outlives it."""
    p = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "ops", "bench", script), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=300)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the script's own group: what it left running
        except ProcessLookupError:
            pass
        p.wait()
    assert p.returncode == 0, out[-2000:] + err[-4000:]
    return out


def test_bench_adapters_quick_run_prints_every_table():
    out = bench("bench_adapters.py", "--quick", "--runs", "3")
    for title in (
        "1. load bandwidth",
        "end to end through AdapterManager.acquire",
        "2. adapter slots",
        "3. Zipf",
        "4. registry",
    ):
        assert title in out, out
    assert "acquire cold->hot, first after register" in out and "cold->warm  cached, read image" in out


def test_bench_adapter_dtypes_quick_run_prints_both_ways_and_the_memory():
    out = bench("bench_adapter_dtypes.py", "--quick", "--runs", "2")
    for row in ("copy kept hot: hit", "conversion at acquire", "cold (its image)", "hot memory per copy"):
        assert row in out, out


def test_bench_rpc_small_run_prints_the_target_line():
    out = bench("bench_rpc.py", "--n", "30")
    assert "target: every broker RPC within 1.3x of echo" in out and "GetStats" in out


@pytest.mark.parametrize("args", [("--chunks", "5"), ("--chunks", "5", "--tenant")])
def test_bench_core_small_run_prints_the_steady_state_target(args):
    out = bench("bench_core.py", *args)
    assert "allocate+free, 1 page" in out and "target:" in out
    assert ("a tenant pool's session" in out) == ("--tenant" in args)


def test_bench_policy_quick_run_prints_every_trace_next_to_belady():
    out = bench("bench_policy.py", "--quick")
    for trace in ("| lab |", "| zipf |", "| shift |"):
        assert trace in out, out
    assert "Belady" in out and "adaptive / Belady" in out


def test_bench_scale_quick_run_prints_every_operation_and_the_adapter_rows():
    out = bench("bench_scale.py", "--quick")
    for op in (
        "stats read",
        "contiguous place + release",
        "allocation crossing the high watermark",
        "allocation just before it (same batch, below)",
        "session end: longest single stall",
        "allocate + free under full turnover",
        "Echo RPC while a session owning N objects ends",
        "ListAdapters page (50) + total",
        "Echo RPC while conversions drain",
        "largest / smallest median",
        "memory per object",
        "Belady",
    ):
        assert op in out, out


def test_bench_rpc_overhead_small_run_prints_the_fixed_cost():
    out = bench("bench_rpc_overhead.py", "--chunks", "3", "--per-chunk", "200")
    assert "fixed cost per call" in out and "core pin + unpin" in out and "not the response message" in out


def test_bench_step_quick_run_prints_every_path_and_both_targets():
    out = bench("bench_step.py", "--quick", "--steps", "60")
    for row in (
        "raw Unix-socket ping-pong",
        "step channel PING",
        "gRPC Echo",
        "gRPC, 4 calls (old path)",
        "step channel, client.step()",
        "step channel, step_begin (pipelined)",
        "step channel, StepBatch.update()",
        "step channel, StepBatch begin+result (overlap)",
    ):
        assert row in out, out
    assert "target steady:" in out and "target trace, blocking" in out and "target trace, overlapped" in out
    assert "target issue 28, step channel, client.step(), steady" in out and "CPU us" in out
    # The asyncio loop's own floor is measured in the same run, and each target line gives its floors.
    assert "raw ping-pong to a bare asyncio loop" in out
    assert "(floors, the 4 round trips it waits for: 4 x the bare asyncio loop" in out and "4 x PING" in out
    # The generic calls' row waits for each of its four frames.
    assert "target issue 28, step channel, same 4 calls, steady" in out
    # The background worker's target, and beside it what this machine charges before any Python,
    # with a worker and with none.
    assert "target issue 28, background batch" in out and "the floor on this machine, no Python" in out
    assert "with no worker, a raw send before the model's wait and the receive after it" in out


def test_bench_cuda_arena_small_run_prints_every_table_beside_the_host_arena():
    out = bench("bench_cuda_arena.py", "--scales", "64,128", "--reps", "10", "--latency-pages", "64")
    assert "### Attach: connect() to a first allocation, and mapping every page" in out
    assert "### Allocate + free" in out and "| host | warm | 16 contiguous |" in out
    assert "| host | 128 |" in out and "open fds of this process (broker and client) at the end:" in out
    # Without a GPU the CUDA columns say why; with one they are measured beside the host's.
    assert "CUDA: not measured (" in out or ("| cuda | warm | 16 contiguous |" in out and "### Copy of" in out)


def test_bench_block_mover_quick_run_prints_every_layout_both_ways():
    out = bench("bench_block_mover.py", "--quick")
    assert "device copy of" in out
    for layout in ("flash_attn", "flashinfer_nhd", "flashinfer_hnd"):
        assert f"| {layout} | torch | pages -> KV |" in out and f"| {layout} | torch | KV -> pages |" in out
    assert "| 2 |" in out  # the torch path: two launches per layer, whatever the blocks


def test_bench_host_populate_small_run_prints_every_setup():
    out = bench("bench_host_populate.py", "--mib", "4", "--repeats", "1")
    for setup in ("fresh (nothing populated)", "broker populated (HostArena", "broker populated + client MAP_POPULATE"):
        assert f"| {setup}" in out


def test_bench_lora_kernels_logic_runs_on_cpu_with_every_row():
    # The script's CPU dry run: its tiny cases in Triton's interpreter, timings stubbed, every check real.
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    args = "--reps 2 --warmup 0 --dtypes float16 --stacked-rank 8 --layers 2 --modules 2".split()
    out = bench("bench_lora_kernels.py", "--cpu-dry-run", *args, "--vllm-ops", "/nonexistent", env=env)
    assert "MISMATCH" not in out, out
    for method in ("plan build, segment, torch ops: host wall", "plan build, segment, one launch: device"):
        assert f"prefill  float16   {method}" in out, out
    assert "decode float16: model step launch 3: max |out - fp32 reference|" in out, out
    assert "model step 2x2: kernels eager, plan + 4 pairs (token)" in out, out
    assert "decode float16: kernels token split-K 8: max |out - fp32 reference|" in out, out
    for method in ("slices per program", "expand fused", "fused", "fused split-K 8"):
        assert f"decode float16: kernels token {method}: max |out - fp32 reference|" in out, out
    assert "model step 2x2: kernels captured: skipped, CUDA graphs need a GPU" in out, out


def test_bench_request_flood_small_run_prints_memory_latency_and_answers():
    out = bench("bench_request_flood.py", "--senders", "2", "--per-sender", "1", "--size-mib", "5", "--settle", "0.2")
    assert "| broker RSS (MiB) | idle | peak in burst | just after | after settle |" in out
    assert "| during the burst |" in out
    assert "senders' answers: RESOURCE_EXHAUSTED" in out and "larger than max" in out


def test_bench_reply_bounds_small_run_prints_each_part():
    out = bench(
        "bench_reply_bounds.py",
        *("--objects", "40", "--pool-size", "32MiB", "--lookups", "2", "--pins", "20", "--after", "1"),
    )
    assert "| 2 x 64 PIN ops x 7,600 copies of one id | 3,891,399 |" in out, out
    assert "| 2 x 64 LOOKUP ops x 40 distinct 1 KiB keys |" in out, out
    assert "| step frame | 524,290 | 72 |" in out and "INVALID_ARGUMENT: object_ids[1] repeats" in out, out
    assert "its answers, read after SIGCONT: INVALID_ARGUMENT: 2, OK: 20" in out, out


@pytest.mark.parametrize("backend", ["valkey", "mooncake"])
def test_bench_tier_small_run_reads_a_chain_through_and_times_commits(backend):
    out = bench("bench_tier.py", "--backend", backend, "--blocks", "4", "--commits", "10", "--rounds", "1")
    assert "| B: fresh broker, through the tier | 1 |" in out and "| B' (A/A control)" in out, out
    assert f"| tier {backend}, write: commit | 1 |" in out and "| no tier again (A/A control) | 1 |" in out, out


def test_bench_step_per_item_quick_run_prints_each_side_at_every_size():
    out = bench("bench_step.py", "--per-item", "--quick", "--steps", "80")
    assert "broker CPU us" in out and "client CPU us" in out
    for n in (1, 8, 64, 512):
        assert any(line.split()[:1] == [str(n)] for line in out.splitlines()), out
    assert "target per-item, broker" in out and "target per-item, client" in out


def test_bench_step_keys_only_prints_the_broker_slope_of_kv_keys_alone():
    out = bench("bench_step.py", "--keys-only", "--quick", "--steps", "80")
    assert "a step of n items: n KV keys" in out
    for n in (1, 8, 64, 512):
        assert any(line.split()[:1] == [str(n)] for line in out.splitlines()), out
    assert "target per-item, broker (keys only)" in out and "target per-item, client (keys only)" in out


def test_bench_store_keys_prints_both_paths_interleaved_and_the_target():
    out = bench("bench_store_keys.py", "--rounds", "1", "--frames", "20")
    assert "native 512" in out and "python 512" in out
    assert "median slope 64..512, a step frame's keys: native" in out
    assert "median slope 64..512, a lookup without pins: native" in out
    assert "target issue 28, broker per KV key (native)" in out


def test_bench_adapters_native_small_run_prints_both_paths_and_their_slopes():
    out = bench("bench_adapters_native.py", "--frames", "20", "--rounds", "1", "--sizes", "8,32")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["1"]]
    assert [r[1] for r in rows] == ["native", "fallback"], out
    assert "slope p10 native" in out and "slope p10 fallback" in out


# ------------------------------------------------ bench_vllm_kv.py: what makes its comparison fair
# (tests/vllm_kv_fairness.py, which the benchmark imports; the engines themselves need
# .venv-vllm and minutes: tests/test_vllm_kv.py runs them)


def _kv_args(*argv: str):
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--omp-cpus", default="")
    ap.add_argument("--vllm-defaults", action="store_true")
    ap.add_argument("--queue-spin-s", type=float, default=0.05)
    return ap.parse_args(list(argv))


def test_bench_vllm_kv_gives_every_engine_the_same_cpus_and_no_idle_spinning():
    # vLLM binds 1 OpenMP thread without a connector and 2 with one on a 2-CPU machine, and its
    # queues spin 1 s after each message: the run sets both alike for every mode.
    a = _kv_args()
    env = kv.engine_env(a)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{os.cpu_count() - 1}"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env[kv.SPIN_ENV] == "0.05"
    assert kv.engine_env(_kv_args("--omp-cpus", "1"))["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert kv.engine_env(_kv_args("--vllm-defaults")) == {}


def test_bench_vllm_kv_numbered_modes_are_controls_and_unknown_modes_are_refused():
    assert [kv.base_mode(m) for m in ("none", "none2", "noop", "broker3", "noop-defer2", "broker-sync")] == [
        "none",
        "none",
        "noop",
        "broker",
        "noop-defer",
        "broker-sync",
    ]
    with pytest.raises(SystemExit, match="unknown mode 'nope'"):
        kv.base_mode("nope")


def test_bench_vllm_kv_random_order_puts_every_mode_first_and_after_every_other():
    modes = ["none", "none2", "noop", "broker"]
    orders = kv.mode_orders(modes, 400, "random")
    assert all(sorted(o) == sorted(modes) for o in orders)
    firsts = {m: sum(o[0] == m for o in orders) for m in modes}
    assert min(firsts.values()) > 60, firsts
    follows = {(o[i - 1], o[i]) for o in orders for i in range(1, 4)}
    assert len(follows) == 12  # every ordered pair: no mode always runs after the same one
    assert kv.mode_orders(modes, 400, "random") == orders  # seeded
    assert kv.mode_orders(modes, 2, "rotate") == [modes, modes[1:] + modes[:1]]


def _row(mode: str, local: float, p90: float) -> dict:
    k = {"n": 1, "median_ms": local, "p90_ms": p90}
    return {"mode": mode, "local": k, "cross": k, "miss": k, "prefill_computed": 0}


def test_bench_vllm_kv_reports_the_a_a_control_and_says_when_the_run_is_not_fair():
    fair = "\n".join(kv.ratio_lines([_row("none", 100, 200), _row("none2", 103, 196), _row("broker", 104, 205)]))
    assert "| broker | 1.040 | 1.025 |" in fair
    assert (
        "A/A control (none2, no connector on its own engines) / none, local hits: median 1.030, p90 0.980: fair" in fair
    )
    unfair = "\n".join(kv.ratio_lines([_row("none", 100, 200), _row("none2", 100, 260)]))
    assert "p90 1.300: NOT FAIR" in unfair
    assert "No A/A control ran" in "\n".join(kv.ratio_lines([_row("none", 1, 1), _row("broker", 1, 1)]))


def test_bench_vllm_kv_counts_the_cpu_of_an_engines_whole_process_tree():
    code = "import subprocess,sys; subprocess.run([sys.executable,'-c','import time\\nt=time.time()\\nwhile time.time()-t<30: pass'])"
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        import time

        deadline = time.monotonic() + 20
        while len(tree := kv.process_tree(p.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree[0] == p.pid and len(tree) == 2
        while kv.cpu_seconds(tree[1:]) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.05)
        child = kv.cpu_seconds(tree[1:])
        assert child >= 0.05 and kv.cpu_seconds(tree) >= child  # the grandchild's busy loop counts
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_bench_vllm_kv_engine_site_shortens_vllms_queue_spin_in_every_engine_process():
    vllm_py = os.path.join(ROOT, ".venv-vllm", "bin", "python")
    if not os.path.exists(vllm_py):
        pytest.skip("no .venv-vllm (`make vllm-venv`)")
    ipc = os.path.join(short_tmpdir(), "spin")  # a Unix socket path: pytest's tmp_path can be too long
    code = ("import inspect; from vllm.distributed.device_communicators import shm_broadcast as s\n"
            f"import zmq; c = s.SpinCondition(True, zmq.Context(), 'ipc://{ipc}')\n"
            "print(c.busy_loop_s)")  # fmt: skip
    site = os.path.join(ROOT, "ops", "bench", "vllm_engine_site")
    outs = {}
    for spin in ("0.05", ""):
        env = {**os.environ, "PYTHONPATH": site, "MB_BENCH_VLLM_SPIN_S": spin}
        outs[spin] = subprocess.run([vllm_py, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert outs["0.05"].stdout.split()[-1] == "0.05", outs["0.05"].stderr[-2000:]
    assert outs[""].stdout.split()[-1] == "1", outs[""].stderr[-2000:]  # unset: vLLM's own


def test_bench_vllm_kv_report_says_a_run_stopped_early_and_its_setup():
    import argparse

    a = argparse.Namespace(groups=1, hits=2, prefix=8, tail=2, order="random", warmup_groups=1, omp_cpus="",
                           vllm_defaults=False, queue_spin_s=0.05, stopped_early="3 of 4 requests per mode (engine failed)")  # fmt: skip
    text = kv.report(a, [_row("none", 100, 200), _row("none2", 101, 199)], True, 1.0)
    assert "**Stopped early**: 3 of 4 requests per mode (engine failed)." in text
    assert "vLLM's queues spinning 0.05 s after a message" in text and ": fair" in text
    assert "in a random order, after 1 untimed" in text  # no pause between requests
    a.vllm_defaults, a.stopped_early, a.settle_s = True, "", 0.3
    text = kv.report(a, [_row("none", 100, 200)], True, 1.0)
    assert "vLLM's own CPU setup" in text and "in a random order, 0.3 s apart, after 1 untimed" in text


def test_bench_vllm_kv_pairs_requests_and_bounds_each_ratio_by_bootstrap():
    # Request i ran in every mode: broker is 0.9x none on every local hit, 1.2x on misses; the A/A
    # control 1.0x everywhere but for noise of +-2%.
    rng = random.Random(3)
    base = [("local", 100 + rng.random() * 50) for _ in range(60)] + [
        ("miss", 500 + rng.random() * 100) for _ in range(20)
    ]
    res = {
        "none": [{"kind": k, "ttft_s": t} for k, t in base],
        "none2": [{"kind": k, "ttft_s": t * (1 + rng.uniform(-0.02, 0.02))} for k, t in base],
        "broker": [{"kind": k, "ttft_s": t * (0.9 if k == "local" else 1.2)} for k, t in base],
    }
    local = kv.paired(res, "broker", "none", "local")
    assert local["n"] == 60 and local["per_request"][0] == pytest.approx(0.9)
    lo, hi = local["per_request"][1:]
    assert lo == pytest.approx(0.9) and hi == pytest.approx(0.9)  # every pair says 0.9: no spread
    aa = kv.paired(res, "none2", "none", "miss")
    assert aa["median"][1] < 1.0 < aa["median"][2] and aa["median"][2] - aa["median"][1] < 0.1
    assert kv.paired(res, "lmcache", "none", "miss") is None
    text = "\n".join(kv.paired_lines(res))
    assert "| broker / none | miss | 20 | 1.200 [1.20-1.20] |" in text
    assert "| none2 / none | local | 60 |" in text and "lmcache" not in text


def test_bench_vllm_kv_phases_give_each_modes_median_split_of_a_requests_time():
    # none's local hits: 1 ms to the engine core, never queued, a 100 or 120 ms step, 2 ms back;
    # noop-defer's: queued 4 ms, a 90 ms step. Requests without phases (a run without
    # --phases) are left out, and a run with none of them prints no table.
    def req(kind, phases):
        return {"kind": kind, "ttft_s": sum(phases) / 1000, "phases_s": [x / 1000 for x in phases]}

    res = {
        "none": [req("local", [1, 0, 100, 2]), req("local", [1, 0, 120, 2]), {"kind": "miss", "ttft_s": 0.5}],
        "noop-defer": [req("local", [1, 4, 90, 2])],
    }
    text = "\n".join(kv.phase_lines(res))
    assert "| front end to engine core | queued | the step | back to the front end | whole |" in text
    assert "| none | local | 2 | 1.0 | 0.0 | 110.0 | 2.0 | 113.0 |" in text
    assert "| noop-defer | local | 1 | 1.0 | 4.0 | 90.0 | 2.0 | 97.0 |" in text
    assert "| none | miss |" not in text
    assert kv.phase_lines({"none": [{"kind": "local", "ttft_s": 0.1}]}) == []


def test_bench_vllm_kv_targets_say_met_or_not_and_where_the_a_a_spread_covers_them():
    rows = [_row("none", 100, 200), _row("none2", 103, 190), _row("broker", 104, 205), _row("lmcache", 110, 200)]
    rows[2]["cross"] = {"n": 1, "median_ms": 20, "p90_ms": 100}
    text = "\n".join(kv.target_lines(rows))
    assert "* broker / none, miss median: 1.040 (target <= 1.05): met; the A/A control is 1.030" in text
    assert (
        "* broker / none, local p90: 1.025 (target <= 1.05): met; the A/A control is 0.950, inside its spread" in text
    )
    assert "* none / broker, cross p90: 2.000 (target >= 3): NOT met" in text
    assert "* broker / lmcache, local p90: 1.025 (target <= 1): NOT met" in text


def test_soak_broker_memory_small_run_prints_both_soaks_and_keeps_every_rule():
    out = bench("soak_broker_memory.py", "--store", "3000", "--sessions", "6", "--frames", "40")
    assert "store: 3,000 transactions behind one open 600 s lease" in out, out
    rows = [ln.split() for ln in out.splitlines() if ln.strip() and ln.split()[0].replace(",", "").isdigit()]
    store_rows = rows[:4]
    assert [r[0] for r in store_rows] == ["301", "751", "1,501", "3,000"], out
    # The deadline heap keeps the open transactions' entries and at most 1,024 more.
    assert all(int(r[2].replace(",", "")) <= 1 + 2 + 1024 for r in store_rows), out
    assert "sessions: 6 sessions of one process, 40 step frames each (seed 1)" in out, out
    assert "every refusal deliberate, the books restored each time" in out, out
    assert "FAIL:" not in out, out


def test_soak_windows_small_run_checks_every_object_here_and_from_a_fresh_process():
    out = bench("soak_windows.py", "--ops", "300")
    assert "soak_windows: 300 operations, two sessions" in out, out
    assert "wrong objects: 0 (checked after every allocation)" in out, out
    assert "wrong survivors from a fresh process: 0 of" in out, out
    assert "FAIL" not in out, out
