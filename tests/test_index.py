"""The chunk-index feed and a router's view of it, and Claim (open by chunk keys): pure logic,
driven through the receiver session with a clock the test moves."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pdpush import protocol
from pdpush.errors import ErrorCode
from pdpush.index import IndexFeed, IndexView
from pdpush.layout import chunk_keys
from pdpush.protocol import IndexEvent, IndexLoad, IndexSnapshot, IndexSubscribe
from pdpush.sessions.receiver import ToDecode, ToSender
from tests.test_sessions import LAY, SPEC, Wire

RX = "tcp://rx-a:1"
SUB = b"router-1"
LOAD = IndexLoad(pages_free=1, pages_total=2, requests_inflight=0)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def feed_msgs(actions, ident=SUB):
    return [a.msg for a in actions if isinstance(a, ToSender) and a.ident == ident
            and isinstance(a.msg, (IndexSnapshot, IndexEvent))]


def subscribe(w: Wire, ident: bytes = SUB, snapshot: bool = True):
    return feed_msgs(w.rx[RX].on_control(ident, IndexSubscribe(snapshot=snapshot), w.now), ident)


def test_a_subscriber_gets_a_snapshot_then_every_change_in_sequence():
    w = Wire()
    rx = w.rx[RX]
    w.push("a", list(range(40)))
    w.complete()
    [snap] = subscribe(w)
    view = IndexView()
    view.on_snapshot(snap, w.now)
    assert view.keys == set(chunk_keys(list(range(40)), LAY)) and snap.layout == SPEC
    # later commits reach the subscriber as `stored` events with the next sequence numbers
    seen = []
    orig = rx.on_control

    def spy(ident, msg, now):
        out = orig(ident, msg, now)
        seen.extend(feed_msgs(out))
        return out

    rx.on_control = spy
    w.push("b", list(range(100, 140)))
    w.complete()
    assert [e.kind for e in seen] == ["stored"] and seen[0].seq == snap.seq + 1
    assert all(view.on_event(e, w.now) for e in seen)
    assert view.held_prefix(chunk_keys(list(range(100, 140)), LAY)) == 3
    assert view.keys == set(rx.pool.indexed_keys())


def test_a_push_that_commits_on_its_words_is_published_at_the_tick_that_sees_them():
    """A push that completes on the data path commits at the receiver's next look at its words, a tick with no
    message behind it: its chunks reach the subscribers then, not at whatever message the receiver gets next
    (on an idle receiver, none: a router's view missed them, and routed a request sharing that prefix blind)."""
    w = Wire(rx_words=True)
    rx = w.rx[RX]
    [snap] = subscribe(w)
    view = IndexView()
    view.on_snapshot(snap, w.now)
    w.push("a", list(range(40)))
    while w.posted:  # the data, then the readiness words, land
        w.run(w.flushed(w.posted.pop(0)))
    assert rx.reqs["a"].state is protocol.ReqState.ALLOCATED  # the receiver has not looked yet
    events = feed_msgs(rx.on_tick(w.rx_now + 10))
    assert rx.reqs["a"].state is protocol.ReqState.COMMITTED
    assert [e.kind for e in events] == ["stored"] and all(view.on_event(e, w.now) for e in events)
    assert view.keys == set(rx.pool.indexed_keys()) == set(chunk_keys(list(range(40)), LAY))


def test_eviction_is_published_and_a_heartbeat_carries_seq_and_load():
    w = Wire()
    rx = w.rx[RX]
    [snap] = subscribe(w)
    view = IndexView()
    view.on_snapshot(snap, 0)
    events = []
    orig = rx.on_control
    rx.on_control = lambda i, m, n: (lambda out: (events.extend(feed_msgs(out)), out)[1])(orig(i, m, n))
    for i in range(30):  # 64 pages, 3 chunks a prompt: the pool fills and evicts LRU chunks
        w.push(f"r{i}", list(range(1000 * i, 1000 * i + 40)))
        w.complete()
        for r in [r for r in list(rx.reqs.values()) if r.state is protocol.ReqState.COMMITTED]:
            rx.on_local(b"d", protocol.Open(req_id=r.req_id), w.now)
            rx.on_local(b"d", protocol.Release(req_id=r.req_id), w.now)  # read: unpinned
    assert {e.kind for e in events} == {"stored", "evicted"}
    for e in events:
        assert view.on_event(e, w.now)
    assert view.keys == set(rx.pool.indexed_keys()) and rx.pool.counters["chunks_evicted"] > 0
    hb = feed_msgs(rx.on_tick(w.now + 5000))
    assert [e.kind for e in hb] == ["heartbeat"] and hb[0].seq == view.seq
    assert hb[0].load.pages_total == 64 and view.on_event(hb[0], w.now + 5000)


def test_a_gap_or_a_new_epoch_loses_the_view_until_a_snapshot():
    f = IndexFeed("e1", SPEC)
    f.subscribe(SUB, True, [], LOAD, 0)
    view = IndexView()
    view.on_snapshot(f.subscribe(SUB, True, [], LOAD, 0)[0][1], 0)
    e1 = f.change("stored", [key(1)], LOAD, 1)[0][1]
    f.change("stored", [key(2)], LOAD, 2)  # lost on the way
    e3 = f.change("evicted", [key(1)], LOAD, 3)[0][1]
    assert view.on_event(e1, 1) and view.held_prefix([key(1)]) == 1
    assert not view.on_event(e3, 3) and not view.synced and view.held_prefix([key(1)]) == 0
    assert view.want_snapshot(3) and not view.want_snapshot(4)  # one ask in flight, not a storm
    view.on_snapshot(f.subscribe(SUB, True, [key(2)], LOAD, 5)[0][1], 5)
    assert view.synced and view.keys == {key(2)} and view.resyncs == 1
    assert view.on_event(e3, 6)  # a late duplicate already folded into the snapshot is ignored
    # a heartbeat that shows a later seq is a gap too
    f.change("stored", [key(3)], LOAD, 7)
    assert not view.on_event(f.tick(LOAD, 10_000)[0][1], 10_000)
    # the receiver restarted: same seq numbers, another epoch
    view.on_snapshot(f.subscribe(SUB, True, [key(2), key(3)], LOAD, 10_001)[0][1], 10_001)
    g = IndexFeed("e2", SPEC)
    g.subscribe(SUB, False, [], LOAD, 0)
    ev = g.change("stored", [key(9)], LOAD, 1)[0][1]
    assert not view.on_event(ev, 10_002) and view.keys == set()
    # `cleared` empties the view in sequence
    view.on_snapshot(g.subscribe(SUB, True, [key(9)], LOAD, 2)[0][1], 2)
    assert view.on_event(g.change("cleared", [], LOAD, 3)[0][1], 3) and view.keys == set() and view.synced


def test_silent_subscribers_expire_and_the_count_is_capped():
    f = IndexFeed("e", SPEC, max_subscribers=3, expire_ms=100)
    for i in range(5):
        f.subscribe(bytes([i]), False, [], LOAD, i)
    assert set(f.subscribers) == {bytes([2]), bytes([3]), bytes([4])}
    f.subscribe(bytes([2]), False, [], LOAD, 90)  # a keep-alive
    f.tick(LOAD, 104)
    assert set(f.subscribers) == {bytes([2])}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["stored", "evicted", "cleared", "drop", "hb", "resub"]),
                          st.lists(st.integers(0, 20), max_size=4)), max_size=60))
def test_a_view_with_resyncs_always_ends_equal_to_the_receiver(ops):
    """Whatever is lost on the way, a view that asks for snapshots when told to converges. The
    router's feed keeps its subscription alive every KEEPALIVE_S (router/feeds.py); "resub" is an
    extra keep-alive. (Without keep-alives the receiver rightly forgets a silent subscriber.)"""
    from pdpush.router.feeds import KEEPALIVE_S

    truth: set[bytes] = set()
    f = IndexFeed("e", SPEC)
    view = IndexView()
    view.on_snapshot(f.subscribe(SUB, True, [], LOAD, 0)[0][1], 0)
    now = last_keepalive = 0
    for kind, ks in ops:
        now += 1000
        keys = [key(k) for k in ks]
        if kind == "resub" or now - last_keepalive >= KEEPALIVE_S * 1000:
            f.subscribe(SUB, False, [], LOAD, now)
            last_keepalive = now
        if kind == "resub":
            continue
        if kind == "hb":
            evs = f.tick(LOAD, now)
        else:
            real = "stored" if kind == "drop" else kind
            if real == "stored":
                truth.update(keys)
            elif real == "evicted":
                truth.difference_update(keys)
            else:
                truth.clear()
            evs = f.change(real, keys, LOAD, now)
            if kind == "drop":
                evs = []
        for _, ev in evs:
            if not view.on_event(ev, now) and view.want_snapshot(now, retry_ms=0):
                view.on_snapshot(f.subscribe(SUB, True, sorted(truth), LOAD, now)[0][1], now)
    now += 1000
    for _, ev in f.tick(LOAD, now):  # a heartbeat shows any trailing loss
        if not view.on_event(ev, now) and view.want_snapshot(now, retry_ms=0):
            view.on_snapshot(f.subscribe(SUB, True, sorted(truth), LOAD, now)[0][1], now)
    assert view.synced and view.keys == truth


def claim(w: Wire, rid: str, ids: list[int], lease_ms: int = 500, ident: bytes = b"d"):
    keys = chunk_keys(ids, LAY)
    msg = protocol.Claim(req_id=rid, chunk_keys=keys, last_chunk_tokens=len(ids) - (len(keys) - 1) * LAY.chunk_tokens,
                         lease_ms=lease_ms)
    return [a.msg for a in w.rx[RX].on_local(ident, msg, w.now) if isinstance(a, ToDecode)][0]


def test_claim_pins_the_held_prefix_and_opens_like_a_committed_push():
    w = Wire()
    rx = w.rx[RX]
    base = list(range(48))  # 3 full chunks
    w.push("p", base)
    w.complete()
    rx.on_local(b"d", protocol.Open(req_id="p"), w.now)  # read, then released: unpinned
    rx.on_local(b"d", protocol.Release(req_id="p"), w.now)
    assert "p" not in rx.reqs and rx.pool.chunks_cached == 3
    longer = base + [7, 8, 9, 10, 11]
    ok = claim(w, "c1", longer)
    assert isinstance(ok, protocol.ClaimOk) and ok.chunks == 3
    assert claim(w, "c1", longer).chunks == 3  # idempotent
    other = claim(w, "c1", list(range(1000, 1048)))  # the id claimed again for another prompt: not its pages
    assert isinstance(other, protocol.Error) and other.code is ErrorCode.DUPLICATE_REQUEST
    r = rx.reqs["c1"]
    assert r.state is protocol.ReqState.COMMITTED and r.claimed and r.alloc.new_idx == []
    # pinned: a full pool does not evict them
    for i in range(30):
        w.push(f"f{i}", list(range(5000 + 100 * i, 5000 + 100 * i + 40)))
        w.complete()
        rx.on_local(b"d", protocol.Open(req_id=f"f{i}"), w.now)
        rx.on_local(b"d", protocol.Release(req_id=f"f{i}"), w.now)
    assert rx.pool.held_prefix(chunk_keys(longer, LAY)) == 3
    [opened] = [a.msg for a in rx.on_local(b"d", protocol.Open(req_id="c1"), w.now) if isinstance(a, ToDecode)]
    assert opened.committed and opened.layers_ready == list(range(LAY.layers)) and len(opened.pages) == 3
    assert opened.last_chunk_tokens == LAY.chunk_tokens
    assert opened.last_key == chunk_keys(longer, LAY)[2]  # the last chunk it claimed: an open can tell the prompt
    rx.on_local(b"d", protocol.Release(req_id="c1"), w.now)
    assert "c1" not in rx.reqs
    rx.check()
    # the whole prompt held (its partial last chunk too): its own last_chunk_tokens
    w.push("q", list(range(200, 240)))
    w.complete()
    assert claim(w, "c2", list(range(200, 240))).chunks == 3 and rx.reqs["c2"].last_chunk_tokens == 8


def test_one_decode_connection_holds_a_bounded_number_of_claims(monkeypatch):
    """Each claim pins its chunks until read or its lease: one connection claiming one prompt under id after id
    (20,000 of them held ~90 MB and pinned every chunk, so pushes found the pool exhausted) is refused past
    CLAIMS_PER_READER, typed; another connection is not, and a claim read and released makes room."""
    from pdpush.sessions import receiver as rxmod

    monkeypatch.setattr(rxmod, "CLAIMS_PER_READER", 3)
    monkeypatch.setattr(rxmod, "CLAIMS_ALL", 4)  # and all connections together (one made again is another)
    w = Wire()
    rx = w.rx[RX]
    w.push("p", list(range(48)))
    w.complete()
    rx.on_local(b"d", protocol.Open(req_id="p"), w.now)
    rx.on_local(b"d", protocol.Release(req_id="p"), w.now)
    assert [claim(w, f"c{i}", list(range(48))).chunks for i in range(3)] == [3, 3, 3]
    err = claim(w, "c3", list(range(48)))
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.TOO_LARGE and "c3" not in rx.reqs
    assert claim(w, "other", list(range(48)), ident=b"e").chunks == 3
    err = claim(w, "third", list(range(48)), ident=b"f")
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.TOO_LARGE and "the receiver holds" in err.message
    rx.check()
    rx.on_local(b"d", protocol.Open(req_id="c0"), w.now)
    rx.on_local(b"d", protocol.Release(req_id="c0"), w.now)
    assert claim(w, "c3", list(range(48))).chunks == 3
    rx.check()


def test_claim_of_nothing_held_makes_nothing_and_an_unopened_claim_ends_at_its_lease():
    w = Wire()
    rx = w.rx[RX]
    assert claim(w, "none", list(range(40))).chunks == 0 and "none" not in rx.reqs
    w.push("p", list(range(40)))
    w.complete()
    assert claim(w, "c", list(range(40)), lease_ms=200).chunks == 3
    err = claim(w, "p", list(range(40)))
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.DUPLICATE_REQUEST
    w.tick(150)
    assert "c" in rx.reqs
    w.tick(100)
    assert "c" not in rx.reqs
    err = claim(w, "c", list(range(40)))  # ended: a new claim under the same id is refused
    assert isinstance(err, protocol.Error) and err.code is ErrorCode.UNKNOWN_REQUEST
    rx.check()


def test_feed_sequence_moves_without_subscribers_so_a_late_snapshot_is_exact():
    w = Wire()
    rx = w.rx[RX]
    rnd = random.Random(1)
    for i in range(3):
        w.push(f"r{i}", [rnd.randrange(1000) for _ in range(40)])
        w.complete()
    [snap] = subscribe(w)
    assert snap.seq == rx.feed.seq == 3 and set(snap.keys) == set(rx.pool.indexed_keys())
