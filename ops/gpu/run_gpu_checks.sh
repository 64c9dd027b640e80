#!/usr/bin/env bash
# The GPU run, in stages, within one short lend of a GPU machine (about 300 s there). It installs
# what the machine lacks (offline), checks that the CUDA arena can run, then runs five stages,
# each within its own share of the time budget, each writing its results and one verdict line
# as it finishes, so a run cut anywhere still says what it measured:
#
#   0 PROBE    ops/gpu/vmm_probe4.py: the driver's open questions (Q1-Q12), one line each
#   1 ARENA    the CUDA arena's tests: tests/test_gpu_arena.py's cuda runs (-k "not host"; its
#              host runs are the CPU suite's), with their own junit
#   2 BENCH    ops/bench/bench_cuda_arena.py at 1,024 pages (--reps 50), then at the device's
#              free memory (the attach table: one pass over every page)
#   3 KERNELS  the kernels' and LoRA's GPU tests (CUDA-graph capture included)
#   4 REST     the other GPU tests (the KV block mover's), then bench_lora_kernels.py and
#              bench_block_mover.py
#
#   ops/gpu/run_gpu_checks.sh [RESULTS_FILE]
#
# Tests that need no GPU are not run here: tests/test_arena_cuda.py (the fake driver; it has no
# GPU-only part), tests/test_kernels_compile.py (sm_90 compiles without a GPU),
# bench_step.py's CPU rows. They run in the CPU suite.
#
# RESULTS_FILE defaults to ops/bench/results/<date>-gpu-<device>.md, ready to commit: a
# `Recorded:` line, the install, software and preflight, then each stage's output and verdict
# line as it ends, and last the verdicts together and `RESULT: PASS` or `RESULT: FAIL: <why>`.
# The stages' full logs and junit files go to RUNS_DIR (default ops/gpu/runs/<date>-<device>/,
# git-ignored; RESULTS_FILE's name with -logs when RESULTS_FILE is given). COPY_TO=DIR copies the
# results file and the logs there after every stage (on a lent machine: COPY_TO=$OUT, so a run
# cut from outside still brings back what it measured).
#
# Verdict lines (stdout and the results file):
#   PROBE VERDICT: answered: N questions (K FAILS) | cut by its N s limit after N answers | not run: why
#   ARENA VERDICT: PASS: N passed | NOT A PASS: why (a failure, a skip, a cut: the tests not run)
#   BENCH VERDICT: 1,024 pages: measured; the device's free memory: not measured (cut by its N s limit)
#   KERNELS VERDICT: PASS: N passed | NOT A PASS: why
#   REST VERDICT: tests: PASS: N passed; bench_lora_kernels.py: measured; ...
# A benchmark cut by its limit is "not measured", not a failure; one that exits with an error is
# "FAILED". A stage with under 3 s of its budget left is "not run: no time left".
#
# Exit status 0 only when the CUDA arena actually ran: the preflight found a GPU the arena can
# use, every test of stages 1, 3 and 4 ran and passed (a skipped test of tests/test_gpu_arena.py,
# or a skipped CUDA-graph capture test of tests/test_kernels_graph.py or tests/test_lora_static.py,
# is a failure), and no benchmark failed. The probe's answers (OK or FAILS) and benchmarks not
# measured are reported, not judged. Without a GPU it fails at once with the reason; with a GPU
# the arena cannot use (e.g. cuda-bindings 13 on a CUDA 12 driver) it still runs the stages, for
# the record, and fails naming the reason.
#
# Time: TOTAL_BUDGET seconds in all (default 300). The install and preflight run first under
# their own limits (INSTALL_TIMEOUT 60 per pip call, PREFLIGHT_TIMEOUT 45), cut to the budget;
# the stages share what is left less END_RESERVE (10 s, for the verdicts), by PROBE_SHARE 15,
# ARENA_SHARE 30, BENCH_SHARE 22, KERNELS_SHARE 20, REST_SHARE 13 (parts of the whole); time a
# stage leaves unused goes to the next. Every command runs under `timeout`; every test under
# pytest-timeout's PER_TEST_TIMEOUT (60 s), so a hung test fails and the next one runs.
#
# Install (the GPU machine has no package registry): WHEELHOUSE (default ops/gpu/wheelhouse,
# made by ops/gpu/build_wheelhouse.py and carried along) is installed with pip --no-index
# --find-links: its requirements.txt as ranges (what the machine already has at an accepted
# version stays), then the project's wheel with --no-deps so pip never touches torch.
# INSTALL_PROJECT=wheel (default) | editable (pip -e . from this checkout, for fixes made on the
# GPU machine) | none. WHEELHOUSE= skips the install. The installed memory_broker must match
# this checkout's sources (a stale wheel fails the run).
#
# Environment: PYTHON (default .venv/bin/python, else python3); PROBE (ops/gpu/vmm_probe4.py);
# ARENA_TESTS (tests/test_gpu_arena.py) and ARENA_SELECT ("not host", pytest -k); ARENA_BENCH
# (ops/bench/bench_cuda_arena.py) and BENCH_REPS (50); KERNEL_TESTS (tests/test_kernels_graph.py
# tests/test_lora_static.py tests/test_lora_batch.py tests/test_kernels_plan.py
# tests/test_kernels.py tests/test_lora_e2e.py, where present); REST_TESTS (tests/test_block_mover.py
# and any other tests/test_gpu_*.py but the arena's and tests/test_gpu_checks.py); REST_BENCHES
# (ops/bench/bench_lora_kernels.py ops/bench/bench_block_mover.py); VLLM_LORA_OPS (default
# ops/gpu/vllm_lora_ops: vLLM's Triton LoRA kernels, copied where vLLM is installed by
# ops/gpu/extract_vllm_lora_ops.py and carried along, git-ignored; bench_lora_kernels.py
# compares the project's kernels with them, and without the folder runs without those rows).
set -uo pipefail
cd "$(dirname "$0")/../.."

budget_end=$((SECONDS + ${TOTAL_BUDGET:-300}))
limit() {  # limit DEFAULT: seconds a setup step may take, DEFAULT cut to what the budget has left (at least 5)
    local left=$((budget_end - SECONDS))
    [ "$left" -lt 5 ] && left=5
    if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
is_cut() { [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; }  # timeout's status when it stopped the command

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

device=""
if command -v nvidia-smi >/dev/null 2>&1; then
    device=$(nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
fi
if [ -z "$device" ]; then
    device=$(timeout 30 "$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null)
fi
[ -n "$device" ] || device="no-gpu"
slug=$(printf '%s' "${device%%,*}" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9' '-' | sed 's/^-*//; s/-*$//')
slug=${slug:-unknown}
out=${1:-ops/bench/results/$(date +%F)-gpu-$slug.md}
if [ -n "${RUNS_DIR:-}" ]; then
    runs=$RUNS_DIR
elif [ -n "${1:-}" ]; then
    runs="${out%.*}-logs"
else
    runs="ops/gpu/runs/$(date +%F)-$slug"
fi
mkdir -p "$(dirname "$out")" "$runs"
log="$runs/install.log"
: >"$log"

probe=${PROBE:-ops/gpu/vmm_probe4.py}
arena_tests=${ARENA_TESTS:-tests/test_gpu_arena.py}
arena_select=${ARENA_SELECT-not host}
arena_bench=${ARENA_BENCH:-ops/bench/bench_cuda_arena.py}
present() {  # present FILE...: those that exist
    local f
    for f in "$@"; do [ -e "$f" ] && printf '%s ' "$f"; done
}
kernel_tests=${KERNEL_TESTS-$(present tests/test_kernels_graph.py tests/test_lora_static.py tests/test_lora_batch.py \
    tests/test_kernels_plan.py tests/test_kernels.py tests/test_lora_e2e.py)}
if [ -z "${REST_TESTS+x}" ]; then
    REST_TESTS=$(present tests/test_block_mover.py)
    for f in tests/test_gpu_*.py; do
        case " $arena_tests tests/test_gpu_checks.py " in *" $f "*) ;; *) [ -e "$f" ] && REST_TESTS="$REST_TESTS$f " ;; esac
    done
fi
rest_tests=$REST_TESTS
rest_benches=${REST_BENCHES-$(present ops/bench/bench_lora_kernels.py ops/bench/bench_block_mover.py)}
vllm_ops=${VLLM_LORA_OPS:-ops/gpu/vllm_lora_ops}

# ---- the results file: sections appended whole as each step ends
fenced() {  # fenced FILE...: the files' text in a ```text block
    echo '```text'
    sed -e '$a\' "$@" 2>/dev/null
    echo '```'
    echo
}
copy_out() {  # the results file and the logs to COPY_TO, if set
    [ -n "${COPY_TO:-}" ] || return 0
    mkdir -p "$COPY_TO" && cp "$out" "$COPY_TO/" && cp -r "$runs" "$COPY_TO/"
    return 0
}

STAGES=(PROBE ARENA BENCH KERNELS REST)
declare -A verdict_of=()
fails=()   # why the run is not a pass
notes=()   # what was not measured or not answered (reported, not judged)
verdict() {  # verdict STAGE TEXT: the stage's verdict line, in the results file and on stdout
    verdict_of[$1]=$2
    printf '%s VERDICT: %s\n\n' "$1" "$2" >>"$out"
    echo "$1 VERDICT: $2"
    copy_out
}

# finish [WHY [NOT_RUN]]: the verdicts together and the RESULT line, then exit (1 unless a pass).
# WHY ends the run early; NOT_RUN is what the stages that did not run say.
finish() {
    local s why=${1:-} not_run=${2:-the run ended before it} result
    [ -n "$why" ] && fails=("$why" ${fails[@]+"${fails[@]}"})
    for s in "${STAGES[@]}"; do
        [ -n "${verdict_of[$s]:-}" ] || verdict_of[$s]="not run: $not_run"
    done
    if [ ${#fails[@]} -eq 0 ]; then
        result="RESULT: PASS: the CUDA arena ran and every GPU test passed"
    else
        result="RESULT: FAIL: $(printf '%s; ' "${fails[@]}" | sed 's/; $//')"
    fi
    [ ${#notes[@]} -eq 0 ] || result="$result (not measured: $(printf '%s; ' "${notes[@]}" | sed 's/; $//'))"
    {
        echo "## Verdicts"
        echo
        echo '```text'
        for s in "${STAGES[@]}"; do echo "$s VERDICT: ${verdict_of[$s]}"; done
        echo '```'
        echo
        echo "$result"
    } >>"$out"
    copy_out
    echo "wrote $out (logs: $runs)"
    echo "$result"
    case $result in "RESULT: PASS"*) exit 0 ;; *) exit 1 ;; esac
}

# The command running now (under `timeout`), its log, and for a pytest stage its junit and
# verdict label: a signal to this script stops the command and keeps what it wrote.
child=""
current=""
current_log=""
current_junit=""
current_must=""
current_label=""
on_signal() {
    trap - TERM INT
    [ -n "$child" ] && kill -TERM "$child" 2>/dev/null && wait "$child" 2>/dev/null
    local stage=${current_stage:-}
    if [ -n "$current_junit" ]; then
        timeout 20 "$PYTHON" ops/gpu/gpu_ready.py verdict "$current_junit" --must-run $current_must --list \
            --label "$current_label" --cut "by SIG$1" >"$current_junit.verdict" 2>&1
        fenced <(grep -v "^$current_label: " "$current_junit.verdict") >>"$out"
        v=$(grep -m1 "^$current_label: " "$current_junit.verdict" | sed "s/^$current_label: //")
        [ -n "$stage" ] && [ -n "$v" ] && verdict "$stage" "$v"
    elif [ -n "$current_log" ] && [ -s "$current_log" ]; then
        { echo "(stopped by SIG$1; the end of its output:)"; echo; fenced <(tail -n 40 "$current_log"); } >>"$out"
    fi
    finish "the run was stopped by SIG$1 during ${current:-the setup}" "the run was stopped by SIG$1"
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

run_limited() {  # run_limited SECONDS LOG CMD...: CMD under `timeout`, its output in LOG; sets rc
    current_log=$2
    # (at least 1 s: `timeout 0` would mean no limit at all)
    timeout -k 5 "$(($1 > 0 ? $1 : 1))" "${@:3}" >"$2" 2>&1 &
    child=$!
    wait "$child"
    rc=$?
    child=""
}

fail() {  # a setup step failed: every stage is not run, and the run ends
    finish "$*" "the setup failed (RESULT says why)"
}

{
    echo "# GPU checks on ${device%%,*} ($(date +%F))"
    echo
    echo "Recorded: **date** $(date -Iseconds); **commit** $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
        "($(git status --porcelain 2>/dev/null | wc -l | tr -d ' ') files changed); **machine** $device," \
        "host $(hostname); **load** not recorded (a lent machine, nothing else started by this run);" \
        "**command** \`ops/gpu/run_gpu_checks.sh\` (TOTAL_BUDGET=${TOTAL_BUDGET:-300})"
    echo
} >"$out"

# ---- install, offline
wheelhouse=${WHEELHOUSE-ops/gpu/wheelhouse}
install_project=${INSTALL_PROJECT:-wheel}
if [ -n "$wheelhouse" ]; then
    current="the install"
    echo "## Install from $wheelhouse (offline)" >>"$out"
    echo >>"$out"
    [ -f "$wheelhouse/requirements.txt" ] || fail "no wheelhouse at $wheelhouse (build it with ops/gpu/build_wheelhouse.py where a registry is reachable, and carry it), or set WHEELHOUSE= to use what is installed"
    [ -f "$wheelhouse/MANIFEST.txt" ] && tail -n 1 "$wheelhouse/MANIFEST.txt" >>"$out"
    pip_install=("$PYTHON" -m pip install --no-index --find-links "$wheelhouse" --no-cache-dir --disable-pip-version-check)
    run_limited "$(limit "${INSTALL_TIMEOUT:-60}")" "$log.1" "${pip_install[@]}" -r "$wheelhouse/requirements.txt"
    cat "$log.1" >>"$log"
    if [ $rc -ne 0 ]; then
        fenced <(tail -n 15 "$log") >>"$out"
        fail "pip could not install $wheelhouse/requirements.txt offline (see $log)"
    fi
    case "$install_project" in
        wheel)
            whl=$(ls "$wheelhouse"/memory_broker-*.whl 2>/dev/null | head -n 1)
            [ -n "$whl" ] || fail "the project's wheel is missing from $wheelhouse"
            run_limited "$(limit "${INSTALL_TIMEOUT:-60}")" "$log.2" "${pip_install[@]}" --no-deps --force-reinstall "$whl"
            cat "$log.2" >>"$log"
            [ $rc -eq 0 ] || fail "pip could not install $whl (see $log)"
            ;;
        editable)
            run_limited "$(limit "${INSTALL_TIMEOUT:-60}")" "$log.2" "${pip_install[@]}" --no-deps --no-build-isolation -e .
            cat "$log.2" >>"$log"
            [ $rc -eq 0 ] || fail "pip could not install this checkout editable (see $log)"
            ;;
        none) ;;
        *) fail "INSTALL_PROJECT=$install_project: use wheel, editable or none" ;;
    esac
    echo "installed: $(grep -E '^Successfully installed' "$log" | tr '\n' ' ' || true)" >>"$out"
    echo >>"$out"
fi
current="the setup"

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

sw="$runs/software.txt"
{
    timeout "$(limit 60)" "$PYTHON" - <<'PY' 2>&1
import platform
print(f"python: {platform.python_version()}")
for name in ("torch", "triton", "cuda-bindings", "grpcio", "protobuf", "numpy", "transformers", "peft", "pytest-timeout", "memory-broker"):
    try:
        from importlib.metadata import version
        print(f"{name}: {version(name)}")
    except Exception as e:
        print(f"{name}: not installed ({type(e).__name__})")
try:
    from memory_broker.proto.wire import native
    core = native.load(native.STEPCORE)
    print("native step core: " + ("built" if core is not None else "not built (the Python path runs)"))
except Exception as e:
    print(f"native step core: unknown ({type(e).__name__})")
PY
    if [ -f "$vllm_ops/MANIFEST.json" ]; then
        echo "vLLM LoRA ops: $(timeout 30 "$PYTHON" -c 'import json, sys; m = json.load(open(sys.argv[1])); print(m["vllm_version"], "from", m["source"])' "$vllm_ops/MANIFEST.json" 2>&1) ($vllm_ops)"
    else
        echo "vLLM LoRA ops: none at $vllm_ops (run ops/gpu/extract_vllm_lora_ops.py where vLLM is installed, and carry the folder)"
    fi
} >"$sw"
{ echo "## Software"; echo; fenced "$sw"; } >>"$out"

# ---- can the CUDA arena run here?
current="the preflight"
run_limited "$(limit "${PREFLIGHT_TIMEOUT:-45}")" "$runs/preflight.txt" "$PYTHON" ops/gpu/gpu_ready.py preflight
preflight_rc=$rc
is_cut $rc && echo "TIMED OUT: the preflight (cut by its time limit)" >>"$runs/preflight.txt"
{ echo "## Preflight"; echo; fenced "$runs/preflight.txt"; } >>"$out"
if [ $preflight_rc -ne 0 ] && grep -q '^NOT READY: no GPU on this machine' "$runs/preflight.txt"; then
    fail "$(grep -m1 '^NOT READY: ' "$runs/preflight.txt" | sed 's/^NOT READY: //')"
fi
if [ $preflight_rc -ne 0 ]; then
    why=$(grep '^NOT READY: ' "$runs/preflight.txt" | sed 's/^NOT READY: //' | paste -sd ';' -)
    fails+=("${why:-the preflight failed (exit $preflight_rc)}")
fi

# ---- the stages: each ends by a deadline, its share of what is left of the budget
shares=("${PROBE_SHARE:-15}" "${ARENA_SHARE:-30}" "${BENCH_SHARE:-22}" "${KERNELS_SHARE:-20}" "${REST_SHARE:-13}")
share_sum=0
for s in "${shares[@]}"; do share_sum=$((share_sum + s)); done
stages_start=$SECONDS
stages_end=$((budget_end - ${END_RESERVE:-10}))
cum=0
deadline=$stages_start
left() { echo $((deadline - SECONDS)); }
stage_begin() {  # stage_begin INDEX NAME TITLE: its heading and deadline; false when it has no time left
    cum=$((cum + shares[$1]))
    deadline=$((stages_start + (stages_end - stages_start) * cum / share_sum))
    current="stage $1 ($2)"
    current_stage=$2
    current_log=""
    stage_t0=$SECONDS
    secs=$(left)
    printf '## Stage %s, %s: %s\n\nbudget: %s s\n\n' "$1" "$2" "$3" "$secs" >>"$out"
    echo "stage $1 ($2): $3, budget $secs s"
    if [ "$secs" -lt 3 ]; then
        verdict "$2" "not run: no time left in the budget (TOTAL_BUDGET=${TOTAL_BUDGET:-300})"
        case $2 in
            PROBE | BENCH) notes+=("stage $1 ($2): no time left") ;;
            *) fails+=("stage $1 ($2) had no time left in the budget") ;;
        esac
        return 1
    fi
}

# pytest_stage TAG LABEL SECONDS MUST_RUN KEXPR LIST FILE...: the files' tests (those KEXPR selects, if
# set), then sets v, the verdict's text; LIST=list writes each test's outcome, not only the failures.
pytest_stage() {
    local tag=$1 label=$2 secs=$3 must=$4 kexpr=$5 listing=()
    [ "$6" = list ] && listing=(--list)
    shift 6
    local junit="$runs/$tag.junit.xml" tlog="$runs/$tag.log" sel=() cut=() summary
    [ -n "$kexpr" ] && sel=(-k "$kexpr")
    rm -f "$junit"
    current_junit=$junit current_label=$label current_must=$must
    run_limited "$secs" "$tlog" env PYTHONPATH="ops/gpu${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -u -m pytest -v -rA \
        -p no:cacheprovider -p live_junit --live-junit "$junit" --timeout "${PER_TEST_TIMEOUT:-60}" ${sel[@]+"${sel[@]}"} "$@"
    current_junit=""
    is_cut $rc && cut=(--cut "by its $secs s budget")
    # shellcheck disable=SC2086
    timeout 60 "$PYTHON" ops/gpu/gpu_ready.py verdict "$junit" --must-run $must --label "$label" \
        ${cut[@]+"${cut[@]}"} ${listing[@]+"${listing[@]}"} --pytest-exit "$rc" >"$runs/$tag.verdict" 2>&1
    summary=$(grep -E '^=+ .* in [0-9.]+s' "$tlog" | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//')
    is_cut $rc && summary="cut by its $secs s budget"
    {
        echo '```text'
        echo "pytest ${kexpr:+-k \"$kexpr\" }$* ($((SECONDS - stage_t0)) s, exit $rc): ${summary:-no summary (see $tlog)}"
        grep -v "^$label: " "$runs/$tag.verdict"
        echo '```'
        echo
    } >>"$out"
    v=$(grep -m1 "^$label: " "$runs/$tag.verdict" | sed "s/^$label: //")
    [ -n "$v" ] || v="NOT A PASS: no verdict ($(tail -n 1 "$runs/$tag.verdict"))"
}

bench_run() {  # bench_run TAG SECONDS SCRIPT ARG...: a benchmark, its tables into the results file; sets bv
    local tag=$1 secs=$2
    shift 2
    local blog="$runs/$tag.txt"
    run_limited "$secs" "$blog" "$PYTHON" -u "$@"
    echo "### \`$*\`" >>"$out"
    echo >>"$out"
    if is_cut $rc; then
        bv="not measured (cut by its $secs s budget)"
        { cat "$blog"; echo; echo "(cut by its $secs s budget: the rows above are what it measured)"; echo; } >>"$out"
    elif [ $rc -ne 0 ]; then
        bv="FAILED (exit $rc: $(tail -n 1 "$blog" | cut -c1-200))"
        fails+=("$* failed (exit $rc)")
        fenced "$blog" >>"$out"
    elif grep -q '^CUDA: not measured (' "$blog"; then
        bv="not measured (no usable CUDA: see its output)"
        { cat "$blog"; echo; } >>"$out"
    else
        bv="measured"
        { cat "$blog"; echo; } >>"$out"
    fi
}

# 0: the driver's open questions
if stage_begin 0 PROBE "the driver's open questions ($probe)"; then
    run_limited "$secs" "$runs/probe.txt" "$PYTHON" -u "$probe"
    fenced "$runs/probe.txt" >>"$out"
    answers=$(grep -cE '^Q[0-9]+ .*: (OK|FAILS) ' "$runs/probe.txt")
    failed=$(grep -cE '^Q[0-9]+ .*: FAILS ' "$runs/probe.txt")
    last=$(grep -E '^Q[0-9]+ ' "$runs/probe.txt" | tail -n 1 | cut -d' ' -f1)
    if is_cut $rc; then
        v="cut by its $secs s budget after $answers answers ($failed FAILS; the last: ${last:-none})"
        notes+=("the probe's questions after ${last:-its start}")
    elif grep -q '^PROBE4 DONE' "$runs/probe.txt"; then
        v="answered: $answers questions ($failed FAILS) in $((SECONDS - stage_t0)) s"
    elif grep -q '^PROBE4 NOT RUN: ' "$runs/probe.txt"; then
        v="not run: $(grep -m1 '^PROBE4 NOT RUN: ' "$runs/probe.txt" | sed 's/^PROBE4 NOT RUN: //')"
        notes+=("the probe")
    else
        v="stopped (exit $rc) after $answers answers: $(tail -n 1 "$runs/probe.txt" | cut -c1-200)"
        notes+=("the probe's questions after ${last:-its start}")
    fi
    verdict PROBE "$v"
fi

# 1: the CUDA arena's tests
if stage_begin 1 ARENA "the CUDA arena's tests ($arena_tests${arena_select:+, -k \"$arena_select\"})"; then
    # shellcheck disable=SC2086
    pytest_stage arena "ARENA VERDICT" "$secs" "$arena_tests" "$arena_select" list $arena_tests
    case $v in PASS*) ;; *) fails+=("stage 1, the CUDA arena's tests: $v") ;; esac
    verdict ARENA "$v"
fi

# 2: the CUDA arena's benchmark, at 1,024 pages, then at the device's free memory
if stage_begin 2 BENCH "$arena_bench at 1,024 pages, then at the device's free memory"; then
    bench_run bench-1024 $((secs * 45 / 100)) "$arena_bench" --scales 1024 --reps "${BENCH_REPS:-50}"
    small=$bv
    if [ "$(left)" -ge 3 ]; then
        bench_run bench-free "$(left)" "$arena_bench" --scales free --tables attach
    else
        bv="not run: no time left in its budget"
    fi
    for b in "1,024 pages:$small" "the device's free memory:$bv"; do
        case ${b#*:} in not*) notes+=("$arena_bench at ${b%%:*}") ;; esac
    done
    verdict BENCH "1,024 pages: $small; the device's free memory: $bv"
fi

# 3: the kernels' and LoRA's GPU tests
if stage_begin 3 KERNELS "the kernels' and LoRA's GPU tests"; then
    if [ -n "${kernel_tests// /}" ]; then
        # shellcheck disable=SC2086
        pytest_stage kernels "KERNELS VERDICT" "$secs" "" "" - $kernel_tests
        case $v in PASS*) ;; *) fails+=("stage 3, the kernels' and LoRA's GPU tests: $v") ;; esac
    else
        v="no tests (KERNEL_TESTS is empty)"
    fi
    verdict KERNELS "$v"
fi

# 4: the rest: other GPU tests, then the other GPU benchmarks
if stage_begin 4 REST "the other GPU tests and benchmarks"; then
    parts=()
    if [ -n "${rest_tests// /}" ]; then
        # shellcheck disable=SC2086
        pytest_stage rest "rest tests" $((secs / 2)) "" "" - $rest_tests
        case $v in PASS*) ;; *) fails+=("stage 4, the other GPU tests: $v") ;; esac
        parts+=("tests: $v")
    fi
    # shellcheck disable=SC2086
    set -- $rest_benches
    while [ $# -gt 0 ]; do
        b=$1
        shift
        if [ "$(left)" -lt 3 ]; then
            parts+=("$(basename "$b"): not run: no time left in its budget")
            notes+=("$b")
            continue
        fi
        bench_args=()
        # The folder's absence is the benchmark's to report (one line); it runs on without it.
        [ "$(basename "$b")" = bench_lora_kernels.py ] && bench_args=(--vllm-ops "$vllm_ops")
        bench_run "rest-$(basename "$b" .py)" $(($(left) / ($# + 1))) "$b" ${bench_args[@]+"${bench_args[@]}"}
        parts+=("$(basename "$b"): $bv")
        case $bv in not*) notes+=("$b") ;; esac
    done
    [ ${#parts[@]} -gt 0 ] || parts=("nothing to run")
    verdict REST "$(printf '%s; ' "${parts[@]}" | sed 's/; $//')"
fi

current=""
finish
