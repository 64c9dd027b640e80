"""How one setting's value is written: sizes, durations, modes, uid and path lists, as a YAML
value or as a flag's text, and how a default is shown back to a person.

This module owns the readers (each refuses bad input with a message that starts with where
the value came from) and the shared constants; it knows nothing of which settings exist (that
is ``options.py``) and imports no third-party package, so ``memory-broker status`` and
``--version`` load it without pydantic.
"""

from __future__ import annotations

import os
import re
from typing import Any

from memory_broker.proto.wire.mapping import format_size

# Binary units only: a GPU page is 2 MiB, not 2 MB. The single letters (1G, 512K) are binary
# too, as in most memory flags; kB/MB/GB/TB are refused because they mean powers of ten to
# some readers and powers of two to others, and a pool size is no place to guess.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
}
_DECIMAL = {"kb": "KiB", "mb": "MiB", "gb": "GiB", "tb": "TiB"}

LOG_FORMATS = ("auto", "console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")

DEFAULT_SOCKET = os.environ.get("MEMORY_BROKER_SOCKET", "/tmp/memory-broker.sock")


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message names the key."""


def parse_size(text: str | int, what: str | None = None) -> int:
    """'2MiB' -> 2097152: bytes, or a number with K/KiB, M/MiB, G/GiB or T/TiB (binary).

    Raises:
        ValueError: not a size, a decimal unit (GB), or not a whole number of bytes; the
            message starts with ``what:`` when given.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    head = f"{what}: " if what else ""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if m and m.group(2).lower() in _DECIMAL:
        unit = _DECIMAL[m.group(2).lower()]
        raise ValueError(
            f"{head}{text!r}: decimal units (kB, MB, GB, TB) are not accepted; sizes are binary: "
            f"write {m.group(1)}{unit} ({m.group(1)} x 2^{_UNITS[unit.lower()].bit_length() - 1} bytes) "
            f"or a number of bytes"
        )
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{head}cannot read {text!r} as a size; write e.g. 2MiB, 512KiB, 1GiB or a number of bytes")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n != int(n):
        raise ValueError(f"{head}{text!r} is not a whole number of bytes ({n:g})")
    return int(n)


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


# ----------------------------------------------------------------- readers, by kind
#
# A kind is how a setting is written. ``read(kind, value, where)`` reads a YAML value (already
# typed by the YAML parser) or a flag's text (a str, or a list of str for a repeated flag).
# ``where`` starts the message: the YAML key for a file, the flag for the command line. (Flags
# of int, float and uid kinds are typed by argparse itself, as they always were.)


def _size(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ConfigError(f"{where}: expected a size like 2MiB or a number of bytes, got {v!r}")
    try:
        return parse_size(v, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where}: expected an integer, got {v!r}")
    return v


def _float(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {v!r}")
    return float(v)


def _bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: expected true or false, got {v!r}")
    return v


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{where}: expected a non-empty string, got {v!r}")
    return v


def _text(v: Any, where: str) -> str:
    """A string that YAML may have read as a number (a device index: ``device: 0``)."""
    return _str(str(v) if isinstance(v, int) and not isinstance(v, bool) else v, where)


def _uids(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in v):
        raise ConfigError(f"{where}: expected a list of uids (non-negative integers), got {v!r}")
    return tuple(v)


def _paths(v: Any, where: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(p, str) and p.startswith("/") for p in v):
        raise ConfigError(f"{where}: expected a list of absolute directory paths, got {v!r}")
    return tuple(v)


# A tenant pool as the schema holds it: (name, uids, gids, bytes).
Tenant = tuple[str, tuple[int, ...], tuple[int, ...], int]
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_TENANT_KEYS = ("name", "uids", "gids", "bytes")


def _tenant_fields(v: Any, where: str) -> dict:
    """One tenant's fields from a YAML mapping or a flag's ``NAME:uids=1,2:gids=3:bytes=8GiB``."""
    if isinstance(v, dict):
        return v
    if not isinstance(v, str):
        raise ConfigError(f"{where}: expected a tenant like {{name: teamA, uids: [1001], bytes: 8GiB}}, got {v!r}")
    name, *parts = v.split(":")
    out: dict[str, Any] = {"name": name}
    for part in parts:
        key, eq, text = part.partition("=")
        if not eq or key not in _TENANT_KEYS[1:]:
            raise ConfigError(f"{where}: {part!r} in {v!r}; write NAME:uids=1001,1002:gids=2000:bytes=8GiB")
        try:
            out[key] = text if key == "bytes" else [int(x) for x in text.split(",") if x]
        except ValueError:
            raise ConfigError(f"{where}: {key}={text!r} in {v!r} is not a list of numbers like 1001,1002") from None
    return out


def _tenants(v: Any, where: str) -> tuple[Tenant, ...]:
    """Tenant pools: a YAML list of mappings, or a repeated flag's texts."""
    if not isinstance(v, list):
        raise ConfigError(f"{where}: expected a list of tenants (name, uids, gids, bytes), got {v!r}")
    out: list[Tenant] = []
    for i, item in enumerate(v):
        f = _tenant_fields(item, f"{where}[{i}]")
        name = f.get("name")
        at = f"{where}[{name if isinstance(name, str) and name else i}]"
        if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
            raise ConfigError(f"{at}.name: expected 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in (t[0] for t in out):
            raise ConfigError(f"{at}.name: tenant {name!r} is named twice")
        if set(f) - set(_TENANT_KEYS):
            raise ConfigError(f"{at}: unknown keys {sorted(set(f) - set(_TENANT_KEYS))}; a tenant has {_TENANT_KEYS}")
        uids = _uids(f.get("uids", []), f"{at}.uids")
        gids = _uids(f.get("gids", []), f"{at}.gids")
        if not uids and not gids:
            raise ConfigError(f"{at}: give uids or gids (or both): the processes whose sessions use this pool")
        if "bytes" not in f:
            raise ConfigError(f"{at}.bytes: missing; the pool's size, whole slabs (e.g. 8GiB)")
        size = _size(f["bytes"], f"{at}.bytes")
        out.append((name, uids, gids, size))
    return tuple(out)


# An engine's limits as the schema holds them: (name, floor bytes, ceiling bytes, weight).
EngineEntry = tuple[str, int, int, float]
_ENGINE_KEYS = ("name", "floor", "ceiling", "weight")


def _engine_fields(v: Any, where: str) -> dict:
    """One engine's fields from a YAML mapping or a flag's ``NAME:floor=1GiB:ceiling=6GiB:weight=2``."""
    if isinstance(v, dict):
        return v
    if not isinstance(v, str):
        raise ConfigError(f"{where}: expected an engine like {{name: llama, floor: 1GiB, ceiling: 6GiB}}, got {v!r}")
    name, *parts = v.split(":")
    out: dict[str, Any] = {"name": name}
    for part in parts:
        key, eq, text = part.partition("=")
        if not eq or key not in _ENGINE_KEYS[1:]:
            raise ConfigError(f"{where}: {part!r} in {v!r}; write NAME:floor=1GiB:ceiling=6GiB:weight=1")
        out[key] = text
    return out


def _engines(v: Any, where: str) -> tuple[EngineEntry, ...]:
    """Engines' KV limits (engine_pool.engines): a YAML list of mappings, or a repeated flag's texts."""
    if not isinstance(v, list):
        raise ConfigError(f"{where}: expected a list of engines (name, floor, ceiling, weight), got {v!r}")
    out: list[EngineEntry] = []
    for i, item in enumerate(v):
        f = _engine_fields(item, f"{where}[{i}]")
        name = f.get("name")
        at = f"{where}[{name if isinstance(name, str) and name else i}]"
        if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
            raise ConfigError(f"{at}.name: expected 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in (e[0] for e in out):
            raise ConfigError(f"{at}.name: engine {name!r} is named twice")
        if set(f) - set(_ENGINE_KEYS):
            raise ConfigError(f"{at}: unknown keys {sorted(set(f) - set(_ENGINE_KEYS))}; an engine has {_ENGINE_KEYS}")
        floor = _size(f.get("floor", 0), f"{at}.floor")
        ceiling = _size(f.get("ceiling", 0), f"{at}.ceiling")
        w = f.get("weight", 1.0)
        try:
            w = float(w) if isinstance(w, str) else w
        except ValueError:
            raise ConfigError(f"{at}.weight: expected a number, got {w!r}") from None
        weight = _float(w, f"{at}.weight")
        if ceiling and floor > ceiling:
            raise ConfigError(f"{at}: floor {format_size(floor)} is above ceiling {format_size(ceiling)}")
        if not weight > 0:
            raise ConfigError(f"{at}.weight: must be > 0, got {weight}")
        out.append((name, floor, ceiling, weight))
    return tuple(out)


def _mode(v: Any, where: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        # YAML reads 0660 as octal-looking decimal 660 only if quoted oddly; accept ints < 0o1000.
        if 0 <= v < 0o1000:
            return v
    if isinstance(v, str) and re.fullmatch(r"0?[0-7]{3}", v):
        return int(v, 8)
    raise ConfigError(f'{where}: expected a file mode like "0660", got {v!r}')


_READERS = {
    "size": _size,
    "duration": parse_duration,
    "int": _int,
    "float": _float,
    "bool": _bool,
    "str": _str,
    "text": _text,
    "uids": _uids,
    "paths": _paths,
    "mode": _mode,
    "tenants": _tenants,
    "engines": _engines,
}
KINDS = frozenset({*_READERS, "choice"})


def read(kind: str, v: Any, where: str, choices: tuple[str, ...] = ()) -> Any:
    """One value of ``kind`` from a YAML value or a flag's text. Raises ConfigError."""
    if kind == "choice":
        if v not in choices:
            raise ConfigError(f"{where}: {v!r} is not one of {', '.join(choices)}")
        return v
    return _READERS[kind](v, where)


def show(kind: str, v: Any) -> str:
    """A value as a person writes it (``2MiB``, ``30s``, ``[1000, 1001]``): help and examples."""
    if v is None:
        return "none"
    if kind == "size":
        text = format_size(v)
        return str(v) if text.endswith(" B") else text.replace(" ", "")
    if kind == "duration":
        return f"{v / 60:g}m" if v >= 60 and v % 60 == 0 else f"{v:g}s"
    if kind == "bool":
        return "true" if v else "false"
    if kind == "mode":
        return f'"{v:04o}"'
    if kind in ("uids", "paths"):
        return "[" + ", ".join(str(x) for x in v) + "]"
    if kind == "tenants":
        return (
            "["
            + ", ".join(
                f"{{name: {n}, uids: {list(u)}, gids: {list(g)}, bytes: {show('size', b)}}}" for n, u, g, b in v
            )
            + "]"
        )
    if kind == "engines":
        return (
            "["
            + ", ".join(
                f"{{name: {n}, floor: {show('size', f)}, ceiling: {show('size', c)}, weight: {w:g}}}"
                for n, f, c, w in v
            )
            + "]"
        )
    if kind == "float":
        return f"{v:.2f}" if v < 1 else f"{v:g}"
    return str(v)
