"""Packaging: one import root (`memory_broker`) for everything this project installs."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {
    "native": "memory_broker._native",
    "broker": "memory_broker.broker",
    "clients": "memory_broker.clients",
    "kernels": "memory_broker.kernels",
    "proto": "memory_broker.proto",
}
# check_coexistence.sh imports Hugging Face's `kernels` on purpose.
NOT_OURS = {os.path.join("ops", "dev", "check_coexistence.sh")}
BARE_IMPORT = re.compile(r"^\s*(from|import)\s+(broker|clients|kernels)(\.|\s|$)", re.M)


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_every_package_folder_is_installed_under_the_import_root():
    declared = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = set()
    for folder, name in FOLDERS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            if "__init__.py" in files:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
                pkg = name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}"
                found.add(pkg)
    assert found == declared, f"missing from pyproject: {found - declared}; stale: {declared - found}"


def test_no_code_or_doc_imports_a_bare_top_level_name():
    offenders = []
    for top in ("broker", "clients", "kernels", "tests", "ops"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(dirpath, f)
                if f.endswith((".py", ".sh", ".md")) and os.path.relpath(path, ROOT) not in NOT_OURS:
                    with open(path) as fh:
                        text = fh.read()
                    offenders += [
                        f"{os.path.relpath(path, ROOT)}: {m.group(0).strip()}" for m in BARE_IMPORT.finditer(text)
                    ]
    for doc in ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(os.path.join(ROOT, doc)) as fh:
            offenders += [f"{doc}: {m.group(0).strip()}" for m in BARE_IMPORT.finditer(fh.read())]
    assert not offenders, "import through memory_broker only:\n" + "\n".join(offenders)


def test_installed_project_exposes_no_bare_top_level_names():
    # Outside the checkout, where only what pip installed is visible.
    code = (
        "import importlib.util as u, json; "
        "print(json.dumps({n: u.find_spec(n) is not None for n in "
        "['broker', 'clients', 'memory_broker.broker', 'memory_broker.clients', 'memory_broker.kernels']}))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert r.stdout.strip() == (
        '{"broker": false, "clients": false, "memory_broker.broker": true, '
        '"memory_broker.clients": true, "memory_broker.kernels": true}'
    )


@pytest.mark.timeout(360)  # two fresh venvs and four installs: about a minute, more on a loaded machine
def test_hugging_face_kernels_and_this_project_coexist_in_either_order():
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "ops", "dev", "check_coexistence.sh"), sys.executable],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("both importable") == 2 and "coexistence: OK" in r.stdout
