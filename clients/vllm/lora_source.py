"""The engine process's side of broker adapters: one session, one lease per adapter vLLM holds,
and (for vLLM's own slot buffers) private copies of an adapter's weights read from the pages.

``BrokerAdapters`` owns this process's ``BrokerClient`` for adapters and the leases: an adapter
is acquired when vLLM loads it and released when vLLM evicts or removes it (``reconcile``); the
broker drops the pins by itself when the process dies. It never writes an adapter's pages (they
are read-only in this mapping): ``copies`` gathers new tensors. It imports neither vLLM nor gRPC
types beyond the client library.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass

import torch

from memory_broker.clients import discovery
from memory_broker.clients.client import BrokerClient
from memory_broker.clients.step.adapters import AdapterLease, LeasedAdapter
from memory_broker.kernels.reference import gather_rows
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.layout import ModuleShard

log = logging.getLogger("vllm.memory_broker.lora")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class Held:
    """One adapter this process holds for vLLM."""

    # The lease pinning it (this session's one pin on it).
    lease: AdapterLease
    # Its placement: pages, layout, generation.
    adapter: LeasedAdapter
    # vLLM's integer ids it is loaded under (the OpenAI server numbers adapters itself).
    int_ids: set[int]
    # The dtype its copy was asked in ("": the broker's own).
    dtype: str = ""


@dataclass(frozen=True, slots=True)
class ModuleCopy:
    """One module's weights, copied out of the pages in vLLM's orientation."""

    # [rank, in_features]
    lora_a: torch.Tensor
    # [out_features, rank]
    lora_b: torch.Tensor
    rank: int
    scaling: float


class BrokerAdapters:
    """This process's adapters from one broker. Thread-safe.

    Args:
        socket: the broker's gRPC Unix socket (or a directory of per-GPU brokers: ``bind``
            names this process's one before the first call).
    """

    def __init__(self, socket: str, *, client_name: str | None = None, timeout_s: float = 30.0):
        self.socket = socket
        # The GPU the broker must serve (a per-GPU broker's, set by ``bind``), or None.
        self.gpu_uuid: str | None = None
        # A tensor-parallel rank's shards (``bind``): every adapter is acquired as that slice.
        self.shards: tuple[ModuleShard, ...] = ()
        self.client_name = client_name or f"vllm-lora-{os.getpid()}"
        self.timeout_s = timeout_s
        self._lock = threading.RLock()
        self._client: BrokerClient | None = None
        # adapter id -> what this process holds of it.
        self._held: dict[str, Held] = {}
        # vLLM lora_int_id -> adapter id.
        self._by_int: dict[int, str] = {}
        # lora_int_ids loaded but not yet in vLLM's adapter cache (reconcile keeps them).
        self.pending: set[int] = set()
        # Counters a test or a stats call can read.
        self.acquires = 0
        self.releases = 0

    def bind(self, socket: str, gpu_uuid: str | None, shards: tuple[ModuleShard, ...] = ()) -> None:
        """Serve this process from the broker on ``socket`` (which must serve ``gpu_uuid`` when
        given: a tensor-parallel rank's GPU's) with every adapter cut to ``shards``.

        Raises:
            RuntimeError: adapters are held already (from another broker, or cut otherwise).
        """
        with self._lock:
            if (socket, gpu_uuid, shards) == (self.socket, self.gpu_uuid, self.shards):
                return
            if self._held:
                raise RuntimeError(f"adapters {sorted(self._held)} are held from {self.socket}; bind before loading")
            if self._client is not None:
                self._client.close()
                self._client = None
            self.socket, self.gpu_uuid, self.shards = socket, gpu_uuid, shards

    def client(self) -> BrokerClient:
        with self._lock:
            if self._client is None or self._client.closed:
                c = BrokerClient.connect(self.socket, client_name=self.client_name, timeout=self.timeout_s)
                try:
                    discovery.check_device(c.arena.device, self.gpu_uuid, self.socket)
                except BrokerError:
                    c.close()
                    raise
                self._client = c
            return self._client

    def register_directory(self, path: str) -> str:
        """Register a PEFT directory under an id derived from its real path (once; a directory
        registered before keeps its id) and return the id: how a zero-copy engine serves an
        adapter vLLM names by path."""
        real = os.path.realpath(path)
        adapter_id = "vllm-dir-" + hashlib.sha256(real.encode()).hexdigest()[:32]
        try:
            self.client().register_adapter(adapter_id, real)
            log.info("memory-broker: registered %s as adapter %s", real, adapter_id)
        except BrokerError as e:
            if e.code != Code.ALREADY_EXISTS:
                raise
        return adapter_id

    def acquire(self, adapter_id: str, lora_int_id: int, dtype: str = "") -> LeasedAdapter:
        """Pin ``adapter_id`` for vLLM's adapter ``lora_int_id`` (once per adapter per process),
        its copy in ``dtype`` (the engine's LoRA dtype: the broker makes the copy from the
        adapter's files, cast once as vLLM casts them; "": the broker's own dtype), of this
        rank's ``shards`` (the broker lays out only this rank's slice).

        Raises:
            BrokerError: the broker does not know the adapter, or cannot place it;
                FAILED_PRECONDITION from a broker too old to make copies in ``dtype``.
        """
        with self._lock:
            held = self._held.get(adapter_id)
            if held is not None and held.lease.epoch != self.client().epoch:
                # The broker restarted: the old session's pins and pages are gone.
                self._held.pop(adapter_id)
                held = None
            if held is None:
                lease = self.client().acquire_adapters([adapter_id], dtype=dtype, shards=self.shards)
                if not lease.adapters:
                    lease.release()
                    raise RuntimeError(f"the broker deferred adapter {adapter_id!r} ({lease.deferred})")
                held = self._held[adapter_id] = Held(lease, lease.adapters[0], set(), dtype)
                self.acquires += 1
                log.info(
                    "memory-broker: acquired adapter %s in %s (found %s, %d pages, generation %d)",
                    adapter_id,
                    held.adapter.layout.dtype,
                    held.adapter.found_in,
                    len(held.adapter.pages),
                    held.adapter.generation,
                )
            held.int_ids.add(lora_int_id)
            self._by_int[lora_int_id] = adapter_id
            return held.adapter

    def adapter(self, lora_int_id: int | None) -> LeasedAdapter | None:
        """The leased adapter vLLM's ``lora_int_id`` runs with, or None (not from the broker)."""
        if lora_int_id is None:
            return None
        with self._lock:
            aid = self._by_int.get(lora_int_id)
            held = self._held.get(aid) if aid is not None else None
            if held is None:
                return None
            if self._client is not None and held.lease.epoch != self._client.epoch:
                # The broker restarted under vLLM's cached adapter: its old pages are gone.
                # Acquire it again on the new session (new pages, new generation).
                log.warning("memory-broker: the broker restarted; acquiring adapter %s again", aid)
                ids = held.int_ids
                self._held.pop(aid)
                try:
                    for i in ids:
                        self.acquire(aid, i, held.dtype)
                except BrokerError as e:
                    raise RuntimeError(
                        f"the broker restarted and adapter {aid!r}, which vLLM holds, cannot be acquired again "
                        f"({e}); register it in the broker again"
                    ) from e
                held = self._held[aid]
            return held.adapter

    def release(self, lora_int_id: int) -> bool:
        """vLLM dropped ``lora_int_id``: release the adapter's lease when no other id uses it."""
        with self._lock:
            aid = self._by_int.pop(lora_int_id, None)
            self.pending.discard(lora_int_id)
            held = self._held.get(aid) if aid is not None else None
            if held is None:
                return False
            held.int_ids.discard(lora_int_id)
            if held.int_ids:
                return False
            self._held.pop(aid)
            try:
                held.lease.release()
            except Exception as e:  # a broker that went away released the pins itself
                log.warning("memory-broker: releasing adapter %s failed: %s", aid, e)
            self.releases += 1
            log.info("memory-broker: released adapter %s", aid)
            return True

    def reconcile(self, live_int_ids) -> int:
        """Forget every id not in ``live_int_ids`` (what vLLM still holds) nor pending, releasing
        adapters left with no id; returns how many leases were released."""
        live = set(live_int_ids)
        with self._lock:
            gone = [i for i in self._by_int if i not in live and i not in self.pending]
        return sum(self.release(i) for i in gone)

    def epoch(self) -> int:
        """The current broker session's number (changes when the client reconnects); 0 before any."""
        c = self._client
        return c.epoch if c is not None else 0

    def held(self) -> dict[str, LeasedAdapter]:
        with self._lock:
            return {aid: h.adapter for aid, h in self._held.items()}

    def arena(self, dtype: str) -> torch.Tensor:
        """The arena's physical view as a 1-D tensor of ``dtype`` (what offset tables index)."""
        return self.client().arena_tensor(TORCH_DTYPES[dtype])

    def copies(self, adapter: LeasedAdapter, dtype: torch.dtype) -> dict[tuple[int, str], ModuleCopy]:
        """(layer, module) -> the module's A and B as new tensors of ``dtype`` (never views of
        the pages: vLLM scales B in place)."""
        arena = self.arena(adapter.layout.dtype)
        offsets = adapter.row_offsets()
        out: dict[tuple[int, str], ModuleCopy] = {}
        for (layer, module, kind), rows in offsets.items():
            if kind != "A":
                continue
            m = adapter.layout.module(layer, module)
            a = gather_rows(arena, torch.from_numpy(rows), m.in_features).to(dtype)
            b = gather_rows(arena, torch.from_numpy(offsets[(layer, module, "B")]), m.out_features).T.to(dtype)
            out[(layer, module)] = ModuleCopy(a.contiguous(), b.contiguous(), m.rank, float(m.scaling))
        return out

    def close(self) -> None:
        with self._lock:
            for aid in list(self._held):
                for i in list(self._held[aid].int_ids):
                    self.release(i)
            if self._client is not None:
                self._client.close()
                self._client = None
