"""The arenas with a real broker and real client processes, on every backend: each test runs
against the CUDA arena on a GPU (``--arena cuda``, CUDA tensors) and, as its CPU twin,
against the host arena (``--arena host``, CPU tensors).

The ``cuda`` runs skip cleanly without a CUDA device that supports VMM with POSIX-fd handles
(and a CUDA build of torch); ops/gpu/run_gpu_checks.sh runs them on a GPU machine. The
``host`` runs are in the ordinary suite, so a test body that cannot pass on any backend (a
write through a mapping the broker handed out read-only, say) fails on the CPU before it
costs a GPU run. What only one backend has is a ``Backend`` attribute, not a skipped test:
synchronizing the device, streams and graphs, and the CUDA view's leases (a live tensor keeps
its mapping; the host view leaves that to its caller).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest
from conftest import read_line, run_child, spawn_child, start_broker

from memory_broker.clients import BrokerClient, Spec
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.mapping import ArenaGeometry
from memory_broker.proto.wire.mapping.cuda import MappingInUse, cuda_available

try:
    import torch

    _torch_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a dependency
    _torch_cuda = False

_ok, CUDA_REASON = cuda_available("0")
cuda_usable = _ok and _torch_cuda

_why = CUDA_REASON if not _ok else "this torch has no CUDA device"
NEEDS_CUDA = pytest.mark.skipif(not cuda_usable, reason=f"needs a CUDA device with VMM and POSIX-fd handles ({_why})")

MiB = 1 << 20
# 2 MiB pages (the usual granularity), 4 pages per 8 MiB slab, 8 slabs at most (64 MiB).
SIZES = ["--page-size", "2MiB", "--slab-size", "8MiB", "--pool-size", "64MiB"]


@dataclass(frozen=True)
class Backend:
    """One arena backend as these tests use it: what the broker serves, where its tensors
    live, and what stands in on it for what only a GPU has."""

    # The arena (``--arena``) and the device type of its tensors: "cuda" or "host".
    name: str

    @property
    def cuda(self) -> bool:
        return self.name == "cuda"

    @property
    def args(self) -> list[str]:
        """A broker's arena and sizes."""
        return ["--arena", self.name, *SIZES]

    @property
    def device_type(self) -> str:
        return "cuda" if self.cuda else "cpu"

    @property
    def leases(self) -> bool:
        """Whether the view refuses to unmap under a live tensor, defers ``close`` until its
        tensors go, and refuses a tensor over an unmapped range (the CUDA view; on the host
        view those are the caller's to avoid: touching such a tensor faults)."""
        return self.cuda

    def on_device(self, t) -> bool:
        """Whether tensor ``t`` is in this backend's memory (``is_cuda`` on a GPU)."""
        return t.device.type == self.device_type

    def sync(self) -> None:
        """Wait for the device's queued work (a CPU's torch ops have finished on return)."""
        if self.cuda:
            torch.cuda.synchronize()

    def arena(self, g: ArenaGeometry):
        """The broker's arena over geometry ``g``."""
        if self.cuda:
            from memory_broker.broker.arena.cuda import CudaArena

            return CudaArena(g, "0")
        from memory_broker.broker.arena.host import HostArena

        return HostArena(g)

    def second_view(self, g: ArenaGeometry, arena, slabs: int):
        """Another view of ``arena`` (as a client has) with its first ``slabs`` slabs' pages
        attached (on CUDA one allocation per page, each fd closed once imported)."""
        if self.cuda:
            from memory_broker.proto.wire.mapping.cuda import CudaArenaView

            v = CudaArenaView(g, arena.device_id)
            v.extend(slabs)
            v.attach_pages(0, arena.export_fds(0, slabs * g.pages_per_slab))
            return v
        from memory_broker.proto.wire.mapping.host import HostArenaView

        v = HostArenaView(g)
        for i, fd in enumerate(arena.export_fds(0, slabs)):
            try:
                v.attach_slab(i, fd)
            finally:
                os.close(fd)
        return v

    def stream(self):
        """A side stream (None on a CPU: no streams)."""
        return torch.cuda.Stream() if self.cuda else None

    def on_stream(self, stream):
        """Queue the block's work on ``stream`` (on a CPU it runs as it is called)."""
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def stream_done(self, stream) -> bool:
        return stream.query() if self.cuda else True

    def capture(self, work, during):
        """Capture ``work`` as a CUDA graph, calling ``during`` inside the capture, and return
        the graph's replay (and the graph, to keep alive). A CPU has no graphs: ``during`` runs
        now, and the replay is ``work`` itself."""
        if not self.cuda:
            during()
            return work, None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            work()
            during()
        return graph.replay, graph

    def child(self, body: str) -> str:
        """A client process's body with ``DEVICE`` (its tensors' device type) and ``sync()``."""
        sync = "torch.cuda.synchronize()" if self.cuda else "pass"
        prelude = f"import torch\nDEVICE = {self.device_type!r}\ndef sync():\n    {sync}\n"
        return prelude + textwrap.dedent(body)


@pytest.fixture(params=[pytest.param("cuda", marks=NEEDS_CUDA), "host"])
def backend(request) -> Backend:
    return Backend(request.param)


@pytest.fixture
def gpu_broker(backend):
    b = start_broker(*backend.args)
    yield b
    b.stop(signal.SIGKILL if b.proc.poll() is None else signal.SIGTERM)


def _serving_line(b) -> dict:
    return next(e for e in b.log_events() if e.get("event") == "serving")


# ----------------------------------------------------------------- the arena alone


def test_arena_and_a_second_view_share_device_memory(backend):
    g = ArenaGeometry(page_size=2 * MiB, pages_per_slab=4, max_slabs=4, window_pages=64)
    a = backend.arena(g)
    v = None
    try:
        a.grow(2)
        v = backend.second_view(g, a, 2)
        ps = g.page_size
        mine = a.view.tensor(a.view.phys_base, 2 * g.slab_size)
        assert backend.on_device(mine) and mine.data_ptr() == a.view.phys_base
        mine.copy_((torch.arange(mine.numel(), device=mine.device) % 251).to(torch.uint8))
        backend.sync()
        theirs = v.tensor(v.phys_base, 2 * g.slab_size)
        assert theirs.data_ptr() == v.phys_base and torch.equal(theirs, mine)
        # A window over scattered pages of both slabs is one contiguous tensor.
        pages = [6, 1, 3, 4]
        v.map_window(5, pages)
        w = v.tensor(v.window_address(5), len(pages) * ps)
        assert w.is_contiguous() and w.data_ptr() == v.window_address(5)
        for i, p in enumerate(pages):
            assert torch.equal(w[i * ps : (i + 1) * ps], mine[p * ps : (p + 1) * ps])
        # Writes through the window land in the physical pages; bf16 views alias.
        w.view(torch.bfloat16)[: ps // 2].fill_(1.5)
        backend.sync()
        assert bool((mine[6 * ps : 7 * ps].view(torch.bfloat16) == 1.5).all())
        if backend.leases:
            # A live tensor keeps its window mapping: replacing it is refused, nothing changes.
            with pytest.raises(MappingInUse, match="still alive"):
                v.map_window(6, [0])
            assert torch.equal(w[ps : 2 * ps], mine[ps : 2 * ps])
        del w
        # Replacing one window page keeps the others (each page is its own mapping).
        v.map_window(6, [0])
        w2 = v.tensor(v.window_address(5), 3 * ps)
        assert torch.equal(w2[ps : 2 * ps], mine[0:ps]) and torch.equal(w2[2 * ps :], mine[3 * ps : 4 * ps])
        del w2
        v.unmap_window(5, 4)
        if backend.leases:
            with pytest.raises(ValueError):
                v.tensor(v.window_address(5), ps)
        del theirs, mine
    finally:
        if v is not None:
            v.close()
        a.close()


def test_close_waits_for_live_tensors_and_unmapping_syncs_only_the_stream_that_used_the_range(backend):
    g = ArenaGeometry(page_size=2 * MiB, pages_per_slab=4, max_slabs=2, window_pages=16)
    a = backend.arena(g)
    try:
        a.grow(1)
        v = a.view
        v.map_window(0, [1, 2])
        side = backend.stream()
        with backend.on_stream(side):
            t = v.tensor(v.window_address(0), 2 * g.page_size, torch.float32)
            for _ in range(20):  # queued work on the side stream over the window pages
                t.mul_(1.0)
        del t
        v.map_window(0, [3])  # syncs `side` (its kernels used the range), then replaces
        assert backend.stream_done(side)
        # A second view closed under a live tensor: the tensor keeps working; the view's
        # memory is unmapped when the tensor goes. (The host view unmaps at close: its
        # tensor is used before.)
        v2 = backend.second_view(g, a, 1)
        held = v2.tensor(v2.page_address(3), g.page_size)
        if backend.leases:
            v2.close()
            assert v2.attached_pages == 4
        held.fill_(9)
        backend.sync()
        assert int(v.tensor(v.window_address(0), 1)[0]) == 9
        del held
        v2.close()
        if backend.leases:
            assert v2.attached_pages == 0  # the deferred teardown ran
    finally:
        a.close()


def test_mapping_during_another_streams_graph_capture_leaves_the_capture_intact(backend):
    g = ArenaGeometry(page_size=2 * MiB, pages_per_slab=4, max_slabs=2, window_pages=16)
    a = backend.arena(g)
    try:
        a.grow(1)
        v = a.view
        v.map_window(0, [0])
        x = v.tensor(v.window_address(0), g.page_size, torch.float32)
        x.fill_(1.0)
        backend.sync()
        # Relaxed capture mode: mapping during the capture is allowed, and the capture survives.
        replay, graph = backend.capture(functools.partial(x.add_, 1.0), lambda: v.map_window(4, [2, 3]))
        replay()
        replay()
        backend.sync()
        assert float(x[0]) == 3.0
        ps = g.page_size
        y = v.tensor(v.window_address(4), 2 * ps)
        assert y.data_ptr() != v.page_address(2) and torch.equal(y, v.tensor(v.page_address(2), 2 * ps))
        if backend.cuda:  # the CUDA view lists its window's mappings
            assert v.window_pages()[-2:] == [(4, 2, False), (5, 3, False)]
        del graph, replay, x, y
    finally:
        a.close()


# A client process that maps page 1 read-only and page 2 writable, writes both and says which
# writes went through. ``{view}`` opens the view over the fds in sys.argv[2].
_READONLY_CHILD = """
import os, sys, torch
from memory_broker.proto.wire.mapping import ArenaGeometry
MiB = 1 << 20
g = ArenaGeometry(page_size=2 * MiB, pages_per_slab=4, max_slabs=1, window_pages=8)
fds = [int(fd) for fd in sys.argv[2].split(",")]
{view}
v.set_page_access([1], True)
v.map_window(0, [1, 2])
ps = g.page_size
w = v.tensor(v.window_address(0), 2 * ps)
print("read", int(w[0]), int(w[ps]), flush=True)  # reads of a read-only page work
w[ps:].fill_(0x22)  # page 2 is writable
{sync}
print("wrote-rw", flush=True)
try:
    w[:ps].fill_(0x33)  # page 1 is read-only: the write must fault
    {sync}
    print("wrote-ro", flush=True)
except Exception as e:
    print("fault", type(e).__name__, str(e).splitlines()[0], flush=True)
"""
_READONLY_VIEW = {
    "cuda": (
        "from memory_broker.proto.wire.mapping.cuda import CudaArenaView\n"
        "v = CudaArenaView(g, sys.argv[1])\n"
        "v.extend(1)\n"
        "v.attach_pages(0, fds)  # closes each once imported"
    ),
    # The process dies of SIGSEGV at the read-only write: no line after "wrote-rw".
    "host": (
        "from memory_broker.proto.wire.mapping.host import HostArenaView\n"
        "v = HostArenaView(g)\n"
        "v.attach_slab(0, fds[0])"
    ),
}


def test_a_write_to_a_read_only_page_faults_in_the_client_process(backend):
    g = ArenaGeometry(page_size=2 * MiB, pages_per_slab=4, max_slabs=1, window_pages=8)
    a = backend.arena(g)
    try:
        a.grow(1)
        ps = g.page_size
        mine = a.view.tensor(a.view.phys_base, g.slab_size)
        mine.fill_(0x11)
        backend.sync()
        fds = a.export_fds(0, a.fd_units())
        sync = "torch.cuda.synchronize()" if backend.cuda else "pass"
        code = _READONLY_CHILD.format(view=_READONLY_VIEW[backend.name], sync=sync)
        try:
            r = subprocess.run(
                [sys.executable, "-c", code, getattr(a, "device_id", ""), ",".join(map(str, fds))],
                pass_fds=fds,
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            for fd in fds:
                os.close(fd)
        lines = r.stdout.splitlines()
        assert lines[:2] == ["read 17 17", "wrote-rw"], r.stdout + r.stderr
        assert "wrote-ro" not in lines, "a write to a read-only page went through"
        assert (lines[2:] and lines[2].startswith("fault")) or r.returncode != 0, r.stdout + r.stderr
        # The broker's bytes: page 1 untouched, page 2 written by the child.
        assert bool((mine[ps : 2 * ps] == 0x11).all()) and bool((mine[2 * ps : 3 * ps] == 0x22).all())
        del mine
    finally:
        a.close()


# ----------------------------------------------------------------- broker and clients


def test_broker_serves_the_arena_and_says_why(backend, gpu_broker):
    line = _serving_line(gpu_broker)
    assert line["arena"] == backend.name
    assert ("supports VMM with POSIX fds" if backend.cuda else "asked for host") in line["arena_reason"]
    with BrokerClient.connect(gpu_broker.socket) as c:
        assert c.arena.backend == backend.name
        assert type(c.view).__name__ == ("CudaArenaView" if backend.cuda else "HostArenaView")


def test_two_client_processes_share_pages_through_their_own_mappings(backend, gpu_broker):
    """The writer's pages, seen through a reader process's own mapping. The reader looked the
    object up, so the broker answers it as shared (not owned) and the reader maps it read-only:
    only the owner writes (a reader's write would fault, on a GPU a sticky illegal address)."""
    with BrokerClient.connect(gpu_broker.socket, client_name="writer") as c:
        total = c.stats().max_pages
        singles = c.allocate([Spec(1) for _ in range(total)])
        c.free(singles[::2])  # every other page free: the free pages are scattered
        free = c.stats().free_pages
        big = c.allocate([Spec(free, contiguous=True, key=b"gpu-big")])[0]
        phys = sorted(big.pages)
        assert any(b - a > 1 for a, b in zip(phys, phys[1:])), "pages should be physically scattered"
        t = big.tensor(torch.int32)
        assert backend.on_device(t) and t.is_contiguous() and t.data_ptr() == big.address
        t.copy_(torch.arange(t.numel(), dtype=torch.int32, device=t.device) * 3)  # a torch op on the device
        backend.sync()
        lines = run_child(
            gpu_broker.socket,
            backend.child(
                """
                with BrokerClient.connect(SOCKET) as c:
                    o = c.lookup([b"gpu-big"])[0]
                    t = o.tensor(torch.int32)
                    want = torch.arange(t.numel(), dtype=torch.int32, device=t.device) * 3
                    ok = bool(torch.equal(t, want))
                    ps = len(t) // len(o.pages)
                    pts = o.page_tensors(torch.int32)
                    per_page = all(torch.equal(t[i*ps:(i+1)*ps], pt) for i, pt in enumerate(pts))
                    same_ptr = t.data_ptr() == o.address and all(
                        pt.data_ptr() == a for pt, a in zip(pts, o.page_addresses()))
                    readonly = set(o.pages) <= c.view.readonly_pages()  # shared: this mapping reads only
                    out(ok=ok, per_page=per_page, same_ptr=same_ptr, on_device=t.device.type == DEVICE,
                        contiguous=t.is_contiguous(), readonly=readonly, n=len(o.pages))
                    c.unpin([o])
                """
            ),
            timeout=120,
        )
        assert lines[0] == {
            "ok": True,
            "per_page": True,
            "same_ptr": True,
            "on_device": True,
            "contiguous": True,
            "readonly": True,
            "n": free,
        }
        # The owner writes through its own mapping; a reader sees it through its own.
        t.add_(1)
        backend.sync()
        lines = run_child(
            gpu_broker.socket,
            backend.child(
                """
                with BrokerClient.connect(SOCKET) as c:
                    (o,) = c.lookup([b"gpu-big"])
                    t = o.tensor(torch.int32)
                    out(sum=int(t.sum(dtype=torch.int64)))
                    c.unpin([o])
                """
            ),
            timeout=120,
        )
        n = t.numel()
        assert lines[0] == {"sum": 3 * n * (n - 1) // 2 + n}
        assert torch.equal(t, torch.arange(n, dtype=torch.int32, device=t.device) * 3 + 1)


def test_killing_the_broker_leaves_a_live_client_computing(backend, gpu_broker):
    with BrokerClient.connect(gpu_broker.socket) as c:
        o = c.allocate([Spec(4, contiguous=True)])[0]
        t = o.tensor(torch.float32)
        t.fill_(2.0)
        gpu_broker.stop(signal.SIGKILL)
        assert c.session_ended.wait(10)
        for _ in range(50):  # keeps launching kernels on the mapping after the broker died
            t.mul_(1.0).add_(0.0)
        backend.sync()
        assert float(t.sum()) == 2.0 * t.numel()
        pages = o.page_tensors(torch.float32)
        assert all(bool((p == 2.0).all()) for p in pages)


def test_killing_a_client_returns_its_pages_and_they_are_reused(backend, gpu_broker):
    with BrokerClient.connect(gpu_broker.socket, client_name="watcher") as w:
        w.allocate([Spec(1)])  # the arena has a slab before the child comes
        slabs0 = w.stats().num_slabs
        free0 = w.stats().free_pages
        child = spawn_child(
            gpu_broker.socket,
            backend.child(
                """
                c = BrokerClient.connect(SOCKET)
                o = c.allocate([Spec(3, contiguous=True)])[0]
                o.tensor().fill_(0x33)
                sync()
                out(pages=list(o.pages))
                time.sleep(600)
                """
            ),
        )
        try:
            pages = read_line(child, timeout=60)["pages"]
            assert w.stats().free_pages == free0 - 3
            child.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and w.stats().sessions != 1:
                time.sleep(0.02)
            st = w.stats()
            assert st.sessions == 1 and st.free_pages == free0
            again = w.allocate([Spec(3)])[0]
            assert sorted(again.pages) == sorted(pages)
            assert w.stats().num_slabs == slabs0  # reused, not grown
            # The pages a dead process had mapped are ordinary memory for the next owner.
            for p in again.page_tensors():
                p.fill_(0x44)
            backend.sync()
            assert all(bool((p == 0x44).all()) for p in again.page_tensors())
        finally:
            child.kill()
            child.wait()


def test_an_engines_kv_cache_on_broker_pages_through_the_worker_half(backend, gpu_broker):
    """Issue 46 (docs/engine-pool.md): the engine pool's worker half (``WorkerRange``) on this
    backend's arena, without vLLM. vLLM's ``torch.zeros`` for the KV cache is answered with the
    range's tensor on the engine's device; group 0 starts on private memory (the warm-up's
    writes land there); the scheduler's half grows two groups, and the first step maps the
    broker's zeroed pages in (group 0's private memory replaced); what the engine writes into a
    layer's page of a group is what the scheduler's own client reads from that broker page; a
    retired group is unmapped and given back after the steps that could read it, and the rest
    still works. On CUDA: UNRUN on a GPU when written (tests/test_arena_cuda.py has its twin
    on the fake driver)."""
    from types import SimpleNamespace

    from memory_broker.clients.engine_kv import EngineKvSession
    from memory_broker.clients.kv_arena import RETIRE_STEPS, KvGroups
    from memory_broker.clients.vllm.engine_pool import WorkerRange

    layers, groups, ps = 2, 4, 2 * MiB
    spec = SimpleNamespace(size=layers * groups * ps, layer_stride=groups * ps, block_stride=ps // 4, offset=0)
    dev = torch.device("cuda", 0) if backend.cuda else torch.device("cpu")
    w = WorkerRange(gpu_broker.socket, {"name": "kv-engine"}, spec, "model", dev)
    g = None
    try:
        rng = w.mapper.rng
        assert type(rng).__name__ == ("CudaKvRange" if backend.cuda else "HostKvRange")
        with w.allocation_context(spec.size):
            kv = torch.zeros(spec.size, dtype=torch.int8, device=dev)
        assert backend.on_device(kv) and kv.data_ptr() == rng.base and kv.numel() == spec.size
        by_group = kv.view(layers, groups, ps)  # [layer, group, byte]
        by_group[:, 0].fill_(5)  # vLLM's warm-up writes group 0 before the scheduler exists
        with BrokerClient.connect(gpu_broker.socket, client_name="kv-scheduler") as c:
            g = KvGroups(EngineKvSession(c, "kv-engine", layers), groups)
            assert g.grow_now(2) == [0, 1]
            ops, slabs = g.take_ops()
            pages = {op[1]: list(op[2]) for op in ops}
            w.apply(ops, slabs)  # the first step: the broker's zeroed pages replace group 0's
            assert int(torch.count_nonzero(by_group[:, :2])) == 0
            for layer in range(layers):
                by_group[layer, 1].fill_(layer + 1)
            backend.sync()
            c._import_pages(pages[1], True)  # CUDA: this client maps the pages too (host: has them)
            for layer, p in enumerate(pages[1]):
                t = c.view.tensor(c.view.page_address(p), ps)
                assert bool((t == layer + 1).all()), (layer, p)
                del t
            g.retire([1])
            w.apply(*g.take_ops())  # unmapped (CUDA: after the device's work is done)
            assert sum(g.step_done() for _ in range(RETIRE_STEPS)) == layers
            by_group[:, 0].fill_(9)  # group 0 is still the engine's
            backend.sync()
            assert int(torch.count_nonzero(by_group[:, 0] != 9)) == 0
            g.close()
            g = None
        del by_group, kv
    finally:
        if g is not None:
            g.close()
        w.close()


def test_growth_slab_by_slab_to_the_maximum_then_eviction(backend):
    b = start_broker(*backend.args, "--pool-size", "32MiB", "--high-watermark", "1.0", "--low-watermark", "1.0")
    try:
        with BrokerClient.connect(b.socket) as c:
            assert c.stats().num_slabs == 0
            objs = []
            for i in range(4):  # 4 slabs of 4 pages
                o = c.allocate([Spec(4, key=f"k{i}".encode())])[0]
                assert c.stats().num_slabs == i + 1
                for p in o.page_tensors():
                    p.fill_(i + 1)
                objs.append(o)
            backend.sync()
            st = c.stats()
            assert st.num_slabs == 4 and st.free_pages == 0 and st.evicted_objects == 0
            new = c.allocate([Spec(4, key=b"k4")])[0]  # full: the least recently used goes
            st = c.stats()
            assert st.num_slabs == 4 and st.evicted_objects == 1
            assert sorted(new.pages) == sorted(objs[0].pages)
            with pytest.raises(BrokerError) as e:
                c.pin([objs[0]])
            assert e.value.code == Code.NOT_FOUND
            lines = run_child(
                b.socket,
                backend.child(
                    """
                    with BrokerClient.connect(SOCKET) as c:
                        found = c.lookup([b"k1", b"k2", b"k3"])
                        out(vals=[int(o.page_tensors()[0][0]) for o in found], slabs=c.view.mapped_slabs)
                        c.unpin(found)
                    """
                ),
                timeout=120,
            )
            assert lines[0] == {"vals": [2, 3, 4], "slabs": 4}
    finally:
        b.stop()


def test_preallocated_slabs_exist_at_start(backend):
    b = start_broker(*backend.args, "--preallocate", "16MiB")
    try:
        with BrokerClient.connect(b.socket) as c:
            assert c.stats().num_slabs == 2 and c.view.mapped_slabs == 2
    finally:
        b.stop()


@NEEDS_CUDA
def test_allocating_past_the_devices_free_memory_is_resource_exhausted_not_a_crash():
    """CUDA only: a host arena's memfds are sparse, so growing past the machine's memory does
    not fail when a slab is made (the kernel's OOM killer answers later, on a CI machine too)."""
    free, total = torch.cuda.mem_get_info()
    slab = 1 << 30
    pool = -(-(total * 3 // 2) // slab) * slab  # the arena's maximum is past the device's memory
    b = start_broker(
        "--arena",
        "cuda",
        "--page-size",
        "2MiB",
        "--slab-size",
        "1GiB",
        "--pool-size",
        str(pool),
        "--window-factor",
        "1",
    )
    try:
        with BrokerClient.connect(b.socket) as c:
            want = total // (2 * MiB) + 1
            with pytest.raises(BrokerError) as e:
                c.allocate([Spec(want)])
            assert e.value.code == Code.RESOURCE_EXHAUSTED
            assert "could not grow" in e.value.message and "CUDA_ERROR_OUT_OF_MEMORY" in e.value.message
            assert b.proc.poll() is None, "the broker died"
            st = c.stats()
            assert st.used_pages == 0 and st.num_slabs == 0  # nothing of the failed growth kept
            o = c.allocate([Spec(2)])[0]  # and it still serves
            o.page_tensors()[0].fill_(7)
            torch.cuda.synchronize()
            assert int(o.page_tensors()[0][0]) == 7
    finally:
        b.stop()
