#!/usr/bin/env python3
"""The service's fixed cost per call, without the transport (issue 13).

Runs a broker in this process (host arena), opens a session, and calls the servicer's Pin and
Unpin handlers directly with a minimal context object: what remains is the handler's own
work (draining check, policy, session lookup, log context, metrics, debug log) plus the core's
pin and unpin, which are timed alone in the same run. Prints medians of chunks.

    python ops/bench/bench_rpc_overhead.py [--chunks 30] [--per-chunk 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from memory_broker.broker.server.app import BrokerServer
from memory_broker.broker.server.logs import configure
from memory_broker.broker.server.options import ServeOptions
from memory_broker.broker.sessions.peer import PeerCred
from memory_broker.broker.store.objects import Spec
from memory_broker.proto.wire.session import session_metadata
from memory_broker.proto.wire.v1 import broker_pb2 as pb


class Context:
    """What a handler reads from grpc's context on the success path."""

    def __init__(self, token: str, key: str):
        self._md = session_metadata(token, key)

    def invocation_metadata(self):
        return self._md

    def peer(self):
        return "unix:"

    async def abort(self, code, message):
        raise RuntimeError(f"{code}: {message}")


async def run(chunks: int, per_chunk: int) -> None:
    d = tempfile.mkdtemp(prefix="mb-ovh-", dir="/tmp")
    opts = ServeOptions(
        socket=os.path.join(d, "b.sock"),
        arena="host",
        pool_size=256 << 20,
        slab_size=64 << 20,
        state_dir=os.path.join(d, "state"),
    )

    srv = BrokerServer(opts, configure("info", "json", open(os.devnull, "w")))
    await srv.start()
    try:
        s = srv.sessions.open("bench", os.getpid())
        ((obj, _),) = srv.store.allocate(s.session_id, [Spec(1, key=b"k")])
        # Proven as the fd channel proves it: this process owns the session and has its key.
        key = srv.sessions.authorize_fd_request(s.token, PeerCred(os.getpid(), os.getuid(), os.getgid()))
        ctx = Context(s.token, key)
        svc = srv.service
        pin = pb.PinRequest(object_ids=[obj.object_id])
        unpin = pb.UnpinRequest(object_ids=[obj.object_id])
        ids = [obj.object_id]

        async def rpc(n):
            for _ in range(n):
                await svc.Pin(pin, ctx)
                await svc.Unpin(unpin, ctx)

        def core(n):
            p, u, sid = srv.store.pin, srv.store.unpin, s.session_id
            for _ in range(n):
                p(sid, ids)
                u(sid, ids)

        def responses(n):
            info, sid = svc._info, s.session_id
            for _ in range(n):
                pb.PinResponse(objects=[info(obj, sid)])
                pb.UnpinResponse()

        rows = {"core pin + unpin": [], "servicer Pin + Unpin (no transport)": [], "their two response messages": []}
        for _ in range(chunks):
            t0 = time.perf_counter_ns()
            core(per_chunk)
            rows["core pin + unpin"].append((time.perf_counter_ns() - t0) / per_chunk / 1e3)
            t0 = time.perf_counter_ns()
            await rpc(per_chunk)
            rows["servicer Pin + Unpin (no transport)"].append((time.perf_counter_ns() - t0) / per_chunk / 1e3)
            t0 = time.perf_counter_ns()
            responses(per_chunk)
            rows["their two response messages"].append((time.perf_counter_ns() - t0) / per_chunk / 1e3)
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"{'call':<40} {'median us':>10}")
        for k, v in med.items():
            print(f"{k:<40} {v:10.2f}")
        fixed = (med["servicer Pin + Unpin (no transport)"] - med["core pin + unpin"]) / 2
        print(f"{'fixed cost per call (handler - core) / 2':<40} {fixed:10.2f}")
        bare = fixed - med["their two response messages"] / 2
        print(f"{'  of which not the response message':<40} {bare:10.2f}")
    finally:
        await srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=30)
    ap.add_argument("--per-chunk", type=int, default=2000)
    a = ap.parse_args()
    asyncio.run(run(a.chunks, a.per_chunk))


if __name__ == "__main__":
    main()
