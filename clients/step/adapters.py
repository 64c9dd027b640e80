"""The client's side of adapters: leases, layouts, and row-offset tables cached per generation.

A lease is what ``BrokerClient.acquire_adapters`` returns: the adapters pinned for this
session (released when the lease ends), each with its generation, physical pages and layout.
``AdapterTables`` turns (layout, pages) into the kernels' element-offset tables once per
(adapter, generation) and keeps them on the device; a new generation (the adapter was
evicted and placed anew) misses the cache and builds fresh tables. An adapter's pages are
read-only in this process's mapping from the moment a lease names them: shared weights are
never written by a client (copy what must change). The client maps an acquired adapter's
pages and decodes its layout before it builds the lease, so nothing here reaches into the
client (which only needs to commit, abort and release for a lease: ``LeaseHolder``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.layout import AdapterLayout, offset_table, row_offsets

if TYPE_CHECKING:
    from memory_broker.kernels.records import LoraTables


class LeaseHolder(Protocol):
    """What a lease needs of the session that holds its pins (``BrokerClient`` is one)."""

    # Sessions the holder has opened so far: a lease of an earlier one holds nothing.
    epoch: int
    closed: bool

    def commit_acquire(self, transaction_id: int) -> None: ...

    def abort_acquire(self, transaction_id: int) -> None: ...

    def release_adapters(self, adapter_ids: Sequence[str], dtype: str = "") -> None: ...


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

    def __init__(
        self,
        client: LeaseHolder,
        adapters: Sequence[LeasedAdapter],
        deferred: Sequence[str] = (),
        transaction_id: int = 0,
        session_id: int = 0,
        dtype: str = "",
    ):
        """A lease of ``adapters`` (already mapped read-only by the holder) pinned by ``client``.

        Args:
            client: the session holding the pins; its ``epoch`` now is the lease's.
            adapters: what was acquired, in request order.
            deferred: ids over the cap (max_adapters), in request order: not acquired.
            transaction_id: a two-phase acquire's transaction (0: pins are active now).
            session_id: the broker's id of the holding session (for messages).
            dtype: the dtype the adapters were asked in ("": the broker's own); released in it.
        """
        self.client = client
        # The session holding the pins: a lease of a session lost to a broker restart holds nothing.
        self.session_id: int = session_id
        self.epoch: int = client.epoch
        self.adapters: list[LeasedAdapter] = list(adapters)
        # Ids over the cap (max_adapters), in request order: not acquired; ask again later.
        self.deferred: list[str] = list(deferred)
        # Two-phase acquires: the transaction to commit (or abort).
        self.transaction_id: int = transaction_id
        self.dtype = dtype
        self.released = False

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
            if self.dtype:
                self.client.release_adapters(self.ids, dtype=self.dtype)
            else:
                self.client.release_adapters(self.ids)

    def __enter__(self) -> AdapterLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class AdapterTables:
    """Kernel offset tables on the device, built once per (adapter, generation).

    Args:
        device: where the tables live ("cpu", "cuda:N", or "cuda": the current CUDA device,
            whose index is filled in so it compares equal to the arena tensor's device).
    """

    def __init__(self, device="cpu"):
        from memory_broker.kernels.devices import device_key

        self.device = device_key(device)
        self._tables: dict[tuple, LoraTables] = {}
        # How many times tables were built (a test can see the cache work).
        self.builds = 0

    def tables(
        self, slots: Sequence[LeasedAdapter | None], layer: int, modules: Sequence[str], max_rank: int | None = None
    ):
        """The ``LoraTables`` record (a_offsets, b_offsets, ranks, scalings) on the device for one launch.

        ``slots[s]`` is the adapter in kernel slot s (None: empty). Cached by the slots'
        (adapter, generation) and the launch's layer and modules.
        """
        import torch

        from memory_broker.kernels.records import LoraTables

        key = (tuple((a.adapter_id, a.generation) if a else None for a in slots), layer, tuple(modules), max_rank)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        t = offset_table([(a.layout, a.pages) if a else None for a in slots], layer, modules, max_rank)
        self.builds += 1
        out = LoraTables(
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
