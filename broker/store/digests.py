"""Digests of committed keyed objects: taken at commit, checked on demand and on a sample.

Read-only mappings stop accidents, not a process that holds the arena's fds (docs/security.md,
"What one client can do to another"): it can map a page writable again and overwrite another session's KV. With
``memory_pool.kv_digest`` on, ``KeyDigests`` hashes each keyed object a transaction commits
(blake2b over its pages, in one thread off the event loop, right after the commit: the cost
is one pass over the bytes), keeps the digest in the object's record, and checks it again on
demand (``VerifyObjects``) and, with ``memory_pool.kv_verify_interval``, one object at a time
in the background. An object that no longer matches is withdrawn (``ObjectStore.withdraw``):
its key stops resolving, so no lookup serves it again, and its pages return with its last
pin. The adapters' checksums (``broker/adapters/checks.py``) do the same for adapter copies.

What it does not see: bytes changed between the commit and the digest (milliseconds). Objects
made with a key by ``Allocate`` are visible at once, before they are written, so there is no
commit to take a digest at: theirs is taken at their first ``VerifyObjects`` (which says so),
and later checks compare against it (the background sample checks only digested objects, so it
never takes a digest while a creator may still be writing). It imports no gRPC.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import itertools
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from memory_broker.broker.store.object_table import ReplyRoom
from memory_broker.broker.store.objects import ObjectStore
from memory_broker.broker.store.records import Allocation
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.mapping import ArenaView

ALGO = "blake2b"


def pages_digest(view: ArenaView, pages: Sequence[int], page_size: int) -> str:
    """The digest of what ``pages`` hold now, read through ``view``. Blocking (hashlib lets
    other threads run while it hashes a page)."""
    from memory_broker.proto.wire.mapping.host import HostArenaView

    h = hashlib.blake2b(digest_size=32)
    host = isinstance(view, HostArenaView)
    for p in pages:
        if host:
            h.update((ctypes.c_uint8 * page_size).from_address(view.page_address(p)))
        else:  # a device arena: each page's bytes to the host first
            h.update(view.tensor(view.page_address(p), page_size).cpu().numpy())
    return f"{ALGO}:{h.hexdigest()}"


@dataclass(slots=True)
class ObjectCheck:
    key: bytes
    object_id: int
    checked: bool
    ok: bool
    digest: str
    detail: str


class KeyDigests:
    """Takes and checks the digests of committed keyed objects (module docstring).

    Args:
        store: the core; its ``on_commit`` is set to ``committed``.
        view: the broker's arena view (pages are read through it).
        page_size: bytes per page.
        log: ``log.warning(event, **fields)`` for corrupt objects and failed digests.
        interval_s: seconds between two background checks of one object (0: none).
    """

    def __init__(self, store: ObjectStore, view: ArenaView, page_size: int, log, interval_s: float = 0.0):
        self.store = store
        self.view = view
        self.page_size = page_size
        self.log = log
        self.interval_s = interval_s
        self.digests_taken = 0
        self.verifications = 0
        self.corruptions = 0
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._turn = 0
        # Objects whose commit digest is being taken (a check leaves them to it).
        self._pending: set[int] = set()
        store.on_commit = self.committed

    def start(self) -> asyncio.Task | None:
        """Start the background checks (with ``interval_s``); returns their task."""
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sample_loop())
        return self._task

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _digest(self, obj: Allocation) -> asyncio.Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="object-digest")
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, pages_digest, self.view, list(obj.pages), self.page_size)

    def _live(self, obj: Allocation) -> bool:
        return self.store.objects.get(obj.object_id) is obj and not obj.freed

    def committed(self, objs: list[Allocation]) -> None:
        """On the event loop, from ``ObjectStore.commit``: digest each newly visible keyed object."""
        try:
            for obj in objs:
                if not obj.digest:
                    fut = self._digest(obj)
                    self._pending.add(obj.object_id)
                    fut.add_done_callback(lambda f, o=obj: self._taken(o, f))
        except Exception as err:  # noqa: BLE001  (the commit is done: it must not fail for this)
            self.log.warning("object_digest_failed", error=repr(err))

    def _taken(self, obj: Allocation, fut: asyncio.Future) -> None:
        self._pending.discard(obj.object_id)
        if fut.cancelled():
            return
        if fut.exception() is not None:
            self.log.warning("object_digest_failed", object_id=obj.object_id, error=repr(fut.exception()))
            return
        if self._live(obj) and not obj.digest:  # freed meanwhile: its pages may be another's now
            obj.digest = fut.result()
            self.digests_taken += 1

    async def verify(self, keys: Sequence[bytes]) -> list[ObjectCheck]:
        """Check the objects ``keys`` resolve to, one at a time, withdrawing corrupt ones."""
        limits = self.store.limits
        if len(keys) > limits.max_batch:
            raise BrokerError(Code.INVALID_ARGUMENT, f"keys has {len(keys)} items; at most {limits.max_batch} per call")
        ReplyRoom.admit(keys, "keys")  # a key twice would digest its object twice
        out = []
        for key in keys:
            obj = self.store.keys.get(key)
            if obj is None:
                out.append(ObjectCheck(key, 0, False, True, "", "no committed object has this key"))
            else:
                out.append(await self.check(obj))
        return out

    async def check(self, obj: Allocation) -> ObjectCheck:
        key, oid, want = obj.key or b"", obj.object_id, obj.digest
        if not want:
            return await self._first_digest(obj)
        got = await self._digest(obj)
        self.verifications += 1
        if not self._live(obj):
            return ObjectCheck(key, oid, False, True, want, "freed while it was checked")
        if got == want:
            return ObjectCheck(key, oid, True, True, want, "matches the digest taken at commit")
        self.corruptions += 1
        self.log.warning(
            "object_corrupted", object_id=oid, key=key.hex()[:64], expected=want, found=got, pinned=obj.pin_count
        )
        self.store.withdraw(obj)
        return ObjectCheck(
            key,
            oid,
            True,
            False,
            want,
            f"object {oid} hashes to {got}, not the digest taken at commit: withdrawn (its key no longer "
            "resolves; sessions that pin it keep their pins, its pages return with the last)",
        )

    async def _first_digest(self, obj: Allocation) -> ObjectCheck:
        """An object with no digest (made by ``Allocate`` with its key, or committed before
        digests were on): its digest is taken now, so every later check compares against it.
        One whose commit digest is still being taken is left to that digest."""
        key, oid = obj.key or b"", obj.object_id
        if oid in self._pending:
            return ObjectCheck(key, oid, False, True, "", "its digest, taken at commit, is still being computed")
        got = await self._digest(obj)
        if not self._live(obj):
            return ObjectCheck(key, oid, False, True, "", "freed while its digest was taken")
        if obj.digest:  # a concurrent check took it first: compare with that one next time
            return ObjectCheck(key, oid, False, True, obj.digest, "its digest was taken by another check")
        obj.digest = got
        self.digests_taken += 1
        return ObjectCheck(
            key,
            oid,
            False,
            True,
            got,
            "no digest before this check (made by Allocate with its key, which its creator may still be "
            "writing, or committed before digests were on): taken now; a later change is reported",
        )

    async def _sample_loop(self) -> None:
        """Every ``interval_s``, check one keyed object that has a digest (``_pick``)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                obj = self._pick()
                if obj is not None:
                    await self.check(obj)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001  (a failed check must not end the checks)
                self.log.warning("object_verify_failed", error=repr(err))

    def _pick(self) -> Allocation | None:
        """One of the first 64 digested objects of the key map's next shard, at random: the
        shards in turn, so every object's shard comes round, at a bounded cost per pick."""
        for _ in range(256):
            self._turn += 1
            cands = [o for o in itertools.islice(self.store.keys.shard_values(self._turn), 64) if o.digest]
            if cands:
                return random.choice(cands)
        return None
