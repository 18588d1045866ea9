"""The hand-over ring (ring.py, sessions/rings.py, the sender's native Ring): its format, the engine's
writer against the sender's reader in one process, the session's book of rings, and real daemons:
a full ring waited for and never overwritten, and an engine killed while it writes its ring."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdpush import protocol, ring
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.errors import ErrorCode, PdpushError, TransportTimeout, UnexpectedMessage
from pdpush.layout import KVLayout
from tests.helpers import kv, read_back, rx_opts, sock, until

LAY = KVLayout(layers=16, kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=8, model_id="default")


def _reader(buf: np.ndarray):
    from pdpush.transport import ucp

    ucp.lib()  # the one libucp, checked (transport/ucx_lib.py), before the data plane uses it
    from pdpush_native import Ring

    return Ring(buf.ctypes.data, len(buf))


@given(st.integers(0, (1 << 32) - 1), st.integers(0, ring.MAX_LAYERS - 1), st.integers(1, ring.MAX_LAYERS))
def test_a_record_names_its_request_and_layers(handle, first, n):
    rec = ring.encode(handle, first, n)
    assert rec & ring.VALID and ring.decode(rec) == (handle, first, n)


@given(st.integers(0, (1 << 32) - 1))
def test_a_finish_record_names_its_request_and_no_layer(handle):
    rec = ring.encode_finish(handle)
    assert rec & ring.VALID and rec & ring.FINISH and ring.decode(rec) == (handle, 0, 0)


def test_the_native_reader_tells_a_finish_record_from_a_layers_record():
    h = (1 << 32) - 1
    buf = np.zeros(2, np.uint64)
    buf[0], buf[1] = ring.encode(h, ring.MAX_LAYERS - 1, ring.MAX_LAYERS), ring.encode_finish(h)
    assert _reader(buf).take() == [(h, ring.MAX_LAYERS - 1, ring.MAX_LAYERS), (h, 0, 0)]


def test_a_finish_record_is_the_requests_finish_from_its_own_ranks_only():
    """The session decides a finish record as the Finish message: after the layers' records before it, only
    from a connection that pushes the request, once; one for a request that has ended is dropped and counted."""
    from tests.test_sessions import ENG, Wire, begin
    from tests.test_sessions import LAY as SLAY

    w = Wire()
    w.tx.on_lifeline(ENG)
    w.engine(begin("a", list(range(100, 140)), "", SLAY, handover_ring=True))
    ok = [m for m in w.to_client if isinstance(m, protocol.BeginOk)][-1]
    assert ok.ring_finish and ok.ring_slots
    w.records(b"other", [(ok.handle, 0, 0)])  # another connection's: refused, counted, never answered (that would
    assert not [m for i, m in w.by_client if i == b"other"]  # name the request), and the request goes on
    assert w.tx.counters.values["handovers_refused"] == 1
    def outcome(rid):  # what ENG heard of the end of ``rid``
        got = [m for i, m in w.by_client if i == ENG and getattr(m, "req_id", None) == rid
               and isinstance(m, (protocol.Done, protocol.Error))]
        return got[-1] if got else None

    w.records(ENG, [(ok.handle, 0, SLAY.push_layers), (ok.handle, 0, 0)])  # every layer, then the finish
    assert outcome("a") is None  # not before every layer landed
    w.complete()
    assert isinstance(outcome("a"), protocol.Done) and outcome("a").layers == SLAY.layers
    assert w.tx.counters.values["finishes_ring"] == 1
    w.records(ENG, [(ok.handle, 0, 0)])  # the request has ended: dropped and counted, nothing answered
    assert w.tx.counters.values["handovers_stale"] == 1 and isinstance(outcome("a"), protocol.Done)
    w.engine(begin("b", list(range(200, 240)), "", SLAY, handover_ring=True))
    okb = [m for m in w.to_client if isinstance(m, protocol.BeginOk)][-1]
    w.records(ENG, [(okb.handle, 0, 2), (okb.handle, 0, 0), (okb.handle, 0, 0)])  # finished twice: the second
    assert outcome("b").code is ErrorCode.UNEXPECTED  # is refused


def test_layers_go_as_runs_in_the_order_given():
    assert ring.runs([3, 4, 5, 9, 1, 2]) == [(3, 3), (9, 1), (1, 2)]
    with pytest.raises(ValueError):
        ring.encode(1, ring.MAX_LAYERS, 1)


def _writer(buf, slots: int, native: bool) -> ring.RingWriter:
    """The engine's writer through pdpush_native (make install builds it) or through libatomic (ctypes)."""
    assert not native or ring._native() is not None, "make install builds pdpush_native._copy's ring_push"
    w = ring.RingWriter(buf.ctypes.data, slots, buf[slots:].ctypes.data, native=native)
    assert (w._nat is not None) == native
    return w


def test_the_native_ring_needs_no_libatomic_and_refuses_a_ring_it_cannot_address(monkeypatch):
    """An engine venv with pdpush_native but no libatomic still hands over through its ring; a misaligned word or
    a ring of no slots is a ValueError, never a store."""
    monkeypatch.setattr(ring, "_lib", None)  # libatomic looked for and not found
    assert ring.available()
    buf = np.zeros(5, np.uint64)
    w = _writer(buf, 4, True)
    assert w.push([ring.encode(3, 0, 1)]) == 1 and buf[0] == ring.encode(3, 0, 1)
    with pytest.raises(RuntimeError, match="libatomic"):
        ring.RingWriter(buf.ctypes.data, 4, buf[4:].ctypes.data, native=False)
    nat = ring._native()
    with pytest.raises(ValueError):
        nat.ring_push(buf.ctypes.data + 4, 4, 0, [1])
    with pytest.raises(ValueError):
        nat.ring_push(buf.ctypes.data, 0, 0, [1])
    with pytest.raises(ValueError):
        nat.load_word(buf.ctypes.data + 4)
    assert list(buf[1:]) == [0, 0, 0, 0]


@pytest.mark.parametrize("native", [True, False], ids=["native", "libatomic"])
def test_a_full_ring_refuses_records_and_never_overwrites_one(native):
    buf = np.zeros(5, np.uint64)  # four slots and the idle word
    w = _writer(buf, 4, native)
    rd = _reader(buf[:4])
    recs = [ring.encode(7, la, 1) for la in range(10)]
    assert w.push(recs) == 4 and w.push(recs[4:]) == 0
    assert list(buf[:4]) == recs[:4]  # the records not yet taken are intact
    assert rd.take(2) == [(7, 0, 1), (7, 1, 1)]
    assert w.push(recs[4:]) == 2 and list(buf[:4]) == [recs[4], recs[5], recs[2], recs[3]]
    assert [t[1] for t in rd.take()] == [2, 3, 4, 5] and not buf[:4].any() and rd.taken == 6
    assert not w.sender_idle()
    buf[4] = 1
    assert w.sender_idle()


@pytest.mark.parametrize("native", [True, False], ids=["native", "libatomic"])
def test_records_from_two_threads_arrive_once_each_in_each_threads_order(native):
    """The engine's owner thread and its completion thread share a ring; the sender takes as it goes."""
    buf = np.zeros(9, np.uint64)
    w = _writer(buf, 8, native)
    rd = _reader(buf[:8])
    n = 3000

    def producer(handle):
        recs = [ring.encode(handle, i % ring.MAX_LAYERS, 1) for i in range(n)]
        done = 0
        while done < n:
            done += w.push(recs[done:done + 3])

    threads = [threading.Thread(target=producer, args=(h,)) for h in (1, 2)]
    for t in threads:
        t.start()
    got: list[tuple[int, int, int]] = []
    deadline = time.monotonic() + 60
    while len(got) < 2 * n and time.monotonic() < deadline:
        got.extend(rd.take())
    for t in threads:
        t.join(10)
    for h in (1, 2):
        assert [la for hh, la, _ in got if hh == h] == [i % ring.MAX_LAYERS for i in range(n)]
    assert len(got) == 2 * n and not buf[:8].any()


# ------------------------------------------------------------------- the session's book of rings

def test_a_connection_keeps_its_ring_until_bye_and_its_records_are_its_layer_ready():
    from tests.test_sessions import ENG, Wire, begin
    from tests.test_sessions import LAY as SLAY

    w = Wire()
    w.tx.on_lifeline(ENG)  # its lifeline is open: the sender will see it die
    w.engine(begin("plain", list(range(40)), "", SLAY))  # an engine that asks for no ring
    ok = [m for m in w.to_client if isinstance(m, protocol.BeginOk)][-1]
    assert ok.ring_slots == 0 and w.tx.rings.stats()["handover_rings"] == 0
    w.engine(begin("a", list(range(100, 140)), "", SLAY, handover_ring=True))
    ok = [m for m in w.to_client if isinstance(m, protocol.BeginOk)][-1]
    assert ok.ring_slots == w.tx.limits.ring_slots and ok.ring_offset and ok.handle
    assert w.tx.rings.stats()["handover_rings"] == 1
    w.records(ENG, [(ok.handle, 0, 2), (ok.handle, 2, SLAY.push_layers - 2)])
    assert w.posted and w.tx.counters.values["handovers_refused"] == 0
    w.records(b"other", [(ok.handle, 0, 1)])  # another connection's request: refused, counted, nothing posted,
    assert not [m for i, m in w.by_client if i == b"other"]  # and never answered (that would name the request)
    w.records(ENG, [(ok.handle, 1, 1)])  # a layer already handed over
    assert "already sent" in w.to_client[-1].message and w.tx.counters.values["handovers_refused"] == 2
    w.complete()
    w.engine(protocol.Finish(req_id="a"))
    assert isinstance(w.outcome("a"), protocol.Done) and w.outcome("a").layers == SLAY.layers
    # a record for a request that has ended is dropped and counted; the ring stays with its connection
    w.records(ENG, [(ok.handle, 0, 1)])
    assert w.tx.counters.values["handovers_stale"] == 1 and w.tx.rings.stats()["handover_rings"] == 1
    w.engine(protocol.Bye())
    assert w.tx.rings.stats()["handover_rings"] == 0 and w.tx.rings.meta_bytes == 64  # the idle word
    # answered, after all it sent before: only then does the engine close its lifeline (client.close)
    assert isinstance(w.to_client[-1], protocol.Ok)


def test_no_ring_when_the_metadata_area_is_full_or_rings_are_off():
    from pdpush.sessions import Counters
    from pdpush.sessions.rings import HandoverRings
    from pdpush.sessions.tx_actions import OpenRing
    from pdpush.staging import StagingAllocator

    meta = StagingAllocator(64 * 16, 0, "staging metadata", align=64)
    c = Counters()
    rings = HandoverRings(meta, 1 << 20, 16, c)  # 128 bytes a ring after the 64-byte idle word
    out: list = []
    got = [rings.open(bytes([i]), True, out) for i in range(4)]
    # rings take at most half of the area: the fourth would pass it, and grant tables keep the rest
    assert got[:3] == [(64, 16), (192, 16), (320, 16)] and got[3] == (0, 0) and c.values["rings_refused"] == 1
    assert meta.alloc(512) == 448
    assert [a.address for a in out if isinstance(a, OpenRing)] == [(1 << 20) + o for o, _ in got[:3]]
    assert rings.open(b"x", False, out) == (0, 0)  # no lifeline: its ring could never come back
    rings.close(bytes([1]), out)  # that engine's lifeline closed
    assert rings.open(bytes([9]), True, out) == (192, 16)  # the dead engine's ring, reused
    assert HandoverRings(StagingAllocator(512, 0, "m", align=64), 0, 0, c).open(b"e", True, out) == (0, 0)
    huge = HandoverRings(StagingAllocator(512, 0, "m", align=64), 0, 1 << 16, c)  # larger than the area itself
    assert huge.open(b"e", True, out) == (0, 0) and c.values["rings_refused"] == 2


def test_handles_are_32_bits_and_never_a_live_requests():
    import itertools

    from tests.test_sessions import ENG, Wire, begin
    from tests.test_sessions import LAY as SLAY

    w = Wire()
    w.tx.on_lifeline(ENG)
    w.engine(begin("a", list(range(40)), "", SLAY, handover_ring=True))
    # 2**32 - 1 is free; 2**32 wraps onto 0, which is no handle; 2**32 + 1 onto 1, which "a" holds
    w.tx._seq = itertools.chain([(1 << 32) - 1, 1 << 32, (1 << 32) + 1], itertools.count(2))
    w.engine(begin("b", list(range(100, 140)), "", SLAY, handover_ring=True))
    w.engine(begin("c", list(range(200, 240)), "", SLAY, handover_ring=True))
    oks = {m.req_id: m.handle for m in w.to_client if isinstance(m, protocol.BeginOk)}
    assert oks == {"a": 1, "b": (1 << 32) - 1, "c": 2}


# ------------------------------------------------------------------------------ real daemons

def _tx_pid(tx) -> int:
    return tx.info["pid"]


def test_a_full_ring_makes_the_engine_wait_and_no_record_is_lost(daemons):
    """The sender is stopped (SIGSTOP) with a ring of 4 records: the engine's fifth hand-over waits for
    room, bounded, and raises a typed timeout if none comes; once the sender runs again every layer
    handed over is pushed, byte for byte, so no record was overwritten. The finish goes as a record after them,
    or, where the ring is full, as a message that the sender reads only after taking the ring's records."""
    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx, handover_ring_slots=4)
    pc = PrefillClient(LAY, sock(tx), timeout_s=1.0)
    dc = DecodeClient(sock(rx), timeout_s=30)
    k, v = kv(LAY, 30, seed=3)
    try:
        h = pc.begin("waits", list(range(30)))
        assert h._ring is not None and h._ring.slots == 4
        os.kill(_tx_pid(tx), signal.SIGSTOP)
        try:
            for layer in range(4):
                h.put_layer(layer, k[layer], v[layer])
            t0 = time.monotonic()
            with pytest.raises(TransportTimeout, match="ring of 4 records is full"):
                h.put_layer(4, k[4], v[4])
            assert time.monotonic() - t0 >= 0.9 and h.layers_handed_over == 4  # layer 4 may be handed over again
            pc.timeout_s = 30
            threading.Timer(0.5, os.kill, (_tx_pid(tx), signal.SIGCONT)).start()
            t0 = time.monotonic()
            h.put_layer(4, k[4], v[4])  # waits for the sender, then goes
            assert time.monotonic() - t0 >= 0.3
        finally:
            os.kill(_tx_pid(tx), signal.SIGCONT)
        for layer in range(5, LAY.layers):
            h.put_layer(layer, k[layer], v[layer])
        # the sender takes the last records before the finish, so that it finds room in the ring (on a loaded
        # machine it may not have yet, and the finish then goes as a message: the case this test checks next)
        until(lambda: status(sock(tx))["handovers_ring"] >= h._ring._head, 10, "the sender taking the records")
        done = h.finish(timeout_s=30)
        assert done.layers == LAY.layers
        gk, gv = read_back(dc, "waits", LAY, 30)
        assert np.array_equal(gk, k) and np.array_equal(gv, v)
        st = status(sock(tx))
        assert st["handovers_ring"] >= LAY.layers - 1 and st["finishes_ring"] == 1  # the finish too, as a record
        # the ring is full when the engine finishes: the Finish goes as a message, after the records
        h = pc.begin("full-at-finish", list(range(100, 130)))
        for layer in range(LAY.layers - 4):
            h.put_layer(layer, k[layer], v[layer])
        until(lambda: status(sock(tx))["handovers_ring"] >= st["handovers_ring"] + LAY.layers - 4, 10,
              "the sender taking the records")
        os.kill(_tx_pid(tx), signal.SIGSTOP)
        try:
            for layer in range(LAY.layers - 4, LAY.layers):
                h.put_layer(layer, k[layer], v[layer])
            h.finish_nowait()
        finally:
            os.kill(_tx_pid(tx), signal.SIGCONT)
        assert h.poll_done(30).layers == LAY.layers
        gk, gv = read_back(dc, "full-at-finish", LAY, 30)
        assert np.array_equal(gk, k) and np.array_equal(gv, v) and status(sock(tx))["finishes_ring"] == 1
        # closing the client stops its ring writer first (a handle still open writes nothing more), and
        # its Bye gives the ring back
        h2 = pc.begin("open-at-close", list(range(500, 530)))
        assert status(sock(tx))["handover_rings"] == 1
        pc.close()
        with pytest.raises(UnexpectedMessage, match="client is closed"):
            h2.post_layers_ready([0])
        until(lambda: status(sock(tx))["handover_rings"] == 0, 10, "the closed client's ring coming back")
    finally:
        pc.close()
        dc.close()


def test_a_finish_record_the_sender_never_took_ends_in_a_typed_error_when_it_dies_or_restarts(daemons):
    """The sender is stopped with the engine's finish record in its ring, then killed; a new sender takes its
    socket, and the engine begins a request there (its connection's lifeline is then the new sender's). The
    finished request's ``poll_done`` raises a typed BrokenResourceError, never waits on a reply that cannot come."""
    from pdpush.errors import BrokenResourceError

    rx = daemons.receiver(**rx_opts(LAY))
    path = str(daemons.workdir / "tx-restarts.sock")
    tx = daemons.sender(rx, ingress_socket=path)
    pc = PrefillClient(LAY, path, timeout_s=10)
    k, v = kv(LAY, 30, seed=4)
    try:
        h = pc.begin("orphan", list(range(30)))
        for layer in range(LAY.layers):
            h.put_layer(layer, k[layer], v[layer])
        os.kill(_tx_pid(tx), signal.SIGSTOP)
        h.finish_nowait()  # a record in the stopped sender's ring
        assert h._ring_finish
        tx.kill()
        daemons.sender(rx, ingress_socket=path)
        h2 = pc.begin("on-the-new-sender", list(range(100, 130)))
        assert pc._conn.peer_id != h._daemon_id
        with pytest.raises(BrokenResourceError, match="died or restarted"):
            h.poll_done(0.1)
        for layer in range(LAY.layers):
            h2.put_layer(layer, k[layer], v[layer])
        assert h2.finish(timeout_s=10).layers == LAY.layers
    finally:
        pc.close()


def test_a_finish_the_sender_never_answers_ends_in_a_typed_timeout(daemons):
    """The sender is alive but stopped (SIGSTOP) when the engine finishes: ``poll_done`` answers None until the
    client's ``finish_timeout_s`` from ``finish_nowait``, then raises a typed TransportTimeout, never waits for good. The
    sender, running again, commits the request; its late answer is dropped, and the next request is served."""
    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=1.0, finish_timeout_s=1.0)
    k, v = kv(LAY, 30, seed=5)
    try:
        h = pc.begin("silent", list(range(30)))
        for layer in range(LAY.layers):
            h.put_layer(layer, k[layer], v[layer])
        os.kill(_tx_pid(tx), signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            h.finish_nowait()
            assert h.poll_done(0.2) is None
            with pytest.raises(TransportTimeout, match="did not answer its finish within 1 s"):
                while h.poll_done(0.1) is None:
                    assert time.monotonic() - t0 < 10, "poll_done never gave up"
            assert time.monotonic() - t0 >= 0.9
        finally:
            os.kill(_tx_pid(tx), signal.SIGCONT)
        until(lambda: status(sock(tx))["requests_done"] >= 1, 10, "the sender committing the request")
        h2 = pc.begin("next", list(range(100, 130)))
        for layer in range(LAY.layers):
            h2.put_layer(layer, k[layer], v[layer])
        assert h2.finish(timeout_s=10).layers == LAY.layers
        assert "silent" not in pc._conn.mail  # the late Done was dropped, not kept for an owner that is gone
    finally:
        pc.close()


ENGINE = """
import sys, time
import numpy as np
from pdpush.client import PrefillClient
from pdpush.layout import KVLayout
lay = KVLayout(layers=512, kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=8, model_id="default")
pc = PrefillClient(lay, sys.argv[1], timeout_s=30)
h = pc.begin("killed", list(range(30)))
assert h._ring is not None
k = np.ones((30, 2, 16), np.float16)
for layer in range(lay.layers):
    h.put_layer(layer, k, k)
    print(layer, flush=True)
    time.sleep(0.002)
"""


def test_an_engine_killed_while_writing_its_ring_fails_its_request_typed(daemons):
    """An engine hands layers over through its ring and is SIGKILLed mid-stream: the sender fails the
    request (pid liveness), the decode side gets a typed error, the dead engine's ring and staging come
    back, and the next engine pushes byte for byte."""
    big = KVLayout(layers=512, kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=8, model_id="default")
    rx = daemons.receiver(**rx_opts(big, pool_pages=16))
    tx = daemons.sender(rx)
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, sock(tx)], stdout=subprocess.PIPE, text=True)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        for _ in range(40):  # forty layers handed over, then kill it between two records
            assert proc.stdout.readline(), "the engine ended early"
        assert status(sock(tx))["handover_rings"] == 1
        proc.kill()
        proc.wait(10)
        until(lambda: status(sock(tx))["requests_failed"] == 1, 20, "the sender failing the request")
        with pytest.raises(PdpushError, match="died"):
            with dc.open("killed", timeout_s=10) as req:
                req.wait_layer(big.layers - 1, timeout_s=10)
        s = until(lambda: (lambda s: s if s["handover_rings"] == 0 and s["staging_held_bytes"] == 0 else None)(
            status(sock(tx))), 10, "the dead engine's ring and staging coming back")
        assert s["handovers_ring"] >= 40
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        dc.close()
    pc = PrefillClient(big, sock(tx), timeout_s=30)
    try:
        k, v = kv(big, 30, seed=9)
        h = pc.begin("next", list(range(1000, 1030)))
        for layer in range(big.layers):
            h.put_layer(layer, k[layer], v[layer])
        assert h.finish(timeout_s=30).layers == big.layers
        dc = DecodeClient(sock(rx), timeout_s=30)
        gk, gv = read_back(dc, "next", big, 30)
        dc.close()
        assert np.array_equal(gk, k) and np.array_equal(gv, v)
    finally:
        pc.close()
