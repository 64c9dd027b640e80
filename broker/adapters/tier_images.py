"""Adapters' page images in the tier past one host (docs/tier.md, "Adapters' images").

A broker that loads an adapter cold -> warm from its own files or its own image cache writes
the image to the tier under a content key (once per process); another broker that has no
image of the adapter yet (converting it ahead of use, or loading it) reads the image from the
tier, its digest checked by the tier (``Tier.get``), instead of converting the files. The content key is the SHA-256 of the
adapter's ``adapter_config.json`` and weights file and of the whole page layout the image is
laid out for (dtype, page size, alignment, every matrix's place): two brokers share an image
only for the same bytes laid out the same way, whatever path or id each registered it under.
A broker still reads the files once to hash them (the digest is kept per file identity); it
skips their conversion.

Blocking: for the adapter wing's executor threads (never the event loop); the tier's own
thread does the calls, each within its deadline, and anything but a whole image with a good
digest is a miss (the files are converted, as without a tier).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from memory_broker.broker.adapters.image_cache import IMAGE_VERSION
from memory_broker.broker.adapters.layout import AdapterLayout
from memory_broker.broker.adapters.peft import AdapterMeta
from memory_broker.broker.adapters.safetensors_io import file_identity
from memory_broker.broker.adapters.warm_image import WarmImage, packed_checksum
from memory_broker.broker.tier.base import Block
from memory_broker.broker.tier.tier import Tier

# File digests remembered (per path and file identity).
REMEMBER = 1024
_READ = 1 << 20


class TierImages:
    """Adapters' images to and from ``tier`` under ``<prefix>/shared/adapter.<content key>``
    (a name no block key takes: those are hex)."""

    def __init__(self, tier: Tier, prefix: str, log):
        self.tier, self.prefix, self.log = tier, prefix, log
        self._digests: OrderedDict[tuple, bytes] = OrderedDict()
        # Names this broker read from the tier or is writing or wrote: never written again.
        self._known: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # (executor threads, the convert thread, the tier's thread)
        # Images written to the tier, and read from it instead of converting the files.
        self.written = self.read = 0

    def name(self, meta: AdapterMeta, layout: AdapterLayout) -> tuple[str, tuple[int, int, int]] | None:
        """The tier's name for the image, and the weights file's identity it was taken at; None
        when the files are not the registered ones (the conversion then says why)."""
        h = hashlib.sha256(b"memory-broker adapter image %d\0" % IMAGE_VERSION)
        h.update(repr(layout).encode())
        for path in (meta.config_path, meta.weights_path):
            try:
                st = os.stat(path)
            except OSError:
                return None
            identity = file_identity(st)
            if path == meta.weights_path and identity[:2] != (meta.file_bytes, meta.file_mtime_ns):
                return None
            h.update(self._file_digest(path, identity))
        return f"{self.prefix}/shared/adapter.{h.hexdigest()}", identity

    def _file_digest(self, path: str, identity: tuple) -> bytes:
        key = (path, *identity)
        got = self._digests.get(key)
        if got is None:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(_READ):
                    h.update(chunk)
            got = h.digest()
            with self._lock:
                self._digests[key] = got
                if len(self._digests) > REMEMBER:
                    self._digests.popitem(last=False)
        return got

    def fetch(self, meta: AdapterMeta, layout: AdapterLayout) -> WarmImage | None:
        """The image from the tier, or None (absent, another size, a bad digest, late, down)."""
        named = self.name(meta, layout)
        if named is None:
            return None
        name, identity = named
        found = self._wait(self.tier.find([name]), [])
        if not found or found[0].size != layout.used_bytes or found[0].num_pages != 1:
            return None
        buf = np.empty(layout.used_bytes, dtype=np.uint8)
        ok = self._wait(self.tier.get([Block(name, ((buf.ctypes.data, buf.nbytes),))], found), [False])
        if not ok[0]:
            return None
        self._remember(name)
        with self._lock:
            self.read += 1
        self.log.info("adapter_image_from_tier", adapter=meta.adapter_id, bytes=buf.nbytes)
        # (The identity lets this broker's own image cache keep it, as after a conversion.)
        return WarmImage(layout, packed=buf, source_bytes=0, source_identity=identity, checksum=packed_checksum(buf))

    def store(self, meta: AdapterMeta, image: WarmImage) -> None:
        """Queue the image's write (int8 images are not shared: their pages' bytes are not
        the image's); it stays alive until the tier's thread has written it."""
        if image.packed is None or not image.packed.flags.c_contiguous:
            return
        named = self.name(meta, image.layout)
        if named is None:
            return
        name, packed = named[0], image.packed
        if name in self._known:
            return
        fut = self.tier.put([Block(name, ((packed.ctypes.data, packed.nbytes),))])
        if fut is not None:
            self._remember(name)
            fut.add_done_callback(lambda f, keep=packed: self._stored(f, name))

    def _stored(self, fut: Future, name: str) -> None:
        """The tier's thread: a failed write's name is forgotten, so a later load writes again."""
        ok = fut.result()[0]
        with self._lock:
            if ok:
                self.written += 1
            else:
                self._known.pop(name, None)

    def _remember(self, name: str) -> None:
        with self._lock:
            self._known[name] = None
            if len(self._known) > REMEMBER:
                self._known.popitem(last=False)

    def _wait(self, fut: Future | None, miss):
        """The tier's answer (it answers every job by its deadline, a miss if late), or
        ``miss`` for a job its queue refused or an answer that never came."""
        if fut is None:
            return miss
        try:
            return fut.result(timeout=self.tier.deadline_s + 5.0)
        except FutureTimeout:
            return miss
