"""vLLM's own KV cache on the broker's pages (the engine pool), with real vLLM CPU engines.

An engine on the pool (vLLM's default multiprocess engine core: its scheduler and worker in two
processes) gives the same greedy tokens as stock vLLM with the same KV bytes, growing and
shrinking at the broker; with a budget below one burst it preempts (its grows are refused) and
still gives the same tokens; two engines on one broker share one budget, the second growing into
pages the first gave back; a grow evicts shared prefix KV, never a held adapter; a page that
moves from one engine to another reads zero there. The engines run as tests/test_vllm_kv.py's do
(tests/vllm_harness.py under .venv-vllm).
"""

from __future__ import annotations

import errno
import json
import random
import re
import signal
import subprocess
import threading
import time

import pytest
from conftest import ROOT, short_tmpdir, start_broker
from test_vllm_kv import VLLM_PY, Engine

from memory_broker.clients import BrokerClient

pytestmark = pytest.mark.timeout(3600)

rng = random.Random(46)
# The tiny model's KV: 16 KiB per 32-token block per layer, 2 layers. A 512 KiB broker page holds
# 32 blocks of a layer: a group is 2 pages (one per layer), 32 blocks. 8 MiB of KV: 256 blocks,
# 8 groups. vLLM's default multiprocess engine core: the scheduler and the worker are two
# processes (the CPU build turns the uni executor into mp), the groups travel in the metadata.
KV_BYTES = 8 << 20
BROKER = ("--page-size", "512KiB", "--slab-size", "1MiB")
PAGE = 512 * 1024


def _toks(n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


BURST = [_toks(150 + 13 * i) for i in range(8)]  # about 60 blocks: 2 groups
BIG = [_toks(290 + 7 * i) for i in range(12)]  # about 125 blocks: 4 groups and more
SHORT = BURST[0][:40]  # with 64 tokens out: 4 blocks


@pytest.fixture(scope="module")
def env(vllm_shared):
    shared = vllm_shared.build()
    state = {"tmp": short_tmpdir(), "model": shared.model, "engines": []}

    def engine(name: str, broker=None, pool: dict | None = None, *args: str) -> Engine:
        extra = ["--kv-bytes", str(KV_BYTES), "--max-model-len", "1024", *args]
        if broker is not None:
            extra += ["--connector", "broker", "--socket", broker.socket]
        if pool is not None:
            extra += ["--engine-pool", json.dumps(pool)]
        e = Engine(name, state["tmp"], state["model"], *extra)
        state["engines"].append(e)
        return e

    state["engine"] = engine
    yield state
    for e in state["engines"]:
        e.stop()


def engine_stats(broker, name: str):
    with BrokerClient.connect(broker.socket, client_name="test") as c:
        st = c.stats()
    return next((e for e in st.engines if e.name == name), None), st


@pytest.fixture(scope="module")
def stock(env):
    """Stock vLLM's tokens with the same KV bytes: (BURST's, BIG's, a short prompt's)."""
    e = env["engine"]("stock").wait_ready()
    out = (
        [o["tokens"] for o in e.generate(BURST, max_tokens=24)],
        [o["tokens"] for o in e.generate(BIG, max_tokens=24)],
        e.generate([SHORT], max_tokens=64)[0]["tokens"],
    )
    e.stop()
    return out


@pytest.fixture(scope="module")
def reference(stock):
    return stock[0]


def _pool_pids(log: str) -> tuple[set[str], set[str]]:
    """The pids vLLM's log lines name for the worker's half and for the scheduler's."""
    worker = set(re.findall(r"pid=(\d+)\)[^\n]*engine pool: KV cache of", log))
    sched = set(re.findall(r"pid=(\d+)\)[^\n]*engine pool: '[^']*' at the broker", log))
    return worker, sched


def test_one_engine_on_the_pool_gives_stock_vllms_tokens_and_grows_and_shrinks(env, reference):
    b = start_broker("--pool-size", "16MiB", *BROKER)
    e = env["engine"]("pool-a", b, {"name": "a"}).wait_ready()
    sampler = Sampler(b)
    try:
        assert "engine pool: KV cache of 8 groups x 32 blocks" in e.log(), e.log()[-3000:]
        worker, sched = _pool_pids(e.log())
        # vLLM's default engine core: the worker's half and the scheduler's in two processes.
        assert len(worker) == 1 and len(sched) == 1 and worker != sched, (worker, sched)
        assert [o["tokens"] for o in e.generate(BURST, max_tokens=24)] == reference
        # Idle after the burst: free groups beyond the reserve (2) go back, group 0 stays.
        deadline = time.monotonic() + 10
        while (s := engine_stats(b, "a")[0]).held_pages > 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.held_pages == 6, s
        assert s.grows >= 1 and s.give_backs >= 1 and s.refusals == 0, s
        assert sampler.most["a"] > s.held_pages, sampler.most
    finally:
        sampler.stop()
        e.stop()
        b.stop(signal.SIGKILL)


def test_an_engine_on_the_pool_alone_without_shared_prefixes_gives_stock_vllms_tokens(env, reference):
    b = start_broker("--pool-size", "16MiB", *BROKER)
    # The engine core in the process that starts it (VLLM_ENABLE_V1_MULTIPROCESSING=0): the
    # same two halves, in one process.
    e = env["engine"]("pool-only", b, {"name": "only"}, "--no-share-prefixes", "--uni").wait_ready()
    try:
        worker, sched = _pool_pids(e.log())
        assert len(worker) == 1 and worker == sched, (worker, sched)
        assert [o["tokens"] for o in e.generate(BURST, max_tokens=24)] == reference
        s, st = engine_stats(b, "only")
        assert s.grows >= 1
        assert st.keyed_objects == 0  # no prefix KV stored
    finally:
        e.stop()
        b.stop(signal.SIGKILL)


def test_a_budget_below_one_burst_preempts_and_keeps_the_tokens(env, reference):
    # 1 MiB: 2 pages, 1 group, 32 blocks (31 usable besides the null block): the burst needs 60.
    b = start_broker("--pool-size", "1MiB", *BROKER)
    e = env["engine"]("pool-small", b, {"name": "small"}).wait_ready()
    try:
        assert [o["tokens"] for o in e.generate(BURST, max_tokens=24)] == reference
        s, st = engine_stats(b, "small")
        assert s.refusals >= 1  # grows refused: vLLM preempted
        assert s.held_pages <= 2 and st.used_pages <= 2
        assert "Traceback" not in e.log()
    finally:
        e.stop()
        b.stop(signal.SIGKILL)


class Sampler:
    """Samples the engines' KV pages at the broker while bursts run: the most seen at once, and
    each engine's most."""

    def __init__(self, broker):
        self.client = BrokerClient.connect(broker.socket, client_name="sampler")
        self.most_total = 0
        self.most: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            st = self.client.stats()
            self.most_total = max(self.most_total, sum(e.held_pages for e in st.engines))
            for e in st.engines:
                self.most[e.name] = max(self.most.get(e.name, 0), e.held_pages)
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()


def test_two_engines_share_one_budget_and_the_second_grows_into_what_the_first_gave_back(env, stock):
    # 6 MiB: 12 pages, 6 groups. BIG alone takes 4-5 groups of one engine: the sum of the two
    # engines' peaks is more than the budget, one peak is not.
    b = start_broker("--pool-size", "6MiB", *BROKER)
    pool = {"reserve_groups": 0}
    a = env["engine"]("pool-a2", b, {"name": "a", **pool})
    c = env["engine"]("pool-b2", b, {"name": "b", **pool})
    a.wait_ready()
    c.wait_ready()
    sampler = Sampler(b)
    try:
        assert [o["tokens"] for o in a.generate(BIG, max_tokens=24)] == stock[1]
        assert [o["tokens"] for o in c.generate(BIG, max_tokens=24)] == stock[1]
        sa, _ = engine_stats(b, "a")
        sb, _ = engine_stats(b, "b")
    finally:
        sampler.stop()
        a.stop()
        c.stop()
        b.stop(signal.SIGKILL)
    assert sampler.most_total <= 12  # never over the budget
    assert sampler.most["a"] + sampler.most["b"] > 12  # so b grew into pages a gave back
    assert sa.given_pages > 0 and sampler.most["b"] >= 8, (sa, sb, sampler.most)


def test_an_engine_killed_mid_burst_returns_its_pages_within_a_second_and_the_other_grows_into_them(env, stock):
    b = start_broker("--pool-size", "6MiB", *BROKER)
    pool = {"reserve_groups": 0}
    a = env["engine"]("pool-a3", b, {"name": "a", **pool})
    c = env["engine"]("pool-b3", b, {"name": "b", **pool})
    a.wait_ready()
    c.wait_ready()
    sampler = Sampler(b)
    try:
        a.send(BIG, max_tokens=200)
        deadline = time.monotonic() + 120
        while sampler.most.get("a", 0) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.most.get("a", 0) >= 8, sampler.most
        a.kill()
        t0 = time.monotonic()
        while engine_stats(b, "a")[0] is not None:
            assert time.monotonic() - t0 < 1.0, "the killed engine's KV pages did not return within 1 s"
            time.sleep(0.02)
        assert [o["tokens"] for o in c.generate(BIG, max_tokens=24)] == stock[1]
    finally:
        sampler.stop()
        c.stop()
        b.stop(signal.SIGKILL)
    assert sampler.most["b"] >= 8 and sampler.most_total <= 12, sampler.most


def lora_pages(client) -> int:
    return sum(x.pages for x in client.stats().by_content if x.content_type == 2)


def test_a_grow_evicts_the_shared_prefix_kv_and_never_the_held_adapter(env, stock, tmp_path):
    from rigs import write_adapter

    # 8 MiB: 16 pages. An engine off the pool stores BURST's prefix KV (a page per block: more
    # than the pool) in what the held adapter leaves, and stops; the engine on the pool, BIG's
    # burst, can only grow by evicting that prefix KV, or the adapter.
    b = start_broker("--pool-size", "8MiB", *BROKER)
    holder = BrokerClient.connect(b.socket, client_name="adapter-holder")
    try:
        holder.register_adapter("held", write_adapter(str(tmp_path / "held"), 1))
        with holder.acquire_adapters(["held"]):
            lora = lora_pages(holder)
            assert lora >= 1
            p = env["engine"]("prefixes", b).wait_ready()
            for prompt in BURST:  # one at a time: a step's stores are one prepare, all or nothing
                p.generate([prompt], max_tokens=4)
            stored, deadline = -1, time.monotonic() + 60  # stores run off the step: let them land
            while stored != holder.stats().keyed_objects and time.monotonic() < deadline:
                stored = holder.stats().keyed_objects
                time.sleep(2)
            p.stop()
            st0 = holder.stats()
            assert st0.keyed_objects > 0 and st0.max_pages - st0.used_pages < 8, st0
            sampler = Sampler(b)
            a = env["engine"]("pool-e", b, {"name": "a", "reserve_groups": 0}, "--no-share-prefixes").wait_ready()
            try:
                assert [o["tokens"] for o in a.generate(BIG, max_tokens=24)] == stock[1]
            finally:
                sampler.stop()
                a.stop()
            st1 = holder.stats()
            assert st1.evicted_objects > st0.evicted_objects and st1.keyed_objects < st0.keyed_objects
            assert sampler.most["a"] >= 8, sampler.most  # grown into the prefix KV's pages
            assert lora_pages(holder) == lora  # the held adapter stayed
    finally:
        holder.close()
        b.stop(signal.SIGKILL)


def _range(log: str) -> tuple[int, int, int]:
    """(worker pid, range base, layer stride) from the worker's log line."""
    m = re.search(
        r"pid=(\d+)\)[^\n]*engine pool: KV cache of .*range at (0x[0-9a-f]+), (\d+) layers of (\d+) bytes", log
    )
    assert m, log[-3000:]
    return int(m.group(1)), int(m.group(2), 16), int(m.group(4))


def _pages(pid: int, base: int, stride: int, layers: int, groups) -> dict[tuple[int, int], bytes | None]:
    """Each (group, layer) page of a worker's range, as bytes; None where it is not mapped."""
    mapped = []
    for line in open(f"/proc/{pid}/maps"):
        span, mode = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if mode.startswith("rw") and hi > base and lo < base + layers * stride:
            mapped.append((lo, hi))
    out: dict[tuple[int, int], bytes | None] = {}
    with open(f"/proc/{pid}/mem", "rb") as mem:
        for g in groups:
            for layer in range(layers):
                at = base + layer * stride + g * PAGE
                out[g, layer] = None
                if any(lo <= at and at + PAGE <= hi for lo, hi in mapped):
                    try:
                        mem.seek(at)
                        out[g, layer] = mem.read(PAGE)
                    except OSError as e:  # EIO: unmapped since /proc/<pid>/maps was read
                        if e.errno != errno.EIO:
                            raise  # not allowed to read it: the test cannot see, and says so
    return out


def test_a_page_that_moves_between_engines_reads_zero_before_it_is_written(env, stock):
    # 6 MiB: 12 pages. a and b hold their group 0 (4 pages); a's BIG burst takes the other 8 and
    # writes each; idle, a gives them back; b, asked for one short prompt, grows ahead of need
    # (4 groups: those 8 pages), writes only in its group 0 (the fullest), and idle keeps 2 of
    # them as its reserve: they read zero in b.
    b = start_broker("--pool-size", "6MiB", *BROKER)
    a = env["engine"]("pool-a5", b, {"name": "a", "reserve_groups": 0})
    c = env["engine"]("pool-b5", b, {"name": "b", "reserve_groups": 2})
    a.wait_ready()
    c.wait_ready()
    sampler = Sampler(b)
    pid_a, base_a, stride = _range(a.log())
    written: set[tuple[int, int]] = set()  # a's (group, layer) pages beyond group 0 seen written
    looks = {"samples": 0, "mapped": 0}
    stop = threading.Event()

    errors: list[BaseException] = []

    def watch_a() -> None:
        while not stop.is_set():
            try:
                pages = _pages(pid_a, base_a, stride, 2, range(1, 8))
            except BaseException as e:
                errors.append(e)
                return
            looks["samples"] += 1
            looks["mapped"] = max(looks["mapped"], sum(1 for v in pages.values() if v is not None))
            written.update(k for k, v in pages.items() if v is not None and v.strip(b"\0"))
            time.sleep(0.02)

    w = threading.Thread(target=watch_a, daemon=True)
    w.start()
    try:
        assert [o["tokens"] for o in a.generate(BIG, max_tokens=24)] == stock[1]
        stop.set()
        w.join(10)
        # Every page beyond the two group 0s held a's KV at some time (a sampled union: on a
        # loaded machine one sample may not catch all 8 mapped at once).
        assert not errors and len(written) == 8, (errors, sorted(written), looks)
        deadline = time.monotonic() + 10
        while engine_stats(b, "a")[0].held_pages > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine_stats(b, "a")[0].held_pages == 2
        assert [o["tokens"] for o in c.generate([SHORT], max_tokens=64)] == [stock[2]]
        deadline = time.monotonic() + 10
        while engine_stats(b, "b")[0].held_pages != 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine_stats(b, "b")[0].held_pages == 6  # group 0 and the 2 reserve groups
        pid_b, base_b, _ = _range(c.log())
        pages = _pages(pid_b, base_b, stride, 2, range(1, 8))
        got = {k: v for k, v in pages.items() if v is not None}
        assert len(got) == 4, sorted(got)
        assert all(not v.strip(b"\0") for v in got.values()), "a page moved from a to b without being zeroed"
    finally:
        stop.set()
        sampler.stop()
        a.stop()
        c.stop()
        b.stop(signal.SIGKILL)


# vLLM's own block pool, 4 groups of 8 blocks (block 0: the null block). Four requests take every
# block; the first (blocks 1-4, in group 0) and the third (group 2, whole) finish; a new request
# takes 4 blocks. vLLM's order reuses the last freed first (group 2's): no group is wholly free.
FULLEST = """
import json
from vllm.v1.core.block_pool import BlockPool
from memory_broker.clients.vllm.engine_pool import prefer_fullest

BPG = 8

def run(fullest):
    pool = BlockPool(num_gpu_blocks=32, enable_caching=True, hash_block_size=16)
    if fullest:
        prefer_fullest(pool.free_block_queue, BPG)
    r1, r2, r3, r4 = (pool.get_new_blocks(n) for n in (4, 11, 8, 8))
    pool.free_blocks(r1)
    pool.free_blocks(r3)
    r5 = pool.get_new_blocks(4)
    whole = [g for g in range(4) if all(b.ref_cnt == 0 and not b.is_null for b in pool.blocks[g * BPG : (g + 1) * BPG])]
    return {"r5": [b.block_id for b in r5], "whole_free": whole, "free": pool.get_num_free_blocks()}

print(json.dumps({"vllm": run(False), "fullest": run(True)}))
"""


def test_allocation_from_the_fullest_group_frees_a_group_that_vllms_order_keeps_partly_used():
    p = subprocess.run([VLLM_PY, "-c", FULLEST], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["vllm"]["r5"] == [16, 17, 18, 19] and out["vllm"]["whole_free"] == []
    assert out["fullest"]["r5"] == [1, 2, 3, 4] and out["fullest"]["whole_free"] == [2]
    assert out["vllm"]["free"] == out["fullest"]["free"] == 8  # the same blocks handed out, elsewhere
