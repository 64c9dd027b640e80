#!/usr/bin/env python3
"""The native cores built with AddressSanitizer and UndefinedBehaviorSanitizer, and the
environment that loads them (``make test-sanitize``).

    python ops/dev/sanitized_cores.py build OUT     # every ext-module of pyproject.toml -> OUT/<name>.so
    python ops/dev/sanitized_cores.py env OUT       # the variables, as NAME=VALUE lines
    python ops/dev/sanitized_cores.py run OUT -- CMD...  # CMD with them set

The cores are built as pip builds them (``[[tool.setuptools.ext-modules]]``: the same sources,
this Python's headers) with ``-fsanitize=address,undefined -fno-sanitize-recover=undefined``,
so the first invalid access or undefined behaviour aborts the process with its report.
``proto/wire/native.py`` loads them from OUT under ``MEMORY_BROKER_NATIVE_DIR``; the sanitizers'
runtimes are preloaded (the interpreter itself is not built with them), leak detection is off
(CPython keeps its interned objects to the end).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
CC = os.environ.get("CC", "gcc")


def modules() -> list[tuple[str, str]]:
    """(full module name, source path) of every native core pyproject.toml declares."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        exts = tomllib.load(f)["tool"]["setuptools"]["ext-modules"]
    return [(e["name"], os.path.join(ROOT, *e["sources"][0].split("/"))) for e in exts]


def build_one(source: str, out_path: str) -> None:
    include = sysconfig.get_paths()["include"]
    cmd = [CC, "-shared", "-fPIC", *FLAGS, f"-I{include}", source, "-o", out_path]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"building {source} with the sanitizers failed:\n{' '.join(cmd)}\n{r.stderr}")


def build(out: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    built = []
    for name, source in modules():
        path = os.path.join(out, name.rpartition(".")[2] + ".so")
        build_one(source, path)
        built.append(path)
    return built


def runtime(lib: str) -> str:
    path = subprocess.run([CC, f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        raise SystemExit(f"{CC} has no {lib} (install gcc's sanitizer runtimes: Debian's libasan8 and libubsan1)")
    return path


def env(out: str) -> dict[str, str]:
    return {
        "LD_PRELOAD": f"{runtime('libasan.so')} {runtime('libubsan.so')}",
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        "MEMORY_BROKER_NATIVE_DIR": os.path.abspath(out),
    }


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("build", "env", "run"):
        raise SystemExit(__doc__)
    what, out = argv[0], argv[1]
    if what == "build":
        for path in build(out):
            print(f"built {path} ({' '.join(FLAGS)})")
    elif what == "env":
        for k, v in env(out).items():
            print(f"{k}={v}")
    else:
        cmd = argv[argv.index("--") + 1 :] if "--" in argv else []
        if not cmd:
            raise SystemExit("run OUT -- CMD...: no command")
        os.execvpe(cmd[0], cmd, {**os.environ, **env(out)})


if __name__ == "__main__":
    main(sys.argv[1:])
