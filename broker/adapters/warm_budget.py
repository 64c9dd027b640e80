"""The warm tier's book-keeping: host memory taken by warm images, and its budget.

``WarmBudget`` counts the bytes of every warm image, keeps the warm policy's victim order
and drops images (policy order, never one a hot load is reading) once ``warm_tier_bytes``
is exceeded. It only forgets images; reading, building and writing them is done elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable

from memory_broker.broker.adapters.context import AdapterContext
from memory_broker.broker.adapters.entry import AdapterEntry
from memory_broker.broker.adapters.policy import BatchedAccess, make_tier_policy
from memory_broker.broker.adapters.warm_image import WarmImage


class WarmBudget:
    """Warm images and their budget.

    Args:
        ctx: the wing's shared record: its config has ``warm_tier_bytes`` and the warm tier's
            policy; dropped images are counted in its counters; entries are looked up in its
            entry table, and an entry whose warm image was just dropped goes to
            ``entries.forget_if_idle``.
    """

    def __init__(self, ctx: AdapterContext):
        self.config = ctx.config
        self.policy = BatchedAccess(make_tier_policy(ctx.config.warm_policy))
        self.counters = ctx.counters
        self._entries = ctx.entries.get
        self._on_drop = ctx.entries.forget_if_idle
        self.bytes = 0

    def add(self, e: AdapterEntry, image: WarmImage) -> None:
        """A warm load finished: ``e`` holds ``image`` now."""
        e.warmed(image)
        self.bytes += image.nbytes
        self.policy.insert(e.key, image.nbytes)

    def drop(self, e: AdapterEntry) -> None:
        image = e.drop_warm()
        self.bytes -= image.nbytes
        self.policy.remove(e.key)
        self.counters.warm_drops += 1
        self._on_drop(e)

    def drop_all(self, entries: Iterable[AdapterEntry]) -> None:
        for e in entries:
            if e.warm is not None:
                self.drop(e)

    def trim(self, keep: AdapterEntry | None = None) -> None:
        """Drop warm images until the tier fits its budget (``keep`` and images a hot load is
        reading stay)."""
        budget = self.config.warm_tier_bytes
        if self.bytes <= budget:
            return
        for vid in self.policy.victims():
            if self.bytes <= budget:
                break
            v = self._entries(vid)
            if v is None or v is keep or v.warm is None or v.loading is not None:
                continue
            self.drop(v)
