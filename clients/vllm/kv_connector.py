"""``MemoryBrokerConnector``, vLLM's KV connector (``KVConnectorBase_V1``) over the broker.

The class vLLM instantiates is a facade over two halves, as vLLM's larger connectors are: in
the scheduler, ``BrokerKVScheduler`` (``kv_scheduler.py``) keys each request's full prompt
blocks, pins the longest stored prefix and plans per step which blocks the worker loads and
which it stores; in each worker, ``BrokerKVWorker`` (``kv_worker.py``) copies loaded blocks
from the broker's pages into vLLM's KV cache before the forward pass and stores new ones in
one prepare per step, layer by layer, committed when the step's saves are done. A broker that
is away, restarting or full never fails a request: vLLM recomputes.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from memory_broker.clients.vllm import check_vllm_version

VLLM_VERSION = check_vllm_version()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats  # noqa: E402

from memory_broker.clients.vllm import engine_pool, identity, store  # noqa: E402
from memory_broker.clients.vllm.kv_records import (  # noqa: E402,F401  (STAT_NAMES, the records: imported from here too)
    STAT_NAMES,
    BrokerKVMetadata,
    BrokerKVStats,
    BrokerKVWorkerMetadata,
    LoadRequest,
    SaveRequest,
    _ReqState,
)
from memory_broker.clients.vllm.kv_scheduler import BrokerKVScheduler  # noqa: E402
from memory_broker.clients.vllm.kv_worker import DEFAULT_STORE_BUFFER, BrokerKVWorker  # noqa: E402

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A child of vLLM's logger, so these lines show among vLLM's own.
log = logging.getLogger("vllm.memory_broker." + __name__.rsplit(".", 1)[-1])

EXTRA_KEYS = (
    "socket",
    "timeout_s",
    "retry_s",
    "store_buffer_mb",
    "store_in_step",
    "engine_pool",
    "share_prefixes",
)


def _flag(v: object) -> bool:
    """A boolean setting given as JSON (true) or as text ("true", "1")."""
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


class MemoryBrokerConnector(KVConnectorBase_V1):
    """KV connector storing prefix KV in the memory broker (see the module docstring).

    ``kv_connector_extra_config``: ``socket``, one broker's socket for every rank, or a directory
    of per-GPU brokers (``<gpu-uuid>/broker.sock``) where each tensor-parallel rank uses its own
    GPU's broker (default ``$MEMORY_BROKER_SOCKET``, else ``/run/memory-broker`` where it holds
    per-GPU brokers, else ``/tmp/memory-broker.sock``); optional ``timeout_s`` (per broker call,
    default 5), ``retry_s`` (between reconnect attempts, default 2), ``store_buffer_mb`` (new
    blocks staged and not yet committed, at most; default 256; a step past it is not stored) and
    ``store_in_step`` (default false: each step waits until its blocks are committed, as before
    the stores moved off the request's path; for comparison).

    With per-GPU brokers, a worker uses the broker of its device (torch's current device, else
    its local rank's visible device) and the scheduler, which may see no GPU, looks rank r up in
    the broker of the r-th visible device (``CUDA_VISIBLE_DEVICES`` applied to the host's
    table): vLLM's rank r uses local device r.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        unknown = set(extra) - set(EXTRA_KEYS)
        if unknown:
            raise ValueError(
                f"MemoryBrokerConnector: unknown kv_connector_extra_config keys {sorted(unknown)}; "
                f"it takes {', '.join(EXTRA_KEYS)}"
            )
        given = str(extra["socket"]) if extra.get("socket") else None
        from vllm.platforms import current_platform

        ident = identity.engine_identity(vllm_config, kv_cache_config, VLLM_VERSION, current_platform.device_type)
        self.block_size = ident["block_size"]
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = 0
        kw = {
            "client_name": f"vllm-kv:{vllm_config.model_config.model}:{os.getpid()}",
            "timeout_s": float(extra.get("timeout_s", 5.0)),
            "retry_s": float(extra.get("retry_s", 2.0)),
        }
        self.stats = BrokerKVStats()
        self.connector_scheduler: BrokerKVScheduler | None = None
        self.connector_worker: BrokerKVWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if cfg.kv_load_failure_policy != "recompute":
                # A broker that goes away between lookup and load must cost a recompute,
                # never a failed request.
                log.warning(
                    "MemoryBrokerConnector sets kv_load_failure_policy to 'recompute' (was %r)",
                    cfg.kv_load_failure_policy,
                )
                cfg.kv_load_failure_policy = "recompute"
            fp = identity.engine_fingerprint(ident)
            brokers = store.rank_brokers(given, self.tp_size, **kw)
            self.broker = brokers[0]
            self.connector_scheduler = BrokerKVScheduler(brokers, fp, self.block_size, self.tp_size, self.stats)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            try:
                self.tp_rank = get_tensor_model_parallel_rank()
            except (AssertionError, RuntimeError):
                self.tp_rank = 0
            self.broker = store.worker_broker(given, self.tp_rank, **kw)
            self.connector_worker = BrokerKVWorker(
                self.broker,
                self.tp_rank,
                kv_cache_config.num_blocks,
                self.stats,
                store_buffer_bytes=int(float(extra.get("store_buffer_mb", DEFAULT_STORE_BUFFER >> 20)) * (1 << 20)),
                store_in_step=_flag(extra.get("store_in_step", False)),
            )
        self.socket = self.broker.socket
        # The engine's own KV cache on the broker's pages (engine_pool.py), when asked for: the
        # scheduler's half (bound with the KV cache manager) and the worker's (with the KV cache).
        self._engine_pool_conf = extra.get("engine_pool")
        self._pool_sched: engine_pool.EngineOnPool | None = None
        self._pool_worker: engine_pool.WorkerRange | None = None
        # False: only the engine pool; no prefix KV is looked up, loaded or stored.
        self._share = _flag(extra.get("share_prefixes", True))
        log.info(
            "MemoryBrokerConnector (%s, tp rank %d) on broker %s, block %d tokens",
            "scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
            self.tp_rank,
            self.socket,
            self.block_size,
        )

    def _sched(self) -> BrokerKVScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side call on a worker's connector"
        return self.connector_scheduler

    def _worker(self) -> BrokerKVWorker:
        assert self.connector_worker is not None, "a worker-side call on the scheduler's connector"
        return self.connector_worker

    # ================================================================ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._share:
            return 0, False
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        if self._share:
            self._sched().on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if self._share:
            self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._share:
            meta = self._sched().build_connector_meta(scheduler_output, self._kv_cache_manager)
        else:
            meta = BrokerKVMetadata()
        if self._pool_sched is not None:
            meta.pool_ops, meta.pool_slabs = self._pool_sched.after_schedule()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput):
        if self._share:
            self._sched().update_connector_output(connector_output)
        if self._pool_sched is not None:
            self._pool_sched.after_step()

    def has_pending_push_work(self) -> bool:
        # The engine pool: a step (empty, when idle) carries the unmaps to the worker.
        return self._pool_sched is not None and self._pool_sched.groups.pending()

    def bind_kv_cache_manager(self, kv_cache_manager):
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._engine_pool_conf is not None:
            conf = self._engine_pool_conf if isinstance(self._engine_pool_conf, dict) else {}
            self._pool_sched = engine_pool.attach(
                kv_cache_manager, self.socket, conf, self._kv_cache_config, self._vllm_config
            )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if not self._share:
            return False, None
        return self._sched().request_finished(request, block_ids)

    # ================================================================ worker side

    def get_mem_pool_context(self):
        if self._engine_pool_conf is None:
            return None
        conf = self._engine_pool_conf if isinstance(self._engine_pool_conf, dict) else {}
        w = engine_pool.start(self.socket, conf, self._kv_cache_config, self._vllm_config)
        self._pool_worker = w
        return None if w is None else w.allocation_context(self._kv_cache_config.kv_cache_tensors[0].size)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        # Called first in every step, before vLLM zeroes new blocks or runs: the engine pool's
        # groups are mapped and unmapped here.
        if self._pool_worker is not None and isinstance(kv_connector_metadata, BrokerKVMetadata):
            self._pool_worker.apply(kv_connector_metadata.pool_ops, kv_connector_metadata.pool_slabs)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copies every layer before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker().save_kv_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self):
        self._worker().wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Nothing is sent asynchronously; loads from the broker's tier are received so.
        return None, self._worker().get_finished()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.connector_worker is None:
            return None
        return self.connector_worker.build_connector_worker_meta()

    # ================================================================ both

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # The halves hold this very object: hand out a copy and zero it.
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return BrokerKVStats(data=dict(data or {}))

    def shutdown(self):
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self._pool_sched is not None:  # its session's pages go back to the broker now
            self._pool_sched.close()
