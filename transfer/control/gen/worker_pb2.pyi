from transfer.control.gen import transfer_pb2 as _transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeCall(_message.Message):
    __slots__ = ("stream_id", "start", "cancel")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    start: DecodeRequest
    cancel: bool
    def __init__(self, stream_id: _Optional[int] = ..., start: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("stream_id", "token", "end")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    token: TokenEvent
    end: DecodeEnd
    def __init__(self, stream_id: _Optional[int] = ..., token: _Optional[_Union[TokenEvent, _Mapping]] = ..., end: _Optional[_Union[DecodeEnd, _Mapping]] = ...) -> None: ...

class DecodeEnd(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: str
    details: str
    def __init__(self, code: _Optional[str] = ..., details: _Optional[str] = ...) -> None: ...

class DecodeEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[DecodeEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[DecodeEvent, _Mapping]]] = ...) -> None: ...

class RegisterPrefillRequest(_message.Message):
    __slots__ = ("addresses",)
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterPrefillReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "max_tokens", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: Sampling
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("ticket", "max_tokens", "sampling")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ticket: _transfer_pb2.Ticket
    max_tokens: int
    sampling: Sampling
    def __init__(self, ticket: _Optional[_Union[_transfer_pb2.Ticket, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "max_tokens", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: Sampling
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "token", "index", "finished", "ttft_ms", "transfer_ms", "kv_bytes", "state_bytes", "descriptors", "logprob", "cached_prompt_tokens", "reused_decode_tokens", "exposed_transfer_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: int
    index: int
    finished: bool
    ttft_ms: float
    transfer_ms: float
    kv_bytes: int
    state_bytes: int
    descriptors: int
    logprob: float
    cached_prompt_tokens: int
    reused_decode_tokens: int
    exposed_transfer_ms: float
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[int] = ..., index: _Optional[int] = ..., finished: _Optional[bool] = ..., ttft_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., state_bytes: _Optional[int] = ..., descriptors: _Optional[int] = ..., logprob: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ..., reused_decode_tokens: _Optional[int] = ..., exposed_transfer_ms: _Optional[float] = ...) -> None: ...
