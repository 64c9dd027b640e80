"""What every tier backend shares: a block's place in memory, the record stored beside its
value, the tier's key names, and the ``Backend`` protocol the tier's thread calls.

A value is an object's pages, in order, read from and written to the arena's own mapping
(``Block.parts``: address and length per page). Beside it the tier keeps a small record
(``Meta``: pages, bytes and the blake2b digest of the bytes, the same digest
``broker/store/digests.py`` takes), written after the value, so a value whose writer died
before its record is a miss, and one whose bytes changed fails its digest. Nothing here
touches the store, sessions or gRPC: the tier sits below the store (ARCHITECTURE.md, "Layers").
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# "blake2b:<hex>", as broker/store/digests.py writes an object's digest.
ALGO = "blake2b"
_META = struct.Struct("<4sIIQ32s")
# ``Meta.flags``: the object was contiguous (its pages back to back in the window).
CONTIGUOUS = 1
# ... the value is in LMCache's format (``Block.raw``): no record, no digest.
RAW = 2
_MAGIC = b"MBT1"
# Suffix of the key of a value's record.
META_SUFFIX = "#meta"


class TierError(Exception):
    """A backend call failed (unreachable, refused, timed out): the tier counts it a miss."""


@dataclass(slots=True, frozen=True)
class Block:
    # The value's key in the tier (``tier_key``).
    key: str
    # (address, bytes) of each page, in the object's page order.
    parts: tuple[tuple[int, int], ...]
    # The object asked for a contiguous window range (kept in the record for its reader).
    contiguous: bool = False
    # LMCache's format (0: the broker's): the value is the first ``raw`` bytes of ``parts``,
    # stored alone with no record beside it; a read takes a value of exactly that size and
    # zeroes the rest of ``parts``.
    raw: int = 0
    # Where ``parts`` stand in for pages the store cannot reach (a device arena's): called in
    # the tier's thread before a write reads ``parts``, and after a read filled them and its
    # digest matched (copies between the pages and ``parts``).
    before: Callable[[], None] | None = field(default=None, repr=False)
    after: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return sum(n for _, n in self.parts)


@dataclass(slots=True, frozen=True)
class Meta:
    # Pages of the object the value was written from.
    num_pages: int
    # Bytes of the value.
    size: int
    # blake2b (32 bytes) of the value.
    digest: bytes
    # ``CONTIGUOUS`` or 0.
    flags: int = 0

    def encode(self) -> bytes:
        return _META.pack(_MAGIC, self.num_pages, self.flags, self.size, self.digest)

    @classmethod
    def decode(cls, raw: bytes | None) -> Meta | None:
        """The record, or None for a missing or malformed one (a miss)."""
        if not raw or len(raw) != _META.size:
            return None
        magic, pages, flags, size, digest = _META.unpack(raw)
        return cls(pages, size, digest, flags) if magic == _MAGIC and pages > 0 else None

    @property
    def text(self) -> str:
        """As the store writes an object's digest (``Allocation.digest``)."""
        return f"{ALGO}:{self.digest.hex()}"


def digest_parts(parts: Sequence[tuple[int, int]]) -> bytes:
    """blake2b over the bytes at ``parts`` in order (hashlib lets other threads run)."""
    h = hashlib.blake2b(digest_size=32)
    for addr, n in parts:
        h.update((ctypes.c_uint8 * n).from_address(addr))
    return h.digest()


def read_parts(parts: Sequence[tuple[int, int]]) -> bytes:
    """The bytes at ``parts``, joined (a copy: for backends that take values, not addresses)."""
    return b"".join(ctypes.string_at(addr, n) for addr, n in parts)


def write_parts(parts: Sequence[tuple[int, int]], value: bytes) -> bool:
    """Copy ``value`` over ``parts``; False (nothing written) when the sizes differ."""
    if len(value) != sum(n for _, n in parts):
        return False
    pos = 0
    for addr, n in parts:
        ctypes.memmove(addr, value[pos : pos + n], n)
        pos += n
    return True


def value_of(block: Block) -> bytes:
    """The bytes a write stores for ``block`` (a copy)."""
    value = read_parts(block.parts)
    return value[: block.raw] if block.raw else value


def fill(block: Block, value: bytes) -> bool:
    """Copy a value read for ``block`` over its parts; False (nothing written) for a value
    of another size than the block's (``raw`` for LMCache's format)."""
    if not block.raw:
        return write_parts(block.parts, value)
    if len(value) != block.raw:
        return False
    return write_parts(block.parts, value + bytes(block.size - block.raw))


def tier_key(prefix: str, pool: str, key: bytes) -> str:
    """The tier's name for a broker block key: the fleet's prefix, the tenant pool's name
    (``shared`` for the shared pool), then the key in hex (keys are bytes; both backends
    take text)."""
    return f"{prefix}/{pool or 'shared'}/{key.hex()}"


def key_pool(key: str) -> str:
    """The tenant pool's name in a tier key (``tier_key``'s second part from the end)."""
    parts = key.rsplit("/", 2)
    return parts[-2] if len(parts) == 3 else "shared"


class Backend(Protocol):
    """A distributed store the tier's thread calls, one call at a time. Every call raises
    ``TierError`` on a failure of the store (never for a plain miss) and returns within about
    ``timeout`` seconds."""

    name: str

    def put(self, blocks: Sequence[Block], metas: Sequence[Meta], timeout: float) -> list[bool]:
        """Write each value, then its record; True per block stored."""
        ...

    def metas(self, keys: Sequence[str], timeout: float) -> list[Meta | None]:
        """Each key's record, None where there is none."""
        ...

    def get_into(self, blocks: Sequence[Block], timeout: float) -> list[bool]:
        """Read each value over its block's parts; True per block read whole."""
        ...

    def sizes(self, keys: Sequence[str], timeout: float) -> list[int]:
        """Each value's size, 0 for none (values in LMCache's format, which have no record)."""
        ...

    def connect(self) -> None:
        """Set up the client ahead of the first job (Mooncake's setup takes longer than a
        deadline on a busy machine); a failure here is retried by the next call."""
        ...

    def register(self, address: int, size: int) -> None:
        """Memory later blocks will name (the arena's slabs): zero copy where the store allows."""
        ...

    def reset(self) -> None:
        """Drop the connection after a failure; the next call connects again."""
        ...

    def close(self) -> None: ...
