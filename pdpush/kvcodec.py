"""The KV codec: the one code that writes KV into staging and reads it from pool pages, for every
layout (``layout.py`` has the byte formulas it follows; ``docs/layout.md`` says them in prose).

An engine's KV for one layer comes as ``C`` components (``layout.components``), each token-major
``[tokens, heads, D]``: K and V for attention (``mha``), the latent ``[tokens, 1, D]`` for MLA. Any
element type of ``layout.DTYPES`` (fp8 included): only bytes move, rows of ``D * B`` bytes at a time.

* ``stage`` writes one rank's share of one layer into staging: page-major ``[H, C, T, D]`` pages,
  split into the share's byte units (``StagingShares``).
* ``read_rows`` and ``read_pages`` read a rank's heads of a layer back from the pool, whatever its
  shards (``PoolGeometry``): rows at given (page, row) positions, or whole pages.
* ``elements`` / ``as_row_bytes`` convert between element arrays and row bytes.

Works on numpy arrays and on torch tensors (any device; the array library of the inputs is used,
so a CUDA gather stays on its device), and imports torch only when handed a torch tensor. Rows move
between host arrays by ``pdpush_native._copy`` (native/src/copy.cpp: the source walked in its memory
order, at memcpy speed) where it is installed, else by the array library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdpush.layout import DTYPES, PoolGeometry, StagingShares, rank_heads

# (first new-page index, first source row, rows): consecutive new chunks whose tokens are rows
# [src, src + rows) of the input, landing in new pages j0, j0 + 1, ... (``segments``)
Segment = tuple[int, int, int]


def _is_torch(x) -> bool:
    return type(x) is not np.ndarray and type(x).__module__.startswith("torch")  # (asked several times a layer)


def _perm(x, *axes):
    return x.permute(*axes) if _is_torch(x) else x.transpose(axes)


def _items(x, row_bytes: int):
    """Row bytes ``[..., row_bytes]`` (uint8) as ``[..., k]`` row items, so that transposes move whole
    rows in wide lanes: 8-byte lanes where the row is a multiple of 8 bytes (numpy moved them 15% faster
    than one ``void`` item per row, out of cache), else numpy's ``void`` of the row (k = 1); torch's widest
    integer dividing it and the tensor's offset in its storage (a view), so two tensors of one copy may get
    different lanes: ``_copy`` then copies their bytes."""
    if not _is_torch(x):
        return x.view(np.uint64) if row_bytes % 8 == 0 else x.view(np.dtype((np.void, row_bytes)))
    import torch

    for w, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row_bytes % w == 0 and x.storage_offset() % w == 0:
            return x.view(dt)
    return x


_NATIVE: list = []  # [pdpush_native._copy or None], loaded on the first copy


def _native():
    if not _NATIVE:
        try:
            from pdpush_native import _copy
        except ImportError:  # an engine venv without pdpush's native build: the array library copies
            _copy = None
        _NATIVE.append(_copy)
    return _NATIVE[0]


def _native_copy():
    return getattr(_native(), "copy_rows", None)


def _row_bytes_view(x):
    """Row items ``[..., k]`` (last axis contiguous) as bytes ``[..., row bytes]``, the same memory."""
    if _is_torch(x):
        import torch

        return x.view(torch.uint8)
    return x.view(np.uint8)


def _copy(dst, src) -> None:
    """``dst[...] = src`` for row items of one shape: natively between host arrays, else by the library."""
    native = _native_copy()
    if native is not None and (not _is_torch(dst) or dst.device.type == "cpu") and \
            (not _is_torch(src) or src.device.type == "cpu") and _is_torch(dst) == _is_torch(src) and dst.ndim:
        native(_row_bytes_view(dst), _row_bytes_view(src))
    elif tuple(dst.shape) != tuple(src.shape):  # lanes of different widths (``_items``): never broadcast
        _row_bytes_view(dst)[...] = _row_bytes_view(src)
    else:
        dst[...] = src


def _host_bytes(x):
    """``x`` as a numpy uint8 array sharing its memory, where it is a host array (numpy, or a CPU tensor); else None."""
    if not _is_torch(x):
        return x
    return x.numpy() if x.device.type == "cpu" else None


def _stage_natively(dst, rows: list, plan: StagePlan, stream: bool = False) -> bool:
    """``stage``'s whole-heads case in one native call (``_copy.stage_pages``) where the arrays are on the
    host and the native build has it; False where it cannot (the caller then writes the pages itself)."""
    fn = plan.native
    if fn is None:
        return False
    d = _host_bytes(dst)
    srcs = [_host_bytes(r) for r in rows]
    if d is None or any(r is None for r in srcs) or not d.flags.c_contiguous:
        return False
    fn(d.reshape(-1), srcs, plan.page_head, plan.Ur, plan.hu, plan.layout.chunk_tokens, plan.seg_array, stream)
    return True


def _zero(x) -> None:
    x[...] = bytes(x.dtype.itemsize) if not _is_torch(x) and x.dtype.kind == "V" else 0


def as_row_bytes(x, row_bytes: int):
    """A contiguous uint8 view ``[..., row_bytes]`` of an element array ``[..., D]`` (numpy or torch,
    staying on its device); ``[tokens, heads * D]`` is taken as ``[tokens, heads, D]``."""
    if _is_torch(x):
        import torch

        t = x.detach()
        t = t if t.is_contiguous() else t.contiguous()
        b = t.view(torch.uint8)
    else:
        a = np.asarray(x)
        b = (a if a.flags.c_contiguous else np.ascontiguousarray(a)).view(np.uint8)
    if b.ndim < 2 or (b.shape[-1] != row_bytes and (b[0].numel() if _is_torch(b) else b[0].size) % row_bytes):
        raise ValueError(f"rows of {b.shape[-1]} bytes, the layout's are {row_bytes} (D x element bytes)")
    return b if b.shape[-1] == row_bytes else b.reshape(b.shape[0], -1, row_bytes)


def elements(b, dtype: str):
    """Row bytes ``[..., D * B]`` as elements ``[..., D]``: torch's dtype for a tensor; for a numpy array
    how numpy holds it (bfloat16 as uint16, fp8 as uint8)."""
    et = DTYPES[dtype]
    if _is_torch(b):
        import torch

        return b.view(torch.uint8).view(getattr(torch, et.torch))
    return b.view(np.uint8).view(np.dtype(et.numpy))


def segments(new_runs: list[tuple[int, int, int]], tokens: int, chunk_tokens: int,
             new_only: bool = False) -> list[Segment]:
    """Where the new chunks' tokens are in an input: the prompt's rows (``new_only`` False: chunk ``c``
    at rows ``c * T``), or only the new chunks' rows back to back (``new_only``)."""
    out, at = [], 0
    for j0, c0, n in new_runs:
        rows = min(tokens, (c0 + n) * chunk_tokens) - c0 * chunk_tokens
        out.append((j0, at if new_only else c0 * chunk_tokens, rows))
        at += rows
    return out


def _write_pages(dst, rows: Sequence, h0: int, T: int, segs: list[Segment]) -> None:
    """``dst`` row items ``[n, hu, C, T, k]``: write heads ``[h0, h0 + hu)`` of each component's
    ``rows[c]`` ``[tokens, heads, k]`` into the pages of ``segs``."""
    hu = dst.shape[1]
    for c, src in enumerate(rows):
        src = src[:, h0:h0 + hu]
        for j0, s0, m in segs:  # one vectorised copy per run of chunks (usually one)
            full, rest = divmod(m, T)
            if full:
                _copy(dst[j0:j0 + full, :, c], _perm(src[s0:s0 + full * T].reshape(full, T, hu, -1), 0, 2, 1, 3))
            if rest:  # a partial last chunk: its tail rows are zeroed, never another request's bytes
                _copy(dst[j0 + full, :, c, :rest], _perm(src[s0 + full * T:s0 + m], 1, 0, 2))
                _zero(dst[j0 + full, :, c, rest:])


def _write_rows(dst, rows: Sequence, r0: int, C: int, T: int, segs: list[Segment]) -> None:
    """``dst`` row items ``[n, R, k]``: rows ``[r0, r0 + R)`` of each of the rank's pages, numbered
    ``(head * C + component) * T + token`` (its page layout, flattened), from ``rows[c]`` ``[tokens, heads, k]``."""
    R = dst.shape[1]
    for blk in range(r0 // T, (r0 + R - 1) // T + 1):  # the (head, component) blocks the unit spans
        hh, c = divmod(blk, C)
        ta, tb = max(r0, blk * T) - blk * T, min(r0 + R, (blk + 1) * T) - blk * T  # its token rows
        at = blk * T + ta - r0  # where they start in the unit
        src = rows[c][:, hh]
        for j0, s0, m in segs:
            full, rest = divmod(m, T)
            if full:
                _copy(dst[j0:j0 + full, at:at + tb - ta], src[s0:s0 + full * T].reshape(full, T, -1)[:, ta:tb])
            if rest:  # a partial last chunk: the rows it has, then zeroed tail rows
                hi = min(tb, rest)
                if hi > ta:
                    _copy(dst[j0 + full, at:at + hi - ta], src[s0 + full * T + ta:s0 + full * T + hi])
                z = max(ta, rest)
                if tb > z:
                    _zero(dst[j0 + full, at + z - ta:at + tb - ta])


@dataclass(frozen=True, eq=False)  # (its arrays compare elementwise: plans are not compared)
class StagePlan:
    """What ``stage`` decides from a request alone (its shares, the rank, the new chunks' segments), once per
    request and layer group: a layer's staging then costs its copy and the checks of its inputs."""

    shares: StagingShares
    rank: int
    segs: list[Segment]
    h0: int  # the rank's heads [h0, h1) of the model's
    h1: int
    need: int  # token rows the inputs must have
    Ur: int  # share_shape: units of the rank, new pages, bytes of a unit
    n: int
    ub: int
    b0: int  # the rank's bytes of a page (share_span)
    b1: int
    hu: int  # heads of a unit, where units are whole heads (heads_aligned)
    page_head: int  # the rank's first head in a page, where units are whole heads
    seg_array: np.ndarray  # segs as int64 [-1, 3], for the native call
    native: Any  # _copy.stage_pages where the native build has it and units are whole heads, else None

    @property
    def layout(self):
        return self.shares.layout


def stage_plan(shares: StagingShares, rank: int, segs: list[Segment]) -> StagePlan:
    """``stage``'s decisions for rank ``rank``'s share of a layer group's layers (``StagePlan``)."""
    lay = shares.layout
    h0, h1 = rank_heads(lay.kv_heads, shares.tp, rank)
    Ur, n, ub = shares.share_shape()
    b0, b1 = shares.share_span(rank)
    aligned = shares.heads_aligned
    return StagePlan(shares, rank, segs, h0, h1, max((s0 + m for _, s0, m in segs), default=0), Ur, n, ub, b0, b1,
                     lay.kv_heads // shares.units if aligned else 0, b0 // lay.head_page_bytes if aligned else 0,
                     np.array(segs, dtype=np.int64).reshape(-1, 3),
                     getattr(_native(), "stage_pages", None) if aligned else None)


def _planned_rows(comps: Sequence, plan: StagePlan) -> list | None:
    """The components as the native call takes them (uint8 ``[tokens, the rank's heads, row bytes]``), where each
    is a C-contiguous numpy array ``[tokens, heads, D]`` of the plan's shape; else None, and ``stage_planned``
    takes its general path, which also says what is wrong. A few attribute reads: at 256 KiB layers the general
    path's views and checks cost a third of the copy."""
    lay = plan.layout
    if len(comps) != lay.components:
        return None
    rows = []
    shape = None
    for x in comps:
        if type(x) is not np.ndarray or x.ndim != 3 or not x.flags.c_contiguous:
            return None
        if shape is None:
            shape = x.shape
            if shape[0] < plan.need or shape[2] * x.itemsize != lay.row_bytes:
                return None
        elif x.shape != shape:
            return None
        rows.append(x.view(np.uint8))
    heads = shape[1]
    if heads == plan.h1 - plan.h0:
        return rows
    if heads == lay.kv_heads:  # every head given: this rank's
        return [r[:, plan.h0:plan.h1] for r in rows]
    return None


def stage(dst, comps: Sequence, shares: StagingShares, rank: int, segs: list[Segment]) -> None:
    """Write rank ``rank``'s share of one layer into ``dst``, the share's staging bytes (uint8, flat or
    ``share_shape``), from ``comps``: the layer's C components ``[tokens, heads, D]``, holding the heads
    this rank holds (``rank_heads``) or every head of the model. The tail rows of a partial last chunk
    are zeroed, so staging never carries bytes of an earlier request to another receiver."""
    stage_planned(dst, comps, stage_plan(shares, rank, segs))


def stage_planned(dst, comps: Sequence, plan: StagePlan, stream: bool = False) -> None:
    """``stage`` with its plan made (``stage_plan``): an engine makes it once per request and layer group.
    ``stream``: ``dst`` is staging, which this thread does not read again: the native copy writes it with
    streaming stores (native/src/copy.cpp), which leave no line of it in this core's cache."""
    if plan.native is not None and type(dst) is np.ndarray and dst.flags.c_contiguous:
        rows = _planned_rows(comps, plan)
        if rows is not None:  # the common case, host arrays as an engine hands them: one native call
            plan.native(dst.reshape(-1), rows, plan.page_head, plan.Ur, plan.hu, plan.layout.chunk_tokens,
                        plan.seg_array, stream)
            return
    shares, lay = plan.shares, plan.layout
    C, T, rb = lay.components, lay.chunk_tokens, lay.row_bytes
    if len(comps) != C:
        raise ValueError(f"{lay.kind} KV has {C} components per layer, got {len(comps)}")
    rows = [as_row_bytes(x, rb) for x in comps]
    if any(r.shape[:2] != rows[0].shape[:2] for r in rows):
        raise ValueError(f"components of different shapes: {[tuple(r.shape) for r in rows]}")
    torch_rows = _is_torch(rows[0])
    if torch_rows and not _is_torch(dst):
        import torch

        dst = torch.from_numpy(dst)
    elif not torch_rows and _is_torch(dst):
        rows = [_as_torch(r, dst) for r in rows]
    h0, h1 = plan.h0, plan.h1
    if rows[0].shape[1] == lay.kv_heads and h1 - h0 != lay.kv_heads:
        rows = [r[:, h0:h1] for r in rows]  # every head given: this rank's
    if rows[0].shape[1] != h1 - h0:
        raise ValueError(f"got {rows[0].shape[1]} heads; rank {plan.rank} of {shares.tp} holds {h1 - h0} "
                         f"(of {lay.kv_heads})")
    if rows[0].shape[0] < plan.need:
        raise ValueError(f"got {rows[0].shape[0]} token rows, need {plan.need}")
    Ur, n, ub, b0, b1, segs = plan.Ur, plan.n, plan.ub, plan.b0, plan.b1, plan.segs
    if _stage_natively(dst, rows, plan, stream):
        return
    rows = [_items(r, rb) for r in rows]
    if shares.heads_aligned:  # each unit is whole heads: write the pages straight into staging
        hu = plan.hu
        d = _items(dst.reshape(Ur, n, hu, C, T, rb), rb)
        for u in range(Ur):
            _write_pages(d[u], rows, plan.page_head + u * hu, T, segs)
        return
    if b0 % rb == 0 and ub % rb == 0:  # a unit is whole rows of a head (an MLA latent's T/U token rows, or K or
        d = _items(dst.reshape(Ur, n, ub // rb, rb), rb)  # V of a replicated head): straight into staging
        for u in range(Ur):
            _write_rows(d[u], rows, (b0 + u * ub) // rb, C, T, segs)
        return
    # a unit cuts rows: the rank's pages, then its bytes of them
    h = h1 - h0
    if _is_torch(dst):
        import torch

        tmp = torch.empty((n, h, C, T, rb), dtype=torch.uint8, device=dst.device)
    else:
        tmp = np.empty((n, h, C, T, rb), dtype=np.uint8)
    _write_pages(_items(tmp, rb), rows, 0, T, segs)
    part = tmp.reshape(n, h * lay.head_page_bytes)[:, b0:b1].reshape(n, Ur, ub)
    _copy(dst.reshape(Ur, n, ub), _perm(part, 1, 0, 2))


def share_rows(shares: StagingShares, rank: int, segs: list[Segment], src_heads: int):
    """What each row of rank ``rank``'s share of a layer holds, in the share's order (``share_shape``'s
    ``[units / tp, new pages, rows of a unit]``, flattened), where its units are whole rows (else None:
    ``stage`` cuts rows there). Three arrays: the component, the input token row (as ``stage``'s ``segs``
    number them; -1 for a zeroed tail row of a partial chunk), and the head among the ``src_heads`` an
    engine's memory holds (the rank's, ``rank_heads``, or every head of the model). ``gather`` fills the
    share from them in one pass; an engine computes them once per request and group, not per layer."""
    lay = shares.layout
    C, T, rb = lay.components, lay.chunk_tokens, lay.row_bytes
    Ur, n, ub = shares.share_shape()
    b0, _ = shares.share_span(rank)
    if b0 % rb or ub % rb:
        return None
    h0, h1 = rank_heads(lay.kv_heads, shares.tp, rank)
    if src_heads == lay.kv_heads:
        first = h0
    elif src_heads == h1 - h0:
        first = 0
    else:
        raise ValueError(f"a source of {src_heads} heads; rank {rank} of {shares.tp} holds {h1 - h0} "
                         f"(of {lay.kv_heads})")
    Q = ub // rb
    page_row = b0 // rb + np.arange(Ur)[:, None] * Q + np.arange(Q)[None, :]  # [Ur, Q]: (head * C + c) * T + t
    head, rest = np.divmod(page_row, C * T)
    comp, t = np.divmod(rest, T)
    tok = np.full((n, T), -1, np.int64)  # each new page's token rows
    for j0, s0, m in segs:
        r = np.arange(m)
        tok[j0 + r // T, r % T] = s0 + r
    token = tok[np.arange(n)[None, :, None], t[:, None, :]]  # [Ur, n, Q]
    shape = (Ur, n, Q)
    return (np.broadcast_to(comp[:, None, :], shape).reshape(-1).copy(), token.reshape(-1),
            np.broadcast_to(head[:, None, :] + first, shape).reshape(-1).copy())


def can_gather() -> bool:
    """Whether ``gather`` can run here (it is native: ``pdpush_native._copy``)."""
    return hasattr(_native(), "gather_rows")


def gather(dst, shares: StagingShares, src, base, sel, emap, stream: bool = False, dst_rows=None) -> None:
    """Fill a rank's share of a layer (``dst``, its staging bytes) straight from an engine's own memory, in
    one pass (native/src/copy.cpp): share row ``r`` (``share_rows``' order) is the ``D`` elements at byte
    ``base[r] + emap[sel[r], d] * B`` of ``src`` (flat host bytes; ``base`` int64, < 0 zeroes the row;
    ``sel`` int32; ``emap`` int32 ``[M, D]`` element offsets). Every address is checked against ``src``.
    ``stream``: as ``stage_planned``'s. ``dst_rows``: the table is in another order (``source_order``'s):
    its entry ``r`` fills share row ``dst_rows[r]``."""
    lay = shares.layout
    _native().gather_rows(dst.reshape(-1, lay.row_bytes), src, base, sel, emap, DTYPES[lay.dtype].bytes, stream,
                          dst_rows)


def source_order(base, sel, emap) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``gather``'s table sorted by where its rows are read (``base``, then ``sel``), for ``gather``'s
    ``dst_rows``: ``(base, sel, emap, dst_rows)``. In an engine's paged cache that is its memory order (a
    block's heads one after the other, each head's K rows then its V rows), where staging's order takes a
    head's rows from every block before the next head's; rows of consecutive tokens stay consecutive, so the
    transposed tiles are found as before. Zeroed rows (a negative base: a partial chunk's tail) go last: first,
    they would hide the tiles from ``gather_rows``, which learns their step from the first rows. Computed once
    per request and group, with the table."""
    base, sel = np.asarray(base, dtype=np.int64), np.asarray(sel, dtype=np.int32)
    order = np.lexsort((sel, base, base < 0))
    return (np.ascontiguousarray(base[order]), np.ascontiguousarray(sel[order]), emap,
            np.ascontiguousarray(order, dtype=np.int64))


def pool_row_offsets(geom: PoolGeometry, layer: int, page_of, row_of, heads: tuple[int, int]) -> np.ndarray:
    """Byte offsets in the pool region of heads ``[h0, h1)`` of one row per token (token ``i`` at row
    ``row_of[i]`` of page ``page_of[i]``), each head's C components: int64 ``[tokens * heads * C]``, in
    (token, head, component) order. A pool of whole heads per shard only (``geom.heads_aligned``)."""
    lay = geom.layout
    C, T, rb = lay.components, lay.chunk_tokens, lay.row_bytes
    if not geom.heads_aligned:
        raise ValueError("pool_row_offsets: a pool whose shards split heads")
    per = lay.kv_heads // geom.shards
    h = np.arange(*heads)
    base = np.array([geom.offset(layer, s, 0) for s in range(geom.shards)], dtype=np.int64)[h // per]
    page = np.asarray(page_of, dtype=np.int64).reshape(-1, 1, 1)
    row = np.asarray(row_of, dtype=np.int64).reshape(-1, 1, 1)
    unit = (h % per)[None, :, None] * C + np.arange(C)[None, None, :]
    return (base[None, :, None] + page * geom.shard_bytes + (unit * T + row) * rb).reshape(-1)


def can_scatter() -> bool:
    """Whether ``scatter`` can run here (it is native: ``pdpush_native._copy``)."""
    return hasattr(_native(), "scatter_rows")


def scatter(dst, base, sel, emap, elem_bytes: int, src, src_off) -> None:
    """``gather``'s way back, in one pass (native/src/copy.cpp): row ``r`` of ``src`` (flat bytes, at byte
    ``src_off[r]``) to the elements at ``dst[base[r] + emap[sel[r], d] * B]``; every address checked first."""
    _native().scatter_rows(dst, base, sel, emap, elem_bytes, src, src_off)


def scatter_order(base, sel, src_off) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``scatter``'s table ``(base, sel, src_off)`` sorted by where its rows are read (``src_off``: the pool's
    head-major pages, a head's rows of consecutive tokens back to back), as ``source_order`` sorts ``gather``'s.
    Every row says where it goes, so the order is free (rows write different bytes). A table made token by token
    reads each token's heads from pages apart: on an AMD EPYC, vLLM CPU_ATTN blocks of 32 slots, 8 heads x 128
    bf16, 1 to 16 MiB layers out of the caches, 2.5-3.3 GB/s that way, 3.2-4.9 sorted (1.26-1.55x)."""
    src_off = np.asarray(src_off, dtype=np.int64)
    order = np.argsort(src_off, kind="stable")
    return (np.ascontiguousarray(np.asarray(base, dtype=np.int64)[order]),
            np.ascontiguousarray(np.asarray(sel, dtype=np.int32)[order]), np.ascontiguousarray(src_off[order]))


def _as_torch(a, like):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).to(like.device)


def _layer(pool, geom: PoolGeometry, layer: int, shard: int):
    off = geom.offset(layer, shard, 0)
    return pool[off:off + geom.pages * geom.shard_bytes]


def read_pages(pool, geom: PoolGeometry, layer: int, pages, heads: tuple[int, int]):
    """Heads ``[h0, h1)`` of pool pages ``pages`` of ``layer``: row bytes ``[n, heads, C, T, D * B]`` (a
    copy). ``pool`` is the pool region's bytes (uint8, numpy or torch)."""
    lay = geom.layout
    C, T, rb, H = lay.components, lay.chunk_tokens, lay.row_bytes, lay.kv_heads
    h0, h1 = heads
    if geom.heads_aligned:
        per = H // geom.shards
        parts = [_layer(pool, geom, layer, s).reshape(geom.pages, per, C, T, rb)[pages, j:j + k]
                 for s, j, k in geom.heads(h0, h1)]
    else:  # shards are byte slices of the pages: put the pages back together
        whole = [_layer(pool, geom, layer, s).reshape(geom.pages, geom.shard_bytes)[pages]
                 for s in range(geom.shards)]
        parts = [_cat(whole, 1).reshape(-1, H, C, T, rb)[:, h0:h1]]
    return parts[0] if len(parts) == 1 else _cat(parts, 1)


def read_rows(pool, geom: PoolGeometry, layer: int, page_of, row_of, heads: tuple[int, int]):
    """Heads ``[h0, h1)`` of one row per token: token ``i`` at row ``row_of[i]`` of pool page
    ``page_of[i]``. Row bytes ``[tokens, heads, C, D * B]`` (one gather)."""
    lay = geom.layout
    C, T, rb, H = lay.components, lay.chunk_tokens, lay.row_bytes, lay.kv_heads
    if geom.heads_aligned:
        per = H // geom.shards
        parts = [_layer(pool, geom, layer, s).reshape(geom.pages, per, C, T, rb)[:, j:j + k][page_of, :, :, row_of]
                 for s, j, k in geom.heads(*heads)]
        return parts[0] if len(parts) == 1 else _cat(parts, 1)
    uniq, inv = (page_of.unique(return_inverse=True) if _is_torch(page_of)
                 else np.unique(page_of, return_inverse=True))
    return read_pages(pool, geom, layer, uniq, heads)[inv, :, :, row_of]


def _cat(parts, axis: int):
    if _is_torch(parts[0]):
        import torch

        return torch.cat(parts, axis)
    return np.concatenate(parts, axis)


def page_rows_to_tokens(pages, tokens: int):
    """Pages ``[n, heads, C, T, k]`` -> token-major ``[tokens, heads, C, k]`` (the first ``tokens``)."""
    n, h, C, T = pages.shape[:4]
    return _perm(pages, 0, 3, 1, 2, 4).reshape(n * T, h, C, -1)[:tokens]



# ---- recurrent state (GDN, Mamba2): a rank's units of each state layer's page (layout.StateSegment) ----

def _bytes_of(x):
    """A contiguous array's bytes, flat (uint8), numpy or torch."""
    if _is_torch(x):
        import torch

        return x.contiguous().view(torch.uint8).reshape(-1)
    return np.ascontiguousarray(x).view(np.uint8).reshape(-1)


def _host_array(x):
    """A host torch tensor as a numpy array of its bytes' width (zero-copy; bfloat16 as int16): slicing and
    copying bytes in numpy costs far less per call than torch's."""
    if not _is_torch(x) or x.device.type != "cpu":
        return x
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.contiguous().view(width).numpy()


def _narrow(x, axis: int, start: int, n: int):
    return x.narrow(axis, start, n) if _is_torch(x) else np.take(x, range(start, start + n), axis=axis)


def _tensor_parts(layout, tp: int) -> dict[str, list[tuple[int, int]]]:
    """Each engine tensor's segments: (segment index, its length along the tensor's axis on one rank)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for i, s in enumerate(layout.state):
        out.setdefault(s.tensor, []).append((i, s.shape[s.axis] if s.replicated else s.shape[s.axis] // tp))
    return out


def state_shapes(layout, tp: int) -> dict[str, tuple[int, ...]]:
    """The shape of each engine tensor (conv, ssm) on one rank of ``tp``, for one state layer."""
    out = {}
    for name, parts in _tensor_parts(layout, tp).items():
        s = layout.state[parts[0][0]]
        sh = list(s.shape)
        sh[s.axis] = sum(n for _, n in parts)
        out[name] = tuple(sh)
    return out


def stage_state(dst, tensors: Sequence[dict], layout, tp: int, rank: int) -> None:
    """Write rank ``rank``'s units of some state layers into ``dst`` (uint8 ``[layers, units / tp, unit
    bytes]``). ``tensors``: per one of those state layers, the rank's engine tensors by name, as the engine
    holds them (each the concatenation of its segments' parts along its axis)."""
    layout.check_state_tp(tp)
    k = layout.state_units // tp
    shapes = state_shapes(layout, tp)
    host = not _is_torch(dst)
    for la, local in enumerate(tensors):
        for name, parts in _tensor_parts(layout, tp).items():
            x = _host_array(local[name]) if host else local[name]
            if tuple(x.shape) != shapes[name]:
                raise ValueError(f"state layer {la}: {name} is {tuple(x.shape)} on a rank of {tp}, the layout's "
                                 f"{shapes[name]}")
            at = 0
            for i, n in parts:
                s = layout.state[i]
                part = _narrow(x, s.axis, at, n)
                at += n
                off = sum(layout.state[j].unit_bytes(layout.state_units) for j in range(i))
                nb = s.unit_bytes(layout.state_units)
                for j in range(k):
                    piece = part if s.replicated else _narrow(part, s.axis, j * (n // k), n // k)
                    dst[la, j, off:off + nb] = _bytes_of(piece)


def read_state(src, layout, tp: int, rank: int) -> list[dict]:
    """Rank ``rank``'s engine tensors of some state layers from its units ``src`` (uint8 ``[layers, units / tp,
    unit bytes]``): the inverse of ``stage_state`` (a replicated part comes from the first unit)."""
    layout.check_state_tp(tp)
    k = layout.state_units // tp
    out = []
    for la in range(src.shape[0]):
        local = {}
        for name, parts in _tensor_parts(layout, tp).items():
            pieces = []
            for i, _ in parts:
                s = layout.state[i]
                off = sum(layout.state[j].unit_bytes(layout.state_units) for j in range(i))
                nb = s.unit_bytes(layout.state_units)
                ush = s.unit_shape(layout.state_units)
                units = [elements(src[la, j, off:off + nb], s.dtype).reshape(ush) for j in range(1 if s.replicated
                                                                                          else k)]
                pieces.append(units[0] if len(units) == 1 else _cat(units, s.axis))
            local[name] = pieces[0] if len(pieces) == 1 else _cat(pieces, layout.state[parts[0][0]].axis)
        out.append(local)
    return out


def _cat(xs, axis: int):
    if _is_torch(xs[0]):
        import torch

        return torch.cat(xs, dim=axis)
    return np.concatenate(xs, axis=axis)
