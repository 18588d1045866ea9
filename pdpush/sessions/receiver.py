"""ReceiverSession: the receiver's protocol logic, sans-I/O.

Events in (each with ``now``, monotonic milliseconds):
  * ``on_control(sender, msg, now)``  a decoded frame from a sender's control socket;
  * ``on_local(client, msg, now)``    a decoded frame from a local decode engine;
  * ``on_tick(now)``                  deadlines: leases, committed TTLs, parked opens, quarantine.
Actions out: ``ToSender``/``ToDecode`` messages, metric ``Count``/``Observe``, ``Log``.

Fencing: a one-sided write cannot be revoked, and a write held up in the network (retransmits, a partition
that heals, a frozen sender) can land long after its request ended. So the pages of a request that ends
uncommitted go back into use only once no write to them can land: the sender's ``Abort`` says its writes
settled (each completed), or the receiver has closed the sender's UCX endpoints (``FenceSender``: the
connection that would carry them is gone), or they closed themselves. Until then they are unfenced
(pool.py). A lease that expires means the sender did not end its request in time: it is fenced at once; a
request failed without a settled Abort is fenced once ``lease_ms`` passes with none.

Read holds: a request that fails while a decode has it open may still be read there (a decode that saw its
last readiness words land a moment after the receiver gave up on them, and before the Error came, takes it
as whole). Its pages and the held chunks it pinned then stay as they are, out of use (``Tomb``), until every
such open is released (the client sends Release after an error too) or its reader's lifeline closes, or, for
a reader that never lets go, ``lease_ms`` passes; only then are they reclaimed as above.

Completion: a request asked for with ``completion = "words"`` (and granted it: new pages, no state layer, no
checksum to verify) needs no Commit. The sender puts each layer's readiness words only once that layer's bytes
are flushed, so when every word of the request holds its lease id it has landed whole: the session commits it
when it next looks (each tick, and before it opens, answers a query about, allocates beside, expires or fails
it). Anything else commits by its Commit, acknowledged.

Withdrawn pushes: a router that sent a decode leg beside its prefill leg, and saw that prefill leg fail, sends
``Withdraw``. A push id not live here is then remembered as withdrawn (``withdrawn``, bounded, apart from
``finished`` so that a flood of them cannot push out other requests' ends): the decode's next ``Query`` finds
it gone and recomputes at once, opens of it are refused (those parked on it too), and a push of it that begins
later is refused, since its decode no longer waits for it. A live request is left alone: its own sender ends
it. Any peer the control endpoint admits may withdraw, a reader's key too. That is a veto over a push id not
begun: a router makes its push ids (random) and hands them to its own legs, and a reader learns no other's
from the receiver (neither the index feed nor the status carries one), so in practice a router can only veto
its own (``Unread`` below can also drop a begun one nobody has open).

A decode engine that stopped waiting for its push (its ``push_wait_s`` passed, and it recomputes), or whose
request ended without loading it (aborted, say), withdraws it the same way on the local endpoint, so that a
push that comes later takes no pages. A push of it already begun, that nobody has open, is dropped once
committed (at once if it is) rather than kept ``committed_ttl_ms`` unread; its chunks stay in the index,
unpinned, as any dropped request's do, and a push of it again is refused too. A claim it made and never loaded
(its prompt found in its own cache, say) is dropped the same way, at once: its held chunks are unpinned rather
than kept for the claim's lease. A router sends ``Unread`` once nobody will read the push (its client hung up
before a decode leg naming it reached its engine, or that engine refused or failed the leg): as ``Withdraw``, and a begun push (never a claim) is dropped the same way. A
local client can open and read any push already, and a router only names its own push ids: what ``Unread``
adds is a veto over a begun push whose id it knows, where ``Withdraw`` is one over a push not begun. A push
that somebody has open is never touched.

Each request's whole life is one ``RxRequest`` here (state, lease, readers,
watchers); the pool only says which pages it owns. Any ``PdpushError`` while
handling a message becomes that message's typed ``Error`` reply; any other
exception fails the request it concerned with ``InternalError`` and is logged
with its traceback. Either way the session keeps serving.

Imports no zmq, UCX, torch or clock.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from pdpush import protocol
from pdpush.errors import (
    Aborted,
    BrokenResourceError,
    ChecksumMismatch,
    DuplicateRequest,
    Forbidden,
    IncompatiblePeer,
    LeaseExpired,
    NoSession,
    PdpushError,
    PoolExhausted,
    ProtocolError,
    RemoteProtocolError,
    RequestTooLarge,
    ShuttingDown,
    TransportTimeout,
    UnexpectedMessage,
    UnknownRequest,
)
from pdpush.index import IndexFeed
from pdpush.layout import KVLayout, PoolGeometry, StagingShares, check_prefill_tp, runs
from pdpush.plan import RequestPlan, tokens_of
from pdpush.pool import PagePool, PoolRequest
from pdpush.protocol import (
    Abort,
    AllocRequest,
    AllocResponse,
    Claim,
    ClaimOk,
    Commit,
    CommitAck,
    Committed,
    Hello,
    HelloAck,
    IndexLoad,
    IndexSubscribe,
    LayerAvailable,
    LayerDone,
    LayoutSpec,
    Msg,
    Ok,
    Open,
    OpenOk,
    Query,
    QueryReply,
    Release,
    ReqEvent,
    ReqState,
    Unread,
    Withdraw,
)
from pdpush.sessions import Count, Counters, Log, Observe, internal_error

PARKED_OPEN_MS = 120_000
MAX_UNREAD_PER_SENDER = 4096  # pushes of one sender that took no page, committed and not opened, kept at most
PARKED_PER_READER = 4096  # opens one decode connection may have waiting for pushes not yet begun
PARKED_ALL = 65536  # and every connection together (the requests parked on, given-up marks too: 4x)
CLAIMS_PER_READER = 4096  # claims one decode connection may hold at once (each pins its chunks until read or its
# lease: 20,000 claims of one prompt held ~90 MB and pinned every chunk, so that pushes found the pool exhausted)
CLAIMS_ALL = 65536  # and every connection together (a connection made again is another)
MAX_TOKENS = 4096
MAX_SESSIONS = 4096  # sender connections remembered as having said Hello (the least recently heard go first)
MAX_FINISHED = 4096
_LIVE = (ReqState.ALLOCATED, ReqState.STREAMING)


def _keep_recent(d: OrderedDict, key, value, cap: int) -> None:
    """``d[key] = value`` as its most recent entry, the least recent ones dropped past ``cap``."""
    d[key] = value
    d.move_to_end(key)
    while len(d) > cap:
        d.popitem(last=False)


@dataclass(frozen=True)
class ToSender:
    ident: bytes
    msg: Msg


@dataclass(frozen=True)
class ToDecode:
    ident: bytes
    msg: Msg


@dataclass(frozen=True)
class FenceSender:
    """Close every UCX endpoint of the sender ``ident``'s session now: writes it may still have in flight must
    not land (its aborted requests' pages are reused next)."""

    ident: bytes


@dataclass(frozen=True)
class PoolInfo:
    """What HelloAck and OpenOk say about the pool and this receiver's data plane."""

    base: int
    pages: int
    shmid: int
    rkey: bytes
    ready_base: int  # address of the readiness words (layout.py)
    ucx_host: str
    ucx_port: int
    daemon_id: str  # this receiver's start (OpenOk.daemon_id)
    shards: int = 1  # PoolGeometry.shards
    state_slots: int = 0  # PoolGeometry.state_slots


@dataclass(frozen=True)
class ReceiverLimits:
    lease_ms: int = 30_000
    quarantine_ms: int = 2000
    committed_ttl_ms: int = 600_000
    max_chunks_per_request: int = 65536
    max_leases_per_sender: int = 1024
    max_inflight_bytes_per_sender: int = 0
    verify_checksums: bool = True
    reader_keys: frozenset[str] = frozenset()  # CURVE keys (Z85) that may only subscribe to the chunk-index feed


@dataclass
class Tomb:
    """A request that failed while a decode had it open: what it held stays out of use until its readers let go
    ("Read holds" above)."""

    req_id: str
    lease_id: int  # its OpenOk's: a Release that names it is one of these readers'
    holds: tuple[int, int | None]  # its pool hold, its state slot's (None: no state pool)
    readers: dict[bytes, int]  # decode connection -> its opens of it not yet released
    fenced: bool  # no late write of its sender can land (else ``unfenced`` holds its id until it settles)
    until_ms: int  # its pages are reclaimed by then, whatever its readers say


@dataclass
class RxRequest:
    """One request, its whole life on the receiver."""

    req_id: str
    sender: bytes
    alloc: PoolRequest
    lease_id: int
    expires_at_ms: int
    last_chunk_tokens: int
    t_alloc_ms: int
    state: ReqState = ReqState.ALLOCATED
    committed_at_ms: int = 0
    readers: int = 0  # opens not yet released
    layers_done: set[int] = field(default_factory=set)
    verified: set[int] = field(default_factory=set)  # layers whose checksum matched (verify_checksums)
    watchers: set[bytes] = field(default_factory=set)
    opens: dict[bytes, int] = field(default_factory=dict)  # decode connection -> its opens not released
    new_runs: list[tuple[int, int, int]] = field(default_factory=list)
    tp_size: int = 1  # prefill ranks whose shares make up each layer
    decode_ranks: int = 1  # opens it takes: a committed request stays until that many releases
    releases: int = 0
    ttl_ms: int = 0  # committed and unread for this long: dropped (0: the receiver's committed_ttl_ms)
    given_up: str = ""  # its decode withdrew it while live: why; remembered as withdrawn once it leaves
    claimed: bool = False  # made by a Claim from held chunks, not pushed
    claimant: bytes = b""  # the decode connection whose Claim made it
    chunks: int = 0  # the prompt's chunks (its items, by group: plan)
    plan: RequestPlan | None = None
    state_slot: int = -1  # its recurrent state's slot in the pool (-1: none)
    principal: str = ""  # who the per-sender caps count it against: the sender's CURVE key, else its connection
    keys: list[bytes] = field(default_factory=list)  # the prompt's chunk keys (its items': alloc.keys)
    words: bool = False  # completes on the data path: its readiness words all set commit it (no Commit message)
    words_at: object = None  # where its readiness words lie, as the shell's ``words_landed`` indexes them (its cache)


class ReceiverSession:
    def __init__(self, layout: KVLayout, pool_pages: int, limits: ReceiverLimits, pool_info: PoolInfo, *,
                 new_token: Callable[[], bytes], layer_checksum: Callable[[list[list[tuple[int, int]]]], int]
                 | None = None, words_landed: Callable[[RxRequest], bool] | None = None,
                 epoch: str = "0", new_lease: Callable[[], int] | None = None) -> None:
        """``epoch``: new on every start (the chunk-index feed's; index.py).
        ``new_lease()``: a request's lease id (its readiness words' value), 1..2**64-1; the daemon's are random, so
        that nobody who saw one (an engine sees its own requests' in staging) can tell another's: set ahead in
        pages a later request gets, a word would say that request's layer is there before it is. By default 1, 2,
        3, ... (tests).
        ``layer_checksum(ranges)``: ``layout.combine_digests`` of each rank's pool byte ranges
        (offset, bytes) hashed in order.
        ``words_landed(r)``: whether every readiness word of ``r`` (``r.plan.ready_cells()``) holds its lease id;
        without it no request completes on the data path (every one needs a Commit)."""
        self.layout = layout
        self.geometry = PoolGeometry(layout, pool_pages, pool_info.shards)
        self.spec = LayoutSpec(**layout.to_dict())
        self.limits = limits
        self.info = pool_info
        self.pool = PagePool(pool_pages, quarantine_ms=limits.quarantine_ms)
        # recurrent state: one slot per request, never shared (prefix reuse of state is off: docs/layout.md)
        self.state_pool = PagePool(pool_info.state_slots, quarantine_ms=limits.quarantine_ms, indexed=False) \
            if layout.state_layers else None
        if layout.state_layers and not pool_info.state_slots:
            raise ValueError("a layout with state layers needs state slots in the pool")
        self.geometry = PoolGeometry(layout, pool_pages, pool_info.shards, pool_info.state_slots)
        self._new_token = new_token
        self._new_lease = new_lease or itertools.count(1).__next__
        self.feed = IndexFeed(epoch, self.spec)
        self._layer_checksum = layer_checksum
        self._words_landed = words_landed
        self.reqs: dict[str, RxRequest] = {}
        self.sessions: OrderedDict[bytes, None] = OrderedDict()  # sender connections that completed Hello (bounded)
        self.tokens: OrderedDict[bytes, bytes] = OrderedDict()  # one-time UCX session token -> sender identity
        # req_id -> [(decode identity, since ms, tp, given up)]: opens that wait for the push's AllocRequest. One given
        # up (released, or its connection died) stays as a mark until then: the request arrives with that reader's
        # release already counted, so a TP rank that gave up does not keep the others' request to its TTL.
        self.parked: dict[str, list[tuple[bytes, int, int, bool]]] = {}
        self._parked_by: dict[bytes, int] = {}  # decode connection -> its parked opens not given up
        self.finished: OrderedDict[str, str] = OrderedDict()  # recently ended req_id -> why (bounded)
        self.withdrawn: OrderedDict[str, str] = OrderedDict()  # push ids withdrawn (a router, a decode) -> why: refused (bounded)
        # recently dropped committed requests: req_id -> (their sender, chunks committed) (bounded): a late Commit
        # of one (its words were in, but late for the sender's clock) is acknowledged, not refused as unknown
        self.dropped_committed: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self.unfenced: dict[str, tuple[bytes, int]] = {}  # ended uncommitted: req_id -> (sender, fence at ms)
        self.tombs: dict[str, list[Tomb]] = {}  # failed while open: req_id -> what its readers keep (oldest first)
        self._claims_by: dict[bytes, int] = {}  # live claims by the decode connection that made them
        self.words_live: set[str] = set()  # live requests that complete by their readiness words (``_by_words``)
        self._words_looked = -1  # when _look_at_words last looked (ms)
        self.draining = False
        self._next_check = 0  # no lease, TTL or parked open is due before this (ms): ticks before it skip the scan
        self.counters = Counters({k: 0 for k in (
            "requests_total", "requests_committed", "requests_failed", "bad_messages", "bytes_received",
            "layers_received", "checksum_failures", "leases_expired", "internal_errors", "requests_claimed",
            "chunks_claimed", "readers_gone", "releases_refused", "requests_committed_by_words",
            "requests_withdrawn", "requests_given_up", "requests_unread_dropped", "parked_marks_forgotten",
            "allocs_refused", "read_holds", "read_holds_expired")})

    # ---- entry points ------------------------------------------------------------------
    def on_control(self, ident: bytes, msg: Msg, now: int, peer: str = "") -> list:
        """A message from connection ``ident`` on the control endpoint; ``peer``: its CURVE public key (Z85, the
        frame's ``User-Id``) where authentication is on, else "" (loopback: the connection is all we know)."""
        return self._guarded(ident, msg, now, partial(self._control, peer=peer), ToSender)

    def on_local(self, ident: bytes, msg: Msg, now: int) -> list:
        return self._guarded(ident, msg, now, self._local, ToDecode)

    def bad_frame(self, ident: bytes, err: PdpushError, local: bool) -> list:
        """A frame that did not decode: a typed error reply, nothing else changes."""
        self.counters.add("bad_messages")
        return [(ToDecode if local else ToSender)(ident, protocol.error_reply(err))]

    def _guarded(self, ident: bytes, msg: Msg, now: int, handler, reply_cls) -> list:
        out: list = []
        rid = getattr(msg, "req_id", None)
        attempt = msg.attempt if isinstance(msg, AllocRequest) else 0  # an error answering it names its attempt
        answer = getattr(msg, "answer", True)  # (a Release sent without waiting: nobody would read an error reply)
        try:
            handler(ident, msg, now, out)
        except PdpushError as e:
            if isinstance(e, ProtocolError):
                self.counters.add("bad_messages")
            if isinstance(msg, AllocRequest):  # a push refused here (a full pool: pdpush_failures_total's
                self.counters.count(out, "allocs_refused", metric="failures", label=e.code.value)  # pool_exhausted)
            out.append(Log(logging.INFO, f"error reply to {msg.type}: {e.code.value}: {e}", e.req_id or rid))
            if answer:
                out.append(reply_cls(ident, protocol.error_reply(e, e.req_id or rid, attempt)))
        except Exception as exc:  # noqa: BLE001 - the top-level guard: one message never ends the daemon
            err, line = internal_error(msg.type, exc, rid)
            self.counters.add("internal_errors")
            out.append(line)
            r = self.reqs.get(rid) if rid else None
            writer = b""  # a live request's sender, whose writes to its pages may still be in flight
            if r is not None and r.state in _LIVE:
                try:
                    self._fail(r, err, now, out)
                except Exception as exc2:  # noqa: BLE001 - the failure path itself is broken: drop the request
                    out.append(internal_error("failing a request", exc2, rid)[1])
                    self.reqs.pop(rid, None)
                    writer = r.sender
            if rid and rid not in self.reqs:
                self._reclaim_orphan(rid, now, out, writer)
            if answer:
                out.append(reply_cls(ident, protocol.error_reply(err, rid, attempt)))
        self._publish(now, out)
        return out

    def _reclaim_orphan(self, rid: str, now: int, out: list, writer: bytes = b"") -> None:
        """Pool records of ``rid`` with no request here: an internal error came between its allocation and its
        request's record (``_alloc``, ``_claim``), or dropped the request. Without this their pages and pins were
        lost for the daemon's life, and ``rid`` refused as a duplicate. Quarantined, as an abort's: a sender may
        have been told them. ``writer``: the live request's sender, whose writes may still land: its pages wait,
        unfenced, and it is fenced at once (as at an expired lease), not after a quarantine's worth of time."""
        fenced = not writer
        for pool in (self.pool, self.state_pool):
            rec = pool.requests.get(rid) if pool is not None else None
            if rec is None:
                continue
            try:
                if rec.indexed:
                    pool.drop(rid)
                else:
                    pool.abort(rid, now, fenced=fenced)
            except Exception as exc:  # noqa: BLE001 - the pool's accounting itself is broken: say so, go on
                out.append(internal_error("reclaiming a request's pages", exc, rid)[1])
        if not fenced:
            self.unfenced[rid] = (writer, now)
            self._due(now)

    def _index_load(self) -> IndexLoad:
        return IndexLoad(pages_free=self.pool.free_pages, pages_total=self.pool.num_pages,
                         requests_inflight=sum(1 for r in self.reqs.values() if r.state in _LIVE))

    def _publish(self, now: int, out: list) -> None:
        """The pool's index changes, to the chunk-index subscribers (index.py)."""
        changes = self.pool.take_changes()
        if changes and self.feed.subscribers:
            load = self._index_load()
            for kind, keys in changes:
                out.extend(ToSender(i, ev) for i, ev in self.feed.change(kind, keys, load, now))
        elif changes:  # nobody listens: the sequence still moves, so a later subscriber's snapshot is exact
            self.feed.seq += len(changes)

    def farewell(self, now: int) -> list:
        """On shutdown: tell subscribers the index is gone."""
        return [ToSender(i, ev) for i, ev in self.feed.change("cleared", [], self._index_load(), now)]

    def _due(self, at_ms: int) -> None:
        self._next_check = min(self._next_check, at_ms)

    def on_tick(self, now: int) -> list:
        out: list = []
        self.pool.tick(now)
        if self.state_pool is not None:
            self.state_pool.tick(now)
        if self.feed.subscribers:
            out.extend(ToSender(i, ev) for i, ev in self.feed.tick(self._index_load(), now))
        self._look_at_words(now, out)
        if now >= self._next_check:
            self._scan(now, out)
        for ident in {s for s, at in self.unfenced.values() if now >= at}:
            out.append(Log(logging.WARNING, "fencing a sender: its writes to ended requests did not settle in time"))
            self._fence(ident, now, out)
            out.append(FenceSender(ident))
        self._publish(now, out)  # what this tick committed (words) or dropped, not at the next message
        return out

    def _scan(self, now: int, out: list) -> None:
        """Leases, committed TTLs and parked opens that came due; when the next one is."""
        self._next_check = now + PARKED_OPEN_MS
        for r in [r for r in self.reqs.values() if r.state in _LIVE and now >= r.expires_at_ms]:
            if self._by_words(r, now, out):  # it landed whole before its lease ended; we had not looked yet
                continue
            out.append(Log(logging.WARNING, "lease expired", r.req_id))
            self.counters.count(out, "leases_expired", metric="leases_expired")
            self._fail(r, LeaseExpired("lease expired before commit", req_id=r.req_id), now, out)
        for r in [r for r in self.reqs.values() if r.state is ReqState.COMMITTED and r.readers == 0
                  and now >= r.committed_at_ms + self._ttl(r)]:
            self._drop(r, "committed, unread past its TTL")
        for t in [t for ts in self.tombs.values() for t in ts if now >= t.until_ms]:
            out.append(Log(logging.WARNING, f"a failed request's readers kept it past {self.limits.lease_ms} ms "
                                            "(lease_ms): its pages are reclaimed", t.req_id))
            self.counters.add("read_holds_expired")
            self._bury(t, now)
        for _, at in self.unfenced.values():
            self._due(at)
        for ts in self.tombs.values():
            for t in ts:
                self._due(t.until_ms)
        for r in self.reqs.values():
            if r.state in _LIVE:
                self._due(r.expires_at_ms)
            elif r.state is ReqState.COMMITTED and r.readers == 0:
                self._due(r.committed_at_ms + self._ttl(r))
        for rid, waiters in list(self.parked.items()):
            for dident, _, _, given_up in self._unparked([w for w in waiters if now - w[1] >= PARKED_OPEN_MS]):
                if not given_up:  # its engine still waits, unless its own deadline came first: told, typed
                    out.append(ToDecode(dident, protocol.error_reply(TransportTimeout(
                        f"request {rid!r}: its push did not begin here within {PARKED_OPEN_MS} ms", req_id=rid), rid)))
            waiters[:] = [w for w in waiters if now - w[1] < PARKED_OPEN_MS]
            if not waiters:
                del self.parked[rid]
            else:
                self._due(min(w[1] for w in waiters) + PARKED_OPEN_MS)

    def _ttl(self, r: RxRequest) -> int:
        return r.ttl_ms or self.limits.committed_ttl_ms

    def begin_drain(self) -> None:
        self.draining = True

    def drained(self) -> bool:
        return not any(r.state in _LIVE for r in self.reqs.values())

    def abort_all(self, reason: str, now: int) -> list:
        out: list = []
        for r in [r for r in self.reqs.values() if r.state in _LIVE]:
            self._fail(r, Aborted(reason, req_id=r.req_id), now, out)
        return out

    def accept_ucx_token(self, token: bytes) -> bytes | None:
        """A UCX peer presented ``token``: valid once, only if a HelloAck handed it out; the sender session
        (its control identity) the endpoint belongs to, or None."""
        return self.tokens.pop(token, None)

    # ---- senders -----------------------------------------------------------------------
    def _control(self, ident: bytes, msg: Msg, now: int, out: list, peer: str = "") -> None:
        if isinstance(msg, IndexSubscribe):  # a router (authenticated where CURVE is on: a sender's or a reader's key)
            keys = self.pool.indexed_keys() if msg.snapshot else []
            out.extend(ToSender(i, m) for i, m in self.feed.subscribe(ident, msg.snapshot, keys,
                                                                      self._index_load(), now))
            return
        if isinstance(msg, (Withdraw, Unread)):  # a router's (or a sender's): "Withdrawn pushes" above
            out.append(ToSender(ident, Ok(req_id=msg.req_id if self._withdraw(msg, out) else None)))
            return
        if peer and peer in self.limits.reader_keys:  # a router's key: never the pool's rkey, never a write
            raise Forbidden(f"{msg.type}: this key may only subscribe to the chunk-index feed (allowed_readers)")
        if isinstance(msg, Hello):
            out.append(ToSender(ident, self._hello(ident, msg)))
            return
        if ident not in self.sessions:
            raise NoSession(f"{msg.type} before hello on this connection (none, forgotten, or made again since)")
        self.sessions.move_to_end(ident)
        if isinstance(msg, AllocRequest):
            out.append(ToSender(ident, self._alloc(ident, msg, now, out, peer or ident.hex())))
        elif isinstance(msg, LayerDone):
            self._layer_done(ident, msg, now, out)
        elif isinstance(msg, Commit):
            self._commit(ident, msg, now, out)
        elif isinstance(msg, Abort):
            if msg.settled and self.unfenced.get(msg.req_id, (None,))[0] == ident:  # a late write can't come now
                self._settle(msg.req_id, now)
                out.append(ToSender(ident, Ok(req_id=msg.req_id)))
                return
            r = self.reqs.get(msg.req_id)
            if r is None or r.sender != ident:  # none of this sender's here (committed, read and gone; ended; never
                # allocated): nothing to end. An error would be taken for the answer to a retry of the id that the
                # sender has begun meanwhile, and fail it
                out.append(ToSender(ident, Ok(req_id=msg.req_id)))
                return
            if r.words and r.state is ReqState.COMMITTED:  # it landed whole first (its words): nothing to end
                out.append(ToSender(ident, Ok(req_id=msg.req_id)))
                return
            protocol.transition(r.state, ReqEvent.ABORT, r.req_id)
            self._fail(r, Aborted(msg.reason or "aborted by sender", req_id=r.req_id), now, out, settled=msg.settled)
            out.append(ToSender(ident, Ok(req_id=msg.req_id)))
        else:
            raise UnexpectedMessage(f"receiver does not accept {msg.type} on the control endpoint")

    def _hello(self, ident: bytes, msg: Hello) -> Msg:
        if msg.version != protocol.PROTOCOL_VERSION:
            raise IncompatiblePeer(f"protocol version {msg.version} unsupported (receiver speaks "
                                   f"{protocol.PROTOCOL_VERSION})")
        mine = self.layout.fingerprint()
        if msg.fingerprint != mine or msg.layout != self.spec:
            theirs = msg.layout.kv_layout
            raise IncompatiblePeer(f"layout mismatch, sender vs receiver: {theirs.mismatch(self.layout) or 'fingerprint'}"
                                   f" (sender {theirs.describe()}, fp {msg.fingerprint}; receiver "
                                   f"{self.layout.describe()}, fp {mine})")
        _keep_recent(self.sessions, ident, None, MAX_SESSIONS)  # one long silent goes: it says Hello again
        token = self._new_token()
        _keep_recent(self.tokens, token, ident, MAX_TOKENS)  # (unused tokens of peers that never connected go)
        i = self.info
        return HelloAck(ucx_token=token, version=protocol.PROTOCOL_VERSION, fingerprint=mine, layout=self.spec,
                        pool_base=i.base, pool_pages=i.pages, page_bytes=self.layout.page_bytes, rkey=i.rkey,
                        ready_base=i.ready_base, ucx_host=i.ucx_host, ucx_port=i.ucx_port, pool_shards=i.shards,
                        state_slots=i.state_slots)

    def _alloc(self, ident: bytes, msg: AllocRequest, now: int, out: list, principal: str) -> Msg:
        rid = msg.req_id
        if self.draining:
            raise ShuttingDown("receiver is draining", req_id=rid)
        if len(msg.chunk_keys) > self.limits.max_chunks_per_request:
            raise RequestTooLarge(f"{len(msg.chunk_keys)} chunks exceeds the cap of "
                                  f"{self.limits.max_chunks_per_request}", req_id=rid)
        if msg.last_chunk_tokens > self.layout.chunk_tokens:
            raise RemoteProtocolError("last_chunk_tokens exceeds chunk_tokens", req_id=rid)
        if rid in self.reqs:
            raise DuplicateRequest(f"request {rid!r} already exists", req_id=rid)
        self._refuse_withdrawn(rid)
        if rid in self.unfenced:  # a retry of an id whose last try may still write: one attempt at a time (its
            # pages and its fence are the id's until that settles: a settled Abort, or its endpoint closing, in ms)
            raise PoolExhausted(f"request {rid!r}: writes of its earlier attempt may still land; it may retry once "
                                "that sender settles or is fenced", req_id=rid, retry_after_ms=self.pool.retry_after_ms)
        self._look_at_words(now, out, at_most_each_ms=True)  # those that landed whole since: indexed, off the caps
        tokens = tokens_of(self.layout, len(msg.chunk_keys), msg.last_chunk_tokens)
        keys = self.layout.item_keys(msg.chunk_keys, tokens)  # one per (group, chunk) it needs (plan.py)
        self._check_sender_caps(principal, msg, len(keys) - self.pool.held(keys), out)
        try:
            check_prefill_tp(self.layout, msg.tp_size, self.geometry.shards)
            self.layout.check_state_tp(msg.tp_size)
        except ValueError as e:
            raise RemoteProtocolError(str(e), req_id=rid) from None
        if self.state_pool is not None:  # its state slot first: the pages' allocation may evict, a slot never
            slot = self.state_pool.allocate(rid, [rid.encode()], owner=principal).new_pages[0]
        try:
            alloc = self.pool.allocate(rid, keys, owner=principal)
        except PdpushError:
            if self.state_pool is not None:  # never told to the sender: free at once, not quarantined
                self.state_pool.abort(rid, now, published=False)
            raise
        lease = min(msg.lease_ms, self.limits.lease_ms)
        r = RxRequest(rid, ident, alloc, self._new_lease(), now + lease, msg.last_chunk_tokens, now)
        r.new_runs = runs(alloc.new_pages)
        try:
            r.plan = RequestPlan(self.layout, tokens, alloc.held_idx)
            r.plan.set_pages(alloc.new_pages)
        except ValueError as e:  # never told to the sender: its pages and slot are free at once
            self.pool.abort(rid, now, published=False)
            if self.state_pool is not None:
                self.state_pool.abort(rid, now, published=False)
            raise RemoteProtocolError(f"request {rid!r}: {e}", req_id=rid) from None
        r.chunks, r.keys, r.principal = len(msg.chunk_keys), list(msg.chunk_keys), principal
        r.tp_size = msg.tp_size
        r.state_slot = slot if self.state_pool is not None else -1
        # completion on the data path where the words can say it all: new pages to put words on, no state layer
        # (it has none), no checksum to verify first (a LayerDone comes after the bytes)
        r.words = (msg.completion == "words" and self._words_landed is not None and r.plan.n_new > 0
                   and not self.layout.state_layers and not self.limits.verify_checksums)
        if r.words:
            self.words_live.add(rid)
        if self.layout.windows:
            self.counters.add("bytes_window_saved", r.plan.window_saved_bytes)
        self.reqs[rid] = r
        self._due(r.expires_at_ms)
        self.finished.pop(rid, None)
        self.dropped_committed.pop(rid, None)  # (an earlier push of this id, read and gone: never this one's answer)
        self.counters.add("requests_total")
        out.append(Count("chunks_hit", len(alloc.held_idx)))
        out.append(Log(logging.DEBUG, f"alloc {len(msg.chunk_keys)} chunks, {len(alloc.held_idx)} held", rid))
        self._answer_parked(r, out)
        return AllocResponse(req_id=rid, already_sent_indexes=alloc.held_idx,
                             page_runs=[(p, n) for _, p, n in r.new_runs], lease_id=r.lease_id,
                             lease_ms=lease, state_slot=r.state_slot, completion="words" if r.words else "commit",
                             attempt=msg.attempt)

    def _answer_parked(self, r: RxRequest, out: list) -> None:
        """The opens parked on ``r``'s id, which has just begun here: answered (a given-up one counts its release)."""
        for dident, _, tp, given_up in self._unparked(self.parked.pop(r.req_id, [])):
            r.decode_ranks = max(r.decode_ranks, tp)
            if given_up:
                r.releases += 1
            else:
                out.append(self._open_ok(dident, r))

    def _check_sender_caps(self, principal: str, msg: AllocRequest, items: int, out: list) -> None:
        """The per-sender caps, counted by key where CURVE is on (however many connections the key opens), else by
        connection (loopback without authentication: one local sender process per connection); ``items``: the new
        request's items that need a page (those held already take none). And its pushes that
        took no page (every chunk held already), committed and unread: past ``MAX_UNREAD_PER_SENDER``, the oldest
        goes (a decode that opens it later is told it is gone, and recomputes), so that a sender whose pushes nobody
        reads cannot grow this receiver past what its pool bounds."""
        ours = [r for r in self.reqs.values() if r.principal == principal]
        # (those that took pages are bounded by the pool: their chunks stay pinned until read or their TTL)
        unread = [r for r in ours if r.state is ReqState.COMMITTED and not r.readers and not r.alloc.new_idx]
        if len(unread) >= MAX_UNREAD_PER_SENDER:
            for r in sorted(unread, key=lambda r: r.committed_at_ms)[:len(unread) - MAX_UNREAD_PER_SENDER + 1]:
                self._drop(r, f"committed and unread, the oldest of its sender's past {MAX_UNREAD_PER_SENDER}")
                self.counters.add("requests_unread_dropped")
                if (n := self.counters.values["requests_unread_dropped"]) & (n - 1) == 0:  # 1st, 2nd, 4th, ...
                    out.append(Log(logging.WARNING, f"a sender's pushes go unread: {MAX_UNREAD_PER_SENDER} committed "
                                                    f"and never opened; the oldest dropped ({n} so far)"))
        mine = [r for r in ours if r.state in _LIVE]
        # and its aborted ones: pages waiting for its late writes to settle, or in quarantine (an Abort, or an
        # expired lease, frees the lease at once: aborting request after request held the whole pool past the caps)
        ended, ended_pages = self.pool.held_by(principal)
        if len(mine) + ended >= self.limits.max_leases_per_sender:
            raise PoolExhausted(f"sender holds {len(mine)} leases and {ended} ended ones whose writes may still land "
                                "(max_leases_per_sender)", req_id=msg.req_id, retry_after_ms=self.pool.retry_after_ms)
        cap = self.limits.max_inflight_bytes_per_sender
        if cap:
            page_set = self.layout.layers * self.layout.page_bytes  # one page index in every layer
            st = self.layout.state_slot_bytes  # and a state slot each, where the model has state
            ended_slots = self.state_pool.held_by(principal)[1] if self.state_pool is not None else 0
            held = sum(len(r.alloc.new_idx) * page_set + st for r in mine) + ended_pages * page_set + ended_slots * st
            if held + items * page_set + st > cap:
                raise PoolExhausted(f"sender would hold {held + items * page_set + st} bytes "
                                    f"uncommitted (max_inflight_bytes_per_sender={cap})", req_id=msg.req_id)

    def _owned(self, ident: bytes, req_id: str) -> RxRequest:
        r = self.reqs.get(req_id)
        if r is None or r.sender != ident:
            raise UnknownRequest(f"unknown request {req_id!r}", req_id=req_id)
        return r

    def _layer_done(self, ident: bytes, msg: LayerDone, now: int, out: list) -> None:
        r = self._owned(ident, msg.req_id)
        bad = [layer for layer in msg.layers if layer >= self.layout.push_layers]
        if bad:
            raise RemoteProtocolError(f"layer {bad[0]} out of range (0..{self.layout.push_layers - 1})")
        if msg.checksums is not None and len(msg.checksums) != len(msg.layers):
            raise RemoteProtocolError(f"{len(msg.checksums)} checksums for {len(msg.layers)} layers")
        r.state = protocol.transition(r.state, ReqEvent.LAYER_DONE, r.req_id)
        if msg.checksums is None:
            self._refuse_unverified(r, msg.layers, "layer_done", now, out)
        elif self.limits.verify_checksums and self._layer_checksum is not None:
            shares: dict[int, StagingShares] = {}  # by layer group
            for layer, want in zip(msg.layers, msg.checksums, strict=True):
                if layer in r.verified:  # (named again, in this message or an earlier one: hashed once, not each time)
                    continue
                if self.layout.is_state(layer):  # a state layer: each rank's units of its page in the slot
                    page = self.layout.state_page_bytes
                    at = self.geometry.state_at(r.state_slot) + (layer - self.layout.layers) * page
                    ranges = [[(at + rank * page // r.tp_size, page // r.tp_size)] for rank in range(r.tp_size)]
                else:
                    gp = r.plan.of(layer)
                    sh = shares.get(gp.group.index) or shares.setdefault(
                        gp.group.index, StagingShares(self.layout, r.tp_size, self.geometry.shards, gp.n_new))
                    ranges = [[(dst, n) for _, dst, n in sh.ranges(layer, rank, gp.page_runs, self.geometry)]
                              for rank in range(r.tp_size)]
                if self._layer_checksum(ranges) != want:
                    self.counters.add("checksum_failures")
                    err = ChecksumMismatch(f"layer {layer} checksum mismatch", req_id=r.req_id)
                    self._fail(r, err, now, out)
                    out.append(ToSender(ident, protocol.error_reply(err)))
                    return
                r.verified.add(layer)
        self._arrived(r, msg.layers, out)
        # LayerDone is not acknowledged: the Commit ack covers it

    def _refuse_unverified(self, r: RxRequest, layers, what: str, now: int, out: list) -> None:
        """Where this receiver verifies checksums, a request's ``layers`` that move bytes must have been verified
        before readers hear of them (``what``: a LayerDone without checksums, or the Commit): else it fails,
        typed (its sender sends none), and is never indexed."""
        if not (self.limits.verify_checksums and self._layer_checksum is not None):
            return
        unverified = [la for la in layers if r.plan.layer_bytes(la) and la not in r.verified]
        if unverified:
            err = ChecksumMismatch(f"{what} of {r.req_id!r} with layer {unverified[0]} (of {len(unverified)}) not "
                                   "verified: this receiver verifies checksums, and its sender sent none for it (set "
                                   "checksums = true on the sender)", req_id=r.req_id)
            self._fail(r, err, now, out)
            raise err

    def _arrived(self, r: RxRequest, layers, out: list) -> None:
        """``layers`` of ``r`` are in the pool: count them, and tell its watchers those they had not heard of."""
        new = [layer for layer in dict.fromkeys(layers) if layer not in r.layers_done]
        if new:
            r.layers_done.update(new)
            sizes = [r.plan.layer_bytes(layer) for layer in new]  # the state's too (plan.py)
            moved = len(new) if r.new_runs else sum(1 for n in sizes if n)  # a held request's KV layers moved nothing
            self.counters.count(out, "layers_received", moved, "layers")
            self.counters.count(out, "bytes_received", sum(sizes), "bytes")
            for w in r.watchers:
                out.append(ToDecode(w, LayerAvailable(req_id=r.req_id, layers=new)))

    def _commit(self, ident: bytes, msg: Commit, now: int, out: list) -> None:
        """The sender's one completion notice: every layer it pushed has landed (a LayerDone came before only for
        layers with checksums, and those were verified then)."""
        if (n := self._dropped_of(ident, msg.req_id)) is not None:
            out.append(ToSender(ident, CommitAck(req_id=msg.req_id, chunks_committed=n)))  # and read since
            return
        r = self._owned(ident, msg.req_id)
        if r.words and r.state is ReqState.COMMITTED:  # its readiness words committed it first
            out.append(ToSender(ident, CommitAck(req_id=r.req_id, chunks_committed=len(r.alloc.new_idx))))
            return
        if (r.new_runs or r.state_slot >= 0) and msg.layers != self.layout.push_layers:
            raise UnexpectedMessage(f"commit of {r.req_id!r} after {msg.layers} of {self.layout.push_layers} "
                                    "layers", req_id=r.req_id)
        self._refuse_unverified(r, range(self.layout.push_layers), "commit", now, out)
        n = self._complete(r, ReqEvent.COMMIT, now, out)
        out.append(ToSender(ident, CommitAck(req_id=r.req_id, chunks_committed=n)))

    def _by_words(self, r: RxRequest, now: int, out: list) -> bool:
        """Completion on the data path: a "words" request whose every readiness word holds its lease id has
        landed whole (the sender puts a layer's words only once its bytes are flushed), so it commits, with no
        message, whatever else was about to end it (its lease, an Abort, its sender's endpoints closing)."""
        if not (r.words and r.state in _LIVE):
            return False
        try:
            landed = self._words_landed(r)
            if landed:
                self._complete(r, ReqEvent.WORDS, now, out)
            return landed
        except Exception as exc:  # noqa: BLE001 - a tick must not end: it completes by Commit or its lease now
            r.words = False  # (looked at no more: logged once)
            self.words_live.discard(r.req_id)
            self.counters.add("internal_errors")
            out.append(internal_error("completing a request by its readiness words", exc, r.req_id)[1])
            return False

    def look(self, now: int) -> list:
        """Commit the requests whose readiness words are all in now (before a status reply: it is current)."""
        out: list = []
        self._look_at_words(now, out)
        self._publish(now, out)
        return out

    def _look_at_words(self, now: int, out: list, at_most_each_ms: bool = False) -> None:
        if at_most_each_ms and now - self._words_looked < 1:  # a batch of allocations looks once a millisecond
            return
        self._words_looked = now
        for rid in list(self.words_live):
            r = self.reqs.get(rid)
            if r is None or r.state not in _LIVE:
                self.words_live.discard(rid)
            else:
                self._by_words(r, now, out)

    def _complete(self, r: RxRequest, event: ReqEvent, now: int, out: list) -> int:
        """Every layer of ``r`` is in the pool (its Commit, or its readiness words): index its chunks, tell its
        watchers. How many new chunks it committed."""
        state = protocol.transition(r.state, event, r.req_id)
        n = self.pool.commit(r.req_id)
        if self.state_pool is not None:
            self.state_pool.commit(r.req_id)
        r.state = state  # (only once its chunks are indexed: check() holds either way)
        self.words_live.discard(r.req_id)
        r.committed_at_ms = now
        self._due(now + self._ttl(r))
        self.counters.count(out, "requests_committed", metric="requests")
        # (words are seen at the receiver's next look, a tick at most 10 ms after they land: so is this sample)
        out.append(Observe("request_seconds", (now - r.t_alloc_ms) / 1000))
        if event is ReqEvent.WORDS:
            self.counters.add("requests_committed_by_words")
        self._arrived(r, range(self.layout.push_layers), out)  # those no LayerDone announced, and a held one's
        for w in r.watchers:
            out.append(ToDecode(w, Committed(req_id=r.req_id)))
        out.append(Log(logging.DEBUG, f"committed {n} new chunks ({event.value})", r.req_id))
        if r.readers == 0 and 0 < r.decode_ranks <= r.releases:  # every reader it was opened for gave it up already
            self._drop(r, "committed after every reader released it")
        return n

    def _fail(self, r: RxRequest, err: PdpushError, now: int, out: list, settled: bool = False) -> None:
        """End a live request: its pages go to quarantine once fenced (``settled``: the sender said no write
        to them is in flight; else they wait, unfenced), and once its readers let go where it is open (a
        ``Tomb``); its watchers get the typed error. A "words" request
        whose every word is set commits instead (``_by_words``)."""
        if self._by_words(r, now, out):
            return
        if r.state in _LIVE:
            event = ReqEvent.EXPIRE if isinstance(err, LeaseExpired) else ReqEvent.ABORT
            state = protocol.transition(r.state, event, r.req_id)
            fenced = settled or not r.sender
            if readers := {i: n for i, n in r.opens.items() if n > 0}:  # they may be reading it: held for them
                if self.state_pool is not None:
                    self.state_pool.get(r.req_id)  # (both records there, or neither is held: a hold is all or none)
                holds = (self.pool.hold(r.req_id), self.state_pool.hold(r.req_id) if self.state_pool is not None else None)
                tomb = Tomb(r.req_id, r.lease_id, holds, readers, fenced, now + self.limits.lease_ms)
                self.tombs.setdefault(r.req_id, []).append(tomb)
                self._due(tomb.until_ms)
                self.counters.add("read_holds")
            else:
                self.pool.abort(r.req_id, now, fenced=fenced)
                if self.state_pool is not None:
                    self.state_pool.abort(r.req_id, now, fenced=fenced)
            r.state = state  # (once its pages are in hand: a failure before leaves it live, for the guard to drop)
            if not fenced:  # an expired lease: the sender did not end it in time, fence it now
                self.unfenced[r.req_id] = (r.sender, now if event is ReqEvent.EXPIRE else now + self.limits.lease_ms)
                self._due(self.unfenced[r.req_id][1])
            self.counters.count(out, "requests_failed", metric="failures", label=err.code.value)
        for w in r.watchers:
            out.append(ToDecode(w, protocol.error_reply(err, r.req_id)))
        self._forget(r.req_id, f"failed: {err.code.value}: {err}")

    def _settle(self, req_id: str, now: int) -> None:
        self.unfenced.pop(req_id, None)
        self.pool.settle(req_id, now)
        if self.state_pool is not None:
            self.state_pool.settle(req_id, now)
        for t in self.tombs.get(req_id, []):  # (one attempt of an id at a time is unfenced: ``_alloc``)
            t.fenced = True

    def _let_go(self, req_id: str, ident: bytes, n: int | None, now: int, lease_id: int = 0) -> bool:
        """``n`` opens (None: all) of failed ``req_id`` that connection ``ident`` held are released (``lease_id``:
        of the try with that lease id; 0: its newest): whether it held any. A tomb whose last reader let go is
        reclaimed."""
        for t in reversed(self.tombs.get(req_id, [])):
            if ident in t.readers and lease_id in (0, t.lease_id):
                if n is not None and t.readers[ident] > n:
                    t.readers[ident] -= n
                else:
                    del t.readers[ident]
                    if not t.readers:
                        self._bury(t, now)
                return True
        return False

    def _bury(self, t: Tomb, now: int) -> None:
        """Nobody reads failed ``t`` any more (or may, past ``until_ms``): its pages are reclaimed as a failed
        request's are, from now (quarantine, or unfenced until its sender settles)."""
        self.pool.abort_held(t.holds[0], now, fenced=t.fenced)
        if t.holds[1] is not None:
            self.state_pool.abort_held(t.holds[1], now, fenced=t.fenced)
        ts = self.tombs[t.req_id]
        ts.remove(t)
        if not ts:
            del self.tombs[t.req_id]

    def _fence(self, ident: bytes, now: int, out: list) -> None:
        """Sender ``ident``'s UCX endpoints are closed (or being closed by our ``FenceSender``): none of its
        writes can land any more. Its live requests cannot complete without them: they fail, fenced."""
        for rid in [rid for rid, (s, _) in self.unfenced.items() if s == ident]:
            self._settle(rid, now)
        for r in [r for r in self.reqs.values() if r.sender == ident and r.state in _LIVE]:
            self._fail(r, BrokenResourceError("the sender's data plane closed", req_id=r.req_id), now, out,
                       settled=True)

    def on_sender_lost(self, ident: bytes, now: int) -> list:
        """Every UCX endpoint of sender ``ident``'s session closed (it died, restarted or closed them): no
        write of it can land now; its requests in flight fail at once instead of at their leases."""
        out: list = []
        self._fence(ident, now, out)
        self._publish(now, out)
        return out

    def _dropped_of(self, ident: bytes, req_id: str) -> int | None:
        """Sender ``ident``'s request ``req_id`` committed, read and dropped lately: the chunks it committed."""
        d = self.dropped_committed.get(req_id) if req_id not in self.reqs else None
        return d[1] if d is not None and d[0] == ident else None

    def _drop(self, r: RxRequest, why: str) -> None:
        """A committed request nobody reads any more."""
        if r.sender:
            _keep_recent(self.dropped_committed, r.req_id, (r.sender, len(r.alloc.new_idx)), MAX_FINISHED)
        self.pool.drop(r.req_id)
        if self.state_pool is not None and r.state_slot >= 0:
            self.state_pool.drop(r.req_id)
        self._forget(r.req_id, why)

    def _withdraw(self, msg: Withdraw | Unread, out: list, by_decode: bool = False) -> bool:
        """The push ``msg.req_id`` will not come, or will not be read: a router's (``by_decode`` False; ``Unread``:
        its client hung up) or its own decode engine's, which stopped waiting for it. Not live here: ended, refused
        if it begins, its parked opens refused; True. Live here (begun): False, and it is left to its sender; where
        its decode gave it up (a claim too), or its router's client did (never a claim), and nobody has it open, it
        is dropped once committed (at once if it is), not kept ``committed_ttl_ms`` unread. Given up once, it is
        counted once."""
        rid = msg.req_id
        unread = isinstance(msg, Unread)
        who = ("its decode engine, which stopped waiting for it" if by_decode else
               "the router that placed it, with no decode to read it" if unread else "the router that placed it")
        why = f"withdrawn by {who}{': ' + msg.reason if msg.reason else ''}"
        if (r := self.reqs.get(rid)) is not None:
            if r.given_up:
                out.append(Log(logging.DEBUG, f"{why}, given up already", rid))
            elif (by_decode or (unread and not r.claimed)) and not r.readers:  # (a claim: unpinned now, not later)
                self.counters.count(out, "requests_given_up", metric="withdrawn",
                                    label="decode_live" if by_decode else "router_live")
                r.given_up = why  # a push of it again (a retried prefill leg) is refused once this one leaves
                if r.state is ReqState.COMMITTED:
                    self._drop(r, why)
                    out.append(Log(logging.DEBUG, f"{why}, after it committed: dropped", rid))
                else:
                    r.ttl_ms = 1
                    out.append(Log(logging.DEBUG, f"{why}, after its push began: dropped once committed", rid))
            else:
                out.append(Log(logging.DEBUG, f"{why}, after its push began: left to its sender", rid))
            return False
        if rid not in self.withdrawn:
            self.counters.count(out, "requests_withdrawn", metric="withdrawn", label="decode" if by_decode else "router")
            out.append(Log(logging.DEBUG, why, rid))  # (counted: a flood of them makes no flood of lines)
        _keep_recent(self.withdrawn, rid, why, MAX_FINISHED)
        for dident, _, _, given_up in self._unparked(self.parked.pop(rid, [])):
            if not given_up:
                out.append(ToDecode(dident, protocol.error_reply(UnknownRequest(f"request {rid!r} is gone: {why}",
                                                                                req_id=rid), rid)))
        return True

    def _ended(self, rid: str) -> str | None:
        """Why request ``rid``, not live here, has ended lately (or was withdrawn before it began); None: unknown."""
        return self.withdrawn.get(rid) or self.finished.get(rid)

    def _refuse_withdrawn(self, rid: str) -> None:
        if rid in self.withdrawn:
            raise Aborted(f"request {rid!r} was {self.withdrawn[rid]} (its decode recomputes)", req_id=rid)

    def _forget(self, req_id: str, why: str) -> None:
        r = self.reqs.pop(req_id, None)
        if r is not None and r.claimed:
            if (left := self._claims_by[r.claimant] - 1) > 0:
                self._claims_by[r.claimant] = left
            else:
                del self._claims_by[r.claimant]
        if r is not None and r.given_up:  # its decode no longer waits for it: a push of it again is refused
            _keep_recent(self.withdrawn, req_id, r.given_up, MAX_FINISHED)
        _keep_recent(self.finished, req_id, why, MAX_FINISHED)

    # ---- local decode engine -----------------------------------------------------------
    def _local(self, ident: bytes, msg: Msg, now: int, out: list) -> None:
        if isinstance(msg, Open):
            r = self.reqs.get(msg.req_id)
            if r is not None:
                r.decode_ranks = max(r.decode_ranks, msg.tp_size)
                out.append(self._open_ok(ident, r))
                self._by_words(r, now, out)  # landed whole: committed (its Committed follows the OpenOk)
            elif (why := self._ended(msg.req_id)) is not None:
                raise UnknownRequest(f"request {msg.req_id!r} is gone: {why}")
            elif msg.exists:
                raise UnknownRequest(f"request {msg.req_id!r} is not on this receiver (its push never began here)")
            else:
                waiters = self.parked.get(msg.req_id, [])
                mine = next((i for i, w in enumerate(waiters) if w[0] == ident and w[3]), None)
                if (mine is None and len(waiters) >= 16) or self._parked_by.get(ident, 0) >= PARKED_PER_READER or (
                        sum(self._parked_by.values()) >= PARKED_ALL):
                    # (one connection cannot fill them all; given-up marks, kept to count releases, make room)
                    raise RequestTooLarge("too many parked opens")
                if msg.req_id not in self.parked and len(self.parked) >= 4 * PARKED_ALL:
                    self._forget_marks()
                waiters = self.parked.setdefault(msg.req_id, waiters)
                self._parked_by[ident] = self._parked_by.get(ident, 0) + 1
                if mine is not None:  # it gave one up before: that one is live again (its release is not counted)
                    waiters[mine] = (ident, now, msg.tp_size, False)
                    self._due(now + PARKED_OPEN_MS)
                    return
                waiters.append((ident, now, msg.tp_size, False))  # answered when the AllocRequest arrives
                self._due(now + PARKED_OPEN_MS)
        elif isinstance(msg, Release):
            r = self.reqs.get(msg.req_id)
            if not self._release_open(r, msg, ident, now, out) and r is not None and msg.lease_id in (0, r.lease_id):
                # only an open of this connection's own: another's reader would lose its pages under its views
                self.counters.add("releases_refused")
                raise UnknownRequest(f"request {msg.req_id!r} has no open of this connection to release",
                                     req_id=msg.req_id)
            if msg.answer:
                out.append(ToDecode(ident, Ok(req_id=msg.req_id)))
        elif isinstance(msg, Claim):
            opened: list = []  # the opens parked on its id, answered after the claim's own answer (a connection that
            ok = self._claim(ident, msg, now, opened)  # opened and then claimed the id waits for the ClaimOk first)
            out.extend(a for a in opened if not isinstance(a, ToDecode))
            out.append(ToDecode(ident, ok))
            out.extend(a for a in opened if isinstance(a, ToDecode))
        elif isinstance(msg, Withdraw):  # the decode engine stopped waiting for this push: "Withdrawn pushes" above
            out.append(ToDecode(ident, Ok(req_id=msg.req_id if self._withdraw(msg, out, by_decode=True) else None)))
        elif isinstance(msg, Query):
            if (r := self.reqs.get(msg.req_id) if msg.req_id else None) is not None:
                self._by_words(r, now, out)
            out.append(ToDecode(ident, QueryReply(
                held_prefix=self.pool.held_prefix(msg.chunk_keys),
                request_chunks=self._request_prefix(msg.req_id, msg.chunk_keys),
                request_gone=msg.req_id is not None and msg.req_id not in self.reqs and
                self._ended(msg.req_id) is not None,
                request_committed=self._committed(msg.req_id))))
        else:
            raise UnexpectedMessage(f"receiver does not accept {msg.type} on the local endpoint")

    def _release_open(self, r: RxRequest | None, msg: Release, ident: bytes, now: int, out: list) -> bool:
        """The open ``msg`` gives up, whether there was one: the live request's, where its lease id names it (or
        none is named and this connection has it open); else a failed try's it names (its read hold); else, named
        by none (an open never answered to its client: ``PendingOpen.abandon``), a parked one. Never a failed try's
        unnamed: that open may have been refused (its id gone), and the release would then let go of a hold its
        connection's earlier open still reads; an unnamed open of a try that then failed is held until
        ``lease_ms``. (One named by a try whose hold has gone, past ``lease_ms``: none.)"""
        if r is not None and r.opens.get(ident) and msg.lease_id in (0, r.lease_id):
            r.watchers.discard(ident)  # (releasing: it hears nothing more of it)
            self._by_words(r, now, out)  # landed whole: committed, so the last release drops it
            self._release(r, ident, 1)
            return True
        if msg.lease_id:
            return self._let_go(msg.req_id, ident, 1, now, msg.lease_id)
        return self._unpark(msg.req_id, ident, 1)

    def _release(self, r: RxRequest, ident: bytes, n: int) -> None:
        r.watchers.discard(ident)
        if r.opens.get(ident, 0) > n:
            r.opens[ident] -= n
        else:
            r.opens.pop(ident, None)
        r.readers = max(0, r.readers - n)
        r.releases += n
        if r.readers == 0 and r.state is ReqState.COMMITTED and r.releases >= r.decode_ranks:
            self._drop(r, "committed and released")
        elif r.readers == 0:
            self._due(r.expires_at_ms)

    def on_reader_gone(self, ident: bytes, now: int) -> list:
        """Decode connection ``ident``'s lifeline closed (its engine died, in whatever PID namespace): its
        opens are released, so a dead reader pins no page, and its parked opens go."""
        out: list = []
        for r in [r for r in self.reqs.values() if ident in r.opens or ident in r.watchers]:
            self._release(r, ident, r.opens.get(ident, 0))
        for rid in [rid for rid, ts in self.tombs.items() if any(ident in t.readers for t in ts)]:
            while self._let_go(rid, ident, None, now):
                pass
        for rid in [rid for rid, ws in self.parked.items() if any(w[0] == ident for w in ws)]:
            self._unpark(rid, ident, None)
        self.counters.add("readers_gone")
        self._publish(now, out)
        return out

    def _unpark(self, rid: str, ident: bytes, n: int | None) -> bool:
        """``n`` of connection ``ident``'s parked opens of ``rid`` (None: all of them) go unanswered: it released
        them, or it died. Each stays as a given-up mark, so that the request counts its release when it arrives.
        Whether there was one."""
        ws = self.parked.get(rid, [])
        found = False
        for i, (who, since, tp, given_up) in enumerate(ws):
            if n == 0:
                break
            if who == ident and not given_up:
                self._unparked([ws[i]])
                ws[i] = (who, since, tp, True)
                n = None if n is None else n - 1
                found = True
        return found

    def _forget_marks(self) -> None:
        """Room in ``parked`` (4x ``PARKED_ALL`` ids): the oldest id that holds given-up marks only goes. Live opens
        are at most ``PARKED_ALL`` ids, so there is one; marks that one connection made by the thousand (an Open and
        a Release of each) can then never refuse another connection's Open. That push, if it begins, is not told
        of the releases: it waits for readers until its committed TTL."""
        rid = next(rid for rid, ws in self.parked.items() if all(w[3] for w in ws))
        del self.parked[rid]
        self.counters.add("parked_marks_forgotten")

    def _unparked(self, waiters: list) -> list:
        """``waiters`` (parked opens) leave the parked: their connections' counts of live ones go down."""
        for who, _, _, given_up in waiters:
            if not given_up:
                left = self._parked_by[who] - 1
                if left:
                    self._parked_by[who] = left
                else:
                    del self._parked_by[who]
        return waiters

    def _claim(self, ident: bytes, msg: Claim, now: int, out: list) -> ClaimOk:
        """A committed request made of the held leading chunks: opened and released like a pushed one."""
        rid = msg.req_id
        r = self.reqs.get(rid)
        if r is not None:
            if not r.claimed:
                raise DuplicateRequest(f"request {rid!r} already exists (pushed)", req_id=rid)
            if list(msg.chunk_keys[:r.chunks]) != r.keys:  # another prompt's: its open would get these pages
                raise DuplicateRequest(f"request {rid!r} already exists, claimed for another prompt", req_id=rid)
            return ClaimOk(req_id=rid, chunks=r.chunks)  # (the same claim again: a retry's)
        self._refuse_withdrawn(rid)
        if rid in self.finished:
            raise UnknownRequest(f"request {rid!r} is gone: {self.finished[rid]}", req_id=rid)
        if self.draining:
            raise ShuttingDown("receiver is draining", req_id=rid)
        if len(msg.chunk_keys) > self.limits.max_chunks_per_request:
            raise RequestTooLarge(f"{len(msg.chunk_keys)} chunks exceeds the cap of "
                                  f"{self.limits.max_chunks_per_request}", req_id=rid)
        held, keys, last = self._claimable(msg) if not self.layout.state_layers else (0, [], 0)
        if held == 0:  # (a state is never held: a model with state layers has nothing to claim)
            return ClaimOk(req_id=rid, chunks=0)
        if self._claims_by.get(ident, 0) >= CLAIMS_PER_READER:
            raise RequestTooLarge(f"this connection holds {CLAIMS_PER_READER} claims: read or release some first",
                                  req_id=rid)
        if sum(self._claims_by.values()) >= CLAIMS_ALL:
            raise RequestTooLarge(f"the receiver holds {CLAIMS_ALL} claims: read or release some first", req_id=rid)
        alloc = self.pool.allocate(rid, keys)  # every item held: pinned, no new page
        self.pool.commit(rid)
        r = RxRequest(rid, b"", alloc, self._new_lease(), now, last, now, state=ReqState.COMMITTED,
                      committed_at_ms=now, layers_done=set(range(self.layout.layers)),
                      ttl_ms=min(msg.lease_ms, self.limits.lease_ms), claimed=True, chunks=held, claimant=ident)
        r.plan = RequestPlan(self.layout, tokens_of(self.layout, held, last), range(len(keys)))
        r.keys = list(msg.chunk_keys[:held])  # what it claimed: a Claim of the id again must name them
        self.reqs[rid] = r
        self._claims_by[ident] = self._claims_by.get(ident, 0) + 1
        self._due(now + r.ttl_ms)
        self._answer_parked(r, out)  # opens that came before the claim: answered as a push's would be
        self.counters.add("requests_claimed")
        self.counters.add("chunks_claimed", held)
        out.append(Log(logging.DEBUG, f"claimed {held} held chunks of {len(msg.chunk_keys)}", rid))
        return ClaimOk(req_id=rid, chunks=held)

    def _claimable(self, msg: Claim) -> tuple[int, list[bytes], int]:
        """The longest leading run of the claim's chunks whose every item is held (with sliding windows,
        the window's items of that shorter prompt too): (chunks, item keys, last chunk's tokens)."""
        lay, keys = self.layout, msg.chunk_keys
        held = self.pool.held_prefix(keys)
        for h in range(held, max(0, held - 64), -1):  # a window's items are few: a short search
            last = min(msg.last_chunk_tokens, lay.chunk_tokens) if h == len(keys) else lay.chunk_tokens
            items = lay.item_keys(keys[:h], tokens_of(lay, h, last))
            if self.pool.held_prefix(items) == len(items):
                return h, items, last
        return 0, [], 0

    def _committed(self, req_id: str | None) -> bool:
        r = self.reqs.get(req_id) if req_id else None
        return r is not None and r.state is ReqState.COMMITTED

    def _request_prefix(self, req_id: str | None, keys: list[bytes]) -> int:
        """How many leading ``keys`` the live request ``req_id`` carries (0 if it is not here)."""
        r = self.reqs.get(req_id) if req_id else None
        if r is None:
            return 0
        n = 0
        for a, b in zip(r.keys or r.alloc.keys, keys, strict=False):
            if a != b:
                break
            n += 1
        return n

    def _open_ok(self, ident: bytes, r: RxRequest) -> ToDecode:
        r.readers += 1
        r.opens[ident] = r.opens.get(ident, 0) + 1
        r.watchers.add(ident)
        i = self.info
        return ToDecode(ident, OpenOk(req_id=r.req_id, shmid=i.shmid, pool_base=i.base, pool_pages=i.pages,
                                      layout=self.spec, pages=r.alloc.pages, new_idx=r.alloc.new_idx,
                                      chunks=r.chunks, state_slot=r.state_slot, state_slots=i.state_slots,
                                      lease_id=r.lease_id, ready_in_pool=not self.limits.verify_checksums,
                                      last_chunk_tokens=r.last_chunk_tokens,
                                      layers_ready=sorted(r.layers_done), committed=r.state is ReqState.COMMITTED,
                                      completion="words" if r.words else "commit",
                                      daemon_id=i.daemon_id, pool_shards=i.shards,
                                      last_key=r.keys[-1] if r.keys else b""))  # a push's, or a claim's last

    # ---- state -------------------------------------------------------------------------
    def stats(self) -> dict:
        p = self.pool
        live = sum(1 for r in self.reqs.values() if r.state in _LIVE)
        return {"pool_pages_total": p.num_pages, "pool_pages_free": p.free_pages,
                "pool_pages_quarantined": p.quarantined_pages, "pool_pages_unfenced": p.unfenced_pages,
                "pool_pages_read_held": p.read_held_pages,
                "chunks_cached": p.chunks_cached,
                "chunks_hit": p.counters["chunks_hit"], "leases_active": live, "requests_inflight": live,
                "draining": self.draining, "index_subscribers": len(self.feed.subscribers),
                "index_seq": self.feed.seq, **self._state_stats(), **self.counters.values}

    def _state_stats(self) -> dict:
        sp = self.state_pool
        if sp is None:
            return {}
        return {"state_slots_total": sp.num_pages, "state_slots_free": sp.free_pages,
                "state_slots_quarantined": sp.quarantined_pages}

    def check(self) -> None:
        """Invariants: the pool's accounting, and one pool record per live request and no other."""
        self.pool.check()
        if self.state_pool is not None:
            self.state_pool.check()
            assert set(self.state_pool.requests) == {r.req_id for r in self.reqs.values() if r.state_slot >= 0}
        assert set(self.pool.requests) == set(self.reqs), "pool and session disagree on requests"
        tombs = [t for ts in self.tombs.values() for t in ts]
        assert sorted(t.holds[0] for t in tombs) == sorted(self.pool.read_holds), "tombs and pool holds disagree"
        assert sorted(t.holds[1] for t in tombs if t.holds[1] is not None) == sorted(
            self.state_pool.read_holds if self.state_pool is not None else []), "tombs and state holds disagree"
        assert all(t.readers and all(n > 0 for n in t.readers.values()) for t in tombs), "a tomb nobody reads"
        assert all(t.fenced or t.req_id in self.unfenced for t in tombs), "an unfenced tomb nobody will fence"
        assert not any(rid in self.reqs for rid in self.withdrawn), "a withdrawn push is live"
        live: dict[bytes, int] = {}
        for ws in self.parked.values():
            for who, _, _, given_up in ws:
                if not given_up:
                    live[who] = live.get(who, 0) + 1
        assert live == self._parked_by, f"parked opens {live} counted as {self._parked_by}"
        claims: dict[bytes, int] = {}
        for r in self.reqs.values():
            if r.claimed:
                claims[r.claimant] = claims.get(r.claimant, 0) + 1
        assert claims == self._claims_by, f"claims {claims} counted as {self._claims_by}"
        for r in self.reqs.values():
            assert r.alloc is self.pool.requests[r.req_id]
            assert (r.state is ReqState.COMMITTED) == r.alloc.indexed
