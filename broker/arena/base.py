"""The broker's arena: physical memory in slabs that it creates, maps and exports as fds.

This module owns what every backend's owner side shares (``Arena``): the slab fds it hands
out, growth with its bounds check and its all-or-nothing rollback, and closing. A backend
keeps only how one slab is made and exported (``_create_slab``). Mapping is the view's
(``memory_broker.proto.wire.mapping``, shared with clients); it knows nothing of objects, owners or
eviction: the page pool above decides which page goes where.
"""

from __future__ import annotations

import abc
import os

from memory_broker.proto.wire.mapping.geometry import ArenaGeometry, format_size
from memory_broker.proto.wire.mapping.view import ArenaView


class Arena(abc.ABC):
    """The broker's arena: creates slabs on demand and keeps its own view of them."""

    # Short name shown in logs and status: "host" or "cuda".
    backend: str

    def __init__(self, geometry: ArenaGeometry, view: ArenaView, name: str) -> None:
        self.geometry = geometry
        # Shown in slab names and messages.
        self.name = name
        # The broker's own mappings.
        self.view = view
        # The broker's slab fds, close-on-exec; shared with clients over SCM_RIGHTS.
        self._fds: list[int] = []
        self._closed = False

    @property
    def num_slabs(self) -> int:
        """Slabs created so far."""
        return len(self._fds)

    @property
    def capacity_pages(self) -> int:
        """Pages backed by physical memory now (grows up to ``geometry.max_pages``)."""
        return self.num_slabs * self.geometry.pages_per_slab

    def grow(self, slabs: int) -> None:
        """Create ``slabs`` more slabs and map them into the broker's view.

        Raises:
            MemoryError: the backend could not create a slab (device or host out of memory;
                the message names the call and the sizes), or the arena would exceed
                ``geometry.max_slabs``. Nothing this call created is left behind.
            ValueError: ``slabs`` is negative.
        """
        self._check_open()
        g = self.geometry
        if slabs < 0:
            raise ValueError(f"cannot grow by {slabs} slabs")
        have = len(self._fds)
        if have + slabs > g.max_slabs:
            raise MemoryError(
                f"arena at {have} of {g.max_slabs} slabs ({format_size(have * g.slab_size)}); cannot grow by {slabs}"
            )
        created: list[int] = []
        try:
            prepared = self._prepare_growth()
            for idx in range(have, have + slabs):
                created.append(self._create_slab(idx, have, slabs, prepared))
        except BaseException:
            try:
                self.view.detach_from(have)
            finally:
                for fd in created:
                    os.close(fd)
            raise
        self._fds.extend(created)

    def slab_fd(self, slab_index: int) -> int:
        """The broker-held fd of a slab; callers duplicate it (SCM_RIGHTS does) and never close it."""
        self._check_open()
        if not 0 <= slab_index < len(self._fds):
            raise ValueError(f"slab {slab_index} does not exist; the arena has {len(self._fds)} slabs")
        return self._fds[slab_index]

    def close(self) -> None:
        """Unmap the broker's view and close every slab fd. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.view.close()
        finally:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()

    # ------------------------------------------------------------- per backend

    def _prepare_growth(self) -> object:
        """What every ``_create_slab`` of one ``grow`` needs (made once per grow); None here."""
        return None

    @abc.abstractmethod
    def _create_slab(self, idx: int, have: int, slabs: int, prepared: object) -> int:
        """Create slab ``idx``, map it into ``self.view`` and return its exported fd.

        ``have`` and ``slabs`` are the grow's start and size, for the message. On failure it
        raises MemoryError (naming the failed call) and leaves nothing of slab ``idx`` behind;
        ``grow`` undoes the slabs before it.
        """

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this arena is closed")


__all__ = ["Arena", "ArenaGeometry", "ArenaView"]
