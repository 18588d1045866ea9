"""KV layout: byte sizes, offsets, fingerprints, chunk keys, page runs and TP shares.

Canonical in-page layout (one page = one chunk of one layer), head-major::

    page[kv_heads, 2, chunk_tokens, head_dim]   # per head: K rows, then V rows

Head-major so that any contiguous run of heads (a tensor-parallel rank's share)
is one contiguous byte range of a page. It is also CPU_ATTN's (block, head)
tile order. A partial last chunk takes a whole page; only its first
``last_chunk_tokens`` token rows of each head are meaningful.

Pool (``PoolGeometry``): ``S = shards`` (a receiver setting, a divisor of
``kv_heads``) splits each page into S slices of ``H/S`` heads, and a layer's
region is shard-major::

    pool[layers, S, pages, H/S, 2, T, D]
    offset(layer, shard, page) = ((layer * S + shard) * pages + page) * page_bytes / S

so shard ``s`` of layer ``l`` over a run of consecutive pages is one contiguous
byte range. With S = 1 this is ``pool[layers, pages, page_bytes]``.

Staging (``StagingShares``) for a request pushed by ``tp`` prefill ranks into a
pool of S shards, with ``U = lcm(tp, S)`` head units of ``H/U`` heads and
``n`` new pages::

    staging[layers, U, n, H/U, 2, T, D]
    rank r's share of layer l: units [r*U/tp, (r+1)*U/tp), one contiguous block of
    n * page_bytes / tp bytes at l * n * page_bytes + r * n * page_bytes / tp

A unit that is a whole shard (U = S) goes in one put per page run; a unit that
is part of a shard (U > S) in one put per page. So a rank's puts per layer are
``runs * U / tp`` when U = S, which is one per page run when tp = S: set the
receiver's ``shards`` to the prefill TP.

After the KV comes the readiness area: one 8-byte word per (layer, page),
``ready[layers, pages]`` (u64, native order), at byte offset
``layers * pages * page_bytes``. When layer ``l`` of a request has landed (every
rank's data puts flushed, which means remote completion), the sender puts the
request's lease id into ``ready[l, p]`` for each of its new pages ``p``. A
decode client reading its zero-copy mapping sees a layer ready when every word
of its new pages equals its lease id. Lease ids are unique and never 0, so a
zeroed word or a late write from an older lease never reads as ready.

Chunk keys and the fingerprint describe the model's whole KV (all heads), not
a rank's or a pool's split, so prefix reuse works across TP configurations.

Pure logic: imports no torch, zmq or ucxx (numpy only where asked for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import xxhash

DType = Literal["float16", "bfloat16", "float32"]
DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
LAYOUT_VERSION = 2
READY_WORD = 8  # bytes of one readiness word (a lease id)


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one model's KV cache as pdpush moves it."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: DType
    chunk_tokens: int
    model_id: str = "default"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer, K and V together."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def page_bytes(self) -> int:
        return self.chunk_tokens * self.token_bytes

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        return (self.kv_heads, 2, self.chunk_tokens, self.head_dim)

    @property
    def head_page_bytes(self) -> int:
        """Bytes of one head of one page (its K rows, then its V rows)."""
        return 2 * self.chunk_tokens * self.head_dim * self.dtype_bytes

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
        s = (f"pdpush-layout-v{LAYOUT_VERSION}|{self.model_id}|L{self.layers}|H{self.kv_heads}"
             f"|D{self.head_dim}|{self.dtype}|T{self.chunk_tokens}|page=[H,2,T,D]")
        return xxhash.xxh3_64_hexdigest(s.encode())

    def to_dict(self) -> dict:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "dtype": self.dtype, "chunk_tokens": self.chunk_tokens, "model_id": self.model_id}


def chunk_keys(token_ids: list[int] | tuple[int, ...], layout: KVLayout) -> list[bytes]:
    """Hash chain over token ids plus the layout fingerprint (16-byte keys).

    key_i = xxh3_128(key_{i-1} || tokens of chunk i as little-endian int64).
    Because each key covers its whole prefix, P and D derive identical keys
    from identical prompts, and a held key implies its whole prefix matches.
    Never uses Python's ``hash()`` (salted per process).
    """
    import struct

    prev = bytes.fromhex(layout.fingerprint()).rjust(16, b"\0")
    keys: list[bytes] = []
    T = layout.chunk_tokens
    for start in range(0, len(token_ids), T):
        chunk = token_ids[start:start + T]
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
    each, or, where tp exceeds kv_heads, one head replicated on ``tp / kv_heads`` ranks."""
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


def check_prefill_tp(kv_heads: int, tp: int) -> None:
    """A prefill TP pdpush can push from: each rank holds distinct heads."""
    if tp < 1 or kv_heads % tp:
        raise ValueError(f"prefill tensor_parallel_size {tp} must divide the model's {kv_heads} KV heads "
                         f"(use one of {[d for d in range(1, kv_heads + 1) if kv_heads % d == 0]}); where TP "
                         "exceeds the KV heads, ranks hold replicas and pdpush would push each head several times")


@dataclass(frozen=True)
class PoolGeometry:
    """Where layer ``l``, shard ``s``, page ``p`` lies in a receiver's pool (module doc)."""

    layout: KVLayout
    pages: int
    shards: int = 1
    shard_bytes: int = field(init=False)  # one shard of one page
    layer_bytes: int = field(init=False)  # one layer of the whole pool: offset(l + 1, s, p) - offset(l, s, p)

    def __post_init__(self) -> None:
        if self.shards < 1 or self.layout.kv_heads % self.shards:
            raise ValueError(f"pool shards={self.shards} must divide kv_heads={self.layout.kv_heads}")
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

    def heads(self, h0: int, h1: int) -> list[tuple[int, int, int]]:
        """Heads [h0, h1) by shard: (shard, first head within the shard, heads)."""
        per = self.layout.kv_heads // self.shards
        out = []
        h = h0
        while h < h1:
            s, j = divmod(h, per)
            k = min(h1 - h, per - j)
            out.append((s, j, k))
            h += k
        return out


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

    def __post_init__(self) -> None:
        check_prefill_tp(self.layout.kv_heads, self.tp)
        if self.shards < 1 or self.layout.kv_heads % self.shards:
            raise ValueError(f"pool shards={self.shards} must divide kv_heads={self.layout.kv_heads}")
        object.__setattr__(self, "units", math.lcm(self.tp, self.shards))
        object.__setattr__(self, "layer_bytes", self.n_new * self.layout.page_bytes)
        object.__setattr__(self, "share_bytes", self.layer_bytes // self.tp)

    @property
    def kv_bytes(self) -> int:
        return self.layout.layers * self.layer_bytes

    def share_offset(self, layer: int, rank: int) -> int:
        """Offset of rank ``rank``'s share of ``layer`` from the request's staging start."""
        return layer * self.layer_bytes + rank * self.share_bytes

    def share_shape(self) -> tuple[int, ...]:
        """A rank's share as an array: (units of the rank, new pages, heads per unit, 2, T, D)."""
        lay, U = self.layout, self.units
        return (U // self.tp, self.n_new, lay.kv_heads // U, 2, lay.chunk_tokens, lay.head_dim)

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
