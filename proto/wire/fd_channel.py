"""The fd side channel's protocol: its framing, its limits and its messages, for both ends.

gRPC cannot carry file descriptors, so slab fds travel over a second Unix socket with
``SCM_RIGHTS``. The daemon's server (``broker.sessions.fd_channel``) and the client's fetch
(``clients.fd_channel``) both build and read their lines with this module, so the two ends
share one set of limits. Sockets, sessions and fds themselves are the ends' business.

Protocol, one request per connection:

* The client connects and sends one JSON line: ``{"token": "<session token>", "from_slab": k}\\n``.
* The server reads the peer's credentials (``SO_PEERCRED``, captured at connect time) and
  checks, in order: the uid is in ``allowed_uids`` (``None`` allows any); the request is a
  JSON object with a string ``token`` and an integer ``from_slab >= 0``; ``authorize(token,
  peer)`` accepts it; then it sends the fds of slabs ``k..end`` from ``slab_fds(k)``.
* Reply: a JSON line ``{"ok": true, "from_slab": k, "count": n}\\n``, then the fds in
  chunks of at most ``MAX_FDS_PER_MESSAGE``, each chunk one ``sendmsg`` whose payload is
  ``{"chunk": i, "count": m}\\n`` so the receiver can check it got them all. A refusal is
  ``{"ok": false, "code": "...", "message": "..."}\\n``. Either way the server then closes.
"""

from __future__ import annotations

import json
import socket

# The kernel allows 253 fds per message (SCM_MAX_FD); the server stays well under it, and the
# receiver makes room for exactly this many per message.
MAX_FDS_PER_MESSAGE = 200
# Bytes of ancillary data a receiver needs for one message's fds (C ints).
FDS_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * 4)
# A request is a token and a number; anything longer is not a client of ours.
MAX_REQUEST_BYTES = 64 * 1024
# How much a receiver reads at once (reply lines are a few dozen bytes).
RECV_BYTES = 64 * 1024


class FdChannelError(Exception):
    """A refused or failed fd exchange: ``code`` names the gRPC status it stands for
    ("PERMISSION_DENIED", "INVALID_ARGUMENT", "UNAVAILABLE", "INTERNAL" ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"FdChannelError({self.code}, {self.message!r})"


def encode(obj: dict) -> bytes:
    """One protocol line."""
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def request_line(token: str, from_slab: int) -> bytes:
    return encode({"token": token, "from_slab": from_slab})


def header_line(from_slab: int, count: int) -> bytes:
    return encode({"ok": True, "from_slab": from_slab, "count": count})


def chunk_line(index: int, count: int) -> bytes:
    return encode({"chunk": index, "count": count})


def refusal_line(code: str, message: str) -> bytes:
    return encode({"ok": False, "code": code, "message": message})


def parse_request(line: bytes) -> tuple[str, int]:
    """The ``(token, from_slab)`` of a request line.

    Raises:
        FdChannelError: INVALID_ARGUMENT, saying what is wrong with the line.
    """
    try:
        req = json.loads(line)
    except (UnicodeDecodeError, ValueError) as e:
        raise FdChannelError("INVALID_ARGUMENT", f"request is not a JSON line: {e}") from None
    if not isinstance(req, dict):
        raise FdChannelError("INVALID_ARGUMENT", f"request must be a JSON object, got {type(req).__name__}")
    token, from_slab = req.get("token"), req.get("from_slab")
    if not isinstance(token, str):
        raise FdChannelError("INVALID_ARGUMENT", 'request needs "token" (a string)')
    # bool is an int in Python but `true` is not a slab number.
    if not isinstance(from_slab, int) or isinstance(from_slab, bool):
        raise FdChannelError("INVALID_ARGUMENT", 'request needs "from_slab" (an integer)')
    if from_slab < 0:
        raise FdChannelError("INVALID_ARGUMENT", f"from_slab must be >= 0, got {from_slab}")
    return token, from_slab


def parse_reply_line(line: bytes, where: str) -> dict:
    """A reply line as a JSON object; INTERNAL FdChannelError when it is not one."""
    try:
        msg = json.loads(line)
    except ValueError:
        raise FdChannelError("INTERNAL", f"{where}: reply is not JSON: {line[:200]!r}") from None
    if not isinstance(msg, dict):
        raise FdChannelError("INTERNAL", f"{where}: reply is not a JSON object: {line[:200]!r}")
    return msg


def header_count(msg: dict, where: str, from_slab: int) -> int:
    """The fd count a reply header announces; the server's refusal raised as FdChannelError."""
    if msg.get("ok") is not True:
        raise FdChannelError(str(msg.get("code", "INTERNAL")), str(msg.get("message", f"refused: {msg}")))
    count = msg.get("count")
    if not isinstance(count, int) or count < 0 or msg.get("from_slab") != from_slab:
        raise FdChannelError("INTERNAL", f"{where}: bad reply header {msg} for from_slab {from_slab}")
    return count


def chunk_count(msg: dict, where: str, expected_index: int) -> int:
    """The fd count of chunk ``expected_index``; INTERNAL FdChannelError for any other line."""
    if msg.get("chunk") != expected_index or not isinstance(msg.get("count"), int):
        raise FdChannelError("INTERNAL", f"{where}: expected chunk {expected_index}, got {msg}")
    return msg["count"]
