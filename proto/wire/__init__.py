"""The wire package: what a client and the daemon must agree on, importable by both.

It holds the shared descriptions (the arena's geometry and the client-side views of it, and
the contract types beside the .proto files). It must never import the daemon
(``memory_broker.broker``) or the client library (``memory_broker.clients``).
"""
