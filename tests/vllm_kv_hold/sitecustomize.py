"""Holds the KV connector's saver between its copy and its Commit, for tests/test_vllm_kv_saver.py.

On PYTHONPATH with ``MB_TEST_KV_HOLD`` naming a folder, every process of the engine imports
this: after the saver has prepared a batch and copied it into the broker's pages, it writes
``<folder>/held`` and waits while ``<folder>/hold`` exists; then it commits. A test can so
look at the broker, or kill the engine, between compute and store.
"""

import os
import time

_DIR = os.environ.get("MB_TEST_KV_HOLD")

if _DIR:
    from memory_broker.clients.vllm import kv_saver

    _copy = kv_saver.KVSaver._copy

    def _held_copy(c, batch, objects):
        _copy(c, batch, objects)
        with open(os.path.join(_DIR, "held"), "a") as f:
            f.write(f"{sum(len(s.keys) for s in batch)}\n")
        while os.path.exists(os.path.join(_DIR, "hold")):
            time.sleep(0.05)

    kv_saver.KVSaver._copy = staticmethod(_held_copy)
