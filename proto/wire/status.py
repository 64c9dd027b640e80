"""Error codes to gRPC statuses and back: the daemon's ``STATUS`` table and the client's reading.

The service aborts a call with ``STATUS[error.code]``; the client turns the status it gets
back into the same ``BrokerError`` (``error_from_rpc``), keeping the broker's message and
replacing gRPC's transport text with a sentence saying what to do. This module decides no
policy and imports neither the daemon nor the client.
"""

from __future__ import annotations

import grpc

from memory_broker.proto.wire.errors import BrokerError, Code

# Code -> the gRPC status a refusal is sent as (one for one: a Code is named after its status).
STATUS: dict[Code, grpc.StatusCode] = {
    Code.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Code.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Code.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Code.INTERNAL: grpc.StatusCode.INTERNAL,
}

# Words of gRPC's own transport failures (the broker's UNAVAILABLE refusals say what to do).
_TRANSPORT_TEXT = (
    "failed to connect",
    "Socket closed",
    "Connection reset",
    "Connection refused",
    "Broken pipe",
    "No such file",
    "recvmsg",
    "sendmsg",
    "unix:",
    "ipv4:",
    "ipv6:",
    "GOAWAY",
    "Stream removed",
    "keepalive",
    "connections to all backends failing",
    "Transport closed",
)


def code_of(name: str) -> Code:
    """The Code named ``name`` (a status or an fd channel reply's code); INTERNAL for any other."""
    return Code[name] if name in Code.__members__ else Code.INTERNAL


# How gRPC begins its refusal of a message over the receiver's max_receive_message_length.
_TOO_LARGE = ("SERVER: Received message larger than max", "Received message larger than max")


def error_from_rpc(e: grpc.RpcError, socket_path: str = "", timeout: float = 0.0) -> BrokerError:
    """A gRPC failure as a BrokerError naming the status and what to do, without transport text.

    Statuses the broker sends keep its message (it says what to do). Failures of the
    transport (no broker on the socket, the connection dropped, no answer in time) carry
    gRPC's internal text in ``details()``; they become UNAVAILABLE with a plain sentence.
    """
    code = e.code()
    details = e.details() or ""
    where = f"the broker at {socket_path}" if socket_path else "the broker"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return BrokerError(
            Code.UNAVAILABLE,
            f"{where} did not answer within {timeout:g} s (busy or stuck); retry, or raise the client's timeout",
        )
    if code == grpc.StatusCode.UNAVAILABLE and (not details or any(w in details for w in _TRANSPORT_TEXT)):
        return BrokerError(
            Code.UNAVAILABLE,
            f"{where} is not reachable (not running, restarting, or the socket path is wrong); "
            "start it or wait for it, then retry",
        )
    if code == grpc.StatusCode.CANCELLED:
        return BrokerError(Code.UNAVAILABLE, f"the call to {where} was cancelled (the connection closed); retry")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(_TOO_LARGE):
        # gRPC's own refusal, at the request's header: say which setting and what to do.
        return BrokerError(
            Code.RESOURCE_EXHAUSTED,
            f"the request is larger than {where} accepts ({details.removeprefix('SERVER: ')}, in bytes): "
            "send smaller batches, or raise its listeners.max_request_size",
        )
    name = code.name if code is not None else "INTERNAL"
    if name not in Code.__members__:
        return BrokerError(Code.INTERNAL, f"{where} failed the call with {name}; see the broker's log")
    return BrokerError(Code[name], details or name)
