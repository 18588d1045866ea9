"""Builds deploy/grafana/pdpush.json, the Grafana dashboard for the daemons, the router and the vLLM connector:
edit the panels here, then run `python deploy/grafana/build_dashboard.py` (tests/test_deploy.py checks that the
JSON is this script's output, and that every series it names is one pdpush exports)."""

from __future__ import annotations

import json

DS = {"type": "prometheus", "uid": "${datasource}"}
R = "$__rate_interval"


class Board:
    """Panels laid out left to right, 8 units high, three to a line by default, under rows."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = self.y = 0

    def row(self, title: str) -> None:
        if self.x:
            self.y += 8
        self.x = 0
        self.panels.append({"type": "row", "title": title, "id": len(self.panels) + 1, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def panel(self, title: str, targets: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries",
              desc: str = "", w: int = 8) -> None:
        if self.x + w > 24:
            self.x, self.y = 0, self.y + 8
        p = {"type": kind, "title": title, "id": len(self.panels) + 1, "datasource": DS, "description": desc,
             "gridPos": {"h": 8, "w": w, "x": self.x, "y": self.y},
             "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {},
             "targets": [{"refId": chr(65 + i), "datasource": DS, "expr": e, "legendFormat": legend}
                         for i, (e, legend) in enumerate(targets)]}
        if kind == "table":
            p["targets"][0].update(format="table", instant=True)
        self.panels.append(p)
        self.x += w


def q(name: str, p: float, by: str = "instance") -> str:
    """The ``p`` quantile of histogram ``name``, by ``by``."""
    return f"histogram_quantile({p}, sum by ({by}, le) (rate({name}_bucket[{R}])))"


def rate(name: str, by: str) -> str:
    return f"sum by ({by}) (rate({name}[{R}]))"


def dashboard() -> dict:
    b = Board()
    b.row("Daemons: requests and failures")
    b.panel("Requests completed /s", [(rate("pdpush_requests_total", "job, instance"), "{{job}} {{instance}}")], "reqps",
            desc="Pushes committed (sender) and requests committed into the pool (receiver).")
    b.panel("Failures /s by reason", [(rate("pdpush_failures_total", "instance, reason"), "{{instance}} {{reason}}")],
            "reqps", desc="Every failed request by its typed reason (errors.ErrorCode); each is a recompute on the "
                          "decode side.")
    b.panel("Requests in flight", [("sum by (job, instance) (pdpush_requests_inflight)", "{{job}} {{instance}}")])
    b.row("Daemons: latency")
    b.panel("Layer put+flush p50 / p99", [(q("pdpush_layer_transfer_seconds", 0.5, "job, instance"), "p50 {{instance}}"),
                                          (q("pdpush_layer_transfer_seconds", 0.99, "job, instance"), "p99 {{instance}}")],
            "s", desc="One layer's puts and flush (sender); alloc-to-LayerDone spacing (receiver). Over a layer's "
                      "compute time, the transfer is exposed.")
    b.panel("Request end to end p50 / p99", [(q("pdpush_request_seconds", 0.5, "job, instance"), "p50 {{job}} {{instance}}"),
                                             (q("pdpush_request_seconds", 0.99, "job, instance"), "p99 {{job}} {{instance}}")],
            "s")
    b.panel("Allocation round trip p99", [(q("pdpush_alloc_rtt_seconds", 0.99), "p99 {{instance}}")], "s",
            desc="AllocRequest to AllocResponse, as the sender sees it.")
    b.row("Receiver: pool and leases")
    b.panel("Pool pages by state", [("sum by (instance, state) (pdpush_pool_pages)", "{{instance}} {{state}}")],
            desc="free; quarantined (the late-write guard); unfenced (an aborted request's writes not yet settled); "
                 "total.")
    b.panel("Leases active, expired /s", [("sum by (instance) (pdpush_leases_active)", "active {{instance}}"),
                                          (rate("pdpush_leases_expired_total", "instance"), "expired/s {{instance}}")])
    b.panel("Senders fenced /s", [(rate("pdpush_senders_fenced_total", "instance"), "{{instance}}")], "ops")
    b.panel("Internal errors /s (bugs; the log says where)",
            [(rate("pdpush_internal_errors_total", "job, instance"), "{{job}} {{instance}}")], "ops")
    b.row("Data moved")
    b.panel("Bytes /s", [(rate("pdpush_bytes_pushed_total", "instance"), "pushed {{instance}}"),
                         (rate("pdpush_bytes_received_total", "instance"), "received {{instance}}")], "Bps")
    b.panel("Layers /s", [(rate("pdpush_layers_total", "job, instance"), "{{job}} {{instance}}")], "ops")
    b.panel("Prefix reuse: chunks skipped /s, chunks cached",
            [(rate("pdpush_chunks_hit_total", "instance"), "skipped/s {{instance}}"),
             ("sum by (instance) (pdpush_chunks_cached)", "cached {{instance}}")])
    b.row("Sender and transport")
    b.panel("Receivers connected", [("sum by (instance) (pdpush_receivers_connected)", "{{instance}}")])
    b.panel("Staging free", [("sum by (instance) (pdpush_staging_free_bytes)", "{{instance}}")], "bytes")
    b.panel("Peer transports (UCX lanes)",
            [("max by (instance, peer, transport, device) (pdpush_peer_transport_info)", "")], kind="table",
            desc="The transport and device each peer's endpoint uses: rc or dc on an RDMA fabric, tcp otherwise.")
    b.row("Router")
    b.panel("Requests /s by outcome", [(rate("pdpush_router_requests_total", "outcome"), "{{outcome}}")], "reqps")
    b.panel("Placement decisions /s", [(rate("pdpush_router_decisions_total", "leg, reason"), "{{leg}} {{reason}}")],
            "ops")
    b.panel("SLO refusals /s", [(rate("pdpush_router_slo_rejections_total", "job"), "429")], "reqps")
    b.panel("Time to first token p90: predicted / observed",
            [(q("pdpush_router_ttft_predicted_seconds", 0.9, "job"), "predicted"),
             (q("pdpush_router_ttft_observed_seconds", 0.9, "job"), "observed")], "s")
    b.panel("Router request p50 / p99 by mode", [(q("pdpush_router_request_seconds", 0.5, "mode"), "p50 {{mode}}"),
                                                 (q("pdpush_router_request_seconds", 0.99, "mode"), "p99 {{mode}}")], "s")
    b.panel("Prefix hit ratio", [(f"sum (rate(pdpush_router_hit_chunks_total[{R}])) / "
                                  f"sum (rate(pdpush_router_prompt_chunks_total[{R}]))", "held / prompt chunks")],
            "percentunit")
    # the metrics' own "instance" label (an engine's URL) is scraped as exported_instance
    b.panel("Instances: healthy, in flight",
            [("max by (exported_instance) (pdpush_router_instance_healthy)", "healthy {{exported_instance}}"),
             ("sum by (exported_instance) (pdpush_router_inflight)", "in flight {{exported_instance}}")])
    b.panel("Receiver index feeds: synced, chunks", [("max by (receiver) (pdpush_router_index_synced)", "synced {{receiver}}"),
                                                    ("max by (receiver) (pdpush_router_index_chunks)", "chunks {{receiver}}")])
    b.panel("Upstream errors /s", [(rate("pdpush_router_upstream_errors_total", "exported_instance"),
                                    "{{exported_instance}}")], "ops")
    b.panel("Pushes withdrawn (legs failed, clients gone), prefill legs cancelled /s",
            [(rate("pdpush_router_withdrawals_total", "outcome"), "withdrawal {{outcome}}"),
             (rate("pdpush_router_prefill_legs_cancelled_total", "job"), "cancelled (still running after its decode)")],
            "ops", desc="Withdrawn: the leg pushed nothing, and its decode was told not to wait (unread_*: the client "
            "hung up, or no decode engine took a leg naming the push, and the receiver was told that nobody will "
            "read it). Cancelled: the leg was still "
            "unanswered prefill_leg_linger_s after its decode's answer (its prefill instance is queued past the "
            "decode's push_wait_s; consider concurrent_legs \"auto\").")
    b.row("vLLM connector (each engine's /metrics)")
    b.panel("Loads /s by path, pushes unread", [(rate("vllm:pdpush_loads_total", "path"), "{{path}}"),
                                                (rate("vllm:pdpush_pushes_unread_total", "job"), "unread: withdrawn"),
                                                (rate("vllm:pdpush_withdrawals_dropped_total", "job"),
                                                 "unread: withdrawal dropped")], "ops",
            desc="Decode loads completed: layerwise (in the forward), async (outside the batch), claim (already held). "
            "Unread: pushes whose request ended here without loading them, withdrawn from the receiver's pool; a "
            "dropped withdrawal (the receiver down long) leaves its push there until committed_ttl_ms.")
    b.panel("Failed loads and recomputes /s", [(rate("vllm:pdpush_load_failures_total", "reason"), "failed: {{reason}}"),
                                               (rate("vllm:pdpush_recomputes_total", "reason"), "recomputed: {{reason}}")],
            "ops", desc="Every one is a prompt the decode instance computed itself.")
    b.panel("Recompute ratio", [(f"(sum (rate(vllm:pdpush_load_failures_total[{R}])) + "
                                 f"sum (rate(vllm:pdpush_recomputes_total[{R}]))) / (sum (rate(vllm:pdpush_loads_total[{R}])) "
                                 f"+ sum (rate(vllm:pdpush_load_failures_total[{R}])) + "
                                 f"sum (rate(vllm:pdpush_recomputes_total[{R}])))", "recomputed / named a push")],
            "percentunit")
    b.panel("Load wait p50 / p99 by path", [(q("vllm:pdpush_load_wait_seconds", 0.5, "path"), "p50 {{path}}"),
                                            (q("vllm:pdpush_load_wait_seconds", 0.99, "path"), "p99 {{path}}")], "s",
            desc="The time a request waited for its KV; layerwise above a step's compute time: the forward waits.")
    b.panel("Loaded bytes /s, tokens /s", [(rate("vllm:pdpush_load_bytes_total", "job"), "bytes/s"),
                                           (rate("vllm:pdpush_load_tokens_total", "job"), "tokens/s")])
    b.panel("Prefill pushes /s: begun, committed, failed",
            [(rate("vllm:pdpush_pushes_total", "job"), "begun"),
             (rate("vllm:pdpush_pushes_committed_total", "job"), "committed"),
             (rate("vllm:pdpush_push_failures_total", "reason"), "failed: {{reason}}")], "ops")
    return {
        "title": "pdpush", "uid": "pdpush-overview", "schemaVersion": 39, "version": 1, "editable": True,
        "description": "pdpush daemons (receiver, sender), router and vLLM connector. Scrape jobs: pdpush-receiver, "
                       "pdpush-sender, pdpush-router, and the vLLM engines' /metrics.",
        "tags": ["pdpush", "vllm", "kv-cache"], "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus", "current": {}, "hide": 0}]},
        "annotations": {"list": []}, "panels": b.panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


if __name__ == "__main__":
    from pathlib import Path

    Path(__file__).with_name("pdpush.json").write_text(render())
