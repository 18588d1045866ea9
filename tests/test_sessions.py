"""The sans-I/O sessions, driven directly: no sockets, no threads, a clock the test moves.

``Wire`` joins a SenderSession and a ReceiverSession the way h11's ConnectionPair
does: actions out of one become events into the other, and posted puts (a model of
the native per-layer path, tests/fake_pusher.py) are completed (or failed, or
stalled) by the test.
"""

from __future__ import annotations

import itertools
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdpush import protocol
from pdpush.errors import ErrorCode, PdpushError, RequestTooLarge, TransportTimeout
from pdpush.layout import KVLayout, chunk_keys
from pdpush.plan import RequestPlan
from pdpush.protocol import ReqState, TxState
from pdpush.sessions import Count, Log
from pdpush.sessions.receiver import (
    MAX_FINISHED,
    FenceSender,
    PoolInfo,
    ReceiverLimits,
    ReceiverSession,
    ToDecode,
    ToSender,
)
from pdpush.sessions.sender import (
    Connect,
    FillWords,
    PlanGrants,
    PlanRequest,
    ResetPeer,
    SenderLimits,
    SenderSession,
    StagingInfo,
    ToClient,
    ToPeer,
)
from tests.fake_pusher import FakePusher, Posted

LAY = KVLayout(3, 2, 64, "float16", 16)
SPEC = protocol.LayoutSpec(**LAY.to_dict())
ENG = b"engine"
DEC = b"decoder"


def receiver(pages: int = 16, shards: int = 1, lay: KVLayout = LAY, words_landed=None, **limits) -> ReceiverSession:
    tokens = (bytes([i]) * 32 for i in itertools.count(1))
    info = PoolInfo(1 << 30, pages, 7, b"rkey", (1 << 30) + lay.kv_bytes(pages), "127.0.0.1", 9, "rx-42", shards,
                    state_slots=8 if lay.state_layers else 0)
    return ReceiverSession(lay, pages, ReceiverLimits(**limits), info, new_token=lambda: next(tokens),
                           words_landed=words_landed)


def sender(staging_bytes: int = 64 << 20, **limits) -> SenderSession:
    return SenderSession(SenderLimits(**limits), StagingInfo(1 << 20, 5, staging_bytes, "tx-41"), "tcp://rx-a:1")


def begin(req_id: str, ids: list[int], receiver: str = "", lay: KVLayout = LAY, **tp) -> protocol.Begin:
    return protocol.Begin(req_id=req_id, receiver=receiver, layout=protocol.LayoutSpec(**lay.to_dict()),
                          chunk_keys=chunk_keys(ids, lay), last_chunk_tokens=lay.last_chunk_tokens(len(ids)), **tp)


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def msgs(actions, cls, mcls):
    return [a.msg for a in actions if isinstance(a, cls) and isinstance(a.msg, mcls)]


class Wire:
    """A sender session and receiver sessions (one per endpoint), with a driven clock."""

    def __init__(self, endpoints=("tcp://rx-a:1",), shards: int = 1, lay: KVLayout = LAY, pages: int = 64,
                 rx_words: bool = False, **sender_limits) -> None:
        """``rx_words``: the receivers complete requests by their readiness words (as the daemon's does, reading
        the words the fake pusher's flushes put); else every request needs a Commit."""
        self.now = 0
        self.lay = lay
        self.tx = sender(**sender_limits)
        self.handles: dict[str, int] = {}  # req_id -> its latest handle (the words the receiver reads are its)
        self.rx = {e: receiver(pages=pages, shards=shards, lay=lay, **({"words_landed": self._words,
                                                                       "verify_checksums": False} if rx_words else {}))
                   for e in endpoints}
        self.pusher = FakePusher(self.tx.staging_info.address, self.tx.limits.layer_timeout_ms)
        self.wire: list[str] = []  # every control message between the daemons, as "out:type" / "in:type"
        self.words: list[FillWords] = []  # staging words the sender wrote (grant tables, readiness sources)
        self.grants: list[PlanGrants] = []  # staging blocks granted (the native path's and the grant tables' words)
        self.to_client: list = []
        self.by_client: list = []  # (engine identity, message)
        self.to_decoder: list = []
        self.partitioned: set[str] = set()
        self.rx_offset = 0  # the receivers' host's monotonic clock minus the sender's (hosts booted apart)
        self.unsettled: list[ToPeer] = []  # Aborts whose puts were in flight: settled ones follow (sender.py)

    @property
    def rx_now(self) -> int:
        return self.now + self.rx_offset

    def run(self, actions) -> None:
        todo = list(actions)
        while todo:
            a = todo.pop(0)
            if isinstance(a, ToPeer) and a.handle:  # as the shell does: settled now, or once its puts are
                if self.pusher.settled(a.handle, a.endpoint):
                    a = ToPeer(a.endpoint, a.msg.model_copy(update={"settled": True}))
                else:
                    self.unsettled.append(a)
                    a = ToPeer(a.endpoint, a.msg)
            if isinstance(a, ToPeer) and a.endpoint not in self.partitioned:
                self.wire.append(f"out:{a.msg.type}")
                for b in self.rx[a.endpoint].on_control(b"tx", a.msg, self.rx_now):
                    if isinstance(b, ToSender):
                        self.wire.append(f"in:{b.msg.type}")
                        todo.extend(self.tx.on_peer(a.endpoint, b.msg, self.now))
                    elif isinstance(b, ToDecode):
                        self.to_decoder.append(b.msg)
            elif isinstance(a, Connect):
                todo.extend(self.tx.on_connected(a.endpoint, None, self.now))
            elif (refused := self.pusher.apply(a, self.now)) is not None:
                if isinstance(a, PlanGrants):
                    self.grants.append(a)
                if isinstance(a, PlanRequest):
                    self.handles[self.tx._by_seq[a.handle].req_id] = a.handle
                if refused:
                    todo.extend(self.tx.on_refused(a.ident, [x for x in refused], self.now))
                if landed := self.pusher.take_landed():
                    todo.extend(self.tx.on_landed(landed, self.now))
            elif isinstance(a, FillWords):
                self.words.append(a)
            elif isinstance(a, ToClient):
                self.to_client.append(a.msg)
                self.by_client.append((a.ident, a.msg))

    def engine(self, msg, ident: bytes = ENG) -> None:
        self.run(self.tx.on_ingress(ident, msg, self.now))

    @property
    def posted(self) -> list[Posted]:
        """Puts posted and not completed."""
        return self.pusher.posted

    @posted.setter
    def posted(self, value: list[Posted]) -> None:
        self.pusher.posted = value

    def flushed(self, p: Posted) -> list:
        """``p``'s flush completed: the session's actions for the layers it lands (not yet run)."""
        landed = self.pusher.land(p, self.now)
        return self.tx.on_landed(landed, self.now, words=self.pusher.take_words())

    def _words(self, r) -> bool:
        """A receiver's ``words_landed``: every layer with new pages has its readiness words in."""
        h = self.handles.get(r.req_id)
        return all((h, layer) in self.pusher.words_in for layer in range(self.lay.layers) if r.plan.of(layer).n_new)

    def complete(self, endpoint: str | None = None) -> None:
        """Flushes complete for every posted batch (of one endpoint)."""
        keep = []
        while self.posted:
            p = self.posted.pop(0)
            if endpoint is None or p.endpoint == endpoint:
                self.run(self.flushed(p))
            else:
                keep.append(p)
        self.posted = keep + self.posted
        self.settle()

    def settle(self) -> None:
        """Settled Aborts for aborted requests none of whose puts is in flight any more."""
        done = [a for a in self.unsettled if self.pusher.settled(a.handle, a.endpoint)]
        self.unsettled = [a for a in self.unsettled if a not in done]
        self.run([ToPeer(a.endpoint, a.msg.model_copy(update={"settled": True})) for a in done])

    def fail(self, endpoint: str, err, now: int | None = None) -> list:
        """``endpoint``'s puts failed (or timed out): its batches go, and the session's actions (run)."""
        self.posted = [p for p in self.posted if p.endpoint != endpoint]
        actions = self.tx.on_peer_lost(endpoint, str(err), self.now if now is None else now, err)
        self.run(actions)
        return actions

    def records(self, ident: bytes, records: list[tuple[int, int, int]]) -> None:
        """Records from ``ident``'s ring, taken by the native path, in order; a finish record is (handle, 0, 0)
        (ring.decode), which the shell hands to the session after the layers' records before it."""
        for i, rec in enumerate(records):
            if rec[2] == 0:
                self.records(ident, records[:i])
                self.run(self.tx.on_ring_finish(ident, [rec[0]], self.now))
                self.records(ident, records[i + 1:])
                return
        refused = self.pusher.hand_all(ident, records, self.now)
        self.run(self.tx.on_refused(ident, refused, self.now) if refused else [])
        if landed := self.pusher.take_landed():
            self.run(self.tx.on_landed(landed, self.now))

    def tick(self, dt: int) -> None:
        self.now += dt
        self.run(self.tx.on_tick(self.now))
        for r in self.rx.values():
            for b in r.on_tick(self.rx_now):
                if isinstance(b, ToDecode):
                    self.to_decoder.append(b.msg)

    def push(self, req_id: str, ids: list[int], receiver: str = "") -> None:
        self.engine(begin(req_id, ids, receiver, self.lay))
        for layer in range(self.lay.push_layers):
            self.engine(protocol.LayerReady(req_id=req_id, layers=[layer]))
        self.engine(protocol.Finish(req_id=req_id))

    def outcome(self, req_id: str):
        got = [m for m in self.to_client if getattr(m, "req_id", None) == req_id
               and isinstance(m, (protocol.Done, protocol.Error))]
        return got[-1] if got else None


def test_a_push_commits_only_after_every_flush_and_the_ack():
    w = Wire()
    w.push("r1", list(range(40)))  # 3 chunks, the last partial
    assert len(w.posted) == LAY.layers and w.outcome("r1") is None  # puts posted, nothing announced yet
    assert all(len(p.ops) == 1 and p.token[2] == "data" for p in w.posted)  # one put per layer per page run
    rx = w.rx["tcp://rx-a:1"]
    assert rx.reqs["r1"].layers_done == set()
    data = list(w.posted)
    w.posted = []
    words = []
    for p in data:  # each layer's flush completes: its readiness words follow, into the words area
        w.run(w.flushed(p))
        ready = [q for q in w.posted if q.token[2] == "ready"]
        assert len(ready) == 1 and ready[0].token[:2] == (p.token[0], p.token[1])
        assert ready[0].ops[0].dst >= (1 << 30) + LAY.kv_bytes(64) and ready[0].ops[0].nbytes == 3 * 8
        words += ready
        w.posted = []
    # every byte is in, but not every readiness word: no Commit yet (once committed, the receiver may reuse the
    # pages, and a word of this request landing after would hide the next one's)
    assert "out:commit" not in w.wire and w.outcome("r1") is None
    for p in words[:-1]:
        w.run(w.flushed(p))
    assert "out:commit" not in w.wire
    w.run(w.flushed(words[-1]))
    assert w.wire[-2:] == ["out:commit", "in:commit_ack"]
    done = w.outcome("r1")
    assert isinstance(done, protocol.Done) and done.layers == LAY.layers and done.puts == LAY.layers
    assert rx.reqs["r1"].state is ReqState.COMMITTED and rx.pool.chunks_cached == 3
    rx.check()
    # a second prompt sharing the first two chunks moves only the new one
    w.push("r2", list(range(32)) + list(range(500, 512)))
    w.complete()
    d2 = w.outcome("r2")
    assert d2.chunks_skipped == 2 and d2.bytes_sent == LAY.layers * LAY.page_bytes


def test_a_push_that_completes_on_the_data_path_costs_two_control_messages_and_commits_on_its_words():
    """Completion on the data path: the AllocRequest and its AllocResponse are the request's only control
    messages. The sender is done once every layer's readiness words are flushed; the receiver commits when it
    next looks at the words (a tick, an open, an allocation)."""
    w = Wire(rx_words=True)
    rx = w.rx["tcp://rx-a:1"]
    w.push("r1", list(range(40)))
    data = list(w.posted)
    w.posted = []
    for p in data:  # every layer's bytes land; the words follow
        w.run(w.flushed(p))
    assert w.outcome("r1") is None and w.tx.reqs["r1"].state is TxState.STREAMING  # the words are not in yet
    assert rx.reqs["r1"].state is ReqState.ALLOCATED  # nor in the receiver's pool
    words = list(w.posted)
    w.posted = []
    for p in words[:-1]:
        w.run(w.flushed(p))
    w.tick(1)
    assert w.outcome("r1") is None and rx.reqs["r1"].state is ReqState.ALLOCATED  # one layer's words missing
    w.run(w.flushed(words[-1]))
    done = w.outcome("r1")
    assert isinstance(done, protocol.Done) and done.layers == LAY.layers and done.bytes_sent == 3 * LAY.layers * LAY.page_bytes
    assert w.wire == ["out:hello", "in:hello_ack", "out:alloc", "in:alloc_ok"]  # no Commit, no CommitAck
    assert rx.reqs["r1"].state is ReqState.ALLOCATED and rx.reqs["r1"].words  # the receiver has not looked yet
    w.tick(10)
    assert rx.reqs["r1"].state is ReqState.COMMITTED and rx.pool.chunks_cached == 3
    assert rx.counters.values["requests_committed_by_words"] == 1 and rx.counters.values["layers_received"] == 3
    rx.check()
    # the next request sharing its prefix skips it, with no message more than its allocation
    w.push("r2", list(range(32)) + list(range(500, 512)))
    w.complete()
    assert w.outcome("r2").chunks_skipped == 2 and w.wire[4:] == ["out:alloc", "in:alloc_ok"]


def test_a_words_request_is_committed_not_expired_or_aborted_once_its_words_are_in():
    """The receiver looks at the words before it ends a request any other way: one whose every word is in
    landed whole, so its lease running out, or its sender's Abort, commits it instead."""
    w = Wire(rx_words=True, lease_ms=1000)
    rx = w.rx["tcp://rx-a:1"]
    w.push("r1", list(range(20)))
    w.complete()
    assert isinstance(w.outcome("r1"), protocol.Done)
    assert rx.reqs["r1"].state is ReqState.ALLOCATED  # no tick has looked since its words landed
    out = rx.on_tick(5000)  # the first look is past its lease
    assert rx.reqs["r1"].state is ReqState.COMMITTED and rx.counters.values["leases_expired"] == 0, out
    # an Abort of a words request that landed whole: committed (Ok), not failed
    w.push("r2", list(range(100, 120)))
    w.complete()
    out = rx.on_control(b"tx", protocol.Abort(req_id="r2", reason="late", settled=True), w.now)
    assert msgs(out, ToSender, protocol.Ok) and rx.reqs["r2"].state is ReqState.COMMITTED
    assert rx.counters.values["requests_failed"] == 0
    rx.check()


def test_a_words_request_whose_words_are_not_all_in_expires_and_the_sender_fails_it():
    w = Wire(rx_words=True, lease_ms=1000)
    rx = w.rx["tcp://rx-a:1"]
    w.push("r1", list(range(20)))
    data = list(w.posted)
    w.posted = []
    for p in data[:-1]:
        w.run(w.flushed(p))
    w.complete()  # every words batch but the missing layer's
    assert w.outcome("r1") is None
    w.tick(2000)  # the sender's lease deadline, then the receiver's lease
    assert w.outcome("r1").code is ErrorCode.TIMEOUT
    assert "r1" not in rx.reqs and rx.counters.values["requests_committed"] == 0
    rx.check()


def test_a_words_request_whose_bytes_all_landed_but_whose_words_are_late_asks_the_receiver_by_commit():
    """Every layer's bytes flushed, the words not heard by the sender's lease deadline: it does not fail a request
    the receiver may hold whole; it asks with a Commit, as before protocol 6, and the CommitAck is its delivery."""
    w = Wire(rx_words=True, lease_ms=1000)
    w.push("r1", list(range(20)))
    data = list(w.posted)
    w.posted = []
    for p in data:
        w.run(w.flushed(p))
    w.posted = []  # the words' batches never complete (a slow link)
    assert w.outcome("r1") is None and "out:commit" not in w.wire
    w.tick(901)  # past 0.9 of the lease
    assert "out:commit" in w.wire and "in:commit_ack" in w.wire
    assert isinstance(w.outcome("r1"), protocol.Done)
    assert w.rx["tcp://rx-a:1"].reqs["r1"].state is ReqState.COMMITTED


@pytest.mark.parametrize("why", ["checksums", "held", "asked_commit"])
def test_requests_the_words_cannot_complete_still_commit_by_message(why):
    """Checksums (verified after the bytes), a request with nothing new to move (no words to put) and a
    sender that asks for a Commit all complete by Commit and CommitAck."""
    w = Wire(rx_words=True, **({"words": False} if why == "asked_commit" else {}))
    rx = w.rx["tcp://rx-a:1"]
    if why == "checksums":
        rx.limits = ReceiverLimits(verify_checksums=True)
    if why == "held":
        w.push("r0", list(range(32)))
        w.complete()
        w.tick(10)
        w.wire = []
    w.push("r1", list(range(32)))
    w.complete()
    done = w.outcome("r1")
    assert isinstance(done, protocol.Done)
    assert "out:commit" in w.wire and "in:commit_ack" in w.wire
    assert rx.reqs["r1"].state is ReqState.COMMITTED and not rx.reqs["r1"].words


@pytest.mark.parametrize("rx_offset", [-86_400_000, 0, 86_400_000])
def test_a_push_with_the_hosts_clocks_a_day_apart_keeps_its_whole_lease(rx_offset):
    """The receiver's host booted a day later (or earlier) than the sender's: the lease crosses the wire
    as a duration, so the engine still has the lease's time to hand its layers over, 50 ms apart."""
    w = Wire(lease_ms=30_000)
    w.now = 90_000_000
    w.rx_offset = rx_offset
    w.engine(begin("r", list(range(40))))
    r = w.tx.reqs["r"]
    assert r.state is TxState.STREAMING and r.deadline_ms == r.t_alloc_ms + 27_000  # 0.9 of the lease, our clock
    for layer in range(LAY.layers):
        w.tick(50)  # a layer's compute
        w.engine(protocol.LayerReady(req_id="r", layers=[layer]))
        w.complete()
    w.engine(protocol.Finish(req_id="r"))
    w.complete()
    assert isinstance(w.outcome("r"), protocol.Done), w.outcome("r")


def test_the_commit_goes_out_once_every_flush_completes_in_any_order_and_no_notice_per_layer_before_it():
    w = Wire()
    w.engine(begin("r", list(range(20))))
    for layer in range(LAY.layers):
        w.engine(protocol.LayerReady(req_id="r", layers=[layer]))
    rx = w.rx["tcp://rx-a:1"]
    last = w.posted.pop()
    out = w.flushed(last)
    assert not msgs(out, ToPeer, protocol.Msg)  # without checksums, a landed layer costs no control message
    w.run(out)
    assert rx.reqs["r"].layers_done == set() and w.tx.reqs["r"].layers_done == {LAY.layers - 1}
    w.engine(protocol.Finish(req_id="r"))
    assert w.outcome("r") is None  # two layers still in flight: no commit yet
    w.complete()
    assert isinstance(w.outcome("r"), protocol.Done)
    assert rx.counters.values["layers_received"] == LAY.layers  # the Commit said so for all of them


def test_checksums_ride_a_layer_done_per_pass_and_the_commit_checks_every_layer_is_in():
    w = Wire()
    w.engine(begin("r", list(range(20))))
    for layer in range(LAY.layers):
        w.engine(protocol.LayerReady(req_id="r", layers=[layer]))
    p = w.posted.pop()
    landed = w.pusher.land(p, w.now)
    out = w.tx.on_landed(landed, w.now, [7] * len(landed))
    notices = msgs(out, ToPeer, protocol.LayerDone)
    assert len(notices) == 1 and notices[0].checksums == [7] * len(landed)
    rx = w.rx["tcp://rx-a:1"]  # a Commit that claims fewer layers than the model has is refused, typed
    err = msgs(rx.on_control(b"tx", protocol.Commit(req_id="r", layers=LAY.layers - 1), 0), ToSender, protocol.Error)
    assert err and err[0].code is ErrorCode.UNEXPECTED and "layers" in err[0].message


def test_a_reader_waiting_on_the_receiver_hears_of_every_layer_at_the_commit_or_of_checksummed_ones_at_once():
    """No LayerDone crosses the wire without a checksum: a reader that waits on the receiver's notices (not the
    words) hears of every layer, and the commit, from the Commit; with checksums, of each verified layer at once."""
    for checksums in (False, True):
        w = Wire()
        rx = w.rx["tcp://rx-a:1"]
        rx._layer_checksum = (lambda ranges: 9) if checksums else None
        w.engine(begin("r", list(range(20))))
        rx.on_local(DEC, protocol.Open(req_id="r"), 0)
        for layer in range(LAY.layers):
            w.engine(protocol.LayerReady(req_id="r", layers=[layer]))
        first = w.posted.pop(0)
        landed = w.pusher.land(first, w.now)
        w.run(w.tx.on_landed(landed, w.now, [9] * len(landed) if checksums else None))
        heard = [m for m in w.to_decoder if isinstance(m, protocol.LayerAvailable)]
        assert sorted(la for m in heard for la in m.layers) == ([la for _, la in landed] if checksums else [])
        w.engine(protocol.Finish(req_id="r"))
        while w.posted:  # (with checksums on, each layer's comes with it: a receiver that verifies needs them all)
            landed = w.pusher.land(w.posted.pop(0), w.now)
            w.run(w.tx.on_landed(landed, w.now, [9] * len(landed) if checksums else None, w.pusher.take_words()))
        w.settle()
        assert isinstance(w.outcome("r"), protocol.Done)
        heard = [m for m in w.to_decoder if isinstance(m, protocol.LayerAvailable)]
        assert sorted(la for m in heard for la in m.layers) == list(range(LAY.layers))  # each layer once
        assert isinstance(w.to_decoder[-1], protocol.Committed)


def test_a_stalled_receiver_holds_only_its_own_requests():
    a, b = "tcp://rx-a:1", "tcp://rx-b:1"
    w = Wire((a, b), layer_timeout_ms=500)
    w.push("warm-a", list(range(20)), a)
    w.push("warm-b", list(range(20)), b)
    w.complete()
    w.engine(begin("on-a", list(range(100, 150)), a))
    w.engine(protocol.LayerReady(req_id="on-a", layers=[0]))  # posted; receiver a now stalls
    for i in range(5):  # b keeps moving requests while a's batch is in flight
        w.tick(50)
        w.push(f"on-b-{i}", list(range(1000 * i, 1000 * i + 40)), b)
        w.complete(b)
        assert isinstance(w.outcome(f"on-b-{i}"), protocol.Done)
    assert w.outcome("on-a") is None
    # a's batch times out at its own deadline (the transport reports it): only a's requests fail
    stalled = [p for p in w.posted if p.endpoint == a]
    assert stalled and all(p.deadline_ms == 500 for p in stalled)
    w.posted = []
    actions = w.fail(a, TransportTimeout("flush did not complete"), 600)
    err = w.outcome("on-a")
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.TIMEOUT
    assert of(actions, ResetPeer) == [ResetPeer(a)]
    w.push("after", list(range(7000, 7040)), b)
    w.complete()
    assert isinstance(w.outcome("after"), protocol.Done)


def test_control_deadlines_come_from_the_driven_clock():
    w = Wire(control_timeout_ms=100)
    w.partitioned.add("tcp://rx-a:1")
    w.engine(begin("r", list(range(20))))
    w.tick(100)
    assert w.outcome("r") is None  # at the deadline, not past it
    w.tick(1)
    err = w.outcome("r")
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.TIMEOUT
    assert not w.tx.reqs


def _held_answers(w: Wire, rx, msg) -> list:
    """``msg`` (an engine's) goes to the sender; its AllocRequest reaches receiver ``rx``, whose answers are held
    (returned, not delivered): a test delivers them late."""
    out = w.tx.on_ingress(ENG, msg, w.now)
    asks = [a for a in out if isinstance(a, ToPeer) and isinstance(a.msg, protocol.AllocRequest)]
    w.run([a for a in out if a not in asks])
    return [b.msg for a in asks for b in rx.on_control(b"tx", a.msg, w.rx_now) if isinstance(b, ToSender)]


def test_a_late_answer_to_an_earlier_attempt_is_never_taken_for_a_retrys():
    """Attempt 1's AllocResponse comes too late (the sender has failed it, and its Abort ended the allocation at the
    receiver), behind the engine's retry of the id: it names attempt 1, so the retry waits for its own answer and
    puts into its own pages; taken for the retry's, the retry's puts went to attempt 1's pages, which the receiver
    had freed for other requests, and the receiver's allocation of the retry was aborted as settled."""
    e = "tcp://rx-a:1"
    w = Wire(control_timeout_ms=100)
    w.push("warm", list(range(100, 120)))  # the peer is up
    w.complete()
    rx = w.rx[e]
    late = _held_answers(w, rx, begin("x", list(range(20))))
    w.tick(101)  # no answer in time: attempt 1 fails; its Abort (settled: nothing was put) reaches the receiver
    assert isinstance(w.outcome("x"), protocol.Error) and "x" not in rx.reqs
    # an Abort of an id the receiver does not hold (another, late) is answered Ok: an error would be taken for the
    # answer to a retry of the id begun meanwhile, and fail it
    again = rx.on_control(b"tx", protocol.Abort(req_id="x", reason="sender no longer wants it", settled=True), w.now)
    assert [type(a.msg) for a in again if isinstance(a, ToSender)] == [protocol.Ok]
    first_pages = late[0].page_runs
    own = _held_answers(w, rx, begin("x", list(range(20))))  # the engine retries the id
    assert own[0].page_runs != first_pages and own[0].attempt != late[0].attempt
    w.wire.clear()
    w.run(w.tx.on_peer(e, late[0], w.now))  # attempt 1's answer, late
    assert w.tx.reqs["x"].state is TxState.ALLOCATING and w.wire == []  # dropped: no Abort naming x went out
    assert w.tx.counters.values["stale_replies"] == 1 and rx.reqs["x"].state is protocol.ReqState.ALLOCATED
    w.run(w.tx.on_peer(e, own[0], w.now))
    r = w.tx.reqs["x"]
    assert r.state is TxState.STREAMING and [(p, n) for _, p, n in r.plan.groups[0].page_runs] == own[0].page_runs
    w.run(w.tx.on_peer(e, own[0], w.now))  # a receiver's duplicate: no settled Abort while the puts may be in flight
    assert r.state is TxState.STREAMING and w.wire == [] and rx.reqs["x"].state is protocol.ReqState.ALLOCATED
    for layer in range(LAY.push_layers):
        w.engine(protocol.LayerReady(req_id="x", layers=[layer]))
    w.engine(protocol.Finish(req_id="x"))
    w.complete()
    assert isinstance(w.outcome("x"), protocol.Done) and rx.reqs["x"].state is protocol.ReqState.COMMITTED


def test_a_late_error_for_an_earlier_attempt_never_fails_the_retry_that_allocates():
    """Attempt 1's AllocRequest is refused (the receiver drains), but the refusal comes after the sender gave up on
    it and the engine's retry of the id has asked for its own allocation. The Error names attempt 1 (protocol 8):
    the retry drops it and takes its own answer. Before, an Error named no attempt and failed the retry at once."""
    e = "tcp://rx-a:1"
    w = Wire(control_timeout_ms=100)
    w.push("warm", list(range(100, 120)))
    w.complete()
    rx = w.rx[e]
    rx.draining = True
    late = _held_answers(w, rx, begin("x", list(range(20))))
    assert isinstance(late[0], protocol.Error) and late[0].code is ErrorCode.SHUTTING_DOWN and late[0].attempt >= 1
    w.tick(101)  # no answer in time: attempt 1 fails
    assert isinstance(w.outcome("x"), protocol.Error)
    rx.draining = False
    own = _held_answers(w, rx, begin("x", list(range(20))))  # the engine retries the id
    assert isinstance(own[0], protocol.AllocResponse) and own[0].attempt != late[0].attempt
    w.wire.clear()
    w.run(w.tx.on_peer(e, late[0], w.now))  # attempt 1's refusal, late
    assert w.tx.reqs["x"].state is TxState.ALLOCATING and w.tx.counters.values["stale_replies"] == 1
    # an error that names no attempt answers no allocation (an earlier attempt's Commit, late): dropped too
    w.run(w.tx.on_peer(e, protocol.Error(code=ErrorCode.UNKNOWN_REQUEST, message="late", req_id="x"), w.now))
    assert w.tx.reqs["x"].state is TxState.ALLOCATING and w.tx.counters.values["stale_replies"] == 2
    w.run(w.tx.on_peer(e, own[0], w.now))
    assert w.tx.reqs["x"].state is TxState.STREAMING
    for layer in range(LAY.push_layers):
        w.engine(protocol.LayerReady(req_id="x", layers=[layer]))
    w.engine(protocol.Finish(req_id="x"))
    w.complete()
    assert isinstance(w.outcome("x"), protocol.Done) and rx.reqs["x"].state is protocol.ReqState.COMMITTED


def test_an_error_naming_the_allocating_attempt_ends_it():
    """The receiver's refusal of this attempt's AllocRequest names it, and fails the request, typed."""
    e = "tcp://rx-a:1"
    w = Wire()
    w.push("warm", list(range(100, 120)))
    w.complete()
    w.rx[e].draining = True
    w.engine(begin("x", list(range(20))))
    w.complete()
    err = w.outcome("x")
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.SHUTTING_DOWN and "x" not in w.tx.reqs


def test_a_receiver_that_has_no_session_for_the_connection_gets_a_hello_again():
    """The receiver forgot the sender's session (past MAX_SESSIONS), or ZeroMQ made the connection again after it
    broke, which the receiver knows by another routing id: every request then got "alloc before hello", for good
    (the sender took the peer for up). NoSession fails the request at hand and resets the peer: the next one says
    Hello and is served."""
    e = "tcp://rx-a:1"
    w = Wire()
    w.push("a", list(range(20)))
    w.complete()
    rx = w.rx[e]
    rx.sessions.clear()
    w.wire.clear()
    actions = w.tx.on_ingress(ENG, begin("b", list(range(100, 120))), w.now)
    w.run(actions)
    err = w.outcome("b")
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.PEER_DEAD and "no session" in err.message
    assert w.wire[:2] == ["out:alloc", "in:error"] and w.tx.counters.values["sessions_lost"] == 1
    w.wire.clear()
    w.push("c", list(range(200, 220)))
    w.complete()
    assert isinstance(w.outcome("c"), protocol.Done) and w.wire[:2] == ["out:hello", "in:hello_ack"]


def test_a_receiver_that_did_not_come_up_is_not_tried_again_for_a_moment():
    """A receiver whose hello went unanswered (or was refused, or whose data plane did not open) failed its requests,
    and every request after made a socket, a hello and an endpoint of its own that failed the same way, at the
    engines' request rate. For min(HOLD_MS, control_timeout_ms) they fail at once, typed, with a retry hint; then it
    is tried again. One that was up and was lost (a restart) is tried again at once."""
    e = "tcp://rx-a:1"
    w = Wire(control_timeout_ms=100)
    w.partitioned.add(e)
    w.engine(begin("a", list(range(20))))
    w.tick(101)
    assert w.outcome("a").code is ErrorCode.TIMEOUT
    w.partitioned.discard(e)
    w.wire.clear()
    w.tick(50)
    w.engine(begin("b", list(range(100, 120))))
    err = w.outcome("b")
    assert err.code is ErrorCode.TIMEOUT and "tried again" in err.message and 0 < err.retry_after_ms <= 50
    assert w.wire == [] and "b" not in w.tx.reqs  # no hello went out for it
    w.tick(50)
    w.push("c", list(range(200, 220)))
    w.complete()
    assert isinstance(w.outcome("c"), protocol.Done) and w.wire[:2] == ["out:hello", "in:hello_ack"]
    w.run(w.tx.on_peer_lost(e, "receiver restarted", w.now))  # up, then lost: the next request tries at once
    w.push("d", list(range(300, 320)))
    w.complete()
    assert isinstance(w.outcome("d"), protocol.Done)


def test_a_receiver_coming_up_sends_only_its_own_waiting_requests_not_a_later_one_under_an_ended_ones_id():
    """A request for receiver A ends while A's hello is under way; another under the same id begins for B. A's data
    plane coming up must not send B's request on: before, it went to B before B was up, checked against A's
    layout, and with A's geometry its puts could reach pages B never granted."""
    a, b = "tcp://rx-a:1", "tcp://rx-b:1"
    tx = sender()
    assert any(isinstance(x, ToPeer) and x.endpoint == a for x in tx.on_ingress(ENG, begin("x", list(range(20)), a), 0))
    tx.on_ingress(ENG, protocol.Abort(req_id="x", reason="engine gave up"), 1)
    tx.on_ingress(ENG, begin("x", list(range(20)), b), 2)
    ack = msgs(receiver().on_control(b"tx", protocol.Hello(version=protocol.PROTOCOL_VERSION,
                                                           fingerprint=LAY.fingerprint(), layout=SPEC), 3),
               ToSender, protocol.HelloAck)[0]
    tx.on_peer(a, ack, 3)
    out = tx.on_connected(a, None, 4)
    assert not any(isinstance(x, ToPeer) and isinstance(x.msg, protocol.AllocRequest) for x in out)
    assert tx.reqs["x"].state is TxState.WAIT_PEER and tx.reqs["x"].peer.endpoint == b


def test_pool_exhausted_backs_off_then_gives_up_within_its_budget():
    w = Wire(alloc_retry_budget_ms=200)
    w.rx["tcp://rx-a:1"] = receiver(pages=2)
    w.engine(begin("big", list(range(16 * 2))))  # takes the whole pool and keeps it (never finished)
    w.engine(begin("r", list(range(500, 520))))
    assert w.tx.reqs["r"].state is TxState.ALLOC_BACKOFF
    for _ in range(10):
        w.tick(50)
    err = w.outcome("r")
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.POOL_EXHAUSTED
    assert w.tx.counters.values["alloc_retries"] >= 2


def test_an_error_that_comes_while_a_request_backs_off_answers_nothing_it_asked_and_is_dropped():
    """An Error names no attempt: a late pool_exhausted for an earlier request of the id, coming while its retry
    backs off (or its retry's own, after a late one was taken for it), failed the retry at once."""
    w = Wire()
    w.rx["tcp://rx-a:1"] = receiver(pages=2)
    w.engine(begin("big", list(range(16 * 2))))  # takes the whole pool
    w.engine(begin("r", list(range(500, 520))))
    assert w.tx.reqs["r"].state is TxState.ALLOC_BACKOFF
    stale = protocol.Error(code=ErrorCode.POOL_EXHAUSTED, message="an earlier request's", req_id="r",
                           retry_after_ms=50)
    w.run(w.tx.on_peer("tcp://rx-a:1", stale, w.now))
    assert w.tx.reqs["r"].state is TxState.ALLOC_BACKOFF and w.tx.counters.values["stale_replies"] == 1


def test_receiver_lease_expiry_readers_and_ttl_on_the_driven_clock():
    rx = receiver(lease_ms=100, committed_ttl_ms=1000)
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    assert msgs(rx.on_control(b"s", hello, 0), ToSender, protocol.HelloAck)
    alloc = protocol.AllocRequest(req_id="a", chunk_keys=chunk_keys(list(range(40)), LAY), last_chunk_tokens=8,
                                  lease_ms=5000)
    # a load planned from the prefill's answer: its push began before the answer left, or it never will here
    err = msgs(rx.on_local(DEC + b"x", protocol.Open(req_id="a", exists=True), 0), ToDecode, protocol.Error)
    assert err and err[0].code is ErrorCode.UNKNOWN_REQUEST and "a" not in rx.parked
    assert msgs(rx.on_local(DEC, protocol.Open(req_id="a"), 0), ToDecode, protocol.OpenOk) == []  # parked
    out = rx.on_control(b"s", alloc, 10)
    assert msgs(out, ToSender, protocol.AllocResponse)[0].lease_ms == 100  # lease capped by the receiver, as a duration
    ok = msgs(out, ToDecode, protocol.OpenOk)  # the parked open is answered
    assert ok and ok[0].last_key == chunk_keys(list(range(40)), LAY)[-1]  # what a decode planning unasked checks
    assert rx.on_tick(109) == [] and "a" in rx.reqs
    out = rx.on_tick(110)
    assert msgs(out, ToDecode, protocol.Error)[0].code is ErrorCode.LEASE_EXPIRED
    # the sender did not end it in time: its writes may still come, so its endpoints are closed (fenced) at once
    assert FenceSender(b"s") in out
    # its decode has it open and may be reading it: its pages stay as they are until that open is released
    assert "a" not in rx.reqs and rx.pool.read_held_pages == 3 and rx.pool.quarantined_pages == 0
    rx.check()
    assert msgs(rx.on_local(DEC, protocol.Release(req_id="a", lease_id=ok[0].lease_id), 120), ToDecode,
                protocol.Ok)  # (its client, told)
    assert rx.pool.read_held_pages == 0 and rx.pool.quarantined_pages == 3 and rx.pool.unfenced_pages == 0
    rx.check()
    # committed, read and released: dropped; committed and never read: dropped after its TTL
    def query(rid):  # what a decode scheduler asks of a live push (load_mode: committed or still arriving)
        return msgs(rx.on_local(DEC, protocol.Query(chunk_keys=[], req_id=rid), 200), ToDecode,
                    protocol.QueryReply)[0]

    for rid, base in (("b", 100), ("c", 200)):
        rx.on_control(b"s", alloc.model_copy(update={"req_id": rid, "chunk_keys": chunk_keys(
            list(range(base, base + 16)), LAY)}), 200)
        for layer in range(LAY.layers):
            assert not query(rid).request_committed
            rx.on_control(b"s", protocol.LayerDone(req_id=rid, layers=[layer]), 200)
        assert not query(rid).request_committed  # every layer landed, not committed yet
        assert msgs(rx.on_control(b"s", protocol.Commit(req_id=rid, layers=LAY.layers), 200), ToSender,
                    protocol.CommitAck)
        assert query(rid).request_committed and not query(rid).request_gone
    rx.on_local(DEC, protocol.Open(req_id="b"), 250)
    rx.on_local(DEC, protocol.Release(req_id="b"), 260)
    assert "b" not in rx.reqs and "c" in rx.reqs
    rx.on_tick(1199)
    assert "c" in rx.reqs
    rx.on_tick(1200)
    assert "c" not in rx.reqs
    rx.check()
    reply = msgs(rx.on_local(DEC, protocol.Query(chunk_keys=[], req_id="a"), 1300), ToDecode, protocol.QueryReply)
    assert reply[0].request_gone and not reply[0].request_committed


def test_a_begin_whose_last_chunk_holds_more_than_a_chunk_is_refused_typed_before_any_plan():
    """``last_chunk_tokens`` past the layout's ``chunk_tokens`` (within the wire's bound): the sender refuses the Begin
    as a protocol error at once, rather than building a plan of every token it implies (10**12 of them took its
    memory before the wire bounded it) or asking the receiver, which refuses it a round trip later."""
    w = Wire()
    b = begin("big-last", list(range(40)))
    w.engine(b.model_copy(update={"last_chunk_tokens": LAY.chunk_tokens + 1}))
    err = w.outcome("big-last")
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.BAD_MESSAGE and "exceeds chunk_tokens" in err.message
    assert "big-last" not in w.tx.reqs and w.tx.counters.values["internal_errors"] == 0
    assert "out:alloc" not in w.wire  # refused here, not by the receiver a round trip later
    w.push("fine", list(range(100, 140)))
    w.complete()
    assert isinstance(w.outcome("fine"), protocol.Done)


def test_a_begin_whose_metadata_cannot_fit_is_refused_before_it_is_planned(monkeypatch):
    """A request's metadata in staging (8 bytes per layer and per item) is counted before its plan is built: a plan
    holds every item of every group, and an engine's layout of 4,096 sliding-window groups over a long prompt made the
    sender plan for minutes, in gigabytes, before refusing it (a review's probe: 2.6 GB for 16,000 chunks)."""
    planned = []
    init = RequestPlan.__init__
    monkeypatch.setattr(RequestPlan, "__init__", lambda self, *a: planned.append(a) or init(self, *a))
    lay = KVLayout(4096, 1, 8, "float16", 1, windows=tuple((1 << 30) + i for i in range(4096)))
    w = Wire()
    w.engine(begin("wide", list(range(100)), lay=lay))  # 4,096 groups x 100 chunks: 3.3 MB of words, of 2 MiB
    err = w.outcome("wide")
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.TOO_LARGE and "metadata" in err.message, err
    assert not planned and "wide" not in w.tx.reqs
    w.push("fine", list(range(100, 140)))
    w.complete()
    assert isinstance(w.outcome("fine"), protocol.Done) and planned


def _hello(rx: ReceiverSession, ident: bytes) -> None:
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    assert msgs(rx.on_control(ident, hello, 0), ToSender, protocol.HelloAck)


def _alloc(rid: str, ids, lease_ms: int = 5000) -> protocol.AllocRequest:
    return protocol.AllocRequest(req_id=rid, chunk_keys=chunk_keys(list(ids), LAY), last_chunk_tokens=16,
                                 lease_ms=lease_ms)


def test_a_late_commit_of_a_failed_push_is_never_acknowledged_by_an_earlier_push_of_its_id():
    """A push committed, read and dropped is remembered (a late Commit or Abort of it is answered as done). The
    same sender pushes that id again and this push fails (its lease expires): its late Commit gets an error, not
    the CommitAck of the earlier push, which would tell the sender a push that holds no page was delivered."""
    rx = receiver(lease_ms=100)
    _hello(rx, b"s")
    rx.on_control(b"s", _alloc("a", range(16)), 0)
    assert msgs(rx.on_control(b"s", protocol.Commit(req_id="a", layers=LAY.layers), 1), ToSender, protocol.CommitAck)
    rx.on_local(DEC, protocol.Open(req_id="a"), 2)
    rx.on_local(DEC, protocol.Release(req_id="a"), 3)
    assert "a" not in rx.reqs  # read and dropped: a late Commit of it is still acknowledged
    assert msgs(rx.on_control(b"s", protocol.Commit(req_id="a", layers=LAY.layers), 4), ToSender, protocol.CommitAck)
    assert msgs(rx.on_control(b"s", _alloc("a", range(100, 116)), 10), ToSender, protocol.AllocResponse)
    rx.on_tick(200)  # the second push's lease ran out
    assert "a" not in rx.reqs
    out = rx.on_control(b"s", protocol.Commit(req_id="a", layers=LAY.layers), 201)
    assert not msgs(out, ToSender, protocol.CommitAck) and msgs(out, ToSender, protocol.Error), out
    rx.check()


def test_the_per_sender_inflight_cap_counts_only_the_pages_a_push_takes():
    """``max_inflight_bytes_per_sender`` counts a push's new pages: its chunks the pool holds already take none, so a
    push of a cached prompt goes whatever the cap; one whose new pages would pass it is refused, typed."""
    page_set = LAY.layers * LAY.page_bytes
    rx = receiver(pages=16, max_inflight_bytes_per_sender=4 * page_set)
    _hello(rx, b"s")
    rx.on_control(b"s", _alloc("warm", range(64)), 0)  # 4 chunks, committed, read: held in the index
    rx.on_control(b"s", protocol.Commit(req_id="warm", layers=LAY.layers), 0)
    rx.on_local(DEC, protocol.Open(req_id="warm"), 0)
    rx.on_local(DEC, protocol.Release(req_id="warm"), 0)
    assert rx.pool.chunks_cached == 4
    assert msgs(rx.on_control(b"s", _alloc("live", range(1000, 1016)), 1), ToSender, protocol.AllocResponse)
    ok = msgs(rx.on_control(b"s", _alloc("again", range(64)), 2), ToSender, protocol.AllocResponse)
    assert ok and sorted(ok[0].already_sent_indexes) == [0, 1, 2, 3]  # no new page: within the cap
    err = msgs(rx.on_control(b"s", _alloc("more", range(2000, 2064)), 3), ToSender, protocol.Error)
    assert err and err[0].code is ErrorCode.POOL_EXHAUSTED and "max_inflight_bytes_per_sender" in err[0].message
    rx.check()


@pytest.mark.parametrize("settled", [False, True], ids=["unfenced", "quarantined"])
def test_a_sender_that_aborts_request_after_request_stays_within_its_caps(settled):
    """An Abort ends a lease at once, but not its pages: they wait for the sender's late writes to settle (unfenced,
    up to a lease), then in quarantine. They were counted against nobody, so a sender that allocated and aborted in a
    loop held the whole pool past its caps and another sender was refused. They count against their sender now:
    unsettled ones as leases and pages, quarantined ones as pages; another sender is served."""
    page_set = LAY.layers * LAY.page_bytes
    rx = receiver(pages=16, quarantine_ms=1000, max_leases_per_sender=2, max_inflight_bytes_per_sender=8 * page_set)
    _hello(rx, b"s")
    _hello(rx, b"t")
    refused = None
    for i in range(4):
        out = rx.on_control(b"s", _alloc(f"r{i}", range(1000 * i, 1000 * i + 64)), i)  # 4 new pages
        if (err := msgs(out, ToSender, protocol.Error)):
            refused = (i, err[0])
            break
        rx.on_control(b"s", protocol.Abort(req_id=f"r{i}", settled=settled), i)
    assert refused is not None and refused[1].code is ErrorCode.POOL_EXHAUSTED
    assert refused[0] == 2, refused  # two aborted requests' pages (8) fill its byte cap; unsettled, its lease cap too
    assert ("leases and 2 ended ones" if not settled else "max_inflight_bytes_per_sender") in refused[1].message
    assert msgs(rx.on_control(b"t", _alloc("other", range(9000, 9064)), 3), ToSender, protocol.AllocResponse)
    rx.check()
    if not settled:
        for i in range(2):
            rx.on_control(b"s", protocol.Abort(req_id=f"r{i}", settled=True), 4)  # its writes settled: quarantined
    rx.on_tick(1100)  # out of quarantine: its caps are its own again
    assert msgs(rx.on_control(b"s", _alloc("again", range(5000, 5064)), 1101), ToSender, protocol.AllocResponse)
    rx.check()


def test_one_decode_connections_given_up_opens_never_refuse_anothers_open(monkeypatch):
    """A decode connection that opens and gives up (``PendingOpen.abandon``) push after push leaves a mark of each, so
    that a push beginning later counts its release. Past 4x ``PARKED_ALL`` ids the oldest marks make room: another
    connection's Open still parks (it was refused "too many parked opens" for ``PARKED_OPEN_MS``), and is answered
    when its push begins."""
    import pdpush.sessions.receiver as rxmod

    monkeypatch.setattr(rxmod, "PARKED_ALL", 8)
    rx = receiver()
    for i in range(4 * 8 + 5):
        assert rx.on_local(DEC, protocol.Open(req_id=f"g{i}"), 0) == []  # parked
        rx.on_local(DEC, protocol.Release(req_id=f"g{i}", answer=False), 0)
    assert len(rx.parked) == 4 * 8 and rx.counters.values["parked_marks_forgotten"] == 5
    assert "g0" not in rx.parked and "g36" in rx.parked  # the oldest went
    assert rx.on_local(b"other", protocol.Open(req_id="mine"), 1) == []  # parked, not refused
    monkeypatch.setattr(rxmod, "PARKED_PER_READER", 1)  # an Open refused (its connection at its cap) forgets none
    err = msgs(rx.on_local(b"other", protocol.Open(req_id="mine-2"), 1), ToDecode, protocol.Error)
    assert err and "too many parked opens" in err[0].message and rx.counters.values["parked_marks_forgotten"] == 6
    _hello(rx, b"s")
    out = rx.on_control(b"s", _alloc("mine", range(16)), 2)
    assert [m.req_id for m in msgs(out, ToDecode, protocol.OpenOk)] == ["mine"]
    rx.check()


def test_a_release_sent_without_waiting_is_never_answered_and_a_strangers_changes_nothing():
    """``Release(answer=False)`` (an engine's step releases without waiting): no Ok, and no error either, for it, a
    stranger's or an unknown one; a late answer would be taken as the answer to a later open of the same id."""
    rx = receiver()
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    rx.on_control(b"s", hello, 0)
    alloc = protocol.AllocRequest(req_id="a", chunk_keys=chunk_keys(list(range(40)), LAY), last_chunk_tokens=8,
                                  lease_ms=5000)
    rx.on_control(b"s", alloc, 0)
    assert msgs(rx.on_local(DEC, protocol.Open(req_id="a"), 1), ToDecode, protocol.OpenOk)
    stranger = rx.on_local(DEC + b"x", protocol.Release(req_id="a", answer=False), 2)
    assert of(stranger, ToDecode) == [] and rx.counters.values["releases_refused"] == 1
    assert rx.reqs["a"].opens == {DEC: 1}  # the reader's open, and its pages, stay
    assert of(rx.on_local(DEC, protocol.Release(req_id="nobody", answer=False), 3), ToDecode) == []
    assert of(rx.on_local(DEC, protocol.Release(req_id="a", answer=False), 4), ToDecode) == []
    assert not rx.reqs["a"].opens
    assert msgs(rx.on_local(DEC, protocol.Release(req_id="nobody"), 5), ToDecode, protocol.Ok)  # answered as ever
    rx.check()


def test_an_unexpected_exception_fails_that_request_only_and_the_session_keeps_serving(monkeypatch):
    w = Wire()
    rx = w.rx["tcp://rx-a:1"]
    w.engine(begin("victim", list(range(20))))
    w.engine(begin("bystander", list(range(100, 120))))

    def boom(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(rx, "_layer_checksum", boom)
    out = rx.on_control(b"tx", protocol.LayerDone(req_id="victim", layers=[0], checksums=[1]), 0)
    errs = msgs(out, ToSender, protocol.Error)
    assert errs and errs[0].code is ErrorCode.INTERNAL and errs[0].req_id == "victim"
    assert any(isinstance(a, Log) and "ZeroDivisionError" in (a.exc_text or "") for a in out)
    assert "victim" not in rx.reqs and rx.counters.values["internal_errors"] == 1
    rx.check()
    monkeypatch.undo()
    for layer in range(LAY.layers):
        w.engine(protocol.LayerReady(req_id="bystander", layers=[layer]))
    w.engine(protocol.Finish(req_id="bystander"))
    w.complete()
    assert isinstance(w.outcome("bystander"), protocol.Done)
    # the same on the sender: a bug while handling one engine message fails that request, typed
    monkeypatch.setattr(w.tx, "_layer_ready", lambda *a: 1 / 0)
    w.engine(begin("v2", list(range(300, 320))))
    w.engine(protocol.LayerReady(req_id="v2", layers=[0]))
    err = w.outcome("v2")
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.INTERNAL
    assert "v2" not in w.tx.reqs


def test_an_unexpected_exception_between_an_allocation_and_its_record_loses_no_page(monkeypatch):
    """A bug after the pool allocated a request's pages (or pinned a claim's chunks) and before the session recorded
    it: the pool's record goes too, so no page or pin is lost for the daemon's life and the id is not refused as a
    duplicate after."""
    from pdpush.sessions import receiver as rxmod

    rx = ReceiverSession(LAY, 8, ReceiverLimits(lease_ms=100, quarantine_ms=50, committed_ttl_ms=300),
                         PoolInfo(1 << 30, 8, 1, b"k", 1 << 31, "127.0.0.1", 1, "rx-1"), new_token=lambda: b"t" * 32)
    rx.on_control(b"s", protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC), 0)
    keys = chunk_keys(list(range(48)), LAY)
    alloc = protocol.AllocRequest(req_id="a", chunk_keys=keys, last_chunk_tokens=16, lease_ms=80)
    with monkeypatch.context() as m:
        m.setattr(rxmod, "runs", lambda pages: 1 / 0)
        [err] = msgs(rx.on_control(b"s", alloc, 0), ToSender, protocol.Error)
    assert err.code is ErrorCode.INTERNAL and "a" not in rx.reqs
    rx.check()
    rx.on_tick(60)  # out of quarantine
    assert rx.pool.free_pages == 8
    msgs(rx.on_control(b"s", alloc, 61), ToSender, protocol.AllocResponse)  # the same id again: not a duplicate
    rx.on_control(b"s", protocol.Commit(req_id="a", layers=LAY.layers), 61)
    rx.on_local(DEC, protocol.Open(req_id="a"), 61)
    rx.on_local(DEC, protocol.Release(req_id="a"), 61)
    claim = protocol.Claim(req_id="c", chunk_keys=keys, last_chunk_tokens=16, lease_ms=80)
    with monkeypatch.context() as m:
        m.setattr(rxmod, "RxRequest", lambda *a, **k: 1 / 0)
        [err] = msgs(rx.on_local(DEC, claim, 62), ToDecode, protocol.Error)
    assert err.code is ErrorCode.INTERNAL and "c" not in rx.reqs
    rx.check()
    assert rx.pool.chunks_cached == 3 and msgs(rx.on_local(DEC, claim, 63), ToDecode, protocol.ClaimOk)[0].chunks == 3
    rx.check()


@pytest.mark.parametrize("runs, pool, says", [
    ([(64, 3)], 64, "a pool of 64"), ([(62, 3)], 64, "a pool of 64"), ([(3, 2), (4, 1)], 64, "overlapping"),
    ([(0, (1 << 32) - 1)] * 4, 64, "17179869180 pages for 3"),
    ([(0, (1 << 32) - 1)], (1 << 32) - 1, "4294967295 pages for 3")],  # a pool said to be that large: not listed
    ids=["past", "across", "twice", "huge", "huge-pool"])
def test_an_allocation_of_pages_outside_the_pool_fails_its_request_before_any_put(runs, pool, says):
    """The puts' remote addresses come from the receiver's page runs, and nothing below the session checks them: a
    run past the pool's ``pool_pages`` (64 here), one page twice, or more pages than the request's new items, is the
    receiver's bug, and fails the request with a typed error, the receiver told, before anything is planned or put
    (or listed: a receiver that said its pool was 2^32 pages made the sender list 2^32 of them)."""
    w = Wire()
    rx = w.rx["tcp://rx-a:1"]
    orig = rx.on_control

    def liar(ident, msg, now, *a, **k):
        return [ToSender(b.ident, b.msg.model_copy(update={"page_runs": runs}))
                if isinstance(b, ToSender) and isinstance(b.msg, protocol.AllocResponse) else
                ToSender(b.ident, b.msg.model_copy(update={"pool_pages": pool}))
                if isinstance(b, ToSender) and isinstance(b.msg, protocol.HelloAck) else b
                for b in orig(ident, msg, now, *a, **k)]

    rx.on_control = liar
    w.engine(begin("r", list(range(40))))  # 3 new pages
    err = w.outcome("r")
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.BAD_MESSAGE and says in err.message
    assert not w.handles and not w.posted and "r" not in w.tx.reqs
    assert w.wire[-2:] == ["out:abort", "in:ok"] and "r" not in rx.reqs  # the receiver told: its pages back
    rx.on_control = orig
    w.push("ok", list(range(100, 140)))  # the next request is served
    w.complete()
    assert isinstance(w.outcome("ok"), protocol.Done)


def test_the_shell_grants_to_the_native_path_before_the_engine_sees_the_grant_table():
    """``PlanGrants`` in the sender shell: each block goes to the native path (which refuses a layer not granted),
    then its offset + 1 into that layer's word of the grant table, and no other word changes."""
    import numpy as np

    from pdpush import sender as shell

    staging = np.full(24, 7, dtype=np.uint64)  # the shell's view of staging's words; the table is 8 of them
    table = staging[8:16]
    calls: list = []

    class Native:
        def grant(self, handle, layer, offset):
            calls.append((handle, layer, offset, table.copy()))

    s = shell.Sender.__new__(shell.Sender)
    s.pusher = Native()
    s.region, s._words = types.SimpleNamespace(address=staging.ctypes.data), staging
    s._do(PlanGrants(9, table.ctypes.data, ((1, 4096), (2, 0), (5, 8192))), None)
    assert [c[:3] for c in calls] == [(9, 1, 4096), (9, 2, 0), (9, 5, 8192)]
    assert all((c[3] == 7).all() for c in calls)  # the table only after the native path has every grant
    assert table.tolist() == [7, 4097, 1, 7, 7, 8193, 7, 7]
    s._do(PlanGrants(9, table.ctypes.data, ((6, 12288),)), None)  # one block (a grant an engine asked for)
    assert table.tolist() == [7, 4097, 1, 7, 7, 8193, 12289, 7] and calls[-1][:3] == (9, 6, 12288)
    assert (staging[:8] == 7).all() and (staging[16:] == 7).all()  # no word outside the table


def test_a_receivers_endpoint_dropped_takes_its_unsettled_aborts_with_it():
    """The sender shell: an aborted request's puts in flight on an endpoint that is dropped (a reset, or a
    reconnection, which attaches a new endpoint under the same id in the same pass) are never reported settled: the
    new endpoint, empty, would say so while the old one's writes may still land."""
    from pdpush import sender as shell

    dropped: list = []
    s = shell.Sender.__new__(shell.Sender)
    s.pusher = types.SimpleNamespace(drop_endpoint=dropped.append)
    s._connecting, s._regions, s._populated, s.eps = {}, {}, {}, {}
    s._eids = {"tcp://a:1": 1, "tcp://b:1": 2}
    s._unsettled = [(7, 1, "tcp://a:1", "r1"), (8, 2, "tcp://b:1", "r2"), (9, 1, "tcp://a:1", "r3")]
    s._drop_ep("tcp://a:1")
    assert s._unsettled == [(8, 2, "tcp://b:1", "r2")] and dropped == [1]


def test_a_replaced_endpoints_close_does_not_fail_the_new_connection():
    """The sender shell: a receiver's endpoint failed and its peer was reset in one pass, and a request dialled the
    receiver again before the old endpoint's close was dispatched: that close is the old endpoint's, not the new
    connection's, whose requests it failed (and whose socket it reset)."""
    from pdpush import sender as shell

    lost: list = []
    s = shell.Sender.__new__(shell.Sender)
    s.session = types.SimpleNamespace(on_peer_lost=lambda endpoint, why, now: lost.append(endpoint) or [])
    s._apply = lambda actions: None
    old, new = object(), object()
    s.eps = {"tcp://a:1": new}
    s._ep_closed("tcp://a:1", old)
    assert lost == []
    s._ep_closed("tcp://a:1", new)
    assert lost == ["tcp://a:1"]


def test_a_wire_up_that_raises_anything_ends_that_connection_not_every_pass_after():
    """The sender shell: attaching a wired-up endpoint raises an untyped error (the native path refusing a receiver's
    pool, say). That connection fails, typed, once; it used to stay in ``_connecting``, and every pass raised again
    before serving anything else, with one more close callback on the endpoint each time."""
    import time as _time

    from pdpush import sender as shell
    from pdpush.config import SenderConfig

    s = shell.Sender(SenderConfig())

    class Ep:
        cbs: list = []

        def wired_up(self):
            return True

        def on_close(self, cb):
            self.cbs.append(cb)

        def attach(self, pusher, eid, pool):
            raise ValueError("a receiver's pool is empty or wraps")

        def cancel_wireup(self):
            pass

    outcomes: list = []
    s.session = types.SimpleNamespace(on_connected=lambda endpoint, err, now: outcomes.append((endpoint, err)) or [])
    s._apply = lambda actions: None
    w = shell._Wiring(None, (1 << 30, 1 << 20), _time.monotonic() + 30, types.SimpleNamespace(done=True))
    w.ep = ep = Ep()
    s._connecting["tcp://r:5710"] = w
    s._eid = lambda endpoint: 1
    try:
        for _ in range(3):
            s._connects()
        assert not s._connecting and len(ep.cbs) == 1 and len(outcomes) == 1
        assert isinstance(outcomes[0][1], PdpushError) and "pool is empty or wraps" in str(outcomes[0][1])
    finally:
        closed: list = []
        s.ucx = types.SimpleNamespace(close=lambda: closed.append(True))
        s.close()
    assert closed == [True]  # its UCX worker too: its close-signal pipe and listener (a sender's close left them)


def test_an_action_the_shell_cannot_carry_out_fails_its_request_and_the_rest_of_the_batch_goes(monkeypatch):
    """The sender shell (``Sender._apply``) with a real session and a native path whose grant raises: that
    grant's request fails, typed; the actions after it in the same batch (another engine's reply) still go."""
    from pdpush import sender as shell
    from pdpush.daemon import Outbox, WireCount

    w = Wire()
    w.engine(begin("victim", list(range(20))))
    handle = w.tx.reqs["victim"].seq

    class BrokenGrants:  # the rest of the native path's surface that failing a request uses works
        def grant(self, *a):
            raise RuntimeError("native grant failed")

        def drop_request(self, handle):
            pass

        def settled(self, handle, eid):
            return True

    sent: list = []
    monkeypatch.setattr(shell.control, "send", lambda sock, msg, ident=None: sent.append((ident, msg)) or True)
    s = shell.Sender.__new__(shell.Sender)
    s.session, s.pusher, s.ingress, s.shell_counters = w.tx, BrokenGrants(), None, {"action_errors": 0}
    s.lifelines = type("L", (), {"has": lambda self, ident: False})()  # no lifeline: the reply goes on the ingress
    s.wire = WireCount()
    s.outbox = Outbox(s.wire)
    s.metrics = type("M", (), {"apply": lambda self, a, log: None})()
    s.conns = type("C", (), {"unref_request": lambda self, h: None})()
    s._eids, s.eps, s._unsettled, s._sock = {}, {}, [], lambda endpoint: None
    s._apply([PlanGrants(handle, 0, ((0, 0),)), ToClient(b"other", protocol.Ok())])
    assert (b"other", protocol.Ok()) in sent, sent
    errs = [m for i, m in sent if i == ENG and isinstance(m, protocol.Error)]
    assert errs and errs[0].code is ErrorCode.INTERNAL and errs[0].req_id == "victim", sent
    assert "native grant failed" in errs[0].message and "victim" not in w.tx.reqs
    assert s.shell_counters["action_errors"] == 1 and w.tx.counters.values["internal_errors"] == 1
    assert [t for t, _ in s.outbox.by["tcp://rx-a:1"]] == ["abort"]  # the receiver hears of it at the end of the pass


# ---- fuzzing the sessions directly ---------------------------------------------------------

_IDS = ["a", "b", "c", "d"]
_KEYS = [k for i in range(4) for k in chunk_keys(list(range(i * 50, i * 50 + 48)), LAY)]
_RID = st.sampled_from(_IDS)
_RX_MSG = st.one_of(
    st.just(protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)),
    st.builds(lambda r, ks, c: protocol.AllocRequest(req_id=r, chunk_keys=ks, last_chunk_tokens=16, lease_ms=80,
                                                     completion=c),
              _RID, st.lists(st.sampled_from(_KEYS), min_size=1, max_size=5), st.sampled_from(["commit", "words"])),
    st.builds(lambda r, lay, c: protocol.LayerDone(req_id=r, layers=lay, checksums=None if c is None else [c] * len(lay)),
              _RID, st.lists(st.integers(0, 3), min_size=1, max_size=3), st.none() | st.integers(0, 3)),
    st.builds(lambda r, n: protocol.Commit(req_id=r, layers=n), _RID, st.sampled_from([0, LAY.layers - 1, LAY.layers])),
    st.builds(lambda r, settled: protocol.Abort(req_id=r, settled=settled), _RID, st.booleans()),
    st.builds(lambda r: protocol.Open(req_id=r), _RID),
    st.builds(lambda r: protocol.Open(req_id=r), _RID),  # (twice as likely: failures with readers, read holds)
    st.builds(lambda r, a, lease: protocol.Release(req_id=r, answer=a, lease_id=lease), _RID, st.booleans(),
              st.just(0) | st.integers(1, 12)),  # (the fuzz's lease ids count 1, 2, 3, ...)
    st.builds(lambda ks, r: protocol.Query(chunk_keys=ks, req_id=r), st.lists(st.sampled_from(_KEYS), max_size=3),
              st.none() | _RID),
    st.builds(lambda r, kind: kind(req_id=r), st.sampled_from(["d", "w"]),
              st.sampled_from([protocol.Withdraw, protocol.Unread])),  # (a, b, c: never withdrawn)
    st.builds(lambda r, ks: protocol.Claim(req_id=r, chunk_keys=ks, last_chunk_tokens=16, lease_ms=80),
              st.sampled_from(["d", "w"]), st.sampled_from([_KEYS[i:i + n] for i in range(0, 12, 3) for n in (1, 3)])),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([b"s1", b"s2"]), st.booleans(), _RX_MSG | st.tuples(st.just("words"), _RID)
                          | st.tuples(st.sampled_from(["reader_gone", "sender_lost"]), st.just("")),
                          st.just(0) | st.integers(0, 20) | st.integers(0, 120)), min_size=20, max_size=60),
       st.booleans())
def test_receiver_session_fuzz(steps, verify):
    """Random messages in random order on both endpoints, the readiness words of random requests landing
    whole, and connections ending (a reader's lifeline, a sender's data plane): every reply typed, the
    accounting whole (a failed request's read holds too), and a request that completes by its words committed
    at the next look, never ended another way."""
    words_in: set[tuple[str, int]] = set()  # (req_id, lease id): every readiness word of that request is in
    rx = ReceiverSession(LAY, 12, ReceiverLimits(lease_ms=400, quarantine_ms=50, committed_ttl_ms=300,
                                                 max_leases_per_sender=3, verify_checksums=verify),
                         PoolInfo(1 << 30, 12, 1, b"k", 1 << 31, "127.0.0.1", 1, "rx-1"), new_token=lambda: b"t" * 32,
                         layer_checksum=lambda ranges: 2,
                         words_landed=lambda r: (r.req_id, r.lease_id) in words_in)
    now = 0
    for ident in (b"s1", b"s2"):  # both said hello (the steps may say it again): their allocations get somewhere
        rx.on_control(ident, protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(),
                                            layout=SPEC), now)
    for ident, local, msg, dt in steps:
        now += dt
        if isinstance(msg, tuple) and msg[0] == "reader_gone":
            out = rx.on_reader_gone(ident, now)
            assert not any(ident in t.readers for ts in rx.tombs.values() for t in ts)
        elif isinstance(msg, tuple) and msg[0] == "sender_lost":
            out = rx.on_sender_lost(ident, now)
        elif isinstance(msg, tuple):  # the words of the request under that id land (if it is there)
            if (r := rx.reqs.get(msg[1])) is not None:
                words_in.add((r.req_id, r.lease_id))
            out = []
        else:
            out = rx.on_local(ident, msg, now) if local else rx.on_control(ident, msg, now)
        assert all(isinstance(a.msg, protocol.Msg) for a in out if isinstance(a, (ToSender, ToDecode)))
        assert rx.counters.values["internal_errors"] == 0, [a for a in out if isinstance(a, Log)]
        rx.on_tick(now)
        rx.check()
        assert not (verify and rx.counters.values["requests_committed_by_words"])  # checksums: by Commit only
        for r in rx.reqs.values():  # looked at by the tick: a words request whose words are in is committed
            assert not (r.words and (r.req_id, r.lease_id) in words_in and r.state is not ReqState.COMMITTED)
        assert not any(now >= t.until_ms for ts in rx.tombs.values() for t in ts)  # a read hold is bounded
        for r in rx.reqs.values():  # a tick that skips its scan never misses a deadline that is due
            assert not (r.state in (ReqState.ALLOCATED, ReqState.STREAMING) and now >= r.expires_at_ms)
            assert not (r.state is ReqState.COMMITTED and r.readers == 0 and now >= r.committed_at_ms + 300)


_CLAIM_IDS = st.sampled_from(["c1", "c2"])
_CLAIM_STEP = st.one_of(
    st.builds(lambda r, ks: protocol.Claim(req_id=r, chunk_keys=ks, last_chunk_tokens=16, lease_ms=80), _CLAIM_IDS,
              st.sampled_from([_KEYS[i:i + n] for i in range(0, 6, 3) for n in (1, 2, 3)])),
    st.builds(lambda r: protocol.Open(req_id=r), _CLAIM_IDS),
    st.builds(lambda r, a: protocol.Release(req_id=r, answer=a), _CLAIM_IDS, st.booleans()),
    st.builds(lambda r: protocol.Withdraw(req_id=r), _CLAIM_IDS),
    st.builds(lambda r: protocol.Unread(req_id=r), _CLAIM_IDS),  # (a router's: on the control endpoint)
    st.builds(lambda r, ks: protocol.AllocRequest(req_id=r, chunk_keys=ks, last_chunk_tokens=16, lease_ms=80),
              st.sampled_from(["x", "y"]), st.lists(st.sampled_from(_KEYS[6:]), min_size=1, max_size=4)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([DEC, b"reader"]), _CLAIM_STEP, st.integers(0, 60)), min_size=5,
                max_size=40))
def test_receiver_claims_fuzz(steps):
    """Claims of held chunks, opened, released and withdrawn in random order, beside pushes that need pages: the
    accounting whole (every pin counted), a claim its decode withdraws with no reader gone at once, one with a reader
    kept, and one a router says is unread kept too (a router never names a claim)."""
    rx = ReceiverSession(LAY, 8, ReceiverLimits(lease_ms=100, quarantine_ms=50, committed_ttl_ms=300),
                         PoolInfo(1 << 30, 8, 1, b"k", 1 << 31, "127.0.0.1", 1, "rx-1"), new_token=lambda: b"t" * 32)
    rx.on_control(b"s", protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC), 0)
    for rid, keys in (("p0", _KEYS[0:3]), ("p1", _KEYS[3:6])):  # held, nobody's: claimable
        rx.on_control(b"s", protocol.AllocRequest(req_id=rid, chunk_keys=keys, last_chunk_tokens=16, lease_ms=80), 0)
        rx.on_control(b"s", protocol.Commit(req_id=rid, layers=LAY.layers), 0)
        rx.on_local(DEC, protocol.Open(req_id=rid), 0)
        rx.on_local(DEC, protocol.Release(req_id=rid), 0)
    assert rx.pool.chunks_cached == 6
    now = 0
    for ident, msg, dt in steps:
        now += dt
        if isinstance(msg, protocol.AllocRequest):
            out = rx.on_control(b"s", msg, now)
        elif isinstance(msg, protocol.Unread):
            r = rx.reqs.get(msg.req_id)
            out = rx.on_control(b"router", msg, now)
            assert r is None or r.req_id in rx.reqs
        else:
            r = rx.reqs.get(msg.req_id)
            read = r is not None and r.readers > 0
            out = rx.on_local(ident, msg, now)
            if isinstance(msg, protocol.Withdraw) and r is not None and r.claimed:
                assert (msg.req_id in rx.reqs) == read  # no reader: dropped at once, its chunks unpinned
        assert all(isinstance(a.msg, protocol.Msg) for a in out if isinstance(a, (ToSender, ToDecode)))
        assert rx.counters.values["internal_errors"] == 0, [a for a in out if isinstance(a, Log)]
        rx.on_tick(now)
        rx.check()

_TX_EVENT = st.one_of(
    st.builds(lambda r, n: ("ingress", begin(r, list(range(n)))), _RID, st.integers(1, 60)),
    st.builds(lambda r, lay: ("ingress", protocol.LayerReady(req_id=r, layers=[lay])), _RID, st.integers(0, 3)),
    st.builds(lambda r: ("ingress", protocol.Finish(req_id=r)), _RID),
    st.builds(lambda r: ("ring_finish", r), _RID),  # a finish record in the engine's ring, naming r's last handle
    st.builds(lambda r: ("ingress", protocol.Abort(req_id=r)), _RID),
    st.builds(lambda ok: ("complete", ok), st.booleans()),
    # an error naming no attempt, or one (the sender's handles are small numbers: some name the attempt that asks)
    st.builds(lambda r, c, a: ("peer", protocol.Error(code=c, message="x", req_id=r, attempt=a)), _RID,
              st.sampled_from(ErrorCode), st.integers(0, 12)),
    st.builds(lambda r: ("peer", protocol.CommitAck(req_id=r, chunks_committed=1)), _RID),
    st.just(("lost", None)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_TX_EVENT, st.integers(0, 300)), max_size=50), st.booleans())
def test_sender_session_fuzz(steps, rx_words):
    """Engine messages, completions (of bytes and of readiness words), receiver errors and losses in random
    order, with receivers that complete requests by their words or by Commit: no escaping exception, staging
    never leaks, every request ends with exactly one Done or Error to its engine."""
    w = Wire(control_timeout_ms=200, layer_timeout_ms=100, lease_ms=1000, rx_words=rx_words)
    for (kind, arg), dt in steps:
        w.tick(dt)
        if kind == "ingress":
            w.engine(arg)
        elif kind == "complete" and w.posted:
            p = w.posted.pop(0)
            if arg:
                w.run(w.flushed(p))
            else:
                w.fail(p.endpoint, TransportTimeout("x"))
        elif kind == "peer":
            w.run(w.tx.on_peer("tcp://rx-a:1", arg, w.now))
        elif kind == "lost":
            w.run(w.tx.on_peer_lost("tcp://rx-a:1", "gone", w.now))
        elif kind == "ring_finish":
            handles = [m.handle for m in w.to_client if isinstance(m, protocol.BeginOk) and m.req_id == arg]
            if handles:
                w.records(ENG, [(handles[-1], 0, 0)])
        assert w.tx.counters.values["internal_errors"] == 0
        tx, g = w.tx, w.tx.grants
        held = [a for h in g._held.values() for a, _ in h.blocks]
        rings = tx.rings.stats()["handover_rings"]
        assert len(g.meta.used) == (sum(1 for r in tx.reqs.values() if r.grant.meta_off is not None) + held.count(g.meta)
                                    + rings + 1)  # + the rings' idle word
        assert len(g.layers.used) == sum(len(r.grant.blocks) for r in tx.reqs.values()) + held.count(g.layers)
    w.tick(5000)
    w.tick(1001)  # staging of failed requests unacknowledged by their engine comes back lease_ms after the failure
    g = w.tx.grants
    assert not w.tx.reqs and g.layers.free_bytes == g.layers.size and g.meta.free_bytes + w.tx.rings.meta_bytes == g.meta.size
    ends: dict[str, int] = {}
    for m in w.to_client:
        if isinstance(m, protocol.Done):
            ends[m.req_id] = ends.get(m.req_id, 0) + 1
    assert all(n == 1 for n in ends.values())


def test_every_wire_code_has_one_class_that_round_trips():
    from pdpush import errors

    for code in ErrorCode:
        cls = errors.error_class(code)
        assert cls.code is code
        err = errors.error_from_code(code, "m", "r", 5)
        assert isinstance(err, cls) and err.req_id == "r" and err.retry_after_ms == 5
        assert protocol.error_reply(err).code is code


@pytest.mark.parametrize("bad", [b"", b"\x81\xa4type\xa3zzz"])
def test_an_undecodable_frame_is_counted_and_answered(bad):
    rx = receiver()
    with pytest.raises(protocol.RemoteProtocolError) as e:
        protocol.decode(bad)
    out = rx.bad_frame(b"x", e.value, local=False)
    assert msgs(out, ToSender, protocol.Error)[0].code is ErrorCode.BAD_MESSAGE
    assert rx.counters.values["bad_messages"] == 1


# ---- tensor parallelism: several ranks, one request --------------------------------------------

RANKS = (b"rank0", b"rank1")


def _tp_begin(w: Wire, req_id: str, ids: list[int], ranks=(0, 1)) -> None:
    for r in ranks:
        w.tx.on_lifeline(RANKS[r])
        w.engine(begin(req_id, ids, tp_rank=r, tp_size=2), RANKS[r])


def _for(w: Wire, ident: bytes, cls):
    return [m for i, m in w.by_client if i == ident and isinstance(m, cls)]


def test_two_ranks_share_one_allocation_and_a_layer_lands_only_with_both_shares():
    w = Wire(shards=2)
    w.push("warm", list(range(16)))  # chunk 0 is then held: both ranks must skip it
    w.complete()
    _tp_begin(w, "t", list(range(40)))
    oks = [_for(w, r, protocol.BeginOk)[-1] for r in RANKS]
    assert oks[0] == oks[1] and oks[0].already_sent_indexes == [0] and oks[0].new_chunks == 2
    assert len(w.rx["tcp://rx-a:1"].reqs) == 2  # one allocation on the receiver, not one per rank
    w.engine(protocol.LayerReady(req_id="t", layers=[0]), RANKS[0])
    w.complete()
    assert w.tx.reqs["t"].layers_done == set()  # rank 1's share of layer 0 is not there yet
    assert w.rx["tcp://rx-a:1"].reqs["t"].layers_done == set()
    w.engine(protocol.LayerReady(req_id="t", layers=[0]), RANKS[1])
    data = list(w.posted)
    assert all(len(p.ops) == 1 for p in data)  # pool shards = tp: a rank's heads of a page run are one put
    w.complete()
    assert w.tx.reqs["t"].layers_done == {0}
    assert w.rx["tcp://rx-a:1"].reqs["t"].layers_done == set()  # no notice per layer: the Commit says it
    for layer in (1, 2):
        for r in (0, 1):
            w.engine(protocol.LayerReady(req_id="t", layers=[layer]), RANKS[r])
    w.complete()
    w.engine(protocol.Finish(req_id="t"), RANKS[0])
    assert w.rx["tcp://rx-a:1"].reqs["t"].state is ReqState.ALLOCATED  # rank 1 has not finished: no Commit yet
    w.engine(protocol.Finish(req_id="t"), RANKS[1])
    dones = [_for(w, r, protocol.Done)[-1] for r in RANKS]
    assert all(d.chunks_skipped == 1 and d.layers == LAY.layers for d in dones)
    assert all(d.rank_puts == LAY.layers for d in dones)  # one put per layer per rank: one page run
    assert w.rx["tcp://rx-a:1"].reqs["t"].state is ReqState.COMMITTED


def test_one_rank_dying_fails_the_request_for_every_rank_and_frees_the_lease():
    w = Wire()
    _tp_begin(w, "t", list(range(40)))
    w.engine(protocol.LayerReady(req_id="t", layers=[0]), RANKS[0])
    assert w.tx.lifelines == set(RANKS)
    w.run(w.tx.on_client_gone(RANKS[1], w.now))
    errs = [_for(w, r, protocol.Error)[-1] for r in RANKS]
    assert all(e.code is ErrorCode.PEER_DEAD for e in errs) and "rank 1 of 2 died" in errs[0].message
    assert "t" not in w.rx["tcp://rx-a:1"].reqs  # the receiver was told: the pages go to quarantine
    _tp_begin(w, "u", list(range(40)), ranks=(0,))
    w.run(w.tx.on_client_gone(RANKS[0], w.now))
    w.engine(begin("u", list(range(40)), tp_rank=1, tp_size=2), RANKS[1])  # a late rank is told, not re-begun
    late = _for(w, RANKS[1], protocol.Error)[-1]  # the same typed error the other rank got
    assert late.code is ErrorCode.PEER_DEAD and "ended before rank 1 began it" in late.message and "u" not in w.tx.reqs
    # a rank that had begun it begins it again: the engine's retry of the id (before, refused as a late rank while
    # the id was among the last 4096 ended)
    refuse = w.tx.grants.check  # a retry refused (here its staging check) leaves the ended one known: a late rank of
    w.tx.grants.check = lambda *a: (_ for _ in ()).throw(RequestTooLarge("no room"))  # it is still told
    w.tx.on_lifeline(RANKS[0])
    w.engine(begin("u", list(range(40)), tp_rank=0, tp_size=2), RANKS[0])
    assert _for(w, RANKS[0], protocol.Error)[-1].code is ErrorCode.TOO_LARGE and "u" in w.tx.ended.ended
    w.tx.grants.check = refuse
    _tp_begin(w, "t", list(range(40)), ranks=(0, 1))
    w.complete()  # (its first try's puts settle: the receiver takes the retry once they have)
    w.tick(100)
    oks = [_for(w, r, protocol.BeginOk)[-1] for r in RANKS]
    assert oks[0].req_id == oks[1].req_id == "t" and w.tx.reqs["t"].state is TxState.STREAMING


def test_an_engines_abort_is_answered_to_the_other_ranks_never_to_itself():
    """An engine reads no answer to its Abort; one about the id would be taken for its next Begin of that id (a
    preempted request's retry), and fail it."""
    w = Wire()
    _tp_begin(w, "t", list(range(40)))
    before = len(_for(w, RANKS[0], protocol.Error))
    w.engine(protocol.Abort(req_id="t", reason="preempted"), RANKS[0])
    assert _for(w, RANKS[1], protocol.Error)[-1].code is ErrorCode.ABORTED and "t" not in w.tx.reqs
    w.engine(protocol.Abort(req_id="never", reason="preempted"), RANKS[0])  # (nothing of it here: not told either)
    assert len(_for(w, RANKS[0], protocol.Error)) == before
    _tp_begin(w, "v", list(range(40)))  # an internal error handling its Abort: the request fails, told to the others
    before = len(_for(w, RANKS[0], protocol.Error))
    w.tx._client_req = lambda *a: 1 / 0
    w.engine(protocol.Abort(req_id="v", reason="preempted"), RANKS[0])
    assert _for(w, RANKS[1], protocol.Error)[-1].code is ErrorCode.INTERNAL and "v" not in w.tx.reqs
    assert len(_for(w, RANKS[0], protocol.Error)) == before


def test_a_rank_that_disagrees_fails_the_request_and_a_second_begin_of_a_rank_is_a_duplicate():
    w = Wire()
    _tp_begin(w, "t", list(range(40)), ranks=(0,))
    w.engine(begin("t", list(range(40)), tp_rank=0, tp_size=2), RANKS[1])
    assert _for(w, RANKS[1], protocol.Error)[-1].code is ErrorCode.DUPLICATE_REQUEST and "t" in w.tx.reqs
    w.engine(begin("t", list(range(41)), tp_rank=1, tp_size=2), RANKS[1])  # another prompt
    assert _for(w, RANKS[0], protocol.Error)[-1].code is ErrorCode.BAD_MESSAGE and "t" not in w.tx.reqs


def test_a_rank_that_never_begins_fails_the_request_soon_naming_it():
    """Ranks of an engine begin a request together: one missing after control_timeout_ms fails it
    (not only at the lease deadline, which is much later)."""
    w = Wire(control_timeout_ms=500)  # the lease stays 30 s
    _tp_begin(w, "t", list(range(40)), ranks=(0,))
    for layer in range(LAY.layers):
        w.engine(protocol.LayerReady(req_id="t", layers=[layer]), RANKS[0])
    w.complete()
    w.engine(protocol.Finish(req_id="t"), RANKS[0])
    w.tick(500)
    assert "t" in w.tx.reqs  # exactly at the deadline: still waiting
    w.tick(1)
    err = _for(w, RANKS[0], protocol.Error)[-1]
    assert err.code is ErrorCode.TIMEOUT and "rank 1 of 2 did not begin the request" in err.message
    assert "t" not in w.rx["tcp://rx-a:1"].reqs  # the receiver was told: its pages go back


def test_a_committed_request_stays_until_every_decode_rank_that_opened_it_released_it():
    w = Wire()
    w.push("r", list(range(20)))
    w.complete()
    rx = w.rx["tcp://rx-a:1"]
    assert rx.reqs["r"].state is ReqState.COMMITTED
    for rank in range(2):  # decode TP=2: the ranks open and release one after the other
        rx.on_local(DEC + bytes([rank]), protocol.Open(req_id="r", tp_size=2), w.now)
        rx.on_local(DEC + bytes([rank]), protocol.Release(req_id="r"), w.now)
        assert ("r" in rx.reqs) == (rank == 0)  # the first release does not end it for the second rank
    rx.check()


def test_per_sender_caps_count_a_curve_key_across_its_connections_and_a_reader_key_cannot_hello():
    """Issue 34 items 7 and 8: with CURVE, the caps count a key's leases whatever connection they came on (one key with
    N connections used to hold N times the cap); without it, each connection is its own sender. A reader's key
    (allowed_readers: a router) subscribes to the index feed and is refused everything else, Hello first of all:
    it never learns the pool's rkey."""
    rx = receiver(pages=16, max_leases_per_sender=1, reader_keys=frozenset({"ROUTER-KEY"}))
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)

    def alloc(ident, rid, peer=""):
        return rx.on_control(ident, protocol.AllocRequest(req_id=rid, chunk_keys=chunk_keys(list(range(rid_base[rid],
                             rid_base[rid] + 16)), LAY), last_chunk_tokens=16, lease_ms=1000), 0, peer)

    rid_base = {"k1": 0, "k2": 100, "c1": 200, "c2": 300}
    for ident in (b"a", b"b", b"c", b"d"):
        assert msgs(rx.on_control(ident, hello, 0, "SENDER-KEY" if ident in (b"a", b"b") else ""), ToSender,
                    protocol.HelloAck)
    assert msgs(alloc(b"a", "k1", "SENDER-KEY"), ToSender, protocol.AllocResponse)
    refused = msgs(alloc(b"b", "k2", "SENDER-KEY"), ToSender, protocol.Error)  # same key, another connection
    assert refused and refused[0].code is ErrorCode.POOL_EXHAUSTED and "max_leases_per_sender" in refused[0].message
    assert msgs(alloc(b"c", "c1"), ToSender, protocol.AllocResponse)  # no CURVE: by connection
    assert msgs(alloc(b"d", "c2"), ToSender, protocol.AllocResponse)
    for msg in (hello, protocol.Commit(req_id="k1", layers=LAY.layers)):
        err = msgs(rx.on_control(b"r", msg, 0, "ROUTER-KEY"), ToSender, protocol.Error)
        assert err and err[0].code is ErrorCode.FORBIDDEN and "allowed_readers" in err[0].message
    fed = rx.on_control(b"r", protocol.IndexSubscribe(snapshot=True), 0, "ROUTER-KEY")
    assert fed and all(isinstance(a, ToSender) for a in fed) and not msgs(fed, ToSender, protocol.Error)
    rx.check()


def test_a_withdrawn_push_is_gone_at_once_for_its_decode_and_refused_if_it_begins_later():
    """A router whose prefill leg, sent beside the decode leg, failed says so (``Withdraw``, a reader's key may): the
    decode's next query finds the push gone (it recomputes at once instead of waiting out push_wait_s), an open
    parked on it is refused, and a push of it that begins later is refused, typed; a live push is left alone."""
    rx = receiver(pages=16, reader_keys=frozenset({"ROUTER-KEY"}))
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    assert msgs(rx.on_control(b"s", hello, 0), ToSender, protocol.HelloAck)
    keys = chunk_keys(list(range(40)), LAY)

    def alloc(rid):
        return rx.on_control(b"s", protocol.AllocRequest(req_id=rid, chunk_keys=keys, last_chunk_tokens=8,
                                                         lease_ms=5000), 1)

    def query(rid):
        return msgs(rx.on_local(DEC, protocol.Query(chunk_keys=keys, req_id=rid), 1), ToDecode, protocol.QueryReply)[0]

    assert not query("w").request_gone  # not here yet: the decode asks again, up to its push_wait_s
    assert msgs(rx.on_local(b"parked", protocol.Open(req_id="w"), 0), ToDecode, protocol.OpenOk) == []
    out = rx.on_control(b"router", protocol.Withdraw(req_id="w", reason="the prefill leg failed"), 1, "ROUTER-KEY")
    assert msgs(out, ToSender, protocol.Ok) == [protocol.Ok(req_id="w")]
    refused = [a for a in out if isinstance(a, ToDecode)]
    assert [a.ident for a in refused] == [b"parked"] and refused[0].msg.code is ErrorCode.UNKNOWN_REQUEST
    assert "withdrawn" in refused[0].msg.message and "w" not in rx.parked
    assert query("w").request_gone
    err = msgs(alloc("w"), ToSender, protocol.Error)
    assert err and err[0].code is ErrorCode.ABORTED and "withdrawn" in err[0].message and "w" not in rx.reqs
    err = msgs(rx.on_local(DEC, protocol.Claim(req_id="w", chunk_keys=keys, last_chunk_tokens=8, lease_ms=100), 1),
               ToDecode, protocol.Error)
    assert err and err[0].code is ErrorCode.ABORTED
    assert rx.counters.values["requests_withdrawn"] == 1
    # a push already begun is its sender's to end: a withdrawal leaves it as it was
    assert msgs(alloc("live"), ToSender, protocol.AllocResponse)
    assert msgs(rx.on_control(b"router", protocol.Withdraw(req_id="live"), 1, "ROUTER-KEY"), ToSender,
                protocol.Ok) == [protocol.Ok(req_id=None)]  # (not named: nothing was withdrawn)
    assert "live" in rx.reqs and "live" not in rx.withdrawn and not query("live").request_gone
    assert rx.counters.values["requests_withdrawn"] == 1
    # a flood of withdrawals pushes out only older withdrawals, never another request's end
    assert msgs(rx.on_control(b"s", protocol.Abort(req_id="live"), 2), ToSender, protocol.Ok)
    assert query("live").request_gone
    for k in range(5000):
        rx.on_control(b"router", protocol.Withdraw(req_id=f"junk-{k}"), 3, "ROUTER-KEY")
    assert query("live").request_gone and not query("w").request_gone  # (the oldest withdrawal went first)
    assert len(rx.withdrawn) <= MAX_FINISHED
    rx.check()


def test_a_router_whose_client_hung_up_has_an_unread_push_dropped_but_never_one_being_read():
    """``Unread`` (the router's client hung up before its decode leg went: nobody will read the push): a committed push
    that nobody has open is dropped at once, a streaming one once committed (counted once, however many say so), and
    a push of it again is refused, as is one not begun yet, or begun again after its first try failed (a retried
    prefill leg); one that a reader has open is kept, and so is a live push the router only withdraws (``Withdraw``)
    and a claim."""
    rx = receiver(pages=16, reader_keys=frozenset({"ROUTER-KEY"}))
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    assert msgs(rx.on_control(b"s", hello, 0), ToSender, protocol.HelloAck)

    def alloc(rid, first):
        keys = chunk_keys(list(range(first, first + 40)), LAY)
        return rx.on_control(b"s", protocol.AllocRequest(req_id=rid, chunk_keys=keys, last_chunk_tokens=8,
                                                         lease_ms=5000), 1)

    def commit(rid, now=2):
        assert msgs(rx.on_control(b"s", protocol.Commit(req_id=rid, layers=LAY.layers), now), ToSender,
                    protocol.CommitAck)

    def gone(rid, now=3):
        return rx.on_control(b"router", protocol.Unread(req_id=rid, reason="its client hung up"), now, "ROUTER-KEY")

    assert msgs(alloc("done", 0), ToSender, protocol.AllocResponse)
    commit("done")
    out = gone("done")
    assert msgs(out, ToSender, protocol.Ok) == [protocol.Ok(req_id=None)]
    assert Count("withdrawn", 1, "router_live") in out
    assert "done" not in rx.reqs and rx.pool.chunks_cached == 3  # dropped at once; its chunks stay, unpinned
    err = msgs(alloc("done", 0), ToSender, protocol.Error)
    assert err and err[0].code is ErrorCode.ABORTED and "its client hung up" in err[0].message
    assert msgs(alloc("streaming", 100), ToSender, protocol.AllocResponse)
    gone("streaming")
    out = rx.on_local(DEC, protocol.Withdraw(req_id="streaming"), 3)  # its decode says so too: counted once
    assert not [a for a in out if isinstance(a, Count)]
    assert "streaming" in rx.reqs  # its sender may still be putting: dropped once committed
    commit("streaming", 4)
    rx.on_tick(5)
    assert "streaming" not in rx.reqs
    assert rx.counters.values["requests_given_up"] == 2
    for rid, first, kind in (("read", 200, protocol.Unread), ("plain", 300, protocol.Withdraw)):
        assert msgs(alloc(rid, first), ToSender, protocol.AllocResponse)
        commit(rid)
        if kind is protocol.Unread:
            assert msgs(rx.on_local(DEC, protocol.Open(req_id=rid), 3), ToDecode, protocol.OpenOk)
        rx.on_control(b"router", kind(req_id=rid), 3, "ROUTER-KEY")
        rx.on_tick(6)
        assert rid in rx.reqs
    # not begun yet, or failed and about to be tried again: refused when it begins
    assert msgs(gone("early", 7), ToSender, protocol.Ok) == [protocol.Ok(req_id="early")]
    assert msgs(alloc("tried", 500), ToSender, protocol.AllocResponse)
    assert msgs(rx.on_control(b"s", protocol.Abort(req_id="tried"), 7), ToSender, protocol.Ok)
    gone("tried", 7)
    for rid, first in (("early", 400), ("tried", 500)):
        err = msgs(alloc(rid, first), ToSender, protocol.Error)
        assert err and err[0].code is ErrorCode.ABORTED and "its client hung up" in err[0].message, err
    assert rx.counters.values["requests_withdrawn"] == 2
    # a claim is its decode's: a router's Unread leaves it
    keys = chunk_keys(list(range(200, 240)), LAY)
    assert msgs(rx.on_local(DEC, protocol.Claim(req_id="cl", chunk_keys=keys, last_chunk_tokens=8, lease_ms=5000), 8),
                ToDecode, protocol.ClaimOk)[0].chunks == 3
    gone("cl", 9)
    assert "cl" in rx.reqs
    assert rx.counters.values["requests_given_up"] == 2 and rx.counters.values["requests_withdrawn"] == 2
    rx.check()


def test_a_decode_that_stopped_waiting_withdraws_its_push_and_a_late_one_takes_no_pages():
    """The decode engine's own ``Withdraw`` (local endpoint), sent when its ``push_wait_s`` passed and it recomputes:
    a push of it that begins later is refused, typed, naming why; one already begun that nobody has open is dropped
    once committed (at once if it already was), its chunks left in the index; one that a reader has open is kept."""
    rx = receiver(pages=16)
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    assert msgs(rx.on_control(b"s", hello, 0), ToSender, protocol.HelloAck)

    def alloc(rid, first):
        return rx.on_control(b"s", protocol.AllocRequest(req_id=rid, chunk_keys=chunk_keys(list(range(first, first + 40)),
                                                                                        LAY), last_chunk_tokens=8,
                                                         lease_ms=5000), 1)

    def withdraw(rid, now=2):
        return msgs(rx.on_local(DEC, protocol.Withdraw(req_id=rid, reason="push_wait_s"), now), ToDecode, protocol.Ok)

    out = rx.on_local(DEC, protocol.Withdraw(req_id="late", reason="push_wait_s"), 2)
    assert msgs(out, ToDecode, protocol.Ok) == [protocol.Ok(req_id="late")] and Count("withdrawn", 1, "decode") in out
    err = msgs(alloc("late", 0), ToSender, protocol.Error)
    assert err and err[0].code is ErrorCode.ABORTED and "its decode engine, which stopped waiting" in err[0].message
    assert "late" not in rx.reqs and rx.pool.free_pages == 16 and rx.counters.values["requests_withdrawn"] == 1
    # begun, then given up: committed, then dropped at the next look instead of waiting out committed_ttl_ms
    assert msgs(alloc("begun", 100), ToSender, protocol.AllocResponse)
    assert withdraw("begun") == [protocol.Ok(req_id=None)]  # (not named: it had begun)
    assert msgs(rx.on_control(b"s", protocol.Commit(req_id="begun", layers=LAY.layers), 3), ToSender, protocol.CommitAck)
    assert "begun" in rx.reqs
    rx.on_tick(4)
    assert "begun" not in rx.reqs and rx.pool.chunks_cached > 0  # its chunks stay, unpinned
    # committed already, unread: dropped at once
    assert msgs(alloc("done", 200), ToSender, protocol.AllocResponse)
    assert msgs(rx.on_control(b"s", protocol.Commit(req_id="done", layers=LAY.layers), 3), ToSender, protocol.CommitAck)
    assert Count("withdrawn", 1, "decode_live") in rx.on_local(DEC, protocol.Withdraw(req_id="done"), 5)
    assert "done" not in rx.reqs
    assert rx.counters.values["requests_given_up"] == 2 and rx.counters.values["requests_withdrawn"] == 1
    # given up while live, then failed (its sender aborted it): a push of it again (a retried prefill leg) is refused
    assert msgs(alloc("retried", 250), ToSender, protocol.AllocResponse)
    withdraw("retried", 5)
    assert msgs(rx.on_control(b"s", protocol.Abort(req_id="retried"), 5), ToSender, protocol.Ok)
    err = msgs(alloc("retried", 250), ToSender, protocol.Error)
    assert err and err[0].code is ErrorCode.ABORTED and "its decode engine, which stopped waiting" in err[0].message
    # one that a reader has open is that reader's: kept, before its commit and after
    for rid, first, committed_first in (("read", 300, False), ("read-after", 350, True)):
        assert msgs(alloc(rid, first), ToSender, protocol.AllocResponse)
        assert msgs(rx.on_local(b"reader", protocol.Open(req_id=rid), 5), ToDecode, protocol.OpenOk)
        if committed_first:
            assert msgs(rx.on_control(b"s", protocol.Commit(req_id=rid, layers=LAY.layers), 6), ToSender,
                        protocol.CommitAck)
        owned = set(rx.pool.requests[rid].pages)
        withdraw(rid, 6)
        if not committed_first:
            assert msgs(rx.on_control(b"s", protocol.Commit(req_id=rid, layers=LAY.layers), 7), ToSender,
                        protocol.CommitAck)
        rx.on_tick(1000)
        assert rid in rx.reqs and set(rx.pool.requests[rid].pages) == owned  # its pages under the reader's views
    assert rx.counters.values["requests_given_up"] == 3
    rx.check()


def test_a_claim_its_decode_never_loaded_is_withdrawn_and_unpins_its_chunks():
    """A claim (conditional disaggregation) that its decode engine made and never loaded (its prompt found in its own
    cache, say) is withdrawn like an unread push: dropped at once, its held chunks unpinned (evictable again) rather
    than pinned for the claim's lease; a claim of it again is refused. One that a reader has open is kept."""
    rx = receiver(pages=8)
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    assert msgs(rx.on_control(b"s", hello, 0), ToSender, protocol.HelloAck)
    keys = chunk_keys(list(range(40)), LAY)  # 3 chunks
    assert msgs(rx.on_control(b"s", protocol.AllocRequest(req_id="p", chunk_keys=keys, last_chunk_tokens=8,
                                                          lease_ms=5000), 1), ToSender, protocol.AllocResponse)
    assert msgs(rx.on_control(b"s", protocol.Commit(req_id="p", layers=LAY.layers), 2), ToSender, protocol.CommitAck)
    rx.on_local(DEC, protocol.Open(req_id="p"), 3)
    assert msgs(rx.on_local(DEC, protocol.Release(req_id="p"), 4), ToDecode, protocol.Ok)
    assert "p" not in rx.reqs and rx.pool.chunks_cached == 3

    def claim(rid, now):
        return msgs(rx.on_local(DEC, protocol.Claim(req_id=rid, chunk_keys=keys, last_chunk_tokens=8,
                                                    lease_ms=30_000), now), ToDecode, protocol.ClaimOk)

    def refs():
        return sorted(e.refs for e in rx.pool._index.values())

    assert claim("c", 5) == [protocol.ClaimOk(req_id="c", chunks=3)] and refs() == [1, 1, 1]
    out = rx.on_local(DEC, protocol.Withdraw(req_id="c", reason="its request ended before loading it"), 6)
    assert msgs(out, ToDecode, protocol.Ok) == [protocol.Ok(req_id=None)] and Count("withdrawn", 1, "decode_live") in out
    assert "c" not in rx.reqs and refs() == [0, 0, 0] and rx.pool.chunks_cached == 3  # unpinned at once, still held
    err = msgs(rx.on_local(DEC, protocol.Claim(req_id="c", chunk_keys=keys, last_chunk_tokens=8, lease_ms=100), 7),
               ToDecode, protocol.Error)
    assert err and err[0].code is ErrorCode.ABORTED
    # a claim its decode has open (loading it) is that reader's until it releases it
    assert claim("read", 8) == [protocol.ClaimOk(req_id="read", chunks=3)]
    assert msgs(rx.on_local(b"reader", protocol.Open(req_id="read"), 8), ToDecode, protocol.OpenOk)
    rx.on_local(DEC, protocol.Withdraw(req_id="read"), 9)
    rx.on_tick(1000)
    assert "read" in rx.reqs and refs() == [1, 1, 1]
    assert rx.counters.values["requests_given_up"] == 1
    rx.check()

def test_only_the_connection_that_opened_a_request_can_release_it():
    """A Release from a connection with no open of the request is refused, typed, and changes nothing: it used to
    take a reader away from whoever held the request open, whose pages could then be reused under its views."""
    w = Wire()
    w.push("r", list(range(20)))
    w.complete()
    rx = w.rx["tcp://rx-a:1"]
    rx.on_local(DEC, protocol.Open(req_id="r"), w.now)
    out = rx.on_local(b"stranger", protocol.Release(req_id="r"), w.now)
    err = msgs(out, ToDecode, protocol.Error)
    assert err and err[0].code is ErrorCode.UNKNOWN_REQUEST and "no open of this connection" in err[0].message
    assert rx.reqs["r"].readers == 1 and rx.counters.values["releases_refused"] == 1
    rx.on_local(DEC, protocol.Release(req_id="r"), w.now)  # its opener's release ends it
    assert "r" not in rx.reqs
    rx.check()


def test_an_open_released_before_its_push_began_is_never_answered_and_holds_nothing():
    """A decode that gives up an open still parked (``PendingOpen.abandon``: Release after Open) is not answered
    when the push arrives, so no open of it pins the request; another connection's parked open still is."""
    rx = receiver()
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    assert msgs(rx.on_control(b"s", hello, 0), ToSender, protocol.HelloAck)
    for ident in (DEC, b"other"):
        assert msgs(rx.on_local(ident, protocol.Open(req_id="a"), 0), ToDecode, protocol.OpenOk) == []  # parked
    assert msgs(rx.on_local(DEC, protocol.Release(req_id="a"), 1), ToDecode, protocol.Ok)
    alloc = protocol.AllocRequest(req_id="a", chunk_keys=chunk_keys(list(range(40)), LAY), last_chunk_tokens=8,
                                  lease_ms=5000)
    out = rx.on_control(b"s", alloc, 10)
    assert [a.ident for a in out if isinstance(a, ToDecode) and isinstance(a.msg, protocol.OpenOk)] == [b"other"]
    assert rx.reqs["a"].opens == {b"other": 1}
    rx.check()


@pytest.mark.parametrize("gone", ["released", "reader died"])
def test_a_decode_rank_that_gave_up_its_parked_open_does_not_hold_the_others_request_to_its_ttl(gone):
    """Two decode TP ranks park their opens; one gives up before the push begins (``PendingOpen.abandon``'s Release,
    or its engine dies). The push then counts that rank's release: once the other rank has read and released it,
    the request goes at once, not at ``committed_ttl_ms``. A request whose only reader gave up goes at its commit."""
    rx = receiver(committed_ttl_ms=600_000)
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    assert msgs(rx.on_control(b"s", hello, 0), ToSender, protocol.HelloAck)
    alloc = protocol.AllocRequest(req_id="a", chunk_keys=chunk_keys(list(range(40)), LAY), last_chunk_tokens=8,
                                  lease_ms=5000)
    for ident in (DEC, b"rank1"):
        assert msgs(rx.on_local(ident, protocol.Open(req_id="a", tp_size=2), 0), ToDecode, protocol.OpenOk) == []
    if gone == "released":
        assert msgs(rx.on_local(b"rank1", protocol.Release(req_id="a"), 1), ToDecode, protocol.Ok)
    else:
        rx.on_reader_gone(b"rank1", 1)
    out = rx.on_control(b"s", alloc, 10)
    assert [a.ident for a in out if isinstance(a, ToDecode) and isinstance(a.msg, protocol.OpenOk)] == [DEC]
    r = rx.reqs["a"]
    assert (r.decode_ranks, r.releases, r.readers) == (2, 1, 1) and not rx.parked
    for layer in range(LAY.layers):
        rx.on_control(b"s", protocol.LayerDone(req_id="a", layers=[layer]), 20)
    assert msgs(rx.on_control(b"s", protocol.Commit(req_id="a", layers=LAY.layers), 20), ToSender, protocol.CommitAck)
    assert "a" in rx.reqs  # rank 0 still reads it
    rx.on_local(DEC, protocol.Release(req_id="a"), 30)
    assert "a" not in rx.reqs and rx.finished["a"] == "committed and released"
    rx.check()
    # the only reader gave up before the push began: the request goes once committed (nobody will read it)
    b = alloc.model_copy(update={"req_id": "b", "chunk_keys": chunk_keys(list(range(100, 116)), LAY)})
    rx.on_local(DEC, protocol.Open(req_id="b"), 40)
    rx.on_local(DEC, protocol.Release(req_id="b"), 41)
    rx.on_control(b"s", b, 50)
    assert rx.reqs["b"].readers == 0
    for layer in range(LAY.layers):
        rx.on_control(b"s", protocol.LayerDone(req_id="b", layers=[layer]), 60)
    rx.on_control(b"s", protocol.Commit(req_id="b", layers=LAY.layers), 60)
    assert "b" not in rx.reqs and rx.finished["b"] == "committed after every reader released it"
    # its sender's late Commit (the words were in, but late for its clock) is acknowledged, not refused
    assert msgs(rx.on_control(b"s", protocol.Commit(req_id="b", layers=LAY.layers), 61), ToSender,
                protocol.CommitAck)[0].chunks_committed == 1
    assert msgs(rx.on_control(b"s", protocol.Abort(req_id="b"), 61), ToSender, protocol.Ok)  # a late Abort: nothing
    rx.on_control(b"t", hello, 61)
    refused = msgs(rx.on_control(b"t", protocol.Commit(req_id="b", layers=LAY.layers), 61), ToSender, protocol.Error)
    assert refused[0].code is ErrorCode.UNKNOWN_REQUEST  # another sender's Commit of it is still refused
    rx.check()
    # a connection that gave its open up and opens again holds one live open, and no release is counted for it;
    # giving up and opening again in a loop never runs into the cap of parked opens
    c = alloc.model_copy(update={"req_id": "c", "chunk_keys": chunk_keys(list(range(200, 216)), LAY)})
    for i in range(40):
        rx.on_local(DEC, protocol.Open(req_id="c"), 70 + i)
        if i < 39:
            rx.on_local(DEC, protocol.Release(req_id="c"), 70 + i)
    assert len(rx.parked["c"]) == 1
    assert [a.ident for a in rx.on_control(b"s", c, 120) if isinstance(a, ToDecode)] == [DEC]
    assert (rx.reqs["c"].readers, rx.reqs["c"].releases) == (1, 0)
    rx.check()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_push_of_chunks_all_held_commits_on_finish_without_any_layer(tp):
    """Regression: an engine that has nothing to stage finishes without handing layers over; the
    request used to wait for layers that never came until its lease ran out."""
    w = Wire()
    w.push("first", list(range(32)))
    w.complete()
    idents = [ENG] if tp == 1 else list(RANKS)
    for r, ident in enumerate(idents):
        w.engine(begin("again", list(range(32)), tp_rank=r, tp_size=tp), ident)
    assert _for(w, idents[0], protocol.BeginOk)[-1].new_chunks == 0
    for ident in idents:
        w.engine(protocol.Finish(req_id="again"), ident)
    assert all(isinstance(_for(w, i, protocol.Done)[-1], protocol.Done) for i in idents)
    assert w.rx["tcp://rx-a:1"].reqs["again"].state is ReqState.COMMITTED and not w.posted


def _pp_begin(w: Wire, req_id: str, ids: list[int], stages=((0, 0, 2), (1, 2, 3))) -> None:
    for s, first, end in stages:
        w.tx.on_lifeline(RANKS[s])
        w.engine(begin(req_id, ids, pp_rank=s, pp_size=2, first_layer=first, end_layer=end), RANKS[s])


def test_a_later_stages_ranks_are_timed_from_that_stages_first_begin_not_the_requests():
    """A later pipeline stage begins once the stage before it has computed (seconds later for a long prompt): its
    TP ranks begin together, and only a rank missing control_timeout_ms after its own stage's first fails it."""
    w = Wire(control_timeout_ms=500)
    ranks = [b"s0r0", b"s0r1", b"s1r0", b"s1r1"]
    for ident in ranks:
        w.tx.on_lifeline(ident)

    def stage_rank(s, t):
        w.engine(begin("p", list(range(40)), pp_rank=s, pp_size=2, tp_rank=t, tp_size=2, first_layer=2 * s,
                       end_layer=2 + s), ranks[2 * s + t])

    stage_rank(0, 0)
    stage_rank(0, 1)
    w.tick(2000)  # stage 0 computes
    stage_rank(1, 0)
    w.tick(1)
    assert "p" in w.tx.reqs  # before, stage 1's rank 1 was late from here: 2001 ms after the request's first Begin
    w.tick(499)
    assert "p" in w.tx.reqs
    w.tick(1)
    err = _for(w, ranks[0], protocol.Error)[-1]
    assert err.code is ErrorCode.TIMEOUT and "stage 1 of 2, rank 1 of 2 did not begin" in err.message


def test_two_stages_share_one_allocation_push_only_their_layers_and_commit_once():
    w = Wire()
    _pp_begin(w, "p", list(range(40)))
    oks = [_for(w, r, protocol.BeginOk)[-1] for r in RANKS]
    assert len(oks) == 2 and oks[0].staging_offset == oks[1].staging_offset  # one allocation
    w.engine(protocol.LayerReady(req_id="p", layers=[2]), RANKS[0])  # not stage 0's layer
    assert "this stage's [0, 2)" in _for(w, RANKS[0], protocol.Error)[-1].message and "p" in w.tx.reqs
    for stage, layers in ((0, [0, 1]), (1, [2])):
        w.engine(protocol.LayerReady(req_id="p", layers=layers), RANKS[stage])
    w.complete()
    w.engine(protocol.Finish(req_id="p"), RANKS[0])
    assert not _for(w, RANKS[0], protocol.Done)  # stage 1 has not finished: no commit
    w.engine(protocol.Finish(req_id="p"), RANKS[1])
    assert [type(m) for i, m in w.by_client if isinstance(m, protocol.Done)] == [protocol.Done] * 2
    assert w.rx["tcp://rx-a:1"].counters.values["requests_committed"] == 1


@pytest.mark.parametrize("stages,why", [
    (((0, 0, 2), (1, 1, 3)), "stages must split the layers"),    # overlap
    (((0, 0, 1), (1, 2, 3)), "do not cover the layout's 3 layers"),  # a gap
])
def test_stages_that_do_not_split_the_layers_fail_the_request(stages, why):
    w = Wire()
    _pp_begin(w, "p", list(range(40)), stages)
    err = _for(w, RANKS[0], protocol.Error)[-1]
    assert err.code is ErrorCode.BAD_MESSAGE and why in err.message and "p" not in w.tx.reqs


def test_a_dead_stage_fails_the_request_for_the_other_naming_it():
    w = Wire()
    _pp_begin(w, "p", list(range(40)))
    w.run(w.tx.on_client_gone(RANKS[1], w.now))
    err = _for(w, RANKS[0], protocol.Error)[-1]
    assert err.code is ErrorCode.PEER_DEAD and "stage 1 of 2, rank 0 of 1 died" in err.message


def test_a_stage_s_layers_beyond_the_layout_or_too_many_ranks_are_refused_at_begin():
    w = Wire()
    _pp_begin(w, "p", list(range(40)), ((0, 0, 1),))
    w.engine(begin("p", list(range(40)), pp_rank=1, pp_size=2, first_layer=2, end_layer=4), RANKS[1])  # 3 layers
    err = _for(w, RANKS[1], protocol.Error)[-1]
    assert err.code is ErrorCode.BAD_MESSAGE and "do not fit the layout's 3 layers" in err.message
    w.engine(begin("q", list(range(40)), tp_size=64, pp_size=128, pp_rank=0, first_layer=0, end_layer=1), RANKS[1])
    assert "exceeds 4096 ranks" in _for(w, RANKS[1], protocol.Error)[-1].message and "q" not in w.tx.reqs


def test_a_later_stage_may_begin_after_the_ranks_window_but_not_after_the_lease():
    """TP ranks of one stage begin together (control_timeout_ms); a later stage starts its forward later,
    so it has until the lease deadline."""
    w = Wire(control_timeout_ms=500)
    _pp_begin(w, "p", list(range(40)), ((0, 0, 2),))
    w.tick(2000)
    assert "p" in w.tx.reqs  # stage 1 has not begun: no short window for a whole stage
    _pp_begin(w, "p", list(range(40)), ((1, 2, 3),))
    for stage, layers in ((0, [0, 1]), (1, [2])):
        w.engine(protocol.LayerReady(req_id="p", layers=layers), RANKS[stage])
        w.engine(protocol.Finish(req_id="p"), RANKS[stage])
    w.complete()
    assert len(_for(w, RANKS[0], protocol.Done)) == 1 and len(_for(w, RANKS[1], protocol.Done)) == 1
    w2 = Wire(control_timeout_ms=500)
    _pp_begin(w2, "p", list(range(40)), ((0, 0, 2),))
    w2.tick(40_000)  # past the 30 s lease: stage 1 never came
    assert _for(w2, RANKS[0], protocol.Error)[-1].code is ErrorCode.TIMEOUT and "p" not in w2.tx.reqs


def _streaming(w: Wire, req_id: str = "r") -> None:
    """``req_id`` allocated and every layer handed over: its puts are in flight, none flushed."""
    w.engine(begin(req_id, list(range(40))))  # 3 chunks: 3 pages
    for layer in range(LAY.push_layers):
        w.engine(protocol.LayerReady(req_id=req_id, layers=[layer]))
    assert w.posted and w.rx["tcp://rx-a:1"].reqs[req_id].state is ReqState.ALLOCATED


def test_an_aborted_requests_pages_stay_out_of_use_until_its_writes_settle():
    """A one-sided write cannot be revoked: the pages of a request aborted with puts in flight go to
    quarantine only when the sender says those puts completed (a settled Abort), never before."""
    w = Wire()
    rx = w.rx["tcp://rx-a:1"]
    _streaming(w)
    w.engine(protocol.Abort(req_id="r", reason="engine gave up"))
    assert "r" not in rx.reqs and rx.pool.unfenced_pages == 3 and rx.pool.quarantined_pages == 0
    w.tick(rx.limits.quarantine_ms + 1)  # a quarantine's worth of time is no fence: a held write may still land
    assert rx.pool.unfenced_pages == 3 and rx.pool.free_pages == rx.pool.num_pages - 3
    rx.check()
    w.complete()  # the puts complete: the sender's settled Abort follows
    assert not w.unsettled and rx.pool.unfenced_pages == 0 and rx.pool.quarantined_pages == 3
    w.tick(rx.limits.quarantine_ms + 1)
    assert rx.pool.free_pages == rx.pool.num_pages
    rx.check()


def test_a_request_aborted_with_nothing_in_flight_is_settled_in_its_abort():
    w = Wire()
    rx = w.rx["tcp://rx-a:1"]
    _streaming(w)
    w.complete()
    w.engine(protocol.Abort(req_id="r", reason="engine gave up before Finish"))
    assert rx.pool.unfenced_pages == 0 and rx.pool.quarantined_pages == 3 and not w.unsettled


def test_writes_that_never_settle_get_their_sender_fenced_after_a_lease():
    """No settled Abort comes (the puts hang, the sender froze or is cut off): after ``lease_ms`` the receiver
    closes that sender's endpoints (FenceSender), which ends its other live requests, and only then reuses
    the pages."""
    w = Wire()
    rx = w.rx["tcp://rx-a:1"]
    _streaming(w)
    w.engine(protocol.Abort(req_id="r", reason="engine gave up"))
    w.engine(begin("other", list(range(500, 540))))
    assert rx.reqs["other"].state is ReqState.ALLOCATED and rx.pool.unfenced_pages == 3
    assert FenceSender(b"tx") not in rx.on_tick(w.rx_now + rx.limits.lease_ms - 1)
    out = rx.on_tick(w.rx_now + rx.limits.lease_ms)
    assert FenceSender(b"tx") in out
    assert rx.pool.unfenced_pages == 0 and rx.pool.quarantined_pages == 6 and "other" not in rx.reqs
    rx.check()


def test_a_senders_data_plane_closing_fails_its_live_requests_at_once_and_fences_their_pages():
    w = Wire()
    rx = w.rx["tcp://rx-a:1"]
    _streaming(w)
    assert msgs(rx.on_local(DEC, protocol.Open(req_id="r"), w.rx_now), ToDecode, protocol.OpenOk)
    out = rx.on_sender_lost(b"tx", w.rx_now)
    assert msgs(out, ToDecode, protocol.Error)[0].code is ErrorCode.PEER_DEAD
    # fenced, but open at its decode, which may be reading it: held until that reader lets go (here its engine dies)
    assert "r" not in rx.reqs and rx.pool.unfenced_pages == 0 and rx.pool.read_held_pages == 3
    assert rx.on_sender_lost(b"another", w.rx_now) == [] and rx.pool.read_held_pages == 3
    rx.check()
    rx.on_reader_gone(DEC, w.rx_now)
    assert rx.pool.read_held_pages == 0 and rx.pool.quarantined_pages == 3 and not rx.tombs
    rx.check()


def test_a_failed_request_its_decode_has_open_keeps_its_pages_and_pinned_chunks_until_that_reader_lets_go():
    """A decode that saw a push's last readiness words land just after the receiver failed it (before the Error
    came) reads it as whole. Before, the failure unpinned the prefix-cache chunks it held at once: a new push
    could evict them and write there under that reader's views. Now they stay pinned, and its own pages out of
    use, until its reader releases it (another connection's Release does not count), or for ``lease_ms``."""
    rx = receiver(pages=4, lease_ms=100)
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    rx.on_control(b"s", hello, 0)

    def alloc(rid, ids, now):
        return rx.on_control(b"s", protocol.AllocRequest(req_id=rid, chunk_keys=chunk_keys(ids, LAY),
                                                         last_chunk_tokens=16, lease_ms=5000), now)

    alloc("base", list(range(32)), 0)  # two chunks, committed, read, dropped: in the index, unpinned
    assert msgs(rx.on_control(b"s", protocol.Commit(req_id="base", layers=LAY.layers), 1), ToSender,
                protocol.CommitAck)
    rx.on_local(DEC, protocol.Open(req_id="base"), 2)
    rx.on_local(DEC, protocol.Release(req_id="base"), 3)
    assert "base" not in rx.reqs and rx.pool.chunks_cached == 2
    assert msgs(alloc("a", list(range(48)), 4), ToSender, protocol.AllocResponse)  # holds both, one new page
    opened = msgs(rx.on_local(DEC, protocol.Open(req_id="a"), 5), ToDecode, protocol.OpenOk)[0]
    out = rx.on_control(b"s", protocol.Abort(req_id="a", reason="engine gave up"), 6)  # writes may be in flight
    assert msgs(out, ToDecode, protocol.Error)[0].code is ErrorCode.ABORTED and "a" not in rx.reqs
    assert rx.pool.read_held_pages == 1 and rx.stats()["pool_pages_read_held"] == 1
    rx.check()
    # a push that needs the held chunks' pages: they are still pinned, so it cannot evict them
    err = msgs(alloc("b", list(range(500, 548)), 7), ToSender, protocol.Error)
    assert err and err[0].code is ErrorCode.POOL_EXHAUSTED and rx.pool.chunks_cached == 2
    assert rx.on_local(DEC + b"x", protocol.Release(req_id="a", answer=False, lease_id=opened.lease_id), 8) == []
    assert rx.pool.read_held_pages == 1  # another connection's release is not its reader's
    # nor one naming no try (an open of the id given up unanswered: maybe a refused one, while this reads on)
    assert msgs(rx.on_local(DEC, protocol.Open(req_id="a"), 8), ToDecode, protocol.Error)  # (gone)
    assert rx.on_local(DEC, protocol.Release(req_id="a", answer=False), 8) == []
    assert rx.pool.read_held_pages == 1
    assert rx.on_local(DEC, protocol.Release(req_id="a", answer=False, lease_id=opened.lease_id), 9) == []  # its
    # reader, told, lets go
    assert rx.pool.read_held_pages == 0 and rx.pool.unfenced_pages == 1 and not rx.tombs  # (its sender never settled)
    rx.check()
    assert msgs(alloc("b", list(range(500, 548)), 10), ToSender, protocol.AllocResponse)  # evicts them now
    rx.check()
    # a reader that never lets go holds it for lease_ms at most
    assert msgs(rx.on_local(DEC, protocol.Open(req_id="b"), 11), ToDecode, protocol.OpenOk)
    rx.on_control(b"s", protocol.Abort(req_id="b", reason="engine gave up", settled=True), 12)
    assert rx.pool.read_held_pages == 3
    rx.on_tick(111)  # ("a"'s sender never settled it: fenced at its lease, so "a"'s page is quarantined, fenced)
    assert rx.pool.read_held_pages == 3
    out = rx.on_tick(112)
    assert rx.pool.read_held_pages == 0 and rx.pool.quarantined_pages == 3 + 1 and rx.counters.values[  # (+ "a"'s,
        "read_holds_expired"] == 1 and any(isinstance(a, Log) and "readers kept it" in a.message for a in out)
    rx.check()


def test_a_release_names_the_try_it_gives_up_where_a_failed_one_and_its_retry_are_open_on_one_connection():
    rx = receiver(pages=8, lease_ms=1000)
    rx.on_control(b"s", protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC),
                  0)
    alloc = protocol.AllocRequest(req_id="x", chunk_keys=chunk_keys(list(range(32)), LAY), last_chunk_tokens=16,
                                  lease_ms=5000)
    rx.on_control(b"s", alloc, 0)
    first = msgs(rx.on_local(DEC, protocol.Open(req_id="x"), 1), ToDecode, protocol.OpenOk)[0]
    rx.on_control(b"s", protocol.Abort(req_id="x", reason="gave up", settled=True), 2)  # held for its reader
    rx.on_control(b"s", alloc, 3)  # the retry
    rx.on_control(b"s", protocol.Commit(req_id="x", layers=LAY.layers), 4)
    retry = msgs(rx.on_local(DEC, protocol.Open(req_id="x"), 5), ToDecode, protocol.OpenOk)[0]
    assert retry.lease_id != first.lease_id and rx.pool.read_held_pages == 2
    # the retry's release first: the failed try's reader (the same connection) still reads its pages
    assert msgs(rx.on_local(DEC, protocol.Release(req_id="x", lease_id=retry.lease_id), 6), ToDecode, protocol.Ok)
    assert rx.pool.read_held_pages == 2 and "x" not in rx.reqs  # (the retry, released by its only reader: dropped)
    rx.check()
    assert rx.on_local(DEC, protocol.Release(req_id="x", lease_id=first.lease_id, answer=False), 7) == []
    assert rx.pool.read_held_pages == 0 and rx.pool.quarantined_pages == 2 and not rx.tombs
    rx.check()
    # and the other way round: the failed try's release leaves the retry's open alone
    rx.on_control(b"s", alloc.model_copy(update={"req_id": "y"}), 10)
    first = msgs(rx.on_local(DEC, protocol.Open(req_id="y"), 11), ToDecode, protocol.OpenOk)[0]
    rx.on_control(b"s", protocol.Abort(req_id="y", reason="gave up", settled=True), 12)
    rx.on_control(b"s", alloc.model_copy(update={"req_id": "y"}), 13)
    msgs(rx.on_local(DEC, protocol.Open(req_id="y"), 14), ToDecode, protocol.OpenOk)
    rx.on_local(DEC, protocol.Release(req_id="y", lease_id=first.lease_id, answer=False), 15)
    assert rx.reqs["y"].readers == 1 and not rx.tombs
    rx.check()
    # a release naming no try (an open given up before its client took the answer) gives up the connection's newest
    # open of the id: the retry's, never the failed try's its reader still reads
    rx.on_control(b"s", alloc.model_copy(update={"req_id": "z"}), 20)
    msgs(rx.on_local(DEC, protocol.Open(req_id="z"), 21), ToDecode, protocol.OpenOk)
    rx.on_control(b"s", protocol.Abort(req_id="z", reason="gave up", settled=True), 22)
    rx.on_control(b"s", alloc.model_copy(update={"req_id": "z"}), 23)
    msgs(rx.on_local(DEC, protocol.Open(req_id="z"), 24), ToDecode, protocol.OpenOk)
    assert rx.on_local(DEC, protocol.Release(req_id="z", answer=False), 25) == []
    assert rx.reqs["z"].readers == 0 and len(rx.tombs["z"]) == 1
    rx.check()


def test_a_retried_id_waits_while_its_earlier_attempts_writes_may_still_land():
    """A router retries a push id on another prefill (another sender) while the first attempt's puts may still land
    (its Abort unsettled). The retry must not share the id's fence record: before, the two attempts' pages merged
    under the id, the second sender's settled Abort (or its fence) released the first's pages, and they went back
    into use while the first sender, never fenced, could still write them. The retry is refused, typed and
    retryable, until the first attempt settles; it then proceeds, and only its own sender settles it."""
    rx = receiver(pages=8)
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    keys = chunk_keys(list(range(48)), LAY)

    def alloc(ident, now):
        return rx.on_control(ident, protocol.AllocRequest(req_id="push-1", chunk_keys=keys, last_chunk_tokens=16,
                                                          lease_ms=30_000), now)

    for ident in (b"P1", b"P2"):
        assert msgs(rx.on_control(ident, hello, 0), ToSender, protocol.HelloAck)
    first = msgs(alloc(b"P1", 0), ToSender, protocol.AllocResponse)[0].page_runs
    rx.on_control(b"P1", protocol.Abort(req_id="push-1", settled=False), 10)  # its puts may still land
    assert rx.pool.unfenced_pages == 3
    refused = msgs(alloc(b"P2", 20), ToSender, protocol.Error)
    assert refused and refused[0].code is ErrorCode.POOL_EXHAUSTED and refused[0].retry_after_ms == rx.pool.retry_after_ms
    assert rx.on_control(b"P2", protocol.Abort(req_id="push-1", settled=True), 30) and rx.pool.unfenced_pages == 3
    rx.on_control(b"P1", protocol.Abort(req_id="push-1", settled=True), 40)  # the first attempt's writes are done
    assert rx.pool.unfenced_pages == 0 and rx.pool.quarantined_pages == 3
    second = msgs(alloc(b"P2", 50), ToSender, protocol.AllocResponse)[0].page_runs
    assert {p for p, n in first for p in range(p, p + n)}.isdisjoint({p for p, n in second for p in range(p, p + n)})
    rx.check()


def test_a_connection_naming_anothers_handle_in_its_ring_learns_nothing_and_changes_nothing():
    """Handles are small numbers a connection can guess. Ring records naming another connection's request (a layer,
    a finish) are refused and counted: the request goes on, and the record's writer is never told its req_id.
    Before, the answer was "unknown request '<the other's req_id>'": with it, a disagreeing Begin of that id ends
    the request (as it must for a rank of it that disagrees)."""
    w = Wire()
    w.engine(begin("secret-id", list(range(40))))
    handle = [m.handle for m in w.to_client if isinstance(m, protocol.BeginOk)][-1]
    w.records(b"stranger", [(handle, 0, 1)])
    w.records(b"stranger", [(handle, 0, 0)])
    said = [m for ident, m in w.by_client if ident == b"stranger"]
    assert not any("secret-id" in repr(m) for m in said), said
    assert "secret-id" in w.tx.reqs and w.tx.counters.values["handovers_refused"] == 2
    for layer in range(LAY.push_layers):
        w.engine(protocol.LayerReady(req_id="secret-id", layers=[layer]))
    w.complete()
    w.engine(protocol.Finish(req_id="secret-id"))
    assert [m for m in w.to_client if isinstance(m, protocol.Done) and m.req_id == "secret-id"]


def _verifying_receiver() -> tuple[ReceiverSession, list]:
    """A receiver session with verify_checksums, a sender's hello taken; the ranges it hashed, each a checksum of 7."""
    tokens = (bytes([i]) * 32 for i in itertools.count(1))
    info = PoolInfo(1 << 30, 8, 7, b"rkey", (1 << 30) + LAY.kv_bytes(8), "127.0.0.1", 9, "rx-42", 1)
    calls: list = []
    rx = ReceiverSession(LAY, 8, ReceiverLimits(verify_checksums=True), info, new_token=lambda: next(tokens),
                         layer_checksum=lambda ranges: calls.append(ranges) or 7)
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    assert msgs(rx.on_control(b"P", hello, 0), ToSender, protocol.HelloAck)
    return rx, calls


def test_a_receiver_that_verifies_checksums_refuses_layers_and_commits_it_could_not_verify():
    """verify_checksums: readers are told a layer is there only once its checksum matched (OpenOk's ready_in_pool is
    False). A LayerDone without checksums, or a Commit with a layer that moved bytes and was never verified (its
    sender sends no checksums), fails the request, typed, and nothing is indexed. Before, both went through: the
    layers were announced and the chunks indexed for other requests, unverified."""
    rx, calls = _verifying_receiver()
    keys = chunk_keys(list(range(32)), LAY)
    for rid, first in (("no-sums", protocol.LayerDone(req_id="no-sums", layers=[0, 1])),
                       ("commit-only", protocol.Commit(req_id="commit-only", layers=LAY.push_layers))):
        assert msgs(rx.on_control(b"P", protocol.AllocRequest(req_id=rid, chunk_keys=keys, last_chunk_tokens=16,
                                                              lease_ms=1000), 0), ToSender, protocol.AllocResponse)
        assert msgs(rx.on_local(DEC, protocol.Open(req_id=rid), 0), ToDecode, protocol.OpenOk)
        out = rx.on_control(b"P", first, 1)
        assert not msgs(out, ToDecode, protocol.LayerAvailable), out
        err = msgs(out, ToSender, protocol.Error)
        assert err and err[0].code is ErrorCode.CHECKSUM_MISMATCH and "checksums = true" in err[0].message, out
        assert rid not in rx.reqs and rx.pool.chunks_cached == 0
    assert not calls
    rx.check()


def test_a_layer_named_again_is_hashed_once():
    """verify_checksums: a LayerDone that names a layer many times (or again, in a later one) costs one pass over its
    pages; each name was hashed, so one message listing a big layer 4,096 times held the receiver's loop for 4,096
    passes over it."""
    rx, calls = _verifying_receiver()
    keys = chunk_keys(list(range(32)), LAY)
    assert msgs(rx.on_control(b"P", protocol.AllocRequest(req_id="r", chunk_keys=keys, last_chunk_tokens=16,
                                                          lease_ms=1000), 0), ToSender, protocol.AllocResponse)
    out = rx.on_control(b"P", protocol.LayerDone(req_id="r", layers=[0] * 1000, checksums=[7] * 1000), 1)
    assert not msgs(out, ToSender, protocol.Error), out
    out = rx.on_control(b"P", protocol.LayerDone(req_id="r", layers=[0, 1], checksums=[7, 7]), 2)
    assert not msgs(out, ToSender, protocol.Error), out
    assert len(calls) == 2  # layer 0 once, layer 1 once
    rx.check()


def test_one_decode_connection_cannot_fill_the_parked_opens_for_every_other(monkeypatch):
    """Opens of pushes that have not begun wait (parked) for them, up to a cap per decode connection: one that opens
    ids that never come, then dies, leaves the others room. Before, the cap was only global, and given-up marks
    of a dead connection filled it: every other engine's open was refused for two minutes."""
    from pdpush.sessions import receiver as rxmod

    monkeypatch.setattr(rxmod, "PARKED_PER_READER", 8)
    monkeypatch.setattr(rxmod, "PARKED_ALL", 12)
    rx = receiver(pages=16)
    for i in range(8):
        assert not msgs(rx.on_local(b"junk", protocol.Open(req_id=f"junk-{i}"), 0), ToDecode, protocol.Error)
    err = msgs(rx.on_local(b"junk", protocol.Open(req_id="junk-8"), 0), ToDecode, protocol.Error)
    assert err and err[0].code is ErrorCode.TOO_LARGE
    rx.check()
    for i in range(4):  # another connection still parks, up to the global cap
        assert not msgs(rx.on_local(DEC, protocol.Open(req_id=f"real-{i}"), 0), ToDecode, protocol.Error)
    assert msgs(rx.on_local(DEC, protocol.Open(req_id="real-4"), 0), ToDecode, protocol.Error)
    rx.on_reader_gone(b"junk", 1)  # its opens are given up: they no longer count
    for i in range(4, 12):
        who = DEC if i < 8 else b"dec2"
        assert not msgs(rx.on_local(who, protocol.Open(req_id=f"real-{i}"), 1), ToDecode, protocol.Error)
    assert msgs(rx.on_local(b"dec2", protocol.Open(req_id="real-12"), 1), ToDecode, protocol.Error)  # all 12 live
    rx.check()
    out = rx.on_tick(rxmod.PARKED_OPEN_MS + 2)  # and all of them expire, each live one told (the junk's are marks)
    assert not rx.parked and not rx._parked_by
    told = [(a.ident, a.msg.req_id) for a in out if isinstance(a, ToDecode) and isinstance(a.msg, protocol.Error)
            and a.msg.code is ErrorCode.TIMEOUT]
    assert sorted(told) == sorted([(DEC, f"real-{i}") for i in range(8)] + [(b"dec2", f"real-{i}") for i in (8, 9, 10, 11)])
    rx.check()


def test_an_open_parked_before_a_claim_of_its_id_is_answered_by_the_claim():
    """A decode's Open parks until its id begins here; a Claim begins it as a push does. The Open was never answered:
    it waited its own deadline, then ``PARKED_OPEN_MS`` later its parked entry went, unanswered."""
    rx = receiver(pages=16)
    keys = chunk_keys(list(range(48)), LAY)
    rx.on_control(b"s", protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC), 0)
    msgs(rx.on_control(b"s", protocol.AllocRequest(req_id="p", chunk_keys=keys, last_chunk_tokens=16, lease_ms=80), 0),
         ToSender, protocol.AllocResponse)
    rx.on_control(b"s", protocol.Commit(req_id="p", layers=LAY.layers), 1)
    rx.on_local(DEC, protocol.Open(req_id="p"), 1)
    rx.on_local(DEC, protocol.Release(req_id="p"), 1)  # held, unpinned
    assert not rx.on_local(b"early", protocol.Open(req_id="c"), 2)  # parked
    out = rx.on_local(DEC, protocol.Claim(req_id="c", chunk_keys=keys, last_chunk_tokens=16, lease_ms=500), 3)
    [ok] = [a.msg for a in out if isinstance(a, ToDecode) and a.ident == b"early"]
    assert isinstance(ok, protocol.OpenOk) and ok.committed and len(ok.pages) == 3
    assert msgs(out, ToDecode, protocol.ClaimOk)[0].chunks == 3 and not rx.parked
    answers = [type(a.msg) for a in out if isinstance(a, ToDecode)]  # the claim's answer first: a connection that
    assert answers == [protocol.ClaimOk, protocol.OpenOk]  # opened, then claimed, waits for it (its call's reply)
    rx.on_local(b"early", protocol.Release(req_id="c"), 4)
    assert "c" not in rx.reqs  # its one reader released it
    rx.check()


def test_a_live_request_whose_failure_path_breaks_still_gets_its_sender_fenced_before_its_pages_are_reused(
        monkeypatch):
    """An internal error in a live request's handler, and its failure path breaking too: the request is dropped and
    its pages reclaimed, but its sender may still be writing them. They wait, unfenced, and the sender is fenced at
    the next tick, as at an expired lease. Before, they went to the plain quarantine, and came back into use after
    it while that sender, never fenced, could still write them."""
    rx = receiver(pages=8, lease_ms=30_000, quarantine_ms=50)
    rx.on_control(b"s", protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC), 0)
    alloc = protocol.AllocRequest(req_id="a", chunk_keys=chunk_keys(list(range(48)), LAY), last_chunk_tokens=16,
                                  lease_ms=30_000)
    assert msgs(rx.on_control(b"s", alloc, 0), ToSender, protocol.AllocResponse)
    monkeypatch.setattr(rx, "_layer_done", lambda *a: 1 / 0)
    monkeypatch.setattr(rx, "_fail", lambda *a, **k: 1 / 0)
    [err] = msgs(rx.on_control(b"s", protocol.LayerDone(req_id="a", layers=[0]), 1), ToSender, protocol.Error)
    assert err.code is ErrorCode.INTERNAL and "a" not in rx.reqs
    assert rx.pool.unfenced_pages == 3 and rx.pool.quarantined_pages == 0
    assert FenceSender(b"s") in rx.on_tick(2)
    assert rx.pool.unfenced_pages == 0 and rx.pool.quarantined_pages == 3
    rx.check()


def test_a_failure_path_that_breaks_in_the_pool_leaves_no_request_behind(monkeypatch):
    """The pool raising as a live request fails (an Abort): the request stayed, ended (its state changed first), with
    its pages, for good, and its id refused as a duplicate. Its state changes only once its pages are in hand, so the
    guard sees it live, fails it again, and nothing is left."""
    rx = receiver(pages=8, lease_ms=30_000, quarantine_ms=50)
    rx.on_control(b"s", protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC), 0)
    alloc = protocol.AllocRequest(req_id="a", chunk_keys=chunk_keys(list(range(48)), LAY), last_chunk_tokens=16,
                                  lease_ms=30_000)
    assert msgs(rx.on_control(b"s", alloc, 0), ToSender, protocol.AllocResponse)
    real, calls = rx.pool.abort, []

    def once(*a, **k):
        calls.append(a)
        if len(calls) == 1:
            raise RuntimeError("a bug in the pool's accounting")
        return real(*a, **k)

    monkeypatch.setattr(rx.pool, "abort", once)
    [err] = msgs(rx.on_control(b"s", protocol.Abort(req_id="a", settled=True), 1), ToSender, protocol.Error)
    assert err.code is ErrorCode.INTERNAL and "a" not in rx.reqs and len(calls) == 2
    rx.check()
    # (the guard's failure is not the settled Abort's: the pages wait for a settled Abort or the sender's fence)
    assert FenceSender(b"s") in rx.on_tick(30_002)
    rx.on_tick(30_060)  # out of quarantine
    assert rx.pool.free_pages == 8
    rx.on_control(b"s", protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC),
                  30_061)
    assert msgs(rx.on_control(b"s", alloc, 30_061), ToSender, protocol.AllocResponse)  # the id again: no duplicate


def test_a_senders_pushes_that_nobody_reads_are_capped(monkeypatch):
    """Pushes whose chunks are all held already take no page and no lease: a sender could commit any number, each
    kept (committed_ttl_ms, 10 min) with its keys and pins. Past MAX_UNREAD_PER_SENDER committed and unopened, the
    oldest goes; one being read never does, and another sender's are not touched."""
    from pdpush.sessions import receiver as rxmod

    monkeypatch.setattr(rxmod, "MAX_UNREAD_PER_SENDER", 4)
    rx = receiver(pages=16)
    hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=SPEC)
    keys = chunk_keys(list(range(32)), LAY)
    for ident in (b"a", b"b"):
        rx.on_control(ident, hello, 0)

    def push(ident, rid, now):
        assert msgs(rx.on_control(ident, protocol.AllocRequest(req_id=rid, chunk_keys=keys, last_chunk_tokens=16,
                                                               lease_ms=1000), now), ToSender, protocol.AllocResponse)
        assert msgs(rx.on_control(ident, protocol.Commit(req_id=rid, layers=LAY.layers), now), ToSender,
                    protocol.CommitAck)

    push(b"b", "b-0", 0)
    push(b"a", "a-0", 1)
    assert msgs(rx.on_local(DEC, protocol.Open(req_id="a-0"), 1), ToDecode, protocol.OpenOk)  # read: stays
    for i in range(1, 10):
        push(b"a", f"a-{i}", 1 + i)
    unread = sorted(r for r in rx.reqs if r.startswith("a-") and not rx.reqs[r].readers)
    assert unread == ["a-6", "a-7", "a-8", "a-9"] and "a-0" in rx.reqs and "b-0" in rx.reqs
    assert rx.counters.values["requests_unread_dropped"] == 5
    assert msgs(rx.on_local(DEC, protocol.Open(req_id="a-1"), 20), ToDecode, protocol.Error)  # gone, said so
    rx.check()
