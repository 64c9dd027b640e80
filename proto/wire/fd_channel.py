"""The fd side channel's protocol: its framing, its limits and its messages, for both ends.

gRPC cannot carry file descriptors, so the arena's fds travel over a second Unix socket with
``SCM_RIGHTS``. The daemon's server (``broker.doors.fd_channel``) and the client's fetch
(``clients.fd_channel``) both build and read their lines with this module, so the two ends
share one set of limits. Sockets, sessions and fds themselves are the ends' business.

What one fd stands for depends on the arena (``ArenaInfo.backend``): a **slab** on a host
arena (a memfd that maps in any page-aligned part), a **page** on a CUDA arena (one
``cuMemCreate`` allocation per page, exported on demand: only whole allocations map on a
GPU). Both are numbered from 0 and called *units* here. The channel's framing is that of
protocol version 2 (version 1 asked for slabs ``from_slab..end`` and is refused); version 3
(``session.PROTOCOL_VERSION``) adds the session's proof key to the reply header.

Protocol, one request per connection:

* The client connects and sends one JSON line: ``{"token": "<session token>", "first": k,
  "count": n}\n`` (``count`` null or absent: every unit from ``k`` to the arena's end).
* The server reads the peer's credentials (``SO_PEERCRED``, captured at connect time) and
  checks, in order: the uid is in ``allowed_uids`` (``None`` allows any); the request is a
  JSON object with a string ``token``, an integer ``first >= 0`` and a ``count >= 0`` (or
  null); ``authorize(token, peer)`` accepts it; the units exist. Then it sends fds for units
  ``k..k+n-1``, made on demand off its event loop, at most ``MAX_FDS_PER_MESSAGE`` at a time,
  closing its own copies once sent.
* With tenant pools (``security.tenants``) a session is sent fds of its own pool only: a
  to-the-end request is answered with the part of ``k..end`` its pool may map (the reply's
  ``first`` may then be past ``k``, and units before it or after its last are not the
  session's), and an explicit range outside the pool is refused PERMISSION_DENIED.
* Reply: a JSON line ``{"ok": true, "first": k, "count": n, "key": "<proof key>"}\n``, then the fds in chunks of
  at most ``MAX_FDS_PER_MESSAGE``, each chunk one ``sendmsg`` whose payload is ``{"chunk": i,
  "count": m}\n`` so the receiver can check it got them all. A refusal is ``{"ok": false,
  "code": "...", "message": "..."}\n``. Either way the server then closes. ``key`` is the
  session's proof key, sent only to the process that owns the session (the first to present
  its token here); every session-bearing gRPC call carries it (``session.KEY_METADATA``), so
  a token read by another process acts for nothing. Asking for no units (``count`` 0) is how
  a process proves itself and takes the key.
* The receiver owns every fd it receives and should import and close each chunk's fds before
  reading the next (a whole GPU is ~70,000 pages, more than a process may hold open).
"""

from __future__ import annotations

import json
import socket

# The kernel allows 253 fds per message (SCM_MAX_FD); the server stays well under it, and the
# receiver makes room for exactly this many per message.
MAX_FDS_PER_MESSAGE = 200
# What one fd stands for, by arena backend.
UNIT_OF_BACKEND = {"host": "slab", "cuda": "page"}
# Bytes of ancillary data a receiver needs for one message's fds (C ints).
FDS_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * 4)
# A request is a token and a number; anything longer is not a client of ours.
MAX_REQUEST_BYTES = 64 * 1024
# Ends the message of a refusal that is only about how busy the channel is (its connection
# caps): the client library retries those within its timeout instead of failing.
BUSY = "retry shortly"
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


def request_line(token: str, first: int, count: int | None = None) -> bytes:
    """A request for units ``first..first+count-1`` (``count`` None: to the arena's end)."""
    return encode({"token": token, "first": first, "count": count})


def header_line(first: int, count: int, key: str | None = None) -> bytes:
    """A reply header; ``key``: the session's proof key, for its owner process."""
    msg: dict = {"ok": True, "first": first, "count": count}
    if key is not None:
        msg["key"] = key
    return encode(msg)


def chunk_line(index: int, count: int) -> bytes:
    return encode({"chunk": index, "count": count})


def refusal_line(code: str, message: str) -> bytes:
    return encode({"ok": False, "code": code, "message": message})


def parse_request(line: bytes) -> tuple[str, int, int | None]:
    """The ``(token, first, count)`` of a request line (``count`` None: to the end).

    Raises:
        FdChannelError: INVALID_ARGUMENT, saying what is wrong with the line (a version-1
            request, which names ``from_slab``, is told to upgrade).
    """
    try:
        req = json.loads(line)
    except (UnicodeDecodeError, ValueError) as e:
        raise FdChannelError("INVALID_ARGUMENT", f"request is not a JSON line: {e}") from None
    except RecursionError:
        # A line of thousands of nested brackets: Python's parser gives up before its end.
        raise FdChannelError("INVALID_ARGUMENT", "request nests too deeply to be the JSON object asked for") from None
    if not isinstance(req, dict):
        raise FdChannelError("INVALID_ARGUMENT", f"request must be a JSON object, got {type(req).__name__}")
    if "from_slab" in req and "first" not in req:
        raise FdChannelError(
            "INVALID_ARGUMENT",
            'request names "from_slab" (fd channel of protocol version 1, one fd per slab); this broker '
            'speaks version 2 ("first"/"count", one fd per page on a GPU): run a client and a broker from '
            "the same memory-broker release",
        )
    token, first, count = req.get("token"), req.get("first"), req.get("count")
    if not isinstance(token, str):
        raise FdChannelError("INVALID_ARGUMENT", 'request needs "token" (a string)')
    # bool is an int in Python but `true` is not a unit number.
    if not isinstance(first, int) or isinstance(first, bool):
        raise FdChannelError("INVALID_ARGUMENT", 'request needs "first" (an integer)')
    if first < 0:
        raise FdChannelError("INVALID_ARGUMENT", f"first must be >= 0, got {first}")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        raise FdChannelError("INVALID_ARGUMENT", f'"count" must be an integer >= 0 or null, got {count!r}')
    return token, first, count


def parse_reply_line(line: bytes, where: str) -> dict:
    """A reply line as a JSON object; INTERNAL FdChannelError when it is not one."""
    try:
        msg = json.loads(line)
    except ValueError:
        raise FdChannelError("INTERNAL", f"{where}: reply is not JSON: {line[:200]!r}") from None
    if not isinstance(msg, dict):
        raise FdChannelError("INTERNAL", f"{where}: reply is not a JSON object: {line[:200]!r}")
    return msg


def header_count(msg: dict, where: str, first: int, to_end: bool = False) -> int:
    """The fd count a reply header announces; the server's refusal raised as FdChannelError.
    ``to_end``: the request had no count, so the reply may start past ``first`` (tenant pools)."""
    if msg.get("ok") is not True:
        raise FdChannelError(str(msg.get("code", "INTERNAL")), str(msg.get("message", f"refused: {msg}")))
    count, at = msg.get("count"), msg.get("first")
    ok_first = at == first or (to_end and isinstance(at, int) and not isinstance(at, bool) and at > first)
    if not isinstance(count, int) or count < 0 or not ok_first:
        raise FdChannelError("INTERNAL", f"{where}: bad reply header {msg} for first {first}")
    return count


def chunk_count(msg: dict, where: str, expected_index: int) -> int:
    """The fd count of chunk ``expected_index``; the server's refusal mid-reply (it could not
    make the fds) raised as FdChannelError; INTERNAL FdChannelError for any other line."""
    if msg.get("ok") is False:
        raise FdChannelError(str(msg.get("code", "INTERNAL")), str(msg.get("message", f"refused: {msg}")))
    if msg.get("chunk") != expected_index or not isinstance(msg.get("count"), int):
        raise FdChannelError("INTERNAL", f"{where}: expected chunk {expected_index}, got {msg}")
    return msg["count"]
