"""An engine's own KV cache at the broker: register, grow by groups, give groups back, and hear
when other engines want pages (docs/engine-pool.md).

``EngineKvSession`` is the thin client of the three engine-pool RPCs over a ``BrokerClient``'s
session; what the groups' pages become in the engine's address space is
``clients/kv_arena.py``'s, and which groups are free is the engine's. Reclaim requests arrive on
the session's event thread: ``on_event`` records them (the newest wins) for the engine to act on
off that thread (``take_reclaim``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from memory_broker.proto.wire.v1 import broker_pb2 as pb


@dataclass(frozen=True, slots=True)
class Reclaim:
    """The broker asks for up to ``pages`` back (whole free groups) before ``deadline``
    (wall-clock seconds)."""

    pages: int
    deadline: float


class EngineKvSession:
    """The engine's registration and its groups' traffic with the broker.

    Args:
        client: a connected ``BrokerClient`` (its session becomes the engine).
        name: the engine's name (``engine_pool.engines`` configures limits by it).
        group_pages: pages per group (one per layer).
        floor_pages, ceiling_pages, weight: asked for, within the configured limits (0: the
            configured ones).
    """

    def __init__(  # noqa: PLR0913 - the registration's fields
        self,
        client,
        name: str,
        group_pages: int,
        floor_pages: int = 0,
        ceiling_pages: int = 0,
        weight: float = 0.0,
    ):
        self.client = client
        self.name = name
        self.group_pages = group_pages
        self._lock = threading.Lock()
        self._reclaim: Reclaim | None = None
        self.registered = self.register(floor_pages, ceiling_pages, weight)

    def register(self, floor_pages: int = 0, ceiling_pages: int = 0, weight: float = 0.0) -> pb.EngineKvStats:
        """(Re)state the engine's limits; returns what the broker granted."""
        c = self.client
        req = pb.EngineKvRegisterRequest(
            name=self.name,
            group_pages=self.group_pages,
            floor_pages=floor_pages,
            ceiling_pages=ceiling_pages,
            weight=weight,
        )
        return c._call(c._stub.EngineKvRegister, req)

    def grow(self, groups: int, wait_ms: int = 0, least: int = 0) -> list[pb.ObjectInfo]:
        """Take ``groups`` new zeroed groups (their pages: ``info.pages``, one per layer); with
        ``least`` (1..groups) as many as fit now, at least ``least`` (only those are waited
        for). Raises BrokerError RESOURCE_EXHAUSTED (the engine then preempts)."""
        c = self.client
        req = pb.EngineKvGrowRequest(groups=groups, wait_ms=wait_ms, min_groups=least)
        resp = c._call(c._stub.EngineKvGrow, req)
        # The broker may have grown the arena for them: map its new slabs before use.
        c._ensure_slabs(max((i.arena_slabs for i in resp.groups), default=0))
        return list(resp.groups)

    def shrink(self, object_ids: Sequence[int]) -> int:
        """Give groups back (unmapped by the engine first); returns pages freed."""
        if not object_ids:
            return 0
        c = self.client
        return c._call(c._stub.EngineKvShrink, pb.EngineKvShrinkRequest(object_ids=list(object_ids))).freed_pages

    def on_event(self, ev: pb.SessionEvent) -> bool:
        """Record a reclaim request (from the session's event thread); True if it was one."""
        if ev.WhichOneof("event") != "engine_kv_reclaim":
            return False
        r = ev.engine_kv_reclaim
        with self._lock:
            self._reclaim = Reclaim(r.pages, r.deadline_unix_ms / 1000.0)
        return True

    def take_reclaim(self) -> Reclaim | None:
        """The pending reclaim request still within its deadline, once; else None."""
        with self._lock:
            r, self._reclaim = self._reclaim, None
        return r if r is not None and r.deadline > time.time() else None

    def stats(self) -> pb.EngineKvStats | None:
        """This engine's figures as the broker reports them (None: not registered there)."""
        c = self.client
        st = c._call(c._stub.GetStats, pb.GetStatsRequest())
        return next((e for e in st.engines if e.session_id == c.session_id), None)
