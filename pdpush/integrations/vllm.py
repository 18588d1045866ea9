"""vLLM KV Connector V1: ``PdpushConnector`` pushes each layer from the prefill instance as it is
produced, and loads it layer by layer into the decode instance's paged cache.

Load it with::

    KVTransferConfig(kv_connector="PdpushConnector", kv_connector_module_path="pdpush.integrations.vllm",
                     kv_role="kv_producer" | "kv_consumer", kv_connector_extra_config={...})

Extra config (see ``ConnectorSettings``): the local daemon (``sender_config``/``sender_socket`` on
the prefill node, ``receiver_config``/``receiver_socket`` on the decode node), the receiver to
push to, and the chunk size / model id both sides must agree on.

Flow (one request, driven by a proxy such as ``pdpush proxy``):

* prefill, scheduler: a request whose ``kv_transfer_params`` has ``do_remote_decode`` is marked;
  on the step its prompt finishes, its block ids go to the worker in the connector metadata.
* prefill, worker: ``start_load_kv`` asks the sender for an allocation (``PrefillClient.begin``,
  which says which chunks the receiver already holds); ``save_kv_layer`` gathers the new chunks of
  layer ``l`` from the paged cache into staging and hands the layer over at once (pipelined push);
  ``wait_for_save`` asks for the commit without waiting for it.
* prefill, scheduler: ``request_finished`` returns ``kv_transfer_params`` for the decode side.
* decode, scheduler: ``get_num_new_matched_tokens`` asks the receiver's chunk index how far the
  pushed request covers this prompt (all tokens but the last, which the decode step computes).
* decode, worker: ``start_load_kv`` opens the request; ``wait_for_layer_load`` waits for layer
  ``l`` and scatters it from the pool (zero-copy view) into vLLM's blocks. A failed or late load
  is reported by block id (``get_block_ids_with_load_errors``): vLLM discards the step's output and
  recomputes from the first bad block, so no block is left holding wrong KV.

Not covered: tensor/pipeline parallel > 1 (refused), MLA and fp8 KV caches (refused), GPU
backends (FLASH_ATTN/TRITON_ATTN follow vLLM's source but are not run here; see vllm_layout).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pdpush.client import DecodeClient, DecodeRequest, PrefillClient, PushHandle
from pdpush.config import ReceiverConfig, SenderConfig, load
from pdpush.errors import BrokenResourceError, ConfigError, PdpushError, TransportError
from pdpush.integrations import vllm_layout as vl
from pdpush.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("pdpush.vllm")

# Per-process counters (the worker and, without multiprocessing, the scheduler live here).
STATS: dict[str, int] = {
    "push_requests": 0, "push_layers": 0, "push_tokens_staged": 0, "push_failures": 0, "push_committed": 0,
    "push_bytes_sent": 0, "push_chunks_skipped": 0, "push_refused": 0, "push_skipped_sender_down": 0,
    "load_requests": 0, "load_tokens": 0, "load_layers": 0, "load_failures": 0, "load_blocks_failed": 0,
    "match_queries": 0, "match_tokens": 0, "match_missing": 0,
    "load_wait_us": 0,  # time the decode forward spent opening loads and waiting for / copying layers
    "push_stage_us": 0,  # time the prefill forward spent beginning pushes and copying layers into staging
}

# The last events of this process's pushes (kind, push id, layer, monotonic seconds): how the
# handovers interleave with the forward, for tests and benchmarks.
EVENTS: deque[tuple[str, str, int, float]] = deque(maxlen=512)


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config`` keys (unknown keys are an error)."""

    model_config = ConfigDict(extra="forbid")

    sender_config: str = ""
    """Prefill node: the sender daemon's TOML (for its ingress socket and default receiver)."""
    sender_socket: str = ""
    """Prefill node: the sender's ingress socket (overrides sender_config's)."""
    receiver: str = ""
    """Prefill node: receiver control endpoint to push to (a request's kv_transfer_params may name
    another as ``pdpush_receiver``); default: the sender's default_receiver."""
    allowed_receivers: list[str] = Field(default_factory=list)
    """Prefill node: receivers a request may name as ``pdpush_receiver`` (it comes from the client's
    kv_transfer_params); ``"*"`` allows any. The configured receiver is always allowed. A request
    naming another is not pushed (its decode side recomputes) and a warning is logged."""
    receiver_config: str = ""
    """Decode node: the receiver daemon's TOML (socket, chunk_tokens and model_id come from it)."""
    receiver_socket: str = ""
    """Decode node: the receiver's local socket (overrides receiver_config's)."""
    chunk_tokens: int | None = Field(None, ge=1)
    """Tokens per pdpush chunk; must equal the receiver's (default: receiver_config's, else 256)."""
    model_id: str | None = None
    """Model identity in chunk keys; must equal the receiver's (default: receiver_config's, else
    the served model name)."""
    timeout_s: float = Field(10.0, gt=0)
    """Deadline for each call to the local daemon (begin, open, query)."""
    load_timeout_s: float = Field(10.0, gt=0)
    """Decode: how long one layer may take to arrive before the load is given up (and recomputed)."""
    sender_retry_s: float = Field(5.0, ge=0)
    """Prefill: after the sender did not answer (or died), requests are not pushed for this long (their
    decode side recomputes), so the forward never waits on a missing sender."""
    query_timeout_s: float = Field(0.5, gt=0)
    """Decode, scheduler: deadline for asking the local receiver about a prompt (it answers in well
    under a millisecond; the scheduler loop waits for it)."""
    receiver_retry_s: float = Field(5.0, ge=0)
    """Decode, scheduler: after the receiver failed to answer, recompute without asking for this long."""
    push_wait_s: float = Field(2.0, ge=0)
    """Decode: how long a request whose push has not reached the receiver yet waits before it is
    recomputed instead."""


# ----------------------------------------------------------------------------- metadata

@dataclass
class PushSpec:
    req_id: str           # vLLM's
    push_id: str          # pdpush's (unique per prefill engine)
    token_ids: list[int]  # the prompt
    block_ids: list[int]
    receiver: str


@dataclass
class LoadSpec:
    req_id: str
    push_id: str
    block_ids: list[int]
    start: int  # tokens [start, end) come from the pool
    end: int


@dataclass
class PdpushConnectorMetadata(KVConnectorMetadata):
    pushes: list[PushSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)


# ----------------------------------------------------------------------------- worker state

@dataclass
class _Push:
    spec: PushSpec
    handle: PushHandle
    src: vl.SlotMap          # the new chunks' tokens in vLLM's cache
    dst_chunk: torch.Tensor  # each token's position among the new chunks in staging
    layers_sent: int = 0


@dataclass
class _Load:
    spec: LoadSpec
    req: DecodeRequest | None
    dst: vl.SlotMap
    src_page: torch.Tensor
    layers_done: int = 0
    failed: str | None = None


@dataclass
class _Pending:  # scheduler side, prefill: a marked request until its prompt is computed
    push_id: str
    receiver: str
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)


# What one request's push or load may raise without taking the engine down: pdpush's typed errors,
# and torch/numpy errors from a malformed transfer (logged with the request, then recomputed).
_REQUEST_ERRORS = (PdpushError, ValueError, RuntimeError, IndexError)

_TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _cpu_writer(dtype: torch.dtype, slots: int, head_size: int, cache_dtype: str) -> vl.Writer:
    """CPU_ATTN's own cache write (the ISA-specific packing), as its forward calls it."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, slots, head_size, cache_dtype)

    def write(key, value, kv_layer, slot_mapping):
        B, H, N, _ = kv_layer.shape
        key_cache, value_cache = kv_layer.view(B, H, 2 * N, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)
    return write


def _storage_tensor(a, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


class PdpushConnector(KVConnectorBase_V1):
    """Layer-by-layer push of prefill KV to the decode instance through pdpush daemons."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        try:
            self.settings = ConnectorSettings(**(tc.kv_connector_extra_config or {}))
        except ValidationError as e:
            raise ConfigError(f"PdpushConnector kv_connector_extra_config: {e}") from None
        self.is_producer = bool(tc.is_kv_producer)
        self.is_consumer = bool(tc.is_kv_consumer)
        pc = vllm_config.parallel_config
        if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
            raise ConfigError("PdpushConnector supports tensor_parallel_size = pipeline_parallel_size = 1 only")
        self.block_size = vllm_config.cache_config.block_size
        self.layout = self._layout(vllm_config)
        self.head_size = self.layout.head_dim
        self.engine_tag = uuid.uuid4().hex[:12]
        self._prefill: PrefillClient | None = None
        self._decode: DecodeClient | None = None
        # scheduler side
        self._pending: dict[str, _Pending] = {}
        self._pushed: dict[str, _Pending] = {}
        self._planned: dict[str, tuple[str, int, int]] = {}  # req_id -> (push_id, start, end)
        self._first_ask: dict[str, float] = {}
        self._next_ask: dict[str, float] = {}
        self._planned_once: set[str] = set()
        self._receiver_down_until = 0.0
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_of: dict[str, int] = {}
        self._paged: vl.PagedKV | None = None
        self._pushes: list[_Push] = []
        self._finishing: list[PushHandle] = []
        self._loads: list[_Load] = []
        self._load_errors: set[int] = set()
        self._sender_down_until = 0.0
        self._resolve_endpoints()
        # connect at start-up: a wrong path or config fails here, with its name, not on a request
        # (ZMQ connects lazily: the daemons may start after the engine)
        if self.is_producer and role == KVConnectorRole.WORKER:
            self._sender()
        if self.is_consumer:
            self._receiver()
        log.info("PdpushConnector %s role=%s producer=%s consumer=%s layout=%s", self.engine_tag, role.name,
                 self.is_producer, self.is_consumer, self.layout)

    # ---- configuration ----
    def _layout(self, vllm_config: VllmConfig) -> KVLayout:
        s = self.settings
        mc = vllm_config.model_config
        chunk, model_id = s.chunk_tokens, s.model_id
        if s.receiver_config:
            rc = load(ReceiverConfig, s.receiver_config)
            chunk = chunk or rc.chunk_tokens
            model_id = model_id or rc.model_id
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", None) and not str(cache_dtype).startswith(("float", "bfloat", "half")):
            raise ConfigError(f"PdpushConnector does not move {cache_dtype} KV caches")
        dtype = _TORCH_DTYPES.get(mc.dtype)
        if dtype is None:
            raise ConfigError(f"PdpushConnector does not move {mc.dtype} KV caches")
        if getattr(mc, "use_mla", False):
            raise ConfigError("PdpushConnector does not support MLA models")
        pc = vllm_config.parallel_config
        lay = KVLayout(mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(), dtype,  # type: ignore[arg-type]
                       chunk or 256, model_id or mc.served_model_name or mc.model)
        if s.receiver_config:
            if (rc.layers, rc.kv_heads, rc.head_dim, rc.dtype) != (lay.layers, lay.kv_heads, lay.head_dim, lay.dtype):
                raise ConfigError(
                    f"receiver {s.receiver_config} holds layers={rc.layers} kv_heads={rc.kv_heads} "
                    f"head_dim={rc.head_dim} dtype={rc.dtype}; this model needs layers={lay.layers} "
                    f"kv_heads={lay.kv_heads} head_dim={lay.head_dim} dtype={lay.dtype}")
        return lay

    def _resolve_endpoints(self) -> None:
        """Sockets and receivers from the settings and the daemons' TOML files, read once."""
        s = self.settings
        self._sender_sock, self._default_receiver = s.sender_socket, s.receiver
        if s.sender_config:
            sc = load(SenderConfig, s.sender_config)
            self._sender_sock = self._sender_sock or str(sc.ingress_socket_path())
            self._default_receiver = self._default_receiver or sc.default_receiver
        self._receiver_sock = s.receiver_socket
        if not self._receiver_sock and s.receiver_config:
            self._receiver_sock = str(load(ReceiverConfig, s.receiver_config).local_socket_path())
        self._allowed_receivers = {r for r in (s.receiver, self._default_receiver, *s.allowed_receivers) if r}

    def _sender(self) -> PrefillClient:
        if self._prefill is None:
            self._prefill = PrefillClient(self.layout, self._sender_sock or None, receiver=self._default_receiver,
                                          timeout_s=self.settings.timeout_s)
        return self._prefill

    def _reset_receiver(self) -> None:
        if self._decode is not None:
            self._decode.close()
            self._decode = None

    def _receiver(self) -> DecodeClient:
        if self._decode is None:
            if not self._receiver_sock:
                raise ConfigError("PdpushConnector (kv_consumer) needs receiver_config or receiver_socket")
            self._decode = DecodeClient(self._receiver_sock, timeout_s=self.settings.timeout_s)
        return self._decode

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer / wait_for_layer_load run between layers

    # ======================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.model_executor.models.utils import extract_layer_index

        self._kv_caches = dict(kv_caches)
        self._layer_of = {name: extract_layer_index(name) for name in kv_caches}
        if sorted(self._layer_of.values()) != list(range(self.layout.layers)):
            raise ConfigError(f"PdpushConnector: attention layers {sorted(self._layer_of.values())} do not match "
                              f"the {self.layout.layers} layers of the layout")
        names = {b.get_name() for b in get_current_attn_backends(self._vllm_config)}
        if len(names) != 1:
            raise ConfigError(f"PdpushConnector needs one attention backend, found {sorted(names)}")
        backend = names.pop()
        sample = next(iter(kv_caches.values()))
        maps = None
        if vl.BACKENDS.get(backend) == vl.TILE:
            maps = vl.learn_tile_map(sample.shape[2], self.head_size, sample.dtype,
                                     _cpu_writer(sample.dtype, sample.shape[2], self.head_size,
                                                 self._vllm_config.cache_config.cache_dtype))
        self._paged = vl.PagedKV(backend, self.head_size, maps)
        for t in kv_caches.values():  # fail at start-up, not on the first request
            self._paged.check(t)
        log.info("PdpushConnector: %d layers, backend %s, cache view %s", len(kv_caches), backend,
                 tuple(sample.shape))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Bound before every forward; start_load_kv may come after it (vLLM starts it late when a
        # step has no synchronous loads), too late for a push's begin.
        super().bind_connector_metadata(connector_metadata)
        if self._role != KVConnectorRole.WORKER:
            return
        assert isinstance(connector_metadata, PdpushConnectorMetadata)
        self._reap_finishing()
        for spec in connector_metadata.pushes:
            self._begin_push(spec)
        for lspec in connector_metadata.loads:
            self._open_load(lspec)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        pass  # loads were opened in bind_connector_metadata; each layer is read in wait_for_layer_load

    # ---- prefill: push ----
    def _begin_push(self, spec: PushSpec) -> None:
        t0 = time.perf_counter()
        try:
            self._begin_push_timed(spec)
        finally:
            STATS["push_stage_us"] += int((time.perf_counter() - t0) * 1e6)

    def _begin_push_timed(self, spec: PushSpec) -> None:
        lay = self.layout
        if time.monotonic() < self._sender_down_until:  # the forward must not wait on a sender that is not there
            STATS["push_failures"] += 1
            STATS["push_skipped_sender_down"] += 1
            return
        try:
            handle = self._sender().begin(spec.push_id, spec.token_ids, spec.receiver or None)
        except (TransportError, BrokenResourceError) as e:  # no sender, or it died: stop asking for a while
            STATS["push_failures"] += 1
            log.error("pdpush: cannot push %s (%s), and not trying for %.0f s: %s", spec.req_id, spec.push_id,
                      self.settings.sender_retry_s, e)
            self._sender_down_until = time.monotonic() + self.settings.sender_retry_s
            if self._prefill is not None:  # a fresh connection: a late reply must not answer another begin
                self._prefill.close()
                self._prefill = None
            return
        except _REQUEST_ERRORS as e:  # the receiver refused this one (pool exhausted, too large, ...)
            STATS["push_failures"] += 1
            log.error("pdpush: cannot push %s (%s): %s", spec.req_id, spec.push_id, e)
            return
        T = lay.chunk_tokens
        n = len(spec.token_ids)
        toks, slot_of_chunk = [], []
        for j, c in enumerate(handle.new_chunk_indexes):
            t0, t1 = c * T, min(n, (c + 1) * T)
            toks.append(torch.arange(t0, t1))
            slot_of_chunk.append(torch.full((t1 - t0,), j))
        if not toks:  # the receiver holds every chunk: nothing to move
            handle.finish_nowait()
            self._finishing.append(handle)
            STATS["push_requests"] += 1
            return
        tokens = torch.cat(toks)
        try:
            src = vl.SlotMap(spec.block_ids, self.block_size, tokens, T)
        except ValueError as e:  # vLLM's blocks do not cover the prompt: a bug, loud but not fatal
            log.exception("pdpush: push of %s (%s): %s", spec.req_id, spec.push_id, e)
            STATS["push_failures"] += 1
            handle.abort(str(e)[:200])
            return
        self._pushes.append(_Push(spec, handle, src, torch.cat(slot_of_chunk)))
        EVENTS.append(("begun", spec.push_id, -1, time.monotonic()))
        STATS["push_requests"] += 1
        STATS["push_tokens_staged"] += len(tokens)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if not self._pushes:  # decode steps and unmarked requests: nothing to do
            return
        t0 = time.perf_counter()
        layer = self._layer_of[layer_name]
        n = self._paged.slots_per_block(kv_layer)
        for p in list(self._pushes):
            try:
                staging = _storage_tensor(p.handle.staging_layer(layer), self.layout.dtype)  # [u, n, h, 2, T, D]
                ks, vs = self._paged.gather(kv_layer, *p.src.addresses(n))  # [tokens, heads, D]
                # a GPU cache: one device-to-host copy of the gathered tokens (synchronous; never run here)
                ks, vs = ks.to("cpu", staging.dtype), vs.to("cpu", staging.dtype)
                hu = staging.shape[2]
                for u in range(staging.shape[0]):  # the share's head units (one unless pool shards > 1)
                    staging[u][p.dst_chunk, :, 0, p.src.chunk_rows] = ks[:, u * hu:(u + 1) * hu]
                    staging[u][p.dst_chunk, :, 1, p.src.chunk_rows] = vs[:, u * hu:(u + 1) * hu]
                p.handle.layer_ready(layer)
                EVENTS.append(("layer_ready", p.spec.push_id, layer, time.monotonic()))
                p.layers_sent += 1
                STATS["push_layers"] += 1
            except _REQUEST_ERRORS as e:
                self._fail_push(p, f"layer {layer}: {e}")
        STATS["push_stage_us"] += int((time.perf_counter() - t0) * 1e6)

    def _fail_push(self, p: _Push, why: str) -> None:
        STATS["push_failures"] += 1
        log.error("pdpush: push of %s (%s) failed: %s", p.spec.req_id, p.spec.push_id, why)
        self._pushes.remove(p)
        try:
            p.handle.abort(why[:200])
        except PdpushError:
            pass

    def wait_for_save(self) -> None:
        for p in self._pushes:
            EVENTS.append(("forward_done", p.spec.push_id, -1, time.monotonic()))
        for p in list(self._pushes):
            if p.layers_sent != self.layout.layers:
                self._fail_push(p, f"only {p.layers_sent} of {self.layout.layers} layers were produced")
                continue
            try:
                p.handle.finish_nowait()  # the commit completes in the background; the decode side waits for layers
                self._finishing.append(p.handle)
            except PdpushError as e:
                self._fail_push(p, str(e))
                continue
            self._pushes.remove(p)

    def _reap_finishing(self, wait_s: float = 0.0) -> None:
        deadline = time.monotonic() + wait_s
        for h in list(self._finishing):
            try:
                done = h.poll_done(max(0.0, deadline - time.monotonic()))
            except PdpushError as e:
                STATS["push_failures"] += 1
                log.error("pdpush: commit of %s failed: %s", h.req_id, e)
                self._finishing.remove(h)
                continue
            if done is not None:
                for i, ms in enumerate(done.layer_done_ms):  # sender clock: ms after it got the begin
                    EVENTS.append(("sender_layer_done_ms", h.req_id, i, ms))
                STATS["push_committed"] += 1
                STATS["push_bytes_sent"] += done.bytes_sent
                STATS["push_chunks_skipped"] += done.chunks_skipped
                self._finishing.remove(h)

    # ---- decode: load ----
    def _open_load(self, spec: LoadSpec) -> None:
        lay = self.layout
        try:
            dst = vl.SlotMap(spec.block_ids, self.block_size, torch.arange(spec.start, spec.end), lay.chunk_tokens)
        except ValueError as e:  # the blocks do not cover the load: a bug, loud but not fatal
            log.exception("pdpush: load of %s (%s): %s", spec.req_id, spec.push_id, e)
            STATS["load_failures"] += 1
            self._load_errors.update(spec.block_ids)
            return
        load_ = _Load(spec, None, dst, torch.empty(0, dtype=torch.int64))
        self._loads.append(load_)
        t0 = time.perf_counter()
        try:
            req = self._receiver().open(spec.push_id, timeout_s=self.settings.load_timeout_s)
        except _REQUEST_ERRORS as e:
            load_.failed = f"open: {e}"
            return
        finally:
            STATS["load_wait_us"] += int((time.perf_counter() - t0) * 1e6)
        load_.req = req
        if req.layout.fingerprint() != lay.fingerprint():
            load_.failed = f"layout mismatch: pushed {req.layout}, this engine has {lay}"
        elif req.tokens < spec.end:
            load_.failed = f"the push carries {req.tokens} tokens, {spec.end} needed"
        else:
            load_.src_page = torch.tensor(req.pages, dtype=torch.int64)[dst.chunk_idx]

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads:
            return
        layer = self._layer_of[layer_name]
        kv = self._kv_caches[layer_name]
        n = self._paged.slots_per_block(kv)
        t0 = time.perf_counter()
        for ld in self._loads:
            if ld.failed is not None or ld.req is None:
                continue
            try:
                parts = [_storage_tensor(view, self.layout.dtype) for _, view in
                         ld.req.layer_shards(layer, timeout_s=self.settings.load_timeout_s)]  # [pages, h, 2, T, D]
                k, v = ([p[ld.src_page, :, i, ld.dst.chunk_rows] for p in parts] for i in (0, 1))
                self._paged.scatter(kv, *ld.dst.addresses(n), k[0] if len(k) == 1 else torch.cat(k, 1),
                                    v[0] if len(v) == 1 else torch.cat(v, 1))
                ld.layers_done += 1
                STATS["load_layers"] += 1
            except _REQUEST_ERRORS as e:
                ld.failed = f"layer {layer}: {e}"
        STATS["load_wait_us"] += int((time.perf_counter() - t0) * 1e6)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # called after every forward: settle this step's loads
        for ld in self._loads:
            if ld.failed is None and ld.layers_done != self.layout.layers:
                ld.failed = f"only {ld.layers_done} of {self.layout.layers} layers were loaded"
            if ld.failed is None:
                STATS["load_requests"] += 1
                STATS["load_tokens"] += ld.dst.tokens
            else:
                STATS["load_failures"] += 1
                STATS["load_blocks_failed"] += len(ld.dst.block_ids)
                self._load_errors.update(ld.dst.block_ids)
                log.error("pdpush: load of %s (%s) failed, its blocks will be recomputed: %s",
                          ld.spec.req_id, ld.spec.push_id, ld.failed)
            if ld.req is not None:
                try:
                    ld.req.release()
                except PdpushError as e:
                    log.warning("pdpush: release of %s: %s", ld.spec.push_id, e)
        if any(ld.failed for ld in self._loads) and self._role == KVConnectorRole.WORKER:
            self._reset_receiver()  # late replies to a failed open must not linger for the next request
        self._loads.clear()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._reap_finishing(wait_s=self.settings.timeout_s)
        for c in (self._prefill, self._decode):
            if c is not None:
                c.close()
        self._prefill = self._decode = None

    # ======================================================================= scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if self.is_producer and params.get("do_remote_decode") and rid not in self._pending:
            receiver = str(params.get("pdpush_receiver") or self.settings.receiver or "")
            if self._receiver_allowed(receiver):
                self._pending[rid] = _Pending(f"{self.engine_tag}-{rid}", receiver,
                                              list(request.prompt_token_ids or []))
            else:
                STATS["push_refused"] += 1
                log.warning("pdpush: request %s names receiver %r, which is not in allowed_receivers; "
                            "not pushing it", rid, receiver)
        push_id = params.get("pdpush_req_id")
        if not (self.is_consumer and push_id) or rid in self._planned_once:
            return 0, False  # a request planned before (then preempted) recomputes: its push was released
        prompt = list(request.prompt_token_ids or [])
        want = len(prompt) - 1  # the last prompt token is computed here, giving the first sampled token
        if want <= num_computed_tokens:
            return 0, False
        if time.monotonic() < self._next_ask.get(rid, 0.0):
            return None, False  # asked very recently; the scheduler loop spins faster than pushes arrive
        self._next_ask.pop(rid, None)
        if time.monotonic() < self._receiver_down_until:  # it did not answer recently: do not ask now
            STATS["match_missing"] += 1
            return 0, False
        STATS["match_queries"] += 1
        try:
            reply = self._receiver().query(prompt, self.layout, req_id=str(push_id),
                                           timeout_s=self.settings.query_timeout_s)
        except PdpushError as e:
            # the scheduler loop must not stall on a dead receiver: recompute, and stop asking for a while;
            # a fresh connection next time, so a late reply to this query can never answer another
            log.error("pdpush: receiver query for %s failed; recomputing it, and not asking for %.0f s: %s", rid,
                      self.settings.receiver_retry_s, e)
            self._receiver_down_until = time.monotonic() + self.settings.receiver_retry_s
            self._reset_receiver()
            STATS["match_missing"] += 1
            return 0, False
        if reply.request_chunks == 0 and reply.request_gone:  # it failed or was already used: recompute now
            STATS["match_missing"] += 1
            log.warning("pdpush: push %s for %s has ended on the receiver; recomputing", push_id, rid)
            return 0, False
        if reply.request_chunks == 0:  # not on the receiver (yet): ask again in a later step, for a while
            now = time.monotonic()
            first = self._first_ask.setdefault(rid, now)
            if now - first < self.settings.push_wait_s:
                self._next_ask[rid] = now + 0.01
                return None, False
            self._first_ask.pop(rid, None)
            STATS["match_missing"] += 1
            log.warning("pdpush: push %s for %s never reached the receiver; recomputing", push_id, rid)
            return 0, False
        self._first_ask.pop(rid, None)
        end = min(want, reply.request_chunks * self.layout.chunk_tokens)
        if end <= num_computed_tokens:
            return 0, False
        self._planned[rid] = (str(push_id), num_computed_tokens, end)
        STATS["match_tokens"] += end - num_computed_tokens
        return end - num_computed_tokens, False

    def _receiver_allowed(self, receiver: str) -> bool:
        return not receiver or "*" in self._allowed_receivers or receiver in self._allowed_receivers

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        plan = self._planned.get(request.request_id)
        if plan is not None and plan[2] - plan[1] != num_external_tokens:
            if num_external_tokens == 0:
                self._planned.pop(request.request_id)
            else:  # the scheduler trimmed the load's start (a partial local block); keep its end
                self._planned[request.request_id] = (plan[0], plan[2] - num_external_tokens, plan[2])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PdpushConnectorMetadata()
        so = scheduler_output
        for new in so.scheduled_new_reqs:
            rid = new.req_id
            plan = self._planned.pop(rid, None)
            if plan is not None:
                meta.loads.append(LoadSpec(rid, plan[0], list(new.block_ids[0]), plan[1], plan[2]))
                self._planned_once.add(rid)
            st = self._pending.get(rid)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                self._maybe_push(meta, rid, st, new.num_computed_tokens + so.num_scheduled_tokens.get(rid, 0))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._pending.get(rid)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new_blocks is not None:
                st.block_ids = list(new_blocks[0])  # a resumed request gets all its blocks anew
            elif new_blocks is not None:
                st.block_ids.extend(new_blocks[0])
            self._maybe_push(meta, rid, st, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0))
        return meta

    def _maybe_push(self, meta: PdpushConnectorMetadata, rid: str, st: _Pending, computed_after: int) -> None:
        if computed_after >= len(st.token_ids):  # the prompt's KV is complete after this step
            meta.pushes.append(PushSpec(rid, st.push_id, st.token_ids, list(st.block_ids), st.receiver))
            self._pushed[rid] = self._pending.pop(rid)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._pending.pop(rid, None)
        self._planned.pop(rid, None)
        self._first_ask.pop(rid, None)
        self._next_ask.pop(rid, None)
        self._planned_once.discard(rid)
        st = self._pushed.pop(rid, None)
        if st is None:
            return False, None
        # the blocks were copied into staging during the forward: vLLM may free them now
        return False, {"do_remote_prefill": True, "pdpush_req_id": st.push_id, "pdpush_tokens": len(st.token_ids),
                       "pdpush_receiver": st.receiver, "pdpush_layout": self.layout.fingerprint()}
