"""The blocking halves of the tiers: cold files to warm host images, warm images into pages.

``build_warm_image`` reads an adapter's safetensors file (cold) and lays its weights out
exactly as they will sit in the pages (warm): A rows and Bᵀ rows in the layout's order,
converted to the broker's dtype, each page's used bytes back to back, so promotion to hot is
one copy per page. With int8 warm storage the image keeps each row as int8 with one fp32
scale (absmax / 127) and promotion dequantizes while it writes. ``HostPageWriter`` does that
copy through the broker's own mapping of a host arena.

Checksums: every image carries the SHA-256 of the page bytes it stands for (the pages' used
bytes in layout order, ``packed_checksum``), computed when it is built from the file and
stored in the image file's header; an image read back from disk is checked against it, and
``pages_checksum`` reads the same bytes back out of an arena mapping, so the manager can tell
a hot copy that someone wrote into from the one it loaded.

Everything here is plain blocking code meant for executor threads: it reads files and
arrays it is given and writes pages it is told to, and touches no manager, store or loop
state.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from memory_broker.broker.adapters.access import open_for
from memory_broker.broker.adapters.layout import AdapterLayout, MatrixPlacement
from memory_broker.broker.adapters.registry import FILE_DTYPES, AdapterMeta
from memory_broker.broker.arena.base import ArenaView
from memory_broker.broker.errors import BrokerError, precondition

# numpy arrays that hold each element type's bits (bf16 has no numpy type: kept as uint16).
_RAW = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
_FILE_RAW = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_FILE_SIZE = {"F32": 4, "F16": 2, "BF16": 2}
_FILE_NAME = {v: k for k, v in FILE_DTYPES.items()}
# int8 warm storage: q = round(x / s), s = absmax(row) / INT8_MAX, so |x - q s| <= s / 2.
INT8_MAX = 127
# Checksums read "sha256:<hex>" (the algorithm is named so it can change).
CHECKSUM_ALGO = "sha256"


# ------------------------------------------------------------------ checksums


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
    from memory_broker.broker.arena.host import HostArenaView

    host = isinstance(view, HostArenaView)
    for p, used in zip(pages, layout.page_used):
        if not used:
            continue
        if host:
            h.update((ctypes.c_uint8 * used).from_address(view.page_address(p)))
        else:  # a device arena: copy the page's used bytes to the host first
            h.update(view.tensor(view.page_address(p), used).cpu().numpy())
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


def image_checksum(image: "WarmImage") -> str:
    """The checksum of the page bytes ``image`` stands for (an int8 image: once dequantized)."""
    return packed_checksum(image.packed if image.packed is not None else dequantize(image))


# ------------------------------------------------------------------ conversions


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even as torch does; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    r = u >> 16
    r &= 1
    r += 0x7FFF
    r += u
    r >>= 16
    out = r.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def bf16_bits_to_f32(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << 16).view(np.float32)


def _to_f32(x: np.ndarray, file_dtype: str) -> np.ndarray:
    if file_dtype == "F32":
        return x
    if file_dtype == "F16":
        return x.astype(np.float32)
    return bf16_bits_to_f32(x)


def convert(x: np.ndarray, file_dtype: str, dtype: str) -> np.ndarray:
    """Raw file elements (``_FILE_RAW`` arrays) -> raw elements of ``dtype`` (``_RAW`` arrays)."""
    if FILE_DTYPES[file_dtype] == dtype:
        return x
    f32 = _to_f32(x, file_dtype)
    if dtype == "float32":
        return f32
    if dtype == "float16":
        return f32.astype(np.float16)
    return f32_to_bf16_bits(f32)


def _from_f32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    return f32_to_bf16_bits(x)


# -------------------------------------------------------------- safetensors files


class WeightsFile:
    """An adapter's safetensors file open for reading, with its tensors' places in it.

    Reads the safetensors layout directly (8-byte header length, JSON header, data) with
    ``pread``, so the kernel copies each byte once from the page cache to where the image
    wants it (no mapping to set up and tear down per load); the registry validated the same
    header with the safetensors library. Thread-safe reads; use as a context manager.

    Raises:
        BrokerError(FAILED_PRECONDITION): the file is gone, or is no longer what was registered.
    """

    def __init__(self, meta: AdapterMeta):
        self.meta = meta
        path = meta.weights_path
        try:
            # Component by component, symlinks resolved by hand: the registered path is the
            # resolved one, so a path that resolves elsewhere now had a symlink put in since
            # registration (which checked the caller's rights on what it pointed to then).
            opened = open_for(path, None, what=f"adapter {meta.adapter_id!r}'s weights")
        except BrokerError as e:
            raise precondition(
                f"adapter {meta.adapter_id!r}: cannot open {path} ({e.message}); its files moved or were deleted "
                "since it was registered: register it again"
            ) from None
        if opened.path != os.path.normpath(path):
            opened.close()
            raise precondition(
                f"adapter {meta.adapter_id!r}: {path} resolves to {opened.path} now, not to the file that was "
                "registered (a symlink appeared on its path): register it again"
            )
        self._fd = opened.fd
        try:
            st = os.fstat(self._fd)
            size = st.st_size
            # What the image cache keys a converted image by (taken before any byte is read).
            self.identity = file_identity(st)
            try:
                (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
                header = json.loads(os.pread(self._fd, n, 8))
                entries = [(k, v["dtype"], tuple(v["shape"]), v["data_offsets"]) for k, v in header.items() if k != "__metadata__"]
            except (struct.error, ValueError, KeyError, TypeError) as e:
                raise precondition(f"adapter {meta.adapter_id!r}: {path} is no longer a safetensors file ({e})") from None
            base = 8 + n
            # key -> (safetensors dtype, shape, byte offset in the file)
            self.tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}
            for key, dt, shape, (b, e) in entries:
                if dt not in _FILE_RAW or base + e > size or e - b != math.prod(shape) * _FILE_SIZE[dt]:
                    raise precondition(
                        f"adapter {meta.adapter_id!r}: {path} changed since registration "
                        f"(tensor {key}: {dt} {list(shape)}); register it again"
                    )
                self.tensors[key] = (dt, shape, base + b)
        except BaseException:
            self.close()
            raise

    def entry(self, key: str, kind: str, rows: int, width: int) -> tuple[str, tuple[int, ...], int]:
        """(dtype, shape, file offset) of a LoRA matrix, checked against the registered shape."""
        got = self.tensors.get(key)
        want = (rows, width) if kind == "A" else (width, rows)
        if got is None or got[1] != want:
            have = "missing" if got is None else f"{list(got[1])}"
            raise precondition(
                f"adapter {self.meta.adapter_id!r}: {self.meta.weights_path} changed since registration: {key} is "
                f"{have}, registered as {list(want)}; register it again"
            )
        return got

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` with the file's bytes from ``offset``."""
        done = 0
        while done < len(buf):
            got = os.preadv(self._fd, [buf[done:]], offset + done)
            if got <= 0:
                raise precondition(f"adapter {self.meta.adapter_id!r}: {self.meta.weights_path} was truncated while loading")
            done += got

    def array(self, dtype: str, shape: tuple[int, ...], offset: int, scratch: np.ndarray) -> np.ndarray:
        """The tensor's raw elements, read into (a prefix of) ``scratch``."""
        n = math.prod(shape) * _FILE_SIZE[dtype]
        self.read_into(memoryview(scratch)[:n], offset)
        return scratch[:n].view(_FILE_RAW[dtype]).reshape(shape)

    def scratch_for(self, entries) -> np.ndarray:
        """A buffer large enough for any of ``entries`` ((dtype, shape, offset) tuples)."""
        return np.empty(max((math.prod(sh) * _FILE_SIZE[dt] for dt, sh, _ in entries), default=0), dtype=np.uint8)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> WeightsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -------------------------------------------------------------------- warm images


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


def _rows_view(buf: np.ndarray, start: int, rows: int, mp: MatrixPlacement, raw, es: int) -> np.ndarray:
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
    paths = {m.name: m.path for m in meta.modules}
    with WeightsFile(meta) as wf:
        # (placement, its module, the file entry), in layout order.
        mats = []
        for m in layout.modules:
            key = f"{meta.key_prefix}{m.layer}.{paths[m.module]}.lora_"
            mats.append((m.a, m, wf.entry(key + "A.weight", "A", m.rank, m.in_features)))
            mats.append((m.b, m, wf.entry(key + "B.weight", "B", m.rank, m.out_features)))
        if int8:
            out = _build_int8(wf, layout, mats, meta.file_bytes)
            out.source_identity = wf.identity
            out.checksum = image_checksum(out)
            return out
        img = (np.zeros if layout.has_padding else np.empty)(layout.used_bytes, dtype=np.uint8)
        offs = layout.image_offsets()
        raw, es = _RAW[layout.dtype], layout.elem_size
        want = _FILE_NAME[layout.dtype]
        # Rows stored as in the file (A, same dtype, no padding) are read straight into the
        # image, one read per chunk; the rest (Bᵀ, conversions) are read into a small scratch
        # buffer that stays in cache and laid out from there by numpy.
        moves: list[tuple[int, int, int]] = []
        arrays: list[tuple[MatrixPlacement, tuple]] = []
        for mp, _m, ent in mats:
            dt, _shape, off = ent
            row_bytes = mp.row_elems * es
            if mp.kind == "A" and dt == want and mp.row_stride == row_bytes:
                r = 0
                for c in mp.chunks:
                    moves.append((offs[c.page] + c.offset, off + r * row_bytes, c.rows * row_bytes))
                    r += c.rows
            else:
                arrays.append((mp, ent))

        def copy_moves(part):
            mv = memoryview(img)
            for d, sr, n in part:
                wf.read_into(mv[d : d + n], sr)

        def copy_arrays(part):
            scratch = wf.scratch_for([ent for _mp, ent in part])
            for mp, (dt, shape, off) in part:
                rows = convert(wf.array(dt, shape, off, scratch), dt, layout.dtype)
                rows = rows if mp.kind == "A" else rows.T
                i = 0
                for c in mp.chunks:
                    dst = _rows_view(img, offs[c.page] + c.offset, c.rows, mp, raw, es)
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
        ident = wf.identity
    return WarmImage(layout, packed=img, source_bytes=meta.file_bytes, source_identity=ident, checksum=packed_checksum(img))


def _build_int8(wf: WeightsFile, layout: AdapterLayout, mats: list, source_bytes: int) -> WarmImage:
    total = sum(mp.rows * mp.row_elems for mp, _m, _e in mats)
    q = np.empty(total, dtype=np.int8)
    scales = np.empty(sum(mp.rows for mp, _m, _e in mats), dtype=np.float32)
    qpos = spos = 0
    scratch = wf.scratch_for([ent for _mp, _m, ent in mats])
    for mp, _m, (dt, shape, off) in mats:
        rows = _to_f32(wf.array(dt, shape, off, scratch), dt)
        rows = rows if mp.kind == "A" else rows.T
        absmax = np.abs(rows).max(axis=1)
        s = np.where(absmax > 0, absmax / INT8_MAX, 1.0).astype(np.float32)
        n = mp.rows * mp.row_elems
        q[qpos : qpos + n].reshape(mp.rows, mp.row_elems)[...] = np.clip(np.rint(rows / s[:, None]), -INT8_MAX, INT8_MAX)
        scales[spos : spos + mp.rows] = s
        qpos += n
        spos += mp.rows
    return WarmImage(layout, q=q, scales=scales, source_bytes=source_bytes)


# ------------------------------------------------------------ converted-image cache


def file_identity(st: os.stat_result) -> tuple[int, int, int]:
    """(size, mtime_ns, inode) of a weights file: a rewritten or replaced file changes it."""
    return (st.st_size, st.st_mtime_ns, st.st_ino)


IMAGE_MAGIC = b"BRKLORA\x01"
# The payload starts here; the header (magic, u32 length, JSON) is zero-padded up to it.
IMAGE_HEADER_BYTES = 4096
# 2: the header carries the payload's checksum (version 1 images are rebuilt).
IMAGE_VERSION = 2
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class ImageCache:
    """Converted warm images on disk, so a cold load after the first is one sequential read.

    ``<directory>/<safe name>.img`` holds one adapter's packed page image (the pages' used
    bytes back to back, in ``layout.dtype``; never the int8 form) behind a 4 KiB header: a
    magic, then JSON naming the adapter id, the weights file and its identity (size,
    mtime_ns, inode) when the image was built, and the layout's geometry (dtype, page_size,
    row_align, used_bytes, num_pages). ``load`` uses an image only when all of them match the
    file as it is now and the layout asked for, and the file is exactly header + payload long;
    anything else is a miss (with the reason), and the caller rebuilds from the safetensors
    and stores the image again. Writes go to a temporary file renamed over the image, so a
    crash leaves the old image or the new one, never half of one. The header also holds the
    payload's checksum; ``load`` (with ``verify``) hashes what it read and refuses an image
    whose bytes changed on disk, so a corrupt image is rebuilt from the file, never loaded.

    Disk budget: with ``max_bytes`` > 0 the images together stay within it. ``store`` makes
    room by deleting the least recently used images (loaded or stored longest ago) when
    ``evict`` is true, and otherwise stores nothing when the image does not fit in what is
    free (conversions ahead of use never push out images that served loads). The cache
    counts the ``.img`` files it finds at start (oldest modification first) and deletes
    leftover ``.tmp`` files of writes a crash cut short.

    Blocking; meant for executor threads. Thread-safe (each call opens its own file; the
    byte accounting is under a lock).
    """

    def __init__(self, directory: str, fsync: bool = False, max_bytes: int = 0, verify: bool = True):
        if max_bytes < 0:
            raise ValueError(f"image cache budget {max_bytes} must be >= 0 (0: no limit)")
        self.directory = directory
        self.fsync = fsync
        # Hash every payload read back and compare it with the header's checksum.
        self.verify = verify
        # Loads refused because the payload did not match its checksum.
        self.corrupt = 0
        self.max_bytes = max_bytes
        os.makedirs(directory, exist_ok=True)
        self._lock = threading.Lock()
        # Image path -> bytes on disk (or reserved by a write in flight), least recently used first.
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self.evictions = 0
        found = []
        with os.scandir(directory) as it:
            for ent in it:
                if not ent.is_file(follow_symlinks=False):
                    continue
                if ent.name.endswith(".tmp"):
                    try:
                        os.unlink(ent.path)
                    except OSError:
                        pass
                elif ent.name.endswith(".img"):
                    st = ent.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, ent.path, st.st_size))
        for _mtime, path, size in sorted(found):
            self._sizes[path] = size
            self._used += size

    @property
    def used_bytes(self) -> int:
        """Bytes of the images on disk (and of the writes in flight)."""
        return self._used

    @property
    def count(self) -> int:
        return len(self._sizes)

    def has(self, adapter_id: str) -> bool:
        """Whether an image file for the adapter exists (``load`` still checks it fits)."""
        return self.path(adapter_id) in self._sizes

    def image_size(self, layout: AdapterLayout) -> int:
        """Bytes an image of ``layout`` takes on disk."""
        return IMAGE_HEADER_BYTES + layout.used_bytes

    def fits(self, layout: AdapterLayout) -> bool:
        """Whether an image of ``layout`` fits in the free part of the budget now."""
        return not self.max_bytes or self._used + self.image_size(layout) <= self.max_bytes

    def paths(self) -> list[str]:
        """The image files, least recently used first."""
        with self._lock:
            return list(self._sizes)

    def _touch(self, path: str) -> None:
        with self._lock:
            if path in self._sizes:
                self._sizes.move_to_end(path)

    def _forget(self, path: str) -> None:
        with self._lock:
            self._used -= self._sizes.pop(path, 0)

    def _reserve(self, path: str, need: int, evict: bool) -> tuple[bool, list[str]]:
        """Account ``need`` bytes for ``path`` (replacing what it held); (False, []) when
        they do not fit, else (True, the images to delete to make room)."""
        with self._lock:
            have = self._sizes.get(path, 0)
            victims: list[str] = []
            over = self._used - have + need - self.max_bytes if self.max_bytes else 0
            if over > 0:
                if not evict or need > self.max_bytes:
                    return False, []
                for victim, size in self._sizes.items():
                    if over <= 0:
                        break
                    if victim != path:
                        victims.append(victim)
                        over -= size
                if over > 0:
                    return False, []
                for victim in victims:
                    self._used -= self._sizes.pop(victim)
                self.evictions += len(victims)
            self._used += need - have
            self._sizes[path] = need
            self._sizes.move_to_end(path)
            return True, victims

    def path(self, adapter_id: str) -> str:
        # Adapter ids may hold ':/@+=': keep a readable prefix, and a hash so that distinct
        # ids never share a file (also on case-insensitive file systems).
        digest = hashlib.sha256(adapter_id.encode()).hexdigest()[:16]
        return os.path.join(self.directory, f"{_UNSAFE.sub('_', adapter_id)[:96]}-{digest}.img")

    @staticmethod
    def _header(meta: AdapterMeta, layout: AdapterLayout, identity: tuple[int, int, int]) -> dict:
        return {
            "version": IMAGE_VERSION,
            "adapter_id": meta.adapter_id,
            "weights_path": os.path.abspath(meta.weights_path),
            "file_bytes": identity[0],
            "file_mtime_ns": identity[1],
            "file_ino": identity[2],
            "dtype": layout.dtype,
            "page_size": layout.page_size,
            "row_align": layout.row_align,
            "used_bytes": layout.used_bytes,
            "num_pages": layout.num_pages,
        }

    def _check(self, fd: int, path: str, meta: AdapterMeta, layout: AdapterLayout) -> tuple[tuple | None, str]:
        """(the weights file's identity, "") when the open image at ``fd`` is the one for
        ``meta`` and ``layout`` as things are now, else (None, why not)."""
        size = os.fstat(fd).st_size
        head = os.pread(fd, IMAGE_HEADER_BYTES, 0)
        if len(head) < 12 or head[:8] != IMAGE_MAGIC:
            return None, f"{path} is not an adapter image (bad magic)"
        (n,) = struct.unpack_from("<I", head, 8)
        try:
            got = json.loads(head[12 : 12 + n]) if 12 + n <= IMAGE_HEADER_BYTES else None
        except ValueError:
            got = None
        if not isinstance(got, dict):
            return None, f"{path} has a corrupt header"
        try:
            ident = file_identity(os.stat(meta.weights_path))
        except OSError as e:
            return None, f"cannot stat {meta.weights_path}: {e.strerror}"
        want = self._header(meta, layout, ident)
        diff = sorted(k for k in want if got.get(k) != want[k])
        if diff:
            return None, f"{path} is stale ({', '.join(diff)} changed)"
        if size != IMAGE_HEADER_BYTES + layout.used_bytes:
            return None, f"{path} is {size} bytes, expected {IMAGE_HEADER_BYTES + layout.used_bytes}"
        return ident, ""

    def valid(self, meta: AdapterMeta, layout: AdapterLayout) -> bool:
        """Whether the adapter's image is there and matches (its header; no payload read)."""
        path = self.path(meta.adapter_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            return self._check(fd, path, meta, layout)[0] is not None
        except OSError:
            return False
        finally:
            os.close(fd)

    def check(self, meta: AdapterMeta, layout: AdapterLayout) -> tuple[bool, bool, str, str]:
        """Verify the adapter's image file against its checksum: (checked, ok, checksum,
        detail). A corrupt image is deleted (the next load rebuilds it from the file)."""
        image, why = self.load(meta, layout, verify=True)
        if image is not None:
            return True, True, image.checksum, "image file matches"
        if " is corrupt: " in why:
            self.remove(meta.adapter_id)
            return True, False, "", f"{why}; deleted, the next load rebuilds it from the weights file"
        return False, True, "", why or "no image file"

    def load(
        self, meta: AdapterMeta, layout: AdapterLayout, threads: int = 1, verify: bool | None = None
    ) -> tuple[WarmImage | None, str]:
        """(the cached image, "") or (None, why it was not used: "" when there is none).
        ``verify`` (default: the cache's setting) hashes the payload against its checksum.

        ``threads`` > 1 splits the read into that many sequential ranges read side by side
        (the copies out of the page cache, and the first touch of the new buffer, release
        the GIL and overlap)."""
        path = self.path(meta.adapter_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None, ""
        except OSError as e:
            return None, f"cannot open {path}: {e.strerror}"
        try:
            ident, why = self._check(fd, path, meta, layout)
            if ident is None:
                return None, why
            img = np.empty(layout.used_bytes, dtype=np.uint8)
            mv = memoryview(img)
            n = len(mv)
            parts = max(1, min(threads, n // (1 << 20)))
            bounds = [n * i // parts for i in range(parts + 1)]
            short: list[str] = []

            def read(lo: int, hi: int) -> None:
                try:
                    while lo < hi:
                        r = os.preadv(fd, [mv[lo:hi]], IMAGE_HEADER_BYTES + lo)
                        if r <= 0:
                            short.append(f"{path} was truncated while reading")
                            return
                        lo += r
                except OSError as e:
                    short.append(f"cannot read {path}: {e.strerror}")

            helpers = [threading.Thread(target=read, args=(bounds[i], bounds[i + 1]), name="adapter-image-read")
                       for i in range(1, parts)]  # fmt: skip
            for t in helpers:
                t.start()
            read(bounds[0], bounds[1])
            for t in helpers:
                t.join()
            if short:
                return None, short[0]
            want = self._stored_checksum(fd)
            if self.verify if verify is None else verify:
                got = packed_checksum(img)
                if got != want:
                    self.corrupt += 1
                    return None, f"{path} is corrupt: its payload hashes to {got}, its header says {want}"
            self._touch(path)
            return WarmImage(
                layout, packed=img, source_bytes=layout.used_bytes, source_identity=ident, checksum=want
            ), ""
        except OSError as e:
            return None, f"cannot read {path}: {e.strerror}"
        finally:
            os.close(fd)

    @staticmethod
    def _stored_checksum(fd: int) -> str:
        head = os.pread(fd, IMAGE_HEADER_BYTES, 0)
        (n,) = struct.unpack_from("<I", head, 8)
        return str(json.loads(head[12 : 12 + n]).get("checksum", ""))

    def store(self, meta: AdapterMeta, image: WarmImage, evict: bool = True) -> int:
        """Write ``image`` (a packed one built from the file) as the adapter's image, atomically;
        returns bytes written (0 when nothing was stored: int8, no file identity, or no room
        in the budget; with ``evict`` the least recently used images make room)."""
        if image.packed is None or image.source_identity is None:
            return 0
        layout = image.layout
        header = self._header(meta, layout, image.source_identity)
        header["checksum"] = image.checksum or packed_checksum(image.packed)
        text = json.dumps(header).encode()
        if 12 + len(text) > IMAGE_HEADER_BYTES:
            return 0  # an id or path too long for the header: such adapters are not cached
        head = bytearray(IMAGE_HEADER_BYTES)
        head[:8] = IMAGE_MAGIC
        struct.pack_into("<I", head, 8, len(text))
        head[12 : 12 + len(text)] = text
        path = self.path(meta.adapter_id)
        had = path in self._sizes
        ok, victims = self._reserve(path, self.image_size(layout), evict)
        if not ok:
            return 0
        for victim in victims:
            try:
                os.unlink(victim)
            except FileNotFoundError:
                pass
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except BaseException:
            if not had:
                self._forget(path)
            raise
        try:
            try:
                for buf in (memoryview(head), memoryview(image.packed)):
                    while len(buf):
                        buf = buf[os.write(fd, buf) :]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if not had or not os.path.exists(path):
                self._forget(path)
            raise
        return self.image_size(layout)

    def remove(self, adapter_id: str) -> bool:
        """Delete the adapter's image; False when there was none."""
        return self.remove_path(self.path(adapter_id))

    def remove_path(self, path: str) -> bool:
        """Delete one image file of this cache; False when there was none."""
        self._forget(path)
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False


# ------------------------------------------------------------------ page writing


class HostPageWriter:
    """Writes warm images into pages through the broker's own mapping of a host arena:
    one ``memmove`` per page. (A device arena uses ``TensorPageWriter``; the manager only
    calls ``write``.)"""

    def __init__(self, view: ArenaView):
        _require_host_memory(view, "HostPageWriter", "use TensorPageWriter")
        self.view = view

    def write(self, image: WarmImage, pages: Sequence[int]) -> int:
        """Copy ``image`` into the physical ``pages`` of its object (in layout page order);
        returns bytes written. Blocking."""
        layout = image.layout
        if len(pages) != layout.num_pages:
            raise ValueError(f"the layout spans {layout.num_pages} pages; {len(pages)} were given")
        if image.packed is not None:
            return self._copy(image.packed, layout, pages)
        # int8: dequantize into a page image first (one more copy; the warm tier traded it
        # for a quarter of the memory).
        return self._copy(dequantize(image), layout, pages)

    def _copy(self, packed: np.ndarray, layout: AdapterLayout, pages: Sequence[int]) -> int:
        addr = self.view.page_address
        src = packed.ctypes.data
        pos = 0
        for p, used in zip(pages, layout.page_used):
            # ctypes releases the GIL for the copy, so loads overlap with the event loop.
            ctypes.memmove(addr(p), src + pos, used)
            pos += used
        return pos


def dequantize(image: WarmImage) -> np.ndarray:
    """An int8 image as the packed page image it stands for (pages' used bytes back to back)."""
    layout = image.layout
    raw, es = _RAW[layout.dtype], layout.elem_size
    img = (np.zeros if layout.has_padding else np.empty)(layout.used_bytes, dtype=np.uint8)
    offs = layout.image_offsets()
    for mp, q, s in image.matrices():
        rows = q.astype(np.float32)
        rows *= s[:, None]
        rows = _from_f32(rows, layout.dtype)
        i = 0
        for c in mp.chunks:
            np.copyto(_rows_view(img, offs[c.page] + c.offset, c.rows, mp, raw, es), rows[i : i + c.rows], casting="no")
            i += c.rows
    return img


class TensorPageWriter:
    """Writes warm images into pages through the view's zero-copy torch tensors
    (``ArenaView.tensor``): a host-to-device copy per page on a CUDA arena.

    Works on any backend; on the host arena ``HostPageWriter`` does the same with less
    overhead. Not yet run on a GPU: the copies are synchronous (pageable host memory), so
    the pages hold the image when ``write`` returns and the object can be committed.
    """

    def __init__(self, view: ArenaView):
        self.view = view

    def write(self, image: WarmImage, pages: Sequence[int]) -> int:
        import torch

        layout = image.layout
        if len(pages) != layout.num_pages:
            raise ValueError(f"the layout spans {layout.num_pages} pages; {len(pages)} were given")
        src = torch.from_numpy(image.packed if image.packed is not None else dequantize(image))
        pos = 0
        for p, used in zip(pages, layout.page_used):
            self.view.tensor(self.view.page_address(p), used).copy_(src[pos : pos + used])
            pos += used
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return pos


def _require_host_memory(view: ArenaView, what: str, instead: str) -> None:
    """Refuse a view whose addresses are not host memory (the CUDA arena's): dereferencing
    them on the host would crash the process."""
    if getattr(view, "host_addressable", True) is False:
        raise ValueError(
            f"{what} reads and writes arena addresses on the host, but this {type(view).__name__}'s "
            f"memory is on a GPU; {instead}"
        )


def read_matrix(view: ArenaView, layout: AdapterLayout, pages: Sequence[int], layer: int, module: str, kind: str) -> np.ndarray:
    """A copy of one stored matrix (A, or Bᵀ) from an arena mapping, as raw ``layout.dtype``
    elements [rank, row_elems]. For checks and tools; any process's host-memory view works
    (a CUDA view is refused with ValueError: copy its pages to the host with ``view.tensor``)."""
    _require_host_memory(view, "read_matrix", "copy the pages to the host with view.tensor(...).cpu() first")
    mp = layout.matrix(layer, module, kind)
    raw, es = _RAW[layout.dtype], layout.elem_size
    out = np.empty((mp.rows, mp.row_elems), dtype=raw)
    i = 0
    for c in mp.chunks:
        span = (c.rows - 1) * mp.row_stride + mp.row_elems * es
        buf = (ctypes.c_uint8 * span).from_address(view.page_address(pages[c.page]) + c.offset)
        out[i : i + c.rows] = np.ndarray((c.rows, mp.row_elems), dtype=raw, buffer=buf, strides=(mp.row_stride, es))
        i += c.rows
    return out
