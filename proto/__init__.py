"""The contract between the broker and its clients.

``proto/broker/v1/`` holds the ``.proto`` files (package ``broker.v1``; not a Python package).
``memory_broker.proto.wire`` (``proto/wire/``) is what both sides import.
"""
