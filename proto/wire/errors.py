"""The error model both sides share (see ARCHITECTURE.md): ``Code`` and ``BrokerError``, free of gRPC.

The daemon's core raises ``BrokerError`` with a code named after the gRPC status it becomes;
the client raises the same type for the statuses it receives, so callers catch one class on
either side. Turning codes into statuses and back is ``wire.status``'s job, not this module's.
Messages carry the numbers that explain the refusal, so a person can act on them.
"""

from __future__ import annotations

from enum import Enum


class Code(str, Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class BrokerError(Exception):
    """A refused request. The refusal changed nothing."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        # The status first, then what to do: "NOT_FOUND: no object 7 ...".
        return f"{self.code.value}: {self.message}"

    def __repr__(self) -> str:
        return f"BrokerError({self.code.value}, {self.message!r})"


def invalid(message: str) -> BrokerError:
    return BrokerError(Code.INVALID_ARGUMENT, message)


def not_found(message: str) -> BrokerError:
    return BrokerError(Code.NOT_FOUND, message)


def exhausted(message: str) -> BrokerError:
    return BrokerError(Code.RESOURCE_EXHAUSTED, message)


def precondition(message: str) -> BrokerError:
    return BrokerError(Code.FAILED_PRECONDITION, message)


def denied(message: str) -> BrokerError:
    return BrokerError(Code.PERMISSION_DENIED, message)


def unavailable(message: str) -> BrokerError:
    return BrokerError(Code.UNAVAILABLE, message)
