"""Adapters through the daemon: registration, sharing across processes, restart, errors, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from adapter_fixtures import copy_adapter, edit_config, peft_dirs  # noqa: F401 - fixture
from conftest import ROOT, run_child, start_broker

from memory_broker.clients import AdapterTables, BrokerClient
from memory_broker.proto.wire.errors import BrokerError, Code

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores


def adapter_broker(state_dir: str | None = None, *extra: str):
    args = ["--pool-size", "64MiB", "--slab-size", "4MiB", "--page-size", "512KiB", "--adapter-dtype", "float32"]
    if state_dir:
        args += ["--state-dir", state_dir]
    return start_broker(*args, *extra)


def expected_rows(path: str) -> dict[tuple[int, str, str], torch.Tensor]:  # noqa: F821
    """From the safetensors file: (layer, module, "A"|"B") -> rows as the layout stores them."""
    from safetensors.torch import load_file

    out = {}
    for k, t in load_file(os.path.join(path, "adapter_model.safetensors")).items():
        parts = k.split(".")
        layer = int(parts[parts.index("layers") + 1])
        module = parts[-3]
        kind = parts[-2][-1]  # lora_A / lora_B
        out[(layer, module, kind)] = t if kind == "A" else t.t().contiguous()
    return out


def test_adapters_are_shared_across_processes_and_bytes_match_the_files(peft_dirs):  # noqa: F811
    b = adapter_broker()
    try:
        with BrokerClient.connect(b.socket) as c:
            for name in ("r4", "r8", "r16"):
                info = c.register_adapter(name, peft_dirs[name])
                assert info.adapter_id == name and info.tier == 3  # cold until used
            listing = c.list_adapters()
            assert [a.adapter_id for a in listing.adapters] == ["r16", "r4", "r8"] and listing.total == 3
            with c.acquire_adapters(["r4", "r8", "r16"]) as lease:
                assert [a.found_in for a in lease.adapters] == ["cold", "cold", "cold"]
                mine = {a.adapter_id: (a.object_id, a.generation) for a in lease.adapters}
                # A second process acquires the same adapters: same objects, no new load, and
                # it reads the weights through its own mapping.
                lines = run_child(
                    b.socket,
                    """
                    import torch
                    from safetensors.torch import load_file
                    with BrokerClient.connect(SOCKET) as c:
                        with c.acquire_adapters(["r4", "r8", "r16"]) as lease:
                            arena = c.arena_tensor(torch.float32)
                            res = {}
                            for a in lease.adapters:
                                rows = {f"{l}.{m}.{k}": arena[off[:, None] + torch.arange(n)[None, :]].tolist()
                                        for (l, m, k), off in ((key, torch.from_numpy(v)) for key, v in a.row_offsets().items())
                                        for n in [a.layout.matrix(l, m, k).row_elems]}
                                res[a.adapter_id] = dict(object_id=a.object_id, generation=a.generation,
                                                         found_in=a.found_in, rows=rows)
                            out(**res)
                    """,
                )
                seen = lines[0]
                st = c.stats().adapters
        for name in ("r4", "r8", "r16"):
            got = seen[name]
            assert (got["object_id"], got["generation"]) == mine[name]
            assert got["found_in"] == "hot"
            want = expected_rows(peft_dirs[name])
            assert set(got["rows"]) == {f"{layer}.{m}.{k}" for (layer, m, k) in want}
            import torch

            for (layer, module, kind), t in want.items():
                assert torch.equal(torch.tensor(got["rows"][f"{layer}.{module}.{kind}"]), t.float()), (
                    name,
                    layer,
                    module,
                    kind,
                )
        assert st.loads_hot == 3 and st.found_hot == 3 and st.found_cold == 3
    finally:
        b.stop()


def test_restart_keeps_every_registered_adapter_acquirable(peft_dirs, tmp_path):  # noqa: F811
    state = str(tmp_path / "state")
    b = adapter_broker(state)
    with BrokerClient.connect(b.socket) as c:
        for name in ("r4", "r8", "pattern"):
            c.register_adapter(name, peft_dirs[name])
    assert b.stop() == 0
    b2 = adapter_broker(state)
    try:
        with BrokerClient.connect(b2.socket) as c:
            assert sorted(a.adapter_id for a in c.list_adapters().adapters) == ["pattern", "r4", "r8"]
            with c.acquire_adapters(["pattern", "r8"]) as lease:
                assert lease.ids == ["pattern", "r8"] and all(a.generation > 0 for a in lease.adapters)
    finally:
        b2.stop()


def test_invalid_directories_are_refused_with_the_reason_and_change_nothing(peft_dirs, tmp_path):  # noqa: F811
    dora = copy_adapter(peft_dirs["r4"], str(tmp_path / "dora"))
    edit_config(dora, use_dora=True)
    missing = str(tmp_path / "missing")
    b = adapter_broker(None, "--adapter-max-rank", "8")
    try:
        with BrokerClient.connect(b.socket) as c:
            c.register_adapter("ok", peft_dirs["r4"])
            for aid, path, words in (
                ("dora", dora, "DoRA"),
                ("missing", missing, "missing"),
                ("big", peft_dirs["r16"], "rank"),
                ("ok", peft_dirs["r8"], "already"),
            ):
                with pytest.raises(BrokerError) as e:
                    c.register_adapter(aid, path)
                assert e.value.code in (Code.INVALID_ARGUMENT, Code.ALREADY_EXISTS), e.value
                assert words.lower() in e.value.message.lower(), e.value.message
            assert [a.adapter_id for a in c.list_adapters().adapters] == ["ok"]
    finally:
        b.stop()


def test_a_cap_defers_the_overflow_and_acquired_adapters_cannot_be_unregistered(peft_dirs):  # noqa: F811
    b = adapter_broker()
    try:
        with BrokerClient.connect(b.socket) as c:
            for name in ("r4", "r8", "r16"):
                c.register_adapter(name, peft_dirs[name])
            with c.acquire_adapters(["r8", "r4", "r8", "r16"], max_adapters=2) as lease:
                assert lease.ids == ["r8", "r4"] and lease.deferred == ["r16"]
                with pytest.raises(BrokerError) as e:
                    c.unregister_adapters(["r4"])
                assert e.value.code == Code.FAILED_PRECONDITION
            c.unregister_adapters(["r4"])  # released: now it can go
            assert c.list_adapters().total == 2
    finally:
        b.stop()


def test_offset_tables_are_built_once_per_generation(peft_dirs):  # noqa: F811
    b = adapter_broker()
    try:
        with BrokerClient.connect(b.socket) as c:
            c.register_adapter("r8", peft_dirs["r8"])
            tables = AdapterTables()
            with c.acquire_adapters(["r8"]) as lease:
                t1 = tables.tables([lease["r8"]], layer=0, modules=["q_proj", "k_proj", "v_proj"])
                t2 = tables.tables([lease["r8"]], layer=0, modules=["q_proj", "k_proj", "v_proj"])
                gen1 = lease["r8"].generation
            assert t1 is t2 and tables.builds == 1
            a_off, b_off, ranks, scal = t1
            assert a_off.shape == (1, 3, 8) and ranks.tolist() == [8] and scal.tolist() == [2.0]
            # Another placement (the same files under a second id) has its own generation and
            # misses the cache. (Eviction and reload bumping the generation is covered in-process
            # by tests/test_adapters.py.)
            c.register_adapter("r8b", peft_dirs["r8"])
            with c.acquire_adapters(["r8b"]) as lease:
                assert lease["r8b"].generation != gen1
                tables.tables([lease["r8b"]], layer=0, modules=["q_proj", "k_proj", "v_proj"])
            assert tables.builds == 2
    finally:
        b.stop()


def test_adapters_command_lists_registers_and_shows(peft_dirs):  # noqa: F811
    b = adapter_broker()
    try:

        def cli(*args):
            return subprocess.run(
                [sys.executable, "-m", "memory_broker.broker.cli", "adapters", "--socket", b.socket, *args],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )

        r = cli("register", "r4", peft_dirs["r4"])
        assert r.returncode == 0 and "registered r4: rank 4" in r.stdout, r.stderr
        with BrokerClient.connect(b.socket) as c:
            with c.acquire_adapters(["r4"]):
                r = cli("list")
                assert r.returncode == 0 and "1 registered: 1 hot" in r.stdout, r.stdout
                assert any(line.split()[:4] == ["r4", "hot", "4", "1"] for line in r.stdout.splitlines()), r.stdout
                r = cli("show", "r4")
                assert r.returncode == 0 and "q_proj" in r.stdout and "generation" in r.stdout
        r = cli("--json", "list")
        assert json.loads(r.stdout)["adapters"][0]["adapter_id"] == "r4"
        r = cli("register", "bad", "/nonexistent")
        assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr
    finally:
        b.stop()


def test_adapter_metrics_move_with_acquires(peft_dirs):  # noqa: F811
    from test_ops import free_port, metric, scrape

    port = free_port()
    b = adapter_broker(None, "--metrics-port", str(port))
    try:
        with BrokerClient.connect(b.socket) as c:
            c.register_adapter("r4", peft_dirs["r4"])
            with c.acquire_adapters(["r4"]):
                pass
            with c.acquire_adapters(["r4"]):
                pass
            time.sleep(1.3)
            text = scrape(port)
        assert metric(text, "memory_broker_adapter_loads_total", tier="hot") == 1
        assert metric(text, "memory_broker_adapter_hits_total", tier="hot") == 1
        assert metric(text, "memory_broker_adapter_hit_ratio") == 0.5
        # One cold load: served by the image converted ahead, or (had it come first) by
        # converting the file and writing the image.
        reads = [metric(text, "memory_broker_adapter_image_reads_total", result=r) for r in ("hit", "miss", "rejected")]
        assert reads[0] + reads[1] == 1 and reads[2] == 0
        assert metric(text, "memory_broker_adapter_image_bytes") > 4096
        assert metric(text, "memory_broker_adapter_image_budget_bytes") == 64 << 30
        assert metric(text, "memory_broker_adapter_convert_queue") == 0
    finally:
        b.stop()


def test_registered_adapters_are_converted_ahead_and_a_restart_prunes_orphans(peft_dirs, tmp_path):  # noqa: F811
    state = str(tmp_path / "state")
    images = os.path.join(state, "images")

    def wait_images(n: int) -> list[str]:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = sorted(f for f in os.listdir(images) if f.endswith(".img")) if os.path.isdir(images) else []
            if len(got) == n and not [f for f in os.listdir(images) if f.endswith(".tmp")]:
                return got
            time.sleep(0.05)
        raise AssertionError(
            f"expected {n} images in {images}, found {os.listdir(images) if os.path.isdir(images) else []}"
        )

    b = adapter_broker(state)
    with BrokerClient.connect(b.socket) as c:
        for name in ("r4", "r8"):
            c.register_adapter(name, peft_dirs[name])
        first = wait_images(2)
        assert all(f.startswith(("r4-", "r8-")) for f in first)
        # The first acquire of each reads its image, and the bytes are the files' (float32 here).
        with c.acquire_adapters(["r4", "r8"]) as lease:
            assert [a.found_in for a in lease.adapters] == ["cold", "cold"]
            arena = c.arena_tensor(torch.float32)
            for a in lease.adapters:
                want = expected_rows(peft_dirs[a.adapter_id])
                for (layer, module, kind), off in a.row_offsets().items():
                    n = a.layout.matrix(layer, module, kind).row_elems
                    got = arena[torch.from_numpy(off)[:, None] + torch.arange(n)[None, :]]
                    assert torch.equal(got, want[(layer, module, kind)].float())
        st = c.stats().adapters
        assert (st.converted_ahead, st.image_hits, st.image_misses, st.convert_queued) == (2, 2, 0, 0)
        assert st.image_count == 2 and st.image_bytes == sum(os.path.getsize(os.path.join(images, f)) for f in first)
        assert st.image_budget_bytes == 64 << 30
        c.unregister_adapters(["r4"])
        assert wait_images(1)[0].startswith("r8-")
    assert b.stop() == 0
    orphan = os.path.join(images, "gone-0123456789abcdef.img")
    with open(orphan, "wb") as f:
        f.write(b"\0" * 5000)
    b2 = adapter_broker(state)
    try:
        assert wait_images(1)[0].startswith("r8-") and not os.path.exists(orphan)
    finally:
        b2.stop()


@pytest.mark.parametrize("fast_path", [True, False], ids=["step", "grpc"])
def test_an_adapter_id_registered_again_with_other_ranks_gets_its_own_layout(fast_path, tmp_path):
    """Issue 48 item 1's audit: a client caches adapters' layouts; an id unregistered and
    registered again by another process names another adapter (here rank 8, was rank 4), and
    the lease's layout must be the new one's, not the cached one (it was cached by id alone)."""
    from rigs import write_adapter

    b = start_broker()
    try:
        with BrokerClient.connect(b.socket, fast_path=fast_path) as c, BrokerClient.connect(b.socket) as admin:
            admin.register_adapter("x", write_adapter(str(tmp_path / "r4"), 1, rank=4))
            with c.acquire_adapters(["x"]) as lease:
                assert {m.rank for m in lease["x"].layout.modules} == {4}
            admin.unregister_adapters(["x"])
            admin.register_adapter("x", write_adapter(str(tmp_path / "r8"), 2, rank=8))
            with c.acquire_adapters(["x"]) as lease:
                got = lease["x"]
                assert {m.rank for m in got.layout.modules} == {8}, "the layout of the id's old adapter"
                assert got.layout.num_pages == len(got.pages)
    finally:
        b.stop()
