"""The client's step socket: a blocking, authenticated Unix socket to the broker's step channel.

``StepTransport`` connects, says HELLO with the session token (the broker checks it and this
process's credentials), and sends and receives whole frames of ``memory_broker.proto.wire.step``; one
call at a time (its caller locks). It knows nothing of what the frames mean (``path.py``).

Replies come in the order the frames went out, so a frame need not wait for its own: a
*posted* frame (``post``: a give-back, whose reply says only whether it ran) goes out and its
reply is read later, before the next awaited reply (``request``, ``reply``), when
``POST_LIMIT`` are unread (``read_oldest``), or by ``settle``. The unread replies are one
ordered queue: posted frames, and at most one awaited frame (``send``'s, a step begun) among
them. A read may take several replies at once; they wait in the buffer. A posted frame the
broker refused, or that the channel broke before answering, is logged at WARNING and kept in
``refused`` (a list the client passes in and raises from: ``BrokerClient.flush``).
"""

from __future__ import annotations

import logging
import socket
import struct
from collections import deque

from memory_broker.proto.wire import step as w
from memory_broker.proto.wire.errors import BrokerError, Code

log = logging.getLogger(__name__)

# Posted frames unread at most: past this, the oldest reply is read before another is posted
# (a few hundred bytes of replies at most wait in the socket, far below what makes the broker
# stop reading this connection, which it does for a client that does not read its replies).
POST_LIMIT = 16
# The read buffer (a step's reply is a few hundred bytes; a larger one grows it for a while).
BUFFER_BYTES = 1 << 16
_HEADER_AT = w.HEADER.unpack_from
_OK = w.OK


def raise_refused(refused: list[BrokerError]) -> None:
    """Raise (and forget) the refusals of posted frames in ``refused``: the first, saying how
    many more there were (each was logged when its reply was read)."""
    n = len(refused)
    if not n:  # another thread raised them meanwhile
        return
    first = refused[0]
    del refused[:n]
    more = f" (and {n - 1} more posted give-backs refused: see the log)" if n > 1 else ""
    raise BrokerError(first.code, first.message + more)


class StepUnavailable(Exception):
    """The step channel cannot be used (absent, refused the handshake, or broke): use gRPC."""


class StepTransport:
    """A connected, authenticated step socket; one call at a time (the caller locks)."""

    def __init__(self, path: str, token: str, timeout: float | None, refused: list | None = None):
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            raise StepUnavailable(f"no step channel at {path}: {e}") from None
        # A blocking socket whose sends and receives the kernel times out: a Python-level
        # timeout polls before every send and receive (two more syscalls a round trip, 15-20 us
        # of a PING's 50-80 on the development VM); SO_RCVTIMEO/SO_SNDTIMEO cost nothing per call.
        sock.settimeout(None)
        if timeout is not None:  # None: no deadline, as for the client's RPCs
            whole = int(timeout)
            tv = struct.pack("ll", whole, int((timeout - whole) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.timeout = timeout
        self._sock = sock
        # Whether ``close()`` ran (a plain field: the session's calls ask before every call).
        self.closed = False
        # Replies decoded to the records made before from the same bytes (``ReplyDecoder``).
        self.decode = w.ReplyDecoder()
        # Replies land here first; ``_buf[_start:_end]`` is read and not yet taken (replies
        # that came with an earlier one's read).
        self._buf = bytearray(BUFFER_BYTES)
        self._start = self._end = 0
        # The frames whose replies are unread, in order: a posted frame's (ops, own) (its ops
        # as (kind, items, ...) tuples; a refusal of one of the first ``own`` is kept to raise),
        # or None for the awaited one (``send``'s).
        self._queue: deque = deque()
        # The same deque, read by the session before a gRPC call (``BrokerSession._settle``:
        # its truth, in C, says whether anything is unread, with no call into this module).
        self.unread_frames: deque = self._queue
        # Posted frames refused or not answered, as BrokerErrors (the client raises them).
        self.refused: list[BrokerError] = refused if refused is not None else []
        try:
            reply = self.request(w.frame(w.HELLO, token.encode()))
        except BaseException:
            sock.close()
            raise
        if reply.error is not None:
            sock.close()
            raise StepUnavailable(f"the step channel refused this session: {reply.error}")
        self.arena_slabs = reply.arena_slabs

    def request(self, data: bytes) -> w.StepReply:
        """Send one frame and read its reply (after the replies of frames posted before it).
        Raises StepUnavailable when the socket breaks. No awaited frame may be in flight
        (``send``'s: the caller collects it first)."""
        if self._queue or self._end:
            return self._after_posted(data)
        sock = self._sock
        buf = self._buf
        try:
            sock.sendall(data)
            # One read takes the whole of a usual reply (``reply``, inline: the round trip is
            # the fixed cost of every frame, and this the whole of it in the usual case).
            got = sock.recv_into(buf)
        except OSError as e:
            raise self._broke(e) from None
        try:
            reply = self.decode.frame(buf, got)
        except Exception:  # noqa: BLE001 (read it the reference way, which says what is wrong)
            reply = None
        if reply is not None:
            return reply
        self._end = got
        return self._read_reply()

    def _after_posted(self, data: bytes) -> w.StepReply:
        """``request`` behind posted frames: sent at once, the posted replies read first. The
        usual case (every reply in one read, the posted ones OK) in one pass here."""
        sock = self._sock
        buf = self._buf
        queue = self._queue
        try:
            sock.sendall(data)
            if not self._end:
                got = self._end = sock.recv_into(buf)
                pos = 0
                unpack = _HEADER_AT
                while queue and got - pos >= 5:
                    size, kind = unpack(buf, pos)
                    stop = pos + 5 + size
                    if stop > got or kind != _OK:
                        break
                    queue.popleft()
                    pos = stop
                self._start = pos
                if not queue and got - pos >= 5 and unpack(buf, pos)[0] == got - pos - 5:
                    # The usual case: what is left is the reply, whole: one native decode.
                    try:
                        reply = self.decode.frame(memoryview(buf)[pos:got] if pos else buf, got - pos)
                    except Exception:  # noqa: BLE001 (read it the reference way, which says what is wrong)
                        reply = None
                    if reply is not None:
                        self._start = self._end = 0
                        return reply
        except OSError as e:
            raise self._broke(e) from None
        while queue:
            self._read_posted(queue.popleft())
        return self._read_reply()

    def send(self, data: bytes) -> None:
        """Send one frame; its reply is read by ``reply()`` (replies come in order)."""
        try:
            self._sock.sendall(data)
        except OSError as e:
            raise self._broke(e) from None
        self._queue.append(None)

    def post(self, data: bytes, ops: list, own: int = -1) -> None:
        """Send a give-back whose reply nobody waits for (``ops``: the frame's ops as tuples,
        for a refusal's message): read before the next awaited reply, by ``read_oldest``, or by
        ``settle``. A refusal of one of its first ``own`` ops (all of them: -1) is logged and
        kept in ``refused``; of a later one (a give-back nobody asked for: idle holdings, a
        failed call's cleanup), logged only. The caller keeps fewer than ``POST_LIMIT``
        unread (``full``)."""
        try:
            self._sock.sendall(data)
        except OSError as e:
            raise self._broke(e) from None
        self._queue.append((ops, len(ops) if own < 0 else own))

    def full(self) -> bool:
        """Whether ``POST_LIMIT`` replies are unread (read the oldest before posting more)."""
        return len(self._queue) >= POST_LIMIT

    def unread(self) -> int:
        """Frames sent whose replies are not read yet (posted or awaited)."""
        return len(self._queue)

    def read_oldest(self) -> bool:
        """Read the oldest unread reply if it is a posted frame's; False (nothing read) if
        it is the awaited one (``reply()`` reads it, for the step that sent it)."""
        queue = self._queue
        if not queue or queue[0] is None:
            return False
        self._read_posted(queue.popleft())
        return True

    def settle(self) -> None:
        """Read every posted frame's reply (none awaited may be in flight)."""
        queue = self._queue
        while queue and queue[0] is not None:
            self._read_posted(queue.popleft())

    def reply(self) -> w.StepReply:
        """Read the reply to the awaited frame (``send``'s), after those of the frames
        posted before it (replies come in order; those posted after it stay unread)."""
        queue = self._queue
        while queue:
            what = queue.popleft()
            if what is None:
                break
            self._read_posted(what)
        if self._end:
            return self._read_reply()
        sock = self._sock
        buf = self._buf
        try:
            # One read takes the whole of a usual reply; larger ones are read to their end.
            got = sock.recv_into(buf)
        except OSError as e:
            raise self._broke(e) from None
        # The usual reply: one whole OK frame, decoded from the buffer in one native call.
        try:
            reply = self.decode.frame(buf, got)
        except Exception:  # noqa: BLE001 (read it the reference way below, which says what is wrong)
            reply = None
        if reply is not None:
            return reply
        self._end = got
        return self._read_reply()

    # ------------------------------------------------------------ the read buffer

    def _read_reply(self) -> w.StepReply:
        """The awaited reply, from the buffer (``buf[_start:_end]``, read to its end as needed):
        the native decode, else the reference one (which says what is wrong)."""
        try:
            kind, size = self._whole()
        except OSError as e:
            raise self._broke(e) from None
        start = self._start
        stop = start + 5 + size
        if stop < self._end and not self._queue:
            e = ConnectionResetError(f"{self._end - stop} bytes after a reply no request asked for")
            raise self._broke(e)
        buf = self._buf
        view = memoryview(buf)
        try:
            reply = self.decode.frame(view[start:stop] if start else buf, stop - start)
        except Exception:  # noqa: BLE001 (read it the reference way below, which says what is wrong)
            reply = None
        if reply is None:
            body = bytes(view[start + 5 : stop])
        view.release()
        self._consumed(stop)
        if reply is not None:
            return reply
        try:
            return self.decode(kind, body)
        except w.WireError as e:
            self.close()
            raise StepUnavailable(f"the step channel at {self.path} sent a malformed reply: {e}") from None

    def _read_posted(self, what: tuple) -> None:
        """Read a posted give-back's reply (``what``: its queue entry, (ops, own)): nothing to
        hand back when it ran; a refusal is logged and, of one of its ``own`` ops, kept for
        the client (``refused``) to raise."""
        try:
            kind, size = self._whole()
        except OSError as e:
            self._queue.appendleft(what)
            raise self._broke(e) from None
        start = self._start
        stop = start + 5 + size
        if kind != w.OK:
            try:
                reply = w.decode_step_reply(kind, bytes(self._buf[start + 5 : stop]))
            except w.WireError as e:
                self._consumed(stop)
                self.close()
                raise StepUnavailable(f"the step channel at {self.path} sent a malformed reply: {e}") from None
            ops, own = what
            i = reply.failed_index if 0 <= reply.failed_index < len(ops) else 0
            self._refuse(ops[i], reply.error, keep=i < own)
        self._consumed(stop)

    def _refuse(self, what: tuple, error: BrokerError | None, unknown: bool = False, keep: bool = True) -> None:
        """Log a posted op's refusal (``what``: the op, an ``Op`` or its fields; ``unknown``:
        the channel broke before its reply), kept in ``refused`` with ``keep``."""
        kind, given = (what.kind, what.items) if isinstance(what, w.Op) else what[:2]
        op = w.OP_NAMES.get(kind, kind)
        items = list(given[:8])  # the first few say which (a give-back may name thousands)
        if len(given) > 8:
            items.append(f"... {len(given)} in all")
        if unknown:
            text = f"the step channel broke before the broker answered a posted {op} of {items}: it may not have run"
        else:
            text = f"a posted {op} of {items} was refused: {error.message}"
        if not keep:
            log.warning("step channel: %s (not raised: nobody asked for it)", text)
            return
        log.warning("step channel: %s", text)
        self.refused.append(BrokerError(error.code if error is not None else Code.UNAVAILABLE, text))

    def _whole(self) -> tuple[int, int]:
        """The next reply's (kind, body size), its whole frame buffered at ``_start``."""
        while self._end - self._start < 5:
            self._more(5)
        size, kind = w.HEADER.unpack_from(self._buf, self._start)
        if size > w.MAX_FRAME_BYTES:
            raise ConnectionResetError(f"reply of {size} bytes")
        while self._end - self._start < 5 + size:
            self._more(5 + size)
        return kind, size

    def _more(self, need: int) -> None:
        """Read more of the socket into the buffer, where a frame of ``need`` bytes from
        ``_start`` fits (moved to the front, or a larger buffer, as needed)."""
        buf = self._buf
        start, end = self._start, self._end
        if start + need > len(buf):
            if need > len(buf):
                grown = bytearray(max(need, len(buf)))
                grown[: end - start] = buf[start:end]
                self._buf = buf = grown
            else:
                buf[: end - start] = buf[start:end]
            self._start, self._end = 0, end - start
        with memoryview(buf) as view:
            n = self._sock.recv_into(view[self._end :])
        if not n:
            raise ConnectionResetError("the broker closed the step channel")
        self._end += n

    def _consumed(self, stop: int) -> None:
        """The buffer read up to ``stop``; empty again once all of it was read."""
        if stop >= self._end:
            self._start = self._end = 0
            if len(self._buf) > BUFFER_BYTES:
                self._buf = bytearray(BUFFER_BYTES)
        else:
            self._start = stop

    def _broke(self, e: OSError) -> StepUnavailable:
        """The socket broke: closed, and the posted give-backs it did not answer reported
        (``refused``: whether the broker ran them is not known)."""
        self.close()
        if isinstance(e, BlockingIOError):  # the kernel's SO_RCVTIMEO/SO_SNDTIMEO ran out
            return StepUnavailable(f"the step channel at {self.path} did not answer within {self.timeout:g} s")
        return StepUnavailable(f"the step channel at {self.path} broke: {e}")

    def close(self) -> None:
        """Close the socket; posted give-backs not answered yet are reported (``refused``)."""
        self.closed = True
        self._sock.close()
        queue = self._queue
        while queue:
            what = queue.popleft()
            if what is not None:
                ops, own = what
                for i, op in enumerate(ops):  # each may not have run
                    self._refuse(op, None, unknown=True, keep=i < own)
        self._start = self._end = 0

    def fileno(self) -> int:
        """The socket's descriptor (to wait for a reply with poll; -1 once closed)."""
        return self._sock.fileno()
