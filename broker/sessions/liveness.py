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
    # Key -> callback, each called once, in order of watch(), with the pid.
    callbacks: dict[object, Callable[[int], None]] = field(default_factory=dict)


# ``unwatch``'s default: every callback of the pid.
_ALL = object()


class PidWatcher:
    """Watches pids with pidfds on an event loop; each callback fires at most once.

    A pid's watch lasts while it has a callback: ``unwatch(pid, key)`` drops one (a session
    that ends while its process lives on), and the pidfd closes with the last, so a
    long-lived process that opens and closes sessions leaves nothing behind."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._watches: dict[int, _Watch] = {}

    def watch(self, pid: int, on_exit: Callable[[int], None], key: object = None) -> bool:
        """Call ``on_exit(pid)`` once when the process exits. ``key`` names the callback for
        ``unwatch`` (a second watch with the same key replaces it; None: a key of its own).

        Returns:
            False if the process is already gone (nothing is watched; treat it as dead).

        Raises:
            ValueError: pid <= 0, e.g. a peer in a pid namespace this process cannot see.
        """
        if pid <= 0:
            raise ValueError(f"cannot watch pid {pid}: not a process this broker can see")
        if key is None:
            key = object()
        w = self._watches.get(pid)
        if w is not None:
            w.callbacks[key] = on_exit
            return True
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        self._watches[pid] = _Watch(pidfd, {key: on_exit})
        self._loop.add_reader(pidfd, self._exited, pid)
        return True

    def unwatch(self, pid: int, key: object = _ALL) -> None:
        """Drop ``pid``'s callback named ``key`` (default: all of them); the watch ends with
        its last callback. Idempotent."""
        w = self._watches.get(pid)
        if w is None:
            return
        if key is not _ALL:
            w.callbacks.pop(key, None)
            if w.callbacks:
                return
        del self._watches[pid]
        self._drop(w)

    def close(self) -> None:
        """Stop every watch."""
        watches, self._watches = self._watches, {}
        for w in watches.values():
            self._drop(w)

    def watching(self, pid: int) -> bool:
        return pid in self._watches

    def callbacks(self, pid: int) -> int:
        """How many callbacks wait on ``pid`` (0: not watched)."""
        w = self._watches.get(pid)
        return 0 if w is None else len(w.callbacks)

    def _exited(self, pid: int) -> None:
        w = self._watches.pop(pid, None)
        if w is None:
            return
        self._drop(w)
        for cb in w.callbacks.values():
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
