"""``MemoryBrokerConnector``, vLLM's KV connector (``KVConnectorBase_V1``) over the broker.

Its scheduler side keys each request's full prompt blocks, pins the longest stored prefix
and plans per step which blocks the worker loads and which it stores; its worker side copies
loaded blocks from the broker's pages into vLLM's KV cache before the forward pass and
stores new ones in one prepare per step, layer by layer, committed when the step's saves are
done. A broker that is away, restarting or full never fails a request: vLLM recomputes.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from memory_broker.clients.vllm import check_vllm_version

VLLM_VERSION = check_vllm_version()

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # noqa: E402

from memory_broker.clients.vllm import identity, store  # noqa: E402
from memory_broker.clients.vllm.kv_records import (  # noqa: E402,F401  (STAT_NAMES, the records: imported from here too)
    STAT_NAMES,
    BrokerKVMetadata,
    BrokerKVStats,
    BrokerKVWorkerMetadata,
    LoadRequest,
    SaveRequest,
    _ReqState,
)
from memory_broker.proto.wire.errors import BrokerError  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A child of vLLM's logger, so these lines show among vLLM's own.
log = logging.getLogger("vllm.memory_broker." + __name__.rsplit(".", 1)[-1])


def _keyable(request: Any) -> bool:
    """Requests whose KV is a function of token ids (no images, no prompt embeddings)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return False
    return not getattr(request, "mm_features", None) and request.prompt_token_ids is not None


class MemoryBrokerConnector(KVConnectorBase_V1):
    """KV connector storing prefix KV in the memory broker (see the module docstring).

    ``kv_connector_extra_config``: ``socket`` (default ``$MEMORY_BROKER_SOCKET`` or
    ``/tmp/memory-broker.sock``); optional ``timeout_s`` (per broker call, default 5) and
    ``retry_s`` (between reconnect attempts, default 2).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        unknown = set(extra) - {"socket", "timeout_s", "retry_s"}
        if unknown:
            raise ValueError(
                f"MemoryBrokerConnector: unknown kv_connector_extra_config keys {sorted(unknown)}; "
                "it takes socket, timeout_s and retry_s"
            )
        self.socket = str(extra.get("socket") or store.default_socket())
        from vllm.platforms import current_platform

        ident = identity.engine_identity(vllm_config, kv_cache_config, VLLM_VERSION, current_platform.device_type)
        self._engine_fp = identity.engine_fingerprint(ident)
        self.block_size = ident["block_size"]
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = 0
        role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self.broker = store.shared(
            self.socket,
            client_name=f"vllm-kv:{vllm_config.model_config.model}:{os.getpid()}",
            timeout_s=float(extra.get("timeout_s", 5.0)),
            retry_s=float(extra.get("retry_s", 2.0)),
        )
        self.stats = BrokerKVStats()
        if role == KVConnectorRole.SCHEDULER:
            if cfg.kv_load_failure_policy != "recompute":
                # A broker that goes away between lookup and load must cost a recompute,
                # never a failed request.
                log.warning(
                    "MemoryBrokerConnector sets kv_load_failure_policy to 'recompute' (was %r)",
                    cfg.kv_load_failure_policy,
                )
                cfg.kv_load_failure_policy = "recompute"
            self._reqs: dict[str, _ReqState] = {}
            self._to_load: set[str] = set()
            self._loading: dict[str, _ReqState] = {}
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            try:
                self.tp_rank = get_tensor_model_parallel_rank()
            except (AssertionError, RuntimeError):
                self.tp_rank = 0
            self._layers: dict[str, int] = {}
            self._block_dims: dict[str, int] = {}
            self._layer_nbytes = 0
            self._block_nbytes = 0
            self._enabled = False
            self._txn = None
            self._txn_client = None
            self._step_saves: list[tuple[int, bytes]] | None = None
            self._load_errors: set[int] = set()
            self._loaded: set[str] = set()
        log.info(
            "MemoryBrokerConnector (%s, tp rank %d) on broker %s, block %d tokens",
            role_name,
            self.tp_rank,
            self.socket,
            self.block_size,
        )

    # ================================================================ scheduler side

    def _state(self, request: Request) -> _ReqState | None:
        st = self._reqs.get(request.request_id)
        if st is None:
            if not _keyable(request):
                return None
            root = identity.chain_root(
                self._engine_fp, identity.lora_identity(request.lora_request), getattr(request, "cache_salt", None)
            )
            toks = list(request.prompt_token_ids)
            st = _ReqState(chain=identity.chain_hashes(root, toks, self.block_size), prompt_len=len(toks))
            self._reqs[request.request_id] = st
        return st

    def _unpin(self, st: _ReqState) -> None:
        if st.pinned:
            objs = [o for rank in st.pinned for o in rank]
            self.broker.release(st.incarnation, objs)
        st.pinned = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if st is None:
            return 0, False
        self._unpin(st)  # asked again (the request could not be scheduled last time)
        st.load = None
        st.local_tokens = num_computed_tokens
        st.hit_blocks = 0
        # vLLM computes at least the prompt's last token.
        loadable = (st.prompt_len - 1) // self.block_size
        c = self.broker.client()
        if c is None or not st.chain:
            st.next_save = max(st.next_save, num_computed_tokens // self.block_size)
            return 0, False
        self.stats.add("lookups")
        inc = self.broker.incarnation
        pinned: list[list[Any]] = []
        try:
            for rank in range(self.tp_size):
                keys = [identity.block_key(h, rank) for h in st.chain]
                got = c.lookup(keys, pin=True)
                pinned.append(got)
                self.broker.hold(inc, len(got))
                if not got:
                    break
        except BrokerError as e:
            self.stats.add("broker_errors")
            st.pinned, st.incarnation = pinned, inc
            self._unpin(st)
            self.broker.failed(c, e, "lookup")
            return 0, False
        st.pinned, st.incarnation = pinned, inc
        found = min(len(p) for p in pinned) if len(pinned) == self.tp_size else 0
        st.hit_blocks = found
        st.next_save = max(st.next_save, found)
        hit = min(found, loadable) * self.block_size
        ext = max(0, hit - num_computed_tokens)
        if ext == 0:
            self._unpin(st)
        return ext, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0:
            self._unpin(st)
            return
        start = st.local_tokens // self.block_size
        end = (st.local_tokens + num_external_tokens) // self.block_size
        st.load = (start, end)
        self._to_load.add(request.request_id)
        self.stats.add("hit_tokens", num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = BrokerKVMetadata()
        mgr = self._kv_cache_manager
        sched = scheduler_output.num_scheduled_tokens
        progress: list[tuple[str, int]] = []
        for r in scheduler_output.scheduled_new_reqs:
            progress.append((r.req_id, r.num_computed_tokens + sched.get(r.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            progress.append((req_id, cached.num_computed_tokens[i] + sched.get(req_id, 0)))
        for req_id, done_tokens in progress:
            st = self._reqs.get(req_id)
            if st is None or mgr is None:
                continue
            block_ids = None
            if req_id in self._to_load and st.load is not None:
                block_ids = mgr.get_block_ids(req_id)[0]
                start, end = st.load
                objs = []
                for b in range(start, end):
                    objs.append([(o.key, o.object_id, list(o.pages)) for o in (rank[b] for rank in st.pinned)])
                meta.loads.append(LoadRequest(req_id, [block_ids[b] for b in range(start, end)], objs, st.incarnation))
                st.load = None
                self._to_load.discard(req_id)
                self._loading[req_id] = st
            full = min(done_tokens, st.prompt_len) // self.block_size
            if full > st.next_save:
                if block_ids is None:
                    block_ids = mgr.get_block_ids(req_id)[0]
                rng = range(st.next_save, min(full, len(block_ids)))
                if rng:
                    meta.saves.append(SaveRequest(req_id, [block_ids[b] for b in rng], [st.chain[b] for b in rng]))
                st.next_save = full
        # Requests asked to load that were not scheduled after all.
        for req_id in list(self._to_load):
            st = self._reqs.get(req_id)
            if st is not None:
                self._unpin(st)
            self._to_load.discard(req_id)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput):
        wm = connector_output.kv_connector_worker_meta
        if not isinstance(wm, BrokerKVWorkerMetadata) or self.tp_size != 1:
            return  # with several ranks the pins go when the request finishes
        for req_id in wm.loaded:
            st = self._loading.pop(req_id, None)
            if st is not None:
                self._unpin(st)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._to_load.discard(request.request_id)
        if st is not None:
            self._unpin(st)
        return False, None

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        num_blocks = self._kv_cache_config.num_blocks
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

    def _block_view(self, name: str, t: torch.Tensor, block_id: int) -> torch.Tensor:
        return t.select(self._block_dims[name], block_id)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, BrokerKVMetadata) or not meta.loads or not self._enabled:
            if isinstance(meta, BrokerKVMetadata):
                for lr in meta.loads:  # connector off on this worker: vLLM recomputes
                    self._load_errors.update(lr.block_ids)
                    self.stats.add("load_failed_blocks", len(lr.block_ids))
            return
        for lr in meta.loads:
            # The scheduler's session when it lives in this process: the pinned pages are in
            # this mapping, and stay readable even if the broker went away since the lookup.
            c = self.broker.client_for(lr.incarnation)
            try:
                self._load_one(c, lr)
                self._loaded.add(lr.req_id)
            except (BrokerError, RuntimeError, ValueError, OSError) as e:
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

    def _load_one(self, c, lr: LoadRequest) -> None:
        rank = self.tp_rank
        wanted = [blk[rank] for blk in lr.objects]
        if c is not None:
            # The scheduler's own session and mapping: its pins hold the pages.
            if c.view.mapped_slabs * c.geometry.pages_per_slab <= max((max(p) for _, _, p in wanted), default=0):
                raise RuntimeError("pages beyond this process's mapping")
            self._copy_in(c, lr, [p for _, _, p in wanted])
            return
        # The scheduler runs in another process: pin the blocks in this process's session for
        # the copy, and check they are the very objects the scheduler pinned.
        c = self.broker.client()
        if c is None:
            raise RuntimeError("the broker is unavailable")
        got = c.lookup([k for k, _, _ in wanted], pin=True)
        try:
            if [(o.object_id, list(o.pages)) for o in got] != [(oid, pages) for _, oid, pages in wanted]:
                raise RuntimeError("the broker no longer holds the blocks the scheduler found")
            self._copy_in(c, lr, [list(o.pages) for o in got])
        finally:
            if got:
                try:
                    c.unpin(got)
                except BrokerError as e:
                    self.broker.failed(c, e, "unpin")

    def _copy_in(self, c, lr: LoadRequest, block_pages: list[list[int]]) -> None:
        ps = c.geometry.page_size
        phys = c.physical_view()
        for pages, bid in zip(block_pages, lr.block_ids):
            if len(pages) * ps < self._block_nbytes:
                raise ValueError(
                    f"an object of {len(pages)} pages is smaller than a block's {self._block_nbytes} bytes"
                )
            for name, li in self._layers.items():
                dst = self._block_view(name, self._kv[name], bid)
                if dst.is_contiguous():
                    store.read_bytes(phys, pages, ps, li * self._layer_nbytes, dst.view(-1).view(torch.uint8))
                else:
                    tmp = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
                    store.read_bytes(phys, pages, ps, li * self._layer_nbytes, tmp.view(-1).view(torch.uint8))
                    dst.copy_(tmp)
        self.stats.add("loaded_blocks", len(lr.block_ids))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copies every layer before the forward pass

    def _prepare_saves(self, meta: BrokerKVMetadata) -> None:
        """One prepare for the step's new blocks (a block two requests share, once)."""
        self._step_saves = []
        seen: set[bytes] = set()
        for sr in meta.saves:
            for bid, h in zip(sr.block_ids, sr.chain_hashes):
                key = identity.block_key(h, self.tp_rank)
                if key not in seen:
                    seen.add(key)
                    self._step_saves.append((bid, key))
        if not self._step_saves:
            return
        c = self.broker.client()
        if c is None:
            self.stats.add("store_skipped_blocks", len(self._step_saves))
            self._step_saves = []
            return
        try:
            specs = store.kv_specs([k for _, k in self._step_saves], self._block_nbytes, c.geometry.page_size)
            self._txn = c.prepare(specs)
            self._txn_client = c
        except BrokerError as e:
            self.stats.add("store_skipped_blocks", len(self._step_saves))
            self.stats.add("broker_errors")
            self.broker.failed(c, e, "prepare")
            self._step_saves = []
            self._txn = None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if not self._enabled or layer_name not in self._layers:
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, BrokerKVMetadata) or not meta.saves:
            return
        if self._step_saves is None:
            self._prepare_saves(meta)
        if self._txn is None:
            return
        c = self._txn_client
        ps = c.geometry.page_size
        li = self._layers[layer_name]
        try:
            phys = c.physical_view()
            for (bid, _), obj in zip(self._step_saves, self._txn.objects):
                src = self._block_view(layer_name, self._kv[layer_name], bid)
                src = src.contiguous().view(-1).view(torch.uint8)
                store.write_bytes(phys, obj.pages, ps, li * self._layer_nbytes, src)
        except (RuntimeError, ValueError, OSError) as e:
            log.warning(
                "MemoryBrokerConnector: writing layer %s failed (%s); this step's blocks are not stored", layer_name, e
            )
            self._abort_saves()

    def _abort_saves(self) -> None:
        if self._txn is not None:
            self.stats.add("store_skipped_blocks", len(self._step_saves or ()))
            try:
                self._txn.abort()
            except BrokerError as e:
                self.broker.failed(self._txn_client, e, "abort")
        self._txn = None

    def wait_for_save(self):
        txn, self._txn = self._txn, None
        saves, self._step_saves = self._step_saves, None
        if txn is None:
            return
        try:
            committed = txn.commit()
        except BrokerError as e:
            self.stats.add("store_skipped_blocks", len(saves or ()))
            self.stats.add("broker_errors")
            self.broker.failed(self._txn_client, e, "commit")
            return
        dedup = sum(1 for o in committed if o.deduplicated)
        self.stats.add("stored_blocks", len(committed) - dedup)
        self.stats.add("deduplicated_blocks", dedup)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._loaded:
            return None
        out = BrokerKVWorkerMetadata(loaded=self._loaded)
        self._loaded = set()
        return out

    # ================================================================ both

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, BrokerKVStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return BrokerKVStats(data=dict(data or {}))

    def shutdown(self):
        if self.role == KVConnectorRole.SCHEDULER:
            for st in list(self._reqs.values()):
                self._unpin(st)
            self._reqs.clear()
        elif self._txn is not None:
            self._abort_saves()
