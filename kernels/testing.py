"""Fake paged arenas for the kernel tests and benchmarks: random LoRA matrices packed row by
row into shuffled pages, with the offset tables the kernels take.

It stands in for the broker's adapter layout (ARCHITECTURE.md, the adapter layout: a row never straddles a
page, rows of one matrix land anywhere) without a broker; production code must not use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .records import LoraTables


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One adapter's matrices for one fused module, in PEFT's shapes, fp32 on the host."""

    # Per slice: lora_A, [rank, in_features] (shared input x).
    a: tuple[torch.Tensor, ...]
    # Per slice: lora_B, [out_features_j, rank].
    b: tuple[torch.Tensor, ...]
    # alpha / rank (or alpha / sqrt(rank) with rsLoRA).
    scaling: float

    @property
    def rank(self) -> int:
        return self.a[0].shape[0]


@dataclass(frozen=True, slots=True)
class PackedArena:
    """An arena holding packed adapters, and the per-slot tables the kernels read it through."""

    # 1-D [num_pages * page_elems]; every element that holds no row is NaN.
    arena: torch.Tensor
    # int64 [num_slots, num_slices, max_rank]; row i of A for (slot, slice); ``unused_offset``
    # past the rank.
    a_offsets: torch.Tensor
    # int64 [num_slots, num_slices, max_rank]; row i of Bᵀ (column i of B); likewise.
    b_offsets: torch.Tensor
    # int32 [num_slots].
    ranks: torch.Tensor
    # float32 [num_slots].
    scalings: torch.Tensor
    # Per slice, its first column in the fused output, and its width.
    slice_offsets: tuple[int, ...]
    slice_sizes: tuple[int, ...]
    # Elements per page.
    page_elems: int

    @property
    def tables(self) -> LoraTables:
        """The four tables as the record the kernels take."""
        return LoraTables(self.a_offsets, self.b_offsets, self.ranks, self.scalings)


def random_adapter(
    rank: int, in_features: int, slice_sizes: Sequence[int], generator: torch.Generator, scaling: float | None = None
) -> LoraWeights:
    """Random matrices scaled so x @ Aᵀ @ Bᵀ stays near unit magnitude for unit-normal x."""
    a = tuple(torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features) for _ in slice_sizes)
    b = tuple(torch.randn(n, rank, generator=generator) / math.sqrt(max(rank, 1)) for n in slice_sizes)
    if scaling is None:
        scaling = 0.5 + 1.5 * float(torch.rand((), generator=generator))
    return LoraWeights(a=a, b=b, scaling=scaling)


def _check_adapters(
    adapters: Sequence[LoraWeights], page_elems: int, max_rank: int | None
) -> tuple[tuple[int, ...], int]:
    """``pack_adapters``'s checks: the adapters' common slice widths, and the tables' rank
    (``max_rank``, or the largest rank by default)."""
    if not adapters:
        raise ValueError("need at least one adapter")
    in_features = adapters[0].a[0].shape[1]
    slice_sizes = tuple(bj.shape[0] for bj in adapters[0].b)
    num_slices = len(slice_sizes)
    for slot, ad in enumerate(adapters):
        if len(ad.a) != num_slices or tuple(bj.shape[0] for bj in ad.b) != slice_sizes:
            raise ValueError(f"adapter {slot} has slices {[bj.shape[0] for bj in ad.b]}, expected {list(slice_sizes)}")
        if any(aj.shape[1] != in_features for aj in ad.a):
            raise ValueError(f"adapter {slot} has in_features {ad.a[0].shape[1]}, expected {in_features}")
    longest = max(in_features, *slice_sizes)
    if longest > page_elems:
        raise ValueError(f"a row of {longest} elements does not fit a page of {page_elems}")
    largest_rank = max(ad.rank for ad in adapters)
    max_rank = max(largest_rank, 1) if max_rank is None else max_rank
    if max_rank < largest_rank:
        raise ValueError(f"max_rank {max_rank} is below the largest rank {largest_rank}")
    return slice_sizes, max_rank


def _place_rows(
    lengths: Sequence[int], shuffled: Sequence[int], generator: torch.Generator, page_elems: int, row_align: int
) -> tuple[list[tuple[int, int]], int]:
    """First fit of rows (of ``lengths``, taken in ``shuffled`` order) with random gaps of up
    to three alignment units: (logical page, offset in page) per row in shuffled order, and
    the pages used."""
    placed: list[tuple[int, int]] = []  # (logical page, offset in page) per row, in shuffled order
    page, cursor = 0, 0
    for k in shuffled:
        n = lengths[k]
        gap = int(torch.randint(0, 4, (), generator=generator)) * row_align
        start = -(-(cursor + gap) // row_align) * row_align
        if start + n > page_elems:
            page, start = page + 1, 0
        placed.append((page, start))
        cursor = start + n
    used_pages = page + 1
    return placed, used_pages


def pack_adapters(
    adapters: Sequence[LoraWeights],
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    page_elems: int = 4096,
    max_rank: int | None = None,
    row_align: int = 1,
    spare_pages: int | None = None,
    unused_offset: int = 0,
) -> PackedArena:
    """Packs adapters (slot i = adapters[i]) into an arena of shuffled pages.

    Rows go in random order, first fit, with random gaps of up to three alignment units, so
    a matrix's rows are scattered over pages and start at uneven offsets. Page 0 is always a
    spare (all NaN) page, so a kernel that reads an unused table entry (offset 0) or past a
    row's end picks up NaN.

    Args:
        adapters: one per slot; all with the same number of slices and slice widths.
        dtype: the arena's dtype.
        generator: source of randomness (the caller records its seed).
        device: where the arena and tables are placed.
        page_elems: elements per page.
        max_rank: the tables' last dimension; at least the largest rank (the default).
        row_align: every row starts at a multiple of this many elements.
        spare_pages: empty pages shuffled in among the used ones; a quarter of them by default.
        unused_offset: table entry past a slot's rank: 0 (page 0, all NaN) or -1 (the adapter
            layer's NO_ROW, outside the arena); a kernel must read neither.

    Raises:
        ValueError: mismatched slices, a row longer than a page, or max_rank too small.
    """
    slice_sizes, max_rank = _check_adapters(adapters, page_elems, max_rank)
    num_slices = len(slice_sizes)

    # (table, slot, slice, row, values): table 0 is A, 1 is Bᵀ.
    rows: list[tuple[int, int, int, int, torch.Tensor]] = []
    for slot, ad in enumerate(adapters):
        for j in range(num_slices):
            for i in range(ad.rank):
                rows.append((0, slot, j, i, ad.a[j][i]))
                rows.append((1, slot, j, i, ad.b[j][:, i]))
    shuffled = torch.randperm(len(rows), generator=generator).tolist()

    placed, used_pages = _place_rows([r[4].shape[0] for r in rows], shuffled, generator, page_elems, row_align)

    spare = max(1, used_pages // 4 if spare_pages is None else spare_pages)
    total_pages = used_pages + spare
    # Physical page 0 stays spare; the used pages take random places among the rest.
    physical = (1 + torch.randperm(total_pages - 1, generator=generator)[:used_pages]).tolist()

    arena = torch.full((total_pages * page_elems,), float("nan"), dtype=dtype)
    a_offsets = torch.full((len(adapters), num_slices, max_rank), unused_offset, dtype=torch.int64)
    b_offsets = torch.full_like(a_offsets, unused_offset)
    for k, (logical, start) in zip(shuffled, placed):
        table, slot, j, i, values = rows[k]
        offset = physical[logical] * page_elems + start
        arena[offset : offset + values.shape[0]] = values.to(dtype)
        (a_offsets if table == 0 else b_offsets)[slot, j, i] = offset

    slice_offsets = tuple(int(sum(slice_sizes[:j])) for j in range(num_slices))
    return PackedArena(
        arena=arena.to(device),
        a_offsets=a_offsets.to(device),
        b_offsets=b_offsets.to(device),
        ranks=torch.tensor([ad.rank for ad in adapters], dtype=torch.int32, device=device),
        scalings=torch.tensor([ad.scaling for ad in adapters], dtype=torch.float32, device=device),
        slice_offsets=slice_offsets,
        slice_sizes=slice_sizes,
        page_elems=page_elems,
    )
