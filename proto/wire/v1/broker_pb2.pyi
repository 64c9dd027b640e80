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

class AdapterTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_TIER_UNSPECIFIED: _ClassVar[AdapterTier]
    ADAPTER_TIER_HOT: _ClassVar[AdapterTier]
    ADAPTER_TIER_WARM: _ClassVar[AdapterTier]
    ADAPTER_TIER_COLD: _ClassVar[AdapterTier]

class AdapterImageState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_IMAGE_STATE_UNSPECIFIED: _ClassVar[AdapterImageState]
    ADAPTER_IMAGE_STATE_OFF: _ClassVar[AdapterImageState]
    ADAPTER_IMAGE_STATE_NONE: _ClassVar[AdapterImageState]
    ADAPTER_IMAGE_STATE_QUEUED: _ClassVar[AdapterImageState]
    ADAPTER_IMAGE_STATE_CONVERTING: _ClassVar[AdapterImageState]
    ADAPTER_IMAGE_STATE_READY: _ClassVar[AdapterImageState]
CONTENT_TYPE_UNSPECIFIED: ContentType
CONTENT_TYPE_KV_CACHE: ContentType
CONTENT_TYPE_LORA_WEIGHT: ContentType
CONTENT_TYPE_TEMP_BUFFER: ContentType
CONTENT_TYPE_ACTIVATION: ContentType
CONTENT_TYPE_GRADIENT: ContentType
OBJECT_STATE_UNSPECIFIED: ObjectState
OBJECT_STATE_PREPARED: ObjectState
OBJECT_STATE_COMMITTED: ObjectState
ADAPTER_TIER_UNSPECIFIED: AdapterTier
ADAPTER_TIER_HOT: AdapterTier
ADAPTER_TIER_WARM: AdapterTier
ADAPTER_TIER_COLD: AdapterTier
ADAPTER_IMAGE_STATE_UNSPECIFIED: AdapterImageState
ADAPTER_IMAGE_STATE_OFF: AdapterImageState
ADAPTER_IMAGE_STATE_NONE: AdapterImageState
ADAPTER_IMAGE_STATE_QUEUED: AdapterImageState
ADAPTER_IMAGE_STATE_CONVERTING: AdapterImageState
ADAPTER_IMAGE_STATE_READY: AdapterImageState

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
    __slots__ = ("client_name", "pid", "protocol_version")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    protocol_version: int
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class Detach(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("opened", "evicted", "arena_grown", "shutting_down", "transactions_expired", "reconnected", "adapter_corrupted", "engine_kv_reclaim")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    ARENA_GROWN_FIELD_NUMBER: _ClassVar[int]
    SHUTTING_DOWN_FIELD_NUMBER: _ClassVar[int]
    TRANSACTIONS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    RECONNECTED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CORRUPTED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KV_RECLAIM_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    evicted: ObjectsEvicted
    arena_grown: ArenaGrown
    shutting_down: ShuttingDown
    transactions_expired: TransactionsExpired
    reconnected: Reconnected
    adapter_corrupted: AdapterCorrupted
    engine_kv_reclaim: EngineKvReclaim
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., evicted: _Optional[_Union[ObjectsEvicted, _Mapping]] = ..., arena_grown: _Optional[_Union[ArenaGrown, _Mapping]] = ..., shutting_down: _Optional[_Union[ShuttingDown, _Mapping]] = ..., transactions_expired: _Optional[_Union[TransactionsExpired, _Mapping]] = ..., reconnected: _Optional[_Union[Reconnected, _Mapping]] = ..., adapter_corrupted: _Optional[_Union[AdapterCorrupted, _Mapping]] = ..., engine_kv_reclaim: _Optional[_Union[EngineKvReclaim, _Mapping]] = ...) -> None: ...

class EngineKvReclaim(_message.Message):
    __slots__ = ("pages", "deadline_unix_ms")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    pages: int
    deadline_unix_ms: int
    def __init__(self, pages: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "token", "arena", "protocol_version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    token: str
    arena: ArenaInfo
    protocol_version: int
    def __init__(self, session_id: _Optional[int] = ..., token: _Optional[str] = ..., arena: _Optional[_Union[ArenaInfo, _Mapping]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

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

class AdapterCorrupted(_message.Message):
    __slots__ = ("adapter_id", "object_id", "generation", "detail")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    object_id: int
    generation: int
    detail: str
    def __init__(self, adapter_id: _Optional[str] = ..., object_id: _Optional[int] = ..., generation: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class Reconnected(_message.Message):
    __slots__ = ("old_session_id", "new_session_id", "reason", "waited_s", "lost")
    OLD_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    old_session_id: int
    new_session_id: int
    reason: str
    waited_s: float
    lost: str
    def __init__(self, old_session_id: _Optional[int] = ..., new_session_id: _Optional[int] = ..., reason: _Optional[str] = ..., waited_s: _Optional[float] = ..., lost: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("keys", "pin", "tier")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pin: bool
    tier: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., pin: _Optional[bool] = ..., tier: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("objects", "tier_blocks")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    tier_blocks: int
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ..., tier_blocks: _Optional[int] = ...) -> None: ...

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

class Adapter(_message.Message):
    __slots__ = ("adapter_id", "path", "rank", "lora_alpha", "use_rslora", "target_modules", "num_layers", "file_bytes", "registered_at", "tier", "generation", "pin_count", "num_pages", "image_state")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_STATE_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    path: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    num_layers: int
    file_bytes: int
    registered_at: float
    tier: AdapterTier
    generation: int
    pin_count: int
    num_pages: int
    image_state: AdapterImageState
    def __init__(self, adapter_id: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., use_rslora: _Optional[bool] = ..., target_modules: _Optional[_Iterable[str]] = ..., num_layers: _Optional[int] = ..., file_bytes: _Optional[int] = ..., registered_at: _Optional[float] = ..., tier: _Optional[_Union[AdapterTier, str]] = ..., generation: _Optional[int] = ..., pin_count: _Optional[int] = ..., num_pages: _Optional[int] = ..., image_state: _Optional[_Union[AdapterImageState, str]] = ...) -> None: ...

class RegisterAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "path")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    path: str
    def __init__(self, adapter_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class RegisterAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class UnregisterAdapterRequest(_message.Message):
    __slots__ = ("adapter_ids",)
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    adapter_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class UnregisterAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("prefix", "limit", "page_token")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    limit: int
    page_token: str
    def __init__(self, prefix: _Optional[str] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token", "total")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    next_page_token: str
    total: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class RowChunk(_message.Message):
    __slots__ = ("page_index", "offset", "rows")
    PAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    page_index: int
    offset: int
    rows: int
    def __init__(self, page_index: _Optional[int] = ..., offset: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class MatrixLayout(_message.Message):
    __slots__ = ("rows", "row_elems", "row_stride", "chunks")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_ELEMS_FIELD_NUMBER: _ClassVar[int]
    ROW_STRIDE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    row_elems: int
    row_stride: int
    chunks: _containers.RepeatedCompositeFieldContainer[RowChunk]
    def __init__(self, rows: _Optional[int] = ..., row_elems: _Optional[int] = ..., row_stride: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[RowChunk, _Mapping]]] = ...) -> None: ...

class ModuleLayout(_message.Message):
    __slots__ = ("layer", "module", "rank", "scaling", "in_features", "out_features", "a", "b")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    IN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    OUT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    layer: int
    module: str
    rank: int
    scaling: float
    in_features: int
    out_features: int
    a: MatrixLayout
    b: MatrixLayout
    def __init__(self, layer: _Optional[int] = ..., module: _Optional[str] = ..., rank: _Optional[int] = ..., scaling: _Optional[float] = ..., in_features: _Optional[int] = ..., out_features: _Optional[int] = ..., a: _Optional[_Union[MatrixLayout, _Mapping]] = ..., b: _Optional[_Union[MatrixLayout, _Mapping]] = ...) -> None: ...

class AdapterLayout(_message.Message):
    __slots__ = ("adapter_id", "generation", "object_id", "pages", "page_size", "dtype", "row_align", "modules", "arena_slabs", "num_pages", "shard")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROW_ALIGN_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    ARENA_SLABS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    generation: int
    object_id: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    page_size: int
    dtype: str
    row_align: int
    modules: _containers.RepeatedCompositeFieldContainer[ModuleLayout]
    arena_slabs: int
    num_pages: int
    shard: str
    def __init__(self, adapter_id: _Optional[str] = ..., generation: _Optional[int] = ..., object_id: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., row_align: _Optional[int] = ..., modules: _Optional[_Iterable[_Union[ModuleLayout, _Mapping]]] = ..., arena_slabs: _Optional[int] = ..., num_pages: _Optional[int] = ..., shard: _Optional[str] = ...) -> None: ...

class ModuleShard(_message.Message):
    __slots__ = ("module", "split_input", "index", "count")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    SPLIT_INPUT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    module: str
    split_input: bool
    index: int
    count: int
    def __init__(self, module: _Optional[str] = ..., split_input: _Optional[bool] = ..., index: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class GetAdapterLayoutRequest(_message.Message):
    __slots__ = ("adapter_id", "dtype", "shards")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    dtype: str
    shards: _containers.RepeatedCompositeFieldContainer[ModuleShard]
    def __init__(self, adapter_id: _Optional[str] = ..., dtype: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ModuleShard, _Mapping]]] = ...) -> None: ...

class AcquireAdaptersRequest(_message.Message):
    __slots__ = ("adapter_ids", "max_adapters", "with_layout", "prepare", "lease_ms", "dtype", "shards")
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WITH_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    adapter_ids: _containers.RepeatedScalarFieldContainer[str]
    max_adapters: int
    with_layout: bool
    prepare: bool
    lease_ms: int
    dtype: str
    shards: _containers.RepeatedCompositeFieldContainer[ModuleShard]
    def __init__(self, adapter_ids: _Optional[_Iterable[str]] = ..., max_adapters: _Optional[int] = ..., with_layout: _Optional[bool] = ..., prepare: _Optional[bool] = ..., lease_ms: _Optional[int] = ..., dtype: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ModuleShard, _Mapping]]] = ...) -> None: ...

class AcquiredAdapter(_message.Message):
    __slots__ = ("adapter_id", "generation", "object_id", "pages", "layout", "found_in", "arena_slabs")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FOUND_IN_FIELD_NUMBER: _ClassVar[int]
    ARENA_SLABS_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    generation: int
    object_id: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    layout: AdapterLayout
    found_in: AdapterTier
    arena_slabs: int
    def __init__(self, adapter_id: _Optional[str] = ..., generation: _Optional[int] = ..., object_id: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[AdapterLayout, _Mapping]] = ..., found_in: _Optional[_Union[AdapterTier, str]] = ..., arena_slabs: _Optional[int] = ...) -> None: ...

class AcquireAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "deferred", "transaction_id", "deadline_unix_ms")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    TRANSACTION_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AcquiredAdapter]
    deferred: _containers.RepeatedScalarFieldContainer[str]
    transaction_id: int
    deadline_unix_ms: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[AcquiredAdapter, _Mapping]]] = ..., deferred: _Optional[_Iterable[str]] = ..., transaction_id: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ...) -> None: ...

class ReleaseAdaptersRequest(_message.Message):
    __slots__ = ("adapter_ids", "dtype")
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    adapter_ids: _containers.RepeatedScalarFieldContainer[str]
    dtype: str
    def __init__(self, adapter_ids: _Optional[_Iterable[str]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ReleaseAdaptersResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefetchAdaptersRequest(_message.Message):
    __slots__ = ("adapter_ids", "tier")
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    adapter_ids: _containers.RepeatedScalarFieldContainer[str]
    tier: AdapterTier
    def __init__(self, adapter_ids: _Optional[_Iterable[str]] = ..., tier: _Optional[_Union[AdapterTier, str]] = ...) -> None: ...

class PrefetchAdaptersResponse(_message.Message):
    __slots__ = ("loaded", "failed")
    class LoadedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: AdapterTier
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[AdapterTier, str]] = ...) -> None: ...
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LOADED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    loaded: _containers.ScalarMap[str, AdapterTier]
    failed: _containers.ScalarMap[str, str]
    def __init__(self, loaded: _Optional[_Mapping[str, AdapterTier]] = ..., failed: _Optional[_Mapping[str, str]] = ...) -> None: ...

class AdapterStats(_message.Message):
    __slots__ = ("registered", "hot", "warm", "cold", "hot_pages", "warm_bytes", "found_hot", "found_warm", "found_cold", "loads_hot", "loads_warm", "bytes_loaded_hot", "bytes_loaded_warm", "hit_rate", "deferred", "shared_loads", "load_failures", "evictions", "demotions", "image_count", "image_bytes", "image_budget_bytes", "image_hits", "image_misses", "converted_ahead", "convert_queued")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    HOT_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    COLD_FIELD_NUMBER: _ClassVar[int]
    HOT_PAGES_FIELD_NUMBER: _ClassVar[int]
    WARM_BYTES_FIELD_NUMBER: _ClassVar[int]
    FOUND_HOT_FIELD_NUMBER: _ClassVar[int]
    FOUND_WARM_FIELD_NUMBER: _ClassVar[int]
    FOUND_COLD_FIELD_NUMBER: _ClassVar[int]
    LOADS_HOT_FIELD_NUMBER: _ClassVar[int]
    LOADS_WARM_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_HOT_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_WARM_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    SHARED_LOADS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_COUNT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_HITS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_MISSES_FIELD_NUMBER: _ClassVar[int]
    CONVERTED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    CONVERT_QUEUED_FIELD_NUMBER: _ClassVar[int]
    registered: int
    hot: int
    warm: int
    cold: int
    hot_pages: int
    warm_bytes: int
    found_hot: int
    found_warm: int
    found_cold: int
    loads_hot: int
    loads_warm: int
    bytes_loaded_hot: int
    bytes_loaded_warm: int
    hit_rate: float
    deferred: int
    shared_loads: int
    load_failures: int
    evictions: int
    demotions: int
    image_count: int
    image_bytes: int
    image_budget_bytes: int
    image_hits: int
    image_misses: int
    converted_ahead: int
    convert_queued: int
    def __init__(self, registered: _Optional[int] = ..., hot: _Optional[int] = ..., warm: _Optional[int] = ..., cold: _Optional[int] = ..., hot_pages: _Optional[int] = ..., warm_bytes: _Optional[int] = ..., found_hot: _Optional[int] = ..., found_warm: _Optional[int] = ..., found_cold: _Optional[int] = ..., loads_hot: _Optional[int] = ..., loads_warm: _Optional[int] = ..., bytes_loaded_hot: _Optional[int] = ..., bytes_loaded_warm: _Optional[int] = ..., hit_rate: _Optional[float] = ..., deferred: _Optional[int] = ..., shared_loads: _Optional[int] = ..., load_failures: _Optional[int] = ..., evictions: _Optional[int] = ..., demotions: _Optional[int] = ..., image_count: _Optional[int] = ..., image_bytes: _Optional[int] = ..., image_budget_bytes: _Optional[int] = ..., image_hits: _Optional[int] = ..., image_misses: _Optional[int] = ..., converted_ahead: _Optional[int] = ..., convert_queued: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("backend", "page_size", "max_pages", "capacity_pages", "num_slabs", "free_pages", "used_pages", "prepared_pages", "pinned_pages", "evictable_pages", "utilization", "high_watermark", "low_watermark", "eviction_active", "eviction_runs", "evicted_objects", "evicted_pages", "objects", "keyed_objects", "sessions", "open_transactions", "by_content", "window_free_pages", "window_free_extents", "window_largest_free", "window_fragmentation", "allocations_total", "deduplicated_total", "allocation_failures", "adapters", "by_owner", "tier", "engines")
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
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    BY_OWNER_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
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
    adapters: AdapterStats
    by_owner: _containers.RepeatedCompositeFieldContainer[OwnerStats]
    tier: TierStats
    engines: _containers.RepeatedCompositeFieldContainer[EngineKvStats]
    def __init__(self, backend: _Optional[str] = ..., page_size: _Optional[int] = ..., max_pages: _Optional[int] = ..., capacity_pages: _Optional[int] = ..., num_slabs: _Optional[int] = ..., free_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., prepared_pages: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., evictable_pages: _Optional[int] = ..., utilization: _Optional[float] = ..., high_watermark: _Optional[float] = ..., low_watermark: _Optional[float] = ..., eviction_active: _Optional[bool] = ..., eviction_runs: _Optional[int] = ..., evicted_objects: _Optional[int] = ..., evicted_pages: _Optional[int] = ..., objects: _Optional[int] = ..., keyed_objects: _Optional[int] = ..., sessions: _Optional[int] = ..., open_transactions: _Optional[int] = ..., by_content: _Optional[_Iterable[_Union[ContentStats, _Mapping]]] = ..., window_free_pages: _Optional[int] = ..., window_free_extents: _Optional[int] = ..., window_largest_free: _Optional[int] = ..., window_fragmentation: _Optional[float] = ..., allocations_total: _Optional[int] = ..., deduplicated_total: _Optional[int] = ..., allocation_failures: _Optional[int] = ..., adapters: _Optional[_Union[AdapterStats, _Mapping]] = ..., by_owner: _Optional[_Iterable[_Union[OwnerStats, _Mapping]]] = ..., tier: _Optional[_Union[TierStats, _Mapping]] = ..., engines: _Optional[_Iterable[_Union[EngineKvStats, _Mapping]]] = ...) -> None: ...

class EngineKvStats(_message.Message):
    __slots__ = ("session_id", "name", "group_pages", "floor_pages", "ceiling_pages", "weight", "held_pages", "grows", "grown_pages", "give_backs", "given_pages", "refusals", "asked", "asked_pages", "grow_seconds", "grow_seconds_max")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_PAGES_FIELD_NUMBER: _ClassVar[int]
    FLOOR_PAGES_FIELD_NUMBER: _ClassVar[int]
    CEILING_PAGES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    GROWS_FIELD_NUMBER: _ClassVar[int]
    GROWN_PAGES_FIELD_NUMBER: _ClassVar[int]
    GIVE_BACKS_FIELD_NUMBER: _ClassVar[int]
    GIVEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    ASKED_FIELD_NUMBER: _ClassVar[int]
    ASKED_PAGES_FIELD_NUMBER: _ClassVar[int]
    GROW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GROW_SECONDS_MAX_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    name: str
    group_pages: int
    floor_pages: int
    ceiling_pages: int
    weight: float
    held_pages: int
    grows: int
    grown_pages: int
    give_backs: int
    given_pages: int
    refusals: int
    asked: int
    asked_pages: int
    grow_seconds: float
    grow_seconds_max: float
    def __init__(self, session_id: _Optional[int] = ..., name: _Optional[str] = ..., group_pages: _Optional[int] = ..., floor_pages: _Optional[int] = ..., ceiling_pages: _Optional[int] = ..., weight: _Optional[float] = ..., held_pages: _Optional[int] = ..., grows: _Optional[int] = ..., grown_pages: _Optional[int] = ..., give_backs: _Optional[int] = ..., given_pages: _Optional[int] = ..., refusals: _Optional[int] = ..., asked: _Optional[int] = ..., asked_pages: _Optional[int] = ..., grow_seconds: _Optional[float] = ..., grow_seconds_max: _Optional[float] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("backend", "up", "last_error", "hits", "misses", "corrupt", "written", "write_failed", "bytes_written", "bytes_read", "errors", "timeouts", "skipped_down", "drops", "spill_dropped", "spilled", "filled", "queue_depth", "lmcache_model", "adapter_images", "adapter_images_written", "adapter_images_read")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    WRITE_FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_DOWN_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    SPILL_DROPPED_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    FILLED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LMCACHE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_IMAGES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_IMAGES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_IMAGES_READ_FIELD_NUMBER: _ClassVar[int]
    backend: str
    up: bool
    last_error: str
    hits: int
    misses: int
    corrupt: int
    written: int
    write_failed: int
    bytes_written: int
    bytes_read: int
    errors: int
    timeouts: int
    skipped_down: int
    drops: int
    spill_dropped: int
    spilled: int
    filled: int
    queue_depth: int
    lmcache_model: str
    adapter_images: bool
    adapter_images_written: int
    adapter_images_read: int
    def __init__(self, backend: _Optional[str] = ..., up: _Optional[bool] = ..., last_error: _Optional[str] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., corrupt: _Optional[int] = ..., written: _Optional[int] = ..., write_failed: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_read: _Optional[int] = ..., errors: _Optional[int] = ..., timeouts: _Optional[int] = ..., skipped_down: _Optional[int] = ..., drops: _Optional[int] = ..., spill_dropped: _Optional[int] = ..., spilled: _Optional[int] = ..., filled: _Optional[int] = ..., queue_depth: _Optional[int] = ..., lmcache_model: _Optional[str] = ..., adapter_images: _Optional[bool] = ..., adapter_images_written: _Optional[int] = ..., adapter_images_read: _Optional[int] = ...) -> None: ...

class OwnerStats(_message.Message):
    __slots__ = ("session_id", "client_name", "pid", "content_type", "objects", "pages")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    client_name: str
    pid: int
    content_type: ContentType
    objects: int
    pages: int
    def __init__(self, session_id: _Optional[int] = ..., client_name: _Optional[str] = ..., pid: _Optional[int] = ..., content_type: _Optional[_Union[ContentType, str]] = ..., objects: _Optional[int] = ..., pages: _Optional[int] = ...) -> None: ...

class EngineKvRegisterRequest(_message.Message):
    __slots__ = ("name", "group_pages", "floor_pages", "ceiling_pages", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_PAGES_FIELD_NUMBER: _ClassVar[int]
    FLOOR_PAGES_FIELD_NUMBER: _ClassVar[int]
    CEILING_PAGES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    group_pages: int
    floor_pages: int
    ceiling_pages: int
    weight: float
    def __init__(self, name: _Optional[str] = ..., group_pages: _Optional[int] = ..., floor_pages: _Optional[int] = ..., ceiling_pages: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class EngineKvGrowRequest(_message.Message):
    __slots__ = ("groups", "wait_ms", "min_groups")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: int
    wait_ms: int
    min_groups: int
    def __init__(self, groups: _Optional[int] = ..., wait_ms: _Optional[int] = ..., min_groups: _Optional[int] = ...) -> None: ...

class EngineKvGrowResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    def __init__(self, groups: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ...) -> None: ...

class EngineKvShrinkRequest(_message.Message):
    __slots__ = ("object_ids",)
    OBJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    object_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, object_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineKvShrinkResponse(_message.Message):
    __slots__ = ("freed_pages",)
    FREED_PAGES_FIELD_NUMBER: _ClassVar[int]
    freed_pages: int
    def __init__(self, freed_pages: _Optional[int] = ...) -> None: ...

class VerifyAdaptersRequest(_message.Message):
    __slots__ = ("adapter_ids",)
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    adapter_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AdapterCheck(_message.Message):
    __slots__ = ("adapter_id", "tier", "checked", "ok", "checksum", "detail")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    tier: AdapterTier
    checked: bool
    ok: bool
    checksum: str
    detail: str
    def __init__(self, adapter_id: _Optional[str] = ..., tier: _Optional[_Union[AdapterTier, str]] = ..., checked: _Optional[bool] = ..., ok: _Optional[bool] = ..., checksum: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class VerifyAdaptersResponse(_message.Message):
    __slots__ = ("checks", "corrupt")
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    checks: _containers.RepeatedCompositeFieldContainer[AdapterCheck]
    corrupt: int
    def __init__(self, checks: _Optional[_Iterable[_Union[AdapterCheck, _Mapping]]] = ..., corrupt: _Optional[int] = ...) -> None: ...

class VerifyObjectsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ObjectCheck(_message.Message):
    __slots__ = ("key", "object_id", "checked", "ok", "digest", "detail")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    object_id: int
    checked: bool
    ok: bool
    digest: str
    detail: str
    def __init__(self, key: _Optional[bytes] = ..., object_id: _Optional[int] = ..., checked: _Optional[bool] = ..., ok: _Optional[bool] = ..., digest: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class VerifyObjectsResponse(_message.Message):
    __slots__ = ("checks", "corrupt")
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    checks: _containers.RepeatedCompositeFieldContainer[ObjectCheck]
    corrupt: int
    def __init__(self, checks: _Optional[_Iterable[_Union[ObjectCheck, _Mapping]]] = ..., corrupt: _Optional[int] = ...) -> None: ...
