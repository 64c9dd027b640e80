"""The warm tier's book-keeping: host memory taken by warm images, and its budget.

``WarmBudget`` counts the bytes of every warm image, keeps the warm policy's victim order
and drops images (policy order, never one a hot load is reading) once ``warm_tier_bytes``
is exceeded. It only forgets images; reading, building and writing them is done elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from memory_broker.broker.adapters.config import AdapterConfig
from memory_broker.broker.adapters.entry import AdapterEntry
from memory_broker.broker.adapters.policy import TierPolicy
from memory_broker.broker.adapters.stats import AdapterCounters
from memory_broker.broker.adapters.warm_image import WarmImage


class WarmBudget:
    """Warm images and their budget.

    Args:
        config: ``warm_tier_bytes``.
        policy: the warm tier's victim order.
        counters: where dropped images are counted.
        entries: looks an entry up by adapter id (None when there is none).
        on_drop: called with an entry whose warm image was just dropped (it may now be idle).
    """

    def __init__(
        self,
        config: AdapterConfig,
        policy: TierPolicy,
        counters: AdapterCounters,
        entries: Callable[[str], AdapterEntry | None],
        on_drop: Callable[[AdapterEntry], None],
    ):
        self.config = config
        self.policy = policy
        self.counters = counters
        self._entries = entries
        self._on_drop = on_drop
        self.bytes = 0

    def add(self, e: AdapterEntry, image: WarmImage) -> None:
        """A warm load finished: ``e`` holds ``image`` now."""
        e.warmed(image)
        self.bytes += image.nbytes
        self.policy.insert(e.adapter_id, image.nbytes)

    def drop(self, e: AdapterEntry) -> None:
        image = e.drop_warm()
        self.bytes -= image.nbytes
        self.policy.remove(e.adapter_id)
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
