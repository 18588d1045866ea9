"""``PdpushConnector``: vLLM's KV connector class, routing vLLM's calls to the side of its role (``SchedulerSide``,
``WorkerSide``), the scheduler side's KV events (``PoolEvents``) and both sides' stats (stats.py). The package's
``__init__`` describes the flow; vLLM loads this class through it (``kv_connector_module_path``)."""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from pdpush.extra_keys import chunk_extras, mm_content_hashed
from pdpush.integrations.vllm import stats as _stats
from pdpush.integrations.vllm.events import PoolEvents
from pdpush.integrations.vllm.metadata import PdpushConnectorMetadata
from pdpush.integrations.vllm.scheduler import SchedulerSide
from pdpush.integrations.vllm.settings import (
    Endpoints,
    check_parallelism,
    derive_layout,
    settings_of,
)
from pdpush.integrations.vllm.stats import SchedulerStats, WorkerStats
from pdpush.integrations.vllm.worker import WorkerSide
from pdpush.kv_params import KvParams

try:  # vLLM's cache-hit tiers (prompt_tokens_cached_by_source)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # a vLLM without them
    CacheHitSource = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("pdpush.vllm")


class PdpushConnector(KVConnectorBase_V1, SupportsHMA):
    """Layer-by-layer push of prefill KV to the decode instance through pdpush daemons. With vLLM's
    hybrid KV cache manager (``SupportsHMA``), every block-id list is one per KV cache group, and a
    sliding-window group moves only its window's chunks."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.P2P  # pushed from the prefill instance (get_external_cache_hit_sources)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = settings_of(tc.kv_connector_extra_config)
        self.is_producer = bool(tc.is_kv_producer)
        self.is_consumer = bool(tc.is_kv_consumer)
        self.layout = derive_layout(vllm_config, self.settings, kv_cache_config)
        check_parallelism(vllm_config, self.layout, self.is_producer, self.is_consumer)
        endpoints = Endpoints.of(self.settings)
        self.engine_tag = uuid.uuid4().hex[:12]
        self._worker: WorkerSide | None = None
        self._sched: SchedulerSide | None = None
        self._events: PoolEvents | None = None  # the receiver pool in vLLM's KV events (events.py)
        if role == KVConnectorRole.WORKER:
            self._worker = WorkerSide(vllm_config, self.settings, endpoints, self.layout, self.is_producer,
                                      self.is_consumer, kv_cache_config)
        else:
            self._sched = SchedulerSide(self.settings, endpoints, self.layout, self.engine_tag, self.is_producer,
                                        self.is_consumer,
                                        len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1,
                                        mm_content_hashed(vllm_config))
            kec = getattr(vllm_config, "kv_events_config", None)
            if self.is_consumer and kec is not None and kec.enable_kv_cache_events:
                s = self.settings
                self._events = PoolEvents(endpoints.receiver_socket, self.layout, timeout_s=s.query_timeout_s,
                                          retry_s=s.receiver_retry_s, pending_s=max(s.timeout_s, s.push_wait_s) * 2)
        # this side's numbers (stats.py): vLLM takes them after every step (get_kv_connector_stats) for its /metrics
        self.stats: WorkerStats | SchedulerStats = (self._worker or self._sched).stats
        log.info("PdpushConnector %s role=%s producer=%s consumer=%s layout=%s tp=%d", self.engine_tag, role.name,
                 self.is_producer, self.is_consumer, self.layout, vllm_config.parallel_config.tensor_parallel_size)
        if not _stats.HAVE_VLLM_STATS or not hasattr(KVConnectorBase_V1, "build_prom_metrics"):
            log.warning("PdpushConnector: this vLLM has no connector stats for /metrics (KVConnectorStats, "
                        "build_prom_metrics): the connector's numbers are counted, not exported")

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer / wait_for_layer_load run between layers

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, PdpushConnectorMetadata)
            self._worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        pass  # loads' opens went out in bind_connector_metadata; each layer is read in wait_for_layer_load

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Asynchronous loads (models of several KV cache groups) that completed, or failed: vLLM recomputes
        a failed one from its first token (it cannot take block-level failures with several groups); those of
        requests vLLM has aborted (``finished_req_ids``) end at once."""
        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.poll_async_loads(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=done | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    # ---- stats (both sides; stats.py) ----
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counts since vLLM last asked (after every step, on each worker and the scheduler); vLLM
        sums them (``PdpushKVStats.aggregate``) and its front-end records them (``build_prom_metrics``)."""
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        if _stats.PdpushKVStats is None:
            return None
        return _stats.PdpushKVStats(data=data) if data is not None else _stats.PdpushKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        """The ``vllm:pdpush_*`` series (``stats.SERIES``), in vLLM's front-end process."""
        if _stats.PdpushPromMetrics is None:
            log.warning("PdpushConnector: this vLLM has no KVConnectorPromMetrics; no vllm:pdpush_* series")
            return None
        return _stats.PdpushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for side in (self._worker, self._sched):
            if side is not None:
                side.shutdown()
        if self._events is not None:
            self._events.close()

    # ---- scheduler side ----
    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))  # a load restores every group, state too

    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        n, load_async = self._sched.get_num_new_matched_tokens(request, num_computed_tokens)
        if n and self._events is not None and not chunk_extras(request, self.layout.chunk_tokens):
            # (vLLM's events carry token ids: chunks keyed with extras, which a router cannot derive from
            # those, are not announced)
            self._events.planned(request.request_id, request.prompt_token_ids)
        return n, load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict:
        """The tier of the tokens loaded (``vllm:prompt_tokens_cached_by_source``): ``p2p`` for a pushed
        request (its KV came from the prefill instance), ``host`` for a claim of chunks the receiver's
        pool already held (conditional disaggregation: host memory on this node, nothing moved)."""
        if not num_external_tokens or CacheHitSource is None:
            return {}
        claim = KvParams.parse(request.kv_transfer_params).pdpush_claim
        return {CacheHitSource.HOST if claim else CacheHitSource.P2P: num_external_tokens}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._sched.build_connector_meta(scheduler_output)
        if self._events is not None and meta.loads:
            now = time.monotonic()
            for load in meta.loads:
                self._events.loaded(load.req_id, now)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' results of the step (all ranks'): the asynchronous loads that ended are no longer awaited."""
        if self._sched is not None:
            self._sched.loads_ended(connector_output.finished_recving or ())

    def take_events(self):
        """The receiver pool's chunks as vLLM KV events (events.py): a decode instance with
        ``--kv-events-config`` only."""
        return self._events.take_events(time.monotonic()) if self._events is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._events is not None:
            self._events.finished(request.request_id)
        return self._sched.request_finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if self._events is not None:
            self._events.finished(request.request_id)
        return self._sched.request_finished(request)  # the hybrid manager's: one block list per group
