"""The GPU run's tooling, checked without a GPU: the check script refuses to pass by skipping,
its verdicts name the reason, and the wheelhouse covers what the generated gRPC code needs.
"""

from __future__ import annotations

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
    so = "memory_broker/proto/wire/_stepcore.cpython-311-x86_64-linux-gnu.so"
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


def test_the_check_script_keeps_what_it_measured_when_steps_run_out_of_time(tmp_path):
    """Every step runs under its own time limit inside the run's budget, and results are
    appended as they are measured: a test run and a benchmark cut off mid-way leave their
    lines in the results file, each step says it timed out, and the run fails, in seconds.
    (PYTHON is a stand-in that passes the preflight, prints a test line or a table, then
    hangs; on a GPU machine the same limits keep the whole run under 8 minutes.)"""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/bash\n"
        'case "$*" in\n'
        '  *"gpu_ready.py preflight"*) echo "READY: a stand-in GPU"; exit 0 ;;\n'
        '  *"gpu_ready.py verdict"*) echo "NOT A PASS: no junit from a stand-in"; exit 1 ;;\n'
        "  *--collect-only*) exit 0 ;;\n"
        '  *"-m pytest"*) echo "tests/test_gpu_x.py::test_one PASSED [ 50%]"; exec sleep 300 ;;\n'
        '  *bench_fake*) echo "### A table measured before the cut"; echo "| row | 1.0 |"; exec sleep 300 ;;\n'
        '  "-") cat >/dev/null; exit 0 ;;\n'
        "  *) exit 0 ;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    out = tmp_path / "results.txt"
    env = {
        **os.environ,
        "WHEELHOUSE": "",
        "PYTHON": str(fake),
        "GPU_TESTS": "tests/test_gpu_x.py",
        "GPU_BENCHES": "ops/bench/bench_fake.py",
        "TEST_TIMEOUT": "3",
        "BENCH_TIMEOUT": "3",
        "TOTAL_BUDGET": "60",
    }
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", os.path.join(GPU, "run_gpu_checks.sh"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    took = time.monotonic() - t0
    text = out.read_text()
    assert r.returncode == 1 and took < 40, (took, r.stdout, r.stderr)
    assert "tests/test_gpu_x.py::test_one PASSED" in text
    assert "TIMED OUT: the GPU tests after 3 s" in text
    assert "### A table measured before the cut" in text and "| row | 1.0 |" in text
    assert "TIMED OUT: ops/bench/bench_fake.py" in text
    assert text.index("test_one PASSED") < text.index("TIMED OUT: the GPU tests") < text.index("### A table")
    assert text.rstrip().splitlines()[-1].startswith("RESULT: FAIL:") and "RESULT: PASS" not in text
