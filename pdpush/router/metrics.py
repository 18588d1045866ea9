"""The router's Prometheus metrics (``/metrics``): requests, placement decisions, instances, the
receivers' index feeds, the prefill engines' cache views, and the cost model's predicted and observed
time to first token."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdpush_router_requests", "Completions by route and outcome", ["route", "outcome"],
                                registry=r)
        self.decisions = Counter("pdpush_router_decisions", "Placement decisions by leg and reason",
                                 ["leg", "reason"], registry=r)
        self.prompt_chunks = Counter("pdpush_router_prompt_chunks", "Chunks of routed prompts", registry=r)
        self.hit_chunks = Counter("pdpush_router_hit_chunks", "Chunks of routed prompts the chosen decode node held",
                                  registry=r)
        self.upstream_errors = Counter("pdpush_router_upstream_errors", "Failed upstream calls", ["instance"],
                                       registry=r)
        self.healthy = Gauge("pdpush_router_instance_healthy", "1 if the instance is admitted", ["instance"],
                             registry=r)
        self.inflight = Gauge("pdpush_router_inflight", "Requests in flight", ["instance"], registry=r)
        self.index_chunks = Gauge("pdpush_router_index_chunks", "Chunks the receiver's index holds (as seen)",
                                  ["receiver"], registry=r)
        self.index_synced = Gauge("pdpush_router_index_synced", "1 if the view of the receiver's index is exact",
                                  ["receiver"], registry=r)
        self.index_resyncs = Counter("pdpush_router_index_resyncs", "Snapshots after gaps, restarts or silence",
                                     ["receiver"], registry=r)
        self.seconds = Histogram("pdpush_router_request_seconds", "Whole request, router to answer", ["mode"],
                                 registry=r)
        ttft = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft_predicted = Histogram("pdpush_router_ttft_predicted_seconds",
                                        "cost_model: the chosen route's predicted time to first token", buckets=ttft,
                                        registry=r)
        self.ttft_observed = Histogram("pdpush_router_ttft_observed_seconds",
                                       "cost_model: time to the decode answer's first bytes (a streamed answer's first "
                                       "token; a whole answer otherwise)", ["stream"], buckets=ttft, registry=r)
        self.withdrawals = Counter("pdpush_router_withdrawals", "Pushes told to their receiver as never coming (a "
                                   "prefill leg sent beside its decode leg pushed nothing), by outcome: sent, "
                                   "acknowledged, unsent; or as never read (their client hung up, or no decode "
                                   "engine took a leg naming them): unread_sent, unread_unsent",
                                   ["outcome"], registry=r)
        self.prefill_cancelled = Counter("pdpush_router_prefill_legs_cancelled", "Prefill legs sent at once, still "
                                         "unanswered prefill_leg_linger_s after their decode's answer (at once where "
                                         "no decode engine took the decode leg): cancelled",
                                         registry=r)
        self.slo_rejections = Counter("pdpush_router_slo_rejections", "Requests refused: predicted TTFT over the SLO",
                                      registry=r)
        self.reloads = Counter("pdpush_router_reloads", "Config files read again (SIGHUP), by outcome: applied, "
                               "unchanged, refused (the old instance lists kept)", ["outcome"], registry=r)
        self.prefill_view_blocks = Gauge("pdpush_router_prefill_view_blocks",
                                         "Blocks of a prefill engine's own cache, as its KV events say", ["instance"],
                                         registry=r)
        self.prefill_view_resyncs = Gauge("pdpush_router_prefill_view_resyncs",
                                          "Times the view of a prefill engine's cache was cleared, by reason",
                                          ["instance", "reason"], registry=r)
