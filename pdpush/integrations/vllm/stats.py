"""The connector's numbers, and how vLLM reports them on its ``/metrics`` as ``vllm:pdpush_*``.

Each connector side counts into its own typed object: ``WorkerStats`` (one per TP rank: pushes, loads, bytes,
waits, and the recent push ``events``) and ``SchedulerStats`` (planned loads, recomputes, refused pushes). vLLM
takes the counts after every engine step (``get_kv_connector_stats``; ``take`` returns a ``PdpushKVStats``,
vLLM's ``KVConnectorStats``, and starts a new interval), sums the workers' with the scheduler's
(``aggregate``), ships the payload to its front-end (``to_dict``: plain ints, strings and float lists, as
msgspec wants), logs a summary (``reduce``) and records it in Prometheus (``PdpushPromMetrics.observe``, built by
``PdpushConnector.build_prom_metrics``). ``totals`` keeps every count since start-up, for tests and benchmarks
that read the engine in-process.

vLLM sums the TP ranks' payloads, and every rank sees every request. So the counts of requests (loads by path,
failures by reason, waits, pushes) are reported by the lead rank only (TP rank 0, pipeline stage 0), and the
bytes a rank copied into its own cache (``load_bytes``) by every rank. A failure that only another rank sees is
logged there and not counted (the ranks share one receiver and one sender, so they nearly always fail together).

With vLLM's stats off (``--disable-log-stats``) vLLM still takes and drops the payload each step; a vLLM without
connector stats never takes it, and an interval then keeps its counts and at most ``MAX_WAITS`` waits.

Imports vLLM's metrics classes where they exist, nothing else of vLLM; no torch.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

log = logging.getLogger("pdpush.vllm")

try:  # vLLM's connector stats (vLLM >= 0.11)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # an older vLLM: counted here, reported nowhere
    KVConnectorStats = None  # type: ignore[assignment, misc]
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
except ImportError:
    KVConnectorPromMetrics = None  # type: ignore[assignment, misc]

HAVE_VLLM_STATS = KVConnectorStats is not None
MAX_WAITS = 4096  # waits kept per interval (an interval is one engine step unless vLLM never takes it)
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LoadRoute(str, Enum):
    """How a decode request's KV got into vLLM's blocks (load.py): the ``path`` label of the load series."""

    LAYERWISE = "layerwise"  # in the forward that computes its last prompt token, each layer as it lands
    ASYNC = "async"  # outside the batch, once its push committed (WAITING_FOR_REMOTE_KVS)
    CLAIM = "claim"  # chunks the receiver already held (conditional disaggregation), either way


class LoadFailure(str, Enum):
    """Why a load that began failed (vLLM then recomputes its blocks, or the request from its first token)."""

    TIMEOUT = "timeout"  # the open, a layer or the commit did not come within load_timeout_s
    PUSH_FAILED = "push_failed"  # the push ended: aborted, its lease expired, its sender died
    RECEIVER = "receiver"  # the receiver refused or broke the open (another pdpush error)
    MISMATCH = "mismatch"  # the push is not what the load needs: layout, tokens, window, chunks
    BLOCKS = "blocks"  # vLLM's blocks do not cover the load (a bug; logged with its stack)
    COPY = "copy"  # copying into vLLM's cache raised (torch/numpy)
    INCOMPLETE = "incomplete"  # vLLM ran fewer layers than the model has


class Recompute(str, Enum):
    """Why a request that named a push was computed here with no load at all (the scheduler's choice)."""

    RECEIVER_DOWN = "receiver_down"  # the receiver failed recently: not asked (receiver_retry_s)
    RECEIVER_ERROR = "receiver_error"  # the receiver did not answer the query now
    PUSH_ENDED = "push_ended"  # the push failed or was already used
    PUSH_TIMEOUT = "push_timeout"  # the push did not reach the receiver within push_wait_s
    PARTIAL = "partial"  # a model with recurrent state whose push does not cover the prompt
    NOTHING_HELD = "nothing_held"  # a claim found none of the prompt's chunks
    BEYOND_TOKENS = "beyond_tokens"  # its KV depends on what chunk keys cannot cover (prompt embeddings, unhashed images): extra_keys.py


class PushFailure(str, Enum):
    """Why a prefill request marked for a push was not pushed, or its push failed (its decode recomputes)."""

    NOT_ALLOWED = "not_allowed"  # it names a receiver outside allowed_receivers (scheduler)
    BEYOND_TOKENS = "beyond_tokens"  # its KV depends on what chunk keys cannot cover (scheduler; extra_keys.py)
    SENDER_DOWN = "sender_down"  # the sender failed recently: not tried (sender_retry_s)
    SENDER = "sender"  # the sender did not answer the begin, or died
    REFUSED = "refused"  # the begin was refused (pool exhausted, request too large, ...)
    BLOCKS = "blocks"  # vLLM's blocks do not cover the prompt (a bug)
    STAGE = "stage"  # a layer or the state could not be staged or handed over
    INCOMPLETE = "incomplete"  # the forward produced fewer layers than this stage has
    COMMIT = "commit"  # the commit failed


# Every series the connector puts on vLLM's /metrics (sample names as they appear there, and their type); vLLM adds
# its labels (model_name, engine) to each. Counters also get prometheus_client's `_created` sample where vLLM keeps
# those; histograms appear as `<name>_bucket`, `<name>_sum` and `<name>_count`.
SERIES: tuple[tuple[str, str], ...] = (
    ("vllm:pdpush_loads_total", "counter"),                  # {path}: loads completed
    ("vllm:pdpush_load_failures_total", "counter"),          # {path, reason}: loads that failed (recomputed)
    ("vllm:pdpush_recomputes_total", "counter"),             # {reason}: requests computed without a load
    ("vllm:pdpush_load_wait_seconds", "histogram"),          # {path}: each load's wait, completed or failed
    ("vllm:pdpush_load_bytes_total", "counter"),             # KV bytes copied into vLLM's cache (all ranks)
    ("vllm:pdpush_load_layers_total", "counter"),            # layers loaded (lead rank)
    ("vllm:pdpush_load_tokens_total", "counter"),            # prompt tokens loaded
    ("vllm:pdpush_pushes_total", "counter"),                 # pushes begun (prefill)
    ("vllm:pdpush_push_failures_total", "counter"),          # {reason}: pushes not made or failed (prefill)
    ("vllm:pdpush_pushes_committed_total", "counter"),       # pushes the sender committed (prefill)
    ("vllm:pdpush_push_bytes_total", "counter"),             # bytes the sender moved for them (prefill)
    ("vllm:pdpush_scheduler_query_seconds_total", "counter"),  # the decode scheduler's time asking about pushes
    ("vllm:pdpush_pushes_unread_total", "counter"),          # pushes (claims) its request ended without loading
    ("vllm:pdpush_withdrawals_dropped_total", "counter"),    # withdrawals never sent (receiver down, too many)
)
SERIES_NAMES: tuple[str, ...] = tuple(name for name, _ in SERIES)

# Counts every TP rank reports (its own share); every other count comes from the lead rank alone.
_PER_RANK = frozenset({"load_bytes"})


@dataclass
class _Counts:
    """Plain ``int`` fields are counters; ``Counter`` fields count by a label (``path:reason`` for two)."""

    def __post_init__(self) -> None:
        self.lead = True  # this side reports counts of requests (WorkerStats: TP rank 0 of stage 0)
        self._past: Counter[str] = Counter()  # counts already taken by vLLM: totals = _past + the current interval
        self.waits: dict[str, list[float]] = {}  # seconds per load, by path, this interval (the histogram)

    def take(self) -> PdpushKVStats | None:
        """This interval's counts as vLLM's stats object (None if nothing happened); a new interval starts."""
        data = self._payload()
        self._past.update(self._flat())
        for f in fields(self):
            setattr(self, f.name, Counter() if isinstance(getattr(self, f.name), Counter) else 0)
        self.waits = {}
        if not any(data.values()):
            return None
        return PdpushKVStats(data=data) if HAVE_VLLM_STATS else None

    def totals(self) -> dict[str, int]:
        """Every count since start-up: each field by name, labelled ones as ``name:label`` too."""
        out = {f.name: 0 for f in fields(self) if not isinstance(getattr(self, f.name), Counter)}
        out.update(self._past)
        for k, v in self._flat().items():
            out[k] = out.get(k, 0) + v
        return out

    def _flat(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Counter):
                out.update({f"{f.name}:{k}": n for k, n in v.items()})
            elif v:
                out[f.name] = v
        return out

    def _payload(self) -> dict[str, Any]:
        n, by = {}, {}
        for f in fields(self):
            v = getattr(self, f.name)
            if not (self.lead or f.name in _PER_RANK):
                continue
            if isinstance(v, Counter):
                if v:
                    by[f.name] = {str(k): int(c) for k, c in v.items()}
            elif v:
                n[f.name] = int(v)
        waits = {p: list(w) for p, w in self.waits.items() if w} if self.lead else {}
        return {"n": n, "by": by, "wait_s": waits}

    def _wait(self, path: LoadRoute, seconds: float) -> None:
        w = self.waits.setdefault(path.value, [])
        if len(w) < MAX_WAITS:
            w.append(seconds)


@dataclass
class WorkerStats(_Counts):
    """One worker rank's counts (what the module-level ``STATS`` held, per process, before)."""

    # prefill: pushes
    push_requests: int = 0  # begun (or nothing to move: the receiver held every chunk)
    push_layers: int = 0
    push_tokens_staged: int = 0
    push_failures: int = 0  # by reason: push_failed
    push_committed: int = 0
    push_bytes_sent: int = 0
    push_chunks_skipped: int = 0
    push_skipped_sender_down: int = 0
    push_stage_us: int = 0  # time the prefill forward spent beginning pushes and copying layers into staging
    # the device-copy path (device_copy.py): layers staged through side-stream copies
    push_layers_copied: int = 0
    push_handover_wait_us: int = 0
    # recurrent state (GDN, Mamba2): time gathering it after the forward
    push_state_us: int = 0
    push_state_layers: int = 0
    # decode: loads
    load_requests: int = 0  # completed, by path: loads
    load_tokens: int = 0
    load_layers: int = 0
    load_bytes: int = 0  # bytes this rank copied into vLLM's cache
    load_failures: int = 0  # by path and reason: load_failed
    load_blocks_failed: int = 0
    load_wait_us: int = 0  # time the decode forward spent opening loads and waiting for / copying layers
    # the device-copy path: layers loaded through it (prefetched: started before their wait_for_layer_load)
    load_layers_copied: int = 0
    load_layers_prefetched: int = 0
    # recurrent state: waiting for it and writing it into vLLM's blocks before the forward
    load_state_us: int = 0
    load_states: int = 0
    # asynchronous loads (load_mode): loaded once committed, or failed (recomputed)
    load_async: int = 0
    load_async_failed: int = 0
    loads: Counter[str] = field(default_factory=Counter)  # path -> loads completed
    load_failed: Counter[str] = field(default_factory=Counter)  # "path:reason" -> loads failed
    push_failed: Counter[str] = field(default_factory=Counter)  # reason -> pushes failed

    def __post_init__(self) -> None:
        super().__post_init__()
        # The last events of this rank's pushes (kind, push id, layer, monotonic seconds): how the hand-overs
        # interleave with the forward, for tests and benchmarks (never reported to vLLM).
        self.events: deque[tuple[str, str, int, float]] = deque(maxlen=512)

    def loaded(self, path: LoadRoute, tokens: int, wait_s: float, *, asynchronous: bool = False) -> None:
        self.load_requests += 1
        self.load_async += int(asynchronous)
        self.load_tokens += tokens
        self.loads[path.value] += 1
        self._wait(path, wait_s)

    def load_fail(self, path: LoadRoute, reason: LoadFailure, wait_s: float, *, asynchronous: bool = False,
                  blocks: int = 0) -> None:
        self.load_failures += 1
        self.load_async_failed += int(asynchronous)
        self.load_blocks_failed += blocks
        self.load_failed[f"{path.value}:{reason.value}"] += 1
        self._wait(path, wait_s)

    def push_fail(self, reason: PushFailure) -> None:
        self.push_failures += 1
        self.push_skipped_sender_down += int(reason is PushFailure.SENDER_DOWN)
        self.push_failed[reason.value] += 1


@dataclass
class SchedulerStats(_Counts):
    """The scheduler side's counts."""

    push_truncated: int = 0  # a model with state: a prefill stopped one token short (on_new_request)
    push_refused: int = 0  # not pushed: names a receiver outside allowed_receivers, or its KV is beyond its tokens
    match_queries: int = 0
    match_params: int = 0  # loads planned from the prefill's answer (kv_transfer_params), no query
    match_query_us: int = 0  # microseconds the scheduler thread spent asking about pushes (asker.py: never a round trip)
    match_tokens: int = 0
    match_missing: int = 0  # recomputed with no load, by reason: recomputed
    claimed_tokens: int = 0
    # the decode scheduler's choice per planned load (load_mode): outside the batch, or layer by layer
    match_async: int = 0
    match_layerwise: int = 0
    push_unread: int = 0  # ended (aborted, or its prompt cached here) before its push was loaded: withdrawn/released
    withdrawals_dropped: int = 0  # withdrawals beyond MAX_WITHDRAWALS waiting (its receiver down): never sent
    load_async_naps: int = 0  # empty steps while only asynchronous loads waited: napped IDLE_NAP_S, not spun
    recomputed: Counter[str] = field(default_factory=Counter)  # reason -> requests recomputed
    push_failed: Counter[str] = field(default_factory=Counter)  # not_allowed

    def recompute(self, reason: Recompute) -> None:
        self.match_missing += 1
        self.recomputed[reason.value] += 1

    def refuse_push(self, reason: PushFailure = PushFailure.NOT_ALLOWED) -> None:
        self.push_refused += 1
        self.push_failed[reason.value] += 1


def engine_totals(worker: WorkerStats | None, scheduler: SchedulerStats | None) -> dict[str, int]:
    """Both sides' totals as one flat dict (every field present; what ``STATS`` held), for in-process readers."""
    out = {**WorkerStats().totals(), **SchedulerStats().totals()}
    for side in (worker, scheduler):
        if side is not None:
            for k, v in side.totals().items():
                out[k] = out.get(k, 0) + v
    return out


def _merge(into: dict[str, Any], other: dict[str, Any]) -> None:
    for k, v in other.get("n", {}).items():
        into["n"][k] = into["n"].get(k, 0) + v
    for name, by in other.get("by", {}).items():
        mine = into["by"].setdefault(name, {})
        for k, v in by.items():
            mine[k] = mine.get(k, 0) + v
    for p, w in other.get("wait_s", {}).items():
        mine = into["wait_s"].setdefault(p, [])
        mine.extend(w[:max(0, MAX_WAITS - len(mine))])


if KVConnectorStats is not None:

    @dataclass
    class PdpushKVStats(KVConnectorStats):
        """vLLM's stats object for this connector: ``data`` is ``{"n": {count: int}, "by": {count: {label: int}},
        "wait_s": {path: [seconds]}}`` (``_Counts._payload``), summed over the ranks and the scheduler."""

        def __post_init__(self) -> None:
            if not self.data:
                self.reset()

        def reset(self) -> None:
            self.data = {"n": {}, "by": {}, "wait_s": {}}

        def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
            for k in ("n", "by", "wait_s"):
                self.data.setdefault(k, {})
            if other is not None and not other.is_empty():
                _merge(self.data, other.data)
            return self

        def is_empty(self) -> bool:
            return not any(self.data.get(k) for k in ("n", "by", "wait_s"))

        def reduce(self) -> dict[str, int | float]:
            """A summary for vLLM's periodic log line ("KV Transfer metrics: ...")."""
            n, by = self.data.get("n", {}), self.data.get("by", {})
            waits = [s for w in self.data.get("wait_s", {}).values() for s in w]
            return {"pdpush loads": n.get("load_requests", 0), "load failures": n.get("load_failures", 0),
                    "recomputed": sum(by.get("recomputed", {}).values()),
                    "MB loaded": round(n.get("load_bytes", 0) / 2**20, 3),
                    "avg load wait (ms)": round(1e3 * sum(waits) / len(waits), 3) if waits else 0,
                    "pushes": n.get("push_requests", 0), "push failures": sum(by.get("push_failed", {}).values()),
                    "MB pushed": round(n.get("push_bytes_sent", 0) / 2**20, 3)}
else:
    PdpushKVStats = None  # type: ignore[assignment, misc]


if KVConnectorPromMetrics is not None:

    class PdpushPromMetrics(KVConnectorPromMetrics):
        """The connector's series (``SERIES``) on vLLM's /metrics, each with vLLM's labels first."""

        def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            ln = list(labelnames)

            def counter(name: str, doc: str, *extra: str):
                return self._counter_cls(name=name, documentation=doc, labelnames=ln + list(extra))

            self.loads = counter("vllm:pdpush_loads", "pdpush loads completed, by path (layerwise, async, claim).",
                                 "path")
            self.load_failures = counter(
                "vllm:pdpush_load_failures", "pdpush loads that began and failed, by path and reason; vLLM recomputes "
                "their blocks (kv_load_failure_policy=recompute).", "path", "reason")
            self.recomputes = counter(
                "vllm:pdpush_recomputes", "Requests that named a pdpush push and were computed here with no load, "
                "by reason.", "reason")
            self.load_bytes = counter("vllm:pdpush_load_bytes", "KV bytes pdpush copied into vLLM's cache (all TP "
                                      "ranks).")
            self.load_layers = counter("vllm:pdpush_load_layers", "Layers pdpush loaded (one per model layer of a "
                                       "load).")
            self.load_tokens = counter("vllm:pdpush_load_tokens", "Prompt tokens pdpush loaded instead of computing.")
            self.pushes = counter("vllm:pdpush_pushes", "pdpush pushes begun on this prefill instance.")
            self.push_failures = counter(
                "vllm:pdpush_push_failures", "Requests marked for a pdpush push that were not pushed, or whose push "
                "failed, by reason; their decode side recomputes.", "reason")
            self.committed = counter("vllm:pdpush_pushes_committed", "pdpush pushes the sender committed.")
            self.push_bytes = counter("vllm:pdpush_push_bytes", "Bytes the pdpush sender moved for committed pushes.")
            self.query_s = counter("vllm:pdpush_scheduler_query_seconds", "Time the decode scheduler's thread spent "
                                   "asking the receiver whether pushes have begun (sent and read without waiting).")
            self.unread = counter("vllm:pdpush_pushes_unread", "Pushes (and claims) named by a request that ended "
                                  "here without loading them (aborted, or its prompt found in this engine's cache): "
                                  "withdrawn, so that they leave the receiver's pool at once.")
            self.withdrawals_dropped = counter(
                "vllm:pdpush_withdrawals_dropped", "Withdrawals dropped unsent, beyond the 4,096 waiting while the "
                "receiver was down: each of those pushes holds its pool pages until committed_ttl_ms.")
            self.wait = self._histogram_cls(
                name="vllm:pdpush_load_wait_seconds", documentation="Per pdpush load, completed or failed: the "
                "time the request waited for its KV (layerwise: the open and its layers' waits and copies in the "
                "forward; async: from the open until loaded).", buckets=list(WAIT_BUCKETS), labelnames=ln + ["path"])
            self._plain = {"load_bytes": self.load_bytes, "load_layers": self.load_layers,
                           "load_tokens": self.load_tokens, "push_requests": self.pushes,
                           "push_committed": self.committed, "push_bytes_sent": self.push_bytes,
                           "push_unread": self.unread, "withdrawals_dropped": self.withdrawals_dropped}
            for values in per_engine_labelvalues.values():  # zeros from the start, so that rate() has a base
                for m in (*self._plain.values(), self.query_s):
                    m.labels(*values)
                for p in LoadRoute:
                    self.loads.labels(*values, p.value)
                    self.wait.labels(*values, p.value)
            self._warned = False

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            try:
                self._observe(transfer_stats_data, self.per_engine_labelvalues[engine_idx])
            except (KeyError, TypeError, ValueError, AttributeError) as e:  # never in vLLM's output loop
                if not self._warned:
                    log.warning("pdpush: connector stats not recorded in Prometheus: %s: %s", type(e).__name__, e)
                    self._warned = True

        def _observe(self, data: dict[str, Any], ev: list[object]) -> None:
            n, by = data.get("n", {}), data.get("by", {})
            for key, m in self._plain.items():
                if n.get(key):
                    m.labels(*ev).inc(n[key])
            if n.get("match_query_us"):
                self.query_s.labels(*ev).inc(n["match_query_us"] / 1e6)
            for path, c in by.get("loads", {}).items():
                self.loads.labels(*ev, path).inc(c)
            for key, c in by.get("load_failed", {}).items():
                path, _, reason = key.partition(":")
                self.load_failures.labels(*ev, path, reason).inc(c)
            for reason, c in by.get("recomputed", {}).items():
                self.recomputes.labels(*ev, reason).inc(c)
            for reason, c in by.get("push_failed", {}).items():
                self.push_failures.labels(*ev, reason).inc(c)
            for path, waits in data.get("wait_s", {}).items():
                h = self.wait.labels(*ev, path)
                for s in waits:
                    h.observe(s)
else:
    PdpushPromMetrics = None  # type: ignore[assignment, misc]
