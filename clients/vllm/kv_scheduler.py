"""The KV connector's scheduler half: keys requests, pins stored prefixes, plans each step.

``BrokerKVScheduler`` runs in vLLM's scheduler process, inside ``MemoryBrokerConnector``
(``kv_connector.py``), the facade vLLM instantiates. Per request it keys the full prompt
blocks (``identity.chain_hashes``); per step it looks up the chains of the requests waiting to
be scheduled, in one frame per broker (each tensor-parallel rank's keys in that rank's broker:
one broker per GPU, or one for all ranks; a prefix is a hit only as far as every rank's broker
holds it), pins in one more frame the blocks the step's requests will load, and tells the
workers which blocks to load (with the pinned objects' pages) and which to store
(``BrokerKVMetadata``). Pins go, in one frame per step, when the workers report the load
done, when a request is not scheduled after all, or when it finishes. A broker that is away
or fails costs a recompute, never a failed request. It never touches KV tensors.

A broker with a tier past the host (docs/tier.md) may hold more of a chain there: the
request is then asked about (``BrokerClient.probe_tier``) and, once the tier has answered,
answered to vLLM as an asynchronous external hit; its load goes to the workers when the
broker has read the blocks in (``_tier_loads``). No step waits on the tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from memory_broker.clients.vllm import check_vllm_version

check_vllm_version()

from memory_broker.clients.vllm import identity  # noqa: E402
from memory_broker.clients.vllm.kv_records import (  # noqa: E402
    BrokerKVMetadata,
    BrokerKVStats,
    BrokerKVWorkerMetadata,
    LoadRequest,
    SaveRequest,
    _ReqState,
)
from memory_broker.proto.wire.errors import BrokerError  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from memory_broker.clients.vllm.store import BrokerKV

log = logging.getLogger("vllm.memory_broker.kv_scheduler")


def _keyable(request: Any) -> bool:
    """Requests whose KV is a function of token ids (no images, no prompt embeddings)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return False
    return not getattr(request, "mm_features", None) and request.prompt_token_ids is not None


# Requests one step's lookup frame covers: the one vLLM asks about and the first waiting
# ones (in arrival order) up to this many in all, so the rest of the step's asks are answered
# from that frame. A step frame holds 64 ops: one unpin and 63 lookups (per rank).
PREFETCH = 63
# A request waits at most this long on its broker's tier past the host (asked, then read into
# the broker's pages) before vLLM computes what was not read; the broker's own deadline
# (tier.deadline, per tier call) normally ends the wait long before.
TIER_WAIT_S = 5.0
# A request waiting on the tier is asked about at most this often (vLLM's steps come back to
# back while nothing else runs).
TIER_POLL_S = 0.002


class _Away(Exception):
    """A rank's broker is unavailable (vLLM recomputes)."""


class BrokerKVScheduler:
    """The scheduler half (see the module docstring); ``stats`` is the facade's, shared.

    Per step, each broker gets at most one frame of lookups (without pins: the first
    ``get_num_new_matched_tokens`` of the step looks up every waiting request's chain at
    once, the step's later asks read its answers), one of pins (``build_connector_meta``
    pins the blocks every request scheduled to load will read) and one of unpins
    (``update_connector_output``: the pins of loads done and of finished requests); an
    unpin waiting for a frame rides on the next one that goes.
    """

    def __init__(
        self,
        broker: BrokerKV | Sequence[BrokerKV],
        engine_fp: bytes,
        block_size: int,
        tp_size: int,
        stats: BrokerKVStats,
    ):
        # ``broker``: one for every rank, or a list with rank r's broker at r.
        self.brokers = list(broker) if isinstance(broker, Sequence) else [broker] * tp_size
        if len(self.brokers) != tp_size:
            raise ValueError(f"{len(self.brokers)} brokers for {tp_size} tensor-parallel ranks")
        self.broker = self.brokers[0]
        self._engine_fp = engine_fp
        self.block_size = block_size
        self.tp_size = tp_size
        self.stats = stats
        self._reqs: dict[str, _ReqState] = {}
        self._to_load: set[str] = set()
        self._loading: dict[str, _ReqState] = {}
        # Requests added and not yet scheduled, in arrival order (what a step's lookup covers).
        self._waiting: dict[str, Request] = {}
        # This step's lookups: request id -> blocks of its chain every rank's broker holds.
        self._found: dict[str, int] = {}
        # Pins let go and not yet unpinned: id(broker) -> [(incarnation, objects)].
        self._releases: dict[int, list] = {}
        # Asynchronous loads from the tier: requests waiting until their blocks are read into
        # the broker, and requests that finished while waiting (their receive still has to be
        # reported finished by the workers, or vLLM keeps their blocks).
        self._tier_waiting: dict[str, _ReqState] = {}
        self._tier_cancelled: list[str] = []

    def _state(self, request: Request) -> _ReqState | None:
        st = self._reqs.get(request.request_id)
        if st is None:
            if not _keyable(request):
                return None
            root = identity.chain_root(
                self._engine_fp, identity.lora_identity(request.lora_request), getattr(request, "cache_salt", None)
            )
            toks = list(request.prompt_token_ids)
            st = _ReqState(chain=identity.chain_hashes(root, toks, self.block_size), prompt_len=len(toks))
            self._reqs[request.request_id] = st
        return st

    def _release(self, st: _ReqState) -> None:
        """The request's pins go with the next frame to their broker (``_flush``)."""
        for rank, objs in enumerate(st.pinned):
            if objs:
                self._releases.setdefault(id(self.brokers[rank]), []).append((st.incarnations[rank], objs))
        st.pinned, st.incarnations = [], []

    def _flush(self) -> None:
        """Unpin every let-go pin now: one frame per broker that has any."""
        for b in {id(b): b for b in self.brokers}.values():
            rel = self._releases.pop(id(b), None)
            if rel:
                b.lookup_many(None, [], False, rel)

    def _frames(self, wanted: list[tuple[int, list[bytes]]], pin: bool) -> list[list]:
        """Look up ``wanted`` ((rank, keys) pairs) in their ranks' brokers: one frame per
        broker, carrying its let-go pins. Raises ``_Away`` (a broker unavailable) or
        ``BrokerError`` (recorded against its broker)."""
        clients = [b.client() for b in self.brokers]
        if any(c is None for c in clients):
            raise _Away
        by: dict[int, list[int]] = {}
        for i, (rank, _) in enumerate(wanted):
            by.setdefault(id(self.brokers[rank]), []).append(i)
        out: list[list] = [[] for _ in wanted]
        for idxs in by.values():
            rank = wanted[idxs[0]][0]
            b = self.brokers[rank]
            got = b.lookup_many(clients[rank], [wanted[i][1] for i in idxs], pin, self._releases.pop(id(b), ()))
            for i, g in zip(idxs, got):
                out[i] = g
        return out

    def _look_up_step(self, request: Request) -> None:
        """One frame per broker: ``request``'s chain and the first waiting requests', up to
        ``PREFETCH`` in all (``_found`` gets how far every rank holds each)."""
        batch = [request]
        for rid, r in self._waiting.items():
            if len(batch) >= PREFETCH:
                break
            if rid not in self._found and rid != request.request_id:
                batch.append(r)
        states = [(r.request_id, self._state(r)) for r in batch]
        states = [(rid, st) for rid, st in states if st is not None and st.chain]
        wanted = [
            (rank, [identity.block_key(h, rank) for h in st.chain]) for _, st in states for rank in range(self.tp_size)
        ]
        got = self._frames(wanted, pin=False)
        for i, (rid, _) in enumerate(states):
            self._found[rid] = min(len(g) for g in got[i * self.tp_size : (i + 1) * self.tp_size])

    def on_new_request(self, request: Request) -> None:
        if _keyable(request):
            self._waiting[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if st is None:
            return 0, False
        self._release(st)  # asked again (the request could not be scheduled last time)
        st.load = None
        st.local_tokens = num_computed_tokens
        st.hit_blocks = 0
        # vLLM computes at least the prompt's last token.
        loadable = (st.prompt_len - 1) // self.block_size
        stored = self._found.get(request.request_id)
        if stored is None and st.chain:
            try:
                self._look_up_step(request)
            except _Away:
                stored = None
            except BrokerError:
                self.stats.add("broker_errors")
                return 0, False
            stored = self._found.get(request.request_id)
        if stored is None:
            # A rank's broker away: no rank can load (vLLM recomputes the whole prefix).
            st.next_save = max(st.next_save, num_computed_tokens // self.block_size)
            return 0, False
        # Pinned in build_connector_meta, with the step's other loads (one frame).
        st.hit_blocks = min(stored, loadable)
        st.tier_blocks = 0
        if st.hit_blocks < loadable and not st.tier_tried:
            more = self._tier_tail(st, st.hit_blocks, loadable)
            if more is None:
                return None, False  # the broker is asking its tier: vLLM asks again next step
            if more and (st.hit_blocks + more) * self.block_size > num_computed_tokens:
                # Read into the broker by its tier: an asynchronous load (build_connector_meta
                # hands it to the workers once the blocks are in the broker).
                self.stats.add("lookups")
                st.tier_blocks = more
                st.hit_blocks += more
                st.next_save = max(st.next_save, st.hit_blocks)
                return st.hit_blocks * self.block_size - num_computed_tokens, True
        self.stats.add("lookups")
        st.next_save = max(st.next_save, stored)
        return max(0, st.hit_blocks * self.block_size - num_computed_tokens), False

    def _tier_tail(self, st: _ReqState, hit: int, loadable: int) -> int | None:
        """Blocks of ``st.chain[hit:loadable]`` every rank's broker has or is reading in from
        its tier (0: none, no tier, or a failure: vLLM computes them); None while a broker is
        still asking its tier (never waited for here)."""
        now = time.monotonic()
        st.tier_since = st.tier_since or now
        if now - st.tier_since > TIER_WAIT_S:
            st.tier_tried = True
            return 0
        more = loadable - hit
        for rank in range(self.tp_size):
            n = self._tier_probe(rank, st.chain[hit:loadable])
            if n is None:
                return None
            more = min(more, n)
            if not more:
                break
        st.tier_tried = True
        return more

    def _tier_probe(self, rank: int, chain: list[bytes]) -> int | None:
        """How many of ``chain``'s blocks rank ``rank``'s broker holds or is reading in from its
        tier (``BrokerClient.probe_tier``); None while it asks the tier."""
        b = self.brokers[rank]
        c = b.client()
        if c is None or not b.tiered(c):
            return 0
        try:
            found, tier = c.probe_tier([identity.block_key(h, rank) for h in chain])
        except BrokerError as e:
            b.failed(c, e, "tier lookup")
            self.stats.add("broker_errors")
            return 0
        return None if tier < 0 else found + tier

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._waiting.pop(request.request_id, None)
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0:
            self._release(st)
            return
        start = st.local_tokens // self.block_size
        end = (st.local_tokens + num_external_tokens) // self.block_size
        st.load = (start, end)
        self.stats.add("hit_tokens", num_external_tokens)
        if st.tier_blocks:
            # An asynchronous load: it waits until the broker has the blocks.
            self._tier_waiting[request.request_id] = st
            st.tier_since = st.tier_next = time.monotonic()
            self.stats.add("tier_hit_tokens", st.tier_blocks * self.block_size)
            return
        self._to_load.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput, mgr: KVCacheManager | None) -> BrokerKVMetadata:
        meta = BrokerKVMetadata()
        self._found.clear()  # the step's lookups are spent
        sched = scheduler_output.num_scheduled_tokens
        progress: list[tuple[str, int]] = []
        for r in scheduler_output.scheduled_new_reqs:
            progress.append((r.req_id, r.num_computed_tokens + sched.get(r.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            progress.append((req_id, cached.num_computed_tokens[i] + sched.get(req_id, 0)))
        loads = [rid for rid, _ in progress if rid in self._to_load and self._reqs[rid].load is not None]
        if mgr is not None:
            self._tier_loads(meta, mgr)
        if loads and mgr is not None:
            self._pin_loads(loads)
        for req_id, done_tokens in progress:
            st = self._reqs.get(req_id)
            if st is None or mgr is None:
                continue
            block_ids = None
            if req_id in self._to_load and st.load is not None:
                block_ids = mgr.get_block_ids(req_id)[0]
                meta.loads.append(self._load_request(req_id, st, block_ids))
            full = min(done_tokens, st.prompt_len) // self.block_size
            if full > st.next_save:
                if block_ids is None:
                    block_ids = mgr.get_block_ids(req_id)[0]
                rng = range(st.next_save, min(full, len(block_ids)))
                if rng:
                    meta.saves.append(SaveRequest(req_id, [block_ids[b] for b in rng], [st.chain[b] for b in rng]))
                st.next_save = full
        # Requests asked to load that were not scheduled after all.
        for req_id in list(self._to_load):
            st = self._reqs.get(req_id)
            if st is not None:
                st.load = None
                self._release(st)
            self._to_load.discard(req_id)
        self._flush()
        return meta

    def _tier_loads(self, meta: BrokerKVMetadata, mgr: KVCacheManager) -> None:
        """The asynchronous loads whose wait is over go to the workers (pinned as the step's
        other loads): every block is in the broker, or its tier answered that no more are
        coming, or ``TIER_WAIT_S`` passed (what is missing then is reported for recompute);
        requests that finished while waiting are reported received, with nothing loaded."""
        for req_id in self._tier_cancelled:
            meta.loads.append(LoadRequest(req_id, [], [], tier=True))
        self._tier_cancelled = []
        ready = [rid for rid, st in self._tier_waiting.items() if self._tier_done(st)]
        if not ready:
            return
        self._pin_loads(ready)
        for req_id in ready:
            st = self._tier_waiting.pop(req_id)
            meta.loads.append(self._load_request(req_id, st, mgr.get_block_ids(req_id)[0], tier=True))

    def _tier_done(self, st: _ReqState) -> bool:
        """Whether the wait of ``st``'s asynchronous load is over (module docstring)."""
        now = time.monotonic()
        if now - st.tier_since > TIER_WAIT_S:
            return True
        if now < st.tier_next:
            return False
        st.tier_next = now + TIER_POLL_S
        start, end = st.load
        for rank in range(self.tp_size):
            b = self.brokers[rank]
            c = b.client()
            if c is None:
                return True
            try:
                found, tier = c.probe_tier([identity.block_key(h, rank) for h in st.chain[start:end]])
            except BrokerError as e:
                b.failed(c, e, "tier lookup")
                self.stats.add("broker_errors")
                return True
            if found < end - start and tier != 0:
                return False  # still read in
        return True

    def _pin_loads(self, req_ids: list[str]) -> None:
        """Pin, on every rank, the blocks each of ``req_ids`` loads this step: one frame per
        broker. A block no longer held (evicted since the step's lookup), and every block
        after it, is left to the worker to report for recompute (``load_ok``)."""
        states = [self._reqs[rid] for rid in req_ids]
        wanted = []
        for st in states:
            start, end = st.load
            wanted += [
                (rank, [identity.block_key(h, rank) for h in st.chain[start:end]]) for rank in range(self.tp_size)
            ]
        try:
            got = self._frames(wanted, pin=True)
        except (_Away, BrokerError) as e:
            if isinstance(e, BrokerError):
                self.stats.add("broker_errors")
            for st in states:
                st.load_ok = 0
            return
        incs = [b.incarnation for b in self.brokers]
        for i, st in enumerate(states):
            per_rank = got[i * self.tp_size : (i + 1) * self.tp_size]
            st.pinned, st.incarnations, st.incarnation, st.pin_first = per_rank, list(incs), incs[0], st.load[0]
            for rank, objs in enumerate(per_rank):
                self.brokers[rank].hold(incs[rank], len(objs))
            st.load_ok = min(len(objs) for objs in per_rank)

    def _load_request(self, req_id: str, st: _ReqState, block_ids: list[int], tier: bool = False) -> LoadRequest:
        """The workers' order to load ``st.load``'s pinned blocks (and to report the rest
        for recompute); the request moves to loading."""
        start, end = st.load
        ok = start + st.load_ok
        objs = []
        for b in range(start, ok):
            objs.append([(o.key, o.object_id, list(o.pages)) for o in (rank[b - st.pin_first] for rank in st.pinned)])
        st.load = None
        self._to_load.discard(req_id)
        self._loading[req_id] = st
        return LoadRequest(
            req_id,
            [block_ids[b] for b in range(start, ok)],
            objs,
            st.incarnation,
            failed_block_ids=[block_ids[b] for b in range(ok, end)],
            tier=tier,
        )

    def update_connector_output(self, connector_output: KVConnectorOutput):
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, BrokerKVWorkerMetadata) and self.tp_size == 1:
            # With several ranks the pins go when the request finishes.
            for req_id in wm.loaded:
                st = self._loading.pop(req_id, None)
                if st is not None:
                    self._release(st)
        self._flush()  # and the pins of requests finished this step

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._to_load.discard(request.request_id)
        if self._tier_waiting.pop(request.request_id, None) is not None:
            self._tier_cancelled.append(request.request_id)
        if st is not None:
            self._release(st)
        return False, None

    def shutdown(self) -> None:
        for st in list(self._reqs.values()):
            self._release(st)
        self._reqs.clear()
        self._waiting.clear()
        self._flush()
