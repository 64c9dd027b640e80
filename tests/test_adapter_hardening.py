"""Issue 26, the adapter wing: no adapter config stalls the broker (target patterns matched in
linear time), absurd numbers in a config are INVALID_ARGUMENT, an adapter above the per-adapter
size limit is refused at registration before any conversion, and a full disk answers
RESOURCE_EXHAUSTED naming the path and the free bytes. A refusal changes nothing."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

import pytest
from adapter_fixtures import AdapterHarness, copy_adapter, edit_config, peft_dirs, run  # noqa: F401 - fixture
from conftest import short_tmpdir

from memory_broker.broker.adapters import inspect_peft_dir
from memory_broker.clients import BrokerClient
from memory_broker.proto.wire.errors import BrokerError, Code

# Catastrophic backtracking for Python's re: every character of a module name after "model"
# doubles the time (5 s for "model.layers.0.self_attn.q_proj" on this machine).
REDOS = "model(?:[a-z_.0-9]|[a-z_.0-9])*Z"


def _adapter(peft_dirs, name: str = "r4", **config) -> str:  # noqa: F811
    d = copy_adapter(peft_dirs[name], os.path.join(short_tmpdir(), "adapter"))
    if config:
        edit_config(d, **config)
    return d


# ------------------------------------------------------------------- 2. ReDoS


def test_redos_patterns_are_answered_within_100ms_and_a_bystander_keeps_its_latency(broker_factory, peft_dirs):  # noqa: F811
    b = broker_factory()
    evil = [
        _adapter(peft_dirs, target_modules=REDOS),
        _adapter(peft_dirs, rank_pattern={REDOS: 4}),
        _adapter(peft_dirs, exclude_modules=REDOS),
    ]
    with BrokerClient.connect(b.socket, client_name="owner") as owner, BrokerClient.connect(b.socket) as by:
        owner.register_adapter("warm-up", peft_dirs["r4"])  # first-call costs (imports) out of the way
        by.stats()
        stop = threading.Event()
        lat: list[float] = []

        def bystander():
            while not stop.is_set():
                t = time.perf_counter()
                by.stats()
                lat.append(time.perf_counter() - t)

        t = threading.Thread(target=bystander)
        t.start()
        took, answers = [], []
        try:
            for i in range(5):
                for j, d in enumerate(evil):
                    t0 = time.perf_counter()
                    try:
                        owner.register_adapter(f"evil-{i}-{j}", d)
                        answers.append("OK")
                    except BrokerError as e:
                        answers.append(e.code)
                        assert e.code == Code.INVALID_ARGUMENT and "target_modules" in e.message, e
                    took.append(time.perf_counter() - t0)
        finally:
            stop.set()
            t.join()
        # target_modules selects nothing (no module name ends in Z): refused; the rank pattern
        # matches no module (the default rank applies) and nothing is excluded: registered.
        assert answers[:3] == [Code.INVALID_ARGUMENT, "OK", "OK"], answers
        assert statistics.median(took) < 0.1 and max(took) < 1.0, took
        assert len(lat) > 10 and max(lat) < 0.5, (len(lat), max(lat))
        want = sorted([f"evil-{i}-{j}" for i in range(5) for j in (1, 2)] + ["warm-up"])
        assert [a.adapter_id for a in owner.list_adapters().adapters] == want


def test_patterns_keep_peft_semantics_and_unmatchable_ones_are_refused(peft_dirs):  # noqa: F811
    # A full match of the string, as PEFT's re.fullmatch: both modules selected.
    meta = inspect_peft_dir(_adapter(peft_dirs, target_modules=r".*\.(q_proj|v_proj)"))
    assert meta.target_modules == ("q_proj", "v_proj")
    # A rank_pattern key matches the end of the name after a dot, as PEFT's get_pattern_key.
    meta = inspect_peft_dir(_adapter(peft_dirs, "pattern"))
    assert {(w.layer, w.module): w.rank for w in meta.weights}[(1, "q_proj")] == 4
    for cfg, words in [
        (dict(target_modules=r"(?=.*q_proj).*"), "no lookaround"),
        (dict(target_modules=r"(q)\1"), "backreferences"),
        (dict(target_modules="x" * 5000), "at most 4096"),
        (dict(rank_pattern={"a{1000}{1000}": 4}), "repetition"),
        (dict(rank_pattern={f"k{i}": 4 for i in range(2000)}), "at most 1024"),
    ]:
        with pytest.raises(BrokerError) as e:
            inspect_peft_dir(_adapter(peft_dirs, **cfg))
        assert e.value.code == Code.INVALID_ARGUMENT and words in e.value.message, e.value.message


# ----------------------------------------------------------- 4. absurd numbers


@pytest.mark.parametrize(
    "text, words",
    [
        ('"r": ' + "9" * 500_000, "number too long"),
        ('"r": ' + "9" * 4000, "r is 9999"),
        ('"lora_alpha": ' + "9" * 4000, "lora_alpha is 9999"),
        ('"lora_alpha": 1e999', "lora_alpha is inf"),
        ('"r": 1e3', "r is 1000.0"),
        ('"rank_pattern": {"q_proj": ' + "9" * 400 + "}", "rank_pattern['q_proj'] is 999"),
        ('"alpha_pattern": {"q_proj": ' + "9" * 400 + "}", "alpha_pattern['q_proj'] is 999"),
        ('"layers_to_transform": [[1]]', "layers_to_transform is [[1]]"),
        ('"layers_to_transform": {"a": 1}', "layers_to_transform is"),
        ('"exclude_modules": 7', "exclude_modules must be"),
    ],
)
def test_absurd_numbers_and_types_in_a_config_are_invalid_argument(peft_dirs, text, words):  # noqa: F811
    d = _adapter(peft_dirs)
    path = os.path.join(d, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    key = text.split('"')[1]
    cfg.pop(key, None)
    body = json.dumps(cfg)
    with open(path, "w") as f:
        f.write(body[:-1] + ", " + text + "}")
    with pytest.raises(BrokerError) as e:
        inspect_peft_dir(d)
    assert e.value.code == Code.INVALID_ARGUMENT and words in e.value.message, e.value.message
    assert len(e.value.message) < 2000
