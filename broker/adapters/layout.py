"""Placement: where an adapter's weight rows go inside its pages (the daemon decides it).

Rows are packed densely page after page in placement order (layer, then module, then A
before B); a row never straddles a page and every row starts at a multiple of ``row_align``
bytes. The layout types this produces, and the offset tables read from them, are shared with
the client and live in ``memory_broker.proto.wire.layout`` (re-exported here). This module knows
nothing of files, tiers or the object store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

# The layout types and readers, defined once for both sides.
from memory_broker.proto.wire.layout import (
    DEFAULT_ROW_ALIGN,
    DTYPE_SIZES,
    NO_ROW,
    AdapterLayout,
    MatrixPlacement,
    ModulePlacement,
    ModuleShard,
    OffsetTable,
    RowChunk,
    elem_size,
    offset_table,
    parse_shards,
    row_offsets,
    shards_text,
)

__all__ = [
    "DEFAULT_ROW_ALIGN",
    "DTYPE_SIZES",
    "NO_ROW",
    "AdapterLayout",
    "LoraModuleSpec",
    "MatrixPlacement",
    "ModulePlacement",
    "ModuleShard",
    "OffsetTable",
    "RowChunk",
    "elem_size",
    "offset_table",
    "pages_needed",
    "parse_shards",
    "plan_layout",
    "row_offsets",
    "shard_specs",
    "shards_text",
]


@dataclass(frozen=True, slots=True)
class LoraModuleSpec:
    """One adapted module of one layer, as placement needs it."""

    layer: int
    # Short module name ("q_proj"), unique within a layer.
    module: str
    rank: int
    in_features: int
    out_features: int
    # alpha / rank, or alpha / sqrt(rank) with rsLoRA.
    scaling: float


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


class _Packer:
    """Greedy dense packing: rows go to the current page until the next one would straddle."""

    def __init__(self, page_size: int, row_align: int):
        self.page_size = page_size
        self.row_align = row_align
        self.page = 0
        self.off = 0
        self.used: list[int] = [0]

    def place(self, rows: int, row_bytes: int, stride: int) -> tuple[RowChunk, ...]:
        chunks = []
        left = rows
        while left:
            off = _round_up(self.off, self.row_align)
            room = self.page_size - off
            fit = 0 if room < row_bytes else (room - row_bytes) // stride + 1
            if fit == 0:
                self.page += 1
                self.off = 0
                self.used.append(0)
                continue
            n = min(fit, left)
            chunks.append(RowChunk(self.page, off, n))
            end = off + (n - 1) * stride + row_bytes
            self.off = end
            self.used[self.page] = end
            left -= n
        return tuple(chunks)


def plan_layout(
    modules: Iterable[LoraModuleSpec],
    page_size: int,
    dtype: str,
    row_align: int = DEFAULT_ROW_ALIGN,
    shard: str = "",
) -> AdapterLayout:
    """Place every module's A and Bᵀ rows in pages, densely, in the order given.

    Args:
        modules: the adapted (layer, module) pairs; each pair at most once.
        page_size: bytes per page (the arena's).
        dtype: element type the rows are stored in.
        row_align: bytes; every row starts at a multiple of it. Must be a multiple of the
            element size and divide the page size.
        shard: the shards ``modules`` were cut to (``shard_specs``), recorded in the layout.

    Raises:
        ValueError: a row longer than a page, a bad alignment, a duplicate or empty module.
    """
    es = elem_size(dtype)
    if row_align <= 0 or row_align % es or page_size % row_align:
        raise ValueError(
            f"row_align {row_align} must be a positive multiple of the {dtype} element size ({es}) "
            f"that divides the page size {page_size}"
        )
    packer = _Packer(page_size, row_align)
    placed: list[ModulePlacement] = []
    seen: set[tuple[int, str]] = set()
    for spec in modules:
        key = (spec.layer, spec.module)
        if key in seen:
            raise ValueError(f"layer {spec.layer} module {spec.module} is listed twice")
        seen.add(key)
        if spec.rank <= 0:
            raise ValueError(f"layer {spec.layer} module {spec.module} has rank {spec.rank}")
        mats = []
        for kind, width in (("A", spec.in_features), ("B", spec.out_features)):
            row_bytes = width * es
            if row_bytes > page_size:
                raise ValueError(
                    f"a row of {kind} of layer {spec.layer} {spec.module} is {row_bytes} bytes "
                    f"({width} x {dtype}); it does not fit in a page of {page_size} bytes"
                )
            stride = _round_up(row_bytes, row_align)
            chunks = packer.place(spec.rank, row_bytes, stride)
            mats.append(MatrixPlacement(spec.layer, spec.module, kind, spec.rank, width, stride, chunks))
        placed.append(
            ModulePlacement(
                spec.layer, spec.module, spec.rank, spec.scaling, spec.in_features, spec.out_features, *mats
            )
        )
    if not placed:
        raise ValueError("an adapter needs at least one module")
    used = packer.used
    return AdapterLayout(
        page_size=page_size,
        dtype=dtype,
        elem_size=es,
        row_align=row_align,
        num_pages=len(used),
        page_used=tuple(used),
        modules=tuple(placed),
        shard=shard,
    )


def shard_specs(modules: Iterable[LoraModuleSpec], shards: Iterable[ModuleShard]) -> list[LoraModuleSpec]:
    """``modules`` as a tensor-parallel rank holds them: each sharded module's input (split
    input) or output width cut to its part; modules without a shard stay whole.

    Raises:
        ValueError: a part that does not divide its width.
    """
    by = {s.module: s for s in shards}
    out = []
    for m in modules:
        s = by.get(m.module)
        if s is None or s.count == 1:
            out.append(m)
        elif s.split_input:
            out.append(replace(m, in_features=s.part(m.in_features)[1]))
        else:
            out.append(replace(m, out_features=s.part(m.out_features)[1]))
    return out


def pages_needed(
    modules: Iterable[LoraModuleSpec], page_size: int, dtype: str, row_align: int = DEFAULT_ROW_ALIGN
) -> int:
    """Pages an adapter occupies for this page size and dtype."""
    return plan_layout(modules, page_size, dtype, row_align).num_pages
