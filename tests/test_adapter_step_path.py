"""A step's adapters on the broker (issue 28): the step channel's acquire of hot adapters and
its release take one pass (``AdapterManager.pin_hot`` / ``release_hot``), reply with each
hot object's kept row, and fall back to the full ``acquire`` / ``release`` for everything
else, having done nothing. The step channel's ops are called directly (no socket)."""

from __future__ import annotations

import pytest
from adapter_fixtures import AdapterHarness, peft_dirs, run  # noqa: F401  (peft_dirs is a fixture)

from memory_broker.broker.adapters.config import AdapterConfig
from memory_broker.broker.doors.step_ops import StepOps, _Load
from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.layout import ModuleShard

# Each test runs on the native cores and on their Python fallback (conftest.native_core).
pytestmark = pytest.mark.both_cores

IDS = ["r4", "r8", "r16"]


def _rig(state_dir: str, peft_dirs: dict, **config):
    h = AdapterHarness(state_dir, config=AdapterConfig(dtype="float32", **config))
    for aid in IDS:
        h.registry.register(aid, peft_dirs[aid])
    server = StepOps(loop=None, store=h.store, sessions=None, adapters=h.manager)
    return h, server


def _acquire(server, sid: int, ids, cap: int = 0) -> w.AcquireOutcome:
    body = server.op(sid, w.Op(w.OP_ACQUIRE, tuple(ids), 0, cap))
    return w.decode_step_reply(w.OK, w.encode_step_reply(0, [body])[5:]).results[0]


def _books(h, sid: int) -> tuple:
    c = h.manager.counters
    pins = {aid: h.manager.entries.get(aid).obj.pins.get(sid, 0) for aid in IDS if h.manager.entries.get(aid)}
    return pins, c.acquires, c.acquired_adapters, c.hot_hits, c.hot_misses, h.manager.hot.policy.pending


def _no_full_path(h, monkeypatch):
    async def refuse(*a, **k):
        raise AssertionError("the full acquire ran")

    def refuse_release(*a, **k):
        raise AssertionError("the full release ran")

    monkeypatch.setattr(h.manager.pins, "acquire", refuse)
    monkeypatch.setattr(h.manager.pins, "release", refuse_release)


def test_a_hot_acquire_and_its_release_take_one_pass_and_reply_as_the_full_path(peft_dirs, tmp_path, monkeypatch):
    async def main():
        h, server = _rig(str(tmp_path / "state"), peft_dirs)
        await h.manager.prefetch(IDS, "hot")
        full_sid, sid = h.store.open_session(), h.store.open_session()
        full = await h.manager.acquire(full_sid, IDS)
        expected = w.encode_acquire_rows(
            0, 0.0, [(a.generation, a.object_id, w.TIER_HOT, a.pages) for a in full.adapters]
        )
        hits = h.manager.counters.hot_hits
        with monkeypatch.context() as mp:
            _no_full_path(h, mp)
            for _ in range(2):  # the second reply is joined from the rows kept by the first
                got = server.op(sid, w.Op(w.OP_ACQUIRE, ("r4", "r8", "r4", "r16")))
                assert got == expected
            assert {aid: h.manager.entries.get(aid).obj.pins[sid] for aid in IDS} == dict.fromkeys(IDS, 2)
            assert h.manager.counters.hot_hits == hits + 6
            # Release by id, one listed twice: one pin dropped per listing.
            server.op(sid, w.Op(w.OP_RELEASE, ("r4", "r4", "r8")))
            assert [h.manager.entries.get(a).obj.pins.get(sid, 0) for a in IDS] == [0, 1, 2]
            server.op(sid, w.Op(w.OP_RELEASE, ("r8", "r16", "r16")))
        assert h.store.sessions[sid].pin_total == 0
        h.manager.release(full_sid, IDS)
        await h.close()

    run(main())


def test_what_the_one_pass_does_not_cover_takes_the_full_path_with_nothing_done_first(peft_dirs, tmp_path):
    async def main():
        h, server = _rig(str(tmp_path / "state"), peft_dirs)
        await h.manager.prefetch(["r4", "r8"], "hot")
        sid = h.store.open_session()
        m = h.manager
        before = _books(h, sid)
        # A cold adapter, a copy's key (not an adapter id), a cap that defers.
        assert m.pin_hot(sid, ["r4", "r16"]) is None
        assert m.pin_hot(sid, ["r4#float16"]) is None
        assert m.pin_hot(sid, ["r4", "r8"], 1) is None
        assert _books(h, sid) == before
        # Not hot (a bad id too): the frame waits for the manager's full acquire, which loads
        # or says why (``_Load``: the channel runs it in a task); nothing is done first.
        for ids in (["r4", "r16"], ["r4#float16"]):
            with pytest.raises(_Load):
                _acquire(server, sid, ids)
        assert _books(h, sid) == before
        deferred = _acquire(server, sid, ["r4", "r8"], cap=1)
        assert [a.object_id for a in deferred.adapters] == [m.entries.get("r4").obj.object_id]
        # Release: more than the session holds, an adapter it does not hold.
        assert not m.release_hot(sid, ["r4", "r4"]) and not m.release_hot(sid, ["r8"])
        with pytest.raises(BrokerError) as e:
            server.op(sid, w.Op(w.OP_RELEASE, ("r4", "r4")))
        assert e.value.code == Code.FAILED_PRECONDITION
        assert m.entries.get("r4").obj.pins[sid] == 1
        assert m.release_hot(sid, ["r4"])
        # A hot object the store lost without telling the manager: declined, and the full
        # path notices it (not hot).
        lost = m.entries.get("r8").obj
        h.store.free(m.system_session, [lost.object_id])
        assert m.pin_hot(sid, ["r8"]) is None
        with pytest.raises(_Load):
            _acquire(server, sid, ["r8"])
        assert h.store.sessions[sid].pin_total == 0
        await h.close()

    run(main())


@pytest.mark.parametrize(
    "other",
    [
        {"dtype": "float16"},  # another dtype's copy (``id#float16``)
        # A tensor-parallel rank's copy in the broker's own dtype (``id##shard``): another copy
        # too, not the adapter's own, though its dtype is the broker's.
        {"shards": [ModuleShard("q_proj", False, 0, 2)]},
    ],
    ids=["dtype", "tp-shard"],
)
def test_with_another_copy_hot_release_takes_the_full_path(peft_dirs, tmp_path, other):
    async def main():
        h, server = _rig(str(tmp_path / "state"), peft_dirs)
        await h.manager.prefetch(["r4"], "hot")
        sid = h.store.open_session()
        (copy,) = (await h.manager.acquire(sid, ["r4"], **other)).adapters
        assert h.manager.hot.other_copies == 1 and list(h.manager.hot.own) == ["r4"]
        own = _acquire(server, sid, ["r4"]).adapters[0]
        assert own.object_id != copy.object_id
        assert not h.manager.release_hot(sid, ["r4"])
        server.op(sid, w.Op(w.OP_RELEASE, ("r4", "r4")))  # the full path: both copies
        assert h.store.sessions[sid].pin_total == 0
        await h.close()

    run(main())


def test_a_reloaded_adapter_replies_with_its_new_object_and_generation(peft_dirs, tmp_path):
    async def main():
        h, server = _rig(str(tmp_path / "state"), peft_dirs)
        await h.manager.prefetch(["r4"], "hot")
        sid = h.store.open_session()
        first = _acquire(server, sid, ["r4"]).adapters[0]
        server.op(sid, w.Op(w.OP_RELEASE, ("r4",)))
        h.manager.demote("r4")
        await h.manager.prefetch(["r4"], "hot")
        again = _acquire(server, sid, ["r4"]).adapters[0]
        e = h.manager.entries.get("r4")
        assert (again.generation, again.object_id, list(again.pages)) == (e.generation, e.obj.object_id, e.obj.pages)
        assert again.generation > first.generation and again.object_id != first.object_id
        server.op(sid, w.Op(w.OP_RELEASE, ("r4",)))
        await h.close()

    run(main())


def test_a_pinned_adapter_is_never_the_hot_tiers_victim_after_one_pass_acquires(peft_dirs, tmp_path):
    async def main():
        h, server = _rig(str(tmp_path / "state"), peft_dirs, hot_tier_adapters=2)
        await h.manager.prefetch(["r4", "r8"], "hot")
        sid = h.store.open_session()
        for _ in range(5):  # r8 is used far more: the policy would keep it over r4
            _acquire(server, sid, ["r8"])
            server.op(sid, w.Op(w.OP_RELEASE, ("r8",)))
        _acquire(server, sid, ["r4"])  # r4 pinned
        assert h.manager.hot.policy.pending == 2  # both keys' uses wait, counted
        await h.manager.prefetch(["r16"], "hot")  # room: r8 goes (idle), not the pinned r4
        assert h.manager.describe("r4").tier.value == "hot" and h.manager.describe("r8").tier.value != "hot"
        assert h.manager.hot.policy.pending == 0
        server.op(sid, w.Op(w.OP_RELEASE, ("r4",)))
        await h.close()

    run(main())
