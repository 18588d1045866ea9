"""vLLM paged KV <-> pdpush canonical pages: the one place that knows vLLM's block layouts.

vLLM (0.32+, RFC #42082) hands connectors a per-layer view shaped ``[B, H, N, C]``
(blocks, KV heads, slots per kernel block, content), whose physical strides follow
the resolved ``KVCacheLayout``. Where K and V of one token sit inside that is the
attention backend's business:

* ``CPU_ATTN``: each (block, head) tile of ``N * C`` elements holds K then V, packed by
  the kernel for its ISA (the ``vec`` kernel stores K dimension-major, ``[D, N]``, and V
  token-major). pdpush does not guess this packing: ``learn_tile_map`` writes known
  values through the backend's own cache-write op into a scratch tile and reads back
  where each (token, dim) landed.
* ``FLASH_ATTN`` / ``TRITON_ATTN``: per slot, ``C = [K | V]`` (they split the last dim).
* MLA backends (``CPU_MLA``; the GPU ones likewise): one latent row ``[kv_c | k_pe]`` of
  ``kv_lora_rank + qk_rope_head_dim`` elements per slot, token-major in each block: a view
  ``[B, N, L]`` (``[B, 1, N, L]`` as registered). ``PagedLatent`` reads and writes it.

``PagedKV`` gathers the K and V of given slots as ``[tokens, H, D]`` (prefill) and
scatters them back (decode): one indexed copy each per layer; ``PagedLatent`` the latent as
``[tokens, 1, L]``. Both give the layout's components (kvcodec.py), which place them in pdpush's
head-major ``page[H, C, T, D]`` (layout.py). Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pdpush.errors import ConfigError

TILE = "tile"        # K and V packed by the kernel inside each (block, head) tile
CHANNEL = "channel"  # K and V side by side in each slot's channels
LATENT = "latent"    # an MLA latent row per slot
BACKENDS = {"CPU_ATTN": TILE, "FLASH_ATTN": CHANNEL, "TRITON_ATTN": CHANNEL,
            "CPU_MLA": LATENT, "TRITON_MLA": LATENT, "FLASHMLA": LATENT, "FLASH_ATTN_MLA": LATENT,
            "FLASHINFER_MLA": LATENT, "CUTLASS_MLA": LATENT}
TESTED_BACKENDS = ("CPU_ATTN", "CPU_MLA")  # the others follow their vLLM source; no GPU here to run them

# writer(key [T, H, D], value [T, H, D], kv_layer [B, H, N, C], slots [T]): the backend's own cache write
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def learn_tile_map(slots: int, head_size: int, dtype: torch.dtype, writer: Writer) -> tuple[torch.Tensor, torch.Tensor]:
    """Where K[n, d] and V[n, d] of one (block, head) tile live: two ``[N, D]`` maps of element offsets.

    Values are written as base-64 digits plus one (small integers, exact in fp16 and bf16),
    one digit per pass, so every element's index is recovered exactly whatever the dtype.
    """
    N, D = slots, head_size
    count = N * D
    digits = 1
    while 64 ** digits < count:
        digits += 1
    idx = torch.arange(count, dtype=torch.int64)
    maps = []
    for which in (0, 1):  # 0: K, 1: V
        found = torch.zeros(2 * count, dtype=torch.int64)
        written = torch.zeros(2 * count, dtype=torch.bool)
        for j in range(digits):
            kv = torch.zeros(1, 1, N, 2 * D, dtype=dtype)
            val = ((idx // 64 ** j) % 64 + 1).to(dtype).reshape(N, 1, D)
            zero = torch.zeros_like(val)
            writer(val if which == 0 else zero, zero if which == 0 else val, kv, torch.arange(N))
            flat = kv.reshape(-1).to(torch.int64)
            written |= flat != 0
            found += torch.where(flat != 0, flat - 1, 0) * 64 ** j
        pos = torch.full((count,), -1, dtype=torch.int64)
        where = written.nonzero().flatten()
        if len(where) != count or found[where].unique().numel() != count:
            raise ConfigError("could not learn the attention backend's KV tile packing")
        pos[found[where]] = where
        maps.append(pos.reshape(N, D))
    return maps[0], maps[1]


class PagedKV:
    """Reads and writes given slots of one layer's paged cache as ``[tokens, H, D]`` K and V."""

    def __init__(self, backend: str, head_size: int, tile_maps: tuple[torch.Tensor, torch.Tensor] | None = None):
        kind = BACKENDS.get(backend)
        if kind == LATENT:
            raise ConfigError(f"{backend} is an MLA backend: its cache holds latents (PagedLatent)")
        if kind is None:
            raise ConfigError(f"pdpush does not know the KV layout of vLLM attention backend {backend!r}; "
                              f"supported: {sorted(BACKENDS)}")
        if kind == TILE and tile_maps is None:
            raise ConfigError(f"{backend}: a tile map is needed (learn_tile_map)")
        self.kind = kind
        self.backend = backend
        self.head_size = head_size
        self.tile_maps = tile_maps
        self._offsets: dict[int, tuple] = {}
        self._emap: torch.Tensor | None = None  # rows' element map: the same for every layer

    def check(self, kv_layer: torch.Tensor) -> None:
        if kv_layer.dim() != 4:
            raise ConfigError(f"expected a [blocks, heads, slots, content] KV view, got {tuple(kv_layer.shape)}")
        B, H, N, C = kv_layer.shape
        if C != 2 * self.head_size:
            raise ConfigError(f"KV content dim {C} is not 2 x head_size {self.head_size} (MLA and packed caches "
                              "are not supported)")
        if self.kind == TILE:
            _, _, sN, sC = kv_layer.stride()
            if sC != 1 or sN != C:
                raise ConfigError(f"{self.backend}: a (slots, content) tile is not contiguous: {kv_layer.stride()}")
            if self.tile_maps[0].shape != (N, self.head_size):
                raise ConfigError(f"{self.backend}: tile map {tuple(self.tile_maps[0].shape)} does not fit "
                                  f"{N} slots x {self.head_size}")

    def slots_per_block(self, kv_layer: torch.Tensor) -> int:
        return kv_layer.shape[2]

    def _flat(self, kv_layer: torch.Tensor, blk: torch.Tensor, off: torch.Tensor):
        """The layer as one flat tensor, and the element offsets of K and V of each token ``[T, H, D]``
        (cached on ``blk``: every layer of a model has the same shape and strides)."""
        B, H, N, C = kv_layer.shape
        sB, sH = kv_layer.stride()[:2]
        flat = kv_layer.as_strided((B * sB,), (1,), kv_layer.storage_offset())
        key = (B, H, N, C, sB, sH)
        cache = self._offsets.get(id(blk))
        if cache is None or cache[0] is not blk or cache[1] != key:
            kmap, vmap = self.tile_maps  # type: ignore[misc]
            base = blk[:, None, None] * sB + torch.arange(H)[None, :, None] * sH
            cache = (blk, key, base + kmap[off][:, None, :], base + vmap[off][:, None, :])
            self._offsets[id(blk)] = cache
            if len(self._offsets) > 64:  # loads and pushes come and go; keep only recent ones
                self._offsets.pop(next(iter(self._offsets)))
        return flat, cache[2], cache[3]

    def rows(self, kv_layer: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, comp, token, head):
        """Where rows live, for ``kvcodec.gather``: row ``r`` is component ``comp[r]`` (0 K, 1 V) of head
        ``head[r]`` of token ``token[r]`` (``blk``/``off``: the tokens' kernel block and slot; -1: a zeroed
        row). Returns (base bytes from ``storage``'s start, int64; map row, int32; the map, int32 ``[M, D]``)."""
        B, H, N, C = kv_layer.shape
        sB, sH, sN = kv_layer.stride()[:3]
        D = self.head_size
        if self._emap is None:  # CHANNEL: K and V side by side in each slot, [0, D) and [D, 2D) from it; TILE:
            # [2N, D], K of slot n is map row n, V is N + n
            self._emap = (torch.arange(2 * D, dtype=torch.int32).reshape(2, D) if self.kind == CHANNEL
                          else torch.cat(self.tile_maps).to(torch.int32))  # type: ignore[arg-type]
        if self.kind == CHANNEL:
            return _row_bases(kv_layer, blk, off, token, head, sB, sH, sN), _as_i32(comp), self._emap
        tok = np.asarray(token, dtype=np.int64)  # (numpy: a dozen small torch ops cost ~10x as much here)
        sel = np.asarray(comp, dtype=np.int64) * N + np.asarray(off)[np.maximum(tok, 0)]
        return _row_bases(kv_layer, blk, off, token, head, sB, sH, 0), _as_i32(sel), self._emap

    def gather(self, kv_layer: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == CHANNEL:
            D = self.head_size
            return kv_layer[blk, :, off, :D], kv_layer[blk, :, off, D:]
        flat, ko, vo = self._flat(kv_layer, blk, off)
        return flat[ko], flat[vo]

    def scatter(self, kv_layer: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.to(kv_layer.device, kv_layer.dtype), v.to(kv_layer.device, kv_layer.dtype)
        if self.kind == CHANNEL:
            D = self.head_size
            kv_layer[blk, :, off, :D] = k
            kv_layer[blk, :, off, D:] = v
            return
        flat, ko, vo = self._flat(kv_layer, blk, off)
        flat[ko] = k
        flat[vo] = v


MAX_BLOCK_ID = 1 << 31  # vLLM's block tables are int32


class SlotMap:
    """Where some tokens of a request live in vLLM's paged cache and in pdpush pages.

    ``block_ids`` are the scheduler's (manager) blocks of ``block_size`` tokens; a layer's
    tensor may split each into kernel blocks (virtual block splitting), hence ``addresses``.
    ``chunk_idx``/``chunk_rows`` give each token's chunk index and row in pdpush's pages.
    """

    def __init__(self, block_ids: list[int], block_size: int, tokens, chunk_tokens: int) -> None:
        t = np.asarray(tokens, dtype=np.int64)  # (numpy, shown as torch: once per request, a dozen small torch
        if len(t) and int(t.min()) < 0:         # ops cost a prefill ~0.3 ms here)
            raise ValueError("negative token position")
        if len(t) and int(t.max()) >= len(block_ids) * block_size:
            raise ValueError(f"token {int(t.max())} does not fit in {len(block_ids)} blocks of {block_size}")
        blk = t // block_size
        try:
            ids = np.asarray(block_ids, dtype=np.int64)[blk]
        except OverflowError:
            raise ValueError(f"a block id of {block_ids} is not a block of a paged cache") from None
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= MAX_BLOCK_ID):
            # a negative id would index from the cache's end (torch) or skip its rows (the native copy), and one
            # past 2**31 can wrap its byte offset back into the cache: either is a silent wrong copy
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"block id {bad} is not a block of a paged cache")
        self._slots = ids * block_size + t % block_size
        self.slots = torch.from_numpy(self._slots)  # flat slot of each token
        self.chunk_idx = torch.from_numpy(t // chunk_tokens)
        self.chunk_rows = torch.from_numpy(t % chunk_tokens)
        self.block_ids = sorted({block_ids[i] for i in np.unique(blk).tolist()})
        self.tokens = len(t)
        self._addr: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def addresses(self, kernel_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel block, slot in it) of each token, for a layer whose blocks hold ``kernel_slots``."""
        a = self._addr.get(kernel_slots)
        if a is None:
            a = self._addr[kernel_slots] = (torch.from_numpy(self._slots // kernel_slots),
                                            torch.from_numpy(self._slots % kernel_slots))
        return a


class PagedLatent:
    """Reads and writes given slots of one layer's MLA cache as the latent ``[tokens, 1, L]`` (one
    component, one "head": layout kind ``mla``)."""

    def __init__(self, backend: str, head_size: int) -> None:
        if BACKENDS.get(backend) != LATENT:
            raise ConfigError(f"{backend!r} is not an MLA backend pdpush knows; MLA backends: "
                              f"{sorted(b for b, k in BACKENDS.items() if k == LATENT)}")
        self.backend, self.head_size = backend, head_size

    @staticmethod
    def _blocks(kv_layer: torch.Tensor) -> torch.Tensor:
        """``[B, N, L]`` (the registered ``[B, 1, N, L]`` or the 3-D view ``save_kv_layer`` gets)."""
        return kv_layer if kv_layer.dim() == 3 else kv_layer.select(1, 0)

    def check(self, kv_layer: torch.Tensor) -> None:
        if kv_layer.dim() not in (3, 4) or (kv_layer.dim() == 4 and kv_layer.shape[1] != 1):
            raise ConfigError(f"{self.backend}: expected an MLA cache [blocks, slots, latent] or [blocks, 1, slots, "
                              f"latent], got {tuple(kv_layer.shape)}")
        b = self._blocks(kv_layer)
        if b.shape[2] != self.head_size:
            raise ConfigError(f"{self.backend}: latent of {b.shape[2]} elements, the layout's is {self.head_size} "
                              "(kv_lora_rank + qk_rope_head_dim)")
        if b.stride(2) != 1 or b.stride(1) != b.shape[2]:
            raise ConfigError(f"{self.backend}: a block's latent rows are not contiguous: {tuple(b.stride())}")

    def slots_per_block(self, kv_layer: torch.Tensor) -> int:
        return kv_layer.shape[-2]

    def rows(self, kv_layer: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, comp, token, head):
        """As ``PagedKV.rows``: each row is a token's latent (one component, one head)."""
        b = self._blocks(kv_layer)
        emap = torch.arange(self.head_size, dtype=torch.int32)[None]
        return _row_bases(kv_layer, blk, off, token, head, b.stride(0), 0, b.stride(1)), _as_i32(comp) * 0, emap

    def gather(self, kv_layer: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> tuple[torch.Tensor]:
        return (self._blocks(kv_layer)[blk, off].unsqueeze(1),)

    def scatter(self, kv_layer: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, latent: torch.Tensor) -> None:
        b = self._blocks(kv_layer)
        b[blk, off] = latent.to(b.device, b.dtype).squeeze(1)


def storage(kv_layer: torch.Tensor) -> torch.Tensor:
    """A layer's paged cache as flat bytes from its first element (what ``rows``' bases count from)."""
    extent = 1 + sum((n - 1) * st for n, st in zip(kv_layer.shape, kv_layer.stride(), strict=True))
    return kv_layer.as_strided((extent,), (1,), kv_layer.storage_offset()).view(torch.uint8)


class Storages:
    """Each layer's paged cache as flat bytes (``storage``) and the geometry its row tables depend on (shape,
    strides, dtype), made once per cache tensor: vLLM hands the connector the same tensor at every step, and in a
    busy engine (its caches cold from the forward) the view and the tuples cost 20 to 50 us a layer."""

    def __init__(self) -> None:
        self._of: dict[str, tuple[torch.Tensor, torch.Tensor, tuple]] = {}

    def get(self, name: str, kv_layer: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        hit = self._of.get(name)
        if hit is None or hit[0] is not kv_layer:  # (holding the tensor: its id is never another's)
            hit = self._of[name] = (kv_layer, storage(kv_layer),
                                    (tuple(kv_layer.shape), tuple(kv_layer.stride()), kv_layer.dtype))
        return hit[1], hit[2]


def _as_i32(x) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32))


def _row_bases(kv_layer: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, token, head, sB: int, sH: int,
               sN: int) -> torch.Tensor:
    """Each row's base in bytes: its token's block, its head and (``sN``) its slot, in elements, times the
    element size; -1 for a row of no token (a zeroed tail row)."""
    tok = np.asarray(token, dtype=np.int64)
    t = np.maximum(tok, 0)
    base = (np.asarray(blk)[t] * sB + np.asarray(head, dtype=np.int64) * sH + np.asarray(off)[t] * sN) \
        * kv_layer.element_size()
    return torch.from_numpy(np.where(tok >= 0, base, -1))


def paged_cache(backend: str, head_size: int, kind: str, tile_maps=None) -> PagedKV | PagedLatent:
    """The reader/writer of one engine's paged cache for a layout of ``kind``."""
    if kind == "mla":
        return PagedLatent(backend, head_size)
    return PagedKV(backend, head_size, tile_maps)
