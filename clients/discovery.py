"""Which broker a process talks to: the one of the GPU it runs on, found by UUID.

``find_socket`` answers for ``BrokerClient.connect`` (and the vLLM integration), in order:
* a socket path given (or ``MEMORY_BROKER_SOCKET``) that is a socket: that broker;
* a directory given (or ``MEMORY_BROKER_SOCKET`` naming one), or else ``/run/memory-broker``
  where it holds per-GPU brokers (``<gpu-uuid>/broker.sock``, the systemd template unit's
  layout): the broker of the GPU this process uses (``proto.wire.gpus.current_gpu_uuid``:
  torch's current device, or ``CUDA_VISIBLE_DEVICES``'s first);
* otherwise the single broker of a host without GPUs, ``/tmp/memory-broker.sock``.
"""

from __future__ import annotations

import os

from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.gpus import DEFAULT_RUN_DIR, SOCKET_NAME, current_gpu_uuid, gpu_sockets

SOCKET_ENV = "MEMORY_BROKER_SOCKET"
DEFAULT_SOCKET = "/tmp/memory-broker.sock"


def broker_dir(socket_path: str | None = None, run_dir: str = DEFAULT_RUN_DIR) -> str | None:
    """The directory of per-GPU brokers this process picks from (``socket_path`` or
    ``MEMORY_BROKER_SOCKET`` naming a directory, else ``run_dir`` where it holds brokers), or
    None where one socket serves it (a socket path given, or a host without per-GPU brokers)."""
    given = socket_path or os.environ.get(SOCKET_ENV) or None
    if given is not None and not os.path.isdir(given):
        return None
    directory = given or run_dir
    if given is None and not gpu_sockets(directory):
        return None
    return directory


def find_socket(
    socket_path: str | None = None, run_dir: str = DEFAULT_RUN_DIR, *, gpu_uuid: str | None = None
) -> tuple[str, str | None]:
    """(the broker's socket, the GPU UUID it must serve or None where any will do).
    ``gpu_uuid``: the GPU to find the broker of (default: this process's, ``current_gpu_uuid``).

    Raises BrokerError: UNAVAILABLE naming the UUID and the unit to start when the directory
    has no broker for this process's GPU, FAILED_PRECONDITION when the process sees no GPU."""
    directory = broker_dir(socket_path, run_dir)
    if directory is None:
        return socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET, None
    brokers = gpu_sockets(directory)
    uuid = gpu_uuid or current_gpu_uuid()
    here = ", ".join(u for u, path in brokers.items() if os.path.exists(path)) or "none running"
    if uuid is None:
        raise BrokerError(
            Code.FAILED_PRECONDITION,
            f"{directory} holds a broker per GPU (for {here}) but this process sees no GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); pass the socket of the one to use",
        )
    socket = os.path.join(directory, uuid, SOCKET_NAME)
    if not os.path.exists(socket):
        raise BrokerError(
            Code.UNAVAILABLE,
            f"no broker for GPU {uuid} (this process's device) in {directory}: start it with "
            f"'systemctl start memory-broker@{uuid}' (brokers there: {here})",
        )
    return socket, uuid


def check_device(found: str, wanted: str | None, socket: str) -> None:
    """Refuse a broker that serves another GPU than the one discovery looked for."""
    if wanted is not None and found != wanted:
        raise BrokerError(
            Code.FAILED_PRECONDITION,
            f"the broker on {socket} serves GPU {found or '(none: a host arena)'}, not this process's GPU {wanted}; "
            "its directory is misnamed or the broker was started with another arena.device",
        )
