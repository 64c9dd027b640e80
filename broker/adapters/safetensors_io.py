"""Safetensors files read for loading: an adapter's weights file opened safely, its tensors
found by the header, and their bytes read with ``pread`` straight where they are wanted.

Blocking, for executor threads. Reads only; it decides nothing about layout or tiers.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

from memory_broker.broker.adapters.access import open_for
from memory_broker.broker.adapters.dtypes import FILE_RAW, FILE_SIZE
from memory_broker.broker.adapters.peft import AdapterMeta
from memory_broker.proto.wire.errors import BrokerError, precondition


def file_identity(st: os.stat_result) -> tuple[int, int, int]:
    """(size, mtime_ns, inode) of a weights file: a rewritten or replaced file changes it."""
    return (st.st_size, st.st_mtime_ns, st.st_ino)


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
                entries = [
                    (k, v["dtype"], tuple(v["shape"]), v["data_offsets"])
                    for k, v in header.items()
                    if k != "__metadata__"
                ]
            except (struct.error, ValueError, KeyError, TypeError) as e:
                raise precondition(
                    f"adapter {meta.adapter_id!r}: {path} is no longer a safetensors file ({e})"
                ) from None
            base = 8 + n
            # key -> (safetensors dtype, shape, byte offset in the file)
            self.tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}
            for key, dt, shape, (b, e) in entries:
                if dt not in FILE_RAW or base + e > size or e - b != math.prod(shape) * FILE_SIZE[dt]:
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
                raise precondition(
                    f"adapter {self.meta.adapter_id!r}: {self.meta.weights_path} was truncated while loading"
                )
            done += got

    def array(self, dtype: str, shape: tuple[int, ...], offset: int, scratch: np.ndarray) -> np.ndarray:
        """The tensor's raw elements, read into (a prefix of) ``scratch``."""
        n = math.prod(shape) * FILE_SIZE[dtype]
        self.read_into(memoryview(scratch)[:n], offset)
        return scratch[:n].view(FILE_RAW[dtype]).reshape(shape)

    def scratch_for(self, entries) -> np.ndarray:
        """A buffer large enough for any of ``entries`` ((dtype, shape, offset) tuples)."""
        return np.empty(max((math.prod(sh) * FILE_SIZE[dt] for dt, sh, _ in entries), default=0), dtype=np.uint8)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> WeightsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
