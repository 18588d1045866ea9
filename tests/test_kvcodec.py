"""The KV codec (kvcodec.py over layout.py's formulas): every element of every case written through
staging by each prefill rank, moved by the sender's put ranges into the pool, and read back by every
decode rank, for MHA/GQA (distinct and replicated heads) and MLA latents, 16/32-bit floats and fp8,
prefill TP 1, 2, 4 and 8, pool shards 1, 2 and 4 where the case allows them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpush import kvcodec as kc
from pdpush.layout import KVLayout, PoolGeometry, StagingShares, check_prefill_tp, chunk_keys, rank_heads, runs

DTYPES = ["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"]
TORCH = {d: getattr(torch, d) for d in DTYPES}


def _kv(lay: KVLayout, tokens: int, seed: int) -> list[torch.Tensor]:
    """The layer's components, every head, with random bits (fp8: every byte pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = tokens * lay.kv_heads * lay.row_bytes
    return [torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(TORCH[lay.dtype])
            .reshape(tokens, lay.kv_heads, lay.head_dim) for _ in range(lay.components)]


def _push(lay: KVLayout, comps, tokens: int, held: set[int], tp: int, shards: int, pages: list[int],
          pool_pages: int, torch_dst: bool = False):
    """Every rank stages its share of every layer (the same ``comps`` for each layer, shifted by the layer
    number), the sender's ranges move staging into the pool; returns the pool bytes."""
    new = [c for c in range(lay.num_chunks(tokens)) if c not in held]
    sh = StagingShares(lay, tp, shards, len(new))
    geom = PoolGeometry(lay, pool_pages, shards)
    staging = np.zeros(sh.kv_bytes, np.uint8)
    pool = np.zeros(geom.region_bytes, np.uint8)
    new_runs = runs(new)
    segs = kc.segments(new_runs, tokens, lay.chunk_tokens)
    page_runs = runs([pages[c] for c in new])
    for layer in range(lay.layers):
        layer_comps = [c.view(torch.uint8).add(layer).view(c.dtype) for c in comps]
        for r in range(tp):
            h0, h1 = rank_heads(lay.kv_heads, tp, r)
            mine = [c[:, h0:h1] for c in layer_comps]  # what this rank holds
            off = sh.share_offset(layer, r)
            dst = staging[off:off + sh.share_bytes]
            kc.stage(torch.from_numpy(dst) if torch_dst else dst, mine, sh, r, segs)
            for s, p, n in sh.ranges(layer, r, page_runs, geom):
                pool[p:p + n] = staging[s:s + n]
    return pool, geom


CASES = st.one_of(
    # MHA/GQA: heads 1, 2, 4, 8; TP dividing them or a multiple of them (replicated heads)
    st.tuples(st.just("mha"), st.sampled_from([1, 2, 4, 8]), st.sampled_from([4, 8, 16])),
    # MLA: one latent of kv_lora_rank + rope dims (tiny stand-ins for 512 + 64)
    st.tuples(st.just("mla"), st.just(1), st.sampled_from([9, 24, 36])),
)


@settings(max_examples=150, deadline=None)
@given(case=CASES, dtype=st.sampled_from(DTYPES), tp=st.sampled_from([1, 2, 4, 8]), shards=st.sampled_from([1, 2, 4]),
       chunk=st.sampled_from([4, 8]), tokens=st.integers(1, 40), data=st.data())
def test_every_element_round_trips_staging_pool_and_every_decode_rank(case, dtype, tp, shards, chunk, tokens, data):
    kind, heads, dim = case
    lay = KVLayout(2, heads, dim, dtype, chunk, "m", kind=kind)
    try:
        check_prefill_tp(lay, tp, shards)
        PoolGeometry(lay, 1, shards)
    except ValueError:
        return  # the case does not allow it (checked to be refused in test_refused_splits)
    n_chunks = lay.num_chunks(tokens)
    held = set(data.draw(st.sets(st.integers(0, n_chunks - 1), max_size=n_chunks - 1))) if n_chunks > 1 else set()
    pages = data.draw(st.permutations(range(n_chunks + 3)))[:n_chunks]
    _round_trip(lay, tp, shards, tokens, held, pages, data.draw(st.integers(0, 1 << 16)), data.draw(st.booleans()))


# each of stage()'s three paths, with more than one head per rank where the path allows it
@pytest.mark.parametrize("kind,heads,dim,tp,shards,chunk", [
    ("mha", 4, 8, 2, 2, 8),   # heads aligned: units of whole heads
    ("mha", 4, 512, 2, 2, 6),  # the same, rows of 1 KiB: the native copy's blocks (4 KiB a head) cut pages
    ("mha", 2, 8, 1, 4, 8),   # a unit is K or V rows of one of the rank's 2 heads
    ("mha", 4, 8, 2, 8, 8),   # units of rows, 2 heads per rank, 8 shards
    ("mha", 1, 8, 2, 1, 8),   # a replicated head: rank 0 its K rows, rank 1 its V rows
    ("mla", 1, 36, 4, 2, 8),  # an MLA latent's 2 token rows per unit
    ("mla", 1, 36, 8, 4, 4),  # a unit cuts rows: pages, then bytes
])
@pytest.mark.parametrize("native", [True, False], ids=["native-copy", "array-library"])
def test_each_staging_path_round_trips(kind, heads, dim, tp, shards, chunk, native, monkeypatch):
    if native:
        assert kc._native_copy() is not None, "make install builds pdpush_native._copy"
    else:
        monkeypatch.setattr(kc, "_NATIVE", [None])
    lay = KVLayout(2, heads, dim, "bfloat16", chunk, "m", kind=kind)
    for torch_dst in (False, True):
        _round_trip(lay, tp, shards, 3 * chunk + 3, {1}, [5, 0, 2, 4], 7, torch_dst)


def test_a_torch_staging_view_at_an_odd_offset_gets_every_byte_not_a_broadcast(monkeypatch):
    """Without the native copy (a CUDA tensor, an engine without pdpush_native) torch lanes follow a view's offset
    as well as the row: a destination 2 bytes into its storage got 2-byte lanes beside a source's 8-byte ones,
    and the assignment broadcast each source row's first lane over the row."""
    monkeypatch.setattr(kc, "_NATIVE", [None])
    lay = KVLayout(1, 2, 4, "float16", 2)  # rows of 8 bytes
    sh = StagingShares(lay, 1, 1, 1)
    k = torch.arange(2 * 2 * 4, dtype=torch.float16).reshape(2, 2, 4)
    segs = kc.segments([(0, 0, 1)], 2, 2)
    dst = torch.zeros(sh.share_bytes + 2, dtype=torch.uint8)[2:]
    kc.stage(dst, [k, k + 100], sh, 0, segs)
    want = np.zeros(sh.share_bytes, np.uint8)
    kc.stage(want, [k.numpy(), (k + 100).numpy()], sh, 0, segs)
    assert np.array_equal(dst.numpy(), want)


def test_native_copy_rows_walks_any_strides_and_refuses_what_it_cannot_copy():
    from pdpush_native._copy import copy_rows

    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, (5, 3, 4, 6), dtype=np.uint8)
    for perm in [(0, 1, 2, 3), (2, 0, 1, 3), (1, 2, 0, 3)]:
        view = src.transpose(perm)[::-1]  # a negative stride too
        dst = np.zeros(view.shape, np.uint8)
        copy_rows(dst, view)
        assert np.array_equal(dst, view)
        out = np.zeros((9, 12, 9, 6), np.uint8)[1:1 + view.shape[0], ::2][:, :view.shape[1], :view.shape[2]]
        copy_rows(out, view)  # a strided destination
        assert np.array_equal(out, view)
    ro = src.copy()
    ro.flags.writeable = False
    dst = np.zeros_like(src)
    copy_rows(dst, ro)  # a read-only source is fine
    assert np.array_equal(dst, src)
    with pytest.raises(ValueError, match="shapes differ"):
        copy_rows(np.zeros((5, 3, 4, 5), np.uint8), src)
    with pytest.raises(ValueError, match="contiguous"):
        copy_rows(np.zeros((5, 3, 6, 4), np.uint8).transpose(0, 1, 3, 2), src)
    with pytest.raises(TypeError):  # not bytes
        copy_rows(np.zeros((5, 3, 4, 6), np.float32), src)


def _round_trip(lay: KVLayout, tp: int, shards: int, tokens: int, held: set[int], pages: list[int], seed: int,
                torch_dst: bool) -> None:
    chunk = lay.chunk_tokens
    n_chunks = lay.num_chunks(tokens)
    pool_pages = n_chunks + 3
    comps = _kv(lay, tokens, seed)
    pool, geom = _push(lay, comps, tokens, held, tp, shards, pages, pool_pages, torch_dst=torch_dst)
    new = [c for c in range(n_chunks) if c not in held]
    new_tok = torch.cat([torch.arange(c * chunk, min(tokens, (c + 1) * chunk)) for c in new])
    page_of = torch.tensor(pages)[new_tok // chunk]
    for dtp in (1, 2, 4, 8):
        try:
            rank_heads(lay.kv_heads, dtp, 0)
        except ValueError:
            continue
        for r in range(dtp):
            h0, h1 = rank_heads(lay.kv_heads, dtp, r)
            for layer in range(lay.layers):
                want = [c.view(torch.uint8).add(layer)[new_tok, h0:h1] for c in comps]  # [t, h, D*B] bytes
                got = kc.read_rows(torch.from_numpy(pool), geom, layer, page_of, new_tok % chunk, (h0, h1))
                for ci in range(lay.components):
                    assert torch.equal(got[:, :, ci], want[ci].reshape(got[:, :, ci].shape)), (dtp, r, layer, ci)
                # whole pages, token-major again (numpy this time)
                pg = kc.read_pages(pool, geom, layer, np.asarray([pages[c] for c in new]), (h0, h1))
                rows = kc.page_rows_to_tokens(pg, n_chunks * chunk)
                sel = np.concatenate([np.arange(j * chunk, j * chunk + min(tokens, (c + 1) * chunk) - c * chunk)
                                      for j, c in enumerate(new)])
                for ci in range(lay.components):
                    assert np.array_equal(rows[sel, :, ci], want[ci].numpy().reshape(len(sel), h1 - h0, -1))


def test_elements_views_fp8_bytes_as_torch_float8():
    lay = KVLayout(1, 1, 4, "float8_e4m3fn", 2, kind="mla")
    x = torch.tensor([[[0.5, -1.0, 2.0, 448.0]]], dtype=torch.float8_e4m3fn)
    b = kc.as_row_bytes(x, lay.row_bytes)
    assert b.dtype == torch.uint8 and b.shape == (1, 1, 4)
    assert torch.equal(kc.elements(b, "float8_e4m3fn").float(), x.float())
    assert kc.elements(b.numpy(), "float8_e5m2").dtype == np.uint8


def test_refused_splits():
    gqa3 = KVLayout(2, 3, 8, "float16", 4)
    with pytest.raises(ValueError, match="neither divides"):
        check_prefill_tp(gqa3, 2)
    with pytest.raises(ValueError, match="pool shards"):
        PoolGeometry(gqa3, 4, 2)
    odd = KVLayout(2, 1, 3, "float8_e4m3fn", 1, kind="mla")  # a page of 3 bytes
    with pytest.raises(ValueError, match="equal parts"):
        check_prefill_tp(odd, 2)
    with pytest.raises(ValueError, match="kv_heads = 1"):
        KVLayout(2, 2, 576, "bfloat16", 16, kind="mla")
    from pdpush import protocol  # the wire's layout too: a bad one is a bad message, not an internal error

    with pytest.raises(ValueError, match="kv_heads = 1"):
        protocol.LayoutSpec(layers=2, kv_heads=2, head_dim=576, dtype="bfloat16", chunk_tokens=16, kind="mla")


def test_fingerprint_and_chunk_keys_cover_the_whole_description():
    base = KVLayout(2, 1, 576, "bfloat16", 16, "m", kind="mla")
    others = [KVLayout(2, 1, 576, "bfloat16", 16, "m"), KVLayout(2, 1, 576, "float8_e4m3fn", 16, "m", kind="mla"),
              KVLayout(2, 1, 320, "bfloat16", 16, "m", kind="mla"),
              KVLayout(2, 1, 576, "bfloat16", 16, "m", kind="mla", kv_scales="static"),
              KVLayout(2, 1, 576, "float8_e4m3fnuz", 16, "m", kind="mla")]
    fps = {lay.fingerprint() for lay in [base, *others]}
    assert len(fps) == 6  # fp8 e4m3fn and ROCm's e4m3fnuz differ too
    assert all(chunk_keys(list(range(20)), base)[0] != chunk_keys(list(range(20)), o)[0] for o in others)
    assert base.mismatch(others[0]) == "kind: 'mla' vs 'mha'"


@pytest.mark.parametrize("kind,heads,tp", [("mha", 2, 1), ("mha", 1, 2), ("mla", 1, 4)])
def test_a_partial_chunk_s_tail_rows_are_zeroed_never_left_from_an_earlier_request(kind, heads, tp):
    lay = KVLayout(1, heads, 8, "bfloat16", 4, kind=kind)
    tokens = 6  # chunk 1 has 2 of its 4 rows
    sh = StagingShares(lay, tp, 1, 2)
    comps = _kv(lay, tokens, 3)
    segs = kc.segments(runs([0, 1]), tokens, lay.chunk_tokens)
    for r in range(tp):  # what staging held before (an earlier request's bytes) leaves no trace
        dirty, clean = np.full(sh.share_bytes, 0xEE, np.uint8), np.zeros(sh.share_bytes, np.uint8)
        kc.stage(dirty, comps, sh, r, segs)
        kc.stage(clean, comps, sh, r, segs)
        assert np.array_equal(dirty, clean)
    pool, geom = _push(lay, comps, tokens, set(), tp, 1, [0, 1], 2)
    page1 = kc.read_pages(pool, geom, 0, np.array([1]), (0, heads))[0]  # [H, C, T, row bytes]
    assert not page1[:, :, 2:].any() and page1[:, :, :2].any()


def test_native_stage_pages_checks_every_index_before_writing():
    from pdpush_native._copy import stage_pages

    comps = [np.arange(5 * 4 * 6, dtype=np.uint8).reshape(5, 4, 6) for _ in range(2)]
    dst = np.full(2 * 3 * 2 * 2 * 4 * 6, 7, np.uint8)  # units 2, pages 3, 2 heads per unit, C 2, T 4, rows of 6
    segs = lambda *s: np.array(s, dtype=np.int64).reshape(-1, 3)  # noqa: E731
    for bad, match in [(segs((0, 2, 4)), "outside"),     # source rows 2..6 of 5
                       (segs((2, 0, 5)), "outside"),     # pages 2..4 of 3
                       (segs((-1, 0, 1)), "outside")]:
        with pytest.raises(IndexError, match=match):
            stage_pages(dst, comps, 0, 2, 2, 4, bad)
    with pytest.raises(ValueError, match="heads"):
        stage_pages(dst, comps, 1, 2, 2, 4, segs((0, 0, 1)))  # heads 1..5 of 4
    with pytest.raises(ValueError, match="different shapes"):
        stage_pages(dst, [comps[0], comps[1][:4]], 0, 2, 2, 4, segs((0, 0, 1)))
    with pytest.raises(ValueError, match="whole pages"):
        stage_pages(dst[:-1], comps, 0, 2, 2, 4, segs((0, 0, 1)))
    for tokens in (2**63, 2**62 + 1):  # a page size that wraps to 0 (a division by it) or to a few bytes (a memset
        with pytest.raises(ValueError, match="past 2"):  # of 2**63 bytes): both passed the checks
            stage_pages(dst, comps, 0, 2, 2, tokens, segs((0, 0, 1)))
    assert (dst == 7).all()  # nothing was written by a refused call
    stage_pages(dst, comps, 0, 2, 2, 4, segs((1, 0, 5)))  # pages 1 and 2; page 2 holds one row, then zeros
    pages = dst.reshape(2, 3, 2, 2, 4, 6)
    for u, j, i, c, t in np.ndindex(2, 3, 2, 2, 4):
        want = 7 if j == 0 else (comps[c][(j - 1) * 4 + t, u * 2 + i] if (j - 1) * 4 + t < 5 else 0)
        assert (pages[u, j, i, c, t] == want).all(), (u, j, i, c, t)


def _aligned(n: int, fill: int, at: int = 0) -> np.ndarray:
    """``n`` bytes of ``fill`` starting ``at`` bytes past a 64-byte boundary, a view of an array with 64 bytes of
    ``fill`` at least on each side (its ``base``: to see that nothing was written past them)."""
    raw = np.full(n + 192, fill, np.uint8)
    start = (-raw.ctypes.data) % 64 + 64 + at
    return raw[start:start + n]


@pytest.mark.parametrize("row", [16, 48, 128, 256, 512, 1024])
@pytest.mark.parametrize("at", [0, 16, 8], ids=["aligned", "16-aligned", "unaligned"])
@pytest.mark.parametrize("wide", [True, False], ids=["avx2", "sse2"])
@pytest.mark.parametrize("eb", [2, 4])
def test_streaming_stores_into_staging_write_what_cached_stores_do(row, at, wide, eb):
    """``stream``: staging is written with streaming stores where the CPU has them, rows and places whole cache
    lines (rows of 128, 256 and 512 bytes inlined, other multiples of 64 by 64 bytes; anything else cached). A
    layer staged, and rows gathered (runs of a map row, and K tiles: AVX2's passes, then SSE2's), each way into
    the same places: the same bytes, each where it belongs, nothing written around them; the calls say whether
    they streamed (so a path that never does shows), and ``set_streaming(False)`` turns it off. A staged row is
    streamed 64, 32 or 16 bytes a store (``set_stream_width``: AVX-512, AVX2, SSE2, as far as the CPU has them)."""
    from pdpush_native._copy import gather_rows, set_stream_width, set_streaming, set_wide_tiles, stage_pages

    rng = np.random.default_rng(row + at + eb)
    T, hu, units, C, tokens, n, h0 = 4, 2, 2, 2, 11, 5, 1
    comps = [rng.integers(0, 256, (tokens, h0 + units * hu + 1, row), dtype=np.uint8) for _ in range(C)]
    # a rank's heads from h0 on; two segments, each ending in a partial page, the second from page 3 on
    segs = np.array([[0, 0, 5], [3, 5, 6]], np.int64)
    N, D = 16 // eb * 2, row // eb  # a K tile (dimension-major: two of SSE2's G tokens) and V rows
    d, k = np.arange(D)[None, :], np.arange(N)[:, None]
    emap = np.concatenate([d * N + k, N * D + k * D + d]).astype(np.int32)
    src = rng.integers(0, 256, 3 * 2 * N * D * eb, dtype=np.uint8)
    rows = 3 * 2 * N
    base = np.repeat(np.arange(3, dtype=np.int64) * 2 * N * D * eb, 2 * N)
    sel = np.tile(np.arange(2 * N, dtype=np.int32), 3)
    whole_lines = at == 0 and row % 64 == 0
    if not (set_streaming(True) or not whole_lines):
        pytest.skip("this CPU has no SSE2: nothing streams")
    out = {}
    was_wide, was_width = set_wide_tiles(wide), set_stream_width(64)
    try:
        # the gather's table in another order (its groups of 2N rows, each one base, last first), dst_rows saying
        # where each entry goes, as kvcodec.source_order's: the tiles within a group are found as before
        perm = np.arange(rows).reshape(3, 2 * N)[::-1].reshape(-1).copy()
        for how in ("stream", "stream32", "stream16", "cached", "switched off", "stream, reordered"):
            set_streaming(how != "switched off")
            set_stream_width(int(how[6:] or 64) if how.startswith("stream") and how[6:].isdigit() else 64)
            staged = _aligned(units * n * hu * C * T * row, 0xEE, at)
            gathered = _aligned(rows * row, 0xEE, at).reshape(rows, row)
            table = (base[perm], sel[perm], emap, eb, how != "cached", perm) if "reordered" in how else \
                (base, sel, emap, eb, how != "cached")
            streamed = (stage_pages(staged, comps, h0, units, hu, T, segs, stream=how != "cached"),
                        gather_rows(gathered, src, *table))
            assert streamed == ((whole_lines and how.startswith("stream")),) * 2, (how, streamed)
            for x in (staged, gathered):  # nothing written around them
                at0 = x.ctypes.data - x.base.ctypes.data
                assert (x.base[:at0] == 0xEE).all() and (x.base[at0 + x.nbytes:] == 0xEE).all(), how
            out[how] = staged.copy(), gathered.copy()
    finally:
        set_streaming(True)
        set_wide_tiles(was_wide)
        set_stream_width(was_width)
    for how in ("stream32", "stream16", "cached", "switched off", "stream, reordered"):
        assert np.array_equal(out["stream"][0], out[how][0]) and np.array_equal(out["stream"][1], out[how][1]), how
    pages = out["stream"][0].reshape(units, n, hu, C, T, row)
    token_at = {}  # (page, row) -> source token; the rows of a segment's partial last page past it: zeroed
    for j0, s0, m in segs.tolist():
        for r in range(-(-m // T) * T):
            token_at[j0 + r // T, r % T] = s0 + r if r < m else None
    for u, j, i, c, t in np.ndindex(units, n, hu, C, T):
        if (j, t) not in token_at:
            continue  # a page no segment writes (page 2): left as it was
        tok = token_at[j, t]
        want = comps[c][tok, h0 + u * hu + i] if tok is not None else 0
        assert (pages[u, j, i, c, t] == want).all(), (u, j, i, c, t)
    assert (pages[:, 2] == 0xEE).all()
    elems = src.view(np.uint16 if eb == 2 else np.uint32)
    for r in range(rows):
        b, m = base[r] // eb, sel[r]
        assert np.array_equal(out["stream"][1][r].view(elems.dtype), elems[b + emap[m]]), r


@pytest.mark.parametrize("tp,shards,given", [(1, 1, "rank"), (2, 1, "rank"), (2, 2, "all"), (4, 1, "all"),
                                             (1, 2, "rank")])
def test_stage_planned_s_numpy_fast_path_writes_what_the_general_path_does(tp, shards, given):
    """``stage_planned`` hands C-contiguous numpy inputs straight to the native copy (``_planned_rows``); the
    bytes equal the general path's (the same inputs as torch tensors), for a rank's heads or every head, and
    inputs the fast path does not take (a strided view, a wrong shape) go the general way: equal bytes, or its
    error."""
    assert kc._native() is not None and getattr(kc._native(), "stage_pages", None) is not None
    lay = KVLayout(1, 8, 16, "bfloat16", 4)
    tokens = 3 * 4 + 1
    new = [0, 2, 3]
    sh = StagingShares(lay, tp, shards, len(new))
    segs = kc.segments(runs(new), tokens, lay.chunk_tokens)
    comps = [c.view(torch.int16).numpy() for c in _kv(lay, tokens, 11)]
    for r in range(tp):
        plan = kc.stage_plan(sh, r, segs)
        h0, h1 = rank_heads(lay.kv_heads, tp, r)
        src = comps if given == "all" else [np.ascontiguousarray(c[:, h0:h1]) for c in comps]
        assert kc._planned_rows(src, plan) is not None  # the fast path takes these
        fast, slow = np.full(sh.share_bytes, 0xEE, np.uint8), np.full(sh.share_bytes, 0xEE, np.uint8)
        kc.stage_planned(fast, src, plan)
        kc.stage_planned(torch.from_numpy(slow), [torch.from_numpy(c) for c in src], plan)
        assert np.array_equal(fast, slow)
        strided = [np.concatenate([c, c], axis=2)[:, :, :lay.head_dim] for c in src]  # rows 2x apart
        assert kc._planned_rows(strided, plan) is None
        other = np.full(sh.share_bytes, 0xEE, np.uint8)
        kc.stage_planned(other, strided, plan)
        assert np.array_equal(other, slow)
        with pytest.raises(ValueError, match="token rows"):
            kc.stage_planned(other, [c[:4] for c in src], plan)
        with pytest.raises(ValueError, match="rows of"):
            kc.stage_planned(other, [c[:, :, :5].copy() for c in src], plan)
        with pytest.raises(ValueError, match="components"):
            kc.stage_planned(other, src[:1], plan)
