"""Sockets served by a thread of their own, each readiness callback run under the loop's core gate.

``StepThread`` offers the four calls of the event loop the step channel uses for its
connections (``add_reader``, ``remove_reader``, ``add_writer``, ``remove_writer``), with the
same arguments, and runs the callbacks on its own thread: a blocking wait on its own epoll, then
the ready callbacks in one hold of the loop's ``CoreGate`` (``core_gate.py``), so they run
between two callbacks of the loop, never beside one, as if the loop had run them. While they
run, the thread's running loop is the broker's (``asyncio.get_running_loop()`` answers it), and
anything they schedule on the loop (``call_soon``, ``call_later``) wakes the loop (bookkeeping
callbacks named ``lazy``, such as the metrics, within ``WAKE_DELAY_S``).

Every call that changes the registrations is made holding the gate: by the loop thread (its
callbacks hold it) or by this thread's callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import select
import socket
import threading
import time
from collections.abc import Callable

from memory_broker.broker.doors.core_gate import CoreGate

# The most a "lazy" callback (``StepThread.lazy``: bookkeeping, such as the step channel's
# metrics) scheduled by a frame waits for the loop to wake for it; anything else wakes it at once.
WAKE_DELAY_S = 0.005

_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
# What an epoll event means, as ``selectors`` reads it: an error or hang-up wakes both sides.
_READ, _WRITE = ~_OUT, ~_IN


def _noop() -> None:
    pass


class StepThread:
    """A thread serving sockets' readiness under ``gate``, with the loop's ``add_reader`` API."""

    def __init__(self, loop: asyncio.AbstractEventLoop, gate: CoreGate, name: str = "step-channel", lazy: tuple = ()):
        self._loop = loop
        # Callbacks that may wait up to WAKE_DELAY_S for the loop when a frame schedules them
        # with call_soon (a wake-up per frame costs more than the frame's dispatch saves).
        self.lazy = frozenset(lazy)
        self._gate = gate
        self._ep = select.epoll()
        # fd -> [reader, writer], each (callback, args) or None; the list object stays the
        # same while the fd is registered (a callback that drops its fd empties it).
        self._handlers: dict[int, list] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._ep.register(self._wake_r.fileno(), _IN)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------ the loop's API

    def add_reader(self, fd: int, callback: Callable[..., object], *args) -> None:
        self._set(fd, 0, (callback, args))

    def remove_reader(self, fd: int) -> bool:
        return self._set(fd, 0, None)

    def add_writer(self, fd: int, callback: Callable[..., object], *args) -> None:
        self._set(fd, 1, (callback, args))

    def remove_writer(self, fd: int) -> bool:
        return self._set(fd, 1, None)

    def _set(self, fd: int, side: int, handler: tuple | None) -> bool:
        """Sets ``fd``'s reader (side 0) or writer (1); whether one was set before."""
        h = self._handlers.get(fd)
        if h is None:
            if handler is None:
                return False
            h = self._handlers[fd] = [None, None]
            h[side] = handler
            self._ep.register(fd, _OUT if side else _IN)
            return False
        had = h[side] is not None
        h[side] = handler
        if h[0] is None and h[1] is None:
            del self._handlers[fd]
            with contextlib.suppress(OSError):  # closed already: epoll forgot it
                self._ep.unregister(fd)
        else:
            self._ep.modify(fd, (_IN if h[0] is not None else 0) | (_OUT if h[1] is not None else 0))
        return had

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        loop = self._loop
        asyncio.events._set_running_loop(loop)
        try:
            self._serve(loop)
        except BaseException as e:  # a bug: the channel stops answering; say so on the loop
            loop.call_soon_threadsafe(
                loop.call_exception_handler, {"message": "the step channel's thread failed", "exception": e}
            )
            raise
        finally:
            asyncio.events._set_running_loop(None)

    def _serve(self, loop) -> None:
        """Wait for events; run each ready callback holding the gate (``with gate:``,
        inlined: this is each frame's fixed cost). Work they schedule on the loop wakes it at
        once, or, ``lazy`` callbacks alone, within ``WAKE_DELAY_S`` if it has not been through
        ``select()`` since (the step channel's metrics are recorded by a ``call_soon`` after
        every frame: a wake-up per frame cost more than the frame's dispatch saves)."""
        poll = self._ep.poll
        gate = self._gate
        lock, arrive = gate._lock, gate._arrivals
        me = threading.get_ident()
        handlers = self._handlers
        ready, timers = loop._ready, loop._scheduled
        clock = time.monotonic
        # A wake-up owed to the loop: its select count when the work was scheduled (-1: none
        # owed), and when it is due.
        owed, due, timeout = -1, 0.0, -1.0
        while True:
            events = poll(timeout)
            if owed >= 0 and (not events or clock() >= due):
                if gate.selects == owed:  # it has not looked at its queues since
                    loop.call_soon_threadsafe(_noop)
                owed, timeout = -1, -1.0
                if not events:
                    continue
            arrive.append(me)
            lock.acquire()
            arrive.pop()
            gate.entered += 1
            gate.owner = me
            # The loop's thread, as its debug checks see it, is this one meanwhile.
            loop_thread, loop._thread_id = loop._thread_id, me
            try:
                if self._stopping:
                    return
                n_ready, n_timers = len(ready), len(timers)
                for fd, ev in events:
                    h = handlers.get(fd)
                    if h is None:
                        continue  # the wake-up socket, or an fd dropped by an earlier callback
                    try:
                        if ev & _READ and h[0] is not None:
                            h[0][0](*h[0][1])
                        if ev & _WRITE and h[1] is not None:
                            h[1][0](*h[1][1])
                    except Exception as e:  # as the loop does with a callback's exception: report, go on
                        loop.call_exception_handler(
                            {"message": "exception in a step channel callback", "exception": e, "fd": fd}
                        )
                if len(ready) != n_ready or len(timers) != n_timers:
                    if len(timers) == n_timers and self._all_lazy(ready, n_ready):
                        if owed < 0:
                            owed, due, timeout = gate.selects, clock() + WAKE_DELAY_S, WAKE_DELAY_S
                    else:
                        loop.call_soon_threadsafe(_noop)
                        owed, timeout = -1, -1.0
            finally:
                loop._thread_id = loop_thread
                gate.owner = None
                if gate._loop_waits:
                    gate._turn.notify()
                lock.release()

    def _all_lazy(self, ready, start: int) -> bool:
        """Whether every handle scheduled after ``start`` runs a lazy callback."""
        lazy = self.lazy
        return bool(lazy) and all(h._callback in lazy for h in itertools.islice(ready, start, None))

    def stop(self) -> None:
        """Stop the thread and wait for it (the gate let go meanwhile, if this thread holds
        it: the thread may be waiting for it). Idempotent."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        t = self._thread
        if t.ident is not None and t is not threading.current_thread():
            with self._gate.released():
                t.join()

    def close(self) -> None:
        """Stop the thread and close its epoll and wake-up sockets (after the sockets it
        served are removed). Idempotent."""
        self.stop()
        self._handlers.clear()
        self._ep.close()
        self._wake_r.close()
        self._wake_w.close()
