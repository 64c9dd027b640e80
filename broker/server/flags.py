"""``memory-broker serve``'s flags, generated from the settings schema (``options.SETTINGS``):
one flag per setting, in the schema's order, and the reverse, flags given -> option values.

The command line's other commands and options stay in ``cli.py``; this module declares no
setting and imports the schema (pydantic) only when serve's flags are wanted.
"""

from __future__ import annotations

import argparse


def add_serve_options(p: argparse.ArgumentParser) -> None:
    """serve's flags, one per setting of the schema (``options.SETTINGS``), in its order."""
    from memory_broker.broker.server.options import SETTINGS, SHORTHANDS

    p.add_argument("--config", metavar="FILE", help="YAML configuration file (see ops/broker.example.yaml)")
    for s in SETTINGS.values():
        if not s.flag:
            continue
        if s.kind == "bool":
            p.add_argument(s.flag, action="store_true", help=s.help)
            continue
        kw: dict = {"metavar": s.metavar, "help": f"{s.help} (default {s.shown_default()})"}
        if s.choices:
            kw = {"choices": s.choices, "help": kw["help"]}
        elif s.kind in ("int", "float", "uids"):
            kw["type"] = float if s.kind == "float" else int
        if s.kind in ("uids", "paths", "tenants", "engines"):
            kw["action"] = "append"
        p.add_argument(s.flag, **kw)
    for flag, (_, _, help) in SHORTHANDS.items():
        p.add_argument(flag, choices=SETTINGS["adapter_hot_policy"].choices, help=help)


def flag_overrides(a: argparse.Namespace) -> dict:
    """The options given as flags (argparse leaves absent flags out of the namespace).

    Raises:
        ValueError: a flag's value cannot be read; the message starts with the flag.
    """
    from memory_broker.broker.server.options import SETTINGS, SHORTHANDS
    from memory_broker.broker.server.values import read

    out = {}
    for dest, names, _ in SHORTHANDS.values():
        if hasattr(a, dest):
            out.update(dict.fromkeys(names, getattr(a, dest)))
    for s in SETTINGS.values():
        dest = s.flag[2:].replace("-", "_") if s.flag else None
        if dest is None or not hasattr(a, dest):
            continue
        v = getattr(a, dest)
        if s.kind == "bool":
            v = not s.flag.startswith("--no-")  # store_true: given means on, or off for --no-X
        elif s.kind == "uids":
            v = tuple(v)
        elif s.kind in ("size", "duration", "mode", "paths", "tenants", "engines"):
            v = read(s.kind, v, s.flag)
        out[s.name] = v
    if getattr(a, "json", False):
        if out.get("log_format", "json") != "json":
            raise ValueError(f"--json means --log-format json; it contradicts --log-format {out['log_format']}")
        out["log_format"] = "json"
    return out
