"""An adapter's layout as both sides read it: where each weight row sits in the adapter's pages,
and the element-offset tables that kernels index the arena with.

Every LoRA matrix is stored as rank-many rows: ``A`` as ``[r, in_features]`` and ``B``
transposed, as ``[r, out_features]``; a row never straddles a page and every row starts at a
multiple of ``row_align`` bytes. A layout is relative to the adapter's own object (page 0 is
the object's first page), so only the physical page list changes across reloads, and
``row_offsets``/``offset_table`` turn the pair into absolute element offsets into the arena's
1-D physical view. Deciding where rows go (placement) is the daemon's job
(``broker.adapters.layout``); the proto form is ``wire.messages``'. No files, tiers or stores here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

# Element types an adapter can be stored in, with their sizes in bytes.
DTYPE_SIZES: Mapping[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
# Default alignment of every row's first byte (16 bytes lets a GPU vectorise the gathers).
DEFAULT_ROW_ALIGN = 16
# Offset-table entry for rows past a slot's rank (kernels never read them).
NO_ROW = -1


def elem_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unknown adapter dtype {dtype!r}; choose one of {', '.join(DTYPE_SIZES)}") from None


@dataclass(frozen=True, slots=True)
class ModuleShard:
    """One tensor-parallel rank's share of one module's LoRA weights, in every layer: a layer
    that splits its output (column-parallel) keeps part ``index`` of ``count`` of B's output
    rows and all of A; one that splits its input (row-parallel, ``split_input``) keeps that
    part of A's input columns and all of B (vLLM's ``slice_lora_b`` / ``slice_lora_a``)."""

    module: str
    split_input: bool
    index: int
    count: int

    def __post_init__(self) -> None:
        if not self.module or not (self.count >= 1 and 0 <= self.index < self.count):
            raise ValueError(
                f"shard of module {self.module!r}: part {self.index} of {self.count} (give a module name, "
                "a count >= 1 and 0 <= index < count)"
            )

    @property
    def text(self) -> str:
        return f"{self.module}:{'i' if self.split_input else 'o'}{self.index}/{self.count}"

    def part(self, width: int) -> tuple[int, int]:
        """(first element, elements) of this part of a dimension of ``width``.

        Raises:
            ValueError: ``count`` does not divide ``width``.
        """
        if width % self.count:
            raise ValueError(
                f"module {self.module}'s {'input' if self.split_input else 'output'} width {width} does not "
                f"split into {self.count} equal parts"
            )
        size = width // self.count
        return self.index * size, size


def shards_text(shards: Iterable[ModuleShard]) -> str:
    """The canonical text of a set of shards (sorted; "" for none, or only whole ones):
    what a layout's ``shard`` says and what names a sharded copy.

    Raises:
        ValueError: a module listed twice.
    """
    split = [s for s in shards if s.count > 1]
    names = [s.module for s in split]
    if len(set(names)) != len(names):
        raise ValueError(f"a module is listed twice in shards: {sorted(names)}")
    return ",".join(sorted(s.text for s in split))


def parse_shards(text: str) -> tuple[ModuleShard, ...]:
    """The shards ``shards_text`` wrote ("" -> none).

    Raises:
        ValueError: text ``shards_text`` does not write.
    """
    out = []
    for item in filter(None, text.split(",")):
        module, _, rest = item.rpartition(":")
        index, _, count = rest[1:].partition("/")
        if not module or rest[:1] not in ("i", "o") or not index.isdigit() or not count.isdigit():
            raise ValueError(f"{item!r} is not a shard (module:o<index>/<count> or module:i<index>/<count>)")
        out.append(ModuleShard(module, rest[0] == "i", int(index), int(count)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class RowChunk:
    """Consecutive rows of one matrix inside one page."""

    # Page index within the adapter's object (0 .. num_pages - 1), not a physical page.
    page: int
    # Byte offset of the chunk's first row inside that page.
    offset: int
    # Rows in the chunk; row i of the chunk starts at offset + i * row_stride.
    rows: int


@dataclass(frozen=True, slots=True)
class MatrixPlacement:
    """The rows of one matrix (A, or B transposed) of one module."""

    layer: int
    module: str
    # "A" ([rank, in_features]) or "B" (stored transposed: [rank, out_features]).
    kind: str
    # Rows (the module's rank).
    rows: int
    # Elements in one row: in_features for A, out_features for B.
    row_elems: int
    # Bytes between consecutive rows of a chunk (row bytes rounded up to the row alignment).
    row_stride: int
    # In row order: the first chunk holds rows 0 .. chunks[0].rows - 1, and so on.
    chunks: tuple[RowChunk, ...]

    def row_positions(self) -> Iterable[tuple[int, int]]:
        """(page index in object, byte offset in page) of every row, in row order."""
        for c in self.chunks:
            for i in range(c.rows):
                yield c.page, c.offset + i * self.row_stride


@dataclass(frozen=True, slots=True)
class ModulePlacement:
    """Both matrices of one module of one layer, with what the kernels need beside the rows."""

    layer: int
    module: str
    rank: int
    scaling: float
    in_features: int
    out_features: int
    a: MatrixPlacement
    b: MatrixPlacement


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    """An adapter's placement in ``num_pages`` pages of ``page_size`` bytes, elements of ``dtype``."""

    page_size: int
    # Element type of every stored row ("float32", "float16", "bfloat16").
    dtype: str
    elem_size: int
    # Every row starts at a multiple of this many bytes (and of elem_size).
    row_align: int
    num_pages: int
    # Bytes used at the start of each page (rows end there; the rest of the page is unused).
    page_used: tuple[int, ...]
    # In placement order: by layer, then module as listed at planning time.
    modules: tuple[ModulePlacement, ...]
    # The tensor-parallel shards it holds (``shards_text``); "": the whole adapter.
    shard: str = ""
    _index: dict[tuple[int, str], ModulePlacement] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update({(m.layer, m.module): m for m in self.modules})

    @property
    def row_align_elems(self) -> int:
        """Every row's element offset is a multiple of this (the kernels' ``row_align``)."""
        return self.row_align // self.elem_size

    @property
    def used_bytes(self) -> int:
        """Bytes of the pages that rows (and their alignment padding) occupy."""
        return sum(self.page_used)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights themselves, without padding."""
        return sum((m.a.rows * m.a.row_elems + m.b.rows * m.b.row_elems) for m in self.modules) * self.elem_size

    @property
    def has_padding(self) -> bool:
        """Whether the used bytes include alignment gaps (a packed image must be zeroed)."""
        return self.used_bytes != self.weight_bytes

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({m.layer for m in self.modules}))

    @property
    def module_names(self) -> tuple[str, ...]:
        return tuple(sorted({m.module for m in self.modules}))

    def module(self, layer: int, module: str) -> ModulePlacement:
        """Raises KeyError when the adapter does not adapt that module in that layer."""
        return self._index[(layer, module)]

    def get(self, layer: int, module: str) -> ModulePlacement | None:
        return self._index.get((layer, module))

    def matrix(self, layer: int, module: str, kind: str) -> MatrixPlacement:
        m = self._index[(layer, module)]
        if kind == "A":
            return m.a
        if kind == "B":
            return m.b
        raise ValueError(f"kind must be 'A' or 'B', not {kind!r}")

    def image_offsets(self) -> tuple[int, ...]:
        """Start of each page's used bytes in a packed image (pages' used parts back to back)."""
        out, pos = [], 0
        for used in self.page_used:
            out.append(pos)
            pos += used
        return tuple(out)

    def to_dict(self) -> dict:
        """A JSON-able form (logs, tools, other processes outside gRPC); ``from_dict`` reverses it.

        The proto form is ``wire.messages``' job, the one codec both sides use on the wire.
        """
        return {
            "page_size": self.page_size,
            "dtype": self.dtype,
            "row_align": self.row_align,
            "num_pages": self.num_pages,
            "page_used": list(self.page_used),
            **({"shard": self.shard} if self.shard else {}),
            "modules": [
                {
                    "layer": m.layer,
                    "module": m.module,
                    "rank": m.rank,
                    "scaling": m.scaling,
                    "in_features": m.in_features,
                    "out_features": m.out_features,
                    "a": [[c.page, c.offset, c.rows] for c in m.a.chunks],
                    "b": [[c.page, c.offset, c.rows] for c in m.b.chunks],
                    "a_stride": m.a.row_stride,
                    "b_stride": m.b.row_stride,
                }
                for m in self.modules
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> AdapterLayout:
        mods = []
        for m in d["modules"]:
            layer, name, rank = int(m["layer"]), str(m["module"]), int(m["rank"])
            a = MatrixPlacement(
                layer,
                name,
                "A",
                rank,
                int(m["in_features"]),
                int(m["a_stride"]),
                tuple(RowChunk(*map(int, c)) for c in m["a"]),
            )
            b = MatrixPlacement(
                layer,
                name,
                "B",
                rank,
                int(m["out_features"]),
                int(m["b_stride"]),
                tuple(RowChunk(*map(int, c)) for c in m["b"]),
            )
            mods.append(ModulePlacement(layer, name, rank, float(m["scaling"]), a.row_elems, b.row_elems, a, b))
        dtype = str(d["dtype"])
        return cls(
            page_size=int(d["page_size"]),
            dtype=dtype,
            elem_size=elem_size(dtype),
            row_align=int(d["row_align"]),
            num_pages=int(d["num_pages"]),
            page_used=tuple(int(x) for x in d["page_used"]),
            modules=tuple(mods),
            shard=str(d.get("shard", "")),
        )


def _matrix_offsets(m: MatrixPlacement, pages: Sequence[int], page_size: int, es: int) -> np.ndarray:
    out = np.empty(m.rows, dtype=np.int64)
    i = 0
    for c in m.chunks:
        base = pages[c.page] * page_size + c.offset
        out[i : i + c.rows] = np.arange(c.rows, dtype=np.int64) * m.row_stride + base
        i += c.rows
    return out // es


def row_offsets(layout: AdapterLayout, pages: Sequence[int]) -> dict[tuple[int, str, str], np.ndarray]:
    """Absolute element offsets of every row, for the object whose physical pages are ``pages``.

    Returns:
        (layer, module, "A" | "B") -> int64 [rank]: row i of that matrix starts at element
        ``offsets[i]`` of the arena's physical view seen as a 1-D tensor of ``layout.dtype``
        (page p starts at element ``p * page_size / elem_size``).

    Raises:
        ValueError: the page list does not match the layout's page count.
    """
    if len(pages) != layout.num_pages:
        raise ValueError(f"the layout spans {layout.num_pages} pages; {len(pages)} physical pages were given")
    ps, es = layout.page_size, layout.elem_size
    out: dict[tuple[int, str, str], np.ndarray] = {}
    for m in layout.modules:
        out[(m.layer, m.module, "A")] = _matrix_offsets(m.a, pages, ps, es)
        out[(m.layer, m.module, "B")] = _matrix_offsets(m.b, pages, ps, es)
    return out


@dataclass(frozen=True, slots=True)
class OffsetTable:
    """Kernel inputs for one launch: one layer, one or more fused module slices."""

    # int64 [num_slots, num_slices, max_rank]: element offset of each row of A; NO_ROW past a rank.
    a_offsets: np.ndarray
    # int64 [num_slots, num_slices, max_rank]: element offset of each row of Bᵀ; NO_ROW past a rank.
    b_offsets: np.ndarray
    # int32 [num_slots]: rank per slot (0 for an empty slot or one that adapts none of the slices).
    ranks: np.ndarray
    # float32 [num_slots]: scaling per slot.
    scalings: np.ndarray


def offset_table(
    slots: Sequence[tuple[AdapterLayout, Sequence[int]] | None],
    layer: int,
    modules: Sequence[str],
    max_rank: int | None = None,
) -> OffsetTable:
    """Build one launch's offset tables for adapters in slots and fused ``modules`` slices.

    Args:
        slots: per slot, (layout, physical pages) of the adapter there, or None for an empty slot.
        layer: the layer this launch serves.
        modules: the slices, in the kernel's slice order (e.g. q_proj, k_proj, v_proj).
        max_rank: the table's rank dimension; at least the largest rank (default: exactly that).

    The kernels take one rank and one scaling per slot for all slices of a launch, so the
    slices fused for a slot must all be adapted, with one rank and one scaling; an adapter
    whose fused modules differ (rank_pattern/alpha_pattern, or a module it does not adapt)
    is served by separate launches. A slot whose adapter adapts none of the slices gets rank
    0 (its tokens' outputs are left untouched).

    Raises:
        ValueError: slices of one slot with different ranks or scalings, or a max_rank too small.
    """
    per_slot: list[tuple[int, float, list] | None] = []
    top = 0
    for s, entry in enumerate(slots):
        if entry is None:
            per_slot.append(None)
            continue
        layout, pages = entry
        mods = [layout.get(layer, name) for name in modules]
        present = [m for m in mods if m is not None]
        if not present:
            per_slot.append(None)
            continue
        if len(present) != len(mods) or len({m.rank for m in present}) > 1 or len({m.scaling for m in present}) > 1:
            desc = ", ".join(
                f"{name}: " + ("absent" if m is None else f"rank {m.rank} scaling {m.scaling:g}")
                for name, m in zip(modules, mods)
            )
            raise ValueError(
                f"slot {s} in layer {layer} cannot fuse slices with different ranks or scalings ({desc}); "
                "launch these modules separately"
            )
        per_slot.append((present[0].rank, present[0].scaling, [(layout, pages, m) for m in present]))
        top = max(top, present[0].rank)
    if max_rank is None:
        max_rank = top
    elif max_rank < top:
        raise ValueError(f"max_rank {max_rank} is below the largest rank in the batch ({top})")
    n = len(slots)
    a = np.full((n, len(modules), max_rank), NO_ROW, dtype=np.int64)
    b = np.full((n, len(modules), max_rank), NO_ROW, dtype=np.int64)
    ranks = np.zeros(n, dtype=np.int32)
    scalings = np.zeros(n, dtype=np.float32)
    for s, entry in enumerate(per_slot):
        if entry is None:
            continue
        rank, scaling, mods = entry
        ranks[s], scalings[s] = rank, scaling
        for j, (layout, pages, m) in enumerate(mods):
            if len(pages) != layout.num_pages:
                raise ValueError(f"slot {s}: the layout spans {layout.num_pages} pages; {len(pages)} were given")
            a[s, j, :rank] = _matrix_offsets(m.a, pages, layout.page_size, layout.elem_size)
            b[s, j, :rank] = _matrix_offsets(m.b, pages, layout.page_size, layout.elem_size)
    return OffsetTable(a, b, ranks, scalings)
