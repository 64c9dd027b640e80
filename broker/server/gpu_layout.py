"""One broker per GPU on a host: where each one's sockets, state and metrics port go.

With ``listeners.run_dir`` (the systemd template unit sets ``/run/memory-broker``), a broker's
sockets live in ``RUN_DIR/<gpu-uuid>/`` (``broker.sock``, ``broker.sock.fds``,
``broker.sock.step``, ``broker.sock.lock``), and ``RUN_DIR/<instance>.sock`` (and ``.fds``,
``.step``) link to them, so the old per-instance path keeps working. With ``state_root`` the
state directory is ``STATE_ROOT/<gpu-uuid>``. With ``listeners.metrics_port_per_gpu`` the
metrics port is ``metrics_port`` plus the GPU's index. The GPU is ``arena.device`` (an index
or a UUID) looked up in the host's device table (``memory_broker.proto.wire.gpus``); a
host-arena broker may be given any UUID (tests stand two of them in for two GPUs).
"""

from __future__ import annotations

import os

from memory_broker.broker.server.options import ServeOptions, SettingError
from memory_broker.proto.wire.gpus import SOCKET_NAME, Gpu, gpu_by_spec, host_gpus, normalize_uuid

# What sits beside the gRPC socket (the fd and step channels), each linked from the instance name.
SUFFIXES = ("", ".fds", ".step")


def broker_gpu(opts: ServeOptions) -> Gpu:
    """The GPU ``arena.device`` names. Raises SettingError for an index the host does not have."""
    spec = opts.device.strip()
    gpus = host_gpus()
    g = gpu_by_spec(spec, gpus)
    if g is not None:
        return g
    uuid = normalize_uuid(spec)
    if uuid is not None:
        # Not in the table: a host arena's stand-in UUID, or a GPU nvidia-smi cannot list.
        return Gpu(0, uuid)
    seen = ", ".join(f"{x.index}={x.uuid}" for x in gpus) or "none (no nvidia-smi, no device table)"
    raise SettingError(
        "device",
        f"{spec!r} names no GPU of this host (GPUs: {seen}); name the GPU by its UUID (nvidia-smi -L)",
    )


def apply_gpu_layout(opts: ServeOptions) -> Gpu | None:
    """Rewrite ``opts``'s socket, state directory and metrics port for its GPU (None: no per-GPU
    setting is on, nothing changes). Creates ``RUN_DIR/<uuid>/`` where it is missing."""
    if not (opts.run_dir or opts.state_root or opts.metrics_port_per_gpu):
        return None
    gpu = broker_gpu(opts)
    if opts.run_dir:
        d = os.path.join(opts.run_dir, gpu.uuid)
        socket = os.path.join(d, SOCKET_NAME)
        if len(os.path.abspath(socket + ".step").encode()) > 107:
            raise SettingError("run_dir", f"{opts.run_dir!r} is too long: {socket}.step would pass 107 bytes")
        os.makedirs(d, exist_ok=True)
        if os.stat(d).st_uid == os.getuid():
            # Searchable by all (the umask under systemd is 0007): the sockets' own modes decide
            # who connects, as in the run directory itself.
            os.chmod(d, 0o755)
        opts.socket = socket
    if opts.state_root:
        opts.state_dir = os.path.join(opts.state_root, gpu.uuid)
    if opts.metrics_port_per_gpu and opts.metrics_port:
        opts.metrics_port = opts.metrics_port + gpu.index
    return gpu


def link_instance(opts: ServeOptions, gpu: Gpu | None) -> list[str]:
    """``RUN_DIR/<instance>.sock`` (and ``.fds``, ``.step``) -> ``<uuid>/broker.sock...``, for the
    instance name the unit was started with when it is not the UUID itself. Returns the links."""
    name = opts.instance.strip()
    if gpu is None or not opts.run_dir or not name or name == gpu.uuid or "/" in name:
        return []
    made = []
    for suffix in SUFFIXES:
        link = os.path.join(opts.run_dir, f"{name}.sock{suffix}")
        target = os.path.join(gpu.uuid, SOCKET_NAME + suffix)
        tmp = f"{link}.{os.getpid()}.tmp"
        os.symlink(target, tmp)
        os.replace(tmp, link)  # atomic: a client never sees the link missing
        made.append(link)
    return made


def serving_gpu(opts: ServeOptions, driver_uuid: str) -> tuple[Gpu | None, str]:
    """The GPU a started broker serves and the UUID it reports (``ArenaInfo.device``, the
    ``gpu_uuid`` label; "" for a host arena named by no UUID). ``driver_uuid`` is the CUDA
    arena's device as the driver sees it ("" on a host arena). Under the per-GPU layout the
    driver must agree with the host's table, which the sockets and state were laid out by."""
    per_gpu = bool(opts.run_dir or opts.state_root or opts.metrics_port_per_gpu)
    try:
        gpu = broker_gpu(opts) if per_gpu or normalize_uuid(opts.device) else None
    except SettingError:
        gpu = None
    if per_gpu and driver_uuid and gpu is not None and driver_uuid != gpu.uuid:
        raise ValueError(
            f"arena.device {opts.device!r} is {driver_uuid} to the CUDA driver but {gpu.uuid} in the host's GPU "
            "table, and sockets and state are laid out by the latter: name the GPU by UUID, and do not set "
            "CUDA_VISIBLE_DEVICES for the broker"
        )
    return gpu, driver_uuid or (gpu.uuid if gpu is not None else "")
