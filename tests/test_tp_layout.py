"""Tensor-parallel shares (layout.py): every rank's puts land each head of each page where the pool
keeps it, a decode rank's views read exactly its heads, and puts per rank per layer are as few as
the geometry allows. Pure logic, driven with numpy arrays standing in for staging and pool."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpush.layout import KVLayout, PoolGeometry, StagingShares, chunk_keys, rank_heads, runs

H = 8
LAY = KVLayout(3, H, 4, "float16", 4)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _page_values(chunk: int) -> np.ndarray:
    """A distinct value per (head, K/V, token, dim) of a chunk, as the model's KV would be."""
    lay = LAY
    n = lay.kv_heads * 2 * lay.chunk_tokens * lay.head_dim
    return (np.arange(n, dtype=np.uint16) + chunk * 7919).reshape(lay.page_shape)


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from(_divisors(H)), shards=st.sampled_from(_divisors(H)),
       pages=st.lists(st.integers(0, 19), min_size=1, max_size=6, unique=True))
def test_every_rank_puts_its_heads_where_the_pool_keeps_them(tp, shards, pages):
    pool = PoolGeometry(LAY, 20, shards)
    req_runs = runs(pages)
    sh = StagingShares(LAY, tp, shards, len(pages))
    staging = np.zeros(sh.kv_bytes, np.uint8)
    mem = np.zeros(pool.kv_bytes, np.uint8)
    layer = 1
    for rank in range(tp):  # each rank writes its heads into its share, as PushHandle.stage_layer does
        h0, h1 = rank_heads(H, tp, rank)
        share = staging[sh.share_offset(layer, rank):][:sh.share_bytes].view(np.uint16).reshape(
            sh.units // tp, len(pages), H // sh.units, *LAY.page_shape[1:])  # heads_aligned: units of whole heads
        hu = share.shape[2]
        for u in range(share.shape[0]):
            for i in range(len(pages)):
                share[u, i] = _page_values(i)[h0 + u * hu:h0 + (u + 1) * hu]
        ops = sh.ranges(layer, rank, req_runs, pool)
        assert len(ops) == sh.puts(req_runs)
        # the sender shifts layer 0's ranges instead of recomputing them for every layer
        assert ops == [(s + layer * sh.layer_bytes, d + layer * pool.layer_bytes, n)
                       for s, d, n in sh.ranges(0, rank, req_runs, pool)]
        assert sum(n for _, _, n in ops) == sh.share_bytes
        for src, dst, n in ops:
            mem[dst:dst + n] = staging[src:src + n]
        if tp == shards:  # one put per rank per page run
            assert len(ops) == len(req_runs)
    # the pool, read the way a decode client reads it, holds every head of every page
    per = H // shards
    for i, p in enumerate(pages):
        for s in range(shards):
            off = pool.offset(layer, s, p)
            got = mem[off:off + pool.shard_bytes].view(np.uint16).reshape(per, *LAY.page_shape[1:])
            assert np.array_equal(got, _page_values(i)[s * per:(s + 1) * per])
    other = [pool.offset(la, s, p) for la in (0, 2) for s in range(shards) for p in pages]
    assert not any(mem[o:o + pool.shard_bytes].any() for o in other)  # nothing landed in another layer


def test_rank_heads_split_and_replicate():
    assert [rank_heads(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # vLLM's replicas
    with pytest.raises(ValueError, match="neither divides"):
        rank_heads(8, 3, 0)


def test_a_prefill_tp_above_the_kv_heads_splits_each_replicated_head_s_bytes():
    lay = KVLayout(2, 2, 4, "float16", 4)  # head pages of 64 bytes; TP 4: two ranks hold each head
    sh = StagingShares(lay, 4, 1, 3)
    assert not sh.heads_aligned and sh.share_bytes == 3 * lay.page_bytes // 4
    assert [sh.share_span(r) for r in range(4)] == [(0, 32), (32, 64), (0, 32), (32, 64)]
    with pytest.raises(ValueError, match="neither divides"):
        StagingShares(KVLayout(2, 2, 4, "float16", 4), 3, 1, 3)


def test_chunk_keys_do_not_depend_on_tp_or_shards():
    ids = list(range(30))
    keys = chunk_keys(ids, LAY)
    for tp in (1, 2, 4):  # nothing about ranks or pool shards goes into a key
        for shards in (1, 2, 8):
            assert chunk_keys(ids, LAY) == keys and StagingShares(LAY, tp, shards, 1).layout.fingerprint() \
                == LAY.fingerprint()


def test_shards_must_divide_the_heads():
    with pytest.raises(ValueError, match="must divide kv_heads"):
        PoolGeometry(LAY, 4, 3)
