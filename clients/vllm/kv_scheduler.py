"""The KV connector's scheduler half: keys requests, pins stored prefixes, plans each step.

``BrokerKVScheduler`` runs in vLLM's scheduler process, inside ``MemoryBrokerConnector``
(``kv_connector.py``), the facade vLLM instantiates. Per request it keys the full prompt
blocks (``identity.chain_hashes``), looks the chain up with pins (one lookup per
tensor-parallel rank, each in that rank's broker: one broker per GPU, or one for all ranks), and
a prefix is a hit only as far as every rank's broker holds it; per step tells the workers which blocks to load (with the pinned
objects' pages) and which to store (``BrokerKVMetadata``). Pins go when the workers report the
load done, when a request is not scheduled after all, or when it finishes. A broker that is
away or fails costs a recompute, never a failed request. It never touches KV tensors.
"""

from __future__ import annotations

import logging
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


class BrokerKVScheduler:
    """The scheduler half (see the module docstring); ``stats`` is the facade's, shared."""

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

    def _unpin(self, st: _ReqState) -> None:
        for rank, objs in enumerate(st.pinned):
            self.brokers[rank].release(st.incarnations[rank], objs)
        st.pinned, st.incarnations = [], []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if st is None:
            return 0, False
        self._unpin(st)  # asked again (the request could not be scheduled last time)
        st.load = None
        st.local_tokens = num_computed_tokens
        st.hit_blocks = 0
        # vLLM computes at least the prompt's last token.
        loadable = (st.prompt_len - 1) // self.block_size
        clients = [b.client() for b in self.brokers]
        if any(c is None for c in clients) or not st.chain:
            # A rank's broker away: no rank can load (vLLM recomputes the whole prefix).
            st.next_save = max(st.next_save, num_computed_tokens // self.block_size)
            return 0, False
        self.stats.add("lookups")
        incs = [b.incarnation for b in self.brokers]
        first = num_computed_tokens // self.block_size  # blocks vLLM's own cache holds
        try:
            # Without pins first: on a local prefix-cache hit the broker holds nothing beyond
            # vLLM's own cache, and nothing is pinned that must be unpinned (one round trip).
            stored = self._stored(clients, st)
            held = stored
            if min(stored, loadable) > first:
                held = self._pin(clients, st, incs, first, min(stored, loadable))
        except BrokerError:
            self.stats.add("broker_errors")
            self._unpin(st)
            return 0, False
        st.hit_blocks = held
        st.next_save = max(st.next_save, stored)
        hit = min(held, loadable) * self.block_size
        ext = max(0, hit - num_computed_tokens)
        if ext == 0:
            self._unpin(st)
        return ext, False

    def _lookup(self, clients: list, rank: int, hashes: list[bytes], pin: bool) -> list:
        """Rank ``rank``'s blocks of ``hashes`` in its broker (a BrokerError is recorded
        against that broker and raised)."""
        c = clients[rank]
        try:
            return c.lookup([identity.block_key(h, rank) for h in hashes], pin=pin)
        except BrokerError as e:
            self.brokers[rank].failed(c, e, "lookup")
            raise

    def _stored(self, clients: list, st: _ReqState) -> int:
        """Blocks of the chain, from block 0, every rank's broker holds (lookups without pins)."""
        found = len(st.chain)
        for rank in range(self.tp_size):
            found = len(self._lookup(clients, rank, st.chain[:found], pin=False))
            if not found:
                break
        return found

    def _pin(self, clients: list, st: _ReqState, incs: list[str], first: int, upto: int) -> int:
        """Pin blocks ``first..upto-1`` on every rank (the request's ``pinned``, from ``first``);
        returns how far, from block 0, the chain is held with pins on every rank."""
        st.pinned, st.incarnations, st.incarnation, st.pin_first = [], [], incs[0], first
        for rank in range(self.tp_size):
            got = self._lookup(clients, rank, st.chain[first:upto], pin=True)
            st.pinned.append(got)
            st.incarnations.append(incs[rank])
            self.brokers[rank].hold(incs[rank], len(got))
            if not got:
                break
        held = min(len(p) for p in st.pinned) if len(st.pinned) == self.tp_size else 0
        return first + held if held else 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0:
            self._unpin(st)
            return
        start = st.local_tokens // self.block_size
        end = (st.local_tokens + num_external_tokens) // self.block_size
        st.load = (start, end)
        self._to_load.add(request.request_id)
        self.stats.add("hit_tokens", num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput, mgr: KVCacheManager | None) -> BrokerKVMetadata:
        meta = BrokerKVMetadata()
        sched = scheduler_output.num_scheduled_tokens
        progress: list[tuple[str, int]] = []
        for r in scheduler_output.scheduled_new_reqs:
            progress.append((r.req_id, r.num_computed_tokens + sched.get(r.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            progress.append((req_id, cached.num_computed_tokens[i] + sched.get(req_id, 0)))
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
                self._unpin(st)
            self._to_load.discard(req_id)
        return meta

    def _load_request(self, req_id: str, st: _ReqState, block_ids: list[int]) -> LoadRequest:
        """The workers' order to load ``st.load``'s blocks; the request moves to loading."""
        start, end = st.load
        objs = []
        for b in range(start, end):
            objs.append([(o.key, o.object_id, list(o.pages)) for o in (rank[b - st.pin_first] for rank in st.pinned)])
        st.load = None
        self._to_load.discard(req_id)
        self._loading[req_id] = st
        return LoadRequest(req_id, [block_ids[b] for b in range(start, end)], objs, st.incarnation)

    def update_connector_output(self, connector_output: KVConnectorOutput):
        wm = connector_output.kv_connector_worker_meta
        if not isinstance(wm, BrokerKVWorkerMetadata) or self.tp_size != 1:
            return  # with several ranks the pins go when the request finishes
        for req_id in wm.loaded:
            st = self._loading.pop(req_id, None)
            if st is not None:
                self._unpin(st)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._to_load.discard(request.request_id)
        if st is not None:
            self._unpin(st)
        return False, None

    def shutdown(self) -> None:
        for st in list(self._reqs.values()):
            self._unpin(st)
        self._reqs.clear()
