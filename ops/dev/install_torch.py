"""Installs torch deliberately, before the project, and says what it is about to download.

An unpinned or unavailable-locally torch can resolve to a CUDA build whose wheels come to
several GB. This script asks pip what the spec resolves to (a dry run: metadata only), says
so plainly when that is a CUDA build on a machine without an NVIDIA GPU, then installs with
pip's progress bar on.

Usage: python ops/dev/install_torch.py SPEC...   (e.g. "torch==2.13.0", or
"torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"); an empty spec does nothing.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tempfile


def _resolve(args: list[str]) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", report.name, *args],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            sys.stderr.write(r.stderr)
            raise SystemExit(f"pip cannot resolve {' '.join(args)!r} (see above)")
        with open(report.name) as f:
            return json.load(f).get("install", [])


def main(argv: list[str]) -> int:
    args = shlex.split(" ".join(argv))
    if not args:
        print("TORCH_SPEC is empty: keeping the torch already installed")
        return 0
    plan = _resolve(args)
    if not plan:
        print(f"{' '.join(args)}: already installed")
        return 0
    names = [f"{p['metadata']['name']}=={p['metadata']['version']}" for p in plan]
    cuda = [n for n in names if n.lower().startswith(("nvidia-", "cuda-toolkit")) or "+cu" in n]
    print(f"installing {' '.join(args)}: {len(names)} package(s): {', '.join(names)}")
    if cuda and shutil.which("nvidia-smi") is None:
        print(
            f"NOTE: this is a CUDA build of torch ({len(cuda)} CUDA package(s), several GB to download),\n"
            "      and this machine shows no NVIDIA GPU. For the CPU build, stop now (Ctrl-C) and run\n"
            "      make ... TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'\n"
            "      or TORCH_SPEC= to keep a torch you have installed.",
            flush=True,
        )
    return subprocess.call([sys.executable, "-m", "pip", "install", "--progress-bar", "on", *args])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
