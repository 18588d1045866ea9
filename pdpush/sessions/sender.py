"""SenderSession: the sender's protocol logic, sans-I/O.

Events in (each with ``now``, monotonic milliseconds):
  * ``on_ingress(client, msg, now)``    Begin / LayerReady / Finish / Abort / Bye from a prefill engine;
  * ``on_refused(client, refused, now)`` hand-overs the native per-layer path would not take;
  * ``on_peer(endpoint, msg, now)``     a decoded frame from a receiver;
  * ``on_connected(endpoint, error, now)`` the data plane to a receiver is up (or failed);
  * ``on_landed(landed, now)``          layers whose every share's flush completed (a loop pass's);
  * ``on_peer_lost(endpoint, why, now)`` a receiver's socket or UCX endpoint broke, or its puts failed;
  * ``on_tick(now)``                    control-reply deadlines, allocation back-off.
Actions out (``tx_actions.py``): ``ToClient``/``ToPeer`` messages, ``Connect``, ``FillWords``,
``ResetPeer``, ``OpenRing``/``CloseRing``, the put plan (``PlanRequest``, ``PlanRank``, ``PlanGrant``,
``Unplan``) and ``Hand``, metric ``Count``/``Observe``, ``Log``.

The per-layer path is native (``native/src/pusher.cpp``): once a request's allocation is known the
session hands it the request's put plan (put_plan.py), and from then on the native path takes each
layer handed over (ring records, or ``Hand`` for a ``LayerReady``), posts its puts, puts its
readiness words once every rank's share is flushed, and reports the layers landed in batches.

Staging holds the layers in flight: each request's blocks are granted, given back and held after a
failure by ``StagingGrants`` (grants.py); an engine asks for a block with ``NeedStaging``. Each engine
connection hands layers over through its ring in staging (``HandoverRings``, rings.py) where it has one.

Many layers, requests and receivers are in flight at once. ``LayerDone`` goes out
when a layer lands, one notice per request for all its layers that landed in the
same pass; a stalled receiver's batches time out at their own deadlines and fail only
that receiver's requests. A request counts as delivered only on CommitAck.

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

Imports no zmq, ucxx, torch or clock.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdpush import protocol
from pdpush.errors import (
    Aborted,
    BrokenResourceError,
    DuplicateRequest,
    IncompatiblePeer,
    PdpushError,
    PoolExhausted,
    RemoteProtocolError,
    ShuttingDown,
    TransportTimeout,
    UnexpectedMessage,
    UnknownRequest,
    error_from_code,
)
from pdpush.layout import KVLayout, PoolGeometry, StagingShares, check_prefill_tp
from pdpush.plan import RequestPlan, tokens_of
from pdpush.protocol import (
    SENDER_PEER,
    SENDER_REQUEST,
    Abort,
    AllocRequest,
    AllocResponse,
    Begin,
    BeginOk,
    Bye,
    Commit,
    CommitAck,
    Done,
    Error,
    Finish,
    Hello,
    HelloAck,
    LayerDone,
    LayerReady,
    Msg,
    NeedStaging,
    Ok,
    PeerEvent,
    PeerState,
    TxEvent,
    TxState,
)
from pdpush.sessions import Counters, Log, Observe, internal_error, put_plan
from pdpush.sessions.grants import StagingGrants
from pdpush.sessions.rings import HandoverRings
from pdpush.sessions.tx_actions import (  # noqa: F401 - the session's actions, importable from here
    CloseRing,
    Connect,
    FillWords,
    Hand,
    OpenRing,
    PlanGrant,
    PlanRank,
    PlanRequest,
    ResetPeer,
    StagingInfo,
    ToClient,
    ToPeer,
    Unplan,
)


@dataclass(frozen=True)
class SenderLimits:
    lease_ms: int = 30_000
    control_timeout_ms: int = 5000
    layer_timeout_ms: int = 5000
    alloc_retry_budget_ms: int = 2000
    ring_slots: int = 256  # per engine connection's hand-over ring (ring.py); 0: hand-overs by message only


@dataclass
class Peer:
    endpoint: str
    state: PeerState = PeerState.NEW
    ack: HelloAck | None = None
    deadline_ms: int = 0
    waiting: list[str] = field(default_factory=list)


@dataclass
class TxRank:
    """One prefill rank of a request (of one pipeline stage): its connection, and what it has handed over."""

    client: bytes
    pid: int
    tp_rank: int = 0
    pp_rank: int = 0
    layers: range = range(0)  # its stage's layers
    layers_posted: set[int] = field(default_factory=set)  # its layers landed (the native path knows the rest)
    finish: bool = False
    ring: bool = False  # its Begin asked for a hand-over ring
    puts: int = 0


@dataclass
class TxRequest:
    """One request, its whole life on the sender (all its ranks)."""

    req_id: str
    seq: int  # distinguishes completions of a request from an earlier one with the same id
    ranks: dict[int, TxRank]  # by participant: pp_rank * tp + tp_rank
    peer: Peer
    begin: Begin
    layout: KVLayout
    deadline_ms: int
    t0_ms: int
    state: TxState = TxState.WAIT_PEER
    meta_off: int | None = None  # its grant table and readiness words in staging (plan.py)
    blocks: dict[int, int] = field(default_factory=dict)  # staging unit -> its block's offset, granted and held
    asked: dict[int, set[bytes]] = field(default_factory=dict)  # unit -> the engines waiting for its block
    n_new: int = 0
    lease_id: int = 0
    skipped: int = 0
    held: list[int] = field(default_factory=list)  # already_sent_indexes: decided once, the same for every rank
    plan: RequestPlan | None = None  # items by layer group, their pages (plan.py)
    state_slot: int = -1  # the receiver's slot for its recurrent state
    shares: list[StagingShares] = field(default_factory=list)  # by group
    pool: PoolGeometry | None = None  # the receiver's pool
    share_puts: list[int] = field(default_factory=list)  # by group: puts of one rank's share of one layer
    layers_done: set[int] = field(default_factory=set)  # landed: every rank's share flushed
    unannounced: list[tuple[int, int | None]] = field(default_factory=list)  # (layer, checksum) flushed, no notice yet
    puts: int = 0
    bytes_sent: int = 0
    layer_done_ms: list[float] = field(default_factory=list)
    alloc_attempts: int = 0
    t_alloc_ms: int = 0
    failure: PdpushError | None = None
    tp: int = 1  # ranks pushing each layer (Begin.tp_size)
    pp: int = 1  # pipeline stages (Begin.pp_size)

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

    def who(self, participant: int) -> str:
        """A participant as errors name it."""
        stage, rank = divmod(participant, self.tp)
        return (f"stage {stage} of {self.pp}, " if self.pp > 1 else "") + f"rank {rank} of {self.tp}"


class SenderSession:
    def __init__(self, limits: SenderLimits, staging: StagingInfo, default_receiver: str = "", *,
                 check_receiver: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self.staging_info = staging
        self.default_receiver = default_receiver
        self._check_receiver = check_receiver
        self.peers: dict[str, Peer] = {}
        self.reqs: dict[str, TxRequest] = {}
        self._by_seq: dict[int, TxRequest] = {}
        self._seq = itertools.count(1)
        # recently ended multi-rank requests (bounded): req_id -> the error that ended it, None if it completed
        self.ended: OrderedDict[str, PdpushError | None] = OrderedDict()
        self.draining = False
        self.counters = Counters({k: 0 for k in (
            "requests_total", "requests_done", "requests_failed", "bytes_pushed", "puts", "layers_pushed",
            "chunks_skipped", "alloc_retries", "internal_errors", "staging_waits", "staging_asks",
            "handovers_stale", "handovers_refused", "rings_refused")})
        self.grants = StagingGrants(staging, self.counters, limits.lease_ms)  # the staging, by request
        self.rings = HandoverRings(self.grants.meta, staging.address, limits.ring_slots, self.counters)

    # ---- entry points ------------------------------------------------------------------
    def on_ingress(self, ident: bytes, msg: Msg, now: int) -> list:
        out: list = []
        rid = getattr(msg, "req_id", None)
        if self.grants.held(rid, ident) and isinstance(msg, (Abort, Finish, Begin)):
            self.grants.stopped(rid, ident, out)  # that engine has stopped writing the failed request's staging
            if isinstance(msg, Abort):
                return out  # its acknowledgement of the failure (client.PushHandle._failed): nothing to answer
        try:
            if isinstance(msg, Begin):
                self._begin(ident, msg, now, out)
            elif isinstance(msg, LayerReady):
                self._layer_ready(ident, msg, now, out)
            elif isinstance(msg, NeedStaging):
                r, rank = self._client_req(ident, msg.req_id)
                if r.state is not TxState.STREAMING:
                    raise UnexpectedMessage(f"need_staging for {r.req_id!r} in state {r.state.value}")
                self.grants.ask(r, ident, msg.unit, r.ranks[rank].layers_posted, out)
            elif isinstance(msg, Finish):
                self._finish(ident, msg, now, out)
            elif isinstance(msg, Abort):
                r, rank = self._client_req(ident, msg.req_id)
                who = f" ({r.who(rank)})" if r.world > 1 else ""
                self._fail(r, Aborted(f"aborted by prefill engine{who}: {msg.reason or 'no reason given'}"), now,
                           out, tell_receiver=True)
                self.grants.stopped(r.req_id, ident, out)  # the engine that aborts has stopped writing
            elif isinstance(msg, Bye):
                self.rings.close(ident, out)
            else:
                raise UnexpectedMessage(f"sender does not accept {msg.type} on the ingress")
        except PdpushError as e:
            out.append(ToClient(ident, protocol.error_reply(e, rid)))
        except Exception as exc:  # noqa: BLE001 - the top-level guard: one message never ends the daemon
            self._internal(msg.type, exc, rid, now, out, reply_to=ident)
        return out

    def on_refused(self, ident: bytes, refused: list[tuple[int, int, int, int]], now: int) -> list:
        """Hand-overs from ``ident`` that the native path would not take, as (request handle, first layer,
        layers, why: ``put_plan.REFUSED``): one for a request that has ended is dropped and counted; the
        engine gets an error for any other."""
        out: list = []
        for handle, first, n, why in refused:
            r = self._by_seq.get(handle)  # a request's seq is its handle (``_next_seq``)
            if r is None or why == put_plan.UNKNOWN:
                self.counters.add("handovers_stale")
                continue
            self.counters.add("handovers_refused")
            k = next((k for k in r.ranks.values() if k.client == ident), None)
            err = (UnknownRequest(f"unknown request {r.req_id!r}") if k is None or why == put_plan.NOT_YOURS
                   else RemoteProtocolError(put_plan.refusal(why, r, k, first, n)))
            out.append(ToClient(ident, protocol.error_reply(err, r.req_id)))
        return out

    def on_peer(self, endpoint: str, msg: Msg, now: int) -> list:
        out: list = []
        p = self.peers.get(endpoint)
        if p is None:
            return out
        try:
            self._peer_msg(p, msg, now, out)
        except Exception as exc:  # noqa: BLE001 - the top-level guard
            self._internal(msg.type, exc, getattr(msg, "req_id", None), now, out)
        return out

    def on_connected(self, endpoint: str, error: PdpushError | None, now: int) -> list:
        out: list = []
        p = self.peers.get(endpoint)
        if p is None or p.state is not PeerState.CONNECTING:
            return out
        if error is not None:
            self._peer_failed(p, BrokenResourceError(f"cannot open the data plane to {endpoint}: {error}"), now, out)
            return out
        p.state = SENDER_PEER.next(p.state, PeerEvent.CONNECTED, f"receiver {endpoint}")
        out.append(Log(logging.INFO, f"receiver {endpoint} ready (pool {p.ack.pool_pages} pages x "
                                     f"{p.ack.page_bytes} B)"))
        waiting, p.waiting = p.waiting, []
        for rid in waiting:
            r = self.reqs.get(rid)
            if r is None or r.state is not TxState.WAIT_PEER:
                continue
            if r.begin.layout != p.ack.layout:
                mine, theirs = KVLayout(**r.begin.layout.model_dump()), KVLayout(**p.ack.layout.model_dump())
                self._fail(r, IncompatiblePeer(f"layout differs from receiver {p.endpoint}'s, request vs receiver: "
                                               f"{mine.mismatch(theirs)}"), now, out)
            else:
                self._send_alloc(r, TxEvent.PEER_READY, now, out)
        return out

    def on_landed(self, landed: list[tuple[int, int]], now: int, checksums: list[int | None] | None = None) -> list:
        """Layers that landed in one loop pass, as (request handle, layer), with their checksums where
        they are on (``layer_checksum``): one LayerDone per request for its layers, then commits."""
        out: list = []
        touched: dict[int, TxRequest] = {}
        for i, (seq, layer) in enumerate(landed):
            r = self._by_seq.get(seq)
            if r is None or r.state is not TxState.STREAMING:
                continue  # the request ended meanwhile (failed, aborted): nothing to announce
            try:
                self._landed(r, layer, checksums[i] if checksums else None)
                touched[seq] = r
            except Exception as exc:  # noqa: BLE001 - the top-level guard
                self._internal("a layer landing", exc, r.req_id, now, out)
        for r in touched.values():
            if r.state is TxState.STREAMING:
                try:
                    self._announce(r, now, out)
                except Exception as exc:  # noqa: BLE001 - the top-level guard
                    self._internal("a layer landing", exc, r.req_id, now, out)
        self.grants.pump(out)  # the blocks these layers gave back
        return out

    def layer_checksum_spans(self, seq: int, layer: int) -> list[tuple[int, int]]:
        """Where a landed layer's shares lie in staging (address, bytes), by TP rank: the shell hashes them
        for its checksum before ``on_landed`` gives the block back."""
        r = self._by_seq.get(seq)
        if r is None or layer not in r.blocks:
            return []
        return put_plan.share_spans(r, layer, self.staging_info.address)

    def on_peer_lost(self, endpoint: str, why: str, now: int, error: PdpushError | None = None) -> list:
        """A receiver's socket or endpoint broke (``BrokenResourceError``), or its puts failed or timed out
        (``error``): its requests fail, and the next request starts afresh."""
        out: list = []
        p = self.peers.get(endpoint)
        if p is not None and p.state in (PeerState.HELLO_SENT, PeerState.CONNECTING, PeerState.READY):
            self._peer_failed(p, error or BrokenResourceError(why), now, out)
        return out

    def client_pids(self) -> set[int]:
        """Processes of the prefill ranks with a request in flight or staging held (the shell watches them)."""
        return ({k.pid for r in self.reqs.values() for k in r.ranks.values() if k.pid} | self.grants.pids()
                | self.rings.pids())

    def on_client_gone(self, pid: int, now: int) -> list:
        """A prefill rank's process died: its requests cannot complete, fail them for every rank."""
        out: list = []
        for r in list(self.reqs.values()):
            dead = [rank for rank, k in r.ranks.items() if k.pid == pid]
            if dead:
                self._fail(r, BrokenResourceError(f"prefill {r.who(dead[0])} (pid {pid}) died mid-push"),
                           now, out, tell_receiver=True)
        self.grants.on_client_gone(pid, out)
        self.rings.on_client_gone(pid, out)
        return out

    def on_tick(self, now: int) -> list:
        out: list = []
        lim = self.limits
        self.grants.on_tick(now, out)
        for p in self.peers.values():
            if p.state in (PeerState.HELLO_SENT, PeerState.CONNECTING) and now > p.deadline_ms:
                self._peer_failed(p, TransportTimeout(
                    f"receiver {p.endpoint} did not answer hello within {lim.control_timeout_ms} ms (down, "
                    "unreachable, or refusing our CURVE key)"), now, out)
        for r in list(self.reqs.values()):
            if len(r.ranks) < r.world and now > r.t0_ms + lim.control_timeout_ms and (late := r.late()):
                # the TP ranks of a stage begin together; a later pipeline stage may begin a forward later (it
                # has until the lease deadline, below)
                more = f" and {len(late) - 8} more" if len(late) > 8 else ""
                self._fail(r, TransportTimeout(f"{', '.join(r.who(k) for k in late[:8])}{more} did not begin the "
                                               f"request within {lim.control_timeout_ms} ms of the first"), now, out,
                           tell_receiver=True)
            elif r.state is TxState.ALLOC_BACKOFF and now >= r.deadline_ms:
                self._send_alloc(r, TxEvent.RETRY, now, out)
            elif r.state in (TxState.ALLOCATING, TxState.COMMITTING, TxState.WAIT_PEER) and now > r.deadline_ms:
                self._fail(r, TransportTimeout(f"no {r.state.value} reply from {r.peer.endpoint} within "
                                               f"{lim.control_timeout_ms} ms"), now, out, tell_receiver=True)
            elif r.state is TxState.STREAMING and now > r.deadline_ms:
                self._fail(r, TransportTimeout("prefill engine did not finish the request before the lease "
                                               "deadline"), now, out, tell_receiver=True)
        return out

    def begin_drain(self) -> None:
        self.draining = True

    def drained(self) -> bool:
        return not self.reqs

    def abort_all(self, reason: str, now: int) -> list:
        out: list = []
        for r in list(self.reqs.values()):
            self._fail(r, ShuttingDown(reason), now, out, tell_receiver=True)
        return out

    def _internal(self, what: str, exc: Exception, rid: str | None, now: int, out: list,
                  reply_to: bytes | None = None) -> None:
        err, line = internal_error(what, exc, rid)
        self.counters.add("internal_errors")
        out.append(line)
        r = self.reqs.get(rid) if rid else None
        if r is not None:
            try:
                self._fail(r, err, now, out, tell_receiver=True)
                return  # its client got the error
            except Exception as exc2:  # noqa: BLE001 - the failure path itself is broken: drop the request
                out.append(internal_error("failing a request", exc2, rid)[1])
                self._release(r, now, out)
        if reply_to is not None:
            out.append(ToClient(reply_to, protocol.error_reply(err, rid)))

    # ---- prefill engine ----------------------------------------------------------------
    def _client_req(self, ident: bytes, req_id: str) -> tuple[TxRequest, int]:
        r = self.reqs.get(req_id)
        if r is not None:
            for rank, k in r.ranks.items():
                if k.client == ident:
                    return r, rank
        raise UnknownRequest(f"unknown request {req_id!r}")

    def _begin(self, ident: bytes, msg: Begin, now: int, out: list) -> None:
        if self.draining:
            raise ShuttingDown("sender is draining")
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
        r = self.reqs.get(msg.req_id)
        if r is not None:
            self._join(r, ident, msg, stage, now, out)
            return
        if msg.tp_size * msg.pp_size > 1 and msg.req_id in self.ended:  # a late rank: it gets what the others got
            why = self.ended[msg.req_id]
            who = (f"stage {msg.pp_rank} " if msg.pp_size > 1 else "") + f"rank {msg.tp_rank}"
            if why is None:
                raise UnknownRequest(f"request {msg.req_id!r} already completed without {who}")
            raise type(why)(f"request {msg.req_id!r} ended before {who} began it: {why}")
        layout = KVLayout(**msg.layout.model_dump())
        try:
            check_prefill_tp(layout, msg.tp_size)
            layout.check_state_tp(msg.tp_size)
        except ValueError as e:
            raise RemoteProtocolError(str(e)) from None
        self.grants.check(RequestPlan(layout, tokens_of(layout, len(msg.chunk_keys), msg.last_chunk_tokens)))
        receiver = msg.receiver or self.default_receiver
        if not receiver:
            raise RemoteProtocolError("no receiver named and no default_receiver configured")
        if self._check_receiver is not None:
            self._check_receiver(receiver)
        peer = self.peers.get(receiver)
        if peer is not None and peer.ack is not None and peer.ack.layout != msg.layout:
            theirs = KVLayout(**peer.ack.layout.model_dump())
            raise IncompatiblePeer(f"receiver {receiver} serves another layout, request vs receiver: "
                                   f"{layout.mismatch(theirs)} (receiver {theirs.describe()})")
        if peer is None:
            peer = self.peers[receiver] = Peer(receiver)
        first = msg.pp_rank * msg.tp_size + msg.tp_rank
        r = TxRequest(msg.req_id, self._next_seq(), {first: TxRank(ident, msg.client_pid, msg.tp_rank, msg.pp_rank, stage, ring=msg.handover_ring)},
                      peer, msg, layout, now + self.limits.control_timeout_ms, now, tp=msg.tp_size, pp=msg.pp_size)
        self.reqs[r.req_id] = r
        self._by_seq[r.seq] = r
        self.counters.add("requests_total")
        if peer.state is PeerState.READY:
            self._send_alloc(r, TxEvent.PEER_READY, now, out)
        else:
            peer.waiting.append(r.req_id)
            if peer.state in (PeerState.NEW, PeerState.DEAD):
                self._hello(peer, msg, now, out)

    def _join(self, r: TxRequest, ident: bytes, msg: Begin, stage: range, now: int, out: list) -> None:
        """Another rank (or stage) of a request in flight begins it: it shares the allocation and the staging."""
        b = r.begin
        part = msg.pp_rank * r.tp + msg.tp_rank
        if r.world == 1 or part in r.ranks or ident in r.clients:
            raise DuplicateRequest(f"request {msg.req_id!r} already in flight"
                                   + (f" ({r.who(part)} began it already)" if r.world > 1 else ""))
        if (msg.tp_size, msg.pp_size) != (r.tp, r.pp):
            raise DuplicateRequest(f"request {msg.req_id!r} already in flight with tp_size {r.tp}, pp_size {r.pp} "
                                   f"(this Begin says {msg.tp_size}, {msg.pp_size})")
        err = None
        if (msg.chunk_keys, msg.last_chunk_tokens, msg.layout, msg.receiver) != (
                b.chunk_keys, b.last_chunk_tokens, b.layout, b.receiver):
            err = RemoteProtocolError(f"{r.who(part)} began {msg.req_id!r} with a different prompt, layout "
                                      "or receiver than the ranks before it")
        else:
            err = _check_stage(r, msg.pp_rank, stage)
        if err is not None:
            self._fail(r, err, now, out, tell_receiver=True)
            raise err
        r.ranks[part] = TxRank(ident, msg.client_pid, msg.tp_rank, msg.pp_rank, stage, ring=msg.handover_ring)
        if r.state is TxState.STREAMING:
            out.append(self._plan_rank(r, r.ranks[part]))
            out.append(ToClient(ident, self._begin_ok(r, ident, out)))

    def _next_seq(self) -> int:
        """A request's seq, which is also its handle in ring records: 32 bits, never a live one's."""
        while True:
            seq = next(self._seq) & 0xFFFFFFFF
            if seq and seq not in self._by_seq:
                return seq

    @staticmethod
    def _plan_rank(r: TxRequest, k: TxRank) -> PlanRank:
        return PlanRank(r.seq, k.client, k.layers.start, k.layers.stop, put_plan.ranges(r, k))

    def _begin_ok(self, r: TxRequest, ident: bytes, out: list) -> BeginOk:
        s = self.staging_info
        rank = next(k for k in r.ranks.values() if k.client == ident)
        ring, slots = (self.rings.open(ident, rank.pid, out) if rank.ring  # the connection's, or none
                       else (0, 0))
        return BeginOk(req_id=r.req_id, already_sent_indexes=r.held, staging_shmid=s.shmid,
                       staging_bytes=s.nbytes, staging_offset=r.meta_off, new_chunks=r.n_new,
                       daemon_pid=s.daemon_pid, pool_shards=r.peer.ack.pool_shards, handle=r.seq,
                       ring_offset=ring, ring_slots=slots, idle_offset=self.rings.idle_offset)

    def _hello(self, peer: Peer, begin: Begin, now: int, out: list) -> None:
        layout = KVLayout(**begin.layout.model_dump())
        peer.state = SENDER_PEER.next(peer.state, PeerEvent.HELLO, f"receiver {peer.endpoint}")
        peer.deadline_ms = now + self.limits.control_timeout_ms
        out.append(ToPeer(peer.endpoint, Hello(version=protocol.PROTOCOL_VERSION, fingerprint=layout.fingerprint(),
                                               layout=begin.layout)))

    def _send_alloc(self, r: TxRequest, event: TxEvent, now: int, out: list) -> None:
        b = r.begin
        r.state = SENDER_REQUEST.next(r.state, event, f"request {r.req_id!r}")
        r.alloc_attempts += 1
        r.t_alloc_ms = now
        r.deadline_ms = now + self.limits.control_timeout_ms
        out.append(ToPeer(r.peer.endpoint, AllocRequest(req_id=r.req_id, chunk_keys=b.chunk_keys,
                                                        last_chunk_tokens=b.last_chunk_tokens,
                                                        lease_ms=self.limits.lease_ms, tp_size=r.tp)))

    def _layer_ready(self, ident: bytes, msg: LayerReady, now: int, out: list) -> None:
        """Layers handed over by message: the native path takes them as it takes ring records."""
        r, _ = self._client_req(ident, msg.req_id)
        if r.state is not TxState.STREAMING:
            raise UnexpectedMessage(f"layer_ready for {r.req_id!r} in state {r.state.value}")
        if len(set(msg.layers)) != len(msg.layers):
            raise RemoteProtocolError(f"layer_ready for {r.req_id!r} names a layer twice: {msg.layers}")
        out.append(Hand(ident, r.seq, tuple(msg.layers)))

    def _landed(self, r: TxRequest, layer: int, digest: int | None) -> None:
        """Every share of ``layer`` is flushed (its readiness words are on their way): count it, give its
        block back, and queue it for the request's next LayerDone."""
        if layer in r.layers_done:
            return
        puts = put_plan.share_puts(r, layer)
        for k in r.ranks.values():
            if layer in k.layers:
                k.puts += puts
                k.layers_posted.add(layer)
        r.puts += puts * r.tp
        self.counters.add("puts", puts * r.tp)
        r.bytes_sent += r.plan.layer_bytes(layer)
        r.layers_done.add(layer)
        self.grants.land(r, layer)
        r.unannounced.append((layer, digest))

    def _announce(self, r: TxRequest, now: int, out: list) -> None:
        """One LayerDone for every layer flushed since the last notice; commit once all are in."""
        done, r.unannounced = r.unannounced, []
        if done:
            nbytes = sum(r.plan.layer_bytes(la) for la, _ in done)
            self.counters.count(out, "bytes_pushed", nbytes, "bytes")
            self.counters.count(out, "layers_pushed", len(done), "layers")
            sums = [c for _, c in done]
            out.append(ToPeer(r.peer.endpoint, LayerDone(req_id=r.req_id, layers=[la for la, _ in done],
                                                         checksums=None if None in sums else sums)))
            r.layer_done_ms.extend([float(now - r.t0_ms)] * len(done))
        if r.finished() and len(r.layers_done) == r.layout.push_layers:
            self._send_commit(r, now, out)

    def _finish(self, ident: bytes, msg: Finish, now: int, out: list) -> None:
        r, rank = self._client_req(ident, msg.req_id)
        if r.state is not TxState.STREAMING or r.ranks[rank].finish:
            raise UnexpectedMessage(f"finish for {r.req_id!r} in state {r.state.value}")
        r.ranks[rank].finish = True
        if r.finished() and len(r.layers_done) == r.layout.push_layers:
            self._send_commit(r, now, out)

    def _send_commit(self, r: TxRequest, now: int, out: list) -> None:
        r.state = SENDER_REQUEST.next(r.state, TxEvent.COMMIT, f"request {r.req_id!r}")
        r.deadline_ms = now + self.limits.control_timeout_ms
        out.append(ToPeer(r.peer.endpoint, Commit(req_id=r.req_id)))

    # ---- receivers ---------------------------------------------------------------------
    def _peer_msg(self, p: Peer, msg: Msg, now: int, out: list) -> None:
        if isinstance(msg, HelloAck):
            if p.state is PeerState.HELLO_SENT:
                p.state = SENDER_PEER.next(p.state, PeerEvent.HELLO_ACK, f"receiver {p.endpoint}")
                p.ack = msg
                out.append(Connect(p.endpoint, msg))
        elif isinstance(msg, AllocResponse):
            r = self.reqs.get(msg.req_id)
            if r is not None and r.peer is p and r.state is TxState.ALLOCATING:
                self._on_alloc(r, msg, now, out)
            else:  # we gave up on it; do not hold the receiver's pages
                out.append(ToPeer(p.endpoint, Abort(req_id=msg.req_id, reason="sender no longer wants it")))
        elif isinstance(msg, CommitAck):
            r = self.reqs.get(msg.req_id)
            if r is not None and r.peer is p and r.state is TxState.COMMITTING:
                self._done(r, now, out)
        elif isinstance(msg, Error):
            r = self.reqs.get(msg.req_id) if msg.req_id else None
            if r is not None and r.peer is p:
                if r.state is TxState.ALLOCATING and isinstance(error_from_code(msg.code, ""), PoolExhausted):
                    self._backoff(r, msg.retry_after_ms or 20, msg.message, now, out)
                else:
                    self._fail(r, error_from_code(msg.code, f"receiver: {msg.message}", r.req_id,
                                                  msg.retry_after_ms), now, out)
            elif p.state is PeerState.HELLO_SENT:
                err = error_from_code(msg.code, f"receiver refused hello: {msg.message}")
                out.append(Log(logging.WARNING, str(err)))
                p.state = SENDER_PEER.next(p.state, PeerEvent.REFUSED, f"receiver {p.endpoint}")
                self._fail_waiting(p, err, now, out)
            else:
                out.append(Log(logging.WARNING, f"error from receiver {p.endpoint}: {msg.code.value} {msg.message}",
                               msg.req_id))
        elif not isinstance(msg, Ok):
            out.append(Log(logging.WARNING, f"unexpected {msg.type} from receiver {p.endpoint}"))

    def _backoff(self, r: TxRequest, retry_after_ms: int, why: str, now: int, out: list) -> None:
        """Retry an exhausted allocation later, within ``alloc_retry_budget_ms`` of the first try."""
        retry_at = now + retry_after_ms
        if retry_at - r.t0_ms > self.limits.alloc_retry_budget_ms:
            self._fail(r, PoolExhausted(
                f"receiver pool exhausted; gave up after {r.alloc_attempts} attempts in {now - r.t0_ms} ms "
                f"(alloc_retry_budget_ms={self.limits.alloc_retry_budget_ms}); receiver: {why}"), now, out)
            return
        r.state = SENDER_REQUEST.next(r.state, TxEvent.EXHAUSTED, f"request {r.req_id!r}")
        r.deadline_ms = retry_at
        self.counters.add("alloc_retries")

    def _on_alloc(self, r: TxRequest, a: AllocResponse, now: int, out: list) -> None:
        out.append(Observe("alloc_rtt", (now - r.t_alloc_ms) / 1000))
        layout = r.layout
        r.held = list(a.already_sent_indexes)
        r.skipped = len(r.held)
        b = r.begin
        try:  # the items by layer group (plan.py): the receiver's held ones, and pages for the rest
            r.plan = RequestPlan(layout, tokens_of(layout, len(b.chunk_keys), b.last_chunk_tokens), r.held)
            r.plan.set_pages([p + i for p, n in a.page_runs for i in range(n)])
        except ValueError as e:
            self._fail(r, RemoteProtocolError(f"receiver's allocation does not fit the request: {e}"), now, out,
                       tell_receiver=True)
            return
        r.n_new = r.plan.n_new
        r.state_slot = a.state_slot
        if (a.state_slot >= 0) != bool(layout.state_layers) or a.state_slot >= r.peer.ack.state_slots > 0:
            self._fail(r, RemoteProtocolError(f"receiver's allocation has state slot {a.state_slot} for a layout "
                                              f"of {layout.state_layers} state layers"), now, out, tell_receiver=True)
            return
        try:  # the grant table and a readiness word per new item (the lease id); staging comes layer by layer
            self.grants.open(r, out)
        except PdpushError as e:
            self._fail(r, e, now, out, tell_receiver=True)
            return
        r.lease_id = a.lease_id
        try:
            ack = r.peer.ack
            r.pool = PoolGeometry(layout, ack.pool_pages, ack.pool_shards)
            r.shares = [StagingShares(layout, r.tp, ack.pool_shards, gp.n_new) for gp in r.plan.groups]
            r.share_puts = [sh.puts(gp.page_runs) for sh, gp in zip(r.shares, r.plan.groups, strict=True)]
            plan = PlanRequest(r.seq, r.peer.endpoint, put_plan.layers(r), put_plan.ready(r, self.grants.words(r)),
                               r.tp)
        except ValueError as e:
            self._fail(r, IncompatiblePeer(str(e)), now, out, tell_receiver=True)
            return
        out.append(plan)  # before any grant (grants.py) or hand-over of it
        if layout.windows:
            self.counters.add("bytes_window_saved", r.plan.window_saved_bytes)
        if r.n_new:
            out.append(FillWords(self.grants.words(r), a.lease_id, r.n_new))
        elif not layout.state_layers:  # the receiver holds every chunk: every layer is there already, a finish commits
            r.layers_done = set(range(layout.layers))
        r.state = SENDER_REQUEST.next(r.state, TxEvent.ALLOC_OK, f"request {r.req_id!r}")
        # the engine has until just before the lease ends to hand over every layer
        r.deadline_ms = now + int(min(self.limits.lease_ms, max(0, a.expires_at_ms - r.t_alloc_ms)) * 0.9)
        self.counters.count(out, "chunks_skipped", r.skipped, "chunks_hit")
        self.grants.ahead(r, out)  # before the BeginOk: those blocks are in the table when the engine looks
        for k in r.ranks.values():  # each rank's plan, then its BeginOk with its connection's ring
            out.append(self._plan_rank(r, k))
            out.append(ToClient(k.client, self._begin_ok(r, k.client, out)))

    def _done(self, r: TxRequest, now: int, out: list) -> None:
        r.state = SENDER_REQUEST.next(r.state, TxEvent.COMMIT_ACK, f"request {r.req_id!r}")
        self._release(r, now, out)
        self.counters.count(out, "requests_done", metric="requests")
        out.append(Observe("request_seconds", (now - r.t0_ms) / 1000))
        for k in r.ranks.values():
            out.append(ToClient(k.client, Done(req_id=r.req_id, bytes_sent=r.bytes_sent, puts=r.puts,
                                               rank_puts=k.puts, layers=len(r.layers_done),
                                               chunks_skipped=r.skipped, layer_done_ms=r.layer_done_ms)))

    def _release(self, r: TxRequest, now: int, out: list) -> None:
        self.grants.release(r, now)
        out.append(Unplan(r.seq))
        self.reqs.pop(r.req_id, None)
        self._by_seq.pop(r.seq, None)
        if r.world > 1:  # a rank that begins it late is told, rather than starting a request of its own
            self.ended[r.req_id] = r.failure
            while len(self.ended) > 4096:
                self.ended.popitem(last=False)

    def _fail(self, r: TxRequest, err: PdpushError, now: int, out: list, tell_receiver: bool = False) -> None:
        if self.reqs.get(r.req_id) is not r:
            return
        out.append(Log(logging.WARNING, f"request failed: {err.code.value}: {err}", r.req_id))
        if tell_receiver and r.state in (TxState.ALLOCATING, TxState.STREAMING, TxState.COMMITTING):
            out.append(ToPeer(r.peer.endpoint, Abort(req_id=r.req_id, reason=str(err)[:1000])))
        r.state = SENDER_REQUEST.next(r.state, TxEvent.FAIL, f"request {r.req_id!r}")
        r.failure = err
        self._release(r, now, out)
        self.counters.count(out, "requests_failed", metric="failures", label=err.code.value)
        reply = protocol.error_reply(err, r.req_id)
        out.extend(ToClient(c, reply) for c in r.clients)
        self.grants.pump(out)  # its place in the queue goes to the next

    def _fail_waiting(self, p: Peer, err: PdpushError, now: int, out: list) -> None:
        for r in [r for r in self.reqs.values() if r.peer is p]:
            self._fail(r, err, now, out)
        p.waiting = []

    def _peer_failed(self, p: Peer, err: PdpushError, now: int, out: list) -> None:
        out.append(Log(logging.WARNING, f"receiver {p.endpoint} failed: {err}"))
        if SENDER_PEER.allows(p.state, PeerEvent.FAIL):
            p.state = SENDER_PEER.next(p.state, PeerEvent.FAIL, f"receiver {p.endpoint}")
        p.ack = None
        self._fail_waiting(p, err, now, out)
        out.append(ResetPeer(p.endpoint))

    # ---- state -------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"requests_inflight": len(self.reqs),
                "receivers_connected": sum(1 for p in self.peers.values() if p.state is PeerState.READY),
                **self.grants.stats(), **self.rings.stats(), "draining": self.draining, **self.counters.values}


MAX_PARTICIPANTS = 4096  # tp_size x pp_size of one request


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
