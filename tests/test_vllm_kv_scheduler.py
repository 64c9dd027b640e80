"""The KV connector's scheduler half (clients/vllm/kv_scheduler.py): against a fake broker that
counts calls, a request whose prefix vLLM's own cache holds costs one lookup and no pins and a
cross-engine hit pins only the blocks it will load; against a real broker, a step's lookups,
pins and unpins are one frame each on the step channel, whatever the number of requests.
Runs in the vLLM environment's Python (the module needs vLLM), as scripts."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap

import pytest
from conftest import ROOT, start_broker

VLLM_PY = os.environ.get("MEMORY_BROKER_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")
if not os.path.exists(VLLM_PY):
    if os.environ.get("MEMORY_BROKER_REQUIRE_VLLM"):
        raise RuntimeError(f"the vLLM environment's python {VLLM_PY} is missing: run `make vllm-venv`")
    pytest.skip(f"no vLLM environment at {VLLM_PY} (`make vllm-venv` builds it)", allow_module_level=True)

SCRIPT = textwrap.dedent(
    """
    from types import SimpleNamespace
    from memory_broker.clients.vllm.kv_records import BrokerKVStats
    from memory_broker.clients.vllm.kv_scheduler import BrokerKVScheduler
    from memory_broker.clients.vllm import identity

    class Client:
        def __init__(self, stored):
            self.stored, self.calls = stored, []
        def lookup(self, keys, pin=True):
            self.calls.append(("lookup", len(keys), pin))
            out = []
            for k in keys:
                if k not in self.stored:
                    break
                out.append(SimpleNamespace(key=k, object_id=len(out), pages=[len(out)]))
            return out

    class Broker:
        incarnation = "i1"
        def __init__(self, client):
            self.c, self.released = client, []
        def client(self):
            return self.c
        def hold(self, inc, n):
            pass
        frames = []
        def lookup_many(self, c, key_lists, pin, releases=()):
            self.frames.append(len(key_lists))
            self.released += [len(objs) for _, objs in releases]
            return [self.c.lookup(k, pin) for k in key_lists]
        def failed(self, c, e, what):
            raise AssertionError(what)
        def tiered(self, c):
            return False

    def step_output(*reqs):
        new = [SimpleNamespace(req_id=r, num_computed_tokens=0) for r in reqs]
        cached = SimpleNamespace(req_ids=[], num_computed_tokens=[])
        return SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                               num_scheduled_tokens={r: 1 for r in reqs})

    class Mgr:
        def get_block_ids(self, rid):
            return [list(range(100, 140))]

    BS = 32
    toks = list(range(100, 100 + 34 * BS + 10))  # 34 full blocks and a partial one
    def request(rid):
        return SimpleNamespace(request_id=rid, prompt_token_ids=toks, lora_request=None, mm_features=None,
                               prompt_embeds=None, cache_salt=None)
    fp = b"engine"
    chain = identity.chain_hashes(identity.chain_root(fp, b"", None), toks, BS)
    keys = [identity.block_key(h, 0) for h in chain]

    # The broker holds the first 32 blocks; vLLM's own cache holds them too (a local hit).
    c = Client(set(keys[:32]))
    b = Broker(c)
    s = BrokerKVScheduler(b, fp, BS, 1, BrokerKVStats())
    assert s.get_num_new_matched_tokens(request("local"), 32 * BS) == (0, False)
    assert c.calls == [("lookup", 34, False)], c.calls
    assert b.released == []  # nothing pinned, nothing to unpin

    # Another engine: its cache holds 2 blocks, the broker 32: pins blocks 2..31 only, when
    # the step's metadata is built.
    c.calls.clear()
    s2 = BrokerKVScheduler(b, fp, BS, 1, BrokerKVStats())
    assert s2.get_num_new_matched_tokens(request("cross"), 2 * BS) == (30 * BS, False)
    assert c.calls == [("lookup", 34, False)], c.calls
    s2.update_state_after_alloc(request("cross"), None, 30 * BS)
    meta = s2.build_connector_meta(step_output("cross"), Mgr())
    assert c.calls == [("lookup", 34, False), ("lookup", 30, True)], c.calls
    st = s2._reqs["cross"]
    assert st.pin_first == 2 and len(st.pinned[0]) == 30
    assert meta.loads[0].block_ids == list(range(102, 132)) and meta.loads[0].failed_block_ids == []
    s2.request_finished(request("cross"), [])
    s2._flush()
    assert b.released == [30]

    # 70 requests waiting: the step's first ask looks up 63 of them in one frame, the others'
    # asks read its answers; the 64th's ask takes the rest.
    b.frames.clear()
    s3 = BrokerKVScheduler(b, fp, BS, 1, BrokerKVStats())
    reqs = [request(f"w{i}") for i in range(70)]
    for r in reqs:
        s3.on_new_request(r)
    for r in reqs[:63]:
        s3.get_num_new_matched_tokens(r, 0)
    assert b.frames == [63], b.frames
    for r in reqs[63:]:
        s3.get_num_new_matched_tokens(r, 0)
    assert b.frames == [63, 7], b.frames
    print("OK")
    """
)


def test_a_local_hit_costs_one_lookup_and_no_pins_and_a_cross_hit_pins_what_it_loads():
    r = subprocess.run([VLLM_PY, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-4000:]


TIER_SCRIPT = SCRIPT.split("    # The broker holds the first 32 blocks")[0] + textwrap.dedent(
    """
    from memory_broker.clients.vllm import kv_scheduler

    kv_scheduler.TIER_POLL_S = 0

    class TierClient(Client):
        # The broker holds ``stored``; its tier answers ``tier`` for the rest (-1 asking, n > 0
        # reading n in, 0 none), as BrokerClient.probe_tier does.
        tier = -1
        def probe_tier(self, keys):
            self.calls.append(("probe", len(keys)))
            n = len(self.lookup(keys, False))
            return n, (self.tier if n < len(keys) else 0)

    class TierBroker(Broker):
        def tiered(self, c):
            return True

    def chain_of(rid, k):
        t = [1000 * k + i for i in range(10 * BS + 5)]  # 10 full blocks and a partial one
        r = SimpleNamespace(request_id=rid, prompt_token_ids=t, lora_request=None, mm_features=None,
                            prompt_embeds=None, cache_salt=None)
        return r, [identity.block_key(h, 0) for h in identity.chain_hashes(identity.chain_root(fp), t, BS)]

    c = TierClient(set())
    stats = BrokerKVStats()
    s = BrokerKVScheduler(TierBroker(c), fp, BS, 1, stats)
    r, keys = chain_of("r", 1)
    # While the broker asks its tier, vLLM is told to ask again (the step goes on without it).
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert s.build_connector_meta(step_output(), Mgr()).loads == []
    # The tier holds the chain: an asynchronous external hit of every loadable block.
    c.tier = 10
    assert s.get_num_new_matched_tokens(r, 0) == (10 * BS, True)
    s.update_state_after_alloc(r, None, 10 * BS)
    assert s.build_connector_meta(step_output(), Mgr()).loads == []  # not in the broker yet
    c.stored |= set(keys)
    lr = s.build_connector_meta(step_output(), Mgr()).loads[0]
    assert lr.tier and lr.block_ids == list(range(100, 110)) and lr.failed_block_ids == [], lr
    assert stats.data["tier_hit_tokens"] == 10 * BS and stats.data["hit_tokens"] == 10 * BS

    # A read that stops short (4 blocks came in, the tier has no more): the rest is recomputed.
    c.tier = 10
    r2, keys2 = chain_of("r2", 2)
    assert s.get_num_new_matched_tokens(r2, 0) == (10 * BS, True)
    s.update_state_after_alloc(r2, None, 10 * BS)
    c.stored |= set(keys2[:4])
    c.tier = 0
    lr = s.build_connector_meta(step_output(), Mgr()).loads[0]
    assert lr.tier and lr.block_ids == list(range(100, 104)) and lr.failed_block_ids == list(range(104, 110))

    # Finished while waiting: the workers report it received, with nothing loaded.
    c.tier = 10
    r3, _ = chain_of("r3", 3)
    assert s.get_num_new_matched_tokens(r3, 0) == (10 * BS, True)
    s.update_state_after_alloc(r3, None, 10 * BS)
    s.request_finished(r3, [])
    (lr,) = s.build_connector_meta(step_output(), Mgr()).loads
    assert (lr.req_id, lr.tier, lr.block_ids, lr.failed_block_ids) == ("r3", True, [], [])

    # A tier that never answers: past TIER_WAIT_S the request is computed, and not asked again.
    kv_scheduler.TIER_WAIT_S = 0.05
    c.tier = -1
    r4, _ = chain_of("r4", 4)
    assert s.get_num_new_matched_tokens(r4, 0) == (None, False)
    time.sleep(0.06)
    assert s.get_num_new_matched_tokens(r4, 0) == (0, False)
    c.calls.clear()
    assert s.get_num_new_matched_tokens(r4, 0) == (0, False)
    assert not [x for x in c.calls if x[0] == "probe"], c.calls

    # A broker without a tier is never asked about one.
    c2 = TierClient(set())
    s5 = BrokerKVScheduler(Broker(c2), fp, BS, 1, BrokerKVStats())
    assert s5.get_num_new_matched_tokens(chain_of("r5", 5)[0], 0) == (0, False)
    assert c2.calls == [("lookup", 10, False)], c2.calls
    print("OK")
    """
)


def test_a_chain_in_the_brokers_tier_is_an_asynchronous_load_that_waits_only_on_its_request():
    r = subprocess.run(
        [VLLM_PY, "-c", "import time\n" + TIER_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-4000:]


# A step of 8 new requests on a real broker: 4 whose prefix vLLM's own cache holds (local
# hits) and 4 that load theirs from the broker, one of which lost blocks to eviction between
# the step's lookup and its pins.
STEP_SCRIPT = textwrap.dedent(
    """
    import sys
    from types import SimpleNamespace
    from memory_broker.clients.vllm import identity, store
    from memory_broker.clients.vllm.kv_records import BrokerKVStats, BrokerKVWorkerMetadata
    from memory_broker.clients.vllm.kv_scheduler import BrokerKVScheduler

    BS, NB = 32, 6  # 6 full blocks a prompt, and a partial one
    fp = b"engine"
    b = store.BrokerKV(sys.argv[1], client_name="sched")
    w = store.BrokerKV(sys.argv[1], client_name="writer")
    c, wc = b.client(), w.client()
    reqs, objs = [], {}
    for i in range(8):
        toks = [1000 * i + t for t in range(NB * BS + 5)]
        rid = f"r{i}"
        reqs.append(SimpleNamespace(request_id=rid, prompt_token_ids=toks, lora_request=None, mm_features=None,
                                    prompt_embeds=None, cache_salt=None))
        keys = [identity.block_key(h, 0) for h in identity.chain_hashes(identity.chain_root(fp), toks, BS)]
        objs[rid] = wc.prepare(store.kv_specs(keys, 4096, wc.geometry.page_size)).commit()
    s = BrokerKVScheduler(b, fp, BS, 1, BrokerKVStats())
    for r in reqs:
        s.on_new_request(r)
    frames = lambda: c._step_path().frames
    f0 = frames()
    local = {f"r{i}" for i in range(4)}
    for r in reqs:
        got = s.get_num_new_matched_tokens(r, NB * BS if r.request_id in local else 0)
        assert got == (0 if r.request_id in local else NB * BS, False), (r.request_id, got)
        if r.request_id == "r7":
            wc.free(objs["r7"][3:])  # evicted before the step pins what it loads
        s.update_state_after_alloc(r, None, got[0])
    lookup_frames = frames() - f0
    new = [SimpleNamespace(req_id=r.request_id, num_computed_tokens=0) for r in reqs]
    out = SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                          num_scheduled_tokens={r.request_id: 1 for r in reqs})
    mgr = SimpleNamespace(get_block_ids=lambda rid: [list(range(10 * int(rid[1:]), 10 * int(rid[1:]) + NB + 1))])
    meta = s.build_connector_meta(out, mgr)
    pin_frames = frames() - f0 - lookup_frames
    loads = {lr.req_id: lr for lr in meta.loads}
    assert sorted(loads) == ["r4", "r5", "r6", "r7"], sorted(loads)
    assert [len(loads[r].block_ids) for r in ("r4", "r5", "r6", "r7")] == [6, 6, 6, 3]
    assert loads["r7"].failed_block_ids == [73, 74, 75] and loads["r4"].failed_block_ids == []
    assert all(len(lr.objects) == len(lr.block_ids) for lr in meta.loads)
    held = b._holds[b.incarnation]
    s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=BrokerKVWorkerMetadata(loaded=set(loads))))
    unpin_frames = frames() - f0 - lookup_frames - pin_frames
    # The pins went: the writer frees what is left and nothing stays behind.
    pins_left = sum(o.session_pins for o in c.lookup([o.key for o in objs["r4"]], pin=False))
    print("RESULT", lookup_frames, pin_frames, unpin_frames, held, b._holds[b.incarnation], pins_left)
    """
)


@pytest.fixture(scope="module")
def broker():
    b = start_broker("--pool-size", "32MiB")
    yield b
    b.stop(signal.SIGKILL)


def test_a_steps_lookups_pins_and_unpins_are_one_frame_each(broker):
    r = subprocess.run(
        [VLLM_PY, "-c", STEP_SCRIPT, broker.socket], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0 and "RESULT" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    lookups, pins, unpins, held, held_after, pins_left = map(int, r.stdout.split("RESULT")[1].split())
    # 8 requests: one frame of lookups, one of pins (4 loads), one of unpins (was 8 + 4 + 4).
    assert (lookups, pins, unpins) == (1, 1, 1)
    assert held == 6 + 6 + 6 + 3 and held_after == 0 and pins_left == 0
