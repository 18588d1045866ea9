"""What the scheduler side tells the workers each step (the counters are in stats.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pdpush.errors import PdpushError

# What one request's push or load may raise without taking the engine down: pdpush's typed errors, and torch/numpy
# errors from a malformed transfer (logged with the request, then recomputed).
REQUEST_ERRORS = (PdpushError, ValueError, RuntimeError, IndexError)


@dataclass
class PushSpec:
    req_id: str           # vLLM's
    push_id: str          # pdpush's (unique per prefill engine; the same on every TP rank)
    token_ids: list[int]  # the prompt
    block_ids: list[list[int]]  # one list per vLLM KV cache group (one with the hybrid manager off)
    receiver: str
    extra: list[bytes] = field(default_factory=list)  # its chunks' extra keys (extra_keys.py)


@dataclass
class LoadSpec:
    req_id: str
    push_id: str
    block_ids: list[list[int]]  # one list per vLLM KV cache group
    start: int  # tokens [start, end) come from the pool
    end: int
    tokens: int = 0  # the prompt's (a sliding window's chunks are those of its last tokens); 0: end + 1
    asynchronous: bool = False  # loaded outside the forward once the push has committed (get_finished)
    claim: bool = False  # chunks the receiver already held (conditional disaggregation), not a push
    prefix_key: bytes = b""  # planned from the prefill's answer: the push's open must show this last chunk key


@dataclass
class PdpushConnectorMetadata(KVConnectorMetadata):
    pushes: list[PushSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
