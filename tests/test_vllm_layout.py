"""Pure logic of the vLLM edge: slot maps, tile-map learning, gather/scatter round trips.

The real CPU_ATTN kernel is exercised by tests/test_vllm.py (real engines); here synthetic
writers with known packings check that whatever packing a backend uses is learnt exactly.
"""

from __future__ import annotations

import pytest
import torch

from pdpush.errors import ConfigError
from pdpush.integrations import vllm_layout as vl


def transposed_k_writer(key, value, kv, slots):
    """Like the CPU 'vec' kernel: K stored dimension-major [D, N], V token-major [N, D] per tile."""
    B, H, N, C = kv.shape
    D = C // 2
    tiles = kv.view(B, H, N * C)
    for i, s in enumerate(slots.tolist()):
        b, n = divmod(s, N)
        for h in range(H):
            tiles[b, h, n: N * D: N] = key[i, h]            # K[n, d] at d * N + n
            tiles[b, h, N * D + n * D: N * D + (n + 1) * D] = value[i, h]


def token_major_writer(key, value, kv, slots):
    B, H, N, C = kv.shape
    D = C // 2
    t = kv.view(B, H, 2, N, D)
    for i, s in enumerate(slots.tolist()):
        b, n = divmod(s, N)
        t[b, :, 0, n] = key[i]
        t[b, :, 1, n] = value[i]


@pytest.mark.parametrize("writer", [transposed_k_writer, token_major_writer])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_learnt_tile_map_round_trips_through_the_writer(writer, dtype):
    N, D, H, B = 8, 16, 3, 5
    kmap, vmap = vl.learn_tile_map(N, D, dtype, writer)
    paged = vl.PagedKV("CPU_ATTN", D, (kmap, vmap))
    kv = torch.zeros(B, H, N, 2 * D, dtype=dtype)
    paged.check(kv)
    torch.manual_seed(0)
    tokens = 13
    key, value = torch.randn(tokens, H, D).to(dtype), torch.randn(tokens, H, D).to(dtype)
    slots = torch.tensor([9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 3])  # blocks 1, 3 and 0
    writer(key, value, kv, slots)  # what the backend's forward would write
    sm = vl.SlotMap([0, 1, 2, 3, 4], N, slots, chunk_tokens=6)  # manager blocks = kernel blocks here
    blk, off = sm.addresses(N)
    k, v = paged.gather(kv, blk, off)
    assert torch.equal(k, key) and torch.equal(v, value)
    out = torch.zeros_like(kv)
    paged.scatter(out, blk, off, key, value)
    assert torch.equal(out, kv)  # byte-identical to the backend's own write: no other element touched


def test_a_writer_that_loses_elements_is_refused():
    def lossy(key, value, kv, slots):
        token_major_writer(key, value, kv, slots)
        kv.view(-1)[0] = 0

    with pytest.raises(ConfigError, match="tile packing"):
        vl.learn_tile_map(4, 8, torch.float32, lossy)


def test_channel_backend_round_trip_and_partial_blocks_stay_untouched():
    B, H, N, D = 4, 2, 16, 8
    kv = torch.randn(B, H, N, 2 * D)
    keep = kv.clone()
    paged = vl.PagedKV("FLASH_ATTN", D)
    paged.check(kv)
    sm = vl.SlotMap([2, 0], N, torch.arange(5, 20), chunk_tokens=8)  # tokens 5..19: block 2 then block 0
    blk, off = sm.addresses(N)
    k, v = paged.gather(kv, blk, off)
    assert torch.equal(k[0], kv[2, :, 5, :D]) and torch.equal(v[-1], kv[0, :, 3, D:])
    new_k, new_v = torch.ones_like(k), -torch.ones_like(v)
    paged.scatter(kv, blk, off, new_k, new_v)
    assert torch.equal(kv[2, :, 5:, :D], torch.ones(H, 11, D))
    assert torch.equal(kv[2, :, :5], keep[2, :, :5])  # tokens before the range are not touched
    assert torch.equal(kv[0, :, 4:], keep[0, :, 4:])   # nor after it
    assert torch.equal(kv[1], keep[1]) and torch.equal(kv[3], keep[3])


def test_slot_map_with_virtual_block_splitting():
    # manager blocks of 64 tokens, kernel blocks of 32: manager block 3 = kernel blocks 6 and 7
    sm = vl.SlotMap([3, 1], 64, torch.arange(60, 70), chunk_tokens=48)
    blk, off = sm.addresses(32)
    assert blk.tolist() == [7] * 4 + [2] * 6
    assert off.tolist() == [28, 29, 30, 31, 0, 1, 2, 3, 4, 5]
    assert sm.chunk_idx.tolist() == [1] * 10 and sm.chunk_rows.tolist() == list(range(12, 22))
    assert sm.block_ids == [1, 3]


def test_bad_geometry_is_a_clear_error():
    with pytest.raises(ConfigError, match="backend"):
        vl.PagedKV("SOME_MLA_BACKEND", 64)
    with pytest.raises(ConfigError, match="2 x head_size"):
        vl.PagedKV("FLASH_ATTN", 64).check(torch.zeros(2, 1, 16, 64))
    with pytest.raises(ValueError, match="does not fit"):
        vl.SlotMap([0], 16, torch.arange(0, 17), chunk_tokens=8)
    with pytest.raises(ValueError, match="is not a block"):
        vl.SlotMap([5, 1 << 64], 16, torch.arange(16, 20), chunk_tokens=8)
    for bad in (-1, 1 << 31, 1 << 51):  # the token's own block; another's may be anything (never read)
        with pytest.raises(ValueError, match=f"block id {bad} is not"):
            vl.SlotMap([5, bad], 16, torch.arange(16, 20), chunk_tokens=8)
    assert vl.SlotMap([-1, 5], 16, torch.arange(16, 20), chunk_tokens=8).block_ids == [5]


def test_mla_latent_round_trip_through_the_registered_and_the_save_views():
    B, N, L = 5, 16, 40
    reg = torch.randn(B, 1, N, L)  # as register_kv_caches gets it
    keep = reg.clone()
    paged = vl.paged_cache("CPU_MLA", L, "mla")
    paged.check(reg)
    paged.check(reg[:, 0])  # the 3-D view save_kv_layer gets
    sm = vl.SlotMap([3, 1], N, torch.arange(10, 30), chunk_tokens=48)
    blk, off = sm.addresses(N)
    (lat,) = paged.gather(reg[:, 0], blk, off)
    assert lat.shape == (20, 1, L) and torch.equal(lat[0, 0], reg[3, 0, 10]) and torch.equal(lat[-1, 0], reg[1, 0, 13])
    paged.scatter(reg, blk, off, -lat)
    assert torch.equal(reg[3, 0, 10:], -keep[3, 0, 10:]) and torch.equal(reg[1, 0, :14], -keep[1, 0, :14])
    assert torch.equal(reg[1, 0, 14:], keep[1, 0, 14:]) and torch.equal(reg[0], keep[0])  # nothing else touched
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        paged.check(torch.zeros(2, 1, 16, 64))
    with pytest.raises(ConfigError, match="MLA backend"):
        vl.paged_cache("CPU_ATTN", L, "mla")
    with pytest.raises(ConfigError, match="MLA backend"):
        vl.paged_cache("CPU_MLA", L, "mha")


_DERIVE = r"""
import json, sys
from types import SimpleNamespace as NS
from pdpush.errors import ConfigError
from pdpush.integrations.vllm.settings import ConnectorSettings, derive_layout


def config(**model):
    m = dict(dtype="torch.float32", use_mla=False, served_model_name="m", model="m", layers=4, kv_heads=2, head=64)
    m.update(model)
    hf = {"num_hidden_layers": m["layers"], "model_type": "llama", **m.get("hf", {})}
    mc = NS(dtype=m["dtype"], use_mla=m["use_mla"], served_model_name=m["served_model_name"], model=m["model"],
            get_total_num_hidden_layers=lambda: m["layers"], get_total_num_kv_heads=lambda: m["kv_heads"],
            get_head_size=lambda: m["head"], hf_text_config=NS(to_dict=lambda: hf))
    cc = NS(cache_dtype=m.get("cache_dtype", "auto"), kv_cache_dtype_skip_layers=m.get("skip", []),
            calculate_kv_scales=m.get("calc", False))
    return NS(model_config=mc, cache_config=cc)


s = ConnectorSettings(chunk_tokens=48, model_id="m")
cases = {"mla": dict(use_mla=True, kv_heads=4, head=576, layers=61), "fp8": dict(cache_dtype="fp8_e5m2"),
         "bf16": dict(dtype="torch.bfloat16"), "ds_mla": dict(cache_dtype="fp8_ds_mla"),
         "per_token_head": dict(cache_dtype="fp8_per_token_head"), "skip": dict(cache_dtype="fp8", skip=["0"]),
         "calc": dict(cache_dtype="fp8", calc=True), "f64": dict(dtype="torch.float64"),
         "gemma": dict(layers=2, hf=dict(model_type="gemma3_text", sliding_window=32,
                                         layer_types=["sliding_attention", "full_attention"])),
         "nemotron": dict(layers=2, hf=dict(model_type="nemotron_h", layers_block_type=["mamba", "attention"],
                                            mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=1,
                                            conv_kernel=4)),
         "jamba": dict(hf=dict(model_type="jamba", layers_block_type=["mamba", "attention"] * 2))}
out = {}
for name, kw in cases.items():
    try:
        out[name] = derive_layout(config(**kw), s).to_dict()
    except ConfigError as e:
        out[name] = str(e)
try:  # an engine against its receiver's config
    derive_layout(config(use_mla=True, kv_heads=4, head=576), ConnectorSettings(receiver_config=sys.argv[1]))
except ConfigError as e:
    out["receiver"] = str(e)
from pdpush.integrations.vllm.settings import cache_dtype_of

out["fnuz"] = [cache_dtype_of("torch.bfloat16", c, p) for c, p in (("fp8", "torch.float8_e4m3fnuz"),
               ("fp8_e4m3", "torch.float8_e4m3fn"), ("fp8_e5m2", "torch.float8_e4m3fnuz"))]
print(json.dumps(out))
"""


def test_the_connector_derives_every_kind_of_layout_and_refuses_by_name(tmp_path):
    """derive_layout with vLLM importable (as in an engine), on stand-in configs."""
    import json
    import subprocess

    from pdpush_tools.harness.vllm_cluster import ROOT, require_vllm_python

    rc = tmp_path / "receiver.toml"
    rc.write_text('layers = 4\nkv_heads = 2\nhead_dim = 64\ndtype = "float32"\nchunk_tokens = 48\nmodel_id = "m"\n')
    r = subprocess.run([str(require_vllm_python()), "-c", _DERIVE, str(rc)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    mla = out["mla"]  # vLLM counts 4 heads for MLA: the latent is 1
    assert (mla["kind"], mla["kv_heads"], mla["head_dim"], mla["layers"], mla["dtype"]) == ("mla", 1, 576, 61, "float32")
    assert (out["fp8"]["dtype"], out["fp8"]["kv_scales"]) == ("float8_e5m2", "static")
    assert out["bf16"]["dtype"] == "bfloat16"
    assert out["gemma"]["windows"] == [32, 0]  # sliding-window layers beside full ones: each its window
    nem = out["nemotron"]  # one attention layer, one Mamba2 layer of state (conv [x|B|C], ssm)
    assert (nem["layers"], nem["state_layers"], nem["state_units"], len(nem["state"])) == (1, 1, 8, 4)
    assert "jamba" in out["jamba"] and "does not move" in out["jamba"]  # refused by name
    for name, word in [("ds_mla", "fp8_ds_mla"), ("per_token_head", "fp8_per_token_head"),
                       ("skip", "kv_cache_dtype_skip_layers"), ("calc", "calculate_kv_scales"), ("f64", "float64")]:
        assert isinstance(out[name], str) and word in out[name], (name, out[name])
    # ROCm's fp8 (e4m3fnuz) is its own element type: its bytes mean other values than e4m3fn's
    assert out["fnuz"] == [["float8_e4m3fnuz", "static"], ["float8_e4m3fn", "static"], ["float8_e5m2", "static"]]
    # refused at start-up, naming both sides' values
    assert "kv_heads: 2 vs 1, head_dim: 64 vs 576, kind: 'mha' vs 'mla'" in out["receiver"], out["receiver"]


@pytest.mark.parametrize("case", [
    # backend, kv heads in the layout, engine heads (this rank's), tp, pool shards, writer, chunk tokens
    ("CPU_ATTN", 4, 2, 2, 1, transposed_k_writer, 8),    # heads aligned, K dimension-major in the tile
    ("CPU_ATTN", 2, 2, 1, 4, transposed_k_writer, 8),    # units of K or V rows of a head
    ("CPU_ATTN", 1, 1, 2, 1, token_major_writer, 8),     # a replicated head: K rows on one rank, V on the other
    ("FLASH_ATTN", 4, 4, 1, 2, None, 8),                 # K and V side by side in each slot
    ("FLASH_ATTN", 2, 1, 2, 2, None, 8),                 # this rank's one head of two
    ("CPU_MLA", 1, 1, 4, 2, None, 8),                    # an MLA latent: token rows split between 4 ranks
    ("CPU_MLA", 1, 1, 8, 4, None, 4),                    # units that cut rows: no table (gather then stage)
])
def test_one_pass_gather_from_paged_blocks_equals_gather_then_stage(case):
    """kvcodec.gather from vLLM's blocks into a rank's staging share (the connector's one-pass path) writes
    the same bytes as gathering token-major rows and staging them, partial and held chunks included."""
    import numpy as np

    from pdpush import kvcodec as kc
    from pdpush.layout import KVLayout, StagingShares

    backend, kv_heads, heads, tp, shards, writer, T = case
    mla = backend == "CPU_MLA"
    D, N, tokens, held = (36 if mla else 16), 8, 3 * T + 5, {1}
    lay = KVLayout(2, kv_heads, D, "bfloat16", T, "m", kind="mla" if mla else "mha")
    B = 8
    g = torch.Generator().manual_seed(5)
    if mla:
        kv = torch.randn(B, 1, N, D, generator=g).to(torch.bfloat16)
        paged = vl.PagedLatent(backend, D)
    else:
        kv = torch.randn(B, heads, N, 2 * D, generator=g).to(torch.bfloat16)
        maps = vl.learn_tile_map(N, D, torch.bfloat16, writer) if writer else None
        paged = vl.PagedKV(backend, D, maps)
    paged.check(kv)
    chunks = [c for c in range(lay.num_chunks(tokens)) if c not in held]
    new_tok = torch.cat([torch.arange(c * T, min(tokens, (c + 1) * T)) for c in chunks])
    sm = vl.SlotMap([6, 2, 7, 0, 5], N, new_tok, T)  # scattered blocks
    blk, off = sm.addresses(N)
    segs = kc.segments([(j, c, 1) for j, c in enumerate(chunks)], tokens, T, new_only=True)  # a partial last
    sh = StagingShares(lay, tp, shards, len(chunks))
    moved = []  # whether a rank's table in the cache's order is another than staging's
    for rank in range(tp):
        want = np.full(sh.share_bytes, 7, np.uint8)
        kc.stage(want.reshape(sh.share_shape()), paged.gather(kv, blk, off), sh, rank, segs)
        what = kc.share_rows(sh, rank, segs, 1 if mla else heads)
        if T == 4:
            assert what is None  # stage cuts rows there; the connector gathers then stages
            continue
        got = np.full(sh.share_bytes, 7, np.uint8)
        kc.gather(got.reshape(sh.share_shape()), sh, vl.storage(kv), *paged.rows(kv, blk, off, *what))
        assert np.array_equal(got, want), rank
        # the table in the cache's memory order (what the connector gathers with): the same bytes
        base, sel, emap, dst_rows = kc.source_order(*paged.rows(kv, blk, off, *what))
        assert sorted(dst_rows.tolist()) == list(range(len(base))), rank
        moved.append((np.diff(dst_rows) != 1).any())
        k = int((base >= 0).sum())  # rows read from the cache in address order, then the zeroed ones
        assert (base[:k] >= 0).all() and (np.diff(base[:k]) >= 0).all(), rank
        got = np.full(sh.share_bytes, 7, np.uint8)
        kc.gather(got.reshape(sh.share_shape()), sh, vl.storage(kv), base, sel, emap, dst_rows=dst_rows)
        assert np.array_equal(got, want), rank
    assert T == 4 or any(moved)  # (scattered blocks: some rank's reads are reordered)


def test_a_sorted_gather_table_finds_its_k_tiles_behind_zeroed_rows_and_from_a_block_s_middle():
    """``source_order`` puts a table's zeroed rows (a partial chunk's tail) last, ``gather_rows`` learns the tiles'
    step past zeroed rows, and tries tiles from every row a tile missed at: a table of K rows of a push that starts
    in a block's middle, its zeroed rows first, still goes through the transposed tiles (the only rows here that
    stream, so the call says it streamed), sorted or not, and writes the K rows as vLLM's own gather reads them.
    Before, zeroed rows among the first eight hid the tiles' step, and tiles were looked for in fixed groups of G
    rows from row 0, which a mid-block start shifts off every block."""
    import platform

    import numpy as np
    from pdpush_native._copy import gather_rows

    from pdpush import kvcodec as kc

    D, N, first, z = 32, 8, 3, 9  # rows of 64 bytes: whole cache lines, which tiles stream into; 9 zeroed rows
    paged = vl.PagedKV("CPU_ATTN", D, vl.learn_tile_map(N, D, torch.bfloat16, transposed_k_writer))
    kv = torch.randn(4, 1, N, 2 * D, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    toks = torch.arange(first, first + 2 * N)  # block 0's slots 3.., block 2 whole, block 3's first three
    blk, off = vl.SlotMap([0, 2, 3], N, toks, 16).addresses(N)
    n = len(toks)
    token = np.concatenate([np.full(z, -1), np.arange(n)])  # the zeroed rows first
    table = paged.rows(kv, blk, off, np.zeros(n + z, np.int64), token, np.zeros(n + z, np.int64))
    k_rows = paged.gather(kv, blk, off)[0][:, 0].contiguous().view(torch.uint8).reshape(n, 64).numpy()
    raw = np.full((n + z) * 64 + 64, 0xEE, np.uint8)
    at = (-raw.ctypes.data) % 64

    def gathered(*args, **kw):
        dst = raw[at:at + (n + z) * 64].reshape(n + z, 64)
        dst[:] = 0xEE
        return gather_rows(dst, vl.storage(kv), *args, 2, True, **kw), dst.copy()

    base, sel, emap, dst_rows = kc.source_order(*table)
    assert (base[-z:] < 0).all() and (base[:-z] >= 0).all()  # zeroed rows last
    for streamed, got in (gathered(base, sel, emap, dst_rows=dst_rows),  # sorted
                          gathered(np.asarray(table[0]), np.asarray(table[1]), emap)):  # as made: zeroed rows first
        assert np.array_equal(got[z:], k_rows) and not got[:z].any()
        if platform.machine() in ("x86_64", "AMD64"):  # (tiles are SSE2's)
            assert streamed, "no tile was found"


@pytest.mark.parametrize("writer", [transposed_k_writer, token_major_writer])
def test_the_decode_s_scatter_in_the_pool_s_order_writes_what_the_token_order_does(writer):
    """The decode connector's table (a row per token, head and component, as ``load.py`` makes it) sorted by
    where its rows are read (``kvcodec.scatter_order``: the pool's head-major pages) fills vLLM's blocks with the
    same bytes as the table in token order: every row says where it goes."""
    import numpy as np

    from pdpush import kvcodec as kc

    D, N, H, C, T, tokens = 16, 8, 2, 2, 8, 29  # a partial last page
    maps = vl.learn_tile_map(N, D, torch.bfloat16, writer)
    paged = vl.PagedKV("CPU_ATTN", D, maps)
    sm = vl.SlotMap([6, 2, 7, 0, 5], N, torch.arange(tokens), T)  # scattered blocks
    blk, off = sm.addresses(N)
    rb = D * 2
    pool = np.random.default_rng(4).integers(0, 256, 5 * H * C * T * rb, dtype=np.uint8)
    idx = np.arange(tokens * H * C)
    comp, tok, head = idx % C, idx // (H * C), idx // C % H
    src_off = ((tok // T) * H * C * T + (head * C + comp) * T + tok % T) * rb  # head-major pages
    out = []
    for sort in (False, True):
        kv = torch.zeros(8, H, N, 2 * D, dtype=torch.bfloat16)
        base, sel, emap = paged.rows(kv, blk, off, comp, tok, head)
        table = kc.scatter_order(base, sel, src_off) if sort else (np.asarray(base), np.asarray(sel), src_off)
        if sort:
            assert (np.diff(table[2]) > 0).all() and sorted(table[2].tolist()) == sorted(src_off.tolist())
        kc.scatter(vl.storage(kv), table[0], table[1], emap, 2, pool, table[2])
        out.append(kv.view(torch.int16).clone())  # (the bits: random bytes hold NaNs)
    assert out[0].any() and torch.equal(out[0], out[1])


@pytest.mark.parametrize("eb", [1, 2, 4, 8])
@pytest.mark.parametrize("D", [16, 20, 3, 44])
@pytest.mark.parametrize("wide", [True, False], ids=["avx2", "sse2"])
def test_gather_and_scatter_rows_equal_an_element_by_element_reference(eb, D, wide):
    """The native row copies against numpy, element by element, on tables that form dimension-major tiles
    (copied G tokens at a time, 2G elements a pass with AVX2, G with SSE2) in staging's order and in the pool's
    token-major one, with the tiles broken by a shuffled run of rows, a zeroed row and a tail of D that is no
    multiple of G (44: two AVX2 passes of 16-bit elements, one SSE2 pass, then single elements)."""
    import numpy as np
    from pdpush_native._copy import gather_rows, scatter_rows, set_wide_tiles

    was = set_wide_tiles(wide)
    if wide and not set_wide_tiles(wide):  # asked for, and not on: the CPU has no AVX2 (every x86 box here has)
        set_wide_tiles(was)
        pytest.skip("this CPU has no AVX2; the sse2 cases run")
    try:
        _gather_scatter_against_reference(eb, D, np, gather_rows, scatter_rows)
    finally:
        set_wide_tiles(was)


def _gather_scatter_against_reference(eb, D, np, gather_rows, scatter_rows):

    rng = np.random.default_rng(eb * 100 + D)
    N, tiles, H = 16, 5, 3  # tokens per tile; tiles (a block's K tile then its V rows: [D, N] then [N, D])
    d, n = np.arange(D)[None, :], np.arange(N)[:, None]
    emap = np.concatenate([d * N + n, N * D + n * D + d]).astype(np.int32)  # K of slot n: row n; V: N + n
    tile_bytes = 2 * N * D * eb
    src = rng.integers(0, 256, tiles * tile_bytes + 64, dtype=np.uint8)

    def reference(base, sel):
        out = np.zeros((len(base), D * eb), np.uint8)
        for r, (b, m) in enumerate(zip(base, sel, strict=True)):
            if b >= 0:
                for k in range(D):
                    a = b + int(emap[m, k]) * eb
                    out[r, k * eb:(k + 1) * eb] = src[a:a + eb]
        return out

    blocks = rng.permutation(tiles)
    tok = np.arange(3 * N + 5)  # whole tiles and part of one
    for order in ("staging", "pool"):
        if order == "staging":  # (head, component, token): consecutive rows are consecutive tokens
            h, c, t = (x.reshape(-1) for x in np.meshgrid(np.arange(H), np.arange(2), tok, indexing="ij"))
        else:  # (token, head, component): a token's next is H * 2 rows on
            t, h, c = (x.reshape(-1) for x in np.meshgrid(tok, np.arange(H), np.arange(2), indexing="ij"))
        base = blocks[t // N].astype(np.int64) * tile_bytes  # (every head in one tile: they share its bytes)
        sel = (c * N + t % N).astype(np.int32)
        base[7] = -1  # a zeroed row (gather) / a row that goes nowhere (scatter)
        base[40:48], sel[40:48] = base[40:48][::-1].copy(), sel[40:48][::-1].copy()  # a run of rows reversed
        want = reference(base, sel)
        got = np.full_like(want, 9)
        gather_rows(got, src, base, sel, emap, eb)
        assert np.array_equal(got, want), order
        rows = rng.integers(0, 256, want.shape, dtype=np.uint8)
        keep = base >= 0
        dst = np.full(src.shape, 5, np.uint8)
        # one writer per element: the rows of distinct (token, component) (heads share a tile here)
        _, first = np.unique(np.stack([t, c]).T[keep], axis=0, return_index=True)
        only = np.flatnonzero(keep)[np.sort(first)]
        b2, s2 = base.copy(), sel.copy()
        b2[np.setdiff1d(np.arange(len(base)), only)] = -1
        scatter_rows(dst, b2, s2, emap, eb, rows.reshape(-1), np.arange(len(base), dtype=np.int64) * D * eb)
        want_dst = np.full(src.shape, 5, np.uint8)
        for r in only:
            for k in range(D):
                a = b2[r] + int(emap[s2[r], k]) * eb
                want_dst[a:a + eb] = rows[r, k * eb:(k + 1) * eb]
        assert np.array_equal(dst, want_dst), order


def test_one_pass_gather_refuses_addresses_outside_the_cache():
    import numpy as np
    from pdpush_native._copy import gather_rows

    src = np.arange(64, dtype=np.uint8)
    emap = np.arange(4, dtype=np.int32)[None]
    dst = np.zeros((2, 8), np.uint8)
    gather_rows(dst, src, np.array([0, -1], np.int64), np.zeros(2, np.int32), emap, 2)
    assert dst[0].tolist() == list(range(8)) and not dst[1].any()  # a negative base zeroes the row
    with pytest.raises(IndexError, match="outside"):
        gather_rows(dst, src, np.array([0, 58], np.int64), np.zeros(2, np.int32), emap, 2)
    with pytest.raises(IndexError, match="outside"):
        gather_rows(dst, src, np.array([0, 0], np.int64), np.array([0, 1], np.int32), emap, 2)
    with pytest.raises(ValueError, match="rows of"):
        gather_rows(dst, src, np.array([0, 0], np.int64), np.zeros(2, np.int32), emap, 4)
    # a table in another order says which row each entry fills: a permutation, else nothing is written (a row
    # filled twice and one never would push a staging row's old bytes)
    gather_rows(dst, src, np.array([8, 0], np.int64), np.zeros(2, np.int32), emap, 2, dst_rows=np.array([1, 0]))
    assert dst[0].tolist() == list(range(8)) and dst[1].tolist() == list(range(8, 16))
    dst[:] = 0
    for bad in ([0, 0], [1, 2], [-1, 0], [0]):
        with pytest.raises(ValueError, match="dst_rows"):
            gather_rows(dst, src, np.array([8, 0], np.int64), np.zeros(2, np.int32), emap, 2,
                        dst_rows=np.array(bad, np.int64))
        assert not dst.any(), bad


def test_one_pass_gather_refuses_a_reversed_row_and_an_empty_map():
    import numpy as np
    from pdpush_native._copy import gather_rows

    src = np.arange(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="contiguous"):  # one row, written backwards: refused, not overrun
        gather_rows(np.zeros((1, 8), np.uint8)[:, ::-1], src, np.zeros(1, np.int64), np.zeros(1, np.int32),
                    np.arange(4, dtype=np.int32)[None], 2)
    with pytest.raises(ValueError, match="no elements"):
        gather_rows(np.zeros((1, 0), np.uint8), src, np.zeros(1, np.int64), np.zeros(1, np.int32),
                    np.zeros((1, 0), np.int32), 2)
    with pytest.raises(IndexError, match="outside"):  # a base past the source, with a map reaching back
        gather_rows(np.zeros((1, 8), np.uint8), src, np.array([(1 << 62)], np.int64), np.zeros(1, np.int32),
                    np.array([[-(1 << 30), 0, 1, 2]], np.int32), 2)


@pytest.mark.parametrize("case", [
    # backend, kv heads in the layout, this rank's heads [h0, h1), pool shards, writer
    ("CPU_ATTN", 4, (2, 4), 2, transposed_k_writer),  # a TP rank's heads, K dimension-major in the tile
    ("CPU_ATTN", 2, (0, 2), 1, token_major_writer),
    ("FLASH_ATTN", 4, (0, 4), 4, None),                # K and V side by side in each slot
    ("CPU_MLA", 1, (0, 1), 1, None),                   # an MLA latent
])
def test_one_pass_scatter_from_the_pool_equals_read_rows_then_scatter(case):
    """kvcodec.scatter (the decode's one-pass copy from the pool into vLLM's blocks) writes exactly what
    reading token-major rows out of the pool and scattering them does, and nothing else."""
    import numpy as np

    from pdpush import kvcodec as kc
    from pdpush.layout import KVLayout, PoolGeometry

    backend, kv_heads, (h0, h1), shards, writer = case
    mla = backend == "CPU_MLA"
    D, N, T, tokens, pages = (36 if mla else 16), 8, 8, 29, 12
    lay = KVLayout(2, kv_heads, D, "bfloat16", T, "m", kind="mla" if mla else "mha")
    geom = PoolGeometry(lay, pages, shards)
    rng = np.random.default_rng(3)
    pool = rng.integers(0, 256, geom.region_bytes, dtype=np.uint8)
    heads = h1 - h0
    if mla:
        shape, paged = (8, 1, N, D), vl.PagedLatent(backend, D)
    else:
        shape = (8, heads, N, 2 * D)
        paged = vl.PagedKV(backend, D, vl.learn_tile_map(N, D, torch.bfloat16, writer) if writer else None)
    sm = vl.SlotMap([6, 2, 7, 0, 5], N, torch.arange(tokens), T)
    blk, off = sm.addresses(N)
    src_page = torch.tensor([9, 3, 4, 11], dtype=torch.int64)[sm.chunk_idx]  # the request's pages, by chunk
    layer = 1
    want = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = want.clone()
    rows = kc.read_rows(torch.from_numpy(pool), geom, layer, src_page, sm.chunk_rows, (h0, h1))
    x = kc.elements(rows, "bfloat16")
    paged.scatter(want, blk, off, *[x[:, :, c] for c in range(x.shape[2])])
    C = lay.components
    idx = torch.arange(tokens * heads * C)
    base, sel, emap = paged.rows(got, blk, off, idx % C, idx // (heads * C), idx // C % heads)
    at = kc.pool_row_offsets(geom, layer, src_page, sm.chunk_rows, (h0, h1))
    # the connector builds layer 0's offsets once and shifts them to each layer
    assert np.array_equal(at, kc.pool_row_offsets(geom, 0, src_page, sm.chunk_rows, (h0, h1)) + geom.offset(layer, 0, 0))
    kc.scatter(vl.storage(got), base, sel, emap, 2, pool, at)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_one_pass_scatter_refuses_addresses_outside_either_side_and_writes_nothing():
    import numpy as np
    from pdpush_native._copy import scatter_rows

    src = np.arange(64, dtype=np.uint8)
    emap = np.arange(4, dtype=np.int32)[None]
    dst = np.zeros(32, np.uint8)
    scatter_rows(dst, np.array([0, -1], np.int64), np.zeros(2, np.int32), emap, 2, src, np.array([8, 0], np.int64))
    assert dst[:8].tolist() == list(range(8, 16)) and not dst[8:].any()  # a negative base: the row goes nowhere
    dst[:] = 0
    for base, sel, off in (([0, 25], [0, 0], [0, 8]),     # past the destination's end
                           ([0, 0], [0, 1], [0, 8]),      # a map row that is not there
                           ([0, 8], [0, 0], [0, 57]),     # past the source's end
                           ([0, 8], [0, 0], [0, -1])):    # before the source's start
        with pytest.raises(IndexError, match="outside"):
            scatter_rows(dst, np.array(base, np.int64), np.array(sel, np.int32), emap, 2, src,
                         np.array(off, np.int64))
        assert not dst.any()  # checked before anything is written
    with pytest.raises(ValueError, match="one entry per row"):
        scatter_rows(dst, np.zeros(2, np.int64), np.zeros(1, np.int32), emap, 2, src, np.zeros(2, np.int64))


def test_storages_make_a_layer_s_flat_bytes_once_per_cache_tensor_and_anew_for_another():
    """``Storages``: the connector's flat view of a layer's cache is made at its first use and reused while vLLM
    hands over the same tensor; another tensor under that name (caches made anew) gets its own view and geometry."""
    st = vl.Storages()
    a = torch.arange(2 * 3 * 4 * 8, dtype=torch.float32).reshape(2, 3, 4, 8)
    flat, geo = st.get("l0", a)
    assert st.get("l0", a)[0] is flat and geo == ((2, 3, 4, 8), (96, 32, 8, 1), torch.float32)
    assert torch.equal(flat, vl.storage(a)) and flat.numel() == a.numel() * 4
    b = torch.zeros(2, 3, 4, 16, dtype=torch.bfloat16)[..., :8]  # strided: rows 16 apart
    flat_b, geo_b = st.get("l0", b)
    assert flat_b is not flat and geo_b == ((2, 3, 4, 8), (192, 64, 16, 1), torch.bfloat16)
    assert flat_b.numel() == vl.storage(b).numel() and st.get("l1", a)[0] is not flat  # one view per name
