"""The KV connector's stores, off the request's path: a thread that commits staged blocks in batches.

``BrokerKVWorker`` (``kv_worker.py``) copies each step's new blocks, layer by layer as vLLM
saves them, into a staging buffer of its own process (no broker call) and hands the step's
``Staged`` to ``KVSaver`` at ``wait_for_save``; the step ends there. The saver's thread takes
everything waiting at once and stores it in one batch: one Prepare, one copy per batch into
the objects' pages, one Commit. No request's step, and no later step, waits for the broker.

Why a copy and not a later read of vLLM's own blocks: a preempted request's blocks go back to
vLLM's pool without ``request_finished`` (so vLLM's delayed-free protocol, ``get_finished``'s
finished-sending set, does not hold them), and a later step may overwrite them before a
deferred read; the staging copy is made while the blocks certainly hold the step's KV. It
also leaves vLLM's engine core with nothing to poll for.

What is staged is bounded (``limit_bytes``, ``kv_connector_extra_config``'s ``store_buffer_mb``):
a step whose blocks do not fit is not stored (``store_skipped_blocks``; a later request
computes them again). A block is visible to other engines once its batch's Commit returns; an
engine that dies first leaves only prepared objects, which the broker drops with its session:
a block reads as written, or not at all.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from memory_broker.clients.vllm import store
from memory_broker.proto.wire.errors import BrokerError

if TYPE_CHECKING:
    from memory_broker.clients.vllm.kv_records import BrokerKVStats
    from memory_broker.clients.vllm.store import BrokerKV

log = logging.getLogger("vllm.memory_broker.kv_saver")


@dataclass
class Staged:
    """One step's new blocks: ``keys[i]``'s bytes are pages ``i * pages_per_block ...`` of
    ``staging`` (pages of ``page_size`` bytes, laid out as the broker's objects will be)."""

    keys: list[bytes]
    staging: torch.Tensor
    page_size: int
    pages_per_block: int
    # Set when the copies into ``staging`` may still run on a device (CUDA) stream.
    ready: object | None = None
    nbytes: int = field(init=False)

    def __post_init__(self):
        # The whole buffer (a spare one may be larger than the step needs): what it counts.
        base = self.staging._base if self.staging._base is not None else self.staging
        self.nbytes = base.numel()


class KVSaver:
    """Stores staged steps in the background (see the module docstring); ``stats`` is the
    connector's, shared with the worker's thread."""

    def __init__(self, broker: BrokerKV, stats: BrokerKVStats, limit_bytes: int):
        self.broker = broker
        self.stats = stats
        self.limit_bytes = limit_bytes
        self._cv = threading.Condition()
        self._queue: list[Staged] = []
        # Keys staged and not yet committed or dropped (a second step's copy is not made).
        self._pending: set[bytes] = set()
        self._bytes = 0
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        # Staging buffers of stored steps, kept for the next steps (a new one would take its
        # page faults on the step's path); their bytes count in the limit.
        self._spare: list[torch.Tensor] = []

    # ---------------------------------------------------------------- the worker's side

    def reserve(self, keys: list[bytes], block_bytes: int) -> list[int] | None:
        """Room for staging ``keys``: the indices of those not already pending (reserved for
        this caller), or None when their bytes do not fit in the limit (nothing reserved)."""
        with self._cv:
            fresh = [i for i, k in enumerate(keys) if k not in self._pending]
            need = len(fresh) * block_bytes
            if not fresh or self._closed or self._bytes + need > self.limit_bytes:
                return None if fresh else []
            self._bytes += need
            self._pending.update(keys[i] for i in fresh)
            return fresh

    def buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of staging on ``device`` (reserved by ``reserve``): a spare buffer's if
        one is large enough."""
        with self._cv:
            for i, t in enumerate(self._spare):
                if t.device == device and t.numel() >= nbytes:
                    # Counted whole while spare; the caller's reservation counted nbytes of it.
                    del self._spare[i]
                    self._bytes -= nbytes
                    return t[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _keep(self, staging: torch.Tensor) -> None:
        """Keep a stored step's buffer (whole) while spare and staged bytes fit in the limit
        (caller holds the lock)."""
        base = staging._base if staging._base is not None else staging
        if self._bytes + base.numel() <= self.limit_bytes and len(self._spare) < 4:
            self._spare.append(base)
            self._bytes += base.numel()

    def release(self, keys: list[bytes], nbytes: int) -> None:
        """Give back a reservation whose staging was not handed over (a failed copy)."""
        with self._cv:
            self._pending.difference_update(keys)
            self._bytes -= nbytes
            self._cv.notify_all()

    def submit(self, staged: Staged) -> None:
        """Queue a staged step for the thread (started on first use)."""
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="memory-broker-kv-saver", daemon=True)
                self._thread.start()
            self._queue.append(staged)
            self._cv.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything submitted is committed or dropped; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_s: float) -> None:
        """Store what is queued (up to ``timeout_s``), then stop the thread."""
        if not self.drain(timeout_s):
            log.warning("MemoryBrokerConnector: stores still queued at shutdown after %.0f s are dropped", timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
                self._busy = True
            try:
                self._store(batch)
            except Exception:  # never let the thread die: the batch is lost, not wrong
                log.exception("MemoryBrokerConnector: storing %d blocks failed", sum(len(s.keys) for s in batch))
                self.stats.add("store_skipped_blocks", sum(len(s.keys) for s in batch))
            finally:
                with self._cv:
                    for s in batch:
                        self._pending.difference_update(s.keys)
                        self._bytes -= s.nbytes
                        self._keep(s.staging)
                    self._busy = False
                    self._cv.notify_all()

    def _store(self, batch: list[Staged]) -> None:
        """One Prepare for every block of ``batch``, the copies, one Commit."""
        keys = [k for s in batch for k in s.keys]
        c = self.broker.client()
        if c is None or any(s.page_size != c.geometry.page_size for s in batch):
            # Away, or restarted with other pages since the copies were staged.
            self.stats.add("store_skipped_blocks", len(keys))
            return
        for s in batch:
            if s.ready is not None:
                s.ready.synchronize()
        try:
            txn = c.prepare(store.kv_specs(keys, batch[0].pages_per_block * batch[0].page_size, c.geometry.page_size))
        except BrokerError as e:
            self.stats.add("store_skipped_blocks", len(keys))
            self.stats.add("broker_errors")
            self.broker.failed(c, e, "prepare")
            return
        try:
            self._copy(c, batch, txn.objects)
            committed = txn.commit()
        except (BrokerError, RuntimeError, ValueError, OSError) as e:
            self.stats.add("store_skipped_blocks", len(keys))
            if isinstance(e, BrokerError):
                self.stats.add("broker_errors")
                self.broker.failed(c, e, "commit")
            else:
                log.warning("MemoryBrokerConnector: writing %d blocks failed (%s); they are not stored", len(keys), e)
            try:
                txn.abort()
            except BrokerError as e2:
                self.broker.failed(c, e2, "abort")
            return
        dedup = sum(1 for o in committed if o.deduplicated)
        self.stats.add("stored_blocks", len(committed) - dedup)
        self.stats.add("deduplicated_blocks", dedup)

    @staticmethod
    def _copy(c, batch: list[Staged], objects) -> None:
        """Each staged page into its object's page: one ``index_copy_`` per staged step."""
        page_size = batch[0].page_size
        phys = c.physical_view().view(-1, page_size)
        first = 0
        for s in batch:
            objs = objects[first : first + len(s.keys)]
            first += len(s.keys)
            dst = [p for o in objs for p in list(o.pages)[: s.pages_per_block]]
            src = s.staging.view(-1, page_size)
            if src.device != phys.device:
                src = src.to(phys.device)
            phys.index_copy_(0, torch.tensor(dst, dtype=torch.int64, device=phys.device), src)
        if phys.device.type == "cuda":  # the bytes in place before the Commit shares them
            torch.cuda.current_stream(phys.device).synchronize()
