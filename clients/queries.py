"""The broker's RPCs that ask or administer, one RPC each and no mapping: the adapter
registry (register, unregister, list, layouts, prefetch, verify), stats, the arena's
description, and the keyed objects' digests. ``BrokerClient`` (``client.py``) adds objects,
transactions, pins, adapter leases and the step calls over the same session.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from memory_broker.clients.session import BrokerSession
from memory_broker.proto.wire.layout import ModuleShard
from memory_broker.proto.wire.messages import shard_msg
from memory_broker.proto.wire.v1 import broker_pb2 as pb


class BrokerQueries(BrokerSession):
    """A session's asking and administering RPCs (``BrokerClient`` is one)."""

    # Adapter id (and "#dtype" for a copy in another dtype) -> its layout; ``BrokerClient`` fills it.
    _layout_cache: dict

    def register_adapter(self, adapter_id: str, path: str) -> pb.Adapter:
        """Register a PEFT directory (readable by the broker) under ``adapter_id``."""
        req = pb.RegisterAdapterRequest(adapter_id=adapter_id, path=os.path.abspath(path))
        return self._call(self._stub.RegisterAdapter, req, retry=True).adapter

    def unregister_adapters(self, adapter_ids: Sequence[str]) -> None:
        self._call(self._stub.UnregisterAdapter, pb.UnregisterAdapterRequest(adapter_ids=list(adapter_ids)))
        for aid in adapter_ids:
            for key in (aid, *(f"{aid}#{d}" for d in ("float32", "float16", "bfloat16"))):
                self._layout_cache.pop(key, None)

    def list_adapters(self, prefix: str = "", limit: int = 100, page_token: str = "") -> pb.ListAdaptersResponse:
        return self._call(
            self._stub.ListAdapters,
            pb.ListAdaptersRequest(prefix=prefix, limit=limit, page_token=page_token),
            retry=True,
        )

    def adapter_layout(self, adapter_id: str, dtype: str = "", shards: Sequence[ModuleShard] = ()) -> pb.AdapterLayout:
        """An adapter's layout (of its copy in ``dtype`` holding ``shards``, as acquired)."""
        req = pb.GetAdapterLayoutRequest(adapter_id=adapter_id, dtype=dtype, shards=[shard_msg(s) for s in shards])
        return self._call(self._stub.GetAdapterLayout, req, retry=True)

    def prefetch_adapters(self, adapter_ids: Sequence[str], tier: str = "hot") -> pb.PrefetchAdaptersResponse:
        """Bring adapters to the warm or hot tier ahead of use, without pinning them."""
        t = {"hot": pb.ADAPTER_TIER_HOT, "warm": pb.ADAPTER_TIER_WARM}[tier]
        return self._call(
            self._stub.PrefetchAdapters, pb.PrefetchAdaptersRequest(adapter_ids=list(adapter_ids), tier=t), retry=True
        )

    def verify_adapters(self, adapter_ids: Sequence[str] = ()) -> pb.VerifyAdaptersResponse:
        """Have the broker check adapters' resident copies against their checksums (no ids:
        every resident adapter). A corrupt copy is dropped and reloaded from its source on
        the next acquire; ``response.corrupt`` counts them."""
        return self._call(
            self._stub.VerifyAdapters, pb.VerifyAdaptersRequest(adapter_ids=list(adapter_ids)), retry=True
        )

    def verify_objects(self, keys: Sequence[bytes]) -> pb.VerifyObjectsResponse:
        """Have the broker check committed keyed objects against the digest taken when their
        transaction committed (a broker started with ``--kv-digest``). A corrupt object is
        withdrawn: its key stops resolving; ``response.corrupt`` counts them."""
        return self._call(self._stub.VerifyObjects, pb.VerifyObjectsRequest(keys=list(keys)), retry=True)

    def probe_tier(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """(keys found here, in order from the first; what the broker's tier answers for the
        rest): the tier's figure is -1 while the broker asks it, n > 0 while it reads the next
        n keys into its pages (a later lookup finds them), 0 for none, a failed tier or no
        tier. Pins nothing and never waits on the tier (docs/tier.md)."""
        resp = self._call(self._stub.Lookup, pb.LookupRequest(keys=list(keys), tier=True), retry=True)
        return len(resp.objects), resp.tier_blocks

    def stats(self) -> pb.Stats:
        return self._call(self._stub.GetStats, pb.GetStatsRequest(), retry=True)

    def get_arena(self) -> pb.ArenaInfo:
        return self._call(self._stub.GetArena, pb.GetArenaRequest(), retry=True)
