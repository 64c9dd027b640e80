"""The ``vllm.general_plugins`` entry point for adapters from the broker.

vLLM runs ``register`` in every process it starts (API server, engine core, workers), maybe
more than once; it is idempotent. It does nothing unless ``MEMORY_BROKER_SOCKET`` names the
broker's socket; then it registers the "memory-broker" ``LoRAResolver`` and installs the worker
patches (``lora_patches``) in the mode ``MEMORY_BROKER_VLLM_LORA`` says ("zero-copy", the
default, or "copy"; "off" disables the plugin) and the rounding ``MEMORY_BROKER_VLLM_LORA_ROUNDING``
says ("vllm", the default: tokens as vLLM's own LoRA gives them; "once": the kernels' single
rounding). It owns only that decision.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("vllm.memory_broker.lora")

_done = False


def register() -> None:
    """Install the memory-broker LoRA integration in this vLLM process (once)."""
    global _done
    if _done:
        return
    _done = True
    socket = os.environ.get("MEMORY_BROKER_SOCKET", "").strip()
    mode = os.environ.get("MEMORY_BROKER_VLLM_LORA", "zero-copy").strip().lower() or "zero-copy"
    if not socket or mode == "off":
        return
    from memory_broker.clients.vllm import lora_patches

    rounding = os.environ.get("MEMORY_BROKER_VLLM_LORA_ROUNDING", "vllm").strip().lower() or "vllm"
    if not lora_patches.install(socket, mode, rounding):
        return
    from vllm.lora.resolver import LoRAResolverRegistry

    from memory_broker.clients.vllm.lora_resolver import RESOLVER_NAME, BrokerLoRAResolver

    if RESOLVER_NAME not in LoRAResolverRegistry.get_supported_resolvers():
        LoRAResolverRegistry.register_resolver(RESOLVER_NAME, BrokerLoRAResolver(socket))
