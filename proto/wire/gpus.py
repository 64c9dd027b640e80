"""The host's GPUs by UUID, and the one a process uses: how a broker and its clients agree on a GPU.

``CUDA_VISIBLE_DEVICES`` renumbers devices differently in every process, so a GPU is named by
its UUID (``GPU-8f2c...``), the name the driver gives it everywhere. Both sides use this
module: the daemon to lay out its sockets and state per UUID, the client library to find the
broker of the device its process runs on.

``host_gpus()`` is the one device lookup. It reads, in order: the JSON file named by
``MEMORY_BROKER_DEVICE_TABLE`` (a stand-in device table, for tests and for hosts where
``nvidia-smi`` is absent: ``[{"index": 0, "uuid": "GPU-...", "name": "..."}, ...]``), else
``nvidia-smi``'s list. ``current_gpu_uuid()`` applies ``CUDA_VISIBLE_DEVICES`` (indices or
UUIDs, as CUDA reads it) to that table, unless the process's torch has CUDA initialized, which
then names its current device itself. No CUDA library is loaded here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

DEVICE_TABLE_ENV = "MEMORY_BROKER_DEVICE_TABLE"
# Where the brokers of a multi-GPU host keep their sockets (the systemd template unit's run_dir),
# and each one's socket within RUN_DIR/<gpu-uuid>/.
DEFAULT_RUN_DIR = "/run/memory-broker"
SOCKET_NAME = "broker.sock"

_UUID_RE = re.compile(
    r"^(?:GPU-|MIG-)?([0-9a-fA-F]{8})-?([0-9a-fA-F]{4})-?([0-9a-fA-F]{4})-?([0-9a-fA-F]{4})-?([0-9a-fA-F]{12})$"
)


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str
    name: str = ""


def normalize_uuid(text: str) -> str | None:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` in lower case, or None if ``text`` is not one."""
    m = _UUID_RE.match(text.strip())
    if not m:
        return None
    return "GPU-" + "-".join(g.lower() for g in m.groups())


def _from_table(path: str) -> list[Gpu]:
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{DEVICE_TABLE_ENV}={path}: not a readable JSON device table ({e})") from None
    gpus = []
    for i, row in enumerate(rows if isinstance(rows, list) else ()):
        uuid = normalize_uuid(str(row.get("uuid", ""))) if isinstance(row, dict) else None
        if uuid is None:
            raise ValueError(f"{DEVICE_TABLE_ENV}={path}: entry {i} has no GPU UUID")
        gpus.append(Gpu(int(row.get("index", i)), uuid, str(row.get("name", ""))))
    return gpus


def _from_nvidia_smi() -> list[Gpu]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,uuid,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",", 2)]
        uuid = normalize_uuid(parts[1]) if len(parts) >= 2 else None
        if uuid is not None and parts[0].isdigit():
            gpus.append(Gpu(int(parts[0]), uuid, parts[2] if len(parts) > 2 else ""))
    return gpus


def host_gpus() -> list[Gpu]:
    """Every GPU on the host, by physical index (empty where there are none or no way to ask)."""
    table = os.environ.get(DEVICE_TABLE_ENV)
    return _from_table(table) if table else _from_nvidia_smi()


def gpu_by_spec(spec: str, gpus: list[Gpu] | None = None) -> Gpu | None:
    """The host GPU a device setting names (``0``, ``cuda:1``, ``GPU-...``), or None."""
    gpus = host_gpus() if gpus is None else gpus
    s = spec.strip().removeprefix("cuda:")
    uuid = normalize_uuid(s)
    for g in gpus:
        if (uuid is not None and g.uuid == uuid) or (s.isdigit() and g.index == int(s)):
            return g
    return None


def _torch_current() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = getattr(props, "uuid", None)
    return normalize_uuid(str(uuid)) if uuid is not None else None


def current_gpu_uuid() -> str | None:
    """The UUID of the GPU this process uses as its device 0 (or torch's current one), or
    None where the process sees no GPU."""
    found = _torch_current()
    if found is not None:
        return found
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = host_gpus()
    if visible is None:
        return gpus[0].uuid if gpus else None
    first = visible.split(",")[0].strip()
    if not first or first.startswith("-"):
        return None  # CUDA_VISIBLE_DEVICES="" or "-1": no device
    g = gpu_by_spec(first, gpus)
    if g is not None:
        return g.uuid
    # A UUID CUDA would accept but the table lacks (no nvidia-smi): it still names the GPU.
    return normalize_uuid(first)


def visible_gpu_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees, in CUDA's order (device 0 first):
    ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) applied to the host table, or the whole table
    where it is unset. Needs no CUDA: a vLLM engine's scheduler process, which may use no GPU,
    finds each tensor-parallel rank's GPU here (vLLM's rank r uses local device r)."""
    gpus = host_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [g.uuid for g in gpus]
    out = []
    for spec in visible.split(","):
        spec = spec.strip()
        if not spec or spec.startswith("-"):
            break  # CUDA stops at the first invalid entry
        g = gpu_by_spec(spec, gpus)
        uuid = g.uuid if g is not None else normalize_uuid(spec)
        if uuid is None:
            break
        out.append(uuid)
    return out


def rank_gpu_uuid(local_rank: int) -> str | None:
    """The UUID of the GPU a tensor-parallel worker of ``local_rank`` uses: torch's current
    device once CUDA is initialized (vLLM sets it to the local rank), else the process's only
    visible device (a launcher that gives each rank its own ``CUDA_VISIBLE_DEVICES``), else
    visible device ``local_rank``; None where there is no such device."""
    found = _torch_current()
    if found is not None:
        return found
    visible = visible_gpu_uuids()
    if len(visible) == 1:
        return visible[0]
    return visible[local_rank] if 0 <= local_rank < len(visible) else None


def gpu_sockets(run_dir: str) -> dict[str, str]:
    """Every per-GPU broker directory under ``run_dir``: {uuid: its socket path}. A stopped
    broker removes its socket but keeps its directory, so the path may not exist."""
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return {}
    found = {}
    for name in names:
        path = os.path.join(run_dir, name, SOCKET_NAME)
        if normalize_uuid(name) == name and os.path.isdir(os.path.join(run_dir, name)):
            found[name] = path
    return found
