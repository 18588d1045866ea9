"""SenderSession: the sender's protocol logic, sans-I/O.

Events in (each with ``now``, monotonic milliseconds):
  * ``on_ingress(client, msg, now)``    Begin / LayerReady / Finish / Abort / Bye from a prefill engine;
  * ``on_refused(client, refused, now)`` hand-overs the native per-layer path would not take;
  * ``on_ring_finish(client, handles, now)`` Finishes that came as records in the client's ring;
  * ``on_peer(endpoint, msg, now)``     a decoded frame from a receiver;
  * ``on_connected(endpoint, error, now)`` the data plane to a receiver is up (or failed);
  * ``on_landed(landed, now)``          layers whose every share's flush completed (a loop pass's);
  * ``on_peer_lost(endpoint, why, now)`` a receiver's socket or UCX endpoint broke, or its puts failed;
  * ``on_tick(now)``                    control-reply deadlines, allocation back-off.
Actions out (``tx_actions.py``): ``ToClient``/``ToPeer`` messages, ``Connect``, ``FillWords``,
``ResetPeer``, ``OpenRing``/``CloseRing``, the put plan (``PlanRequest``, ``PlanRank``, ``PlanGrants``,
``Unplan``) and ``Hand``, metric ``Count``/``Observe``, ``Log``.

The per-layer path is native (``native/src/pusher.cpp``): once a request's allocation is known the
session hands it the request's put plan (put_plan.py), and from then on the native path takes each
layer handed over (ring records, or ``Hand`` for a ``LayerReady``), posts its puts, puts its
readiness words once every rank's share is flushed, and reports the layers landed in batches.

Staging holds the layers in flight: each request's blocks are granted, given back and held after a
failure by ``StagingGrants`` (grants.py); an engine asks for a block with ``NeedStaging``. Each engine
connection hands layers over through its ring in staging (``HandoverRings``, rings.py) where it has one.

Many layers, requests and receivers are in flight at once. On the wire a request costs an
AllocRequest and its AllocResponse, and nothing else where it completes on the data path (``words``,
the common case: the decode side and the receiver see each layer land by its readiness words, put once
the layer's bytes are flushed, and the request is delivered once every layer's words are flushed too).
Otherwise (checksums, state layers, nothing new to move) a Commit follows, sent once every layer has
landed, and its CommitAck, on which it counts as delivered. Only where checksums are on does a
``LayerDone`` carry them, one per request for its layers that landed in the same pass. A stalled
receiver's requests time out at their own deadlines and fail only that receiver's requests.

Receivers (``PeerTable``, peers.py): a request waits for its receiver's hello and data plane, and
fails with it. Tensor and pipeline parallelism (participants.py): every rank of every stage begins the
request; the first allocates, the others join it, and it commits once every one has finished.

Imports no zmq, UCX, torch or clock.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdpush import protocol
from pdpush.errors import (
    Aborted,
    BrokenResourceError,
    ErrorCode,
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
from pdpush.layout import PoolGeometry, StagingShares, check_prefill_tp
from pdpush.plan import RequestPlan, tokens_of
from pdpush.protocol import (
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
    HelloAck,
    LayerDone,
    LayerReady,
    Msg,
    NeedStaging,
    Ok,
    PeerState,
    TxEvent,
    TxState,
)
from pdpush.sessions import Counters, Log, Observe, internal_error, participants, put_plan
from pdpush.sessions.grants import StagingGrants
from pdpush.sessions.participants import MAX_PARTICIPANTS, Ended  # noqa: F401 - importable from here
from pdpush.sessions.peers import Peer, PeerTable
from pdpush.sessions.rings import HandoverRings
from pdpush.sessions.tx_actions import (  # noqa: F401 - the session's actions, importable from here
    CloseRing,
    Connect,
    FillWords,
    ForgetPeer,
    Hand,
    OpenRing,
    PlanGrants,
    PlanRank,
    PlanRequest,
    ResetPeer,
    StagingInfo,
    ToClient,
    ToPeer,
    Unplan,
)
from pdpush.sessions.tx_request import TxRank, TxRequest  # noqa: F401 - importable from here

PEER_SWEEP_MS = 1000  # how often on_tick forgets receivers that failed (or were never reached) and serve no request


@dataclass(frozen=True)
class SenderLimits:
    lease_ms: int = 30_000
    control_timeout_ms: int = 5000
    layer_timeout_ms: int = 5000
    alloc_retry_budget_ms: int = 2000
    ring_slots: int = 256  # per engine connection's hand-over ring (ring.py); 0: hand-overs by message only
    words: bool = True  # ask for completion on the data path (AllocRequest.completion "words"): no Commit



def _pages_in(runs: list[tuple[int, int]], pool_pages: int, want: int) -> list[int]:
    """The ``want`` pages of an allocation's ``page_runs``, each in the receiver's pool (its HelloAck's
    ``pool_pages``) and none twice: the puts' remote addresses are computed from them, and no layer below checks
    those (a receiver's bug must fail its request, not send a put outside its pool). Counted before they are listed:
    runs of 2^32 pages were listed first, and a pool said to be that large passes the pool's check."""
    if (got := sum(n for _, n in runs)) != want:
        raise ValueError(f"{got} pages for {want} new items")
    if any(p + n > pool_pages for p, n in runs):
        raise ValueError(f"page runs {runs[:8]} outside a pool of {pool_pages} pages")
    pages = [p + i for p, n in runs for i in range(n)]
    if len(set(pages)) != len(pages):
        raise ValueError(f"page runs {runs[:8]} outside a pool of {pool_pages} pages, or overlapping")
    return pages

class SenderSession:
    def __init__(self, limits: SenderLimits, staging: StagingInfo, default_receiver: str = "", *,
                 check_receiver: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self.staging_info = staging
        self.peers = PeerTable(limits.control_timeout_ms, default_receiver, check_receiver)  # the receivers
        self.reqs: dict[str, TxRequest] = {}
        self._by_seq: dict[int, TxRequest] = {}
        self._seq = itertools.count(1)
        self.ended = Ended()  # recently ended multi-rank requests, for a rank that begins one late
        self.draining = False
        self.lifelines: set[bytes] = set()  # engine connections whose death the shell will report (lifeline.py)
        self.counters = Counters({k: 0 for k in (
            "requests_total", "requests_done", "requests_failed", "bytes_pushed", "puts", "layers_pushed",
            "chunks_skipped", "alloc_retries", "internal_errors", "staging_waits", "staging_asks",
            "handovers_stale", "handovers_refused", "rings_refused", "finishes_ring", "stale_replies",
            "sessions_lost")})
        self.grants = StagingGrants(staging, self.counters, limits.lease_ms)  # the staging, by request
        self.rings = HandoverRings(self.grants.meta, staging.address, limits.ring_slots, self.counters)
        self._swept_ms = 0  # when on_tick last forgot the receivers nothing uses

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
                           out, tell_receiver=True, quiet=ident)  # (it reads no answer: ``except`` below)
                self.grants.stopped(r.req_id, ident, out)  # the engine that aborts has stopped writing
            elif isinstance(msg, Bye):
                self.rings.close(ident, out)
                out.append(ToClient(ident, Ok()))  # the engine closes its lifeline after this: what it sent
                # before (an Abort, say) is handled as sent, not as a death
            else:
                raise UnexpectedMessage(f"sender does not accept {msg.type} on the ingress")
        except PdpushError as e:
            if not isinstance(msg, Abort):  # an engine reads no answer to its Abort: one about the id would be taken
                out.append(ToClient(ident, protocol.error_reply(e, rid)))  # for its next Begin of it (a retry)'s
            else:
                out.append(Log(logging.DEBUG, f"an engine's abort not taken: {e.code.value}: {e}", rid))
        except Exception as exc:  # noqa: BLE001 - the top-level guard: one message never ends the daemon
            aborting = isinstance(msg, Abort)  # (an engine reads no answer to its Abort: above)
            self._internal(msg.type, exc, rid, now, out, reply_to=None if aborting else ident,
                           quiet=ident if aborting else b"")
            if aborting and rid:  # it has stopped writing that request's staging, whatever went wrong here
                self.grants.stopped(rid, ident, out)
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
            k = r.ranks.get(r.rank_of(ident))
            if k is None or why == put_plan.NOT_YOURS:
                continue  # another connection's request: counted, and never named to this one
            err = RemoteProtocolError(put_plan.refusal(why, r, k, first, n))
            out.append(ToClient(ident, protocol.error_reply(err, r.req_id)))
        return out

    def on_ring_finish(self, ident: bytes, handles: list[int], now: int) -> list:
        """Finish records from ``ident``'s ring (ring.py ``FINISH``), by request handle, in order: each is
        that request's Finish, checked and answered as the message would be. One naming a request that has
        ended is dropped and counted (the engine heard of its end already); where the request failed, it also
        says that engine has stopped writing the request's staging, as the message does."""
        out: list = []
        for handle in handles:
            r = self._by_seq.get(handle)
            if r is None:
                self.counters.add("handovers_stale")
                if (rid := self.grants.held_by_handle(handle, ident)) is not None:
                    self.grants.stopped(rid, ident, out)
                continue
            if r.rank_of(ident) is None:  # another connection's request: counted, and never named to this one
                self.counters.add("handovers_refused")
                continue
            self.counters.add("finishes_ring")
            out.extend(self.on_ingress(ident, Finish(req_id=r.req_id), now))
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
        p = self.peers.connecting(endpoint)
        if p is None:
            return out
        if error is not None:
            self._peer_failed(p, BrokenResourceError(f"cannot open the data plane to {endpoint}: {error}"), now, out)
            return out
        for rid in self.peers.ready(p, out):
            r = self.reqs.get(rid)
            if r is None or r.state is not TxState.WAIT_PEER or r.peer is not p:  # (ended: the id may be another
                continue  # request's now, waiting for another receiver)
            if (err := p.layout_error(r.begin.layout)) is not None:
                self._fail(r, err, now, out)
            else:
                self._send_alloc(r, TxEvent.PEER_READY, now, out)
        return out

    def on_landed(self, landed: list[tuple[int, int]], now: int, checksums: list[int | None] | None = None,
                  words: list[int] | tuple[int, ...] = (), at_ms: list[float] | None = None) -> list:
        """Layers that landed since the last call, as (request handle, layer), with their checksums where
        they are on (``layer_checksum``: a LayerDone per request carries them), and ``words``: a request handle
        for each layer whose readiness words are in the pool; then the requests that completed. ``at_ms``: when
        each landed (the native path reports landings in batches), else ``now``."""
        out: list = []
        touched: dict[int, TxRequest] = {}
        for seq in words:
            r = self._by_seq.get(seq)
            if r is not None and r.state is TxState.STREAMING:
                r.words_in += 1
                touched[seq] = r
        for i, (seq, layer) in enumerate(landed):
            r = self._by_seq.get(seq)
            if r is None or r.state is not TxState.STREAMING:
                continue  # the request ended meanwhile (failed, aborted): nothing to announce
            try:
                self._landed(r, layer, checksums[i] if checksums else None, at_ms[i] if at_ms else now)
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

    @property
    def wants_each_landing(self) -> bool:
        """Engines wait for staging blocks that landings give back: the shell reports each landing at once."""
        return self.grants.waiting

    def layer_checksum_spans(self, seq: int, layer: int) -> list[tuple[int, int]]:
        """Where a landed layer's shares lie in staging (address, bytes), by TP rank: the shell hashes them
        for its checksum before ``on_landed`` gives the block back."""
        r = self._by_seq.get(seq)
        if r is None or layer not in r.grant.blocks:
            return []
        return put_plan.share_spans(r, layer, self.staging_info.address)

    def on_peer_lost(self, endpoint: str, why: str, now: int, error: PdpushError | None = None) -> list:
        """A receiver's socket or endpoint broke (``BrokenResourceError``), or its puts failed or timed out
        (``error``): its requests fail, and the next request starts afresh."""
        out: list = []
        if (p := self.peers.live(endpoint)) is not None:
            self._peer_failed(p, error or BrokenResourceError(why), now, out)
        return out

    def on_lifeline(self, ident: bytes) -> None:
        """Engine connection ``ident`` opened a lifeline (lifeline.py): its death will be seen."""
        self.lifelines.add(ident)

    def on_client_gone(self, ident: bytes, now: int) -> list:
        """Engine connection ``ident``'s lifeline closed (its process died, in whatever PID namespace):
        its requests cannot complete, fail them for every rank; its staging and ring come back."""
        out: list = []
        self.lifelines.discard(ident)
        for r in list(self.reqs.values()):
            dead = [rank for rank, k in r.ranks.items() if k.client == ident]
            if dead:
                self._fail(r, BrokenResourceError(f"prefill {r.who(dead[0])} died mid-push (its connection's "
                                                  "lifeline closed)"), now, out, tell_receiver=True)
        self.grants.on_client_gone(ident, out)
        self.rings.close(ident, out)
        return out

    def on_action_failed(self, what: str, exc: Exception, owner: str | int | None, now: int) -> list:
        """The shell could not carry out action ``what`` (``tx_actions.action_owner``: the request it belonged to,
        by req_id or handle): that request fails with an internal error, and nothing else does."""
        out: list = []
        r = self._by_seq.get(owner) if isinstance(owner, int) else self.reqs.get(owner) if owner else None
        self._internal(f"the shell's {what}", exc, r.req_id if r is not None else None, now, out)
        return out

    def on_tick(self, now: int) -> list:
        out: list = []
        lim = self.limits
        self.grants.on_tick(now, out)
        for p, err in self.peers.expired(now):
            self._peer_failed(p, err, now, out)
        if now - self._swept_ms >= PEER_SWEEP_MS:
            self._swept_ms = now
            out.extend(ForgetPeer(e) for e in self.peers.forget_idle({r.peer.endpoint for r in self.reqs.values()}))
        for r in list(self.reqs.values()):
            if (err := r.late_error(now, lim.control_timeout_ms)) is not None:
                self._fail(r, err, now, out, tell_receiver=True)  # a stage's ranks did not all begin in time
            elif r.state is TxState.ALLOC_BACKOFF and now >= r.deadline_ms:
                self._send_alloc(r, TxEvent.RETRY, now, out)
            elif r.state in (TxState.ALLOCATING, TxState.COMMITTING, TxState.WAIT_PEER) and now > r.deadline_ms:
                self._fail(r, TransportTimeout(f"no {r.state.value} reply from {r.peer.endpoint} within "
                                               f"{lim.control_timeout_ms} ms"), now, out, tell_receiver=True)
            elif r.state is TxState.STREAMING and now > r.deadline_ms and r.words and r.finished() \
                    and len(r.layers_done) == r.layout.push_layers:  # every byte landed, its words not yet heard:
                self._send_commit(r, now, out)  # the receiver says whether it has it whole (a Commit, as before)
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
                  reply_to: bytes | None = None, quiet: bytes = b"") -> None:
        """An exception handling ``what``: the request it concerned fails (told to its engines but ``quiet``), and
        ``reply_to`` is answered."""
        err, line = internal_error(what, exc, rid)
        self.counters.add("internal_errors")
        out.append(line)
        r = self.reqs.get(rid) if rid else None
        if r is not None:
            try:
                self._fail(r, err, now, out, tell_receiver=True, quiet=quiet)
                return  # its client got the error
            except Exception as exc2:  # noqa: BLE001 - the failure path itself is broken: drop the request
                out.append(internal_error("failing a request", exc2, rid)[1])
                self._release(r, now, out)
        if reply_to is not None:
            out.append(ToClient(reply_to, protocol.error_reply(err, rid)))

    # ---- prefill engine ----------------------------------------------------------------
    def _client_req(self, ident: bytes, req_id: str) -> tuple[TxRequest, int]:
        r = self.reqs.get(req_id)
        if r is not None and (rank := r.rank_of(ident)) is not None:
            return r, rank
        raise UnknownRequest(f"unknown request {req_id!r}")

    def _begin(self, ident: bytes, msg: Begin, now: int, out: list) -> None:
        if self.draining:
            raise ShuttingDown("sender is draining")
        stage = participants.check_begin(msg)
        r = self.reqs.get(msg.req_id)
        if r is not None:
            self._join(r, ident, msg, stage, now, out)
            return
        self.ended.check(msg)  # a late rank of a request that ended: it gets what the others got (else a retry)
        layout = msg.layout.kv_layout
        try:
            check_prefill_tp(layout, msg.tp_size)
            layout.check_state_tp(msg.tp_size)
            tokens = tokens_of(layout, len(msg.chunk_keys), msg.last_chunk_tokens)
        except ValueError as e:
            raise RemoteProtocolError(str(e)) from None
        self.grants.check(layout, tokens)
        peer = self.peers.for_begin(msg, layout, now)
        first = msg.pp_rank * msg.tp_size + msg.tp_rank
        r = TxRequest(msg.req_id, self._next_seq(), {first: TxRank.of(ident, msg, stage, now)}, peer, msg, layout,
                      now + self.limits.control_timeout_ms, now, tp=msg.tp_size, pp=msg.pp_size)
        self.reqs[r.req_id] = r
        self._by_seq[r.seq] = r
        self.ended.begun(r.req_id)
        self.counters.add("requests_total")
        if peer.state is PeerState.READY:
            self._send_alloc(r, TxEvent.PEER_READY, now, out)
        else:
            self.peers.wait(peer, r.req_id, msg, now, out)

    def _join(self, r: TxRequest, ident: bytes, msg: Begin, stage: range, now: int, out: list) -> None:
        """Another rank (or stage) of a request in flight begins it: it shares the allocation and the staging."""
        part, err = participants.check_join(r, ident, msg, stage)
        if err is not None:
            self._fail(r, err, now, out, tell_receiver=True)
            raise err
        r.ranks[part] = TxRank.of(ident, msg, stage, now)
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
        rank = r.ranks[r.rank_of(ident)]
        ring, slots = (self.rings.open(ident, ident in self.lifelines, out) if rank.ring  # the connection's, or none
                       else (0, 0))
        return BeginOk(req_id=r.req_id, already_sent_indexes=r.held, staging_shmid=s.shmid,
                       staging_bytes=s.nbytes, staging_offset=r.grant.meta_off, new_chunks=r.n_new,
                       daemon_id=s.daemon_id, pool_shards=r.peer.ack.pool_shards, handle=r.seq,
                       ring_offset=ring, ring_slots=slots, idle_offset=self.rings.idle_offset,
                       doorbell=s.doorbell if slots else "", ring_finish=bool(slots))

    def _send_alloc(self, r: TxRequest, event: TxEvent, now: int, out: list) -> None:
        b = r.begin
        r.state = SENDER_REQUEST.next(r.state, event, f"request {r.req_id!r}")
        r.alloc_attempts += 1
        r.t_alloc_ms = now
        r.deadline_ms = now + self.limits.control_timeout_ms
        out.append(ToPeer(r.peer.endpoint, AllocRequest(req_id=r.req_id, chunk_keys=b.chunk_keys,
                                                        last_chunk_tokens=b.last_chunk_tokens,
                                                        lease_ms=self.limits.lease_ms, tp_size=r.tp,
                                                        completion="words" if self.limits.words else "commit",
                                                        attempt=r.seq)))

    def _layer_ready(self, ident: bytes, msg: LayerReady, now: int, out: list) -> None:
        """Layers handed over by message: the native path takes them as it takes ring records."""
        r, _ = self._client_req(ident, msg.req_id)
        if r.state is not TxState.STREAMING:
            raise UnexpectedMessage(f"layer_ready for {r.req_id!r} in state {r.state.value}")
        if len(set(msg.layers)) != len(msg.layers):
            raise RemoteProtocolError(f"layer_ready for {r.req_id!r} names a layer twice: {msg.layers}")
        out.append(Hand(ident, r.seq, tuple(msg.layers)))

    def _landed(self, r: TxRequest, layer: int, digest: int | None, at: int) -> None:
        """Every share of ``layer`` is flushed (its readiness words are on their way): count it, give its
        block back, and queue it for the request's next look (``_announce``)."""
        if layer in r.layers_done:
            return
        puts = r.layer_puts[layer]
        for k in r.ranks.values():
            if layer in k.layers:
                k.puts += puts
                k.layers_posted.add(layer)
        r.puts += puts * r.tp
        self.counters.add("puts", puts * r.tp)
        r.bytes_sent += r.plan.layer_bytes(layer)
        r.layers_done.add(layer)
        self.grants.land(r, layer)
        r.unannounced.append((layer, digest, at))

    def _announce(self, r: TxRequest, now: int, out: list) -> None:
        """Count the layers flushed since the last look (a LayerDone carries their checksums, where they are on);
        commit once all are in."""
        done, r.unannounced = r.unannounced, []
        if done:
            nbytes = sum(r.plan.layer_bytes(la) for la, _, _ in done)
            self.counters.count(out, "bytes_pushed", nbytes, "bytes")
            self.counters.count(out, "layers_pushed", len(done), "layers")
            summed = [(la, c) for la, c, _ in done if c is not None]
            if summed:  # only a checksum needs a notice per layer; readiness words tell the rest, the Commit covers it
                out.append(ToPeer(r.peer.endpoint, LayerDone(req_id=r.req_id, layers=[la for la, _ in summed],
                                                             checksums=[c for _, c in summed])))
            r.layer_done_ms.extend(float(at - r.t0_ms) for _, _, at in done)
        self._complete(r, now, out)

    def _finish(self, ident: bytes, msg: Finish, now: int, out: list) -> None:
        r, rank = self._client_req(ident, msg.req_id)
        if r.state is not TxState.STREAMING or r.ranks[rank].finish:
            raise UnexpectedMessage(f"finish for {r.req_id!r} in state {r.state.value}")
        r.ranks[rank].finish = True
        self._complete(r, now, out)

    def _complete(self, r: TxRequest, now: int, out: list) -> None:
        """Once every rank has finished and every layer landed: the Commit, or, where the request completes on
        the data path, done as soon as every layer's readiness words are in (the receiver commits on them). Its
        lease deadline (``deadline_ms``, 0.9 of the lease counted from our AllocRequest) ends before the
        receiver's, so words in by then were in before the receiver could expire it. A Commit waits for the words
        too: once committed, the receiver may hand the request's pages to another, and a readiness put of this one
        landing there after that one's would hide it (its lease id, not the new one's)."""
        if not (r.finished() and len(r.layers_done) == r.layout.push_layers) or r.words_in < r.words_want:
            return
        if not r.words:
            self._send_commit(r, now, out)
        else:
            if now > r.deadline_ms:  # in whole, but late for our clock: the receiver says (a CommitAck, or why not)
                self._send_commit(r, now, out)
            else:
                self._done(r, now, out, TxEvent.LANDED)

    def _send_commit(self, r: TxRequest, now: int, out: list) -> None:
        r.state = SENDER_REQUEST.next(r.state, TxEvent.COMMIT, f"request {r.req_id!r}")
        r.deadline_ms = now + self.limits.control_timeout_ms
        out.append(ToPeer(r.peer.endpoint, Commit(req_id=r.req_id, layers=len(r.layers_done))))

    # ---- receivers ---------------------------------------------------------------------
    def _peer_msg(self, p: Peer, msg: Msg, now: int, out: list) -> None:
        if isinstance(msg, HelloAck):
            self.peers.hello_ack(p, msg, out)
        elif isinstance(msg, AllocResponse):
            r = self.reqs.get(msg.req_id)
            if r is not None and r.peer is p and r.state is TxState.ALLOCATING and msg.attempt == r.seq:
                self._on_alloc(r, msg, now, out)
            elif r is not None and r.peer is p and (msg.attempt != r.seq or r.state in (TxState.STREAMING,
                                                                                        TxState.COMMITTING)):
                # an earlier attempt's, late (its Abort went before this attempt's AllocRequest: the receiver has
                # ended it), or a receiver's duplicate: an Abort naming the id now would end this attempt's pages at
                # the receiver, settled, while its puts may be in flight
                self.counters.add("stale_replies")
                out.append(Log(logging.WARNING, f"an answer to another attempt of the request from {p.endpoint} "
                                                f"(attempt {msg.attempt}, this one {r.seq}, {r.state.value}): dropped",
                               r.req_id))
            else:  # we gave up on it (or this attempt backs off: a retry asks again); do not hold its pages
                out.append(ToPeer(p.endpoint, Abort(req_id=msg.req_id, reason="sender no longer wants it",
                                                    settled=True)))  # nothing was ever put to its pages
        elif isinstance(msg, CommitAck):
            r = self.reqs.get(msg.req_id)
            if r is not None and r.peer is p and r.state is TxState.COMMITTING:
                self._done(r, now, out)
        elif isinstance(msg, Error) and msg.code is ErrorCode.NO_SESSION:
            # the receiver does not know this connection (any more): it forgot it, or ZeroMQ made the connection again
            # after it broke (another routing id there). Its requests fail; the next request says Hello afresh
            self.counters.add("sessions_lost")
            self._peer_failed(p, BrokenResourceError(f"receiver {p.endpoint} has no session for this connection "
                                                     f"({msg.message}); saying Hello again"), now, out)
        elif isinstance(msg, Error):
            r = self.reqs.get(msg.req_id) if msg.req_id else None
            if r is not None and r.peer is p and (r.state in (TxState.ALLOC_BACKOFF, TxState.WAIT_PEER) or (
                    msg.attempt != r.seq if r.state is TxState.ALLOCATING else msg.attempt not in (0, r.seq))):
                # it answers another attempt, or nothing this one asked: it has asked nothing (it backs off, or waits
                # for hello), or it allocates and the error does not name its AllocRequest's attempt (one naming
                # none answers an earlier attempt's Commit or LayerDone, late). Taken, a late pool_exhausted or
                # refusal for an earlier attempt of the id failed its retry
                self.counters.add("stale_replies")
                out.append(Log(logging.WARNING, f"an error from {p.endpoint} for another attempt of the request "
                                                f"(attempt {msg.attempt}, this one {r.seq}, {r.state.value}): "
                                                f"{msg.code.value} {msg.message}: dropped", r.req_id))
            elif r is not None and r.peer is p:
                if r.state is TxState.ALLOCATING and isinstance(error_from_code(msg.code, ""), PoolExhausted):
                    self._backoff(r, msg.retry_after_ms or 20, msg.message, now, out)
                else:  # the receiver ended it: where it had pages, say when our writes to them have settled
                    self._fail(r, error_from_code(msg.code, f"receiver: {msg.message}", r.req_id,
                                                  msg.retry_after_ms), now, out,
                               tell_receiver=r.state in (TxState.STREAMING, TxState.COMMITTING))
            elif p.state is PeerState.HELLO_SENT:
                self._fail_waiting(p, self.peers.refused(p, msg, now, out), now, out)
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
                f"receiver pool exhausted; gave up after {r.alloc_attempts} attempts in {now - r.t0_ms:.0f} ms "
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
            r.plan.set_pages(_pages_in(a.page_runs, r.peer.ack.pool_pages, r.plan.n_new))
        except ValueError as e:
            self._fail(r, RemoteProtocolError(f"receiver's allocation does not fit the request: {e}"), now, out,
                       tell_receiver=True)
            return
        r.n_new = r.plan.n_new
        r.words_want = sum(len(gp.group.layers) for gp in r.plan.groups if gp.n_new)  # layers with new pages
        r.words = a.completion == "words"
        if r.words and not (self.limits.words and r.words_want and not layout.state_layers):
            self._fail(r, RemoteProtocolError("receiver's allocation completes on the data path where this request "
                                              "cannot (not asked, no new pages, or state layers)"), now, out,
                       tell_receiver=True)
            return
        r.state_slot = a.state_slot
        if (a.state_slot >= 0) != bool(layout.state_layers) or a.state_slot >= r.peer.ack.state_slots:
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
            r.layer_puts = put_plan.layer_puts(r)
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
        # The engine has until just before the lease ends to hand over every layer. The lease is a duration
        # (no clock crosses the wire); the receiver started it after our AllocRequest left, so counting from
        # the send on our own clock ends before it on any host.
        r.deadline_ms = r.t_alloc_ms + int(min(self.limits.lease_ms, a.lease_ms) * 0.9)
        self.counters.count(out, "chunks_skipped", r.skipped, "chunks_hit")
        self.grants.ahead(r, out)  # before the BeginOk: those blocks are in the table when the engine looks
        for k in r.ranks.values():  # each rank's plan, then its BeginOk with its connection's ring
            out.append(self._plan_rank(r, k))
            out.append(ToClient(k.client, self._begin_ok(r, k.client, out)))

    def _done(self, r: TxRequest, now: int, out: list, event: TxEvent = TxEvent.COMMIT_ACK) -> None:
        r.state = SENDER_REQUEST.next(r.state, event, f"request {r.req_id!r}")
        self._release(r, now, out)
        self.counters.count(out, "requests_done", metric="requests")
        out.append(Observe("request_seconds", (now - r.t0_ms) / 1000))
        for k in r.ranks.values():
            out.append(ToClient(k.client, Done(req_id=r.req_id, bytes_sent=r.bytes_sent, puts=r.puts,
                                               rank_puts=k.puts, layers=len(r.layers_done),
                                               chunks_skipped=r.skipped, layer_done_ms=r.layer_done_ms)))

    def _release(self, r: TxRequest, now: int, out: list, told: bool = True) -> None:
        """``told``: an engine may know the request's staging (a BeginOk went out)."""
        self.grants.release(r, now, told)
        out.append(Unplan(r.seq))
        self.reqs.pop(r.req_id, None)
        self._by_seq.pop(r.seq, None)
        self.ended.add(r)

    def _fail(self, r: TxRequest, err: PdpushError, now: int, out: list, tell_receiver: bool = False,
              quiet: bytes = b"") -> None:
        """End ``r`` with ``err``, told to each of its engines but ``quiet`` (the one that aborted it)."""
        if self.reqs.get(r.req_id) is not r:
            return
        out.append(Log(logging.WARNING, f"request failed: {err.code.value}: {err}", r.req_id))
        if tell_receiver and r.state in (TxState.ALLOCATING, TxState.STREAMING, TxState.COMMITTING):
            planned = r.state is not TxState.ALLOCATING  # puts may be in flight: the shell says when they settle
            out.append(ToPeer(r.peer.endpoint, Abort(req_id=r.req_id, reason=str(err)[:1000], settled=not planned),
                              r.seq if planned else 0))
        told = r.state in (TxState.STREAMING, TxState.COMMITTING)  # its BeginOk went out (``_on_alloc``)
        r.state = SENDER_REQUEST.next(r.state, TxEvent.FAIL, f"request {r.req_id!r}")
        r.failure = err
        self._release(r, now, out, told)
        self.counters.count(out, "requests_failed", metric="failures", label=err.code.value)
        reply = protocol.error_reply(err, r.req_id)
        out.extend(ToClient(c, reply) for c in r.clients if c != quiet)
        self.grants.pump(out)  # its place in the queue goes to the next

    def _fail_waiting(self, p: Peer, err: PdpushError, now: int, out: list) -> None:
        for r in [r for r in self.reqs.values() if r.peer is p]:
            self._fail(r, err, now, out)
        p.waiting = []

    def _peer_failed(self, p: Peer, err: PdpushError, now: int, out: list) -> None:
        self.peers.fail(p, err, now, out)  # DEAD until the next request (held down, where it never came up)
        self._fail_waiting(p, err, now, out)
        out.append(ResetPeer(p.endpoint))

    # ---- state -------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"requests_inflight": len(self.reqs),
                "receivers_connected": self.peers.connected(), "receivers_known": self.peers.known(),
                **self.grants.stats(), **self.rings.stats(), "draining": self.draining, **self.counters.values}
