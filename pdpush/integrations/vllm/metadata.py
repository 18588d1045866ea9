"""What the scheduler side tells the workers each step, and the per-process counters."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pdpush.errors import PdpushError

# Per-process counters (the worker and, without multiprocessing, the scheduler live here).
# What one request's push or load may raise without taking the engine down: pdpush's typed errors, and torch/numpy
# errors from a malformed transfer (logged with the request, then recomputed).
REQUEST_ERRORS = (PdpushError, ValueError, RuntimeError, IndexError)

STATS: dict[str, int] = {
    "push_requests": 0, "push_layers": 0, "push_tokens_staged": 0, "push_failures": 0, "push_committed": 0,
    "push_bytes_sent": 0, "push_chunks_skipped": 0, "push_refused": 0, "push_skipped_sender_down": 0,
    "load_requests": 0, "load_tokens": 0, "load_layers": 0, "load_failures": 0, "load_blocks_failed": 0,
    "match_queries": 0, "match_tokens": 0, "match_missing": 0, "claimed_tokens": 0,
    "load_wait_us": 0,  # time the decode forward spent opening loads and waiting for / copying layers
    "push_stage_us": 0,  # time the prefill forward spent beginning pushes and copying layers into staging
    # the device-copy path (device_copy.py): layers staged through side-stream copies, and decode layers
    # loaded through them (prefetched: started before their wait_for_layer_load)
    "push_layers_copied": 0, "push_handover_wait_us": 0, "load_layers_copied": 0, "load_layers_prefetched": 0,
    # recurrent state (GDN, Mamba2): time gathering it after the forward (prefill), and waiting for it and
    # writing it into vLLM's blocks before the forward (decode)
    "push_state_us": 0, "push_state_layers": 0, "load_state_us": 0, "load_states": 0, "push_truncated": 0,
    # asynchronous loads (load_mode; always for models of several KV cache groups): loaded once committed, or
    # failed (recomputed)
    "load_async": 0, "load_async_failed": 0,
    # the decode scheduler's choice per planned load (load_mode): outside the batch, or layer by layer
    "match_async": 0, "match_layerwise": 0,
    "load_async_naps": 0,  # empty steps while only asynchronous loads waited: napped IDLE_NAP_S, not spun
}

# The last events of this process's pushes (kind, push id, layer, monotonic seconds): how the
# handovers interleave with the forward, for tests and benchmarks.
EVENTS: deque[tuple[str, str, int, float]] = deque(maxlen=512)


@dataclass
class PushSpec:
    req_id: str           # vLLM's
    push_id: str          # pdpush's (unique per prefill engine; the same on every TP rank)
    token_ids: list[int]  # the prompt
    block_ids: list[list[int]]  # one list per vLLM KV cache group (one with the hybrid manager off)
    receiver: str


@dataclass
class LoadSpec:
    req_id: str
    push_id: str
    block_ids: list[list[int]]  # one list per vLLM KV cache group
    start: int  # tokens [start, end) come from the pool
    end: int
    tokens: int = 0  # the prompt's (a sliding window's chunks are those of its last tokens); 0: end + 1
    asynchronous: bool = False  # loaded outside the forward once the push has committed (get_finished)


@dataclass
class PdpushConnectorMetadata(KVConnectorMetadata):
    pushes: list[PushSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
