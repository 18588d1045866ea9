"""vLLM KV Connector V1: ``PdpushConnector`` pushes each layer from the prefill instance as it is
produced, and loads it layer by layer into the decode instance's paged cache.

Load it with::

    KVTransferConfig(kv_connector="PdpushConnector", kv_connector_module_path="pdpush.integrations.vllm",
                     kv_role="kv_producer" | "kv_consumer", kv_connector_extra_config={...})

Extra config (``settings.ConnectorSettings``): the local daemon (``sender_config``/``sender_socket``
on the prefill node, ``receiver_config``/``receiver_socket`` on the decode node), the receiver to
push to, and the chunk size / model id both sides must agree on.

The connector is split by role: ``settings`` (configuration, layout, parallelism checks),
``scheduler`` (``SchedulerSide``: which requests to push, how many tokens a push provides; one
record per request), ``worker`` (``WorkerSide``, one per TP rank: gather into staging, scatter
from the pool; its push path in ``push``, its load path in ``load``) and ``stats`` (each side's
counts, which vLLM takes after every step and exports on its /metrics as ``vllm:pdpush_*``).
``PdpushConnector`` (``connector``) only routes vLLM's calls to the side of its role.

Flow (one request, driven by a router such as ``pdpush router``):

* prefill, scheduler: a request whose ``kv_transfer_params`` has ``do_remote_decode`` is marked;
  on the step its prompt finishes, its block ids go to the workers in the connector metadata.
* prefill, every worker rank: ``bind_connector_metadata`` begins the push under the same push id
  (``PrefillClient.begin(tp_rank, tp_size)``: one allocation, the same ``already_sent_indexes`` on
  every rank); ``save_kv_layer`` gathers this rank's heads of the new chunks of layer ``l`` into its
  share of staging and hands the layer over at once (pipelined push), from the first layer after the
  begin's answer came (the layers finished before it go then: the forward never waits for it); ``wait_for_save`` asks for
  the commit without waiting. The sender marks a layer landed once every rank's share is in, and
  commits once every rank has finished.
* prefill, scheduler: ``request_finished`` returns ``kv_transfer_params`` for the decode side.
* decode, scheduler: ``get_num_new_matched_tokens`` asks the receiver's chunk index how far the
  pushed request covers this prompt (all tokens but the last, which the decode step computes).
* decode, every worker rank: the request's open goes to the receiver at bind time, and its answer is
  taken at the first layer (an asynchronous or state load's at once); ``wait_for_layer_load`` waits for
  layer ``l`` and scatters this rank's heads from the pool (zero-copy views) into vLLM's blocks. A
  failed or late load is reported by block id (``get_block_ids_with_load_errors``): vLLM discards
  the step's output and recomputes from the first bad block, so no block is left holding wrong KV.
* decode, scheduler, with ``--kv-events-config``: ``take_events`` reports the receiver pool's chunks of
  the prompts this engine loaded as vLLM KV events (``BlockStored`` once the receiver's index holds
  them, ``BlockRemoved`` once it evicts them; medium ``pdpush:<receiver control endpoint>``; events.py),
  and ``get_external_cache_hit_sources`` names the loaded tokens' tier (``p2p``; ``host`` for a claim).

Models: MHA/GQA attention and MLA latents (kvcodec.py), 16/32-bit floats and fp8 caches with unit
scales (fp8 with other static scales, run-time scales and formats with scales inside the cache are
refused by name). Hybrids, with vLLM's hybrid KV cache manager (``SupportsHMA``: one block list per KV
cache group): sliding-window groups move only their window's chunks, and GDN / Mamba2 state goes as one
page per state layer per request, the prefill stopping one token short (``on_new_request``) so that the
decode continues the state after N - 1 tokens; such models load asynchronously (docs/layout.md). Parallelism: any tensor_parallel_size on either role, equal or not: where a prefill
TP exceeds the KV heads (an MLA latent is one), the ranks holding a head split its bytes; decode
ranks read vLLM's replicas. Pipeline parallelism on the prefill side: each stage pushes its own
layers under the same push id; decode-side pipeline parallelism is refused. GPU backends (FLASH_ATTN/TRITON_ATTN
and the GPU MLA backends) follow vLLM's source but are not run here; see vllm_layout.

The package imports vLLM and torch only when its connector is asked for (``PdpushConnector`` and the other names
below, resolved on first use), so that ``pdpush.integrations.vllm.stats`` (the exported series, ``SERIES``) can be
imported where vLLM is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module defining it (imported on first use)
_LAZY = {"PdpushConnector": "connector", "PdpushConnectorMetadata": "metadata", "LoadSpec": "metadata",
         "PushSpec": "metadata", "ConnectorSettings": "settings", "SchedulerStats": "stats", "WorkerStats": "stats",
         "SERIES": "stats"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
