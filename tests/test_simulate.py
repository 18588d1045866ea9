"""``pdpush simulate`` (router/simulate.py): traces generated here, round-robin and the pooled cache
checked against independent replays, the cost model against the other policies, bad traces refused,
and the command's JSON."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from pdpush.router import simulate as sim
from pdpush_tools.bench.simulate import replay  # written apart from the simulator, as the check needs


def conversations(n_conv: int = 12, turns: int = 6, seed: int = 1, gap_ms: float = 400.0) -> list[sim.TraceRequest]:
    """Multi-turn chats: each turn's prompt is the last one's plus new blocks; every chat shares a system
    prompt block (as the conversation trace does), turns of different chats interleave."""
    rng = random.Random(seed)
    out, next_id = [], 1000
    hist = {c: [0] for c in range(n_conv)}
    t = 0.0
    for _ in range(turns):
        for c in rng.sample(range(n_conv), n_conv):
            add = rng.randint(1, 4)
            hist[c] = hist[c] + list(range(next_id, next_id + add))
            next_id += add
            out.append(sim.TraceRequest(t, len(hist[c]) * 512 - rng.randint(0, 500), rng.randint(1, 200),
                                        tuple(hist[c])))
            t += rng.expovariate(1 / gap_ms)
    return out


@pytest.mark.parametrize("nodes,capacity", [(1, 10), (3, 12), (4, 40)])
def test_round_robin_and_pooled_agree_with_an_independent_replay(nodes, capacity):
    trace = conversations()
    cfg = sim.SimConfig(prefill=nodes, decode=nodes, pool_blocks=capacity, prefill_cache_blocks=capacity)
    res = sim.run(trace, cfg, ("round_robin",))
    rr = res["policies"]["round_robin"]
    assert rr["decode_hit_share"] == pytest.approx(replay(trace, capacity, nodes, lambda i: i % nodes))
    assert rr["prefill_hit_share"] == pytest.approx(replay(trace, capacity, nodes, lambda i: i % nodes))
    assert res["pooled"]["decode_hit_share"] == pytest.approx(replay(trace, capacity * nodes, 1, lambda i: 0))
    assert rr["bytes_pushed"] == rr["blocks_pushed"] * 512 * cfg.kv_bytes_per_token
    assert rr["served"] == len(trace) and rr["rejected"] == 0


def test_a_hand_checked_trace():
    """Three requests, two nodes, round-robin: the third returns to node 0, which holds its first two blocks."""
    t = [sim.TraceRequest(0, 1024, 1, (1, 2)), sim.TraceRequest(10, 1024, 1, (1, 3)),
         sim.TraceRequest(20, 1536, 1, (1, 2, 4))]
    res = sim.run(t, sim.SimConfig(prefill=2, decode=2, pool_blocks=8, prefill_cache_blocks=8), ("round_robin",))
    rr = res["policies"]["round_robin"]
    assert rr["decode_hit_share"] == pytest.approx(2 / 7) and rr["blocks_pushed"] == 5
    assert rr["prefill_tokens"] == 1024 + 1024 + 512
    assert res["pooled"]["decode_hit_share"] == pytest.approx(3 / 7)  # block 1 twice, then 1, 2


def test_the_cost_model_follows_history_on_both_legs_within_load_caps():
    trace = conversations(n_conv=16, turns=8, seed=4)
    cfg = sim.SimConfig(prefill=4, decode=4, pool_blocks=120, prefill_cache_blocks=120, prefill_tokens_per_s=20_000)
    res = sim.run(trace, cfg)
    p = res["policies"]
    cost, ll, rr = p["cost_model"], p["least_loaded"], p["round_robin"]
    assert cost["prefill_tokens"] <= 0.85 * ll["prefill_tokens"]
    assert cost["prefill_hit_share"] > ll["prefill_hit_share"] and cost["decode_hit_share"] > rr["decode_hit_share"]
    assert cost["decode_hit_share"] >= res["pooled"]["decode_hit_share"] - 0.05
    assert cost["ttft_p50_ms"] <= min(x["ttft_p50_ms"] for x in p.values())
    assert cost["imbalance"] <= 2.0
    for r in p.values():
        assert set(r) >= {"prefill_hit_share", "decode_hit_share", "bytes_pushed", "prefill_tokens", "ttft_p50_ms",
                          "ttft_p99_ms", "slo_attainment", "rejected", "imbalance"}


def test_an_slo_refuses_what_the_cost_model_predicts_over_it():
    trace = conversations(n_conv=8, turns=4, seed=2, gap_ms=1.0)  # a burst: queues build
    cfg = sim.SimConfig(prefill=1, decode=1, prefill_tokens_per_s=2000, ttft_slo_ms=3000)
    res = sim.run(trace, cfg, ("cost_model", "least_loaded"))
    cost, ll = res["policies"]["cost_model"], res["policies"]["least_loaded"]
    assert cost["rejected"] > 0 and cost["served"] + cost["rejected"] == len(trace)
    assert ll["rejected"] == 0
    assert cost["slo_attainment"] > ll["slo_attainment"]


def test_conditional_disaggregation_is_a_candidate_of_the_cost_model():
    trace = conversations(n_conv=4, turns=6, seed=3)
    base = dict(prefill=2, decode=2, pool_blocks=200, prefill_cache_blocks=1, prefill_tokens_per_s=5000)
    off = sim.run(trace, sim.SimConfig(**base), ("cost_model",))["policies"]["cost_model"]
    on = sim.run(trace, sim.SimConfig(**base, local_tokens_per_s=50_000), ("cost_model",))["policies"]["cost_model"]
    assert on["prefill_tokens"] < off["prefill_tokens"] and on["ttft_p50_ms"] < off["ttft_p50_ms"]


def test_a_bad_trace_line_says_where(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a trace request"):
        sim.load_trace(p)
    p.write_text('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match=":1: a request needs"):
        sim.load_trace(p)
    with pytest.raises(ValueError, match="unknown policy"):
        sim.simulate([], sim.SimConfig(), "random")


def test_the_command_writes_json_markdown_and_a_plot(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                         "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                             for r in conversations()))
    out, md, png = tmp_path / "sim.json", tmp_path / "sim.md", tmp_path / "sim.png"
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "simulate", "--trace", str(trace), "--prefill", "2",
                        "--decode", "3", "--json", str(out), "--markdown", str(md), "--plot", str(png),
                        "--pool-blocks", "20"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert set(res["policies"]) == {"round_robin", "least_loaded", "decode_cache_aware", "cost_model"}
    assert 0 <= res["pooled"]["decode_hit_share"] <= 1
    assert "| cost_model |" in md.read_text() and png.stat().st_size > 1000
    bad = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "simulate", "--trace", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "No such file" in bad.stderr
