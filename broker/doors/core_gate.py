"""The core gate: one lock that makes a thread's work a callback of the event loop.

The broker's core (store, sessions, adapters) is run by the event loop's thread, one callback at
a time. A loop made by ``gated_loop`` holds its ``CoreGate`` whenever it runs callbacks and
lets go of it only inside its selector's ``select()``, while it waits for events. Another thread
that does its work ``with gate:`` therefore runs it between two callbacks of the loop, exactly as
a callback would: never beside one. The step channel serves its frames so (``step_thread``):
a blocking wait on its own epoll and a frame under the gate cost what a raw echo does, where
each ``add_reader`` dispatch of the loop costs 5-9 us more on one CPU.

A busy loop (its ``select()`` returns at once) would take the gate back before a waiting thread
gets it: after each ``select()`` the loop lets the threads that were already waiting go first.
"""

from __future__ import annotations

import asyncio
import selectors
import sys
import threading


class CoreGate:
    """The lock the loop thread holds except inside ``select()``. ``with gate:`` on another
    thread waits for the loop to be in ``select()`` (or to give way after it) and keeps the loop
    from running callbacks until the block ends."""

    __slots__ = ("_lock", "_arrivals", "_turn", "entered", "owner", "_loop_waits", "_loop_holds", "selects")

    def __init__(self):
        self._lock = threading.Lock()
        self._turn = threading.Condition(self._lock)
        # One entry per thread waiting for the gate (each appends one before it waits and pops
        # one once it holds the gate: a list's append and pop are atomic), and how many times
        # a thread got the gate.
        self._arrivals: list[int] = []
        self.entered = 0
        # The thread that holds the gate (None: nobody, or a thread that did not say).
        self.owner: int | None = None
        self._loop_waits = False
        # The loop thread holds the gate (only the loop thread reads and writes it).
        self._loop_holds = False
        # How many times the loop came out of select() (so looked at its queues again).
        self.selects = 0

    # ------------------------------------------------------------ another thread

    def __enter__(self) -> CoreGate:
        me = threading.get_ident()
        self._arrivals.append(me)
        self._lock.acquire()
        self._arrivals.pop()
        self.entered += 1
        self.owner = me
        return self

    def __exit__(self, *exc) -> None:
        self.owner = None
        if self._loop_waits:
            self._turn.notify()
        self._lock.release()

    def held_here(self) -> bool:
        """Whether the calling thread holds the gate."""
        return self.owner == threading.get_ident()

    def released(self) -> _Released:
        """``with gate.released():`` lets go of the gate this thread holds for the block (to
        join a thread that waits for it), and takes it back after."""
        return _Released(self)

    # ------------------------------------------------------------ the loop thread

    def before_select(self) -> None:
        """The loop thread, entering ``select()``: let go of the gate (if it holds it: the
        first ``select()`` of a loop comes before any callback, so a loop takes the gate
        there the first time)."""
        if self._loop_holds:
            self._loop_holds = False
            self.owner = None
            self._lock.release()

    def after_select(self) -> None:
        """The loop thread, leaving ``select()``: take the gate back, after the threads that
        were waiting for it when ``select()`` returned (a busy loop starves none)."""
        self._lock.acquire()
        self.selects += 1
        if self._arrivals:
            target = self.entered + len(self._arrivals)
            self._loop_waits = True
            try:
                while self.entered < target:
                    self._turn.wait()
            finally:
                self._loop_waits = False
        self._loop_holds = True
        self.owner = threading.get_ident()


class _Released:
    __slots__ = ("gate", "held")

    def __init__(self, gate: CoreGate):
        self.gate = gate
        self.held = False

    def __enter__(self) -> None:
        g = self.gate
        self.held = g.held_here()
        if self.held:
            g.owner = None
            g._lock.release()

    def __exit__(self, *exc) -> None:
        if self.held:
            g = self.gate
            g._lock.acquire()
            g.owner = threading.get_ident()


class GateSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The loop's selector: the gate is open only while it waits for events."""

    def __init__(self, gate: CoreGate):
        super().__init__()
        self.gate = gate

    def select(self, timeout: float | None = None):
        gate = self.gate
        gate.before_select()
        try:
            return super().select(timeout)
        finally:
            gate.after_select()


class GatedLoop(asyncio.SelectorEventLoop):
    """An event loop that runs its callbacks holding ``core_gate``."""

    def __init__(self, gate: CoreGate | None = None):
        self.core_gate = gate if gate is not None else CoreGate()
        super().__init__(GateSelector(self.core_gate))


# The event loop's private attributes the step thread reads or sets (``step_thread.py``).
LOOP_PARTS = ("_ready", "_scheduled", "_thread_id")


def unsupported() -> str:
    """Why this Python cannot run a gated loop's step thread ("" if it can): the step thread
    reads and sets parts of asyncio that are not public API (CPython 3.11-3.13 have them)."""
    missing = [f"asyncio.{n}" for n in ("Runner",) if not hasattr(asyncio, n)]
    missing += [f"asyncio.events.{n}" for n in ("_set_running_loop",) if not hasattr(asyncio.events, n)]
    loop = asyncio.SelectorEventLoop()
    try:
        missing += [f"the event loop's {n}" for n in LOOP_PARTS if not hasattr(loop, n)]
        handle = loop.call_soon(lambda: None)
        if not hasattr(handle, "_callback"):
            missing.append("asyncio.Handle._callback")
    finally:
        loop.close()
    return f"this Python ({'.'.join(map(str, sys.version_info[:3]))}) lacks {', '.join(missing)}" if missing else ""


def gate_of(loop) -> CoreGate | None:
    """The loop's core gate; None for a loop without one (it runs everything itself)."""
    return getattr(loop, "core_gate", None)
