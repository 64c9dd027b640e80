"""The ``memory-broker`` command: ``serve`` runs the daemon; ``status`` and ``adapters`` show a
person the pool and the adapters (``--json`` for scripts), with the common options accepted
before or after any subcommand. Every failure is one line on stderr (a broker's refusal starts
with its gRPC status name) and a non-zero exit code, never a traceback."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time

from memory_broker.broker.cli_host import add_run_dir, cmd_gpus, cmd_status_all, gpus_parser, register_all
from memory_broker.broker.server.flags import add_serve_options, flag_overrides
from memory_broker.broker.server.values import DEFAULT_SOCKET, format_size

PROG = "memory-broker"

# Default --timeout per command: reading the pool is quick; registering may read a large file.
_TIMEOUTS = {"status": 5.0, "adapters": 60.0}


class CliError(Exception):
    """A failure the command reports as one line (``memory-broker: <message>``) and exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that says where to find help (exit 2); and with
    ``populate``, the options are added on first use (parsing, help, or a look at them), so
    building the whole command line for ``--version`` or ``status`` does not import serve's
    settings schema (pydantic)."""

    def __init__(self, *args, populate=None, **kwargs):
        self._populate = None
        super().__init__(*args, **kwargs)
        self._populate = populate

    # argparse reaches every option through ``_actions``: the first reach adds them.
    @property
    def _actions(self) -> list:
        if self._populate is not None:
            populate, self._populate = self._populate, None
            populate(self)
        return self.__dict__["_actions"]

    @_actions.setter
    def _actions(self, value: list) -> None:
        self.__dict__["_actions"] = value

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{PROG}: {message} (see `{self.prog} --help`)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("memory-broker")
    except PackageNotFoundError:
        return "unknown (the memory-broker distribution is not installed)"


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 seconds")
    return v


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return v


def _common(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """The options every command takes, in any position. Absent ones stay out of the namespace
    (SUPPRESS), so an option given before the subcommand is not reset by the subcommand's parser;
    ``_fill_defaults`` supplies the defaults afterwards."""
    S = argparse.SUPPRESS
    g = p.add_argument_group("common options (before or after the command)")
    if not serve:  # serve declares --socket among its own settings
        g.add_argument(
            "--socket",
            default=S,
            metavar="PATH",
            help=f"the broker's gRPC Unix socket (default {DEFAULT_SOCKET}; $MEMORY_BROKER_SOCKET)",
        )
    g.add_argument(
        "--json",
        action="store_true",
        default=S,
        help="serve: log JSON lines (--log-format json); others: machine-readable output",
    )
    if not serve:
        g.add_argument(
            "--timeout",
            type=_positive_float,
            default=S,
            metavar="SECONDS",
            help="seconds each call to the broker may take, and --wait waits (default 5 for status, 60 for adapters)",
        )
        g.add_argument(
            "--wait",
            action="store_true",
            default=S,
            help="if no broker answers yet, wait up to --timeout for one to come up (says so on stderr)",
        )


def _serve_parser(sub) -> None:
    sub.add_parser(
        "serve",
        help="run the broker in the foreground",
        description="Run the broker. Settings come from defaults, then --config FILE, then flags. "
        "Sizes are binary: 2MiB, 512KiB, 1GiB (or 1G), or bytes; 1GB is refused. Durations: 100ms, 30s, 2m "
        "or seconds. Every flag is also a key of the config file (ops/broker.example.yaml).",
        argument_default=argparse.SUPPRESS,
        populate=_serve_options,
    )


def _serve_options(p: argparse.ArgumentParser) -> None:
    add_serve_options(p)  # one per setting of the schema
    _common(p, serve=True)


def _status_parser(sub) -> None:
    p = sub.add_parser("status", help="print the pool's state", description="Print the pool's state.")
    _common(p)
    p.add_argument(
        "--all", action="store_true", help="every broker of this host (per-GPU layout under --run-dir), one table"
    )
    add_run_dir(p)


def _adapters_parser(sub) -> None:
    p = sub.add_parser(
        "adapters",
        help="list, show, register, unregister or verify LoRA adapters",
        description="LoRA adapters. Without an action: list them, with each one's tier and page image "
        "state and the conversion backlog.",
    )
    _common(p)
    _list_options(p)
    asub = p.add_subparsers(dest="action", metavar="{list,show,register,unregister,verify}")
    ls = asub.add_parser(
        "list",
        help="registered adapters, their tier and image state (the default)",
        description="Registered adapters, their tier, their page image state and the conversion backlog.",
    )
    _list_options(ls)
    _common(ls)
    sh = asub.add_parser("show", help="one adapter with its layout", description="One adapter with its layout.")
    sh.add_argument("adapter_id", help="the adapter's id")
    _common(sh)
    rg = asub.add_parser(
        "register",
        help="register a PEFT directory",
        description="Register a PEFT directory (adapter_config.json + adapter_model.safetensors).",
    )
    rg.add_argument("adapter_id", help="the id engines will acquire it by")
    rg.add_argument("path", help="the PEFT directory (the broker must be able to read it)")
    rg.add_argument(
        "--all",
        action="store_true",
        help="on every broker of this host (per-GPU layout under --run-dir), each reported",
    )
    add_run_dir(rg)
    _common(rg)
    ur = asub.add_parser(
        "unregister",
        help="forget adapters (refused while acquired)",
        description="Forget adapters; refused while any session has one acquired.",
    )
    ur.add_argument("adapter_ids", nargs="+", metavar="adapter_id", help="ids to forget")
    _common(ur)
    vf = asub.add_parser(
        "verify",
        help="check resident copies against their checksums (exit 1 if any is corrupt)",
        description="Check adapters' resident copies (hot pages, warm images, image files) against "
        "their checksums; a corrupt copy is dropped and reloaded from its source on the next "
        "acquire. Exits 1 if any was corrupt.",
    )
    vf.add_argument(
        "adapter_ids", nargs="*", metavar="adapter_id", help="ids to check (default: every resident adapter)"
    )
    _common(vf)


def _list_options(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    p.add_argument("--prefix", default=S, help="only ids starting with this")
    p.add_argument("--limit", type=_count, default=S, metavar="N", help="show at most N adapters (default 0: all)")


# ----------------------------------------------------------------- serve


def _needs_daemon(e: ImportError) -> CliError:
    return CliError(f"serve needs the daemon's dependencies ({e}); install them: pip install 'memory-broker[daemon]'")


def cmd_serve(a: argparse.Namespace) -> int:
    for opt in ("timeout", "wait"):
        if hasattr(a, opt):
            raise CliError(f"--{opt} is for status and adapters, not serve", code=2)
    try:
        from memory_broker.broker.server.config import build_options, deprecation_notes
        from memory_broker.broker.server.logs import configure
    except ImportError as e:
        raise _needs_daemon(e) from None
    try:
        overrides = flag_overrides(a)
        config = getattr(a, "config", None)
        opts = build_options(config, overrides)
        opts.config_path = config
        log = configure(opts.log_level, opts.log_format)
    except ValueError as e:
        raise CliError(str(e), code=2) from None
    try:
        # Imported once the log is set up: loading the server loads the native cores, and a
        # core that was not built says so in the log's own format.
        from memory_broker.broker.server.app import serve
        from memory_broker.broker.server.lock import SocketPathLocked
    except ImportError as e:
        raise _needs_daemon(e) from None
    for note in deprecation_notes():
        log.warning("deprecated_setting", detail=note)
    try:
        asyncio.run(serve(opts, log, overrides))
    except SocketPathLocked as e:
        log.error("socket_locked", error=str(e))
        raise CliError(str(e)) from None
    except OSError as e:
        log.error("start_failed", error=str(e))
        what = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
        raise CliError(f"cannot start: {what}") from None
    except (ValueError, MemoryError) as e:
        log.error("start_failed", error=str(e))
        raise CliError(f"cannot start: {e}") from None
    return 0


# ----------------------------------------------------------------- talking to a broker


def _rpc_error(e, a: argparse.Namespace) -> CliError:
    """A gRPC failure as one line: the status name, then what it means here."""
    import grpc

    code, details = e.code(), (e.details() or "").strip()
    if code == grpc.StatusCode.UNAVAILABLE:
        return CliError(
            f"UNAVAILABLE: no broker answered on {a.socket} ({details.rsplit(': ', 1)[-1] or 'no answer'}); "
            f"start one (`{PROG} serve --socket {a.socket}`) or add --wait to wait for it"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CliError(
            f"DEADLINE_EXCEEDED: the broker on {a.socket} did not answer within {a.timeout:g}s (raise --timeout)"
        )
    return CliError(f"{code.name}: {details}")


class _PatientStub:
    """The broker's stub, whose calls say so on stderr (once) when the answer takes longer than
    ``notice_after`` seconds (a registration reading a large file, a loaded broker), so a person
    knows the command waits rather than hangs. stdout stays clean for --json."""

    def __init__(self, stub, socket: str, notice_after: float = 2.0):
        self._stub, self._socket, self._notice_after = stub, socket, notice_after

    def __getattr__(self, method: str):
        import grpc

        def call(request, timeout: float, metadata=None):
            extra = {"metadata": metadata} if metadata else {}
            fut = getattr(self._stub, method).future(request, timeout=timeout, **extra)
            if timeout <= self._notice_after:
                return fut.result()
            try:
                return fut.result(timeout=min(self._notice_after, timeout))
            except grpc.FutureTimeoutError:
                print(
                    f"{PROG}: waiting for the broker on {self._socket} to answer {method} "
                    f"(up to {timeout:g}s, --timeout) ...",
                    file=sys.stderr,
                    flush=True,
                )
                return fut.result()

        return call


class _Broker:
    """A channel and stub to the broker on ``a.socket``; with ``a.wait``, first waits (and says
    so on stderr) until a broker answers there, for up to ``a.timeout`` seconds."""

    def __init__(self, a: argparse.Namespace):
        import grpc

        from memory_broker.proto.wire.v1 import broker_pb2 as pb
        from memory_broker.proto.wire.v1 import broker_pb2_grpc

        self.a, self.pb = a, pb
        if a.wait:
            self._wait_for_broker()
        self.channel = grpc.insecure_channel(f"unix:{a.socket}")
        self.stub = _PatientStub(broker_pb2_grpc.MemoryBrokerStub(self.channel), a.socket)
        self._stack = contextlib.ExitStack()
        self._session: tuple | None = None

    def _wait_for_broker(self) -> None:
        import grpc

        from memory_broker.proto.wire.v1 import broker_pb2_grpc

        a, pb = self.a, self.pb
        t0 = time.monotonic()
        deadline = t0 + a.timeout
        said = False
        while True:
            # A fresh channel per attempt: a channel that failed to connect backs off for
            # seconds before trying again, longer than a broker takes to come up.
            with grpc.insecure_channel(f"unix:{a.socket}") as ch:
                try:
                    broker_pb2_grpc.MemoryBrokerStub(ch).GetArena(pb.GetArenaRequest(), timeout=1.0)
                    break
                except grpc.RpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
            if not said:
                print(
                    f"{PROG}: waiting up to {a.timeout:g}s for a broker on {a.socket} ...", file=sys.stderr, flush=True
                )
                said = True
            if time.monotonic() >= deadline:
                raise CliError(f"UNAVAILABLE: no broker came up on {a.socket} within {a.timeout:g}s (--timeout)")
            time.sleep(0.2)
        if said:
            print(f"{PROG}: broker on {a.socket} is up after {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)

    @property
    def session(self) -> tuple:
        """Call metadata of a session for this process, opened on first use: the adapter RPCs
        need one (the broker allows adapter management by the caller's uid)."""
        if self._session is None:
            from memory_broker.clients.admin import BrokerError, FdChannelError, admin_session

            try:
                self._session = self._stack.enter_context(admin_session(self.channel, timeout=self.a.timeout))
            except (FdChannelError, BrokerError) as e:  # BrokerError: another protocol version
                raise CliError(f"{getattr(e.code, 'value', e.code)}: {e.message}") from None
        return self._session

    def __enter__(self) -> _Broker:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()  # the session first: it ends on this channel
        self.channel.close()


def _as_dict(m) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(m, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _tier_line(t) -> str:
    """The tier past one host in one line: up or down, reads, writes, what was dropped."""
    state = "up" if t.up else f"DOWN ({t.last_error})"
    line = (
        f"{t.backend} {state}: {t.hits} hits, {t.misses} misses ({t.corrupt} corrupt), {t.filled} read in; "
        f"{t.written} written ({format_size(t.bytes_written)}), {t.spilled} spilled; "
        f"{t.drops + t.spill_dropped} dropped, {t.errors} errors, {t.timeouts} timeouts; {t.queue_depth} queued"
    )
    if t.adapter_images:
        line += f"; adapter images {t.adapter_images_written} written, {t.adapter_images_read} read"
    if t.lmcache_model:
        line += f"; chunks shared with LMCache for {t.lmcache_model}"
    return line


def _engine_line(e) -> str:
    """One engine's own KV cache on the pool: held within floor and ceiling, and its traffic."""
    mean = e.grow_seconds / e.grows * 1e3 if e.grows else 0.0
    return (
        f"{e.name} (session {e.session_id}): {e.held_pages} KV pages, floor {e.floor_pages}, "
        f"ceiling {e.ceiling_pages}, weight {e.weight:g}; {e.grows} grows ({e.grown_pages} pages, "
        f"{mean:.1f} ms mean, {e.grow_seconds_max * 1e3:.1f} ms max), {e.give_backs} give-backs "
        f"({e.given_pages} pages), {e.refusals} refused, asked back {e.asked_pages} pages"
    )


def cmd_status(a: argparse.Namespace) -> int:
    import grpc

    if a.all:
        return cmd_status_all(a)

    try:
        with _Broker(a) as b:
            arena = b.stub.GetArena(b.pb.GetArenaRequest(), timeout=a.timeout)
            st = b.stub.GetStats(b.pb.GetStatsRequest(), timeout=a.timeout)
    except grpc.RpcError as e:
        raise _rpc_error(e, a) from None
    pb = b.pb
    if a.json:
        print(json.dumps({"arena": _as_dict(arena), "stats": _as_dict(st)}, indent=2))
        return 0
    ps = st.page_size
    print(f"broker on {a.socket}")
    print(
        f"  arena      {arena.backend}, page {format_size(ps)}, {st.num_slabs}/{arena.max_slabs} slabs "
        f"of {arena.pages_per_slab} pages, placement {arena.placement}"
    )
    print(
        f"  pool       {st.used_pages}/{st.max_pages} pages used ({st.utilization:.1%}), "
        f"{st.capacity_pages} backed, {st.free_pages} free"
    )
    print(f"  pages      prepared {st.prepared_pages}, pinned {st.pinned_pages}, evictable {st.evictable_pages}")
    print(
        f"  eviction   watermarks {st.low_watermark:.2f}/{st.high_watermark:.2f}, "
        f"{'ACTIVE' if st.eviction_active else 'idle'}, {st.eviction_runs} runs, "
        f"{st.evicted_objects} objects / {st.evicted_pages} pages evicted"
    )
    print(
        f"  objects    {st.objects} ({st.keyed_objects} keyed), {st.sessions} sessions, "
        f"{st.open_transactions} open transactions"
    )
    print(
        f"  window     {st.window_free_pages} free pages in {st.window_free_extents} extents, "
        f"largest {st.window_largest_free}, fragmentation {st.window_fragmentation:.2f}"
    )
    for c in st.by_content:
        print(
            f"  {pb.ContentType.Name(c.content_type).removeprefix('CONTENT_TYPE_').lower():<10} "
            f"{c.objects} objects, {c.pages} pages"
        )
    for o in st.by_owner:
        who = (
            f"{o.client_name or '?'} (session {o.session_id}, pid {o.pid})"
            if o.session_id
            else "no owner (session ended)"
        )
        print(
            f"  owner      {who}: {pb.ContentType.Name(o.content_type).removeprefix('CONTENT_TYPE_').lower()} "
            f"{o.objects} objects, {o.pages} pages"
        )
    print(
        f"  totals     {st.allocations_total} allocations, {st.deduplicated_total} deduplicated, "
        f"{st.allocation_failures} failed"
    )
    if st.HasField("tier"):
        print(f"  tier       {_tier_line(st.tier)}")
    for e in st.engines:
        print(f"  engine     {_engine_line(e)}")
    if st.HasField("adapters") and st.adapters.convert_queued:
        print(f"  adapters   {_backlog(st.adapters.convert_queued)}")
    return 0


# ----------------------------------------------------------------- adapters

_TIER = {0: "?", 1: "hot", 2: "warm", 3: "cold"}


def _image_state(pb, state: int) -> str:
    return pb.AdapterImageState.Name(state).removeprefix("ADAPTER_IMAGE_STATE_").lower()


def _backlog(n: int) -> str:
    if not n:
        return "conversion backlog: none"
    return f"conversion backlog: {n} adapter{'s' if n != 1 else ''} waiting for a page image"


def cmd_adapters(a: argparse.Namespace) -> int:
    import grpc

    if a.action == "register" and a.all:
        return register_all(a, lambda one: cmd_adapters(one), CliError)
    try:
        with _Broker(a) as b:
            actions = {
                "register": _register,
                "unregister": _unregister,
                "show": _show,
                "list": _list,
                "verify": _verify,
            }
            return actions[a.action](a, b)
    except grpc.RpcError as e:
        raise _rpc_error(e, a) from None


def _register(a: argparse.Namespace, b: _Broker) -> int:
    pb = b.pb
    r = b.stub.RegisterAdapter(
        pb.RegisterAdapterRequest(adapter_id=a.adapter_id, path=os.path.abspath(a.path)),
        timeout=a.timeout,
        metadata=b.session,
    ).adapter
    if a.json:
        print(json.dumps(_as_dict(r), indent=2))
        return 0
    print(
        f"registered {r.adapter_id}: rank {r.rank}, {len(r.target_modules)} module types over {r.num_layers} "
        f"layers, {format_size(r.file_bytes)}"
    )
    state = _image_state(pb, r.image_state)
    if state in ("queued", "converting"):
        n = b.stub.GetStats(pb.GetStatsRequest(), timeout=a.timeout).adapters.convert_queued
        print(f"  page image {state} ({_backlog(n)}); `{PROG} adapters` shows progress")
    return 0


def _unregister(a: argparse.Namespace, b: _Broker) -> int:
    b.stub.UnregisterAdapter(
        b.pb.UnregisterAdapterRequest(adapter_ids=a.adapter_ids), timeout=a.timeout, metadata=b.session
    )
    print(json.dumps({"unregistered": a.adapter_ids}) if a.json else "unregistered " + ", ".join(a.adapter_ids))
    return 0


def _verify(a: argparse.Namespace, b: _Broker) -> int:
    r = b.stub.VerifyAdapters(
        b.pb.VerifyAdaptersRequest(adapter_ids=a.adapter_ids), timeout=a.timeout, metadata=b.session
    )
    if a.json:
        print(json.dumps(_as_dict(r), indent=2))
    else:
        for c in r.checks:
            verdict = ("ok" if c.ok else "CORRUPT") if c.checked else "not checked"
            print(f"{c.adapter_id:<32}{_TIER[c.tier]:<6}{verdict:<12}{c.detail}")
    return 1 if r.corrupt else 0


def _show(a: argparse.Namespace, b: _Broker) -> int:
    lay = b.stub.GetAdapterLayout(
        b.pb.GetAdapterLayoutRequest(adapter_id=a.adapter_id), timeout=a.timeout, metadata=b.session
    )
    if a.json:
        print(json.dumps(_as_dict(lay), indent=2))
        return 0
    state = f"hot, generation {lay.generation}, pages {list(lay.pages)}" if lay.generation else "not hot"
    print(
        f"{lay.adapter_id}: {state}; {lay.num_pages} pages of {format_size(lay.page_size)}, "
        f"{lay.dtype}, rows aligned to {lay.row_align} B"
    )
    for m in lay.modules:
        print(
            f"  layer {m.layer:<3} {m.module:<12} rank {m.rank:<4} scaling {m.scaling:<8.4g} "
            f"A {m.a.rows}x{m.a.row_elems} in {len(m.a.chunks)} chunks, "
            f"Bt {m.b.rows}x{m.b.row_elems} in {len(m.b.chunks)} chunks"
        )
    return 0


def _list(a: argparse.Namespace, b: _Broker) -> int:
    pb = b.pb
    rows, token = [], ""
    while True:
        page = b.stub.ListAdapters(
            pb.ListAdaptersRequest(prefix=a.prefix, limit=1000, page_token=token), timeout=a.timeout, metadata=b.session
        )
        rows.extend(page.adapters)
        token = page.next_page_token
        if not token or (a.limit and len(rows) >= a.limit):
            break
    if a.limit:
        rows = rows[: a.limit]
    st = b.stub.GetStats(pb.GetStatsRequest(), timeout=a.timeout)
    if not st.HasField("adapters"):
        raise CliError(f"FAILED_PRECONDITION: adapters are not enabled on the broker on {a.socket}")
    st = st.adapters
    if a.json:
        out = {"adapters": [_as_dict(r) for r in rows], "stats": _as_dict(st), "convert_backlog": st.convert_queued}
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{st.registered} registered: {st.hot} hot ({st.hot_pages} pages), {st.warm} warm "
        f"({format_size(st.warm_bytes)}), {st.cold} cold; hit rate {st.hit_rate:.1%}"
    )
    print(f"{_backlog(st.convert_queued)}; {st.image_count} page images on disk ({format_size(st.image_bytes)})")
    if rows:
        print(f"{'adapter':<32}{'tier':<6}{'rank':>5}{'pins':>6}{'gen':>6}  {'image':<12}modules")
    for r in rows:
        print(
            f"{r.adapter_id:<32}{_TIER[r.tier]:<6}{r.rank:>5}{r.pin_count:>6}{r.generation:>6}  "
            f"{_image_state(pb, r.image_state):<12}{','.join(r.target_modules)}"
        )
    return 0


# ----------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog=PROG,
        description="A per-GPU memory broker: `serve` runs the daemon; `status` and `adapters` show a person "
        "the pool and the LoRA adapters (--json for scripts).",
        epilog="Every command's --help lists its options.",
    )
    ap.add_argument(
        "--version", action="version", version=f"{PROG} {_version()}", help="print the installed version and exit"
    )
    _common(ap)
    sub = ap.add_subparsers(dest="command", required=True, metavar="{serve,status,adapters,gpus}")
    _serve_parser(sub)
    _status_parser(sub)
    _adapters_parser(sub)
    gpus_parser(sub)
    return ap


def _fill_defaults(a: argparse.Namespace) -> None:
    """Defaults of the options that were left out (SUPPRESS keeps them out while parsing)."""
    if a.command in ("serve", "gpus"):
        return  # absent serve flags stay absent: the config file may set them
    for name, default in (
        ("socket", DEFAULT_SOCKET),
        ("json", False),
        ("wait", False),
        ("timeout", _TIMEOUTS[a.command]),
        ("prefix", ""),
        ("limit", 0),
    ):
        if not hasattr(a, name):
            setattr(a, name, default)
    if a.command == "adapters" and getattr(a, "action", None) is None:
        a.action = "list"


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    _fill_defaults(a)
    try:
        return {"serve": cmd_serve, "status": cmd_status, "adapters": cmd_adapters, "gpus": cmd_gpus}[a.command](a)
    except CliError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `memory-broker status | head`: the reader left; not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # noqa: BLE001  (a bug: still one line, the traceback on request)
        if os.environ.get("MEMORY_BROKER_DEBUG"):
            raise
        print(
            f"{PROG}: internal error: {type(e).__name__}: {e} (MEMORY_BROKER_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
