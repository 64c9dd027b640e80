"""Between the store and the tier past one host (broker/tier/): write-behind and read-through.

``TierLink`` hangs off three hooks of ``ObjectStore`` and does the rest on the event loop with
tasks that wait on the tier's futures, so no store call waits for the tier:

* **Write-behind.** With ``write="commit"``, the keyed KV objects each commit makes visible are
  written in batches, straight from their pages (no copy here; Mooncake moves them from the
  registered slabs), each pinned by the link's own session of its pool until the tier
  answers, so nothing can evict or reuse its pages meanwhile. A batch the tier's queue
  refuses is dropped and counted (``TierCounts.drops``).
* **Spill on eviction.** A keyed KV object being evicted that is not known to be in the tier
  (``write="evict"``, or its commit write was dropped or failed) is copied out of its pages
  before they return, if the tier's queue has room, and written from the copy; otherwise it
  is dropped as before and counted (``spill_dropped``).
* **Read-through.** A lookup that finds fewer keys than it was given (``on_miss``) answers at
  once with the local hits; the link then asks the tier for the missing tail, reserves pages
  in the asking session's pool, reads into them, checks each value's digest, and commits the
  good ones under their keys, so the next lookup finds them. A miss, an error, a timeout or a
  bad digest of the tier only means nothing is committed: never a wrong block, never a wait
  in a store call. The step path stays one synchronous pass (the reason for answering now
  rather than waiting on the tier inside a lookup): an engine asks again at its next step.
  ``probe`` tells a lookup that asked (``LookupRequest.tier``) how that read stands, so the
  vLLM connector can count the blocks being read in as an asynchronous external hit.

It imports no gRPC; the tier is below it (ARCHITECTURE.md, "Layers").
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields

from memory_broker.broker.store.eviction import ContentType
from memory_broker.broker.store.objects import ObjectStore
from memory_broker.broker.store.records import Allocation, Transaction
from memory_broker.broker.tier.base import CONTIGUOUS, RAW, Block, Meta, tier_key
from memory_broker.broker.tier.tier import Tier
from memory_broker.proto.wire import lmcache
from memory_broker.proto.wire.errors import BrokerError
from memory_broker.proto.wire.spec import Spec

# Objects one tier job carries (a write's batch, a chain's read).
BATCH = 64
# A device arena's blocks go through host buffers: at most this many bytes of them at once.
STAGING_BYTES = 256 << 20
# Object ids known to be in the tier (written, or read from it), remembered for spills.
REMEMBER = 1 << 16
# A chain's first missing key that the tier did not serve is not asked for again this soon
# (an engine looks a waiting request's chain up at every step: one probe a step would be
# load on the tier, and on Mooncake a lease renewal each).
MISS_TTL_S = 1.0
WRITE_MODES = ("commit", "evict")


@dataclass(slots=True, frozen=True)
class LMCacheFleet:
    """The LMCache nodes this broker's engines are declared equal to (``tier.lmcache_*``):
    chunks under their model and kv_rank are written and read in LMCache's format."""

    model: str
    kv_rank: int
    # A chunk's bytes in the fleet's layout (its shape and dtype, pinned in the configuration).
    chunk_bytes: int

    def wire(self, pool_name: str, key: bytes, size: int, page_size: int) -> str | None:
        """The LMCache key an object of ``size`` bytes under ``key`` shares, or None: only in
        the shared pool (LMCache has no tenants), under this fleet's model and kv_rank, and
        for an object of exactly the pages a chunk takes."""
        parsed = lmcache.parse(key) if not pool_name else None
        if parsed is None or parsed[:2] != (self.model, self.kv_rank):
            return None
        return parsed[2] if size == -(-self.chunk_bytes // page_size) * page_size else None


@dataclass(slots=True)
class LinkCounts:
    # Objects handed to the tier at commit, and objects spilled at eviction.
    queued: int = 0
    spilled: int = 0
    # Evicted objects not in the tier that the queue had no room for.
    spill_dropped: int = 0
    # Write batches the tier's queue refused.
    write_dropped: int = 0
    # Read-through: chains asked, objects committed from the tier, objects whose pages (or,
    # on a device arena, host buffers) could not be reserved.
    chains: int = 0
    filled: int = 0
    no_room: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class TierLink:
    """Write-behind and read-through for one store (module docstring).

    Args:
        store: the core; its ``on_commit`` (chained after any set), ``on_evict`` and
            ``on_miss`` are set here.
        tier: the tier (its thread and queue).
        view: the broker's arena view (``page_address``, ``tensor``).
        geometry: the arena's geometry (page and slab sizes).
        prefix: the fleet's key prefix (``tier.key_prefix``).
        write: "commit" (write at commit and spill on eviction) or "evict" (spill only).
        pool_names: each pool's name by number ("" the shared pool).
        log: ``log.warning(event, **fields)``.
        host: the arena's pages are host memory this process maps (the backends read and
            write them in place); False (a CUDA arena): each block goes through a host
            buffer of its own, copied in the tier's thread, at most ``STAGING_BYTES`` at once.
        lmcache: the LMCache fleet the configuration declares this broker's engines equal
            to, or None: no key is ever written or read in LMCache's format.
    """

    def __init__(  # noqa: PLR0913 - the link's parts and settings, from one call site (app.py)
        self,
        store: ObjectStore,
        tier: Tier,
        view,
        geometry,
        prefix: str,
        write: str,
        pool_names: Sequence[str],
        log,
        host: bool = True,
        lmcache: LMCacheFleet | None = None,
    ):
        if write not in WRITE_MODES:
            raise ValueError(f"tier.write must be one of {', '.join(WRITE_MODES)}; got {write!r}")
        self.store, self.tier, self.view, self.log = store, tier, view, log
        self.page_size = geometry.page_size
        self.pages_per_slab = geometry.pages_per_slab
        self.slab_size = geometry.slab_size
        self.prefix, self.write = prefix, write
        self.pool_names = list(pool_names)
        self.host = host
        self.lmcache = lmcache
        # Adapters' images in the tier (``adapters.tier_images.TierImages``; the server sets
        # it where ``tier.adapters`` is on), for its figures.
        self.images = None
        self.staged = 0  # bytes of host buffers standing in for device pages now
        self.counts = LinkCounts()
        self._sessions: dict[int, int] = {}  # pool -> the link's session in it
        self._registered: set[int] = set()  # slabs the tier was told of
        self._stored: OrderedDict[int, None] = OrderedDict()  # object ids known to be in the tier
        # (pool, first missing key) being read -> None while the tier is asked, then how
        # many keys from there it holds (``probe``'s answer) until they are committed.
        self._reading: dict[tuple[int, bytes], int | None] = {}
        self._missed: OrderedDict[tuple[int, bytes], float] = OrderedDict()  # ... not served, since when
        self._tasks: set[asyncio.Task] = set()
        self._pending: list[Allocation] = []
        self._filling = False
        if write == "commit":
            before = store.on_commit
            store.on_commit = self.committed if before is None else _chain(before, self.committed)
        store.on_evict = self.evicting
        store.on_miss = self.missed

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------ shared parts

    def _session(self, pool: int):
        """The link's own session in ``pool`` (pins its writes, owns what it reads in)."""
        sid = self._sessions.get(pool)
        if sid is None:
            sid = self.store.open_session()
            self.store.assign_pool(sid, pool)
            self._sessions[pool] = sid
        return self.store.sessions[sid]

    def _key(self, pool: int, key: bytes, pages: int) -> tuple[str, int]:
        """The tier's name for an object of ``pages`` pages under ``key``, and the size of
        its value in LMCache's format (0: the broker's own format, under the fleet's prefix)."""
        name = self.pool_names[pool] if pool < len(self.pool_names) else str(pool)
        fleet = self.lmcache
        wire = fleet.wire(name, key, pages * self.page_size, self.page_size) if fleet is not None else None
        return (tier_key(self.prefix, name, key), 0) if wire is None else (wire, fleet.chunk_bytes)

    def _expected(self, pool: int, key: bytes) -> Meta | None:
        """For a key read in LMCache's format, the record its value must fit (it has none)."""
        fleet = self.lmcache
        if fleet is None:
            return None
        pages = -(-fleet.chunk_bytes // self.page_size)
        if self._key(pool, key, pages)[1] == 0:
            return None
        return Meta(pages, fleet.chunk_bytes, b"", RAW)

    def _parts(self, pages: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """The pages' addresses in the broker's view; slabs the tier has not seen are
        registered first (a job queued ahead of the one that names them)."""
        for slab in {p // self.pages_per_slab for p in pages} - self._registered:
            if self.tier.register(self.view.page_address(slab * self.pages_per_slab), self.slab_size) is not None:
                self._registered.add(slab)
        ps, address = self.page_size, self.view.page_address
        return tuple((address(p), ps) for p in pages)

    def _blocks(self, pool: int, objs: Sequence[Allocation], keys: Sequence[bytes]) -> list[Block] | None:
        """One block per object (its pages, under its key in the tier); None when a device
        arena's host buffers would pass ``STAGING_BYTES``."""
        if self.host:
            out = []
            for o, k in zip(objs, keys):
                name, raw = self._key(pool, k, o.num_pages)
                out.append(Block(name, self._parts(o.pages), o.window_page >= 0, raw))
            return out
        need = sum(o.num_pages for o in objs) * self.page_size
        if self.staged + need > STAGING_BYTES:
            return None
        self.staged += need
        out = []
        for o, k in zip(objs, keys):
            buf = ctypes.create_string_buffer(o.num_pages * self.page_size)
            base, ps, pages = ctypes.addressof(buf), self.page_size, list(o.pages)
            name, raw = self._key(pool, k, o.num_pages)
            out.append(
                Block(
                    name,
                    tuple((base + i * ps, ps) for i in range(len(pages))),
                    o.window_page >= 0,
                    raw,
                    before=lambda b=buf, p=pages: _pages_to(self.view, p, self.page_size, b),
                    after=lambda b=buf, p=pages: _to_pages(self.view, p, self.page_size, b),
                )
            )
        return out

    def _unstage(self, objs: Sequence[Allocation]) -> None:
        if not self.host:
            self.staged -= sum(o.num_pages for o in objs) * self.page_size

    def _remember(self, object_id: int) -> None:
        self._stored[object_id] = None
        if len(self._stored) > REMEMBER:
            self._stored.popitem(last=False)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _wanted(obj: Allocation) -> bool:
        return obj.key is not None and obj.content_type == ContentType.KV_CACHE

    # ------------------------------------------------------------ write-behind

    def committed(self, objs: list[Allocation]) -> None:
        """On the loop, from ``ObjectStore.commit``: keyed KV objects go out on the next turn."""
        if self._filling:
            return  # read from the tier: already there
        wanted = [o for o in objs if self._wanted(o)]
        if not wanted:
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending += wanted

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        by_pool: dict[int, list[Allocation]] = {}
        for obj in pending:
            if self.store.is_live(obj):
                by_pool.setdefault(obj.pool, []).append(obj)
        for pool, objs in by_pool.items():
            for i in range(0, len(objs), BATCH):
                self._write(pool, objs[i : i + BATCH])

    def _write(self, pool: int, objs: list[Allocation]) -> None:
        s = self._session(pool)
        blocks = self._blocks(pool, objs, [o.key for o in objs])
        fut = self.tier.put(blocks) if blocks is not None else None
        if fut is None:
            if blocks is not None:
                self._unstage(objs)
            self.counts.write_dropped += 1
            return
        for o in objs:
            self.store.ledger.pin(s, o)
        self.counts.queued += len(objs)
        self._spawn(self._written(s, objs, fut))

    async def _written(self, s, objs: list[Allocation], fut) -> None:
        try:
            ok = await asyncio.wrap_future(fut)
        finally:
            self._unstage(objs)
            ledger = self.store.ledger
            for o in objs:
                ledger.unpin(s, o, 1)
        for o, good in zip(objs, ok):
            if good:
                self._remember(o.object_id)

    # ------------------------------------------------------- spill on eviction

    def evicting(self, victims: list[Allocation]) -> None:
        """On the loop, inside an eviction, before the victims' pages return: copy the keyed KV
        ones the tier lacks and queue them, if there is room; otherwise count them dropped."""
        spill = [o for o in victims if self._wanted(o) and o.object_id not in self._stored]
        if not spill:
            return
        if self.tier.queued >= self.tier.queue_depth:  # no room: no copy either
            self.counts.spill_dropped += len(spill)
            return
        # The copies: the victims' pages are another object's as soon as this call returns.
        copies = [(o, ctypes.create_string_buffer(o.num_pages * self.page_size)) for o in spill]
        blocks = []
        ps, address = self.page_size, self.view.page_address
        for o, buf in copies:
            base = ctypes.addressof(buf)
            if self.host:
                for i, p in enumerate(o.pages):
                    ctypes.memmove(base + i * ps, address(p), ps)
            else:
                _pages_to(self.view, o.pages, ps, buf)
            parts = tuple((base + i * ps, ps) for i in range(o.num_pages))
            name, raw = self._key(o.pool, o.key, o.num_pages)
            blocks.append(Block(name, parts, o.window_page >= 0, raw))
        fut = self.tier.put(blocks)
        if fut is None:
            self.counts.spill_dropped += len(spill)
            return
        self.counts.spilled += len(spill)
        fut.add_done_callback(lambda f, keep=copies: None)  # the copies live until the write is done

    # ------------------------------------------------------------ read-through

    def missed(self, pool: int, keys: Sequence[bytes], found: int) -> None:
        """On the loop, from a lookup that found ``found`` of ``keys``: read the rest through."""
        first = (pool, keys[found])
        if first in self._reading or len(self._reading) >= self.tier.queue_depth or self._recently_missed(first):
            return
        tail = list(keys[found : found + BATCH])
        self._reading[first] = None
        self.counts.chains += 1
        self._spawn(self._read_through(pool, tail, first))

    def probe(self, pool: int, keys: Sequence[bytes], found: int) -> int:
        """After a lookup of ``keys`` in ``pool`` found ``found`` (its ``missed`` ran): -1
        while the tier is asked about the rest, n > 0 while the n keys after ``found`` are
        read in from it (a later lookup finds them committed), 0 when it holds none of them
        or failed (a miss). Never waits: an engine asks again at its next step."""
        if found >= len(keys):
            return 0
        n = self._reading.get((pool, keys[found]), 0)
        return -1 if n is None else n

    def _recently_missed(self, first: tuple[int, bytes]) -> bool:
        missed = self._missed
        now = time.monotonic()
        while missed and next(iter(missed.values())) < now - MISS_TTL_S:
            missed.popitem(last=False)
        return first in missed

    async def _read_through(self, pool: int, keys: list[bytes], first: tuple[int, bytes]) -> None:
        served = False
        try:
            expected = [self._expected(pool, k) for k in keys]
            names = [self._key(pool, k, m.num_pages if m else 0)[0] for k, m in zip(keys, expected)]
            fut = self.tier.find(names, expected)
            metas: list[Meta] = await asyncio.wrap_future(fut) if fut is not None else []
            metas = [m for m in _leading(metas, self.page_size)]
            self._reading[first] = len(metas)
            if metas:
                served = await self._fill(pool, keys[: len(metas)], metas)
        except Exception as e:  # noqa: BLE001  (a read-through is a miss, never the lookup's failure)
            self.log.warning("tier_read_failed", error=repr(e))
        finally:
            self._reading.pop(first, None)
            if not served:
                self._missed[first] = time.monotonic()
                self._missed.move_to_end(first)
                if len(self._missed) > REMEMBER:
                    self._missed.popitem(last=False)

    async def _fill(self, pool: int, keys: list[bytes], metas: list[Meta]) -> bool:
        """Reserve pages for each value (a transaction each), read them in, commit the good
        ones; whether the first was."""
        s = self._session(pool)
        store = self.store
        specs = [
            Spec(m.num_pages, int(ContentType.KV_CACHE), key=k, contiguous=bool(m.flags & CONTIGUOUS))
            for k, m in zip(keys, metas)
        ]
        try:
            txns = await self._prepare(s.session_id, specs)
        except BrokerError:
            self.counts.no_room += len(specs)
            return False
        objs = [t.objects[0] for t in txns]
        blocks = self._blocks(pool, objs, keys)
        if blocks is None:  # a device arena's host buffers are all in use
            self.counts.no_room += len(objs)
        fut = self.tier.get(blocks, metas) if blocks is not None else None
        try:
            ok = await asyncio.wrap_future(fut) if fut is not None else [False] * len(txns)
        finally:
            if blocks is not None:
                self._unstage(objs)
        good = [t for t, g in zip(txns, ok) if g]
        bad = [t.txn_id for t, g in zip(txns, ok) if not g]
        if bad:
            store.abort(s.session_id, bad)
        for t, m, g in zip(txns, metas, ok):
            if g and not m.flags & RAW:  # (LMCache's values have none: KeyDigests takes it)
                t.objects[0].digest = m.text  # the digest KeyDigests would take
        self._filling = True
        try:
            done = store.commit(s.session_id, [t.txn_id for t in good]) if good else []
        finally:
            self._filling = False
        for t in done:
            for obj, dedup in t.result:
                if not dedup:
                    self._remember(obj.object_id)
                    self.counts.filled += 1
        return bool(ok) and ok[0]

    async def _prepare(self, sid: int, specs: list[Spec]) -> list[Transaction]:
        """One transaction per value (a bad one is aborted alone), with any grow off the loop.
        The lease outlasts the tier's deadline many times over: the pages must stay reserved
        until the tier's thread has answered (it writes into them)."""
        store = self.store
        lease = min(store.config.max_lease_s, max(60.0, 10 * self.tier.deadline_s))

        def prepare_all() -> list[Transaction]:
            out: list[Transaction] = []
            try:
                for sp in specs:
                    out.append(store.prepare(sid, [sp], lease_s=lease))
            except BaseException:
                if out:
                    store.abort(sid, [t.txn_id for t in out])
                raise
            return out

        return prepare_all() if store.growth is None else await store.growth.run(prepare_all)

    # ------------------------------------------------------------------ figures

    def stats(self) -> dict:
        """The link's and the tier's counters, the tier's queue now, whether it is up and its
        last error (changes nothing)."""
        tier, images = self.tier, self.images
        return {
            **self.counts.as_dict(),
            **tier.counts.as_dict(),
            "queue_depth": tier.queued,
            "up": tier.up,
            "backend": tier.backend.name,
            "last_error": tier.last_error,
            "lmcache_model": self.lmcache.model if self.lmcache is not None else "",
            "adapter_images": images is not None,
            "adapter_images_written": images.written if images is not None else 0,
            "adapter_images_read": images.read if images is not None else 0,
        }


def _pages_to(view, pages: Sequence[int], page_size: int, buf) -> None:
    """Copy device ``pages`` into the host buffer ``buf``, in order."""
    import torch

    host = torch.frombuffer(buf, dtype=torch.uint8)
    for i, p in enumerate(pages):
        host[i * page_size : (i + 1) * page_size].copy_(view.tensor(view.page_address(p), page_size))


def _to_pages(view, pages: Sequence[int], page_size: int, buf) -> None:
    """Copy the host buffer ``buf`` over device ``pages``, in order."""
    import torch

    host = torch.frombuffer(buf, dtype=torch.uint8)
    for i, p in enumerate(pages):
        view.tensor(view.page_address(p), page_size).copy_(host[i * page_size : (i + 1) * page_size])


def _leading(metas: list[Meta], page_size: int):
    """The leading records whose values fit this broker's pages (a fleet's brokers may differ)."""
    for m in metas:
        if m.size != m.num_pages * page_size and not m.flags & RAW:
            return
        yield m


def _chain(first, second):
    def both(objs):
        first(objs)
        second(objs)

    return both
