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

Here: the checks of a Begin (``check_begin``) and of a rank joining (``check_join``), and the requests ended lately
(``Ended``), so that a rank that begins one late is told rather than starting a request of its own (a rank that had
begun it, beginning it again, is the engine's retry).
The session (sender.py) allocates, fails and replies.

Imports no zmq, UCX, torch or clock.
"""

from __future__ import annotations

from collections import OrderedDict

from pdpush.errors import DuplicateRequest, PdpushError, RemoteProtocolError, UnknownRequest
from pdpush.protocol import Begin
from pdpush.sessions.tx_request import TxRequest

MAX_PARTICIPANTS = 4096  # tp_size x pp_size of one request
ENDED_KEPT = 4096  # recently ended multi-rank requests remembered


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
    """Multi-rank requests ended lately (bounded): req_id -> the error that ended it (None if it completed), and
    the participants that had begun it."""

    def __init__(self) -> None:
        self.ended: OrderedDict[str, tuple[PdpushError | None, frozenset[int], int]] = OrderedDict()

    def add(self, r: TxRequest) -> None:
        if r.world > 1:  # a rank that begins it late is told, rather than starting a request of its own
            self.ended[r.req_id] = (r.failure, frozenset(r.ranks), r.tp)
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)

    def begun(self, req_id: str) -> None:
        """A request of ``req_id`` is in flight again (a retry)."""
        self.ended.pop(req_id, None)

    def check(self, msg: Begin) -> None:
        """A Begin of no request in flight: a late rank of one that ended gets what the others got. One from a
        rank that had begun it is the engine's retry of the id (a preempted request, say): a new request (``begun``
        forgets the ended one once it is, so that its other ranks join it)."""
        if msg.tp_size * msg.pp_size > 1 and msg.req_id in self.ended:
            why, began, tp = self.ended[msg.req_id]
            if tp == msg.tp_size and msg.pp_rank * msg.tp_size + msg.tp_rank in began:
                return
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
