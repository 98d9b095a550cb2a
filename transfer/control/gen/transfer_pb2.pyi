from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Ticket(_message.Message):
    __slots__ = ("request_id", "instance_id", "address", "block_ids", "slot_id", "num_tokens", "first_token", "lease_deadline", "first_logprob", "abort_key", "cached_tokens", "block_hashes", "stream_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    ABORT_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    STREAM_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slot_id: int
    num_tokens: int
    first_token: int
    lease_deadline: float
    first_logprob: float
    abort_key: str
    cached_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    stream_key: int
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., slot_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., first_token: _Optional[int] = ..., lease_deadline: _Optional[float] = ..., first_logprob: _Optional[float] = ..., abort_key: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., stream_key: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("instance_id", "compat", "compat_hash")
    class CompatEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    compat: _containers.ScalarMap[str, str]
    compat_hash: str
    def __init__(self, instance_id: _Optional[str] = ..., compat: _Optional[_Mapping[str, str]] = ..., compat_hash: _Optional[str] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("instance_id", "compat", "compat_hash", "rank_metadata", "rank_layouts")
    class CompatEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    RANK_METADATA_FIELD_NUMBER: _ClassVar[int]
    RANK_LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    compat: _containers.ScalarMap[str, str]
    compat_hash: str
    rank_metadata: _containers.RepeatedScalarFieldContainer[bytes]
    rank_layouts: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, instance_id: _Optional[str] = ..., compat: _Optional[_Mapping[str, str]] = ..., compat_hash: _Optional[str] = ..., rank_metadata: _Optional[_Iterable[bytes]] = ..., rank_layouts: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("request_id", "holder")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    holder: str
    def __init__(self, request_id: _Optional[str] = ..., holder: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("request_id", "holder")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    holder: str
    def __init__(self, request_id: _Optional[str] = ..., holder: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("lease_deadline",)
    LEASE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    lease_deadline: float
    def __init__(self, lease_deadline: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "holder", "block_ids", "slot_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    holder: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slot_id: int
    def __init__(self, request_id: _Optional[str] = ..., holder: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., slot_id: _Optional[int] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason", "abort_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ABORT_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    abort_key: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., abort_key: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankGather(_message.Message):
    __slots__ = ("src_offsets", "lengths")
    SRC_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    src_offsets: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src_offsets: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("request_id", "holder", "ranks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    holder: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankGather]
    def __init__(self, request_id: _Optional[str] = ..., holder: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankGather, _Mapping]]] = ...) -> None: ...

class StageReply(_message.Message):
    __slots__ = ("staging_offset",)
    STAGING_OFFSET_FIELD_NUMBER: _ClassVar[int]
    staging_offset: int
    def __init__(self, staging_offset: _Optional[int] = ...) -> None: ...
