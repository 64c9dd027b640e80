"""Process death watch: calls back when a client process exits, however it exits.

``PidWatcher`` owns one pidfd per watched pid, registered with the event loop, so a
SIGKILLed client is noticed without polling; it knows nothing of sessions or what its
callbacks release. Use it from the event loop's thread only (``add_reader`` is not
thread-safe).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Watch:
    # Readable once the process has exited; owned here, closed when the watch ends.
    pidfd: int
    # Called once each, in order of watch(), with the pid.
    callbacks: list[Callable[[int], None]] = field(default_factory=list)


class PidWatcher:
    """Watches pids with pidfds on an event loop; each callback fires at most once."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._watches: dict[int, _Watch] = {}

    def watch(self, pid: int, on_exit: Callable[[int], None]) -> bool:
        """Call ``on_exit(pid)`` once when the process exits.

        Returns:
            False if the process is already gone (nothing is watched; treat it as dead).

        Raises:
            ValueError: pid <= 0, e.g. a peer in a pid namespace this process cannot see.
        """
        if pid <= 0:
            raise ValueError(f"cannot watch pid {pid}: not a process this broker can see")
        w = self._watches.get(pid)
        if w is not None:
            w.callbacks.append(on_exit)
            return True
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        self._watches[pid] = _Watch(pidfd, [on_exit])
        self._loop.add_reader(pidfd, self._exited, pid)
        return True

    def unwatch(self, pid: int) -> None:
        """Stop watching ``pid``, dropping all its callbacks. Idempotent."""
        w = self._watches.pop(pid, None)
        if w is not None:
            self._drop(w)

    def close(self) -> None:
        """Stop every watch."""
        watches, self._watches = self._watches, {}
        for w in watches.values():
            self._drop(w)

    def watching(self, pid: int) -> bool:
        return pid in self._watches

    def _exited(self, pid: int) -> None:
        w = self._watches.pop(pid, None)
        if w is None:
            return
        self._drop(w)
        for cb in w.callbacks:
            # One failing callback must not keep the others from releasing their session.
            try:
                cb(pid)
            except Exception as e:
                self._loop.call_exception_handler(
                    {"message": f"PidWatcher callback for pid {pid} failed", "exception": e}
                )

    def _drop(self, w: _Watch) -> None:
        self._loop.remove_reader(w.pidfd)
        os.close(w.pidfd)
