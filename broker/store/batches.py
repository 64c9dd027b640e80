"""Validation of one request's batch before the store changes anything: its length, duplicate
ids, key sizes, and each ``Spec`` (pages, content type, key).

Pure functions of the request and the limits: they raise ``BrokerError`` (INVALID_ARGUMENT or
RESOURCE_EXHAUSTED) with the numbers that explain the refusal, and never read or change the
store's objects, sessions or pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from memory_broker.broker.store.eviction import ContentType
from memory_broker.broker.store.records import VALID_CONTENT, Spec
from memory_broker.proto.wire.errors import exhausted, invalid


def check_batch(n: int, what: str, max_batch: int) -> None:
    if n > max_batch:
        raise invalid(f"{what} has {n} items; at most {max_batch} per call")


def check_unique(ids: Iterable[int], what: str) -> None:
    seen = set()
    for i in ids:
        if i in seen:
            raise invalid(f"{what} lists {i} twice")
        seen.add(i)


def check_key(key: bytes | None, where: str, max_key_bytes: int) -> None:
    if not key:
        raise invalid(f"{where} is empty; keys must be 1..{max_key_bytes} bytes")
    if len(key) > max_key_bytes:
        raise invalid(f"{where} is {len(key)} bytes; keys are at most {max_key_bytes}")


def check_specs(specs: Sequence[Spec], max_pages: int, max_key_bytes: int) -> tuple[int, bool]:
    """Validate a batch of specs; returns (total pages, whether any spec has a key)."""
    total = 0
    keys: set[bytes] = set()
    for i, sp in enumerate(specs):
        n = sp.num_pages
        if n.__class__ is not int or not 1 <= n <= max_pages:
            raise invalid(f"objects[{i}].num_pages is {n}; must be 1..{max_pages} (the arena's size)")
        if sp.content_type not in VALID_CONTENT:
            raise invalid(
                f"objects[{i}].content_type is {sp.content_type}; give one of "
                + ", ".join(f"{c.name}={c.value}" for c in ContentType)
            )
        if sp.key is not None:
            check_key(sp.key, f"objects[{i}].key", max_key_bytes)
            if sp.key in keys:
                raise invalid(f"objects[{i}].key appears twice in one batch")
            keys.add(sp.key)
        total += n
    if total > max_pages:
        raise exhausted(f"batch needs {total} pages; the arena holds at most {max_pages}")
    return total, bool(keys)
