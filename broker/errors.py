"""The daemon's name for the shared error model: ``memory_broker.wire.errors``, re-exported.

The core raises these (``invalid``, ``not_found`` ...) and imports them from here; the one
definition lives in the wire package, which the client imports too. Nothing else belongs here.
"""

from __future__ import annotations

from memory_broker.wire.errors import (
    BrokerError,
    Code,
    denied,
    exhausted,
    invalid,
    not_found,
    precondition,
    unavailable,
)

__all__ = ["BrokerError", "Code", "denied", "exhausted", "invalid", "not_found", "precondition", "unavailable"]
