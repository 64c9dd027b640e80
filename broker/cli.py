"""The ``memory-broker`` command: ``serve`` runs the daemon; ``status`` and ``adapters`` show a
person the pool and the adapters (``--json`` for scripts)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from memory_broker.broker.server.options import DEFAULT_SOCKET, ServeOptions, format_size, parse_size


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
    p.add_argument("--adapter-dtype", choices=("bfloat16", "float16", "float32"), help="storage of hot adapter rows (default bfloat16)")
    p.add_argument("--adapter-max-rank", type=int, help="largest LoRA rank accepted (default 256)")
    p.add_argument("--hot-tier-adapters", type=int, help="most adapters in arena pages (default 0: pool-bound)")
    p.add_argument("--hot-tier-pages", type=int, help="most arena pages adapters may take (default 0: pool-bound)")
    p.add_argument("--warm-tier-bytes", help="host memory for warm adapters (default 4GiB)")
    p.add_argument("--warm-int8", action="store_true", help="keep warm adapters as int8 rows with per-row scales")
    p.add_argument("--no-adapter-image-cache", action="store_true", help="do not keep converted adapter images on disk")
    p.add_argument("--adapter-image-budget", help="disk the converted images may take (default 64GiB; 0: no limit)")
    p.add_argument("--no-adapter-convert-ahead", action="store_true",
                   help="convert adapters into images only when first loaded, not after registration")
    p.add_argument("--adapter-policy", choices=("lru", "lfu", "gdsf"), help="victim order of both adapter tiers (default lru)")
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
    "adapter_dtype": ("adapter_dtype", str),
    "adapter_max_rank": ("adapter_max_rank", int),
    "hot_tier_adapters": ("hot_tier_adapters", int),
    "hot_tier_pages": ("hot_tier_pages", int),
    "warm_tier_bytes": ("warm_tier_bytes", lambda v: parse_size(v, "--warm-tier-bytes")),
    "warm_int8": ("warm_int8", bool),
    "no_adapter_image_cache": ("adapter_image_cache", lambda v: not v),
    "adapter_image_budget": ("adapter_image_budget", lambda v: parse_size(v, "--adapter-image-budget")),
    "no_adapter_convert_ahead": ("adapter_convert_ahead", lambda v: not v),
    "metrics_port": ("metrics_port", int),
    "metrics_address": ("metrics_address", str),
    "enable_echo": ("enable_echo", bool),
    "grace": ("grace_s", float),
    "log_level": ("log_level", str),
}


def flag_overrides(a: argparse.Namespace) -> dict:
    """The options given as flags (argparse leaves absent flags out of the namespace)."""
    out = {}
    if hasattr(a, "adapter_policy"):
        out["adapter_hot_policy"] = out["adapter_warm_policy"] = a.adapter_policy
    for dest, (field_name, conv) in _FLAGS.items():
        if hasattr(a, dest):
            try:
                out[field_name] = conv(getattr(a, dest))
            except ValueError as e:
                raise ValueError(f"--{dest.replace('_', '-')}: {e}") from None
    return out


def cmd_serve(a: argparse.Namespace) -> int:
    from memory_broker.broker.server.app import serve
    from memory_broker.broker.server.config import build_options
    from memory_broker.broker.server.lock import SocketPathLocked
    from memory_broker.broker.server.logs import configure

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

    from memory_broker.broker.v1 import broker_pb2 as pb
    from memory_broker.broker.v1 import broker_pb2_grpc

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
    for o in st.by_owner:
        who = f"{o.client_name or '?'} (session {o.session_id}, pid {o.pid})" if o.session_id else "no owner (session ended)"
        print(f"  owner      {who}: {pb.ContentType.Name(o.content_type).removeprefix('CONTENT_TYPE_').lower()} "
              f"{o.objects} objects, {o.pages} pages")
    print(f"  totals     {st.allocations_total} allocations, {st.deduplicated_total} deduplicated, "
          f"{st.allocation_failures} failed")
    return 0


def _adapters_parser(sub) -> None:
    p = sub.add_parser("adapters", help="list, show, register or unregister LoRA adapters")
    p.add_argument("--socket", default=DEFAULT_SOCKET)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    asub = p.add_subparsers(dest="action")
    ls = asub.add_parser("list", help="registered adapters and where they are (default)")
    ls.add_argument("--prefix", default="")
    ls.add_argument("--limit", type=int, default=0, help="show at most this many (default: all)")
    sh = asub.add_parser("show", help="one adapter with its layout")
    sh.add_argument("adapter_id")
    rg = asub.add_parser("register", help="register a PEFT directory")
    rg.add_argument("adapter_id")
    rg.add_argument("path")
    ur = asub.add_parser("unregister", help="forget adapters (refused while acquired)")
    ur.add_argument("adapter_ids", nargs="+")


_TIER = {0: "?", 1: "hot", 2: "warm", 3: "cold"}


def cmd_adapters(a: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from memory_broker.broker.v1 import broker_pb2 as pb
    from memory_broker.broker.v1 import broker_pb2_grpc

    def as_dict(m) -> dict:
        return MessageToDict(m, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    action = a.action or "list"
    try:
        with grpc.insecure_channel(f"unix:{a.socket}") as ch:
            stub = broker_pb2_grpc.MemoryBrokerStub(ch)
            if action == "register":
                r = stub.RegisterAdapter(
                    pb.RegisterAdapterRequest(adapter_id=a.adapter_id, path=os.path.abspath(a.path)), timeout=a.timeout
                )
                print(json.dumps(as_dict(r.adapter), indent=2) if a.json else
                      f"registered {r.adapter.adapter_id}: rank {r.adapter.rank}, "
                      f"{len(r.adapter.target_modules)} module types over {r.adapter.num_layers} layers, "
                      f"{format_size(r.adapter.file_bytes)}")  # fmt: skip
                return 0
            if action == "unregister":
                stub.UnregisterAdapter(pb.UnregisterAdapterRequest(adapter_ids=a.adapter_ids), timeout=a.timeout)
                print("unregistered " + ", ".join(a.adapter_ids))
                return 0
            if action == "show":
                lay = stub.GetAdapterLayout(pb.GetAdapterLayoutRequest(adapter_id=a.adapter_id), timeout=a.timeout)
                if a.json:
                    print(json.dumps(as_dict(lay), indent=2))
                    return 0
                state = f"hot, generation {lay.generation}, pages {list(lay.pages)}" if lay.generation else "not hot"
                print(f"{lay.adapter_id}: {state}; {lay.num_pages} pages of {format_size(lay.page_size)}, "
                      f"{lay.dtype}, rows aligned to {lay.row_align} B")  # fmt: skip
                for m in lay.modules:
                    print(f"  layer {m.layer:<3} {m.module:<12} rank {m.rank:<4} scaling {m.scaling:<8.4g} "
                          f"A {m.a.rows}x{m.a.row_elems} in {len(m.a.chunks)} chunks, "
                          f"Bt {m.b.rows}x{m.b.row_elems} in {len(m.b.chunks)} chunks")  # fmt: skip
                return 0
            rows, token = [], ""
            while True:
                page = stub.ListAdapters(
                    pb.ListAdaptersRequest(prefix=a.prefix, limit=1000, page_token=token), timeout=a.timeout
                )
                rows.extend(page.adapters)
                token = page.next_page_token
                if not token or (a.limit and len(rows) >= a.limit):
                    break
            if a.limit:
                rows = rows[: a.limit]
            st = stub.GetStats(pb.GetStatsRequest(), timeout=a.timeout).adapters
    except grpc.RpcError as e:
        print(f"memory-broker: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({"adapters": [as_dict(r) for r in rows], "stats": as_dict(st)}, indent=2))
        return 0
    print(f"{st.registered} registered: {st.hot} hot ({st.hot_pages} pages), {st.warm} warm "
          f"({format_size(st.warm_bytes)}), {st.cold} cold; hit rate {st.hit_rate:.1%}")  # fmt: skip
    if rows:
        print(f"{'adapter':<32}{'tier':<6}{'rank':>5}{'pins':>6}{'gen':>6}  modules")
    for r in rows:
        print(f"{r.adapter_id:<32}{_TIER[r.tier]:<6}{r.rank:>5}{r.pin_count:>6}{r.generation:>6}  "
              f"{','.join(r.target_modules)}")  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="memory-broker", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _status_parser(sub)
    _adapters_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return {"serve": cmd_serve, "status": cmd_status, "adapters": cmd_adapters}[a.command](a)
    except BrokenPipeError:
        # `memory-broker status | head`: the reader left; not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
