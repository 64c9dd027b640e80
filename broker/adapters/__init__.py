"""LoRA adapters in the broker: registry, placement into pages, tiers and their manager.

``registry`` validates PEFT directories and persists what is registered; ``layout`` decides
where every weight row sits inside an adapter's pages and turns that into the kernels'
element-offset tables; ``tiers`` does the blocking copies (file -> host image -> pages);
``policy`` orders victims within a tier; ``manager`` runs it all on the broker's event loop
on top of the object store. Nothing here imports gRPC.
"""

from importlib import import_module
from typing import Any

# Names re-exported here, by the module that defines them. Loaded on first use, so that
# importing one light module of this package (``policy``, ``layout``) does not load the
# manager, the registry and sqlite3 with it.
_EXPORTS = {
    "layout": ("AdapterLayout", "LoraModuleSpec", "MatrixPlacement", "ModulePlacement", "OffsetTable", "RowChunk",
               "offset_table", "pages_needed", "plan_layout", "row_offsets"),
    "manager": ("AcquiredAdapter", "AcquireResult", "AdapterConfig", "AdapterManager", "AdapterStatus",
                "PrefetchResult", "Tier"),
    "registry": ("AdapterInfo", "AdapterMeta", "AdapterPage", "AdapterRegistry", "inspect_peft_dir"),
}  # fmt: skip
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
