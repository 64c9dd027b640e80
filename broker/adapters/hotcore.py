"""The adapter wing's native core (``_hotcore.c``): a step's per-adapter passes in C.

``load()`` returns the C module, or None (not built, or ``MEMORY_BROKER_NATIVE=0``:
``proto/wire/native.py`` says so once); its users (``AdapterPins.pin_hot`` / ``release_hot``,
the step channel's acquire reply) then take their Python path,
which gives the same results (tests/test_adapter_hot_native.py runs both).
"""

from __future__ import annotations

from types import ModuleType

from memory_broker.proto.wire import native

NAME = native.HOTCORE


def load() -> ModuleType | None:
    """The C module, or None."""
    return native.load(NAME)
