"""Module-name patterns of PEFT configs, matched in linear time.

PEFT matches ``target_modules`` and ``exclude_modules`` given as a string with
``re.fullmatch(pattern, module_name)``, and the keys of ``rank_pattern``/``alpha_pattern`` with
``re.match(rf"(.*\\.)?({key})$", module_name)``; a list matches a module by its exact name or a
``.name`` suffix. Whoever writes an adapter chooses both the patterns and the module names (the
tensor names), so Python's backtracking ``re`` would let one config stall the broker for as
long as its author likes (``model(?:[a-z_.0-9]|[a-z_.0-9])*Z`` doubles its time with every
character of a name, and holds the GIL while it runs). Here the same expressions are matched
by RE2 (``google-re2``), whose time is linear in the name, over bounded input: a pattern of at
most ``MAX_PATTERN_CHARS`` characters, compiled within ``RE2_MAX_MEM`` bytes, against names of at
most ``MAX_NAME_CHARS``. RE2 has no lookaround and no backreferences; a pattern that needs them
is refused with INVALID_ARGUMENT saying so, as are an over-long pattern and one too large to
compile.

Pure functions of their arguments; no file, store or registry access.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping

from memory_broker.proto.wire.errors import invalid, precondition

# Longest pattern accepted (real ones are tens of characters).
MAX_PATTERN_CHARS = 4096
# Longest module name (a tensor name less its suffix) matched; real ones are under 100.
MAX_NAME_CHARS = 1024
# Memory RE2 may use to compile one pattern (RE2's own default is 8 MiB).
RE2_MAX_MEM = 8 << 20
# Most keys of one rank_pattern / alpha_pattern (each is matched against every module).
MAX_PATTERN_KEYS = 1024
# An unescaped "{,n}" (searched in linear time: no nested repetition).
_OPEN_LOWER_BOUND = re.compile(r"(?<!\\)\{,\d")


@functools.lru_cache(maxsize=512)
def _compile(pattern: str):
    import re2

    opts = re2.Options()
    opts.log_errors = False
    opts.max_mem = RE2_MAX_MEM
    return re2.compile(pattern, opts)


def compile_pattern(pattern: str, where: str, what: str, show: bool = True):
    """``pattern`` compiled for linear-time matching (``what`` names it in refusals, followed by
    the pattern itself when ``show``).

    Raises:
        BrokerError(INVALID_ARGUMENT): too long, not a valid expression, or one RE2 cannot
            run (lookaround, backreferences) or compile within its memory bound.
    """
    if len(pattern) > MAX_PATTERN_CHARS:
        raise invalid(f"{where}: {what} is {len(pattern)} characters long; at most {MAX_PATTERN_CHARS} are accepted")
    shown = f" {_short(pattern)}" if show else ""
    if _OPEN_LOWER_BOUND.search(pattern):
        # Python reads {,n} as {0,n}, RE2 as the literal text: refused rather than read otherwise.
        raise invalid(f"{where}: {what}{shown} uses {{,n}}; write {{0,n}}")
    try:
        return _compile(pattern)
    except ImportError:
        raise precondition(
            f"{where}: {what} is a regular expression and this broker lacks google-re2, which matches them "
            "(install memory-broker[daemon]); or list the module names instead",
        ) from None
    except Exception as e:  # re2.error, with RE2's reason in bytes
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise invalid(
            f"{where}: {what}{shown} is not a regular expression the broker can match ({why}); "
            "patterns are matched in linear time (RE2 syntax): no lookaround, backreferences or "
            "possessive quantifiers, and repetition counts up to 1000"
        ) from None


def check_name(name: str, where: str) -> None:
    """Refuse a module name too long to match, or holding control characters."""
    if len(name) > MAX_NAME_CHARS:
        raise invalid(f"{where}: a tensor name is {len(name)} characters long; at most {MAX_NAME_CHARS} are accepted")
    if not name.isprintable():
        raise invalid(f"{where}: tensor name {_short(name)} holds control characters")


def _listed(names: list, name: str) -> bool:
    return name in names or any(name.endswith(f".{t}") for t in names)


def targets(tm: str | list, name: str, where: str) -> bool:
    """PEFT's test of ``target_modules`` for a module name ("all-linear" selects every one)."""
    if isinstance(tm, str):
        return tm == "all-linear" or compile_pattern(tm, where, "target_modules").fullmatch(name) is not None
    return _listed(tm, name)


def excluded(ex: str | list | None, name: str, where: str) -> bool:
    """PEFT's test of ``exclude_modules``."""
    if not ex:
        return False
    if isinstance(ex, str):
        return compile_pattern(ex, where, "exclude_modules").fullmatch(name) is not None
    return _listed(ex, name)


def pattern_value(patterns: Mapping, module_name: str, default, where: str, what: str):
    """PEFT's ``get_pattern_key``: (the value of the first key matching the end of the module's
    name, that key), or (``default``, None)."""
    for key, value in patterns.items():
        if compile_pattern(rf"(.*\.)?({key})$", where, f"{what} key {_short(key)}", show=False).match(module_name):
            return value, key
    return default, None


def check_patterns(cfg: Mapping, where: str) -> None:
    """Every pattern of a config compiled once (refused as ``compile_pattern`` says), and its
    pattern tables bounded, before any module name is matched."""
    for key in ("target_modules", "exclude_modules"):
        if isinstance(cfg.get(key), str):
            compile_pattern(cfg[key], where, key)
    for key in ("rank_pattern", "alpha_pattern"):
        table = cfg.get(key) or {}
        if len(table) > MAX_PATTERN_KEYS:
            raise invalid(f"{where}: {key} has {len(table)} keys; at most {MAX_PATTERN_KEYS} are accepted")
        for k in table:
            compile_pattern(rf"(.*\.)?({k})$", where, f"{key} key {_short(k)}", show=False)


def _short(text: str, limit: int = 120) -> str:
    """``repr`` of ``text``, cut to ``limit`` characters (messages quote what a caller sent)."""
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 3] + "..."
