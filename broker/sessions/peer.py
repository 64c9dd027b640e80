"""Who is on the other end of a Unix socket, and the refusal an fd request gets.

The session layer decides who may fetch fds (``SessionManager.authorize_fd_request``); the fd
channel (``memory_broker.broker.doors.fd_channel``) asks it, with the peer's kernel-reported
credentials, and sends the refusal it raises.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from memory_broker.proto.wire.fd_channel import FdChannelError


@dataclass(frozen=True, slots=True)
class PeerCred:
    """The connecting process as the kernel saw it at connect time (``SO_PEERCRED``)."""

    # 0 when the peer is in a pid namespace this process cannot see.
    pid: int
    uid: int
    gid: int


class FdRequestRefused(FdChannelError):
    """Raised by an authorize callback: code is one of "PERMISSION_DENIED", "NOT_FOUND",
    "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"."""

    def __repr__(self) -> str:
        return f"FdRequestRefused({self.code}, {self.message!r})"


def peer_cred(sock: socket.socket) -> PeerCred:
    """The credentials of a connected Unix socket's peer."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return PeerCred(pid, uid, gid)
