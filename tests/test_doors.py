"""One access policy for both front doors: every op the step channel serves is refused exactly
as the gRPC call it stands for is, because both doors call the same
``SessionManager.authorize`` with the rule of the RPC (``POLICY``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import step_frames as frames

from memory_broker.broker.doors.policy import POLICY
from memory_broker.broker.doors.step_ops import METHODS, RULES
from memory_broker.broker.sessions.manager import SessionManager
from memory_broker.clients import BrokerClient, BrokerError, Code, Spec
from memory_broker.proto.wire import step as w

# ------------------------------------------------------------------ live: both doors


def _refusal(c: BrokerClient, act) -> tuple[Code, str]:
    with pytest.raises(BrokerError) as e:
        act(c)
    # The same refusal names the caller's own session: compare it as "session S".
    return e.value.code, e.value.message.replace(f"session {c.session_id} ", "session S ")


def test_every_step_op_is_refused_as_its_grpc_call_is(step_rig):
    b, setup = step_rig
    anon = setup.allocate([Spec(1)])[0]  # another session's anonymous object
    cases = {
        # op: what the client does (over the step channel when fast_path is on)
        w.OP_PIN: lambda c: c.pin([anon.object_id]),
        w.OP_UNPIN: lambda c: c.unpin([anon.object_id]),
        w.OP_LOOKUP: lambda c: c.lookup([b"k" * 2000]),
        w.OP_RELEASE: lambda c: c.release_adapters(["a0"]),
        w.OP_RELEASE_IN: lambda c: c.release_adapters(["a0"], dtype="float32"),
        w.OP_COMMIT: lambda c: c.commit_acquire(12345),
        w.OP_ABORT: lambda c: c.abort_acquire(12345),
        w.OP_ACQUIRE: lambda c: c.acquire_adapters(["no-such"]),
    }
    assert set(cases) == set(METHODS), "a step op without a parity case"
    with BrokerClient.connect(b.socket) as fast, BrokerClient.connect(b.socket, fast_path=False) as slow:
        for op, act in cases.items():
            n = frames(fast)
            over_step = _refusal(fast, act)
            assert frames(fast) > n, f"{w.OP_NAMES[op]} did not go over the step channel"
            over_grpc = _refusal(slow, act)
            if op in (w.OP_COMMIT, w.OP_ABORT):
                # gRPC commits an adapter acquire with the generic Commit (the store's words),
                # the step channel with the adapter manager's: the same status, each its text.
                over_step, over_grpc = over_step[0], over_grpc[0]
            assert over_step == over_grpc, f"{w.OP_NAMES[op]}: step {over_step} != gRPC {over_grpc}"
        assert fast.stats().pinned_pages == slow.stats().pinned_pages == 0
    setup.free([anon])


def test_a_pin_the_owner_may_make_is_served_at_both_doors(step_rig):
    b, setup = step_rig
    with BrokerClient.connect(b.socket) as fast, BrokerClient.connect(b.socket, fast_path=False) as slow:
        for c in (fast, slow):
            (mine,) = c.allocate([Spec(1)])
            (pinned,) = c.pin([mine])
            assert pinned.session_pins == 1
            c.unpin([mine])
            c.free([mine])


# ------------------------------------------------------------------ the policy itself


@dataclass
class _Caller:
    uid: int
    pid: int = 1234


KEY = "k" * 32


@dataclass
class _Session:
    session_id: int
    closed: bool = False
    caller: _Caller | None = None
    key: str = KEY


class _Store:
    def __init__(self):
        self.asked: list[tuple[int, list[int]]] = []

    def check_visible(self, session_id, ids):
        self.asked.append((session_id, list(ids)))
        if 666 in ids:
            raise BrokerError(Code.NOT_FOUND, "no object 666")


def _policy(store=None, manager_uids=None) -> SessionManager:
    p = SessionManager(store or _Store(), None)
    if manager_uids is not None:
        p.manager_uids = manager_uids
    return p


def test_the_step_channel_authorizes_each_op_with_its_rpcs_rule():
    assert set(RULES) == set(METHODS) and all(RULES[op] is POLICY[m] for op, m in METHODS.items())


def test_a_draining_broker_refuses_every_method_unavailable():
    p = _policy()
    p.draining = True
    for method, rule in POLICY.items():
        with pytest.raises(BrokerError) as e:
            p.authorize(method, rule, _Session(1, caller=_Caller(0)))
        assert e.value.code == Code.UNAVAILABLE, method
    with pytest.raises(BrokerError) as e:
        p.check_session(_Session(1), "a step")
    assert e.value.code == Code.UNAVAILABLE


def test_session_methods_refuse_no_session_and_an_ended_one():
    p = _policy()
    for method, rule in POLICY.items():
        if not rule.session:
            p.authorize(method, rule, None)  # sessionless calls need none
            continue
        for s in (None, _Session(3, closed=True)):
            with pytest.raises(BrokerError) as e:
                p.authorize(method, rule, s)
            assert e.value.code == Code.PERMISSION_DENIED, method


def test_managing_adapters_needs_a_proven_uid_in_manager_uids():
    p = _policy(manager_uids=frozenset({7}))
    manage = [m for m, r in POLICY.items() if r.manage]
    assert manage
    for m in manage:
        for s in (_Session(1), _Session(1, caller=_Caller(8))):
            with pytest.raises(BrokerError) as e:
                p.authorize(m, POLICY[m], s, key=KEY)
            assert e.value.code == Code.PERMISSION_DENIED and m in e.value.message or "manager_uids" in e.value.message
        p.authorize(m, POLICY[m], _Session(1, caller=_Caller(7)), key=KEY)


def test_every_session_method_needs_a_proven_session_and_its_key():
    p = _policy()
    for method, rule in POLICY.items():
        if not rule.session:
            continue
        for s, key, words in (
            (_Session(1), KEY, "not proven"),  # no process presented the token on the fd channel
            (_Session(1, caller=_Caller(0)), None, "key"),  # a token alone
            (_Session(1, caller=_Caller(0)), "x" * 32, "key"),  # a wrong key
            (_Session(1, caller=_Caller(0)), "é" * 32, "key"),  # not even ASCII
        ):
            with pytest.raises(BrokerError) as e:
                p.authorize(method, rule, s, key=key)
            assert e.value.code == Code.PERMISSION_DENIED and words in e.value.message, (method, e.value.message)
        if not rule.manage and not rule.visible:
            p.authorize(method, rule, _Session(1, caller=_Caller(0)), key=KEY)


def test_an_owner_uid_no_longer_allowed_is_refused_on_every_session_method():
    p = _policy()
    p.allowed_uids = frozenset({5})
    for method, rule in POLICY.items():
        if rule.session:
            with pytest.raises(BrokerError) as e:
                p.authorize(method, rule, _Session(1, caller=_Caller(6)), key=KEY)
            assert e.value.code == Code.PERMISSION_DENIED and "allowed_uids" in e.value.message, method


def test_visible_fields_are_asked_of_the_store_and_its_refusal_passes_through():
    store = _Store()
    p = _policy(store)
    fields = {"object_ids": [1, 666], "pin_object_ids": [666]}
    for method, rule in POLICY.items():
        if not rule.visible:
            continue
        with pytest.raises(BrokerError) as e:
            p.authorize(method, rule, _Session(5, caller=_Caller(0)), lambda f: fields[f], key=KEY)
        assert e.value.code == Code.NOT_FOUND
    assert store.asked and all(sid == 5 for sid, _ in store.asked)
    # The step channel names its PIN items as PinRequest.object_ids.
    from memory_broker.broker.doors.step_ops import op_ids

    assert list(op_ids(w.Op(w.OP_PIN, (4, 5)))("object_ids")) == [4, 5]
    assert list(op_ids(w.Op(w.OP_UNPIN, (4,)))("object_ids")) == []
