"""The systemd notify protocol, spoken directly: READY, STATUS, WATCHDOG, STOPPING datagrams.

Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op. The watchdog is pinged from
a task on the event loop itself, so a wedged loop stops the pings and systemd restarts the
daemon. No library: the protocol is one datagram per message.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, env: dict[str, str] | None = None):
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        # A leading '@' names the abstract namespace.
        self.address = ("\0" + addr[1:]) if addr.startswith("@") else addr
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # systemd sets WATCHDOG_PID for the main process; honour it when present.
        self.watchdog_usec = int(usec) if usec.isdigit() and (not pid or pid == str(os.getpid())) else 0

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def watchdog_interval_s(self) -> float:
        """How often to ping: half the watchdog timeout, or 0 when no watchdog is set."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else 0.0

    def send(self, *fields: str) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
            return True
        except OSError:
            # systemd gone or socket full: nothing useful to do but keep serving.
            return False

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *((f"STATUS={status}",) if status else ()), f"MAINPID={os.getpid()}")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def reloading(self) -> bool:
        return self.send("RELOADING=1")

    def stopping(self, status: str = "") -> bool:
        return self.send("STOPPING=1", *((f"STATUS={status}",) if status else ()))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
