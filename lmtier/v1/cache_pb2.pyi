from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hits",)
    HITS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    def __init__(self, hits: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("keys", "landing")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LANDING_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    landing: _containers.RepeatedCompositeFieldContainer[SharedRegion]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., landing: _Optional[_Iterable[_Union[SharedRegion, _Mapping]]] = ...) -> None: ...

class Pieces(_message.Message):
    __slots__ = ("pieces",)
    PIECES_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedCompositeFieldContainer[ChunkPiece]
    def __init__(self, pieces: _Optional[_Iterable[_Union[ChunkPiece, _Mapping]]] = ...) -> None: ...

class ChunkPiece(_message.Message):
    __slots__ = ("key", "frame_size", "offset", "data", "region", "head", "lease")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FRAME_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    frame_size: int
    offset: int
    data: bytes
    region: SharedRegion
    head: bytes
    lease: int
    def __init__(self, key: _Optional[bytes] = ..., frame_size: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., region: _Optional[_Union[SharedRegion, _Mapping]] = ..., head: _Optional[bytes] = ..., lease: _Optional[int] = ...) -> None: ...

class SharedRegion(_message.Message):
    __slots__ = ("segment", "offset", "length")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offset: int
    length: int
    def __init__(self, segment: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "dropped")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    dropped: int
    def __init__(self, stored: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: int
    def __init__(self, lease: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("keys", "truncated")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    truncated: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., truncated: bool = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "chunks", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    chunks: int
    counters: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "tenant_chunks", "config_json")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TENANT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    tenant_chunks: int
    config_json: str
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., tenant_chunks: _Optional[int] = ..., config_json: _Optional[str] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("token_ids", "namespaces", "chunk_tokens", "hash")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespaces: _containers.RepeatedScalarFieldContainer[bytes]
    chunk_tokens: int
    hash: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., namespaces: _Optional[_Iterable[bytes]] = ..., chunk_tokens: _Optional[int] = ..., hash: _Optional[str] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("tokens", "chunks", "runs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    chunks: int
    runs: _containers.RepeatedCompositeFieldContainer[MatchRun]
    def __init__(self, tokens: _Optional[int] = ..., chunks: _Optional[int] = ..., runs: _Optional[_Iterable[_Union[MatchRun, _Mapping]]] = ...) -> None: ...

class MatchRun(_message.Message):
    __slots__ = ("tier", "chunks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    chunks: int
    def __init__(self, tier: _Optional[str] = ..., chunks: _Optional[int] = ...) -> None: ...

class DirectoryRequest(_message.Message):
    __slots__ = ("read",)
    READ_FIELD_NUMBER: _ClassVar[int]
    read: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, read: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DirectoryResponse(_message.Message):
    __slots__ = ("segment",)
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    segment: str
    def __init__(self, segment: _Optional[str] = ...) -> None: ...

class OpenDataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenDataResponse(_message.Message):
    __slots__ = ("ticket", "port", "tls")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    port: int
    tls: bool
    def __init__(self, ticket: _Optional[bytes] = ..., port: _Optional[int] = ..., tls: bool = ...) -> None: ...
