"""Tensor parallelism end to end: real receiver and sender daemons, prefill ranks as separate
processes (as a TP engine's workers are) pushing their heads of one request, decode ranks reading
theirs; every byte checked on the decode side."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from pdpush.client import DecodeClient, status
from pdpush.layout import KVLayout
from pdpush_tools.bench.tp import Ranks, read_ranks, source
from tests.helpers import rx_opts, sock, until, writable_pool

LAY = KVLayout(3, 4, 16, "float16", 16)  # 4 KV heads: TP 1, 2 and 4 all hold whole heads


def _spec(rng, n: int) -> dict:
    return {"ids": rng.integers(0, 1 << 31, size=n).tolist(), "seed": int(rng.integers(1 << 31))}




@pytest.mark.parametrize("prefill_tp,shards,checksums", [(2, 2, False), (1, 2, False), (2, 1, False), (4, 2, False),
                                                         (2, 2, True)])
def test_ranks_push_one_request_and_any_decode_tp_reads_its_heads(daemons, prefill_tp, shards, checksums):
    """With checksums on, the receiver checks each layer against the ranks' combined digests."""
    rx = daemons.receiver(**rx_opts(LAY, pool_pages=32), pool_shards=shards, verify_checksums=checksums)
    tx = daemons.sender(rx, checksums=checksums)
    rng = np.random.default_rng(prefill_tp * 10 + shards)
    ranks = Ranks(LAY, sock(tx), prefill_tp)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        first = _spec(rng, 5 * LAY.chunk_tokens + 7)  # not a multiple of the chunk size
        ranks.push("tp-a", first)
        outs = ranks.results()
        assert not [o["error"] for o in outs if o["error"]]
        assert {o["chunks_skipped"] for o in outs} == {0} and {o["layers"] for o in outs} == {LAY.layers}
        # a fresh pool gives the request one page run: where a rank's heads are one pool shard, one put
        # per layer per rank; otherwise as few as the shard split allows (one per page)
        for o in outs:
            assert o["rank_puts"] <= LAY.layers * (1 if prefill_tp == shards else 6)
        with dc.open("tp-a"):  # held open: the reads of one decode TP then do not end the request
            for decode_tp in (1, 2, 4, 8):  # every decode TP reads its own heads (8 > 4 heads: vLLM's replicas)
                assert read_ranks(dc, "tp-a", source(LAY, first), LAY, decode_tp)
        # a second prompt sharing 3 chunks: every rank skips the same chunks, only the new ones move
        second = {"ids": first["ids"][:3 * LAY.chunk_tokens] + rng.integers(0, 1 << 31, 40).tolist(),
                  "seed": int(rng.integers(1 << 31)), "prefix": first, "shared": 3 * LAY.chunk_tokens}
        hit_before = status(sock(rx))["chunks_hit"]
        ranks.push("tp-b", second)
        outs = ranks.results()
        assert not [o["error"] for o in outs if o["error"]]
        assert {o["chunks_skipped"] for o in outs} == {3}
        assert status(sock(rx))["chunks_hit"] - hit_before == 3  # one allocation, not one per rank
        with dc.open("tp-b"):
            for decode_tp in (1, 2):
                assert read_ranks(dc, "tp-b", source(LAY, second), LAY, decode_tp)
        if checksums:
            assert status(sock(rx))["checksum_failures"] == 0 and status(sock(rx))["requests_committed"] == 2
    finally:
        dc.close()
        ranks.close()


def test_a_corrupted_share_of_one_rank_is_caught_on_the_decode_side(daemons):
    """The negative control of the byte check: one rank's heads changed in the pool fail it."""
    rx = daemons.receiver(**rx_opts(LAY, pool_pages=32), pool_shards=2)
    tx = daemons.sender(rx)
    rng = np.random.default_rng(3)
    ranks = Ranks(LAY, sock(tx), 2)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        spec = _spec(rng, 40)
        ranks.push("tp-c", spec)
        assert not [o["error"] for o in ranks.results() if o["error"]]
        with dc.open("tp-c", tp_rank=1, tp_size=2) as held:  # holds it while we corrupt rank 1's heads
            held.wait_committed()
            with writable_pool(dc) as writable:
                writable(held.layer_runs(1)[0].view(np.uint8))[0, 0, 0, 0, 0] ^= 0xFF
            assert read_ranks(dc, "tp-c", source(LAY, spec), LAY, 1) is False
            assert read_ranks(dc, "tp-c", source(LAY, spec), LAY, 2) is False
    finally:
        dc.close()
        ranks.close()


def test_a_rank_killed_mid_push_fails_the_request_for_the_others_and_the_pool_comes_back(daemons):
    rx = daemons.receiver(**rx_opts(LAY, pool_pages=32), pool_shards=2, lease_ms=3000, quarantine_ms=200)
    tx = daemons.sender(rx)
    rng = np.random.default_rng(4)
    ranks = Ranks(LAY, sock(tx), 2)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        total = status(sock(rx))["pool_pages_total"]
        ranks.push("tp-d", _spec(rng, 70), stall={1: 0})  # rank 1 hands over layer 0, then hangs
        stalled = ranks.results(1)[0]
        assert stalled["rank"] == 1 and stalled.get("stalled")
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        out = ranks.results(1, timeout_s=30)[0]  # rank 0 finished its layers and waits for the commit
        assert out["rank"] == 0 and out["code"] == "peer_dead" and "rank 1 of 2" in out["error"]
        assert status(sock(tx))["requests_failed"] == 1
        until(lambda: status(sock(rx))["pool_pages_free"] == total, 10, "every page back in the pool")
        with pytest.raises(Exception, match="gone"):
            dc.open("tp-d", timeout_s=2)
    finally:
        dc.close()
        ranks.close()


def test_pipeline_stages_push_one_request_with_one_allocation_and_one_commit(daemons):
    """Two stages x TP 2 (four processes) push their own layers under one push id: one allocation,
    one skip list for every participant, one commit; every byte read back."""
    lay = KVLayout(4, 4, 16, "float16", 16)
    rx = daemons.receiver(**rx_opts(lay, pool_pages=32), pool_shards=2)
    tx = daemons.sender(rx)
    rng = np.random.default_rng(5)
    ranks = Ranks(lay, sock(tx), 2, pp=2)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        first = _spec(rng, 3 * lay.chunk_tokens + 5)
        ranks.push("pp-a", first)
        outs = ranks.results()
        assert not [o["error"] for o in outs if o["error"]]
        assert {o["layers"] for o in outs} == {lay.layers}  # the Done of every participant: all 4 layers
        assert status(sock(rx))["requests_committed"] == 1
        with dc.open("pp-a"):  # held open: the reads of one decode TP then do not end the request
            for decode_tp in (1, 2):
                assert read_ranks(dc, "pp-a", source(lay, first), lay, decode_tp)
        second = {"ids": first["ids"][:2 * lay.chunk_tokens] + rng.integers(0, 1 << 31, 20).tolist(),
                  "seed": int(rng.integers(1 << 31)), "prefix": first, "shared": 2 * lay.chunk_tokens}
        hit_before = status(sock(rx))["chunks_hit"]
        ranks.push("pp-b", second)
        outs = ranks.results()
        assert not [o["error"] for o in outs if o["error"]]
        assert {o["chunks_skipped"] for o in outs} == {2} and status(sock(rx))["chunks_hit"] - hit_before == 2
        assert status(sock(rx))["requests_committed"] == 2
        assert read_ranks(dc, "pp-b", source(lay, second), lay, 1)
    finally:
        dc.close()
        ranks.close()


def test_a_stage_killed_mid_push_fails_the_request_for_the_other_stage_and_the_pool_comes_back(daemons):
    lay = KVLayout(4, 4, 16, "float16", 16)
    rx = daemons.receiver(**rx_opts(lay, pool_pages=32), lease_ms=3000, quarantine_ms=200)
    tx = daemons.sender(rx)
    rng = np.random.default_rng(6)
    ranks = Ranks(lay, sock(tx), 1, pp=2)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        total = status(sock(rx))["pool_pages_total"]
        ranks.push("pp-d", _spec(rng, 50), stall={1: 2})  # stage 1 hands over layer 2 (its first), then hangs
        stalled = ranks.results(1)[0]
        assert stalled["rank"] == 1 and stalled.get("stalled")
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        out = ranks.results(1, timeout_s=30)[0]  # stage 0 pushed layers 0 and 1 and waits for the commit
        assert out["rank"] == 0 and out["code"] == "peer_dead" and "stage 1 of 2, rank 0 of 1" in out["error"], out
        assert status(sock(tx))["requests_failed"] == 1
        until(lambda: status(sock(rx))["pool_pages_free"] == total, 10, "every page back in the pool")
        with pytest.raises(Exception, match="gone"):
            dc.open("pp-d", timeout_s=2)
    finally:
        dc.close()
        ranks.close()
