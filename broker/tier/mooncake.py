"""The tier on Mooncake Store: values moved straight from and into the arena's pages.

The arena's slabs are registered with the store (``register``), so a write is one
``batch_put_from_multi_buffers`` over each object's pages and a read one
``batch_get_into_multi_buffers`` into the pages reserved for it: no copy in this process.
The records beside the values are small and go through the store's own buffer. This broker
is a Mooncake client that also contributes ``segment_size`` bytes of its host memory to the
fleet (Mooncake keeps values in its clients' segments, under its master's leases and
eviction). Over TCP here; the same calls run over RDMA where the store is set up for it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from memory_broker.broker.tier.base import META_SUFFIX, Block, Meta, TierError

# Mooncake's error codes for a failed RPC to its master (-900 failed, -901 timed out, ...):
# the store is unreachable.
RPC_FAIL = -900
RPC_ERRORS = range(-999, -899)
LOCAL_BUFFER = 16 << 20


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
        tenant: Mooncake's tenant id for this broker's values.
    """

    name = "mooncake"

    def __init__(  # noqa: PLR0913 - the tier.mooncake_* settings and the deadline
        self, master: str, metadata: str, segment_size: int, tenant: str = "default", timeout_s: float = 1.0
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
            "tenant_id": tenant,
        }
        self._store = None
        self._regions: dict[int, int] = {}

    def _connected(self):
        if self._store is None:
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
            rc = store.setup(self._config)
            if rc != 0:
                store.close()
                raise TierError(f"mooncake: setup with master {self._config['master_server_addr']} failed ({rc})")
            for addr, size in self._regions.items():
                store.register_buffer(addr, size)
            self._store = store
        return self._store

    @staticmethod
    def _check(codes: Sequence[int], what: str) -> None:
        bad = next((c for c in codes if c in RPC_ERRORS), None)
        if bad is not None:
            raise TierError(f"mooncake: {what} failed: the master did not answer ({bad})")

    def put(self, blocks: Sequence[Block], metas: Sequence[Meta], timeout: float) -> list[bool]:
        store = self._connected()
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
        store = self._connected()
        names = [k + META_SUFFIX for k in keys]
        there = store.batch_is_exist(names)
        self._check(there, "exists")
        n = next((i for i, e in enumerate(there) if e != 1), len(names))  # the leading hits
        raw = store.get_batch(names[:n]) if n else []
        return [Meta.decode(r) for r in raw] + [None] * (len(keys) - n)

    def get_into(self, blocks: Sequence[Block], timeout: float) -> list[bool]:
        store = self._connected()
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
        if self._store is not None:
            rc = self._store.register_buffer(address, size)
            if rc != 0:
                raise TierError(f"mooncake: registering {size} bytes at {address:#x} failed ({rc})")

    def reset(self) -> None:
        """Nothing: a connected client finds a restarted master by itself, and closing it would
        drop the values other brokers keep in this broker's segment."""

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
