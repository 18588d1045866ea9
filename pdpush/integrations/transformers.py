"""transformers adapter: push each layer's K/V as the prefill produces it; rebuild the cache on decode.

Prefill side: ``PushingCache`` (a ``DynamicCache``) sees every layer's new K/V in
``update()``, right after that layer's k/v projection and RoPE, before its
attention and MLP. In pipelined mode it hands the layer to ``PrefillClient``
there and then; in eager mode the layers are handed over after the forward.

Decode side: ``cache_from_pool`` builds a ``DynamicCache`` from ``DecodeClient``
reads, layer by layer as each lands; ``greedy`` continues generation.

HF layout is ``[B, kv_heads, S, head_dim]``; pdpush's is token-major
``[S, kv_heads, head_dim]`` (B = 1). The conversion lives here and nowhere else.
Imports torch and transformers (this module is only imported by engines and the demo).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from pdpush.client import DecodeRequest, PendingBegin, PrefillClient, PushHandle
from pdpush.integrations.device_copy import D2HStager, H2DLoader
from pdpush.layout import KVLayout


@dataclass(frozen=True)
class ModelSpec:
    """A small Llama built from a config with a fixed seed: identical weights in every process."""

    layers: int = 8
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 688
    vocab: int = 1000
    dtype: str = "float32"
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def model_id(self) -> str:
        return (f"tiny-llama-L{self.layers}-h{self.hidden}-a{self.heads}-kv{self.kv_heads}-i{self.intermediate}"
                f"-v{self.vocab}-seed{self.seed}")

    def layout(self, chunk_tokens: int) -> KVLayout:
        return KVLayout(self.layers, self.kv_heads, self.head_dim, self.dtype, chunk_tokens,  # type: ignore[arg-type]
                        self.model_id)


def build_model(spec: ModelSpec, device: str = "cpu") -> LlamaForCausalLM:
    # initializer_range=0.1: with the default 0.02 the random model repeats one token, and a
    # token-equality check would prove nothing (notes/transformers.md).
    cfg = LlamaConfig(num_hidden_layers=spec.layers, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                      num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, vocab_size=spec.vocab,
                      initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(spec.seed)  # seeds the CUDA generators too: the same weights in every process
    with torch.device(device):  # initialised where it runs (a large model's init on a GPU takes no time)
        model = LlamaForCausalLM(cfg)
    return model.to(getattr(torch, spec.dtype)).eval()


# transformers 5.x renamed the forward's ``past_key_values`` to ``cache`` (notes/transformers.md); a GPU
# machine may carry a release from before the rename, where ``cache=`` would be silently ignored
_CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def _forward(model, input_ids: torch.Tensor, cache: DynamicCache, **kw):
    return model(input_ids=input_ids, use_cache=True, **{_CACHE_KW: cache}, **kw)


def to_tokens_major(x: torch.Tensor) -> torch.Tensor:
    """HF ``[1, H, S, D]`` -> pdpush ``[S, H, D]`` (a view; put_layer copies it into staging)."""
    return x[0].transpose(0, 1)


def to_hf(x: torch.Tensor) -> torch.Tensor:
    """pdpush ``[S, H, D]`` -> HF ``[1, H, S, D]``."""
    return x.transpose(0, 1).unsqueeze(0).contiguous()


class PushingCache(DynamicCache):
    """A DynamicCache that hands each layer's K/V to pdpush as soon as the layer produces it.

    The copy into staging goes through ``stager`` (integrations/device_copy.py): on a GPU it runs on a
    side stream and the layer is handed over when its copy completes; on the CPU it is ``put_layer``."""

    def __init__(self, config, handle: PushHandle | PendingBegin | None, pipelined: bool,
                 stager: D2HStager | None = None) -> None:
        super().__init__(config=config)
        # a begin not answered yet (``begin_nowait``): answered at the first layer, its round trip under its compute
        self._pending = handle if isinstance(handle, PendingBegin) else None
        self.handle = None if self._pending is not None else handle
        self.pipelined = pipelined
        self.stager = stager or D2HStager("cpu")
        self.push_times: list[float] = []

    def push_handle(self) -> PushHandle | None:
        """The request's handle, waiting for the begin's answer if it has not come yet."""
        if self._pending is not None:
            self.handle, self._pending = self._pending.wait(), None
        return self.handle

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.pipelined and self.push_handle() is not None:
            self.stager.put_layer(self.handle, layer_idx, to_tokens_major(key_states), to_tokens_major(value_states))
            self.push_times.append(time.monotonic())
        return out


@dataclass
class PrefillResult:
    first_token: int
    last_logits: torch.Tensor
    t_start: float
    t_end: float  # the forward (all layers + lm_head) is done
    layer_end: list[float]  # monotonic end time of each decoder layer
    bytes_sent: int = 0
    puts: int = 0
    chunks_skipped: int = 0
    already_sent_indexes: list[int] = field(default_factory=list)
    t_committed: float = 0.0
    t_forward: float = 0.0  # the forward starts (after the begin's round trip to the sender)


def _device(model) -> torch.device:
    return next(model.parameters()).device


class _LayerClock:
    """End time of each decoder layer on the monotonic clock. On a GPU the forward's Python runs
    ahead of the device, so ends are CUDA events, placed on the host clock from the forward's start
    (``at``: the device is idle then, so its work starts within microseconds of the launch)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host: list[float] = []
        self.events: list = []
        self.t0 = 0.0
        self.start = None

    def begin(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.t0 = time.monotonic()
        return self.t0

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)
        else:
            self.host.append(time.monotonic())

    def ends(self) -> list[float]:
        if not self.cuda:
            return self.host
        return [self.t0 + self.start.elapsed_time(e) / 1000 for e in self.events]


def prefill_and_push(model, prompt: list[int], client: PrefillClient, req_id: str, *, pipelined: bool = True,
                     layer_compute_ms: float = 0.0, receiver: str | None = None,
                     stager: D2HStager | None = None, finish_timeout_s: float | None = None) -> PrefillResult:
    """Run the prefill and push its KV. ``layer_compute_ms`` adds a sleep after each decoder layer,
    standing in for GPU compute (a sleep costs the host no CPU, as GPU compute does not). On a GPU
    the copies into staging run on ``stager``'s side stream; the push is committed once every copy
    has been handed over, or fails with ``HandOverTimeout`` after ``finish_timeout_s``."""
    dev = _device(model)
    stager = stager or D2HStager(dev)
    clock = _LayerClock(dev)

    def after_layer(_mod, _args, _out):
        if layer_compute_ms:
            time.sleep(layer_compute_ms / 1000)
        clock.mark()

    hooks = [layer.register_forward_hook(after_layer) for layer in model.model.layers]
    try:
        t_start = time.monotonic()
        pending = client.begin_nowait(req_id, prompt, receiver)  # allocated while the first layer computes
        t_forward = clock.begin()
        cache = PushingCache(model.config, pending, pipelined, stager)
        try:
            with torch.no_grad():
                out = _forward(model, torch.tensor([prompt], device=dev), cache, logits_to_keep=1)
                logits = out.logits[0, -1].float().cpu()  # the first token exists: the host has waited for it
        except BaseException:
            (pending if cache.handle is None else cache.handle).abort("the prefill's forward failed")
            raise
        t_end = time.monotonic()
        handle = cache.push_handle()
        if not pipelined:
            for i, layer in enumerate(cache.layers):
                stager.put_layer(handle, i, to_tokens_major(layer.keys), to_tokens_major(layer.values))
        stager.wait(handle, finish_timeout_s)
        done = handle.finish()
        t_committed = time.monotonic()
    finally:
        for h in hooks:
            h.remove()
    return PrefillResult(int(logits.argmax()), logits, t_start, t_end, clock.ends(), done.bytes_sent, done.puts,
                         done.chunks_skipped, handle.already_sent_indexes, t_committed, t_forward)


def forward_time(model, prompt: list[int]) -> float:
    """Seconds of one prefill forward with no push (the reference for the push's cost to the forward)."""
    dev = _device(model)
    clock = _LayerClock(dev)
    t0 = clock.begin()
    with torch.no_grad():
        out = _forward(model, torch.tensor([prompt], device=dev), DynamicCache(config=model.config), logits_to_keep=1)
        out.logits[0, -1].float().cpu()
    return time.monotonic() - t0


def cache_from_pool(model, req: DecodeRequest, timeout_s: float = 60.0,
                    arrivals: list[float] | None = None) -> DynamicCache:
    """Build the decode-side cache from the pool, layer by layer as each lands. On a GPU each layer
    goes up on a side stream (``H2DLoader``) while the next one is awaited; compute waits on its event."""
    cache = DynamicCache(config=model.config)
    dev = _device(model)
    dtype = next(model.parameters()).dtype
    loader = H2DLoader(dev)
    for layer in range(req.layout.layers):
        k, v = loader.finish(loader.start(req, layer, timeout_s), req.tokens, req.layout.dtype)
        if arrivals is not None:
            arrivals.append(time.monotonic())
        cache.update(to_hf(k).to(dtype), to_hf(v).to(dtype), layer)
    return cache


def greedy(model, cache: DynamicCache, first_token: int, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Continue greedy decoding from ``first_token``; returns the tokens after it and each step's logits."""
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    tok = first_token
    with torch.no_grad():
        for _ in range(steps):
            out = _forward(model, torch.tensor([[tok]], device=_device(model)), cache)
            lg = out.logits[0, -1].float().cpu()
            logits.append(lg)
            tok = int(lg.argmax())
            tokens.append(tok)
    return tokens, logits


def colocated(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Reference: prefill and decode in one process. Returns all tokens and all logits (prefill first)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = _forward(model, torch.tensor([prompt], device=_device(model)), cache, logits_to_keep=1)
    first = out.logits[0, -1].float().cpu()
    rest, rest_logits = greedy(model, cache, int(first.argmax()), new_tokens - 1)
    return [int(first.argmax()), *rest], [first, *rest_logits]
