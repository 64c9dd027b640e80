"""Imported at start-up by every process of a ``bench_vllm_kv.py`` engine (its folder is put on
the engines' PYTHONPATH when ``MB_BENCH_VLLM_SPIN_S`` is set): vLLM's shared-memory queues
between the engine core and its worker busy-wait (``sched_yield`` in a loop) for 1 s after
every message before they sleep on a socket (``shm_broadcast.SpinCondition``,
``busy_loop_s=1``, no setting). On a machine where several engines share two cores, an idle
engine that served a request under a second ago takes CPU from the one serving now, so a
request's time depends on which engines ran before it. This sets that time to
``MB_BENCH_VLLM_SPIN_S`` seconds in every engine of every mode. Benchmark-only; the product
never imports it."""

import os

if os.environ.get("MB_BENCH_VLLM_SPIN_S"):
    try:
        from vllm.distributed.device_communicators import shm_broadcast as _shm

        _spin_s = float(os.environ["MB_BENCH_VLLM_SPIN_S"])
        _init = _shm.SpinCondition.__init__

        def _short_spin(self, is_reader, context, notify_address, busy_loop_s=1):  # noqa: ANN001
            _init(self, is_reader, context, notify_address, busy_loop_s=_spin_s)

        _shm.SpinCondition.__init__ = _short_spin
    except Exception as e:  # noqa: BLE001 - a vLLM without it: say so, run unpatched
        print(f"bench_vllm_kv: vLLM's queue spin left at 1 s ({e!r})", file=__import__("sys").stderr)
