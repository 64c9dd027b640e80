#!/usr/bin/env bash
# Install what the GPU checks need (offline), check that the CUDA arena can run here, run the GPU
# tests and the GPU benchmarks, and write one results file.
#
#   ops/gpu/run_gpu_checks.sh [RESULTS_FILE]
#
# RESULTS_FILE defaults to ops/gpu/results-<date>-<device>.txt. The file holds the date, the
# device (nvidia-smi, else torch), the software versions, the install log's tail, the preflight
# (GPUs, driver CUDA version, cuda-bindings, torch, whether the CUDA arena can run and why
# not), one line per test, the per-file tally, the verdict, and the benchmark tables; the full
# pytest output goes beside it as RESULTS_FILE.log.
#
# Time: the whole run is bounded by TOTAL_BUDGET seconds (default 440, under 8 minutes on an
# H100/H200); every step runs under `timeout` with its own limit (INSTALL_TIMEOUT 60,
# PREFLIGHT_TIMEOUT 45, COLLECT_TIMEOUT 60, TEST_TIMEOUT 240, BENCH_TIMEOUT 90 per benchmark),
# cut to what is left of the budget. Results are appended to RESULTS_FILE as they are measured
# (one line per test as it finishes, each benchmark's tables as they print, unbuffered), so a
# run that is cut off keeps everything it measured; a step that times out says so.
#
# Exit status 0 only when the CUDA arena actually ran: the preflight found a GPU the arena can
# use, no test failed, and every test in tests/test_gpu_arena.py ran and passed (a run where
# the GPU tests skip is a failure, with the skip reason; so is a skipped CUDA-graph capture test
# of tests/test_kernels_graph.py or tests/test_lora_static.py). Without a GPU it fails at once with
# the reason; with a GPU the arena cannot use (e.g. cuda-bindings 13 on a CUDA 12 driver) it
# still runs the tests, for the record, and fails naming the reason.
#
# Install (the GPU machine has no package registry): WHEELHOUSE (default ops/gpu/wheelhouse,
# made by ops/gpu/build_wheelhouse.py and carried along) is installed with pip --no-index
# --find-links: its requirements.txt as ranges (what the machine already has at an accepted
# version stays), then the project's wheel with --no-deps so pip never touches torch.
# INSTALL_PROJECT=wheel (default) | editable (pip -e . from this checkout, for fixes made on the
# GPU machine) | none. WHEELHOUSE= skips the install. The installed memory_broker must match
# this checkout's sources (a stale wheel fails the run).
#
# Environment: PYTHON (default .venv/bin/python, else python3), GPU_TESTS (test files,
# default tests/test_gpu_*.py tests/test_arena_cuda.py tests/test_kernels.py
# tests/test_kernels_compile.py tests/test_kernels_plan.py tests/test_kernels_graph.py and
# tests/test_lora_static.py (CUDA-graph capture and replay) tests/test_lora_batch.py
# tests/test_lora_e2e.py tests/test_block_mover.py (the KV block mover on vLLM's CUDA layouts)
# tests/test_step_thread.py (the step thread's use of asyncio's private parts, on the GPU
# machine's Python) where present), GPU_BENCHES (default ops/bench/bench_cuda_arena.py
# ops/bench/bench_lora_kernels.py ops/bench/bench_block_mover.py where present, and
# ops/bench/bench_step.py's StepBatch rows, `--steps 600 --only StepBatch`: no GPU in them, but
# issue 28's background-batch CPU target read on bare metal, whose idle CPUs wake cheaply, which
# the development VM's do not), BENCH_TIMEOUT
# (seconds per benchmark, default 90), VLLM_LORA_OPS (default ops/gpu/vllm_lora_ops: vLLM's
# Triton LoRA kernels, copied where vLLM is installed by ops/gpu/extract_vllm_lora_ops.py and
# carried along, git-ignored; bench_lora_kernels.py compares the project's kernels with them,
# and without the folder runs without those rows, saying so).
set -uo pipefail
cd "$(dirname "$0")/../.."

budget_end=$((SECONDS + ${TOTAL_BUDGET:-440}))
limit() {  # limit DEFAULT: seconds a step may take, DEFAULT cut to what the budget has left (at least 5)
    local left=$((budget_end - SECONDS))
    [ "$left" -lt 5 ] && left=5
    if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
timed_out() {  # timed_out RC STEP: a line saying a step ran out of time (timeout exits 124, or 137 when killed)
    if [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then echo "TIMED OUT: $2 (cut by its time limit; what it measured is above)"; fi
}

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

device=""
if command -v nvidia-smi >/dev/null 2>&1; then
    device=$(nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
fi
if [ -z "$device" ]; then
    device=$(timeout 60 "$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null)
fi
[ -n "$device" ] || device="no-gpu"
slug=$(printf '%s' "${device%%,*}" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9' '-' | sed 's/^-*//; s/-*$//')
out=${1:-ops/gpu/results-$(date +%F)-${slug:-unknown}.txt}
mkdir -p "$(dirname "$out")"
log="$out.log"
junit="$out.junit.xml"
: >"$log"

tests=${GPU_TESTS:-}
if [ -z "$tests" ]; then
    for f in tests/test_gpu_*.py tests/test_arena_cuda.py tests/test_kernels.py tests/test_kernels_compile.py \
        tests/test_kernels_plan.py tests/test_kernels_graph.py tests/test_lora_batch.py tests/test_lora_static.py \
        tests/test_lora_e2e.py tests/test_block_mover.py tests/test_step_thread.py; do
        [ -e "$f" ] && tests="$tests $f"
    done
fi
vllm_ops=${VLLM_LORA_OPS:-ops/gpu/vllm_lora_ops}
benches=${GPU_BENCHES:-}
if [ -z "$benches" ]; then
    for f in ops/bench/bench_cuda_arena.py ops/bench/bench_lora_kernels.py ops/bench/bench_block_mover.py \
        ops/bench/bench_step.py; do
        [ -e "$f" ] && benches="$benches $f"
    done
fi

fail() {  # the verdict line, then exit 1
    echo "RESULT: FAIL: $*" >>"$out"
    echo "wrote $out"
    echo "RESULT: FAIL: $*"
    exit 1
}

{
    echo "# memory-broker GPU checks"
    echo "date: $(date -Iseconds)"
    echo "host: $(hostname)"
    echo "device: $device"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') ($(git status --porcelain 2>/dev/null | wc -l | tr -d ' ') files changed)"
    echo
} >"$out"

# ---- install, offline
wheelhouse=${WHEELHOUSE-ops/gpu/wheelhouse}
install_project=${INSTALL_PROJECT:-wheel}
if [ -n "$wheelhouse" ]; then
    echo "## Install from $wheelhouse (offline)" >>"$out"
    [ -f "$wheelhouse/requirements.txt" ] || fail "no wheelhouse at $wheelhouse (build it with ops/gpu/build_wheelhouse.py where a registry is reachable, and carry it), or set WHEELHOUSE= to use what is installed"
    [ -f "$wheelhouse/MANIFEST.txt" ] && tail -n 1 "$wheelhouse/MANIFEST.txt" >>"$out"
    pip_install=("$PYTHON" -m pip install --no-index --find-links "$wheelhouse" --no-cache-dir --disable-pip-version-check)
    if ! timeout "$(limit "${INSTALL_TIMEOUT:-60}")" "${pip_install[@]}" -r "$wheelhouse/requirements.txt" >>"$log" 2>&1; then
        tail -n 15 "$log" >>"$out"
        fail "pip could not install $wheelhouse/requirements.txt offline (see $log)"
    fi
    case "$install_project" in
        wheel)
            whl=$(ls "$wheelhouse"/memory_broker-*.whl 2>/dev/null | head -n 1)
            [ -n "$whl" ] || fail "the project's wheel is missing from $wheelhouse"
            timeout "$(limit "${INSTALL_TIMEOUT:-60}")" "${pip_install[@]}" --no-deps --force-reinstall "$whl" >>"$log" 2>&1 || fail "pip could not install $whl (see $log)"
            ;;
        editable)
            timeout "$(limit "${INSTALL_TIMEOUT:-60}")" "${pip_install[@]}" --no-deps --no-build-isolation -e . >>"$log" 2>&1 || fail "pip could not install this checkout editable (see $log)"
            ;;
        none) ;;
        *) fail "INSTALL_PROJECT=$install_project: use wheel, editable or none" ;;
    esac
    echo "installed: $(grep -E '^Successfully installed' "$log" | tr '\n' ' ' || true)" >>"$out"
    echo >>"$out"
fi

# The tests must exercise this checkout, not an older wheel.
stale=$(timeout 60 "$PYTHON" - <<'PY' 2>&1
import filecmp, importlib.util, os, sys
bad = []
# The arena's views (the CUDA arena's mapping code) live in proto/wire/mapping (memory_broker.proto.wire.mapping).
for folder, name in (("broker", "broker"), ("clients", "clients"), ("kernels", "kernels"), ("proto", "proto")):
    spec = importlib.util.find_spec(f"memory_broker.{name}")  # finds without importing torch
    if spec is None or not spec.submodule_search_locations:
        print(f"memory_broker.{name} is not installed"); sys.exit(0)
    inst = list(spec.submodule_search_locations)[0]
    if os.path.realpath(inst) == os.path.realpath(folder):
        continue  # an editable install of this checkout
    for dp, _, files in os.walk(folder):
        if os.path.join("proto", "compat") in dp:
            continue  # the deprecated alias memory_broker.wire installs elsewhere
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dp, f), folder)
                other = os.path.join(inst, rel)
                if not os.path.exists(other) or not filecmp.cmp(os.path.join(dp, f), other, shallow=False):
                    bad.append(os.path.join(folder, rel))
if bad:
    print(f"the installed memory_broker differs from this checkout in {len(bad)} file(s) ({', '.join(bad[:3])}): "
          "rebuild the wheelhouse, or rerun with INSTALL_PROJECT=editable")
PY
)
[ -z "$stale" ] || fail "$stale"

{
    timeout 60 "$PYTHON" - <<'PY' 2>&1
import platform
print(f"python: {platform.python_version()}")
for name in ("torch", "triton", "cuda-bindings", "grpcio", "protobuf", "numpy", "transformers", "peft", "memory-broker"):
    try:
        from importlib.metadata import version
        print(f"{name}: {version(name)}")
    except Exception as e:
        print(f"{name}: not installed ({type(e).__name__})")
try:
    from memory_broker.proto.wire import native
    core = native.load("memory_broker.proto.wire._stepcore")
    print("native step core: " + ("built" if core is not None else "not built (the Python path runs)"))
except Exception as e:
    print(f"native step core: unknown ({type(e).__name__})")
PY
    if [ -f "$vllm_ops/MANIFEST.json" ]; then
        echo "vLLM LoRA ops: $(timeout 30 "$PYTHON" -c 'import json, sys; m = json.load(open(sys.argv[1])); print(m["vllm_version"], "from", m["source"])' "$vllm_ops/MANIFEST.json" 2>&1) ($vllm_ops)"
    else
        echo "vLLM LoRA ops: none at $vllm_ops (run ops/gpu/extract_vllm_lora_ops.py where vLLM is installed, and carry the folder)"
    fi
    echo
    echo "## Preflight"
} >>"$out"

# ---- can the CUDA arena run here?
timeout "$(limit "${PREFLIGHT_TIMEOUT:-45}")" "$PYTHON" ops/gpu/gpu_ready.py preflight >>"$out" 2>&1
preflight_rc=$?
timed_out $preflight_rc "the preflight" >>"$out"
echo >>"$out"
if [ $preflight_rc -ne 0 ] && grep -q '^NOT READY: no GPU on this machine' "$out"; then
    fail "$(grep -m1 '^NOT READY: ' "$out" | sed 's/^NOT READY: //')"
fi

# ---- import audit: a test module that cannot import fails here, by name, not as a skip
echo "## Tests:$tests" >>"$out"
# shellcheck disable=SC2086
if ! timeout "$(limit "${COLLECT_TIMEOUT:-60}")" "$PYTHON" -m pytest -q --collect-only -p no:cacheprovider $tests >"$log.collect" 2>&1; then
    grep -E '^(ERROR|E +)' "$log.collect" | head -n 20 >>"$out"
    fail "the GPU tests do not import (see $log.collect)"
fi

# Each test's line is appended to RESULTS_FILE as it finishes (-v, followed with tail --pid,
# which also ends if a test's child process keeps the output open), so a cut-off run keeps
# them. The benchmarks keep BENCH_RESERVE seconds (default 180) of the budget.
test_limit=$(limit "${TEST_TIMEOUT:-240}")
avail=$((budget_end - SECONDS - ${BENCH_RESERVE:-180}))
[ "$avail" -lt 30 ] && avail=30
[ "$avail" -lt "$test_limit" ] && test_limit=$avail
tlog="$log.tests"
: >"$tlog"
# shellcheck disable=SC2086
timeout -k 10 "$test_limit" "$PYTHON" -u -m pytest -v -rA -p no:cacheprovider --junitxml="$junit" $tests >"$tlog" 2>&1 &
tpid=$!
tail -n +1 -f --pid="$tpid" "$tlog" | grep --line-buffered -E ' (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)( |$)' >>"$out"
wait "$tpid"
test_rc=$?
cat "$tlog" >>"$log"
{
    timed_out "$test_rc" "the GPU tests after $test_limit s"
    echo
    echo "pytest: $(tail -n 1 "$tlog") (exit $test_rc)"
    echo
    echo "## Verdict"
} >>"$out"
verdict_rc=1
if [ -s "$junit" ]; then
    timeout 60 "$PYTHON" ops/gpu/gpu_ready.py verdict "$junit" >>"$out" 2>&1
    verdict_rc=$?
else
    echo "NOT A PASS: pytest wrote no $junit" >>"$out"
fi
echo >>"$out"

bench_rc=0
if [ $preflight_rc -eq 0 ]; then
    for b in $benches; do
        {
            echo "## Benchmark: $b"
            echo
            bench_args=()
            # The folder's absence is the benchmark's to report (one line); it runs on without it.
            [ "$(basename "$b")" = bench_lora_kernels.py ] && bench_args=(--vllm-ops "$vllm_ops")
            [ "$(basename "$b")" = bench_step.py ] && bench_args=(--steps 600 --only StepBatch)
            timeout -k 5 "$(limit "${BENCH_TIMEOUT:-90}")" "$PYTHON" -u "$b" ${bench_args[@]+"${bench_args[@]}"} 2>&1
            rc=$?
            if [ $rc -ne 0 ]; then
                timed_out $rc "$b"
                echo "(exit $rc)"
                bench_rc=1
            fi
            echo
        } >>"$out"
    done
fi

grep -E '^pytest: ' "$out"
if [ $preflight_rc -ne 0 ]; then
    fail "$(grep '^NOT READY: ' "$out" | sed 's/^NOT READY: //' | paste -sd ';' -)"
fi
if [ $test_rc -ne 0 ] || [ $verdict_rc -ne 0 ] || [ $bench_rc -ne 0 ]; then
    why=$(grep '^NOT A PASS: ' "$out" | sed 's/^NOT A PASS: //' | paste -sd ';' -)
    [ $bench_rc -eq 0 ] || why="${why:+$why; }a benchmark failed"
    fail "${why:-pytest exited $test_rc}"
fi
echo "RESULT: PASS: the CUDA arena ran and every GPU test passed" >>"$out"
echo "wrote $out (pytest log: $log)"
echo "RESULT: PASS"
exit 0
