#!/usr/bin/env python3
"""Copies vLLM's Triton LoRA kernels (lora_shrink / lora_expand and the files they need),
unmodified, out of an installed vLLM or a vLLM wheel into a git-ignored folder laid out as a
tiny ``vllm`` package, so the kernel benchmark can run them on a GPU machine without vLLM.

It owns that folder (default ops/gpu/vllm_lora_ops/, never committed: the files are vLLM's) and
the shims written beside the copied files: stand-ins for exactly the ``vllm`` imports those
files make, each behaving as vLLM's own does on a CUDA machine. It must not edit the copied
files, and it refuses a vLLM whose files import anything the shims do not provide.

    python ops/gpu/extract_vllm_lora_ops.py [--python .venv-vllm/bin/python | --from-site DIR |
                                             --wheel vllm-X.whl] [--out ops/gpu/vllm_lora_ops]

Then put the output folder first on sys.path: ``import vllm.lora.ops.triton_ops`` gives
``lora_shrink``, ``lora_expand`` and ``LoRAKernelMeta``. MANIFEST.json records the vLLM version,
where the files came from, and each file's sha256.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "ops" / "gpu" / "vllm_lora_ops"
OPS_DIR = "vllm/lora/ops/triton_ops"
# What the benchmark calls, and everything they import from vLLM's own LoRA ops.
COPIED = ("lora_shrink_op.py", "lora_expand_op.py", "kernel_utils.py", "utils.py", "lora_kernel_metadata.py")

# ---- the shims: one module per vllm import the copied files make ---------------------------

SHIM_HEADER = '"""Shim written by memory-broker\'s ops/gpu/extract_vllm_lora_ops.py, not vLLM\'s code. {what}"""\n'

SHIMS: dict[str, str] = {
    "vllm/__init__.py": SHIM_HEADER.format(
        what="A bare stand-in for the vllm package: only what vllm/lora/ops/triton_ops needs is here."
    ),
    "vllm/envs.py": SHIM_HEADER.format(
        what="Stands for vllm/envs.py: the four variables the LoRA ops read, parsed as vLLM parses "
        "them (same names, same defaults), read at each access as vLLM's module __getattr__ does."
    )
    + """
import os

_VARIABLES = {
    # Batch-invariant mode (fixed split-K, no atomics); off by default.
    "VLLM_BATCH_INVARIANT": lambda: bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0"))),
    # A folder of tuned kernel configs; unset means vLLM's default configs.
    "VLLM_TUNED_CONFIG_FOLDER": lambda: os.getenv("VLLM_TUNED_CONFIG_FOLDER", None),
    # PDL is used only when dual-stream LoRA is on, and never when this is set.
    "VLLM_LORA_DISABLE_PDL": lambda: bool(int(os.getenv("VLLM_LORA_DISABLE_PDL", "0"))),
    "VLLM_LORA_ENABLE_DUAL_STREAM": lambda: bool(int(os.getenv("VLLM_LORA_ENABLE_DUAL_STREAM", "0"))),
}


def __getattr__(name: str):
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"the vllm.envs shim has no {name!r} (only {sorted(_VARIABLES)})")
""",
    "vllm/logger.py": SHIM_HEADER.format(
        what="Stands for vllm/logger.py's init_logger: a stdlib logger with vLLM's info_once / "
        "warning_once (each message printed once)."
    )
    + """
import logging
from types import MethodType

_seen: set = set()


def _once(level: int):
    def method(self, msg, *args, **kwargs):
        key = (level, msg, args)
        if key not in _seen:
            _seen.add(key)
            self.log(level, msg, *args)

    return method


def init_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.info_once = MethodType(_once(logging.INFO), logger)
    logger.warning_once = MethodType(_once(logging.WARNING), logger)
    logger.debug_once = MethodType(_once(logging.DEBUG), logger)
    return logger
""",
    "vllm/triton_utils/__init__.py": SHIM_HEADER.format(
        what="Stands for vllm/triton_utils: vLLM re-exports the installed triton and triton.language."
    )
    + """
import triton
import triton.language as tl

HAS_TRITON = True
""",
    "vllm/utils/__init__.py": SHIM_HEADER.format(what="Package marker for the shims below."),
    "vllm/utils/math_utils.py": SHIM_HEADER.format(what="Stands for vllm/utils/math_utils.py (same code).")
    + '''

def next_power_of_2(n: int) -> int:
    """The next power of 2 (inclusive)."""
    return 1 if n < 1 else 1 << (n - 1).bit_length()
''',
    "vllm/utils/torch_utils.py": SHIM_HEADER.format(
        what="Stands for vllm/utils/torch_utils.py: direct_register_custom_op registers the op in a "
        "'vllm' torch library under the platform's dispatch key, as vLLM does (so callers pay the "
        "same dispatcher cost as in vLLM); async_tensor_h2d stages a list in pinned memory on CUDA "
        "and copies it non-blocking, as vLLM does."
    )
    + '''
import torch
from torch.library import Library, infer_schema

from vllm.platforms import current_platform

vllm_lib = Library("vllm", "FRAGMENT")


def direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None, target_lib=None,
                              dispatch_key=None, tags=()):
    if mutates_args is None:
        mutates_args = []
    if dispatch_key is None:
        dispatch_key = current_platform.dispatch_key
    schema_str = infer_schema(op_func, mutates_args=mutates_args)
    my_lib = target_lib or vllm_lib
    my_lib.define(op_name + schema_str, tags=tags)
    my_lib.impl(op_name, op_func, dispatch_key=dispatch_key)
    if fake_impl is not None:
        my_lib._register_fake(op_name, fake_impl)


def async_tensor_h2d(data, device=None, dtype=None, out=None):
    """Copy a list (or tensor) from host to device without blocking (pinned staging on CUDA)."""
    pin = current_platform.is_pin_memory_available()
    if dtype is None and out is not None:
        dtype = out.dtype
    if isinstance(data, torch.Tensor):
        t = data
        if pin and not t.is_pinned():
            t = torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=True).copy_(t)
    else:
        t = torch.tensor(data, dtype=dtype, pin_memory=pin, device="cpu")
    if out is not None:
        return out.copy_(t, non_blocking=True)
    assert device is not None, "must provide destination tensor or device"
    return t.to(device=device, dtype=dtype, non_blocking=True)
''',
    "vllm/platforms/__init__.py": SHIM_HEADER.format(
        what="Stands for vllm.platforms.current_platform as vLLM's CUDA platform answers: is_cuda() "
        "is a CUDA (not ROCm) torch with a device; has_device_capability compares the device's "
        "compute capability (major * 10 + minor, or a (major, minor) tuple) exactly as vLLM's "
        "Platform.has_device_capability does, so utils.supports_pdl decides PDL as in vLLM "
        "(capability >= 90, and only with VLLM_LORA_ENABLE_DUAL_STREAM). On a machine without CUDA "
        "it answers as vLLM's CPU platform (dispatch key CPU, no pinned memory)."
    )
    + """
import torch


class _Platform:
    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    @property
    def dispatch_key(self) -> str:
        return "CUDA" if self.is_cuda() else "CPU"

    def is_pin_memory_available(self) -> bool:
        return self.is_cuda()

    def get_device_capability(self, device_id: int = 0):
        if not self.is_cuda():
            return None
        return torch.cuda.get_device_capability(device_id)

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        if isinstance(capability, tuple):
            return tuple(current) >= capability
        return current[0] * 10 + current[1] >= capability


current_platform = _Platform()
""",
    "vllm/lora/__init__.py": SHIM_HEADER.format(what="Package marker."),
    "vllm/lora/ops/__init__.py": SHIM_HEADER.format(what="Package marker."),
    # vLLM's own triton_ops/__init__.py also imports the fused-MoE and fp8 ops; this one imports
    # only what was copied.
    f"{OPS_DIR}/__init__.py": SHIM_HEADER.format(
        what="Replaces vLLM's triton_ops/__init__.py, which also imports the MoE and fp8 ops (not copied)."
    )
    + """
from vllm.lora.ops.triton_ops.lora_expand_op import lora_expand
from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta
from vllm.lora.ops.triton_ops.lora_shrink_op import lora_shrink

__all__ = ["lora_expand", "lora_shrink", "LoRAKernelMeta"]
""",
}

# (module, name) pairs the shims provide, and the vllm.envs attributes they define.
PROVIDED = {
    ("vllm", "envs"),
    ("vllm.logger", "init_logger"),
    ("vllm.platforms", "current_platform"),
    ("vllm.triton_utils", "tl"),
    ("vllm.triton_utils", "triton"),
    ("vllm.utils.math_utils", "next_power_of_2"),
    ("vllm.utils.torch_utils", "direct_register_custom_op"),
    ("vllm.utils.torch_utils", "async_tensor_h2d"),
}
ENVS = {"VLLM_BATCH_INVARIANT", "VLLM_TUNED_CONFIG_FOLDER", "VLLM_LORA_DISABLE_PDL", "VLLM_LORA_ENABLE_DUAL_STREAM"}
# The platform methods the shim answers.
PLATFORM_METHODS = {"is_cuda", "has_device_capability"}


class ExtractError(Exception):
    """The source is missing, incomplete, or imports something the shims do not provide."""


def check_imports(name: str, text: str) -> None:
    """Every vllm import of a copied file must be a copied module or a shim; every
    envs.X / current_platform.X it reads must be one the shims define."""
    tree = ast.parse(text, filename=name)
    copied_modules = {f"{OPS_DIR.replace('/', '.')}.{f[:-3]}" for f in COPIED}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "vllm" or alias.name.startswith("vllm."):
                    raise ExtractError(f"{name}: 'import {alias.name}' has no shim")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (node.level == 0)
            and (node.module == "vllm" or node.module.startswith("vllm."))
        ):
            if node.module in copied_modules:
                continue
            for alias in node.names:
                if (node.module, alias.name) not in PROVIDED:
                    raise ExtractError(f"{name}: 'from {node.module} import {alias.name}' has no shim")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "envs" and node.attr not in ENVS:
                raise ExtractError(f"{name}: reads envs.{node.attr}, which the vllm.envs shim does not define")
            if node.value.id == "current_platform" and node.attr not in PLATFORM_METHODS:
                raise ExtractError(f"{name}: calls current_platform.{node.attr}, which the shim does not answer")


def version_from(text: str) -> str:
    m = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text, re.M)
    return m.group(1) if m else "unknown"


def read_installed(package_dir: Path) -> tuple[dict[str, bytes], str, str]:
    """The copied files' bytes, the version, and a description, from a vllm package folder."""
    files = {}
    for f in COPIED:
        p = package_dir / "lora" / "ops" / "triton_ops" / f
        if not p.is_file():
            raise ExtractError(f"{p} is missing: is {package_dir} a vLLM with Triton LoRA ops?")
        files[f] = p.read_bytes()
    vfile = package_dir / "_version.py"
    version = version_from(vfile.read_text()) if vfile.is_file() else "unknown"
    dists = sorted(d.name for d in package_dir.parent.glob("vllm*.dist-info"))
    return files, version, f"installed package {package_dir}" + (f" ({', '.join(dists)})" if dists else "")


def read_wheel(wheel: Path) -> tuple[dict[str, bytes], str, str]:
    if not wheel.is_file():
        raise ExtractError(f"no wheel at {wheel}")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        files = {}
        for f in COPIED:
            member = f"{OPS_DIR}/{f}"
            if member not in names:
                raise ExtractError(f"{wheel} has no {member}")
            files[f] = z.read(member)
        version = version_from(z.read("vllm/_version.py").decode()) if "vllm/_version.py" in names else "unknown"
    return files, version, f"wheel {wheel.name} (sha256 {sha256(wheel.read_bytes())})"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def vllm_dir_of(python: str) -> Path:
    """Where ``python`` finds the vllm package, without importing it (vLLM's import is slow)."""
    code = (
        "import importlib.util as u; s = u.find_spec('vllm'); print(list(s.submodule_search_locations)[0] if s else '')"
    )
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise ExtractError(f"cannot run {python}: {e}") from e
    where = r.stdout.strip()
    if r.returncode != 0 or not where:
        raise ExtractError(f"{python} has no vllm package ({r.stderr.strip()[-200:] or 'find_spec found none'})")
    return Path(where)


def default_python() -> str | None:
    """MEMORY_BROKER_VLLM_PYTHON (as the Makefile sets it for the vLLM tests), else the repo's .venv-vllm."""
    env = os.environ.get("MEMORY_BROKER_VLLM_PYTHON")
    if env:
        return env
    local = REPO / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else None


def extract(files: dict[str, bytes], version: str, source: str, out: Path) -> dict:
    """Writes the package into ``out`` (replacing what an earlier run left) and returns the manifest."""
    for f, data in files.items():
        check_imports(f, data.decode())
    if out.exists():
        if not (out / "MANIFEST.json").is_file():
            raise ExtractError(f"{out} exists and is not an earlier extraction (no MANIFEST.json); not replacing it")
        shutil.rmtree(out)
    tmp = Path(tempfile.mkdtemp(prefix=".vllm_lora_ops.", dir=out.parent))
    try:
        for rel, text in SHIMS.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        for f, data in files.items():
            (tmp / OPS_DIR / f).write_bytes(data)
        manifest = {
            "what": "vLLM's Triton LoRA ops, copied unmodified, with shims; never commit this folder",
            "vllm_version": version,
            "source": source,
            "extracted_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "copied": {f"{OPS_DIR}/{f}": sha256(data) for f, data in sorted(files.items())},
            "shims": {rel: sha256(text.encode()) for rel, text in sorted(SHIMS.items())},
        }
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--python",
        help="a python whose vllm to copy from (default: $MEMORY_BROKER_VLLM_PYTHON, else .venv-vllm/bin/python)",
    )
    src.add_argument("--from-site", type=Path, help="a site-packages folder holding vllm/ (or the vllm folder itself)")
    src.add_argument("--wheel", type=Path, help="a vllm wheel file")
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT.relative_to(REPO)})"
    )
    args = ap.parse_args(argv)
    try:
        if args.wheel:
            files, version, source = read_wheel(args.wheel)
        else:
            if args.from_site:
                site = args.from_site
                package = site if (site / "lora" / "ops").is_dir() else site / "vllm"
            else:
                python = args.python or default_python()
                if python is None:
                    raise ExtractError("no vLLM to copy from: pass --python, --from-site or --wheel, or make vllm-venv")
                package = vllm_dir_of(python)
            files, version, source = read_installed(package)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        manifest = extract(files, version, source, args.out.resolve())
    except ExtractError as e:
        print(f"extract_vllm_lora_ops: {e}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"vLLM {manifest['vllm_version']} LoRA ops from {manifest['source']} -> {args.out} ({size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
