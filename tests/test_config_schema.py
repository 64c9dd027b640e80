"""The one configuration schema (``broker/server/options.py``): every setting declared once, and
its flag, its YAML key, its messages and its line in ``ops/broker.example.yaml`` all follow
from that declaration; old spellings still read, said once."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import ROOT, start_broker

from memory_broker.broker.cli import build_parser
from memory_broker.broker.server import config as config_mod
from memory_broker.broker.server.config import (
    ALIASES,
    RELOADABLE,
    SCHEMA,
    SECTIONS,
    ConfigError,
    build_options,
    deprecation_notes,
    load_config,
)
from memory_broker.broker.server.flags import flag_overrides
from memory_broker.broker.server.options import SETTINGS, SHORTHANDS, ServeOptions, SettingError
from memory_broker.broker.server.values import read

EXAMPLE = os.path.join(ROOT, "ops", "broker.example.yaml")


# ----------------------------------------------------------------- the schema itself


def test_every_setting_has_one_yaml_key_one_flag_and_help():
    yamls = [s.yaml for s in SETTINGS.values() if s.yaml]
    flags = [s.flag for s in SETTINGS.values() if s.flag] + list(SHORTHANDS)
    assert len(yamls) == len(set(yamls)) and len(flags) == len(set(flags))
    for s in SETTINGS.values():
        assert s.help, s.name
        assert s.yaml or s.flag, s.name
        # The one-name rule: the field is the flag's name, bar the three old shorthands.
        if s.flag and s.flag not in ("--lease", "--grace", "--allow-uid") and not s.flag.startswith("--no-"):
            assert s.flag[2:].replace("-", "_") in (s.name, s.name.removesuffix("_s"), s.name.removesuffix("s")), s
        # The adapters section drops the field's adapter_ prefix: AdapterConfig's names.
        if s.yaml and s.yaml.startswith("adapters."):
            assert s.yaml == "adapters." + s.name.removeprefix("adapter_"), s
    # Every serve flag comes from the schema (plus --config, --json and --help).
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    got = {o for act in serve._actions for o in act.option_strings}
    assert got == set(flags) | {"--config", "--json", "-h", "--help"}


def test_a_setting_is_named_by_its_yaml_key_and_flag():
    assert SETTINGS["hot_tier_adapters"].label == "adapters.hot_tier_adapters (--hot-tier-adapters)"
    assert SETTINGS["default_lease_s"].label == "memory_pool.transactions.default_lease (--lease)"
    assert SETTINGS["instance"].label == "--instance"


def test_what_sighup_may_change_is_declared_on_the_settings():
    assert RELOADABLE == {
        "high_watermark",
        "low_watermark",
        "default_lease_s",
        "allowed_uids",
        "log_level",
        "max_pins_per_session",
        "grace_s",
        "status_interval_s",
        "adapter_manager_uids",
        "max_sessions",
        "max_sessions_per_uid",
        "request_bytes_in_flight",
        "large_requests",
    }


# Per kind, a value written in a file and the same value as a flag's text.
SAMPLES = {
    "size": ("8MiB", "8MiB"),
    "duration": ("45s", "45s"),
    "int": (3, "3"),
    "float": (0.5, "0.5"),
    "choice": (None, None),
    "str": ("/tmp/x.sock", "/tmp/x.sock"),
    "text": (1, "1"),
    "uids": ([1000, 1001], ["1000", "1001"]),
    "paths": (["/a", "/b"], ["/a", "/b"]),
    "mode": ("0640", "0640"),
    "tenants": (
        [
            {"name": "teamA", "uids": [1001, 1002], "bytes": "64MiB"},
            {"name": "teamB", "gids": [2000], "bytes": "32MiB"},
        ],
        ["teamA:uids=1001,1002:bytes=64MiB", "teamB:gids=2000:bytes=32MiB"],
    ),
    "engines": (
        [{"name": "llama", "floor": "16MiB", "ceiling": "64MiB", "weight": 2}, {"name": "canary"}],
        ["llama:floor=16MiB:ceiling=64MiB:weight=2", "canary"],
    ),
}


def _as_yaml(key: str, value) -> str:
    doc: dict = {}
    node = doc
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return yaml.safe_dump(doc)


@pytest.mark.parametrize("name", [n for n, s in SETTINGS.items() if s.yaml and s.flag and s.kind != "bool"])
def test_a_value_means_the_same_in_the_file_and_as_a_flag(tmp_path, name):
    s = SETTINGS[name]
    in_file, as_flag = SAMPLES[s.kind]
    if s.kind == "choice":
        in_file = as_flag = s.choices[-1]
    p = tmp_path / "broker.yaml"
    p.write_text(_as_yaml(s.yaml, in_file))
    argv = ["serve"]
    for text in as_flag if isinstance(as_flag, list) else [as_flag]:
        argv += [s.flag, text]
    from_file = load_config(str(p))[name]
    from_flag = flag_overrides(build_parser().parse_args(argv))[name]
    assert from_file == from_flag and from_file != s.default()


@pytest.mark.parametrize("name", [n for n, s in SETTINGS.items() if s.yaml and s.kind == "bool"])
def test_a_switch_flag_sets_what_its_yaml_key_sets(tmp_path, name):
    s = SETTINGS[name]
    p = tmp_path / "broker.yaml"
    p.write_text(_as_yaml(s.yaml, not s.default()))
    assert load_config(str(p))[name] == flag_overrides(build_parser().parse_args(["serve", s.flag]))[name]


def test_the_policy_shorthand_sets_both_tiers_and_a_tier_flag_wins():
    over = flag_overrides(
        build_parser().parse_args(["serve", "--adapter-policy", "lru", "--adapter-warm-policy", "gdsf"])
    )
    assert over["adapter_hot_policy"] == "lru" and over["adapter_warm_policy"] == "gdsf"


# ----------------------------------------------------------------- messages


@pytest.mark.parametrize(
    "doc,words",
    [
        ("listeners:\n  metrics_port: 70000\n", "listeners.metrics_port (metrics_port: 70000; must be 0..65535)"),
        ("security:\n  max_sessions: -1\n", "security.max_sessions (max_sessions: -1; must be >= 0 (0 = no limit))"),
        (
            "listeners:\n  idle_timeout: 0.5s\n",
            "listeners.idle_timeout (idle_timeout_s: 0.5; must be 1..86400 seconds)",
        ),
        ("memory_pool:\n  window_factor: 65\n", "memory_pool.window_factor (window_factor: 65; must be 1..64)"),
        ("adapters:\n  hot_tier_adapters: -2\n", "adapters.hot_tier_adapters (hot_tier_adapters: -2; must be >= 0)"),
        ("adapters:\n  hot_policy: mru\n", "adapters.hot_policy: 'mru' is not one of adaptive, lru, lfu, gdsf"),
        ("adapters:\n  hot_tier_budgets: 1\n", "did you mean adapters.hot_tier_adapters?"),
    ],
)
def test_a_bad_value_in_the_file_names_its_key_and_the_bound(tmp_path, doc, words):
    p = tmp_path / "broker.yaml"
    p.write_text(doc)
    with pytest.raises(ConfigError) as e:
        build_options(str(p), {})
    assert words in str(e.value)


def test_a_bad_flag_value_names_the_setting_and_the_bound():
    with pytest.raises(ConfigError, match=r"^window_factor: 99; must be 1\.\.64 \(given as --window-factor\)$"):
        build_options(None, flag_overrides(build_parser().parse_args(["serve", "--window-factor", "99"])))
    # A default that no longer fits what was given: named with the key and flag that change it.
    with pytest.raises(ConfigError) as e:
        build_options(None, flag_overrides(build_parser().parse_args(["serve", "--slab-size", "48MiB"])))
    assert str(e.value) == (
        "pool_size: 1073741824 bytes must be a positive multiple of slab_size (50331648); "
        "pool_size is at its default: set memory_pool.pool_size (--pool-size)"
    )
    with pytest.raises(ValueError, match=r"^--idle-timeout: cannot read 'soon' as a duration"):
        flag_overrides(build_parser().parse_args(["serve", "--idle-timeout", "soon"]))


def test_options_check_types_and_bounds_when_built_and_when_changed():
    with pytest.raises(SettingError, match="tcp_port: 70000; must be 0..65535"):
        ServeOptions(tcp_port=70000)
    with pytest.raises(SettingError, match="pool_size: input should be a valid integer"):
        ServeOptions(pool_size="1GiB")
    with pytest.raises(SettingError, match="not a setting"):
        ServeOptions(hot_budget_adapters=1)
    opts = ServeOptions()
    with pytest.raises(SettingError, match="high_watermark: 1.5; must be in \\(0, 1\\]"):
        opts.high_watermark = 1.5
    assert opts.high_watermark == 0.90  # refused: nothing changed
    opts.high_watermark = 0.95
    assert opts.high_watermark == 0.95


# ----------------------------------------------------------------- deprecated spellings


def test_an_old_yaml_spelling_still_reads_and_is_said_once(tmp_path, monkeypatch):
    monkeypatch.setattr(config_mod, "_said", set())
    deprecation_notes()
    p = tmp_path / "broker.yaml"
    p.write_text("adapters:\n  hot_tier_budget: 3\n")
    assert build_options(str(p), {}).hot_tier_adapters == 3
    assert build_options(str(p), {}).hot_tier_adapters == 3  # a reload reads it again ...
    notes = deprecation_notes()
    assert notes == ["adapters.hot_tier_budget is deprecated; write adapters.hot_tier_adapters (--hot-tier-adapters)"]
    assert deprecation_notes() == []  # ... and says nothing new
    p.write_text("adapters:\n  hot_tier_budget: 3\n  hot_tier_adapters: 4\n")
    with pytest.raises(ConfigError, match="deprecated spelling of adapters.hot_tier_adapters; give only"):
        load_config(str(p))
    assert set(ALIASES) == {"adapters.hot_tier_budget"}


def test_the_daemon_logs_an_old_spelling_as_a_warning(tmp_path):
    p = tmp_path / "broker.yaml"
    p.write_text("adapters:\n  hot_tier_budget: 3\n")
    b = start_broker("--config", str(p))
    try:
        said = [e for e in b.log_events() if e.get("event") == "deprecated_setting"]
        assert [e["detail"] for e in said] == [
            "adapters.hot_tier_budget is deprecated; write adapters.hot_tier_adapters (--hot-tier-adapters)"
        ]
        assert said[0]["level"] == "warning"
        # A reload reads the old spelling again (a new value is applied) without saying it again.
        p.write_text("adapters:\n  hot_tier_budget: 3\nshutdown:\n  grace: 7s\n")
        b.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not any(e.get("event") == "reloaded" for e in b.log_events()) and time.monotonic() < deadline:
            time.sleep(0.05)
        (reloaded,) = [e for e in b.log_events() if e.get("event") == "reloaded"]
        assert reloaded["applied"] == {"grace_s": 7.0} and reloaded["needs_restart"] == []
        assert len([e for e in b.log_events() if e.get("event") == "deprecated_setting"]) == 1
    finally:
        assert b.stop() == 0


# ----------------------------------------------------------------- ops/broker.example.yaml


def example_keys(text: str) -> tuple[dict[str, dict], list[str]]:
    """Each key the example shows (set or commented out) -> {"value", "commented", "doc"}: its
    value's text, and the comment block above it (shared by the keys right after it)."""
    keys: dict[str, dict] = {}
    problems: list[str] = []
    stack: list[str] = []
    doc: list[str] = []
    after_key = False
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            doc, after_key = [], False
            continue
        m = re.match(r"^(\s*)(#\s*)?([a-z_0-9]+):(?:\s+(.*))?$", line)
        depth = len(m.group(1)) // 2 if m else 0
        path = ".".join([*stack[:depth], m.group(3)]) if m else ""
        if m and (not m.group(2) or path in SCHEMA or path in ALIASES):
            if m.group(4) is None and not m.group(2):  # a section
                stack[depth:] = [m.group(3)]
                doc, after_key = [], False
                continue
            if path in keys:
                problems.append(f"line {n}: {path} shown twice")
            keys[path] = {"value": m.group(4), "commented": bool(m.group(2)), "doc": " ".join(doc)}
            after_key = True
        elif line.lstrip().startswith("#"):
            if after_key:
                doc, after_key = [], False
            doc.append(line.strip().lstrip("#").strip())
    return keys, problems


def check_example(text: str, schema: dict = SCHEMA) -> list[str]:
    """What is wrong with the example against the schema: a key missing or unknown, a value
    that is not the default, a [reload] mark that does not match."""
    keys, problems = example_keys(text)
    problems += [f"{k}: in the schema, not in the example" for k in schema if k not in keys]
    problems += [f"{k}: in the example, not in the schema" for k in keys if k not in schema]
    for key, got in keys.items():
        s = schema.get(key)
        if s is None:
            continue
        if ("[reload]" in got["doc"]) != s.reload:
            problems.append(f"{key}: [reload] {'missing' if s.reload else 'marked'} in its comment")
        # The value shown is the default (the socket and state dir defaults follow the environment).
        if not got["commented"] and s.name not in ("socket", "state_dir"):
            if read(s.kind, yaml.safe_load(got["value"]), key, s.choices) != s.default():
                problems.append(f"{key}: shows {got['value']}, the default is {s.shown_default()}")
    return problems


def test_the_example_config_shows_every_key_with_its_default_and_reload_mark():
    text = open(EXAMPLE).read()
    assert check_example(text) == []
    assert not set(ALIASES) & set(example_keys(text)[0])  # old spellings are not taught


def test_the_example_check_fails_for_a_setting_without_an_example_line():
    text = open(EXAMPLE).read()
    extra = dict(SCHEMA, **{"adapters.new_knob": SETTINGS["warm_int8"]})
    assert check_example(text, extra) == ["adapters.new_knob: in the schema, not in the example"]
    assert "memory_pool.slab_size: in the schema, not in the example" in check_example(
        re.sub(r"^  slab_size: .*\n", "", text, flags=re.M)
    )
    assert "memory_pool.pool_size: shows 2GiB, the default is 1GiB" in check_example(
        text.replace("pool_size: 1GiB", "pool_size: 2GiB")
    )
    wrong = text.replace("# [reload] Most pins", "# Most pins")
    assert check_example(wrong) == ["memory_pool.pinning.max_pins_per_session: [reload] missing in its comment"]


def test_every_section_of_the_schema_is_a_section_of_the_example():
    doc = yaml.safe_load(open(EXAMPLE))
    top = {k.split(".")[0] for k in SECTIONS}
    assert top <= set(doc)


# ----------------------------------------------------------------- start-up cost


def test_only_serve_imports_the_schema_library():
    code = (
        "import sys; from memory_broker.broker.cli import build_parser; a = build_parser().parse_args(sys.argv[1:]);"
        " print('pydantic' in sys.modules)"
    )
    for argv, loaded in ((["status"], "False"), (["adapters", "list"], "False"), (["serve"], "True")):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.stdout.strip() == loaded, (argv, r.stdout, r.stderr)
