"""A client survives its broker: it waits for one that is starting, replaces a session lost
to a restart (and says so with a ``reconnected`` event), and its errors name the status and
what to do instead of gRPC's transport text."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import short_tmpdir, start_broker

from memory_broker.clients import BrokerClient, BrokerError, Code, Spec

# Pieces of gRPC's transport text that must never reach a caller.
TRANSPORT_WORDS = ("failed to connect to all addresses", "debug_error_string", "ipv4:", "Socket closed", "UNKNOWN:")


def _events(kind: str, events: list) -> list:
    return [ev for ev in events if ev.WhichOneof("event") == kind]


def _wait_for(pred, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_connect_right_after_start_succeeds():
    sock = os.path.join(short_tmpdir(), "b.sock")
    b = start_broker(socket=sock, wait=False)  # the socket does not exist yet
    try:
        t0 = time.monotonic()
        with BrokerClient.connect(sock, wait_s=30) as c:
            assert c.allocate([Spec(1)])[0].pages
        assert time.monotonic() - t0 < 30
    finally:
        b.stop()


def test_connect_with_no_broker_is_unavailable_within_its_bound_and_says_what_to_do():
    sock = os.path.join(short_tmpdir(), "none.sock")
    t0 = time.monotonic()
    with pytest.raises(BrokerError) as e:
        BrokerClient.connect(sock, wait_s=0.5)
    assert time.monotonic() - t0 < 5
    assert e.value.code == Code.UNAVAILABLE
    text = str(e.value)
    assert text.startswith("UNAVAILABLE: ") and sock in text and "start it" in text
    assert not any(w in text for w in TRANSPORT_WORDS)


def test_client_keeps_working_across_a_broker_restart():
    sock = os.path.join(short_tmpdir(), "b.sock")
    b1 = start_broker(socket=sock)
    events: list = []
    c = BrokerClient.connect(sock, on_event=events.append, timeout=10)
    b2 = None
    try:
        old_session = c.session_id
        (old,) = c.allocate([Spec(2)])
        assert b1.stop(signal.SIGKILL) == -signal.SIGKILL
        assert c.session_ended.wait(10)
        b2 = start_broker(socket=sock)
        assert _wait_for(lambda: _events("reconnected", events))
        (ev,) = _events("reconnected", events)
        r = ev.reconnected
        assert r.old_session_id == old_session and r.new_session_id == c.session_id
        assert "gone" in r.lost and f"session {old_session}" in r.lost and r.reason
        assert c.reconnects == 1 and not c.session_ended.is_set()
        # The new session works: pages, tensors over the new mapping, stats.
        (new,) = c.allocate([Spec(3, contiguous=True)])
        new.tensor().fill_(7)
        assert int(new.tensor()[-1]) == 7
        assert c.stats().sessions == 1
        # Objects of the old session are refused by name, not sent to the new broker.
        with pytest.raises(BrokerError) as e:
            c.free([old])
        assert e.value.code == Code.FAILED_PRECONDITION and "restarted" in str(e.value)
        assert c.free([new]) == (3, 0)
    finally:
        c.close()
        for b in (b1, b2):
            if b is not None:
                b.stop(signal.SIGKILL)


def test_a_call_during_a_restart_waits_for_the_new_session():
    sock = os.path.join(short_tmpdir(), "b.sock")
    b1 = start_broker(socket=sock)
    started: list = []
    c = BrokerClient.connect(sock, timeout=30)
    try:
        b1.stop(signal.SIGKILL)
        assert c.session_ended.wait(10)
        threading.Timer(0.5, lambda: started.append(start_broker(socket=sock))).start()
        st = c.stats()  # blocks until the new broker answers on a new session
        assert st.sessions == 1 and c.reconnects == 1
    finally:
        c.close()
        assert _wait_for(lambda: started, 30)
        started[0].stop(signal.SIGKILL)


def test_a_client_that_does_not_reconnect_says_so_without_transport_text():
    sock = os.path.join(short_tmpdir(), "b.sock")
    b = start_broker(socket=sock)
    c = BrokerClient.connect(sock, reconnect_s=0, timeout=2)
    try:
        b.stop(signal.SIGKILL)
        assert c.session_ended.wait(10)
        with pytest.raises(BrokerError) as e:
            c.allocate([Spec(1)])
        text = str(e.value)
        assert e.value.code == Code.UNAVAILABLE and text.startswith("UNAVAILABLE: ")
        assert "connect again" in text and not any(w in text for w in TRANSPORT_WORDS)
    finally:
        c.close()


def test_broker_refusals_keep_the_brokers_message_behind_the_status():
    sock = os.path.join(short_tmpdir(), "b.sock")
    b = start_broker(socket=sock)
    try:
        with BrokerClient.connect(sock) as c:
            with pytest.raises(BrokerError) as e:
                c.unpin([123456])
            assert e.value.code == Code.NOT_FOUND
            assert str(e.value) == f"NOT_FOUND: {e.value.message}" and "123456" in e.value.message
    finally:
        b.stop()


def test_close_during_reconnect_stops_trying():
    sock = os.path.join(short_tmpdir(), "b.sock")
    b = start_broker(socket=sock)
    c = BrokerClient.connect(sock, timeout=2)
    b.stop(signal.SIGKILL)
    assert c.session_ended.wait(10)
    c.close()
    c._events.join(5)
    assert not c._events.is_alive()
    with pytest.raises(BrokerError) as e:
        c.stats()
    assert e.value.code == Code.FAILED_PRECONDITION and "closed" in str(e.value)
