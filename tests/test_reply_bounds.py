"""Replies bounded like requests (issue 48, item 2): an op naming one id or key many times is
refused, a frame's or a call's object records are capped before they are encoded, and a step
connection that does not read its replies stops being read instead of holding them."""

from __future__ import annotations

import socket
import time

import pytest
from conftest import step_frames as frames
from test_step_channel import _rss, raw_conn

from memory_broker.clients import BrokerClient, BrokerError, Code
from memory_broker.proto.wire import step as w

pytestmark = pytest.mark.both_cores

FOLD = 65535


def _pinned(c: BrokerClient) -> int:
    return c.stats().pinned_pages


def test_a_pin_naming_one_id_65535_times_is_refused_within_16x_its_request(step_rig):
    b, setup = step_rig
    (k0,) = setup.lookup([b"k0"], pin=False)
    with BrokerClient.connect(b.socket) as c:
        before = _pinned(c)
        s = raw_conn(c, c.token)
        request = w.encode_step([w.Op(w.OP_PIN, (k0.object_id,) * FOLD)])
        s.sendall(request)
        n, kind = w.HEADER.unpack(s.recv(5, socket.MSG_WAITALL))
        assert 5 + n <= 16 * len(request)
        r = w.decode_step_reply(kind, s.recv(n, socket.MSG_WAITALL))
        assert kind == w.ERROR and r.error.code == Code.INVALID_ARGUMENT, r.error
        assert f"object_ids[1] repeats {k0.object_id}" in r.error.message
        assert _pinned(c) == before  # nothing pinned
    with BrokerClient.connect(b.socket, fast_path=False) as g:  # the same over gRPC
        with pytest.raises(BrokerError) as e:
            g.pin([k0.object_id] * FOLD)
        assert e.value.code == Code.INVALID_ARGUMENT and f"repeats {k0.object_id}" in e.value.message
        assert _pinned(g) == before


def test_a_lookup_naming_one_key_many_times_is_refused_and_pins_nothing(step_rig):
    b, _ = step_rig
    for fast in (True, False):
        with BrokerClient.connect(b.socket, fast_path=fast) as c:
            before = _pinned(c)
            for keys in ([b"k0"] * 30000, [b"k0", b"k1", b"k0"]):
                with pytest.raises(BrokerError) as e:
                    c.lookup(keys)
                assert e.value.code == Code.INVALID_ARGUMENT and "keys[" in e.value.message, e.value
                assert "repeats b'k0'" in e.value.message
            assert _pinned(c) == before
            assert [o.key for o in c.lookup([b"k0", b"k1"])] == [b"k0", b"k1"]  # distinct keys: served


def test_two_unread_amplifying_frames_hold_at_most_32_mib(step_rig):
    b, setup = step_rig
    (k0,) = setup.lookup([b"k0"], pin=False)
    with BrokerClient.connect(b.socket) as c:
        c.pin([k0])  # warm: the step path is up
        c.unpin([k0])
        idle = _rss(b.proc.pid)
        conns = []
        per_op = (FOLD - 64) // 8  # ids of a few PIN ops: a frame just under MAX_FRAME_BYTES
        pins = [w.Op(w.OP_PIN, (k0.object_id,) * per_op)] * 8
        looks = [w.Op(w.OP_LOOKUP, (b"k0",) * 30000, 1)] * 3
        for ops in (pins, looks, [w.Op(w.OP_LOOKUP, (b"k0", b"k1", b"k2"), 0)] * w.MAX_OPS):
            s = raw_conn(c, c.token)
            frame = w.encode_step(ops)
            assert len(frame) <= w.MAX_FRAME_BYTES
            for _ in range(2):  # sent, never read
                s.sendall(frame)
            conns.append(s)
        time.sleep(1.0)
        grown = _rss(b.proc.pid) - idle
        assert grown <= 32 << 20, f"the broker grew {grown >> 20} MiB"
        # A bystander is served meanwhile.
        n = frames(c)
        assert [o.key for o in c.lookup([b"k1"])] == [b"k1"] and frames(c) == n + 1
        for s in conns:
            s.close()
