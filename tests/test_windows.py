"""Sliding-window layer groups (pure logic): a request's items by group (layout.items, plan.py), and the
sessions' holding per (chunk, group), driven through a sender and a receiver session on a driven clock."""

from __future__ import annotations

import pytest

from pdpush import protocol
from pdpush.layout import KVLayout, chunk_keys
from pdpush.plan import RequestPlan
from tests.test_sessions import Wire

LAY = KVLayout(4, 2, 64, "float16", 16, windows=(16, 0, 16, 0))  # window 16: the last chunk or two


def test_groups_put_full_attention_first_then_each_window():
    lay = KVLayout(5, 2, 8, "float16", 16, windows=(32, 0, 64, 32, 0))
    assert [(g.window, g.layers) for g in lay.groups] == [(0, (1, 4)), (32, (0, 3)), (64, (2,))]
    assert KVLayout(2, 2, 8, "float16", 16, windows=(0, 0)).windows == ()  # all full: one group, no windows
    assert KVLayout(2, 2, 8, "float16", 16).fingerprint() == KVLayout(2, 2, 8, "float16", 16, windows=(0, 0)).fingerprint()
    assert lay.fingerprint() != KVLayout(5, 2, 8, "float16", 16).fingerprint()
    with pytest.raises(ValueError, match="one window"):
        KVLayout(2, 2, 8, "float16", 16, windows=(16,))


@pytest.mark.parametrize("tokens,window", [(50, [2, 3]), (48, [2]), (16, [0]), (17, [0, 1]), (33, [1, 2])])
def test_a_window_group_needs_the_chunks_of_the_prompt_s_last_window_tokens(tokens, window):
    swa = LAY.groups[1]
    assert list(LAY.group_chunks(swa, tokens)) == window
    assert list(LAY.group_chunks(LAY.groups[0], tokens)) == list(range(LAY.num_chunks(tokens)))
    items = LAY.items(tokens)
    assert items == [(0, c) for c in range(LAY.num_chunks(tokens))] + [(1, c) for c in window]
    keys = LAY.item_keys(chunk_keys(list(range(tokens)), LAY), tokens)
    assert len(set(keys)) == len(keys) and keys[:LAY.num_chunks(tokens)] == chunk_keys(list(range(tokens)), LAY)


def test_a_plan_places_each_group_s_new_pages_in_staging_and_the_pool():
    plan = RequestPlan(LAY, 50, held=[0, 1])  # chunks 0, 1 of full attention held; window chunks 2, 3 new
    full, swa = plan.groups
    assert (full.new_chunks, swa.new_chunks, plan.n_new) == ([2, 3], [2, 3], 4)
    assert swa.first_item == 4 and swa.new_first == 2
    plan.set_pages([9, 10, 30, 31])
    assert full.page_runs == [(0, 9, 2)] and swa.page_runs == [(0, 30, 2)]
    assert plan.layer_bytes(0) == 2 * LAY.page_bytes and plan.meta_bytes == (LAY.layers + 4) * 8
    # staging: one block per layer with new pages, each its group's new pages, granted in layer order
    assert plan.staging_units() == [(layer, 2 * LAY.page_bytes) for layer in range(LAY.layers)]


def _bytes(w: Wire, rid: str) -> int:
    return next(m for m in w.to_client if isinstance(m, protocol.Done) and m.req_id == rid).bytes_sent


def test_window_layers_push_only_their_window_and_holding_is_per_chunk_and_group():
    w = Wire(lay=LAY)
    rx = w.rx["tcp://rx-a:1"]
    ids = list(range(1000, 1050))  # 4 chunks; the window layers need chunks 2, 3
    w.push("a", ids)
    w.complete()
    w.complete()
    assert _bytes(w, "a") == (2 * 4 + 2 * 2) * LAY.page_bytes  # full layers: 4 pages; window layers: 2
    assert rx.counters.values["bytes_window_saved"] == 2 * 2 * LAY.page_bytes
    assert w.tx.counters.values["bytes_window_saved"] == 2 * 2 * LAY.page_bytes
    assert rx.pool.chunks_cached == 6  # 4 full-attention items and 2 window items
    # a shorter prompt sharing chunks 0 and 1: its window needs chunk 1, whose window bytes "a" never sent.
    # Only the full-attention items of chunks 0, 1 are held; the window item of chunk 1 is pushed, never read
    short = ids[:32] + [7, 8, 9]  # 35 tokens: chunks 0, 1, 2; window chunks 1, 2
    w.push("b", short)
    w.complete()
    w.complete()
    done = next(m for m in w.to_client if isinstance(m, protocol.Done) and m.req_id == "b")
    assert done.chunks_skipped == 2
    assert done.bytes_sent == (2 * 1 + 2 * 2) * LAY.page_bytes
    # the same prompt again: everything is held, nothing moves
    w.push("c", short)
    w.complete()
    done = next(m for m in w.to_client if isinstance(m, protocol.Done) and m.req_id == "c")
    assert done.chunks_skipped == 5 and done.bytes_sent == 0
    rx.check()


def test_a_claim_of_a_windowed_prefix_takes_only_chunks_whose_window_items_are_held():
    w = Wire(lay=LAY)
    rx = w.rx["tcp://rx-a:1"]
    ids = list(range(2000, 2064))  # 4 full chunks
    w.push("a", ids)
    w.complete()
    w.complete()
    # the whole prompt: every item held
    out = rx.on_local(b"d", protocol.Claim(req_id="c1", chunk_keys=chunk_keys(ids, LAY), last_chunk_tokens=16,
                                           lease_ms=1000), w.now)
    assert out[-1].msg.chunks == 4
    # a longer prompt: its 4 leading chunks are held with their window (chunks 2, 3 of a 64-token prompt)
    more = ids + [5] * 20
    out = rx.on_local(b"d", protocol.Claim(req_id="c2", chunk_keys=chunk_keys(more, LAY), last_chunk_tokens=4,
                                           lease_ms=1000), w.now)
    assert out[-1].msg.chunks == 4
    rx.check()
