"""vLLM's own KV cache on broker pages (docs/engine-pool.md), entered through the KV connector.

Two halves, in vLLM's two roles, which may be two processes (vLLM's default multiprocess engine
core runs the worker apart from the scheduler). The worker's half (``WorkerRange``) answers vLLM's
one ``torch.zeros`` for the KV cache (``allocate_kv_cache``, inside the connector's
``get_mem_pool_context()``) with a view over a range it reserves once (``clients/kv_arena.py``),
and maps and unmaps groups of broker pages in it as the scheduler says. The scheduler's half
(``EngineOnPool``), handed the block pool by ``bind_kv_cache_manager``, is the engine at the
broker: it keeps the blocks of unmapped groups out of vLLM's free queue and appends them when
their pages come (asked for ahead of need by a background thread; at once when an allocation
would otherwise fail); it takes whole free groups back out, beyond a reserve, or when the broker
asks, and gives them back two steps later. What to map and unmap travels in the connector's
metadata of the next step (``BrokerKVMetadata.pool_ops``), carried out by the worker in
``handle_preemptions``, before the step zeroes or touches a block.

The range is the arena's: host memory on a host arena (a CPU engine), device address space on a
cuda arena (a CUDA engine; never run on a GPU). Every vLLM internal used here is checked per
release (``compat.engine_pool_problems``); a failed check, another layout, TP > 1 or an arena
that is not the engine's device's leaves vLLM's own KV cache in place, said in one log line.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any

from memory_broker.proto.wire.errors import BrokerError, Code

log = logging.getLogger("vllm.memory_broker.engine_pool")

# kv_connector_extra_config["engine_pool"]: these keys (all optional).
KEYS = ("name", "floor_mb", "ceiling_mb", "weight", "reserve_groups", "start_groups", "batch_groups")

# How long a grow made on the step (an allocation that would fail) waits for give-backs.
SYNC_WAIT_MS = 20
# How long the first grow (at the engine's start) waits for them.
START_WAIT_MS = 1000


# The arena the engine pool needs per engine device type (vLLM's ``device_config.device_type``).
ARENAS = {"cpu": "host", "cuda": "cuda"}


def _device_type(vllm_config: Any) -> str:
    """The engine's device type ("cpu", "cuda", ...), as vLLM's device config says."""
    return str(getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu")


def _connect(socket: str, role: str, name: str, tensor: Any, on_event=None, device_type: str = "cpu"):
    """A client of the broker for one half, refused (ValueError) unless its arena is the one for
    the engine's device (a CPU engine's KV cache on a host arena, a CUDA engine's on a cuda
    arena) and a page is whole KV blocks."""
    from memory_broker.clients import BrokerClient

    try:
        client = BrokerClient.connect(
            socket, client_name=f"vllm-engine-kv-{role}:{name}:{os.getpid()}", on_event=on_event
        )
    except BrokerError as e:
        if e.code != Code.FAILED_PRECONDITION:  # UNAVAILABLE and the rest: as they are
            raise
        # This process cannot map the broker's arena (or speak its protocol): both halves
        # meet the same and stay off.
        raise ValueError(f"the engine on {device_type!r} cannot use the broker's arena: {e.message}") from None
    ps = client.arena.page_size
    why = None
    if client.arena.backend != ARENAS.get(device_type):
        why = (
            f"the broker's arena is {client.arena.backend!r} and the engine runs on {device_type!r}: the engine "
            "pool puts a CPU engine's KV cache on a host arena and a CUDA engine's on a cuda arena"
        )
    elif ps % tensor.block_stride:
        why = f"a broker page ({ps} bytes) is not whole KV blocks of {tensor.block_stride} bytes"
    if why:
        client.close()
        raise ValueError(why)
    return client


def _name(conf: dict, model: str) -> str:
    unknown = set(conf) - set(KEYS)
    if unknown:
        raise ValueError(f"engine_pool: unknown keys {sorted(unknown)}; it takes {', '.join(KEYS)}")
    return str(conf.get("name") or os.path.basename(str(model).rstrip("/")) or "engine")


class EngineOnPool:
    """The scheduler's half: the engine's registration at the broker, its groups, and the
    block pool's view of them.

    Args:
        socket: the broker's socket.
        conf: ``kv_connector_extra_config["engine_pool"]``.
        tensor: vLLM's one ``KVCacheTensor`` (size, layer_stride, block_stride, offset).
        model: a name for the engine when ``conf`` gives none.
        device_type: the engine's device type ("cpu" or "cuda"): the arena it needs.
    """

    def __init__(self, socket: str, conf: dict, tensor: Any, model: str, device_type: str = "cpu"):
        self.name = _name(conf, model)
        self.reserve = int(conf.get("reserve_groups", 2))
        start = max(1, int(conf.get("start_groups", 1)))
        self.kv = None
        self.client = _connect(socket, "scheduler", self.name, tensor, self._event, device_type)
        try:
            self._register(conf, tensor, start)
        except BaseException:  # a refused registration or grow: the session (and its pages) go
            self.client.close()
            raise
        self.pool = None  # vLLM's BlockPool, once bound
        # Slots whose blocks are in vLLM's free queue or held by requests.
        self.live: set[int] = set()
        # Grows refused (vLLM preempted) and grows made on the step.
        self.preemptions = self.sync_grows = 0

    def _register(self, conf: dict, tensor: Any, start: int) -> None:
        from memory_broker.clients.engine_kv import EngineKvSession
        from memory_broker.clients.kv_arena import KvGroups, kv_geometry

        ps = self.client.arena.page_size
        layers, self.num_groups = kv_geometry(tensor.size, tensor.layer_stride, ps)
        self.blocks_per_group = ps // tensor.block_stride
        mb = 1 << 20
        self.kv = EngineKvSession(
            self.client,
            self.name,
            layers,
            # At least group 0, which holds vLLM's null block and is never given back.
            floor_pages=max(layers, -(-int(float(conf.get("floor_mb", 0)) * mb) // ps)),
            ceiling_pages=int(float(conf.get("ceiling_mb", 0)) * mb) // ps,
            weight=float(conf.get("weight", 0.0)),
        )
        self.groups = KvGroups(self.kv, self.num_groups, max(1, int(conf.get("batch_groups", 4))))
        # Group 0 holds vLLM's null block; other engines above their floors may give pages back.
        self.groups.grow_now(min(start, self.num_groups), START_WAIT_MS)

    def _event(self, ev) -> None:
        if self.kv is not None:
            self.kv.on_event(ev)

    def group_blocks(self, slot: int) -> list:
        bpg = self.blocks_per_group
        return self.pool.blocks[slot * bpg : (slot + 1) * bpg]

    def bind(self, pool) -> None:
        """Hold the blocks of unmapped groups out of vLLM's free queue."""
        self.pool = pool
        bpg = self.blocks_per_group
        if pool.num_gpu_blocks != self.num_groups * bpg:
            raise ValueError(f"vLLM has {pool.num_gpu_blocks} blocks; the range holds {self.num_groups * bpg}")
        backed = set(self.groups.backed)
        for b in pool.blocks:
            if b.block_id // bpg not in backed and not b.is_null:
                pool.free_block_queue.remove(b)
        self.live = backed

    def add(self, slots) -> None:
        """Mapped groups: their blocks join vLLM's free queue."""
        for slot in slots:
            if slot not in self.live:
                self.live.add(slot)
                self.pool.free_block_queue.append_n([b for b in self.group_blocks(slot) if not b.is_null])

    def grow_for(self, need_blocks: int) -> bool:
        """Map groups now (on the step: nothing spare was left); True if any came."""
        groups = min(max(1, -(-need_blocks // self.blocks_per_group)), self.groups.batch)
        try:
            # On the step, one call: as many of the batch as the broker has, else one group
            # after a brief wait for other engines' give-backs (an idle one answers at its
            # next step), else vLLM preempts; the background grower waits longer.
            slots = self.groups.grow_now(groups, SYNC_WAIT_MS, least=1)
        except BrokerError as e:
            slots = []
            why = e.message
        else:
            why = "the range is full"
        if not slots:
            log.debug("engine pool: grow refused (%s); vLLM preempts", why)
            self.preemptions += 1
            return False
        self.sync_grows += 1
        self.add(slots)
        return bool(slots)

    def _free_groups(self) -> list[int]:
        """Slots whose every block is free (not the null block's), fullest-numbered last."""
        out = []
        for slot in sorted(self.live):
            blocks = self.group_blocks(slot)
            if all(b.ref_cnt == 0 and not b.is_null for b in blocks):
                out.append(slot)
        return out

    def take_back(self, slots) -> None:
        """Take whole free groups out of vLLM's free queue (evicting their cached prefixes)."""
        pool = self.pool
        for slot in slots:
            for b in self.group_blocks(slot):
                pool._maybe_evict_cached_block(b)
                pool.free_block_queue.remove(b)
            self.live.discard(slot)
        self.groups.retire(slots)

    def after_schedule(self) -> tuple[list[tuple], int]:
        """Once per step, after scheduling: new groups in; more asked for when spare is low.
        Returns what the worker maps and unmaps before this step runs, and the arena slabs
        those pages need."""
        self.add(self.groups.take_ready())
        spare = self.pool.get_num_free_blocks()
        if spare < self.reserve * self.blocks_per_group and len(self.live) < self.num_groups:
            self.groups.want(self.groups.batch)
        return self.groups.take_ops()

    def after_step(self) -> None:
        """Once per step, after its output: retire free groups beyond the reserve (all the
        broker asks for, floor kept), and give back what no step can read any more."""
        free = self._free_groups()
        r = self.kv.take_reclaim()
        keep = self.reserve
        if r is not None:
            keep = 0
            log.debug("engine pool: asked for %d pages back", r.pages)
        floor_groups = -(-self.kv.registered.floor_pages // max(1, self.kv.group_pages))
        most = max(0, len(self.live) - floor_groups)
        give = free[keep:] if r is None else free[: -(-r.pages // self.kv.group_pages)]
        give = [s for s in give if s != 0][:most]
        if give:
            self.take_back(give)
        # No request holds a block (and the CPU schedules synchronously): nothing in flight can
        # read a retired group, so it goes now rather than after steps an idle engine never
        # takes; the worker unmaps it at the next step (``has_pending_push_work`` asks for one).
        idle = not any(b.ref_cnt for b in self.pool.blocks if not b.is_null)
        self.groups.step_done(idle)

    def close(self) -> None:
        self.groups.close()
        self.client.close()


def prefer_fullest(queue, blocks_per_group: int) -> None:
    """Make ``queue`` (vLLM's ``FreeKVCacheBlockQueue``) hand out blocks from the fullest groups
    first (fewest free blocks; vLLM's order among a group's), so that whole groups fall free to
    be given back; vLLM's order takes the oldest free blocks, wherever they lie."""
    popleft_n = queue.popleft_n

    def fullest_first(n: int) -> list:
        free = queue.get_all_free_blocks()
        if n >= len(free):
            return popleft_n(n)
        count: dict[int, int] = {}
        for b in free:
            g = b.block_id // blocks_per_group
            count[g] = count.get(g, 0) + 1
        rank = {g: i for i, g in enumerate(sorted(count, key=count.__getitem__))}
        out = sorted(free, key=lambda b: rank[b.block_id // blocks_per_group])[:n]
        for b in out:
            queue.remove(b)
        return out

    queue.popleft_n = fullest_first


class WorkerRange:
    """The worker's half: the KV cache's range, and the groups the scheduler says to map.

    On a CPU engine the range is a ``HostKvRange`` over a host arena; on a CUDA engine a
    ``CudaKvRange`` over a cuda arena (device address space on the broker's GPU, which must be
    the engine's), its pages imported into this process's view of the arena as the scheduler
    hands them out. Group 0 starts on private memory (vLLM's warm-up may write its null block,
    and on a GPU capture graphs over the range, before the scheduler exists; the CUDA range's
    tensor also needs its base address mapped); the scheduler's first grow always takes group 0
    (its null block is never given back), and the broker's pages replace the private memory
    with the first step (on CUDA after the context's work is done: ``CudaKvRange.map_group``).
    On CUDA that private group is device memory outside the broker's budget (one page per
    layer) until then.

    Args:
        device: the engine's device ("cpu", "cuda:N"; "cuda" is this process's current one).

    Raises:
        ValueError: the broker's arena is not the device's, its GPU is not the engine's, or the
            KV cache does not fit its pages.
        BrokerError: the broker is unavailable.
        CudaError: a driver call failed.
    """

    def __init__(self, socket: str, conf: dict, tensor: Any, model: str, device: Any = "cpu"):
        import torch

        from memory_broker.clients.kv_arena import CudaKvRange, HostKvRange, KvMapper

        self.name = _name(conf, model)
        dev = torch.device(device)
        client = _connect(socket, "worker", self.name, tensor, device_type=dev.type)
        ps = client.arena.page_size
        try:
            if dev.type == "cuda":
                at = client.view.device
                if dev.index is not None and dev.index != at.ordinal:
                    raise ValueError(f"the broker's GPU is {at.describe()} here; the engine runs on {dev}")
                rng = CudaKvRange(client.view, tensor.size, tensor.layer_stride, ps)
                self.device = torch.device("cuda", at.ordinal)
            else:
                rng = HostKvRange(tensor.size, tensor.layer_stride, ps)
                self.device = torch.device("cpu")
            try:
                rng.map_private(0)
            except BaseException:
                rng.close()
                raise
        except BaseException:
            client.close()
            raise
        self.mapper = KvMapper(rng, client)
        self.blocks_per_group = ps // tensor.block_stride

    @contextmanager
    def allocation_context(self, size: int):
        """Answer ``torch.zeros(size, dtype=torch.int8)`` on the range's device (on CUDA
        ``device="cuda"`` or the range's ``cuda:N``) with the range's tensor."""
        import torch
        from torch.overrides import TorchFunctionMode

        rng, mine = self.mapper.rng, self.device

        def ours(dev) -> bool:
            d = torch.device("cpu") if dev is None else torch.device(dev)
            return d.type == mine.type and d.index in (None, mine.index)

        class Answer(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is torch.zeros and kwargs.get("dtype") is torch.int8 and tuple(args) in ((size,), ((size,),)):
                    if ours(kwargs.get("device")):
                        return rng.tensor()
                return func(*args, **kwargs)

        with Answer():
            yield

    def apply(self, ops: list[tuple], slabs: int) -> None:
        self.mapper.apply(ops, slabs)

    def close(self) -> None:
        self.mapper.close()


def _why_not(kv_cache_config: Any, vllm_config: Any) -> tuple[str, ...]:
    """Why the engine pool cannot run here (the same answer in both halves), or ()."""
    from memory_broker.clients.vllm import compat

    why = compat.engine_pool_problems_installed()
    tensors = list(getattr(kv_cache_config, "kv_cache_tensors", []) or [])
    if not why and vllm_config.parallel_config.tensor_parallel_size != 1:
        why = ("tensor parallelism > 1",)
    if not why and len(tensors) != 1:
        why = (f"{len(tensors)} KV cache tensors (the pool maps one)",)
    return why


def _worker_device(vllm_config: Any) -> str:
    """The worker's device: "cuda:N" (torch's current device: vLLM's worker set it) or the type."""
    kind = _device_type(vllm_config)
    if kind == "cuda":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return kind


def start(socket: str, conf: dict, kv_cache_config: Any, vllm_config: Any) -> WorkerRange | None:
    """The worker's half (it decides first: the worker allocates the KV cache before vLLM
    creates the scheduler), or None: one log line says why vLLM keeps its own KV cache."""
    why = _why_not(kv_cache_config, vllm_config)
    if why:
        log.warning("engine pool off, vLLM keeps its own KV cache: %s", "; ".join(why))
        return None
    tensor = kv_cache_config.kv_cache_tensors[0]
    if tensor.offset:
        log.warning("engine pool off: the KV cache starts at offset %d of its allocation", tensor.offset)
        return None
    from memory_broker.proto.wire.mapping.cuda_driver import CudaError

    try:
        w = WorkerRange(socket, conf, tensor, vllm_config.model_config.model, _worker_device(vllm_config))
    except (ValueError, BrokerError, OSError, CudaError) as e:
        log.warning("engine pool off, vLLM keeps its own KV cache: %s", e)
        return None
    rng = w.mapper.rng
    log.info(
        "engine pool: KV cache of %d groups x %d blocks on broker %s as %r (range at %#x, %d layers of %d bytes)",
        rng.num_groups,
        w.blocks_per_group,
        socket,
        w.name,
        rng.base,
        rng.num_layers,
        rng.layer_stride,
    )
    return w


def attach(kv_cache_manager, socket: str, conf: dict, kv_cache_config: Any, vllm_config: Any) -> EngineOnPool | None:
    """The scheduler's half: the engine at the broker, the block pool bound, and allocations
    that grow the pool before they fail; None where the worker's half made the same checks and
    kept vLLM's own KV cache.

    Raises:
        RuntimeError: the broker answered but refused the engine: the worker's half, which
            reached it first, put the KV cache on the range, and it cannot run with blocks
            nobody maps.
    """
    if _why_not(kv_cache_config, vllm_config) or kv_cache_config.kv_cache_tensors[0].offset:
        return None
    tensor = kv_cache_config.kv_cache_tensors[0]
    try:
        eng = EngineOnPool(socket, conf, tensor, vllm_config.model_config.model, _device_type(vllm_config))
    except (ValueError, OSError) as e:  # the worker's half met the same and stayed off
        log.warning("engine pool off, vLLM keeps its own KV cache: %s", e)
        return None
    except BrokerError as e:
        if e.code == Code.UNAVAILABLE:  # as the worker's half found it: it stayed off
            log.warning("engine pool off, vLLM keeps its own KV cache: %s", e)
            return None
        raise RuntimeError(f"engine pool: the broker at {socket} refused the engine {conf.get('name')!r}: {e}") from e
    eng.bind(kv_cache_manager.block_pool)
    from memory_broker.clients.vllm import compat

    why = compat.fullest_group_problems_installed()
    if why:
        log.warning(
            "engine pool: blocks are handed out in vLLM's own order, not fullest group first: %s", "; ".join(why)
        )
    else:
        prefer_fullest(kv_cache_manager.block_pool.free_block_queue, eng.blocks_per_group)
    allocate = kv_cache_manager.allocate_slots

    def allocate_slots(*args, **kwargs):
        out = allocate(*args, **kwargs)
        if out is None and len(eng.live) < eng.num_groups and eng.grow_for(eng.groups.batch * eng.blocks_per_group):
            out = allocate(*args, **kwargs)
        return out

    kv_cache_manager.allocate_slots = allocate_slots
    log.info("engine pool: %r at the broker, %d groups mapped", eng.name, len(eng.groups.backed))
    return eng
