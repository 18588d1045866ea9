"""Real daemons, real ZeroMQ, real UCX on loopback: bytes end to end."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from pdpush import lifeline, protocol
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.errors import Aborted, ErrorCode, IncompatiblePeer, PdpushError
from pdpush.layout import KVLayout, chunk_keys
from tests.helpers import kv, push, read_back, round_trip, rx_opts, sock, writable_pool

LAYOUTS = [
    # (layout, prompt tokens): fp16 GQA with a partial last chunk; bf16 MHA-ish; fp32 with 1 KV head
    (KVLayout(4, 2, 64, "float16", 16), 100),
    (KVLayout(3, 8, 128, "bfloat16", 32), 96),
    (KVLayout(2, 1, 32, "float32", 8), 21),
]


@pytest.mark.parametrize("layout,tokens", LAYOUTS, ids=["fp16-gqa-partial", "bf16-8heads", "fp32-1head-partial"])
def test_byte_exact_transfer(daemons, layout, tokens):
    rx = daemons.receiver(**rx_opts(layout))
    tx = daemons.sender(rx)
    pc = PrefillClient(layout, sock(tx), timeout_s=30)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        k, v = kv(layout, tokens, seed=tokens)
        ids = list(range(1000, 1000 + tokens))
        h, done = push(pc, "req-a", ids, k, v)
        assert h.already_sent_indexes == []
        assert done.layers == layout.layers
        assert done.bytes_sent == layout.layers * layout.num_chunks(tokens) * layout.page_bytes
        # one put per layer: a fresh pool hands out one contiguous run
        assert done.puts == layout.layers
        k2, v2 = read_back(dc, "req-a", layout, tokens, torch_check=True)
        assert np.array_equal(k2, k) and np.array_equal(v2, v)
        # a released request is gone: opening it again fails fast with a typed error
        with pytest.raises(PdpushError, match="released"):
            dc.open("req-a", timeout_s=10)
    finally:
        pc.close()
        dc.close()


def test_prefix_reuse_moves_only_new_chunks(daemons):
    layout = KVLayout(4, 2, 64, "float16", 16)
    rx = daemons.receiver(**rx_opts(layout))
    tx = daemons.sender(rx)
    pc = PrefillClient(layout, sock(tx), timeout_s=30)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        k1, v1 = kv(layout, 80, seed=1)
        ids1 = list(range(80))
        _, d1 = push(pc, "first", ids1, k1, v1)
        read_back(dc, "first", layout, 80)
        # the second prompt shares the first 56 tokens = 3 full chunks (48 tokens) + part of the 4th
        ids2 = ids1[:56] + list(range(5000, 5044))
        k2, v2 = kv(layout, 100, seed=2)
        k2[:, :56], v2[:, :56] = k1[:, :56], v1[:, :56]
        before = status(sock(rx))
        assert dc.held_prefix(ids2, layout) == 3
        h, d2 = push(pc, "second", ids2, k2, v2)
        after = status(sock(rx))
        assert h.already_sent_indexes == [0, 1, 2]
        assert d2.chunks_skipped == 3
        new_chunks = layout.num_chunks(100) - 3
        assert d2.bytes_sent == layout.layers * new_chunks * layout.page_bytes
        assert d1.bytes_sent == layout.layers * 5 * layout.page_bytes
        assert after["chunks_hit"] - before["chunks_hit"] == 3
        assert after["bytes_received"] - before["bytes_received"] == d2.bytes_sent
        got_k, got_v = read_back(dc, "second", layout, 100)
        assert np.array_equal(got_k, k2) and np.array_equal(got_v, v2)
        tx_stats = status(sock(tx))
        assert tx_stats["chunks_skipped"] == 3 and tx_stats["requests_done"] == 2
    finally:
        pc.close()
        dc.close()


def test_a_begin_not_waited_for_is_allocated_while_the_engine_computes_and_can_be_given_up(daemons):
    """``begin_nowait``: the Begin goes, the engine goes on (its forward), the receiver allocates meanwhile; ``wait``
    gives the handle. One given up before its answer frees its pages; its ``wait`` raises Aborted."""
    import time

    layout = KVLayout(4, 2, 64, "float16", 16)
    rx = daemons.receiver(**rx_opts(layout), quarantine_ms=100)
    tx = daemons.sender(rx)
    pc = PrefillClient(layout, sock(tx), timeout_s=30)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        pending = pc.begin_nowait("nw", list(range(40)))
        deadline = time.monotonic() + 10
        while status(sock(rx))["requests_total"] < 1:  # allocated before anyone waits for it
            assert time.monotonic() < deadline, "the receiver never saw the allocation"
            time.sleep(0.01)
        h = pending.wait()
        k, v = kv(layout, 40, seed=7)
        for layer in range(layout.layers):
            h.put_layer(layer, k[layer], v[layer])
        assert h.finish(timeout_s=30).layers == layout.layers
        k2, v2 = read_back(dc, "nw", layout, 40)
        assert np.array_equal(k2, k) and np.array_equal(v2, v)
        free = status(sock(rx))["pool_pages_free"]
        gone = pc.begin_nowait("given-up", list(range(100, 140)))
        gone.abort("the forward failed")
        with pytest.raises(Aborted):
            gone.wait()
        deadline = time.monotonic() + 10
        while status(sock(tx))["requests_inflight"]:
            assert time.monotonic() < deadline, "the sender kept the request given up"
            time.sleep(0.01)
        h = pc.begin("after", list(range(200, 216)))  # the connection answers the next one, not the one given up
        assert h.req_id == "after" and h.plan.n_new == 1
        h.abort("done with it")
        deadline = time.monotonic() + 10
        while status(sock(rx))["pool_pages_free"] != free:  # nothing held: the given-up requests' pages came back
            assert time.monotonic() < deadline, status(sock(rx))
            time.sleep(0.05)
    finally:
        pc.close()
        dc.close()


def test_the_clients_keep_no_mail_for_requests_that_ended(daemons):
    """An engine's clients live as long as the engine: whatever they filed for a request (an answer read while
    waiting for another's, the BeginOk a look at the socket found) goes when that request ends, done or refused.
    They kept an empty mailbox for every request before: a few hundred bytes each, for ever."""
    layout = KVLayout(4, 2, 64, "float16", 16)
    rx = daemons.receiver(**rx_opts(layout))
    tx = daemons.sender(rx)
    pc = PrefillClient(layout, sock(tx), timeout_s=30)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        for i in range(3):  # as the vLLM worker pushes: begun ahead, its answer found by a look, layer by layer
            ids = list(range(100 * i, 100 * i + 40))
            pending = pc.begin_nowait(f"p{i}", ids)
            while not pending.answered():
                pass
            h = pending.wait()
            k, v = kv(layout, 40, seed=i)
            for layer in range(layout.layers):
                h.put_layer(layer, k[layer], v[layer])
            h.finish(timeout_s=30)
        # two loads on one connection, each answer read while waiting for the other's; one of them refused
        gone, first = dc.open_nowait("nobody", exists=True), dc.open_nowait("p0")
        req = first.wait()
        with pytest.raises(PdpushError, match="nobody"):
            gone.wait()
        k2, _ = req.kv_bytes(0, wait=True, timeout_s=30)
        assert np.array_equal(k2, kv(layout, 40, seed=0)[0][0].reshape(k2.shape))
        req.release()
        for i in (1, 2):
            read_back(dc, f"p{i}", layout, 40)
        s = _raw_dealer(rx.info["local_endpoint"])  # a begin refused: a push its decode withdrew
        try:
            assert _ask(s, protocol.encode(protocol.Withdraw(req_id="w"))) == protocol.Ok(req_id="w")
        finally:
            s.close(0)
        refused = pc.begin_nowait("w", list(range(500, 540)))
        while not refused.answered():
            pass
        with pytest.raises(Aborted, match="withdrawn"):
            refused.wait()
        assert pc._conn.mail == {} and dc._conn.mail == {}, (pc._conn.mail, dc._conn.mail)
    finally:
        pc.close()
        dc.close()


def _raw_dealer(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def _ask(s: zmq.Socket, frame: bytes) -> protocol.Msg:
    s.send(frame)
    assert s.poll(5000), "daemon did not reply"
    return protocol.decode(s.recv_multipart()[-1])


def test_an_engine_of_another_local_protocol_is_refused_by_either_daemon_and_nothing_is_held(daemons):
    """Engines and their daemons often come from separate images. A Begin to the sender or an Open to the receiver
    from a pdpush of another local protocol, or from one before it was numbered (no version on the wire), is answered
    with an IncompatiblePeer naming the request and both versions; neither daemon holds anything for it (each counts
    and logs it), and an engine of this pdpush then pushes and reads back as usual. So is a decode scheduler's Query
    (its chunk keys are computed by the engine's pdpush; it may come before any Open), refused naming no request, as
    its answer names none."""
    import msgpack

    layout = KVLayout(2, 2, 64, "float16", 16)
    rx = daemons.receiver(**rx_opts(layout))
    tx = daemons.sender(rx)
    ids = list(range(40))
    begin = protocol.Begin(req_id="skewed", receiver="", layout=protocol.LayoutSpec(**layout.to_dict()),
                           chunk_keys=chunk_keys(ids, layout), last_chunk_tokens=layout.last_chunk_tokens(len(ids)))
    query = protocol.Query(chunk_keys=chunk_keys(ids, layout), req_id="skewed")
    for endpoint, msg in ((tx.info["ingress_endpoint"], begin), (rx.info["local_endpoint"], protocol.Open(req_id="skewed")),
                          (rx.info["local_endpoint"], query)):
        s = _raw_dealer(endpoint)
        try:
            before = msgpack.unpackb(protocol.encode(msg), raw=False)
            del before["local_version"]
            newer = msg.model_copy(update={"local_version": protocol.LOCAL_PROTOCOL_VERSION + 1})
            for frame in (msgpack.packb(before, use_bin_type=True), protocol.encode(newer)):
                reply = _ask(s, frame)
                assert isinstance(reply, protocol.Error) and reply.code is ErrorCode.INCOMPATIBLE_PEER, reply
                assert reply.req_id == (None if msg is query else "skewed") and "local protocol" in reply.message, reply
        finally:
            s.close(0)
    assert status(sock(tx))["requests_total"] == 0 and status(sock(rx))["requests_inflight"] == 0
    for d, n, logged in ((tx, 2, 2), (rx, 4, 3)):  # each daemon's operator sees it too: counted, logged at 1, 2, 4
        assert status(sock(d))["local_protocol_refused"] == n and d.log().count("of another local protocol") == logged
    round_trip(tx, rx, layout, "skewed", ids)


def test_a_request_cannot_begin_on_a_daemons_zeromq_socket_where_its_engine_could_die_unseen(daemons):
    """An engine's connection sends its messages on its lifeline, whose hang-up tells the daemon it died. The daemons'
    ZeroMQ sockets answer a status request and a decode scheduler's Query or Withdraw, and refuse a Begin, Open or
    Claim with a typed error naming the lifeline: nothing is held for them."""
    layout = KVLayout(2, 2, 64, "float16", 16)
    rx = daemons.receiver(**rx_opts(layout))
    tx = daemons.sender(rx)
    ids = list(range(40))
    keys = chunk_keys(ids, layout)
    begin = protocol.Begin(req_id="unseen", receiver="", layout=protocol.LayoutSpec(**layout.to_dict()),
                           chunk_keys=keys, last_chunk_tokens=layout.last_chunk_tokens(len(ids)))
    claim = protocol.Claim(req_id="unseen", chunk_keys=keys, last_chunk_tokens=layout.last_chunk_tokens(len(ids)),
                           lease_ms=1000)
    for endpoint, msg in ((tx.info["ingress_endpoint"], begin), (rx.info["local_endpoint"], protocol.Open(req_id="unseen")),
                          (rx.info["local_endpoint"], claim)):
        s = _raw_dealer(endpoint)
        try:
            reply = _ask(s, protocol.encode(msg))
            assert isinstance(reply, protocol.Error) and reply.code is ErrorCode.UNEXPECTED, reply
            assert reply.req_id == "unseen" and ".life" in reply.message, reply
            assert isinstance(_ask(s, protocol.encode(protocol.StatusRequest())), protocol.StatusReply)
        finally:
            s.close(0)
    s = _raw_dealer(rx.info["local_endpoint"])
    try:
        assert isinstance(_ask(s, protocol.encode(protocol.Query(chunk_keys=keys))), protocol.QueryReply)
        assert _ask(s, protocol.encode(protocol.Withdraw(req_id="given-up"))) == protocol.Ok(req_id="given-up")
    finally:
        s.close(0)
    assert status(sock(tx))["requests_total"] == 0 and status(sock(rx))["requests_inflight"] == 0


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_engine_refuses_a_daemon_of_another_local_protocol_and_gives_back_what_it_answered(tmp_path, side):
    """The other way round: a daemon from before local protocols were numbered answers without a version (a stand-in
    on the lifeline, replaying what such a daemon sends). The engine raises IncompatiblePeer rather than reading its
    staging or pool by another protocol's rules, and tells the daemon it gave the request up (Abort; Release)."""
    import socket
    import threading

    import msgpack

    layout = KVLayout(2, 2, 64, "float16", 16)
    path = tmp_path / "daemon.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(lifeline.path_for(path)))
    listener.listen(1)
    listener.settimeout(10)
    answer = (protocol.BeginOk(req_id="r", already_sent_indexes=[], staging_shmid=1, staging_bytes=1 << 20,
                               staging_offset=0, new_chunks=1) if side == "prefill" else
              protocol.OpenOk(req_id="r", shmid=1, pool_base=0, pool_pages=1, layout=protocol.LayoutSpec(
                  **layout.to_dict()), pages=[0], last_chunk_tokens=16, layers_ready=[], committed=False))
    old = msgpack.unpackb(protocol.encode(answer), raw=False)
    del old["local_version"]
    seen: list[protocol.Msg] = []

    def daemon():
        conn, _ = listener.accept()
        conn.settimeout(10)
        buf, hello = bytearray(), None
        with conn:
            while len(seen) < 2:  # the Begin or Open, then what the engine says after the answer
                data = conn.recv(1 << 16)
                if not data:
                    return
                buf += data
                for f in lifeline.split(buf, 1 << 20)[0]:
                    if hello is None:
                        hello = f  # the connection's name
                        continue
                    seen.append(protocol.decode(f))
                    if len(seen) == 1:
                        conn.sendall(lifeline.frame(msgpack.packb(old, use_bin_type=True)))

    t = threading.Thread(target=daemon, daemon=True)
    t.start()
    client = PrefillClient(layout, path, timeout_s=10) if side == "prefill" else DecodeClient(path, timeout_s=10)
    try:
        with pytest.raises(IncompatiblePeer, match="local protocol 0"):
            client.begin("r", list(range(16))) if side == "prefill" else client.open("r")
        t.join(10)
        assert [m.type for m in seen] == (["begin", "abort"] if side == "prefill" else ["open", "release"])
    finally:
        client.close()
        listener.close()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_engine_names_a_daemon_whose_lifelines_carry_no_messages(tmp_path, side):
    """A daemon of local protocol 2 and before listens for lifelines on a packet socket, and reads messages from
    its ZeroMQ socket: an engine of this pdpush says so at once, rather than waiting for answers that cannot come."""
    import socket

    layout = KVLayout(2, 2, 64, "float16", 16)
    path = tmp_path / "daemon.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(lifeline.path_for(path)))
    listener.listen(1)
    client = PrefillClient(layout, path, timeout_s=10) if side == "prefill" else DecodeClient(path, timeout_s=10)
    try:
        with pytest.raises(IncompatiblePeer, match="older local protocol"):
            client.begin("r", list(range(16))) if side == "prefill" else client.open("r")
    finally:
        client.close()
        listener.close()


def test_bad_input_gets_typed_error_and_daemon_keeps_serving(daemons):
    import msgpack

    layout = KVLayout(2, 2, 64, "float16", 16)
    rx = daemons.receiver(**rx_opts(layout))
    s = _raw_dealer(rx.info["control_endpoint"])
    try:
        bad_frames = [
            b"\xff\x00garbage",                                              # not msgpack
            msgpack.packb(7),                                                # not a map, nor a batch of them
            msgpack.packb([{"type": "ok"}]),                                 # a batch of one (one goes alone)
            msgpack.packb({"type": "nope"}),                                 # unknown type
            msgpack.packb({"type": "alloc", "req_id": "x"}),                 # missing fields
            msgpack.packb({"type": "alloc", "req_id": "x", "chunk_keys": [b"short"], "last_chunk_tokens": 1,
                           "lease_ms": 10}),                                 # bad key length
            protocol.encode(protocol.AllocRequest(req_id="x", chunk_keys=[b"k" * 16], last_chunk_tokens=1,
                                                  lease_ms=100)),            # valid but before hello
            protocol.encode(protocol.Commit(req_id="nobody", layers=1)),               # unexpected
        ]
        for frame in bad_frames:
            reply = _ask(s, frame)
            assert isinstance(reply, protocol.Error), reply
            assert reply.code in (ErrorCode.BAD_MESSAGE, ErrorCode.UNEXPECTED, ErrorCode.NO_SESSION)
        # a batch (a peer daemon's frame: daemon.Outbox) of bad entries: a typed error for each, in one frame
        s.send(msgpack.packb([1, {"type": "nope"}, 3]))
        assert s.poll(5000), "daemon did not reply"
        replies = protocol.decode_batch(s.recv_multipart()[-1])
        assert [r.code for r in replies] == [ErrorCode.BAD_MESSAGE] * 3, replies
        # a wrong layout gets a typed IncompatiblePeer, never garbage
        other = KVLayout(2, 4, 64, "float16", 16)
        hello = protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=other.fingerprint(),
                               layout=protocol.LayoutSpec(**other.to_dict()))
        reply = _ask(s, protocol.encode(hello))
        assert isinstance(reply, protocol.Error) and reply.code is ErrorCode.INCOMPATIBLE_PEER
        # an oversized frame: typed error, not a crash
        reply = _ask(s, b"\x00" * (8 << 20) + b"\x00")
        assert isinstance(reply, protocol.Error) and reply.code is ErrorCode.TOO_LARGE
        assert rx.alive()
        st = status(sock(rx))
        assert st["bad_messages"] >= len(bad_frames) and st["pool_pages_free"] == 64
    finally:
        s.close(0)
    # ... and it still serves a real transfer afterwards
    tx = daemons.sender(rx)
    pc = PrefillClient(layout, sock(tx), timeout_s=30)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        k, v = kv(layout, 40, seed=3)
        push(pc, "after-garbage", list(range(40)), k, v)
        k2, v2 = read_back(dc, "after-garbage", layout, 40)
        assert np.array_equal(k2, k) and np.array_equal(v2, v)
    finally:
        pc.close()
        dc.close()


def test_sender_reports_incompatible_receiver(daemons):
    rx = daemons.receiver(**rx_opts(KVLayout(2, 2, 64, "float16", 16)))
    tx = daemons.sender(rx)
    pc = PrefillClient(KVLayout(2, 2, 64, "bfloat16", 16), sock(tx), timeout_s=10)
    try:
        with pytest.raises(IncompatiblePeer, match="layout mismatch"):
            pc.begin("wrong-layout", list(range(20)))
        assert tx.alive() and rx.alive()
    finally:
        pc.close()


def test_many_requests_in_flight_and_two_receivers(daemons):
    """Interleaved requests on one sender, spread over two receivers, all byte-exact."""
    layout = KVLayout(3, 2, 32, "float16", 8)
    rxs = [daemons.receiver(**rx_opts(layout)) for _ in range(2)]
    tx = daemons.sender(rxs[0])
    pc = PrefillClient(layout, sock(tx), timeout_s=30)
    dcs = [DecodeClient(sock(r), timeout_s=30) for r in rxs]
    try:
        handles, data = [], []
        for i in range(6):
            tokens = 20 + 3 * i
            k, v = kv(layout, tokens, seed=100 + i)
            rx = rxs[i % 2]
            h = pc.begin(f"m{i}", [i * 1000 + t for t in range(tokens)], receiver=rx.info["control_endpoint"])
            handles.append(h)
            data.append((k, v, tokens, i % 2))
        for layer in range(layout.layers):  # layer by layer across all requests
            for h, (k, v, _, _) in zip(handles, data, strict=False):
                h.put_layer(layer, k[layer], v[layer])
        for h in handles:
            h.finish(timeout_s=30)
        for i, (k, v, tokens, which) in enumerate(data):
            k2, v2 = read_back(dcs[which], f"m{i}", layout, tokens)
            assert np.array_equal(k2, k) and np.array_equal(v2, v)
        assert status(sock(tx))["receivers_connected"] == 2
    finally:
        pc.close()
        for d in dcs:
            d.close()


def test_keys_are_identical_across_processes():
    import subprocess
    import sys

    layout = KVLayout(2, 2, 64, "float16", 16)
    ids = list(range(50))
    code = ("from pdpush.layout import KVLayout, chunk_keys; "
            "print(','.join(k.hex() for k in chunk_keys(list(range(50)), KVLayout(2, 2, 64, 'float16', 16))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin"}).stdout.strip()
    assert out == ",".join(k.hex() for k in chunk_keys(ids, layout))


def test_an_aborted_push_never_reads_as_committed_and_leaves_no_mail(daemons):
    """Defects: abort() used to store an all-zero Done that finish() returned as if committed, and the
    sender's late Error for the aborted request sat in the client's mailbox forever."""
    lay = KVLayout(2, 2, 64, "float16", 16)
    rx = daemons.receiver(**rx_opts(lay))
    tx = daemons.sender(rx)
    pc = PrefillClient(lay, sock(tx), timeout_s=10)
    try:
        k, v = kv(lay, 40, 3)
        h = pc.begin("given-up", list(range(40)))
        h.put_layer(0, k[0], v[0])
        h.abort("engine preempted it")
        with pytest.raises(Aborted):
            h.finish()
        with pytest.raises(Aborted):
            h.put_layer(1, k[1], v[1])
        for i in range(3):  # later requests pump the connection: the late Error for "given-up" arrives meanwhile
            push(pc, f"after-{i}", list(range(100 * (i + 1), 100 * (i + 1) + 40)), k, v)
        assert "given-up" not in pc._conn.mail, pc._conn.mail
        assert not any(pc._conn.mail.values())
        st = status(sock(tx))
        assert st["requests_failed"] == 1 and st["requests_done"] == 3 and st["requests_inflight"] == 0
    finally:
        pc.close()


def test_layer_readiness_travels_in_the_data_plane(daemons):
    """With the receiver process stopped (it can send no LayerAvailable), the decode client still sees
    each layer land, from the readiness words the sender puts into the pool after the layer's data."""
    import os
    import signal

    lay = KVLayout(3, 2, 64, "float16", 16)
    rx = daemons.receiver(**rx_opts(lay))
    tx = daemons.sender(rx)
    pc = PrefillClient(lay, sock(tx), timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)
    try:
        k, v = kv(lay, 40, 5)
        h = pc.begin("in-band", list(range(40)))
        req = dc.open("in-band")
        assert req.lease_id and not req._landed(0)
        os.kill(rx.info["pid"], signal.SIGSTOP)
        try:
            for layer in range(lay.layers):
                h.put_layer(layer, k[layer], v[layer])
                req.wait_layer(layer, timeout_s=10)
            got = [np.concatenate([r.view(np.uint8) for r in req.layer_runs(layer, wait=False)]).ravel()
                   for layer in range(lay.layers)]
        finally:
            os.kill(rx.info["pid"], signal.SIGCONT)
        h.finish()
        req.wait_committed()
        k2, v2 = read_back(dc, "in-band", lay, 40)
        assert np.array_equal(k2, k) and np.array_equal(v2, v)
        assert all(np.array_equal(g, np.concatenate([r.view(np.uint8) for r in req.layer_runs(la)]).ravel())
                   for la, g in enumerate(got))
        # a word from another lease never reads as ready (written through a mapping of the pool that may write, as
        # a sender's puts are: the decode engine's own is read-only)
        with writable_pool(dc) as writable:
            writable(req._words)[0, req._new_pages[0]] = req.lease_id + 1
            assert not req._landed(0)
        req.release()
        # lease ids are random: an engine, which sees its own requests' (its staging holds the words' source), cannot
        # tell the next one's and set words ahead in pages it will get (1 in 2**44 that this fails by chance)
        h2 = pc.begin("in-band-2", list(range(100, 140)))
        req2 = dc.open("in-band-2")
        assert abs(req2.lease_id - req.lease_id) > 1 << 20
        h2.abort("done")
        req2.release()
    finally:
        pc.close()
        dc.close()


FP8_MLA = [
    # (layout, prefill TP, pool shards): fp8 GQA; an fp8 MLA latent split between 2 ranks; a bf16 latent, 4 ranks
    (KVLayout(3, 2, 64, "float8_e4m3fn", 16, kv_scales="static"), 1, 1),
    (KVLayout(2, 1, 576, "float8_e5m2", 16, kind="mla", kv_scales="static"), 2, 2),
    (KVLayout(2, 1, 576, "bfloat16", 16, kind="mla"), 4, 2),
]


@pytest.mark.parametrize("layout,tp,shards", FP8_MLA, ids=["fp8e4m3-gqa", "fp8e5m2-mla-tp2", "bf16-mla-tp4"])
def test_fp8_and_mla_tensors_through_the_daemons_byte_for_byte(daemons, layout, tp, shards):
    """torch float8 / bf16 tensors staged by each prefill rank (the latent replicated on every rank: each
    pushes its part of the bytes), read back as the same dtype by decode ranks of TP 1 and 2."""
    import torch

    dtype = getattr(torch, layout.dtype)
    rx = daemons.receiver(**rx_opts(layout), pool_shards=shards, verify_checksums=True)
    tx = daemons.sender(rx, checksums=True)
    clients = [PrefillClient(layout, sock(tx), timeout_s=30) for _ in range(tp)]
    dc = DecodeClient(sock(rx), timeout_s=30)
    tokens = 45  # 2 full chunks and a partial one
    g = torch.Generator().manual_seed(tp)
    comps = [torch.randint(0, 256, (layout.layers, tokens, layout.kv_heads, layout.row_bytes), generator=g,
                           dtype=torch.uint8).view(dtype) for _ in range(layout.components)]
    try:
        handles = [pc.begin("f8", list(range(tokens)), tp_rank=r, tp_size=tp) for r, pc in enumerate(clients)]
        for layer in range(layout.layers):
            for h in handles:  # every rank holds the whole latent (or is given all heads and takes its own)
                h.put_layer(layer, *(c[layer] for c in comps))
        for h in handles:  # every rank finishes before any waits (one thread drives them all)
            h.finish_nowait()
        dones = [h.poll_done(30) for h in handles]
        assert None not in dones
        assert sum(d.rank_puts for d in dones) == dones[0].puts
        assert status(sock(tx))["bytes_put"] == layout.layers * 3 * layout.page_bytes  # every byte once
        assert status(sock(rx))["checksum_failures"] == 0
        with dc.open("f8", timeout_s=30):  # held: each decode TP's reads
            for dtp in (1, 2) if layout.kv_heads == 1 or layout.kv_heads % 2 == 0 else (1,):
                for r in range(dtp):
                    with dc.open("f8", tp_rank=r, tp_size=dtp) as req:
                        h0, h1 = req.heads
                        for layer in range(layout.layers):
                            got = req.layer_kv(layer)
                            assert all(x.dtype == dtype for x in got)
                            for x, want in zip(got, comps, strict=True):
                                assert torch.equal(x.view(torch.uint8), want[layer][:, h0:h1].view(torch.uint8))
    finally:
        for pc in clients:
            pc.close()
        dc.close()


def test_a_sender_meets_a_receiver_of_another_layout_kind_and_both_sides_values_are_named(daemons):
    mla = KVLayout(2, 1, 576, "bfloat16", 16, kind="mla")
    gqa = KVLayout(2, 1, 576, "bfloat16", 16)  # the same bytes per token, another meaning
    rx = daemons.receiver(**rx_opts(gqa))
    tx = daemons.sender(rx)
    pc = PrefillClient(mla, sock(tx), timeout_s=30)
    try:
        with pytest.raises(IncompatiblePeer, match=r"kind: 'mla' vs 'mha'"):
            pc.begin("x", list(range(20)))
    finally:
        pc.close()


@pytest.mark.parametrize("ring_slots", [0, 256], ids=["messages", "ring"])
def test_a_hand_over_naming_a_bad_layer_is_refused_and_nothing_of_it_is_taken(daemons, ring_slots):
    """The native per-layer path takes a hand-over whole or not at all: a LayerReady naming a layer past
    the layout posts nothing of it, and the engine is told. In a ring each record is a hand-over of its
    own: the bad one is refused, the good one before it is taken."""
    from tests.helpers import until

    layout = LAYOUTS[0][0]
    rx = daemons.receiver(**rx_opts(layout))
    tx = daemons.sender(rx, handover_ring_slots=ring_slots)
    pc = PrefillClient(layout, sock(tx), timeout_s=10)
    try:
        ids = list(range(40))
        k, v = kv(layout, len(ids), 3)
        h = pc.begin("bad", ids)
        for layer in range(layout.layers):
            h.stage_layer(layer, k[layer], v[layer])
        h.layers_ready([0, layout.layers + 5])
        until(lambda: status(sock(tx))["handovers_refused"] == 1, 10, "the refusal")
        assert status(sock(tx))["layers_handed"] == (1 if ring_slots else 0)
        h.abort("the test is done with it")
    finally:
        pc.close()


@pytest.mark.parametrize("completion", ["words", "commit"])
def test_each_daemon_counts_the_control_messages_between_them_and_the_counts_mirror(daemons, completion):
    """What a request costs on the wire between the hosts (daemon.WireCount, read by the latency bench):
    every message the sender sent the receiver took in, and the other way round, type by type. Completing on
    the data path (the default), a request costs its allocation and nothing more; by Commit, 4 messages."""
    import json

    layout = KVLayout(2, 2, 64, "float16", 16)
    rx = daemons.receiver(**rx_opts(layout))
    tx = daemons.sender(rx, completion=completion)
    pc = PrefillClient(layout, sock(tx), timeout_s=30)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        for i in range(3):
            k, v = kv(layout, 40, seed=i)
            push(pc, f"wire-{i}", list(range(100 * i, 100 * i + 40)), k, v)
            read_back(dc, f"wire-{i}", layout, 40)
        s, r = status(sock(tx)), status(sock(rx))
    finally:
        pc.close()
        dc.close()
    sent, got = json.loads(s["wire_messages"]), json.loads(r["wire_messages"])
    assert {k.removeprefix("out:"): n for k, n in sent.items() if k.startswith("out:")} == \
        {k.removeprefix("in:"): n for k, n in got.items() if k.startswith("in:")}
    assert {k.removeprefix("in:"): n for k, n in sent.items() if k.startswith("in:")} == \
        {k.removeprefix("out:"): n for k, n in got.items() if k.startswith("out:")}
    per_request = {"out:alloc": 3, "in:alloc_ok": 3} if completion == "words" else \
        {"out:alloc": 3, "in:alloc_ok": 3, "out:commit": 3, "in:commit_ack": 3}
    assert sent == {"out:hello": 1, "in:hello_ack": 1, **per_request}
    r_status = status(sock(rx))  # the receiver committed every one (by its words, or by its Commit)
    assert r_status["requests_committed"] == 3
    assert r_status["requests_committed_by_words"] == (3 if completion == "words" else 0)


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt, field 10


def _rss_of_segment(pid: int, shmid: int) -> int:
    """Bytes of SysV segment ``shmid`` mapped in process ``pid``'s page tables (its smaps Rss)."""
    rss, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and parts[0][0] in "0123456789abcdef" and not parts[0].endswith(":"):
                inside = len(parts) >= 6 and parts[5].startswith("/SYSV") and int(parts[4]) == shmid
            elif inside and parts[0] == "Rss:":
                rss += int(parts[1]) * 1024
    return rss


@pytest.mark.parametrize("prefault", [True, False])
def test_a_sender_maps_a_receivers_pool_in_ahead_so_its_first_puts_fault_no_page(daemons, prefault):
    """The sender's first write into each 4 KiB page of a receiver's pool used to fault it into the sender's
    own mapping (40% of its CPU while the pool was cold). With ``prefault`` it maps the receiver's (prefaulted)
    pool in once the endpoint is up, and pushes onto pages it never wrote fault none; without, the same
    pushes map each page they write into the sender then (its mapping grows by their bytes)."""
    from tests.helpers import until

    layout = KVLayout(8, 4, 64, "bfloat16", 16)  # a page of a layer: 16 KiB
    pages, chunks = 64, 8
    rx = daemons.receiver(**rx_opts(layout, pool_pages=pages), prefault=True)
    tx = daemons.sender(rx, prefault=prefault)
    pool, shmid = rx.info["pool_bytes"], rx.info["shmid"]
    pc = PrefillClient(layout, sock(tx), timeout_s=30)
    dc = DecodeClient(sock(rx), timeout_s=30)
    tokens = chunks * layout.chunk_tokens
    try:
        k, v = kv(layout, tokens, seed=0)
        push(pc, "first", list(range(tokens)), k, v)  # connects the data plane, and writes the pool's first pages
        if prefault:
            until(lambda: status(sock(tx))["peer_bytes_populated"] >= pool, 30, "the pool populated")
        rss, before = _rss_of_segment(tx.pid, shmid), _minor_faults(tx.pid)
        for i in range(1, 5):  # pages the sender has not written yet (the pool hands out its lowest free ones)
            k, v = kv(layout, tokens, seed=i)
            push(pc, f"r{i}", list(range(1000 * i, 1000 * i + tokens)), k, v)
        faults, grown = _minor_faults(tx.pid) - before, _rss_of_segment(tx.pid, shmid) - rss
        for i in range(1, 5):
            assert np.array_equal(read_back(dc, f"r{i}", layout, tokens)[0], kv(layout, tokens, seed=i)[0])
    finally:
        pc.close()
        dc.close()
    written = 4 * chunks * layout.layers * layout.page_bytes  # bytes of pool pages the four pushes wrote
    if prefault:
        assert rss >= pool and grown == 0, (rss, pool, grown)
        assert faults < written // 4096 // 4, faults
    else:
        assert rss < pool // 2 and grown >= written, (rss, pool, grown)  # the puts fault the pool in, page by page
