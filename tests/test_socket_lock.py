"""SocketLock: one broker per socket path, across processes, and none after the holder dies."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from memory_broker.broker.server.lock import SocketLock, SocketPathLocked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOLDER = """
import sys, time
from memory_broker.broker.server.lock import SocketLock
SocketLock({sock!r}).acquire()
print("locked", flush=True)
time.sleep(60)
"""

CONTENDER = """
import sys
from memory_broker.broker.server.lock import SocketLock, SocketPathLocked
try:
    SocketLock({sock!r}).acquire()
except SocketPathLocked as e:
    print(e)
else:
    print("acquired")
"""


@pytest.fixture
def sock():
    d = tempfile.mkdtemp(prefix="lk-", dir="/tmp")
    yield os.path.join(d, "b.sock")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def holder(sock):
    """A process holding the lock on ``sock`` until killed."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=ROOT, sock=sock)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    yield p
    p.kill()
    p.wait()


def contend(sock: str) -> str:
    r = subprocess.run(
        [sys.executable, "-c", CONTENDER.format(root=ROOT, sock=sock)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_acquire_writes_our_pid_to_the_lock_file(sock):
    lock = SocketLock(sock)
    lock.acquire()
    try:
        with open(sock + ".lock") as f:
            assert f.read().strip() == str(os.getpid())
    finally:
        lock.release()


def test_lock_held_by_another_process_is_refused_naming_its_pid(sock, holder):
    with pytest.raises(SocketPathLocked) as e:
        SocketLock(sock).acquire()
    assert str(e.value) == (f"another broker (pid {holder.pid}) owns {sock}; stop it or choose another --socket")


def test_lock_held_by_another_process_is_refused_in_a_third_process(sock, holder):
    assert contend(sock).startswith(f"another broker (pid {holder.pid}) owns {sock}")


def test_second_lock_in_the_same_process_is_refused(sock):
    first = SocketLock(sock)
    first.acquire()
    try:
        with pytest.raises(SocketPathLocked, match=f"pid {os.getpid()}"):
            SocketLock(sock).acquire()
    finally:
        first.release()


def test_lock_of_a_sigkilled_holder_can_be_taken(sock, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert os.path.exists(sock + ".lock")  # stale file left behind
    lock = SocketLock(sock)
    lock.acquire()
    try:
        with open(sock + ".lock") as f:
            assert f.read().strip() == str(os.getpid())
    finally:
        lock.release()


def test_release_unlinks_the_lock_file_and_is_idempotent(sock):
    lock = SocketLock(sock)
    lock.acquire()
    lock.release()
    assert not os.path.exists(sock + ".lock")
    lock.release()


def test_released_lock_can_be_taken_by_another_process(sock):
    lock = SocketLock(sock)
    lock.acquire()
    assert contend(sock).startswith(f"another broker (pid {os.getpid()})")
    lock.release()
    assert contend(sock) == "acquired"
