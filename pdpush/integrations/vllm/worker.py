"""The connector's worker side, one per TP rank: gathers this rank's KV of each layer (its heads, or
an MLA latent) into its share of the sender's staging as the forward produces it (prefill), and
scatters its heads of each pushed layer from the receiver's pool into vLLM's blocks (decode); the KV
codec (kvcodec.py) places the bytes. Every rank pushes under the same push id
(layout.py: each rank's share); the sender commits the request once every rank has finished.

This module holds the rank's view of vLLM's caches (registration, KV cache groups, state layers, scales); the push
path is ``push.py`` and the load path ``load.py``, mixed into ``WorkerSide``."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch

from pdpush import kvcodec
from pdpush.client import PrefillClient, PushHandle
from pdpush.errors import ConfigError
from pdpush.integrations import vllm_layout as vl
from pdpush.integrations.device_copy import CopyHolds, D2HStager, H2DLoader
from pdpush.integrations.vllm.load import LoadPath, _Load, _release_failed
from pdpush.integrations.vllm.metadata import PdpushConnectorMetadata
from pdpush.integrations.vllm.push import PushPath, _Push
from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints, ReceiverLink
from pdpush.integrations.vllm.stats import WorkerStats
from pdpush.layout import DTYPES, KVLayout, dtype_name, rank_heads

log = logging.getLogger("pdpush.vllm")

# backends of recurrent-state layers (GDN_ATTN, MAMBA2_ATTN, ...): their layers are moved as state, not paged KV
_STATE_BACKENDS = ("MAMBA", "GDN", "LINEAR", "SHORT_CONV")


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


class WorkerSide(PushPath, LoadPath):
    """One TP rank's connector worker: the engine's KV caches and their layout, with the push path (push.py) and the
    load path (load.py)."""

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
        self.stats = WorkerStats()  # what vLLM reports (stats.py); requests are counted by the lead rank alone
        self.stats.lead = self.tp_rank == 0 and self.pp_rank == 0
        self._prefill: PrefillClient | None = None
        self._retired: list = []  # connections to the sender given up, open until their device copies end (push.py)
        # a GPU cache: copies on side streams (device_copy.py), set up in register_kv_caches
        self._stager: D2HStager | None = None
        self._loader: H2DLoader | None = None
        self._holds = CopyHolds()  # loaded requests released once their copies to the device have completed
        self.receiver = ReceiverLink(endpoints, settings.timeout_s)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._storages = vl.Storages()  # each layer's cache as flat bytes, for the one-pass copies
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
        self._pending: list = []  # (PushSpec, PendingBegin): Begins sent before the forward, not answered yet
        self._step_layers: list = []  # (name, kv cache) of the layers this forward finished while Begins were pending
        self._finishing: list[PushHandle] = []
        self._loads: list[_Load] = []
        self._async: list[_Load] = []  # asynchronous loads waiting for their push's commit (get_finished)
        self._binds = 0  # metadata bound so far (each step's): which loads a step's finished ids can be about
        self._load_errors: set[int] = set()
        self._sender_down_until = 0.0
        self._receiver_down_until = 0.0  # loads fail at once until then: the receiver could not be reached (load.py)
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
        self._storages = vl.Storages()  # (caches made anew: the old ones' views go with them)
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
        if not 0 <= block < len(self._kv_caches[name]):  # (a negative one would index from the end: another's)
            raise ValueError(f"{name}: block {block} is not a block of its cache")
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

    def _slots(self, block_ids: list[int], tokens: np.ndarray, window: bool) -> vl.SlotMap:
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
        self._binds += 1
        self._reap_finishing()
        for spec in meta.pushes:
            self._begin_push(spec)
        self._open_loads(meta.loads)

    # ---- prefill: push ----

    def shutdown(self) -> None:
        if self._stager is not None:
            self._stager.close()
        self._reap_finishing(wait_s=self.settings.timeout_s)
        if self._prefill is not None:
            self._prefill.close()
            self._prefill = None
        if self._retired:  # connections given up: closed once their device copies end, or at the timeout
            self._close_retired(self.settings.timeout_s)
            if self._retired:
                log.error("pdpush: %d connection(s) to the sender left open at shutdown: a device copy still "
                          "writes their staging", len(self._retired))
        self._holds.drain(_release_failed)
        self.receiver.reset()
