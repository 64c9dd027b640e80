"""The KV connector's scheduler half (clients/vllm/kv_scheduler.py) against a fake broker that
counts calls: a request whose prefix vLLM's own cache holds costs one lookup and no pins; a
cross-engine hit pins only the blocks it will load. Runs in the vLLM environment's Python
(the module needs vLLM), as a script."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest
from conftest import ROOT

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
        def release(self, inc, objs):
            self.released.append(len(objs))
        def failed(self, c, e, what):
            raise AssertionError(what)

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

    # Another engine: its cache holds 2 blocks, the broker 32: pins blocks 2..31 only.
    c.calls.clear()
    s2 = BrokerKVScheduler(b, fp, BS, 1, BrokerKVStats())
    assert s2.get_num_new_matched_tokens(request("cross"), 2 * BS) == (30 * BS, False)
    assert c.calls == [("lookup", 34, False), ("lookup", 30, True)], c.calls
    st = s2._reqs["cross"]
    assert st.pin_first == 2 and len(st.pinned[0]) == 30
    s2.request_finished(request("cross"), [])
    assert b.released == [30]
    print("OK")
    """
)


def test_a_local_hit_costs_one_lookup_and_no_pins_and_a_cross_hit_pins_what_it_loads():
    r = subprocess.run([VLLM_PY, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-4000:]
