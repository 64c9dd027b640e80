"""PidWatcher: a process's exit, however it happens, reaches the callbacks once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from memory_broker.broker.sessions.liveness import PidWatcher


def open_pidfds() -> int:
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[pidfd]"
        except FileNotFoundError:
            pass  # listdir's own fd
    return n


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_sigkilled_process_triggers_on_exit_within_1s():
    async def main():
        loop = asyncio.get_running_loop()
        watcher = PidWatcher(loop)
        p = sleeper()
        exited = asyncio.Event()
        got: list[int] = []
        try:
            assert watcher.watch(p.pid, lambda pid: (got.append(pid), exited.set()))
            p.send_signal(signal.SIGKILL)
            await asyncio.wait_for(exited.wait(), 1.0)
            await asyncio.sleep(0.05)  # a second firing would land here
            assert got == [p.pid]
            assert not watcher.watching(p.pid)
        finally:
            watcher.close()
            p.kill()
            p.wait()

    asyncio.run(main())


def test_watch_of_a_dead_pid_returns_false():
    p = sleeper()
    p.kill()
    p.wait()  # reaped: the pid names no process

    async def main():
        watcher = PidWatcher(asyncio.get_running_loop())
        assert watcher.watch(p.pid, lambda pid: None) is False
        assert not watcher.watching(p.pid)

    asyncio.run(main())


def test_unwatch_prevents_the_callback():
    async def main():
        watcher = PidWatcher(asyncio.get_running_loop())
        p = sleeper()
        got: list[int] = []
        try:
            watcher.watch(p.pid, got.append)
            watcher.unwatch(p.pid)
            watcher.unwatch(p.pid)  # idempotent
            p.kill()
            p.wait()
            await asyncio.sleep(0.2)
            assert got == []
        finally:
            watcher.close()
            p.kill()
            p.wait()

    asyncio.run(main())


def test_several_watches_of_one_pid_each_fire_once_and_share_one_pidfd():
    async def main():
        watcher = PidWatcher(asyncio.get_running_loop())
        p = sleeper()
        got: list[str] = []
        done = asyncio.Event()
        try:
            before = open_pidfds()
            watcher.watch(p.pid, lambda pid: got.append("a"))
            watcher.watch(p.pid, lambda pid: got.append("b"))
            watcher.watch(p.pid, lambda pid: done.set())
            assert open_pidfds() == before + 1
            p.kill()
            await asyncio.wait_for(done.wait(), 1.0)
            assert got == ["a", "b"]
            assert open_pidfds() == before
        finally:
            watcher.close()
            p.kill()
            p.wait()

    asyncio.run(main())


def test_a_failing_callback_does_not_stop_the_others():
    async def main():
        loop = asyncio.get_running_loop()
        errors: list[dict] = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        watcher = PidWatcher(loop)
        p = sleeper()
        done = asyncio.Event()

        def boom(pid: int) -> None:
            raise RuntimeError("boom")

        try:
            watcher.watch(p.pid, boom)
            watcher.watch(p.pid, lambda pid: done.set())
            p.kill()
            await asyncio.wait_for(done.wait(), 1.0)
            assert [type(e["exception"]) for e in errors] == [RuntimeError]
        finally:
            watcher.close()
            p.kill()
            p.wait()

    asyncio.run(main())


def test_close_stops_every_watch_and_closes_the_pidfds():
    async def main():
        watcher = PidWatcher(asyncio.get_running_loop())
        procs = [sleeper(), sleeper()]
        got: list[int] = []
        try:
            before = open_pidfds()
            for p in procs:
                watcher.watch(p.pid, got.append)
            watcher.close()
            assert open_pidfds() == before
            assert not any(watcher.watching(p.pid) for p in procs)
            for p in procs:
                p.kill()
                p.wait()
            await asyncio.sleep(0.2)
            assert got == []
        finally:
            for p in procs:
                p.kill()
                p.wait()

    asyncio.run(main())


def test_watch_refuses_pid_zero():
    async def main():
        with pytest.raises(ValueError, match="pid 0"):
            PidWatcher(asyncio.get_running_loop()).watch(0, lambda pid: None)

    asyncio.run(main())


def test_unwatch_of_one_key_keeps_the_others_and_the_last_closes_the_pidfd():
    async def main():
        watcher = PidWatcher(asyncio.get_running_loop())
        p = sleeper()
        got: list[str] = []
        done = asyncio.Event()
        try:
            before = open_pidfds()
            for key in range(100):  # a process that opens and closes sessions: none left behind
                watcher.watch(p.pid, lambda pid, key=key: got.append(key), key)
                watcher.unwatch(p.pid, key)
            assert watcher.callbacks(p.pid) == 0 and not watcher.watching(p.pid)
            assert open_pidfds() == before
            watcher.watch(p.pid, lambda pid: got.append("a"), "a")
            watcher.watch(p.pid, lambda pid: got.append("stale"), "b")
            watcher.watch(p.pid, lambda pid: got.append("b"), "b")  # the same key: replaced
            watcher.watch(p.pid, lambda pid: done.set(), "c")
            watcher.unwatch(p.pid, "a")
            watcher.unwatch(p.pid, "a")  # idempotent
            assert watcher.callbacks(p.pid) == 2 and open_pidfds() == before + 1
            p.kill()
            await asyncio.wait_for(done.wait(), 1.0)
            assert got == ["b"] and open_pidfds() == before
        finally:
            watcher.close()
            p.kill()
            p.wait()

    asyncio.run(main())
