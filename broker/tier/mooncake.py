"""The tier on Mooncake Store: values moved straight from and into the arena's pages.

The arena's slabs are registered with the store (``register``), so a write is one
``batch_put_from_multi_buffers`` over each object's pages and a read one
``batch_get_into_multi_buffers`` into the pages reserved for it: no copy in this process.
The records beside the values are small and go through the store's own buffer. This broker
is a Mooncake client that also contributes ``segment_size`` bytes of its host memory to the
fleet (Mooncake keeps values in its clients' segments, under its master's leases and
eviction). Over TCP here; the same calls run over RDMA where the store is set up for it.

With ``tenants``, each tenant pool's blocks go through a Mooncake client of their own whose
``tenant_id`` is the pool's name (the shared pool's: ``default``): on a master started with
``-enable_multi_tenants`` and a quota policy naming them, each pool's values are in their
own namespace and count against their own quota (a put past it is refused and counted as a
failed write). Mooncake sets the tenant per client, not per call; the pools' clients lend no
segment of their own (the broker's default client lends ``segment_size``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from memory_broker.broker.tier.base import META_SUFFIX, Block, Meta, TierError, key_pool

# Mooncake's error codes for a failed RPC to its master (-900 failed, -901 timed out, ...):
# the store is unreachable.
RPC_FAIL = -900
RPC_ERRORS = range(-999, -899)
LOCAL_BUFFER = 16 << 20
# Mooncake's tenant of the shared pool's values (and of every value without ``tenants``).
DEFAULT_TENANT = "default"


def local_address(master: str) -> str:
    """This host's address on the route to ``master`` (host:port): what peers reach us at."""
    host, _, port = master.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host or "127.0.0.1", int(port or 50051)))
        return s.getsockname()[0]


class MooncakeBackend:
    """A Mooncake Store client of the master at ``master`` (host:port).

    Args:
        master: the master's RPC address.
        metadata: the transfer engine's metadata service ("P2PHANDSHAKE": none, peers meet
            through the master).
        segment_size: bytes of host memory this broker contributes to the store.
        tenants: each tenant pool as a Mooncake tenant of its own (module docstring).
    """

    name = "mooncake"

    def __init__(  # noqa: PLR0913 - the tier.mooncake_* settings and the deadline
        self, master: str, metadata: str, segment_size: int, timeout_s: float = 1.0, tenants: bool = False
    ):
        # Every RPC of the client within the tier's deadline (its default is far longer, and
        # a call that waits on a master that does not answer holds this process's thread).
        ms = str(max(1, int(timeout_s * 1000)))
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", ms)
        os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", ms)
        self._config = {
            "local_hostname": local_address(master),
            "metadata_server": metadata,
            "global_segment_size": segment_size,
            "local_buffer_size": LOCAL_BUFFER,
            "protocol": "tcp",
            "master_server_addr": master,
            "tenant_id": DEFAULT_TENANT,
        }
        self.tenants = tenants
        self._stores: dict[str, object] = {}  # Mooncake tenant -> its client
        self._regions: dict[int, int] = {}

    @property
    def _store(self):
        return self._stores.get(DEFAULT_TENANT)

    def _tenant(self, key: str) -> str:
        pool = key_pool(key) if self.tenants else "shared"
        return DEFAULT_TENANT if pool == "shared" else pool

    def _connected(self, tenant: str = DEFAULT_TENANT):
        store = self._stores.get(tenant)
        if store is None:
            from mooncake.store import MooncakeDistributedStore

            if tenant != DEFAULT_TENANT:
                self._connected()  # the segment this broker lends is the default client's
            config = dict(self._config, tenant_id=tenant)
            if tenant != DEFAULT_TENANT:
                config["global_segment_size"] = 0
            store = MooncakeDistributedStore()
            rc = store.setup(config)
            if rc != 0:
                store.close()
                raise TierError(
                    f"mooncake: setup of tenant {tenant!r} with master {config['master_server_addr']} failed ({rc})"
                )
            for addr, size in self._regions.items():
                store.register_buffer(addr, size)
            self._stores[tenant] = store
        return store

    def _by_tenant(self, keys: Sequence[str]) -> dict[str, list[int]]:
        """Positions of ``keys`` per Mooncake tenant, in order."""
        out: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            out.setdefault(self._tenant(k), []).append(i)
        return out

    @staticmethod
    def _check(codes: Sequence[int], what: str) -> None:
        bad = next((c for c in codes if c in RPC_ERRORS), None)
        if bad is not None:
            raise TierError(f"mooncake: {what} failed: the master did not answer ({bad})")

    def put(self, blocks: Sequence[Block], metas: Sequence[Meta], timeout: float) -> list[bool]:
        ok = [False] * len(blocks)
        for tenant, idx in self._by_tenant([b.key for b in blocks]).items():
            got = self._put(self._connected(tenant), [blocks[i] for i in idx], [metas[i] for i in idx])
            for i, g in zip(idx, got):
                ok[i] = g
        return ok

    def _put(self, store, blocks: Sequence[Block], metas: Sequence[Meta]) -> list[bool]:
        keys = [b.key for b in blocks]
        codes = store.batch_put_from_multi_buffers(
            keys, [[a for a, _ in b.parts] for b in blocks], [[n for _, n in b.parts] for b in blocks]
        )
        self._check(codes, "put")
        ok = [c == 0 for c in codes]
        stored = [i for i, good in enumerate(ok) if good]
        if stored:
            rc = store.put_batch([keys[i] + META_SUFFIX for i in stored], [metas[i].encode() for i in stored])
            self._check([rc], "put of records")
            if rc != 0:
                return [False] * len(blocks)
        return ok

    def metas(self, keys: Sequence[str], timeout: float) -> list[Meta | None]:
        # A chain is one pool's (a lookup is one session's, in one pool): one tenant.
        store = self._connected(self._tenant(keys[0])) if keys else None
        if store is None:
            return []
        names = [k + META_SUFFIX for k in keys]
        there = store.batch_is_exist(names)
        self._check(there, "exists")
        n = next((i for i, e in enumerate(there) if e != 1), len(names))  # the leading hits
        raw = store.get_batch(names[:n]) if n else []
        return [Meta.decode(r) for r in raw] + [None] * (len(keys) - n)

    def sizes(self, keys: Sequence[str], timeout: float) -> list[int]:
        """LMCache's format is shared through Valkey only (the broker's options refuse it here)."""
        raise TierError("mooncake: values in LMCache's format are shared through Valkey only")

    def get_into(self, blocks: Sequence[Block], timeout: float) -> list[bool]:
        store = self._connected(self._tenant(blocks[0].key)) if blocks else None
        if store is None:
            return []
        got = store.batch_get_into_multi_buffers(
            [b.key for b in blocks],
            [[a for a, _ in b.parts] for b in blocks],
            [[n for _, n in b.parts] for b in blocks],
        )
        self._check(got, "get")
        return [g == b.size for g, b in zip(got, blocks)]

    def connect(self) -> None:
        self._connected()

    def register(self, address: int, size: int) -> None:
        if address in self._regions:
            return
        self._regions[address] = size
        for store in self._stores.values():
            rc = store.register_buffer(address, size)
            if rc != 0:
                raise TierError(f"mooncake: registering {size} bytes at {address:#x} failed ({rc})")

    def reset(self) -> None:
        """Nothing: a connected client finds a restarted master by itself, and closing it would
        drop the values other brokers keep in this broker's segment."""

    def close(self) -> None:
        # The pools' clients first: the default client's segment may hold their values.
        for tenant in sorted(self._stores, key=lambda t: t == DEFAULT_TENANT):
            self._stores.pop(tenant).close()
