"""The converted-image cache: warm images kept on disk, so a cold load after the first is one
sequential read instead of a conversion of the safetensors file.

Owns the ``images`` directory, its byte budget and its checksum checks. Blocking, for
executor threads; it knows nothing of tiers, entries or the store.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
import threading
from collections import OrderedDict

import numpy as np

from memory_broker.broker.adapters.access import disk_free
from memory_broker.broker.adapters.layout import AdapterLayout
from memory_broker.broker.adapters.peft import AdapterMeta
from memory_broker.broker.adapters.safetensors_io import file_identity
from memory_broker.broker.adapters.warm_image import WarmImage, packed_checksum

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

    Free-space floor: with ``min_free`` > 0 no image is written that would leave less than
    that free on the filesystem (the adapter registry in the same state directory keeps room
    for its writes; images are a cache, the registry is not).

    Blocking; meant for executor threads. Thread-safe (each call opens its own file; the
    byte accounting is under a lock).
    """

    def __init__(self, directory: str, fsync: bool = False, max_bytes: int = 0, verify: bool = True, min_free: int = 0):
        if max_bytes < 0 or min_free < 0:
            raise ValueError(f"image cache budget {max_bytes} and floor {min_free} must be >= 0 (0: no limit)")
        # Free bytes the filesystem keeps after any image write: the registry's reserve (an
        # image is not written when it would leave less).
        self.min_free = min_free
        # Images not written because of that floor.
        self.floor_skips = 0
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
        """Whether an image of ``layout`` fits in the free part of the budget now, and above
        the free-space floor."""
        need = self.image_size(layout)
        return (not self.max_bytes or self._used + need <= self.max_bytes) and self.above_floor(need)

    def above_floor(self, need: int) -> bool:
        """Whether writing ``need`` bytes leaves at least ``min_free`` bytes free on the disk."""
        if not self.min_free:
            return True
        free = disk_free(self.directory)
        return free < 0 or free - need >= self.min_free

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

            helpers = [
                threading.Thread(target=read, args=(bounds[i], bounds[i + 1]), name="adapter-image-read")
                for i in range(1, parts)
            ]
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
        head = self._head(meta, layout, image.source_identity, image.checksum or packed_checksum(image.packed))
        if head is None:
            return 0  # an id or path too long for the header: such adapters are not cached
        path = self.path(meta.adapter_id)
        had = path in self._sizes
        if not self.above_floor(self.image_size(layout) - self._sizes.get(path, 0)):
            self.floor_skips += 1
            return 0
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

    def _head(self, meta: AdapterMeta, layout: AdapterLayout, identity: tuple, checksum: str) -> bytearray | None:
        """An image file's header block (None: the id or path is too long for it)."""
        header = self._header(meta, layout, identity)
        header["checksum"] = checksum
        text = json.dumps(header).encode()
        if 12 + len(text) > IMAGE_HEADER_BYTES:
            return None
        head = bytearray(IMAGE_HEADER_BYTES)
        head[:8] = IMAGE_MAGIC
        struct.pack_into("<I", head, 8, len(text))
        head[12 : 12 + len(text)] = text
        return head

    def store_built(self, meta: AdapterMeta, layout: AdapterLayout, build) -> int:
        """Build the adapter's image straight into its file (conversion ahead of use):
        ``build(buf)`` lays the payload out into ``buf``, a zeroed uint8 mapping of the new
        file, and returns the weights file's identity. The image exists only as the file's
        pages (which the kernel writes back and may drop), never as an anonymous copy of the
        whole image. The file's blocks are allocated first, so a full disk is an OSError here
        rather than a fault while writing. Takes only free room in the budget, above the
        floor; atomic like ``store``. Returns bytes written (0: no room)."""
        path = self.path(meta.adapter_id)
        size = self.image_size(layout)
        if not self.above_floor(size - self._sizes.get(path, 0)):
            self.floor_skips += 1
            return 0
        had = path in self._sizes
        if not self._reserve(path, size, evict=False)[0]:
            return 0
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
                head = _fill_mapped(
                    fd, size, lambda payload: self._head(meta, layout, build(payload), packed_checksum(payload))
                )
                if head is not None and self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if head is None:
                raise _NotCached
            os.replace(tmp, path)
        except BaseException as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if not had or not os.path.exists(path):
                self._forget(path)
            if isinstance(e, _NotCached):
                return 0
            raise
        return size

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


class _NotCached(Exception):
    """An image whose header cannot hold its id or path: not cached."""


def _fill_mapped(fd: int, size: int, fill) -> bytearray | None:
    """Map ``size`` bytes of ``fd``, let ``fill(payload)`` write the payload (past the header)
    and return the header block, write that header, and unmap."""
    mm = mmap.mmap(fd, size)
    try:
        payload = np.frombuffer(mm, dtype=np.uint8, offset=IMAGE_HEADER_BYTES)
        head = fill(payload)
        del payload
        if head is not None:
            mm[:IMAGE_HEADER_BYTES] = head
        return head
    finally:
        try:
            mm.close()
        except BufferError:  # a view still alive (an exception's traceback): closed when collected
            pass
