"""The YAML configuration file (shaped like the ADR's section 12) read through the one schema in
``options.py``, and what a SIGHUP reload may change.

Keys, their readers and what reloads come from ``SETTINGS``; nothing here declares a setting.
Unknown keys and bad values are refused with a message naming the key
(``memory_pool.eviction.high_watermark: ...``), the nearest known key suggested; a deprecated
spelling is read and said once. Flags override the file. This module does not parse flags.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

import yaml

from memory_broker.broker.server.gpu_layout import apply_gpu_layout
from memory_broker.broker.server.options import SETTINGS, ServeOptions, Setting, SettingError
from memory_broker.broker.server.values import ConfigError, read

# pool_size given as a count of pages: a key of the file only, turned into pool_size on reading.
TOTAL_PAGES = "memory_pool.total_pages"

# YAML key -> setting (every key a file may hold, deprecated spellings aside).
SCHEMA: dict[str, Setting | None] = {s.yaml: s for s in SETTINGS.values() if s.yaml} | {TOTAL_PAGES: None}

# Deprecated YAML key -> the setting it now names.
ALIASES: dict[str, Setting] = {old: s for s in SETTINGS.values() for old in s.aliases}

# Options SIGHUP may change in a running broker.
RELOADABLE = frozenset(s.name for s in SETTINGS.values() if s.reload)

# Section paths ("memory_pool", "memory_pool.eviction", ...): the mappings a file may hold.
SECTIONS = frozenset(k.rsplit(".", i)[0] for k in SCHEMA for i in range(1, k.count(".") + 1))

# Deprecated spellings already said (each is said once per process, not at every reload), and
# those said but not yet logged (the log is configured after the file is read).
_said: set[str] = set()
_pending: list[str] = []


def deprecation_notes() -> list[str]:
    """The deprecation notices not yet logged, and forget them (the caller logs them)."""
    notes = list(_pending)
    _pending.clear()
    return notes


def _deprecated(old: str, s: Setting) -> None:
    if old not in _said:
        _said.add(old)
        _pending.append(f"{old} is deprecated; write {s.label}")


def _unknown_key(key: str, where: str) -> ConfigError:
    """Refuse ``key``, suggesting the closest known key or section at the same depth."""
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = sorted(
        k
        for k in (*SCHEMA, *SECTIONS)
        if k.count(".") == key.count(".") and (k.rsplit(".", 1)[0] if "." in k else "") == parent
    )
    leaves = [k.rsplit(".", 1)[-1] for k in siblings]
    # A misspelled old spelling is pointed at the current key, not at the old one.
    old = {k.rsplit(".", 1)[-1]: s.yaml.rsplit(".", 1)[-1] for k, s in ALIASES.items() if k.startswith(f"{parent}.")}
    near = difflib.get_close_matches(key.rsplit(".", 1)[-1], leaves + list(old), n=1, cutoff=0.7)
    if near:
        hint = f" (did you mean {parent + '.' if parent else ''}{old.get(near[0], near[0])}?)"
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
        if key in SCHEMA or key in ALIASES:
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
        if key == TOTAL_PAGES:
            values["_total_pages"] = read("int", v, key)
            continue
        s = SCHEMA.get(key) or ALIASES[key]
        if key in ALIASES:
            if s.yaml in flat:
                raise ConfigError(f"{key}: a deprecated spelling of {s.yaml}; give only {s.yaml}")
            _deprecated(key, s)
        values[s.name] = read(s.kind, v, key, s.choices)
    if "_total_pages" in values:
        if "pool_size" in values:
            raise ConfigError(f"{TOTAL_PAGES}: give total_pages or pool_size, not both")
        page_size = values.get("page_size", SETTINGS["page_size"].default())
        values["pool_size"] = values.pop("_total_pages") * page_size
    return values


def instance_config(config_path: str | None, instance: str | None) -> str | None:
    """``INSTANCE.yaml`` beside the config file, where it exists: one broker's own settings
    (``/etc/memory-broker/GPU-....yaml``), read over the shared file."""
    if not config_path or not instance or "/" in instance or instance.startswith("."):
        return None
    own = os.path.join(os.path.dirname(os.path.abspath(config_path)), f"{instance}.yaml")
    return own if os.path.isfile(own) and os.path.abspath(own) != os.path.abspath(config_path) else None


def build_options(config_path: str | None, overrides: dict[str, Any]) -> ServeOptions:
    """Defaults, then the file, then the instance's own file (``instance_config``), then flags
    (``overrides``: only flags given), then the per-GPU layout (``gpu_layout``). Validated; a bad
    value is named with where it came from: its key in the file (``memory_pool.page_size
    (page_size: ...)``), its flag (``page_size: ... (given as --page-size)``), or the key and
    flag that would change a default."""
    values: dict[str, Any] = load_config(config_path) if config_path else {}
    own = instance_config(config_path, overrides.get("instance"))
    if own:
        values.update(load_config(own))
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        opts = ServeOptions(**values)
        apply_gpu_layout(opts)
        opts.validate()
    except SettingError as e:
        # Say where the bad value came from, and so where to change it.
        s = SETTINGS.get(e.setting)
        if s is None:
            raise ConfigError(str(e)) from None
        if e.setting in overrides:
            raise ConfigError(f"{e} (given as {s.flag})") from None
        if s.yaml and e.setting in values:
            raise ConfigError(f"{s.yaml} ({e})") from None
        raise ConfigError(f"{e}; {s.name} is at its default: set {s.label}") from None
    return opts


def reload_changes(running: ServeOptions, new: ServeOptions) -> tuple[dict[str, Any], list[str]]:
    """What a reload may apply now, and the fields that changed but need a restart."""
    apply: dict[str, Any] = {}
    restart: list[str] = []
    for name in ServeOptions.model_fields:
        old, cur = getattr(running, name), getattr(new, name)
        if old != cur:
            (apply.__setitem__(name, cur) if name in RELOADABLE else restart.append(name))
    return apply, restart
