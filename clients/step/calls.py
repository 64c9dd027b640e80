"""Which step calls a session uses: the step channel's (``channel.ChannelCalls``) where the
broker has one, else gRPC's (``grpc_calls.GrpcCalls``). Its own module, so neither imports
the other to choose."""

from __future__ import annotations

import logging

from memory_broker.clients.step.channel import ChannelCalls
from memory_broker.clients.step.grpc_calls import GrpcCalls
from memory_broker.clients.step.lease import SessionRecords
from memory_broker.clients.step.path import StepPath, StepTransport, StepUnavailable
from memory_broker.proto.wire.errors import BrokerError, Code

log = logging.getLogger(__name__)


def choose_calls(client) -> ChannelCalls | GrpcCalls:
    """Make the current session's step calls (``client``: a ``BrokerClient``, which keeps
    them as ``_calls``): the step channel's where the broker has one and ``fast_path`` is on,
    else gRPC's for the rest of the session. Called when the client has none for the current
    session, or its step channel broke (a new channel is opened then)."""
    if client.closed:
        raise BrokerError(Code.FAILED_PRECONDITION, "the client is closed; connect again")
    client._wait_live()
    with client._calls_lock:
        calls = client._calls
        if calls is not None and calls.current(client.epoch):
            return calls
        if calls is not None:
            calls.close()
        grpc = GrpcCalls(client, SessionRecords(client))
        calls = grpc
        if client.fast_path:
            try:
                transport = StepTransport(client._step_socket(), client.token, client.timeout)
            except StepUnavailable as e:
                # Said once a client at WARNING (a step call over gRPC is many times slower,
                # and nothing else shows it), again at INFO for each later session.
                first = client.step_fallback is None
                client.step_fallback = str(e)
                (log.warning if first else log.info)("step calls go over gRPC for this session: %s", e)
            else:
                calls = ChannelCalls(client, StepPath(transport), grpc)
        client._calls = calls
        return calls
