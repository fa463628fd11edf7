from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("worker", "token", "fingerprint_json", "protocol", "config_only")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_JSON_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    CONFIG_ONLY_FIELD_NUMBER: _ClassVar[int]
    worker: str
    token: str
    fingerprint_json: str
    protocol: int
    config_only: bool
    def __init__(self, worker: _Optional[str] = ..., token: _Optional[str] = ..., fingerprint_json: _Optional[str] = ..., protocol: _Optional[int] = ..., config_only: _Optional[bool] = ...) -> None: ...

class SliceRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("config_json", "shard", "num_shards", "slices", "rounds", "session", "chunk_values", "uninitialized", "init_hash")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_VALUES_FIELD_NUMBER: _ClassVar[int]
    UNINITIALIZED_FIELD_NUMBER: _ClassVar[int]
    INIT_HASH_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    shard: int
    num_shards: int
    slices: _containers.RepeatedCompositeFieldContainer[SliceRange]
    rounds: _containers.RepeatedScalarFieldContainer[int]
    session: str
    chunk_values: int
    uninitialized: bool
    init_hash: str
    def __init__(self, config_json: _Optional[str] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., slices: _Optional[_Iterable[_Union[SliceRange, _Mapping]]] = ..., rounds: _Optional[_Iterable[int]] = ..., session: _Optional[str] = ..., chunk_values: _Optional[int] = ..., uninitialized: _Optional[bool] = ..., init_hash: _Optional[str] = ...) -> None: ...

class InitChunk(_message.Message):
    __slots__ = ("worker", "token", "fingerprint_json", "fragment", "offset", "values", "last", "init_hash", "slice_hashes")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_JSON_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    INIT_HASH_FIELD_NUMBER: _ClassVar[int]
    SLICE_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker: str
    token: str
    fingerprint_json: str
    fragment: int
    offset: int
    values: bytes
    last: bool
    init_hash: str
    slice_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker: _Optional[str] = ..., token: _Optional[str] = ..., fingerprint_json: _Optional[str] = ..., fragment: _Optional[int] = ..., offset: _Optional[int] = ..., values: _Optional[bytes] = ..., last: _Optional[bool] = ..., init_hash: _Optional[str] = ..., slice_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class InitReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("fragment", "round", "seq", "offset", "numel", "total", "codec", "block_size", "scales", "payload", "last")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    seq: int
    offset: int
    numel: int
    total: int
    codec: str
    block_size: int
    scales: bytes
    payload: bytes
    last: bool
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., seq: _Optional[int] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., total: _Optional[int] = ..., codec: _Optional[str] = ..., block_size: _Optional[int] = ..., scales: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("worker", "session", "passive")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PASSIVE_FIELD_NUMBER: _ClassVar[int]
    worker: str
    session: str
    passive: bool
    def __init__(self, worker: _Optional[str] = ..., session: _Optional[str] = ..., passive: _Optional[bool] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("from_rounds",)
    FROM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    from_rounds: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, from_rounds: _Optional[_Iterable[int]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("weight", "has_loss", "loss", "step", "blocked_seconds", "total_steps", "tokens", "has_utilization", "compute_utilization", "has_eval_loss", "eval_loss", "eval_step", "step_seconds")
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    HAS_EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    weight: float
    has_loss: bool
    loss: float
    step: int
    blocked_seconds: float
    total_steps: int
    tokens: int
    has_utilization: bool
    compute_utilization: float
    has_eval_loss: bool
    eval_loss: float
    eval_step: int
    step_seconds: float
    def __init__(self, weight: _Optional[float] = ..., has_loss: _Optional[bool] = ..., loss: _Optional[float] = ..., step: _Optional[int] = ..., blocked_seconds: _Optional[float] = ..., total_steps: _Optional[int] = ..., tokens: _Optional[int] = ..., has_utilization: _Optional[bool] = ..., compute_utilization: _Optional[float] = ..., has_eval_loss: _Optional[bool] = ..., eval_loss: _Optional[float] = ..., eval_step: _Optional[int] = ..., step_seconds: _Optional[float] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "push", "ready")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    push: Push
    ready: Ready
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., push: _Optional[_Union[Push, _Mapping]] = ..., ready: _Optional[_Union[Ready, _Mapping]] = ...) -> None: ...

class Push(_message.Message):
    __slots__ = ("chunk", "header")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    header: PushHeader
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., header: _Optional[_Union[PushHeader, _Mapping]] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("fragment", "round", "accepted", "reason", "message", "pace_seconds")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    accepted: bool
    reason: str
    message: str
    pace_seconds: float
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., pace_seconds: _Optional[float] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("rounds", "started", "member", "pushes", "min_workers")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedScalarFieldContainer[int]
    started: _containers.RepeatedScalarFieldContainer[bool]
    member: bool
    pushes: _containers.RepeatedScalarFieldContainer[int]
    min_workers: int
    def __init__(self, rounds: _Optional[_Iterable[int]] = ..., started: _Optional[_Iterable[bool]] = ..., member: _Optional[bool] = ..., pushes: _Optional[_Iterable[int]] = ..., min_workers: _Optional[int] = ...) -> None: ...

class ShardMessage(_message.Message):
    __slots__ = ("welcome", "update", "result")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    update: Chunk
    result: PushResult
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., update: _Optional[_Union[Chunk, _Mapping]] = ..., result: _Optional[_Union[PushResult, _Mapping]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("fragments", "offset", "token", "describe")
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    fragments: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    token: str
    describe: bool
    def __init__(self, fragments: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., token: _Optional[str] = ..., describe: _Optional[bool] = ...) -> None: ...

class MasterChunk(_message.Message):
    __slots__ = ("fragment", "round", "offset", "total", "values", "last", "fingerprint_json", "shard", "num_shards")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    offset: int
    total: int
    values: bytes
    last: bool
    fingerprint_json: str
    shard: int
    num_shards: int
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., offset: _Optional[int] = ..., total: _Optional[int] = ..., values: _Optional[bytes] = ..., last: _Optional[bool] = ..., fingerprint_json: _Optional[str] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...

class PiecesRequest(_message.Message):
    __slots__ = ("worker", "session", "token", "train_tokens", "data_sha256", "done", "held", "want")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_SHA256_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    worker: str
    session: str
    token: str
    train_tokens: int
    data_sha256: str
    done: _containers.RepeatedScalarFieldContainer[int]
    held: _containers.RepeatedScalarFieldContainer[int]
    want: int
    def __init__(self, worker: _Optional[str] = ..., session: _Optional[str] = ..., token: _Optional[str] = ..., train_tokens: _Optional[int] = ..., data_sha256: _Optional[str] = ..., done: _Optional[_Iterable[int]] = ..., held: _Optional[_Iterable[int]] = ..., want: _Optional[int] = ...) -> None: ...

class PieceRange(_message.Message):
    __slots__ = ("id", "start", "end")
    ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    id: int
    start: int
    end: int
    def __init__(self, id: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class PiecesReply(_message.Message):
    __slots__ = ("held", "epoch", "pieces_done", "pieces_total", "refused", "piece_tokens", "repeated")
    HELD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PIECES_DONE_FIELD_NUMBER: _ClassVar[int]
    PIECES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    PIECE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPEATED_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedCompositeFieldContainer[PieceRange]
    epoch: int
    pieces_done: int
    pieces_total: int
    refused: _containers.RepeatedScalarFieldContainer[int]
    piece_tokens: int
    repeated: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, held: _Optional[_Iterable[_Union[PieceRange, _Mapping]]] = ..., epoch: _Optional[int] = ..., pieces_done: _Optional[int] = ..., pieces_total: _Optional[int] = ..., refused: _Optional[_Iterable[int]] = ..., piece_tokens: _Optional[int] = ..., repeated: _Optional[_Iterable[int]] = ...) -> None: ...
