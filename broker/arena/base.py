"""The broker's arena: physical memory in slabs that it creates, maps and exports as fds.

This module owns what every backend's owner side shares (``Arena``): growth by slabs with its
bounds check and its all-or-nothing rollback, the fd channel's units (``fd_units``) and
closing. A backend keeps how one slab is made (``_create_slab``), what it keeps of it, and how
fds are made for the fd channel (``export_fds``: a slab's memfd on the host, one fd per page
on CUDA, where only whole allocations map). Mapping is the view's
(``memory_broker.proto.wire.mapping``, shared with clients); it knows nothing of objects, owners or
eviction: the page pool above decides which page goes where.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from memory_broker.proto.wire.mapping.geometry import ArenaGeometry, format_size
from memory_broker.proto.wire.mapping.view import ArenaView


class Arena(abc.ABC):
    """The broker's arena: creates slabs on demand and keeps its own view of them."""

    # Short name shown in logs and status: "host" or "cuda".
    backend: str
    # What one fd of the fd channel stands for: "slab" (host) or "page" (CUDA).
    fd_unit: str

    def __init__(self, geometry: ArenaGeometry, view: ArenaView, name: str) -> None:
        self.geometry = geometry
        # Shown in slab names and messages.
        self.name = name
        # The broker's own mappings.
        self.view = view
        # Per slab, what the backend keeps of it (the host's memfd; nothing on CUDA).
        self._slabs: list[Any] = []
        # ``num_slabs`` as a plain callable (the list's own ``__len__``: no Python frame), for
        # the step channel, which reads it for every reply. The list is never replaced.
        self.count_slabs: Callable[[], int] = self._slabs.__len__
        self._closed = False
        # Guards the bookkeeping the fd channel's export threads read (held only for it, never
        # across a driver call: exports of several clients overlap) and ``close``'s flag.
        self._lock = threading.Lock()
        # Exports between their bookkeeping and their last driver call; ``close`` waits for
        # none before it releases what they export.
        self._exports_in_flight = 0
        self._exports_done = threading.Condition(self._lock)
        # Held across a whole grow (made off the event loop, on the grow thread, or in place)
        # and by ``close``: one grow at a time, and never a close beside one.
        self._grow_lock = threading.Lock()

    @property
    def num_slabs(self) -> int:
        """Slabs created so far."""
        return len(self._slabs)

    @property
    def capacity_pages(self) -> int:
        """Pages backed by physical memory now (grows up to ``geometry.max_pages``)."""
        return self.num_slabs * self.geometry.pages_per_slab

    def fd_units(self) -> int:
        """How many fds the fd channel can send now: slabs, or pages on CUDA."""
        return self.num_slabs if self.fd_unit == "slab" else self.capacity_pages

    def grow(self, slabs: int) -> None:
        """Create ``slabs`` more slabs and map them into the broker's view.

        Raises:
            MemoryError: the backend could not create a slab (device or host out of memory;
                the message names the call and the sizes), or the arena would exceed
                ``geometry.max_slabs``. Nothing this call created is left behind.
            ValueError: ``slabs`` is negative.
        """
        with self._grow_lock:
            self._check_open()
            self._grow_locked(slabs)

    def _grow_locked(self, slabs: int) -> None:
        g = self.geometry
        if slabs < 0:
            raise ValueError(f"cannot grow by {slabs} slabs")
        have = len(self._slabs)
        if have + slabs > g.max_slabs:
            raise MemoryError(
                f"arena at {have} of {g.max_slabs} slabs ({format_size(have * g.slab_size)}); cannot grow by {slabs}"
            )
        created: list[Any] = []
        try:
            prepared = self._prepare_growth()
            for idx in range(have, have + slabs):
                created.append(self._create_slab(idx, have, slabs, prepared))
        except BaseException:
            try:
                self.view.detach_from(have)
            finally:
                for rec in created:
                    self._discard_slab(rec)
            raise
        self._slabs.extend(created)
        self._grown(have, slabs)

    @abc.abstractmethod
    def export_fds(self, first: int, count: int) -> list[int]:
        """New close-on-exec fds for fd units ``first..first+count-1`` (slabs or pages), owned
        by the caller, who closes them once sent. Called from the fd channel's export threads.

        Raises:
            ValueError: a unit does not exist.
            OSError, MemoryError: an fd could not be made (none of this call's is left open).
        """

    def close(self) -> None:
        """Unmap the broker's view and close what it keeps of each slab, once a grow and the
        exports in flight are done (later ones are refused). Idempotent."""
        with self._grow_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            self._exports_done.wait_for(lambda: self._exports_in_flight == 0)
        try:
            self.view.close()
        finally:
            for rec in self._slabs:
                self._discard_slab(rec)
            self._slabs.clear()

    @contextlib.contextmanager
    def _exporting(self, first: int, count: int) -> Iterator[None]:
        """Hold ``close`` off while the body exports units ``first..first+count-1`` (checked to
        exist, under the lock); the body runs without the lock."""
        with self._lock:
            self._check_open()
            self._check_units(first, count)
            self._exports_in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._exports_in_flight -= 1
                self._exports_done.notify_all()

    # ------------------------------------------------------------- per backend

    def _prepare_growth(self) -> object:
        """What every ``_create_slab`` of one ``grow`` needs (made once per grow); None here."""
        return None

    @abc.abstractmethod
    def _create_slab(self, idx: int, have: int, slabs: int, prepared: object) -> Any:
        """Create slab ``idx``, map it into ``self.view`` and return what the arena keeps of it.

        ``have`` and ``slabs`` are the grow's start and size, for the message. On failure it
        raises MemoryError (naming the failed call) and leaves nothing of slab ``idx`` behind;
        ``grow`` undoes the slabs before it.
        """

    def _grown(self, first: int, count: int) -> None:
        """Slabs ``first..first+count-1`` were added (after a whole grow succeeded); nothing here."""
        return None

    def _discard_slab(self, record: Any) -> None:
        """Close what ``_create_slab`` returned (after the view unmapped it); nothing here."""
        return None

    def _check_units(self, first: int, count: int) -> None:
        have = self.fd_units()
        if first < 0 or count < 0 or first + count > have:
            raise ValueError(f"{self.fd_unit}s {first}..{first + count - 1} do not exist; the arena has {have}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this arena is closed")


__all__ = ["Arena", "ArenaGeometry", "ArenaView"]
