"""The adapter wing's settings: one record, one name per knob (the configuration schema's names).

``AdapterConfig`` holds what the manager and its parts read: dtype, tier budgets, policies,
the image cache, conversion ahead of use and the checksum checks. Old field names
(``hot_budget_adapters`` and the like) are accepted as deprecated aliases that log once. It
validates itself and reads nothing else: no files, no store, no registry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from memory_broker.broker.adapters.layout import DEFAULT_ROW_ALIGN, DTYPE_SIZES
from memory_broker.broker.adapters.policy import make_tier_policy

# Old field name -> the one name it stands for now.
DEPRECATED_FIELDS = {
    "hot_budget_pages": "hot_tier_pages",
    "hot_budget_adapters": "hot_tier_adapters",
    "warm_budget_bytes": "warm_tier_bytes",
    "image_budget_bytes": "image_budget",
}
# How an operator sets each budget (for error messages): YAML key and flag.
SETTING_NAMES = {
    "hot_tier_pages": "adapters.hot_tier_pages (--hot-tier-pages)",
    "hot_tier_adapters": "adapters.hot_tier_adapters (--hot-tier-adapters)",
    "warm_tier_bytes": "adapters.warm_tier_bytes (--warm-tier-bytes)",
    "image_budget": "adapters.image_budget (--adapter-image-budget)",
}
_log = logging.getLogger(__name__)
_warned: set[str] = set()


def _deprecated(old: str) -> str:
    """The new name of ``old``, logging the first use of each old name in the process."""
    new = DEPRECATED_FIELDS[old]
    if old not in _warned:
        _warned.add(old)
        _log.warning("AdapterConfig.%s is deprecated; use %s (%s)", old, new, SETTING_NAMES[new])
    return new


@dataclass(slots=True)
class _AdapterSettings:
    # Element type of stored rows (hot pages, and warm images unless int8): the dtype of the
    # 1-D arena tensor the kernels read. "bfloat16", "float16" or "float32".
    dtype: str = "bfloat16"
    # Every row starts at a multiple of this many bytes (a multiple of the element size).
    row_align: int = DEFAULT_ROW_ALIGN
    # Most arena pages / adapters the hot tier may hold; 0 = bounded only by the pool.
    hot_tier_pages: int = 0
    hot_tier_adapters: int = 0
    # Host memory for warm images. 0 keeps no warm tier (an image lives only while it loads).
    warm_tier_bytes: int = 4 << 30
    # Keep warm images as int8 rows with a float32 scale per row (absmax / 127): a quarter
    # of fp32, half of bf16; promotion dequantizes, with |error| <= absmax(row) / 254.
    warm_int8: bool = False
    # Victim order of each tier: "lru", "lfu" or "gdsf" (see broker.adapters.policy).
    hot_policy: str = "lru"
    warm_policy: str = "lru"
    # Lease of the prepared object while a load writes it (capped at the store's max lease).
    load_lease_s: float = 300.0
    # Lease of prepare_acquire when the caller gives none (None: the store's default).
    acquire_lease_s: float | None = None
    # Loader threads when no executor is given.
    load_workers: int = 2
    # Threads one cold load splits its copies over (plain reads beside the Bᵀ transposes).
    copy_threads: int = 2
    # How many two-phase acquires are remembered (so commit and abort stay idempotent).
    remember_txns: int = 65536
    # Keep each adapter's converted page image in ``<state_dir>/images`` after its first
    # cold load, so later cold loads read it back in one sequential read instead of
    # converting the safetensors again (Bᵀ, dtype). Needs the registry's state_dir; not used
    # with warm_int8 (the image holds ``dtype`` elements).
    image_cache: bool = True
    # fsync each image before it is renamed into place (survives a power loss, not needed
    # for correctness: a torn image fails validation and is rebuilt).
    image_fsync: bool = False
    # Disk the images may take together; 0 = no limit. A load's image pushes out the least
    # recently used ones; a conversion ahead of use only takes room that is free.
    image_budget: int = 0
    # Free disk an image write must leave on the state directory's filesystem (the registry's
    # reserve): images are a cache and never take the room the registry needs.
    image_min_free: int = 64 << 20
    # Convert adapters into images ahead of use, in one background thread: each adapter
    # registered through the manager, and (``start``) every registered adapter without an
    # image, so a first acquire reads an image instead of converting the safetensors.
    convert_ahead: bool = True
    # Share of wall time conversion ahead of use may take (after each conversion it sleeps
    # the rest): a backlog of thousands of registrations drains in the background without
    # starving requests of the CPU (the backlog's size: adapter stats convert_queued).
    convert_duty: float = 0.25
    # Seconds between background checks of one hot adapter's pages against its checksum
    # (each check hashes one adapter, in its own thread); 0 turns the background check off.
    verify_interval_s: float = 30.0
    # Hash every image read back from disk and refuse one whose bytes changed.
    verify_images: bool = True


class AdapterConfig(_AdapterSettings):
    """The adapter wing's settings (see the fields' comments); old names are deprecated aliases."""

    __slots__ = ()

    def __init__(self, *args, **kwargs) -> None:
        for old in [k for k in kwargs if k in DEPRECATED_FIELDS]:
            new = _deprecated(old)
            if new in kwargs:
                raise TypeError(f"AdapterConfig got both {old} (deprecated) and {new}; give only {new}")
            kwargs[new] = kwargs.pop(old)
        super().__init__(*args, **kwargs)

    def __getattr__(self, name: str):
        # Only reached for names that are not fields: the deprecated aliases.
        if name in DEPRECATED_FIELDS:
            return getattr(self, _deprecated(name))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name in DEPRECATED_FIELDS:
            name = _deprecated(name)
        super().__setattr__(name, value)

    def validate(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"adapter dtype {self.dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
        if self.row_align <= 0 or self.row_align % DTYPE_SIZES[self.dtype]:
            raise ValueError(f"row_align {self.row_align} must be a positive multiple of the {self.dtype} element size")
        if self.image_min_free < 0:
            raise ValueError(f"image_min_free {self.image_min_free} must be >= 0 (0: no floor)")
        for name in ("hot_tier_pages", "hot_tier_adapters", "warm_tier_bytes", "image_budget"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"{SETTING_NAMES[name]} must be >= 0 (0 means no limit for hot budgets, no warm tier for warm)"
                )
        if self.verify_interval_s < 0:
            raise ValueError(f"verify_interval_s {self.verify_interval_s} must be >= 0 (0: no background checks)")
        if self.load_lease_s <= 0 or self.load_workers < 1 or self.copy_threads < 1:
            raise ValueError("load_lease_s must be positive, load_workers and copy_threads at least 1")
        make_tier_policy(self.hot_policy)
        make_tier_policy(self.warm_policy)
