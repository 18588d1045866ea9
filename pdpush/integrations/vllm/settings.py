"""The connector's configuration: ``kv_connector_extra_config``, the KV layout it derives from the
model, the daemons' endpoints, and what tensor/pipeline parallelism it accepts. Read once, at
start-up, so that a wrong setting stops the engine there with its name, not on a request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdpush.client import DecodeClient
from pdpush.config import SenderConfig, load, read_receiver
from pdpush.errors import ConfigError
from pdpush.layout import KVLayout, check_prefill_tp, dtype_name, rank_heads
from pdpush.model_layout import ATTENTION, ModelConfigError, layer_kinds, state_of, windows_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig


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
    handover: Literal["", "thread", "poll"] = ""
    """Prefill on a GPU: how a layer's finished device-to-host copy reaches the sender: ``thread`` (a
    completion thread hands each layer over as its copy completes; the default) or ``poll`` (the
    engine's thread hands over what has completed at each layer, the rest in ``wait_for_save``). With a
    CPU cache, setting it runs that same logic with copies that complete at once (tests use it);
    unset, a CPU cache is written straight into staging."""
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
    load_mode: Literal["auto", "layerwise", "async"] = "auto"
    """Decode: how a pushed request's KV gets into vLLM's blocks. ``layerwise``: inside the forward that
    computes its last prompt token, each layer read as it lands (the transfer overlaps that forward, but
    every request in the step waits for the layers still on the wire). ``async``: outside the batch, the
    request waiting (vLLM's WAITING_FOR_REMOTE_KVS) until its push has committed, then copied whole, so
    running requests' steps never wait on its layers. ``auto``: async when the push has not committed
    by the time the request is scheduled and the engine is running other requests; layer by layer when
    it has committed (nothing to wait for) or the engine is idle (nobody to hold up). Models of several
    KV cache groups always load asynchronously."""
    async_layers_per_step: int = Field(2, ge=1)
    """Decode, asynchronous loads: layers copied into vLLM's blocks per engine step, over all such loads, as
    they land (before the commit): a step pays for a few layers' copy, never for a whole request's."""


# vLLM cache dtypes whose bytes pdpush moves as they are, one element per byte: fp8 with per-layer
# static scales (or none); the rest keep scales or a second format inside the cache (refused by name)
_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class Endpoints:
    """Sockets and receivers from the settings and the daemons' TOML files."""

    sender_socket: str
    default_receiver: str
    receiver_socket: str
    allowed_receivers: frozenset[str]

    @classmethod
    def of(cls, s: ConnectorSettings) -> Endpoints:
        sender_sock, default_receiver = s.sender_socket, s.receiver
        if s.sender_config:
            sc = load(SenderConfig, s.sender_config)
            sender_sock = sender_sock or str(sc.ingress_socket_path())
            default_receiver = default_receiver or sc.default_receiver
        receiver_sock = s.receiver_socket
        if not receiver_sock and s.receiver_config:
            receiver_sock = str(read_receiver(s.receiver_config).local_socket_path())
        allowed = frozenset(r for r in (s.receiver, default_receiver, *s.allowed_receivers) if r)
        return cls(sender_sock, default_receiver, receiver_sock, allowed)

    def receiver_allowed(self, receiver: str) -> bool:
        return not receiver or "*" in self.allowed_receivers or receiver in self.allowed_receivers


class ReceiverLink:
    """The decode node's connection to its receiver, opened on first use and replaced after a failure
    (so that a late reply can never answer another request). Both connector sides hold one."""

    def __init__(self, endpoints: Endpoints, timeout_s: float) -> None:
        self.socket, self.timeout_s = endpoints.receiver_socket, timeout_s
        self._client: DecodeClient | None = None
        self.pin_cuda = False  # a GPU cache: the pool is page-locked in this process for H2D copies

    def get(self) -> DecodeClient:
        if self._client is None:
            if not self.socket:
                raise ConfigError("PdpushConnector (kv_consumer) needs receiver_config or receiver_socket")
            self._client = DecodeClient(self.socket, timeout_s=self.timeout_s, pin_cuda=self.pin_cuda)
        elif self.pin_cuda and not self._client._segments.pin:
            self._client._segments.pin_all()
        return self._client

    def flush(self) -> None:
        """Releases sent without waiting that the socket could not take then (``DecodeClient.flush``)."""
        if self._client is not None:
            self._client.flush()

    def reset(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def settings_of(extra: dict | None) -> ConnectorSettings:
    try:
        return ConnectorSettings(**(extra or {}))
    except ValidationError as e:
        raise ConfigError(f"PdpushConnector kv_connector_extra_config: {e}") from None


def cache_dtype_of(model_dtype: str, cache_dtype: str | None, platform_fp8: str = "float8_e4m3fn") -> tuple[str, str]:
    """(pdpush element type, kv_scales) of an engine's KV cache; a cache format pdpush cannot move
    byte for byte with its scales checked is refused by name. ``platform_fp8``: what vLLM's "fp8" and
    "fp8_e4m3" are on this platform (``current_platform.fp8_dtype()``: e4m3fnuz on ROCm MI300)."""
    cd = str(cache_dtype or "auto")
    if cd == "auto":
        try:
            return dtype_name(model_dtype), "none"
        except ValueError:
            raise ConfigError(f"PdpushConnector does not move {model_dtype} KV caches") from None
    if cd in _FP8:
        return (dtype_name(platform_fp8) if _FP8[cd] == "float8_e4m3fn" else _FP8[cd]), "static"
    if cd in ("float16", "bfloat16", "float32"):
        return cd, "none"
    raise ConfigError(f"PdpushConnector does not move kv_cache_dtype={cd!r} caches (it moves auto, float16, "
                      f"bfloat16 and {sorted(_FP8)}; {cd} keeps scales or an indexer inside the cache in a format "
                      "pdpush does not check yet)")


def _platform_fp8() -> str:
    try:
        from vllm.platforms import current_platform

        return str(current_platform.fp8_dtype())
    except Exception:  # noqa: BLE001 - no platform (tests with stand-in configs): vLLM's default
        return "float8_e4m3fn"


def derive_layout(vllm_config: VllmConfig, s: ConnectorSettings, kv_cache_config=None) -> KVLayout:
    """The model's whole KV as pdpush moves it: every KV head and every layer, whatever this engine's
    TP or PP stage; an MLA model's latent as one head of kv_lora_rank + qk_rope_head_dim; each layer's
    sliding window from the model's config, checked against vLLM's KV cache groups (``check_groups``)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    chunk, model_id = s.chunk_tokens, s.model_id
    rc = None
    if s.receiver_config:
        rc = read_receiver(s.receiver_config)
        chunk = chunk or rc.chunk_tokens
        model_id = model_id or rc.model_id
    dtype, scales = cache_dtype_of(str(mc.dtype), cc.cache_dtype, _platform_fp8())
    if getattr(cc, "kv_cache_dtype_skip_layers", None):
        raise ConfigError(f"PdpushConnector does not move per-layer KV dtypes (kv_cache_dtype_skip_layers="
                          f"{cc.kv_cache_dtype_skip_layers}): its layout has one dtype for every layer")
    if scales == "static" and getattr(cc, "calculate_kv_scales", False):
        raise ConfigError("PdpushConnector does not move fp8 KV caches whose scales are computed at run time "
                          "(calculate_kv_scales): the two sides' scales could not be checked")
    mla = bool(getattr(mc, "use_mla", False))
    tc = mc.hf_text_config.to_dict()
    check_groups(kv_cache_config)
    n = mc.get_total_num_hidden_layers()
    try:
        kinds = layer_kinds(tc, "the model's config", n)
        windows = windows_of(tc, "the model's config", n)
        conv_dt, ssm_dt = _state_dtypes(kv_cache_config, dtype)
        state_layers, state, units = state_of(tc, conv_dt, ssm_dt, "the model's config", n)
    except ModelConfigError as e:
        raise ConfigError(f"PdpushConnector: {e}") from None
    layers = sum(1 for k in kinds if k in ATTENTION)
    lay = KVLayout(layers, 1 if mla else (mc.get_total_num_kv_heads() if layers else 1),
                   mc.get_head_size() if layers else 1, dtype, chunk or 256,  # type: ignore[arg-type]
                   model_id or mc.served_model_name or mc.model, kind="mla" if mla else "mha",
                   kv_scales=scales, windows=engine_windows(kv_cache_config, windows, kinds),  # type: ignore[arg-type]
                   state_layers=state_layers, state=state, state_units=units)
    if rc is not None and (mismatch := rc.layout.mismatch(lay)):
        raise ConfigError(f"receiver {s.receiver_config} holds another layout than this model's, receiver vs "
                          f"model: {mismatch}")
    return lay


_MOVED_SPECS = {"FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "MambaSpec"}


def _group_kinds(kv_cache_config) -> list[str]:
    return [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]


def check_groups(kv_cache_config) -> None:
    """vLLM's KV cache groups pdpush moves: attention (full, sliding window, MLA) and recurrent state
    (MambaSpec: GDN, Mamba2). Any other is refused at start-up, naming every group's kind: no push may
    skip a group silently."""
    if kv_cache_config is None:
        return
    kinds = _group_kinds(kv_cache_config)
    other = sorted({k for k in kinds if k not in _MOVED_SPECS})
    if other:
        raise ConfigError(f"PdpushConnector does not move KV cache groups of kind {other} (this model's groups: "
                          f"{kinds}); it moves attention KV (full and sliding window), MLA latents and Mamba "
                          "state (GDN, Mamba2)")


def _state_dtypes(kv_cache_config, dtype: str) -> tuple[str, str | None]:
    """The conv and SSM state's element types as this engine keeps them (its MambaSpec), else the model's."""
    for g in (kv_cache_config.kv_cache_groups if kv_cache_config is not None else ()):
        if type(g.kv_cache_spec).__name__ == "MambaSpec":
            dts = [dtype_name(str(d)) for d in g.kv_cache_spec.dtypes]
            return dts[0], dts[-1]
    return dtype, None


def engine_windows(kv_cache_config, windows: tuple[int, ...], kinds: list[str]) -> tuple[int, ...]:
    """The windows this engine keeps: a sliding-window layer whose blocks vLLM keeps whole (its hybrid KV
    cache manager off: a full-attention group) moves every chunk, since vLLM's prefix cache would keep
    the blocks a window push never wrote; a sliding-window group's window must be the model's."""
    if kv_cache_config is None or not windows:
        return windows
    from vllm.model_executor.models.utils import extract_layer_index

    out = list(windows)
    attention = [i for i, k in enumerate(kinds) if k in ATTENTION]  # model layer -> attention layer
    for g in kv_cache_config.kv_cache_groups:
        sliding = type(g.kv_cache_spec).__name__ == "SlidingWindowSpec"
        if type(g.kv_cache_spec).__name__ == "MambaSpec":
            continue
        for name in g.layer_names:
            la = extract_layer_index(name)
            la = attention.index(la) if la in attention else len(out)
            if la >= len(out):
                continue
            if not sliding:
                out[la] = 0
            elif out[la] != g.kv_cache_spec.sliding_window:
                raise ConfigError(f"PdpushConnector: layer {name} keeps a window of {g.kv_cache_spec.sliding_window} "
                                  f"tokens in vLLM's KV cache groups, {out[la]} in the model's config")
    return tuple(out)


def check_parallelism(vllm_config: VllmConfig, layout: KVLayout, producer: bool, consumer: bool) -> None:
    """Any TP on either role where pdpush can split the page's bytes (distinct heads per rank, or a
    replicated head's bytes split among the ranks holding it); pipeline parallelism on the prefill
    side (each stage pushes its own layers under the same push id; the sender joins the stages)."""
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1 and consumer:
        raise ConfigError("PdpushConnector does not support pipeline_parallel_size > 1 on the decode side (kv_consumer"
                          " or kv_both): each decode stage would have to open the push and load its own layers, and a "
                          "stage that failed its load would leave the others' KV in place; run the decode instance "
                          "with tensor parallelism instead (prefill-side pipeline parallelism is supported)")
    tp = pc.tensor_parallel_size
    if layout.state_layers and pc.pipeline_parallel_size > 1:
        raise ConfigError("PdpushConnector does not support pipeline parallelism for a model with recurrent state "
                          f"({layout.state_layers} GDN/Mamba2 layers): one stage would have to push every layer's state")
    try:
        if producer:
            check_prefill_tp(layout, tp)
        if consumer:
            rank_heads(layout.kv_heads, tp, 0)
        layout.check_state_tp(tp)
    except ValueError as e:
        raise ConfigError(f"PdpushConnector: {e}") from None
