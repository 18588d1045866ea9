"""The sender session's actions: what ``SenderSession`` (and its staging book, ``grants.py``) asks its
shell (``pdpush.sender``) to do. Pure data; imports no zmq, UCX or torch."""

from __future__ import annotations

from dataclasses import dataclass

from pdpush.protocol import HelloAck, Msg


@dataclass(frozen=True)
class ToClient:
    ident: bytes
    msg: Msg


@dataclass(frozen=True)
class ToPeer:
    endpoint: str
    msg: Msg
    handle: int = 0  # an Abort's request: the shell marks it settled once none of its writes is in flight


@dataclass(frozen=True)
class Connect:
    """Open the data plane to a receiver (UCX endpoint, session token, rkey); answer with on_connected."""

    endpoint: str
    ack: HelloAck


@dataclass(frozen=True)
class PlanRequest:
    """A request's put plan for the native per-layer path (put_plan.py): from now on its layers handed
    over are posted to ``endpoint``, and each that lands is reported (``SenderSession.on_landed``)."""

    handle: int
    endpoint: str
    layers: list[tuple[int, int, int, int]]  # per layer: (group, pool address, readiness address, block bytes)
    ready: list[list[tuple[int, int, int]]]  # per group: readiness puts (staging address, offset, bytes)
    tp: int  # shares per layer


@dataclass(frozen=True)
class PlanRank:
    """One rank (connection ``ident``) of a planned request: its stage's layers and its share's spans."""

    handle: int
    ident: bytes
    first: int
    end: int
    ranges: list[list[tuple[int, int, int]]]  # per group: (offset in the block, offset in the pool, bytes)


@dataclass(frozen=True)
class PlanGrants:
    """Layers of a planned request have their staging blocks, ``grants`` as (layer, block offset): the shell
    tells the native path first (where it reads them from, put_plan.py), then writes each block's offset + 1
    into the layer's word of the request's grant table at staging address ``table`` (where its engines do).
    One action for all the blocks a request gets at once (at allocation, ``StagingGrants.ahead``)."""

    handle: int
    table: int
    grants: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Hand:
    """Connection ``ident`` handed ``layers`` of request ``handle`` over by message: take them as its ring
    records are taken; answer refusals with ``on_refused``."""

    ident: bytes
    handle: int
    layers: tuple[int, ...]


@dataclass(frozen=True)
class Unplan:
    """The request ended: its plan goes (completions still in flight for it are dropped)."""

    handle: int


@dataclass(frozen=True)
class FillWords:
    """Write ``count`` u64 words of ``value`` at ``address`` (the source of readiness puts)."""

    address: int
    value: int
    count: int


@dataclass(frozen=True)
class ResetPeer:
    """Close the receiver's UCX endpoint and start a fresh control socket (queued frames are stale)."""

    endpoint: str


@dataclass(frozen=True)
class ForgetPeer:
    """The session forgot this receiver (failed or never reached, and no request on it): whatever the shell keeps
    for its endpoint goes too, so that a sender seeing receivers come and go at new addresses does not grow."""

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
    daemon_id: str  # this sender's start (BeginOk.daemon_id)
    doorbell: str = ""  # the FIFO that wakes the sender (doorbell.py), offered with a hand-over ring


def action_owner(a) -> str | int | None:
    """The request an action belongs to: its req_id (a message), its handle (a put-plan action), or None
    (a receiver's or a connection's action, a metric)."""
    if isinstance(a, (ToClient, ToPeer)):
        return getattr(a.msg, "req_id", None)
    return getattr(a, "handle", None) if isinstance(a, (Hand, PlanGrants, PlanRequest, PlanRank, Unplan)) else None
