"""The KV connector's lookups, off the scheduler's path: a thread that looks arriving requests up.

``BrokerKVScheduler`` (``kv_scheduler.py``) hands each request's keys to ``AsyncLookups`` when
vLLM adds the request (``on_new_request``); the thread looks up everything handed over since
its last frame in one frame per broker (no pins) and keeps how far every rank's broker holds
each chain. vLLM's ask (``get_num_new_matched_tokens``) is answered from that, or "not yet"
(None) while the frame is out: vLLM then runs its step without the request and asks again
at the next one. No step waits on a broker round trip to look up. On a busy engine the answer
is in by the time vLLM asks; an idle engine runs one step without the request first, as it
does with LMCache's connector (whose server looks up the same way), which on a CPU engine often
made the next step faster (0.85-0.98 of an engine without a connector at the median in three
runs: ops/bench/results/2026-12-07-cpu-vllm-kv-local-hits.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memory_broker.proto.wire.errors import BrokerError

if TYPE_CHECKING:
    from memory_broker.clients.vllm.store import BrokerKV

log = logging.getLogger("vllm.memory_broker.kv_lookups")

# What ``result`` gives for a request whose rank's broker was away (vLLM computes it all).
AWAY = -1


class AsyncLookups:
    """Lookups on a thread (see the module docstring): ``brokers[r]`` is rank r's broker."""

    def __init__(self, brokers: Sequence[BrokerKV]):
        self.brokers = list(brokers)
        self._cv = threading.Condition()
        self._queue: list[tuple[str, list[list[bytes]]]] = []
        self._out: set[str] = set()  # handed over, not yet answered
        self._done: dict[str, int | BrokerError] = {}
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, req_id: str, keys_per_rank: list[list[bytes]]) -> None:
        """Look ``req_id`` up (each rank's keys in its broker), unless it is already out or answered."""
        with self._cv:
            if self._closed or req_id in self._out or req_id in self._done:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="memory-broker-kv-lookups", daemon=True)
                self._thread.start()
            self._queue.append((req_id, keys_per_rank))
            self._out.add(req_id)
            self._cv.notify_all()

    def result(self, req_id: str) -> int | BrokerError | None:
        """Blocks of ``req_id``'s chain every rank's broker holds (``AWAY``: a broker was away),
        the ``BrokerError`` its frame met, or None while it is out or was never handed over.
        Kept until ``forget``."""
        with self._cv:
            return self._done.get(req_id)

    def out(self, req_id: str) -> bool:
        with self._cv:
            return req_id in self._out

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s answer (scheduled or finished); one still out is dropped when it comes."""
        with self._cv:
            self._done.pop(req_id, None)
            self._out.discard(req_id)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                batch, self._queue = self._queue, []
            try:
                got = self._frames(batch)
            except Exception:  # never let the thread die: vLLM computes these requests
                log.exception("MemoryBrokerConnector: looking up %d requests failed", len(batch))
                got = dict.fromkeys((rid for rid, _ in batch), AWAY)
            with self._cv:
                for rid, _ in batch:
                    if rid in self._out:  # not forgotten meanwhile
                        self._out.discard(rid)
                        self._done[rid] = got[rid]

    def _frames(self, batch: list[tuple[str, list[list[bytes]]]]) -> dict[str, int | BrokerError]:
        """One frame per broker for every request of ``batch``: how far every rank holds each."""
        clients = [b.client() for b in self.brokers]
        if any(c is None for c in clients):
            return {rid: AWAY for rid, _ in batch}
        found = {rid: None for rid, _ in batch}
        by: dict[int, list[int]] = {}  # id(broker) -> its ranks
        for rank, b in enumerate(self.brokers):
            by.setdefault(id(b), []).append(rank)
        for ranks in by.values():
            b = self.brokers[ranks[0]]
            lists = [keys[r] for _, keys in batch for r in ranks]
            try:
                got = b.lookup_many(clients[ranks[0]], lists, False)
            except BrokerError as e:  # recorded against its broker by lookup_many
                return {rid: e for rid, _ in batch}
            for i, (rid, _) in enumerate(batch):
                n = min(len(g) for g in got[i * len(ranks) : (i + 1) * len(ranks)])
                found[rid] = n if found[rid] is None else min(found[rid], n)
        return found
