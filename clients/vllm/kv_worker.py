"""The KV connector's worker half: copies blocks between the broker's pages and vLLM's KV cache.

``BrokerKVWorker`` runs in each of vLLM's workers, inside ``MemoryBrokerConnector``
(``kv_connector.py``), the facade vLLM instantiates. Before the forward pass it copies the
step's loads (``BrokerKVMetadata.loads``, objects the scheduler pinned) from the broker's pages
into the KV cache; during it, it copies the step's new blocks, layer by layer as vLLM saves
them, into a staging buffer, which ``wait_for_save`` hands to ``KVSaver`` (``kv_saver.py``): a
thread stores them in batches, off the request's path. A block object holds a block's bytes
layer after layer, each layer's elements in the KV cache's memory order (``BlockMover``;
``identity.KEY_VERSION`` 2). Failures are reported to vLLM as blocks to recompute, or as blocks not stored; never as a failed request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from memory_broker.clients.vllm import check_vllm_version

check_vllm_version()

import torch  # noqa: E402

from memory_broker.clients.vllm import identity, store  # noqa: E402
from memory_broker.clients.vllm.block_mover import BlockMover  # noqa: E402
from memory_broker.clients.vllm.kv_records import (  # noqa: E402
    BrokerKVMetadata,
    BrokerKVStats,
    BrokerKVWorkerMetadata,
    LoadRequest,
)
from memory_broker.clients.vllm.kv_saver import KVSaver, Staged  # noqa: E402
from memory_broker.proto.wire.errors import BrokerError  # noqa: E402

if TYPE_CHECKING:
    from memory_broker.clients.vllm.store import BrokerKV

log = logging.getLogger("vllm.memory_broker.kv_worker")

# Bytes of new blocks staged and not yet committed, at most (``store_buffer_mb``).
DEFAULT_STORE_BUFFER = 256 << 20
_UNSET = object()


class BrokerKVWorker:
    """The worker half (see the module docstring); ``stats`` is the facade's, shared."""

    def __init__(
        self,
        broker: BrokerKV,
        tp_rank: int,
        num_blocks: int,
        stats: BrokerKVStats,
        *,
        store_buffer_bytes: int = DEFAULT_STORE_BUFFER,
        store_in_step: bool = False,
    ):
        self.broker = broker
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        self.stats = stats
        self._layers: dict[str, int] = {}
        self._block_dims: dict[str, int] = {}
        self._kv: dict[str, torch.Tensor] = {}
        self._mover: BlockMover | None = None
        self._layer_nbytes = 0
        self._block_nbytes = 0
        self._enabled = False
        self.store_in_step = store_in_step
        self._saver = KVSaver(broker, stats, store_buffer_bytes)
        # This step's staged saves: _UNSET until its first save_kv_layer, None for none.
        self._staged: Staged | None | object = _UNSET
        self._staged_blocks: list[int] = []
        self._load_errors: set[int] = set()
        self._loaded: set[str] = set()
        # Asynchronous loads (from the broker's tier) done this step, loaded or not.
        self._received: set[str] = set()

    # ---------------------------------------------------------------- the KV cache

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.num_blocks
        layer_nbytes = None
        views: dict[str, torch.Tensor] = {}
        for i, (name, t) in enumerate(kv_caches.items()):
            if t.shape[0] != num_blocks and t.shape[0] % num_blocks == 0:
                t = t.unflatten(0, (num_blocks, -1))  # kernel blocks smaller than vLLM's blocks
            dims = [d for d, s in enumerate(t.shape) if s == num_blocks]
            if not dims:
                log.error(
                    "MemoryBrokerConnector: layer %s's KV tensor %s has no dimension of %d blocks; "
                    "the connector stays off",
                    name,
                    tuple(t.shape),
                    num_blocks,
                )
                return
            nbytes = t.numel() // num_blocks * t.element_size()
            if layer_nbytes is not None and nbytes != layer_nbytes:
                log.error(
                    "MemoryBrokerConnector: layers differ in KV bytes per block (%d, %d); the connector stays off",
                    layer_nbytes,
                    nbytes,
                )
                return
            layer_nbytes = nbytes
            views[name] = t
            self._layers[name] = i
            self._block_dims[name] = dims[0]
        self._layer_nbytes = layer_nbytes or 0
        self._block_nbytes = self._layer_nbytes * len(self._layers)
        self._kv = views
        self._enabled = self._block_nbytes > 0
        log.info(
            "MemoryBrokerConnector: %d layers, KV tensors %s, %d bytes per block",
            len(views),
            tuple(next(iter(views.values())).shape) if views else (),
            self._block_nbytes,
        )

    def _mover_for(self, page_size: int) -> BlockMover:
        """The block mover over the registered layers for this arena's page size (made once,
        and again only if a restarted broker's pages differ)."""
        m = self._mover
        if m is None or m.page_size != page_size:
            names = list(self._layers)
            m = self._mover = BlockMover([self._kv[n] for n in names], [self._block_dims[n] for n in names], page_size)
        return m

    # ---------------------------------------------------------------- loads

    def start_load_kv(self, meta: object) -> None:
        if isinstance(meta, BrokerKVMetadata):
            # vLLM holds an asynchronous load's request until it hears it received, whatever
            # became of its blocks (those that fail are reported with them, this step).
            self._received.update(lr.req_id for lr in meta.loads if lr.tier)
        if not isinstance(meta, BrokerKVMetadata) or not meta.loads or not self._enabled:
            if isinstance(meta, BrokerKVMetadata):
                for lr in meta.loads:  # connector off on this worker: vLLM recomputes
                    self._load_errors.update(lr.block_ids + lr.failed_block_ids)
                    self.stats.add("load_failed_blocks", len(lr.block_ids) + len(lr.failed_block_ids))
            return
        remote: list[LoadRequest] = []
        for lr in meta.loads:
            if lr.failed_block_ids:  # no longer in the broker when the scheduler pinned them
                self._load_errors.update(lr.failed_block_ids)
                self.stats.add("load_failed_blocks", len(lr.failed_block_ids))
            if not lr.block_ids:
                continue
            # The scheduler's session when it lives in this process: the pinned pages are in
            # this mapping, and stay readable even if the broker went away since the lookup.
            c = self.broker.client_for(lr.incarnation)
            if c is None:
                remote.append(lr)
                continue
            try:
                wanted = [blk[self.tp_rank] for blk in lr.objects]
                if c.view.mapped_slabs * c.geometry.pages_per_slab <= max((max(p) for _, _, p in wanted), default=0):
                    raise RuntimeError("pages beyond this process's mapping")
                self._copy_in(c, lr, [p for _, _, p in wanted])
            except (BrokerError, RuntimeError, ValueError, OSError) as e:
                self._load_failed(c, lr, e)
        if remote:
            self._load_remote(remote)

    def _load_failed(self, c, lr: LoadRequest, e: BaseException) -> None:
        self._load_errors.update(lr.block_ids)
        self.stats.add("load_failed_blocks", len(lr.block_ids))
        if isinstance(e, BrokerError):
            self.stats.add("broker_errors")
            self.broker.failed(c, e, "load")
        log.warning(
            "MemoryBrokerConnector: loading %d blocks of request %s failed (%s); vLLM recomputes them",
            len(lr.block_ids),
            lr.req_id,
            e,
        )

    def _load_remote(self, lrs: list[LoadRequest]) -> None:
        """Loads whose scheduler runs in another process: the step's blocks pinned in this
        process's session in one frame, checked to be the very objects the scheduler pinned,
        copied, and unpinned in one more."""
        c = self.broker.client()
        wanted = [[blk[self.tp_rank] for blk in lr.objects] for lr in lrs]
        try:
            if c is None:
                raise RuntimeError("the broker is unavailable")
            got = c.lookup_many([[k for k, _, _ in w] for w in wanted], pin=True)
        except (BrokerError, RuntimeError) as e:
            for i, lr in enumerate(lrs):  # one error, counted once
                self._load_failed(c, lr, e if i == 0 else RuntimeError(str(e)))
            return
        try:
            for lr, w, g in zip(lrs, wanted, got):
                try:
                    if [(o.object_id, list(o.pages)) for o in g] != [(oid, pages) for _, oid, pages in w]:
                        raise RuntimeError("the broker no longer holds the blocks the scheduler found")
                    self._copy_in(c, lr, [list(o.pages) for o in g])
                except (RuntimeError, ValueError, OSError) as e:
                    self._load_failed(None, lr, e)
        finally:
            pinned = [o for g in got for o in g]
            if pinned:
                try:
                    c.unpin(pinned)
                except BrokerError as e:
                    self.broker.failed(c, e, "unpin")

    def _copy_in(self, c, lr: LoadRequest, block_pages: list[list[int]]) -> None:
        self._mover_for(c.geometry.page_size).load(c.physical_view(), lr.block_ids, block_pages)
        self.stats.add("loaded_blocks", len(lr.block_ids))
        self._loaded.add(lr.req_id)

    # ---------------------------------------------------------------- saves

    def _stage_saves(self, meta: BrokerKVMetadata) -> None:
        """Staging for the step's new blocks (a block two requests share, once; one another
        step staged and the saver has not committed yet, not again). No broker call: the
        page size is the current session's."""
        self._staged = None
        blocks, keys, seen = [], [], set()
        for sr in meta.saves:
            for bid, h in zip(sr.block_ids, sr.chain_hashes):
                key = identity.block_key(h, self.tp_rank)
                if key not in seen:
                    seen.add(key)
                    blocks.append(bid)
                    keys.append(key)
        c = self.broker.client() if keys else None
        if c is None:
            self.stats.add("store_skipped_blocks", len(keys))
            return
        page_size = c.geometry.page_size
        per_block = store.pages_for(self._block_nbytes, page_size)
        fresh = self._saver.reserve(keys, per_block * page_size)
        if fresh is None:  # the staging limit: these blocks are not stored
            self.stats.add("store_skipped_blocks", len(keys))
            return
        if not fresh:
            return
        device = next(iter(self._kv.values())).device
        staging = self._saver.buffer(len(fresh) * per_block * page_size, device)
        self._staged = Staged([keys[i] for i in fresh], staging, page_size, per_block)
        self._staged_blocks = [blocks[i] for i in fresh]

    def save_kv_layer(self, meta: object, layer_name: str) -> None:
        if not self._enabled or layer_name not in self._layers:
            return
        if not isinstance(meta, BrokerKVMetadata) or not meta.saves:
            return
        if self._staged is _UNSET:
            self._stage_saves(meta)
        st = self._staged
        if st is None:
            return
        k = st.pages_per_block
        pages = [list(range(i * k, (i + 1) * k)) for i in range(len(st.keys))]
        try:
            self._mover_for(st.page_size).save(st.staging, self._staged_blocks, pages, layer=self._layers[layer_name])
        except (RuntimeError, ValueError, OSError) as e:
            log.warning(
                "MemoryBrokerConnector: copying layer %s failed (%s); this step's blocks are not stored", layer_name, e
            )
            self.stats.add("store_skipped_blocks", len(st.keys))
            self._saver.release(st.keys, st.nbytes)
            self._staged = None

    def wait_for_save(self) -> None:
        """The step's staged blocks go to the saver's thread; the step does not wait for
        them (``store_in_step``: it does, the connector's behaviour before the saver)."""
        st, self._staged = self._staged, _UNSET
        if st is None or st is _UNSET:
            return
        if st.staging.device.type == "cuda":
            st.ready = torch.cuda.Event()
            st.ready.record()
        self._saver.submit(st)
        if self.store_in_step:
            self._saver.drain(self.broker.timeout_s * 3)

    # ---------------------------------------------------------------- reports

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def get_finished(self) -> set[str] | None:
        """The asynchronous loads done since the last call (vLLM's ``get_finished``)."""
        out, self._received = self._received, set()
        return out or None

    def build_connector_worker_meta(self) -> BrokerKVWorkerMetadata | None:
        if not self._loaded:
            return None
        out = BrokerKVWorkerMetadata(loaded=self._loaded)
        self._loaded = set()
        return out

    def shutdown(self) -> None:
        self._saver.close(self.broker.timeout_s)
