"""Codec round trip, bounded decoding, and the receiver's request state machine (no sockets)."""

from __future__ import annotations

import re

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpush import protocol as P
from pdpush.errors import ErrorCode, IncompatiblePeer, RemoteProtocolError

KEY = b"\x01" * 16
SPEC = P.LayoutSpec(layers=2, kv_heads=2, head_dim=64, dtype="float16", chunk_tokens=16)

SAMPLES = [
    P.Hello(version=P.PROTOCOL_VERSION, fingerprint="ab", layout=SPEC),
    P.HelloAck(version=1, fingerprint="ab", layout=SPEC, pool_base=1 << 40, pool_pages=8, page_bytes=4096, ready_base=7,
               rkey=b"\x00\xff" * 20, ucx_host="127.0.0.1", ucx_port=5711, ucx_token=b"t" * 32),
    P.AllocRequest(req_id="r", chunk_keys=[KEY, b"\x02" * 16], last_chunk_tokens=3, lease_ms=100),
    P.AllocResponse(req_id="r", already_sent_indexes=[0], page_runs=[(4, 1)], lease_id=7, lease_ms=99),
    P.LayerDone(req_id="r", layers=[1, 2], checksums=[(1 << 64) - 1, 0]),
    P.LayerDone(req_id="r", layers=[0]),
    P.Commit(req_id="r", layers=2), P.CommitAck(req_id="r", chunks_committed=1), P.Abort(req_id="r", reason="x"),
    P.Error(code=ErrorCode.POOL_EXHAUSTED, message="full", req_id="r", retry_after_ms=50),
    P.StatusRequest(), P.StatusReply(stats={"a": 1, "b": "x", "c": 1.5, "d": True}),
    P.Begin(req_id="r", receiver="tcp://h:1", layout=SPEC, chunk_keys=[KEY], last_chunk_tokens=16),
    P.BeginOk(req_id="r", already_sent_indexes=[], staging_shmid=3, staging_bytes=1 << 20, staging_offset=0,
              new_chunks=1, daemon_id="5e1d"),
    P.LayerReady(req_id="r", layers=[0]), P.Finish(req_id="r"),
    P.NeedStaging(req_id="r", unit=3), P.StagingGranted(req_id="r", unit=3), P.Wake(), P.Bye(),
    P.Done(req_id="r", bytes_sent=10, puts=1, layers=2, chunks_skipped=0, layer_done_ms=[1.0, 2.0]),
    P.Open(req_id="r"),
    P.OpenOk(req_id="r", shmid=1, pool_base=5, pool_pages=8, layout=SPEC, pages=[1, 2], last_chunk_tokens=4,
             layers_ready=[0], committed=False),
    P.LayerAvailable(req_id="r", layers=[1, 3]), P.Committed(req_id="r"), P.Release(req_id="r"),
    P.Query(chunk_keys=[KEY], req_id="r"), P.QueryReply(held_prefix=1), P.Ok(req_id=None),
    P.Claim(req_id="c", chunk_keys=[KEY], last_chunk_tokens=3, lease_ms=10), P.ClaimOk(req_id="c", chunks=1),
    P.IndexSubscribe(), P.IndexSubscribe(snapshot=False), P.Withdraw(req_id="r", reason="the prefill leg failed"),
    P.Unread(req_id="r", reason="its client hung up"),
    P.IndexSnapshot(epoch="e", seq=3, layout=SPEC, keys=[KEY], load=P.IndexLoad(pages_free=1, pages_total=2,
                                                                                  requests_inflight=0)),
    P.IndexEvent(epoch="e", seq=4, kind="evicted", keys=[KEY], load=P.IndexLoad(pages_free=1, pages_total=2,
                                                                                 requests_inflight=1)),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.type)
def test_round_trip(msg):
    assert P.decode(P.encode(msg)) == msg


def test_every_message_type_is_sampled():
    sampled = {m.type for m in SAMPLES}
    declared = {cls.model_fields["type"].default for cls in P.Msg.__subclasses__() if "type" in cls.model_fields}
    assert declared <= sampled


def test_messages_are_frozen():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        SAMPLES[0].version = 2  # type: ignore[misc]


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", msgpack.packb(None), msgpack.packb([]), msgpack.packb({"type": 3}),
    msgpack.packb({"type": "alloc", "req_id": "", "chunk_keys": [KEY], "last_chunk_tokens": 1, "lease_ms": 1}),
    msgpack.packb({"type": "layer_done", "req_id": "r", "layer": -1}),
    msgpack.packb({"type": "commit", "req_id": "r", "extra": 1}),
    msgpack.packb({"type": "hello", "version": 1, "fingerprint": "x", "layout": {"layers": 0}}),
    msgpack.packb({1: 2}),
    msgpack.packb({"type": ["begin"]}), msgpack.packb({"type": {}, "req_id": "r"}),  # (unhashable: a TypeError was)
])
def test_garbage_is_a_remote_protocol_error(frame):
    with pytest.raises(RemoteProtocolError):
        P.decode(frame)


@pytest.mark.parametrize("kind", ["begin", "alloc", "claim"])
def test_a_last_chunk_of_more_tokens_than_any_chunk_is_refused_at_decode(kind):
    """A prompt's last chunk holds at most a chunk's tokens (at most 2**20): a count past that is refused before any
    plan is made of it (a sender built one entry per token it implied: 10**12 took its memory)."""
    obj = msgpack.unpackb(P.encode(next(m for m in SAMPLES if m.type == kind)))
    for n, ok in ((1 << 20, True), ((1 << 20) + 1, False), (10**12, False)):
        obj["last_chunk_tokens"] = n
        if ok:
            assert P.decode(msgpack.packb(obj)).last_chunk_tokens == n
        else:
            for fast in (True, False):
                with pytest.raises(RemoteProtocolError, match="last_chunk_tokens"):
                    P.decode(msgpack.packb(obj), fast=fast)


def test_frame_cap():
    frame = P.encode(P.Query(chunk_keys=[KEY] * 1000))
    with pytest.raises(RemoteProtocolError) as e:
        P.decode(frame, max_frame=len(frame) - 1)
    assert e.value.code is ErrorCode.TOO_LARGE
    assert P.decode(frame, max_frame=len(frame)).chunk_keys[0] == KEY


def test_a_batch_carries_each_message_as_encoded_and_one_bad_entry_costs_only_itself():
    msgs = SAMPLES[:20]
    frame = P.encode_batch([P.encode(m) for m in msgs])  # 20 entries: the array-16 header
    assert P.decode_batch(frame) == msgs
    assert P.encode_batch([P.encode(msgs[0])]) == P.encode(msgs[0])  # one message goes as itself
    assert P.decode_batch(P.encode(msgs[0])) == [msgs[0]]
    got = P.decode_batch(P.encode_batch([P.encode(msgs[0]), msgpack.packb({"type": "nope"}), msgpack.packb(7),
                                         msgpack.packb({"type": ["ok"], "req_id": "r"}),
                                         msgpack.packb({"type": "query", "chunk_keys": [], "local_version": 3}),
                                         P.encode(msgs[1])]))
    assert got[0] == msgs[0] and all(isinstance(e, RemoteProtocolError) for e in got[1:4])
    assert isinstance(got[4], IncompatiblePeer) and got[5] == msgs[1]  # (another local protocol's: it raised, and
    # the whole batch was lost)
    for bad in (msgpack.packb([]), msgpack.packb([{"type": "ok"}]), msgpack.packb([{"type": "ok"}] * (P.MAX_BATCH + 1)),
                msgpack.packb(3)):
        with pytest.raises(RemoteProtocolError):
            P.decode_batch(bad)
    with pytest.raises(RemoteProtocolError) as e:
        P.decode_batch(frame, max_frame=len(frame) - 1)
    assert e.value.code is ErrorCode.TOO_LARGE


def test_the_outbox_sends_a_pass_in_one_frame_per_peer_in_order_and_counts_shares():
    from pdpush.daemon import Outbox, WireCount

    wire = WireCount()
    box = Outbox(wire, batch_bytes=200)
    big = P.Query(chunk_keys=[KEY] * 20)  # over the frame budget: goes alone
    for m in (P.Commit(req_id="a", layers=2), P.Ok(req_id="b"), big, P.Ok(req_id="c")):
        box.post("x", m)
    box.post("y", P.Ok(req_id="d"))
    sent: list = []
    assert box.flush(lambda peer, frame: sent.append((peer, P.decode_batch(frame))) or True) == []
    assert [(p, [m.req_id for m in ms]) for p, ms in sent] == [("x", ["a", "b"]), ("x", [None]), ("x", ["c"]),
                                                               ("y", ["d"])]
    assert not box and wire.frames["out"] == 4
    assert wire.by == {"out:commit": 0.5, "out:ok": 2.5, "out:query": 1.0}
    box.post("x", P.Ok(req_id="e"))
    box.post("x", P.Ok(req_id="f"))
    assert box.flush(lambda peer, frame: False) == ["x"] and not box  # a peer that cannot take it: said, dropped


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_escape_the_taxonomy(data):
    for decode in (P.decode, P.decode_batch):
        try:
            decode(data)
        except RemoteProtocolError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "req_id", "layer", "chunk_keys", "code", "message", "x"]),
                       st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.text(max_size=8), st.binary(max_size=20),
                                 st.sampled_from(["alloc", "commit", "layer_done", "error", "hello"]),
                                 st.lists(st.text(max_size=3), max_size=2),
                                 st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2)),
                       max_size=6))
def test_random_maps_never_escape_the_taxonomy(obj):
    try:
        P.decode(msgpack.packb(obj))
    except RemoteProtocolError:
        pass


def test_state_machine_table():
    S, E = P.ReqState, P.ReqEvent
    s = P.transition(S.ALLOCATED, E.LAYER_DONE, "r")
    assert s is S.STREAMING
    assert P.transition(s, E.COMMIT, "r") is S.COMMITTED
    with pytest.raises(RemoteProtocolError, match="receiver request: request .r. is committed; layer_done"):
        P.transition(S.COMMITTED, E.LAYER_DONE, "r")
    with pytest.raises(RemoteProtocolError):
        P.transition(S.ABORTED, E.COMMIT, "r")
    # completion on the data path: a live request's words commit it, once; nothing after an end
    assert P.transition(S.ALLOCATED, E.WORDS, "r") is S.COMMITTED and P.transition(s, E.WORDS, "r") is S.COMMITTED
    for ended in (S.COMMITTED, S.ABORTED, S.EXPIRED):
        with pytest.raises(RemoteProtocolError):
            P.transition(ended, E.WORDS, "r")
    T, X = P.TxState, P.TxEvent  # the sender: done from streaming by its words, or by the CommitAck after a Commit
    assert P.SENDER_REQUEST.next(T.STREAMING, X.LANDED, "r") is T.DONE
    assert P.SENDER_REQUEST.next(T.COMMITTING, X.COMMIT_ACK, "r") is T.DONE
    for state in (T.ALLOCATING, T.COMMITTING, T.DONE, T.FAILED):
        assert not P.SENDER_REQUEST.allows(state, X.LANDED)


@pytest.mark.parametrize("msg", [m for m in SAMPLES if "local_version" in type(m).model_fields], ids=lambda m: m.type)
def test_an_engine_s_and_its_daemon_s_messages_carry_their_local_protocol_and_another_is_refused(msg):
    """Begin/BeginOk, Open/OpenOk, Claim/ClaimOk and Query/QueryReply carry the local protocol of the pdpush that sent
    them (an engine's and its daemon's come from separate images). One of a pdpush from before it was numbered (the
    field absent: 0) or of another, whose fields may differ (one more here), is an IncompatiblePeer naming both
    versions and the request, before its fields are read; an engine reading it as an answer files it as that request's
    Error. A Query's refusal names no request, as its answer names none: the engine's wait for the answer gets it."""
    assert msg.local_version == P.LOCAL_PROTOCOL_VERSION and P.decode(P.encode(msg)) == msg
    old = msgpack.unpackb(P.encode(msg), raw=False)
    del old["local_version"]
    newer = {**old, "local_version": P.LOCAL_PROTOCOL_VERSION + 1, "a_field_of_the_next_one": 1}
    for frame, theirs in ((msgpack.packb(old, use_bin_type=True), "0 (a pdpush from before"),
                          (msgpack.packb(newer, use_bin_type=True), str(P.LOCAL_PROTOCOL_VERSION + 1))):
        with pytest.raises(IncompatiblePeer, match=re.escape(f"local protocol {theirs}")) as e:
            P.decode(frame)
        named = None if msg.type == "query" else getattr(msg, "req_id", None)
        assert e.value.req_id == named
        if named is None:  # nothing to file it under: raised to the wait that reads it
            with pytest.raises(IncompatiblePeer):
                P.decode_answer(frame)
            continue
        answer = P.decode_answer(frame)
        assert isinstance(answer, P.Error) and answer.code is ErrorCode.INCOMPATIBLE_PEER and answer.req_id == msg.req_id
    nameless = msgpack.packb({**old, "req_id": 7}, use_bin_type=True)  # no request to file it under: raised
    with pytest.raises(IncompatiblePeer) as e:
        P.decode_answer(nameless)
    assert e.value.req_id is None
