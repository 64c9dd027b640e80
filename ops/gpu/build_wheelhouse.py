#!/usr/bin/env python3
"""Gathers, on a machine with a package registry, exactly the wheels a GPU machine needs to run
the GPU checks offline: what ops/gpu/wheelhouse.in lists (the versions this venv runs, for
CPython 3.12 on manylinux x86_64) plus this project's own wheel, built here.

It proves the folder is closed (every dependency of every wheel is in the folder or on the GPU
machine, per ops/gpu/machine-packages.txt), refuses a folder over --max-mib, and writes beside
the wheels requirements.txt (the ranges the machine installs) and MANIFEST.txt (each wheel,
its size, the total). Run it here, then carry the folder (run_gpu_checks.sh installs from it):

    .venv/bin/python ops/gpu/build_wheelhouse.py [--out ops/gpu/wheelhouse]
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64")
PROJECT = "memory-broker"


def read_requirements(path: str) -> list[Requirement]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                out.append(Requirement(line))
    return out


def read_machine(path: str) -> dict[str, str | None]:
    """name -> version (None where only the name is known)."""
    out: dict[str, str | None] = {}
    with open(path) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if words:
                out[canonicalize_name(words[0])] = words[1] if len(words) > 1 else None
    return out


def pins(reqs: list[Requirement]) -> list[str]:
    """``name==version`` for each requirement, at the version this environment runs (which
    the tests here pass with); refuses one whose local version is outside its range."""
    out = []
    for r in reqs:
        try:
            v = md.version(r.name)
        except md.PackageNotFoundError as e:
            raise SystemExit(
                f"{r.name} is not installed in {sys.prefix}: install it here first (it is what gets tested)"
            ) from e
        if r.specifier and not r.specifier.contains(v, prereleases=True):
            raise SystemExit(f"{r.name} {v} here is outside {r} (ops/gpu/wheelhouse.in): fix one of them")
        out.append(f"{r.name}=={v}")
    return out


def wheel_requirements(path: str) -> list[Requirement]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [
        Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")
    ]


def target_environment(python_version: str) -> dict:
    env = default_environment()
    major, minor = python_version.split(".")[:2]
    env.update(
        python_version=f"{major}.{minor}",
        python_full_version=f"{major}.{minor}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        os_name="posix",
    )
    return env


def unmet(out_dir: str, machine: dict[str, str | None], python_version: str) -> list[str]:
    """Dependencies of the folder's wheels that neither the folder nor the machine provides."""
    have: dict[str, Version] = {}
    for w in glob.glob(os.path.join(out_dir, "*.whl")):
        name, ver, _, _ = parse_wheel_filename(os.path.basename(w))
        have[canonicalize_name(name)] = ver
    env = target_environment(python_version)
    problems = []
    for w in sorted(glob.glob(os.path.join(out_dir, "*.whl"))):
        for r in wheel_requirements(w):
            if r.marker is not None and not r.marker.evaluate({**env, "extra": ""}):
                continue
            name = canonicalize_name(r.name)
            if name in have:
                if not r.specifier.contains(have[name], prereleases=True):
                    problems.append(f"{os.path.basename(w)} needs {r}; the folder has {name} {have[name]}")
            elif name in machine:
                known = machine[name]
                if known is not None and "." in known and not r.specifier.contains(known, prereleases=True):
                    problems.append(f"{os.path.basename(w)} needs {r}; the GPU machine has {name} {known}")
            else:
                problems.append(f"{os.path.basename(w)} needs {r}: neither in the folder nor on the GPU machine")
    return problems


def target_python(python_version: str) -> str | None:
    """An interpreter of the GPU machine's Python (``python3.12`` on PATH or under pyenv), or None."""
    pyenv = os.path.join(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv")), "versions")
    candidates = [
        os.path.join(d, "bin", "python") for d in sorted(glob.glob(os.path.join(pyenv, f"{python_version}.*")))
    ]
    candidates.reverse()
    found = shutil.which(f"python{python_version}")
    if found and "/shims/" not in found:  # a pyenv shim fails unless that version is selected
        candidates.insert(0, found)
    for exe in candidates:
        ok = subprocess.run([exe, "-m", "pip", "--version"], capture_output=True).returncode == 0
        if os.access(exe, os.X_OK) and ok:
            return exe
    return None


def purify(wheel: str) -> str:
    """``wheel`` without its compiled native step core, retagged py3-none-any; returns the new path.

    The native core is optional (proto/wire/native.py): without it the installed project runs its
    Python path, so a wheel that any CPython 3 installs beats no wheel on a GPU machine whose
    Python differs from the one that built it.
    """
    name, ver, _, _ = parse_wheel_filename(os.path.basename(wheel))
    out = os.path.join(os.path.dirname(wheel), f"{name.replace('-', '_')}-{ver}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename.endswith(".so"):
                continue
            data = src.read(item.filename)
            if item.filename.endswith(".dist-info/WHEEL"):
                lines = [ln for ln in data.decode().splitlines() if not ln.startswith(("Tag:", "Root-Is-Purelib:"))]
                data = ("\n".join(lines) + "\nRoot-Is-Purelib: true\nTag: py3-none-any\n").encode()
            elif item.filename.endswith(".dist-info/RECORD"):
                data = "".join(ln for ln in data.decode().splitlines(True) if ".so," not in ln).encode()
            dst.writestr(item, data)
    os.remove(wheel)
    return out


def project_wheel(out_dir: str, python_version: str) -> str:
    """Builds this project's wheel for the GPU machine's Python, native step core included when it can.

    The native core is a C extension, so the wheel is tied to the Python that builds it. An
    interpreter of ``python_version`` here builds it (in an isolated build environment, since
    the project needs setuptools>=74.1); without one, the wheel this venv builds is stripped of
    the core and retagged pure, and the GPU machine runs the Python path (and says so once).
    """
    exe = target_python(python_version)
    if exe is not None:
        built = _pip_wheel(out_dir, [exe, "-m", "pip", "wheel", "--no-deps", "-w", out_dir, ROOT])
        if built is not None:
            return built
        print(f"note: Python {python_version} ({exe}) could not build the wheel; this venv builds it", flush=True)
    built = _pip_wheel(
        out_dir, [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out_dir, ROOT]
    )
    if built is None:
        raise SystemExit("pip could not build the project's wheel (run the command above to see why)")
    print(f"note: no Python {python_version} here: the project's wheel leaves out the native step core", flush=True)
    return purify(built)


def _pip_wheel(out_dir: str, cmd: list[str]) -> str | None:
    """The wheel ``cmd`` (a pip wheel command) adds to ``out_dir``, or None if it fails."""
    print("+", " ".join(cmd), flush=True)
    before = set(glob.glob(os.path.join(out_dir, "*.whl")))
    ok = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode == 0
    shutil.rmtree(os.path.join(ROOT, "build"), ignore_errors=True)  # setuptools' scratch folder in the checkout
    added = set(glob.glob(os.path.join(out_dir, "*.whl"))) - before
    return added.pop() if ok and len(added) == 1 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "wheelhouse"), help="the folder to (re)fill")
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--requirements", default=os.path.join(HERE, "wheelhouse.in"))
    ap.add_argument("--machine", default=os.path.join(HERE, "machine-packages.txt"))
    ap.add_argument("--max-mib", type=float, default=32.0, help="refuse a folder larger than this")
    args = ap.parse_args()

    reqs = read_requirements(args.requirements)
    machine = read_machine(args.machine)
    for r in reqs:
        if canonicalize_name(r.name) in machine and canonicalize_name(r.name) not in ("grpcio", "protobuf"):
            print(f"note: {r.name} is listed as on the GPU machine and in {args.requirements}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    for old in glob.glob(os.path.join(args.out, "*")):  # exactly what this run gathers
        os.remove(old) if os.path.isfile(old) else shutil.rmtree(old)

    pip = [sys.executable, "-m", "pip"]
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [
        *pip,
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        args.python_version,
        "--implementation",
        "cp",
        *plat,
        "-d",
        args.out,
        *pins(reqs),
    ]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    project_wheel(args.out, args.python_version)

    wheels = sorted(glob.glob(os.path.join(args.out, "*.whl")))
    if not any(canonicalize_name(parse_wheel_filename(os.path.basename(w))[0]) == PROJECT for w in wheels):
        raise SystemExit(f"the project's wheel ({PROJECT}) is missing from {args.out}")
    problems = unmet(args.out, machine, args.python_version)
    if problems:
        print("the folder is not closed:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1

    with open(os.path.join(args.out, "requirements.txt"), "w") as f:
        f.write("# Installed offline on the GPU machine: pip install --no-index --find-links . -r requirements.txt\n")
        f.writelines(f"{r}\n" for r in reqs)
    total = sum(os.path.getsize(w) for w in wheels)
    lines = [f"{os.path.getsize(w):>10}  {os.path.basename(w)}" for w in wheels]
    summary = f"{len(wheels)} wheels, {total} bytes ({total / 2**20:.2f} MiB) for CPython {args.python_version} manylinux x86_64"
    with open(os.path.join(args.out, "MANIFEST.txt"), "w") as f:
        f.write("\n".join(lines) + "\n" + summary + "\n")
    print("\n".join(lines))
    print(f"{args.out}: {summary}")
    if total > args.max_mib * 2**20:
        print(f"the folder is over {args.max_mib} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
