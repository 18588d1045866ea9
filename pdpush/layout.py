"""KV layout: byte sizes, offsets, fingerprints, chunk keys and page runs.

Canonical in-page layout (one page = one chunk of one layer)::

    page[2, chunk_tokens, kv_heads, head_dim]   # [0] = K, [1] = V, row-major

The pool is layer-major: ``pool[layers, pages, page_bytes]``, so layer ``l``
of a run of consecutive pages ``p..p+n`` is one contiguous byte range.
A partial last chunk takes a whole page; only its first ``last_chunk_tokens``
token rows are meaningful.

After the KV comes the readiness area: one 8-byte word per (layer, page),
``ready[layers, pages]`` (u64, native order), at byte offset
``layers * pages * page_bytes``. When layer ``l`` of a request has landed (its
data puts' flush completed, which means remote completion), the sender puts the
request's lease id into ``ready[l, p]`` for each of its new pages ``p``. A
decode client reading its zero-copy mapping sees a layer ready when every word
of its new pages equals its lease id. Lease ids are unique and never 0, so a
zeroed word or a late write from an older lease never reads as ready.

Pure logic: imports no torch, zmq or ucxx (numpy only where asked for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import xxhash

DType = Literal["float16", "bfloat16", "float32"]
DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
LAYOUT_VERSION = 1
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
        return (2, self.chunk_tokens, self.kv_heads, self.head_dim)

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
             f"|D{self.head_dim}|{self.dtype}|T{self.chunk_tokens}|page=[2,T,H,D]")
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
