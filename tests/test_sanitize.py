"""The sanitizer run (``make test-sanitize``, part of ``make test-all``) builds every native core
with AddressSanitizer and UndefinedBehaviorSanitizer and runs the native-against-fallback tests
on those builds. Here: it builds every core pyproject.toml declares, the loader takes them, and
the run's environment turns a planted out-of-bounds write and a planted signed overflow into a
failed process with the sanitizer's report (so a clean run means something)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from conftest import ROOT

_spec = importlib.util.spec_from_file_location(
    "sanitized_cores", os.path.join(ROOT, "ops", "dev", "sanitized_cores.py")
)
sanitized = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sanitized)

PLANTED = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdlib.h>

static PyObject *overflow(PyObject *self, PyObject *n) {
    long k = PyLong_AsLong(n);
    char *p = malloc(8);
    p[k] = 1; /* k = 8: one past the end */
    char c = p[0];
    free(p);
    return PyLong_FromLong(c);
}

static PyObject *add_max(PyObject *self, PyObject *n) {
    int k = (int)PyLong_AsLong(n);
    int x = INT_MAX;
    x += k; /* k = 1: signed overflow */
    return PyLong_FromLong(x);
}

static PyMethodDef methods[] = {
    {"overflow", overflow, METH_O, ""},
    {"add_max", add_max, METH_O, ""},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_planted", NULL, -1, methods};
PyMODINIT_FUNC PyInit__planted(void) { return PyModule_Create(&mod); }
"""


def _run(tmp_path, code: str, extra: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **extra},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )


def test_every_core_is_built_sanitized_and_loaded_from_there(tmp_path):
    out = str(tmp_path / "san")
    built = sanitized.build(out)
    names = [name for name, _ in sanitized.modules()]
    assert sorted(os.path.basename(p) for p in built) == sorted(n.rpartition(".")[2] + ".so" for n in names)
    code = (
        "import sys\n"
        "from memory_broker.proto.wire import native\n"
        "for name in sys.argv[1:]:\n"
        "    print(native.load(name).__file__)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *names],
        env={**os.environ, **sanitized.env(out)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [os.path.join(out, n.rpartition(".")[2] + ".so") for n in names]


def test_a_planted_overflow_and_signed_overflow_fail_the_run_with_the_report(tmp_path):
    src = tmp_path / "_planted.c"
    src.write_text(PLANTED)
    sanitized.build_one(str(src), str(tmp_path / "_planted.so"))
    extra = sanitized.env(str(tmp_path))
    load = "import importlib.util as u; s = u.spec_from_file_location('_planted', '_planted.so'); m = u.module_from_spec(s); s.loader.exec_module(m)\n"
    fine = _run(tmp_path, load + "print(m.overflow(0), m.add_max(0))", extra)
    assert fine.returncode == 0 and fine.stdout.split() == ["1", str(2**31 - 1)], fine.stderr
    oob = _run(tmp_path, load + "m.overflow(8)", extra)
    # Whichever sanitizer sees it first: UBSan's object-size check, or ASan's shadow memory.
    seen = (
        "AddressSanitizer: heap-buffer-overflow" in oob.stderr or "with insufficient space for an object" in oob.stderr
    )
    assert oob.returncode != 0 and seen, oob.stderr[-2000:]
    ub = _run(tmp_path, load + "m.add_max(1)", extra)
    assert ub.returncode != 0 and "runtime error: signed integer overflow" in ub.stderr, ub.stderr[-2000:]
