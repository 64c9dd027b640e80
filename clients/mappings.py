"""How many memory mappings this process may still make, checked before the broker is asked.

Linux caps the mappings (VMAs) of one process at ``vm.max_map_count`` (65,530 by default);
every contiguous object this client maps into its window costs one or two of them (its run,
and the split of the reserved range around it), so a process holding tens of thousands of
contiguous objects would otherwise fail inside ``mmap`` with ENOMEM after the broker had
already allocated. ``MappingBudget`` keeps a cheap estimate of the process's mappings, reads
the real count from ``/proc/self/maps`` only when the estimate nears the limit, and refuses a
request that would cross ``limit - headroom`` with an error naming the sysctl. It never maps
or unmaps anything itself and knows nothing of the broker.

``MappedWindows`` remembers which window mappings are in place in this process, so an object
placed where an earlier one was, on the same pages, maps nothing again.
"""

from __future__ import annotations

import threading
from bisect import bisect_left

from memory_broker.proto.wire.errors import BrokerError, Code

MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
DEFAULT_LIMIT = 65530
# Mappings a contiguous object may add (its run plus the split reservation around it).
PER_OBJECT = 2


def read_limit(path: str = MAX_MAP_COUNT) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return DEFAULT_LIMIT


def count_mappings() -> int:
    """The process's mappings now (one line of /proc/self/maps each)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0


class MappingBudget:
    """Args:
    limit: the kernel's per-process limit (read from the sysctl when None).
    headroom: mappings left for the rest of the process (the Python runtime, torch, CUDA,
        an engine): 10% of the limit, at least 2,048, when None.
    """

    def __init__(self, limit: int | None = None, headroom: int | None = None):
        self.limit = read_limit() if limit is None else limit
        self.headroom = max(2048, self.limit // 10) if headroom is None else headroom
        self._lock = threading.Lock()
        self._known = count_mappings()
        self._added = 0

    @property
    def allowed(self) -> int:
        return self.limit - self.headroom

    def check(self, objects: int, what: str) -> None:
        """Refuse (RESOURCE_EXHAUSTED) if mapping ``objects`` more contiguous objects could
        cross the budget. Reads the real count only when the estimate says it might."""
        if objects <= 0:
            return
        need = PER_OBJECT * objects
        with self._lock:
            if self._known + self._added + need <= self.allowed:
                return
            self._known, self._added = count_mappings(), 0
            if self._known + need <= self.allowed:
                return
            raise BrokerError(
                Code.RESOURCE_EXHAUSTED,
                f"{what}: this process has {self._known} memory mappings and mapping {objects} more contiguous "
                f"object(s) may take {need}; the kernel allows {self.limit} per process (vm.max_map_count) and "
                f"this client keeps {self.headroom} for the rest of the process. Free contiguous objects you no "
                f"longer need, use non-contiguous objects (page_addresses()/page_tensors()), or raise the limit: "
                f"sysctl -w vm.max_map_count={max(4 * self.limit, 262144)}",
            )

    def mapped(self, objects: int = 1) -> None:
        """Count mappings this client just made."""
        with self._lock:
            self._added += PER_OBJECT * objects

    def exhausted_error(self, e: OSError, what: str) -> BrokerError:
        """The error for an ``mmap`` that failed with ENOMEM anyway (e.g. mappings made
        elsewhere in the process)."""
        return BrokerError(
            Code.RESOURCE_EXHAUSTED,
            f"{what}: mapping failed ({e}); the process is probably at its mapping limit "
            f"(vm.max_map_count = {self.limit}, {count_mappings()} in use). Raise it with "
            f"sysctl -w vm.max_map_count={max(4 * self.limit, 262144)}",
        )


class MappedWindows:
    """The window mappings in place in this process: window page -> the physical pages mapped
    there from it, back to back. A new mapping replaces every remembered one it overlaps (a
    mapping remembered by its start alone, after a later one had partly replaced it, once
    handed an object at that start another object's pages), so none overlap and each is found
    by bisecting the sorted starts. Not thread-safe: the client holds its map lock."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._pages: dict[int, tuple[int, ...]] = {}

    def get(self, start: int) -> tuple[int, ...] | None:
        """The pages mapped from window page ``start``, if a mapping starts there."""
        return self._pages.get(start)

    def put(self, start: int, pages: tuple[int, ...]) -> None:
        """``pages`` are now mapped from ``start``: forget what that range overlapped."""
        starts = self._starts
        i = bisect_left(starts, start)
        if i and starts[i - 1] + len(self._pages[starts[i - 1]]) > start:
            i -= 1  # the mapping before ``start`` reaches into it
        j = bisect_left(starts, start + len(pages))
        for w in starts[i:j]:
            del self._pages[w]
        starts[i:j] = [start]
        self._pages[start] = pages
