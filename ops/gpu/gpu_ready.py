#!/usr/bin/env python3
"""The GPU check's verdicts: whether this machine can run the CUDA arena (``preflight``), and
whether a pytest run of GPU tests really ran them (``verdict``). run_gpu_checks.sh calls both;
either exits 1 with the reason as a sentence, so a run without a GPU, or with a GPU the arena
cannot use (a cuda-python/driver major mismatch, say), fails instead of passing by skipping.

    python3 ops/gpu/gpu_ready.py preflight
    python3 ops/gpu/gpu_ready.py verdict JUNIT_XML [--must-run tests/test_gpu_arena.py ...]
        [--label "ARENA VERDICT"] [--cut SECONDS] [--pytest-exit RC]

``verdict`` reads pytest's junit or live_junit.py's (rewritten after every test, so it survives
a cut run and lists the tests that never ran); with ``--label`` it ends with one line,
``LABEL: PASS: ...`` or ``LABEL: NOT A PASS: ...``.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
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
    """One test file's results."""

    # (test name, outcome, message), in the run's order; outcome is "passed", "failed" (a failure
    # or an error), "skipped" or "not run" (collected, not finished when the run ended: a live
    # junit's <skipped type="notrun">).
    cases: list[tuple[str, str, str]] = field(default_factory=list)

    def named(self, outcome: str) -> list[str]:
        """``name: message`` of each test with this outcome."""
        return [f"{n}: {m}" if m else n for n, o, m in self.cases if o == outcome]

    @property
    def passed(self) -> int:
        return sum(o == "passed" for _, o, _ in self.cases)

    @property
    def failed(self) -> int:
        return sum(o == "failed" for _, o, _ in self.cases)

    @property
    def skipped(self) -> int:
        return sum(o == "skipped" for _, o, _ in self.cases)

    @property
    def not_run(self) -> int:
        return sum(o == "not run" for _, o, _ in self.cases)

    @property
    def skips(self) -> list[str]:
        return self.named("skipped")


def _norm(path: str) -> str:
    """A test file's path as the tallies key it: relative to the working directory."""
    return os.path.relpath(os.path.abspath(path))


def tally(junit_xml: str) -> dict[str, Tally]:
    """Per test file (the testcase's ``file``, else from its classname), what passed, failed,
    skipped and did not run."""
    out: dict[str, Tally] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        if case.get("file"):
            path = _norm(case.get("file"))
        else:
            cls = case.get("classname", "")
            path = cls.replace(".", "/")
            # classname is "tests.test_x" (module) or "tests.test_x.TestClass": cut at the module.
            parts = cls.split(".")
            for i in range(len(parts), 0, -1):
                if parts[i - 1].startswith("test_"):
                    path = "/".join(parts[:i]) + ".py"
                    break
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            outcome, message = "failed", (bad.get("message") or "").partition("\n")[0]
        elif skip is not None:
            outcome = "not run" if skip.get("type") == "notrun" else "skipped"
            message = skip.get("message", "")
        else:
            outcome, message = "passed", ""
        out.setdefault(path, Tally()).cases.append((case.get("name", ""), outcome, message))
    return out


def verdict_problems(
    counts: dict[str, Tally], must_run: tuple[str, ...] = MUST_RUN, cut: str | None = None
) -> list[str]:
    """Why a run does not count as a pass; empty when it does. ``cut``: what stopped the run
    before its end, if something did ("by its 90 s budget")."""
    out = []
    total = Tally([c for t in counts.values() for c in t.cases])
    if cut is not None:
        first = next(iter(total.named("not run")), None)
        out.append(f"cut {cut}: {total.not_run} test(s) not run" + (f" (first: {first})" if first else ""))
    elif total.not_run:
        out.append(f"{total.not_run} test(s) not run")
    if total.failed:
        out.append(f"{total.failed} test(s) failed or errored")
    if total.passed == 0:
        out.append(f"no test passed ({total.skipped} skipped): nothing ran on the GPU")
    for path in map(_norm, must_run):
        t = counts.get(path)
        if t is None or t.passed == 0:
            out.append(
                f"{path} ran no test: the CUDA arena did not run" + (f" ({t.skips[0]})" if t and t.skips else "")
            )
        elif t.skipped:
            out.append(f"{path} skipped {t.skipped} test(s) on a GPU run: {t.skips[0]}")
    for path in NO_SKIP:
        t = counts.get(path)
        if t is not None and path not in map(_norm, must_run) and t.skipped:
            out.append(f"{path} skipped {t.skipped} test(s) on a GPU run (CUDA-graph capture): {t.skips[0]}")
    return out


def verdict(
    junit_xml: str,
    must_run: tuple[str, ...],
    label: str | None = None,
    cut: str | None = None,
    pytest_exit: int | None = None,
    listing: bool = False,
) -> int:
    """Print the tallies per file (each test's outcome with ``listing``, else the failures), the
    reasons the run is not a pass, and with ``label`` the one verdict line; 1 unless a pass."""
    if os.path.exists(junit_xml):
        counts = tally(junit_xml)
        why = verdict_problems(counts, must_run, cut)
    else:
        counts = {}
        why = [f"pytest wrote no {junit_xml}" + (f" (exit {pytest_exit})" if pytest_exit is not None else "")]
    if pytest_exit not in (None, 0, 1) and cut is None and counts:
        why.append(f"pytest exited {pytest_exit}")  # 1 is failed tests, named above; 2-5 are pytest's own
    for path in sorted(counts):
        t = counts[path]
        print(
            f"{path}: {t.passed} passed, {t.failed} failed, {t.skipped} skipped"
            + (f", {t.not_run} not run" if t.not_run else "")
        )
        for name, outcome, message in t.cases:
            if listing or outcome == "failed":
                print(f"  {outcome.upper()} {path}::{name}" + (f": {message}" if message else ""))
    for w in why:
        print(f"NOT A PASS: {w}")
    if label:
        passed = sum(t.passed for t in counts.values())
        print(f"{label}: NOT A PASS: {'; '.join(why)}" if why else f"{label}: PASS: {passed} passed")
    return 1 if why else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("preflight", help="can the CUDA arena run here? exit 1 with the reason if not")
    v = sub.add_parser("verdict", help="did a pytest run (its --junitxml file) really run the GPU tests?")
    v.add_argument("junit_xml")
    v.add_argument("--must-run", nargs="*", default=list(MUST_RUN))
    v.add_argument("--label", help="end with one line, 'LABEL: PASS: ...' or 'LABEL: NOT A PASS: ...'")
    v.add_argument("--cut", metavar="HOW", help="what stopped the run before its end ('by its 90 s budget')")
    v.add_argument("--pytest-exit", type=int, metavar="RC", help="pytest's exit status")
    v.add_argument("--list", action="store_true", help="each test's outcome, not only the failures")
    args = ap.parse_args(argv)
    if args.cmd == "preflight":
        return preflight()
    return verdict(args.junit_xml, tuple(args.must_run), args.label, args.cut, args.pytest_exit, args.list)


if __name__ == "__main__":
    sys.exit(main())
