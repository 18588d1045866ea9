"""Wire messages, the msgpack codec and the request state machine (sans-I/O).

Every message is a frozen pydantic model with a ``type`` discriminator. This
module is the only place that touches msgpack; it never touches a socket or a
clock. Decoding enforces a frame-size cap before unpacking and validates every
field, so a malformed frame becomes a ``RemoteProtocolError`` and nothing else.

Imports no zmq, ucxx or torch.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from pdpush.errors import ErrorCode, LocalProtocolError, RemoteProtocolError

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME = 8 << 20
MAX_CHUNKS = 1 << 20  # absolute ceiling; daemons enforce a smaller configured cap

ReqId = Annotated[str, Field(min_length=1, max_length=256)]
Key = Annotated[bytes, Field(min_length=16, max_length=16)]
U32 = Annotated[int, Field(ge=0, lt=1 << 32)]
U64 = Annotated[int, Field(ge=0, lt=1 << 64)]


class Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


class LayoutSpec(Msg):
    layers: Annotated[int, Field(ge=1, le=4096)]
    kv_heads: Annotated[int, Field(ge=1, le=4096)]
    head_dim: Annotated[int, Field(ge=1, le=65536)]
    dtype: Literal["float16", "bfloat16", "float32"]
    chunk_tokens: Annotated[int, Field(ge=1, le=1 << 20)]
    model_id: Annotated[str, Field(max_length=256)] = "default"


# ---- sender <-> receiver (control plane) -------------------------------------------------

class Hello(Msg):
    type: Literal["hello"] = "hello"
    version: int
    role: Literal["sender"] = "sender"
    fingerprint: Annotated[str, Field(max_length=64)]
    layout: LayoutSpec
    sender_id: Annotated[str, Field(max_length=256)] = ""


class HelloAck(Msg):
    type: Literal["hello_ack"] = "hello_ack"
    version: int
    fingerprint: str
    layout: LayoutSpec
    pool_base: U64
    pool_pages: U32
    page_bytes: U64
    rkey: Annotated[bytes, Field(max_length=65536)]
    ucx_host: str
    ucx_port: Annotated[int, Field(ge=0, le=65535)]
    ucx_token: Annotated[bytes, Field(min_length=32, max_length=32)]  # one-time: binds the UCX endpoint to this session


class AllocRequest(Msg):
    type: Literal["alloc"] = "alloc"
    req_id: ReqId
    chunk_keys: Annotated[list[Key], Field(min_length=1, max_length=MAX_CHUNKS)]
    last_chunk_tokens: Annotated[int, Field(ge=1)]
    lease_ms: Annotated[int, Field(ge=1, le=3_600_000)]


class AllocResponse(Msg):
    type: Literal["alloc_ok"] = "alloc_ok"
    req_id: ReqId
    already_sent_indexes: list[U32]
    # Pages for the new chunks, in chunk order, as (first page, count) runs.
    page_runs: list[tuple[U32, U32]]
    lease_id: U64
    expires_at_ms: U64


class LayerDone(Msg):
    type: Literal["layer_done"] = "layer_done"
    req_id: ReqId
    layer: U32
    checksum: U64 | None = None


class Commit(Msg):
    type: Literal["commit"] = "commit"
    req_id: ReqId


class CommitAck(Msg):
    type: Literal["commit_ack"] = "commit_ack"
    req_id: ReqId
    chunks_committed: U32


class Abort(Msg):
    type: Literal["abort"] = "abort"
    req_id: ReqId
    reason: Annotated[str, Field(max_length=1024)] = ""


class Error(Msg):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: Annotated[str, Field(max_length=4096)]
    req_id: str | None = None
    retry_after_ms: U32 | None = None


class StatusRequest(Msg):
    type: Literal["status"] = "status"


class StatusReply(Msg):
    type: Literal["status_ok"] = "status_ok"
    stats: dict[str, int | float | str | bool]


# ---- prefill engine <-> sender (local ingress) --------------------------------------------

class Begin(Msg):
    type: Literal["begin"] = "begin"
    req_id: ReqId
    receiver: Annotated[str, Field(max_length=512)]
    layout: LayoutSpec
    chunk_keys: Annotated[list[Key], Field(min_length=1, max_length=MAX_CHUNKS)]
    last_chunk_tokens: Annotated[int, Field(ge=1)]


class BeginOk(Msg):
    type: Literal["begin_ok"] = "begin_ok"
    req_id: ReqId
    already_sent_indexes: list[U32]
    staging_shmid: int
    staging_bytes: U64
    staging_offset: U64
    new_chunks: U32
    daemon_pid: int = 0  # the prefill engine watches the sender's pid while it waits


class LayerReady(Msg):
    type: Literal["layer_ready"] = "layer_ready"
    req_id: ReqId
    layer: U32


class Finish(Msg):
    type: Literal["finish"] = "finish"
    req_id: ReqId


class Done(Msg):
    type: Literal["done"] = "done"
    req_id: ReqId
    bytes_sent: U64
    puts: U32
    layers: U32
    chunks_skipped: U32
    layer_done_ms: list[float]


# ---- decode engine <-> receiver (local) ---------------------------------------------------

class Open(Msg):
    type: Literal["open"] = "open"
    req_id: ReqId


class OpenOk(Msg):
    type: Literal["open_ok"] = "open_ok"
    req_id: ReqId
    shmid: int
    pool_base: U64
    pool_pages: U32
    layout: LayoutSpec
    pages: list[U32]  # one page per chunk, all chunks (held + new), in chunk order
    last_chunk_tokens: U32
    layers_ready: list[U32]
    committed: bool
    daemon_pid: int = 0  # the decode engine has no UCX endpoint: it watches this pid for liveness


class LayerAvailable(Msg):
    type: Literal["layer_available"] = "layer_available"
    req_id: ReqId
    layer: U32


class Committed(Msg):
    type: Literal["committed"] = "committed"
    req_id: ReqId


class Release(Msg):
    type: Literal["release"] = "release"
    req_id: ReqId


class Query(Msg):
    type: Literal["query"] = "query"
    chunk_keys: Annotated[list[Key], Field(max_length=MAX_CHUNKS)]
    req_id: ReqId | None = None  # also count how far this live (maybe still arriving) request covers the keys


class QueryReply(Msg):
    type: Literal["query_ok"] = "query_ok"
    held_prefix: U32  # leading keys held complete in the chunk index
    request_chunks: U32 = 0  # leading keys that the request named in the query carries (0: not live here)
    request_gone: bool = False  # the named request was here and has ended (failed, expired or released)


class Ok(Msg):
    type: Literal["ok"] = "ok"
    req_id: str | None = None


Message = Annotated[
    Union[
        Hello, HelloAck, AllocRequest, AllocResponse, LayerDone, Commit, CommitAck, Abort, Error,
        StatusRequest, StatusReply, Begin, BeginOk, LayerReady, Finish, Done, Open, OpenOk,
        LayerAvailable, Committed, Release, Query, QueryReply, Ok,
    ],
    Field(discriminator="type"),
]
_adapter: TypeAdapter = TypeAdapter(Message)


def encode(msg: Msg) -> bytes:
    if not isinstance(msg, Msg):
        raise LocalProtocolError(f"not a protocol message: {type(msg).__name__}")
    return msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)


def decode(frame: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> Msg:
    """Bytes -> validated message, or RemoteProtocolError. Never anything else."""
    if len(frame) > max_frame:
        raise RemoteProtocolError(f"frame of {len(frame)} bytes exceeds the {max_frame}-byte cap",
                                  code=ErrorCode.TOO_LARGE)
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises many unrelated types on garbage
        raise RemoteProtocolError(f"undecodable frame: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"frame is a msgpack {type(obj).__name__}, expected a map")
    try:
        return _adapter.validate_python(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise RemoteProtocolError(f"invalid message at {where or '<root>'}: {first.get('msg')}") from None


def error(code: ErrorCode, message: str, req_id: str | None = None, retry_after_ms: int | None = None) -> Error:
    return Error(code=code, message=message[:4096], req_id=req_id, retry_after_ms=retry_after_ms)


# ---- receiver-side request state machine ---------------------------------------------------

class ReqState(Enum):
    ALLOCATED = "allocated"   # pages leased, waiting for layers
    STREAMING = "streaming"   # at least one LayerDone seen
    COMMITTED = "committed"   # chunks complete and indexed
    ABORTED = "aborted"
    EXPIRED = "expired"
    ERROR = "error"


class ReqEvent(Enum):
    LAYER_DONE = "layer_done"
    COMMIT = "commit"
    ABORT = "abort"
    EXPIRE = "expire"


_TRANSITIONS: dict[tuple[ReqState, ReqEvent], ReqState] = {
    (ReqState.ALLOCATED, ReqEvent.LAYER_DONE): ReqState.STREAMING,
    (ReqState.STREAMING, ReqEvent.LAYER_DONE): ReqState.STREAMING,
    (ReqState.ALLOCATED, ReqEvent.COMMIT): ReqState.COMMITTED,  # 0 new chunks: nothing to stream
    (ReqState.STREAMING, ReqEvent.COMMIT): ReqState.COMMITTED,
    (ReqState.ALLOCATED, ReqEvent.ABORT): ReqState.ABORTED,
    (ReqState.STREAMING, ReqEvent.ABORT): ReqState.ABORTED,
    (ReqState.ALLOCATED, ReqEvent.EXPIRE): ReqState.EXPIRED,
    (ReqState.STREAMING, ReqEvent.EXPIRE): ReqState.EXPIRED,
}


def transition(state: ReqState, event: ReqEvent, req_id: str) -> ReqState:
    """Next state, or RemoteProtocolError naming role, state and event."""
    nxt = _TRANSITIONS.get((state, event))
    if nxt is None:
        raise RemoteProtocolError(
            f"receiver: request {req_id!r} is {state.value}; {event.value} is not allowed there",
            code=ErrorCode.UNEXPECTED)
    return nxt
