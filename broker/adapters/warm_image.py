"""Warm images: an adapter laid out in host memory exactly as it will sit in its pages.

``build_warm_image`` reads an adapter's safetensors file (cold) and lays its weights out
as in the pages (warm): A rows and Bᵀ rows in the layout's order, converted to the broker's
dtype, each page's used bytes back to back, so promotion to hot is one copy per page. With
int8 warm storage the image keeps each row as int8 with one fp32 scale (absmax / 127) and
promotion dequantizes. Every image carries the SHA-256 of the page bytes it stands for
(``packed_checksum``); ``pages_checksum`` reads the same bytes back out of an arena mapping.

Blocking code for executor threads; touches no manager, store or loop state.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from memory_broker.broker.adapters.dtypes import FILE_NAME, RAW, convert, from_f32, to_f32
from memory_broker.broker.adapters.layout import AdapterLayout, MatrixPlacement, parse_shards
from memory_broker.broker.adapters.peft import AdapterMeta
from memory_broker.broker.adapters.safetensors_io import WeightsFile
from memory_broker.proto.wire.mapping import ArenaView

# int8 warm storage: q = round(x / s), s = absmax(row) / INT8_MAX, so |x - q s| <= s / 2.
INT8_MAX = 127
# Checksums read "sha256:<hex>" (the algorithm is named so it can change).
CHECKSUM_ALGO = "sha256"


def packed_checksum(packed: np.ndarray) -> str:
    """The checksum of a packed page image (the pages' used bytes back to back). Blocking;
    hashlib releases the GIL while it hashes."""
    h = hashlib.new(CHECKSUM_ALGO)
    h.update(memoryview(packed).cast("B"))
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


def pages_checksum(view: ArenaView, layout: AdapterLayout, pages: Sequence[int]) -> str:
    """The checksum of what ``pages`` hold now, read through ``view`` (the bytes
    ``packed_checksum`` hashes when the pages hold the image). Blocking."""
    if len(pages) != layout.num_pages:
        raise ValueError(f"the layout spans {layout.num_pages} pages; {len(pages)} were given")
    h = hashlib.new(CHECKSUM_ALGO)
    from memory_broker.proto.wire.mapping.host import HostArenaView

    host = isinstance(view, HostArenaView)
    for p, used in zip(pages, layout.page_used):
        if not used:
            continue
        if host:
            h.update((ctypes.c_uint8 * used).from_address(view.page_address(p)))
        else:  # a device arena: copy the page's used bytes to the host first
            h.update(view.tensor(view.page_address(p), used).cpu().numpy())
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


def image_checksum(image: WarmImage) -> str:
    """The checksum of the page bytes ``image`` stands for (an int8 image: once dequantized)."""
    return packed_checksum(image.packed if image.packed is not None else dequantize(image))


@dataclass(slots=True, eq=False)
class WarmImage:
    """One adapter in host memory, ready to be written into its pages.

    ``packed`` holds the pages' used bytes back to back (``layout.image_offsets()``); an
    int8 image holds instead one int8 row per weight row (``q``, in layout order: per
    module A rows then Bᵀ rows) and one float32 scale per row (``scales``).
    """

    layout: AdapterLayout
    packed: np.ndarray | None = None
    q: np.ndarray | None = None
    scales: np.ndarray | None = None
    # Bytes of the weights file read to build it.
    source_bytes: int = 0
    # The weights file it was built from (``file_identity``), when known.
    source_identity: tuple[int, int, int] | None = None
    # ``packed_checksum`` of the page bytes it stands for (what its pages must hold).
    checksum: str = ""

    @property
    def int8(self) -> bool:
        return self.q is not None

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        return self.q.nbytes + self.scales.nbytes

    def matrices(self) -> Iterator[tuple[MatrixPlacement, np.ndarray, np.ndarray]]:
        """int8 images: (placement, q int8 [rows, row_elems], scales float32 [rows]) per matrix."""
        qpos = spos = 0
        for m in self.layout.modules:
            for mp in (m.a, m.b):
                n = mp.rows * mp.row_elems
                yield mp, self.q[qpos : qpos + n].reshape(mp.rows, mp.row_elems), self.scales[spos : spos + mp.rows]
                qpos += n
                spos += mp.rows


def rows_view(buf: np.ndarray, start: int, rows: int, mp: MatrixPlacement, raw, es: int) -> np.ndarray:
    """[rows, row_elems] of ``raw`` elements at byte ``start`` of ``buf``, rows ``row_stride`` apart."""
    return np.ndarray((rows, mp.row_elems), dtype=raw, buffer=buf, offset=start, strides=(mp.row_stride, es))


def build_warm_image(
    meta: AdapterMeta,
    layout: AdapterLayout,
    int8: bool = False,
    threads: int = 1,
) -> WarmImage:
    """Read an adapter's file and lay it out for its pages (cold -> warm). Blocking.

    Args:
        meta: the registered adapter.
        layout: its placement (``plan_layout`` of ``meta.weights``).
        int8: keep int8 rows with per-row scales instead of ``layout.dtype`` elements.
        threads: split the copies over this many threads (the copies release the GIL).

    Raises:
        BrokerError(FAILED_PRECONDITION): the file is gone or no longer matches the registration.
    """
    with WeightsFile(meta) as wf:
        mats = _matrices(meta, layout, wf)
        if int8:
            out = _build_int8(wf, layout, mats, meta.file_bytes)
            out.source_identity = wf.identity
            out.checksum = image_checksum(out)
            return out
        img = _build_packed(wf, layout, mats, threads)
        ident = wf.identity
    return WarmImage(
        layout, packed=img, source_bytes=meta.file_bytes, source_identity=ident, checksum=packed_checksum(img)
    )


def build_packed_into(meta: AdapterMeta, layout: AdapterLayout, out: np.ndarray) -> tuple[int, int, int]:
    """Lay an adapter's file out for its pages straight into ``out`` (``layout.used_bytes`` of
    zeroed uint8, e.g. the mapping of the image file being written, so that no copy of the
    whole image is made in anonymous memory); returns the weights file's identity. Blocking.

    Raises:
        BrokerError(FAILED_PRECONDITION): the file is gone or no longer matches the registration.
    """
    if out.dtype != np.uint8 or out.shape != (layout.used_bytes,):
        raise ValueError(f"need a uint8 buffer of {layout.used_bytes} bytes, not {out.dtype} {out.shape}")
    with WeightsFile(meta) as wf:
        _build_packed(wf, layout, _matrices(meta, layout, wf), 1, out)
        return wf.identity


def _matrices(meta: AdapterMeta, layout: AdapterLayout, wf: WeightsFile) -> list:
    """(placement, its module, the file entry, the columns kept or None) of every matrix, in
    layout order. A sharded layout (``layout.shard``) keeps part of each split matrix's columns
    (of A's rows, or of Bᵀ's): the file's tensors are checked against the registered shapes."""
    paths = {m.name: m.path for m in meta.modules}
    full = {(w.layer, w.module): w for w in meta.weights}
    shards = {s.module: s for s in parse_shards(layout.shard)}
    mats = []
    for m in layout.modules:
        key = f"{meta.key_prefix}{m.layer}.{paths[m.module]}.lora_"
        w, sh = full[(m.layer, m.module)], shards.get(m.module)
        a_cols = sh.part(w.in_features) if sh is not None and sh.split_input else None
        b_cols = sh.part(w.out_features) if sh is not None and not sh.split_input else None
        mats.append((m.a, m, wf.entry(key + "A.weight", "A", m.rank, w.in_features), a_cols))
        mats.append((m.b, m, wf.entry(key + "B.weight", "B", m.rank, w.out_features), b_cols))
    return mats


def _kept(rows: np.ndarray, cols: tuple[int, int] | None) -> np.ndarray:
    """``rows`` ([rank, width]), or the columns of it a shard keeps."""
    return rows if cols is None else rows[:, cols[0] : cols[0] + cols[1]]


def _build_packed(
    wf: WeightsFile, layout: AdapterLayout, mats: list, threads: int, out: np.ndarray | None = None
) -> np.ndarray:
    """The packed page image of ``mats`` ((placement, module, file entry) in layout order):
    the pages' used bytes back to back, in ``layout.dtype`` (written into ``out``, zeroed, when
    given)."""
    img = out if out is not None else (np.zeros if layout.has_padding else np.empty)(layout.used_bytes, np.uint8)
    offs = layout.image_offsets()
    raw, es = RAW[layout.dtype], layout.elem_size
    want = FILE_NAME[layout.dtype]
    # Rows stored as in the file (A, same dtype, no padding) are read straight into the
    # image, one read per chunk; the rest (Bᵀ, conversions) are read into a small scratch
    # buffer that stays in cache and laid out from there by numpy.
    moves: list[tuple[int, int, int]] = []
    arrays: list[tuple[MatrixPlacement, tuple]] = []
    for mp, _m, ent, cols in mats:
        dt, _shape, off = ent
        row_bytes = mp.row_elems * es
        if mp.kind == "A" and dt == want and mp.row_stride == row_bytes and cols is None:
            r = 0
            for c in mp.chunks:
                moves.append((offs[c.page] + c.offset, off + r * row_bytes, c.rows * row_bytes))
                r += c.rows
        else:
            arrays.append((mp, ent, cols))

    def copy_moves(part):
        mv = memoryview(img)
        for d, sr, n in part:
            wf.read_into(mv[d : d + n], sr)

    def copy_arrays(part):
        scratch = wf.scratch_for([ent for _mp, ent, _c in part])
        for mp, (dt, shape, off), cols in part:
            rows = convert(wf.array(dt, shape, off, scratch), dt, layout.dtype)
            rows = _kept(rows if mp.kind == "A" else rows.T, cols)
            i = 0
            for c in mp.chunks:
                dst = rows_view(img, offs[c.page] + c.offset, c.rows, mp, raw, es)
                np.copyto(dst, rows[i : i + c.rows], casting="no")
                i += c.rows

    if threads <= 1 or not arrays or not moves:
        copy_moves(moves)
        copy_arrays(arrays)
    else:
        # Two streams: the plain reads beside the transposes (both release the GIL).
        errors: list[BaseException] = []

        def run_arrays(part=arrays):
            try:
                copy_arrays(part)
            except BaseException as e:  # re-raised below, in the caller's thread
                errors.append(e)

        helper = threading.Thread(target=run_arrays, name="adapter-copy")
        helper.start()
        try:
            copy_moves(moves)
        finally:
            helper.join()
        if errors:
            raise errors[0]
    return img


def _build_int8(wf: WeightsFile, layout: AdapterLayout, mats: list, source_bytes: int) -> WarmImage:
    total = sum(mp.rows * mp.row_elems for mp, *_ in mats)
    q = np.empty(total, dtype=np.int8)
    scales = np.empty(sum(mp.rows for mp, *_ in mats), dtype=np.float32)
    qpos = spos = 0
    scratch = wf.scratch_for([ent for _mp, _m, ent, _c in mats])
    for mp, _m, (dt, shape, off), cols in mats:
        rows = to_f32(wf.array(dt, shape, off, scratch), dt)
        rows = _kept(rows if mp.kind == "A" else rows.T, cols)
        absmax = np.abs(rows).max(axis=1)
        s = np.where(absmax > 0, absmax / INT8_MAX, 1.0).astype(np.float32)
        n = mp.rows * mp.row_elems
        q[qpos : qpos + n].reshape(mp.rows, mp.row_elems)[...] = np.clip(
            np.rint(rows / s[:, None]), -INT8_MAX, INT8_MAX
        )
        scales[spos : spos + mp.rows] = s
        qpos += n
        spos += mp.rows
    return WarmImage(layout, q=q, scales=scales, source_bytes=source_bytes)


def dequantize(image: WarmImage) -> np.ndarray:
    """An int8 image as the packed page image it stands for (pages' used bytes back to back)."""
    layout = image.layout
    raw, es = RAW[layout.dtype], layout.elem_size
    img = (np.zeros if layout.has_padding else np.empty)(layout.used_bytes, dtype=np.uint8)
    offs = layout.image_offsets()
    for mp, q, s in image.matrices():
        rows = q.astype(np.float32)
        rows *= s[:, None]
        rows = from_f32(rows, layout.dtype)
        i = 0
        for c in mp.chunks:
            np.copyto(rows_view(img, offs[c.page] + c.offset, c.rows, mp, raw, es), rows[i : i + c.rows], casting="no")
            i += c.rows
    return img
