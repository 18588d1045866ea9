"""The sender's record of a request (pure data): its ranks (``TxRank``), their arithmetic
(``Participants``), its staging grants (``Grant``) and the request itself (``TxRequest``).

Every module of the sender's session reads these: the session (sender.py) that owns them, the join
of ranks and stages (participants.py), the staging grants (grants.py) and the put plan (put_plan.py).
They live here, below all of those, so that none of them imports another for its types.

Imports no zmq, UCX, torch or clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdpush.errors import PdpushError, TransportTimeout
from pdpush.layout import KVLayout, PoolGeometry, StagingShares
from pdpush.plan import RequestPlan
from pdpush.protocol import Begin, TxState
from pdpush.sessions.peers import Peer


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
    began_ms: int = 0  # when its Begin came

    @classmethod
    def of(cls, client: bytes, msg: Begin, stage: range, now: int = 0) -> TxRank:
        """The rank that sent ``msg`` on ``client`` at ``now``, pushing the layers ``stage``."""
        return cls(client, msg.tp_rank, msg.pp_rank, stage, ring=msg.handover_ring, began_ms=now)


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

    def late(self, began_before: int | None = None) -> list[int]:
        """Participants missing from a stage whose other ranks have begun (``began_before``: whose first rank
        began before then)."""
        first: dict[int, int] = {}
        for k in self.ranks.values():
            first[k.pp_rank] = min(first.get(k.pp_rank, k.began_ms), k.began_ms)
        return [p for s in sorted(first) if began_before is None or first[s] < began_before
                for p in range(s * self.tp, (s + 1) * self.tp) if p not in self.ranks]

    def rank_of(self, client: bytes) -> int | None:
        """The participant that ``client`` is, if it is one."""
        return next((rank for rank, k in self.ranks.items() if k.client == client), None)

    def late_error(self, now: int, timeout_ms: int) -> PdpushError | None:
        """The error for a stage whose ranks have not all begun ``timeout_ms`` after that stage's first did (the
        TP ranks of a stage begin together; a later pipeline stage may begin a forward later: it has until the
        lease deadline, and its ranks are timed from its own first)."""
        if len(self.ranks) < self.world and (late := self.late(now - timeout_ms)):
            more = f" and {len(late) - 8} more" if len(late) > 8 else ""
            return TransportTimeout(f"{', '.join(self.who(k) for k in late[:8])}{more} did not begin the request "
                                    f"within {timeout_ms} ms of the first of its stage")
        return None

    def who(self, participant: int) -> str:
        """A participant as errors name it."""
        stage, rank = divmod(participant, self.tp)
        return (f"stage {stage} of {self.pp}, " if self.pp > 1 else "") + f"rank {rank} of {self.tp}"


@dataclass
class Grant:
    """A request's staging (grants.py): its grant table and readiness words, and the layers' blocks."""

    meta_off: int | None = None  # its grant table and readiness words in staging (plan.py)
    blocks: dict[int, int] = field(default_factory=dict)  # staging unit -> its block's offset, granted and held
    asked: dict[int, set[bytes]] = field(default_factory=dict)  # unit -> the engines waiting for its block


@dataclass
class TxRequest(Participants):
    """One request, its whole life on the sender (all its ranks)."""

    req_id: str
    seq: int  # distinguishes completions of a request from an earlier one with the same id
    ranks: dict[int, TxRank]  # by participant: pp_rank * tp + tp_rank (participants.py)
    peer: Peer
    begin: Begin
    layout: KVLayout
    deadline_ms: int
    t0_ms: int
    state: TxState = TxState.WAIT_PEER
    grant: Grant = field(default_factory=Grant)  # its staging, as grants.py hands it out
    n_new: int = 0
    lease_id: int = 0
    skipped: int = 0
    held: list[int] = field(default_factory=list)  # already_sent_indexes: decided once, the same for every rank
    plan: RequestPlan | None = None  # items by layer group, their pages (plan.py)
    state_slot: int = -1  # the receiver's slot for its recurrent state
    shares: list[StagingShares] = field(default_factory=list)  # by group
    pool: PoolGeometry | None = None  # the receiver's pool
    layer_puts: list[int] = field(default_factory=list)  # by layer: puts of one rank's share (put_plan.layer_puts)
    layers_done: set[int] = field(default_factory=set)  # landed: every rank's share flushed
    unannounced: list[tuple[int, int | None, int]] = field(default_factory=list)  # (layer, checksum, landed ms): no notice yet
    puts: int = 0
    bytes_sent: int = 0
    layer_done_ms: list[float] = field(default_factory=list)
    alloc_attempts: int = 0
    t_alloc_ms: int = 0
    failure: PdpushError | None = None
    tp: int = 1  # ranks pushing each layer (Begin.tp_size)
    pp: int = 1  # pipeline stages (Begin.pp_size)
    words: bool = False  # completes on the data path (AllocResponse.completion): done once its words are in
    words_want: int = 0  # layers that put readiness words (those with new pages)
    words_in: int = 0  # of those, the layers whose words' flush completed
