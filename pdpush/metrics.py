"""Prometheus metrics for both daemons, served on /metrics (loopback by default).

Counters and histograms are updated where the events happen; gauges are
refreshed from the daemon's own state by its loop (``refresh``), so the HTTP
thread never reads structures the loop is changing. prometheus_client is
imported only when metrics are enabled.
"""

from __future__ import annotations

import json
from typing import Any

# the daemon's counts of errors it served on after (a bug each): pdpush_internal_errors_total moves by all of them.
# (Not the sender's action_errors: each is an internal error of its session's too, on_action_failed)
INTERNAL_ERRORS = ("loop_errors", "internal_errors")
_LAT = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, role: str, host: str, port: int) -> None:
        """``port`` -1 keeps the metrics in-process only (no HTTP server); 0 picks a free port."""
        import prometheus_client as pc

        self.registry = pc.CollectorRegistry()
        r = self.registry
        self.role = role
        self.bytes = pc.Counter(f"pdpush_bytes_{'pushed' if role == 'sender' else 'received'}",
                                f"KV bytes {'pushed to receivers' if role == 'sender' else 'received into the pool'}",
                                registry=r)
        self.layers = pc.Counter("pdpush_layers", "Layers transferred", registry=r)
        self.layer_seconds = pc.Histogram("pdpush_layer_transfer_seconds", "Put+flush of one layer (sender)", buckets=_LAT, registry=r)
        self.alloc_rtt = pc.Histogram("pdpush_alloc_rtt_seconds", "AllocRequest -> AllocResponse round trip",
                                      buckets=_LAT, registry=r)
        self.request_seconds = pc.Histogram("pdpush_request_seconds", "End-to-end latency of a request "
                                            "(sender: begin to commit ack; receiver: alloc to commit)",
                                            buckets=_LAT, registry=r)
        self.requests = pc.Counter("pdpush_requests", "Requests completed", registry=r)
        self.failures = pc.Counter("pdpush_failures", "Failed requests by typed reason", ["reason"], registry=r)
        self.inflight = pc.Gauge("pdpush_requests_inflight", "Requests in flight", registry=r)
        self.chunks_hit = pc.Counter("pdpush_chunks_hit", "Chunks skipped because the receiver already held them "
                                     "(already_sent_indexes)", registry=r)
        self.internal_errors = pc.Counter("pdpush_internal_errors", "Errors inside the daemon that it served on "
                                          "after: a bug (its log says where)", registry=r)
        self._internal_seen = 0
        self._lanes: set[tuple[str, str, str]] = set()  # (peer, transport, device) set in peer_transport
        self.peer_transport = pc.Gauge("pdpush_peer_transport_info", "The UCX transport and device of each lane of "
                                       "each peer's endpoint (1 per lane)", ["peer", "transport", "device"], registry=r)
        if role == "receiver":
            self.pool_pages = pc.Gauge("pdpush_pool_pages", "Pool pages by state", ["state"], registry=r)
            self.chunks_cached = pc.Gauge("pdpush_chunks_cached", "Complete chunks in the index", registry=r)
            self.leases_active = pc.Gauge("pdpush_leases_active", "Uncommitted allocations", registry=r)
            self.leases_expired = pc.Counter("pdpush_leases_expired", "Leases reclaimed at their deadline",
                                             registry=r)
            self.withdrawn = pc.Counter("pdpush_pushes_withdrawn", "Pushes withdrawn before they began, by the router "
                                        "that placed them or the decode that stopped waiting (refused if they begin "
                                        "later); decode_live: given up by their decode after they began (dropped "
                                        "once committed), or claims it never loaded; router_live: the same, their "
                                        "client gone", ["by"], registry=r)
            self.senders_fenced = pc.Counter("pdpush_senders_fenced", "Senders whose UCX endpoints the receiver "
                                             "closed because their writes to ended requests did not settle in time",
                                             registry=r)
        else:
            self.receivers = pc.Gauge("pdpush_receivers_connected", "Receivers with a live session", registry=r)
            self.staging_free = pc.Gauge("pdpush_staging_free_bytes", "Free staging bytes", registry=r)
        self._children: dict[tuple[str, str | None], Any] = {}  # (name, label) -> the metric to count on
        from pdpush.sessions import Count, Log, Observe

        self._bookkeeping = {Count: lambda a, _log: self.count(a), Observe: lambda a, _log: self.observe(a),
                             Log: self.log}
        self._server = None
        self.endpoint = ""
        if port >= 0:
            self._server, _ = pc.start_http_server(port, addr=host, registry=r)
            self.endpoint = f"http://{host}:{self._server.server_port}/metrics"

    def refresh(self, stats: dict[str, Any]) -> None:
        """Set gauges from a stats snapshot (called on the daemon's own thread)."""
        self.inflight.set(stats["requests_inflight"])
        # counts the daemon keeps (it moves by the new ones): its shell's loop, and its session's handlers (which
        # answer a message that raised with an internal error and serve on) and failed actions
        internal = sum(stats.get(k, 0) for k in INTERNAL_ERRORS)
        if internal > self._internal_seen:
            self.internal_errors.inc(internal - self._internal_seen)
            self._internal_seen = internal
        lanes = set()
        for peer, named in json.loads(stats.get("ucx_transports") or "{}").items():
            for lane in named.split():
                transport, _, device = lane.partition("/")
                lanes.add((peer, transport, device))
        for gone in self._lanes - lanes:  # the current ones stay set meanwhile: a scrape never finds none
            self.peer_transport.remove(*gone)
        for lane in lanes - self._lanes:
            self.peer_transport.labels(*lane).set(1)
        self._lanes = lanes
        if self.role == "receiver":
            self.pool_pages.labels("total").set(stats["pool_pages_total"])
            self.pool_pages.labels("free").set(stats["pool_pages_free"])
            self.pool_pages.labels("quarantined").set(stats["pool_pages_quarantined"])
            self.pool_pages.labels("unfenced").set(stats["pool_pages_unfenced"])
            self.pool_pages.labels("read_held").set(stats["pool_pages_read_held"])
            self.chunks_cached.set(stats["chunks_cached"])
            self.leases_active.set(stats["leases_active"])
        else:
            self.receivers.set(stats["receivers_connected"])
            self.staging_free.set(stats["staging_bytes_free"])

    def count(self, c) -> None:
        """A session's ``Count`` action."""
        m = self._children.get((c.name, c.label))
        if m is None:  # a labelled child is looked up once (prometheus_client's ``labels`` takes a lock and more)
            m = getattr(self, c.name)
            m = self._children[(c.name, c.label)] = m.labels(c.label) if c.label is not None else m
        m.inc(c.n)

    def observe(self, o) -> None:
        """A session's ``Observe`` action."""
        getattr(self, o.name).observe(o.seconds)

    def apply(self, a, log) -> bool:
        """Carry out a session's bookkeeping action (Count, Observe, Log); False if it is not one."""
        do = self._bookkeeping.get(type(a))
        if do is None:
            return False
        do(a, log)
        return True

    @staticmethod
    def log(a, log) -> None:
        """A session's ``Log`` action, on the daemon's logger ``log``."""
        log.log(a.level, "%s%s", a.message, "\n" + a.exc_text if a.exc_text else "", extra={"req_id": a.req_id})

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
