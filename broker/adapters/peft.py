"""PEFT LoRA directories: what one holds, checked before anything is registered.

``inspect_peft_dir`` validates a directory (``adapter_config.json`` + ``adapter_model.safetensors``):
the config and every tensor's shape and dtype from the safetensors header (no weights are
read), refusing what the kernels cannot serve with a message naming the file and the problem.
It returns an ``AdapterMeta``; ``AdapterInfo`` is the one record the service turns into a wire
message (``AdapterMeta.info`` for a full record, the registry's listing for a page). Pure
validation: nothing here persists anything or knows of tiers, pages or sessions.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from memory_broker.broker.adapters import patterns
from memory_broker.broker.adapters.access import Caller, Opened, open_for, read_bounded
from memory_broker.broker.adapters.layout import LoraModuleSpec
from memory_broker.proto.wire.errors import BrokerError, Code, exhausted, invalid

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Version of ``AdapterMeta.to_json`` (the registry stores it and refuses another).
SCHEMA_VERSION = 1

# Adapter ids: what a person types and a path or metric label can carry. Every allowed
# character sorts below 0x7f, which the prefix listing relies on.
ADAPTER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+=-]{0,255}")
# Bytes per element of the safetensors dtypes (an unknown one counts 8; any but FILE_DTYPES is
# refused later anyway).
_DTYPE_BYTES: Mapping[str, int] = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
# Safetensors element types an adapter file may use (converted to the broker's dtype on load).
FILE_DTYPES: Mapping[str, str] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
DEFAULT_MAX_RANK = 256
# Largest adapter_config.json read (real ones are a few KiB).
MAX_CONFIG_BYTES = 1 << 20
# Bounds on a config's numbers, far beyond any real adapter: ranks (and layer indices), and the
# magnitude of alphas (a scaling must stay a finite float in every storage dtype).
MAX_CONFIG_RANK = 1 << 20
MAX_CONFIG_NUMBER = 1e12
# Most tensors in one weights file (a 128-layer model with 16 adapted modules has 4,096).
MAX_TENSORS = 1 << 16
# PEFT prefixes every saved key with this (the PeftModel wrapper's attribute path).
_PEFT_KEY_PREFIX = "base_model.model."
_LORA_WEIGHT = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")
_LORA_BIAS = re.compile(r".+\.lora_[AB](?:\.[^.]+)?\.bias")
# Config flags that change the math the kernels do (or add weights they cannot use): any
# truthy value is refused. The values are the reasons given.
_REFUSED_FLAGS = {
    "use_dora": "DoRA adapters (use_dora) add a magnitude vector the kernels do not apply; "
    "merge the adapter or retrain it without DoRA",
    "lora_bias": "LoRA biases (lora_bias) are not supported; the kernels add no bias",
    "use_qalora": "QA-LoRA (use_qalora) pools the input before A; the kernels apply plain LoRA",
    "layer_replication": "layer_replication changes which base layer each adapter layer maps to",
    "target_parameters": "LoRA on raw parameters (target_parameters) is not supported, only on linear modules",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices) are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) applies only after an invocation "
    "sequence; the kernels apply the adapter to every token",
    "use_bdlora": "BD-LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) mixes several adapters per token; not supported",
}


@dataclass(frozen=True, slots=True)
class ModuleShape:
    """One adapted module type, the same in every layer it appears in."""

    # Short name ("q_proj"), the module's id in layouts.
    name: str
    # Path inside a layer ("self_attn.q_proj"), for the safetensors keys.
    path: str
    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class AdapterMeta:
    """What registration learned about one adapter; enough to place and load it."""

    adapter_id: str
    # Absolute path of the PEFT directory.
    source: str
    # ``r`` and ``lora_alpha`` of the config (defaults when patterns override some modules).
    rank: int
    lora_alpha: float
    use_rslora: bool
    # Module types, sorted by path.
    modules: tuple[ModuleShape, ...]
    # Every adapted (layer, module), in placement order (layer, then module path), with its
    # own rank and scaling (rank_pattern / alpha_pattern resolved as PEFT does).
    weights: tuple[LoraModuleSpec, ...]
    # Key of layer L, module path P, matrix X: f"{key_prefix}{L}.{P}.lora_{X}.weight".
    key_prefix: str
    # Safetensors dtypes found in the file ("F32", "F16", "BF16").
    file_dtypes: tuple[str, ...]
    # Size and modification time of the weights file when registered (a changed file is refused at load).
    file_bytes: int
    file_mtime_ns: int
    base_model: str | None = None
    registered_at: float = 0.0

    @property
    def weights_path(self) -> str:
        return os.path.join(self.source, WEIGHTS_FILE)

    @property
    def config_path(self) -> str:
        return os.path.join(self.source, CONFIG_FILE)

    @property
    def max_rank(self) -> int:
        return max(w.rank for w in self.weights)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({w.layer for w in self.weights}))

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.modules)

    @property
    def uniform(self) -> bool:
        """One rank and one scaling for every module (what fused kernel launches need)."""
        return len({w.rank for w in self.weights}) == 1 and len({w.scaling for w in self.weights}) == 1

    @property
    def num_params(self) -> int:
        return sum(w.rank * (w.in_features + w.out_features) for w in self.weights)

    @property
    def info(self) -> AdapterInfo:
        """This adapter as a listing shows it (the one record the service sends)."""
        return AdapterInfo(
            self.adapter_id,
            self.source,
            self.max_rank,
            self.lora_alpha,
            self.use_rslora,
            self.target_modules,
            len(self.layers),
            self.file_bytes,
            self.registered_at,
        )

    def weight_key(self, layer: int, module: str, kind: str) -> str:
        path = self._paths()[module]
        return f"{self.key_prefix}{layer}.{path}.lora_{kind}.weight"

    def _paths(self) -> dict[str, str]:
        return {m.name: m.path for m in self.modules}

    def with_id(self, adapter_id: str, registered_at: float) -> AdapterMeta:
        return AdapterMeta(
            adapter_id,
            self.source,
            self.rank,
            self.lora_alpha,
            self.use_rslora,
            self.modules,
            self.weights,
            self.key_prefix,
            self.file_dtypes,
            self.file_bytes,
            self.file_mtime_ns,
            self.base_model,
            registered_at,
        )

    def to_json(self) -> str:
        index = {m.name: i for i, m in enumerate(self.modules)}
        return json.dumps(
            {
                "v": SCHEMA_VERSION,
                "source": self.source,
                "r": self.rank,
                "alpha": self.lora_alpha,
                "rslora": self.use_rslora,
                "modules": [[m.name, m.path, m.in_features, m.out_features] for m in self.modules],
                "weights": [[w.layer, index[w.module], w.rank, w.scaling] for w in self.weights],
                "prefix": self.key_prefix,
                "dtypes": list(self.file_dtypes),
                "bytes": self.file_bytes,
                "mtime_ns": self.file_mtime_ns,
                "base_model": self.base_model,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, adapter_id: str, text: str, registered_at: float) -> AdapterMeta:
        d = json.loads(text)
        modules = tuple(ModuleShape(n, p, int(i), int(o)) for n, p, i, o in d["modules"])
        weights = tuple(
            LoraModuleSpec(
                int(layer), modules[mi].name, int(r), modules[mi].in_features, modules[mi].out_features, float(s)
            )
            for layer, mi, r, s in d["weights"]
        )
        return cls(
            adapter_id,
            d["source"],
            int(d["r"]),
            float(d["alpha"]),
            bool(d["rslora"]),
            modules,
            weights,
            d["prefix"],
            tuple(d["dtypes"]),
            int(d["bytes"]),
            int(d["mtime_ns"]),
            d.get("base_model"),
            registered_at,
        )


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A registered adapter in a listing (no per-layer detail)."""

    adapter_id: str
    source: str
    # Largest rank of any module.
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    num_layers: int
    # Weights in the file, in bytes.
    file_bytes: int
    registered_at: float


def check_adapter_id(adapter_id: object, what: str = "adapter_id") -> str:
    if not isinstance(adapter_id, str) or not ADAPTER_ID_RE.fullmatch(adapter_id):
        raise invalid(
            f"{what} {adapter_id!r} is not a valid adapter id: 1-256 characters of letters, digits and "
            "._:/@+=- starting with a letter or digit"
        )
    return adapter_id


# --------------------------------------------------------------------- validation


def _targets(cfg: Mapping, name: str, layer: int, where: str) -> bool:
    """PEFT's ``check_target_module_exists`` for a module that has LoRA tensors."""
    if not patterns.targets(cfg["target_modules"], name, where):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is not None and layers != []:
        allowed = {layers} if isinstance(layers, int) else set(layers)
        return layer in allowed
    return True


def _number(v: object, *, rank: bool = False) -> bool:
    """A finite number within bounds (``rank``: an integer 1..MAX_CONFIG_RANK). Never raises,
    whatever JSON gave (an integer of thousands of digits does not fit a float)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if rank:
        return isinstance(v, int) and 1 <= v <= MAX_CONFIG_RANK
    return (isinstance(v, int) or math.isfinite(v)) and abs(v) <= MAX_CONFIG_NUMBER


def _layer_index(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_CONFIG_RANK


def _short(v: object, limit: int = 80) -> str:
    """``repr`` of a config value, cut to ``limit`` characters (a value may be huge)."""
    try:
        r = repr(v)
    except ValueError:  # an integer too long to print
        return f"an integer of {v.bit_length()} bits"  # type: ignore[union-attr]
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _read_config(
    path: str,
    caller: Caller | None = None,
    roots: tuple[str, ...] = (),
    start: Opened | None = None,
    max_bytes: int = MAX_CONFIG_BYTES,
) -> dict:
    """The JSON object in a config file, read bounded and typed (see ``access.open_for``)."""
    try:
        with open_for(
            os.path.basename(path) if start is not None else path,
            caller,
            roots,
            max_bytes=max_bytes,
            start=start,
            what=path,
        ) as f:
            text = read_bounded(f, max_bytes, path)
    except BrokerError as e:
        if e.code == Code.INVALID_ARGUMENT and "no such file" in e.message:
            raise invalid(f"{path}: missing; a PEFT LoRA directory holds {CONFIG_FILE} and {WEIGHTS_FILE}") from None
        raise
    except OSError as e:
        raise invalid(f"{path}: cannot be read ({e})") from None
    try:
        cfg = json.loads(text.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise invalid(f"{path}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise invalid(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise invalid(f"{path}: JSON nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise invalid(f"{path}: holds a number too long to read ({str(e).split(':')[0]})") from None
    if not isinstance(cfg, dict):
        raise invalid(f"{path}: must hold a JSON object, not {type(cfg).__name__}")
    return cfg


def _check_config(cfg: dict, path: str) -> None:
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise invalid(f"{path}: peft_type is {_short(peft_type)}; only LORA adapters are supported")
    for flag, why in _REFUSED_FLAGS.items():
        if cfg.get(flag):
            raise invalid(f"{path}: {flag} is {_short(cfg[flag])}: {why}")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise invalid(
            f"{path}: bias is {_short(bias)}: biases are not supported (the kernels add none); need bias 'none'"
        )
    _check_numbers(cfg, path)
    tm = cfg.get("target_modules")
    if tm is None:
        raise invalid(f"{path}: target_modules is missing; LoRA needs the modules it adapts")
    if not isinstance(tm, str) and (not isinstance(tm, list) or not tm or not all(isinstance(t, str) for t in tm)):
        raise invalid(f"{path}: target_modules must be a non-empty list of module names or a regular expression")
    ex = cfg.get("exclude_modules")
    if ex and not isinstance(ex, str) and (not isinstance(ex, list) or not all(isinstance(t, str) for t in ex)):
        raise invalid(f"{path}: exclude_modules must be a list of module names or a regular expression")
    layers = cfg.get("layers_to_transform")
    if layers is not None and not all(_layer_index(x) for x in (layers if isinstance(layers, list) else [layers])):
        raise invalid(f"{path}: layers_to_transform is {_short(layers)}; need a layer index or a list of layer indices")
    patterns.check_patterns(cfg, path)


def _check_numbers(cfg: dict, path: str) -> None:
    """r, lora_alpha, use_rslora and the pattern tables' values: typed and within bounds."""
    if not _number(cfg.get("r"), rank=True):
        raise invalid(f"{path}: r is {_short(cfg.get('r'))}; need a positive integer rank (at most {MAX_CONFIG_RANK})")
    if not _number(cfg.get("lora_alpha")):
        raise invalid(
            f"{path}: lora_alpha is {_short(cfg.get('lora_alpha'))}; need a finite number "
            f"(magnitude at most {MAX_CONFIG_NUMBER:g})"
        )
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise invalid(f"{path}: use_rslora is {_short(cfg.get('use_rslora'))}; need true or false")
    for key in ("rank_pattern", "alpha_pattern"):
        pat = cfg.get(key) or {}
        if not isinstance(pat, dict):
            raise invalid(f"{path}: {key} must be an object mapping module patterns to numbers")
        for k, v in pat.items():
            if key == "rank_pattern" and not _number(v, rank=True):
                raise invalid(
                    f"{path}: {key}[{_short(k)}] is {_short(v)}; need a positive integer (at most {MAX_CONFIG_RANK})"
                )
            if key == "alpha_pattern" and not _number(v):
                raise invalid(
                    f"{path}: {key}[{_short(k)}] is {_short(v)}; need a finite number "
                    f"(magnitude at most {MAX_CONFIG_NUMBER:g})"
                )


def _split_module(name: str) -> tuple[str, int, str] | None:
    """'model.layers.3.self_attn.q_proj' -> ('model.layers.', 3, 'self_attn.q_proj'): the
    first numbered segment is the layer index, as PEFT reads it."""
    parts = name.split(".")
    for i in range(1, len(parts) - 1):
        if parts[i].isdigit():
            return ".".join(parts[:i]) + ".", int(parts[i]), ".".join(parts[i + 1 :])
    return None


class _PeftFiles(NamedTuple):
    """What ``_read_dir`` found: the resolved directory, the config (its path and its checked
    contents), the weights file's path, its header (tensor name -> (shape, dtype)) and stat."""

    source: str
    cfg_path: str
    cfg: dict
    wpath: str
    header: dict[str, tuple[tuple[int, ...], str]]
    st: os.stat_result


def _read_dir(source: str, caller: Caller | None, roots: tuple[str, ...], max_config_bytes: int) -> _PeftFiles:
    """Open the directory, read and check its config, read its weights file's header."""
    from safetensors import safe_open

    if "\x00" in source:
        raise invalid("path contains a NUL byte; give a plain absolute path")
    source = os.path.abspath(source)
    try:
        d = open_for(source, caller, roots, directory=True)
    except BrokerError as e:
        if e.code == Code.INVALID_ARGUMENT and ("no such file" in e.message or "not a directory" in e.message):
            raise invalid(
                f"{source}: no such directory; register a PEFT LoRA directory ({CONFIG_FILE} + {WEIGHTS_FILE})"
            ) from None
        raise
    with d:
        source = d.path
        cfg_path = os.path.join(source, CONFIG_FILE)
        cfg = _read_config(cfg_path, caller, roots, start=d, max_bytes=max_config_bytes)
        _check_config(cfg, cfg_path)
        wpath = os.path.join(source, WEIGHTS_FILE)
        try:
            w = open_for(WEIGHTS_FILE, caller, roots, start=d, what=wpath)
        except BrokerError as e:
            if e.code != Code.INVALID_ARGUMENT or "no such file" not in e.message:
                raise
            hint = ""
            if os.path.exists(os.path.join(source, "adapter_model.bin")):
                hint = " (adapter_model.bin is a pickle; convert it to safetensors)"
            raise invalid(
                f"{wpath}: missing{hint}; a PEFT LoRA directory holds {CONFIG_FILE} and {WEIGHTS_FILE}"
            ) from None
        with w:
            st = w.st
            try:
                with safe_open(w.proc_path, framework="numpy") as f:
                    keys = f.keys()
                    if len(keys) > MAX_TENSORS:
                        raise invalid(f"{wpath}: holds {len(keys)} tensors; at most {MAX_TENSORS} are accepted")
                    header = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in keys}
            except BrokerError:
                raise
            except Exception as e:  # the library raises its own error types for a bad header
                raise invalid(f"{wpath}: not a readable safetensors file ({e})") from None
    if not header:
        raise invalid(f"{wpath}: holds no tensors")

    return _PeftFiles(source, cfg_path, cfg, wpath, header, st)


_Found = dict[tuple[str, int, str], dict[str, tuple[int, ...]]]


def _lora_matrices(header: dict, cfg: dict, wpath: str, cfg_where: str) -> tuple[_Found, set[str]]:
    """Every tensor checked as a LoRA A/B weight of a targeted module in a numbered layer:
    {(prefix, layer, path): {"A": shape, "B": shape}}, and the file dtypes seen."""
    # (prefix, layer, path) -> {"A": shape, "B": shape}
    found: _Found = {}
    dtypes: set[str] = set()
    for key, (shape, dtype) in header.items():
        patterns.check_name(key, wpath)
        name = key[len(_PEFT_KEY_PREFIX) :] if key.startswith(_PEFT_KEY_PREFIX) else key
        if "lora_magnitude_vector" in name:
            raise invalid(f"{wpath}: tensor {key} is a DoRA magnitude vector; DoRA adapters are not supported")
        if "lora_embedding_" in name:
            raise invalid(
                f"{wpath}: tensor {key} is an embedding LoRA; only LoRA on linear layers inside decoder layers is supported"
            )
        if _LORA_BIAS.fullmatch(name):
            raise invalid(f"{wpath}: tensor {key} is a LoRA bias; biases are not supported (the kernels add none)")
        m = _LORA_WEIGHT.fullmatch(name)
        if m is None:
            raise invalid(
                f"{wpath}: tensor {key} is not a LoRA A/B weight (modules_to_save and other full weights are not supported)"
            )
        module_name, ab = m.group("module"), m.group("ab")
        split = _split_module(module_name)
        if split is None:
            raise invalid(
                f"{wpath}: tensor {key} adapts {module_name}, which is not inside a numbered decoder layer; "
                "LoRA on lm_head or embeddings is not supported"
            )
        prefix, layer, path = split
        if dtype not in FILE_DTYPES:
            raise invalid(f"{wpath}: tensor {key} has dtype {dtype}; supported: {', '.join(FILE_DTYPES)}")
        if len(shape) != 2 or min(shape) < 1:
            raise invalid(f"{wpath}: tensor {key} has shape {list(shape)}; a LoRA matrix is 2-D and non-empty")
        if patterns.excluded(cfg.get("exclude_modules"), module_name, cfg_where) or not _targets(
            cfg, module_name, layer, cfg_where
        ):
            raise invalid(
                f"{wpath}: tensor {key} adapts {module_name}, which target_modules "
                f"{cfg.get('target_modules')!r} (layers_to_transform {cfg.get('layers_to_transform')!r}, "
                f"exclude_modules {cfg.get('exclude_modules')!r}) does not select"
            )
        dtypes.add(dtype)
        found.setdefault((prefix, layer, path), {})[ab] = shape

    return found, dtypes


def _module_specs(
    found: _Found, cfg: dict, cfg_path: str, wpath: str, max_rank: int
) -> tuple[dict[str, ModuleShape], list[LoraModuleSpec]]:
    """The module shapes by name and one spec per (layer, module) in placement order (layer,
    then module path), checked against the config's ranks and against each other."""
    r_default = int(cfg["r"])
    alpha_default = float(cfg["lora_alpha"])
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    shapes: dict[str, ModuleShape] = {}
    specs: list[LoraModuleSpec] = []
    for (prefix, layer, path), mats in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        where = f"{prefix}{layer}.{path}"
        for ab in ("A", "B"):
            if ab not in mats:
                other = "B" if ab == "A" else "A"
                raise invalid(f"{wpath}: {where} has lora_{other} but no lora_{ab}")
        (ra, in_f), (out_f, rb) = mats["A"], mats["B"]
        if ra != rb:
            raise invalid(
                f"{wpath}: {where}: lora_A is {list(mats['A'])} (rank {ra}) but lora_B is {list(mats['B'])} (rank {rb}); "
                "A must be [r, in_features] and B [out_features, r]"
            )
        rank = ra
        if rank > max_rank:
            raise invalid(f"{wpath}: {where} has rank {rank}, above the broker's max_rank of {max_rank}")
        expect, pkey = patterns.pattern_value(rank_pattern, where, r_default, cfg_path, "rank_pattern")
        if rank != expect:
            src = f"rank_pattern[{pkey!r}]" if pkey is not None else "r"
            raise invalid(f"{wpath}: {where} has rank {rank} in its tensors but {CONFIG_FILE} says {expect} ({src})")
        alpha, _ = patterns.pattern_value(alpha_pattern, where, alpha_default, cfg_path, "alpha_pattern")
        name = path.rsplit(".", 1)[-1]
        seen = shapes.get(name)
        if seen is None:
            shapes[name] = ModuleShape(name, path, in_f, out_f)
        elif seen.path != path:
            raise invalid(
                f"{wpath}: module name {name} appears at two paths ({seen.path}, {path}); names must be unique within a layer"
            )
        elif (seen.in_features, seen.out_features) != (in_f, out_f):
            raise invalid(
                f"{wpath}: {name} is {seen.in_features}->{seen.out_features} in one layer but {in_f}->{out_f} in "
                f"layer {layer}; every layer's {name} must have the same shape"
            )
        scaling = float(alpha) / (math.sqrt(rank) if rslora else rank)
        specs.append(LoraModuleSpec(layer, name, rank, in_f, out_f, scaling))
    return shapes, specs


def check_declared_size(header: Mapping, wpath: str, max_bytes: int, stored_elem_size: int) -> int:
    """The bytes a weights file's tensors declare (shapes x element size, from the header: no
    data read), each element counted at the larger of its file size and ``stored_elem_size``
    (what a conversion writes). Raises RESOURCE_EXHAUSTED, with the numbers, above ``max_bytes``
    (0: no limit)."""
    elements = declared = counted = 0
    for shape, dtype in header.values():
        n = math.prod(shape)
        size = _DTYPE_BYTES.get(dtype, 8)
        elements += n
        declared += n * size
        counted += n * max(size, stored_elem_size)
    if max_bytes and counted > max_bytes:
        raise exhausted(
            f"{wpath}: its {len(header)} tensors declare {elements} elements, {declared} bytes in the file and "
            f"{elements * stored_elem_size} bytes in pages, above the per-adapter limit of {max_bytes} bytes "
            "(adapters.max_bytes, --adapter-max-bytes; by default the pool or the hot tier's pages, whichever is "
            "smaller); register a smaller adapter or raise the limit"
        )
    return counted


def inspect_peft_dir(
    source: str,
    *,
    max_rank: int = DEFAULT_MAX_RANK,
    require_uniform: bool = False,
    caller: Caller | None = None,
    roots: tuple[str, ...] = (),
    max_config_bytes: int = MAX_CONFIG_BYTES,
    max_bytes: int = 0,
    stored_elem_size: int = 2,
) -> AdapterMeta:
    """Validate a PEFT LoRA directory and describe it (reads the config and the safetensors
    header only).

    Files are opened as ``access.open_for`` does: regular files only, the config at most
    ``max_config_bytes``, each path checked against ``caller``'s rights (None: the broker's
    own read) and, when ``roots`` is given, resolved inside one of them.

    Args:
        source: the directory.
        max_rank: largest rank accepted for any module.
        require_uniform: refuse adapters whose modules differ in rank or scaling (for
            engines that fuse modules into one kernel launch).
        caller: whose rights bound the reads (the RPC's session peer).
        roots: real paths the adapter's files must resolve inside.
        max_config_bytes: largest ``adapter_config.json`` read.
        max_bytes: most bytes the file's tensors may declare, counted in the larger of their
            own element size and ``stored_elem_size`` (the pages' dtype); 0: no limit.

    Returns:
        The adapter's metadata with an empty id; ``source`` is the resolved directory.

    Raises:
        BrokerError: INVALID_ARGUMENT with the file and the problem; PERMISSION_DENIED
            when the caller could not read it or it lies outside the roots; RESOURCE_EXHAUSTED
            when its tensors declare more than ``max_bytes`` (checked on the header, before
            any tensor is looked at or read).
    """
    source, cfg_path, cfg, wpath, header, st = _read_dir(source, caller, roots, max_config_bytes)
    check_declared_size(header, wpath, max_bytes, stored_elem_size)
    found, dtypes = _lora_matrices(header, cfg, wpath, cfg_path)
    prefixes = {p for p, _, _ in found}
    if len(prefixes) > 1:
        raise invalid(
            f"{wpath}: tensors sit under more than one layer stack ({', '.join(sorted(prefixes))}); only one is supported"
        )
    key_prefix = _PEFT_KEY_PREFIX + prefixes.pop()
    shapes, specs = _module_specs(found, cfg, cfg_path, wpath, max_rank)
    r_default = int(cfg["r"])
    alpha_default = float(cfg["lora_alpha"])
    rslora = bool(cfg.get("use_rslora", False))
    # Placement order: layer, then module path (as ``_module_specs`` sorts them).
    meta = AdapterMeta(
        adapter_id="",
        source=source,
        rank=r_default,
        lora_alpha=alpha_default,
        use_rslora=rslora,
        modules=tuple(sorted(shapes.values(), key=lambda s: s.path)),
        weights=tuple(specs),
        key_prefix=key_prefix,
        file_dtypes=tuple(sorted(dtypes)),
        file_bytes=st.st_size,
        file_mtime_ns=st.st_mtime_ns,
        base_model=cfg.get("base_model_name_or_path") if isinstance(cfg.get("base_model_name_or_path"), str) else None,
    )
    if require_uniform and not meta.uniform:
        detail = sorted({(w.module, w.rank, round(w.scaling, 6)) for w in meta.weights})
        raise invalid(
            f"{cfg_path}: modules differ in rank or scaling ({', '.join(f'{m}: r={r} s={s:g}' for m, r, s in detail)}) "
            "and this broker requires uniform adapters (adapters.require_uniform)"
        )
    return meta
