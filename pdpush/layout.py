"""KV layout: the byte formulas of every KV shape pdpush moves (the KV codec's geometry).

One description per model (``KVLayout``): the kind of KV, the element type, the tokens per page
and the per-token layout. A page (one chunk of one layer) is, for every kind::

    page[H, C, T, D]      # H "heads", C components, T token rows, D elements per row

    kind "mha" (MHA/GQA attention):  H = kv_heads, C = 2 (K rows, then V rows), D = head_dim
    kind "mla" (an MLA latent):       H = 1,        C = 1, D = kv_lora_rank + qk_rope_head_dim

Head-major so that any contiguous run of heads (a tensor-parallel rank's share) is one contiguous
byte range of a page; it is also CPU_ATTN's (block, head) tile order, and for MLA the latent's
token-major rows. A partial last chunk takes a whole page; only its first ``last_chunk_tokens``
token rows of each (head, component) are meaningful.

Element types (``DTYPES``): 16- and 32-bit floats and fp8 (e4m3fn, e5m2, and ROCm's e4m3fnuz, whose
bytes mean other values than e4m3fn's, so the two never share a fingerprint), one byte per element;
bytes move as they are. ``kv_scales`` says where quantization scales live: ``none`` (no scales),
``static`` (an fp8 cache with one k/v scale per layer, held by the engines' attention layers; the
vLLM connector moves them only where they are all 1.0 and refuses other values at start-up, by
layer: nothing yet compares two sides' scales).

**Shares are byte fractions of a page.** Rank ``r`` of ``tp`` prefill ranks pushes bytes
``[r * page_bytes / tp, (r + 1) * page_bytes / tp)`` of every page. Where ``tp`` divides ``H``
that is its own heads; where ``tp`` is a multiple of ``H`` (vLLM replicates heads; MLA's one latent
is replicated on every rank) the ``tp / H`` ranks holding a head each push one part of its bytes,
so every rank sends and no byte is sent twice.

Pool (``PoolGeometry``): ``S = shards`` (a receiver setting) splits each page's bytes into S
slices, and a layer's region is shard-major::

    pool[layers, S, pages, page_bytes / S]
    offset(layer, shard, page) = ((layer * S + shard) * pages + page) * page_bytes / S

so shard ``s`` of layer ``l`` over a run of consecutive pages is one contiguous byte range. With
S = 1 this is ``pool[layers, pages, page_bytes]``. S must divide ``page_bytes``; where it divides
``H`` a shard is whole heads (``heads_aligned``), which decode ranks read as zero-copy views.

Staging (``StagingShares``) for a request pushed by ``tp`` prefill ranks into a pool of S shards,
with ``U = lcm(tp, S)`` byte units of ``page_bytes / U`` and ``n`` new pages::

    staging[layers, U, n, page_bytes / U]
    rank r's share of layer l: units [r*U/tp, (r+1)*U/tp), one contiguous block of
    n * page_bytes / tp bytes at l * n * page_bytes + r * n * page_bytes / tp

A unit that is a whole shard (U = S) goes in one put per page run; a unit that is part of a shard
(U > S) in one put per page. So a rank's puts per layer are ``runs * U / tp`` when U = S, which is
one per page run when tp = S: set the receiver's ``shards`` to the prefill TP.

After the KV comes the readiness area: one 8-byte word per (layer, page),
``ready[layers, pages]`` (u64, native order), at byte offset
``layers * pages * page_bytes``. When layer ``l`` of a request has landed (every
rank's data puts flushed, which means remote completion), the sender puts the
request's lease id into ``ready[l, p]`` for each of its new pages ``p``. A
decode client reading its zero-copy mapping sees a layer ready when every word
of its new pages equals its lease id. Lease ids are random 64-bit values, never 0
(1 in 2**64 that two match), so a zeroed word or a late write from an older lease never
reads as ready, and nobody who saw one lease id can set words for another ahead.

Chunk keys and the fingerprint describe the model's whole KV (every field of the description,
all heads), not a rank's or a pool's split, so prefix reuse works across TP configurations, and
two sides that differ in any field never share a chunk.

Pure logic: imports no torch, zmq or UCX (``kvcodec.py`` moves the bytes these formulas place).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import xxhash


class ElementType(NamedTuple):
    bytes: int
    numpy: str   # how numpy holds it (bfloat16 and fp8 have no numpy type: raw integers)
    torch: str   # the torch dtype's name


DTYPES: dict[str, ElementType] = {
    "float16": ElementType(2, "float16", "float16"),
    "bfloat16": ElementType(2, "uint16", "bfloat16"),
    "float32": ElementType(4, "float32", "float32"),
    "float8_e4m3fn": ElementType(1, "uint8", "float8_e4m3fn"),
    "float8_e5m2": ElementType(1, "uint8", "float8_e5m2"),
    "float8_e4m3fnuz": ElementType(1, "uint8", "float8_e4m3fnuz"),  # ROCm (MI300): other bytes for the same values
}
DType = Literal["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"]
Kind = Literal["mha", "mla"]
KvScales = Literal["none", "static"]
KINDS: dict[str, int] = {"mha": 2, "mla": 1}  # kind -> components per head
# the names engines and configs use for an element type
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32",
                 "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
                 "fp8_e5m2": "float8_e5m2"}
LAYOUT_VERSION = 3
READY_WORD = 8  # bytes of one readiness word (a lease id)


def dtype_name(name: str) -> str:
    """The canonical element type of ``name`` (``torch.bfloat16``, ``bf16``, ``fp8_e4m3``, ...)."""
    n = str(name).removeprefix("torch.")
    n = DTYPE_ALIASES.get(n, n)
    if n not in DTYPES:
        raise ValueError(f"element type {name!r} is not one pdpush moves; supported: {sorted(DTYPES)}")
    return n


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one model's KV cache as pdpush moves it (module doc)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: DType
    chunk_tokens: int
    model_id: str = "default"
    kind: Kind = "mha"
    kv_scales: KvScales = "none"
    # per layer, the sliding window in tokens (0: full attention); () when every layer is full
    windows: tuple[int, ...] = ()
    # recurrent state (GDN, Mamba2): layers of state beside the attention ``layers``, each one state page
    # per request made of ``state`` segments, split into ``state_units`` units for tensor parallelism
    state_layers: int = 0
    state: tuple[StateSegment, ...] = ()
    state_units: int = 1

    def __post_init__(self) -> None:
        w = tuple(int(x) for x in self.windows)
        if any(x < 0 for x in w) or (w and len(w) != self.layers):
            raise ValueError(f"KVLayout.windows must give one window >= 0 per layer ({self.layers}), got {w}")
        object.__setattr__(self, "windows", w if any(w) else ())
        segs = tuple(StateSegment(str(t), dtype_name(d), tuple(int(x) for x in sh), int(a), bool(r))
                     for t, d, sh, a, r in self.state)
        object.__setattr__(self, "state", segs)
        if bool(self.state_layers) != bool(segs) or self.state_layers < 0 or self.state_units < 1:
            raise ValueError(f"KVLayout: state_layers={self.state_layers} needs state segments, and they need it "
                             f"(got {len(segs)}); state_units={self.state_units} must be positive")
        for s in segs:
            if not -len(s.shape) <= s.axis < len(s.shape) or min(s.shape, default=0) <= 0 or (
                    not s.replicated and s.shape[s.axis] % self.state_units):
                raise ValueError(f"state segment {s}: its axis must be one of its (positive) dimensions, split into "
                                 f"state_units={self.state_units} equal parts")
        for name in ("layers", "kv_heads", "head_dim", "chunk_tokens"):
            if getattr(self, name) <= 0 and not (name == "layers" and self.state_layers and self.layers == 0):
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kind not in KINDS:
            raise ValueError(f"KVLayout.kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        if self.kind == "mla" and self.kv_heads != 1:
            raise ValueError(f"an MLA latent is one head (kv_heads = 1), got kv_heads={self.kv_heads}")
        if self.kv_scales not in ("none", "static"):
            raise ValueError(f"KVLayout.kv_scales must be 'none' or 'static', got {self.kv_scales!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype].bytes

    @property
    def components(self) -> int:
        """C: rows per (head, token) in a page: K and V (2), or one MLA latent (1)."""
        return KINDS[self.kind]

    @property
    def row_bytes(self) -> int:
        """Bytes of one (head, component, token) row: ``D * B``."""
        return self.head_dim * self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer, every head and component."""
        return self.components * self.kv_heads * self.row_bytes

    @property
    def page_bytes(self) -> int:
        return self.chunk_tokens * self.token_bytes

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        return (self.kv_heads, self.components, self.chunk_tokens, self.head_dim)

    @property
    def head_page_bytes(self) -> int:
        """Bytes of one head of one page (its C components' T rows each)."""
        return self.components * self.chunk_tokens * self.row_bytes

    def kv_bytes(self, pages: int) -> int:
        """Bytes of the KV part of a pool of ``pages`` pages (all layers)."""
        return self.layers * pages * self.page_bytes

    def ready_offset(self, layer: int, page: int, pages: int) -> int:
        """Byte offset of the readiness word of (``layer``, ``page``) in a pool of ``pages`` pages."""
        return self.kv_bytes(pages) + (layer * pages + page) * READY_WORD

    def region_bytes(self, pages: int) -> int:
        """The whole pool region: KV, then the readiness words."""
        return self.kv_bytes(pages) + self.layers * pages * READY_WORD

    def num_chunks(self, tokens: int) -> int:
        return -(-tokens // self.chunk_tokens)

    def last_chunk_tokens(self, tokens: int) -> int:
        r = tokens % self.chunk_tokens
        return r if r else self.chunk_tokens

    def fingerprint(self) -> str:
        """Stable id of everything that must match for KV bytes to mean the same."""
        s = (f"pdpush-layout-v{LAYOUT_VERSION}|{self.model_id}|{self.kind}|L{self.layers}|H{self.kv_heads}"
             f"|D{self.head_dim}|{self.dtype}|scales={self.kv_scales}|T{self.chunk_tokens}|page=[H,C,T,D]")
        if self.windows:  # a layout with sliding-window layers (an all-full one keeps its fingerprint)
            s += "|windows=" + ",".join(map(str, self.windows))
        if self.state_layers:
            s += f"|state={self.state_layers}x{self.state_units}:" + ";".join(
                f"{g.tensor},{g.dtype},{'x'.join(map(str, g.shape))},{g.axis},{int(g.replicated)}" for g in self.state)
        return xxhash.xxh3_64_hexdigest(s.encode())

    # ---- recurrent state: one page per state layer per request (module doc) ----
    @property
    def state_unit_bytes(self) -> int:
        return sum(s.unit_bytes(self.state_units) for s in self.state)

    @property
    def state_page_bytes(self) -> int:
        """One state layer's page: ``state_units`` units, each every segment's part of that unit."""
        return self.state_units * self.state_unit_bytes

    @property
    def state_slot_bytes(self) -> int:
        """A request's state: every state layer's page, ``[state_layers, units, unit bytes]``."""
        return self.state_layers * self.state_page_bytes

    @property
    def push_layers(self) -> int:
        """What a push hands over and lands, by index: the attention layers ``[0, layers)``, then each state
        layer ``s`` as ``layers + s``."""
        return self.layers + self.state_layers

    def is_state(self, layer: int) -> bool:
        return layer >= self.layers

    def check_state_tp(self, tp: int) -> None:
        """A TP whose every rank holds whole units of the state: it divides ``state_units``."""
        if self.state_layers and self.state_units % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide the state's {self.state_units} units "
                             "(its heads and groups): each rank must hold whole units")

    # ---- layer groups: the layers that keep the same tokens (full attention, or one sliding window) ----
    @functools.cached_property
    def groups(self) -> tuple[Group, ...]:
        """Group 0 is full attention where any layer is; then one group per window, smallest first."""
        w = self.windows or (0,) * self.layers
        return tuple(Group(g, win, tuple(la for la in range(self.layers) if w[la] == win))
                     for g, win in enumerate(sorted(set(w), key=lambda x: (x != 0, x))))

    def group_of(self, layer: int) -> Group:
        return self._group_of[layer]

    @functools.cached_property
    def _group_of(self) -> tuple[Group, ...]:
        out: list = [None] * self.layers
        for g in self.groups:
            for la in g.layers:
                out[la] = g
        return tuple(out)

    @functools.cached_property
    def local_index(self) -> tuple[int, ...]:
        """Each layer's position among its group's layers."""
        return tuple(self._group_of[la].layers.index(la) for la in range(self.layers))

    def group_chunks(self, group: Group, tokens: int) -> range:
        """The chunks of a ``tokens``-token prompt that ``group``'s layers need on decode: every chunk
        for full attention; for a window of W, those holding the prompt's last W tokens. A token at p
        attends to [p - W + 1, p] (vLLM's and transformers' window), and the decode's first step
        recomputes the last prompt token, N - 1, so it reads from N - W on. vLLM frees a block only
        once all of it is below that, so a prefill engine still holds every token gathered here."""
        n = self.num_chunks(tokens)
        if not group.window:
            return range(n)
        return range(max(0, tokens - group.window) // self.chunk_tokens, n)

    def item_count(self, tokens: int) -> int:
        """How many items ``items`` lists, without listing them."""
        return sum(len(self.group_chunks(g, tokens)) for g in self.groups)

    def items(self, tokens: int) -> list[tuple[int, int]]:
        """A request's items, (group, chunk) in order: group 0's chunks, then group 1's, ... Each item
        is one page of every layer of its group; the pool, the index and the wire count items."""
        return [(g.index, c) for g in self.groups for c in self.group_chunks(g, tokens)]

    def item_keys(self, keys: list[bytes], tokens: int) -> list[bytes]:
        """The items' index keys: group 0's are the chunk keys; another group's are derived from them
        and the group's window, so holding is per (chunk, group)."""
        out = []
        for g in self.groups:
            for c in self.group_chunks(g, tokens):
                out.append(keys[c] if g.index == 0 else
                           xxhash.xxh3_128(keys[c] + f"|window={g.window}".encode()).digest())
        return out

    def to_dict(self) -> dict:
        d = {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
             "dtype": self.dtype, "chunk_tokens": self.chunk_tokens, "model_id": self.model_id,
             "kind": self.kind, "kv_scales": self.kv_scales}
        if self.windows:
            d["windows"] = list(self.windows)
        if self.state_layers:
            d.update(state_layers=self.state_layers, state_units=self.state_units,
                     state=[[s.tensor, s.dtype, list(s.shape), s.axis, s.replicated] for s in self.state])
        return d

    def describe(self) -> str:
        """Every field, for errors that name both sides of a mismatch."""
        return " ".join(f"{k}={v}" for k, v in self.to_dict().items())

    def mismatch(self, other: KVLayout) -> str:
        """The fields in which ``other`` differs, as ``name: mine vs theirs`` ('' if none)."""
        a, b = self.to_dict(), other.to_dict()
        return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in dict.fromkeys([*a, *b])
                         if a.get(k) != b.get(k))


class StateSegment(NamedTuple):
    """One part of a state layer's tensors, for the whole model (every rank's): ``tensor`` (the engine's
    tensor it is part of: conv or ssm), its element type, its ``shape``, and the ``axis`` along which the
    tensor's parts are laid side by side in an engine and tensor parallelism splits it (``replicated``: every
    rank holds all of it, as Mamba2's B and C where its groups do not split)."""

    tensor: str
    dtype: str
    shape: tuple[int, ...]
    axis: int
    replicated: bool = False

    def unit_shape(self, units: int) -> tuple[int, ...]:
        """Its part in one of ``units`` units (all of it, replicated)."""
        if self.replicated:
            return self.shape
        sh = list(self.shape)
        sh[self.axis] //= units
        return tuple(sh)

    def unit_bytes(self, units: int) -> int:
        return math.prod(self.unit_shape(units)) * DTYPES[self.dtype].bytes


class Group(NamedTuple):
    """Layers that keep the same tokens: full attention (window 0), or one sliding window."""

    index: int
    window: int
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        return "sliding" if self.window else "full"


EXTRA_SEED = 0x7064707573686578  # a chunk with an extra is hashed with this seed (chunk_keys)


def chunk_keys(token_ids: list[int] | tuple[int, ...], layout: KVLayout,
               extra: Sequence[bytes] = ()) -> list[bytes]:
    """Hash chain over token ids plus the layout fingerprint (16-byte keys).

    key_i = xxh3_128(key_{i-1} || tokens of chunk i as little-endian int64).
    Because each key covers its whole prefix, P and D derive identical keys
    from identical prompts, and a held key implies its whole prefix matches.
    Never uses Python's ``hash()`` (salted per process).

    ``extra[i]``: what besides its tokens chunk i's KV depends on (a LoRA adapter, an image's hash, a
    tenant's salt: the vLLM connector's ``extra_keys.chunk_extras``). Such a chunk is hashed apart, with
    seed ``EXTRA_SEED``: ``xxh3_128(key_{i-1} || len(extra[i]) as u64 || extra[i] || tokens)``, so that no
    token ids, whatever their values, hash like an extra. An empty one, or one past the list, adds nothing
    (the key is the token-only one). Through the chain, an extra in chunk i is in every key from i on.
    """
    import struct

    prev = bytes.fromhex(layout.fingerprint()).rjust(16, b"\0")
    keys: list[bytes] = []
    T = layout.chunk_tokens
    for i, start in enumerate(range(0, len(token_ids), T)):
        chunk = token_ids[start:start + T]
        if i < len(extra) and extra[i]:
            h = xxhash.xxh3_128(prev, seed=EXTRA_SEED)
            h.update(struct.pack("<Q", len(extra[i])) + extra[i])
        else:
            h = xxhash.xxh3_128(prev)
        h.update(struct.pack(f"<{len(chunk)}q", *chunk))
        prev = h.digest()
        keys.append(prev)
    return keys


def runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """Split a page list into maximal runs of consecutive page ids.

    Returns (index into ``pages`` where the run starts, first page, length).
    """
    out: list[tuple[int, int, int]] = []
    i = 0
    n = len(pages)
    while i < n:
        j = i + 1
        while j < n and pages[j] == pages[j - 1] + 1:
            j += 1
        out.append((i, pages[i], j - i))
        i = j
    return out


def combine_digests(digests: list[int]) -> int:
    """A layer's checksum: xxh3-64 over its ranks' share digests (each xxh3-64 of the share's bytes in
    staging order, ``StagingShares.ranges``), little-endian, in rank order."""
    return xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in digests))


def rank_heads(kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """The KV heads [h0, h1) that rank ``rank`` of ``tp`` holds, as vLLM splits them: ``kv_heads / tp``
    each, or, where tp exceeds kv_heads, one head replicated on ``tp / kv_heads`` ranks (an MLA latent,
    one head, is on every rank)."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} out of range for tp={tp}")
    if kv_heads % tp == 0:
        per = kv_heads // tp
        return rank * per, (rank + 1) * per
    if tp % kv_heads == 0:
        h = rank // (tp // kv_heads)
        return h, h + 1
    raise ValueError(f"tensor parallel size {tp} neither divides nor is a multiple of the model's "
                     f"{kv_heads} KV heads")


def check_prefill_tp(layout: KVLayout, tp: int, shards: int = 1) -> None:
    """A prefill TP pdpush can push from into a pool of ``shards``: each rank's share is ``page_bytes / tp``
    (its own heads, or its part of a replicated head's bytes), in units of ``page_bytes / lcm(tp, shards)``."""
    if tp < 1:
        raise ValueError(f"prefill tensor_parallel_size must be positive, got {tp}")
    rank_heads(layout.kv_heads, tp, 0)
    u = math.lcm(tp, shards)
    if layout.page_bytes % u:
        raise ValueError(f"a page of {layout.page_bytes} bytes does not split into lcm(tp={tp}, pool shards="
                         f"{shards}) = {u} equal parts")


@dataclass(frozen=True)
class PoolGeometry:
    """Where layer ``l``, shard ``s``, page ``p`` lies in a receiver's pool (module doc)."""

    layout: KVLayout
    pages: int
    shards: int = 1
    state_slots: int = 0  # requests' state (layout.state_slot_bytes each), after the readiness words
    shard_bytes: int = field(init=False)  # one shard of one page
    layer_bytes: int = field(init=False)  # one layer of the whole pool: offset(l + 1, s, p) - offset(l, s, p)

    def __post_init__(self) -> None:
        check_shards(self.layout, self.shards)
        object.__setattr__(self, "shard_bytes", self.layout.page_bytes // self.shards)
        object.__setattr__(self, "layer_bytes", self.pages * self.layout.page_bytes)

    def offset(self, layer: int, shard: int, page: int) -> int:
        return ((layer * self.shards + shard) * self.pages + page) * self.shard_bytes

    @property
    def kv_bytes(self) -> int:
        return self.layout.kv_bytes(self.pages)

    def ready_offset(self, layer: int, page: int) -> int:
        return self.layout.ready_offset(layer, page, self.pages)

    @property
    def region_bytes(self) -> int:
        return self.layout.region_bytes(self.pages)

    @property
    def state_offset(self) -> int:
        """Where the state slots start: after the readiness words, 64-byte aligned."""
        return -(-self.region_bytes // 64) * 64

    def state_at(self, slot: int) -> int:
        """Offset of state slot ``slot``: ``[state_layers, units, unit bytes]`` (layout.state_slot_bytes)."""
        return self.state_offset + slot * self.layout.state_slot_bytes

    @property
    def total_bytes(self) -> int:
        """The pool's whole mapping: KV, readiness words, state slots."""
        return self.state_at(self.state_slots) if self.state_slots else self.region_bytes

    @property
    def heads_aligned(self) -> bool:
        """Each shard is whole heads (S divides H): a rank's heads are views of one shard or several."""
        return self.layout.kv_heads % self.shards == 0

    def heads(self, h0: int, h1: int) -> list[tuple[int, int, int]]:
        """Heads [h0, h1) by shard: (shard, first head within the shard, heads); ``heads_aligned`` only."""
        if not self.heads_aligned:
            raise ValueError(f"pool shards={self.shards} split heads ({self.layout.kv_heads} KV heads): read pages")
        per = self.layout.kv_heads // self.shards
        out = []
        h = h0
        while h < h1:
            s, j = divmod(h, per)
            k = min(h1 - h, per - j)
            out.append((s, j, k))
            h += k
        return out


def check_shards(layout: KVLayout, shards: int) -> None:
    """Pool shards split a page's bytes: whole heads where S divides H; for a layout of fewer heads than
    S (an MLA latent, or one KV head), equal byte slices of each page."""
    if shards < 1 or layout.page_bytes % shards or (layout.kv_heads % shards and shards % layout.kv_heads):
        raise ValueError(f"pool shards={shards} must divide kv_heads={layout.kv_heads}, or be a multiple of it "
                         f"that divides the page ({layout.page_bytes} bytes)")


@dataclass(frozen=True)
class StagingShares:
    """A request's staging and its puts, for ``tp`` prefill ranks into a pool of ``shards`` (module doc)."""

    layout: KVLayout
    tp: int
    shards: int
    n_new: int
    units: int = field(init=False)  # lcm(tp, shards)
    layer_bytes: int = field(init=False)  # the request's new pages of one layer
    share_bytes: int = field(init=False)  # one rank's share of one layer
    unit_bytes: int = field(init=False)  # one unit of one page

    def __post_init__(self) -> None:
        check_shards(self.layout, self.shards)
        check_prefill_tp(self.layout, self.tp, self.shards)
        object.__setattr__(self, "units", math.lcm(self.tp, self.shards))
        object.__setattr__(self, "layer_bytes", self.n_new * self.layout.page_bytes)
        object.__setattr__(self, "share_bytes", self.layer_bytes // self.tp)
        object.__setattr__(self, "unit_bytes", self.layout.page_bytes // self.units)

    @property
    def kv_bytes(self) -> int:
        return self.layout.layers * self.layer_bytes

    @property
    def heads_aligned(self) -> bool:
        """Each unit is whole heads (U divides H): staging is ``[U, n, H/U, C, T, D]``."""
        return self.layout.kv_heads % self.units == 0

    def share_offset(self, layer: int, rank: int) -> int:
        """Offset of rank ``rank``'s share of ``layer`` from the request's staging start."""
        return layer * self.layer_bytes + rank * self.share_bytes

    def share_shape(self) -> tuple[int, ...]:
        """A rank's share as bytes: (units of the rank, new pages, bytes of one unit of one page)."""
        return (self.units // self.tp, self.n_new, self.unit_bytes)

    def share_span(self, rank: int) -> tuple[int, int]:
        """The bytes [b0, b1) of a page that rank ``rank`` pushes, counted from the start of the page
        bytes that rank holds (its heads, ``rank_heads``)."""
        lay = self.layout
        h0, _ = rank_heads(lay.kv_heads, self.tp, rank)
        b0 = rank * lay.page_bytes // self.tp - h0 * lay.head_page_bytes
        return b0, b0 + lay.page_bytes // self.tp

    def puts(self, runs: list[tuple[int, int, int]]) -> int:
        """Puts of one rank's share of one layer."""
        per_shard = self.units // self.shards
        return self.units // self.tp * (len(runs) if per_shard == 1 else sum(n for _, _, n in runs))

    def ranges(self, layer: int, rank: int, runs: list[tuple[int, int, int]],
               pool: PoolGeometry) -> list[tuple[int, int, int]]:
        """Rank ``rank``'s share of ``layer`` as (staging offset, pool offset, bytes), in staging order
        (so their pool bytes, read in this order, are the share's bytes); ``runs`` are the request's
        (new-page index, first pool page, pages). Layer ``l``'s ranges are layer 0's shifted by
        ``l * layer_bytes`` in staging and ``l * pool.layer_bytes`` in the pool."""
        U = self.units
        per_shard = U // self.shards  # units in a shard
        unit_page = self.layout.page_bytes // U  # one unit of one page
        out: list[tuple[int, int, int]] = []
        src = self.share_offset(layer, rank)
        for u in range(rank * U // self.tp, (rank + 1) * U // self.tp):
            s, j = divmod(u, per_shard)
            for idx, page, n in runs:
                if per_shard == 1:  # the unit is the shard: the run is contiguous in the pool
                    out.append((src + idx * unit_page, pool.offset(layer, s, page), n * unit_page))
                else:
                    out.extend((src + (idx + i) * unit_page, pool.offset(layer, s, page + i) + j * unit_page,
                                unit_page) for i in range(n))
            src += self.n_new * unit_page
        return out
