#!/usr/bin/env bash
# Run the GPU tests and the GPU benchmarks on this machine and write one results file.
#
#   ops/gpu/run_gpu_checks.sh [RESULTS_FILE]
#
# RESULTS_FILE defaults to ops/gpu/results-<date>-<device>.txt. The file holds the date, the
# device (nvidia-smi, else torch), the software versions, one line per test (PASSED /
# FAILED / SKIPPED / ERROR), the pytest summary, and the benchmark tables; the full pytest
# output goes beside it as RESULTS_FILE.log. Exit status: 0 when no test failed (skips
# included: on a machine without a usable GPU every GPU test skips and says why), 1 otherwise.
#
# Environment: PYTHON (default .venv/bin/python, else python3), GPU_TESTS (test files,
# default tests/test_gpu_*.py tests/test_arena_cuda.py tests/test_kernels.py where present),
# GPU_BENCHES (default ops/bench/bench_cuda_arena.py ops/bench/bench_lora_kernels.py where
# present), BENCH_TIMEOUT (seconds per benchmark, default 900).
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

device=""
if command -v nvidia-smi >/dev/null 2>&1; then
    device=$(nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
fi
if [ -z "$device" ]; then
    device=$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null)
fi
[ -n "$device" ] || device="no-gpu"
slug=$(printf '%s' "${device%%,*}" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9' '-' | sed 's/^-*//; s/-*$//')
out=${1:-ops/gpu/results-$(date +%F)-${slug:-unknown}.txt}
mkdir -p "$(dirname "$out")"
log="$out.log"

tests=${GPU_TESTS:-}
if [ -z "$tests" ]; then
    for f in tests/test_gpu_*.py tests/test_arena_cuda.py tests/test_kernels.py tests/test_kernels_compile.py \
        tests/test_lora_batch.py tests/test_lora_e2e.py; do
        [ -e "$f" ] && tests="$tests $f"
    done
fi
benches=${GPU_BENCHES:-}
if [ -z "$benches" ]; then
    for f in ops/bench/bench_cuda_arena.py ops/bench/bench_lora_kernels.py; do
        [ -e "$f" ] && benches="$benches $f"
    done
fi

{
    echo "# memory-broker GPU checks"
    echo "date: $(date -Iseconds)"
    echo "host: $(hostname)"
    echo "device: $device"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') ($(git status --porcelain 2>/dev/null | wc -l | tr -d ' ') files changed)"
    "$PYTHON" - <<'PY' 2>&1
import platform
print(f"python: {platform.python_version()}")
try:
    import torch
    print(f"torch: {torch.__version__} (cuda {torch.version.cuda}, available: {torch.cuda.is_available()})")
except Exception as e:
    print(f"torch: not importable ({e})")
try:
    import cuda.bindings
    print(f"cuda-python bindings: {cuda.bindings.__version__}")
except Exception as e:
    print(f"cuda-python: not importable ({e})")
from memory_broker.broker.arena.cuda import cuda_available
print(f"cuda arena: {cuda_available('0')[1]}")
PY
    echo
    echo "## Tests:$tests"
} >"$out"

# shellcheck disable=SC2086
"$PYTHON" -m pytest -rA -p no:cacheprovider $tests >"$log" 2>&1
test_rc=$?
{
    grep -E '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ' "$log" || echo "(no per-test lines; see $log)"
    echo
    echo "pytest: $(tail -n 1 "$log") (exit $test_rc)"
    echo
} >>"$out"

bench_rc=0
for b in $benches; do
    {
        echo "## Benchmark: $b"
        echo
        timeout "${BENCH_TIMEOUT:-900}" "$PYTHON" "$b" 2>&1
        rc=$?
        if [ $rc -ne 0 ]; then
            echo "(exit $rc)"
            bench_rc=1
        fi
        echo
    } >>"$out"
done

echo "wrote $out (pytest log: $log)"
grep -E '^pytest: ' "$out"
# pytest exits 5 when it collected nothing; 0 is a pass (skips included).
if [ $test_rc -ne 0 ] || [ $bench_rc -ne 0 ]; then exit 1; fi
exit 0
