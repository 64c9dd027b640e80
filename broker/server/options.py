"""What ``memory-broker serve`` is told: every setting with its default, checked at start.

Sizes are binary and written the way people write them ("2MiB", "1GiB", "512KiB", "1G", or
plain bytes); "1GB" is refused with a hint rather than guessed. A bad value is refused with
a message that names the setting.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from memory_broker.broker.adapters.policy import DEFAULT_POLICY, POLICIES
from memory_broker.wire.arena import check_sizes, format_size  # format_size: re-exported for the CLI

# Binary units only: a GPU page is 2 MiB, not 2 MB. The single letters (1G, 512K) are binary
# too, as in most memory flags; kB/MB/GB/TB are refused because they mean powers of ten to
# some readers and powers of two to others, and a pool size is no place to guess.
_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tib": 1 << 40,
}  # fmt: skip
_DECIMAL = {"kb": "KiB", "mb": "MiB", "gb": "GiB", "tb": "TiB"}

LOG_FORMATS = ("auto", "console", "json")

DEFAULT_SOCKET = os.environ.get("MEMORY_BROKER_SOCKET", "/tmp/memory-broker.sock")


def parse_size(text: str | int, what: str | None = None) -> int:
    """'2MiB' -> 2097152: bytes, or a number with K/KiB, M/MiB, G/GiB or T/TiB (binary).

    Raises:
        ValueError: not a size, a decimal unit (GB), or not a whole number of bytes; the
            message starts with ``what:`` when given.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    head = f"{what}: " if what else ""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if m and m.group(2).lower() in _DECIMAL:
        unit = _DECIMAL[m.group(2).lower()]
        raise ValueError(
            f"{head}{text!r}: decimal units (kB, MB, GB, TB) are not accepted; sizes are binary: "
            f"write {m.group(1)}{unit} ({m.group(1)} x 2^{_UNITS[unit.lower()].bit_length() - 1} bytes) "
            f"or a number of bytes"
        )
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{head}cannot read {text!r} as a size; write e.g. 2MiB, 512KiB, 1GiB or a number of bytes")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n != int(n):
        raise ValueError(f"{head}{text!r} is not a whole number of bytes ({n:g})")
    return int(n)


@dataclass(slots=True)
class ServeOptions:
    # gRPC Unix socket; the fd side channel listens at this path + ".fds".
    socket: str = DEFAULT_SOCKET
    # Optional loopback TCP port for gRPC (0 = none).
    tcp_port: int = 0
    # auto | host | cuda
    arena: str = "auto"
    # CUDA device: index ("0") or UUID ("GPU-..."); sockets and state are best keyed by UUID.
    device: str = "0"
    # Most memory the arena may hold, and how much of it to create at start.
    pool_size: int = 1 << 30
    preallocate: int = 0
    page_size: int = 2 << 20
    slab_size: int = 64 << 20
    # Virtual window size as a multiple of pool_size.
    window_factor: int = 4
    # best_fit | first_fit (placement of contiguous ranges in the window).
    placement: str = "best_fit"
    eviction_policy: str = "lru_size_aware"
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    default_lease_s: float = 30.0
    # Where persistent state lives (the adapter registry of a later version); created if missing.
    state_dir: str = field(default_factory=lambda: os.environ.get("MEMORY_BROKER_STATE_DIR", "/tmp/memory-broker-state"))
    # uids allowed on the fd channel; empty = the broker's own uid only.
    allowed_uids: tuple[int, ...] = ()
    # Serve the bare Echo service beside the broker (benchmarks).
    enable_echo: bool = False
    # Seconds SIGTERM waits for in-flight calls.
    grace_s: float = 10.0
    log_level: str = "info"
    # auto (human-readable on a terminal, JSON lines otherwise) | console | json
    log_format: str = "auto"
    # Most pins one session may hold at once (0 = no limit).
    max_pins_per_session: int = 0
    # Permissions for the two sockets (None: follow the umask) and their group (engines').
    socket_mode: int | None = None
    socket_group: str | None = None
    # LoRA adapters: storage dtype of hot rows (what the kernels read), the largest rank
    # accepted at registration, tier budgets (0 = bounded only by the pool for hot), int8
    # warm images, and each tier's victim policy (adaptive, lru, lfu, gdsf).
    adapter_dtype: str = "bfloat16"
    adapter_max_rank: int = 256
    hot_tier_pages: int = 0
    hot_tier_adapters: int = 0
    warm_tier_bytes: int = 4 << 30
    warm_int8: bool = False
    # Keep converted page images in STATE_DIR/images so later cold loads are a plain read;
    # the disk they may take (0 = no limit); convert registered adapters ahead of use.
    adapter_image_cache: bool = True
    adapter_image_budget: int = 64 << 30
    adapter_convert_ahead: bool = True
    adapter_hot_policy: str = DEFAULT_POLICY
    adapter_warm_policy: str = DEFAULT_POLICY
    # Security (see README "Security"): directories registered adapters must resolve inside
    # (empty: wherever the caller may read); uids whose sessions may register, unregister and
    # prefetch adapters (empty: the broker's own uid and the allowed uids); open sessions in
    # all and per uid (0: no limit); seconds a gRPC connection with no call open is kept.
    adapter_allowed_roots: tuple[str, ...] = ()
    adapter_manager_uids: tuple[int, ...] = ()
    max_sessions: int = 4096
    max_sessions_per_uid: int = 1024
    idle_timeout_s: float = 300.0
    # Prometheus endpoint (0 = off).
    metrics_port: int = 0
    metrics_address: str = "127.0.0.1"
    # How often STATUS lines and metric snapshots are refreshed.
    status_interval_s: float = 1.0
    # Name of this broker (the systemd instance, e.g. a GPU index or UUID); in logs.
    instance: str = ""
    # The YAML file the options came from (SIGHUP rereads it).
    config_path: str | None = None

    @property
    def fd_socket(self) -> str:
        return self.socket + ".fds"

    def effective_uids(self) -> frozenset[int]:
        return frozenset(self.allowed_uids) if self.allowed_uids else frozenset({os.getuid()})

    def _check_socket_dir(self) -> None:
        """The socket's directory must exist and take new files (the socket, .fds, .lock)."""
        d = os.path.dirname(os.path.abspath(self.socket))
        if not os.path.isdir(d):
            raise ValueError(
                f"socket: the directory {d} does not exist; create it (mkdir -p {d}) "
                f"or choose a socket path in an existing directory"
            )
        if not os.access(d, os.W_OK | os.X_OK):
            raise ValueError(
                f"socket: cannot create files in {d} (permission denied for uid {os.getuid()}); "
                f"run as a user who may, or choose a socket path in a writable directory"
            )

    def manager_uids(self) -> frozenset[int]:
        """Uids allowed to manage adapters: as configured, else the broker's and the allowed ones."""
        if self.adapter_manager_uids:
            return frozenset(self.adapter_manager_uids)
        return self.effective_uids() | {os.getuid()}

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        check_sizes(self.page_size, self.slab_size, self.pool_size)
        if self.preallocate < 0 or self.preallocate > self.pool_size:
            raise ValueError(f"preallocate: {self.preallocate} bytes must be between 0 and pool_size ({self.pool_size})")
        if not 1 <= self.window_factor <= 64:
            raise ValueError(f"window_factor: {self.window_factor}; must be 1..64")
        if self.placement not in ("best_fit", "first_fit"):
            raise ValueError(f"placement: {self.placement!r}; must be best_fit or first_fit")
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"high_watermark: {self.high_watermark}; must be in (0, 1]")
        if not 0.0 < self.low_watermark <= self.high_watermark:
            raise ValueError(
                f"low_watermark: {self.low_watermark}; must be in (0, high_watermark={self.high_watermark}]"
            )
        if not 0 < self.default_lease_s <= 600:
            raise ValueError(f"default_lease_s: {self.default_lease_s}; must be in (0, 600]")
        if not 0 <= self.tcp_port <= 65535:
            raise ValueError(f"tcp_port: {self.tcp_port}; must be 0..65535")
        if len(self.fd_socket.encode()) > 107:
            raise ValueError(f"socket: {self.socket!r} is too long for a Unix socket path (with '.fds', at most 107 bytes)")
        self._check_socket_dir()
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format: {self.log_format!r}; must be {', '.join(LOG_FORMATS)}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s: {self.grace_s}; must be >= 0")
        if self.max_pins_per_session < 0:
            raise ValueError(f"max_pins_per_session: {self.max_pins_per_session}; must be >= 0 (0 = no limit)")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: {self.metrics_port}; must be 0..65535")
        if not 0.05 <= self.status_interval_s <= 3600:
            raise ValueError(f"status_interval_s: {self.status_interval_s}; must be 0.05..3600 seconds")
        if self.adapter_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"adapter_dtype: {self.adapter_dtype!r}; must be bfloat16, float16 or float32")
        if not 1 <= self.adapter_max_rank <= 4096:
            raise ValueError(f"adapter_max_rank: {self.adapter_max_rank}; must be 1..4096")
        for name in ("hot_tier_pages", "hot_tier_adapters", "warm_tier_bytes", "adapter_image_budget"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: {getattr(self, name)}; must be >= 0")
        for name in ("adapter_hot_policy", "adapter_warm_policy"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name}: {getattr(self, name)!r}; must be one of {', '.join(POLICIES)}")
        for name in ("max_sessions", "max_sessions_per_uid"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: {getattr(self, name)}; must be >= 0 (0 = no limit)")
        if not 1 <= self.idle_timeout_s <= 86400:
            raise ValueError(f"idle_timeout_s: {self.idle_timeout_s}; must be 1..86400 seconds")
        for root in self.adapter_allowed_roots:
            if not root.startswith("/") or "\x00" in root:
                raise ValueError(f"adapter_allowed_roots: {root!r} is not an absolute path")
        if self.socket_group is not None:
            import grp

            try:
                grp.getgrnam(self.socket_group)
            except KeyError:
                raise ValueError(f"socket_group: no group named {self.socket_group!r} on this machine") from None
