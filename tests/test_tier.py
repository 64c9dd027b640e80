"""The tier's front (broker/tier/tier.py) over a fake backend: the queue is bounded and never
blocks a caller, a job past its deadline is a miss, a failure is a miss and backs off, and a
read whose bytes fail the digest is a miss. The real backends: tests/test_tier_backends.py."""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time

import pytest

from memory_broker.broker.tier.base import RAW, Block, Meta, digest_parts, fill, value_of
from memory_broker.broker.tier.tier import BACKOFF_S, Tier


class FakeBackend:
    """A dict store; ``gate`` (when set) holds every call until it opens; ``fail`` raises.
    As Valkey's: a value in LMCache's format (``Block.raw``) is stored alone, with no record."""

    name = "fake"

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.metas_: dict[str, Meta] = {}
        self.gate: threading.Event | None = None
        self.fail = False
        self.calls = 0
        self.resets = 0

    def _call(self):
        self.calls += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise ConnectionError("refused")

    def put(self, blocks, metas, timeout):
        self._call()
        for b, m in zip(blocks, metas):
            self.values[b.key] = value_of(b)
            if not b.raw:
                self.metas_[b.key] = m
        return [True] * len(blocks)

    def sizes(self, keys, timeout):
        self._call()
        return [len(self.values.get(k, b"")) for k in keys]

    def metas(self, keys, timeout):
        self._call()
        return [self.metas_.get(k) for k in keys]

    def get_into(self, blocks, timeout):
        self._call()
        return [b.key in self.values and fill(b, self.values[b.key]) for b in blocks]

    def connect(self):
        pass

    def register(self, address, size):
        pass

    def reset(self):
        self.resets += 1

    def close(self):
        pass


def buffer(n: int, fill: int = 0):
    buf = (ctypes.c_uint8 * n)(*([fill] * n))
    return buf, Block("k", ((ctypes.addressof(buf), n),))


def test_a_full_queue_refuses_and_counts_without_blocking_the_caller():
    backend = FakeBackend()
    backend.gate = threading.Event()
    tier = Tier(backend, deadline_s=5.0, queue_depth=2)
    first = tier.find(["a"])  # taken by the thread, held at the gate
    time.sleep(0.05)
    queued = [tier.find(["b"]), tier.find(["c"])]
    t0 = time.monotonic()
    refused = [tier.find(["d"]) for _ in range(100)]
    assert time.monotonic() - t0 < 0.1
    assert refused == [None] * 100 and tier.counts.drops == 100 and tier.queued == 2
    backend.gate.set()
    assert [f.result(5) for f in (first, *queued)] == [[], [], []]
    tier.close()


def test_a_job_past_its_deadline_is_a_miss_without_a_call():
    backend = FakeBackend()
    backend.gate = threading.Event()
    tier = Tier(backend, deadline_s=0.2, queue_depth=4)
    held = tier.find(["a"])
    time.sleep(0.05)
    late = tier.find(["b"])
    time.sleep(0.3)
    backend.gate.set()
    assert held.result(5) == [] and late.result(5) == []
    assert tier.counts.timeouts == 2 and backend.calls == 1
    tier.close()


def test_a_failure_is_a_miss_that_backs_off_then_retries():
    backend = FakeBackend()
    tier = Tier(backend, deadline_s=1.0, queue_depth=4)
    buf, block = buffer(64, 3)
    backend.fail = True
    assert tier.put([block]).result(5) == [False]
    assert tier.counts.errors == 1 and backend.resets == 1 and not tier.up
    assert tier.find(["k"]).result(5) == [] and tier.counts.skipped_down == 1 and backend.calls == 1
    backend.fail = False
    time.sleep(BACKOFF_S * 1.5)
    assert tier.put([block]).result(5) == [True] and tier.up
    tier.close()


def test_registering_memory_does_not_mark_a_failed_tier_up():
    backend = FakeBackend()
    tier = Tier(backend, deadline_s=1.0, queue_depth=4)
    backend.fail = True
    assert tier.find(["k"]).result(5) == [] and not tier.up
    tier.register(0x1000, 4096).result(5)  # a local call, made whatever the backoff
    assert not tier.up and tier.last_error
    tier.close()


def test_a_read_whose_bytes_fail_the_digest_is_a_miss():
    backend = FakeBackend()
    tier = Tier(backend, deadline_s=1.0, queue_depth=4)
    buf, block = buffer(64, 7)
    assert tier.put([block]).result(5) == [True]
    assert backend.metas_["k"].digest == digest_parts(block.parts)
    backend.values["k"] = b"\x08" * 64
    out, into = buffer(64)
    metas = tier.find(["k"]).result(5)
    assert tier.get([into], metas).result(5) == [False]
    assert tier.counts.corrupt == 1 and tier.counts.misses == 1 and tier.counts.hits == 0
    tier.close()


def test_a_value_in_lmcache_s_format_is_its_bytes_alone_and_read_only_at_its_exact_size():
    backend = FakeBackend()
    tier = Tier(backend, deadline_s=2.0, queue_depth=8)
    src = (ctypes.c_uint8 * 8192)(*([7] * 5000 + [9] * 3192))
    parts = ((ctypes.addressof(src), 4096), (ctypes.addressof(src) + 4096, 4096))
    _, plain = buffer(64, 3)
    assert tier.put([Block("chunk", parts, raw=5000), Block("kv", plain.parts)]).result(5) == [True, True]
    assert backend.values["chunk"] == bytes([7] * 5000) and "chunk" not in backend.metas_  # no record
    want = Meta(2, 5000, b"", RAW)
    # A chain mixing both formats: each key found its own way, in order.
    found = tier.find(["kv", "chunk"], [None, want]).result(5)
    assert [m.size for m in found] == [64, 5000]
    assert tier.find(["chunk"], [Meta(2, 4999, b"", RAW)]).result(5) == []  # another size: a miss
    assert tier.find(["chunk"]).result(5) == []  # asked for a record, of which it has none
    dst = (ctypes.c_uint8 * 8192)(*([1] * 8192))
    out = ((ctypes.addressof(dst), 4096), (ctypes.addressof(dst) + 4096, 4096))
    assert tier.get([Block("chunk", out, raw=5000)], [want]).result(5) == [True]
    assert bytes(dst) == bytes([7] * 5000 + [0] * 3192)  # the rest of the pages zeroed
    backend.values["chunk"] = bytes(4999)  # shortened after it was found
    assert tier.get([Block("chunk", out, raw=5000)], [want]).result(5) == [False]
    assert tier.counts.hits == 1 and tier.counts.corrupt == 0
    tier.close()


def test_a_tier_backend_without_its_address_is_refused_naming_the_setting():
    from memory_broker.broker.server.options import ServeOptions, SettingError

    with pytest.raises(SettingError, match="tier_valkey_url: is not set"):
        ServeOptions(tier_backend="valkey").validate()
    with pytest.raises(SettingError, match="tier_mooncake_master: is not set"):
        ServeOptions(tier_backend="mooncake").validate()
    ServeOptions(tier_backend="valkey", tier_valkey_url="valkey://h:1/0", arena="cuda").validate()


# ---------------------------------------------------------------- the store's hooks for the tier


def small_store(max_pages: int):
    from memory_broker.broker.store.objects import ObjectStore, StoreConfig
    from memory_broker.broker.store.pool import PagePool, WindowSpace

    pool = PagePool(max_pages, max_pages, max_pages, lambda slabs: None)
    return ObjectStore(pool, WindowSpace(4 * max_pages), config=StoreConfig(high_watermark=1.0, low_watermark=1.0))


@pytest.mark.both_cores
def test_a_lookup_that_misses_tells_on_miss_what_it_found_pinned_or_not():
    from memory_broker.broker.store.objects import Spec

    store = small_store(16)
    s = store.open_session()
    store.allocate(s, [Spec(1, 1, key=b"a")])
    seen = []
    store.on_miss = lambda pool, keys, found: seen.append((pool, list(keys), found))
    assert len(store.lookup(s, [b"a", b"b", b"c"], pin=True)) == 1
    assert len(store.lookup(s, (b"a", b"b"), pin=False)) == 1
    assert len(store.lookup(s, [b"a"], pin=False)) == 1  # nothing missing: not told
    assert seen == [(0, [b"a", b"b", b"c"], 1), (0, [b"a", b"b"], 1)]


def test_an_eviction_shows_its_victims_while_they_still_hold_their_pages():
    from memory_broker.broker.store.objects import Spec

    store = small_store(4)
    s = store.open_session()
    store.allocate(s, [Spec(1, 1, key=b"k%d" % i) for i in range(4)])
    seen = []
    store.on_evict = lambda victims: seen.append([(v.key, store.is_live(v), store.pool.free_pages) for v in victims])
    store.allocate(s, [Spec(2)])
    assert seen == [[(b"k0", True, 0), (b"k1", True, 0)]]
    assert store.keys.get(b"k0") is None and store.pool.free_pages == 0


# ---------------------------------------------------------------- the link, in one process


class FakeView:
    """An arena view over an anonymous mapping: page p at base + p * page size; ``tensor``
    gives CPU tensors over it, as a CUDA view gives device tensors."""

    def __init__(self, pages: int, page_size: int):
        import mmap

        self.map = mmap.mmap(-1, pages * page_size)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.page_size = page_size

    def page_address(self, p: int) -> int:
        return self.base + p * self.page_size

    def tensor(self, address: int, nbytes: int):
        import torch

        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=address - self.base)

    def page_bytes(self, pages) -> bytes:
        return b"".join(self.map[p * self.page_size : (p + 1) * self.page_size] for p in pages)


class Geometry:
    page_size = 4096
    pages_per_slab = 8
    slab_size = 8 * 4096


def linked(backend: FakeBackend, host: bool):
    from memory_broker.broker.store.tiering import TierLink

    store, view = small_store(32), FakeView(32, Geometry.page_size)
    tier = Tier(backend, deadline_s=2.0, queue_depth=8)
    link = TierLink(store, tier, view, Geometry(), "fleet", "commit", [""], log=None, host=host)
    return store, view, link


async def until(check, timeout: float = 5.0) -> None:
    import asyncio

    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("host", [True, False], ids=["host-pages", "device-through-host-buffers"])
def test_what_one_store_commits_another_reads_through_with_bytes_and_digest_equal(host):
    import asyncio

    from memory_broker.broker.store.objects import Spec

    async def run():
        backend = FakeBackend()
        a, view_a, link_a = linked(backend, host)
        b, view_b, link_b = linked(backend, host)
        sa, sb = a.open_session(), b.open_session()
        keys = [b"k%d" % i for i in range(3)]
        txn = a.prepare(sa, [Spec(2, 1, key=k) for k in keys])
        for i, obj in enumerate(txn.objects):
            for j, p in enumerate(obj.pages):
                view_a.map[p * 4096 : (p + 1) * 4096] = bytes([10 * i + j + 1]) * 4096
        a.commit(sa, [txn.txn_id])
        await until(lambda: link_a.tier.counts.written == 3)
        assert a.lookup(sa, keys, pin=False) and all(o.pin_count == 0 for o in txn.objects)  # unpinned again
        assert b.lookup(sb, keys, pin=False) == []  # answered now; read through behind it
        await until(lambda: len(b.lookup(sb, keys, pin=False)) == 3)
        got = b.lookup(sb, keys, pin=False)
        assert [view_b.page_bytes(o.pages) for o in got] == [view_a.page_bytes(o.pages) for o in txn.objects]
        want = [
            "blake2b:" + hashlib.blake2b(view_a.page_bytes(o.pages), digest_size=32).hexdigest() for o in txn.objects
        ]
        assert [o.digest for o in got] == want  # the digest KeyDigests takes of A's objects
        assert link_b.tier.counts.hits == 3 and link_b.staged == 0 and link_a.staged == 0
        for link in (link_a, link_b):
            await link.close()
            link.tier.close()

    asyncio.run(run())
