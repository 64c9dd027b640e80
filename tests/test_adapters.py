"""LoRA adapters: registry, layout, tiers and the manager, on a real host arena.

Adapters are real PEFT saves of a tiny random Llama (``adapter_fixtures``); the manager
runs on a real HostArena + PagePool + WindowSpace + ObjectStore inside ``asyncio.run``, and
bytes are read back through an independent mapping of the same slab fds, as a client would.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from adapter_fixtures import (  # noqa: F401  (peft_dirs is a fixture)
    AdapterHarness,
    copy_adapter,
    edit_config,
    edit_tensors,
    peft_dirs,
    run,
)
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file as load_torch
from store_invariants import check_invariants

from memory_broker.broker.adapters import (
    AdapterConfig,
    AdapterLayout,
    AdapterRegistry,
    LoraModuleSpec,
    Tier,
    offset_table,
    plan_layout,
    row_offsets,
)
from memory_broker.broker.adapters.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from memory_broker.broker.adapters.page_writers import read_matrix
from memory_broker.broker.adapters.policy import GDSFPolicy, LFUPolicy, LRUPolicy
from memory_broker.broker.arena.host import host_buffer
from memory_broker.broker.store.eviction import ContentType
from memory_broker.broker.store.objects import Spec
from memory_broker.proto.wire.errors import BrokerError, Code

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMP = ContentType.TEMP_BUFFER


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def state_dir(tmp_path) -> str:
    return str(tmp_path / "state")


def register_all(h: AdapterHarness, dirs: dict[str, str]) -> None:
    for name, path in dirs.items():
        h.registry.register(name, path)


def assert_stored_equals_file(view, registry, acquired) -> int:
    """Every A row and Bᵀ row in the pages equals the safetensors tensor, bit for bit."""
    meta = registry.get(acquired.adapter_id)
    tensors = load_numpy(meta.weights_path)
    layout = acquired.layout
    checked = 0
    for w in meta.weights:
        a = read_matrix(view, layout, acquired.pages, w.layer, w.module, "A")
        b = read_matrix(view, layout, acquired.pages, w.layer, w.module, "B")
        assert np.array_equal(a, tensors[meta.weight_key(w.layer, w.module, "A")])
        assert np.array_equal(b, tensors[meta.weight_key(w.layer, w.module, "B")].T)
        checked += 2
    return checked


# ------------------------------------------------------------------- registry


def test_registers_real_peft_adapters_with_their_shapes_and_scalings(peft_dirs, state_dir):
    reg = AdapterRegistry(state_dir)
    for name, path in peft_dirs.items():
        meta = reg.register(name, path)
        with open(os.path.join(path, "scalings.json")) as f:
            peft_scalings = json.load(f)
        assert {f"{w.layer}.{w.module}": w.scaling for w in meta.weights} == pytest.approx(peft_scalings)
        assert meta.layers == (0, 1)
    r8 = reg.get("r8")
    assert (r8.rank, r8.lora_alpha, r8.use_rslora) == (8, 16.0, False)
    assert r8.target_modules == ("k_proj", "o_proj", "q_proj", "v_proj")
    shapes = {m.name: (m.in_features, m.out_features) for m in r8.modules}
    assert shapes == {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64)}
    r16 = reg.get("r16")
    assert r16.use_rslora and {w.scaling for w in r16.weights} == {16 / math.sqrt(16)}
    pattern = reg.get("pattern")
    ranks = {(w.layer, w.module): w.rank for w in pattern.weights}
    assert ranks[(1, "q_proj")] == 4 and ranks[(0, "q_proj")] == 8 and not pattern.uniform
    reg.close()


def test_registry_survives_a_restart(peft_dirs, state_dir):
    reg = AdapterRegistry(state_dir)
    for name, path in peft_dirs.items():
        reg.register(name, path)
    before = {n: reg.get(n) for n in peft_dirs}
    reg.close()
    reg = AdapterRegistry(state_dir)
    assert len(reg) == len(peft_dirs)
    assert [i.adapter_id for i in reg.list().adapters] == sorted(peft_dirs)
    for n, meta in before.items():
        assert reg.get(n) == meta
    reg.close()


def test_registry_count_is_kept_without_scanning_and_matches_the_table(peft_dirs, state_dir):
    reg = AdapterRegistry(state_dir)
    meta = reg.inspect(peft_dirs["r4"])
    reg.add_many([(f"t/{i:04d}", meta) for i in range(300)])
    reg.register("x", peft_dirs["r8"])
    with pytest.raises(BrokerError):
        reg.add_many([("t/0001", meta), ("new", meta)])  # all or none: nothing counted
    reg.unregister("t/0007")
    with pytest.raises(BrokerError):
        reg.unregister("t/0007")

    def table_count(prefix=""):
        return reg._db.execute("SELECT count(*) FROM adapters WHERE id LIKE ?", (prefix + "%",)).fetchone()[0]

    assert reg.count() == table_count() == 300
    assert reg.count("t/") == table_count("t/") == 299 and reg.count("t/00") == 99
    reg.close()
    reg = AdapterRegistry(state_dir)  # counted once at open
    assert len(reg) == 300
    reg.close()


def test_taken_id_is_already_exists_and_changes_nothing(peft_dirs, state_dir):
    reg = AdapterRegistry(state_dir)
    reg.register("a", peft_dirs["r4"])
    with pytest.raises(BrokerError) as e:
        reg.register("a", peft_dirs["r8"])
    assert e.value.code == Code.ALREADY_EXISTS
    assert reg.get("a").target_modules == ("q_proj", "v_proj") and len(reg) == 1


@pytest.mark.parametrize("bad", ["", "-x", "a b", "x" * 300, "é"])
def test_malformed_adapter_id_is_invalid_argument(peft_dirs, state_dir, bad):
    reg = AdapterRegistry(state_dir)
    with pytest.raises(BrokerError) as e:
        reg.register(bad, peft_dirs["r4"])
    assert e.value.code == Code.INVALID_ARGUMENT and len(reg) == 0


def _drop(path, name):
    os.remove(os.path.join(path, name))


def _write(path, name, text):
    with open(os.path.join(path, name), "w") as f:
        f.write(text)


def _add_tensor(key, shape, dtype=torch.float32):
    return lambda t: t.__setitem__(key, torch.zeros(shape, dtype=dtype))


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
# name -> (how to break a copy of the r8 adapter, text the refusal names, file it names)
INVALID = {
    "missing config": (lambda p: _drop(p, "adapter_config.json"), "missing", "adapter_config.json"),
    "missing weights": (lambda p: _drop(p, "adapter_model.safetensors"), "missing", "adapter_model.safetensors"),
    "pickle weights only": (
        lambda p: (_drop(p, "adapter_model.safetensors"), _write(p, "adapter_model.bin", "x")),
        "convert it to safetensors",
        "adapter_model.safetensors",
    ),
    "unreadable json": (
        lambda p: _write(p, "adapter_config.json", "{not json"),
        "not valid JSON",
        "adapter_config.json",
    ),
    "not a safetensors file": (
        lambda p: _write(p, "adapter_model.safetensors", "garbage"),
        "not a readable safetensors file",
        "adapter_model.safetensors",
    ),
    "not lora": (lambda p: edit_config(p, peft_type="IA3"), "only LORA", "adapter_config.json"),
    "dora config": (lambda p: edit_config(p, use_dora=True), "DoRA", "adapter_config.json"),
    "dora tensor": (
        lambda p: edit_tensors(p, _add_tensor(f"{Q0}.lora_magnitude_vector", (64,))),
        "DoRA",
        "adapter_model.safetensors",
    ),
    "bias config": (lambda p: edit_config(p, bias="all"), "bias", "adapter_config.json"),
    "bias tensor": (
        lambda p: edit_tensors(p, _add_tensor(f"{Q0}.lora_B.bias", (64,))),
        "LoRA bias",
        "adapter_model.safetensors",
    ),
    "inconsistent in_features": (
        lambda p: edit_tensors(p, _add_tensor(f"{Q0}.lora_A.weight", (8, 65))),
        "must have the same shape",
        "adapter_model.safetensors",
    ),
    "A and B ranks differ": (
        lambda p: edit_tensors(p, _add_tensor(f"{Q0}.lora_B.weight", (64, 7))),
        "rank 8",
        "adapter_model.safetensors",
    ),
    "rank differs from config": (lambda p: edit_config(p, r=6), "says 6", "adapter_model.safetensors"),
    "lora_B missing": (
        lambda p: edit_tensors(p, lambda t: t.pop(f"{Q0}.lora_B.weight")),
        "no lora_B",
        "adapter_model.safetensors",
    ),
    "module not targeted": (
        lambda p: edit_config(p, target_modules=["q_proj", "k_proj", "o_proj"]),
        "does not select",
        "adapter_model.safetensors",
    ),
    "layer not transformed": (
        lambda p: edit_config(p, layers_to_transform=[0]),
        "does not select",
        "adapter_model.safetensors",
    ),
    "embedding lora": (
        lambda p: edit_tensors(p, _add_tensor("base_model.model.model.embed_tokens.lora_embedding_A", (8, 128))),
        "embedding",
        "adapter_model.safetensors",
    ),
    "lm_head lora": (
        lambda p: edit_tensors(p, _add_tensor("base_model.model.lm_head.lora_A.weight", (8, 64))),
        "lm_head",
        "adapter_model.safetensors",
    ),
    "unsupported dtype": (
        lambda p: edit_tensors(p, lambda t: t.__setitem__(f"{Q0}.lora_A.weight", t[f"{Q0}.lora_A.weight"].double())),
        "dtype F64",
        "adapter_model.safetensors",
    ),
    "not a matrix": (
        lambda p: edit_tensors(p, _add_tensor(f"{Q0}.lora_A.weight", (8, 8, 8))),
        "2-D",
        "adapter_model.safetensors",
    ),
    "full weights (modules_to_save)": (
        lambda p: edit_tensors(p, _add_tensor("base_model.model.score.modules_to_save.weight", (2, 64))),
        "not a LoRA A/B weight",
        "adapter_model.safetensors",
    ),
    "bad rank_pattern": (lambda p: edit_config(p, rank_pattern={"(": 4}), "regular expression", "adapter_config.json"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_directory_is_refused_naming_file_and_problem(peft_dirs, state_dir, tmp_path, case):
    breaker, problem, filename = INVALID[case]
    reg = AdapterRegistry(state_dir)
    reg.register("good", peft_dirs["r4"])
    path = copy_adapter(peft_dirs["r8"], str(tmp_path / "bad"))
    breaker(path)
    with pytest.raises(BrokerError) as e:
        reg.register("bad", path)
    assert e.value.code == Code.INVALID_ARGUMENT
    assert problem in e.value.message and os.path.join(path, filename) in e.value.message, e.value.message
    assert "bad" not in reg and len(reg) == 1
    reg.close()
    assert [i.adapter_id for i in AdapterRegistry(state_dir).list().adapters] == ["good"]


def test_missing_directory_is_refused(state_dir, tmp_path):
    reg = AdapterRegistry(state_dir)
    with pytest.raises(BrokerError) as e:
        reg.register("x", str(tmp_path / "nowhere"))
    assert e.value.code == Code.INVALID_ARGUMENT and "no such directory" in e.value.message
    assert len(reg) == 0


def test_rank_above_max_rank_is_refused(peft_dirs, state_dir):
    reg = AdapterRegistry(state_dir, max_rank=8)
    reg.register("r8", peft_dirs["r8"])
    with pytest.raises(BrokerError) as e:
        reg.register("r16", peft_dirs["r16"])
    assert e.value.code == Code.INVALID_ARGUMENT
    assert "rank 16, above the broker's max_rank of 8" in e.value.message
    assert "adapter_model.safetensors" in e.value.message and len(reg) == 1


def test_uniform_registry_refuses_rank_and_alpha_patterns(peft_dirs, state_dir):
    reg = AdapterRegistry(state_dir, require_uniform=True)
    reg.register("r8", peft_dirs["r8"])
    with pytest.raises(BrokerError) as e:
        reg.register("pattern", peft_dirs["pattern"])
    assert e.value.code == Code.INVALID_ARGUMENT and "require_uniform" in e.value.message


def test_list_filters_by_prefix_and_pages(peft_dirs, state_dir):
    reg = AdapterRegistry(state_dir)
    ids = [f"tenant-{i:03d}" for i in range(25)] + ["other-1", "tenant"]
    for aid in ids:
        reg.register(aid, peft_dirs["r4"])
    seen, token = [], ""
    while True:
        page = reg.list(prefix="tenant-", limit=10, page_token=token)
        assert len(page.adapters) <= 10
        seen += [a.adapter_id for a in page.adapters]
        token = page.next_page_token
        if not token:
            break
    assert seen == sorted(i for i in ids if i.startswith("tenant-"))
    assert reg.count("tenant") == 26 and reg.count("") == 27
    info = reg.list(prefix="other").adapters[0]
    assert (info.rank, info.target_modules, info.num_layers) == (4, ("q_proj", "v_proj"), 2)
    with pytest.raises(BrokerError) as e:
        reg.list(limit=0)
    assert e.value.code == Code.INVALID_ARGUMENT


def test_ten_thousand_adapters_register_and_list_in_seconds(peft_dirs, state_dir):
    reg = AdapterRegistry(state_dir)
    t0 = time.perf_counter()
    for i in range(10_000):
        reg.register(f"tenant-{i:05d}", peft_dirs["r8"])
    registered = time.perf_counter() - t0
    t0 = time.perf_counter()
    n, token = 0, ""
    while True:
        page = reg.list(limit=1000, page_token=token)
        n += len(page.adapters)
        token = page.next_page_token
        if not token:
            break
    listed = time.perf_counter() - t0
    assert n == 10_000
    assert registered < 20 and listed < 5, (registered, listed)
    reg.close()
    t0 = time.perf_counter()
    assert len(AdapterRegistry(state_dir)) == 10_000 and time.perf_counter() - t0 < 2


def test_unregister_forgets_and_persists(peft_dirs, state_dir):
    reg = AdapterRegistry(state_dir)
    reg.register("a", peft_dirs["r4"])
    reg.register("b", peft_dirs["r4"])
    reg.unregister("a")
    with pytest.raises(BrokerError) as e:
        reg.unregister("a")
    assert e.value.code == Code.NOT_FOUND
    reg.close()
    assert [i.adapter_id for i in AdapterRegistry(state_dir).list().adapters] == ["b"]


# --------------------------------------------------------------------- layout


def _random_specs(rng: random.Random, n: int) -> list[LoraModuleSpec]:
    return [
        LoraModuleSpec(i // 3, f"m{i % 3}", rng.randint(1, 40), rng.randint(1, 700), rng.randint(1, 700), 1.0)
        for i in range(n)
    ]


@pytest.mark.parametrize("dtype,align", [("float32", 16), ("bfloat16", 16), ("float16", 2), ("float32", 4)])
def test_layout_rows_never_straddle_pages_and_pack_densely(dtype, align):
    rng = random.Random(7)
    page = 4096
    for _ in range(20):
        specs = _random_specs(rng, rng.randint(1, 12))
        lay = plan_layout(specs, page, dtype, align)
        es = lay.elem_size
        per_page: dict[int, list[tuple[int, int]]] = {}
        padded = 0
        for m in lay.modules:
            for mp in (m.a, m.b):
                assert sum(c.rows for c in mp.chunks) == mp.rows == m.rank
                assert mp.row_stride % align == 0 and mp.row_stride >= mp.row_elems * es
                for p, off in mp.row_positions():
                    end = off + mp.row_elems * es
                    assert 0 <= off and end <= page and off % align == 0
                    assert end <= lay.page_used[p]
                    per_page.setdefault(p, []).append((off, end))
                padded += mp.rows * mp.row_stride
        for spans in per_page.values():
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "rows overlap"
        widest = max(max(m.a.row_stride, m.b.row_stride) for m in lay.modules)
        # Greedy packing wastes less than one row per page.
        assert lay.num_pages <= math.ceil(padded / (page - widest)) + 1
        assert lay.num_pages == len(per_page)


def test_layout_puts_many_small_rows_in_one_page():
    specs = [LoraModuleSpec(layer, "q_proj", 8, 64, 64, 2.0) for layer in range(4)]
    lay = plan_layout(specs, 65536, "bfloat16")
    assert lay.num_pages == 1 and lay.page_used == (4 * 2 * 8 * 128,)
    assert not lay.has_padding


def test_layout_refuses_a_row_longer_than_a_page():
    with pytest.raises(ValueError, match="does not fit in a page"):
        plan_layout([LoraModuleSpec(0, "q_proj", 4, 4096, 8, 1.0)], 4096, "float32")


def test_layout_round_trips_through_dict():
    lay = plan_layout(_random_specs(random.Random(3), 9), 4096, "bfloat16")
    assert AdapterLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay


def test_bf16_conversion_matches_torch():
    x = torch.randn(10_000) * 100
    x[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    ours = f32_to_bf16_bits(x.numpy())
    theirs = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    # Bit for bit, but for the NaN payload (any NaN will do).
    assert np.array_equal(ours[1:], theirs[1:]) and np.isnan(bf16_bits_to_f32(ours[:1]))[0]
    assert np.array_equal(bf16_bits_to_f32(ours)[1:], x.to(torch.bfloat16).float().numpy()[1:])


# -------------------------------------------------------------- manager: bytes


def test_acquired_pages_hold_the_safetensors_tensors_in_the_documented_layout(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        res = await h.manager.acquire(s, list(peft_dirs), with_layout=True)
        view = h.reader()
        try:
            checked = sum(assert_stored_equals_file(view, h.registry, a) for a in res.adapters)
        finally:
            view.close()
        assert checked > 0
        # The layout that comes back is the one the manager reports any time.
        for a in res.adapters:
            assert a.layout == h.manager.layout(a.adapter_id) and len(a.pages) == a.layout.num_pages
        check_invariants(h.store)
        await h.close()

    run(main())


def test_bf16_storage_holds_torch_rounded_weights(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="bfloat16"))
        register_all(h, peft_dirs)
        s = h.store.open_session()
        (a,) = (await h.manager.acquire(s, ["r16"], with_layout=True)).adapters
        meta = h.registry.get("r16")
        tensors = load_torch(meta.weights_path)
        view = h.reader()
        for w in meta.weights:
            for kind in ("A", "B"):
                got = read_matrix(view, a.layout, a.pages, w.layer, w.module, kind)
                t = tensors[meta.weight_key(w.layer, w.module, kind)]
                t = t if kind == "A" else t.T.contiguous()
                assert np.array_equal(got, t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
        view.close()
        await h.close()

    run(main())


def test_offset_tables_reproduce_peft_outputs(peft_dirs, state_dir):
    """Rows gathered through the element-offset tables from a 1-D arena tensor, times the
    layout's scaling, give what PEFT's LoRA layers add to the base output."""

    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        res = await h.manager.acquire(s, list(peft_dirs), with_layout=True)
        view = h.reader()
        nbytes = h.arena.capacity_pages * h.geometry.page_size
        arena = torch.frombuffer(host_buffer(view.phys_base, nbytes), dtype=torch.float32)
        for a in res.adapters:
            ref = load_torch(os.path.join(peft_dirs[a.adapter_id], "reference.safetensors"))
            offs = row_offsets(a.layout, a.pages)
            for m in a.layout.modules:
                table = offset_table([(a.layout, a.pages)], m.layer, [m.module])
                assert np.array_equal(table.a_offsets[0, 0, : m.rank], offs[(m.layer, m.module, "A")])
                a_off = torch.from_numpy(table.a_offsets[0, 0])
                b_off = torch.from_numpy(table.b_offsets[0, 0])
                A = arena[a_off[:, None] + torch.arange(m.in_features)]
                Bt = arena[b_off[:, None] + torch.arange(m.out_features)]
                x = ref["x"][:, : m.in_features]
                delta = float(table.scalings[0]) * (x @ A.T) @ Bt
                torch.testing.assert_close(delta, ref[f"delta.{m.layer}.{m.module}"], rtol=1e-5, atol=1e-5)
        del arena
        view.close()
        await h.close()

    run(main())


def test_offset_table_refuses_to_fuse_slices_of_different_ranks(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        res = await h.manager.acquire(s, ["r8", "pattern"], with_layout=True)
        r8, pattern = res.adapters
        t = offset_table([(r8.layout, r8.pages), None], 0, ["q_proj", "k_proj", "v_proj"], max_rank=16)
        assert t.a_offsets.shape == (2, 3, 16) and list(t.ranks) == [8, 0]
        assert (t.a_offsets[0, :, 8:] == -1).all() and (t.a_offsets[1] == -1).all()
        with pytest.raises(ValueError, match="different ranks or scalings"):
            offset_table([(pattern.layout, pattern.pages)], 1, ["q_proj", "v_proj"])
        await h.close()

    run(main())


CHILD = """
import json, sys
import numpy as np
from safetensors.numpy import load_file
from memory_broker.broker.adapters.layout import AdapterLayout
from memory_broker.broker.adapters.page_writers import read_matrix
from memory_broker.broker.arena.base import ArenaGeometry
from memory_broker.broker.arena.host import HostArenaView
job = json.loads(sys.stdin.read())
view = HostArenaView(ArenaGeometry(*job["geometry"]))
for i, fd in enumerate(job["fds"]):
    view.attach_slab(i, fd, readonly=True)
checked = 0
for a in job["adapters"]:
    layout = AdapterLayout.from_dict(a["layout"])
    tensors = load_file(a["file"])
    for layer, module, key_a, key_b in a["weights"]:
        assert np.array_equal(read_matrix(view, layout, a["pages"], layer, module, "A"), tensors[key_a])
        assert np.array_equal(read_matrix(view, layout, a["pages"], layer, module, "B"), tensors[key_b].T)
        checked += 1
print(json.dumps({{"checked": checked}}))
"""


def test_another_process_reads_the_adapters_through_its_own_mapping(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        res = await h.manager.acquire(s, list(peft_dirs), with_layout=True)
        fds = [h.arena.slab_fd(i) for i in range(h.arena.num_slabs)]
        g = h.geometry
        job = {
            "geometry": [g.page_size, g.pages_per_slab, g.max_slabs, g.window_pages],
            "fds": fds,
            "adapters": [
                {
                    "layout": a.layout.to_dict(),
                    "pages": list(a.pages),
                    "file": h.registry.get(a.adapter_id).weights_path,
                    "weights": [
                        [
                            w.layer,
                            w.module,
                            *(h.registry.get(a.adapter_id).weight_key(w.layer, w.module, k) for k in "AB"),
                        ]
                        for w in h.registry.get(a.adapter_id).weights
                    ],
                }
                for a in res.adapters
            ],
        }
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", CHILD.format(root=ROOT)],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            pass_fds=fds,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        expected = sum(len(h.registry.get(a.adapter_id).weights) for a in res.adapters)
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"checked": expected}
        await h.close()

    run(main())


# ------------------------------------------------------------ manager: sharing


def test_two_sessions_share_one_copy(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s1, s2 = h.store.open_session(), h.store.open_session()
        (a1,) = (await h.manager.acquire(s1, ["r8"])).adapters
        (a2,) = (await h.manager.acquire(s2, ["r8"])).adapters
        assert (a1.object_id, a1.pages, a1.generation) == (a2.object_id, a2.pages, a2.generation)
        assert (a1.found_in, a2.found_in) == (Tier.COLD, Tier.HOT)
        st = h.manager.stats().as_dict()
        assert st["loads"] == {"hot": 1, "warm": 1} and st["hits"]["hot"] == 1
        assert h.store.objects[a1.object_id].pins == {s1: 1, s2: 1}
        assert h.store.stats().by_content[int(ContentType.LORA_WEIGHT)] == (1, len(a1.pages))
        check_invariants(h.store)
        await h.close()

    run(main())


def test_concurrent_acquires_share_one_load(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        sessions = [h.store.open_session() for _ in range(8)]
        results = await asyncio.gather(*(h.manager.acquire(s, ["r16", "r4"]) for s in sessions))
        assert len({r.adapters[0].object_id for r in results}) == 1
        st = h.manager.stats().as_dict()
        assert st["loads"] == {"hot": 2, "warm": 2}
        assert st["shared_loads"] == 14
        obj = h.store.objects[results[0].adapters[0].object_id]
        assert obj.pins == {s: 1 for s in sessions}
        check_invariants(h.store)
        await h.close()

    run(main())


def test_repeat_acquires_add_pins_and_each_release_drops_one(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        (a,) = (await h.manager.acquire(s, ["r4", "r4"])).adapters
        await h.manager.acquire(s, ["r4"])
        obj = h.store.objects[a.object_id]
        assert obj.pins == {s: 2}
        h.manager.release(s, ["r4"])
        assert obj.pins == {s: 1}
        h.manager.release(s, ["r4"])
        assert obj.pin_count == 0 and h.manager.describe("r4").tier == Tier.HOT
        check_invariants(h.store)
        await h.close()

    run(main())


def test_release_refusals_come_from_pin_ownership(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s1, s2 = h.store.open_session(), h.store.open_session()
        await h.manager.acquire(s1, ["r4"])
        cases = [
            (s2, ["r4"], Code.PERMISSION_DENIED),
            (s1, ["r4", "r4"], Code.FAILED_PRECONDITION),
            (s1, ["r8"], Code.FAILED_PRECONDITION),
            (s1, ["nope"], Code.NOT_FOUND),
            (999, ["r4"], Code.PERMISSION_DENIED),
        ]
        for session, ids, code in cases:
            with pytest.raises(BrokerError) as e:
                h.manager.release(session, ids)
            assert e.value.code == code, (ids, e.value)
        assert h.manager.describe("r4").pin_count == 1
        await h.close()

    run(main())


def test_cap_admits_the_first_n_distinct_in_order_and_defers_the_rest(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        res = await h.manager.acquire(s, ["r8", "r4", "r8", "r16", "pattern"], max_adapters=2)
        assert [a.adapter_id for a in res.adapters] == ["r8", "r4"]
        assert res.deferred == ("r16", "pattern")
        assert h.manager.describe("r16").tier == Tier.COLD and h.manager.describe("pattern").tier == Tier.COLD
        assert h.manager.stats().as_dict()["deferred"] == 2
        res = await h.manager.acquire(s, ["r8", "r4"], max_adapters=2)
        assert res.deferred == ()
        await h.close()

    run(main())


def test_unknown_adapter_refuses_the_whole_acquire(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        with pytest.raises(BrokerError) as e:
            await h.manager.acquire(s, ["r4", "missing"])
        assert e.value.code == Code.NOT_FOUND and "missing" in e.value.message
        assert h.manager.describe("r4").tier == Tier.COLD
        with pytest.raises(BrokerError) as e:
            await h.manager.acquire(12345, ["r4"])
        assert e.value.code == Code.PERMISSION_DENIED
        await h.close()

    run(main())


def test_session_end_releases_adapter_pins(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        (a,) = (await h.manager.acquire(s, ["r16"])).adapters
        assert h.manager.describe("r16").pin_count == 1
        h.store.end_session(s)
        assert h.manager.describe("r16").pin_count == 0
        # Idle now: the store may evict it.
        assert a.object_id in {o.object_id for o in h.store.policy}
        check_invariants(h.store)
        await h.close()

    run(main())


# -------------------------------------------------------------- manager: tiers


def test_store_eviction_demotes_idle_adapters_to_warm_and_spares_acquired_ones(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        user, other = h.store.open_session(), h.store.open_session()
        (kept,) = (await h.manager.acquire(user, ["r8"])).adapters
        await h.manager.acquire(user, ["r16"])
        h.manager.release(user, ["r16"])
        free = h.pool.free_pages
        # Another tenant needs (and pins) every page but the acquired adapter's.
        h.store.allocate(other, [Spec(free + 9, TEMP, pin=True)])
        assert h.manager.describe("r16").tier == Tier.WARM
        assert h.manager.describe("r8").tier == Tier.HOT
        assert h.store.objects[kept.object_id].pins == {user: 1}
        assert h.manager.stats().as_dict()["evictions"] == 1
        with pytest.raises(BrokerError) as e:
            h.store.allocate(other, [Spec(1, TEMP)])
        assert e.value.code == Code.RESOURCE_EXHAUSTED
        assert h.manager.describe("r8").tier == Tier.HOT
        check_invariants(h.store)
        await h.close()

    run(main())


def test_generation_changes_after_eviction_and_reload(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        user, other = h.store.open_session(), h.store.open_session()
        (first,) = (await h.manager.acquire(user, ["r16"], with_layout=True)).adapters
        h.manager.release(user, ["r16"])
        filler = h.store.allocate(other, [Spec(h.pool.max_pages, TEMP)])
        assert h.manager.describe("r16").tier == Tier.WARM
        h.store.free(other, [filler[0][0].object_id])
        (second,) = (await h.manager.acquire(user, ["r16"], with_layout=True)).adapters
        assert second.found_in == Tier.WARM and second.generation > first.generation
        assert second.object_id != first.object_id and second.layout == first.layout
        assert h.manager.stats().as_dict()["loads"] == {"hot": 2, "warm": 1}
        view = h.reader()
        assert_stored_equals_file(view, h.registry, second)
        view.close()
        await h.close()

    run(main())


def test_hot_budget_demotes_the_least_recently_used_idle_adapter(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", hot_tier_adapters=2))
        register_all(h, peft_dirs)
        s = h.store.open_session()
        for aid in ("r4", "r8", "r4"):
            await h.manager.acquire(s, [aid])
            h.manager.release(s, [aid])
        await h.manager.acquire(s, ["r16"])
        tiers = {a: h.manager.describe(a).tier for a in ("r4", "r8", "r16")}
        assert tiers == {"r4": Tier.HOT, "r8": Tier.WARM, "r16": Tier.HOT}
        assert h.manager.stats().as_dict()["demotions"] == 1
        await h.close()

    run(main())


def test_resource_exhausted_with_numbers_when_the_hot_budget_is_all_pinned(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", hot_tier_adapters=2))
        register_all(h, peft_dirs)
        s = h.store.open_session()
        await h.manager.acquire(s, ["r4", "r8"])
        with pytest.raises(BrokerError) as e:
            await h.manager.acquire(s, ["r16"])
        msg = e.value.message
        assert e.value.code == Code.RESOURCE_EXHAUSTED
        assert "'r16' needs 9 pages" in msg and "budget 2 adapters" in msg and "pinned by acquires in 2" in msg, msg
        assert "0 evictable" in msg
        assert {a: h.manager.describe(a).tier for a in ("r4", "r8")} == {"r4": Tier.HOT, "r8": Tier.HOT}
        await h.close()

    run(main())


def test_resource_exhausted_with_numbers_when_the_pool_is_all_pinned(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s, other = h.store.open_session(), h.store.open_session()
        await h.manager.acquire(s, ["r4"])
        # Room for r8 (4 pages) but not for r16 (9) besides it.
        h.store.allocate(other, [Spec(h.pool.free_pages - 6, TEMP, pin=True)])
        with pytest.raises(BrokerError) as e:
            await h.manager.acquire(s, ["r8", "r16"])
        msg = e.value.message
        assert e.value.code == Code.RESOURCE_EXHAUSTED
        assert "'r16' needs 9 pages" in msg and "free" in msg and "0 evictable" in msg and "pinned" in msg, msg
        # All or nothing: r8 may have loaded, but the session holds no new pin.
        assert h.manager.describe("r8").pin_count == 0 and h.manager.describe("r4").pin_count == 1
        check_invariants(h.store)
        await h.close()

    run(main())


def test_int8_warm_tier_restores_weights_within_half_a_quantization_step(peft_dirs, state_dir):
    """Stated bound: |restored - original| <= absmax(row) / 127 * 0.5 (+ fp32 rounding)."""

    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", warm_int8=True))
        register_all(h, peft_dirs)
        s = h.store.open_session()
        (a,) = (await h.manager.acquire(s, ["r16"], with_layout=True)).adapters
        meta = h.registry.get("r16")
        tensors = load_numpy(meta.weights_path)
        view = h.reader()
        worst = 0.0
        for w in meta.weights:
            for kind in "AB":
                got = read_matrix(view, a.layout, a.pages, w.layer, w.module, kind)
                want = tensors[meta.weight_key(w.layer, w.module, kind)]
                want = want if kind == "A" else want.T
                bound = np.abs(want).max(axis=1, keepdims=True) / 127 * 0.5 * (1 + 1e-5)
                err = np.abs(got - want)
                assert (err <= bound).all()
                worst = max(worst, float((err / bound).max()))
        view.close()
        assert worst > 0.5  # it is a real quantization, not a copy
        st = h.manager.stats().as_dict()
        assert st["warm_bytes"] < a.layout.weight_bytes / 3  # int8 + scales vs fp32
        await h.close()

    run(main())


def test_warm_budget_drops_least_recently_used_images_to_cold(peft_dirs, state_dir):
    async def main():
        probe = AdapterHarness(state_dir + "-probe")
        register_all(probe, peft_dirs)
        sizes = {n: probe.manager.layout(n).used_bytes for n in peft_dirs}
        await probe.close()
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", warm_tier_bytes=sizes["r8"] + sizes["r4"]))
        register_all(h, peft_dirs)
        await h.manager.prefetch(["r4"], "warm")
        await h.manager.prefetch(["r8"], "warm")
        await h.manager.prefetch(["pattern"], "warm")
        tiers = {a: h.manager.describe(a).tier for a in ("r4", "r8", "pattern")}
        assert tiers["r4"] == Tier.COLD and tiers["pattern"] == Tier.WARM
        assert h.manager.stats().as_dict()["warm_bytes"] <= sizes["r8"] + sizes["r4"]
        await h.close()

    run(main())


def test_prefetch_loads_without_pinning(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        res = await h.manager.prefetch(["r4", "r8"], "hot")
        assert res.loaded == {"r4": Tier.HOT, "r8": Tier.HOT} and not res.failed
        assert h.manager.describe("r4").pin_count == 0
        res = await h.manager.prefetch(["r16"], "warm")
        assert res.loaded == {"r16": Tier.WARM}
        s = h.store.open_session()
        res = await h.manager.acquire(s, ["r4", "r16"])
        assert [a.found_in for a in res.adapters] == [Tier.HOT, Tier.WARM]
        with pytest.raises(BrokerError) as e:
            await h.manager.prefetch(["r4"], "lukewarm")
        assert e.value.code == Code.INVALID_ARGUMENT
        await h.close()

    run(main())


def test_stats_count_hits_and_loads_per_tier(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        for _ in range(3):
            await h.manager.acquire(s, ["r4", "r8"])
        st = h.manager.stats().as_dict()
        assert st["hits"] == {"hot": 4, "warm": 0, "cold": 2}
        assert st["misses"] == {"hot": 2, "warm": 2}
        assert st["hit_rate"] == pytest.approx(4 / 6)
        assert st["loads"] == {"hot": 2, "warm": 2}
        assert st["bytes_loaded"]["hot"] == sum(h.manager.layout(a).used_bytes for a in ("r4", "r8"))
        assert st["resident"] == {"hot": 2, "warm": 2, "cold": 2} and st["hot_pinned_adapters"] == 2
        await h.close()

    run(main())


# ------------------------------------------------------- manager: two-phase


def test_two_phase_acquire_pins_at_prepare_and_keeps_them_at_commit(peft_dirs, state_dir):
    async def main():
        clock = Clock()
        h = AdapterHarness(state_dir, clock=clock)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        res = await h.manager.prepare_acquire(s, ["r8", "r4"], lease_s=5)
        assert res.txn_id and res.deadline_unix > time.time()
        assert h.manager.describe("r8").pin_count == 1
        h.manager.commit_acquire(s, res.txn_id)
        h.manager.commit_acquire(s, res.txn_id)  # idempotent
        clock.now += 60
        h.store.expire()
        assert h.manager.describe("r8").pin_count == 1
        h.manager.release(s, ["r8", "r4"])
        assert h.manager.describe("r8").pin_count == 0
        check_invariants(h.store)
        await h.close()

    run(main())


def test_two_phase_acquire_released_by_abort_lease_end_or_session_end(peft_dirs, state_dir):
    async def main():
        clock = Clock()
        h = AdapterHarness(state_dir, clock=clock)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        res = await h.manager.prepare_acquire(s, ["r8"], lease_s=5)
        h.manager.abort_acquire(s, res.txn_id)
        assert h.manager.describe("r8").pin_count == 0
        with pytest.raises(BrokerError) as e:
            h.manager.commit_acquire(s, res.txn_id)
        assert e.value.code == Code.FAILED_PRECONDITION
        res = await h.manager.prepare_acquire(s, ["r8"], lease_s=5)
        clock.now += 6
        h.store.expire()
        assert h.manager.describe("r8").pin_count == 0
        with pytest.raises(BrokerError) as e:
            h.manager.commit_acquire(s, res.txn_id)
        assert e.value.code == Code.FAILED_PRECONDITION
        res = await h.manager.prepare_acquire(s, ["r8"], lease_s=5)
        other = h.store.open_session()
        with pytest.raises(BrokerError) as e:
            h.manager.commit_acquire(other, res.txn_id)
        assert e.value.code == Code.PERMISSION_DENIED
        h.store.end_session(s)
        assert h.manager.describe("r8").pin_count == 0
        with pytest.raises(BrokerError) as e:
            h.manager.commit_acquire(other, 424242)
        assert e.value.code == Code.NOT_FOUND
        check_invariants(h.store)
        await h.close()

    run(main())


# ----------------------------------------------------- manager: unregister


def test_unregistering_an_acquired_adapter_is_refused(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        await h.manager.acquire(s, ["r8"])
        with pytest.raises(BrokerError) as e:
            h.manager.unregister("r8")
        assert e.value.code == Code.FAILED_PRECONDITION and "release" in e.value.message
        assert "r8" in h.registry and h.manager.describe("r8").tier == Tier.HOT
        await h.close()

    run(main())


def test_unregistering_an_idle_hot_adapter_frees_its_pages(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        await h.manager.acquire(s, ["r16"])
        h.manager.release(s, ["r16"])
        used = h.pool.used_pages
        h.manager.unregister("r16")
        assert h.pool.used_pages == used - 9
        assert "r16" not in h.registry and h.manager.stats().as_dict()["resident"]["hot"] == 0
        with pytest.raises(BrokerError) as e:
            await h.manager.acquire(s, ["r16"])
        assert e.value.code == Code.NOT_FOUND
        check_invariants(h.store)
        await h.close()

    run(main())


def test_unregistering_while_a_prefetch_loads_aborts_the_load(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        task = asyncio.ensure_future(h.manager.prefetch(["r16"], "hot"))
        await asyncio.sleep(0)
        h.manager.unregister("r16")
        res = await task
        assert res.failed["r16"].code == Code.NOT_FOUND
        assert int(ContentType.LORA_WEIGHT) not in h.store.stats().by_content
        check_invariants(h.store)
        await h.close()

    run(main())


def test_changed_source_files_fail_the_load_not_the_registry(peft_dirs, state_dir, tmp_path):
    async def main():
        h = AdapterHarness(state_dir)
        path = copy_adapter(peft_dirs["r4"], str(tmp_path / "moving"))
        h.registry.register("moving", path)
        edit_tensors(path, _add_tensor(f"{Q0}.lora_A.weight", (4, 32)))
        s = h.store.open_session()
        with pytest.raises(BrokerError) as e:
            await h.manager.acquire(s, ["moving"])
        assert e.value.code == Code.FAILED_PRECONDITION and "changed since registration" in e.value.message
        assert h.store.stats().objects == 0
        await h.close()

    run(main())


# ---------------------------------------------------------------- restart


def test_after_a_restart_every_adapter_is_listed_and_can_be_acquired(peft_dirs, state_dir):
    async def first():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        await h.manager.acquire(s, ["r4"])
        await h.close()

    async def second():
        h = AdapterHarness(state_dir)
        assert [i.adapter_id for i in h.registry.list().adapters] == sorted(peft_dirs)
        s = h.store.open_session()
        res = await h.manager.acquire(s, list(peft_dirs), with_layout=True)
        view = h.reader()
        for a in res.adapters:
            assert a.found_in == Tier.COLD
            assert_stored_equals_file(view, h.registry, a)
        view.close()
        await h.close()

    run(first())
    run(second())


# ---------------------------------------------------------- policies, traces


def test_policies_order_victims():
    lru = LRUPolicy()
    for k in "abc":
        lru.insert(k, 1)
    lru.access("a")
    assert list(lru.victims()) == ["b", "c", "a"]
    lfu = LFUPolicy()
    for k, uses in (("a", 3), ("b", 1), ("c", 2)):
        lfu.insert(k, 1)
        for _ in range(uses):
            lfu.access(k)
    assert list(lfu.victims()) == ["b", "c", "a"]
    lfu.remove("a")
    lfu.insert("a", 1)  # history survives demotion
    assert list(lfu.victims())[-1] == "a"
    gdsf = GDSFPolicy()
    gdsf.insert("small", 1)
    gdsf.insert("big", 10)
    assert list(gdsf.victims())[0] == "big"


def test_skewed_traffic_keeps_lru_hit_rate_above_75_percent(peft_dirs, state_dir):
    """The lab's scenario through the real manager: 16 adapters, 4 hot slots, 80% of requests
    to the hottest 20% (3 adapters) and the other 20% uniformly over all 16."""

    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", hot_tier_adapters=4))
        ids = [f"t{i:02d}" for i in range(16)]
        for aid in ids:
            h.registry.register(aid, peft_dirs["r4"])
        rng = random.Random(0)
        s = h.store.open_session()
        for _ in range(3000):
            aid = rng.choice(ids[:3]) if rng.random() < 0.8 else rng.choice(ids)
            await h.manager.acquire(s, [aid])
            h.manager.release(s, [aid])
        st = h.manager.stats().as_dict()
        assert st["hit_rate"] > 0.75, st
        assert st["resident"]["hot"] == 4
        check_invariants(h.store)
        await h.close()

    run(main())


def test_two_copy_threads_build_the_same_image(peft_dirs, state_dir):
    from memory_broker.broker.adapters.warm_image import build_warm_image

    reg = AdapterRegistry(state_dir)
    for name in ("r8", "pattern"):
        meta = reg.register(name, peft_dirs[name])
        for dtype in ("float32", "bfloat16"):
            layout = plan_layout(meta.weights, 4096, dtype)
            one = build_warm_image(meta, layout, threads=1).packed
            two = build_warm_image(meta, layout, threads=2).packed
            assert np.array_equal(one, two)


def test_a_cancelled_acquire_leaves_no_pins_behind(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        task = asyncio.ensure_future(h.manager.acquire(s, ["r16", "r8"]))
        while not h.manager.describe("r16").loading:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The shared loads run on; once they finish nothing holds the adapters.
        while h.manager.describe("r16").loading or h.manager.describe("r8").loading:
            await asyncio.sleep(0.001)
        for aid in ("r16", "r8"):
            st = h.manager.describe(aid)
            assert st.tier == Tier.HOT
            # No session's pin and no pin of the manager's own (a hold for the cancelled call).
            assert h.store.objects[st.object_id].pin_count == 0
        check_invariants(h.store)
        (a,) = (await h.manager.acquire(s, ["r16"])).adapters
        assert a.found_in == Tier.HOT
        await h.close()

    run(main())


@pytest.mark.parametrize("int8", [False, True])
def test_the_tensor_page_writer_writes_the_same_pages(peft_dirs, state_dir, int8):
    """The writer used for device arenas (through ArenaView.tensor), run on the host arena."""
    from memory_broker.broker.adapters.page_writers import TensorPageWriter

    async def main():
        ref = AdapterHarness(state_dir + "-ref", config=AdapterConfig(dtype="bfloat16", warm_int8=int8))
        h = AdapterHarness(
            state_dir, config=AdapterConfig(dtype="bfloat16", warm_int8=int8), page_writer=TensorPageWriter
        )
        for x in (ref, h):
            register_all(x, peft_dirs)
        s1, s2 = ref.store.open_session(), h.store.open_session()
        (a,) = (await ref.manager.acquire(s1, ["r16"], with_layout=True)).adapters
        (b,) = (await h.manager.acquire(s2, ["r16"], with_layout=True)).adapters
        v1, v2 = ref.reader(), h.reader()
        for m in a.layout.modules:
            for kind in "AB":
                assert np.array_equal(
                    read_matrix(v1, a.layout, a.pages, m.layer, m.module, kind),
                    read_matrix(v2, b.layout, b.pages, m.layer, m.module, kind),
                )
        v1.close()
        v2.close()
        await ref.close()
        await h.close()

    run(main())


def test_unregistering_several_changes_nothing_when_one_is_acquired(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        s = h.store.open_session()
        await h.manager.acquire(s, ["r8"])
        await h.manager.prefetch(["r4"], "hot")
        with pytest.raises(BrokerError) as e:
            h.manager.unregister_many(["r4", "r8"])
        assert e.value.code == Code.FAILED_PRECONDITION and "'r8'" in e.value.message
        assert "r4" in h.registry and h.manager.resident("r4").tier == Tier.HOT
        h.manager.release(s, ["r8"])
        h.manager.unregister_many(["r4", "r8"])
        assert "r4" not in h.registry and "r8" not in h.registry
        assert h.manager.resident("r4") is None and h.pool.used_pages == 0
        assert [i.use_rslora for i in h.registry.list().adapters] == [False, True]  # pattern, r16
        await h.close()

    run(main())


# ------------------------------------------------------- converted-image cache


def _image_path(h: AdapterHarness, adapter_id: str) -> str:
    return h.manager.images.path(adapter_id)


def _no_file_reads(monkeypatch) -> None:
    """Any read of a safetensors file (a rebuild instead of the image) fails the test."""
    import memory_broker.broker.adapters.image_service as manager_mod
    import memory_broker.broker.adapters.warm_image as tiers_mod

    def boom(*a, **k):
        raise AssertionError("the safetensors file was read: the image cache was not used")

    monkeypatch.setattr(manager_mod, "build_warm_image", boom)
    monkeypatch.setattr(manager_mod, "build_packed_into", boom)
    monkeypatch.setattr(tiers_mod, "WeightsFile", boom)


async def _acquire_and_check(h: AdapterHarness, ids) -> list:
    s = h.store.open_session()
    res = await h.manager.acquire(s, list(ids), with_layout=True)
    view = h.reader()
    try:
        for a in res.adapters:
            assert assert_stored_equals_file(view, h.registry, a) > 0
    finally:
        view.close()
    h.manager.release(s, list(ids))
    return list(res.adapters)


def test_first_cold_load_writes_the_image_and_a_restart_loads_from_it(peft_dirs, state_dir, monkeypatch):
    async def first():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        await _acquire_and_check(h, peft_dirs)
        await h.manager.wait_image_writes()
        for name in peft_dirs:
            path = _image_path(h, name)
            assert os.path.dirname(path) == os.path.join(state_dir, "images")
            assert os.path.getsize(path) == 4096 + h.manager.layout(name).used_bytes
        assert not [f for f in os.listdir(os.path.join(state_dir, "images")) if f.endswith(".tmp")]
        st = h.manager.stats().as_dict()["images"]
        assert st["enabled"] and st["misses"] == len(peft_dirs) and st["writes"] == len(peft_dirs) and st["hits"] == 0
        await h.close()

    async def second():
        _no_file_reads(monkeypatch)
        h = AdapterHarness(state_dir)
        adapters = await _acquire_and_check(h, peft_dirs)
        assert all(a.found_in == Tier.COLD for a in adapters)
        st = h.manager.stats().as_dict()["images"]
        assert st["hits"] == len(peft_dirs) and st["misses"] == 0 and st["rejected"] == 0
        check_invariants(h.store)
        await h.close()

    run(first())
    run(second())


def test_demoted_to_cold_reloads_from_the_image(peft_dirs, state_dir, monkeypatch):
    async def main():
        # No warm tier: a demoted adapter is cold again.
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", warm_tier_bytes=0))
        h.registry.register("r8", peft_dirs["r8"])
        await _acquire_and_check(h, ["r8"])
        await h.manager.wait_image_writes()
        assert h.manager.demote("r8") == Tier.COLD
        _no_file_reads(monkeypatch)
        (a,) = await _acquire_and_check(h, ["r8"])
        assert a.found_in == Tier.COLD and h.manager.stats().as_dict()["images"]["hits"] == 1
        await h.close()

    run(main())


def test_a_changed_weights_file_or_layout_invalidates_the_image(peft_dirs, state_dir, tmp_path):
    path = copy_adapter(peft_dirs["r4"], str(tmp_path / "changing"))
    wpath = os.path.join(path, "adapter_model.safetensors")

    async def load(config=None, expect_rejected=0):
        h = AdapterHarness(state_dir, config=config)
        if "x" not in h.registry:
            h.registry.register("x", path)
        if config is None:
            await _acquire_and_check(h, ["x"])
        else:
            s = h.store.open_session()
            await h.manager.acquire(s, ["x"])
        await h.manager.wait_image_writes()
        st = h.manager.stats().as_dict()["images"]
        assert st["rejected"] == expect_rejected
        await h.close()
        return st

    st = run(load())
    assert st["misses"] == 1
    assert run(load())["hits"] == 1
    # Same shapes, new values, and a new mtime: the image is stale and rebuilt from the file.
    old = os.stat(wpath).st_mtime_ns
    edit_tensors(path, lambda t: t.__setitem__(f"{Q0}.lora_B.weight", t[f"{Q0}.lora_B.weight"] * 2 + 1))
    os.utime(wpath, ns=(old + 10**9, old + 10**9))
    st = run(load(expect_rejected=1))
    assert st["misses"] == 1 and st["hits"] == 0 and st["writes"] == 1
    assert run(load())["hits"] == 1
    # Another storage dtype: another geometry, never the float32 image.
    st = run(load(AdapterConfig(dtype="bfloat16"), expect_rejected=1))
    assert st["misses"] == 1 and st["hits"] == 0
    assert run(load(AdapterConfig(dtype="bfloat16")))["hits"] == 1


@pytest.mark.parametrize("damage", ["truncated", "garbage header", "header of another adapter", "empty"])
def test_a_corrupt_image_is_ignored_and_rebuilt(peft_dirs, state_dir, damage, monkeypatch):
    async def first():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        await _acquire_and_check(h, ["r8", "r16"])
        await h.close()
        return h.manager.images.path("r8"), h.manager.images.path("r16")

    p8, p16 = run(first())
    if damage == "truncated":
        os.truncate(p8, os.path.getsize(p8) - 100)
    elif damage == "garbage header":
        with open(p8, "r+b") as f:
            f.seek(12)
            f.write(b"\xff{not json")
    elif damage == "header of another adapter":
        os.replace(p16, p8)
    else:
        open(p8, "wb").close()

    async def second():
        h = AdapterHarness(state_dir)
        await _acquire_and_check(h, ["r8"])
        st = h.manager.stats().as_dict()["images"]
        assert st["rejected"] == 1 and st["misses"] == 1 and st["hits"] == 0
        await h.close()

    async def third():
        _no_file_reads(monkeypatch)
        h = AdapterHarness(state_dir)
        await _acquire_and_check(h, ["r8"])
        assert h.manager.stats().as_dict()["images"]["hits"] == 1
        await h.close()

    run(second())
    assert os.path.getsize(p8) > 4096
    run(third())


def test_unregister_deletes_the_image(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        register_all(h, peft_dirs)
        await _acquire_and_check(h, ["r4", "r8"])
        await h.manager.wait_image_writes()
        p4, p8 = _image_path(h, "r4"), _image_path(h, "r8")
        assert os.path.exists(p4) and os.path.exists(p8)
        h.manager.unregister("r4")
        assert not os.path.exists(p4) and os.path.exists(p8)
        # Unregistered while its image is still being written: the image goes too.
        h.manager.demote("r8")
        await h.manager.prefetch(["r16"], "warm")
        h.manager.unregister("r16")
        await h.manager.wait_image_writes()
        assert not os.path.exists(_image_path(h, "r16"))
        await h.close()

    run(main())


def test_image_cache_off_writes_nothing(peft_dirs, state_dir):
    async def main():
        for config in (
            AdapterConfig(dtype="float32", image_cache=False),
            AdapterConfig(dtype="float32", warm_int8=True),
        ):
            h = AdapterHarness(state_dir, config=config)
            if "r8" not in h.registry:
                h.registry.register("r8", peft_dirs["r8"])
            s = h.store.open_session()
            await h.manager.acquire(s, ["r8"])
            assert h.manager.images is None and not h.manager.stats().as_dict()["images"]["enabled"]
            await h.close()
            assert not os.path.exists(os.path.join(state_dir, "images")) or not os.listdir(
                os.path.join(state_dir, "images")
            )

    run(main())


def test_image_cache_writer_and_reader_round_trip(peft_dirs, state_dir, tmp_path):
    from memory_broker.broker.adapters.image_cache import ImageCache
    from memory_broker.broker.adapters.warm_image import build_warm_image

    reg = AdapterRegistry(state_dir)
    meta = reg.register("a:b/c@d", peft_dirs["pattern"])
    layout = plan_layout(meta.weights, 8192, "bfloat16", 64)
    cache = ImageCache(str(tmp_path / "imgs"))
    assert cache.load(meta, layout) == (None, "")
    built = build_warm_image(meta, layout)
    assert cache.store(meta, built) == 4096 + layout.used_bytes
    assert "/" not in os.path.basename(cache.path(meta.adapter_id))
    got, why = cache.load(meta, layout)
    assert why == "" and np.array_equal(got.packed, built.packed)
    other = plan_layout(meta.weights, 16384, "bfloat16", 64)
    got, why = cache.load(meta, other)
    assert got is None and "page_size" in why
    assert cache.remove(meta.adapter_id) and not cache.remove(meta.adapter_id)
    reg.close()


# ------------------------------------------------------ conversion ahead of use


def _images(state_dir: str) -> list[str]:
    d = os.path.join(state_dir, "images")
    return sorted(f for f in os.listdir(d)) if os.path.isdir(d) else []


def test_registering_converts_ahead_so_the_first_acquire_reads_the_image(peft_dirs, state_dir, monkeypatch):
    async def main():
        h = AdapterHarness(state_dir)
        for name in ("r4", "r8"):
            await h.manager.register(name, peft_dirs[name])
        await h.manager.wait_conversions()
        st = h.manager.stats().as_dict()["images"]
        assert st["converted_ahead"] == 2 and st["writes"] == 2 and st["count"] == 2 and st["convert_queued"] == 0
        assert st["bytes"] == sum(4096 + h.manager.layout(n).used_bytes for n in ("r4", "r8"))
        assert len(_images(state_dir)) == 2
        # Nothing went warm or hot: conversion ahead of use only writes images.
        assert h.manager.stats().as_dict()["resident"] == {"hot": 0, "warm": 0, "cold": 2}
        _no_file_reads(monkeypatch)
        adapters = await _acquire_and_check(h, ["r4", "r8"])
        assert [a.found_in for a in adapters] == [Tier.COLD, Tier.COLD]
        st = h.manager.stats().as_dict()["images"]
        assert st["hits"] == 2 and st["misses"] == 0
        await h.close()

    run(main())


def test_conversion_ahead_of_use_keeps_to_its_duty_cycle_and_shows_its_backlog(peft_dirs, state_dir, monkeypatch):
    import memory_broker.broker.adapters.image_service as manager_mod

    pauses: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(s, *a, **kw):
        pauses.append(s)
        await real_sleep(0)

    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", convert_duty=0.2))
        monkeypatch.setattr(manager_mod.asyncio, "sleep", sleep)
        meta = h.registry.inspect(peft_dirs["r4"])
        h.registry.add_many([(f"bulk/{i}", meta) for i in range(6)])
        assert h.manager.schedule_conversions([f"bulk/{i}" for i in range(6)]) == 6
        assert h.manager.stats().as_dict()["images"]["convert_queued"] >= 5  # the backlog is visible
        await h.manager.wait_conversions()
        st = h.manager.stats().as_dict()["images"]
        assert st["converted_ahead"] == 6 and st["convert_queued"] == 0
        # After each conversion it slept 4x its time (duty 0.2): pauses are positive.
        assert len([p for p in pauses if p > 0]) >= 6
        await h.close()

    run(main())


def test_convert_ahead_off_converts_only_on_first_load(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", convert_ahead=False))
        await h.manager.register("r4", peft_dirs["r4"])
        await h.manager.wait_conversions()
        assert _images(state_dir) == [] and h.manager.stats().as_dict()["images"]["converted_ahead"] == 0
        await _acquire_and_check(h, ["r4"])
        await h.manager.wait_image_writes()
        st = h.manager.stats().as_dict()["images"]
        assert st["misses"] == 1 and st["writes"] == 1 and len(_images(state_dir)) == 1
        await h.close()

    run(main())


def test_an_acquire_during_the_conversion_waits_for_it_and_reads_the_image(peft_dirs, state_dir, monkeypatch):
    import threading

    import memory_broker.broker.adapters.image_service as manager_mod

    builds = []
    release = threading.Event()
    real = manager_mod.build_packed_into  # what conversion ahead of use builds with

    def slow(*a, **k):
        builds.append(threading.current_thread().name)
        release.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(manager_mod, "build_packed_into", slow)

    async def main():
        h = AdapterHarness(state_dir)
        await h.manager.register("r8", peft_dirs["r8"])
        while not builds:  # the conversion has started (and is held)
            await asyncio.sleep(0.01)
        acquire = asyncio.ensure_future(_acquire_and_check(h, ["r8"]))
        await asyncio.sleep(0.1)
        assert not acquire.done()
        release.set()
        (a,) = await acquire
        st = h.manager.stats().as_dict()["images"]
        # One conversion (in the convert thread); the load read its image.
        assert builds == ["adapter-convert_0"] and st["converted_ahead"] == 1
        assert st["hits"] == 1 and st["misses"] == 0 and a.found_in == Tier.COLD
        await h.close()

    run(main())


def test_unregistering_during_conversion_leaves_no_image(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)
        for name in ("r4", "r8", "r16"):
            await h.manager.register(name, peft_dirs[name])
        # r4 is converting or about to; r8 and r16 are queued.
        h.manager.unregister("r4")
        h.manager.unregister("r16")
        await h.manager.wait_conversions()
        await h.manager.wait_image_writes()
        assert _images(state_dir) == [os.path.basename(_image_path(h, "r8"))]
        st = h.manager.stats().as_dict()["images"]
        assert st["count"] == 1 and st["bytes"] == 4096 + h.manager.layout("r8").used_bytes
        await h.close()

    run(main())


def test_image_budget_conversions_take_free_room_loads_push_out_the_oldest(peft_dirs, state_dir):
    async def main():
        cfg = AdapterConfig(dtype="float32")
        probe = AdapterHarness(state_dir + "-probe", config=cfg)
        for name in ("r4", "r8", "r16"):
            probe.registry.register(name, peft_dirs[name])
        size = {n: 4096 + probe.manager.layout(n).used_bytes for n in ("r4", "r8", "r16")}
        await probe.close()
        # Room for r8 and r16, so for r4 and r8 but not for r16 besides them.
        budget = size["r8"] + size["r16"]
        assert size["r4"] < size["r16"]
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", image_budget=budget))
        for name in ("r4", "r8", "r16"):
            await h.manager.register(name, peft_dirs[name])
        await h.manager.wait_conversions()
        st = h.manager.stats().as_dict()["images"]
        assert st["converted_ahead"] == 2 and st["convert_skipped"] == 1 and st["evictions"] == 0
        assert sorted(_images(state_dir)) == sorted(os.path.basename(_image_path(h, n)) for n in ("r4", "r8"))
        # r8 is used, so r4 is the least recently used image.
        await _acquire_and_check(h, ["r8"])
        # r16's first load converts it and stores its image, pushing out r4.
        await _acquire_and_check(h, ["r16"])
        await h.manager.wait_image_writes()
        st = h.manager.stats().as_dict()["images"]
        assert st["evictions"] == 1 and st["bytes"] <= budget
        assert sorted(_images(state_dir)) == sorted(os.path.basename(_image_path(h, n)) for n in ("r8", "r16"))
        assert st["bytes"] == size["r8"] + size["r16"]
        # r4 still loads (from its file) and still works.
        (a,) = await _acquire_and_check(h, ["r4"])
        assert a.found_in == Tier.COLD
        await h.close()

    run(main())


def test_start_prunes_orphan_images_and_converts_the_registered_ones_without_one(peft_dirs, state_dir):
    async def first():
        h = AdapterHarness(state_dir)
        # Registered behind the manager's back (as by an older broker): no images yet.
        for name in ("r4", "r8"):
            h.registry.register(name, peft_dirs[name])
        await h.close()

    run(first())
    d = os.path.join(state_dir, "images")
    os.makedirs(d, exist_ok=True)
    orphan = os.path.join(d, "gone-0123456789abcdef.img")
    with open(orphan, "wb") as f:
        f.write(b"\0" * 5000)
    leftover = os.path.join(d, "r4-feed.img.1.2.tmp")
    open(leftover, "wb").close()

    async def second(monkeypatch_free=True):
        h = AdapterHarness(state_dir)
        assert not os.path.exists(leftover)  # a torn write of a crashed broker
        assert h.manager.images.used_bytes == 5000
        await h.manager.start()
        assert not os.path.exists(orphan)
        await h.manager.wait_conversions()
        assert sorted(_images(state_dir)) == sorted(os.path.basename(_image_path(h, n)) for n in ("r4", "r8"))
        st = h.manager.stats().as_dict()["images"]
        assert st["converted_ahead"] == 2 and st["bytes"] == sum(
            4096 + h.manager.layout(n).used_bytes for n in ("r4", "r8")
        )
        # A second start finds every image in place: nothing to convert.
        await h.manager.start()
        await h.manager.wait_conversions()
        assert h.manager.stats().as_dict()["images"]["converted_ahead"] == 2
        await h.close()

    run(second())


def test_image_cache_budget_accounting(peft_dirs, state_dir, tmp_path):
    from memory_broker.broker.adapters.image_cache import ImageCache
    from memory_broker.broker.adapters.warm_image import build_warm_image

    reg = AdapterRegistry(state_dir)
    metas = [reg.register(n, peft_dirs[n]) for n in ("r4", "r8", "r16")]
    layouts = [plan_layout(m.weights, 8192, "float32") for m in metas]
    images = [build_warm_image(m, lay) for m, lay in zip(metas, layouts)]
    sizes = [4096 + lay.used_bytes for lay in layouts]
    d = str(tmp_path / "imgs")
    with pytest.raises(ValueError, match="budget"):
        ImageCache(d, max_bytes=-1)
    cache = ImageCache(d, max_bytes=sizes[0] + sizes[2])
    assert sizes[1] < sizes[2]
    assert cache.store(metas[0], images[0]) == sizes[0]
    assert cache.store(metas[1], images[1], evict=False) == sizes[1]
    assert cache.fits(layouts[2]) is False
    # No room without evicting: nothing stored, nothing lost.
    assert cache.store(metas[2], images[2], evict=False) == 0
    assert cache.used_bytes == sizes[0] + sizes[1] and cache.count == 2
    # Loading r4 makes r8 the least recently used; a store with evict pushes it out.
    assert cache.load(metas[0], layouts[0])[0] is not None
    assert cache.store(metas[2], images[2]) == sizes[2]
    assert not cache.has("r8") and cache.has("r4") and cache.has("r16") and cache.evictions == 1
    assert not os.path.exists(cache.path("r8"))
    assert cache.used_bytes == sizes[0] + sizes[2] <= cache.max_bytes
    # Storing the same adapter again replaces its bytes, not adds to them.
    assert cache.store(metas[2], images[2]) == sizes[2] and cache.used_bytes == sizes[0] + sizes[2]
    # An image larger than the whole budget is never stored.
    small = ImageCache(str(tmp_path / "small"), max_bytes=sizes[0] - 1)
    assert small.store(metas[0], images[0]) == 0 and small.count == 0 and os.listdir(small.directory) == []
    # A new cache over the same directory counts what is there.
    again = ImageCache(d)
    assert again.used_bytes == cache.used_bytes and sorted(again.paths()) == sorted(cache.paths())
    assert again.valid(metas[0], layouts[0]) and not again.valid(metas[1], layouts[1])
    assert again.remove("r4") and again.used_bytes == sizes[2]
    reg.close()


def test_a_failed_conversion_is_counted_and_the_first_load_converts_instead(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir)

        def broken(meta, layout):
            raise OSError(28, "No space left on device")

        h.manager.image_service.convert_one = broken
        await h.manager.register("r8", peft_dirs["r8"])
        await h.manager.wait_conversions()
        st = h.manager.stats().as_dict()["images"]
        assert st["convert_failures"] == 1 and st["converted_ahead"] == 0 and _images(state_dir) == []
        (a,) = await _acquire_and_check(h, ["r8"])
        await h.manager.wait_image_writes()
        st = h.manager.stats().as_dict()["images"]
        assert a.found_in == Tier.COLD and st["misses"] == 1 and st["writes"] == 1 and len(_images(state_dir)) == 1
        check_invariants(h.store)
        await h.close()

    run(main())
