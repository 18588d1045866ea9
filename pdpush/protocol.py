"""Wire messages, the msgpack codec and the request state machine (sans-I/O).

Every message is a frozen pydantic model with a ``type`` discriminator. This
module and its fast path (fastcodec.py: msgspec twins of the models) are the only
places that touch msgpack; neither touches a socket or a clock. Decoding enforces
a frame-size cap before unpacking and validates every field, so a malformed frame
becomes a ``RemoteProtocolError`` and nothing else.

Imports no zmq, UCX or torch.
"""

from __future__ import annotations

import functools
import typing
from enum import Enum
from typing import Annotated, Any, Literal, Union

import msgpack
import msgspec
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, model_validator

from pdpush import fastcodec
from pdpush.errors import (
    ErrorCode,
    FrameTooLarge,
    IncompatiblePeer,
    LocalProtocolError,
    PdpushError,
    ProtocolError,
    RemoteProtocolError,
    UnexpectedMessage,
)

PROTOCOL_VERSION = 8  # 4: leases travel as durations (AllocResponse.lease_ms), never as clock readings;
# 5: no LayerDone without a checksum (the Commit says every layer landed: Commit.layers);
# 6: completion on the data path (AllocRequest.completion): the readiness words commit a request, no Commit;
# 7: an AllocResponse names the attempt it answers (AllocRequest.attempt): a late answer to an earlier attempt of
# the same id is never taken for a retry's (its pages, since given to another request, would be written);
# 8: an Error that answers an AllocRequest names its attempt too (Error.attempt): a late error for an earlier attempt
# (a pool_exhausted, a refusal) is never taken for a retry's, which it failed
# An engine and its local daemon (Begin/BeginOk, Open/OpenOk, Query/QueryReply, and what follows on that connection:
# the hand-over ring's records, the staging and pool views): their pdpush must speak the same one, or it is refused
# (``_validate``, before the message's fields are read: a newer one may have more). Engines and daemons often come
# from separate images. 0: a pdpush from before it was numbered; 2: a decode scheduler's Query and its answer carry it
# too (a Query may come before any Open); 3: an engine's connection sends and receives its messages on its lifeline,
# a stream (lifeline.py), not the daemon's ZeroMQ socket; 4: a Release may ask for no answer (``Release.answer``: an
# engine's step releases without waiting); 5: a Release names the open it gives up (``Release.lease_id``, its
# OpenOk's), so that a failed request's read hold is let go only by a release of that open
LOCAL_PROTOCOL_VERSION = 5
Completion = Literal["commit", "words"]
DEFAULT_MAX_FRAME = 8 << 20
MAX_BATCH = 256  # messages in one frame between the daemons (``encode_batch``)
MAX_CHUNKS = 1 << 20  # absolute ceiling; daemons enforce a smaller configured cap

ReqId = Annotated[str, Field(min_length=1, max_length=256)]
Key = Annotated[bytes, Field(min_length=16, max_length=16)]
U32 = Annotated[int, Field(ge=0, lt=1 << 32)]
U64 = Annotated[int, Field(ge=0, lt=1 << 64)]


class Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


StateSegmentSpec = tuple[Annotated[str, Field(min_length=1, max_length=32)],
                         Literal["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"],
                         Annotated[list[Annotated[int, Field(ge=1, lt=1 << 31)]], Field(min_length=1, max_length=8)],
                         Annotated[int, Field(ge=-8, lt=8)], bool]


class LayoutSpec(Msg):
    layers: Annotated[int, Field(ge=0, le=4096)]  # 0: no attention layer (state only: pure Mamba2)
    kv_heads: Annotated[int, Field(ge=1, le=4096)]
    head_dim: Annotated[int, Field(ge=1, le=65536)]
    dtype: Literal["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"]
    chunk_tokens: Annotated[int, Field(ge=1, le=1 << 20)]
    model_id: Annotated[str, Field(max_length=256)] = "default"
    kind: Literal["mha", "mla"] = "mha"
    kv_scales: Literal["none", "static"] = "none"
    # per layer, its sliding window in tokens (0: full attention); empty when every layer is full
    windows: Annotated[list[Annotated[int, Field(ge=0, lt=1 << 31)]], Field(max_length=4096)] = []
    # recurrent state (layout.StateSegment): state layers, their segments and units
    state_layers: Annotated[int, Field(ge=0, le=4096)] = 0
    state_units: Annotated[int, Field(ge=1, le=256)] = 1
    state: Annotated[list[StateSegmentSpec], Field(max_length=16)] = []
    _kv: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_latent(self):
        if self.kind == "mla" and self.kv_heads != 1:
            raise ValueError(f"an MLA latent is one head (kv_heads = 1), got kv_heads={self.kv_heads}")
        if self.windows and len(self.windows) != self.layers:
            raise ValueError(f"{len(self.windows)} windows for {self.layers} layers")
        if bool(self.state_layers) != bool(self.state) or (self.layers == 0 and not self.state_layers):
            raise ValueError("state layers need state segments (and a layout with no attention layer, state layers)")
        # every rule of the description (state segments' axes, units, ...): KVLayout's, checked once per layout
        self._kv = _kv_layout((self.layers, self.kv_heads, self.head_dim, self.dtype, self.chunk_tokens, self.model_id,
                               self.kind, self.kv_scales, tuple(self.windows), self.state_layers, self.state_units,
                               tuple((t, d, tuple(sh), a, r) for t, d, sh, a, r in self.state)))
        return self

    @property
    def kv_layout(self):
        """The layout it describes (``pdpush.layout.KVLayout``: immutable, shared by the specs of one layout)."""
        return self._kv


@functools.lru_cache(maxsize=64)
def _kv_layout(key: tuple):
    """A ``KVLayout`` by its fields, in ``LayoutSpec``'s order: built (and checked) once per layout; a Begin carries
    its engine's layout every time."""
    from pdpush.layout import KVLayout

    names = ("layers", "kv_heads", "head_dim", "dtype", "chunk_tokens", "model_id", "kind", "kv_scales", "windows",
             "state_layers", "state_units", "state")
    return KVLayout(**dict(zip(names, key, strict=True)))


# ---- sender <-> receiver (control plane) -------------------------------------------------

class Hello(Msg):
    type: Literal["hello"] = "hello"
    version: int
    fingerprint: Annotated[str, Field(max_length=64)]
    layout: LayoutSpec


class HelloAck(Msg):
    type: Literal["hello_ack"] = "hello_ack"
    version: int
    fingerprint: str
    layout: LayoutSpec
    pool_base: U64
    pool_pages: U32
    page_bytes: U64
    rkey: Annotated[bytes, Field(max_length=65536)]
    ready_base: U64  # remote address of the readiness words (layout.py): ready[layer, page]
    pool_shards: Annotated[int, Field(ge=1, le=4096)] = 1  # PoolGeometry.shards (layout.py)
    state_slots: U32 = 0  # PoolGeometry.state_slots: requests' state pages, after the readiness words
    ucx_host: str
    ucx_port: Annotated[int, Field(ge=0, le=65535)]
    ucx_token: Annotated[bytes, Field(min_length=32, max_length=32)]  # one-time: binds the UCX endpoint to this session


class AllocRequest(Msg):
    type: Literal["alloc"] = "alloc"
    req_id: ReqId
    chunk_keys: Annotated[list[Key], Field(min_length=1, max_length=MAX_CHUNKS)]
    last_chunk_tokens: Annotated[int, Field(ge=1, le=1 << 20)]
    lease_ms: Annotated[int, Field(ge=1, le=3_600_000)]
    tp_size: Annotated[int, Field(ge=1, le=4096)] = 1  # prefill ranks pushing it (their shares: layout.py)
    # "words": the sender sends no Commit if the receiver agrees (AllocResponse.completion): its readiness words,
    # put after each layer's bytes are flushed, say every layer landed, and the receiver commits on seeing them all
    completion: Completion = "commit"
    # the sender's number for this attempt of the request (never 0; an engine's retry of the id has another, its
    # AllocRequests again after pool_exhausted the same: one is answered before the next goes), which the
    # AllocResponse echoes: answers come in order, but one that came too late for an attempt the sender gave up on
    # can come while a retry of the same id waits for its own
    attempt: Annotated[int, Field(ge=1, lt=1 << 32)] = 1


class AllocResponse(Msg):
    type: Literal["alloc_ok"] = "alloc_ok"
    req_id: ReqId
    already_sent_indexes: list[U32]
    # Pages for the new chunks, in chunk order, as (first page, count) runs.
    page_runs: list[tuple[U32, U32]]
    lease_id: U64
    # The lease granted, as a duration: hosts' monotonic clocks share no epoch, so no clock reading crosses
    # the wire. The sender's deadline runs on its own clock from when it sent the AllocRequest.
    lease_ms: Annotated[int, Field(ge=1, le=3_600_000)]
    state_slot: Annotated[int, Field(ge=-1, lt=1 << 32)] = -1  # the request's state pages (-1: no state)
    # how this request completes: "words" only where asked, with new pages, no state layer and no checksum to
    # verify (those need a message after the bytes); else "commit" (a Commit and its CommitAck)
    completion: Completion = "commit"
    attempt: Annotated[int, Field(ge=1, lt=1 << 32)] = 1  # the AllocRequest's it answers


Layers = Annotated[list[U32], Field(min_length=1, max_length=4096)]


class LayerDone(Msg):
    """These layers' puts were flushed, with their checksums: sent only where the sender computes them (the
    receiver verifies them before it says the layers are there). One notice carries every layer of a request
    that completed in the same pass of the sender's loop."""

    type: Literal["layer_done"] = "layer_done"
    req_id: ReqId
    layers: Layers
    checksums: Annotated[list[U64], Field(max_length=4096)] | None = None  # one per layer, in order


class Commit(Msg):
    """Every layer's puts (and readiness words) of the request are flushed: the one completion notice. No
    notice per layer precedes it unless it carries a checksum (``LayerDone``)."""

    type: Literal["commit"] = "commit"
    req_id: ReqId
    layers: Annotated[int, Field(ge=0, le=1 << 20)]  # layers the sender pushed: the receiver checks it has them all


class CommitAck(Msg):
    type: Literal["commit_ack"] = "commit_ack"
    req_id: ReqId
    chunks_committed: U32


class Abort(Msg):
    type: Literal["abort"] = "abort"
    req_id: ReqId
    reason: Annotated[str, Field(max_length=1024)] = ""
    # sender -> receiver: none of the request's writes is queued or in flight any more (each completed), so
    # its pages may be reused. False: some may still land; the receiver keeps the pages out of use until a
    # settled Abort follows, or it has closed the sender's endpoints (sessions/receiver.py, "Fencing").
    settled: bool = False


class Error(Msg):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: Annotated[str, Field(max_length=4096)]
    req_id: str | None = None
    retry_after_ms: U32 | None = None
    # the AllocRequest's attempt where this answers one (protocol 8; AllocRequest.attempt); 0: it names none
    attempt: Annotated[int, Field(ge=0, lt=1 << 32)] = 0


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
    last_chunk_tokens: Annotated[int, Field(ge=1, le=1 << 20)]
    # tensor parallelism: every rank sends its own Begin under the same req_id; one request on the wire
    tp_rank: Annotated[int, Field(ge=0, le=4095)] = 0
    tp_size: Annotated[int, Field(ge=1, le=4096)] = 1
    # pipeline parallelism: each stage's ranks begin it too, pushing their stage's layers [first, end)
    pp_rank: Annotated[int, Field(ge=0, le=255)] = 0
    pp_size: Annotated[int, Field(ge=1, le=256)] = 1
    first_layer: Annotated[int, Field(ge=0, le=4096)] = 0
    end_layer: Annotated[int, Field(ge=0, le=4096)] = 0  # 0: every layer (pp_size 1)
    handover_ring: bool = False  # this engine can write a hand-over ring (ring.py); it says Bye when it closes
    local_version: U32 = LOCAL_PROTOCOL_VERSION  # the engine's (_validate refuses another); absent on the wire: 0


class BeginOk(Msg):
    type: Literal["begin_ok"] = "begin_ok"
    req_id: ReqId
    already_sent_indexes: list[U32]
    staging_shmid: int
    staging_bytes: U64
    staging_offset: U64  # the request's grant table in staging (plan.py): each layer's block, once granted
    new_chunks: U32
    # this sender's start (random; new on every start): a request begun on another start writes a dead staging
    daemon_id: Annotated[str, Field(max_length=64)] = ""
    pool_shards: Annotated[int, Field(ge=1, le=4096)] = 1  # the receiver's; with tp_size, the staging shares
    # the hand-over ring of this connection (ring.py): its records name the request by ``handle``
    handle: U32 = 0
    ring_offset: U64 = 0
    ring_slots: U32 = 0  # 0: no ring, hand layers over by LayerReady
    idle_offset: U64 = 0  # the sender's idle word: wake it after a record when it is set
    doorbell: Annotated[str, Field(max_length=4096)] = ""  # its FIFO to wake it (doorbell.py); "": by Wake
    ring_finish: bool = False  # the ring also takes the request's Finish, as a record (ring.py FINISH)
    local_version: U32 = LOCAL_PROTOCOL_VERSION  # the sender's (_validate refuses another); absent on the wire: 0


class LayerReady(Msg):
    """These layers are in staging: push them."""

    type: Literal["layer_ready"] = "layer_ready"
    req_id: ReqId
    layers: Layers


class Wake(Msg):
    """The engine wrote its hand-over ring while the sender said it was idle (ring.py)."""

    type: Literal["wake"] = "wake"


class Bye(Msg):
    """This connection will not write its hand-over ring again: the sender may reuse it."""

    type: Literal["bye"] = "bye"


class NeedStaging(Msg):
    """The engine is about to write ``unit`` (plan.py: a layer, or the state) and found no block granted."""

    type: Literal["need_staging"] = "need_staging"
    req_id: ReqId
    unit: Annotated[int, Field(ge=0, le=4096)]


class StagingGranted(Msg):
    """The block of ``unit`` an engine asked for is in the request's grant table."""

    type: Literal["staging_granted"] = "staging_granted"
    req_id: ReqId
    unit: Annotated[int, Field(ge=0, le=4096)]


class Finish(Msg):
    type: Literal["finish"] = "finish"
    req_id: ReqId


class Done(Msg):
    type: Literal["done"] = "done"
    req_id: ReqId
    bytes_sent: U64
    puts: U32  # all ranks'
    layers: U32
    chunks_skipped: U32
    rank_puts: U32 = 0  # this rank's: (layers x page runs) where its share is one pool shard
    layer_done_ms: list[float]


# ---- decode engine <-> receiver (local) ---------------------------------------------------

class Open(Msg):
    type: Literal["open"] = "open"
    req_id: ReqId
    tp_size: Annotated[int, Field(ge=1, le=4096)] = 1  # decode ranks that each open it: kept until all released
    # it must be here already (a load planned from the prefill's answer, whose Begin was answered before that
    # answer left): one that is not is refused at once, not parked until its push begins
    exists: bool = False
    local_version: U32 = LOCAL_PROTOCOL_VERSION  # the engine's (_validate refuses another); absent on the wire: 0


class OpenOk(Msg):
    type: Literal["open_ok"] = "open_ok"
    req_id: ReqId
    shmid: int
    pool_base: U64
    pool_pages: U32
    layout: LayoutSpec
    pages: list[U32]  # one page per item, all items (held + new), in item order (plan.py: (group, chunk))
    new_idx: list[U32] = []  # item indexes this request writes (the others were held complete)
    chunks: U32 = 0  # the prompt's chunks (0: as many as pages, one layer group)
    state_slot: Annotated[int, Field(ge=-1, lt=1 << 32)] = -1  # its state pages (-1: none)
    state_slots: U32 = 0  # PoolGeometry.state_slots
    lease_id: U64 = 0  # the value its readiness words take as each layer lands (layout.py)
    ready_in_pool: bool = False  # read readiness from the pool (off where the receiver verifies checksums)
    last_chunk_tokens: U32
    layers_ready: list[U32]
    committed: bool
    completion: Completion = "commit"  # "words": every layer's readiness words set means committed (AllocResponse)
    daemon_id: Annotated[str, Field(max_length=64)] = ""  # this receiver's start (liveness: lifeline.py)
    pool_shards: Annotated[int, Field(ge=1, le=4096)] = 1  # PoolGeometry.shards (layout.py)
    # the request's last chunk key (layout.chunk_keys: it covers every token before it), so that a decode that planned
    # its load from the prefill's answer, without asking, can check that the push is of its own prompt
    last_key: Annotated[bytes, Field(max_length=16)] = b""
    local_version: U32 = LOCAL_PROTOCOL_VERSION  # the receiver's (_validate refuses another); absent: 0


class LayerAvailable(Msg):
    """These layers landed in the pool (batched like LayerDone)."""

    type: Literal["layer_available"] = "layer_available"
    req_id: ReqId
    layers: Layers


class Committed(Msg):
    type: Literal["committed"] = "committed"
    req_id: ReqId


class Release(Msg):
    type: Literal["release"] = "release"
    req_id: ReqId
    answer: bool = True  # False: nobody waits for the answer, so none goes (a late one would answer a later open)
    lease_id: U64 = 0  # the OpenOk's: which of the id's opens it gives up (0: one never answered: this connection's
    # open of the live request, else its parked one; never a failed try's, whose hold then lasts until lease_ms)


class Query(Msg):
    type: Literal["query"] = "query"
    chunk_keys: Annotated[list[Key], Field(max_length=MAX_CHUNKS)]
    req_id: ReqId | None = None  # also count how far this live (maybe still arriving) request covers the keys
    # the engine's (_validate refuses another): a decode scheduler may ask before it opens anything; absent: 0
    local_version: U32 = LOCAL_PROTOCOL_VERSION


class QueryReply(Msg):
    type: Literal["query_ok"] = "query_ok"
    held_prefix: U32  # leading keys held complete in the chunk index
    request_chunks: U32 = 0  # leading keys that the request named in the query carries (0: not live here)
    request_gone: bool = False  # the named request was here and has ended (failed, expired or released)
    request_committed: bool = False  # the named request is here and committed: every layer has landed
    local_version: U32 = LOCAL_PROTOCOL_VERSION  # the receiver's (_validate refuses another); absent: 0


class Claim(Msg):
    """Decode side, local endpoint: open a request made of the chunks the index already holds (the
    leading ``chunk_keys`` held complete), with no push. They are pinned until the request is
    released, or for ``lease_ms`` if it is never opened. Idempotent for the same ``req_id``."""

    type: Literal["claim"] = "claim"
    req_id: ReqId
    chunk_keys: Annotated[list[Key], Field(min_length=1, max_length=MAX_CHUNKS)]
    last_chunk_tokens: Annotated[int, Field(ge=1, le=1 << 20)]  # of the prompt's last chunk (used if every chunk is held)
    lease_ms: Annotated[int, Field(ge=1, le=3_600_000)]
    local_version: U32 = LOCAL_PROTOCOL_VERSION  # the engine's (_validate refuses another); absent on the wire: 0


class ClaimOk(Msg):
    type: Literal["claim_ok"] = "claim_ok"
    req_id: ReqId
    chunks: U32  # leading chunks claimed (0: none held, and no request was made)
    local_version: U32 = LOCAL_PROTOCOL_VERSION  # the receiver's (_validate refuses another); absent: 0


# ---- chunk-index events (receiver -> routers, on the control endpoint) ----

MAX_INDEX_KEYS = 1 << 22  # a snapshot holds every indexed key: at most the pool's pages


class IndexSubscribe(Msg):
    """A router asks for a snapshot of the chunk index, then its changes. Sent again on a gap, on a
    new epoch, after silence, and every few seconds as a keep-alive."""

    type: Literal["index_subscribe"] = "index_subscribe"
    snapshot: bool = True  # False: keep-alive only


class IndexLoad(Msg):
    """The receiver's load, carried by every snapshot and event."""

    pages_free: U32
    pages_total: U32
    requests_inflight: U32


class IndexSnapshot(Msg):
    type: Literal["index_snapshot"] = "index_snapshot"
    epoch: Annotated[str, Field(min_length=1, max_length=64)]  # new on every receiver start
    seq: U64  # the last event folded into ``keys``
    layout: LayoutSpec
    keys: Annotated[list[Key], Field(max_length=MAX_INDEX_KEYS)]
    load: IndexLoad


class IndexEvent(Msg):
    """``stored``/``evicted``/``cleared`` take the next seq; ``heartbeat`` repeats the current one."""

    type: Literal["index_event"] = "index_event"
    epoch: Annotated[str, Field(min_length=1, max_length=64)]
    seq: U64
    kind: Literal["stored", "evicted", "cleared", "heartbeat"]
    keys: Annotated[list[Key], Field(max_length=MAX_INDEX_KEYS)] = []
    load: IndexLoad


class Withdraw(Msg):
    """A router, to the receiver of a decode leg it sent beside its prefill leg: the push ``req_id`` will not come
    (the prefill leg surely pushed nothing: router/app.py). The decode's next ``Query`` of it finds it gone, so the
    decode recomputes at once instead of waiting out its ``push_wait_s``, and a push of it that begins later is
    refused. A push already begun is left to end as it would. Accepted from any peer the control endpoint admits,
    a reader's key too (sessions/receiver.py, "Withdrawn pushes"); answered ``Ok`` naming it, or ``Ok`` with no
    ``req_id`` where the push had begun (nothing withdrawn). A decode engine sends it too, on the local endpoint,
    for a push it will not read (its ``push_wait_s`` passed, or its request ended without loading it): one that
    begins later is refused, and one already begun that nobody has open is dropped once committed; so is a claim
    (``Claim``) it made and never loaded, whose held chunks are then unpinned."""

    type: Literal["withdraw"] = "withdraw"
    req_id: ReqId
    reason: Annotated[str, Field(max_length=1024)] = ""


class Unread(Msg):
    """A router, to the receiver of the decode its request was placed on, once no decode engine will read push
    ``req_id`` nor withdraw it: the client hung up before a decode leg naming it reached its engine, or that engine
    refused or failed the leg (an error status, a broken connection; a leg recomputed elsewhere). As ``Withdraw``,
    and a push of it already begun that nobody has open is dropped once committed (at once if it is), as its
    decode's own ``Withdraw`` does. Never a claim's. Accepted where ``Withdraw`` is, on the control endpoint (a
    reader's key too); answered as ``Withdraw`` is. A message of its own, not a field of ``Withdraw``: a receiver
    older than its router refuses it alone, and keeps taking the router's other withdrawals."""

    type: Literal["unread"] = "unread"
    req_id: ReqId
    reason: Annotated[str, Field(max_length=1024)] = ""


class Ok(Msg):
    type: Literal["ok"] = "ok"
    req_id: str | None = None


Message = Annotated[
    Union[
        Hello, HelloAck, AllocRequest, AllocResponse, LayerDone, Commit, CommitAck, Abort, Error,
        StatusRequest, StatusReply, Begin, BeginOk, LayerReady, Wake, Bye, NeedStaging, StagingGranted, Finish, Done,
        Open, OpenOk, LayerAvailable, Committed, Release, Query, QueryReply, Ok, Claim, ClaimOk, IndexSubscribe, IndexSnapshot,
        IndexEvent, Withdraw, Unread,
    ],
    Field(discriminator="type"),
]
_adapter: TypeAdapter = TypeAdapter(Message)


# every message's msgspec twin (fastcodec.py): it decodes, in C, the frames it accepts into the same messages, and
# leaves the others to msgpack and pydantic (``_unpack``, ``_validate``), which stay the authority. A versioned
# message takes the fast path only with this local protocol's version on the wire (``_check_local`` judges others).
# ``Error.attempt`` (protocol 8) is absent from an Error that names no attempt: every Error on the local path, and
# a Hello's refusal, then reads as before it, to an engine or a sender of the version before (their models refuse an
# unknown field, and an Error they cannot read fails another request than its own, or none)
_fast = fastcodec.Codec(list(typing.get_args(typing.get_args(Message)[0])),
                        pinned={"local_version": LOCAL_PROTOCOL_VERSION}, base=Msg, sparse={Error: {"attempt": 0}})


def encode(msg: Msg) -> bytes:
    """A message's fields in order, as a msgpack map (what ``msgpack.packb(msg.model_dump())`` gives, byte for
    byte, but for a sparse field at its default: ``Error.attempt`` 0 is left out)."""
    if not isinstance(msg, Msg):
        raise LocalProtocolError(f"not a protocol message: {type(msg).__name__}")
    return _fast.encode(msg)


def encode_batch(encoded: list[bytes]) -> bytes:
    """Several messages to one peer in one frame: a msgpack array of the messages, each as ``encode`` made it (so each
    is encoded once, whichever frame it ends up in); one message is sent as itself. The daemons send what one pass of
    their loop has for a peer this way (``daemon.Outbox``): one wire message, shared by its requests."""
    n = len(encoded)
    if n == 1:
        return encoded[0]
    if not 1 < n <= MAX_BATCH:
        raise LocalProtocolError(f"a batch of {n} messages (1..{MAX_BATCH})")
    head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")  # fixarray, array 16
    return head + b"".join(encoded)


def _cap(frame: bytes, max_frame: int) -> None:
    if len(frame) > max_frame:
        raise FrameTooLarge(f"frame of {len(frame)} bytes exceeds the {max_frame}-byte cap")


def _unpack(frame: bytes, max_frame: int):
    _cap(frame, max_frame)
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises many unrelated types on garbage
        raise RemoteProtocolError(f"undecodable frame: {type(e).__name__}: {e}") from None


def _entry(o, i: int) -> Msg | RemoteProtocolError:
    """One entry of a batch (its bytes, where the fast path split the frame, or what msgpack made of it): its message,
    or the error that costs only that entry."""
    try:
        if isinstance(o, msgspec.Raw):
            if (msg := _fast.decode(o)) is not None:
                return msg
            o = _unpack(bytes(o), len(o))
        if not isinstance(o, dict):
            raise RemoteProtocolError(f"batch entry {i} is a msgpack {type(o).__name__}, expected a map")
        return _validate(o)
    except (RemoteProtocolError, IncompatiblePeer) as e:  # (another local protocol's entry: only itself refused)
        return e


def decode_batch(frame: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> list[Msg | PdpushError]:
    """A frame from a peer daemon: one message, or a batch of them (``encode_batch``). Each entry is a validated
    message or the RemoteProtocolError saying why it is not one, so one bad entry costs only itself. A frame that is
    not a message or a batch of 2..MAX_BATCH raises RemoteProtocolError (or FrameTooLarge)."""
    _cap(frame, max_frame)
    if (msg := _fast.decode(frame)) is not None:
        return [msg]
    obj = _fast.entries(frame, MAX_BATCH)
    if obj is None:
        obj = _unpack(frame, max_frame)
        if isinstance(obj, dict):
            return [_validate(obj)]
    if not isinstance(obj, list) or not 1 < len(obj) <= MAX_BATCH:
        raise RemoteProtocolError(f"frame is a msgpack {type(obj).__name__}"
                                  f"{f' of {len(obj)}' if isinstance(obj, list) else ''}, expected a map or a batch "
                                  f"of 2..{MAX_BATCH} maps")
    return [_entry(o, i) for i, o in enumerate(obj)]


def decode(frame: bytes, max_frame: int = DEFAULT_MAX_FRAME, fast: bool = True) -> Msg:
    """Bytes -> validated message, or RemoteProtocolError. Never anything else. ``fast=False``: by msgpack and
    pydantic alone, the authority the fast path answers as (the bench compares the two)."""
    _cap(frame, max_frame)
    msg = _fast.decode(frame) if fast else None
    if msg is not None:
        return msg
    obj = _unpack(frame, max_frame)
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"frame is a msgpack {type(obj).__name__}, expected a map")
    return _validate(obj)


# the messages that carry local_version: those that begin something for an engine on its daemon, the query a decode
# scheduler may send before any of them (its chunk keys are computed by the engine's pdpush), and their answers
_VERSIONED = frozenset({"begin", "begin_ok", "open", "open_ok", "claim", "claim_ok", "query", "query_ok"})
# answered by a message that names no request (QueryReply): a refusal naming the request asked about would be filed
# under it, and the engine's wait for the answer would never see it
_ANSWER_NAMELESS = frozenset({"query"})
_OF_LOCAL = "is of local protocol"  # in _check_local's message, which is all an Error carries to an engine


def _check_local(obj: dict) -> None:
    """A Begin, Open, Claim or Query (an engine to its daemon) or its answer of another local protocol than this
    pdpush's (``LOCAL_PROTOCOL_VERSION``; absent: 0, a pdpush from before it was numbered) is an ``IncompatiblePeer``
    naming both versions and, where the message carries a valid one, the request, so that the answer reaches that
    request (``error_reply``; an engine files it, ``decode_answer``). A Query's names none (``_ANSWER_NAMELESS``).
    Looked at before the fields: another version's may differ."""
    v = obj.get("local_version", 0)
    if v == LOCAL_PROTOCOL_VERSION:
        return
    rid = obj.get("req_id") if obj.get("type") not in _ANSWER_NAMELESS else None
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= 256 else None
    theirs = v if isinstance(v, int) and v else "0 (a pdpush from before local protocol versions)"
    raise IncompatiblePeer(f"{obj.get('type')} for {rid!r} {_OF_LOCAL} {theirs}, this pdpush speaks "
                           f"{LOCAL_PROTOCOL_VERSION}: install one pdpush version in the engine's environment and the "
                           f"daemons' (`pdpush --version` prints it)", req_id=rid)


def _validate(obj: dict) -> Msg:
    t = obj.get("type")
    if not isinstance(t, str | None):  # (a list or a map: unhashable, and no message's)
        raise RemoteProtocolError(f"invalid message at type: a msgpack {type(t).__name__}, expected a string")
    if t in _VERSIONED:
        _check_local(obj)
    try:
        return _adapter.validate_python(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise RemoteProtocolError(f"invalid message at {where or '<root>'}: {first.get('msg')}") from None


def local_mismatch(e: Exception) -> bool:
    """Whether ``e`` says an engine and its daemon speak different local protocols (``_check_local``): a lasting
    condition, which the connector treats as a daemon that is not there. Also an older daemon's refusal of the
    ``local_version`` field itself (``_validate``'s "invalid message at query.local_version: Extra inputs ...": a
    Query to a daemon of local protocol 1, which did not number queries), where that refusal reaches the engine."""
    if isinstance(e, IncompatiblePeer):
        return _OF_LOCAL in str(e)
    return isinstance(e, ProtocolError) and e.code is ErrorCode.BAD_MESSAGE and ".local_version:" in str(e)


def decode_answer(frame: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> Msg:
    """``decode`` for an engine reading its daemon's answers: one that cannot be read but names its request (another
    local protocol's BeginOk or OpenOk) becomes that request's ``Error``, so that the request fails with it rather
    than whichever wait read the frame."""
    try:
        return decode(frame, max_frame)
    except PdpushError as e:
        if e.req_id is None:
            raise
        return error_reply(e)


def error_reply(err: PdpushError, req_id: str | None = None, attempt: int = 0) -> Error:
    """The one place an exception becomes a wire ``Error``: its code comes from its class. ``attempt``: the
    AllocRequest's it answers, if it answers one."""
    return Error(code=type(err).code, message=str(err)[:4096], req_id=req_id if req_id is not None else err.req_id,
                 retry_after_ms=err.retry_after_ms, attempt=attempt)


# ---- state machines --------------------------------------------------------------------------

class StateMachine:
    """A transition table for one kind of state. A missing transition raises
    ``UnexpectedMessage`` naming the role, the state and the event."""

    def __init__(self, role: str, table: dict[tuple[Enum, Enum], Enum]) -> None:
        self.role = role
        self.table = table

    def next(self, state: Enum, event: Enum, what: str) -> Enum:
        nxt = self.table.get((state, event))
        if nxt is None:
            raise UnexpectedMessage(f"{self.role}: {what} is {state.value}; {event.value} is not allowed there")
        return nxt

    def allows(self, state: Enum, event: Enum) -> bool:
        return (state, event) in self.table


# ---- receiver-side request state machine ---------------------------------------------------

class ReqState(Enum):
    ALLOCATED = "allocated"   # pages leased, waiting for layers
    STREAMING = "streaming"   # at least one LayerDone seen
    COMMITTED = "committed"   # chunks complete and indexed; readers may hold it open
    ABORTED = "aborted"
    EXPIRED = "expired"


class ReqEvent(Enum):
    LAYER_DONE = "layer_done"
    COMMIT = "commit"
    WORDS = "words"  # a "words" request's every readiness word is set: committed with no message
    ABORT = "abort"
    EXPIRE = "expire"


RECEIVER_REQUEST = StateMachine("receiver request", {
    (ReqState.ALLOCATED, ReqEvent.LAYER_DONE): ReqState.STREAMING,
    (ReqState.STREAMING, ReqEvent.LAYER_DONE): ReqState.STREAMING,
    (ReqState.ALLOCATED, ReqEvent.COMMIT): ReqState.COMMITTED,  # 0 new chunks: nothing to stream
    (ReqState.STREAMING, ReqEvent.COMMIT): ReqState.COMMITTED,
    (ReqState.ALLOCATED, ReqEvent.WORDS): ReqState.COMMITTED,
    (ReqState.STREAMING, ReqEvent.WORDS): ReqState.COMMITTED,
    (ReqState.ALLOCATED, ReqEvent.ABORT): ReqState.ABORTED,
    (ReqState.STREAMING, ReqEvent.ABORT): ReqState.ABORTED,
    (ReqState.ALLOCATED, ReqEvent.EXPIRE): ReqState.EXPIRED,
    (ReqState.STREAMING, ReqEvent.EXPIRE): ReqState.EXPIRED,
})


def transition(state: ReqState, event: ReqEvent, req_id: str) -> ReqState:
    """Next receiver request state, or UnexpectedMessage naming role, state and event."""
    return RECEIVER_REQUEST.next(state, event, f"request {req_id!r}")  # type: ignore[return-value]


# ---- sender-side request and peer state machines -------------------------------------------

class TxState(Enum):
    WAIT_PEER = "wait_peer"          # hello under way to its receiver
    ALLOCATING = "allocating"        # AllocRequest sent
    ALLOC_BACKOFF = "alloc_backoff"  # receiver said pool_exhausted; retrying within a budget
    STREAMING = "streaming"          # engine hands layers over; puts posted per layer
    COMMITTING = "committing"        # Commit sent, waiting for CommitAck
    DONE = "done"
    FAILED = "failed"


class TxEvent(Enum):
    PEER_READY = "peer_ready"
    ALLOC_OK = "alloc_ok"
    EXHAUSTED = "exhausted"
    RETRY = "retry"
    COMMIT = "commit"
    COMMIT_ACK = "commit_ack"
    LANDED = "landed"  # completion on the data path: every layer's readiness words flushed (no Commit)
    FAIL = "fail"


_LIVE_TX = (TxState.WAIT_PEER, TxState.ALLOCATING, TxState.ALLOC_BACKOFF, TxState.STREAMING, TxState.COMMITTING)
SENDER_REQUEST = StateMachine("sender request", {
    (TxState.WAIT_PEER, TxEvent.PEER_READY): TxState.ALLOCATING,
    (TxState.ALLOCATING, TxEvent.ALLOC_OK): TxState.STREAMING,
    (TxState.ALLOCATING, TxEvent.EXHAUSTED): TxState.ALLOC_BACKOFF,
    (TxState.ALLOC_BACKOFF, TxEvent.RETRY): TxState.ALLOCATING,
    (TxState.STREAMING, TxEvent.COMMIT): TxState.COMMITTING,
    (TxState.COMMITTING, TxEvent.COMMIT_ACK): TxState.DONE,
    (TxState.STREAMING, TxEvent.LANDED): TxState.DONE,
    **{(s, TxEvent.FAIL): TxState.FAILED for s in _LIVE_TX},
})


class PeerState(Enum):
    NEW = "new"                # no hello yet (or refused: try again on the next request)
    HELLO_SENT = "hello_sent"
    CONNECTING = "connecting"  # HelloAck in; UCX endpoint wiring up (token, rkey)
    READY = "ready"
    DEAD = "dead"              # failed; a fresh socket and hello on the next request


class PeerEvent(Enum):
    HELLO = "hello"
    HELLO_ACK = "hello_ack"
    CONNECTED = "connected"
    REFUSED = "refused"
    FAIL = "fail"


SENDER_PEER = StateMachine("sender peer", {
    (PeerState.NEW, PeerEvent.HELLO): PeerState.HELLO_SENT,
    (PeerState.DEAD, PeerEvent.HELLO): PeerState.HELLO_SENT,
    (PeerState.HELLO_SENT, PeerEvent.HELLO_ACK): PeerState.CONNECTING,
    (PeerState.CONNECTING, PeerEvent.CONNECTED): PeerState.READY,
    (PeerState.HELLO_SENT, PeerEvent.REFUSED): PeerState.NEW,
    **{(s, PeerEvent.FAIL): PeerState.DEAD for s in (PeerState.HELLO_SENT, PeerState.CONNECTING, PeerState.READY)},
})
