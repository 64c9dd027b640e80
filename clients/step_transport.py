"""The client's step socket: a blocking, authenticated Unix socket to the broker's step channel.

``StepTransport`` connects, says HELLO with the session token (the broker checks it and this
process's credentials), and sends and receives whole frames of ``memory_broker.proto.wire.step``; one
call at a time (its caller locks). It knows nothing of what the frames mean (``step.py``).
"""

from __future__ import annotations

import socket
import struct

from memory_broker.proto.wire import step as w


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
        # Replies land here first (a step's reply is a few hundred bytes).
        self._buf = bytearray(1 << 16)
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
        """Send one frame and read its reply. Raises StepUnavailable when the socket breaks."""
        sock = self._sock
        buf = self._buf
        try:
            sock.sendall(data)
            # One read takes the whole of a usual reply (``reply``, inline: the round trip is
            # the fixed cost of every frame, and this the whole of it in the usual case).
            got = sock.recv_into(buf)
        except OSError as e:
            self.close()
            raise self._broke(e) from None
        try:
            reply = self.decode.frame(buf, got)
        except Exception:  # noqa: BLE001 (read it the reference way, which says what is wrong)
            reply = None
        if reply is not None:
            return reply
        return self._rest(sock, buf, got)

    def send(self, data: bytes) -> None:
        """Send one frame; its reply is read by ``reply()`` (replies come in order)."""
        try:
            self._sock.sendall(data)
        except OSError as e:
            self.close()
            raise self._broke(e) from None

    def reply(self) -> w.StepReply:
        """Read the reply to the oldest frame not yet answered (at most one is in flight,
        so nothing after it is on the socket)."""
        sock = self._sock
        buf = self._buf
        try:
            # One read takes the whole of a usual reply; larger ones are read to their end.
            got = sock.recv_into(buf)
        except OSError as e:
            self.close()
            raise self._broke(e) from None
        # The usual reply: one whole OK frame, decoded from the buffer in one native call.
        try:
            reply = self.decode.frame(buf, got)
        except Exception:  # noqa: BLE001 (read it the reference way below, which says what is wrong)
            reply = None
        if reply is not None:
            return reply
        return self._rest(sock, buf, got)

    def _rest(self, sock, buf: bytearray, got: int) -> w.StepReply:
        """``reply`` of a frame the native decoder did not take: read to its end (``got``
        bytes of it are in ``buf``) and decoded the reference way."""
        try:
            while got < 5:
                n = sock.recv_into(memoryview(buf)[got:])
                if not n:
                    raise ConnectionResetError("the broker closed the step channel")
                got += n
            size, kind = w.HEADER.unpack_from(buf)
            if size > w.MAX_FRAME_BYTES:
                raise ConnectionResetError(f"reply of {size} bytes")
            if got > 5 + size:
                raise ConnectionResetError(f"{got - 5 - size} bytes after a reply no request asked for")
            if got == 5 + size:
                body = bytes(memoryview(buf)[5:got])
            else:
                whole = bytearray(5 + size)
                whole[:got] = memoryview(buf)[:got]
                view = memoryview(whole)
                while got < 5 + size:
                    n = sock.recv_into(view[got:])
                    if not n:
                        raise ConnectionResetError("the broker closed the step channel")
                    got += n
                body = bytes(view[5:])
        except OSError as e:
            self.close()
            raise self._broke(e) from None
        try:
            return self.decode(kind, body)
        except w.WireError as e:
            self.close()
            raise StepUnavailable(f"the step channel at {self.path} sent a malformed reply: {e}") from None

    def _broke(self, e: OSError) -> StepUnavailable:
        if isinstance(e, BlockingIOError):  # the kernel's SO_RCVTIMEO/SO_SNDTIMEO ran out
            return StepUnavailable(f"the step channel at {self.path} did not answer within {self.timeout:g} s")
        return StepUnavailable(f"the step channel at {self.path} broke: {e}")

    def close(self) -> None:
        self.closed = True
        self._sock.close()

    def fileno(self) -> int:
        """The socket's descriptor (to wait for a reply with poll; -1 once closed)."""
        return self._sock.fileno()
