"""One allocation request, ``Spec``, as both the client and the daemon's core spell it.

The client builds ``Spec``s and sends them as ``ObjectSpec`` messages; the service rebuilds
the same type from those messages and hands it to the object store, so a positional
``Spec(4, ...)`` means the same thing on both sides. This module only describes a request:
validating it against the pool is the store's job, and it imports no protobuf or gRPC.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

# Content type names -> numbers (those of the proto enum broker.v1.ContentType and of the
# daemon's eviction.ContentType; tests/test_wire.py checks the three agree).
CONTENT_TYPES: dict[str, int] = {
    "kv_cache": 1,
    "lora_weight": 2,
    "temp_buffer": 3,
    "activation": 4,
    "gradient": 5,
}
TEMP_BUFFER = CONTENT_TYPES["temp_buffer"]


@dataclass(slots=True)
class Spec:
    """One allocation to ask for: ``Spec(num_pages, content_type, *, contiguous, key, pin)``.

    ``content_type`` is a name ("kv_cache", "lora_weight", "temp_buffer", "activation",
    "gradient") or its number (``content_type_number`` reads either). A name is checked here
    and becomes its number on the wire; numbers are checked by the store (an unknown one is
    refused there with INVALID_ARGUMENT). The daemon's store takes numbers: the service
    decodes them from the wire.

    Raises:
        ValueError: an unknown content type name, or a bool given as the content type.
    """

    num_pages: int
    content_type: int | str = TEMP_BUFFER
    _: KW_ONLY
    # Map the pages into one contiguous range of the virtual window.
    contiguous: bool = False
    # Content key (shared, findable by lookup once committed); None for anonymous.
    key: bytes | None = None
    # Pin for the asking session once committed.
    pin: bool = False

    def __post_init__(self) -> None:
        ct = self.content_type
        if isinstance(ct, str):
            if ct not in CONTENT_TYPES:
                raise ValueError(f"unknown content type {ct!r}; use one of {sorted(CONTENT_TYPES)}")
        elif isinstance(ct, bool):
            # Spec(4, True) once meant contiguous=True in the client: refuse it rather than
            # read it as content type 1.
            raise ValueError(
                f"content_type must be a content type name or number, not {ct!r}; "
                "for a contiguous object write Spec(n, contiguous=True)"
            )

    @property
    def content_type_number(self) -> int:
        """The content type as its number (what the wire and the store use)."""
        ct = self.content_type
        return CONTENT_TYPES[ct] if isinstance(ct, str) else ct
