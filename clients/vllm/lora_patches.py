"""Every place where memory-broker adapters replace vLLM internals, in one module: worker-side
adapter loading (``broker://<adapter_id>`` LoRA paths), lease release when vLLM evicts or
removes an adapter, and the zero-copy path (vLLM's LoRA linear layers compute from the broker's
pages instead of per-process slot buffers).

The patches are written against vLLM ``lora_patches.WRITTEN_FOR`` (0.32 and 0.33); ``install``
checks that the installed vLLM's sources have every patch point (``compat.LORA_PATCH_POINTS``)
and, where one moved, patches nothing and logs a warning naming it (vLLM then loads adapters
its own way and ``broker://`` paths fail to load). Adapters are acquired in the engine's LoRA
dtype: the broker's copy in it, cast from the files as vLLM casts them. This module owns the patches and
their on/off state; the lease bookkeeping is ``lora_source``'s and the arithmetic
``lora_zero_copy``'s. It must not change vLLM's behaviour for adapters that are not from the
broker, except that a zero-copy engine has the broker register their directories and serves
them from its pages too (it has no slot buffers to copy them into).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import types
from dataclasses import dataclass

import torch

from memory_broker.clients.vllm import SUPPORTED, check_vllm_version
from memory_broker.clients.vllm.identity import broker_adapter_id
from memory_broker.clients.vllm.lora_source import TORCH_DTYPES, BrokerAdapters
from memory_broker.clients.vllm.lora_zero_copy import (
    ROUNDINGS,
    LayerAddress,
    StaticStepBuffers,
    StepHolder,
    ZeroCopyStep,
    check_backend,
)
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.layout import DEFAULT_ROW_ALIGN, ModuleShard, elem_size, shards_text

log = logging.getLogger("vllm.memory_broker.lora")

# The vLLM releases whose internals these patches replace (their sources are checked at install).
WRITTEN_FOR = SUPPORTED
MODES = ("zero-copy", "copy")


@dataclass(slots=True)
class State:
    """What ``install`` did in this process."""

    # "zero-copy" or "copy" (vLLM's slot buffers filled with copies from the pages).
    mode: str
    source: BrokerAdapters
    # Where zero-copy layers round half-precision outputs (lora_zero_copy.ROUNDINGS).
    rounding: str = "vllm"


_state: State | None = None


def state() -> State | None:
    return _state


def install(socket: str, mode: str = "zero-copy", rounding: str = "vllm") -> bool:
    """Patch vLLM in this process to load ``broker://`` adapters from the broker on ``socket``.

    Idempotent. Returns False (and patches nothing) on a vLLM release whose patch points or
    connector methods moved (``compat``).

    Raises:
        ValueError: an unknown mode.
    """
    global _state
    if mode not in MODES:
        raise ValueError(f"memory-broker LoRA mode must be one of {MODES}, got {mode!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"memory-broker LoRA rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if _state is not None:
        return True
    try:
        check_vllm_version()
    except ImportError as e:
        log.warning("memory-broker: LoRA patches not installed, vLLM loads adapters its own way: %s", e)
        return False
    _state = State(mode, BrokerAdapters(socket), rounding)
    _patch()
    log.info("memory-broker: LoRA adapters from the broker at %s (%s)", socket, mode)
    return True


def _wrap(cls, name: str, make):
    """Replace ``cls.name`` by ``make(original)`` once (marking it, so a second install is a no-op)."""
    orig = cls.__dict__[name]
    if getattr(orig, "_memory_broker", False):
        return
    new = make(orig)
    functools.update_wrapper(new, orig)
    new._memory_broker = True
    setattr(cls, name, new)


def _patch() -> None:
    from vllm.lora import model_manager as mm
    from vllm.lora import worker_manager as wm

    _wrap(wm.WorkerLoRAManager, "_load_adapter", _load_adapter)
    for cls in (mm.LoRAModelManager, mm.LRUCacheLoRAModelManager):
        for name in ("add_adapter", "remove_adapter", "remove_oldest_adapter", "remove_all_adapters"):
            if name in cls.__dict__:
                _wrap(cls, name, _reconciling)
    _wrap(mm.LoRAModelManager, "_create_lora_modules", _create_lora_modules)
    _wrap(mm.LoRAModelManager, "_create_merged_loras_inplace", _create_merged_loras_inplace)
    _wrap(mm.LoRAModelManager, "create_dummy_lora", _create_dummy_lora)
    _wrap(mm.LoRAModelManager, "_set_adapter_mapping", _set_adapter_mapping)
    _wrap(mm.LoRAModelManager, "set_adapter_mapping", _set_adapter_mapping_public)


# ----------------------------------------------------------------- loading and leases


def _leaf_names(manager) -> dict[tuple[int, str], str]:
    """(layer, module short name) -> vLLM's full module name, for every LoRA linear leaf."""
    from memory_broker.clients.lora import layer_index

    out: dict[tuple[int, str], str] = {}
    for name in manager.modules:
        for leaf in manager.packed_modules.get(name, [name]):
            layer = layer_index(leaf)
            if layer is not None:
                out[(layer, leaf.rsplit(".", 1)[-1])] = leaf
    return out


def _broker_model_cls():
    from vllm.lora.lora_model import LoRAModel

    cls = globals().get("_BrokerLoRAModel")
    if cls is None:

        class _BrokerLoRAModel(LoRAModel):
            """A LoRAModel whose weights stay in the broker's pages (zero-copy: ``loras`` is empty)."""

            zero_copy = True

        cls = globals()["_BrokerLoRAModel"] = _BrokerLoRAModel
    return cls


def _load_adapter(orig):
    def load(self, lora_request):
        aid = broker_adapter_id(lora_request.lora_path)
        st = _state
        zero_copy = getattr(self._adapter_manager, "_mb_holder", None) is not None
        if aid is None:
            if not zero_copy:
                return orig(self, lora_request)
            # A zero-copy engine has no slot buffers to copy a file adapter into: the broker
            # registers the directory (vLLM's resolution of the path: local, or downloaded)
            # and the engine computes from its pages like any other.
            from vllm.lora.utils import get_adapter_absolute_path

            try:
                aid = st.source.register_directory(get_adapter_absolute_path(lora_request.lora_path))
            except Exception as e:
                raise ValueError(
                    f"LoRA {lora_request.lora_name!r} ({lora_request.lora_path}): this engine serves adapters "
                    f"zero-copy from the broker's pages, and the broker could not register the directory: {e}. "
                    "Register it in the broker yourself and request broker://<adapter_id>, or run the engine "
                    "with MEMORY_BROKER_VLLM_LORA=copy"
                ) from e
        return _load_from_broker(self, st, aid, lora_request, zero_copy)

    return load


def _load_from_broker(worker_manager, st: State, aid: str, lora_request, zero_copy: bool):
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights

    manager = worker_manager._adapter_manager
    cfg = worker_manager.lora_config
    # The copy in the engine's LoRA dtype: vLLM casts a file's weights to it once at load, and
    # so does the broker for this copy (a rounding of the broker's own bfloat16 copy would
    # give other tokens in a float32 engine).
    try:
        leased = st.source.acquire(aid, lora_request.lora_int_id, dtype_name(cfg.lora_dtype))
    except BrokerError as e:
        if e.code != Code.NOT_FOUND or st.source.gpu_uuid is None:
            raise
        raise ValueError(
            f"{e.message} on the broker of GPU {st.source.gpu_uuid} ({st.source.socket}), this tensor-parallel "
            "rank's: register it on every GPU's broker (memory-broker adapters register --all)"
        ) from e
    try:
        names = _leaf_names(manager)
        layout = leased.layout
        missing = [
            f"{layer}.{mod}"
            for layer in layout.layers
            for mod in layout.module_names
            if layout.get(layer, mod) is not None and (layer, mod) not in names
        ]
        if missing:
            raise ValueError(
                f"adapter {aid!r} adapts modules this engine has no LoRA layer for: {missing[:8]}; "
                f"its LoRA layers are {sorted(set(m for _, m in names))} (check --lora-target-modules)"
            )
        holder = getattr(manager, "_mb_holder", None)
        if zero_copy and holder is not None:
            _check_widths(aid, layout, holder.widths, st.source)
        rank = max(m.rank for m in layout.modules)
        if rank > cfg.max_lora_rank:
            raise ValueError(f"adapter {aid!r} has rank {rank}, above this engine's max_lora_rank {cfg.max_lora_rank}")
        if zero_copy:
            model = _broker_model_cls()(lora_request.lora_int_id, rank, {})
        else:
            loras = {}
            for (layer, mod), w in st.source.copies(leased, cfg.lora_dtype).items():
                full = names[(layer, mod)]
                loras[full] = LoRALayerWeights(full, w.rank, w.scaling * w.rank, w.lora_a, w.lora_b, scaling=w.scaling)
            model = LoRAModel(lora_request.lora_int_id, rank, loras)
        model.is_3d_lora_weight = False
        st.source.pending.add(lora_request.lora_int_id)
        return model
    except BaseException:
        st.source.release(lora_request.lora_int_id)
        raise


def _check_widths(aid: str, layout, widths: dict, source: BrokerAdapters) -> None:
    """Refuse a copy whose modules are not as wide as this engine's layers (this rank's slices)."""
    for m in layout.modules:
        want = widths.get((m.layer, m.module))
        if want is not None and (m.in_features, m.out_features) != want:
            raise ValueError(
                f"adapter {aid!r}: layer {m.layer} {m.module} is {m.in_features} -> {m.out_features} in the copy "
                f"from the broker at {source.socket} (shards {shards_text(source.shards) or 'none'}), but this "
                f"engine's layer takes {want[0]} -> {want[1]}: the adapter was trained for another model, or this "
                "rank's slice is cut otherwise (run the engine with MEMORY_BROKER_VLLM_LORA=copy)"
            )


def dtype_name(dtype) -> str:
    """vLLM's resolved ``lora_dtype`` (a torch dtype, or its name) as the broker names dtypes."""
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise ValueError(f"LoRA dtype {dtype}: the broker serves adapters in {', '.join(TORCH_DTYPES)}")
    return name


def _reconciling(orig):
    def call(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        st = _state
        if st is not None:
            live = set(self.list_adapters())
            st.source.pending.difference_update(live)
            st.source.reconcile(live)
        return result

    return call


# ----------------------------------------------------------------- the zero-copy path


def _zero_copy_refusal(manager) -> str | None:
    """Why this manager cannot run zero-copy (it then runs with copies), or None."""
    from vllm import envs

    cfg = manager.lora_config
    if manager.supports_mm:
        return "multimodal models are not supported"
    if manager._is_moe:
        return "MoE LoRA layers are not supported"
    if cfg.fully_sharded_loras:
        return "fully_sharded_loras is not supported"
    if getattr(envs, "VLLM_LORA_ENABLE_DUAL_STREAM", False):
        return "VLLM_LORA_ENABLE_DUAL_STREAM is not supported"
    return None


def _tp() -> tuple[int, int]:
    """(this worker's tensor-parallel rank, the TP size); (0, 1) with no model-parallel group."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):
        return 0, 1  # no model-parallel group set up (one process): nothing is split


def _bind_rank(st: State, tp_rank: int, shards: tuple[ModuleShard, ...]) -> None:
    """This worker's broker: with a directory of per-GPU brokers, its tensor-parallel rank's
    GPU's (as the KV connector finds it: ``gpus.rank_gpu_uuid``); with one socket, that one.
    Every adapter is then acquired as ``shards`` (the rank's slice)."""
    from memory_broker.clients import discovery
    from memory_broker.clients.vllm.store import rank_socket
    from memory_broker.proto.wire import gpus

    socket, gpu = st.source.socket, st.source.gpu_uuid
    if discovery.broker_dir(socket) is not None:
        socket, gpu = rank_socket(socket, gpus.rank_gpu_uuid(tp_rank), tp_rank)
    st.source.bind(socket, gpu, shards)
    log.info("memory-broker: LoRA adapters (tp rank %d) from the broker at %s", tp_rank, socket)


def _rank_shards(manager, tp_rank: int, tp_size: int) -> tuple[ModuleShard, ...]:
    """What this rank's layers keep of each adapted module, as vLLM's ``slice_lora_a`` /
    ``slice_lora_b`` cut it: row-parallel layers part ``tp_rank`` of A's input columns,
    column-parallel ones their output part of B's rows (q, k and v by their own shard ids).

    Raises:
        RuntimeError: a layer whose one LoRA module packs several sharded outputs (a fused
            qkv_proj or gate_up_proj adapted as one), or a module split differently in two layers.
    """
    if tp_size == 1:
        return ()
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA

    out: dict[str, ModuleShard] = {}
    for name, module in manager.modules.items():
        if not isinstance(module, BaseLinearLayerWithLoRA):
            continue
        leaves = [n.rsplit(".", 1)[-1] for n in manager.packed_modules.get(name, [name])]
        if isinstance(module, RowParallelLinearWithLoRA):
            parts = [ModuleShard(leaf, True, tp_rank, tp_size) for leaf in leaves]
        else:
            ids = getattr(module, "output_ids", None)
            if ids is None and (getattr(module, "is_merged_col_linear", False) or hasattr(module, "q_proj_total_size")):
                raise RuntimeError(
                    f"memory-broker: {name} packs several sharded outputs in one LoRA module; zero-copy LoRA cannot "
                    "serve it with tensor parallelism: run the engine with MEMORY_BROKER_VLLM_LORA=copy"
                )
            ids = ids or (tp_rank,) * len(leaves)
            kv = hasattr(module, "kv_shard_id")  # q, k, v: k and v heads may be replicated
            counts = [tp_size // (module.base_layer.num_kv_head_replicas if kv and j else 1) for j in range(len(ids))]
            parts = [ModuleShard(leaf, False, i, c) for leaf, i, c in zip(leaves, ids, counts)]
        for p in parts:
            if out.setdefault(p.module, p) != p:
                raise RuntimeError(
                    f"memory-broker: module {p.module} is split differently in two layers: {out[p.module]}, {p}"
                )
    return tuple(out[m] for m in sorted(out))


def _create_lora_modules(orig):
    def create(self):
        st = _state
        if st is None:
            return orig(self)
        tp_rank, tp_size = _tp()
        why = _zero_copy_refusal(self) if st.mode == "zero-copy" else "copy mode"
        if why:
            if st.mode == "zero-copy":
                log.warning(
                    "memory-broker: zero-copy LoRA off for this model (%s); vLLM's slot buffers get copies", why
                )
            _bind_rank(st, tp_rank, ())  # whole adapters: vLLM slices its copies itself
            return orig(self)
        real = self.lora_config
        # Slot buffers with a rank dimension of 0: vLLM's shapes stay valid, they hold no bytes.
        empty = copy.copy(real)
        object.__setattr__(empty, "max_lora_rank", 0)
        self.lora_config = empty
        try:
            orig(self)
        finally:
            self.lora_config = real
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
        from vllm.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA

        from memory_broker.clients.lora import layer_index

        _bind_rank(st, tp_rank, _rank_shards(self, tp_rank, tp_size))
        holder = StepHolder(self.device, _static_buffers(self, real, st))
        holder.epoch = st.source.epoch()
        check_backend(self.device)
        for name, module in self.modules.items():
            if hasattr(module, "lora_config"):
                module.lora_config = real
            if not isinstance(module, BaseLinearLayerWithLoRA):
                continue
            layer = layer_index(name)
            leaves = self.packed_modules.get(name, [name])
            slices = tuple(module.output_slices)
            if layer is None or len(slices) != len(leaves):
                continue  # outside numbered layers: adapters in the broker cannot adapt it
            module._mb_address = address = LayerAddress(layer, tuple(n.rsplit(".", 1)[-1] for n in leaves), slices)
            for mod, width in zip(address.modules, slices):
                holder.widths[(layer, mod)] = (module.input_size, width)
            module._mb_holder = holder
            module._apply_lora_to_output = types.MethodType(_zero_copy_output, module)
            if isinstance(module, RowParallelLinearWithLoRA):
                module.apply = types.MethodType(_zero_copy_row_apply, module)
        self._mb_holder = holder

    return create


def _captured_batch(manager) -> tuple[int, bool]:
    """The largest batch (tokens) this engine's CUDA graphs hold, and whether it captures any:
    the compilation config's largest ``cudagraph_capture_sizes`` (vLLM pads a batch up to one of
    them; ``max_cudagraph_capture_size``) on a CUDA device unless ``cudagraph_mode`` is NONE
    (``enforce_eager``); otherwise ``max_num_seqs``, a decode step's batch."""
    from vllm import config

    current = getattr(config, "get_current_vllm_config_or_none", lambda: None)()
    comp = getattr(current, "compilation_config", None)
    sizes = list(getattr(comp, "cudagraph_capture_sizes", None) or ())
    mode = getattr(getattr(comp, "cudagraph_mode", None), "name", "NONE")
    if sizes and mode != "NONE" and torch.device(manager.device).type == "cuda":
        return max(sizes), True
    return manager.max_num_seqs, False


def _static_buffers(manager, cfg, st: State) -> StaticStepBuffers | None:
    """The buffers a captured step reads: steps of up to ``_captured_batch`` tokens (decode, and
    any batch a graph holds) run on them, larger ones the ordinary path; ``max_loras`` slots of
    ``max_lora_rank``, the arena in the engine's LoRA dtype, rows aligned as the broker lays
    them out (``DEFAULT_ROW_ALIGN``: a broker configured with less is refused at the step when
    graphs are captured; an eager engine runs such steps the ordinary path)."""
    max_tokens, captured = _captured_batch(manager)
    dtype = dtype_name(cfg.lora_dtype)
    try:
        arena = st.source.arena(dtype)
    except Exception as e:
        if captured:
            raise RuntimeError(
                f"memory-broker: zero-copy LoRA needs the broker's arena before vLLM captures CUDA graphs, and the "
                f"broker at {st.source.socket} could not be reached or viewed ({e}): start it first, or run the engine "
                "with enforce_eager=True"
            ) from e
        # Not only an unreachable broker: a host-arena broker with no slab mapped yet has no arena to view.
        log.warning(
            "memory-broker: the broker's arena at %s could not be viewed at engine start (%s); LoRA steps run the "
            "ordinary path (tokens are the same; the CUDA-graph static buffers are not used)",
            st.source.socket,
            e,
        )
        return None
    row_align = DEFAULT_ROW_ALIGN // elem_size(dtype)
    return StaticStepBuffers(max_tokens, len(manager.lora_index_to_id), cfg.max_lora_rank, arena, row_align, captured)


def _zero_copy_output(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    step = self._mb_holder.step
    if step is None or not step.active:
        return output
    shape = output.shape if output.ndim == 3 else None
    if x.ndim == 3 and output.ndim == 3:
        output, x = output.flatten(0, 1), x.flatten(0, 1)
    step.apply(x, output, self._mb_address)
    return output.reshape(shape) if shape is not None else output


def _zero_copy_row_apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    output = self._get_quant_method().apply(self.base_layer, x, bias)
    shape = output.shape
    out = _zero_copy_output(self, x.reshape(-1, x.shape[-1]), output.reshape(-1, shape[-1]))
    return out.view(*shape)


def _create_merged_loras_inplace(orig):
    def merge(self, lora_model):
        if getattr(lora_model, "zero_copy", False):
            return  # nothing to merge or scale: the weights stay in the pages
        return orig(self, lora_model)

    return merge


def _create_dummy_lora(orig):
    def dummy(self, lora_id, rank, embedding_modules=None):
        if getattr(self, "_mb_holder", None) is not None:
            # Warm-up adapters of a zero-copy engine: no weights, no broker slot (rank 0 everywhere).
            return _broker_model_cls()(lora_id, rank, {})
        return orig(self, lora_id, rank, embedding_modules)

    return dummy


def _build_step(manager, holder: StepHolder, st: State) -> None:
    wrapper = next(iter(manager.punica_wrapper_mapping.values()))
    slots = tuple(st.source.adapter(i) for i in manager.lora_index_to_id)
    if holder.static is not None and st.source.epoch() != holder.epoch:
        # A new broker session (restart): its arena is another mapping.
        holder.static = holder.static.for_arena(st.source.arena(dtype_name(holder.static.arena.dtype)))
    holder.step = ZeroCopyStep.build(
        slots, wrapper.token_lora_indices, holder.tables, st.source.arena, st.rounding, static=holder.static
    )
    holder.epoch = st.source.epoch()
    holder.builds += 1


def _set_adapter_mapping(orig):
    # Called by vLLM when the mapping or the slot layout changed: a new step.
    def set_mapping(self, mapping):
        orig(self, mapping)
        holder = getattr(self, "_mb_holder", None)
        if holder is not None and _state is not None:
            _build_step(self, holder, _state)

    return set_mapping


def _set_adapter_mapping_public(orig):
    # Called every step: a broker restart under an unchanged mapping still rebuilds the step
    # (new session, new pages) before the layers read them.
    def set_mapping(self, mapping):
        orig(self, mapping)
        holder = getattr(self, "_mb_holder", None)
        st = _state
        if holder is not None and st is not None and holder.step is not None and holder.epoch != st.source.epoch():
            _build_step(self, holder, st)

    return set_mapping


# ----------------------------------------------------------------- measurement


def lora_memory(worker) -> dict:
    """LoRA weight memory of the engine ``worker`` runs (for ``LLM.collective_rpc``): vLLM's slot
    buffers, the weight copies in its adapter cache, and the zero-copy path's per-engine extra."""
    wm = worker.model_runner.lora_manager
    manager = wm._adapter_manager
    slot = 0
    for module in manager.modules.values():
        for name in ("lora_a_stacked", "lora_b_stacked"):
            held = getattr(module, name, None)
            for t in [held] if isinstance(held, torch.Tensor) else list(held or ()):
                if isinstance(t, torch.Tensor):
                    slot += t.numel() * t.element_size()
    cached = 0
    for model in manager.list_adapters().values():
        for w in model.loras.values():
            for t in (w.lora_a, w.lora_b):
                for x in t if isinstance(t, list) else [t]:
                    if isinstance(x, torch.Tensor):
                        cached += x.numel() * x.element_size()
    holder = getattr(manager, "_mb_holder", None)
    st = _state
    return {
        "mode": (st.mode if holder is not None else "copy") if st is not None else "vllm",
        "max_loras": manager.lora_config.max_loras,
        "max_lora_rank": manager.lora_config.max_lora_rank,
        "slot_buffer_bytes": slot,
        "adapter_cache_bytes": cached,
        "zero_copy_extra_bytes": (holder.step.extra_bytes() if holder is not None and holder.step is not None else 0)
        + (holder.static.bytes() if holder is not None and holder.static is not None else 0),
        "zero_copy_table_bytes": holder.step.tables_bytes() if holder is not None and holder.step is not None else 0,
        "step_builds": holder.builds if holder is not None else 0,
        # Static buffers (for captured steps): their batch size, and layer launches run on them.
        "static_max_tokens": holder.static.max_tokens if holder is not None and holder.static is not None else 0,
        "static_applies": holder.static.applies if holder is not None and holder.static is not None else 0,
        "held": sorted(st.source.held()) if st is not None else [],
        # This worker's broker and the tensor-parallel slice it asks for.
        "socket": st.source.socket if st is not None else "",
        "shard": shards_text(st.source.shards) if st is not None else "",
        "weight_bytes": sum(a.layout.weight_bytes for a in st.source.held().values()) if st is not None else 0,
        "acquires": st.source.acquires if st is not None else 0,
        "releases": st.source.releases if st is not None else 0,
    }


def mode_from_env() -> str:
    return os.environ.get("MEMORY_BROKER_VLLM_LORA", "zero-copy").strip().lower() or "zero-copy"
