"""The client's step socket: a blocking, authenticated Unix socket to the broker's step channel.

``StepTransport`` connects, says HELLO with the session token (the broker checks it and this
process's credentials), and sends and receives whole frames of ``memory_broker.proto.wire.step``; one
call at a time (its caller locks), one frame in flight at a time: ``request`` sends a frame and
reads its reply; ``send`` sends one whose reply ``reply`` reads later (a step begun). It knows
nothing of what the frames mean (``path.py``).
"""

from __future__ import annotations

import logging
import socket
import struct
from collections import deque

from memory_broker.proto.wire import step as w

log = logging.getLogger(__name__)

# The read buffer (a step's reply is a few hundred bytes; a larger one grows it for a while).
BUFFER_BYTES = 1 << 16


class StepUnavailable(Exception):
    """The step channel cannot be used (absent, refused the handshake, or broke): use gRPC."""


class StepTransport:
    """A connected, authenticated step socket; one call at a time (the caller locks)."""

    def __init__(self, path: str, token: str, timeout: float | None):
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
        # Replies land here first; ``_buf[_start:_end]`` is read and not yet taken (a reply
        # that came in parts).
        self._buf = bytearray(BUFFER_BYTES)
        self._start = self._end = 0
        # The frame whose reply is unread (``send``'s, at most one), as None.
        self._queue: deque = deque()
        # The same deque, read by the session before a gRPC call (``BrokerSession._settle``:
        # its truth, in C, says whether anything is unread, with no call into this module).
        self.unread_frames: deque = self._queue
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
        """Send one frame and read its reply (no other may be in flight: the caller reads a
        begun one's first). Raises StepUnavailable when the socket breaks."""
        self.send(data)
        return self.reply()

    def send(self, data: bytes) -> None:
        """Send one frame; its reply is read by ``reply()``."""
        try:
            self._sock.sendall(data)
        except OSError as e:
            raise self._broke(e) from None
        self._queue.append(None)

    def unread(self) -> int:
        """Frames sent whose replies are not read yet (0 or 1)."""
        return len(self._queue)

    def reply(self) -> w.StepReply:
        """Read the reply to the frame in flight (``send``'s)."""
        if self._queue:
            self._queue.popleft()
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
        """The socket broke: closed."""
        self.close()
        if isinstance(e, BlockingIOError):  # the kernel's SO_RCVTIMEO/SO_SNDTIMEO ran out
            return StepUnavailable(f"the step channel at {self.path} did not answer within {self.timeout:g} s")
        return StepUnavailable(f"the step channel at {self.path} broke: {e}")

    def close(self) -> None:
        """Close the socket."""
        self.closed = True
        self._sock.close()
        self._queue.clear()
        self._start = self._end = 0

    def fileno(self) -> int:
        """The socket's descriptor (to wait for a reply with poll; -1 once closed)."""
        return self._sock.fileno()
