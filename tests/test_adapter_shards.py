"""A tensor-parallel rank's slice of an adapter, laid out by its broker (no engine here).

An acquire may carry ``shards`` (``ModuleShard``: for each module an engine splits, whether its
layers split their output, column-parallel, or their input, row-parallel, and the rank's part):
the broker then holds a copy of only that rank's slice, cut from the adapter's files as vLLM's
``slice_lora_b`` (B's output rows) and ``slice_lora_a`` (A's input columns) cut them. Checked
here against the PEFT files and PEFT's own LoRA outputs: each rank's column-parallel delta is
its columns of PEFT's, and the row-parallel partial deltas sum to PEFT's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from adapter_fixtures import AdapterHarness, peft_dirs, run  # noqa: F401  (peft_dirs is a fixture)
from safetensors.torch import load_file as load_torch
from store_invariants import check_invariants

from memory_broker.broker.adapters import AdapterConfig, Tier
from memory_broker.broker.adapters.layout import AdapterLayout, LoraModuleSpec, plan_layout, shard_specs
from memory_broker.broker.adapters.page_writers import read_matrix
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.layout import ModuleShard, parse_shards, shards_text

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

ROW_PARALLEL = ("o_proj", "down_proj")
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tp_shards(rank: int, size: int) -> list[ModuleShard]:
    """What a vLLM Llama rank asks for: row-parallel o/down split their input, the rest their output."""
    return [ModuleShard(m, m in ROW_PARALLEL, rank, size) for m in MODULES]


def _matrix(h, acquired, layer: int, module: str, kind: str) -> torch.Tensor:
    view = h.reader()
    try:
        return torch.from_numpy(read_matrix(view, acquired.layout, acquired.pages, layer, module, kind).copy())
    finally:
        view.close()


def test_each_rank_holds_its_slice_of_the_peft_weights_and_reproduces_peft(peft_dirs, state_dir):  # noqa: F811
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32"))
        s = h.store.open_session()
        for name in ("r8", "r16"):
            h.registry.register(name, peft_dirs[name])
            meta = h.registry.get(name)
            files = load_torch(meta.weights_path)
            ref = load_torch(os.path.join(peft_dirs[name], "reference.safetensors"))
            with open(os.path.join(peft_dirs[name], "scalings.json")) as f:
                scalings = json.load(f)
            ranks = [
                (await h.manager.acquire(s, [name], with_layout=True, shards=tp_shards(r, 2))).adapters[0]
                for r in (0, 1)
            ]
            (whole,) = (await h.manager.acquire(s, [name], with_layout=True)).adapters
            assert [a.layout.shard for a in ranks] == [shards_text(tp_shards(r, 2)) for r in (0, 1)]
            assert whole.layout.shard == "" and len({whole.object_id, *(a.object_id for a in ranks)}) == 3
            # Each rank's copy holds less than the whole: its broker's hot tier holds only its slice.
            for a in ranks:
                assert a.layout.weight_bytes < whole.layout.weight_bytes
            for w in meta.weights:
                a_file = files[meta.weight_key(w.layer, w.module, "A")]  # [r, in]
                b_file = files[meta.weight_key(w.layer, w.module, "B")]  # [out, r]
                x = ref["x"][:, : w.in_features]
                delta = ref[f"delta.{w.layer}.{w.module}"]
                scaling = scalings[f"{w.layer}.{w.module}"]
                partial = torch.zeros_like(delta)
                for r, a in enumerate(ranks):
                    got_a = _matrix(h, a, w.layer, w.module, "A")
                    got_b = _matrix(h, a, w.layer, w.module, "B").T  # Bᵀ rows -> B [out part, r]
                    if w.module in ROW_PARALLEL:  # vLLM's RowParallel slice_lora_a: A's input columns
                        n = w.in_features // 2
                        assert torch.equal(got_a, a_file[:, r * n : (r + 1) * n]) and torch.equal(got_b, b_file)
                        partial += (x[:, r * n : (r + 1) * n] @ got_a.T @ got_b.T) * scaling
                    else:  # ColumnParallel slice_lora_b: B's output rows
                        n = w.out_features // 2
                        assert torch.equal(got_a, a_file) and torch.equal(got_b, b_file[r * n : (r + 1) * n])
                        mine = (x @ got_a.T @ got_b.T) * scaling
                        torch.testing.assert_close(mine, delta[:, r * n : (r + 1) * n], rtol=1e-4, atol=1e-5)
                if w.module in ROW_PARALLEL:  # the ranks' partial sums (vLLM's all-reduce) give PEFT's delta
                    torch.testing.assert_close(partial, delta, rtol=1e-4, atol=1e-5)
        check_invariants(h.store)
        await h.close()

    run(main())


def test_a_rank_s_copy_is_shared_counted_and_goes_with_its_adapter(peft_dirs, state_dir):  # noqa: F811
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(hot_tier_adapters=2))
        h.registry.register("r8", peft_dirs["r8"])
        s1, s2 = h.store.open_session(), h.store.open_session()
        (a,) = (await h.manager.acquire(s1, ["r8"], dtype="float32", shards=tp_shards(1, 2))).adapters
        # A second engine of that rank (same shards, any order) shares the copy: a hot hit.
        (b,) = (await h.manager.acquire(s2, ["r8"], dtype="float32", shards=tp_shards(1, 2)[::-1])).adapters
        assert (b.object_id, b.found_in) == (a.object_id, Tier.HOT)
        # Each copy counts against the hot tier's budget (2 adapters here).
        await h.manager.acquire(s1, ["r8"], dtype="float32")
        with pytest.raises(BrokerError) as e:
            await h.manager.acquire(s1, ["r8"], dtype="float32", shards=tp_shards(0, 2))
        assert e.value.code == Code.RESOURCE_EXHAUSTED and "budget 2 adapters" in e.value.message
        # Released by id in its dtype; unregistering waits for it, then frees every copy.
        h.manager.release(s1, ["r8", "r8"], "float32")
        assert h.store.objects[a.object_id].pins == {s2: 1}
        with pytest.raises(BrokerError) as e:
            h.manager.unregister("r8")
        assert e.value.code == Code.FAILED_PRECONDITION
        h.manager.release(s2, ["r8"], "float32")
        h.manager.unregister("r8")
        assert h.manager.stats().resident.hot == 0 and len(h.manager.entries) == 0
        check_invariants(h.store)
        await h.close()

    run(main())


def test_shards_that_do_not_divide_or_repeat_are_invalid_and_change_nothing(peft_dirs, state_dir):  # noqa: F811
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig())
        h.registry.register("r8", peft_dirs["r8"])
        s = h.store.open_session()
        for bad, words in (
            ([ModuleShard("q_proj", False, 0, 3)], "does not split into 3"),  # 64 rows in 3 parts
            ([ModuleShard("q_proj", False, 0, 2), ModuleShard("q_proj", True, 1, 2)], "listed twice"),
        ):
            with pytest.raises(BrokerError) as e:
                await h.manager.acquire(s, ["r8"], shards=bad)
            assert e.value.code == Code.INVALID_ARGUMENT and words in e.value.message, e.value
        assert h.manager.stats().resident.hot == 0 and len(h.manager.entries) == 0
        # A module the adapter does not adapt, or one part of one, is whole: the broker's own copy.
        (a,) = (await h.manager.acquire(s, ["r8"], shards=[ModuleShard("up_proj", False, 0, 1)])).adapters
        assert a.layout is None or a.layout.shard == ""
        assert len(h.manager.entries) == 1
        await h.close()

    run(main())


def test_shard_text_round_trips_and_refuses_nonsense():
    shards = tp_shards(1, 4)
    text = shards_text(shards)
    assert text.startswith("down_proj:i1/4,gate_proj:o1/4")
    assert sorted(parse_shards(text), key=lambda s: s.module) == sorted(shards, key=lambda s: s.module)
    assert ModuleShard("q_proj", False, 3, 4).part(64) == (48, 16)
    for bad in ("q_proj", "q_proj:x0/2", "q_proj:o0/"):
        with pytest.raises(ValueError):
            parse_shards(bad)
    with pytest.raises(ValueError):
        ModuleShard("q_proj", False, 2, 2)
    # A layout records its shards, through its JSON form too (a whole one's form is unchanged).
    specs = [LoraModuleSpec(0, "q_proj", 4, 64, 64, 1.0), LoraModuleSpec(0, "o_proj", 4, 64, 64, 1.0)]
    cut = plan_layout(shard_specs(specs, shards), 4096, "float32", 16, text)
    assert (cut.module(0, "q_proj").out_features, cut.module(0, "o_proj").in_features) == (16, 16)
    assert AdapterLayout.from_dict(json.loads(json.dumps(cut.to_dict()))) == cut and cut.shard == text
    assert "shard" not in plan_layout(specs, 4096, "float32", 16).to_dict()


def test_over_grpc_shards_are_served_and_a_broker_that_ignores_them_is_refused(
    peft_dirs,  # noqa: F811
    broker_factory,
    monkeypatch,
):
    from memory_broker.clients import BrokerClient
    from memory_broker.clients import client as client_mod
    from memory_broker.proto.wire.v1 import broker_pb2 as pb

    b = broker_factory("--pool-size", "64MiB", "--slab-size", "4MiB")
    # gRPC's calls (a session without a step channel); the step channel's are the next test's.
    with BrokerClient.connect(b.socket, client_name="t", fast_path=False) as c:
        c.register_adapter("r8", peft_dirs["r8"])
        whole = c.acquire_adapters(["r8"], dtype="float32")
        lease = c.acquire_adapters(["r8"], dtype="float32", shards=tp_shards(1, 2))
        got = lease["r8"].layout
        assert got.shard == shards_text(tp_shards(1, 2)) and got.dtype == "float32"
        assert got.module(0, "q_proj").out_features == whole["r8"].layout.module(0, "q_proj").out_features // 2
        assert got.module(0, "o_proj").in_features == whole["r8"].layout.module(0, "o_proj").in_features // 2
        # The layout cache keeps the whole copy's layout apart from the rank's.
        assert c.acquire_adapters(["r8"], dtype="float32")["r8"].layout.shard == ""
        # A bad shard on the wire: INVALID_ARGUMENT naming it.
        with pytest.raises(BrokerError) as e:
            c._call(
                c._stub.AcquireAdapters,
                pb.AcquireAdaptersRequest(
                    adapter_ids=["r8"], shards=[pb.ModuleShard(module="q_proj", index=2, count=2)]
                ),
            )
        assert e.value.code == Code.INVALID_ARGUMENT and "q_proj" in e.value.message, e.value
        # A broker older than the field ignores it (here: the field is not sent) and returns the
        # whole adapter: the client refuses, naming the fix, and keeps no pin.
        before = {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"]
        real = client_mod.pb.AcquireAdaptersRequest

        def old_request(**kw):
            kw.pop("shards", None)
            return real(**kw)

        monkeypatch.setattr(client_mod.pb, "AcquireAdaptersRequest", old_request)
        with pytest.raises(BrokerError) as e:
            c.acquire_adapters(["r8"], dtype="float32", shards=tp_shards(0, 2))
        assert e.value.code == Code.FAILED_PRECONDITION and "older than sharded copies" in e.value.message
        assert {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"] == before


def test_on_the_step_channel_a_ranks_shards_are_acquired_in_one_frame_and_bad_ones_refused(
    peft_dirs,  # noqa: F811
    broker_factory,
    monkeypatch,
):
    from conftest import step_frames

    from memory_broker.clients import BrokerClient
    from memory_broker.clients.step.grpc_calls import GrpcCalls
    from memory_broker.proto.wire import step as w

    def no_grpc(*a, **k):
        raise AssertionError("a step call went over gRPC")

    for name in ("acquire_adapters", "release_adapters"):
        monkeypatch.setattr(GrpcCalls, name, no_grpc)
    b = broker_factory("--pool-size", "64MiB", "--slab-size", "4MiB")
    with BrokerClient.connect(b.socket, client_name="t") as c:
        c.register_adapter("r8", peft_dirs["r8"])
        whole = c.acquire_adapters(["r8"])
        n = step_frames(c)
        lease = c.acquire_adapters(["r8"], shards=tp_shards(1, 2))  # cut on the broker; the reply waits
        assert step_frames(c) == n + 1
        got = lease["r8"].layout
        assert got.shard == shards_text(tp_shards(1, 2)) and got.dtype == whole["r8"].layout.dtype
        assert got.module(0, "q_proj").out_features == whole["r8"].layout.module(0, "q_proj").out_features // 2
        assert got.module(0, "o_proj").in_features == whole["r8"].layout.module(0, "o_proj").in_features // 2
        assert c.acquire_adapters(["r8"])["r8"].layout.shard == ""  # each copy's layout kept apart
        pins = {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"]
        lease.release()
        assert {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"] == pins - 1
        # Shards the broker cannot cut, or text that names none: INVALID_ARGUMENT naming them,
        # and no pin taken.
        with pytest.raises(BrokerError) as e:
            c.acquire_adapters(["r8"], shards=[ModuleShard("q_proj", False, 0, 7)])  # 7 does not divide it
        assert e.value.code == Code.INVALID_ARGUMENT and "q_proj" in e.value.message, e.value
        path = c._step_path()
        reply = path.send([(w.OP_ACQUIRE, ["r8"], w.ACQUIRE_SHAPED, 0, 0, "", "q_proj:x1/2")])
        assert reply.error.code == Code.INVALID_ARGUMENT and "q_proj:x1/2" in reply.error.message
        assert {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"] == pins - 1


@pytest.fixture
def state_dir(tmp_path) -> str:
    return str(tmp_path / "state")
