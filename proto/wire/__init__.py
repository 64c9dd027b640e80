"""The wire: what the broker daemon and its clients both speak, imported by both sides.

It owns the contract beside the .proto files: the generated gRPC code (``v1``), one
allocation ``Spec``, the error codes and their gRPC statuses, session metadata and the
protocol version, the fd channel's framing and limits, the adapter layout types and their
one codec, and the arena's geometry and the views any process maps it with (``mapping``). It must not import
the daemon (``memory_broker.broker``) or the client (``memory_broker.clients``).
"""
