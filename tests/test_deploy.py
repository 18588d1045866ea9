"""The files operators load into their monitoring (deploy/prometheus, deploy/grafana): the alert rules pass
promtool's checks and its unit tests, and every series the rules and the dashboard name is one pdpush exports
(read from the code's own registries, not a hand list; the vLLM connector's from the list its stats class
registers with vLLM)."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy/prometheus/pdpush-alerts.yaml"
DASHBOARD = ROOT / "deploy/grafana/pdpush.json"
PROMETHEUS_OWN = {"up"}  # series Prometheus makes itself for every target
SERIES = re.compile(r"\b(pdpush_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def promtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is missing: make test installs it (Debian's prometheus package)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def exported() -> set[str]:
    """Every series name the daemons' and the router's registries expose, as Prometheus scrapes them."""
    from pdpush.metrics import Metrics
    from pdpush.router.metrics import Metrics as RouterMetrics

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                "info": ("_info",), "summary": ("", "_sum", "_count")}
    names = set()
    for registry in (Metrics("receiver", "127.0.0.1", -1).registry, Metrics("sender", "127.0.0.1", -1).registry,
                     RouterMetrics().registry):
        for family in registry.collect():
            names.update(family.name + s for s in suffixes[family.type])
    from pdpush.integrations.vllm.stats import SERIES as CONNECTOR  # on vLLM's /metrics, by vLLM's registry

    names.update(n for n, kind in CONNECTOR if kind == "counter")  # named as scraped, _total included
    names.update(n + s for n, kind in CONNECTOR if kind == "histogram" for s in suffixes[kind])
    return names


def rule_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_the_alert_rules_pass_promtool_and_fire_on_their_unit_tests():
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    r = promtool("test", "rules", str(RULES.with_name("pdpush-alerts.test.yaml")))
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_series_the_rules_and_the_dashboard_name_is_exported():
    have = exported() | PROMETHEUS_OWN
    for where, exprs in (("rules", rule_exprs()), ("dashboard", dashboard_exprs())):
        named = {m for e in exprs for m in SERIES.findall(e)}
        assert named, where
        assert named <= have, f"{where} names series pdpush does not export: {sorted(named - have)}"
    assert "up" in " ".join(rule_exprs())  # the daemon-down rule


def test_the_dashboards_queries_are_valid_promql_and_the_json_is_its_builders_output(tmp_path):
    built = runpy.run_path(str(ROOT / "deploy/grafana/build_dashboard.py"))["render"]()
    assert DASHBOARD.read_text() == built, "run python deploy/grafana/build_dashboard.py"
    board = json.loads(built)
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    # promtool checks PromQL in rules: each query as a recording rule, Grafana's interval made concrete
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(dashboard_exprs())]}]}
    f = tmp_path / "queries.yaml"
    f.write_text(yaml.safe_dump(rules))
    r = promtool("check", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr
