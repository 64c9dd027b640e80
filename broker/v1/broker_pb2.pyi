from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ContentType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTENT_TYPE_UNSPECIFIED: _ClassVar[ContentType]
    CONTENT_TYPE_KV_CACHE: _ClassVar[ContentType]
    CONTENT_TYPE_LORA_WEIGHT: _ClassVar[ContentType]
    CONTENT_TYPE_TEMP_BUFFER: _ClassVar[ContentType]
    CONTENT_TYPE_ACTIVATION: _ClassVar[ContentType]
    CONTENT_TYPE_GRADIENT: _ClassVar[ContentType]

class ObjectState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBJECT_STATE_UNSPECIFIED: _ClassVar[ObjectState]
    OBJECT_STATE_PREPARED: _ClassVar[ObjectState]
    OBJECT_STATE_COMMITTED: _ClassVar[ObjectState]
CONTENT_TYPE_UNSPECIFIED: ContentType
CONTENT_TYPE_KV_CACHE: ContentType
CONTENT_TYPE_LORA_WEIGHT: ContentType
CONTENT_TYPE_TEMP_BUFFER: ContentType
CONTENT_TYPE_ACTIVATION: ContentType
CONTENT_TYPE_GRADIENT: ContentType
OBJECT_STATE_UNSPECIFIED: ObjectState
OBJECT_STATE_PREPARED: ObjectState
OBJECT_STATE_COMMITTED: ObjectState

class ObjectSpec(_message.Message):
    __slots__ = ("num_pages", "contiguous", "content_type", "key", "pin")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    CONTIGUOUS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    contiguous: bool
    content_type: ContentType
    key: bytes
    pin: bool
    def __init__(self, num_pages: _Optional[int] = ..., contiguous: _Optional[bool] = ..., content_type: _Optional[_Union[ContentType, str]] = ..., key: _Optional[bytes] = ..., pin: _Optional[bool] = ...) -> None: ...

class ObjectInfo(_message.Message):
    __slots__ = ("object_id", "content_type", "state", "key", "pages", "window_page", "session_pins", "total_pins", "deduplicated", "owned", "arena_slabs")
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PAGE_FIELD_NUMBER: _ClassVar[int]
    SESSION_PINS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PINS_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    ARENA_SLABS_FIELD_NUMBER: _ClassVar[int]
    object_id: int
    content_type: ContentType
    state: ObjectState
    key: bytes
    pages: _containers.RepeatedScalarFieldContainer[int]
    window_page: int
    session_pins: int
    total_pins: int
    deduplicated: bool
    owned: bool
    arena_slabs: int
    def __init__(self, object_id: _Optional[int] = ..., content_type: _Optional[_Union[ContentType, str]] = ..., state: _Optional[_Union[ObjectState, str]] = ..., key: _Optional[bytes] = ..., pages: _Optional[_Iterable[int]] = ..., window_page: _Optional[int] = ..., session_pins: _Optional[int] = ..., total_pins: _Optional[int] = ..., deduplicated: _Optional[bool] = ..., owned: _Optional[bool] = ..., arena_slabs: _Optional[int] = ...) -> None: ...

class GetArenaRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("backend", "page_size", "pages_per_slab", "max_slabs", "num_slabs", "window_pages", "fd_socket_path", "placement", "device")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGES_PER_SLAB_FIELD_NUMBER: _ClassVar[int]
    MAX_SLABS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLABS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PAGES_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    backend: str
    page_size: int
    pages_per_slab: int
    max_slabs: int
    num_slabs: int
    window_pages: int
    fd_socket_path: str
    placement: str
    device: str
    def __init__(self, backend: _Optional[str] = ..., page_size: _Optional[int] = ..., pages_per_slab: _Optional[int] = ..., max_slabs: _Optional[int] = ..., num_slabs: _Optional[int] = ..., window_pages: _Optional[int] = ..., fd_socket_path: _Optional[str] = ..., placement: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("hello", "detach")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    detach: Detach
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., detach: _Optional[_Union[Detach, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("client_name", "pid")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class Detach(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("opened", "evicted", "arena_grown", "shutting_down", "transactions_expired")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    ARENA_GROWN_FIELD_NUMBER: _ClassVar[int]
    SHUTTING_DOWN_FIELD_NUMBER: _ClassVar[int]
    TRANSACTIONS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    evicted: ObjectsEvicted
    arena_grown: ArenaGrown
    shutting_down: ShuttingDown
    transactions_expired: TransactionsExpired
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., evicted: _Optional[_Union[ObjectsEvicted, _Mapping]] = ..., arena_grown: _Optional[_Union[ArenaGrown, _Mapping]] = ..., shutting_down: _Optional[_Union[ShuttingDown, _Mapping]] = ..., transactions_expired: _Optional[_Union[TransactionsExpired, _Mapping]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "token", "arena")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    token: str
    arena: ArenaInfo
    def __init__(self, session_id: _Optional[int] = ..., token: _Optional[str] = ..., arena: _Optional[_Union[ArenaInfo, _Mapping]] = ...) -> None: ...

class ObjectsEvicted(_message.Message):
    __slots__ = ("object_ids", "keys")
    OBJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    object_ids: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, object_ids: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ArenaGrown(_message.Message):
    __slots__ = ("num_slabs",)
    NUM_SLABS_FIELD_NUMBER: _ClassVar[int]
    num_slabs: int
    def __init__(self, num_slabs: _Optional[int] = ...) -> None: ...

class ShuttingDown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class TransactionsExpired(_message.Message):
    __slots__ = ("transaction_ids",)
    TRANSACTION_IDS_FIELD_NUMBER: _ClassVar[int]
    transaction_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transaction_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("objects",)
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectSpec]
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectSpec, _Mapping]]] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("objects",)
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("objects", "pin_object_ids", "lease_ms")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PIN_OBJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectSpec]
    pin_object_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_ms: int
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectSpec, _Mapping]]] = ..., pin_object_ids: _Optional[_Iterable[int]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("transaction_id", "deadline_unix_ms", "objects", "pinned")
    TRANSACTION_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    transaction_id: int
    deadline_unix_ms: int
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    pinned: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    def __init__(self, transaction_id: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ..., pinned: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("transaction_ids",)
    TRANSACTION_IDS_FIELD_NUMBER: _ClassVar[int]
    transaction_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transaction_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CommittedTransaction(_message.Message):
    __slots__ = ("transaction_id", "objects")
    TRANSACTION_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    transaction_id: int
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    def __init__(self, transaction_id: _Optional[int] = ..., objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("transactions",)
    TRANSACTIONS_FIELD_NUMBER: _ClassVar[int]
    transactions: _containers.RepeatedCompositeFieldContainer[CommittedTransaction]
    def __init__(self, transactions: _Optional[_Iterable[_Union[CommittedTransaction, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("transaction_ids",)
    TRANSACTION_IDS_FIELD_NUMBER: _ClassVar[int]
    transaction_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transaction_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("freed_pages",)
    FREED_PAGES_FIELD_NUMBER: _ClassVar[int]
    freed_pages: int
    def __init__(self, freed_pages: _Optional[int] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("object_ids",)
    OBJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    object_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, object_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("freed_pages", "deferred_pages")
    FREED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_PAGES_FIELD_NUMBER: _ClassVar[int]
    freed_pages: int
    deferred_pages: int
    def __init__(self, freed_pages: _Optional[int] = ..., deferred_pages: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("object_ids",)
    OBJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    object_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, object_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("objects",)
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("object_ids",)
    OBJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    object_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, object_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "pin")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pin: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., pin: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("objects",)
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContentStats(_message.Message):
    __slots__ = ("content_type", "objects", "pages")
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    content_type: ContentType
    objects: int
    pages: int
    def __init__(self, content_type: _Optional[_Union[ContentType, str]] = ..., objects: _Optional[int] = ..., pages: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("backend", "page_size", "max_pages", "capacity_pages", "num_slabs", "free_pages", "used_pages", "prepared_pages", "pinned_pages", "evictable_pages", "utilization", "high_watermark", "low_watermark", "eviction_active", "eviction_runs", "evicted_objects", "evicted_pages", "objects", "keyed_objects", "sessions", "open_transactions", "by_content", "window_free_pages", "window_free_extents", "window_largest_free", "window_fragmentation", "allocations_total", "deduplicated_total", "allocation_failures")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLABS_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREPARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    LOW_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    EVICTION_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    EVICTION_RUNS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    KEYED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OPEN_TRANSACTIONS_FIELD_NUMBER: _ClassVar[int]
    BY_CONTENT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FREE_EXTENTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_LARGEST_FREE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    page_size: int
    max_pages: int
    capacity_pages: int
    num_slabs: int
    free_pages: int
    used_pages: int
    prepared_pages: int
    pinned_pages: int
    evictable_pages: int
    utilization: float
    high_watermark: float
    low_watermark: float
    eviction_active: bool
    eviction_runs: int
    evicted_objects: int
    evicted_pages: int
    objects: int
    keyed_objects: int
    sessions: int
    open_transactions: int
    by_content: _containers.RepeatedCompositeFieldContainer[ContentStats]
    window_free_pages: int
    window_free_extents: int
    window_largest_free: int
    window_fragmentation: float
    allocations_total: int
    deduplicated_total: int
    allocation_failures: int
    def __init__(self, backend: _Optional[str] = ..., page_size: _Optional[int] = ..., max_pages: _Optional[int] = ..., capacity_pages: _Optional[int] = ..., num_slabs: _Optional[int] = ..., free_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., prepared_pages: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., evictable_pages: _Optional[int] = ..., utilization: _Optional[float] = ..., high_watermark: _Optional[float] = ..., low_watermark: _Optional[float] = ..., eviction_active: _Optional[bool] = ..., eviction_runs: _Optional[int] = ..., evicted_objects: _Optional[int] = ..., evicted_pages: _Optional[int] = ..., objects: _Optional[int] = ..., keyed_objects: _Optional[int] = ..., sessions: _Optional[int] = ..., open_transactions: _Optional[int] = ..., by_content: _Optional[_Iterable[_Union[ContentStats, _Mapping]]] = ..., window_free_pages: _Optional[int] = ..., window_free_extents: _Optional[int] = ..., window_largest_free: _Optional[int] = ..., window_fragmentation: _Optional[float] = ..., allocations_total: _Optional[int] = ..., deduplicated_total: _Optional[int] = ..., allocation_failures: _Optional[int] = ...) -> None: ...
