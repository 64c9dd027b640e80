"""The adapter wing's native core (``_hotcore.c``): a step's per-adapter passes in C.

``load()`` returns the C module, or None (not built, or ``MEMORY_BROKER_NATIVE=0``:
``proto/wire/native.py`` says so once); its users (``AdapterPins.pin_hot`` / ``release_hot``,
the step channel's acquire reply) then take their Python path,
which gives the same results (tests/test_adapter_hot_native.py runs both).
"""

from __future__ import annotations

from types import ModuleType

from memory_broker.proto.wire import native

NAME = "memory_broker.broker.adapters._hotcore"


def load() -> ModuleType | None:
    """The C module with the hot entries' and the store objects' slots read into it
    (``layout``: their fields are read without an attribute lookup), or None."""
    core = native.load(NAME)
    if core is not None:
        from memory_broker.broker.adapters.entry import AdapterEntry  # noqa: PLC0415 (not at import: a cycle)
        from memory_broker.broker.store.records import Allocation  # noqa: PLC0415

        core.layout(AdapterEntry, Allocation)
    return core
