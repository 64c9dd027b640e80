"""Helpers that start and fill a broker for tests, shared with the benchmarks in ops/bench/
(which put tests/ on sys.path to import them; a test never imports a benchmark).

* ``write_adapter``: a tiny PEFT LoRA directory, written with numpy (no torch, no PEFT).
* ``inprocess_broker``: a broker served by a thread of this process, so its step channel's
  frame handler can be called directly.
* ``fill``, ``wrong``, ``churn_once``: objects written and checked through their own tensors.
* ``recv_exact``: whole replies read from a raw step-channel socket.
* ``encode_objects``: a lookup's or pin's reply record from ``ObjectRecord``s (what the broker's
  ``encode_allocations`` writes from its objects).
"""

from __future__ import annotations

import os

import numpy as np


def encode_objects(kind: int, objs) -> bytes:
    """An OP_PIN or OP_LOOKUP result record of ``step.ObjectRecord``s."""
    import struct

    from memory_broker.proto.wire import step as w

    parts = [w._OBJS_HEAD.pack(kind, len(objs))]
    for o in objs:
        flags = (w.OBJ_OWNED if o.owned else 0) | (w.OBJ_DEDUP if o.deduplicated else 0)
        head = (o.object_id, o.window_page, o.state, o.content_type, flags, o.session_pins, o.total_pins)
        parts.append(w._OBJ_HEAD.pack(*head, len(o.pages)) + struct.pack("<%dI" % len(o.pages), *o.pages))
        parts.append(w._U16.pack(len(o.key)) + o.key)
    return b"".join(parts)


def write_adapter(path: str, seed: int, rank: int = 4) -> str:
    """A tiny PEFT LoRA directory (rank 4 unless said, hidden 64, one layer, q/v)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    t = {}
    for m in ("q_proj", "v_proj"):
        k = f"base_model.model.model.layers.0.self_attn.{m}"
        t[f"{k}.lora_A.weight"] = (rng.standard_normal((rank, 64)) * 0.02).astype(np.float16)
        t[f"{k}.lora_B.weight"] = (rng.standard_normal((64, rank)) * 0.02).astype(np.float16)
    save_file(t, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write(f'{{"peft_type": "LORA", "r": {rank}, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}')
    return path


def inprocess_broker(d: str, sock: str) -> dict:
    """A broker (host arena, 512 KiB pages) served by a thread of this process, so the
    step channel's frame handler can be called directly: {"server", "loop", "thread"}."""
    import asyncio
    import threading

    from memory_broker.broker.cli import build_parser
    from memory_broker.broker.server.app import BrokerServer
    from memory_broker.broker.server.config import build_options
    from memory_broker.broker.server.flags import flag_overrides
    from memory_broker.broker.server.logs import configure

    argv = ["serve", "--socket", sock, "--arena", "host", "--pool-size", "8GiB", "--page-size", "512KiB"]
    argv += ["--slab-size", "256MiB", "--state-dir", os.path.join(d, "state-items"), "--log-level", "warning"]
    opts = build_options(None, flag_overrides(build_parser().parse_args(argv)))
    log = configure("warning")
    box: dict = {}
    ready = threading.Event()

    async def serve() -> None:
        server = BrokerServer(opts, log)
        await server.start()
        box["server"], box["loop"] = server, asyncio.get_running_loop()
        ready.set()
        await server.wait()

    def run() -> None:
        with asyncio.Runner() as runner:
            runner.run(serve())

    box["thread"] = t = threading.Thread(target=run, name="inprocess-broker", daemon=True)
    t.start()
    if not ready.wait(60):
        raise SystemExit("the in-process broker did not start")
    return box


def fill(obj, value: int) -> None:
    """Write ``value`` over a broker object through its own tensor (the window, for a
    contiguous one; its page tensors otherwise)."""
    if obj.window_page >= 0:
        obj.tensor().view(-1).fill_(value)
    else:
        for p in obj.page_tensors():
            p.fill_(value)


def wrong(obj, value: int) -> bool:
    """Whether the object's pages, read through the physical view, hold anything but ``value``
    (one byte in 4 KiB: a page another object's window reached differs throughout)."""
    return any(bool((p.view(-1)[::4096] != value).any()) for p in obj.page_tensors())


def churn_once(rng, clients, live: list, most_live: int):
    """One operation of two sessions' churn (test_windows, soak_windows): free a random live
    ``(client, object, byte)`` (always once ``most_live`` are live), or allocate 1-4 pages,
    contiguous or paged, in a random session. Returns ``(client, object)`` allocated, or None:
    freed, or the pool or window space was full (BrokerError)."""
    from memory_broker.clients import BrokerError, Spec

    if live and (rng.random() < 0.5 or len(live) >= most_live):
        c, obj, _ = live.pop(rng.randrange(len(live)))
        c.free([obj])
        return None
    c = rng.choice(clients)
    try:
        (obj,) = c.allocate([Spec(rng.choice((1, 2, 3, 4)), contiguous=rng.random() < 0.5)])
    except BrokerError:
        return None
    return c, obj


def recv_exact(s, n: int) -> bytes:
    """``n`` bytes from a blocking socket (ConnectionError if it closes first)."""
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return out
