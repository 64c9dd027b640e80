"""Shared content is read-only for clients, and every adapter copy carries a checksum.

A client's mapping keeps adapter pages (and other sessions' objects) read-only from the
moment it learns them, so a write faults instead of changing what every engine reads; pages
it is later given to write become writable again. The broker checks adapter copies against
their checksums on load, on demand and in the background, and a corrupt copy is never
returned again: the next acquire reloads it from its source.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from adapter_fixtures import AdapterHarness, peft_dirs, run  # noqa: F401  (peft_dirs is a fixture)
from conftest import ROOT, child_code, start_broker
from store_invariants import check_invariants

from memory_broker.broker.adapters import AdapterConfig
from memory_broker.broker.adapters.page_writers import read_matrix
from memory_broker.broker.adapters.records import AdapterCorrupted, Tier
from memory_broker.broker.arena.base import ArenaGeometry
from memory_broker.broker.arena.host import HostArena, HostArenaView, host_buffer
from memory_broker.proto.wire.errors import BrokerError, Code


@pytest.fixture
def state_dir(tmp_path) -> str:
    return str(tmp_path / "state")


GEOM = ArenaGeometry(page_size=8192, pages_per_slab=4, max_slabs=4, window_pages=32)


def _write_in_child(fn) -> int:
    """Run ``fn`` in a forked child; its exit status (negative: killed by that signal)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        faulthandler.disable()  # the expected SIGSEGV needs no traceback in the suite's output
        try:
            fn()
            os._exit(0)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _poke(address: int) -> None:
    host_buffer(address, 1)[0] = 7


@pytest.fixture
def arena_and_view():
    arena = HostArena(GEOM, name="readonly-test")
    arena.grow(2)
    view = HostArenaView(GEOM)
    for i in range(arena.num_slabs):
        view.attach_slab(i, arena.slab_fd(i))
    yield arena, view
    view.close()
    arena.close()


# ------------------------------------------------------------------ the host view


def test_readonly_page_faults_on_write_and_reads_still_work(arena_and_view):
    arena, view = arena_and_view
    host_buffer(arena.view.page_address(3), 4)[:] = b"\x01\x02\x03\x04"
    view.set_page_access([3], readonly=True)
    assert bytes(host_buffer(view.page_address(3), 4)) == b"\x01\x02\x03\x04"
    assert _write_in_child(lambda: _poke(view.page_address(3))) == -signal.SIGSEGV
    # Its neighbours are untouched: still writable.
    assert _write_in_child(lambda: _poke(view.page_address(2))) == 0
    assert _write_in_child(lambda: _poke(view.page_address(4))) == 0
    assert view.readonly_pages() == {3}


def test_page_made_writable_again_accepts_writes(arena_and_view):
    arena, view = arena_and_view
    view.set_page_access([1, 2, 5], readonly=True)
    view.set_page_access([2], readonly=False)
    _poke(view.page_address(2))
    assert host_buffer(arena.view.page_address(2), 1)[0] == 7
    assert _write_in_child(lambda: _poke(view.page_address(1))) == -signal.SIGSEGV
    assert view.readonly_pages() == {1, 5}


def test_window_pages_follow_the_access_of_the_pages_they_map(arena_and_view):
    _arena, view = arena_and_view
    # Mapped before the page became read-only: protected with it.
    view.map_window(10, [6, 7])
    view.set_page_access([7], readonly=True)
    assert _write_in_child(lambda: _poke(view.window_address(11))) == -signal.SIGSEGV
    assert _write_in_child(lambda: _poke(view.window_address(10))) == 0
    # Mapped after: read-only from the start.
    view.map_window(20, [7, 1])
    assert _write_in_child(lambda: _poke(view.window_address(20))) == -signal.SIGSEGV
    assert _write_in_child(lambda: _poke(view.window_address(21))) == 0
    # Writable again: both window places accept writes.
    view.set_page_access([7], readonly=False)
    assert _write_in_child(lambda: _poke(view.window_address(11))) == 0
    assert _write_in_child(lambda: _poke(view.window_address(20))) == 0
    # An unmapped window place no longer follows the page.
    view.unmap_window(20, 2)
    view.set_page_access([7], readonly=True)
    view.map_window(20, [1])
    assert _write_in_child(lambda: _poke(view.window_address(20))) == 0


def test_page_outside_the_mapped_slabs_is_refused_and_changes_nothing(arena_and_view):
    _arena, view = arena_and_view
    with pytest.raises(ValueError, match="outside the 8 pages"):
        view.set_page_access([1, 8], readonly=True)
    assert view.readonly_pages() == frozenset()
    assert _write_in_child(lambda: _poke(view.page_address(1))) == 0


def test_pages_already_readonly_cost_no_check_and_detached_slabs_are_refused_again(arena_and_view, monkeypatch):
    # A lookup of another session's objects asks for pages that are read-only already (a host
    # slab attaches read-only in a client): nothing to sort, check or protect. That shortcut
    # must not let a page of a slab detached since (a failed grow) through.
    arena, view = arena_and_view
    view.set_page_access([1, 2, 5], readonly=True)

    def no_check(pages):
        raise AssertionError("pages already read-only were checked again")

    monkeypatch.setattr(view, "_access_pages", no_check)
    view.set_page_access([5, 1, 5], readonly=True)
    monkeypatch.undo()
    assert view.readonly_pages() == {1, 2, 5}
    view.set_page_access([3], readonly=True)  # not read-only yet: protected as before
    assert _write_in_child(lambda: _poke(view.page_address(3))) == -signal.SIGSEGV
    view.detach_from(1)
    assert view.readonly_pages() == {1, 2, 3}
    with pytest.raises(ValueError, match="outside the 4 pages"):
        view.set_page_access([5], readonly=True)


def test_readonly_slab_pages_stay_readonly(arena_and_view):
    arena, _view = arena_and_view
    ro = HostArenaView(GEOM)
    try:
        ro.attach_slab(0, arena.slab_fd(0), readonly=True)
        ro.set_page_access([1], readonly=False)
        assert _write_in_child(lambda: _poke(ro.page_address(1))) == -signal.SIGSEGV
    finally:
        ro.close()


# ------------------------------------------------------- clients over a real broker

CLIENT_WRITES_ADAPTER = """
import ctypes
with BrokerClient.connect(SOCKET) as c:
    c.register_adapter("a", {path!r})
    lease = c.acquire_adapters(["a"])
    page = lease["a"].pages[0]
    addr = c.view.page_address(page)
    out(page=page, first=ctypes.c_uint8.from_address(addr).value, readonly=sorted(c.view.readonly_pages()))
    ctypes.c_uint8.from_address(addr).value ^= 0xFF   # must fault
    out(wrote=True)
"""

CLIENT_REUSES_PAGES = """
import ctypes
with BrokerClient.connect(SOCKET) as c:
    c.register_adapter("a", {path!r})
    with c.acquire_adapters(["a"]) as lease:
        pages = list(lease["a"].pages)
    c.unregister_adapters(["a"])            # frees its pages
    st = c.stats()
    objs = c.allocate([Spec(st.max_pages - st.used_pages)])   # every free page, those included
    mine = set(objs[0].pages) & set(pages)
    for p in mine:                          # pages that held the adapter, now this client's to write
        ctypes.c_uint8.from_address(c.view.page_address(p)).value = 9
    out(reused=len(mine), readonly_left=sorted(set(c.view.readonly_pages()) & set(objs[0].pages)))
"""


def _child(socket: str, body: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", child_code(socket, body)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_client_writing_into_an_acquired_adapter_page_gets_sigsegv(peft_dirs):
    b = start_broker()
    try:
        r = _child(b.socket, CLIENT_WRITES_ADAPTER.format(path=peft_dirs["r4"]))
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stdout, r.stderr)
        assert len(lines) == 1 and lines[0]["page"] in lines[0]["readonly"]
        # The shared copy is unchanged: a second client reads what the broker loaded, and
        # the broker's own check finds the copy intact.
        from memory_broker.clients import BrokerClient

        with BrokerClient.connect(b.socket) as c:
            with c.acquire_adapters(["a"]) as lease:
                import ctypes

                assert ctypes.c_uint8.from_address(c.view.page_address(lease["a"].pages[0])).value == lines[0]["first"]
            v = c.verify_adapters(["a"])
            assert v.corrupt == 0 and v.checks[0].checked and v.checks[0].ok
    finally:
        b.stop()


def test_pages_that_held_an_adapter_are_writable_once_the_client_is_given_them(peft_dirs):
    b = start_broker()
    try:
        r = _child(b.socket, CLIENT_REUSES_PAGES.format(path=peft_dirs["r4"]))
        assert r.returncode == 0, r.stderr
        line = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")][-1]
        assert line["reused"] > 0 and line["readonly_left"] == []
    finally:
        b.stop()


def test_another_sessions_keyed_object_is_readonly_and_the_creator_keeps_writing():
    b = start_broker()
    try:
        from memory_broker.clients import BrokerClient, Spec

        with BrokerClient.connect(b.socket) as owner:
            (obj,) = owner.allocate([Spec(1, content_type="kv_cache", key=b"k")])
            host_buffer(owner.view.page_address(obj.pages[0]), 1)[0] = 5  # the creator writes
            body = """
import ctypes
with BrokerClient.connect(SOCKET) as c:
    (o,) = c.lookup([b"k"])
    dup = c.allocate([Spec(1, content_type="kv_cache", key=b"k")])[0]
    out(value=ctypes.c_uint8.from_address(c.view.page_address(o.pages[0])).value, dedup=dup.deduplicated,
        readonly=o.pages[0] in c.view.readonly_pages())
    ctypes.c_uint8.from_address(c.view.page_address(o.pages[0])).value = 1   # must fault
"""
            r = _child(b.socket, body)
            assert r.returncode == -signal.SIGSEGV, (r.stdout, r.stderr)
            line = json.loads(r.stdout.splitlines()[0])
            assert line == {"value": 5, "dedup": True, "readonly": True}
            assert host_buffer(owner.view.page_address(obj.pages[0]), 1)[0] == 5
    finally:
        b.stop()


def test_a_client_maps_host_pages_readonly_until_it_is_given_them_to_write():
    # Lookups of other processes' pages then change no page access (no mprotect, no TLB
    # flush on the step path); allocate and prepare make their pages writable.
    b = start_broker()
    try:
        from memory_broker.clients import BrokerClient, Spec

        with BrokerClient.connect(b.socket) as owner, BrokerClient.connect(b.socket) as c:
            (kv,) = owner.allocate([Spec(1, content_type="kv_cache", key=b"kv")])
            (mine,) = c.allocate([Spec(2)])  # (maps the slabs the arena grew since c connected)
            t = c.prepare([Spec(1)])
            writable = set(mine.pages) | set(t.objects[0].pages)
            mapped = c.view.mapped_slabs * c.geometry.pages_per_slab
            assert mapped > len(writable) and kv.pages[0] < mapped
            assert c.view.readonly_pages() == frozenset(range(mapped)) - writable
            for p in writable:
                host_buffer(c.view.page_address(p), 1)[0] = 7  # no fault
            import memory_broker.proto.wire.mapping.host as host

            calls, real = [], host._mprotect
            host._mprotect = lambda *a: (calls.append(a), real(*a))[1]
            try:
                (found,) = c.lookup([b"kv"])
            finally:
                host._mprotect = real
            assert found.pages == kv.pages and found.pages[0] in c.view.readonly_pages() and calls == []
            t.abort()
    finally:
        b.stop()


# ------------------------------------------------------------------- checksums


def _corrupt(h: AdapterHarness, page: int, offset: int = 0) -> None:
    """Flip a byte through the broker's own mapping (what a stray client write would do)."""
    buf = host_buffer(h.arena.view.page_address(page) + offset, 1)
    buf[0] ^= 0xFF


def _matches_file(h: AdapterHarness, acquired) -> bool:
    from safetensors.numpy import load_file

    meta = h.registry.get(acquired.adapter_id)
    tensors = load_file(meta.weights_path)
    view = h.reader()
    try:
        for w in meta.weights:
            a = read_matrix(view, acquired.layout, acquired.pages, w.layer, w.module, "A")
            bt = read_matrix(view, acquired.layout, acquired.pages, w.layer, w.module, "B")
            if not (
                np.array_equal(a, tensors[meta.weight_key(w.layer, w.module, "A")])
                and np.array_equal(bt, tensors[meta.weight_key(w.layer, w.module, "B")].T)
            ):
                return False
    finally:
        view.close()
    return True


def test_verify_finds_a_corrupt_hot_copy_and_the_next_acquire_reloads_it(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", verify_interval_s=0))
        h.registry.register("r8", peft_dirs["r8"])
        holder = h.store.open_session()
        first = (await h.manager.acquire(holder, ["r8"], with_layout=True)).adapters[0]
        assert [c.ok for c in await h.manager.verify(["r8"])] == [True]
        _corrupt(h, first.pages[0], 8)
        assert not _matches_file(h, first)
        (check,) = await h.manager.verify(["r8"])
        assert (check.tier, check.checked, check.ok) == (Tier.HOT, True, False)
        assert h.manager.stats().as_dict()["checksums"]["corruptions"] == 1
        # The session that holds it is told which copy went bad.
        told = [ev for sid, ev in h.events if sid == holder and isinstance(ev, AdapterCorrupted)]
        assert [(ev.adapter_id, ev.object_id, ev.generation) for ev in told] == [
            ("r8", first.object_id, first.generation)
        ]
        # The holder still pins the corrupt copy; a new acquire never gets it.
        other = h.store.open_session()
        again = (await h.manager.acquire(other, ["r8"], with_layout=True)).adapters[0]
        assert again.generation != first.generation and again.object_id != first.object_id
        assert again.found_in == Tier.COLD  # reloaded from its source, not from memory
        assert _matches_file(h, again)
        assert [c.ok for c in await h.manager.verify(["r8"])] == [True]
        # Both sessions release as usual; the corrupt copy's pages go with its last pin.
        h.manager.release(holder, ["r8"])
        assert first.object_id not in h.store.objects
        h.manager.release(other, ["r8"])
        check_invariants(h.store)
        await h.close()

    run(main())


def test_background_check_finds_corruption_without_anyone_asking(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", verify_interval_s=0.05))
        h.registry.register("r4", peft_dirs["r4"])
        await h.manager.start()
        s = h.store.open_session()
        a = (await h.manager.acquire(s, ["r4"], with_layout=True)).adapters[0]
        h.manager.release(s, ["r4"])
        _corrupt(h, a.pages[-1])
        for _ in range(100):
            if h.manager.stats().as_dict()["checksums"]["corruptions"]:
                break
            await asyncio.sleep(0.05)
        assert h.manager.stats().as_dict()["checksums"]["corruptions"] == 1
        assert h.manager.describe("r4").tier == Tier.COLD
        b = (await h.manager.acquire(s, ["r4"], with_layout=True)).adapters[0]
        assert b.generation != a.generation and _matches_file(h, b)
        h.manager.release(s, ["r4"])
        await h.close()

    run(main())


def test_acquire_path_never_hashes(peft_dirs, state_dir, monkeypatch):
    """Checks run on demand and in the background only: acquiring a hot adapter reads no page."""
    import memory_broker.broker.adapters.checks as mgr

    calls = []
    monkeypatch.setattr(mgr, "pages_checksum", lambda *a: calls.append(a) or "")

    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", verify_interval_s=0))
        h.registry.register("r4", peft_dirs["r4"])
        s = h.store.open_session()
        for _ in range(5):
            await h.manager.acquire(s, ["r4"])
            h.manager.release(s, ["r4"])
        await h.close()

    run(main())
    assert calls == []


def test_corrupt_image_file_is_refused_on_load_and_rebuilt_from_the_weights(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", verify_interval_s=0))
        h.registry.register("r4", peft_dirs["r4"])
        await h.manager.start()
        await h.manager.wait_conversions()
        path = h.manager.images.path("r4")
        with open(path, "r+b") as f:  # flip a payload byte on disk
            f.seek(os.path.getsize(path) - 3)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))
        (check,) = await h.manager.verify(["r4"])
        assert (check.tier, check.checked, check.ok) == (Tier.COLD, True, False)
        assert not os.path.exists(path)  # deleted: the next load converts the file again
        # Corrupt it again and load: the load refuses the image and reads the weights file.
        await h.manager.prefetch(["r4"], "warm")
        await h.manager.wait_image_writes()
        h.manager.demote("r4")
        h.manager.warm.drop(h.manager.entries.get("r4"))
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 3)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))
        s = h.store.open_session()
        a = (await h.manager.acquire(s, ["r4"], with_layout=True)).adapters[0]
        st = h.manager.stats().as_dict()
        # Both corrupt images were counted: the one verify found, the one the load refused.
        assert st["images"]["rejected"] == 1
        assert st["checksums"]["image_corruptions"] == 2 and st["checksums"]["corruptions"] == 2
        assert _matches_file(h, a)
        h.manager.release(s, ["r4"])
        await h.close()

    run(main())


def test_verify_of_an_unregistered_adapter_is_not_found_and_checks_nothing(peft_dirs, state_dir):
    async def main():
        h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", verify_interval_s=0))
        h.registry.register("r4", peft_dirs["r4"])
        with pytest.raises(BrokerError) as e:
            await h.manager.verify(["r4", "nope"])
        assert e.value.code == Code.NOT_FOUND
        assert h.manager.stats().as_dict()["checksums"]["verifications"] == 0
        await h.close()

    run(main())


def test_verify_rpc_cli_and_metrics_report_a_corrupt_image(peft_dirs):
    """Over gRPC (a client cannot write into the broker's pages: see above), corrupt the image
    file of a registered, not yet loaded adapter: verify reports it, the CLI exits 1, the
    metrics count it, and the next acquire reads the weights file instead."""
    from test_ops import free_port, metric, scrape

    port = free_port()
    b = start_broker("--metrics-port", str(port))
    try:
        from memory_broker.clients import BrokerClient

        with BrokerClient.connect(b.socket) as c:
            c.register_adapter("a", peft_dirs["r4"])
            c.register_adapter("b", peft_dirs["r8"])
            with c.acquire_adapters(["a"]):
                pass
            v = c.verify_adapters()  # no ids: every resident adapter ("a" is hot)
            assert [(x.adapter_id, x.tier, x.checked, x.ok) for x in v.checks] == [("a", 1, True, True)]
            assert v.checks[0].checksum.startswith("sha256:") and v.corrupt == 0
            for _ in range(200):  # "b" is converted into its image ahead of use
                if c.stats().adapters.image_count == 2:
                    break
                time.sleep(0.05)
            images = os.path.join(os.path.dirname(b.socket), "state", "images")
            (img,) = [os.path.join(images, f) for f in os.listdir(images) if f.startswith("b-")]
            with open(img, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0x01]))
        cli = [sys.executable, "-m", "memory_broker.broker.cli", "adapters", "--socket", b.socket, "verify"]
        r = subprocess.run([*cli, "a"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and " ok " in r.stdout, r.stdout + r.stderr
        r = subprocess.run([*cli, "b"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "CORRUPT" in r.stdout and "is corrupt" in r.stdout, r.stdout + r.stderr
        r = subprocess.run([*cli, "nope"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "NOT_FOUND" in r.stderr
        for _ in range(100):
            text = scrape(port)
            if "memory_broker_adapter_corruptions_total" in text and metric(
                text, "memory_broker_adapter_corruptions_total"
            ):
                break
            time.sleep(0.1)
        assert metric(text, "memory_broker_adapter_corruptions_total") == 1
        assert metric(text, "memory_broker_adapter_verifications_total") >= 3
        with BrokerClient.connect(b.socket) as c:
            with c.acquire_adapters(["b"]) as lease:
                assert lease["b"].found_in == "cold"
            assert c.verify_adapters(["b"]).corrupt == 0
    finally:
        b.stop()
