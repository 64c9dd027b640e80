"""The client library: sessions with a memory broker and zero-copy access to its pages."""

from __future__ import annotations

from typing import Any

from memory_broker.clients.client import BrokerClient, BrokerObject, Transaction
from memory_broker.clients.step.adapters import AdapterLease, AdapterTables, LeasedAdapter
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.spec import Spec

# Multi-LoRA in an engine (clients.lora) imports torch: loaded on first use, so a client
# that only allocates pages never imports it.
_LORA_NAMES = frozenset({"LoRALinear", "LoraBatch", "LoraModel", "Segment", "admitted_sequences", "wrap_model"})

__all__ = [
    "AdapterLease",
    "AdapterTables",
    "BrokerClient",
    "BrokerError",
    "BrokerObject",
    "Code",
    "LeasedAdapter",
    "Spec",
    "Transaction",
    *sorted(_LORA_NAMES),
]


def __getattr__(name: str) -> Any:
    if name in _LORA_NAMES:
        from memory_broker.clients import lora

        return getattr(lora, name)
    raise AttributeError(f"module 'clients' has no attribute {name!r}")
