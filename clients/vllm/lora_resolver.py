"""``BrokerLoRAResolver``: vLLM's OpenAI server serves any adapter registered in the broker by
name, with no path on the engine's side and no restart.

The resolver asks the broker whether an adapter of that id is registered (one short admin
session per lookup, no arena mapping) and answers a ``LoRARequest`` whose path is
``broker://<adapter_id>``; the engine's worker then takes the weights from the broker
(``lora_patches``). With a directory of per-GPU brokers (tensor parallelism: each rank serves
its slice from its GPU's broker), a name resolves when every running broker of this process's
visible GPUs has it registered (``memory-broker adapters register --all`` registers it on every
broker). It owns no state beyond the socket path and never loads weights itself.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.lora.resolver import LoRAResolver  # noqa: E402

from memory_broker.clients.vllm.identity import BROKER_SCHEME, broker_lora_int_id
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc

log = logging.getLogger("vllm.memory_broker.lora")

RESOLVER_NAME = "memory-broker"


def registered(socket: str, adapter_id: str, timeout: float = 10.0) -> bool:
    """True when the broker on ``socket`` has an adapter registered under exactly ``adapter_id``."""
    from memory_broker.clients.admin import admin_session

    channel = grpc.insecure_channel(f"unix:{socket}")
    try:
        with admin_session(channel, client_name="vllm-lora-resolver", timeout=timeout) as md:
            stub = broker_pb2_grpc.MemoryBrokerStub(channel)
            page = stub.ListAdapters(
                pb.ListAdaptersRequest(prefix=adapter_id, limit=1000), metadata=md, timeout=timeout
            )
            return any(a.adapter_id == adapter_id for a in page.adapters)
    finally:
        channel.close()


def broker_sockets(socket: str) -> list[str]:
    """The brokers a name must be registered on: ``socket``, or with a directory of per-GPU
    brokers the running ones of this process's visible GPUs (its TP ranks')."""
    import os

    from memory_broker.proto.wire.gpus import SOCKET_NAME, visible_gpu_uuids

    if not os.path.isdir(socket):
        return [socket]
    paths = [os.path.join(socket, uuid, SOCKET_NAME) for uuid in visible_gpu_uuids()]
    return [p for p in paths if os.path.exists(p)]


def registered_everywhere(socket: str, adapter_id: str) -> bool:
    sockets = broker_sockets(socket)
    missing = [s for s in sockets if not registered(s, adapter_id)]
    if missing and len(missing) < len(sockets):
        log.warning(
            "memory-broker resolver: %r is registered on some brokers but not on %s: register it on every broker "
            "(memory-broker adapters register --all)",
            adapter_id,
            missing,
        )
    return bool(sockets) and not missing


class BrokerLoRAResolver(LoRAResolver):
    """Resolves an adapter name to the broker adapter of the same id."""

    def __init__(self, socket: str):
        self.socket = socket

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        try:
            found = await asyncio.to_thread(registered_everywhere, self.socket, lora_name)
        except grpc.RpcError as e:
            log.warning("memory-broker resolver: cannot ask the broker at %s about %r: %s", self.socket, lora_name, e)
            return None
        if not found:
            return None
        # The server renumbers lora_int_id; the worker goes by the broker:// path.
        return LoRARequest(
            lora_name, broker_lora_int_id(lora_name), BROKER_SCHEME + lora_name, base_model_name=base_model_name
        )
