"""The tier's front: one thread of its own calls the backend, jobs reach it through a bounded
queue, and every job has a deadline.

``Tier.put``, ``find`` and ``get`` return at once with a ``concurrent.futures.Future``, or None
when the queue is full (counted in ``drops``): no caller, the broker's event loop least of
all, ever waits on the store. In the thread each job is one batched backend call. A job
past its deadline, a failed call (``TierError`` or anything else the backend raises) or a
backend marked down is a miss: the future gets the answer a miss gives (nothing stored,
nothing found), never an exception. A failure marks the backend down for a backoff that
doubles from ``BACKOFF_S`` to ``BACKOFF_MAX_S``; jobs in that time are misses without a
call, and the first job after it tries again. Reads check each value's digest over the
bytes they wrote: a value that fails it is a miss (counted in ``corrupt``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields

from memory_broker.broker.tier.base import CONTIGUOUS, RAW, Backend, Block, Meta, TierError, digest_parts

BACKOFF_S = 0.05
BACKOFF_MAX_S = 2.0


@dataclass(slots=True)
class TierCounts:
    # Blocks read whole with a good digest.
    hits: int = 0
    # Keys asked for and not served (not there, failed, late, corrupt or down).
    misses: int = 0
    # Values whose bytes failed their digest.
    corrupt: int = 0
    # Blocks stored, and blocks a put did not store.
    written: int = 0
    write_failed: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    # Backend calls that failed, and jobs that missed their deadline.
    errors: int = 0
    timeouts: int = 0
    # Jobs refused because the queue was full, and jobs answered as misses while down.
    drops: int = 0
    skipped_down: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class _Job:
    run: Callable[[float], object]
    # What the future gets when the job misses (late, down, failed).
    miss: Callable[[], object]
    future: Future
    deadline: float
    op: str


class Tier:
    """A backend behind a thread and a bounded queue (module docstring).

    Args:
        backend: the store (``valkey.ValkeyBackend``, ``mooncake.MooncakeBackend``).
        deadline_s: seconds from a call to its answer, queueing included.
        queue_depth: jobs that may wait; one more is refused.
        observe: ``observe(op, seconds)`` per backend call ("put", "find", "get"), from the
            tier's thread (the metrics' latency histogram).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        backend: Backend,
        deadline_s: float,
        queue_depth: int,
        observe: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.backend = backend
        self.deadline_s = deadline_s
        self.queue_depth = queue_depth
        self.counts = TierCounts()
        self._observe = observe
        self._clock = clock
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_depth)
        self._down_until = 0.0
        self._backoff = 0.0
        self._healthy = True
        self.last_error = ""
        self._thread = threading.Thread(target=self._serve, name=f"tier-{backend.name}", daemon=True)
        self._thread.start()
        # The client set up ahead, outside any job's deadline.
        self._submit("connect", lambda t: backend.connect(), lambda: None, late=True)

    # ------------------------------------------------------------------ callers

    @property
    def queued(self) -> int:
        """Jobs waiting now."""
        return self._queue.qsize()

    @property
    def up(self) -> bool:
        """False from a failed call until one succeeds again."""
        return self._healthy

    def put(self, blocks: Sequence[Block]) -> Future | None:
        """Store each block's bytes with their digest; the future: True per block stored."""
        blocks = list(blocks)
        return self._submit("put", lambda t: self._put(blocks, t), lambda: [False] * len(blocks))

    def find(self, keys: Sequence[str], raw: Sequence[Meta | None] = ()) -> Future | None:
        """The records of the leading keys the tier holds (a chain's hits, up to its first miss).
        ``raw[i]``, where given and not None, is the record key i's value in LMCache's format
        must fit (it has none of its own): found when a value of exactly its size is there."""
        keys, raw = list(keys), list(raw) or [None] * len(keys)
        return self._submit("find", lambda t: self._find(keys, raw, t), lambda: self._missed(len(keys), []))

    def get(self, blocks: Sequence[Block], metas: Sequence[Meta]) -> Future | None:
        """Read each value over its block's parts and check its digest; True per block whose
        bytes are the value's (a False block's bytes are undefined: never use them)."""
        blocks, metas = list(blocks), list(metas)
        return self._submit("get", lambda t: self._get(blocks, metas, t), lambda: self._missed(len(blocks), None))

    def register(self, address: int, size: int) -> Future | None:
        """Memory later blocks will name (queued ahead of them: registration is a backend call,
        made whatever the deadline or the backoff: it is local, and later jobs count on it)."""
        return self._submit("register", lambda t: self.backend.register(address, size), lambda: None, late=True)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread after the jobs queued (those past their deadline answer as misses);
        it closes the backend. Waits at most about ``timeout`` seconds: a store that does not
        answer (Mooncake's client retries its master) must not hold up a broker's exit."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _missed(self, n: int, value: list | None) -> list:
        self.counts.misses += n
        return [False] * n if value is None else value

    def _submit(self, op: str, run, miss, late: bool = False) -> Future | None:
        fut: Future = Future()
        deadline = float("inf") if late else self._clock() + self.deadline_s
        try:
            self._queue.put_nowait(_Job(run, miss, fut, deadline, op))
        except queue.Full:
            self.counts.drops += 1
            return None
        return fut

    # ------------------------------------------------------------- the thread

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            job.future.set_result(self._answer(job))
        try:
            self.backend.close()
        except Exception:  # noqa: BLE001, S110  (closing: nothing left to tell)
            pass

    def _answer(self, job: _Job) -> object:
        now = self._clock()
        if now >= job.deadline:
            self.counts.timeouts += 1
            return job.miss()
        if now < self._down_until and job.deadline != float("inf"):
            self.counts.skipped_down += 1
            return job.miss()
        try:
            out = job.run(job.deadline - now)
        except Exception as e:  # noqa: BLE001  (any failure of the store is a miss, never the broker's)
            self._failed(e)
            return job.miss()
        finally:
            if self._observe is not None:
                self._observe(job.op, self._clock() - now)
        if self._clock() > job.deadline:
            self.counts.timeouts += 1
            return job.miss()
        if job.op != "register":  # a local call: it says nothing of the store
            self._backoff = 0.0
            self._healthy = True
        return out

    def _failed(self, e: Exception) -> None:
        self.counts.errors += 1
        self._healthy = False
        self.last_error = str(e) if isinstance(e, TierError) else repr(e)
        self._backoff = min(BACKOFF_MAX_S, self._backoff * 2 or BACKOFF_S)
        self._down_until = self._clock() + self._backoff
        try:
            self.backend.reset()
        except Exception:  # noqa: BLE001, S110  (the next call reconnects or fails again)
            pass

    def _put(self, blocks: list[Block], timeout: float) -> list[bool]:
        for b in blocks:
            if b.before is not None:
                b.before()
        metas = [
            Meta(len(b.parts), b.size, b"" if b.raw else digest_parts(b.parts), CONTIGUOUS * b.contiguous)
            for b in blocks
        ]
        ok = self.backend.put(blocks, metas, timeout)
        c = self.counts
        for b, good in zip(blocks, ok):
            if good:
                c.written += 1
                c.bytes_written += b.size
            else:
                c.write_failed += 1
        return ok

    def _find(self, keys: list[str], raw: list[Meta | None], timeout: float) -> list[Meta]:
        kept = [k for k, r in zip(keys, raw) if r is None]
        records = iter(self.backend.metas(kept, timeout) if kept else [])
        sized = [k for k, r in zip(keys, raw) if r is not None]
        sizes = iter(self.backend.sizes(sized, timeout) if sized else [])
        found = []
        for r in raw:
            m = next(records) if r is None else (r if next(sizes) == r.size else None)
            if m is None:
                break
            found.append(m)
        self.counts.misses += len(keys) - len(found)
        return found

    def _get(self, blocks: list[Block], metas: list[Meta], timeout: float) -> list[bool]:
        read = self.backend.get_into(blocks, timeout)
        c = self.counts
        out = []
        for b, m, got in zip(blocks, metas, read):
            # LMCache's values carry no digest: their exact size was checked (``fill``).
            good = got and (bool(m.flags & RAW) if b.raw else b.size == m.size and digest_parts(b.parts) == m.digest)
            if got and not good:
                c.corrupt += 1
            if good and b.after is not None:
                b.after()
            if good:
                c.hits += 1
                c.bytes_read += b.size
            else:
                c.misses += 1
            out.append(good)
        return out


def open_backend(  # noqa: PLR0913 - the tier.* settings of one call site (broker/server/app.py)
    kind: str,
    *,
    valkey_url: str,
    mooncake_master: str,
    mooncake_metadata: str,
    segment_size: int,
    deadline_s: float,
    mooncake_tenants: bool = False,
) -> Backend:
    """The backend ``tier.backend`` names ("valkey" or "mooncake"); nothing connects yet for
    Mooncake (its first call does, in the tier's thread).

    Raises:
        ValueError: an unknown kind, or one whose address is not set.
    """
    if kind == "valkey":
        if not valkey_url:
            raise ValueError("tier.backend is valkey but tier.valkey_url is not set (valkey://host:port/0)")
        from memory_broker.broker.tier.valkey import ValkeyBackend

        return ValkeyBackend(valkey_url, deadline_s)
    if kind == "mooncake":
        if not mooncake_master:
            raise ValueError("tier.backend is mooncake but tier.mooncake_master is not set (host:port)")
        from memory_broker.broker.tier.mooncake import MooncakeBackend

        return MooncakeBackend(
            mooncake_master, mooncake_metadata, segment_size, timeout_s=deadline_s, tenants=mooncake_tenants
        )
    raise ValueError(f"unknown tier backend {kind!r}; one of none, valkey, mooncake")
