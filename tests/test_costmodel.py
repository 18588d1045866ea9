"""The router's cost model (router/costmodel.py): predicted TTFT per (prefill, decode) pair and per decode
instance alone, the choice under load caps and an SLO, and the speeds it learns. Pure logic."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpush.router import costmodel as cm

PROMPT = cm.Prompt(tokens=4096, chunk_tokens=256, chunk_bytes=1 << 20, layers=32)


def test_a_pairs_prediction_is_queue_compute_exposed_push_and_wait():
    p = cm.PrefillCand(True, 1, tokens_per_s=1000.0, pending_tokens=500.0, held_tokens=1024)
    d = cm.DecodeCand(True, 0, bytes_per_s=1e6, held_chunks=4, wait_s=0.25)
    e = cm.predict(PROMPT, p, d, 0, 0)
    assert e.queue_s == pytest.approx(0.5)
    assert e.compute_s == pytest.approx(3.072) and e.computed_tokens == 3072
    push = 12 * (1 << 20) / 1e6  # 16 chunks, 4 held
    assert e.pushed_chunks == 12
    assert e.transfer_s == pytest.approx(push - 3.072)  # what the compute does not hide
    assert e.ttft_s == pytest.approx(0.5 + 3.072 + (push - 3.072) + 0.25)


def test_a_hidden_push_still_exposes_one_layer_and_a_held_prompt_computes_one_token():
    p = cm.PrefillCand(True, 0, tokens_per_s=100.0, held_tokens=10_000)
    d = cm.DecodeCand(True, 0, bytes_per_s=1e9)
    e = cm.predict(PROMPT, p, d)
    assert e.computed_tokens == 1
    push = 16 * (1 << 20) / 1e9
    assert e.transfer_s == pytest.approx(max(push / 32, push - 0.01))


def test_the_prefill_holding_the_history_wins_and_load_caps_stop_affinity():
    prefills = [cm.PrefillCand(True, 0, 1000.0), cm.PrefillCand(True, 0, 1000.0, held_tokens=3840)]
    decodes = [cm.DecodeCand(True, 0, 1e9)]
    plan = cm.choose(PROMPT, prefills, decodes, cm.Caps())
    assert plan.reason == "cost" and plan.best.prefill == 1
    loaded = [prefills[0], cm.PrefillCand(True, 5, 1000.0, held_tokens=3840)]  # 5 over the other: past the cap
    assert cm.choose(PROMPT, loaded, decodes, cm.Caps(max_imbalance=4)).best.prefill == 0
    assert cm.choose(PROMPT, loaded, decodes, cm.Caps(max_imbalance=5)).best.prefill == 1


def test_among_near_candidates_the_one_pushing_least_wins():
    prefills = [cm.PrefillCand(True, 0, 1000.0)]
    decodes = [cm.DecodeCand(True, 0, 1e12), cm.DecodeCand(True, 0, 1e12, held_chunks=15, wait_s=0.01)]
    plan = cm.choose(PROMPT, prefills, decodes, cm.Caps(near_frac=0.05))  # 10 ms later, within 5% of ~4 s
    assert plan.best.decode == 1 and plan.best.pushed_chunks == 1
    plan = cm.choose(PROMPT, prefills, decodes, cm.Caps(near_frac=0.0, near_s=0.0))
    assert plan.best.decode == 0


def test_no_prefill_leg_is_a_candidate_only_where_offered():
    prefills = [cm.PrefillCand(True, 0, 1000.0)]
    held = cm.DecodeCand(True, 0, 1e9, held_chunks=15, local_tokens_per_s=500.0)
    plan = cm.choose(PROMPT, prefills, [held], cm.Caps())
    assert plan.best.prefill is None and plan.best.computed_tokens == 256  # 256 / 500 s beats 3.8 s of prefill
    off = cm.DecodeCand(True, 0, 1e9, held_chunks=15)
    assert cm.choose(PROMPT, prefills, [off], cm.Caps()).best.prefill == 0


def test_refusals_say_why():
    p, d = [cm.PrefillCand(True, 0, 1000.0)], [cm.DecodeCand(True, 0, 1e9)]
    assert cm.choose(PROMPT, p, [cm.DecodeCand(False, 0, 1e9)], cm.Caps()).reason == "no_healthy"
    assert cm.choose(PROMPT, p, [cm.DecodeCand(True, 16, 1e9)], cm.Caps(max_inflight=16)).reason == "saturated"
    assert cm.choose(PROMPT, [cm.PrefillCand(False, 0, 1.0)], d, cm.Caps()).reason == "no_healthy"
    slo = cm.choose(PROMPT, p, d, cm.Caps(), slo_s=1.0)  # 4.1 s predicted
    assert slo.reason == "slo" and slo.best.ttft_s > 1.0
    assert cm.choose(PROMPT, p, d, cm.Caps(), slo_s=10.0).reason == "cost"


def test_within_the_slo_a_near_candidate_over_it_is_not_taken():
    p = [cm.PrefillCand(True, 0, 1000.0)]
    d = [cm.DecodeCand(True, 0, 1e12), cm.DecodeCand(True, 0, 1e12, held_chunks=15, wait_s=0.1)]
    fast = cm.predict(PROMPT, p[0], d[0]).ttft_s
    plan = cm.choose(PROMPT, p, d, cm.Caps(near_frac=0.5), slo_s=fast + 0.05)
    assert plan.reason == "cost" and plan.best.decode == 0  # the one holding more would miss the SLO


cands = st.builds(cm.PrefillCand, st.booleans(), st.integers(0, 20), st.floats(100, 1e5),
                  st.floats(0, 1e5), st.integers(0, 8192))
dcands = st.builds(cm.DecodeCand, st.booleans(), st.integers(0, 20), st.floats(1e6, 1e11), st.integers(0, 40),
                   st.floats(0, 2), st.sampled_from([0.0, 1000.0]))


@settings(max_examples=300, deadline=None)
@given(st.lists(cands, min_size=1, max_size=5), st.lists(dcands, min_size=1, max_size=5), st.integers(1, 10_000),
       st.integers(0, 6), st.floats(0, 0.2))
def test_the_choice_is_eligible_and_near_the_least_ttft(prefills, decodes, tokens, imbalance, frac):
    prompt = cm.Prompt(tokens, 256, 1 << 20, 32)
    caps = cm.Caps(max_inflight=16, max_imbalance=imbalance, near_frac=frac, near_s=0.0)
    plan = cm.choose(prompt, prefills, decodes, caps)
    if plan.best is None:
        assert plan.reason in ("no_healthy", "saturated")
        return

    def ok(cs, i):
        live = [c.inflight for c in cs if c.healthy and c.inflight < 16]
        return cs[i].healthy and cs[i].inflight < 16 and cs[i].inflight <= min(live) + imbalance

    b = plan.best
    assert ok(decodes, b.decode) and (b.prefill is None or ok(prefills, b.prefill))
    every = [cm.predict(prompt, prefills[i], decodes[j], i, j).ttft_s for i in range(len(prefills))
             for j in range(len(decodes)) if ok(prefills, i) and ok(decodes, j)]
    every += [cm.predict(prompt, None, decodes[j], None, j).ttft_s for j in range(len(decodes))
              if ok(decodes, j) and decodes[j].local_tokens_per_s > 0 and decodes[j].held_chunks > 0]
    assert b.ttft_s <= min(every) * (1 + frac) + 1e-9


def test_estimates_learn_each_instances_speed_and_ignore_nonsense():
    e = cm.Estimates(prefill_tokens_per_s=1000.0, alpha=0.5)
    assert e.prefill_speed("a") == 1000.0 and e.prefill_overhead("a") == 0.0
    e.observe_prefill("a", 1000, 1000.0, 1.0)  # 2000 tokens/s: one length seen, tokens over time
    assert e.prefill_speed("a") == 2000.0 and e.prefill_overhead("a") == 0.0
    e.observe_prefill("a", 10, 0.0, 0.0)
    e.observe_prefill("a", 10, 0.0, math.inf)
    e.observe_push("b", 0, 1.0)
    e.observe_push("b", 10, math.inf)
    assert e.prefill_speed("a") == 2000.0 and e.push_speed("b") == e.push_bytes_per_s
    # an instance not measured yet is taken to be as the measured ones are, not the (flattering) default
    assert e.prefill_speed("b") == 2000.0 and e.local_speed("b") == 0.0


def test_an_instance_measured_on_few_legs_is_drawn_towards_the_fleet():
    """One slow leg (a transient) does not keep an instance out of placement: its fit is drawn towards the
    fleet's mean until its own legs outweigh it; legs that keep saying it is slow do."""
    e = cm.Estimates(prefill_tokens_per_s=1000.0, alpha=0.2, prior_legs=2.0)
    for _ in range(20):
        e.observe_prefill("a", 1000, 0.0, 1.0)  # 1000 tokens/s, many legs
    e.observe_prefill("b", 1000, 0.0, 10.0)  # one leg at 100 tokens/s
    once = e.prefill_speed("b")
    assert 100.0 < once < 1000.0 and e.prefill_speed("a") > once
    for _ in range(40):
        e.observe_prefill("b", 1000, 0.0, 10.0)
    assert e.prefill_speed("b") == pytest.approx(100.0, rel=0.05)  # its own legs, many now, say it is slow


def test_an_instance_forgotten_no_longer_weighs_in_the_fleets_mean():
    """A prefill instance a reload dropped: an instance not measured yet is estimated at the fleet's mean of those
    still listed, not dragged down by the one gone."""
    e = cm.Estimates(prefill_tokens_per_s=1000.0, alpha=0.2)
    e.observe_prefill("fast", 1000, 0.0, 0.5)
    e.observe_prefill("gone", 1000, 0.0, 10.0)
    assert e.prefill_speed("new") < 1000.0
    e.forget("gone")
    assert e.prefill_speed("new") == pytest.approx(2000.0) and "gone" not in e.samples
    e.forget("never-seen")  # nothing learned there: nothing to do


@given(speed=st.floats(100.0, 1e6), overhead=st.floats(0.0, 0.5),
       lengths=st.lists(st.integers(1, 20_000), min_size=3, max_size=20))
def test_estimates_separate_a_legs_overhead_from_its_speed(speed, overhead, lengths):
    """Legs of differing lengths on an instance with a fixed cost per leg: the fit finds both, so a long
    prompt is not predicted at a short one's (overhead-laden) speed."""
    if max(lengths) < 1.5 * min(lengths):
        lengths = [*lengths, 2 * max(lengths)]
    e = cm.Estimates(alpha=0.2)
    for n in lengths:
        e.observe_prefill("a", n, 0.0, overhead + n / speed)
    assert e.prefill_speed("a") == pytest.approx(speed, rel=1e-3)
    assert e.prefill_overhead("a") == pytest.approx(overhead, rel=1e-3, abs=1e-6)
    p = cm.PrefillCand(True, 0, e.prefill_speed("a"), overhead_s=e.prefill_overhead("a"))
    est = cm.predict(PROMPT, p, cm.DecodeCand(True, 0, 1e12))
    assert est.compute_s == pytest.approx(overhead + PROMPT.tokens / speed, rel=1e-3)
    assert e.decode_wait(3) == pytest.approx(3 * e.decode_wait_s_per_request)


def test_idle_prefill_instances_alike_take_cold_prompts_in_turn():
    """Nothing to tell two prefill instances apart: each cold prompt goes to the one after the last chosen,
    not always to the first (which would leave the other idle while its queue grows)."""
    prefills = [cm.PrefillCand(True, 0, 1000.0), cm.PrefillCand(True, 0, 1000.0), cm.PrefillCand(True, 0, 1000.0)]
    d = [cm.DecodeCand(True, 0, 1e9)]
    last, seen = -1, []
    for _ in range(6):
        last = cm.choose(PROMPT, prefills, d, cm.Caps(), last_prefill=last).best.prefill
        seen.append(last)
    assert seen == [0, 1, 2, 0, 1, 2]
    # a prefix held on one of them still wins over the turn
    held = [prefills[0], cm.PrefillCand(True, 0, 1000.0, held_tokens=2048), prefills[2]]
    assert cm.choose(PROMPT, held, d, cm.Caps(), last_prefill=1).best.prefill == 1
