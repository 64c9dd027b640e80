"""LMCache's keys, as a client spells them for the broker and the broker's tier writes them.

A fleet that mixes LMCache nodes and brokers meets in one Valkey (docs/tier.md, "Sharing
with LMCache"). LMCache 0.5.6's multiprocess server and its RESP (Redis/Valkey) L2 adapter
store one value per 256-token chunk under ``<model>@<kv_rank:08x>@<group:x>@<hash hex>``
(``@<cache_salt>`` after it when salted), the value being the chunk's bytes alone (no
record, no digest). A chunk's hash chains the chunks before it: ``h = blake3(prev ||
tokens as big-endian u32)``, the first ``prev`` being ``blake3`` of 12 zero bytes, and a
partial last chunk has none (LMCache's ``TokenHasher``). ``kv_rank`` packs the parallel
setup: ``world_size << 24 | global_rank << 16 | local_world_size << 8 | local_rank``.

A client stores such a chunk in the broker under ``broker_key(wire_key)``: the wire key
with ``PREFIX`` before it. A broker whose configuration declares the key's model and
kv_rank as its fleet's (``tier.lmcache_*``) writes that object to the tier under the wire
key itself, in LMCache's format, and reads an LMCache node's chunk back under it. The key
carries no adapter, dtype or layout: ``chunk_keys`` refuses a request with an adapter, and
the broker's configuration pins the rest (the value's exact size).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

# Tokens per LMCache chunk (its default ``chunk_size``; the only one this mode shares).
CHUNK_TOKENS = 256
# A broker key that stands for an LMCache wire key.
PREFIX = b"lmcache:"
_SEP = "@"


def kv_rank(world_size: int = 1, global_rank: int = 0, local_world_size: int = 1, local_rank: int = 0) -> int:
    """LMCache's ``ObjectKey.ComputeKVRank``: the parallel setup packed one byte a field."""
    for name, v in (("world_size", world_size), ("local_world_size", local_world_size)):
        if not 1 <= v <= 255:
            raise ValueError(f"{name} must be in 1..255, got {v}")
    if not 0 <= global_rank < world_size or not 0 <= local_rank < local_world_size:
        raise ValueError(f"rank {global_rank} (local {local_rank}) is outside world size {world_size}")
    return world_size << 24 | global_rank << 16 | local_world_size << 8 | local_rank


def chunk_hashes(token_ids: Sequence[int]) -> list[bytes]:
    """One 32-byte hash per full chunk of ``token_ids``, chained (a partial chunk has none)."""
    import blake3

    prev = blake3.blake3(bytes(12)).digest()
    out = []
    for i in range(0, len(token_ids) - len(token_ids) % CHUNK_TOKENS, CHUNK_TOKENS):
        chunk = token_ids[i : i + CHUNK_TOKENS]
        h = blake3.blake3(prev)
        h.update(struct.pack(f">{len(chunk)}I", *chunk))
        prev = h.digest()
        out.append(prev)
    return out


def wire_key(model: str, rank: int, chunk_hash: bytes, group: int = 0, salt: str = "") -> str:
    """The key LMCache's RESP adapter stores a chunk under."""
    if not model or _SEP in model:
        raise ValueError(f"the model name must be non-empty without {_SEP!r}, got {model!r}")
    if any(c in salt for c in "@/\\\x00"):
        raise ValueError(f"a cache salt cannot hold '@', '/', '\\' or NUL, got {salt!r}")
    key = f"{model}{_SEP}{rank:08x}{_SEP}{group:x}{_SEP}{chunk_hash.hex()}"
    return f"{key}{_SEP}{salt}" if salt else key


def broker_key(wire: str) -> bytes:
    """The broker key of the chunk LMCache stores under ``wire``."""
    return PREFIX + wire.encode()


def chunk_keys(
    token_ids: Sequence[int], model: str, rank: int, *, lora_request=None, salt: str | None = None
) -> list[bytes]:
    """The broker keys of a request's full chunks. A request with an adapter has none to
    share: LMCache's keys do not carry it (``ValueError``, never a key another adapter's
    KV would match)."""
    if lora_request is not None:
        raise ValueError("LMCache's keys carry no adapter: a request with one cannot share them")
    return [broker_key(wire_key(model, rank, h, salt=salt or "")) for h in chunk_hashes(token_ids)]


def parse(key: bytes) -> tuple[str, int, str] | None:
    """``(model, kv_rank, wire key)`` of a broker key made by ``broker_key``; None for any
    other key (one that is not well formed included)."""
    if not key.startswith(PREFIX):
        return None
    try:
        wire = key[len(PREFIX) :].decode()
    except UnicodeDecodeError:
        return None
    parts = wire.split(_SEP)
    if len(parts) not in (4, 5) or not parts[0] or len(parts[1]) != 8:
        return None
    try:
        rank = int(parts[1], 16)
        int(parts[2], 16)
        bytes.fromhex(parts[3])
    except ValueError:
        return None
    return parts[0], rank, wire
