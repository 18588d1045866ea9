"""Daemon configuration: pydantic settings from flags, PDPUSH_* env, a TOML file, defaults.

Precedence: CLI flags > ``PDPUSH_*`` environment > the TOML file > defaults.
Unknown keys are an error that names the key. Imports no zmq, UCX or torch.
"""

from __future__ import annotations

import contextvars
import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from pdpush import staging
from pdpush.errors import ConfigError
from pdpush.layout import DType, Kind, KVLayout, KvScales, PoolGeometry, check_shards

_toml_path: contextvars.ContextVar[Path | None] = contextvars.ContextVar("pdpush_toml", default=None)


def runtime_dir() -> Path:
    """Where local sockets live: $XDG_RUNTIME_DIR/pdpush, else /tmp/pdpush-<uid> (mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    d = Path(base) / "pdpush" if base else Path(f"/tmp/pdpush-{os.getuid()}")
    return d


def default_sender_socket(metrics_port: int = 9711) -> Path:
    return runtime_dir() / (f"sender-{metrics_port}.sock" if metrics_port > 0 else "sender.sock")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Settings(BaseSettings):
    """Sources and precedence, and what every pdpush process (daemons, router) has."""

    model_config = SettingsConfigDict(env_prefix="PDPUSH_", extra="forbid", validate_default=True)

    host: str = "127.0.0.1"
    """Address the network-facing endpoints bind to. Loopback by default."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log verbosity."""
    log_format: Literal["text", "json"] = "text"
    """'text' for people, 'json' for log pipelines."""
    ready_file: str | None = None
    """If set, a JSON file with the bound endpoints is written here once the process can serve."""
    _source: tuple[Path | None, dict[str, Any]] | None = PrivateAttr(default=None)
    # what load() built it from (the file, the overrides), so that reload() can read it again

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource):
        path = _toml_path.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)



_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")


def socket_path_error(path: Path) -> str | None:
    """Why a daemon's local socket ``path`` cannot be bound, or None: with its lifeline's ``.life`` beside it, the
    longest path a unix socket takes is 107 bytes."""
    n = len(os.fsencode(f"{path}.life"))
    return f"{path} is {n} bytes with its '.life' lifeline: a unix socket's path holds 107" if n > 107 else None


def endpoint_host_port(endpoint: str) -> tuple[str, int]:
    """The host (brackets stripped) and port of a receiver's control endpoint that ``endpoint_error`` accepts."""
    m = _ENDPOINT.fullmatch(endpoint)
    if m is None:
        raise ValueError(f"{endpoint!r} is not a receiver control endpoint tcp://host:port")
    return m.group(1).strip("[]"), int(m.group(2))


def url_error(url: str) -> str | None:
    """Why ``url`` is not an engine's base URL (``http://host:port``, https too), or None."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        u.port  # noqa: B018 - raises for a port that is not a number, or out of range
    except ValueError as e:
        return f"{url!r} is not an engine URL http://host:port: {e}"
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
        return f"{url!r} is not an engine URL http://host:port"
    return None


def endpoint_error(endpoint: str) -> str | None:
    """Why ``endpoint`` is not a receiver's control endpoint (``tcp://host:port``), or None: checked where a config
    or a request names one, so that a typo fails there, typed, rather than as a socket error in the daemon's loop."""
    m = _ENDPOINT.fullmatch(endpoint)
    if m is None or not 0 < int(m.group(2)) < 65536 or (m.group(1).startswith("[") and not _ipv6(m.group(1)[1:-1])):
        return f"{endpoint!r} is not a receiver control endpoint tcp://host:port"  # (brackets: an IPv6 address only)
    return None


def _ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return "%" not in text  # (a zone: ZeroMQ's endpoints take none)


class _Base(_Settings):
    max_frame_bytes: int = Field(8 << 20, ge=4096, le=256 << 20)
    """Largest control frame accepted; larger frames get a typed error."""
    prefault: bool = True
    """Touch every page of the shared region at start-up, so the first transfers do not pay
    for page faults (about 1 s per GiB here). Turn off for very large pools on fast-start hosts.
    A sender also maps each receiver's pool in, on a thread once connected, where UCX maps it into
    the sender (shared memory on one host), what of it the receiver has in memory: about 0.2 s per GiB
    here, and page tables of 2 MiB per GiB."""
    ucx_env: dict[str, str] = Field(default_factory=dict)
    """Extra UCX_* variables (UCX_TLS, UCX_NET_DEVICES, ...), applied before UCX starts."""
    drain_timeout_s: float = Field(10.0, gt=0)
    """On SIGTERM, how long in-flight work may take before it is aborted."""
    metrics_host: str = "127.0.0.1"
    """Address of the Prometheus /metrics endpoint (loopback by default)."""

    @model_validator(mode="after")
    def _check_ucx_env(self):
        for k in self.ucx_env:
            if not k.startswith("UCX_"):
                raise ValueError(f"ucx_env key {k!r} must start with UCX_")
        return self


class ReceiverConfig(_Base):
    metrics_port: int = Field(9710, ge=-1, le=65535)
    """Prometheus /metrics port (0 = any free port, -1 = off)."""
    control_port: int = Field(5710, ge=0, le=65535)
    """ZMQ ROUTER port for senders (0 = any free port; see ready_file)."""
    ucx_port: int = Field(5711, ge=0, le=65535)
    """UCX listener port for senders' data plane (0 = any free port)."""
    local_socket: str = ""
    """Unix socket for the local decode engine; default <runtime dir>/receiver-<control_port>.sock."""
    model: str = ""
    """A model directory (its ``config.json``): the layout fields this config does not set are read from it
    (``pdpush layout --model DIR`` prints them). Set ``dtype`` where the engine serves another dtype than the
    config's."""
    layers: int = Field(32, ge=0)
    """Layout: number of layers the pool holds."""
    kv_heads: int = Field(8, ge=1)
    """Layout: KV heads per layer."""
    head_dim: int = Field(128, ge=1)
    """Layout: dimension of one head."""
    dtype: DType = "bfloat16"
    """Layout: element type of the KV cache (fp8 caches: float8_e4m3fn or float8_e5m2)."""
    kind: Kind = "mha"
    """Layout: ``mha`` (attention K and V per KV head, MHA/GQA) or ``mla`` (one latent of
    kv_lora_rank + qk_rope_head_dim per token: set kv_heads = 1 and head_dim to that sum)."""
    kv_scales: KvScales = "none"
    """Layout: ``static`` for an fp8 cache (per-layer k/v scales, which the vLLM connector requires to be
    1.0), else ``none``."""
    chunk_tokens: int = Field(256, ge=1)
    """Layout: tokens per chunk (one page per chunk per layer)."""
    model_id: str = "default"
    """Layout: model identity; senders of another model are refused."""
    windows: list[int] = Field(default_factory=list)
    """Layout: each layer's sliding window in tokens, 0 for full attention (empty: every layer full). A
    sliding-window layer gets only the chunks of a prompt's last window (docs/layout.md); ``model`` reads
    it from ``layer_types``."""
    pool_pages: int = Field(64, ge=1)
    """Pages in the pool; the pool is layers x pool_pages x page_bytes bytes."""
    state_slots: int = Field(64, ge=1)
    """Where the model has recurrent state (GDN, Mamba2: ``state_layers``): how many requests' state the pool
    holds at once (each ``state_layers`` pages, docs/layout.md). A request holds its slot until it is read."""
    state_layers: int = Field(0, ge=0)
    """Layout: layers of recurrent state (GDN, Mamba2) beside the attention ``layers``; ``model`` reads it."""
    state_units: int = Field(1, ge=1)
    """Layout: units a state page splits into for tensor parallelism (a TP must divide it)."""
    state: list[tuple[str, DType, list[int], int, bool]] = Field(default_factory=list)
    """Layout: the state's segments ``[tensor, dtype, shape, axis, replicated]`` (layout.StateSegment)."""
    pool_shards: int = Field(1, ge=1)
    """Slices a pool page's bytes are split into, shard-major per layer (docs/layout.md). Set it to the prefill
    instances' tensor-parallel size: each prefill rank then puts its share in one put per page run. Must
    divide kv_heads (whole heads per shard), or be a multiple of it that divides the page (MLA, one KV head)."""
    lease_ms: int = Field(30_000, ge=10)
    """Upper bound on any lease; an uncommitted allocation is reclaimed after it."""
    quarantine_ms: int = Field(2_000, ge=0)
    """Grace period before reclaimed pages are reused (late one-sided writes)."""
    committed_ttl_ms: int = Field(600_000, ge=1)
    """Committed requests no decode client has opened are dropped after this."""
    max_chunks_per_request: int = Field(65536, ge=1)
    """Cap on chunk keys in one AllocRequest."""
    verify_checksums: bool = False
    """Verify per-layer xxhash checksums sent in LayerDone (costs a pass over the bytes). A push whose layers come
    without them (its sender's ``checksums = false``) fails, typed (checksum_mismatch), and is never indexed."""
    max_leases_per_sender: int = Field(1024, ge=1)
    """Cap on uncommitted allocations one sender may hold: per CURVE key where authentication is on (whatever
    connections it opens), else per connection. Its ended requests whose late writes may still land (aborted
    unsettled, or expired, until its Abort says settled or it is fenced) count too."""
    max_inflight_bytes_per_sender: int = Field(0, ge=0)
    """Cap on pool bytes one sender (as ``max_leases_per_sender`` counts senders) may hold uncommitted (0 = the
    whole pool), its ended requests' pages (and state slots) too while they wait for its late writes or sit in
    quarantine."""
    curve_secret_key_file: str | None = None
    """This receiver's CURVE secret key (``.key_secret`` from ``pdpush keygen``): turns on authentication."""
    allowed_senders: list[str] = Field(default_factory=list)
    """Sender public keys admitted with CURVE: Z85 keys, ``.key`` files, or directories of them."""
    allowed_readers: list[str] = Field(default_factory=list)
    """Router public keys admitted with CURVE only to subscribe to the chunk-index feed, to withdraw a push that has
    not begun (``Withdraw``) and one nobody will read (``Unread``: a begun push nobody has open too): no Hello, so no
    pool rkey and no UCX token (a compromised HTTP-facing router cannot write KV). Same forms as ``allowed_senders``;
    a key named here is a reader's though ``allowed_senders`` names it too (a directory of keys)."""
    insecure: bool = False
    """Allow binding a non-loopback address without CURVE authentication (logs a warning)."""
    ucx_token_timeout_ms: int = Field(5000, ge=10)
    """A UCX peer must present its one-time session token within this, or it is dropped."""

    @model_validator(mode="before")
    @classmethod
    def _layout_from_model(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("model"):
            return data
        from pdpush.model_layout import layout_of

        lay = layout_of(data["model"], chunk_tokens=data.get("chunk_tokens"), dtype=data.get("dtype"),
                        model_id=data.get("model_id"))
        return {**lay.to_dict(), **data}

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.layers, self.kv_heads, self.head_dim, self.dtype, self.chunk_tokens, self.model_id,
                        self.kind, self.kv_scales, tuple(self.windows), self.state_layers, tuple(self.state),
                        self.state_units)

    @property
    def pool_bytes(self) -> int:
        return self.geometry.total_bytes  # KV, the readiness words, the state slots (layout.py)

    def local_socket_path(self) -> Path:
        return Path(self.local_socket) if self.local_socket else runtime_dir() / f"receiver-{self.control_port}.sock"

    @property
    def geometry(self) -> PoolGeometry:
        lay = self.layout
        return PoolGeometry(lay, self.pool_pages, self.pool_shards, self.state_slots if lay.state_layers else 0)

    @model_validator(mode="after")
    def _check_pool(self):
        try:
            check_shards(self.layout, self.pool_shards)
        except ValueError as e:
            raise ValueError(f"pool_shards: {e}") from None
        if self.pool_bytes > (1 << 40):
            raise ValueError(f"pool_pages: pool would be {self.pool_bytes} bytes (> 1 TiB)")
        from pydantic import ValidationError as Invalid

        from pdpush.protocol import LayoutSpec

        try:  # the layout as the HelloAck carries it: one the protocol cannot carry fails here, not at start
            LayoutSpec(**self.layout.to_dict())
        except Invalid as e:
            raise ValueError(f"the layout is outside what the protocol carries: {e}") from None
        if (why := socket_path_error(self.local_socket_path())) is not None:
            raise ValueError(f"local_socket: {why}")
        return self

    @model_validator(mode="after")
    def _check_exposure(self):
        if self.curve_secret_key_file and not self.allowed_senders:
            raise ValueError("allowed_senders: CURVE authentication needs an allowlist of sender public keys")
        if not is_loopback(self.host) and not self.curve_secret_key_file and not self.insecure:
            raise ValueError(
                f"host: refusing to expose the control plane on {self.host!r} without authentication. Either "
                "run `pdpush keygen receiver --dir KEYS` and set curve_secret_key_file and allowed_senders, or "
                "pass --insecure (insecure = true) to accept unauthenticated senders on this network")
        return self


class SenderConfig(_Base):
    metrics_port: int = Field(9711, ge=-1, le=65535)
    """Prometheus /metrics port (0 = any free port, -1 = off)."""
    ingress_socket: str = ""
    """Unix socket for the local prefill engine; default <runtime dir>/sender-<metrics_port>.sock (so that
    senders on one host, which need their own metrics ports anyway, get their own sockets)."""
    staging_bytes: int = Field(1 << 30, ge=staging.MIN_BYTES)
    """Shared staging memory the prefill engine writes layers into: the layers in flight (a layer must fit in
    half of it; docs/layout.md, "Staging: the layers in flight")."""
    default_receiver: str = "tcp://127.0.0.1:5710"
    """Receiver control endpoint used when a request names none."""
    name_recheck_ms: int = Field(30_000, ge=100)
    """How often a receiver named by a host name (``tcp://decode-0.decode:5710``) has its name looked up again:
    where it no longer resolves to the address the sender reached, the receiver moved, and its requests start
    afresh there (docs/operations.md, "Receivers named by host names")."""
    lease_ms: int = Field(30_000, ge=10, le=3_600_000)
    """Lease asked for each request."""
    control_timeout_ms: int = Field(5_000, ge=10)
    """Deadline for each control reply (HelloAck, AllocResponse, CommitAck)."""
    alloc_retry_budget_ms: int = Field(2_000, ge=0)
    """When a receiver answers pool_exhausted, retry (after its retry_after_ms) for at most this long."""
    layer_timeout_ms: int = Field(10_000, ge=10)
    """Deadline for one layer's put+flush."""
    handover_ring_slots: int = Field(256, ge=0, le=65536)
    """Records in each engine connection's hand-over ring, 8 bytes each, in staging (docs/layout.md, "The
    hand-over ring"); an engine that fills it waits for the sender. 0: engines hand layers over by message."""
    checksums: bool = False
    """Send an xxhash checksum of each layer's bytes in LayerDone."""
    completion: Literal["words", "commit"] = "words"
    """How a request completes. ``words``: on the data path, where the receiver agrees (no checksums, no state
    layers): each layer's readiness words, put once its bytes are flushed, tell the receiver, and no Commit
    crosses the wire (2 control messages a request). ``commit``: a Commit after the last layer, and its
    CommitAck (4). Checksums always complete by Commit."""
    curve_secret_key_file: str | None = None
    """This sender's CURVE secret key (``.key_secret`` from ``pdpush keygen``)."""
    receiver_public_key: str | None = None
    """The receivers' CURVE public key (Z85 or a ``.key`` file), for every receiver without its own entry."""
    receiver_keys: dict[str, str] = Field(default_factory=dict)
    """Per-receiver CURVE public keys: control endpoint -> Z85 key or ``.key`` file."""

    @model_validator(mode="after")
    def _check_curve(self):
        if (self.receiver_public_key or self.receiver_keys) and not self.curve_secret_key_file:
            raise ValueError("curve_secret_key_file: receiver keys are set but this sender has no key pair")
        for endpoint in [self.default_receiver, *self.receiver_keys]:
            if (why := endpoint_error(endpoint)) is not None:
                raise ValueError(f"{'default_receiver' if endpoint == self.default_receiver else 'receiver_keys'}: {why}")
        return self

    def ingress_socket_path(self) -> Path:
        return Path(self.ingress_socket) if self.ingress_socket else default_sender_socket(self.metrics_port)

    @model_validator(mode="after")
    def _check_socket(self):
        if (why := socket_path_error(self.ingress_socket_path())) is not None:
            raise ValueError(f"ingress_socket: {why}")
        return self


class DecodeInstance(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    """The decode vLLM instance's base URL (http://host:port)."""
    receiver: str
    """Its receiver's control endpoint (tcp://host:5710): the prefill pushes there, and the router
    subscribes to its chunk-index feed."""
    receiver_public_key: str | None = None
    """The receiver's CURVE public key (Z85 or a ``.key`` file), where it is exposed with CURVE."""

    _key: str | None = PrivateAttr(None)  # the key itself, read at load: a key file replaced in place is another key

    @model_validator(mode="after")
    def _check_addresses(self):
        if (why := url_error(self.url)) is not None:
            raise ValueError(f"url: {why}")
        if (why := endpoint_error(self.receiver)) is not None:
            raise ValueError(f"receiver: {why}")
        if self.receiver_public_key:
            from pdpush import auth

            try:
                self._key = b",".join(auth.load_public_keys(self.receiver_public_key)).decode()
            except (ConfigError, OSError, ValueError):
                self._key = None  # (the router says why when it reads it to subscribe)
        return self


class KvEventsSource(BaseModel):
    """Where a prefill vLLM instance publishes its KV events (its ``--kv-events-config``), as the router
    reaches it."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str
    """Its PUB endpoint (tcp://host:5557)."""
    replay_endpoint: str = ""
    """Its replay endpoint (tcp://host:5558): gaps are filled from it; without one, a gap clears the view."""
    topic: str = ""
    """Its topic (``topic`` in --kv-events-config)."""

    @model_validator(mode="after")
    def _check_endpoints(self):  # (vLLM's own setting binds, tcp://*:5557: the router connects, to a host)
        for name in ("endpoint", "replay_endpoint"):
            if (v := getattr(self, name)) and (why := endpoint_error(v)) is not None:
                raise ValueError(f"{name}: {why.replace('a receiver control endpoint', 'an endpoint to reach')}")
        return self


class RouterConfig(_Settings):
    port: int = Field(8000, ge=0, le=65535)
    """HTTP port of the OpenAI-compatible front (0 = any free port; see ready_file)."""
    prefill: list[str] = Field(default_factory=list)
    """Prefill vLLM instances' base URLs."""
    decode: list[DecodeInstance] = Field(default_factory=list)
    """Decode vLLM instances, each with its receiver."""
    policy: Literal["cache_aware", "round_robin", "cost_model"] = "cache_aware"
    """Placement: ``cache_aware`` puts the decode leg where the held prefix weighs most against load and the
    prefill leg on the least loaded instance; ``round_robin`` takes each in turn; ``cost_model`` predicts
    each (prefill, decode) pair's time to first token (router/costmodel.py) from the prefill engines' own
    caches (``kv_events``), the receivers' pools, queues and learned speeds, and takes the least."""
    ttft_slo_ms: float | None = Field(None, gt=0)
    """With ``cost_model``: a request whose best predicted time to first token is over this is refused at
    once (429 with Retry-After), before any leg runs."""
    kv_events: dict[str, KvEventsSource] = Field(default_factory=dict)
    """By prefill URL: where that instance publishes its vLLM KV events (``cost_model`` follows its prefix
    cache from them; an instance with none is placed by load alone)."""
    prefill_tokens_per_s: float = Field(20_000.0, gt=0)
    """``cost_model``: a prefill instance's speed until the router has measured it."""
    push_gbps: float = Field(5.0, gt=0)
    """``cost_model``: a receiver's push bandwidth until the router has measured it."""
    decode_wait_ms_per_request: float = Field(2.0, ge=0)
    """``cost_model``: what each request in flight on a decode instance adds to a new one's wait."""
    local_tokens_per_s: float = Field(0.0, ge=0)
    """``cost_model``: a decode instance's own prefill speed, for requests it may compute itself from the
    prefix its receiver holds (conditional disaggregation as a candidate of the model); 0 = never."""
    concurrent_legs: bool | Literal["auto"] = "auto"
    """Send the prefill and decode legs at once (the decode loads each layer as it lands), rather than the
    decode leg after the prefill's answer: ``true``, ``false``, or ``auto``, at once where the prefill instance
    has no leg of this router in flight (router/legs.py ``at_once``: behind a queue, the decode engine could wait
    longer than its ``push_wait_s`` for the push to begin, and recompute). At once, the first token came about 0.76x
    as late; behind a queue, later (docs/bench/fleet.md)."""
    prefill_leg_linger_s: float = Field(1.0, ge=0)
    """A prefill leg sent at once with its decode leg that is still unanswered this long after the decode's answer
    ended is cancelled: its engine drops the request (vLLM aborts what its client hung up on). The decode loaded
    the push or recomputed the prompt by then, so the leg would compute it for nobody; typically it was queued
    past the decode's ``push_wait_s``. A push already begun goes on all the same: a request is aborted between
    steps, a push is handed to the sender within the step that computes its prompt's last chunk, and the sender
    commits it whatever happens to the request after. ``inf``: never."""
    local_prefill_max_tokens: int = Field(0, ge=0)
    """Conditional disaggregation: when the chosen decode instance's receiver holds all but at most
    this many prompt tokens, skip the prefill instance; the decode instance loads the held chunks
    from its receiver and computes the rest. 0 = off."""
    tokenizer: str = "engine"
    """How prompt token ids are found for chunk keys: ``engine`` asks a prefill instance's /tokenize
    (exactly what it will see, chat template included); a directory loads that tokenizer here."""
    weight_load: float = Field(1.0, ge=0)
    """Placement score: weight of requests in flight (placement.py)."""
    weight_pool: float = Field(0.5, ge=0)
    """Placement score: weight of the receiver's used pool pages."""
    max_inflight: int = Field(16, ge=1)
    """Requests in flight per instance; when every instance has this many, the router answers 503."""
    max_imbalance: int = Field(4, ge=0)
    """A decode instance takes at most this many more requests in flight than the least-loaded one,
    whatever it holds (keeps a hot prefix from overloading one node)."""
    retry_after_s: int = Field(1, ge=1)
    """Retry-After of a 503."""
    max_body_bytes: int = Field(8 << 20, ge=1024)
    """Largest request body accepted (413 above it)."""
    upstream_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for an upstream's next bytes: a leg's whole answer where it is not streamed (vLLM sends its
    headers once done), between chunks where it is. A decode leg past it answers 504; it is not run again
    elsewhere (its engine is still at it)."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Deadline to connect to an upstream."""
    max_upstream_connections: int = Field(1024, ge=1)
    """Connections to the engines the legs (and /tokenize) hold at once, every engine together: a stream holds one
    for its whole answer. With all of them in use a request waits connect_timeout_s for one, then answers 503 (busy,
    Retry-After); nothing is counted against an engine for it, and health checks have connections of their own.
    Raise it above max_inflight x instances where that is higher."""
    client_write_timeout_s: float = Field(60.0, gt=0)
    """Longest wait for a client to take the next part of a streamed answer (its socket's buffers full): past it, its
    connection and the decode leg's are broken off (the engine aborts the request). A request's body must come whole
    within it too (else 408)."""
    health_interval_s: float = Field(1.0, gt=0)
    """How often every instance's /health is checked."""
    eject_after: int = Field(2, ge=1)
    """Failed checks in a row that eject an instance (a refused connection ejects at once)."""
    index_silence_s: float = Field(3.5, ge=2.0, le=3600)
    """A receiver feed unheard for this long is distrusted (and re-subscribed). At least two of the receivers' 1 s
    heartbeats: under one, every feed went silent between beats, and its socket was made again and again (each
    renewal a new subscriber at the receiver, which keeps the old ones for 15 s)."""
    name_recheck_s: float = Field(30.0, gt=0)
    """A receiver or KV-events publisher named by a host name is reached at the address the name gave; the name is
    looked up again this often, and one that moved (a pod rescheduled) is followed to its new address."""
    api_key_file: str | None = None
    """If set, clients must send ``Authorization: Bearer <the file's content>``."""
    push_id_prefix: str = ""
    """Namespace of the push ids this router makes (default: ``rt-`` and 8 random hex digits)."""
    curve_secret_key_file: str | None = None
    """This router's CURVE secret key, for receivers exposed with CURVE (add its public key to their
    allowed_readers: it subscribes to their chunk-index feeds, withdraws pushes that will not come, and can do
    nothing else)."""

    @model_validator(mode="after")
    def _check_router(self):
        if not self.prefill:
            raise ValueError("prefill: give at least one prefill instance URL")
        for u in self.prefill:
            if (why := url_error(u)) is not None:
                raise ValueError(f"prefill: {why}")
        if not self.decode:
            raise ValueError("decode: give at least one decode instance (url and receiver)")
        if any(d.receiver_public_key for d in self.decode) and not self.curve_secret_key_file:
            raise ValueError("curve_secret_key_file: a receiver key is set but this router has no key pair")
        unknown = [u for u in self.kv_events if u not in self.prefill]
        if unknown:
            raise ValueError(f"kv_events: {unknown[0]!r} is not one of the prefill instances {self.prefill}")
        if self.ttft_slo_ms is not None and self.policy != "cost_model":
            raise ValueError("ttft_slo_ms: refusing by predicted time to first token needs policy = \"cost_model\"")
        return self


def load(cls: type[_Settings], path: str | os.PathLike | None = None, **overrides: Any):
    """Build a config; a bad file or value raises ConfigError naming the field."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    p = Path(path) if path else None
    if p is not None and not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    token = _toml_path.set(p)
    try:
        cfg = cls(**overrides)
        cfg._source = (p, overrides)
        return cfg
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            field = ".".join(str(x) for x in err.get("loc", ())) or "<config>"
            msgs.append(f"{field}: {err.get('msg')}")
        where = f" in {p}" if p else ""
        raise ConfigError(f"invalid {cls.__name__}{where}: " + "; ".join(msgs)) from None
    except ValueError as e:  # TOML syntax errors, unparsable PDPUSH_* values
        raise ConfigError(f"invalid {cls.__name__}{f' ({p})' if p else ''}: {e}") from None
    finally:
        _toml_path.reset(token)


def read_receiver(path: str | os.PathLike) -> ReceiverConfig:
    """A receiver's config read to find the daemon (its sockets, its layout), not to serve: its exposure is not
    judged here. A receiver exposed with ``--insecure`` or ``PDPUSH_INSECURE`` in its own environment has a file
    that its engines' connector, ``pdpush status`` and ``doctor`` must still read (the connector refused it, and
    the decode engine would not start)."""
    return load(ReceiverConfig, path, insecure=True)


def reload(cfg: _Settings):
    """``cfg`` built again as ``load`` built it: its file as it is now, the environment, the same overrides (flags).
    Raises ConfigError as ``load`` does, or where ``cfg`` came from no file (nothing to read again)."""
    if cfg._source is None or cfg._source[0] is None:
        raise ConfigError("no config file to read again (started without --config)")
    path, overrides = cfg._source
    return load(type(cfg), path, **overrides)
