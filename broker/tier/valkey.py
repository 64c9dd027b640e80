"""The tier on Valkey: values and their records as plain strings, pipelined, over one client.

Valkey takes values, not addresses, so a write reads the pages into one bytes object and a
read copies the value over the pages (``base.read_parts``/``write_parts``): fine for small
fleets and tests; Mooncake Store (``mooncake.py``) moves bytes from registered memory.
Each value is written before its record, in one pipeline, so a reader that finds the record
finds the value (or a digest that fails, if someone changed it).
"""

from __future__ import annotations

from collections.abc import Sequence

from memory_broker.broker.tier.base import META_SUFFIX, Block, Meta, TierError, read_parts, write_parts


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
            pipe.set(b.key, read_parts(b.parts))
        for b, m in zip(blocks, metas):
            pipe.set(b.key + META_SUFFIX, m.encode())
        try:
            done = pipe.execute(raise_on_error=False)
        except self._errors as e:
            raise TierError(f"valkey: {e}") from None
        n = len(blocks)
        return [done[i] is True and done[n + i] is True for i in range(n)]

    def metas(self, keys: Sequence[str], timeout: float) -> list[Meta | None]:
        try:
            raw = self._client.mget([k + META_SUFFIX for k in keys])
        except self._errors as e:
            raise TierError(f"valkey: {e}") from None
        return [Meta.decode(r) for r in raw]

    def get_into(self, blocks: Sequence[Block], timeout: float) -> list[bool]:
        try:
            values = self._client.mget([b.key for b in blocks])
        except self._errors as e:
            raise TierError(f"valkey: {e}") from None
        return [v is not None and write_parts(b.parts, v) for b, v in zip(blocks, values)]

    def connect(self) -> None:
        """Nothing ahead: the client connects at its first command."""

    def register(self, address: int, size: int) -> None:
        """Nothing to register: Valkey copies."""

    def reset(self) -> None:
        self._client.connection_pool.disconnect()

    def close(self) -> None:
        self._client.close()
