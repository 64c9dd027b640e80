#!/usr/bin/env python3
"""The GPU check's verdicts: whether this machine can run the CUDA arena (``preflight``), and
whether a pytest run of the GPU tests really ran them (``verdict``). run_gpu_checks.sh calls
both; either exits 1 with the reason as a sentence, so a run without a GPU, or with a GPU the
arena cannot use (a cuda-python/driver major mismatch, say), fails instead of passing by
skipping.

    python3 ops/gpu/gpu_ready.py preflight
    python3 ops/gpu/gpu_ready.py verdict JUNIT_XML [--must-run tests/test_gpu_arena.py ...]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

# Test files that only mean something on a GPU: every test in them must run and pass.
MUST_RUN = ("tests/test_gpu_arena.py",)
# Test files whose GPU-only tests (a real CUDA-graph capture and replay) skip only without
# CUDA: where they ran, a skip on the GPU run is a failure (absent files are not).
NO_SKIP = ("tests/test_kernels_graph.py", "tests/test_lora_static.py")


@dataclass
class Facts:
    """What preflight found; ``None`` where a probe could not tell."""

    # GPUs nvidia-smi lists, or /dev/nvidiaN nodes when it is missing.
    gpus: list[str] = field(default_factory=list)
    # cuDriverGetVersion of libcuda.so.1 (e.g. 13000), None without a driver library.
    driver_cuda: int | None = None
    # cuda.bindings.__version__, None when cuda-python is not importable.
    bindings: str | None = None
    # broker.arena.cuda.cuda_available("0"): (usable, reason).
    arena: tuple[bool, str] = (False, "not probed")
    # torch.cuda.is_available() and torch.version.cuda.
    torch_cuda: bool = False
    torch_version: str = ""


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def problems(f: Facts) -> list[str]:
    """Why the CUDA arena cannot run here, as sentences; empty when it can."""
    if not f.gpus:
        return [
            "no GPU on this machine (nvidia-smi lists none and there is no /dev/nvidia0): "
            "the GPU checks cannot pass without one"
        ]
    out = []
    if f.bindings is None:
        out.append("cuda-python (cuda.bindings) is not importable: install cuda-bindings matching the driver")
    elif f.driver_cuda is not None:
        major = int(f.bindings.split(".")[0])
        if major > f.driver_cuda // 1000:
            out.append(
                f"cuda-bindings {f.bindings} needs a CUDA {major} driver, but this driver supports CUDA "
                f"{_cuda_version(f.driver_cuda)}: install cuda-bindings {f.driver_cuda // 1000}.x or a newer driver"
            )
    if f.driver_cuda is None:
        out.append(f"{len(f.gpus)} GPU(s) listed but libcuda.so.1 cannot be loaded or cuDriverGetVersion failed")
    if not f.arena[0]:
        out.append(f"the CUDA arena is unavailable: {f.arena[1]}")
    if not f.torch_cuda:
        out.append(f"torch {f.torch_version or '(not importable)'} sees no CUDA device")
    return out


def gather() -> Facts:
    f = Facts()
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
        f.gpus = [ln.strip() for ln in r.stdout.splitlines() if ln.startswith("GPU ")]
    if not f.gpus:
        f.gpus = sorted(p for p in glob.glob("/dev/nvidia[0-9]*"))
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            f.driver_cuda = v.value
    except OSError:
        pass
    try:
        import cuda.bindings

        f.bindings = str(cuda.bindings.__version__)
    except Exception:
        pass
    try:
        from memory_broker.broker.arena.cuda import cuda_available

        f.arena = cuda_available("0")
    except Exception as e:  # an import error is itself the reason
        f.arena = (False, f"memory_broker.broker.arena.cuda does not import ({type(e).__name__}: {e})")
    try:
        import torch

        f.torch_version = f"{torch.__version__} (CUDA {torch.version.cuda})"
        f.torch_cuda = bool(torch.cuda.is_available())
    except Exception as e:
        f.torch_version = f"(not importable: {e})"
    return f


def preflight() -> int:
    f = gather()
    print(f"gpus: {'; '.join(f.gpus) or 'none'}")
    print(f"driver CUDA version: {_cuda_version(f.driver_cuda) if f.driver_cuda else 'unknown (no libcuda.so.1)'}")
    print(f"cuda-bindings: {f.bindings or 'not importable'}")
    print(f"torch: {f.torch_version} cuda available: {f.torch_cuda}")
    print(f"cuda arena: {'usable' if f.arena[0] else 'UNAVAILABLE'}: {f.arena[1]}")
    why = problems(f)
    for w in why:
        print(f"NOT READY: {w}")
    return 1 if why else 0


@dataclass
class Tally:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    skips: list[str] = field(default_factory=list)


def tally(junit_xml: str) -> dict[str, Tally]:
    """Per test file (from the testcase's classname), what passed, failed and skipped."""
    out: dict[str, Tally] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        cls = case.get("classname", "")
        path = cls.replace(".", "/")
        # classname is "tests.test_x" (module) or "tests.test_x.TestClass": cut at the module.
        parts = cls.split(".")
        for i in range(len(parts), 0, -1):
            if parts[i - 1].startswith("test_"):
                path = "/".join(parts[:i]) + ".py"
                break
        t = out.setdefault(path, Tally())
        if case.find("failure") is not None or case.find("error") is not None:
            t.failed += 1
        elif case.find("skipped") is not None:
            t.skipped += 1
            s = case.find("skipped")
            t.skips.append(f"{case.get('name')}: {s.get('message', '')}")
        else:
            t.passed += 1
    return out


def verdict_problems(counts: dict[str, Tally], must_run: tuple[str, ...] = MUST_RUN) -> list[str]:
    """Why a run does not count as a pass; empty when it does."""
    out = []
    total = Tally()
    for t in counts.values():
        total.passed += t.passed
        total.failed += t.failed
        total.skipped += t.skipped
    if total.failed:
        out.append(f"{total.failed} test(s) failed or errored")
    if total.passed == 0:
        out.append(f"no test passed ({total.skipped} skipped): nothing ran on the GPU")
    for path in must_run:
        t = counts.get(path)
        if t is None or t.passed == 0:
            out.append(
                f"{path} ran no test: the CUDA arena did not run" + (f" ({t.skips[0]})" if t and t.skips else "")
            )
        elif t.skipped:
            out.append(f"{path} skipped {t.skipped} test(s) on a GPU run: {t.skips[0]}")
    for path in NO_SKIP:
        t = counts.get(path)
        if t is not None and path not in must_run and t.skipped:
            out.append(f"{path} skipped {t.skipped} test(s) on a GPU run (CUDA-graph capture): {t.skips[0]}")
    return out


def verdict(junit_xml: str, must_run: tuple[str, ...]) -> int:
    counts = tally(junit_xml)
    for path in sorted(counts):
        t = counts[path]
        print(f"{path}: {t.passed} passed, {t.failed} failed, {t.skipped} skipped")
    why = verdict_problems(counts, must_run)
    for w in why:
        print(f"NOT A PASS: {w}")
    return 1 if why else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("preflight", help="can the CUDA arena run here? exit 1 with the reason if not")
    v = sub.add_parser("verdict", help="did a pytest run (its --junitxml file) really run the GPU tests?")
    v.add_argument("junit_xml")
    v.add_argument("--must-run", nargs="*", default=list(MUST_RUN))
    args = ap.parse_args(argv)
    if args.cmd == "preflight":
        return preflight()
    return verdict(args.junit_xml, tuple(args.must_run))


if __name__ == "__main__":
    sys.exit(main())
