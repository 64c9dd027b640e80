"""The tier on Valkey: values and their records as plain strings, pipelined, over one client.

Valkey takes values, not addresses, so a write reads the pages into one bytes object and a
read copies the value over the pages (``base.value_of``/``fill``): fine for small fleets and
tests; Mooncake Store (``mooncake.py``) moves bytes from registered memory. Each value is
written before its record, in one pipeline, so a reader that finds the record finds the value
(or a digest that fails, if someone changed it). A value in LMCache's format (``Block.raw``)
has no record: its size (``sizes``) stands in for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from memory_broker.broker.tier.base import META_SUFFIX, Block, Meta, TierError, fill, value_of


class ValkeyBackend:
    """One Valkey (or Redis-protocol) server at ``url`` (``valkey://host:port/db``).

    Args:
        url: the server.
        timeout_s: every call's socket timeout (the tier's deadline).
    """

    name = "valkey"

    def __init__(self, url: str, timeout_s: float):
        import valkey

        self._errors = (valkey.exceptions.ValkeyError, OSError)
        self._client = valkey.Valkey.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def put(self, blocks: Sequence[Block], metas: Sequence[Meta], timeout: float) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for b in blocks:
            pipe.set(b.key, value_of(b))
        recorded = [(b, m) for b, m in zip(blocks, metas) if not b.raw]  # LMCache's values have none
        for b, m in recorded:
            pipe.set(b.key + META_SUFFIX, m.encode())
        try:
            done = pipe.execute(raise_on_error=False)
        except self._errors as e:
            raise TierError(f"valkey: {e}") from None
        records = iter(done[len(blocks) :])
        return [(b.raw > 0 or next(records) is True) and v is True for b, v in zip(blocks, done)]

    def metas(self, keys: Sequence[str], timeout: float) -> list[Meta | None]:
        try:
            raw = self._client.mget([k + META_SUFFIX for k in keys])
        except self._errors as e:
            raise TierError(f"valkey: {e}") from None
        return [Meta.decode(r) for r in raw]

    def sizes(self, keys: Sequence[str], timeout: float) -> list[int]:
        """Each value's size in bytes, 0 where there is none (LMCache's values: no record)."""
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(k)
        try:
            return [int(n) for n in pipe.execute()]
        except self._errors as e:
            raise TierError(f"valkey: {e}") from None

    def get_into(self, blocks: Sequence[Block], timeout: float) -> list[bool]:
        try:
            values = self._client.mget([b.key for b in blocks])
        except self._errors as e:
            raise TierError(f"valkey: {e}") from None
        return [v is not None and fill(b, v) for b, v in zip(blocks, values)]

    def connect(self) -> None:
        """Nothing ahead: the client connects at its first command."""

    def register(self, address: int, size: int) -> None:
        """Nothing to register: Valkey copies."""

    def reset(self) -> None:
        self._client.connection_pool.disconnect()

    def close(self) -> None:
        self._client.close()
