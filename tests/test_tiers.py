"""The tiers (tests/tiers.py): every collected test has exactly one; a test whose run leaves its
tier fails; a hand-placed tier that disagrees with the rules is refused; ``make test`` and
``make test-all`` (and so CI) run the tiers the README says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import tiers
from conftest import ROOT
from tiers import TIERS

TESTS = os.path.join(ROOT, "tests")

# A plugin for a collecting run: each test's tiers, one JSON line per test.
DUMP = """
import json, pytest
TIERS = {tiers!r}

def pytest_collection_finish(session):
    with open({out!r}, "w") as f:
        for item in session.items:
            names = [m.name for m in item.iter_markers() if m.name in TIERS]
            f.write(json.dumps({{"id": item.nodeid, "tiers": names,
                                 "fallback": item.get_closest_marker("fallback") is not None}}) + "\\n")
"""


def _collect(tmp_path, *args: str, cwd: str = ROOT) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "tiers.jsonl"
    (tmp_path / "tierdump.py").write_text(DUMP.format(tiers=sorted(TIERS), out=str(out)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), TESTS])}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "tierdump", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return r, rows


def test_every_collected_test_has_exactly_one_tier_and_every_tier_has_tests(tmp_path):
    # The whole suite's tiers: as this run collected them (before -m deselected any), or, in a
    # run of a few modules, from a collecting run of the whole suite.
    if len(tiers.COLLECTED) > 2000:
        rows = [{"id": n, "tiers": t, "fallback": fb} for n, (t, fb) in tiers.COLLECTED.items()]
    else:
        r, rows = _collect(tmp_path, "tests")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(rows) > 2000, f"collected only {len(rows)} tests"
    wrong = [row["id"] for row in rows if len(row["tiers"]) != 1]
    assert not wrong, f"tests without exactly one tier: {wrong[:20]}"
    counts = {t: sum(row["tiers"] == [t] for row in rows) for t in TIERS}
    assert all(counts.values()), counts
    # The fallback runs (make test-all only) exist for the modules marked both_cores.
    assert sum(row["fallback"] for row in rows) > 500
    # Under pytest-xdist every engine-tier test is in the one unit of work that runs on one worker.
    engine_files = {row["id"].split("::")[0] for row in rows if row["tiers"] == ["engine"]}
    assert engine_files and all(tiers.engine_module(os.path.join(ROOT, f)) for f in engine_files)
    assert not tiers.engine_module(os.path.join(TESTS, "test_objects.py"))


PLANTED = """
import pytest


def test_in_one_process():
    assert sum(range(4)) == 6


def test_a_process_the_rules_cannot_see():
    run = getattr(__import__("subprocess"), "r" + "un")
    run(["true"], check=True)


def test_a_child_the_rules_see():
    import subprocess
    subprocess.run(["true"], check=True)
"""


def _plant(tmp_path, body: str) -> str:
    d = tmp_path / "planted"
    d.mkdir()
    # The suite's conftest (fixtures and the tiers plugin) over a planted test module.
    (d / "conftest.py").write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {os.path.join(TESTS, 'conftest.py')!r})\n"
        "suite = sys.modules['suite_conftest'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(suite)\n"
        "globals().update({k: v for k, v in vars(suite).items() if not k.startswith('__')})\n"
    )
    (d / "test_planted.py").write_text(textwrap.dedent(body))
    return str(d)


def _run_planted(d: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": TESTS}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tiers", "-o", "addopts=", *args, d],
        cwd=d,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_test_that_escapes_its_tier_fails_with_the_rule(tmp_path):
    d = _plant(tmp_path, PLANTED)
    r = _run_planted(d)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert re.search(r"test_a_process_the_rules_cannot_see is in tier 'unit' .* started a process", out), out
    assert "3 passed, 1 error" in out, out  # its call passed; its teardown says why it fails
    assert "tests by tier: unit 2, broker 1" in out, out


def test_a_hand_placed_tier_that_disagrees_with_the_rules_is_refused(tmp_path):
    d = _plant(tmp_path, PLANTED + "\n\n@pytest.mark.unit\ndef test_marked_by_hand():\n    import subprocess\n")
    r = _run_planted(d, "--collect-only")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "marked ['unit'] by hand, but what it uses makes it 'broker'" in out, out


def _make(target: str) -> list[str]:
    r = subprocess.run(["make", "-n", "-W", "pyproject.toml", target], cwd=ROOT, capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if "bin/pytest" in line]


def test_make_test_runs_unit_and_broker_on_the_native_cores_and_test_all_everything():
    (quick,) = _make("test")
    assert '-m "(unit or broker) and not fallback"' in quick, quick
    every, sanitized = _make("test-all")  # the whole suite, then test-sanitize's run
    assert " -m " not in every and " -n 2" in every, every
    assert "sanitized_cores.py run" in sanitized and "test_store_native.py" in sanitized, sanitized
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert re.search(r"^make test-all$", f.read(), re.M)
