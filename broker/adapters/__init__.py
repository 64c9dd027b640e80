"""LoRA adapters in the broker: registry, placement into pages, tiers and their manager.

``registry`` validates PEFT directories and persists what is registered; ``layout`` decides
where every weight row sits inside an adapter's pages and turns that into the kernels'
element-offset tables; ``tiers`` does the blocking copies (file -> host image -> pages);
``policy`` orders victims within a tier; ``manager`` runs it all on the broker's event loop
on top of the object store. Nothing here imports gRPC.
"""

from memory_broker.broker.adapters.layout import (
    AdapterLayout,
    LoraModuleSpec,
    MatrixPlacement,
    ModulePlacement,
    OffsetTable,
    RowChunk,
    offset_table,
    pages_needed,
    plan_layout,
    row_offsets,
)
from memory_broker.broker.adapters.manager import (
    AcquiredAdapter,
    AcquireResult,
    AdapterConfig,
    AdapterManager,
    AdapterStatus,
    PrefetchResult,
    Tier,
)
from memory_broker.broker.adapters.registry import AdapterInfo, AdapterMeta, AdapterPage, AdapterRegistry, inspect_peft_dir

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
