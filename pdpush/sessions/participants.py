"""The join of a request's participants on the sender (pure): its TP ranks and, with pipeline
parallelism, its stages.

Tensor parallelism: every prefill rank sends its own ``Begin`` under the same
req_id (``tp_rank``/``tp_size``); the first one allocates, and every rank gets
the same ``already_sent_indexes``. Each rank hands over its share of a layer
(layout.py: ``StagingShares``), and the layer lands (readiness words, ``LayerDone``)
only when every rank's share is flushed; the commit goes out once
every rank has finished. One rank's failure, abort or death fails the request
for all of them.

Pipeline parallelism joins stages the same way: each stage's ranks begin the request too
(``pp_rank``/``pp_size``, with the stage's layers ``[first_layer, end_layer)``), and a rank
hands over only its stage's layers. One allocation and one skip list for every stage's every
rank (``pp_size * tp_size`` participants); a layer lands when its stage's ranks' shares are in;
the commit goes out once every participant has finished; a dead stage fails it for all.

Here: a rank (``TxRank``), the participant arithmetic of a request (``Participants``), the checks
of a Begin (``check_begin``) and of a rank joining (``check_join``), and the requests ended lately
(``Ended``), so that a rank that begins one late is told rather than starting a request of its own.
The session (sender.py) allocates, fails and replies.

Imports no zmq, UCX, torch or clock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdpush.errors import DuplicateRequest, PdpushError, RemoteProtocolError, TransportTimeout, UnknownRequest
from pdpush.protocol import Begin

if TYPE_CHECKING:
    from pdpush.sessions.sender import TxRequest

MAX_PARTICIPANTS = 4096  # tp_size x pp_size of one request
ENDED_KEPT = 4096  # recently ended multi-rank requests remembered


@dataclass
class TxRank:
    """One prefill rank of a request (of one pipeline stage): its connection, and what it has handed over."""

    client: bytes
    tp_rank: int = 0
    pp_rank: int = 0
    layers: range = range(0)  # its stage's layers
    layers_posted: set[int] = field(default_factory=set)  # its layers landed (the native path knows the rest)
    finish: bool = False
    ring: bool = False  # its Begin asked for a hand-over ring
    puts: int = 0

    @classmethod
    def of(cls, client: bytes, msg: Begin, stage: range) -> TxRank:
        """The rank that sent ``msg`` on ``client``, pushing the layers ``stage``."""
        return cls(client, msg.tp_rank, msg.pp_rank, stage, ring=msg.handover_ring)


class Participants:
    """A request's participants (``TxRequest`` is one): ``ranks`` by participant (``pp_rank * tp + tp_rank``),
    ``tp`` ranks pushing each layer (Begin.tp_size), ``pp`` pipeline stages (Begin.pp_size)."""

    ranks: dict[int, TxRank]
    tp: int
    pp: int

    @property
    def world(self) -> int:
        """Participants: every stage's every rank."""
        return self.tp * self.pp

    @property
    def clients(self) -> list[bytes]:
        return [k.client for k in self.ranks.values()]

    def finished(self) -> bool:
        return len(self.ranks) == self.world and all(k.finish for k in self.ranks.values())

    def late(self) -> list[int]:
        """Participants missing from a stage whose other ranks have begun."""
        begun = {k.pp_rank for k in self.ranks.values()}
        return [p for s in sorted(begun) for p in range(s * self.tp, (s + 1) * self.tp) if p not in self.ranks]

    def rank_of(self, client: bytes) -> int | None:
        """The participant that ``client`` is, if it is one."""
        return next((rank for rank, k in self.ranks.items() if k.client == client), None)

    def late_error(self, waited_ms: int, timeout_ms: int) -> PdpushError | None:
        """The error for a stage whose ranks have not all begun ``timeout_ms`` after the first did (the TP ranks
        of a stage begin together; a later pipeline stage may begin a forward later: it has until the lease
        deadline)."""
        if len(self.ranks) < self.world and waited_ms > timeout_ms and (late := self.late()):
            more = f" and {len(late) - 8} more" if len(late) > 8 else ""
            return TransportTimeout(f"{', '.join(self.who(k) for k in late[:8])}{more} did not begin the request "
                                    f"within {timeout_ms} ms of the first")
        return None

    def who(self, participant: int) -> str:
        """A participant as errors name it."""
        stage, rank = divmod(participant, self.tp)
        return (f"stage {stage} of {self.pp}, " if self.pp > 1 else "") + f"rank {rank} of {self.tp}"


def check_begin(msg: Begin) -> range:
    """A Begin's ranks and stage in range and fitting its layout: the layers its stage pushes."""
    if msg.tp_rank >= msg.tp_size:
        raise RemoteProtocolError(f"tp_rank {msg.tp_rank} out of range for tp_size {msg.tp_size}")
    if msg.pp_rank >= msg.pp_size:
        raise RemoteProtocolError(f"pp_rank {msg.pp_rank} out of range for pp_size {msg.pp_size}")
    if msg.tp_size * msg.pp_size > MAX_PARTICIPANTS:
        raise RemoteProtocolError(f"tp_size {msg.tp_size} x pp_size {msg.pp_size} exceeds {MAX_PARTICIPANTS} ranks")
    stage = _stage_layers(msg)
    push_layers = msg.layout.layers + msg.layout.state_layers  # each state layer after them (layout.py)
    if msg.pp_size > 1 and msg.layout.state_layers:
        raise RemoteProtocolError("pipeline parallelism with state layers is not supported: one stage pushes "
                                  "the state")
    if stage.stop > push_layers or (msg.pp_size == 1 and stage != range(push_layers)):
        raise RemoteProtocolError(f"stage layers [{stage.start}, {stage.stop}) do not fit the layout's "
                                  f"{push_layers} layers" + (" (one stage pushes them all)"
                                                              if msg.pp_size == 1 else ""))
    return stage


def check_join(r: TxRequest, client: bytes, msg: Begin, stage: range) -> tuple[int, PdpushError | None]:
    """Another rank (or stage) of ``r`` begins it: its participant, and the error that fails ``r`` if
    its Begin does not match the first (or its stage does not fit the others'). A duplicate is raised."""
    b = r.begin
    part = msg.pp_rank * r.tp + msg.tp_rank
    if r.world == 1 or part in r.ranks or client in r.clients:
        raise DuplicateRequest(f"request {msg.req_id!r} already in flight"
                               + (f" ({r.who(part)} began it already)" if r.world > 1 else ""))
    if (msg.tp_size, msg.pp_size) != (r.tp, r.pp):
        raise DuplicateRequest(f"request {msg.req_id!r} already in flight with tp_size {r.tp}, pp_size {r.pp} "
                               f"(this Begin says {msg.tp_size}, {msg.pp_size})")
    if (msg.chunk_keys, msg.last_chunk_tokens, msg.layout, msg.receiver) != (
            b.chunk_keys, b.last_chunk_tokens, b.layout, b.receiver):
        return part, RemoteProtocolError(f"{r.who(part)} began {msg.req_id!r} with a different prompt, layout "
                                         "or receiver than the ranks before it")
    return part, _check_stage(r, msg.pp_rank, stage)


class Ended:
    """Multi-rank requests ended lately (bounded): req_id -> the error that ended it, None if it completed."""

    def __init__(self) -> None:
        self.ended: OrderedDict[str, PdpushError | None] = OrderedDict()

    def add(self, r: TxRequest) -> None:
        if r.world > 1:  # a rank that begins it late is told, rather than starting a request of its own
            self.ended[r.req_id] = r.failure
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)

    def check(self, msg: Begin) -> None:
        """A Begin of no request in flight: a late rank of one that ended gets what the others got."""
        if msg.tp_size * msg.pp_size > 1 and msg.req_id in self.ended:
            why = self.ended[msg.req_id]
            who = (f"stage {msg.pp_rank} " if msg.pp_size > 1 else "") + f"rank {msg.tp_rank}"
            if why is None:
                raise UnknownRequest(f"request {msg.req_id!r} already completed without {who}")
            raise type(why)(f"request {msg.req_id!r} ended before {who} began it: {why}")


def _stage_layers(msg: Begin) -> range:
    """The layers a Begin's stage pushes (every layer for one stage)."""
    if msg.end_layer == 0 and msg.first_layer == 0:
        if msg.pp_size > 1:
            raise RemoteProtocolError(f"stage {msg.pp_rank} of {msg.pp_size} did not say its layers")
        return range(int(msg.layout.layers) + int(msg.layout.state_layers))
    if not msg.first_layer < msg.end_layer:
        raise RemoteProtocolError(f"stage layers [{msg.first_layer}, {msg.end_layer}) are empty")
    return range(msg.first_layer, msg.end_layer)


def _check_stage(r: TxRequest, pp_rank: int, stage: range) -> PdpushError | None:
    """A joining rank's stage layers: the same as its stage's other ranks', disjoint from the other
    stages'; once every stage has begun, the stages cover every layer exactly."""
    for k in {k.pp_rank: k for k in r.ranks.values()}.values():  # one rank per stage
        same = k.pp_rank == pp_rank
        if (same and k.layers != stage) or (not same and k.layers.start < stage.stop and stage.start < k.layers.stop):
            return RemoteProtocolError(f"stage {pp_rank} pushes layers [{stage.start}, {stage.stop}), stage "
                                       f"{k.pp_rank} [{k.layers.start}, {k.layers.stop}): stages must split the "
                                       "layers between them")
    stages = {k.pp_rank: k.layers for k in r.ranks.values()} | {pp_rank: stage}
    if len(stages) == r.pp and sorted(la for x in stages.values() for la in x) != list(range(r.layout.push_layers)):
        return RemoteProtocolError(f"the stages' layers {sorted((x.start, x.stop) for x in stages.values())} do "
                                   f"not cover the layout's {r.layout.push_layers} layers")
    return None
