"""The ``memory-broker`` command: ``serve`` runs the daemon, ``status`` shows a person the pool."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from broker.server.options import DEFAULT_SOCKET, ServeOptions, format_size, parse_size


def _serve_parser(sub) -> None:
    d = ServeOptions()
    p = sub.add_parser(
        "serve",
        help="run the broker in the foreground",
        description="Run the broker. Settings come from defaults, then --config FILE, then flags.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", help="YAML configuration file (see ops/broker.example.yaml)")
    p.add_argument("--instance", help="name of this broker (systemd instance: GPU index or UUID)")
    p.add_argument("--socket", help=f"gRPC Unix socket (default {d.socket}); the fd channel is SOCKET.fds")
    p.add_argument("--tcp-port", type=int, help="also serve gRPC on 127.0.0.1:PORT")
    p.add_argument("--arena", choices=("auto", "host", "cuda"), help="arena backend (default auto)")
    p.add_argument("--device", help="CUDA device index or UUID (default 0)")
    p.add_argument("--pool-size", help="most memory the arena may hold (default 1GiB)")
    p.add_argument("--preallocate", help="memory to create at start (default 0: grow on demand)")
    p.add_argument("--page-size", help="page size, 512KiB..4MiB (default 2MiB)")
    p.add_argument("--slab-size", help="slab (growth unit) size (default 64MiB)")
    p.add_argument("--window-factor", type=int, help="virtual window / pool size (default 4)")
    p.add_argument("--placement", choices=("best_fit", "first_fit"), help="default best_fit")
    p.add_argument("--eviction-policy", choices=("lru_size_aware", "lru"), help="default lru_size_aware")
    p.add_argument("--high-watermark", type=float, help=f"default {d.high_watermark}")
    p.add_argument("--low-watermark", type=float, help=f"default {d.low_watermark}")
    p.add_argument("--lease", type=float, help=f"default transaction lease, seconds (default {d.default_lease_s:g})")
    p.add_argument("--max-pins-per-session", type=int, help="most pins one session may hold (default 0: no limit)")
    p.add_argument("--state-dir", help=f"persistent state (default {d.state_dir})")
    p.add_argument("--allow-uid", type=int, action="append", help="uid allowed on the fd channel (repeat; default: own uid)")
    p.add_argument("--socket-mode", help="permissions of both sockets, e.g. 0660 (default: umask)")
    p.add_argument("--socket-group", help="group of both sockets (the engines' group)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (default 0: off)")
    p.add_argument("--metrics-address", help="address of the metrics endpoint (default 127.0.0.1)")
    p.add_argument("--enable-echo", action="store_true", help="serve the bare Echo service (benchmarks)")
    p.add_argument("--grace", type=float, help=f"seconds SIGTERM waits for in-flight calls (default {d.grace_s:g})")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


def _status_parser(sub) -> None:
    p = sub.add_parser("status", help="print the pool's state")
    p.add_argument("--socket", default=DEFAULT_SOCKET)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=5.0)


# flag dest -> (ServeOptions field, converter)
_FLAGS = {
    "instance": ("instance", str),
    "socket": ("socket", str),
    "tcp_port": ("tcp_port", int),
    "arena": ("arena", str),
    "device": ("device", str),
    "pool_size": ("pool_size", lambda v: parse_size(v, "--pool-size")),
    "preallocate": ("preallocate", lambda v: parse_size(v, "--preallocate")),
    "page_size": ("page_size", lambda v: parse_size(v, "--page-size")),
    "slab_size": ("slab_size", lambda v: parse_size(v, "--slab-size")),
    "window_factor": ("window_factor", int),
    "placement": ("placement", str),
    "eviction_policy": ("eviction_policy", str),
    "high_watermark": ("high_watermark", float),
    "low_watermark": ("low_watermark", float),
    "lease": ("default_lease_s", float),
    "max_pins_per_session": ("max_pins_per_session", int),
    "state_dir": ("state_dir", str),
    "allow_uid": ("allowed_uids", tuple),
    "socket_mode": ("socket_mode", lambda v: int(v, 8)),
    "socket_group": ("socket_group", str),
    "metrics_port": ("metrics_port", int),
    "metrics_address": ("metrics_address", str),
    "enable_echo": ("enable_echo", bool),
    "grace": ("grace_s", float),
    "log_level": ("log_level", str),
}


def flag_overrides(a: argparse.Namespace) -> dict:
    """The options given as flags (argparse leaves absent flags out of the namespace)."""
    out = {}
    for dest, (field_name, conv) in _FLAGS.items():
        if hasattr(a, dest):
            try:
                out[field_name] = conv(getattr(a, dest))
            except ValueError as e:
                raise ValueError(f"--{dest.replace('_', '-')}: {e}") from None
    return out


def cmd_serve(a: argparse.Namespace) -> int:
    from broker.server.app import serve
    from broker.server.config import build_options
    from broker.server.lock import SocketPathLocked
    from broker.server.logs import configure

    try:
        overrides = flag_overrides(a)
        config = getattr(a, "config", None)
        opts = build_options(config, overrides)
        opts.config_path = config
        log = configure(opts.log_level)
    except ValueError as e:
        print(f"memory-broker: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(opts, log, overrides))
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
