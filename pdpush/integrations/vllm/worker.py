"""The connector's worker side, one per TP rank: gathers this rank's KV of each layer (its heads, or
an MLA latent) into its share of the sender's staging as the forward produces it (prefill), and
scatters its heads of each pushed layer from the receiver's pool into vLLM's blocks (decode); the KV
codec (kvcodec.py) places the bytes. Every rank pushes under the same push id
(layout.py: each rank's share); the sender commits the request once every rank has finished."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdpush import kvcodec
from pdpush.client import DecodeRequest, PrefillClient, PushHandle
from pdpush.errors import BrokenResourceError, ConfigError, PdpushError, TransportError
from pdpush.integrations import vllm_layout as vl
from pdpush.integrations.device_copy import CopyHolds, D2HStager, H2DLoader
from pdpush.integrations.vllm.metadata import EVENTS, STATS, LoadSpec, PdpushConnectorMetadata, PushSpec
from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints, ReceiverLink
from pdpush.layout import DTYPES, KVLayout, dtype_name, rank_heads

log = logging.getLogger("pdpush.vllm")

# What one request's push or load may raise without taking the engine down: pdpush's typed errors,
# and torch/numpy errors from a malformed transfer (logged with the request, then recomputed).
_REQUEST_ERRORS = (PdpushError, ValueError, RuntimeError, IndexError)
# backends of recurrent-state layers (GDN_ATTN, MAMBA2_ATTN, ...): their layers are moved as state, not paged KV
_STATE_BACKENDS = ("MAMBA", "GDN", "LINEAR", "SHORT_CONV")


@dataclass
class _Push:
    spec: PushSpec
    handle: PushHandle
    src: list[vl.SlotMap]    # by vLLM KV cache group: its layers' new chunks' tokens in vLLM's cache, in order
    layers_sent: int = 0
    dev_addr: dict = field(default_factory=dict)  # a CUDA cache: (group, slots) -> slot addresses on its device
    rows: dict = field(default_factory=dict)  # (group, slots, shape, strides) -> the one-pass gather's rows, or None
    states_sent: int = 0  # state layers handed over (in model order: those before each attention layer first)


@dataclass
class _Load:
    spec: LoadSpec
    req: DecodeRequest | None
    dst: list[vl.SlotMap]  # by vLLM KV cache group: the tokens it loads (a sliding window's: its window's)
    src_page: list[torch.Tensor]  # by vLLM group: each token's page in the pool
    src_chunk: list[torch.Tensor]  # by vLLM group: each token's chunk among its layers' pages
    layers_done: int = 0
    failed: str | None = None
    tickets: dict = field(default_factory=dict)  # a CUDA cache: layer -> H2D copy started (H2DLoader)
    copies: list = field(default_factory=list)  # the fences of every H2D copy started from its pages (CopyHolds)
    dev_idx: dict = field(default_factory=dict)  # a CUDA cache: vLLM group -> indexes on the device
    state_blocks: list[int] = field(default_factory=list)  # the state groups' blocks the state goes into
    deadline: float = 0.0  # an asynchronous load: its push must have committed by then

    @property
    def block_ids(self) -> set[int]:
        return {b for d in self.dst if d is not None for b in d.block_ids} | set(self.state_blocks)


def _release_failed(req: DecodeRequest, e: PdpushError) -> None:
    log.warning("pdpush: release of %s: %s", req.req_id, e)


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


def _comps(rows: torch.Tensor, dtype: str, kv: torch.Tensor) -> list[torch.Tensor]:
    """Row bytes ``[tokens, heads, C, D * B]`` as the C components in the cache's own dtype (an fp8
    cache may be held as uint8: the bytes are viewed, never converted)."""
    x = kvcodec.elements(rows, dtype)
    if x.dtype != kv.dtype and x.element_size() == kv.element_size():
        x = x.view(kv.dtype)
    return [x[:, :, c] for c in range(x.shape[2])]


class WorkerSide:
    def __init__(self, vllm_config: Any, settings: ConnectorSettings, endpoints: Endpoints, layout: KVLayout,
                 producer: bool, consumer: bool, kv_cache_config: Any = None) -> None:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        from vllm.distributed.utils import get_pp_indices

        self._vllm_config = vllm_config
        self.settings, self.endpoints, self.layout = settings, endpoints, layout
        self.producer, self.consumer = producer, consumer
        self.block_size = vllm_config.cache_config.block_size
        self.head_size = layout.head_dim
        self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.heads = rank_heads(layout.kv_heads, self.tp_size, self.tp_rank)
        pp = get_pp_group()
        self.pp_rank, self.pp_size = pp.rank_in_group, pp.world_size
        # this pipeline stage's layers (all of them without PP); a stage pushes only its own
        self.stage = range(*get_pp_indices(layout.layers, self.pp_rank, self.pp_size))
        self._prefill: PrefillClient | None = None
        # a GPU cache: copies on side streams (device_copy.py), set up in register_kv_caches
        self._stager: D2HStager | None = None
        self._loader: H2DLoader | None = None
        self._holds = CopyHolds()  # loaded requests released once their copies to the device have completed
        self.receiver = ReceiverLink(endpoints, settings.timeout_s)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_of: dict[str, int] = {}
        self._load_order: list[str] = []  # attention layer names in model order (asynchronous loads copy so)
        # vLLM's KV cache groups (one per layer kind with its hybrid KV cache manager): each block-id list
        # the scheduler passes is one of theirs; each is one pdpush layer group (a window), whose items it holds
        self._vgroup_names = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups] \
            if kv_cache_config is not None else None
        self._vgroup_specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups] \
            if kv_cache_config is not None else None
        self._vgroup_of: dict[str, int] = {}
        self._pgroup: list[int] = []  # vLLM group -> pdpush group (layout.groups); -1: a state group
        # recurrent state (GDN, Mamba2): layer name -> state layer; the engine tensors of a state page
        self._state_of: dict[str, int] = {}
        self._state_before: dict[str, int] = {}  # attention layer -> the state layers before it (model order)
        self._state_tensors: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._paged: vl.PagedKV | None = None
        self._pushes: list[_Push] = []
        self._finishing: list[PushHandle] = []
        self._loads: list[_Load] = []
        self._async: list[_Load] = []  # asynchronous loads waiting for their push's commit (get_finished)
        self._load_errors: set[int] = set()
        self._sender_down_until = 0.0
        # connect at start-up: a wrong path or config fails here, with its name, not on a request
        # (ZMQ connects lazily: the daemons may start after the engine)
        if producer:
            self._sender()
        if consumer:
            self.receiver.get()

    def _sender(self) -> PrefillClient:
        if self._prefill is None:
            self._prefill = PrefillClient(self.layout, self.endpoints.sender_socket or None,
                                          receiver=self.endpoints.default_receiver, timeout_s=self.settings.timeout_s,
                                          pin_cuda=self._stager is not None)
        return self._prefill


    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.model_executor.models.utils import extract_layer_index

        self._kv_caches = dict(kv_caches)
        specs = self._vgroup_specs or []
        state_names = {n for g, spec in zip(self._vgroup_names or [], specs, strict=True)
                       if type(spec).__name__ == "MambaSpec" for n in g}
        attention = sorted((n for n in kv_caches if n not in state_names), key=extract_layer_index)
        if self.layout.state_layers:  # a hybrid's layers by kind, in model order (no pipeline parallelism here)
            self._layer_of = {n: i for i, n in enumerate(attention)}
            self._state_of = {n: i for i, n in enumerate(sorted(state_names, key=extract_layer_index))}
            self._state_before = {a: sum(1 for s in state_names if extract_layer_index(s) < extract_layer_index(a))
                                  for a in attention}
            self._check_state(specs)
        else:
            self._layer_of = {name: extract_layer_index(name) for name in attention}
        self._load_order = sorted(self._layer_of, key=self._layer_of.__getitem__)  # layer names, in model order
        if state_names and not self.layout.state_layers:
            raise ConfigError(f"PdpushConnector: layers {sorted(state_names)[:4]} keep recurrent state; the layout has "
                              "no state layers")
        self._map_groups()
        kv_caches = {n: kv_caches[n] for n in attention}
        if not kv_caches:  # state only (Mamba2): no attention layer, no save_kv_layer or wait_for_layer_load
            log.info("PdpushConnector: %d state layers, no attention layer", len(self._state_of))
            return
        heads = {1 if t.dim() == 3 else t.shape[1] for t in kv_caches.values()}
        if heads != {self.heads[1] - self.heads[0]}:
            raise ConfigError(f"PdpushConnector: rank {self.tp_rank} of {self.tp_size} holds {sorted(heads)} KV "
                              f"heads per layer; pdpush expects heads {self.heads} of {self.layout.kv_heads}")
        if sorted(self._layer_of.values()) != list(self.stage):
            raise ConfigError(f"PdpushConnector: attention layers {sorted(self._layer_of.values())} do not match "
                              f"layers [{self.stage.start}, {self.stage.stop}) of the layout's {self.layout.layers}"
                              + (f" (pipeline stage {self.pp_rank} of {self.pp_size})" if self.pp_size > 1 else ""))
        names = {b.get_name() for b in get_current_attn_backends(self._vllm_config)}
        names = {n for n in names if not n.startswith(_STATE_BACKENDS)}  # a hybrid's state layers' own
        if len(names) != 1:
            raise ConfigError(f"PdpushConnector needs one attention backend, found {sorted(names)}")
        backend = names.pop()
        sample = next(iter(kv_caches.values()))
        if (vl.BACKENDS.get(backend) == vl.LATENT) != (self.layout.kind == "mla"):
            raise ConfigError(f"PdpushConnector: attention backend {backend} does not hold a {self.layout.kind} cache")
        if sample.element_size() != self.layout.dtype_bytes:
            raise ConfigError(f"PdpushConnector: the KV cache holds {sample.dtype} elements, the layout "
                              f"{self.layout.dtype}")
        self._check_scales()
        maps = None
        if vl.BACKENDS.get(backend) == vl.TILE:
            maps = vl.learn_tile_map(sample.shape[2], self.head_size, sample.dtype,
                                     _cpu_writer(sample.dtype, sample.shape[2], self.head_size,
                                                 self._vllm_config.cache_config.cache_dtype))
        self._paged = vl.paged_cache(backend, self.head_size, self.layout.kind, maps)
        for t in kv_caches.values():  # fail at start-up, not on the first request
            self._paged.check(t)
        if sample.is_cuda or self.settings.handover:  # a CPU cache with `handover` set: the same logic (tests)
            if self.producer:
                self._stager = D2HStager(sample.device, mode=self.settings.handover or None,
                                         timeout_s=self.settings.timeout_s)
                if self._prefill is not None:
                    self._prefill._segments.pin_all()
            if self.consumer:
                self._loader = H2DLoader(sample.device)
                self.receiver.pin_cuda = True
        log.info("PdpushConnector: %d layers, backend %s, cache view %s", len(kv_caches), backend,
                 tuple(sample.shape))

    def _check_state(self, specs: list) -> None:
        """This rank's state tensors as vLLM keeps them (its MambaSpec: conv, then SSM, in each page) must be
        the layout's (kvcodec.state_shapes), else the engine stops here, naming both."""
        want = kvcodec.state_shapes(self.layout, self.tp_size)
        dts = {s.tensor: s.dtype for s in self.layout.state}
        for spec in specs:
            if type(spec).__name__ != "MambaSpec":
                continue
            got = [tuple(int(x) for x in sh) for sh in spec.shapes]
            if got != list(want.values()) or [dtype_name(str(d)) for d in spec.dtypes] != list(dts.values()):
                raise ConfigError(f"PdpushConnector: this rank keeps state {got} of {[str(d) for d in spec.dtypes]}; the "
                                  f"layout's at tp {self.tp_size} is {list(want.values())} of {list(dts.values())} "
                                  "(conv as [kernel - 1, channels]: VLLM_SSM_CONV_STATE_LAYOUT=DS is not moved)")
        self._state_tensors = [(name, shape, getattr(torch, DTYPES[dts[name]].torch)) for name, shape in want.items()]

    def _state_views(self, name: str, block: int) -> dict[str, torch.Tensor]:
        """State layer ``name``'s tensors in block ``block`` (views of its page: conv first, then SSM)."""
        page = self._kv_caches[name][block]
        if not page.is_contiguous():
            raise ValueError(f"{name}: block {block} is not one contiguous page")
        raw = page.reshape(-1).view(torch.uint8)
        out, off = {}, 0
        for tname, shape, dt in self._state_tensors:
            nb = math.prod(shape) * dt.itemsize
            out[tname] = raw[off:off + nb].view(dt).view(shape)
            off += nb
        return out

    def _state_names(self) -> list[str]:
        return sorted(self._state_of, key=self._state_of.__getitem__)

    def _map_groups(self) -> None:
        """Each vLLM KV cache group's layers keep one window: map it to that pdpush layer group. A window
        moves whole chunks, and vLLM caches whole blocks: with a chunk of one block, every block a decode
        engine keeps of a window is one pushed whole (layout.group_chunks), never part-written."""
        if self.layout.windows and self.block_size != self.layout.chunk_tokens:
            raise ConfigError(f"PdpushConnector: a model with sliding-window layers needs chunk_tokens equal to "
                              f"vLLM's block size ({self.block_size}), not {self.layout.chunk_tokens}")
        names = self._vgroup_names or [list(self._kv_caches)]
        self._vgroup_of, self._pgroup = {}, []
        for vi, group in enumerate(names):
            if any(n in self._state_of for n in group):
                self._pgroup.append(-1)
                self._vgroup_of.update({n: vi for n in group if n in self._state_of})
                continue
            mine = [n for n in group if n in self._layer_of]
            kinds = {self.layout.group_of(self._layer_of[n]).index for n in mine}
            if len(kinds) > 1:
                raise ConfigError(f"PdpushConnector: vLLM's KV cache group {vi} mixes layers of windows "
                                  f"{sorted(self.layout.groups[k].window for k in kinds)}; pdpush needs one window "
                                  "per group (run with the hybrid KV cache manager on)")
            self._pgroup.append(kinds.pop() if kinds else 0)
            self._vgroup_of.update(dict.fromkeys(mine, vi))
        missing = [n for n in self._kv_caches if n not in self._vgroup_of]
        if missing:
            raise ConfigError(f"PdpushConnector: layers {missing[:4]} are in no KV cache group")

    def _slots(self, block_ids: list[int], tokens: torch.Tensor, window: bool) -> vl.SlotMap:
        """A SlotMap of ``tokens`` in a group's blocks; a sliding window's blocks may be vLLM's null block
        (id 0, out of the window): reading or writing one would be a bug, refused here."""
        sm = vl.SlotMap(block_ids, self.block_size, tokens, self.layout.chunk_tokens)
        if window and 0 in sm.block_ids:
            raise ValueError(f"tokens {int(tokens.min())}..{int(tokens.max())} fall in vLLM's null block "
                             "(outside its sliding window)")
        return sm

    def _check_scales(self) -> None:
        """An fp8 cache's static k/v scales live on the attention layers. Until the two sides compare
        them at first contact, only unit scales are moved (a push between different scales would
        decode garbage), and anything else is refused here, by layer."""
        if self.layout.kv_scales != "static":
            return
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(self._vllm_config, AttentionLayerBase, list(self._kv_caches))
        for name, layer in layers.items():
            scales = [float(getattr(layer, a, 1.0)) for a in ("_k_scale_float", "_v_scale_float")]
            if scales != [1.0, 1.0]:
                raise ConfigError(f"PdpushConnector: layer {name} has fp8 KV scales k={scales[0]} v={scales[1]}; "
                                  "pdpush moves fp8 caches with unit scales only (non-unit static scales are "
                                  "not checked between the two sides yet)")

    def bind_connector_metadata(self, meta: PdpushConnectorMetadata) -> None:
        # Bound before every forward; start_load_kv may come after it (vLLM starts it late when a
        # step has no synchronous loads), too late for a push's begin.
        self._reap_finishing()
        for spec in meta.pushes:
            self._begin_push(spec)
        for lspec in meta.loads:
            self._open_load(lspec)

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
            handle = self._sender().begin(spec.push_id, spec.token_ids, spec.receiver or None,
                                          tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank,
                                          pp_size=self.pp_size,
                                          layers=(self.stage.start, self.stage.stop) if self.pp_size > 1 else None)
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
        if not handle.plan.n_new and not lay.state_layers:  # the receiver holds every item: nothing to move
            handle.finish_nowait()
            self._finishing.append(handle)
            STATS["push_requests"] += 1
            return
        src = []
        try:  # each vLLM group's layers: their pdpush group's new chunks (a sliding window's: of its window)
            for vi, pg in enumerate(self._pgroup):
                if pg < 0:  # a state group: its running state, gathered once the forward is done
                    src.append(None)
                    continue
                gp = handle.plan.groups[pg]
                tokens = torch.cat([torch.arange(c * T, min(n, (c + 1) * T)) for c in gp.new_chunks]) \
                    if gp.new_chunks else torch.empty(0, dtype=torch.int64)
                src.append(self._slots(spec.block_ids[vi], tokens, bool(gp.group.window)))
        except (ValueError, IndexError) as e:  # vLLM's blocks do not cover the prompt: a bug, loud but not fatal
            log.exception("pdpush: push of %s (%s): %s", spec.req_id, spec.push_id, e)
            STATS["push_failures"] += 1
            handle.abort(str(e)[:200])
            return
        self._pushes.append(_Push(spec, handle, src))
        EVENTS.append(("begun", spec.push_id, -1, time.monotonic()))
        STATS["push_requests"] += 1
        STATS["push_tokens_staged"] += sum(sm.tokens for sm in src if sm is not None)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if not self._pushes:  # decode steps and unmarked requests: nothing to do
            return
        t0 = time.perf_counter()
        layer = self._layer_of[layer_name]
        vg = self._vgroup_of[layer_name]
        n = self._paged.slots_per_block(kv_layer)
        for p in list(self._pushes):
            try:
                if self._stager is not None:  # gather and copy on a side stream, hand over when the copy is done
                    addr = p.dev_addr.get((vg, n))
                    if addr is None:
                        addr = p.dev_addr[vg, n] = tuple(a.to(kv_layer.device) for a in p.src[vg].addresses(n))
                    self._stager.put_layer(p.handle, layer, lambda a=addr: self._paged.gather(kv_layer, *a),
                                           new_only=True)
                    p.layers_sent += 1
                    STATS["push_layers"] += 1
                    STATS["push_layers_copied"] += 1
                    continue
                if p.src[vg].tokens and (rows := self._gather_rows(p, vg, layer, kv_layer, n)) is not None:
                    p.handle.stage_gathered(layer, vl.storage(kv_layer), *rows)  # one pass, cache to staging
                elif p.src[vg].tokens:  # [new tokens, heads, D] each, then into staging
                    comps = self._paged.gather(kv_layer, *p.src[vg].addresses(n))
                    p.handle.stage_layer(layer, *comps, new_only=True)
                p.handle.layer_ready(layer)
                EVENTS.append(("layer_ready", p.spec.push_id, layer, time.monotonic()))
                p.layers_sent += 1
                STATS["push_layers"] += 1
                if self._state_before.get(layer_name, 0) > p.states_sent:  # state layers the forward has passed
                    self._push_state(p, self._state_before[layer_name])
            except _REQUEST_ERRORS as e:
                self._fail_push(p, f"layer {layer}: {e}")
        STATS["push_stage_us"] += int((time.perf_counter() - t0) * 1e6)

    def _gather_rows(self, p: _Push, vg: int, layer: int, kv_layer: torch.Tensor, n: int):
        """Where each row of this rank's share of the group's layers lives in vLLM's cache (``kvcodec.gather``:
        one pass from the paged blocks into staging), computed at the group's first layer, as every layer of
        it has the same shape and strides. None where that cannot run here (no native copy, a cache on a
        device, units that cut rows): the layer is gathered, then staged."""
        key = (vg, n, tuple(kv_layer.shape), tuple(kv_layer.stride()))
        if key not in p.rows:
            rows = None
            if kv_layer.device.type == "cpu" and kvcodec.can_gather():
                heads = 1 if isinstance(self._paged, vl.PagedLatent) else kv_layer.shape[1]
                what = p.handle.share_rows(layer, heads)
                if what is not None:
                    rows = self._paged.rows(kv_layer, *p.src[vg].addresses(n), *what)
            p.rows[key] = rows
        return p.rows[key]

    def _push_state(self, p: _Push, upto: int) -> None:
        """The prompt's running state of state layers ``[p.states_sent, upto)``, after its last token here
        (the prefill stopped one short of the prompt: ``SchedulerSide.on_new_request``), from each state
        group's last block (vLLM keeps a request's running state there), as this rank's units of them
        (kvcodec.stage_state), each handed over as the layer ``layout.layers + s``. Mamba and GDN layers
        have no save hook: the state of those before an attention layer goes at that layer's save (while the
        forward goes on), the rest once the forward is done (``wait_for_save``)."""
        t0 = time.perf_counter()
        names = self._state_names()[p.states_sent:upto]
        tensors = [self._state_views(name, p.spec.block_ids[self._vgroup_of[name]][-1]) for name in names]
        for s, t in enumerate(tensors, p.states_sent):  # each handed over as soon as it is in: its block comes back
            p.handle.stage_state(s, t)
            p.handle.layer_ready(self.layout.layers + s)
        EVENTS.append(("state_ready", p.spec.push_id, self.layout.layers + upto - 1, time.monotonic()))
        p.states_sent = upto
        STATS["push_state_layers"] += len(names)
        STATS["push_state_us"] += int((time.perf_counter() - t0) * 1e6)

    def _fail_push(self, p: _Push, why: str) -> None:
        STATS["push_failures"] += 1
        log.error("pdpush: push of %s (%s) failed: %s", p.spec.req_id, p.spec.push_id, why)
        self._pushes.remove(p)
        if self._stager is not None:
            self._stager.drop(p.handle)
        try:
            p.handle.abort(why[:200])
        except PdpushError:
            pass

    def wait_for_save(self) -> None:
        for p in self._pushes:
            EVENTS.append(("forward_done", p.spec.push_id, -1, time.monotonic()))
        for p in list(self._pushes):
            if p.layers_sent != len(self.stage):
                self._fail_push(p, f"only {p.layers_sent} of this stage's {len(self.stage)} layers were produced")
                continue
            try:
                if self._stager is not None:
                    # every copy handed over before the commit; also, vLLM may reuse these blocks once the
                    # step ends, so no copy may still be reading them (with a deadline: HandOverTimeout)
                    t0 = time.perf_counter()
                    try:
                        self._stager.wait(p.handle, self.settings.timeout_s)
                    finally:
                        STATS["push_handover_wait_us"] += int((time.perf_counter() - t0) * 1e6)
                if p.states_sent < self.layout.state_layers:  # those after the last attention layer
                    self._push_state(p, self.layout.state_layers)
                p.handle.finish_nowait()  # the commit completes in the background; the decode side waits for layers
                self._finishing.append(p.handle)
            except _REQUEST_ERRORS as e:
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
        prompt = spec.tokens or spec.end + 1
        pushed = prompt - 1 if lay.state_layers else prompt  # a model with state: the prefill stopped one short
        dst, state_blocks = [], []
        try:  # each vLLM group: the tokens its layers load (a sliding window's: those of its window)
            for vi, pg in enumerate(self._pgroup):
                if pg < 0:  # a state group
                    state_blocks.extend(self._state_targets(spec, vi))
                    dst.append(None)
                    continue
                group = lay.groups[pg]
                dst.append(self._group_dst(spec, vi, group, lay.group_chunks(group, pushed).start))
        except (ValueError, IndexError) as e:  # the blocks do not cover the load: a bug, loud but not fatal
            log.exception("pdpush: load of %s (%s): %s", spec.req_id, spec.push_id, e)
            if spec.asynchronous:
                self._async.append(_Load(spec, None, [], [], [], failed=str(e)))
                return
            STATS["load_failures"] += 1
            self._load_errors.update(b for ids in spec.block_ids for b in ids if b)
            return
        load_ = _Load(spec, None, dst, [], [], state_blocks=state_blocks,
                      deadline=time.monotonic() + self.settings.load_timeout_s)
        (self._async if spec.asynchronous else self._loads).append(load_)
        t0 = time.perf_counter()
        try:
            req = self.receiver.get().open(spec.push_id, timeout_s=self.settings.load_timeout_s,
                                        tp_rank=self.tp_rank, tp_size=self.tp_size)
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
        elif lay.state_layers and spec.end != req.tokens:  # its state is after all of them: all, or nothing
            load_.failed = f"a load of tokens [{spec.start}, {spec.end}) with a state after {req.tokens}"
        else:
            for i, (d, pg) in enumerate(zip(dst, self._pgroup, strict=True)):
                if d is None:
                    load_.src_chunk.append(None)
                    load_.src_page.append(None)
                    continue
                chunks = req.plan.groups[pg].chunks
                group = lay.groups[pg]
                if group.window:  # the push's own window (a claim's is of its shorter prompt), which must hold
                    # every token the decode's next one attends to: [end - W + 1, end)
                    if max(0, spec.end - group.window + 1) < chunks.start * lay.chunk_tokens:
                        load_.failed = (f"the push holds the window of tokens from {chunks.start * lay.chunk_tokens}"
                                        f", the decode's token {spec.end} attends from {spec.end - group.window + 1}")
                        break
                    d = dst[i] = self._group_dst(spec, i, group, chunks.start)
                rel = d.chunk_idx - chunks.start
                if len(rel) and (int(rel.min()) < 0 or int(rel.max()) >= len(chunks)):
                    load_.failed = f"the push holds chunks {chunks} of layer group {pg}, the load needs others"
                    break
                load_.src_chunk.append(rel)
                load_.src_page.append(torch.tensor(req.group_pages(pg), dtype=torch.int64)[rel])
            if lay.state_layers and load_.failed is None and not spec.asynchronous:
                self._load_state(load_)

    def _group_dst(self, spec: LoadSpec, vi: int, group, first_chunk: int) -> vl.SlotMap:
        """The tokens of ``[spec.start, spec.end)`` that vLLM group ``vi``'s layers load: from chunk
        ``first_chunk`` on (a window's first), and for a window not in vLLM's null block (out of its window)."""
        t = torch.arange(max(spec.start, first_chunk * self.layout.chunk_tokens), spec.end)
        blocks = spec.block_ids[vi]
        if group.window and len(t):
            t = t[torch.tensor(blocks, dtype=torch.int64)[t // self.block_size] != 0]
        return self._slots(blocks, t, bool(group.window))

    def _state_targets(self, spec: LoadSpec, vi: int) -> list[int]:
        """State group ``vi``'s blocks a load writes the state into: the one the forward reads the running
        state from (the last), and the one before where it differs (vLLM copies that one into the last
        before the step)."""
        blocks = spec.block_ids[vi]
        prompt = spec.tokens or spec.end + 1
        prev = blocks[(prompt - 2) // self.block_size] if prompt >= 2 else 0
        return list(dict.fromkeys(b for b in (blocks[-1], prev) if b))

    def _load_state(self, ld: _Load) -> None:
        """The pushed running state into the decode's state blocks, before its forward (Mamba layers have no
        load hook): it lands last, so this waits for the push's end (``load_timeout_s``, then recompute)."""
        t0 = time.perf_counter()
        try:
            state = kvcodec.read_state(torch.from_numpy(ld.req.state_bytes(timeout_s=self.settings.load_timeout_s)),
                                       self.layout, self.tp_size, self.tp_rank)
            for vi, pg in enumerate(self._pgroup):
                if pg >= 0:
                    continue
                targets = self._state_targets(ld.spec, vi)
                for name in self._vgroup_names[vi]:
                    if name not in self._state_of:
                        continue
                    for b in targets:
                        for tname, view in self._state_views(name, b).items():
                            view.copy_(state[self._state_of[name]][tname])
            STATS["load_states"] += 1
        except _REQUEST_ERRORS as e:
            ld.failed = f"state: {e}"
        finally:
            STATS["load_state_us"] += int((time.perf_counter() - t0) * 1e6)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads:
            return
        t0 = time.perf_counter()
        for ld in self._loads:
            self._load_layer(ld, layer_name)
        STATS["load_wait_us"] += int((time.perf_counter() - t0) * 1e6)

    def _load_layer(self, ld: _Load, layer_name: str) -> None:
        """One layer of one load, from the pool into vLLM's blocks (it waits for the layer to land)."""
        if ld.failed is not None or ld.req is None:
            return
        layer = self._layer_of[layer_name]
        vg = self._vgroup_of[layer_name]
        kv = self._kv_caches[layer_name]
        n = self._paged.slots_per_block(kv)
        if self._loader is not None:
            self._load_layer_staged(ld, layer, vg, kv, n)
            return
        try:
            dst = ld.dst[vg]
            pool = torch.from_numpy(ld.req.pool_bytes(layer, timeout_s=self.settings.load_timeout_s))
            if dst.tokens:
                rows = kvcodec.read_rows(pool, ld.req.geometry, layer, ld.src_page[vg], dst.chunk_rows,
                                         ld.req.heads)
                self._paged.scatter(kv, *dst.addresses(n), *_comps(rows, self.layout.dtype, kv))
            ld.layers_done += 1
            STATS["load_layers"] += 1
        except _REQUEST_ERRORS as e:
            ld.failed = f"layer {layer}: {e}"

    def poll_async_loads(self) -> tuple[set[str], set[str]]:
        """Asynchronous loads (``load_mode``; always for a model of several KV cache groups, whose failed loads
        vLLM can only take as a failed request), once per engine step, outside the forward: the layers that
        have landed are copied in order, at most ``async_layers_per_step`` over all loads, so that no step
        pays for a whole request's copy; a load whose every layer is copied and whose push has committed
        gets its state (if any) and is done. One that failed, or did not commit by its deadline, fails (vLLM
        recomputes it from its first token). Returns (loaded, failed) vLLM request ids."""
        self._holds.poll(_release_failed)  # loads whose copies to the device have completed since
        done: set[str] = set()
        failed: set[str] = set()
        t0 = time.perf_counter()
        budget = self.settings.async_layers_per_step
        names = self._load_order
        for ld in list(self._async):
            if ld.failed is None:
                try:
                    while (ld.layers_done < len(names) and budget > 0 and ld.failed is None
                           and ld.req.landed(self._layer_of[names[ld.layers_done]])):
                        self._load_layer(ld, names[ld.layers_done])
                        budget -= 1
                    if ld.failed is None and not (ld.layers_done == len(names) and ld.req.poll_committed()):
                        if time.monotonic() < ld.deadline:
                            continue
                        ld.failed = (f"the push did not commit, or its layers were not copied ({ld.layers_done} of "
                                     f"{len(names)}), within load_timeout_s={self.settings.load_timeout_s}")
                except _REQUEST_ERRORS as e:
                    ld.failed = str(e)
            if ld.failed is None and self.layout.state_layers:
                self._load_state(ld)
            self._async.remove(ld)
            if ld.failed is None:
                done.add(ld.spec.req_id)
                STATS["load_requests"] += 1
                STATS["load_async"] += 1
                STATS["load_tokens"] += ld.spec.end - ld.spec.start
            else:
                failed.add(ld.spec.req_id)
                STATS["load_failures"] += 1
                STATS["load_async_failed"] += 1
                log.error("pdpush: load of %s (%s) failed, it will be recomputed: %s", ld.spec.req_id,
                          ld.spec.push_id, ld.failed)
            if ld.req is not None:
                self._holds.release(ld.req, ld.copies, _release_failed)
        if failed:
            self._reset_if_idle()
        STATS["load_wait_us"] += int((time.perf_counter() - t0) * 1e6)
        return done, failed

    def _load_layer_staged(self, ld: _Load, layer: int, vg: int, kv: torch.Tensor, n: int) -> None:
        """A GPU cache: this layer's pages go up on a side stream (H2DLoader), with every later layer
        that has already landed started behind it; the scatter on the compute stream waits on its event.
        (On a CPU cache with ``handover`` set, the same logic with copies done at once.)"""
        try:
            req, loader = ld.req, self._loader
            for later in range(layer + 1, self.layout.layers):  # prefetch what has landed, in order
                if later in ld.tickets:
                    continue
                if not req.landed(later):
                    break
                ld.tickets[later] = loader.start(req, later)
                ld.copies.append(loader.fence_of(ld.tickets[later]))
                STATS["load_layers_prefetched"] += 1
            ticket = ld.tickets.pop(layer, None)
            if ticket is None:
                ticket = loader.start(req, layer, self.settings.load_timeout_s)
                ld.copies.append(loader.fence_of(ticket))
            pages = loader.ready(ticket)  # the compute stream waits on the copy; the host does not
            if vg not in ld.dev_idx:
                d = ld.dst[vg]
                ld.dev_idx[vg] = (ld.src_chunk[vg].to(kv.device), d.chunk_rows.to(kv.device),
                                  *(a.to(kv.device) for a in d.addresses(n)))
            ci, rows, blk, off = ld.dev_idx[vg]
            self._paged.scatter(kv, blk, off, *_comps(pages[ci, :, :, rows], self.layout.dtype, kv))
            ld.layers_done += 1
            STATS["load_layers"] += 1
            STATS["load_layers_copied"] += 1
        except _REQUEST_ERRORS as e:
            ld.failed = f"layer {layer}: {e}"

    def get_block_ids_with_load_errors(self) -> set[int]:
        # called after every forward: settle this step's loads
        self._holds.poll(_release_failed)
        for ld in self._loads:
            if ld.failed is None and ld.layers_done != self.layout.layers:
                ld.failed = f"only {ld.layers_done} of {self.layout.layers} layers were loaded"
            if ld.failed is None:
                STATS["load_requests"] += 1
                STATS["load_tokens"] += ld.spec.end - ld.spec.start
            else:
                STATS["load_failures"] += 1
                STATS["load_blocks_failed"] += len(ld.block_ids)
                self._load_errors.update(ld.block_ids)
                log.error("pdpush: load of %s (%s) failed, its blocks will be recomputed: %s",
                          ld.spec.req_id, ld.spec.push_id, ld.failed)
            if ld.req is not None:
                self._holds.release(ld.req, ld.copies, _release_failed)
        failed = any(ld.failed for ld in self._loads)
        self._loads.clear()
        if failed:
            self._reset_if_idle()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _reset_if_idle(self) -> None:
        """After a failed load, a fresh connection to the receiver, so that late replies to the failed open cannot
        answer the next request; only while no load holds the pool's pages (closing the client unmaps the pool
        under an asynchronous load's views: the engine would crash at its next poll)."""
        if not self._async and not self._loads and not self._holds.poll(_release_failed):
            self.receiver.reset()

    def shutdown(self) -> None:
        if self._stager is not None:
            self._stager.close()
        self._reap_finishing(wait_s=self.settings.timeout_s)
        if self._prefill is not None:
            self._prefill.close()
            self._prefill = None
        self._holds.drain(_release_failed)
        self.receiver.reset()
