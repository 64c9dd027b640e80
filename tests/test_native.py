"""The native step core's loader: built by the install, off on request, a missing module said once."""

from __future__ import annotations

import logging
import subprocess
import sys

from memory_broker.proto.wire import native

STEPCORE = "memory_broker.proto.wire._stepcore"


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
