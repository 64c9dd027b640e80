"""The vLLM LoRA integration's parts that run without vLLM: adapter identity, the plugin's
off switch and version fallback, the process's leases, the weight copies, and the zero-copy
step against the weights in the PEFT files (a real broker, no engine)."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
from conftest import short_tmpdir, start_broker
from safetensors.torch import load_file

from memory_broker.clients import BrokerClient
from memory_broker.clients.step.adapters import AdapterTables
from memory_broker.clients.vllm import identity, lora_patches, lora_plugin, tiny_model
from memory_broker.clients.vllm.lora_source import BrokerAdapters
from memory_broker.clients.vllm.lora_zero_copy import LayerAddress, StaticStepBuffers, StepHolder, ZeroCopyStep
from memory_broker.proto.wire.errors import BrokerError

HIDDEN = tiny_model.LLAMA["hidden_size"]
KV = HIDDEN // tiny_model.LLAMA["num_attention_heads"] * tiny_model.LLAMA["num_key_value_heads"]


@pytest.fixture(scope="module")
def adapters():
    """A float32-adapter broker with two tiny adapters registered (a1, a2) and their files."""
    tmp = short_tmpdir()
    dirs = {n: tiny_model.build_lora(os.path.join(tmp, n), seed) for seed, n in enumerate(("a1", "a2"), start=1)}
    broker = start_broker("--pool-size", "64MiB", "--slab-size", "16MiB", "--adapter-dtype", "float32")
    with BrokerClient.connect(broker.socket, client_name="test") as c:
        for n, d in dirs.items():
            c.register_adapter(n, d)
    yield broker, dirs
    broker.stop()


def _pins(socket: str) -> dict[str, int]:
    with BrokerClient.connect(socket, client_name="test") as c:
        return {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}


def _file_weights(path: str, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor]:
    t = load_file(os.path.join(path, "adapter_model.safetensors"))
    pre = f"base_model.model.model.layers.{layer}.self_attn.{module}"
    return t[f"{pre}.lora_A.weight"], t[f"{pre}.lora_B.weight"]


def test_broker_lora_paths_name_adapters_and_get_stable_ids():
    assert identity.broker_adapter_id("broker://tenant/a-1") == "tenant/a-1"
    assert identity.broker_adapter_id("/models/lora1") is None
    assert identity.broker_adapter_id(None) is None
    with pytest.raises(ValueError, match="names no adapter"):
        identity.broker_adapter_id("broker://")
    a, b = identity.broker_lora_int_id("a1"), identity.broker_lora_int_id("a2")
    assert a == identity.broker_lora_int_id("a1") and a != b and 0 < a < 2**31
    # The KV connector's keys: a broker adapter is its id, whatever number an engine gave it.
    assert identity.lora_identity(("a1", a, "broker://a1")) == identity.lora_identity(("a1", 3, "broker://a1"))
    assert identity.lora_identity(("a1", a, "broker://a1")) != identity.lora_identity(("a2", b, "broker://a2"))
    assert identity.lora_identity(("a1", a, "broker://a1")) != identity.lora_identity(("a1", a, "/loras/a1"))
    assert identity.lora_identity(("a1", 1, "/loras/a1")) != identity.lora_identity(("a1", 2, "/loras/a1"))


def test_plugin_does_nothing_without_the_broker_socket(monkeypatch):
    monkeypatch.delenv("MEMORY_BROKER_SOCKET", raising=False)
    monkeypatch.setattr(lora_plugin, "_done", False)
    monkeypatch.setattr(lora_patches, "_state", None)
    lora_plugin.register()
    assert lora_patches.state() is None


def test_patches_fall_back_to_vllm_with_a_warning_on_another_vllm(monkeypatch, caplog):
    def other(found=None):
        raise ImportError("memory_broker.clients.vllm supports vLLM >=0.32,<0.33; vllm 0.40.0 is installed")

    monkeypatch.setattr(lora_patches, "_state", None)
    monkeypatch.setattr(lora_patches, "check_vllm_version", other)
    with caplog.at_level(logging.WARNING, logger="vllm.memory_broker.lora"):
        assert lora_patches.install("/tmp/none.sock") is False
    assert lora_patches.state() is None
    assert "vLLM loads adapters its own way" in caplog.text and "0.40.0" in caplog.text
    with pytest.raises(ValueError, match="zero-copy"):
        lora_patches.install("/tmp/none.sock", mode="fast")


def test_leases_follow_what_vllm_holds(adapters):
    broker, _ = adapters
    src = BrokerAdapters(broker.socket)
    try:
        src.acquire("a1", 7)
        src.acquire("a1", 9)  # the OpenAI server may number one adapter twice: still one lease
        src.acquire("a2", 8)
        assert _pins(broker.socket) == {"a1": 1, "a2": 1}
        assert src.adapter(7).adapter_id == "a1" and src.adapter(5) is None and src.adapter(None) is None
        src.pending.add(8)  # loaded, not yet in vLLM's cache: kept
        assert src.reconcile({9}) == 0 and _pins(broker.socket) == {"a1": 1, "a2": 1}
        assert src.reconcile(set()) == 1 and _pins(broker.socket) == {"a1": 0, "a2": 1}
        assert src.release(8) and _pins(broker.socket) == {"a1": 0, "a2": 0}
        assert (src.acquires, src.releases) == (2, 2)
    finally:
        src.close()


def test_copies_are_private_and_scaling_them_leaves_the_pages_alone(adapters):
    broker, dirs = adapters
    src = BrokerAdapters(broker.socket)
    try:
        leased = src.acquire("a1", 1)
        arena = src.arena("float32")
        before = arena.clone()
        copies = src.copies(leased, torch.float32)
        a_file, b_file = _file_weights(dirs["a1"], 1, "v_proj")
        w = copies[(1, "v_proj")]
        assert torch.equal(w.lora_a, a_file) and torch.equal(w.lora_b, b_file) and w.scaling == 2.0
        for w in copies.values():
            w.lora_b.mul_(w.scaling)  # in place, as vLLM's LoRALayerWeights.optimize() does
        assert torch.equal(arena, before)
    finally:
        src.close()


def test_zero_copy_step_keeps_base_rows_base_with_every_slot_taken(adapters):
    broker, dirs = adapters
    src = BrokerAdapters(broker.socket)
    try:
        slots = (src.acquire("a1", 1), src.acquire("a2", 2))
        token_slot = torch.tensor([-1, 0, 1, -1, 1, 0, -1], dtype=torch.int64)  # vLLM's indices
        holder = StepHolder("cpu")
        step = ZeroCopyStep.build(slots, token_slot, holder.tables, src.arena)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(7, HIDDEN, generator=g)
        base = torch.randn(7, HIDDEN + 2 * KV, generator=g)
        out = base.clone()
        step.apply(x, out, LayerAddress(0, ("q_proj", "k_proj", "v_proj"), (HIDDEN, KV, KV)))
        base_rows = [0, 3, 6]
        assert torch.equal(out[base_rows], base[base_rows])
        for row, slot in ((1, 0), (2, 1), (4, 1), (5, 0)):
            path = dirs[("a1", "a2")[slot]]
            want = base[row].clone()
            col = 0
            for mod, width in (("q_proj", HIDDEN), ("k_proj", KV), ("v_proj", KV)):
                a, b = _file_weights(path, 0, mod)
                want[col : col + width] += 2.0 * (b @ (a @ x[row]))
                col += width
            torch.testing.assert_close(out[row], want, rtol=1e-5, atol=1e-4)
        # Padding rows beyond vLLM's token map are base rows too.
        more = torch.cat([x, x[:2]])
        out2 = torch.cat([base, base[:2]]).clone()
        step.apply(more, out2, LayerAddress(0, ("q_proj", "k_proj", "v_proj"), (HIDDEN, KV, KV)))
        assert torch.equal(out2[7:], base[:2]) and torch.equal(out2[:7], out)
        assert step.extra_bytes() > 0
    finally:
        src.close()


QKV = LayerAddress(0, ("q_proj", "k_proj", "v_proj"), (HIDDEN, KV, KV))
O_PROJ = LayerAddress(1, ("o_proj",), (HIDDEN,))


def _vllm_indices(values: list[int], size: int = 16) -> torch.Tensor:
    """vLLM's token -> slot indices: a view of the first tokens of a preallocated int64 buffer."""
    buffer = torch.full((size,), -7, dtype=torch.int64)
    buffer[: len(values)] = torch.tensor(values)
    return buffer[: len(values)]


def test_a_static_zero_copy_step_replays_changed_maps_and_adapters_from_the_same_buffers(adapters):
    """With StaticStepBuffers each step's build (vLLM's per-step metadata update) copies the token
    map and every launch's tables into tensors allocated once; the layers' work reads only them,
    so a forward captured with an earlier step's objects (a CUDA graph's replay, emulated here
    by calling that step's apply again) gives the new step's output."""
    broker, _ = adapters
    src = BrokerAdapters(broker.socket)
    try:
        a1, a2 = src.acquire("a1", 1), src.acquire("a2", 2)
        holder = StepHolder("cpu", StaticStepBuffers(8, 3, 16, src.arena("float32")))
        g = torch.Generator().manual_seed(3)
        x = torch.randn(8, HIDDEN, generator=g)  # vLLM pads a batch to the captured size: 8
        base = {QKV: torch.randn(8, HIDDEN + 2 * KV, generator=g), O_PROJ: torch.randn(8, HIDDEN, generator=g)}
        steps = [
            ((a1, a2, None), [-1, 0, 1, -1, 1, 0, -1]),
            ((a2, None, None), [0, 0, -1, 1, 0]),  # a1 left; slot 1 empty (its token stays base)
            ((None, a1, a2), [2, 1, 2, 1, 2, 1, -1, 2]),  # adapters came back in other slots
            ((None, None, None), [-1, -1]),  # warm-up-like: no adapters at all
        ]
        captured = None
        ptrs = None
        for slots, indices in steps:
            step = ZeroCopyStep.build(
                slots, _vllm_indices(indices), holder.tables, src.arena, "once", static=holder.static
            )
            eager = ZeroCopyStep.build(slots, _vllm_indices(indices), holder.tables, src.arena, "once")
            captured = captured or step  # the step whose objects a graph would have captured
            for address, b in base.items():
                got = captured.apply(x, b.clone(), address)
                want = eager.apply(x, b.clone(), address)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                assert torch.equal(got[len(indices) :], b[len(indices) :]), "padding rows changed"
            now = [t.data_ptr() for t in holder.static.buffers()]
            assert ptrs is None or now == ptrs, "a step moved a buffer the graph reads"
            ptrs = now
        assert len(ptrs) == 1 + 2 * 4  # the token map and two launches' tables, allocated once
    finally:
        src.close()


def test_static_zero_copy_buffers_refuse_what_they_cannot_hold(adapters):
    broker, _ = adapters
    src = BrokerAdapters(broker.socket)
    try:
        a1, a2 = src.acquire("a1", 1), src.acquire("a2", 2)
        holder = StepHolder("cpu", StaticStepBuffers(8, 1, 16, src.arena("float32")))
        with pytest.raises(ValueError, match="2 LoRA slots do not fit static buffers of 1"):
            ZeroCopyStep.build((a1, a2), _vllm_indices([0, 1]), holder.tables, src.arena, static=holder.static)
        small = StaticStepBuffers(8, 2, 4, src.arena("float32"))  # the adapters are rank 8
        step = ZeroCopyStep.build((a1, a2), _vllm_indices([0, 1]), holder.tables, src.arena, static=small)
        with pytest.raises(ValueError, match="captured LoRA step cannot serve layer 0 q_proj.*enforce_eager"):
            step.apply(torch.zeros(2, HIDDEN), torch.zeros(2, HIDDEN + 2 * KV), QKV)
        other = StaticStepBuffers(8, 2, 16, torch.zeros(16))
        with pytest.raises(ValueError, match="capture anew"):
            ZeroCopyStep.build((a1, a2), _vllm_indices([0, 1]), holder.tables, src.arena, static=other)
    finally:
        src.close()


def test_static_buffers_of_an_eager_engine_leave_what_they_cannot_hold_to_the_ordinary_path(adapters):
    """The plugin gives every zero-copy engine static buffers; one that captures no graphs
    (captured=False) runs a step they cannot hold (here adapters of rank 8 over buffers of rank
    4) the ordinary way, with the same output, instead of refusing it. A broker restart gives
    such an engine buffers over the new arena; one that captured graphs is told to restart."""
    broker, _ = adapters
    src = BrokerAdapters(broker.socket)
    try:
        a1, a2 = src.acquire("a1", 1), src.acquire("a2", 2)
        arena = src.arena("float32")
        x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(5))
        eager = ZeroCopyStep.build((a1, a2), _vllm_indices([0, 1]), AdapterTables("cpu"), src.arena, "once")
        want = eager.apply(x, torch.zeros(2, HIDDEN + 2 * KV), QKV)
        assert want.abs().sum() > 0
        # Refused at the build (2 slots, buffers of 1) and in the forward (a launch's tables are
        # loaded on first use: rank 8 over buffers of rank 4).
        for small in (
            StaticStepBuffers(8, 1, 16, arena, captured=False),
            StaticStepBuffers(8, 2, 4, arena, captured=False),
        ):
            step = ZeroCopyStep.build(
                (a1, a2), _vllm_indices([0, 1]), AdapterTables("cpu"), src.arena, "once", static=small
            )
            got = step.apply(x, torch.zeros(2, HIDDEN + 2 * KV), QKV)
            torch.testing.assert_close(got, want)
            assert step.static is None and small.applies == 0
        fits = StaticStepBuffers(8, 2, 16, arena, captured=False)
        step = ZeroCopyStep.build((a1, a2), _vllm_indices([0, 1]), AdapterTables("cpu"), src.arena, "once", static=fits)
        step.apply(x, torch.zeros(2, HIDDEN + 2 * KV), QKV)
        assert step.static is fits and fits.applies == 1
        assert fits.for_arena(arena) is fits
        moved = fits.for_arena(arena.clone())
        assert moved is not fits and moved.arena.data_ptr() != arena.data_ptr() and moved.max_tokens == 8
        with pytest.raises(RuntimeError, match="broker restarted.*restart the engine"):
            StaticStepBuffers(8, 2, 16, arena).for_arena(arena.clone())
    finally:
        src.close()


def test_half_precision_rounds_where_vllm_rounds(adapters):
    """bfloat16 outputs: the rank-r intermediate and the delta rounded to bfloat16, then added
    (vLLM's CPU LoRA ops), bit for bit; "once" is the kernels' single rounding."""
    _, dirs = adapters
    broker = start_broker("--pool-size", "64MiB", "--slab-size", "16MiB", "--adapter-dtype", "bfloat16")
    try:
        with BrokerClient.connect(broker.socket, client_name="test") as c:
            c.register_adapter("a1", dirs["a1"])
        src = BrokerAdapters(broker.socket)
        try:
            slots = (src.acquire("a1", 1), None)
            token_slot = torch.tensor([0, -1, 0, 0])
            g = torch.Generator().manual_seed(1)
            x = torch.randn(4, HIDDEN, generator=g).to(torch.bfloat16)
            base = torch.randn(4, HIDDEN, generator=g).to(torch.bfloat16)
            address = LayerAddress(1, ("o_proj",), (HIDDEN,))
            a, b = _file_weights(dirs["a1"], 1, "o_proj")
            a, b = a.to(torch.bfloat16), (b.to(torch.bfloat16) * 2.0)  # vLLM: B scaled in the LoRA dtype
            # vLLM's bgmv_shrink / bgmv_expand on CPU, for the adapter's rows.
            y = (x.float() @ a.float().T).to(torch.bfloat16)
            want = base.clone()
            want[[0, 2, 3]] += (y @ b.T)[[0, 2, 3]]
            out = base.clone()
            ZeroCopyStep.build(slots, token_slot, StepHolder("cpu").tables, src.arena).apply(x, out, address)
            assert torch.equal(out, want)
            once = base.clone()
            ZeroCopyStep.build(slots, token_slot, StepHolder("cpu").tables, src.arena, "once").apply(x, once, address)
            exact = base.float() + (x.float() @ a.float().T) @ b.float().T  # b holds the scaling
            assert torch.equal(once[1], base[1])
            rows = [0, 2, 3]
            assert not torch.equal(once[rows], out[rows])  # the two roundings do differ here
            assert (once[rows].float() - exact[rows]).abs().sum() < (out[rows].float() - exact[rows]).abs().sum()
            with pytest.raises(ValueError, match="rounding"):
                ZeroCopyStep.build(slots, token_slot, StepHolder("cpu").tables, src.arena, "twice")
        finally:
            src.close()
    finally:
        broker.stop()


def test_a_directory_named_by_path_is_registered_once_under_a_stable_id(adapters):
    broker, dirs = adapters
    src = BrokerAdapters(broker.socket)
    try:
        aid = src.register_directory(dirs["a2"])
        assert aid.startswith("vllm-dir-") and src.register_directory(dirs["a2"] + "/") == aid
        assert src.register_directory(dirs["a1"]) != aid
        leased = src.acquire(aid, 11)
        assert _pins(broker.socket)[aid] == 1 and leased.layout.module(0, "q_proj").rank == 8
        with pytest.raises(BrokerError, match="INVALID_ARGUMENT|adapter_config"):
            src.register_directory(os.path.join(dirs["a2"], "missing"))
    finally:
        src.close()


def test_adapters_are_acquired_again_after_a_broker_restart(adapters):
    _, dirs = adapters
    first = start_broker("--pool-size", "64MiB", "--slab-size", "16MiB", "--adapter-dtype", "float32")
    second = None
    try:
        with BrokerClient.connect(first.socket, client_name="test") as c:
            c.register_adapter("a1", dirs["a1"])
        src = BrokerAdapters(first.socket)
        try:
            src.acquire("a1", 4)
            epoch = src.client().epoch
            first.stop()
            second = start_broker(
                "--pool-size", "64MiB", "--slab-size", "16MiB", "--adapter-dtype", "float32", socket=first.socket
            )
            with BrokerClient.connect(second.socket, client_name="test") as c:
                c.register_adapter("a1", dirs["a1"])
            deadline = time.monotonic() + 30
            while src.client().epoch == epoch:
                assert time.monotonic() < deadline, "the client did not reconnect to the new broker"
                time.sleep(0.1)
            # The next step asks for the adapter: it is pinned again on the new broker.
            again = src.adapter(4)
            assert again is not None and _pins(second.socket) == {"a1": 1}
            assert src.adapter(4) is again  # once
        finally:
            src.close()
    finally:
        for b in (first, second):
            if b is not None and b.proc.poll() is None:
                b.stop()
