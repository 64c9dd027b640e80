"""What memory the machine, and the broker's cgroup, can give the host arena.

This module reads it (``MachineMemory.read``: ``/proc/meminfo``'s MemTotal and MemAvailable,
and the tightest cgroup v2 ``memory.max`` on the process's cgroup path with that cgroup's
``memory.current``) and checks a pool and a grow against it. It allocates nothing and knows
nothing of slabs or pages; the host arena asks it before it starts and before each grow.

``MEMORY_BROKER_MACHINE_MEMORY`` stands in for the reading: ``TOTAL`` or ``TOTAL:AVAILABLE``, in
bytes, with no cgroup limit (tests; a host that must keep memory for others than the broker).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from memory_broker.proto.wire.mapping.geometry import format_size

ENV = "MEMORY_BROKER_MACHINE_MEMORY"
CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True, slots=True)
class MachineMemory:
    """One reading of the memory the host arena may take."""

    # MemTotal: the most the machine could ever give.
    total: int
    # MemAvailable: what it can give now without swapping.
    available: int
    # The tightest cgroup v2 memory.max over the process's cgroup and its parents; None: no limit.
    cgroup_max: int | None = None
    # memory.current of the cgroup that sets ``cgroup_max`` (0 without a limit).
    cgroup_current: int = 0
    # That cgroup's path under the cgroup root, for messages.
    cgroup: str = ""
    # The variable that stated these figures ("": read from the machine).
    stated_by: str = ""

    @classmethod
    def read(cls) -> MachineMemory:
        """The machine's figures now (``MEMORY_BROKER_MACHINE_MEMORY`` when set).

        Raises:
            ValueError: the variable is set but is not ``TOTAL`` or ``TOTAL:AVAILABLE`` in bytes.
        """
        stated = os.environ.get(ENV, "").strip()
        if stated:
            return cls.stated(stated)
        total, available = _meminfo()
        limit, current, where = _cgroup_limit()
        return cls(total, available, limit, current, where)

    @classmethod
    def stated(cls, text: str) -> MachineMemory:
        """The figures ``MEMORY_BROKER_MACHINE_MEMORY`` states."""
        try:
            total, _, available = text.partition(":")
            got = cls(int(total), int(available or total), stated_by=f"{ENV}={text}")
        except ValueError:
            raise ValueError(f"{ENV}={text!r}: write TOTAL or TOTAL:AVAILABLE, in bytes") from None
        if got.available > got.total or got.total <= 0:
            raise ValueError(f"{ENV}={text!r}: TOTAL must be positive and AVAILABLE at most TOTAL")
        return got

    @property
    def limit(self) -> int:
        """The most the arena could ever hold here: MemTotal, or the cgroup's limit if lower."""
        return self.total if self.cgroup_max is None else min(self.total, self.cgroup_max)

    @property
    def headroom(self) -> int:
        """What a grow may take now: MemAvailable, or the cgroup's room if lower."""
        if self.cgroup_max is None:
            return self.available
        return max(0, min(self.available, self.cgroup_max - self.cgroup_current))

    def describe(self) -> str:
        """The figures, as a message quotes them."""
        text = f"MemTotal {format_size(self.total)}, MemAvailable {format_size(self.available)}"
        text += f" ({self.stated_by})" if self.stated_by else " (/proc/meminfo)"
        if self.cgroup_max is not None:
            text += (
                f"; cgroup {self.cgroup or '/'} memory.max {format_size(self.cgroup_max)}, "
                f"memory.current {format_size(self.cgroup_current)}"
            )
        return text

    def check_pool(self, pool_size: int) -> None:
        """Refuse a pool the machine could never back.

        Raises:
            ValueError: ``pool_size`` is more than ``limit``; the message has both numbers.
        """
        if pool_size > self.limit:
            raise ValueError(
                f"pool_size {format_size(pool_size)} is more than this machine can give the host arena: "
                f"{self.describe()}; set pool_size (--pool-size, memory_pool.pool_size) to at most "
                f"{format_size(self.limit)} less what the engines and the system need"
            )

    def check_grow(self, nbytes: int, have: int, backed: int) -> None:
        """Refuse a grow the machine cannot back now, before any page is made.

        Args:
            nbytes: what the grow adds.
            have: the arena's size before it.
            backed: how much of ``have`` is populated, so MemAvailable already counts it
                (the rest is still to come out of it). A stated machine's figures are
                before the arena: all of ``have`` is still to come out of them.
        Raises:
            MemoryError: ``nbytes`` and what is still to come are more than ``headroom``.
        """
        pending = have if self.stated_by else have - backed
        if nbytes + pending > self.headroom:
            owed = f", {format_size(pending)} of the arena not yet backed" if pending else ""
            raise MemoryError(
                f"growing the host arena from {format_size(have)} by {format_size(nbytes)} needs more than "
                f"the machine can give now ({format_size(self.headroom)}{owed}: {self.describe()})"
            )


def _meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    """MemTotal and MemAvailable, in bytes."""
    fields: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                fields[name] = int(rest.split()[0]) * 1024
    total = fields["MemTotal"]
    return total, fields.get("MemAvailable", total)


def _cgroup_limit(root: str = CGROUP_ROOT) -> tuple[int | None, int, str]:
    """The tightest ``memory.max`` on this process's cgroup v2 path, that cgroup's
    ``memory.current`` and its path; (None, 0, "") where none is set or cgroup v2 is absent."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
    except OSError:
        return None, 0, ""
    if path is None:
        return None, 0, ""
    best: tuple[int | None, int, str] = (None, 0, "")
    while True:
        limit = _read_int(os.path.join(root, path.lstrip("/"), "memory.max"))
        if limit is not None and (best[0] is None or limit < best[0]):
            current = _read_int(os.path.join(root, path.lstrip("/"), "memory.current")) or 0
            best = (limit, current, path or "/")
        if path in ("", "/"):
            return best
        path = os.path.dirname(path.rstrip("/"))


def _read_int(path: str) -> int | None:
    """A cgroup file's number; None for "max", a missing file or anything else."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


__all__ = ["ENV", "MachineMemory"]
