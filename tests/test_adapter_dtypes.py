"""Adapters in the dtype an engine asks for: one broker, at its default dtype (bfloat16), serves
float32, float16 and bfloat16 engines, each with the weights as vLLM would load them from the
file (cast once from the file's dtype), never a rounding of the broker's own copy.

Every copy is a hot entry of its own (key ``id#dtype``): it shares the hot tier's budget,
its pins are released by id, and it goes with its adapter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from adapter_fixtures import AdapterHarness, peft_dirs, run  # noqa: F401  (peft_dirs is a fixture)
from safetensors.torch import load_file as load_torch
from store_invariants import check_invariants

from memory_broker.broker.adapters import AdapterConfig, Tier
from memory_broker.broker.adapters.page_writers import read_matrix
from memory_broker.proto.wire.errors import BrokerError, Code

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

NP = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


def _file_cast(meta, w, kind: str, dtype: torch.dtype) -> np.ndarray:
    """The file's tensor cast to ``dtype`` as torch (and so vLLM) casts it, Bᵀ for B, as raw bits."""
    t = load_torch(meta.weights_path)[meta.weight_key(w.layer, w.module, kind)]
    t = (t if kind == "A" else t.T.contiguous()).to(dtype)
    return t.view(torch.int16).numpy().view(np.uint16) if dtype == torch.bfloat16 else t.numpy()


def _assert_pages_hold(h, acquired, dtype: torch.dtype) -> None:
    meta = h.registry.get(acquired.adapter_id)
    view = h.reader()
    try:
        for w in meta.weights:
            for kind in ("A", "B"):
                got = read_matrix(view, acquired.layout, acquired.pages, w.layer, w.module, kind)
                assert got.dtype == NP[dtype]
                assert np.array_equal(got, _file_cast(meta, w, kind, dtype)), (w.layer, w.module, kind)
    finally:
        view.close()


def test_each_dtype_asked_for_gets_the_files_weights_cast_once(peft_dirs, state_dir):  # noqa: F811
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig())  # the broker's defaults: bfloat16
        h.registry.register("r16", peft_dirs["r16"])
        s = h.store.open_session()
        # No dtype: the broker's own copy, as before (old clients).
        (a16,) = (await h.manager.acquire(s, ["r16"], with_layout=True)).adapters
        assert a16.layout.dtype == "bfloat16"
        _assert_pages_hold(h, a16, torch.bfloat16)
        got = {}
        for name, dtype in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
            (a,) = (await h.manager.acquire(s, ["r16"], with_layout=True, dtype=name)).adapters
            assert a.layout.dtype == name and a.adapter_id == "r16"
            _assert_pages_hold(h, a, dtype)
            got[name] = a
        # The stored dtype asked by name is the stored copy; the others are copies of their own.
        assert got["bfloat16"].object_id == a16.object_id
        assert len({got[d].object_id for d in got}) == 3
        # float32 rows take twice the bytes of bfloat16 ones.
        assert got["float32"].layout.used_bytes == 2 * a16.layout.used_bytes
        # A second engine of a dtype shares its copy: a hot hit, no conversion.
        s2 = h.store.open_session()
        (again,) = (await h.manager.acquire(s2, ["r16"], dtype="float32")).adapters
        assert (again.object_id, again.found_in) == (got["float32"].object_id, Tier.HOT)
        st = h.manager.stats()
        assert st.resident.hot == 3 and st.registered == 1
        # Pins count across copies: s holds 4 (bf16 twice), s2 one.
        assert h.manager.describe("r16").pin_count == 5
        check_invariants(h.store)
        await h.close()

    run(main())


def test_release_by_id_finds_the_copy_the_session_pins(peft_dirs, state_dir):  # noqa: F811
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig())
        h.registry.register("r8", peft_dirs["r8"])
        s1, s2 = h.store.open_session(), h.store.open_session()
        (c32,) = (await h.manager.acquire(s1, ["r8"], dtype="float32")).adapters
        (own,) = (await h.manager.acquire(s2, ["r8"])).adapters
        # s1 pins only the float32 copy; releasing r8 releases that, not s2's pin.
        h.manager.release(s1, ["r8"])
        assert h.store.objects[c32.object_id].pin_count == 0
        assert h.store.objects[own.object_id].pins == {s2: 1}
        with pytest.raises(BrokerError) as e:
            h.manager.release(s1, ["r8"])
        assert e.value.code == Code.PERMISSION_DENIED, e.value
        # Unregistering waits for every copy's pins, then frees every copy.
        (await h.manager.acquire(s1, ["r8"], dtype="float16"))
        h.manager.release(s2, ["r8"])
        with pytest.raises(BrokerError) as e:
            h.manager.unregister("r8")
        assert e.value.code == Code.FAILED_PRECONDITION
        h.manager.release(s1, ["r8"])
        h.manager.unregister("r8")
        assert h.manager.stats().resident.hot == 0 and len(h.manager.entries) == 0
        check_invariants(h.store)
        await h.close()

    run(main())


def test_a_release_in_a_dtype_drops_only_that_copys_pin(peft_dirs, state_dir):  # noqa: F811
    """A session holding the broker's copy and a float32 copy (two leases): releasing the
    float32 lease keeps the other lease's pages pinned."""

    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig())
        h.registry.register("r4", peft_dirs["r4"])
        s = h.store.open_session()
        (own,) = (await h.manager.acquire(s, ["r4"])).adapters
        (c32,) = (await h.manager.acquire(s, ["r4"], dtype="float32")).adapters
        h.manager.release(s, ["r4"], "float32")
        assert h.store.objects[own.object_id].pins == {s: 1}
        assert h.store.objects[c32.object_id].pin_count == 0
        with pytest.raises(BrokerError) as e:
            h.manager.release(s, ["r4"], "float32")
        assert e.value.code == Code.FAILED_PRECONDITION, e.value
        with pytest.raises(BrokerError) as e:
            h.manager.release(s, ["r4"], "int4")
        assert e.value.code == Code.INVALID_ARGUMENT
        assert h.store.objects[own.object_id].pins == {s: 1}
        h.manager.release(s, ["r4"], "bfloat16")  # the broker's own dtype, by name
        assert h.store.objects[own.object_id].pin_count == 0
        await h.close()

    run(main())


def test_copies_count_against_the_hot_tier_budget(peft_dirs, state_dir):  # noqa: F811
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(hot_tier_adapters=2))
        h.registry.register("r4", peft_dirs["r4"])
        s = h.store.open_session()
        await h.manager.acquire(s, ["r4"])
        await h.manager.acquire(s, ["r4"], dtype="float32")
        with pytest.raises(BrokerError) as e:
            await h.manager.acquire(s, ["r4"], dtype="float16")
        assert e.value.code == Code.RESOURCE_EXHAUSTED and "budget 2 adapters" in e.value.message
        # Released, a copy is a cache like any hot adapter: the next one demotes it.
        h.manager.release(s, ["r4", "r4"])
        (a,) = (await h.manager.acquire(s, ["r4"], dtype="float16")).adapters
        # (Its warm image stayed from the refused acquire, as loads that finished do.)
        assert a.found_in == Tier.WARM and h.manager.stats().resident.hot == 2
        assert h.manager.stats().as_dict()["demotions"] == 1
        await h.close()

    run(main())


def test_an_unknown_dtype_is_invalid_argument_and_changes_nothing(peft_dirs, state_dir):  # noqa: F811
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig())
        h.registry.register("r4", peft_dirs["r4"])
        s = h.store.open_session()
        for bad in ("fp32", "int8", "float64"):
            with pytest.raises(BrokerError) as e:
                await h.manager.acquire(s, ["r4"], dtype=bad)
            assert e.value.code == Code.INVALID_ARGUMENT
            assert "bfloat16, float16, float32" in e.value.message or "float32" in e.value.message, e.value
        assert h.manager.stats().resident.hot == 0 and len(h.manager.entries) == 0
        await h.close()

    run(main())


def test_over_grpc_a_dtype_is_served_and_a_broker_that_ignores_it_is_refused(
    peft_dirs,  # noqa: F811
    broker_factory,
    monkeypatch,
):
    from memory_broker.clients import BrokerClient
    from memory_broker.clients import client as client_mod

    b = broker_factory("--pool-size", "64MiB", "--slab-size", "4MiB")  # defaults: bfloat16 adapters
    # gRPC's calls (a session without a step channel); the step channel's are the next test's.
    with BrokerClient.connect(b.socket, client_name="t", fast_path=False) as c:
        c.register_adapter("r8", peft_dirs["r8"])
        # Old clients send no dtype: the broker's own.
        assert c.acquire_adapters(["r8"]).adapters[0].layout.dtype == "bfloat16"
        lease = c.acquire_adapters(["r8"], dtype="float32")
        assert lease["r8"].layout.dtype == "float32"
        assert len(lease["r8"].pages) == lease["r8"].layout.num_pages
        # The layout cache keeps each dtype's layout apart.
        own = c.acquire_adapters(["r8"])
        assert own["r8"].layout.dtype == "bfloat16"
        # Releasing the float32 lease leaves the other lease's pin.
        lease.release()
        pins = {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"]
        own.release()
        assert pins - 1 == {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"]
        with pytest.raises(BrokerError) as e:
            c.acquire_adapters(["r8"], dtype="fp32")
        assert e.value.code == Code.INVALID_ARGUMENT and "'fp32' is not one of" in e.value.message
        # A broker older than the field ignores it (here: the field is not sent) and returns its
        # own dtype: the client refuses, naming the fix, and keeps no pin.
        before = {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"]
        real = client_mod.pb.AcquireAdaptersRequest

        def old_request(**kw):
            kw.pop("dtype", None)
            return real(**kw)

        monkeypatch.setattr(client_mod.pb, "AcquireAdaptersRequest", old_request)
        with pytest.raises(BrokerError) as e:
            c.acquire_adapters(["r8"], dtype="float16")
        assert e.value.code == Code.FAILED_PRECONDITION
        assert "in float16" in e.value.message and "returned them in bfloat16" in e.value.message
        assert "--adapter-dtype float16" in e.value.message
        assert {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"] == before


def test_on_the_step_channel_a_dtype_is_acquired_and_released_in_one_frame_each(
    peft_dirs,  # noqa: F811
    broker_factory,
    monkeypatch,
):
    from conftest import step_frames

    from memory_broker.clients import BrokerClient
    from memory_broker.clients.step.grpc_calls import GrpcCalls

    def no_grpc(*a, **k):
        raise AssertionError("a step call went over gRPC")

    for name in ("acquire_adapters", "release_adapters"):
        monkeypatch.setattr(GrpcCalls, name, no_grpc)
    b = broker_factory("--pool-size", "64MiB", "--slab-size", "4MiB")  # defaults: bfloat16 adapters
    with BrokerClient.connect(b.socket, client_name="t") as c:
        c.register_adapter("r8", peft_dirs["r8"])
        own = c.acquire_adapters(["r8"])
        frames = step_frames(c)
        lease = c.acquire_adapters(["r8"], dtype="float32")  # converted on the broker; the reply waits
        assert step_frames(c) == frames + 1
        assert lease["r8"].layout.dtype == "float32" and own["r8"].layout.dtype == "bfloat16"
        assert len(lease["r8"].pages) == lease["r8"].layout.num_pages
        assert lease["r8"].object_id != own["r8"].object_id
        again = c.acquire_adapters(["r8"], dtype="float32")  # hot now: the same copy, its layout cached
        assert again["r8"].object_id == lease["r8"].object_id and again["r8"].layout == lease["r8"].layout
        pins = {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"]
        lease.release()
        again.release()  # in float32: the broker's own copy keeps its pin
        assert {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"] == pins - 2
        own.release()
        assert {a.adapter_id: a.pin_count for a in c.list_adapters().adapters}["r8"] == pins - 3
        with pytest.raises(BrokerError) as e:
            c.acquire_adapters(["r8"], dtype="fp32")
        assert e.value.code == Code.INVALID_ARGUMENT and "'fp32' is not one of" in e.value.message
        with pytest.raises(BrokerError) as e:
            c.acquire_adapters("r8")
        assert e.value.code == Code.INVALID_ARGUMENT and "not one string" in e.value.message


@pytest.fixture
def state_dir(tmp_path) -> str:
    return str(tmp_path / "state")
