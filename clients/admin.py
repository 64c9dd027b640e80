"""A session without an arena mapping, for tools that manage the broker (the ``adapters`` CLI).

``admin_session`` opens the Attach stream on a gRPC channel and proves the session on the
fd channel (asking for no slabs), so the broker learns this process's uid (adapter
management is allowed by uid), ties the session to this process and hands over its proof
key; it yields the call metadata (token and key) and ends the session on exit. Engines use ``BrokerClient`` instead.
"""

from __future__ import annotations

import contextlib
import os
import queue
from collections.abc import Iterator

import grpc

from memory_broker.clients.fd_channel import FdChannelError, prove_session
from memory_broker.proto.wire import session as wire_session
from memory_broker.proto.wire.errors import BrokerError, Code
from memory_broker.proto.wire.session import session_metadata, version_mismatch
from memory_broker.proto.wire.v1 import broker_pb2 as pb
from memory_broker.proto.wire.v1 import broker_pb2_grpc


@contextlib.contextmanager
def admin_session(
    channel: grpc.Channel, client_name: str = "memory-broker-cli", timeout: float = 10.0
) -> Iterator[tuple]:
    """Yield the metadata (``session_metadata(token, key)``) for calls on ``channel`` that need a session.

    Raises:
        grpc.RpcError: the broker refused or could not be reached.
        BrokerError: FAILED_PRECONDITION, the broker speaks another protocol version.
        FdChannelError: the fd channel refused the handshake (its code and message).
    """
    requests: queue.Queue = queue.Queue()
    hello = pb.Hello(client_name=client_name, pid=os.getpid(), protocol_version=wire_session.PROTOCOL_VERSION)
    requests.put(pb.AttachRequest(hello=hello))

    def gen():
        while True:
            msg = requests.get()
            if msg is None:
                return
            yield msg

    stream = broker_pb2_grpc.MemoryBrokerStub(channel).Attach(gen(), timeout=None)
    try:
        opened = next(stream).opened
        mismatch = version_mismatch(opened.protocol_version, peer="the broker", mine="this tool")
        if mismatch is not None:
            raise BrokerError(Code.FAILED_PRECONDITION, mismatch)
        # No fds wanted, only the proof and its key.
        key = prove_session(opened.arena.fd_socket_path, opened.token, timeout=timeout)
        yield session_metadata(opened.token, key)
    finally:
        requests.put(pb.AttachRequest(detach=pb.Detach()))
        requests.put(None)
        stream.cancel()


__all__ = ["admin_session", "BrokerError", "FdChannelError"]
