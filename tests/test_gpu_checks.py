"""The GPU run's tooling, checked without a GPU: the check script refuses to pass by skipping,
its verdicts name the reason, its stages keep within their budgets and say what they measured
when one is cut, the driver probe fails cleanly where it cannot run, and the wheelhouse covers
what the generated gRPC code needs.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(ROOT, "ops", "gpu")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(GPU, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


gpu_ready = _load("gpu_ready")


def test_the_check_script_fails_without_a_gpu_instead_of_passing_by_skipping(tmp_path):
    if gpu_ready.gather().gpus:
        pytest.skip("this machine has a GPU: the dry run is for machines without one")
    out = tmp_path / "results.txt"
    # Nothing to install here; this interpreter (the script's default, .venv's, may not exist).
    env = {**os.environ, "WHEELHOUSE": "", "PYTHON": sys.executable}
    r = subprocess.run(
        ["bash", os.path.join(GPU, "run_gpu_checks.sh"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "RESULT: FAIL: no GPU on this machine" in r.stdout
    text = out.read_text()
    assert "## Preflight" in text and "cuda arena: UNAVAILABLE" in text
    assert text.rstrip().splitlines()[-1].startswith("RESULT: FAIL: no GPU on this machine")
    assert "RESULT: PASS" not in text
    for stage in ("PROBE", "ARENA", "BENCH", "KERNELS", "REST"):
        assert f"{stage} VERDICT: not run: the setup failed (RESULT says why)" in text


def test_the_check_script_refuses_a_missing_wheelhouse(tmp_path):
    out = tmp_path / "results.txt"
    env = {**os.environ, "WHEELHOUSE": str(tmp_path / "nowhere")}
    r = subprocess.run(
        ["bash", os.path.join(GPU, "run_gpu_checks.sh"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert f"no wheelhouse at {tmp_path / 'nowhere'}" in out.read_text()


def _facts(**kw):
    base = dict(
        gpus=["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-x)"],
        driver_cuda=13000,
        bindings="13.4.4",
        arena=(True, "CUDA device 0 supports VMM with POSIX fds"),
        torch_cuda=True,
        torch_version="2.11.0",
    )
    base.update(kw)
    return gpu_ready.Facts(**base)


def test_preflight_passes_only_with_a_usable_gpu_and_names_each_reason():
    assert gpu_ready.problems(_facts()) == []
    (why,) = gpu_ready.problems(_facts(gpus=[]))
    assert why.startswith("no GPU on this machine")
    # A GPU the arena cannot use: cuda-bindings 13 on a CUDA 12.8 driver.
    why = gpu_ready.problems(_facts(driver_cuda=12080, arena=(False, "no usable CUDA driver (cuInit: CUDA_ERROR_X)")))
    assert any("cuda-bindings 13.4.4 needs a CUDA 13 driver, but this driver supports CUDA 12.8" in w for w in why)
    assert any(w == "the CUDA arena is unavailable: no usable CUDA driver (cuInit: CUDA_ERROR_X)" for w in why)
    assert gpu_ready.problems(_facts(torch_cuda=False)) == ["torch 2.11.0 sees no CUDA device"]
    assert gpu_ready.problems(_facts(bindings=None))[0].startswith("cuda-python (cuda.bindings) is not importable")


def _junit(tmp_path, cases):
    body = []
    for cls, name, kind in cases:
        inner = {
            "pass": "",
            "skip": '<skipped message="needs a CUDA device (no CUDA driver)"/>',
            "fail": '<failure message="boom"/>',
        }[kind]
        body.append(f'<testcase classname="{cls}" name="{name}">{inner}</testcase>')
    p = tmp_path / "junit.xml"
    p.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(body)}</testsuite></testsuites>')
    return str(p)


def test_a_run_whose_gpu_tests_all_skipped_is_not_a_pass(tmp_path, capsys):
    skipped = _junit(
        tmp_path,
        [
            ("tests.test_gpu_arena", "test_a", "skip"),
            ("tests.test_gpu_arena", "test_b", "skip"),
            ("tests.test_arena_cuda", "test_fake", "pass"),
        ],
    )
    assert gpu_ready.main(["verdict", skipped]) == 1
    out = capsys.readouterr().out
    assert "tests/test_gpu_arena.py: 0 passed, 0 failed, 2 skipped" in out
    assert (
        "NOT A PASS: tests/test_gpu_arena.py ran no test: the CUDA arena did not run (test_a: needs a CUDA device"
        in out
    )


def test_verdicts_on_partial_skips_failures_and_a_full_pass(tmp_path):
    tally = gpu_ready.tally
    partial = tally(_junit(tmp_path, [("tests.test_gpu_arena", "a", "pass"), ("tests.test_gpu_arena", "b", "skip")]))
    assert gpu_ready.verdict_problems(partial) == [
        "tests/test_gpu_arena.py skipped 1 test(s) on a GPU run: b: needs a CUDA device (no CUDA driver)"
    ]
    failed = tally(_junit(tmp_path, [("tests.test_gpu_arena", "a", "pass"), ("tests.test_kernels.TestX", "k", "fail")]))
    assert gpu_ready.verdict_problems(failed) == ["1 test(s) failed or errored"]
    assert set(failed) == {"tests/test_gpu_arena.py", "tests/test_kernels.py"}
    ok = tally(_junit(tmp_path, [("tests.test_gpu_arena", "a", "pass"), ("tests.test_kernels", "k", "pass")]))
    assert gpu_ready.verdict_problems(ok) == []


def test_a_skipped_cuda_graph_capture_test_on_a_gpu_run_is_not_a_pass(tmp_path):
    cases = [("tests.test_gpu_arena", "a", "pass"), ("tests.test_kernels_graph", "logic", "pass")]
    skipped = gpu_ready.tally(_junit(tmp_path, [*cases, ("tests.test_kernels_graph", "captured", "skip")]))
    assert gpu_ready.verdict_problems(skipped) == [
        "tests/test_kernels_graph.py skipped 1 test(s) on a GPU run (CUDA-graph capture): captured: needs a CUDA "
        "device (no CUDA driver)"
    ]
    ran = gpu_ready.tally(_junit(tmp_path, [*cases, ("tests.test_lora_static", "captured", "pass")]))
    assert gpu_ready.verdict_problems(ran) == []


# ----------------------------------------------------------------- the wheelhouse

wheelhouse = _load("build_wheelhouse")


def _generated_minimums() -> tuple[tuple[int, ...], tuple[int, ...]]:
    pb2 = open(os.path.join(ROOT, "proto", "wire", "v1", "broker_pb2.py")).read()
    m = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb2
    )
    grpc_py = open(os.path.join(ROOT, "proto", "wire", "v1", "broker_pb2_grpc.py")).read()
    g = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_py)
    return tuple(int(x) for x in m.groups()), tuple(int(x) for x in g.group(1).split("."))


def test_the_wheelhouse_ranges_admit_nothing_older_than_the_generated_code_needs():
    from packaging.version import Version

    reqs = {r.name: r for r in wheelhouse.read_requirements(os.path.join(GPU, "wheelhouse.in"))}
    pb_min, grpc_min = _generated_minimums()
    below = lambda v: Version(".".join(map(str, v[:-1] + (v[-1] - 1,))) if v[-1] else f"{v[0]}.{v[1] - 1}.999")  # noqa: E731
    assert not reqs["protobuf"].specifier.contains(below(pb_min))
    assert not reqs["protobuf"].specifier.contains(f"{pb_min[0] + 1}.0.0")  # the gencode's major only
    assert not reqs["grpcio"].specifier.contains(below(grpc_min))
    for name in ("grpcio-health-checking", "grpcio-reflection"):
        assert not reqs[name].specifier.contains(below(grpc_min))
    # What is downloaded is what this venv runs, and it is inside the ranges.
    pins = dict(p.split("==") for p in wheelhouse.pins(list(reqs.values())))
    assert set(pins) == set(reqs)


def _fake_wheel(folder, name, version, requires=()):
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(
            f"{name.replace('-', '_')}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n{meta}"
        )
    return path


def test_the_closure_check_names_what_neither_the_folder_nor_the_machine_has(tmp_path):
    _fake_wheel(
        tmp_path,
        "opentelemetry-sdk",
        "1.45.2",
        ["opentelemetry-api==1.45.2", "typing-extensions>=4.5.0", "importlib-metadata>=6; python_version < '3.10'"],
    )
    _fake_wheel(tmp_path, "opentelemetry-api", "1.45.2", ["typing-extensions>=4.5.0"])
    _fake_wheel(tmp_path, "structlog", "26.1.0", ["extra-thing; extra == 'dev'"])
    machine = {"typing-extensions": None, "numpy": "2.5.2"}
    assert wheelhouse.unmet(str(tmp_path), machine, "3.12") == []
    _fake_wheel(tmp_path, "memory-broker", "0.1.0", ["numpy>=3", "grpcio>=1.85.1"])
    got = wheelhouse.unmet(str(tmp_path), machine, "3.12")
    assert got == [
        "memory_broker-0.1.0-py3-none-any.whl needs numpy>=3; the GPU machine has numpy 2.5.2",
        "memory_broker-0.1.0-py3-none-any.whl needs grpcio>=1.85.1: neither in the folder nor on the GPU machine",
    ]


def test_a_wheel_built_for_another_python_loses_its_native_core_and_installs_anywhere(tmp_path):
    # Built by this venv's CPython 3.11 when no 3.12 is here: the GPU machine's pip would refuse a
    # cp311 wheel, so the native step core goes (its Python path runs) and the wheel is pure.
    built = tmp_path / "memory_broker-0.1.0-cp311-cp311-linux_x86_64.whl"
    info = "memory_broker-0.1.0.dist-info"
    so = "memory_broker/_native/_stepcore.cpython-311-x86_64-linux-gnu.so"
    with zipfile.ZipFile(built, "w") as z:
        z.writestr("memory_broker/proto/wire/native.py", "x = 1\n")
        z.writestr(so, b"\x7fELF")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp311-cp311-linux_x86_64\n")
        z.writestr(
            f"{info}/RECORD", f"memory_broker/proto/wire/native.py,sha256=x,6\n{so},sha256=y,4\n{info}/RECORD,,\n"
        )
    out = wheelhouse.purify(str(built))
    assert os.path.basename(out) == "memory_broker-0.1.0-py3-none-any.whl" and not built.exists()
    with zipfile.ZipFile(out) as z:
        names = z.namelist()
        wheel_meta = z.read(f"{info}/WHEEL").decode()
        record = z.read(f"{info}/RECORD").decode()
    assert so not in names and "memory_broker/proto/wire/native.py" in names
    assert "Tag: py3-none-any" in wheel_meta and "Root-Is-Purelib: true" in wheel_meta and "cp311" not in wheel_meta
    assert ".so," not in record and "native.py" in record


def _stand_in(tmp_path, cut: bool):
    """A stand-in python for the check script: the preflight passes; pytest and the verdicts are
    this interpreter's (over stand-in test files); the probe and the benchmarks print a few lines,
    then, with ``cut``, hang (the probe, and the arena benchmark at the device's free memory)."""
    hang = "exec sleep 300" if cut else "exit 0"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/bash\n"
        'case "$*" in\n'
        '  *"gpu_ready.py preflight"*) echo "READY: a stand-in GPU"; exit 0 ;;\n'
        f'  *"gpu_ready.py verdict"* | *"-m pytest"*) exec {sys.executable} "$@" ;;\n'
        '  *vmm_probe4.py*) echo "Q1 one page, two VAs, RW+RO: OK 3/1 (4 ms)"; '
        'echo "Q2 same-process import: FAILS RuntimeError: CUDA_ERROR_X"; '
        f"{'' if cut else 'echo PROBE4 DONE; '}{hang} ;;\n"
        '  *"--scales 1024"*) echo "### Attach at 1024"; echo; echo "| cuda | 1024 | 0.5 |"; exit 0 ;;\n'
        f'  *"--scales free"*) echo "### Attach at free memory"; echo; echo "| cuda | 36000 (free) |"; {hang} ;;\n'
        '  *bench_boom*) echo "Traceback: boom"; exit 3 ;;\n'
        '  *bench_ok*) echo "| ok | 1.0 |"; exit 0 ;;\n'
        '  "-") cat >/dev/null; exit 0 ;;\n'
        "  *) exit 0 ;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    arena = tmp_path / "test_stand_arena.py"
    arena.write_text(
        "import time\n\n\ndef test_one_passes():\n    pass\n\n\n"
        + ("def test_two_hangs():\n    time.sleep(600)\n\n\n" if cut else "")
        + "def test_three():\n    pass\n"
    )
    kernels = tmp_path / "test_stand_kernels.py"
    kernels.write_text("def test_kernel():\n    pass\n")
    return {
        **os.environ,
        "WHEELHOUSE": "",
        "PYTHON": str(fake),
        "ARENA_TESTS": str(arena),
        "KERNEL_TESTS": str(kernels),
        "REST_TESTS": "",
        "PER_TEST_TIMEOUT": "200",
    }


def _run_checks(env, out, timeout):
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", os.path.join(GPU, "run_gpu_checks.sh"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r, time.monotonic() - t0


def test_the_staged_run_shares_a_300_s_budget_and_passes_when_every_stage_does(tmp_path):
    """With nothing cut (stand-ins for the GPU's work), every stage prints its verdict line, the
    stages share the default 300 s budget (the probe's share first: 15 of 100 of what the setup
    left, less 10 s kept for the end) and the results file ends with the verdicts and a pass."""
    env = {**_stand_in(tmp_path, cut=False), "REST_BENCHES": "ops/bench/bench_ok.py"}
    env.pop("TOTAL_BUDGET", None)
    out = tmp_path / "results.md"
    r, took = _run_checks(env, out, 120)
    assert r.returncode == 0, r.stdout + r.stderr
    budgets = [int(b) for b in re.findall(r"^stage \d \(\w+\): .*, budget (\d+) s$", r.stdout, re.M)]
    assert len(budgets) == 5 and 36 <= budgets[0] <= 44 and max(budgets) <= 290, r.stdout
    text = out.read_text()
    assert text.startswith("# GPU checks on ") and "\nRecorded: **date** " in text
    for line in (
        "PROBE VERDICT: answered: 2 questions (1 FAILS)",
        "ARENA VERDICT: PASS: 2 passed",
        "BENCH VERDICT: 1,024 pages: measured; the device's free memory: measured",
        "KERNELS VERDICT: PASS: 1 passed",
        "REST VERDICT: bench_ok.py: measured",
    ):
        assert line in r.stdout and line in text, line
    assert "| cuda | 1024 | 0.5 |" in text and "| cuda | 36000 (free) |" in text and "| ok | 1.0 |" in text
    assert text.rstrip().splitlines()[-1] == "RESULT: PASS: the CUDA arena ran and every GPU test passed"
    assert took < 90


def test_a_cut_stage_says_so_and_the_next_stages_still_run_within_the_budget(tmp_path):
    """Every stage runs within its share of TOTAL_BUDGET: the probe hangs after two answers and
    is cut; the arena's pytest hangs in its second test and is cut, and its junit (written after
    each test, since a killed pytest writes none) says what passed and what never ran; the arena
    benchmark at the device's free memory hangs and is "not measured", beside the measured run
    at 1,024 pages; the kernels' stage and the rest still run (a benchmark that exits with an
    error is a failure). The results file keeps all of it, and the run ends within the budget."""
    env = {
        **_stand_in(tmp_path, cut=True),
        "REST_BENCHES": "ops/bench/bench_boom.py ops/bench/bench_ok.py",
        "TOTAL_BUDGET": "40",
        "END_RESERVE": "5",
        "PROBE_SHARE": "9",
        "ARENA_SHARE": "29",
        "BENCH_SHARE": "14",
        "KERNELS_SHARE": "30",
        "REST_SHARE": "18",
    }
    out = tmp_path / "results.md"
    r, took = _run_checks(env, out, 90)
    text = out.read_text()
    assert r.returncode == 1 and took < 43, (took, r.stdout, r.stderr)
    probe = re.search(r"^PROBE VERDICT: cut by its \d+ s budget after 2 answers \(1 FAILS; the last: Q2\)$", text, re.M)
    assert probe and "Q1 one page, two VAs, RW+RO: OK 3/1" in text
    arena = re.search(
        r"^ARENA VERDICT: NOT A PASS: cut by its \d+ s budget: 2 test\(s\) not run \(first: test_two_hangs: not finished",
        text,
        re.M,
    )
    assert arena, text
    assert "  PASSED " in text and "test_stand_arena.py::test_one_passes" in text
    assert "test_stand_arena.py::test_three: not run: the run ended before it" in text
    # The junit of stage 1 survived the cut pytest.
    junit = tmp_path / "results-logs" / "arena.junit.xml"
    counts = gpu_ready.tally(str(junit))
    (t,) = counts.values()
    assert (t.passed, t.failed, t.not_run) == (1, 0, 2)
    bench = re.search(
        r"^BENCH VERDICT: 1,024 pages: measured; the device's free memory: not measured \(cut by its \d+ s budget\)$",
        text,
        re.M,
    )
    assert bench and "| cuda | 1024 | 0.5 |" in text and "| cuda | 36000 (free) |" in text
    assert "KERNELS VERDICT: PASS: 1 passed" in text
    assert "REST VERDICT: bench_boom.py: FAILED (exit 3: Traceback: boom); bench_ok.py: measured" in text
    last = text.rstrip().splitlines()[-1]
    assert last.startswith("RESULT: FAIL: stage 1, the CUDA arena's tests: NOT A PASS: cut by its"), last
    assert (
        "ops/bench/bench_boom.py failed (exit 3)" in last
        and "bench_cuda_arena.py" not in last.split("(not measured:")[0]
    )
    assert (
        "not measured: the probe's questions after Q2; ops/bench/bench_cuda_arena.py at the device's free memory"
        in last
    )
    # Each stage's verdict line, in order, in the file and on stdout.
    order = [text.index(f"{s} VERDICT:") for s in ("PROBE", "ARENA", "BENCH", "KERNELS", "REST")]
    assert order == sorted(order) and all(f"{s} VERDICT:" in r.stdout for s in ("PROBE", "ARENA", "KERNELS"))


def test_a_verdict_names_the_tests_a_cut_run_never_ran(tmp_path):
    p = tmp_path / "live.xml"
    p.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu_arena" name="a[cuda]" file="tests/test_gpu_arena.py"/>'
        '<testcase classname="tests.test_gpu_arena" name="b[cuda]" file="tests/test_gpu_arena.py">'
        '<skipped type="notrun" message="not finished: it was running when the run ended"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts = gpu_ready.tally(str(p))
    assert counts["tests/test_gpu_arena.py"].not_run == 1
    assert gpu_ready.verdict_problems(counts, cut="by its 80 s budget") == [
        "cut by its 80 s budget: 1 test(s) not run (first: b[cuda]: not finished: it was running when the run ended)"
    ]
    assert gpu_ready.verdict_problems(counts) == ["1 test(s) not run"]


# ----------------------------------------------------------------- the driver probe (stage 0)

PROBE = os.path.join(GPU, "vmm_probe4.py")


def test_the_probe_compiles_and_says_in_one_line_why_it_cannot_run_here():
    if gpu_ready.gather().driver_cuda is not None:
        pytest.skip("this machine has a CUDA driver: the probe would run")
    r = subprocess.run([sys.executable, PROBE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    (line,) = r.stdout.splitlines()
    assert line.startswith("PROBE4 NOT RUN: ") and ("driver" in line or "cuda-bindings" in line), line


def test_the_probe_calls_only_what_the_installed_bindings_have_with_their_arity():
    """Written without a GPU, the probe is checked against cuda-bindings' own signatures: every
    ``cu.X`` it names exists, and every driver call passes as many arguments as the call takes."""
    cu = pytest.importorskip("cuda.bindings.driver")
    tree = ast.parse(open(PROBE).read())
    missing, arity = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, x = [], node
            while isinstance(x, ast.Attribute):
                chain.append(x.attr)
                x = x.value
            if isinstance(x, ast.Name) and x.id == "cu":
                obj = cu
                for part in reversed(chain):
                    if not hasattr(obj, part):
                        missing.append(".".join(reversed(chain)))
                        break
                    obj = getattr(obj, part)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if isinstance(f.value, ast.Name) and f.value.id == "cu" and f.attr.startswith("cu"):
                sig = re.match(rf"{f.attr}\((.*)\)$", (getattr(cu, f.attr).__doc__ or "").partition("\n")[0])
                assert sig, f"cu.{f.attr} has no signature in its docstring"
                want = len([p for p in sig.group(1).split(",") if p.strip()])
                if want != len(node.args) or node.keywords:
                    arity.append(f"line {node.lineno}: cu.{f.attr} takes {want}, given {len(node.args)}")
    assert not missing and not arity, (missing, arity)


def test_each_unverified_rule_of_the_fake_driver_names_a_question_the_probe_asks():
    """tests/test_arena_cuda.py's FakeDriver.UNVERIFIED: the fake's guesses (the export error at
    the fd limit, refusing one unmap over a run of mappings), each with the probe's question."""
    src = open(os.path.join(ROOT, "tests", "test_arena_cuda.py")).read()
    fake = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "FakeDriver")
    table = next(
        ast.literal_eval(n.value)
        for n in fake.body
        if isinstance(n, ast.Assign) and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["UNVERIFIED"]
    )
    assert sorted(table.values()) == ["Q4", "Q8"]
    assert any("fd limit" in rule and "CUDA_ERROR_OPERATING_SYSTEM" in rule for rule in table)
    assert any(rule.startswith("cuMemUnmap over a run") for rule in table)
    asked = re.findall(r'\("(Q\d+) [^"]*", q\d+\)', open(PROBE).read())
    assert set(table.values()) <= set(asked), asked
