"""The native step core's loader: built by the install, off on request, a missing module said once."""

from __future__ import annotations

import logging
import pathlib
import re
import subprocess
import sys

import pytest

from memory_broker.proto.wire import native

STEPCORE = native.STEPCORE


def test_the_native_core_is_built_by_the_projects_install():
    # CI installs the project as the README says; the C compiler is there, so the core is too.
    assert native.load(STEPCORE) is not None, "the native step core was not built by pip install -e ."


def test_native_off_gives_none_and_missing_module_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv(native.ENV, "0")
    assert native.load(STEPCORE) is None
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.delenv(native.ENV)
    with caplog.at_level(logging.WARNING, logger="memory_broker.native"):
        assert native.load("memory_broker.proto.wire._no_such_core") is None
        assert native.load("memory_broker.proto.wire._no_such_core") is None
    said = [r for r in caplog.records if "not built" in r.getMessage()]
    assert len(said) == 1 and "pure-Python path runs" in said[0].getMessage()
    assert native.status() == {"memory_broker.proto.wire._no_such_core": False}


def test_env_switch_reaches_a_fresh_process():
    code = f"from memory_broker.proto.wire import native; print(native.load({STEPCORE!r}) is None)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"MEMORY_BROKER_NATIVE": "off", "PATH": "/usr/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "True"


CORES = (native.STEPCORE, native.STORECORE, native.HOTCORE)
SOURCES = ("native/_stepcore.c", "native/_storecore.c", "native/_hotcore.c")
ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_each_core_keeps_its_objects_in_module_state_not_in_process_globals():
    # Multi-phase init: a module object per import (per interpreter), its names and caches in
    # its state, released with it; a `static PyObject *` would be shared by every interpreter.
    shared = (ROOT / "native/module_state.h").read_text()  # every core's init and state
    assert "PyModuleDef_Init(" in shared and "Py_mod_exec" in shared
    assert ".m_traverse" in shared and ".m_clear" in shared and ".m_size = sizeof(State)" in shared
    for src in SOURCES:
        text = (ROOT / src).read_text()
        assert '#include "module_state.h"' in text and "CORE_MODULE(" in text, src
        assert "PyModule_Create(" not in text, src
        globals_ = re.findall(r"^\s*static\s+(?:PyObject|PyTypeObject)\s*\*\s*\w+\s*[;,=\[]", text + shared, re.M)
        assert not globals_, (src, globals_)


SUBINTERPRETER = f"""
import _xxsubinterpreters as interpreters
code = '''
from memory_broker.proto.wire import native
mods = [native.load(n) for n in {CORES!r}]
assert all(m is not None for m in mods), mods
assert mods[0].encode_ok_reply(3, [b"ab"]) == bytes([8, 0, 0, 0, 0x80, 3, 0, 0, 0, 1, 0]) + b"ab"
'''
for _ in range(2):  # a second interpreter after the first is gone: nothing of it is left behind
    i = interpreters.create()
    try:
        interpreters.run_string(i, code)
    finally:
        interpreters.destroy(i)
exec(code)
print("ok")
"""


def test_the_cores_load_and_run_in_sub_interpreters_beside_the_main_one():
    if not all(native.load(n) for n in CORES):
        pytest.skip("the native cores are off or not built here")
    out = subprocess.run([sys.executable, "-c", SUBINTERPRETER], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
