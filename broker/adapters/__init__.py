"""LoRA adapters in the broker: registration, placement into pages, tiers, and the facade over them.

Where to start: ``manager`` (the facade the service calls) composes ``entry`` (each adapter's
state machine), ``hot_budget`` and ``warm_budget`` (the tiers' book-keeping), ``loader`` (loads
up the tiers), ``image_service`` (the converted-image cache and conversion ahead of use) and
``checks`` (checksum checks), each given the ``context`` record of what they share; ``stats``
and ``records`` are what it returns. Below them:
``peft`` validates PEFT directories (``patterns`` matches their module patterns in linear
time), ``registry`` persists them in SQLite, ``layout`` places
rows in pages, ``safetensors_io``, ``dtypes``, ``warm_image``, ``image_cache`` and
``page_writers`` do the blocking copies, ``policy`` orders victims. Nothing here imports gRPC.
"""

from importlib import import_module
from typing import Any

# Names re-exported here, by the module that defines them. Loaded on first use, so that
# importing one light module of this package (``policy``, ``layout``) does not load the
# manager, the registry and sqlite3 with it.
_EXPORTS = {
    "layout": (
        "AdapterLayout",
        "LoraModuleSpec",
        "MatrixPlacement",
        "ModulePlacement",
        "OffsetTable",
        "RowChunk",
        "offset_table",
        "pages_needed",
        "plan_layout",
        "row_offsets",
    ),
    "config": ("AdapterConfig",),
    "manager": ("AdapterManager",),
    "peft": ("AdapterInfo", "AdapterMeta", "inspect_peft_dir"),
    "records": ("AcquiredAdapter", "AcquireResult", "AdapterStatus", "PrefetchResult", "Tier"),
    "registry": ("AdapterPage", "AdapterRegistry"),
    "stats": ("AdapterStats",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)


__all__ = [
    "AcquireResult",
    "AcquiredAdapter",
    "AdapterConfig",
    "AdapterInfo",
    "AdapterLayout",
    "AdapterManager",
    "AdapterMeta",
    "AdapterPage",
    "AdapterRegistry",
    "AdapterStats",
    "AdapterStatus",
    "LoraModuleSpec",
    "MatrixPlacement",
    "ModulePlacement",
    "OffsetTable",
    "PrefetchResult",
    "RowChunk",
    "Tier",
    "inspect_peft_dir",
    "offset_table",
    "pages_needed",
    "plan_layout",
    "row_offsets",
]
