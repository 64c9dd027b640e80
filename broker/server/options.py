"""The one schema of what ``memory-broker serve`` is told: each setting declared once, as a
field of ``ServeOptions`` (a pydantic model) with its type, default, bounds, YAML key, flag,
help, whether SIGHUP may change it, and its deprecated spellings.

Everything else is generated from here: the serve flags (``flags.py``), the YAML reading and the
reload split (``config.py``), the messages that name a setting, and the check of
``ops/broker.example.yaml`` (tests/test_config_schema.py). This module does not read files or
parse command lines, and is imported only by ``serve`` (pydantic costs ~0.1 s to import).

One name per setting: the field is the flag's name (``--hot-tier-adapters`` ->
``hot_tier_adapters``; the shorthands ``--lease``, ``--grace`` and ``--allow-uid`` are the only
exceptions); the YAML key is ``<section>.<name>``, where the ``adapters`` section drops the
``adapter_`` prefix of a field (``adapter_image_budget`` -> ``adapters.image_budget``), and
``AdapterConfig``'s fields are those YAML leaf names; the other sections keep the ADR's keys
(``placement`` is ``memory_pool.allocation_strategy``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from memory_broker.broker.adapters.policy import DEFAULT_POLICY, POLICIES
from memory_broker.broker.server.values import (
    DEFAULT_SOCKET,
    KINDS,
    LOG_FORMATS,
    LOG_LEVELS,
    ConfigError,
    show,
)
from memory_broker.proto.wire.mapping import check_sizes

_AUTO = "auto"


def setting(  # noqa: PLR0913 - a declaration: keyword-only facets of one setting
    default: Any = None,
    *,
    kind: str,
    help: str,
    yaml: str | None,
    flag: str | None = _AUTO,
    metavar: str | None = None,
    reload: bool = False,
    aliases: tuple[str, ...] = (),
    shown: str | None = None,
    note: str = "",
    unit: str = "",
    factory: Any = None,
    **bounds: Any,
) -> Any:
    """One setting's declaration: a pydantic ``Field`` carrying the rest in ``json_schema_extra``.

    ``flag`` defaults to the field's name with dashes; None means no flag (``yaml`` None: no
    YAML key). ``shown`` replaces the default in help text ("0: grow on demand"); ``note`` and
    ``unit`` complete the bounds in messages ("must be >= 0 (0 = no limit)").
    """
    if kind not in KINDS:
        raise ValueError(f"unknown setting kind {kind!r}; one of {', '.join(sorted(KINDS))}")
    extra = {
        "kind": kind,
        "yaml": yaml,
        "flag": flag,
        "metavar": metavar,
        "reload": reload,
        "aliases": list(aliases),
        "shown": shown,
        "note": note,
        "unit": unit,
    }
    if factory is not None:
        return Field(default_factory=factory, description=help, json_schema_extra=extra, **bounds)
    return Field(default, description=help, json_schema_extra=extra, **bounds)


class _Explained(BaseModel):
    """A model whose validation errors are SettingErrors naming the setting (``_explain``)."""

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise _explain(e) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise _explain(e) from None


class ServeOptions(_Explained):
    """Every setting of a running broker, with its default: types and bounds are checked on construction and
    assignment; ``validate`` adds the checks that span settings or look at the machine (socket dir, group)."""

    model_config = ConfigDict(strict=True, validate_assignment=True, extra="forbid")

    socket: str = setting(
        DEFAULT_SOCKET,
        kind="str",
        yaml="listeners.socket",
        metavar="PATH",
        help="gRPC Unix socket; the fd channel is PATH.fds, PATH.lock guards it",
    )
    run_dir: str | None = setting(
        None,
        kind="str",
        yaml="listeners.run_dir",
        metavar="DIR",
        shown="none: use --socket",
        help="per-GPU layout: sockets in DIR/<gpu-uuid>/ (broker.sock, .fds, .step), DIR/<instance>.sock "
        "links to them; replaces --socket",
    )
    tcp_port: int = setting(
        0,
        kind="int",
        yaml="listeners.tcp_port",
        metavar="N",
        shown="none",
        ge=0,
        le=65535,
        help="also serve gRPC on 127.0.0.1:N (GetArena, GetStats and health only)",
    )
    arena: Literal["auto", "host", "cuda"] = setting(
        "auto", kind="choice", yaml="arena.backend", help="arena backend (auto: CUDA where usable, else host)"
    )
    device: str = setting(
        "0",
        kind="text",
        yaml="arena.device",
        help="CUDA device index or UUID (GPU-...; stable across CUDA_VISIBLE_DEVICES)",
    )
    pool_size: int = setting(
        1 << 30, kind="size", yaml="memory_pool.pool_size", metavar="SIZE", help="most memory the arena may hold"
    )
    preallocate: int = setting(
        0,
        kind="size",
        yaml="memory_pool.preallocate",
        metavar="SIZE",
        shown="0: grow on demand",
        help="memory to create at start",
    )
    page_size: int = setting(
        2 << 20,
        kind="size",
        yaml="memory_pool.page_size",
        metavar="SIZE",
        help="page size, a power of two 512KiB..4MiB",
    )
    slab_size: int = setting(
        64 << 20,
        kind="size",
        yaml="memory_pool.slab_size",
        metavar="SIZE",
        help="slab (growth unit) size, a multiple of the page size",
    )
    window_factor: int = setting(
        4, kind="int", yaml="memory_pool.window_factor", metavar="N", ge=1, le=64, help="virtual window / pool size"
    )
    placement: Literal["best_fit", "first_fit"] = setting(
        "best_fit",
        kind="choice",
        yaml="memory_pool.allocation_strategy",
        help="placement of contiguous ranges in the window",
    )
    eviction_policy: Literal["lru_size_aware", "lru"] = setting(
        "lru_size_aware",
        kind="choice",
        yaml="memory_pool.eviction.policy",
        help="victim order when above the high watermark",
    )
    high_watermark: float = setting(
        0.90,
        kind="float",
        yaml="memory_pool.eviction.high_watermark",
        metavar="F",
        reload=True,
        gt=0.0,
        le=1.0,
        help="pool utilization that starts eviction",
    )
    low_watermark: float = setting(
        0.80,
        kind="float",
        yaml="memory_pool.eviction.low_watermark",
        metavar="F",
        reload=True,
        gt=0.0,
        le=1.0,
        help="utilization eviction brings the pool down to",
    )
    default_lease_s: float = setting(
        30.0,
        kind="duration",
        yaml="memory_pool.transactions.default_lease",
        flag="--lease",
        metavar="S",
        reload=True,
        gt=0.0,
        le=600.0,
        help="default transaction lease (30s, 2m, or seconds)",
    )
    state_dir: str = setting(
        kind="str",
        yaml="state_dir",
        metavar="DIR",
        factory=lambda: os.environ.get("MEMORY_BROKER_STATE_DIR", "/tmp/memory-broker-state"),
        help="persistent state: the adapter registry and images; created if missing",
    )
    state_root: str | None = setting(
        None,
        kind="str",
        yaml="state_root",
        metavar="DIR",
        shown="none: use --state-dir",
        help="per-GPU layout: the state directory is DIR/<gpu-uuid>; replaces --state-dir",
    )
    allowed_uids: tuple[int, ...] = setting(
        (),
        kind="uids",
        yaml="security.allowed_uids",
        flag="--allow-uid",
        metavar="UID",
        reload=True,
        shown="own and manager uids only",
        help="uid whose processes may prove a session and call through it, besides the broker's own (repeat)",
    )
    tenants: tuple[tuple[str, tuple[int, ...], tuple[int, ...], int], ...] = setting(
        (),
        kind="tenants",
        yaml="security.tenants",
        flag="--tenant",
        metavar="NAME:uids=U,..:gids=G,..:bytes=SIZE",
        shown="none: one shared pool",
        help="a tenant pool of whole slabs for the sessions of these uids/gids (repeat)",
    )
    engines: tuple[tuple[str, int, int, float], ...] = setting(
        (),
        kind="engines",
        yaml="engine_pool.engines",
        flag="--engine",
        metavar="NAME:floor=SIZE:ceiling=SIZE:weight=W",
        shown="none: any engine, no floor, the whole pool as ceiling, weight 1",
        help="an engine's own KV cache limits on the pool, by engine or tenant pool name (repeat)",
    )
    engine_reclaim_wait_s: float = setting(
        0.5,
        kind="duration",
        yaml="engine_pool.reclaim_wait",
        metavar="S",
        gt=0.0,
        le=10.0,
        help="how long an engine's KV grow waits for other engines' give-backs before it is refused",
    )
    enable_echo: bool = setting(False, kind="bool", yaml=None, help="serve the bare Echo service (benchmarks)")
    grace_s: float = setting(
        10.0,
        kind="duration",
        yaml="shutdown.grace",
        flag="--grace",
        metavar="S",
        reload=True,
        ge=0.0,
        help="time SIGTERM waits for in-flight calls",
    )
    log_level: Literal[LOG_LEVELS] = setting(  # type: ignore[valid-type]
        "info", kind="choice", yaml="logging.level", reload=True, help="least severe event logged"
    )
    log_format: Literal[LOG_FORMATS] = setting(  # type: ignore[valid-type]
        "auto",
        kind="choice",
        yaml="logging.format",
        help="auto: human-readable on a terminal, JSON lines otherwise; console; json (--json)",
    )
    max_pins_per_session: int = setting(
        0,
        kind="int",
        yaml="memory_pool.pinning.max_pins_per_session",
        metavar="N",
        reload=True,
        ge=0,
        note="0 = no limit",
        shown="0: no limit",
        help="most pins one session may hold",
    )
    socket_mode: int | None = setting(
        None,
        kind="mode",
        yaml="listeners.socket_mode",
        metavar="MODE",
        shown="0660 with --socket-group, else the umask",
        help="permissions of the sockets, e.g. 0660",
    )
    socket_group: str | None = setting(
        None,
        kind="str",
        yaml="listeners.socket_group",
        metavar="GROUP",
        shown="the broker's",
        help="group of both sockets (the engines' group)",
    )
    # LoRA adapters (the adapters section; AdapterConfig's fields are the YAML leaf names).
    adapter_dtype: Literal["bfloat16", "float16", "float32"] = setting(
        "bfloat16", kind="choice", yaml="adapters.dtype", help="storage of hot adapter rows (what the kernels read)"
    )
    adapter_max_rank: int = setting(
        256,
        kind="int",
        yaml="adapters.max_rank",
        metavar="R",
        ge=1,
        le=4096,
        help="largest LoRA rank accepted at registration",
    )
    adapter_max_bytes: int = setting(
        0,
        kind="size",
        yaml="adapters.max_bytes",
        metavar="SIZE",
        ge=0,
        shown="0: the pool size, or the hot tier's pages if less",
        help="most bytes one adapter's tensors may declare (larger ones are refused at registration)",
    )
    hot_tier_pages: int = setting(
        0,
        kind="int",
        yaml="adapters.hot_tier_pages",
        metavar="N",
        ge=0,
        shown="0: pool-bound",
        help="most arena pages adapters may take",
    )
    hot_tier_adapters: int = setting(
        0,
        kind="int",
        yaml="adapters.hot_tier_adapters",
        metavar="N",
        ge=0,
        aliases=("adapters.hot_tier_budget",),
        shown="0: pool-bound",
        help="most adapters in arena pages",
    )
    warm_tier_bytes: int = setting(
        4 << 30,
        kind="size",
        yaml="adapters.warm_tier_bytes",
        metavar="SIZE",
        ge=0,
        help="host memory for warm adapters (0: no warm tier)",
    )
    warm_int8: bool = setting(
        False, kind="bool", yaml="adapters.warm_int8", help="keep warm adapters as int8 rows with per-row scales"
    )
    adapter_image_cache: bool = setting(
        True,
        kind="bool",
        yaml="adapters.image_cache",
        flag="--no-adapter-image-cache",
        help="do not keep converted adapter images on disk",
    )
    adapter_image_budget: int = setting(
        64 << 30,
        kind="size",
        yaml="adapters.image_budget",
        metavar="SIZE",
        ge=0,
        help="disk the converted images may take (0: no limit)",
    )
    adapter_convert_ahead: bool = setting(
        True,
        kind="bool",
        yaml="adapters.convert_ahead",
        flag="--no-adapter-convert-ahead",
        help="convert adapters into images only when first loaded, not after registration",
    )
    adapter_hot_policy: Literal[tuple(POLICIES)] = setting(  # type: ignore[valid-type]
        DEFAULT_POLICY, kind="choice", yaml="adapters.hot_policy", help="victim order of the hot tier"
    )
    adapter_warm_policy: Literal[tuple(POLICIES)] = setting(  # type: ignore[valid-type]
        DEFAULT_POLICY, kind="choice", yaml="adapters.warm_policy", help="victim order of the warm tier"
    )
    # Security (docs/security.md).
    adapter_allowed_roots: tuple[str, ...] = setting(
        (),
        kind="paths",
        yaml="adapters.allowed_roots",
        flag="--adapter-allowed-root",
        metavar="DIR",
        shown="any path the caller may read",
        help="directory registered adapters must resolve inside (repeat)",
    )
    adapter_manager_uids: tuple[int, ...] = setting(
        (),
        kind="uids",
        yaml="adapters.manager_uids",
        flag="--adapter-manager-uid",
        metavar="UID",
        reload=True,
        shown="own uid and 0",
        help="uid whose sessions may register, unregister and prefetch adapters (repeat)",
    )
    max_sessions: int = setting(
        4096,
        kind="int",
        yaml="security.max_sessions",
        metavar="N",
        reload=True,
        ge=0,
        note="0 = no limit",
        help="open sessions in all (0: no limit)",
    )
    max_sessions_per_uid: int = setting(
        1024,
        kind="int",
        yaml="security.max_sessions_per_uid",
        metavar="N",
        reload=True,
        ge=0,
        note="0 = no limit",
        help="open sessions owned by one uid (0: no limit)",
    )
    idle_timeout_s: float = setting(
        300.0,
        kind="duration",
        yaml="listeners.idle_timeout",
        flag="--idle-timeout",
        metavar="T",
        ge=1.0,
        le=86400.0,
        unit="seconds",
        help="close a gRPC connection with no call open for this long",
    )
    kv_digest: bool = setting(
        False,
        kind="bool",
        yaml="memory_pool.integrity.kv_digest",
        help="digest keyed objects at commit (VerifyObjects)",
    )
    kv_verify_interval_s: float = setting(
        0.0,
        kind="duration",
        yaml="memory_pool.integrity.kv_verify_interval",
        flag="--kv-verify-interval",
        metavar="T",
        ge=0.0,
        le=86400.0,
        unit="seconds",
        help="with --kv-digest, check one digested object this often in the background (0: off)",
    )
    tier_backend: Literal["none", "valkey", "mooncake"] = setting(
        "none",
        kind="choice",
        yaml="tier.backend",
        help="the tier past one host (docs/tier.md): keyed KV written behind to it, lookups' misses read through",
    )
    tier_valkey_url: str = setting(
        "",
        kind="str",
        yaml="tier.valkey_url",
        metavar="URL",
        shown="none",
        help="with tier.backend valkey: the server (valkey://host:port/0)",
    )
    tier_mooncake_master: str = setting(
        "",
        kind="str",
        yaml="tier.mooncake_master",
        metavar="HOST:PORT",
        shown="none",
        help="with tier.backend mooncake: the Mooncake Store master's RPC address",
    )
    tier_mooncake_metadata: str = setting(
        "P2PHANDSHAKE",
        kind="str",
        yaml="tier.mooncake_metadata",
        metavar="ADDR",
        help="Mooncake's metadata service (P2PHANDSHAKE: none, peers meet through the master)",
    )
    tier_mooncake_segment_size: int = setting(
        1 << 30,
        kind="size",
        yaml="tier.mooncake_segment_size",
        metavar="SIZE",
        ge=1 << 20,
        help="host memory this broker contributes to the Mooncake Store (its share of the fleet's tier)",
    )
    tier_mooncake_tenants: bool = setting(
        False,
        kind="bool",
        yaml="tier.mooncake_tenants",
        help="with tier.backend mooncake: each tenant pool's blocks as a Mooncake tenant named after the pool "
        "(the shared pool: default), in its namespace and under its quota on a master started with "
        "-enable_multi_tenants",
    )
    tier_deadline_s: float = setting(
        1.0,
        kind="duration",
        yaml="tier.deadline",
        flag="--tier-deadline",
        metavar="T",
        ge=0.001,
        le=60.0,
        unit="seconds",
        help="every tier call's answer within this, queueing included; later is a miss",
    )
    tier_queue_depth: int = setting(
        64,
        kind="int",
        yaml="tier.queue_depth",
        metavar="N",
        ge=1,
        le=65536,
        help="tier jobs (batches) that may wait; one more is dropped and counted",
    )
    tier_write: Literal["commit", "evict"] = setting(
        "commit",
        kind="choice",
        yaml="tier.write",
        help="what is written to the tier: commit (keyed KV at commit, and at eviction if not yet written) "
        "or evict (at eviction only)",
    )
    tier_key_prefix: str = setting(
        "mb",
        kind="str",
        yaml="tier.key_prefix",
        metavar="TEXT",
        help="the fleet's prefix of every tier key (then the tenant pool, then the block key)",
    )
    tier_adapters: bool = setting(
        False,
        kind="bool",
        yaml="tier.adapters",
        help="adapters' page images to the tier under content keys, written after a conversion and read "
        "(digest checked) instead of converting the files where this broker has no image of its own",
    )
    tier_lmcache_model: str = setting(
        "",
        kind="str",
        yaml="tier.lmcache_model",
        metavar="NAME",
        shown="none",
        help="share chunks with LMCache nodes through Valkey (docs/tier.md): the model name their keys carry; "
        "set only where this broker's engines are declared equal to theirs",
    )
    tier_lmcache_kv_rank: int = setting(
        0x01000100,
        kind="int",
        yaml="tier.lmcache_kv_rank",
        metavar="N",
        ge=0,
        le=0xFFFFFFFF,
        shown="0x01000100: world size 1, rank 0",
        help="with tier.lmcache_model: the kv_rank LMCache's keys carry (world size and rank, packed)",
    )
    tier_lmcache_chunk_shape: str = setting(
        "",
        kind="str",
        yaml="tier.lmcache_chunk_shape",
        metavar="AxBx...",
        shown="none",
        help="with tier.lmcache_model: the shape of a 256-token chunk in the fleet's layout (2xLAYERSx256xHIDDEN)",
    )
    tier_lmcache_dtype: Literal["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8"] = setting(
        "bfloat16",
        kind="choice",
        yaml="tier.lmcache_dtype",
        help="with tier.lmcache_model: the KV cache's element type",
    )
    max_request_size: int = setting(
        4 << 20,
        kind="size",
        yaml="listeners.max_request_size",
        metavar="SIZE",
        ge=64 << 10,
        le=1 << 30,
        help="largest gRPC request (gRPC's own default); a larger one is refused at its header, unread",
    )
    request_bytes_in_flight: int = setting(
        64 << 20,
        kind="size",
        yaml="listeners.request_bytes_in_flight",
        metavar="SIZE",
        reload=True,
        ge=64 << 10,
        le=16 << 30,
        help="bytes of gRPC requests being handled at once; more are RESOURCE_EXHAUSTED unparsed",
    )
    large_requests: int = setting(
        4,
        kind="int",
        yaml="listeners.large_requests",
        metavar="N",
        reload=True,
        ge=1,
        le=4096,
        help="gRPC requests of 1 MiB or more handled at once; more are RESOURCE_EXHAUSTED unparsed",
    )
    metrics_port: int = setting(
        0,
        kind="int",
        yaml="listeners.metrics_port",
        metavar="N",
        ge=0,
        le=65535,
        shown="0: off",
        help="serve Prometheus metrics on this port",
    )
    metrics_port_per_gpu: bool = setting(
        False,
        kind="bool",
        yaml="listeners.metrics_port_per_gpu",
        help="serve metrics on metrics_port + the GPU's index (one port per broker of a host)",
    )
    metrics_address: str = setting(
        "127.0.0.1",
        kind="str",
        yaml="listeners.metrics_address",
        metavar="ADDR",
        help="address of the metrics endpoint",
    )
    step_thread: bool = setting(
        True,
        kind="bool",
        yaml="listeners.step_thread",
        flag="--no-step-thread",
        help="no effect, kept so that command lines and files naming it still start: the step channel is "
        "served from the event loop (its thread of its own was removed: it starved the loop's other callers)",
    )
    status_interval_s: float = setting(
        1.0,
        kind="duration",
        yaml="status_interval",
        flag="--status-interval",
        metavar="T",
        reload=True,
        ge=0.05,
        le=3600.0,
        unit="seconds",
        help="how often STATUS lines and metric snapshots are refreshed",
    )
    instance: str = setting(
        "",
        kind="str",
        yaml=None,
        shown="none",
        help="name of this broker (systemd instance: GPU index or UUID); in logs",
    )
    # The YAML file the options came from (SIGHUP rereads it): not a setting.
    config_path: str | None = None

    @property
    def fd_socket(self) -> str:
        return self.socket + ".fds"

    def effective_uids(self) -> frozenset[int]:
        """Uids whose processes may prove a session: the configured ones and, always, the
        broker's own and those that manage adapters (the operator's tools run as them)."""
        return frozenset(self.allowed_uids) | {os.getuid()} | self.manager_uids()

    def manager_uids(self) -> frozenset[int]:
        """Uids allowed to manage adapters: as configured, else the broker's own and root's
        (an engine's uid may list and acquire adapters, not register them)."""
        if self.adapter_manager_uids:
            return frozenset(self.adapter_manager_uids)
        return frozenset({os.getuid(), 0})

    def validate(self) -> None:  # type: ignore[override]  (pydantic's deprecated classmethod)
        """Raise SettingError naming the first bad setting (``_check_options``)."""
        _check_options(self)


def _check_tier(opts: ServeOptions) -> None:
    """The tier's address must be set for its backend."""
    if opts.tier_backend == "valkey" and not opts.tier_valkey_url:
        raise SettingError("tier_valkey_url", "is not set; tier.backend valkey needs it (valkey://host:port/0)")
    if opts.tier_backend == "mooncake" and not opts.tier_mooncake_master:
        raise SettingError("tier_mooncake_master", "is not set; tier.backend mooncake needs it (host:port)")
    if opts.tier_adapters and opts.tier_backend == "none":
        raise SettingError("tier_adapters", "is set; adapters' images in the tier need tier.backend")
    if opts.tier_lmcache_model:
        if opts.tier_backend != "valkey":
            raise SettingError("tier_lmcache_model", "is set; sharing with LMCache needs tier.backend valkey")
        if "@" in opts.tier_lmcache_model:
            raise SettingError("tier_lmcache_model", f"{opts.tier_lmcache_model!r} holds '@' (LMCache's separator)")
        lmcache_chunk_bytes(opts)


DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1}


def lmcache_chunk_bytes(opts: ServeOptions) -> int:
    """The bytes of one chunk in the LMCache fleet's layout (``tier.lmcache_chunk_shape``
    and ``tier.lmcache_dtype``); SettingError for a shape that is not positive numbers."""
    try:
        dims = [int(d) for d in opts.tier_lmcache_chunk_shape.lower().split("x")]
    except ValueError:
        dims = []
    if not dims or min(dims) <= 0:
        raise SettingError(
            "tier_lmcache_chunk_shape",
            f"{opts.tier_lmcache_chunk_shape!r} is not a shape like 2x24x256x1024; tier.lmcache_model needs it",
        )
    return math.prod(dims) * DTYPE_BYTES[opts.tier_lmcache_dtype]


def _check_options(opts: ServeOptions) -> None:
    """ServeOptions.validate's checks. Types and single-setting bounds were checked on
    construction; these are the checks that span settings or ask the machine. The arena
    geometry (page, slab, pool) is checked by the one check the arenas use."""
    try:
        check_sizes(opts.page_size, opts.slab_size, opts.pool_size)
    except ValueError as e:
        name, _, detail = str(e).partition(": ")
        raise SettingError(name, detail) from None
    if opts.preallocate < 0 or opts.preallocate > opts.pool_size:
        raise SettingError(
            "preallocate", f"{opts.preallocate} bytes must be between 0 and pool_size ({opts.pool_size})"
        )
    if not opts.low_watermark <= opts.high_watermark:
        raise SettingError(
            "low_watermark", f"{opts.low_watermark}; must be in (0, high_watermark={opts.high_watermark}]"
        )
    if len(opts.fd_socket.encode()) > 107:
        raise SettingError(
            "socket", f"{opts.socket!r} is too long for a Unix socket path (with '.fds', at most 107 bytes)"
        )
    if opts.request_bytes_in_flight < opts.max_request_size:
        raise SettingError(
            "request_bytes_in_flight",
            f"{opts.request_bytes_in_flight} bytes is less than max_request_size ({opts.max_request_size}):"
            " the largest request could never be served",
        )
    _check_tenants(opts)
    _check_tier(opts)
    _check_socket_dir(opts.socket)
    for root in opts.adapter_allowed_roots:
        if not root.startswith("/") or "\x00" in root:
            raise SettingError("adapter_allowed_roots", f"{root!r} is not an absolute path")
    if opts.socket_group is not None:
        import grp

        try:
            grp.getgrnam(opts.socket_group)
        except KeyError:
            raise SettingError("socket_group", f"no group named {opts.socket_group!r} on this machine") from None


def _check_tenants(opts: ServeOptions) -> None:
    """Each tenant pool is whole slabs, and together they leave the shared pool a slab."""
    for name, _, _, size in opts.tenants:
        if size <= 0 or size % opts.slab_size:
            raise SettingError(
                "tenants",
                f"tenants[{name}].bytes = {show('size', size)} must be a positive multiple of "
                f"slab_size ({show('size', opts.slab_size)}): a tenant pool is whole slabs",
            )
    total = sum(t[3] for t in opts.tenants)
    if opts.tenants and total + opts.slab_size > opts.pool_size:
        raise SettingError(
            "tenants",
            f"the tenant pools add up to {show('size', total)}; pool_size ({show('size', opts.pool_size)}) "
            "must exceed that by a slab at least (the shared pool: adapters and sessions of no tenant)",
        )
    if opts.tenants and opts.preallocate + total > opts.pool_size:
        raise SettingError(
            "preallocate",
            f"{show('size', opts.preallocate)} plus the tenant pools ({show('size', total)}) is "
            f"over pool_size ({show('size', opts.pool_size)}); preallocate is the shared pool's part",
        )


def tenant_of(tenants, uid: int, gids: Iterable[int]) -> int:
    """The pool of a process: 1 + the index of the first tenant listing its uid or one of its
    gids, or 0 (the shared pool)."""
    gids = set(gids)
    for i, (_, uids, tgids, _) in enumerate(tenants, 1):
        if uid in uids or gids.intersection(tgids):
            return i
    return 0


def _check_socket_dir(socket: str) -> None:
    """The socket's directory must exist and take new files (the socket, .fds, .lock)."""
    d = os.path.dirname(os.path.abspath(socket))
    if not os.path.isdir(d):
        raise SettingError(
            "socket",
            f"the directory {d} does not exist; create it (mkdir -p {d}) "
            f"or choose a socket path in an existing directory",
        )
    if not os.access(d, os.W_OK | os.X_OK):
        raise SettingError(
            "socket",
            f"cannot create files in {d} (permission denied for uid {os.getuid()}); "
            f"run as a user who may, or choose a socket path in a writable directory",
        )


class SettingError(ConfigError):
    """A bad value of one setting: ``<field>: <what is wrong>``; ``setting`` is the field."""

    def __init__(self, setting: str, detail: str):
        super().__init__(f"{setting}: {detail}")
        self.setting, self.detail = setting, detail


# ----------------------------------------------------------------- the schema, as records


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting as the rest of the daemon sees it (read from ``ServeOptions``' fields)."""

    name: str  # the ServeOptions field
    kind: str  # how it is written (values.KINDS)
    yaml: str | None  # its key in the config file, dotted
    flag: str | None  # its serve flag
    help: str
    metavar: str | None
    reload: bool  # SIGHUP may change it in a running broker
    aliases: tuple[str, ...]  # deprecated YAML keys, still read
    choices: tuple[str, ...]
    shown: str | None  # the default as help text shows it, where showing the value misleads
    note: str
    unit: str
    bounds: tuple[Any, ...]  # pydantic's bound markers (annotated_types Gt/Ge/Lt/Le)

    @property
    def label(self) -> str:
        """How messages name it: ``adapters.hot_tier_adapters (--hot-tier-adapters)``."""
        names = [n for n in (self.yaml, self.flag) if n]
        return f"{names[0]} ({names[1]})" if len(names) == 2 else names[0]

    def default(self) -> Any:
        return ServeOptions.model_fields[self.name].get_default(call_default_factory=True)

    def shown_default(self) -> str:
        return self.shown if self.shown is not None else show(self.kind, self.default())

    def must_be(self) -> str:
        """The bounds in words: ``1..64``, ``in (0, 1]``, ``>= 0 (0 = no limit)``."""
        b = {type(x).__name__: getattr(x, type(x).__name__.lower()) for x in self.bounds}
        lo, hi = b.get("Ge", b.get("Gt")), b.get("Le", b.get("Lt"))
        if lo is not None and hi is not None:
            text = (
                f"{lo:g}..{hi:g}"
                if "Ge" in b and "Le" in b
                else (f"in {'[' if 'Ge' in b else '('}{lo:g}, {hi:g}{']' if 'Le' in b else ')'}")
            )
        elif lo is not None:
            text = f"{'>=' if 'Ge' in b else '>'} {lo:g}"
        else:
            text = f"{'<=' if 'Le' in b else '<'} {hi:g}"
        return text + (f" {self.unit}" if self.unit else "") + (f" ({self.note})" if self.note else "")


def _settings() -> dict[str, Setting]:
    out = {}
    for name, f in ServeOptions.model_fields.items():
        x = f.json_schema_extra
        if not isinstance(x, dict):
            continue  # config_path: not a setting
        flag = x["flag"]
        if flag == _AUTO:
            flag = "--" + name.replace("_", "-")
        choices = tuple(getattr(f.annotation, "__args__", ())) if x["kind"] == "choice" else ()
        bounds = tuple(m for m in f.metadata if type(m).__name__ in ("Gt", "Ge", "Lt", "Le"))  # annotated_types
        out[name] = Setting(
            name,
            x["kind"],
            x["yaml"],
            flag,
            f.description or "",
            x["metavar"],
            x["reload"],
            tuple(x["aliases"]),
            choices,
            x["shown"],
            x["note"],
            x["unit"],
            bounds,
        )
    return out


# Every setting, by field name, in declaration order.
SETTINGS: dict[str, Setting] = _settings()

# Flags that set several settings at once: --adapter-policy sets both tiers' policies (a
# tier's own flag, given too, wins for that tier).
SHORTHANDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "--adapter-policy": (
        "adapter_policy",
        ("adapter_hot_policy", "adapter_warm_policy"),
        f"victim order of both adapter tiers (default {DEFAULT_POLICY})",
    ),
}


def _explain(e: ValidationError) -> SettingError:
    """pydantic's first complaint, as this project words it: ``window_factor: 70; must be 1..64``."""
    err = e.errors()[0]
    name = str(err["loc"][0]) if err["loc"] else "options"
    v = err.get("input")
    s = SETTINGS.get(name)
    if err["type"] == "extra_forbidden":
        return SettingError(name, "not a setting of ServeOptions")
    if s and err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return SettingError(name, f"{v}; must be {s.must_be()}")
    if s and err["type"] == "literal_error":
        return SettingError(name, f"{v!r}; must be one of {', '.join(s.choices)}")
    return SettingError(name, f"{err['msg'].lower()}, got {v!r}")


def socket_mode(opts: ServeOptions) -> int | None:
    """The sockets' mode: as configured; else 0660 when a socket group is set (the engines'
    group can connect, others cannot); else None (the umask decides)."""
    if opts.socket_mode is not None:
        return opts.socket_mode
    return 0o660 if opts.socket_group is not None else None


def adapter_size_limit(opts: ServeOptions) -> int:
    """Most bytes one adapter's tensors may declare: ``adapter_max_bytes``, else what the hot
    tier can hold (the pool, or ``hot_tier_pages`` pages if less): a larger adapter could never
    be loaded, and converting it would only take memory and disk."""
    if opts.adapter_max_bytes:
        return opts.adapter_max_bytes
    hot = opts.hot_tier_pages * opts.page_size if opts.hot_tier_pages else opts.pool_size
    return min(hot, opts.pool_size)


def engine_limits(opts: ServeOptions) -> dict:
    """``engine_pool.engines`` as the engine pool's limits in pages (a floor rounds up, a
    ceiling down, to whole pages)."""
    from memory_broker.broker.store.engine_pool import EngineLimits

    ps = opts.page_size
    return {n: EngineLimits(-(-f // ps), c // ps, w) for n, f, c, w in opts.engines}


def adapter_config(opts: ServeOptions) -> Any:
    """The adapter wing's ``AdapterConfig`` from the options: the one place that maps them
    (its fields carry the YAML leaf names under ``adapters.``)."""
    from memory_broker.broker.adapters import AdapterConfig

    return AdapterConfig(
        dtype=opts.adapter_dtype,
        hot_tier_pages=opts.hot_tier_pages,
        hot_tier_adapters=opts.hot_tier_adapters,
        warm_tier_bytes=opts.warm_tier_bytes,
        warm_int8=opts.warm_int8,
        image_cache=opts.adapter_image_cache,
        image_budget=opts.adapter_image_budget,
        convert_ahead=opts.adapter_convert_ahead,
        hot_policy=opts.adapter_hot_policy,
        warm_policy=opts.adapter_warm_policy,
    )
