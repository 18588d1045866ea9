"""The sender session's actions: what ``SenderSession`` (and its staging book, ``grants.py``) asks its
shell (``pdpush.sender``) to do. Pure data; imports no zmq, ucxx or torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdpush.errors import TransportError
from pdpush.protocol import HelloAck, Msg
from pdpush.transport.base import PutOp


@dataclass(frozen=True)
class ToClient:
    ident: bytes
    msg: Msg


@dataclass(frozen=True)
class ToPeer:
    endpoint: str
    msg: Msg


@dataclass(frozen=True)
class Connect:
    """Open the data plane to a receiver (UCX endpoint, session token, rkey); answer with on_connected."""

    endpoint: str
    ack: HelloAck


@dataclass(frozen=True)
class PostPuts:
    """Post these layers' puts and one flush on ``endpoint``; answer with on_flushed([Flushed(token, ...)]).

    ``kind`` "data": the layers' puts, one per layer per page run. "ready": once their data is
    flushed, the layers' readiness words (layout.py), which a decode client reads in the pool."""

    endpoint: str
    ops: list[PutOp]
    token: tuple[int, tuple[int, ...], str, int]  # (request seq, layers, kind, rank)
    deadline_ms: int
    srcs: list[tuple[int, int]] = field(default_factory=list)  # data: (staging address, bytes) per layer


@dataclass(frozen=True)
class FillWords:
    """Write ``count`` u64 words of ``value`` at ``address`` (the source of readiness puts)."""

    address: int
    value: int
    count: int


@dataclass(frozen=True)
class Flushed:
    """A posted layer's flush completed (``error`` None) or failed."""

    token: tuple[int, tuple[int, ...], str, int]
    error: TransportError | None = None
    checksums: list[int] | None = None  # one per layer of the token, where checksums are on


@dataclass(frozen=True)
class ResetPeer:
    """Close the receiver's UCX endpoint and start a fresh control socket (queued frames are stale)."""

    endpoint: str


@dataclass(frozen=True)
class OpenRing:
    """Take hand-over records (ring.py) from ``ident``'s ring of ``slots`` words at ``address``."""

    ident: bytes
    address: int
    slots: int


@dataclass(frozen=True)
class CloseRing:
    """``ident``'s ring is gone: take no more records from it."""

    ident: bytes


@dataclass(frozen=True)
class StagingInfo:
    address: int
    shmid: int
    nbytes: int
    daemon_pid: int
