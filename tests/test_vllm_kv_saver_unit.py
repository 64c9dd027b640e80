"""KVSaver (clients/vllm/kv_saver.py) against a fake broker: steps staged while a batch is in
flight go in one Prepare and one Commit, each block's bytes land in its own object's pages,
the staging limit refuses a step whole, a key staged twice is staged once, and a refused
Prepare stores nothing and counts the blocks skipped."""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import torch

from memory_broker.clients.vllm.kv_saver import KVSaver, Staged
from memory_broker.proto.wire.errors import BrokerError, Code

PAGE = 64


class Stats:
    def __init__(self):
        self.data = Counter()

    def add(self, name, n=1):
        self.data[name] += n


class Client:
    def __init__(self, pages=64):
        self.geometry = SimpleNamespace(page_size=PAGE)
        self.phys = torch.zeros(pages * PAGE, dtype=torch.uint8)
        self.prepares, self.commits, self.next_page = [], [], pages - 1
        self.gate = threading.Event()
        self.gate.set()
        self.refuse = False

    def physical_view(self):
        return self.phys

    def prepare(self, specs):
        self.gate.wait(10)
        if self.refuse:
            raise BrokerError(Code.RESOURCE_EXHAUSTED, "full")
        self.prepares.append([s.key for s in specs])
        objs = []
        for s in specs:  # pages handed out from the top down: never the staging order
            pages = list(range(self.next_page, self.next_page - s.num_pages, -1))
            self.next_page -= s.num_pages
            objs.append(SimpleNamespace(key=s.key, pages=pages, deduplicated=False))
        client = self

        class Txn:
            objects = objs

            def commit(self):
                client.commits.append([o.key for o in objs])
                return objs

            def abort(self):
                return 0

        return Txn()


class Broker:
    timeout_s = 5.0

    def __init__(self, client):
        self.c, self.failures = client, []

    def client(self):
        return self.c

    def failed(self, c, e, what):
        self.failures.append(what)


def _staged(saver: KVSaver, keys: list[bytes], fill: int, per_block: int = 2) -> Staged | None:
    fresh = saver.reserve(keys, per_block * PAGE)
    if not fresh:
        return None
    buf = saver.buffer(len(fresh) * per_block * PAGE, torch.device("cpu"))
    for j, _ in enumerate(fresh):
        buf[j * per_block * PAGE : (j + 1) * per_block * PAGE] = fill + j
    return Staged([keys[i] for i in fresh], buf, PAGE, per_block)


def test_steps_waiting_while_a_batch_is_stored_go_in_one_prepare_and_land_in_their_pages():
    c = Client()
    saver = KVSaver(Broker(c), Stats(), 1 << 20)
    c.gate.clear()  # the first batch's Prepare waits
    saver.submit(_staged(saver, [b"a"], 10))
    for _ in range(100):
        if saver._busy:
            break
        threading.Event().wait(0.01)
    saver.submit(_staged(saver, [b"b", b"c"], 20))
    saver.submit(_staged(saver, [b"d"], 30))
    c.gate.set()
    assert saver.drain(10)
    assert c.prepares == [[b"a"], [b"b", b"c", b"d"]] and c.commits == c.prepares
    assert saver.stats.data["stored_blocks"] == 4
    # Each object's two pages hold its block's bytes (a: 10, b: 20, c: 21, d: 30).
    pages = c.phys.view(-1, PAGE)
    want = {63: 10, 62: 10, 61: 20, 60: 20, 59: 21, 58: 21, 57: 30, 56: 30}
    assert {p: int(pages[p].unique().item()) for p in want} == want
    saver.close(5)


def test_the_staging_limit_refuses_a_step_whole_and_a_pending_key_is_staged_once():
    c = Client()
    saver = KVSaver(Broker(c), Stats(), 4 * 2 * PAGE)  # four blocks of two pages
    c.gate.clear()
    saver.submit(_staged(saver, [b"a", b"b", b"c"], 1))
    assert saver.reserve([b"x", b"y"], 2 * PAGE) is None  # 5 blocks > 4: nothing reserved
    assert saver.reserve([b"a", b"b"], 2 * PAGE) == []  # staged already, not committed yet
    assert saver.reserve([b"b", b"z"], 2 * PAGE) == [1]
    saver.release([b"z"], 2 * PAGE)
    c.gate.set()
    assert saver.drain(10)
    assert c.commits == [[b"a", b"b", b"c"]]
    # Committed: the keys may be staged again, and the buffer is kept for the next step.
    assert saver.reserve([b"a"], 2 * PAGE) == [0]
    assert saver._spare and saver.buffer(2 * PAGE, torch.device("cpu"))._base is not None
    saver.close(5)


def test_a_refused_prepare_stores_nothing_and_counts_the_blocks_skipped():
    c = Client()
    c.refuse = True
    broker = Broker(c)
    saver = KVSaver(broker, Stats(), 1 << 20)
    saver.submit(_staged(saver, [b"a", b"b"], 1))
    assert saver.drain(10)
    assert c.commits == [] and broker.failures == ["prepare"]
    assert saver.stats.data["store_skipped_blocks"] == 2 and saver.stats.data["broker_errors"] == 1
    assert saver._bytes <= saver.limit_bytes and not saver._pending
    saver.close(5)
