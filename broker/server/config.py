"""The YAML configuration file (shaped like the ADR's section 12) and how it maps to options.

Every key has one place in ``ServeOptions``; unknown keys and bad values are refused with a
message naming the key (``memory_pool.eviction.high_watermark: ...``). Flags override the
file. ``RELOADABLE`` lists what SIGHUP may change while the broker runs; the rest needs a
restart, and a reload that changes it says so and keeps the running value.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Callable

import yaml

from memory_broker.broker.adapters.policy import POLICIES
from memory_broker.broker.server.options import LOG_FORMATS, ServeOptions, parse_size


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message names the key."""


def parse_duration(text: Any, key: str) -> float:
    """'30s', '100ms', '2m', or a number of seconds."""
    if isinstance(text, bool):
        raise ConfigError(f"{key}: expected a duration like 30s or 100ms, got {text!r}")
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", str(text))
    if not m:
        raise ConfigError(f"{key}: cannot read {text!r} as a duration; write e.g. 30s, 100ms, 2m")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}[m.group(2)]


def _size(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ConfigError(f"{key}: expected a size like 2MiB or a number of bytes, got {v!r}")
    try:
        return parse_size(v, key)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _int(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{key}: expected an integer, got {v!r}")
    return v


def _float(v: Any, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {v!r}")
    return float(v)


def _bool(v: Any, key: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: expected true or false, got {v!r}")
    return v


def _str(v: Any, key: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{key}: expected a non-empty string, got {v!r}")
    return v


def _choice(*choices: str) -> Callable[[Any, str], str]:
    def parse(v: Any, key: str) -> str:
        if v not in choices:
            raise ConfigError(f"{key}: {v!r} is not one of {', '.join(choices)}")
        return v

    return parse


def _uids(v: Any, key: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in v):
        raise ConfigError(f"{key}: expected a list of uids (non-negative integers), got {v!r}")
    return tuple(v)


def _paths(v: Any, key: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(p, str) and p.startswith("/") for p in v):
        raise ConfigError(f"{key}: expected a list of absolute directory paths, got {v!r}")
    return tuple(v)


def _mode(v: Any, key: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        # YAML reads 0660 as octal-looking decimal 660 only if quoted oddly; accept ints < 0o1000.
        if 0 <= v < 0o1000:
            return v
    if isinstance(v, str) and re.fullmatch(r"0?[0-7]{3}", v):
        return int(v, 8)
    raise ConfigError(f"{key}: expected a file mode like \"0660\", got {v!r}")


# key -> (ServeOptions field, parser). total_pages is handled specially (needs page_size).
SCHEMA: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    "memory_pool.page_size": ("page_size", _size),
    "memory_pool.pool_size": ("pool_size", _size),
    "memory_pool.total_pages": ("_total_pages", _int),
    "memory_pool.slab_size": ("slab_size", _size),
    "memory_pool.preallocate": ("preallocate", _size),
    "memory_pool.window_factor": ("window_factor", _int),
    "memory_pool.allocation_strategy": ("placement", _choice("best_fit", "first_fit")),
    "memory_pool.eviction.policy": ("eviction_policy", _choice("lru_size_aware", "lru")),
    "memory_pool.eviction.high_watermark": ("high_watermark", _float),
    "memory_pool.eviction.low_watermark": ("low_watermark", _float),
    "memory_pool.pinning.max_pins_per_session": ("max_pins_per_session", _int),
    "memory_pool.transactions.default_lease": ("default_lease_s", parse_duration),
    "adapters.dtype": ("adapter_dtype", _choice("bfloat16", "float16", "float32")),
    "adapters.max_rank": ("adapter_max_rank", _int),
    "adapters.hot_tier_budget": ("hot_tier_adapters", _int),
    "adapters.hot_tier_pages": ("hot_tier_pages", _int),
    "adapters.warm_tier_bytes": ("warm_tier_bytes", _size),
    "adapters.warm_int8": ("warm_int8", _bool),
    "adapters.image_cache": ("adapter_image_cache", _bool),
    "adapters.image_budget": ("adapter_image_budget", _size),
    "adapters.convert_ahead": ("adapter_convert_ahead", _bool),
    "adapters.hot_policy": ("adapter_hot_policy", _choice(*POLICIES)),
    "adapters.warm_policy": ("adapter_warm_policy", _choice(*POLICIES)),
    "adapters.allowed_roots": ("adapter_allowed_roots", _paths),
    "adapters.manager_uids": ("adapter_manager_uids", _uids),
    "arena.backend": ("arena", _choice("auto", "host", "cuda")),
    "arena.device": ("device", lambda v, k: _str(str(v), k)),
    "listeners.socket": ("socket", _str),
    "listeners.tcp_port": ("tcp_port", _int),
    "listeners.socket_mode": ("socket_mode", _mode),
    "listeners.socket_group": ("socket_group", _str),
    "listeners.metrics_port": ("metrics_port", _int),
    "listeners.metrics_address": ("metrics_address", _str),
    "security.allowed_uids": ("allowed_uids", _uids),
    "security.max_sessions": ("max_sessions", _int),
    "security.max_sessions_per_uid": ("max_sessions_per_uid", _int),
    "listeners.idle_timeout": ("idle_timeout_s", parse_duration),
    "state_dir": ("state_dir", _str),
    "logging.level": ("log_level", _choice("debug", "info", "warning", "error")),
    "logging.format": ("log_format", _choice(*LOG_FORMATS)),
    "shutdown.grace": ("grace_s", parse_duration),
    "status_interval": ("status_interval_s", parse_duration),
}

# Options SIGHUP may change in a running broker.
RELOADABLE = frozenset({
    "high_watermark", "low_watermark", "default_lease_s", "allowed_uids", "log_level",
    "max_pins_per_session", "grace_s", "status_interval_s", "adapter_manager_uids", "max_sessions",
    "max_sessions_per_uid",
})  # fmt: skip


# Section paths ("memory_pool", "memory_pool.eviction", ...): the mappings a file may hold.
SECTIONS = frozenset(k.rsplit(".", i)[0] for k in SCHEMA for i in range(1, k.count(".") + 1))


def _unknown_key(key: str, where: str) -> ConfigError:
    """Refuse ``key``, suggesting the closest known key or section at the same depth."""
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = sorted(
        k for k in (*SCHEMA, *SECTIONS) if k.count(".") == key.count(".") and (k.rsplit(".", 1)[0] if "." in k else "") == parent
    )
    leaves = [k.rsplit(".", 1)[-1] for k in siblings]
    near = difflib.get_close_matches(key.rsplit(".", 1)[-1], leaves, n=1, cutoff=0.7)
    if near:
        hint = f" (did you mean {parent + '.' if parent else ''}{near[0]}?)"
    else:
        hint = f"; known keys {'in ' + parent if parent else 'at the top level'}: {', '.join(leaves)}"
    return ConfigError(f"{key}: unknown key{where}{hint}")


def _flatten(node: Any, prefix: str, out: dict[str, Any], where: str = "") -> None:
    """``{"a": {"b": 1}}`` -> ``out["a.b"] = 1``. Refuses, at any depth, a key that is neither
    a setting nor a section (even one whose value is empty), and a mapping where a value
    belongs or the reverse."""
    if not isinstance(node, dict):
        raise ConfigError(f"{prefix or 'the file'}: expected a mapping of keys, got {type(node).__name__}")
    for k, v in node.items():
        if not isinstance(k, str):
            raise ConfigError(f"{prefix or 'top level'}: key {k!r} is not a string")
        key = f"{prefix}.{k}" if prefix else k
        if key in SCHEMA:
            if isinstance(v, dict):
                raise ConfigError(f"{key}: expected a value, got a mapping")
            out[key] = v
        elif key in SECTIONS:
            if v is None:
                continue  # a section whose keys are all commented out
            if not isinstance(v, dict):
                raise ConfigError(f"{key}: expected a mapping of keys, got {type(v).__name__}")
            _flatten(v, key, out, where)
        else:
            raise _unknown_key(key, where)


def load_config(path: str) -> dict[str, Any]:
    """Read a YAML file into ``{ServeOptions field: value}``. Raises ConfigError."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if raw is None:
        return {}
    flat: dict[str, Any] = {}
    _flatten(raw, "", flat, f" in {path}")
    values: dict[str, Any] = {}
    for key, v in flat.items():
        field_name, parse = SCHEMA[key]
        values[field_name] = parse(v, key)
    if "_total_pages" in values:
        if "pool_size" in values:
            raise ConfigError("memory_pool.total_pages: give total_pages or pool_size, not both")
        values["pool_size"] = values.pop("_total_pages") * values.get("page_size", ServeOptions().page_size)
    return values


def build_options(config_path: str | None, overrides: dict[str, Any]) -> ServeOptions:
    """Defaults, then the file, then flags (``overrides``: only flags given). Validated."""
    values: dict[str, Any] = load_config(config_path) if config_path else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    opts = ServeOptions(**values)
    try:
        opts.validate()
    except ValueError as e:
        # Say which config key the bad option came from.
        msg = str(e)
        field_name = msg.split(":", 1)[0]
        keys = [k for k, (f, _) in SCHEMA.items() if f == field_name]
        if keys and field_name not in overrides:
            raise ConfigError(f"{keys[0]} ({msg})") from None
        raise ConfigError(msg) from None
    return opts


def reload_changes(running: ServeOptions, new: ServeOptions) -> tuple[dict[str, Any], list[str]]:
    """What a reload may apply now, and the fields that changed but need a restart."""
    apply: dict[str, Any] = {}
    restart: list[str] = []
    for f in dataclasses.fields(ServeOptions):
        old, cur = getattr(running, f.name), getattr(new, f.name)
        if old != cur:
            (apply.__setitem__(f.name, cur) if f.name in RELOADABLE else restart.append(f.name))
    return apply, restart
