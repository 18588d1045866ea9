"""Staging sized by the layers in flight: each layer's block is granted when it fits and given back
when its flush completes; an engine that finds staging full asks and waits, in order, with a deadline.

Pure allocator and session logic first, then real daemons pushing requests several times the size
of the sender's staging, byte for byte."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpush import protocol
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.errors import ErrorCode, PdpushError, PoolExhausted, RequestTooLarge, TransportTimeout
from pdpush.layout import KVLayout
from pdpush.sessions.sender import ToClient
from pdpush.staging import ALIGN, MIN_BYTES, StagingAllocator, ahead_bytes, split
from tests.helpers import kv, push, read_back, rx_opts, sock, until
from tests.test_sessions import ENG, Wire, begin

# ---- the allocator -----------------------------------------------------------------------------


def test_next_fit_carries_on_past_the_last_block_and_wraps():
    a = StagingAllocator(8 * ALIGN, base=4 * ALIGN)
    blocks = [a.alloc(ALIGN) for _ in range(3)]
    assert blocks == [4 * ALIGN, 5 * ALIGN, 6 * ALIGN]
    a.free(blocks[0])
    assert a.alloc(ALIGN) == 7 * ALIGN  # not the freed first block: it carries on
    assert a.alloc(4 * ALIGN) == 8 * ALIGN  # up to the end
    assert a.alloc(ALIGN) == 4 * ALIGN  # then wraps around
    with pytest.raises(PoolExhausted, match="free in fragments"):
        a.alloc(ALIGN)
    with pytest.raises(RequestTooLarge):
        a.alloc(9 * ALIGN)


def test_a_block_held_long_is_stepped_over():
    """A slow receiver's layer keeps its block; the space freed behind it is used (first-in first-out
    lifetimes otherwise, as a ring)."""
    a = StagingAllocator(4 * ALIGN)
    slow, b, c, d = (a.alloc(ALIGN) for _ in range(4))
    for x in (b, c, d):
        a.free(x)
    assert [a.alloc(ALIGN) for _ in range(3)] == [b, c, d] and slow == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["free", "alloc", "run"]), st.integers(0, 6)), max_size=200))
def test_blocks_never_overlap_and_every_byte_comes_back(steps):
    """``alloc`` and ``alloc_run`` (a request's layers at once: the longest prefix that fits, each block its own)."""
    a = StagingAllocator(32 * ALIGN, base=ALIGN)
    live: dict[int, int] = {}

    def took(off: int, nbytes: int) -> None:
        n = a.rounded(nbytes)
        assert ALIGN <= off and off + n <= 33 * ALIGN
        assert all(off + n <= o or o + m <= off for o, m in live.items())
        live[off] = n

    for kind, n in steps:
        if kind == "free" and live:
            off = sorted(live)[n % len(live)]
            a.free(off)
            del live[off]
        elif kind == "run":
            sizes = [(n + i) % 3 * ALIGN + 100 for i in range(n)]  # not whole pages: rounded up
            offs = a.alloc_run(sizes)
            for off, nb in zip(offs, sizes, strict=False):
                took(off, nb)
            if len(offs) < n:  # it stopped at the first that did not fit, as alloc would have
                with pytest.raises(PoolExhausted):
                    a.free(a.alloc(sizes[len(offs)]))
        elif n:
            try:
                took(a.alloc(n * ALIGN), n * ALIGN)
            except PoolExhausted:
                assert a.free_bytes < 32 * ALIGN
        assert a.free_bytes + sum(live.values()) == 32 * ALIGN
        assert all(o + m < p for (o, m), (p, _) in zip(a._free, a._free[1:], strict=False)), a._free  # coalesced
    for off in list(live):
        a.free(off)
    assert a.free_bytes == 32 * ALIGN and a.alloc(32 * ALIGN) == ALIGN  # coalesced back into one range


def test_a_run_of_blocks_lies_back_to_back_where_it_fits():
    a = StagingAllocator(8 * ALIGN)
    a.alloc(ALIGN)
    assert a.alloc_run([ALIGN, 2 * ALIGN, 10]) == [ALIGN, 2 * ALIGN, 4 * ALIGN]
    a.free(2 * ALIGN)  # each block is its own
    assert a.alloc_run([ALIGN] * 4) == [5 * ALIGN, 6 * ALIGN, 7 * ALIGN, 2 * ALIGN]  # then next fit, one by one
    assert a.alloc_run([ALIGN]) == [3 * ALIGN] and a.alloc_run([ALIGN]) == []


def test_split_keeps_a_small_metadata_area():
    assert split(1 << 20) == (64 << 10, (1 << 20) - (64 << 10))
    assert split(1 << 30) == (16 << 20, (1 << 30) - (16 << 20))


# ---- the session -------------------------------------------------------------------------------

LAY = KVLayout(4, 2, 64, "float16", 16)  # 8 KiB pages
STAGING = 1 << 20  # 960 KiB of layer blocks: half of it holds one layer of a 48-chunk request
BIG = list(range(48 * 16))  # 48 chunks: 384 KiB a layer, 1.5 MiB in all


def _wire(**kw) -> Wire:
    return Wire(lay=LAY, pages=256, staging_bytes=STAGING, **kw)


def _granted(w: Wire, rid: str) -> set[int]:
    return set(w.tx.reqs[rid].grant.blocks)


def _ask(w: Wire, rid: str, unit: int, ident: bytes = ENG) -> list:
    out = w.tx.on_ingress(ident, protocol.NeedStaging(req_id=rid, unit=unit), w.now)
    w.run(out)
    return [a.msg for a in out if isinstance(a, ToClient) and isinstance(a.msg, protocol.StagingGranted)]


def _hand_over(w: Wire, rid: str, layer: int, ident: bytes = ENG) -> None:
    w.engine(protocol.LayerReady(req_id=rid, layers=[layer]), ident)
    w.complete()


def test_a_request_larger_than_staging_gets_each_layer_as_the_one_before_lands():
    w = _wire()
    w.engine(begin("big", BIG, lay=LAY))
    assert _granted(w, "big") == {0}  # granted ahead only while staging stays half free
    words = w.words
    assert words[0].count == LAY.layers and words[0].value == 0  # the grant table (a word per layer), cleared, first
    # its block, for the native path and, at layer 0's word of that table, for the engine
    assert [(g.table, g.grants) for g in w.grants] == [(words[0].address, ((0, w.tx.reqs["big"].grant.blocks[0]),))]
    w.engine(protocol.LayerReady(req_id="big", layers=[1]))  # before its block: refused, nothing posted
    assert w.to_client[-1].code is ErrorCode.BAD_MESSAGE and "granted" in w.to_client[-1].message and not w.posted
    assert _ask(w, "big", 1) == [protocol.StagingGranted(req_id="big", unit=1)]  # room for a second layer
    _hand_over(w, "big", 0)
    _hand_over(w, "big", 1)
    assert _granted(w, "big") == set()  # both landed: their blocks are back
    for layer in (2, 3):
        assert _ask(w, "big", layer)
        _hand_over(w, "big", layer)
    w.engine(protocol.Finish(req_id="big"))
    assert isinstance(w.outcome("big"), protocol.Done) and w.outcome("big").layers == LAY.layers
    assert w.tx.grants.layers.free_bytes == w.tx.grants.layers.size and w.tx.grants.meta.free_bytes + w.tx.rings.meta_bytes == w.tx.grants.meta.size


@pytest.mark.parametrize("chunks", [1, 7, 48, 2000])
def test_ahead_bytes_is_the_least_staging_under_which_a_request_never_asks(chunks):
    """Every block granted with the allocation at ``ahead_bytes``, not at a page less: twice the request is not
    enough, since the metadata comes out of the region first. A small request gets the least staging a sender
    takes (1 MiB)."""
    ids = list(range(chunks * LAY.chunk_tokens))
    need = ahead_bytes(chunks * LAY.page_bytes, LAY.layers)
    for nbytes, all_ahead in ((need, True), (need - ALIGN, False)):
        if nbytes < MIN_BYTES:
            continue
        w = Wire(lay=LAY, pages=4 * chunks, staging_bytes=nbytes)
        w.engine(begin("r", ids, lay=LAY))
        assert (_granted(w, "r") == set(range(LAY.layers))) is all_ahead, (chunks, nbytes)
    assert need > 2 * LAY.layers * chunks * LAY.page_bytes
    assert (need == MIN_BYTES) is (chunks <= 7)  # (7 chunks: 448 KiB a request, 1 MiB of staging)


def test_engines_that_ask_are_served_in_the_order_they_asked():
    w = _wire()
    for rid in ("a", "b", "c"):
        w.engine(begin(rid, BIG, lay=LAY), ident=rid.encode())
    assert _granted(w, "a") == {0} and _granted(w, "b") == set() and _granted(w, "c") == set()
    assert _ask(w, "b", 0, b"b")  # fits beside a's layer 0
    assert _ask(w, "c", 0, b"c") == [] and _ask(w, "a", 1, b"a") == []  # staging full: c asked first
    assert w.tx.stats()["staging_grants_waiting"] == 2 and w.tx.counters.values["staging_waits"] == 1
    _hand_over(w, "b", 0, b"b")  # b's block comes back: c's turn, though a asked for less
    assert _granted(w, "c") == {0} and _granted(w, "a") == {0}
    granted = [m for ident, m in w.by_client if isinstance(m, protocol.StagingGranted)]
    assert granted[-1] == protocol.StagingGranted(req_id="c", unit=0)
    _hand_over(w, "a", 0, b"a")
    assert _granted(w, "a") == {1}


@pytest.mark.parametrize("finish_by", ["message", "ring"])
def test_a_failed_request_keeps_its_staging_until_its_engine_says_it_stopped(finish_by):
    """An engine may still read its grant table and write a block when its request fails (it has not
    read the error yet): the request's staging is reused only once the engine says it stopped (an Abort,
    as the client sends when it sees the failure, or its Finish: a message, or a record in its ring that
    names the request by handle), or dies, or lease_ms later."""
    w = _wire(lease_ms=5000)
    w.engine(begin("a", BIG, lay=LAY), ident=b"a")
    w.engine(begin("b", BIG, lay=LAY), ident=b"b")
    assert _ask(w, "a", 1, b"a") and _ask(w, "b", 0, b"b") == []
    w.run(w.tx.on_peer_lost("tcp://rx-a:1", "receiver gone", w.now))  # both fail; a held two blocks
    assert "a" not in w.tx.reqs and w.tx.stats()["staging_held_bytes"] > 2 * 384 * 1024  # and its grant table
    w.tick(4000)
    w.engine(begin("c", BIG, lay=LAY), ident=b"c")  # a new request finds a's blocks still held
    assert _granted(w, "c") == set() and _ask(w, "c", 0, b"c") == []
    out = w.tx.on_ingress(b"a", protocol.Abort(req_id="a", reason="saw it fail"), w.now)
    w.run(out)
    assert not [a for a in out if isinstance(a, ToClient) and a.ident == b"a"]  # an acknowledgement: no reply
    assert _granted(w, "c") == {0} and 0 < w.tx.stats()["staging_held_bytes"] < 4096  # b's grant table
    assert protocol.StagingGranted(req_id="c", unit=0) in [m for i, m in w.by_client if i == b"c"]
    if finish_by == "message":  # b's engine finishing says it stopped too
        w.engine(protocol.Finish(req_id="b"), ident=b"b")
    else:
        handle = next(m.handle for i, m in w.by_client if i == b"b" and isinstance(m, protocol.BeginOk))
        w.records(b"a", [(handle, 0, 0)])  # another engine's record naming b: it did not write b's staging
        assert w.tx.stats()["staging_held_bytes"] > 0
        w.records(b"b", [(handle, 0, 0)])
    assert w.tx.stats()["staging_held_bytes"] == 0


def test_a_request_that_fails_before_its_begin_ok_gives_its_grant_table_back_at_once(monkeypatch):
    """No engine learned where its grant table is (no BeginOk went out), so none can write it: the table goes
    back when the allocation's answer cannot be used, not a lease later."""
    from pdpush.sessions import sender as tx_session

    def unusable(r):
        raise ValueError("a pool this request cannot be put into")

    monkeypatch.setattr(tx_session.put_plan, "layer_puts", unusable)
    w = _wire(lease_ms=60_000)
    meta_free = w.tx.grants.meta.free_bytes
    w.engine(begin("a", BIG, lay=LAY), ident=b"a")
    assert "a" not in w.tx.reqs
    assert [m.code for i, m in w.by_client if i == b"a"] == [ErrorCode.INCOMPATIBLE_PEER]
    assert w.tx.stats()["staging_held_bytes"] == 0 and w.tx.grants.meta.free_bytes == meta_free


def test_an_engine_that_never_says_it_stopped_gets_its_staging_back_after_the_lease():
    w = _wire(lease_ms=5000)
    w.engine(begin("a", BIG, lay=LAY), ident=b"a")
    w.engine(protocol.Abort(req_id="a", reason="x"), ident=b"other")  # not a's engine: refused
    assert "a" in w.tx.reqs
    w.run(w.tx.on_peer_lost("tcp://rx-a:1", "receiver gone", w.now))
    w.tick(4999)
    assert w.tx.stats()["staging_held_bytes"] > 384 * 1024
    w.tick(2)
    assert w.tx.stats()["staging_held_bytes"] == 0 and w.tx.grants.layers.free_bytes == w.tx.grants.layers.size
    assert w.tx.grants.meta.free_bytes + w.tx.rings.meta_bytes == w.tx.grants.meta.size


def test_a_dead_engine_gives_its_held_staging_back():
    w = _wire(lease_ms=60_000)
    w.tx.on_lifeline(b"a")
    w.engine(begin("a", BIG, lay=LAY), ident=b"a")
    w.run(w.tx.on_peer_lost("tcp://rx-a:1", "receiver gone", w.now))
    assert w.tx.stats()["staging_held_bytes"] > 0
    w.run(w.tx.on_client_gone(b"a", w.now))  # its lifeline closed
    assert w.tx.stats()["staging_held_bytes"] == 0 and b"a" not in w.tx.lifelines


def test_only_a_layer_over_half_of_staging_is_too_large():
    w = _wire()
    w.engine(begin("held-prefix-is-free", BIG, lay=LAY))
    assert "held-prefix-is-free" in w.tx.reqs  # 1.5 MiB of KV through 1 MiB of staging
    w.engine(begin("huge", list(range(64 * 16)), lay=LAY))  # 512 KiB a layer: more than half of 960 KiB
    assert w.to_client[-1].code is ErrorCode.TOO_LARGE and "half" in w.to_client[-1].message


# ---- real daemons ------------------------------------------------------------------------------

REAL = KVLayout(16, 8, 128, "float16", 64)  # 256 KiB pages
TOKENS = 3 * 64  # 768 KiB a layer, 12 MiB in all: six times the sender's 2 MiB of staging


def test_a_request_several_times_the_staging_is_pushed_byte_for_byte(daemons):
    rx = daemons.receiver(**rx_opts(REAL, pool_pages=32))
    tx = daemons.sender(rx, staging_bytes=2 << 20)
    pc = PrefillClient(REAL, sock(tx), timeout_s=30)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        k, v = kv(REAL, TOKENS, seed=7)
        h, done = push(pc, "big", list(range(TOKENS)), k, v)
        assert done.bytes_sent == REAL.layers * 3 * REAL.page_bytes == 6 * (2 << 20)
        got_k, got_v = read_back(dc, "big", REAL, TOKENS)
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)
        st = status(sock(tx))
        # the first layer was granted with the BeginOk, every other one asked for as the engine came to it
        assert st["staging_asks"] == REAL.layers - 1 and st["requests_done"] == 1
    finally:
        pc.close()
        dc.close()


def test_engines_pushing_at_once_share_a_small_staging_and_all_succeed(daemons):
    rx = daemons.receiver(**rx_opts(REAL, pool_pages=64))
    tx = daemons.sender(rx, staging_bytes=2 << 20)
    results: dict[str, object] = {}

    def engine(rid: str, seed: int) -> None:
        pc = PrefillClient(REAL, sock(tx), timeout_s=30)
        try:
            k, v = kv(REAL, TOKENS, seed=seed)
            ids = list(range(seed * 10_000, seed * 10_000 + TOKENS))
            results[rid] = (push(pc, rid, ids, k, v)[1], k, v)
        except Exception as e:  # noqa: BLE001 - reported below
            results[rid] = e
        finally:
            pc.close()

    threads = [threading.Thread(target=engine, args=(f"r{i}", i + 1)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        for rid, res in sorted(results.items()):
            assert not isinstance(res, Exception), (rid, res)
            _, k, v = res
            got_k, got_v = read_back(dc, rid, REAL, TOKENS)
            assert np.array_equal(got_k, k) and np.array_equal(got_v, v)
        assert len(results) == 3 and status(sock(tx))["staging_asks"] >= 3 * (REAL.layers - 1) - 2
    finally:
        dc.close()


def test_an_engine_waits_for_staging_only_until_its_deadline(daemons):
    """A request holds every block it was granted (its engine never hands them over); the next one's
    engine waits, then gets a typed timeout; once the first is aborted, its blocks come back."""
    rx = daemons.receiver(**rx_opts(REAL, pool_pages=32))
    tx = daemons.sender(rx, staging_bytes=2 << 20, control_timeout_ms=500)
    hog = PrefillClient(REAL, sock(tx), timeout_s=30)
    pc = PrefillClient(REAL, sock(tx), timeout_s=1)
    try:
        h1 = hog.begin("hog", list(range(TOKENS)))
        h1.staging_layer(0)  # granted ahead
        h1.staging_layer(1)  # asked for: the rest of staging
        h2 = pc.begin("waits", list(range(50_000, 50_000 + TOKENS)))
        with pytest.raises(TransportTimeout, match="granted no staging"):
            h2.staging_layer(0)
        h2.abort("gave up")
        h1.abort("done hogging")
        pc.timeout_s = 30
        k, v = kv(REAL, TOKENS, seed=3)
        _, done = push(pc, "after", list(range(70_000, 70_000 + TOKENS)), k, v)
        assert done.layers == REAL.layers
    finally:
        hog.close()
        pc.close()


def test_an_engine_sees_its_request_fail_at_its_next_layer_and_its_staging_comes_back(daemons):
    """The receiver dies mid-push: the engine's next layer raises the typed failure (it reads its mail at
    every layer), tells the sender it stopped, and the request's held staging is free again."""
    rx = daemons.receiver(**rx_opts(REAL, pool_pages=32))
    tx = daemons.sender(rx, staging_bytes=2 << 20)
    pc = PrefillClient(REAL, sock(tx), timeout_s=10)
    try:
        k, v = kv(REAL, TOKENS, seed=5)
        h = pc.begin("doomed", list(range(TOKENS)))
        h.put_layer(0, k[0], v[0])
        rx.stop()
        until(lambda: status(sock(tx))["requests_failed"] == 1, 20, "the sender failing the request")
        assert status(sock(tx))["staging_held_bytes"] > 0  # its engine has not heard yet
        with pytest.raises(PdpushError) as e:
            for layer in range(1, REAL.layers):
                h.put_layer(layer, k[layer], v[layer])
        assert e.value.code in (ErrorCode.PEER_DEAD, ErrorCode.TRANSFER_FAILED, ErrorCode.TIMEOUT)
        until(lambda: status(sock(tx))["staging_held_bytes"] == 0, 10, "the held staging coming back")
        assert h.layers_handed_over < REAL.layers
    finally:
        pc.close()


def _gather_tables(h, layer: int, k: np.ndarray, v: np.ndarray):
    """``stage_gathered``'s source and row tables for plain ``[tokens, heads, row bytes]`` K and V (as the vLLM
    connector's are for its paged blocks): the two stacked as flat bytes, each share row's base in them."""
    comp, token, head = h.share_rows(layer, REAL.kv_heads)
    rb, tokens = REAL.row_bytes, k.shape[0]
    base = np.where(token >= 0, ((comp * tokens + token) * REAL.kv_heads + head) * rb, -1).astype(np.int64)
    emap = np.arange(REAL.head_dim, dtype=np.int32)[None]  # one map row: a row's elements, back to back
    return np.ascontiguousarray(np.stack([k, v])).reshape(-1), base, np.zeros(len(base), np.int32), emap


def test_a_gathered_layer_handed_over_in_its_staging_call_lands_once_and_byte_for_byte(daemons):
    """``stage_gathered(..., hand_over=True)``, the vLLM connector's staging of a layer: every layer pushed so reads
    back byte for byte. A layer handed over already is refused before a byte is written (once it lands its block may
    be another request's), by either staging call, and a request that failed meanwhile raises its typed failure at
    the next layer."""
    from pdpush.client import DecodeClient

    rx = daemons.receiver(**rx_opts(REAL, pool_pages=32))
    tx = daemons.sender(rx, staging_bytes=32 << 20)
    pc, dc = PrefillClient(REAL, sock(tx), timeout_s=10), DecodeClient(sock(rx), timeout_s=10)
    try:
        k, v = kv(REAL, TOKENS, seed=9)
        h = pc.begin("gathered", list(range(TOKENS)))
        for layer in range(REAL.layers):
            h.stage_gathered(layer, *_gather_tables(h, layer, k[layer], v[layer]), hand_over=True)
            if layer == 0:
                sh = h.layer_shares(0)
                at = int(h._grants[0]) - 1 + sh.share_offset(0, h.tp_rank)  # layer 0's block, as staging_layer
                block = h._base[at:at + sh.share_bytes]
                was = block.copy()
                for again in (lambda: h.stage_gathered(0, *_gather_tables(h, 0, k[1], v[1]), hand_over=True),
                              lambda: h.put_layer(0, k[1], v[1])):
                    with pytest.raises(ValueError, match="already handed over"):
                        again()
                assert np.array_equal(block, was)  # nothing written
        h.finish(timeout_s=30)
        got_k, got_v = read_back(dc, "gathered", REAL, TOKENS)
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)

        h = pc.begin("doomed-gathered", list(range(TOKENS)))
        h.stage_gathered(0, *_gather_tables(h, 0, k[0], v[0]), hand_over=True)
        rx.stop()
        until(lambda: status(sock(tx))["requests_failed"] == 1, 20, "the sender failing the request")
        with pytest.raises(PdpushError) as e:
            for layer in range(1, REAL.layers):
                h.stage_gathered(layer, *_gather_tables(h, layer, k[layer], v[layer]), hand_over=True)
        assert e.value.code in (ErrorCode.PEER_DEAD, ErrorCode.TRANSFER_FAILED, ErrorCode.TIMEOUT)
    finally:
        pc.close()
        dc.close()
