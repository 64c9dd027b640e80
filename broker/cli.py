"""The ``memory-broker`` command: ``serve`` runs the daemon, ``status`` shows a person the pool."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from broker.server.options import DEFAULT_SOCKET, ServeOptions, format_size, parse_size


def _serve_parser(sub) -> None:
    d = ServeOptions()
    p = sub.add_parser("serve", help="run the broker in the foreground")
    p.add_argument("--socket", default=d.socket, help=f"gRPC Unix socket (default {d.socket}); the fd channel is SOCKET.fds")
    p.add_argument("--tcp-port", type=int, default=0, help="also serve gRPC on 127.0.0.1:PORT")
    p.add_argument("--arena", choices=("auto", "host", "cuda"), default=d.arena, help="arena backend (default auto)")
    p.add_argument("--pool-size", default="1GiB", help="most memory the arena may hold (default 1GiB)")
    p.add_argument("--preallocate", default="0", help="memory to create at start (default 0: grow on demand)")
    p.add_argument("--page-size", default="2MiB", help="page size, 512KiB..4MiB (default 2MiB)")
    p.add_argument("--slab-size", default="64MiB", help="slab (growth unit) size (default 64MiB)")
    p.add_argument("--window-factor", type=int, default=d.window_factor, help="virtual window / pool size (default 4)")
    p.add_argument("--placement", choices=("best_fit", "first_fit"), default=d.placement)
    p.add_argument("--eviction-policy", default=d.eviction_policy, help="lru_size_aware (default) or lru")
    p.add_argument("--high-watermark", type=float, default=d.high_watermark)
    p.add_argument("--low-watermark", type=float, default=d.low_watermark)
    p.add_argument("--lease", type=float, default=d.default_lease_s, help="default transaction lease, seconds")
    p.add_argument("--state-dir", default=d.state_dir, help=f"persistent state (default {d.state_dir})")
    p.add_argument(
        "--allow-uid", type=int, action="append", default=[], help="uid allowed on the fd channel (repeat; default: own uid)"
    )
    p.add_argument("--enable-echo", action="store_true", help="serve the bare Echo service (benchmarks)")
    p.add_argument("--grace", type=float, default=d.grace_s, help="seconds SIGTERM waits for in-flight calls")
    p.add_argument("--log-level", default=d.log_level)


def _status_parser(sub) -> None:
    p = sub.add_parser("status", help="print the pool's state")
    p.add_argument("--socket", default=DEFAULT_SOCKET)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=5.0)


def _options(a: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        socket=a.socket,
        tcp_port=a.tcp_port,
        arena=a.arena,
        pool_size=parse_size(a.pool_size, "--pool-size"),
        preallocate=parse_size(a.preallocate, "--preallocate"),
        page_size=parse_size(a.page_size, "--page-size"),
        slab_size=parse_size(a.slab_size, "--slab-size"),
        window_factor=a.window_factor,
        placement=a.placement,
        eviction_policy=a.eviction_policy,
        high_watermark=a.high_watermark,
        low_watermark=a.low_watermark,
        default_lease_s=a.lease,
        state_dir=a.state_dir,
        allowed_uids=tuple(a.allow_uid),
        enable_echo=a.enable_echo,
        grace_s=a.grace,
        log_level=a.log_level,
    )


def cmd_serve(a: argparse.Namespace) -> int:
    from broker.server.app import serve
    from broker.server.lock import SocketPathLocked
    from broker.server.logs import configure

    try:
        opts = _options(a)
        opts.validate()
        log = configure(opts.log_level)
    except ValueError as e:
        print(f"memory-broker: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(opts, log))
    except SocketPathLocked as e:
        log.error("socket_locked", error=str(e))
        print(f"memory-broker: {e}", file=sys.stderr)
        return 1
    except (ValueError, MemoryError, OSError) as e:
        log.error("start_failed", error=str(e))
        print(f"memory-broker: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from broker.v1 import broker_pb2 as pb
    from broker.v1 import broker_pb2_grpc

    try:
        with grpc.insecure_channel(f"unix:{a.socket}") as ch:
            stub = broker_pb2_grpc.MemoryBrokerStub(ch)
            arena = stub.GetArena(pb.GetArenaRequest(), timeout=a.timeout)
            st = stub.GetStats(pb.GetStatsRequest(), timeout=a.timeout)
    except grpc.RpcError as e:
        print(f"memory-broker: no broker answered on {a.socket}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if a.json:
        out = {
            "arena": MessageToDict(arena, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
            "stats": MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
        }
        print(json.dumps(out, indent=2))
        return 0
    ps = st.page_size
    print(f"broker on {a.socket}")
    print(f"  arena      {arena.backend}, page {format_size(ps)}, {st.num_slabs}/{arena.max_slabs} slabs "
          f"of {arena.pages_per_slab} pages, placement {arena.placement}")
    print(f"  pool       {st.used_pages}/{st.max_pages} pages used ({st.utilization:.1%}), "
          f"{st.capacity_pages} backed, {st.free_pages} free")
    print(f"  pages      prepared {st.prepared_pages}, pinned {st.pinned_pages}, evictable {st.evictable_pages}")
    print(f"  eviction   watermarks {st.low_watermark:.2f}/{st.high_watermark:.2f}, "
          f"{'ACTIVE' if st.eviction_active else 'idle'}, {st.eviction_runs} runs, "
          f"{st.evicted_objects} objects / {st.evicted_pages} pages evicted")
    print(f"  objects    {st.objects} ({st.keyed_objects} keyed), {st.sessions} sessions, "
          f"{st.open_transactions} open transactions")
    print(f"  window     {st.window_free_pages} free pages in {st.window_free_extents} extents, "
          f"largest {st.window_largest_free}, fragmentation {st.window_fragmentation:.2f}")
    for c in st.by_content:
        print(f"  {pb.ContentType.Name(c.content_type).removeprefix('CONTENT_TYPE_').lower():<10} "
              f"{c.objects} objects, {c.pages} pages")
    print(f"  totals     {st.allocations_total} allocations, {st.deduplicated_total} deduplicated, "
          f"{st.allocation_failures} failed")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memory-broker", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _status_parser(sub)
    a = ap.parse_args(argv)
    return {"serve": cmd_serve, "status": cmd_status}[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
