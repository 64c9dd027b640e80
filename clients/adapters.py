"""The client's side of adapters: leases, layouts, and row-offset tables cached per generation.

A lease is what ``BrokerClient.acquire_adapters`` returns: the adapters pinned for this
session (released when the lease ends), each with its generation, physical pages and layout.
``AdapterTables`` turns (layout, pages) into the kernels' element-offset tables once per
(adapter, generation) and keeps them on the device; a new generation (the adapter was
evicted and placed anew) misses the cache and builds fresh tables. An adapter's pages are
read-only in this process's mapping from the moment a lease names them: shared weights are
never written by a client (copy what must change).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from memory_broker.broker.adapters.layout import AdapterLayout, offset_table, row_offsets
from memory_broker.broker.errors import BrokerError, Code
from memory_broker.broker.v1 import broker_pb2 as pb

if TYPE_CHECKING:
    from memory_broker.clients.client import BrokerClient

TIER_NAMES = {pb.ADAPTER_TIER_HOT: "hot", pb.ADAPTER_TIER_WARM: "warm", pb.ADAPTER_TIER_COLD: "cold"}


def layout_from_proto(msg: pb.AdapterLayout) -> AdapterLayout:
    """The broker's placement record, rebuilt from its wire form."""
    return AdapterLayout.from_dict(
        {
            "page_size": msg.page_size,
            "dtype": msg.dtype,
            "row_align": msg.row_align,
            "num_pages": msg.num_pages,
            # Only the broker writes pages; readers do not need the used extents.
            "page_used": [0] * msg.num_pages,
            "modules": [
                {
                    "layer": m.layer,
                    "module": m.module,
                    "rank": m.rank,
                    "scaling": m.scaling,
                    "in_features": m.in_features,
                    "out_features": m.out_features,
                    "a": [[c.page_index, c.offset, c.rows] for c in m.a.chunks],
                    "b": [[c.page_index, c.offset, c.rows] for c in m.b.chunks],
                    "a_stride": m.a.row_stride,
                    "b_stride": m.b.row_stride,
                }
                for m in msg.modules
            ],
        }
    )


@dataclass(frozen=True, slots=True)
class LeasedAdapter:
    adapter_id: str
    # Changes whenever the adapter is placed anew; offset tables are cached by it.
    generation: int
    object_id: int
    # Physical pages of the adapter's object, in layout page order.
    pages: tuple[int, ...]
    layout: AdapterLayout
    # Where the broker found it: "hot" is a hit.
    found_in: str

    def row_offsets(self) -> dict[tuple[int, str, str], np.ndarray]:
        """(layer, module, "A"|"B") -> element offsets of each row in the arena's physical view."""
        return row_offsets(self.layout, self.pages)


class AdapterLease:
    """Adapters pinned for this session until ``release()`` (or the end of a ``with`` block)."""

    def __init__(self, client: "BrokerClient", resp: pb.AcquireAdaptersResponse):
        self.client = client
        # The session holding the pins: a lease of a session lost to a broker restart holds nothing.
        self.session_id: int = client.session_id
        self.epoch: int = client.epoch
        self.adapters: list[LeasedAdapter] = []
        for a in resp.adapters:
            client._ensure_slabs(a.arena_slabs)
            # Shared weights: read-only in this mapping before anyone here can touch them.
            client._set_access(a.pages, True)
            layout = client._layout_cache.get(a.adapter_id)
            if a.HasField("layout"):
                layout = layout_from_proto(a.layout)
                client._layout_cache[a.adapter_id] = layout
            if layout is None:
                # The cache was cleared under the request (a reconnect): ask for it now.
                layout = layout_from_proto(client.adapter_layout(a.adapter_id))
                client._layout_cache[a.adapter_id] = layout
            self.adapters.append(
                LeasedAdapter(a.adapter_id, a.generation, a.object_id, tuple(a.pages), layout, TIER_NAMES[a.found_in])
            )
        # Ids over the cap (max_adapters), in request order: not acquired; ask again later.
        self.deferred: list[str] = list(resp.deferred)
        # Two-phase acquires: the transaction to commit (or abort).
        self.transaction_id: int = resp.transaction_id
        self.released = False

    @classmethod
    def of(
        cls, client: "BrokerClient", adapters: list[LeasedAdapter], deferred: Sequence[str], transaction_id: int
    ) -> "AdapterLease":
        """A lease from records the client already holds (the step path's acquire)."""
        lease = cls.__new__(cls)
        lease.client = client
        lease.session_id = client.session_id
        lease.epoch = client.epoch
        lease.adapters = adapters
        lease.deferred = list(deferred)
        lease.transaction_id = transaction_id
        lease.released = False
        return lease

    def __getitem__(self, adapter_id: str) -> LeasedAdapter:
        for a in self.adapters:
            if a.adapter_id == adapter_id:
                return a
        raise KeyError(adapter_id)

    @property
    def ids(self) -> list[str]:
        return [a.adapter_id for a in self.adapters]

    def commit(self) -> None:
        """Keep a prepared acquire's pins past its lease."""
        if self.transaction_id:
            self.client.commit_acquire(self.transaction_id)

    def release(self) -> None:
        """Drop this lease's pins (once)."""
        if self.released:
            return
        self.released = True
        if self.epoch != self.client.epoch:
            return  # its pins ended with the old session
        if self.transaction_id:
            # A prepared acquire that was never committed aborts; a committed one releases.
            try:
                self.client.abort_acquire(self.transaction_id)
                return
            except BrokerError as e:
                if e.code != Code.FAILED_PRECONDITION:  # committed: release its pins below
                    raise
        if self.adapters and not self.client.closed:
            self.client.release_adapters(self.ids)

    def __enter__(self) -> "AdapterLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class AdapterTables:
    """Kernel offset tables on the device, built once per (adapter, generation).

    Args:
        device: where the tables live ("cpu" or "cuda:N").
    """

    def __init__(self, device="cpu"):
        import torch

        self.device = torch.device(device)
        self._tables: dict[tuple, tuple] = {}
        # How many times tables were built (a test can see the cache work).
        self.builds = 0

    def tables(
        self, slots: Sequence[LeasedAdapter | None], layer: int, modules: Sequence[str], max_rank: int | None = None
    ):
        """(a_offsets, b_offsets, ranks, scalings) device tensors for one launch.

        ``slots[s]`` is the adapter in kernel slot s (None: empty). Cached by the slots'
        (adapter, generation) and the launch's layer and modules.
        """
        import torch

        key = (tuple((a.adapter_id, a.generation) if a else None for a in slots), layer, tuple(modules), max_rank)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        t = offset_table([(a.layout, a.pages) if a else None for a in slots], layer, modules, max_rank)
        self.builds += 1
        out = (
            torch.from_numpy(t.a_offsets).to(self.device),
            torch.from_numpy(t.b_offsets).to(self.device),
            torch.from_numpy(t.ranks).to(self.device),
            torch.from_numpy(t.scalings).to(self.device),
        )
        self._tables[key] = out
        return out

    def forget_stale(self, live: Sequence[LeasedAdapter]) -> int:
        """Drop tables that mention an (adapter, generation) not in ``live``; returns how many."""
        keep = {(a.adapter_id, a.generation) for a in live}
        stale = [k for k in self._tables if any(s is not None and s not in keep for s in k[0])]
        for k in stale:
            del self._tables[k]
        return len(stale)
