"""Reference speeds measured in the same run: raw UCX put+flush between two processes, and memcpy.

The passive side is ``pdpush_tools.peer``, a region allocated exactly as the receiver's pool is.
``measure_put`` is the active side and uses the same transport code and pattern as the sender:
one put+flush per layer; ``PutReference`` does the same through a push's footprint of memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from pdpush.launch import die_with_parent  # helpers die with the bench


def _env() -> dict:
    return {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def _peer(nbytes: int):
    """A ``pdpush_tools.peer`` process holding ``nbytes``, and an endpoint to it with its rkey:
    yields (worker, endpoint, the peer's info); the endpoint is closed and the peer stopped after."""
    proc = subprocess.Popen([sys.executable, "-m", "pdpush_tools.peer", str(nbytes)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=_env(), preexec_fn=die_with_parent)
    try:
        with connected(json.loads(proc.stdout.readline())) as peer:
            yield peer
    finally:
        proc.stdin.close()
        _stop(proc)


@contextlib.contextmanager
def connected(info: dict, host: str = "127.0.0.1"):
    """An endpoint to a running ``pdpush_tools.peer`` (``info``: the line it printed) at ``host``, with its
    rkey: yields (worker, endpoint, info). Another host's peer is measured this way (bench/across_hosts.py)."""
    from pdpush.transport.auto import open_transport

    w = open_transport()
    ep = w.connect(host, info["port"])
    ep.set_rkey(bytes.fromhex(info["rkey"]))
    try:
        yield w, ep, info
    finally:
        ep.close()


class PutReference:
    """Raw put+flush of one request's layers (one put and its flush each, as ``measure_put``) from a source
    of ``src_copies`` requests into a peer of ``dst_copies``, request by request in turn: the footprint a
    push moves through (the sender's staging ring, the receiver's pool of several requests), so its bytes
    are in the same caches as a push's. ``rewrite``: each request's source is written just before it is
    put, untimed, as the engine writes staging before its hand-over. ``batched``: every layer's put is posted
    at once, with one flush after them all (as the sender posts a request whose layers are all handed over).
    ``once()`` times one request (GB/s)."""

    def __init__(self, w, ep, info: dict, layer_bytes: int, layers: int, src_copies: int, dst_copies: int,
                 rewrite: bool, batched: bool = False, spin_s: float | None = None) -> None:
        from pdpush.shm import array_at

        self.w, self.ep, self.info = w, ep, info
        self.layer_bytes, self.layers, self.rewrite, self.batched = layer_bytes, layers, rewrite, batched
        self.spin_s = spin_s
        self.total = layer_bytes * layers
        self.src_copies, self.dst_copies = src_copies, dst_copies
        self.src, _, _ = w.alloc_shared(self.total * src_copies)  # the same memory the sender's staging uses
        self.view = array_at(self.src.address, self.total * src_copies)
        self.view[:] = 1  # fault the pages in, as a real staging area would be
        self.n = 0

    def once(self, batched: bool | None = None, streamed: bool = False) -> float:
        """``batched``: this call's (None: the reference's own). ``streamed``: the source is written with
        streaming stores, as the engine writes staging (``kvcodec.stage_planned``): out of the caches when it
        is put, where ``rewrite``'s stores leave the last few MiB of it in this core's."""
        from pdpush.transport.base import PutOp
        from pdpush_tools.peer import put_and_wait

        s, d = (self.n % self.src_copies) * self.total, (self.n % self.dst_copies) * self.total
        self.n += 1
        if streamed:
            _stream_fill(self.view[s:s + self.total], self.n & 0xFF)
        elif self.rewrite:
            self.view[s:s + self.total] = self.n & 0xFF
        ops = [PutOp(self.src.address + s + off, self.info["address"] + d + off, self.layer_bytes)
               for off in range(0, self.total, self.layer_bytes)]
        t = time.perf_counter()
        for batch in [ops] if (self.batched if batched is None else batched) else [[op] for op in ops]:
            put_and_wait(self.w, self.ep, batch, 30.0, self.spin_s)
        return self.total / (time.perf_counter() - t) / 1e9

    def close(self) -> None:
        self.src.close()


_LINE = 64  # _stream_fill's rows: one cache line each, so that every whole line streams


def _stream_fill(view: np.ndarray, value: int) -> None:
    """Fill ``view`` (uint8, contiguous) with ``value``: its whole cache lines by streaming stores
    (``pdpush_native._copy.gather_rows``, which staging's copies use, then a fence), the bytes before the first and
    after the last by plain stores."""
    from pdpush_native import _copy

    head = min(-view.ctypes.data % _LINE, view.size)
    rows = (view.size - head) // _LINE
    view[:head] = value
    view[head + rows * _LINE:] = value
    if not rows:
        return
    body = view[head:head + rows * _LINE].reshape(rows, _LINE)
    if not _copy.gather_rows(body, np.full(_LINE, value, np.uint8), np.zeros(rows, np.int64), np.zeros(rows, np.int32),
                             np.arange(_LINE // 8, dtype=np.int32).reshape(1, -1), 8, True):
        raise RuntimeError("_stream_fill: no streaming stores here (no SSE2, or set_streaming(False))")


@contextlib.contextmanager
def put_reference(layer_bytes: int, layers: int, src_copies: int = 1, dst_copies: int = 1, rewrite: bool = False,
                  peer: tuple[dict, str] | None = None, batched: bool = False, spin_s: float | None = None):
    """A ``PutReference`` into a peer started here (``peer``: as ``measure_put``'s), its peer stopped after.
    Each request's first pass touches its remote pages: warm it with ``dst_copies`` calls of ``once()``."""
    total = layer_bytes * layers
    with _peer(total * dst_copies) if peer is None else connected(*peer) as (w, ep, info):
        ref = PutReference(w, ep, info, layer_bytes, layers, src_copies, dst_copies, rewrite, batched, spin_s)
        try:
            yield ref
        finally:
            ref.close()


def measure_put(layer_bytes: int, layers: int, reps: int = 5, peer: tuple[dict, str] | None = None,
                batched: bool = False) -> dict:
    """Median GB/s of ``layers`` x (put ``layer_bytes`` + flush), between two processes: a peer started here,
    or ``peer`` (its info line and host), one already serving at least ``layer_bytes * layers``. The same
    source and destination every time: below a few MiB a request, they stay in cache (``PutReference``
    with a push's footprint does not). ``batched``: every put posted at once, with one flush after them all, as
    the sender posts a request's layers handed over together (each waited for from Python, one by one, costs a
    small layer about twice its put)."""
    with put_reference(layer_bytes, layers, peer=peer, batched=batched) as ref:
        rates = [ref.once() for _ in range(reps + 1)][1:]  # the first pass touches the remote pages
    return {"median_gbps": statistics.median(rates), "samples_gbps": rates}


def measure_put_rate(layer_bytes: int, slots: int = 32, count: int = 2000, windows: tuple[int, ...] = (1, 16),
                     reps: int = 5, peer: tuple[dict, str] | None = None) -> dict:
    """Puts of ``layer_bytes``, each with its own flush, posted by a native loop (``pdpush_native.put_loop``,
    no interpreter per put) into another process: median ops/s with ``window`` pairs in flight (1: back
    to back; more: pipelined, as the sender keeps many layers in flight). ``peer``: as ``measure_put``'s."""
    from pdpush.shm import array_at

    total = layer_bytes * slots
    with _peer(total) if peer is None else connected(*peer) as (w, ep, info):
        src, _, _ = w.alloc_shared(total)
        array_at(src.address, total)[:] = 1
        from pdpush_native import put_loop

        out = {}
        for window in windows:
            rates = []
            for _ in range(reps + 1):
                secs = put_loop(w.worker.handle, ep.handle, ep.rkey.handle, src.address, info["address"],
                                layer_bytes, slots, count, window, 60.0)
                rates.append(count / secs)
            out[window] = statistics.median(rates[1:])  # the first pass touches the remote pages
        src.close()
    return {"ops_per_s": out, "layer_bytes": layer_bytes}


class StagingRing:
    """Memory as the engine finds staging: a SysV segment (staging's kind of memory) of ``slots`` places of
    ``nbytes``, written in turn, so that what one is written into is not in this core's cache (the sender's
    staging is a ring of 1 GiB by default; a request's blocks follow the last ones round it, and the sender's
    put reads them from another core). ``footprint``: the ring's bytes at least (two places at most, where a
    request is that large itself)."""

    def __init__(self, nbytes: int, footprint: int = 64 << 20) -> None:
        from pdpush import shm

        self.nbytes, self.slots = nbytes, max(2, -(-footprint // nbytes))
        self._shmid, self._addr = shm.create_private(nbytes * self.slots)
        self.array = shm.array_at(self._addr, nbytes * self.slots)
        self.array[:] = 1  # faulted in, as the sender's staging is (shm.populate)
        self._next = 0

    def next(self) -> np.ndarray:
        """The next place's bytes."""
        k, self._next = self._next, (self._next + 1) % self.slots
        return self.array[k * self.nbytes:(k + 1) * self.nbytes]

    def close(self) -> None:
        from pdpush import shm

        self.array = None
        shm.detach(self._addr)


def paired_with_memcpy(write, nbytes: int, layers: int, reps: int) -> dict:
    """``write(place)`` (one request's layers into ``place``, ``nbytes`` in all) timed in a ``StagingRing``, each
    repetition paired with a memcpy of as many bytes layer by layer into the ring's place just before it:
    ``ratio`` is the median of the pairs' ratios, which a drift of this shared box's speed between two separate
    measurements (0.59x and 0.85x of memcpy at 1 MiB layers in two runs of one code) does not move."""
    return interleaved_with_memcpy({"write": write}, nbytes, layers, reps)["write"]


def interleaved_with_memcpy(writes: dict, nbytes: int, layers: int, reps: int,
                            streaming: dict[str, bool] | None = None) -> dict[str, dict]:
    """``paired_with_memcpy`` for several ways of writing the same bytes (``writes``: name -> write), taken in
    turn within each repetition, in an order rotated each time, each paired with its own memcpy just before it:
    the ways are compared in the same stretch of this box's speed, not one after the other. ``streaming``: the
    native copies' streaming stores on or off for a way (``_streaming``), set outside its clock."""
    ring = StagingRing(nbytes)
    src = np.ones(nbytes, dtype=np.uint8)
    per = nbytes // layers
    names = list(writes)
    rates: dict[str, list[float]] = {k: [] for k in names}
    mems: dict[str, list[float]] = {k: [] for k in names}
    try:
        for rep in range(reps + 1):
            turn = (rep - 1) % len(names)  # (the repetitions kept start at the first way)
            for name in names[turn:] + names[:turn]:
                b = ring.next()
                t = time.perf_counter()
                for layer in range(layers):
                    np.copyto(b[layer * per:(layer + 1) * per], src[layer * per:(layer + 1) * per])
                mems[name].append(nbytes / (time.perf_counter() - t) / 1e9)
                place = ring.next()
                was = _streaming(streaming[name]) if streaming and name in streaming else None
                try:
                    t = time.perf_counter()
                    writes[name](place)
                    rates[name].append(nbytes / (time.perf_counter() - t) / 1e9)
                finally:
                    if was is not None:
                        _streaming(was)
    finally:
        ring.close()
    out = {}
    for name in names:
        r, m = rates[name][1:], mems[name][1:]  # the first repetition warms up
        out[name] = {"median_gbps": statistics.median(r), "samples_gbps": r, "memcpy_gbps": statistics.median(m),
                     "ratio": statistics.median(x / y for x, y in zip(r, m, strict=True))}
    return out


def _streaming(on: bool) -> bool | None:
    """``pdpush_native._copy.set_streaming``, where the module has it: the previous setting."""
    from pdpush import kvcodec

    native = kvcodec._native()
    return native.set_streaming(on) if native is not None and hasattr(native, "set_streaming") else None


def measure_stage(layout, tokens: int, reps: int = 7) -> dict:
    """Median GB/s of the engine's staging copy (token-major ``[tokens, heads, D]`` components into head-major
    pages) of ``layout.layers`` layers, as ``PushHandle.put_layer`` does it: the request's plan made once
    (``kvcodec.stage_plan``, inside the clock), then ``kvcodec.stage_planned`` per layer, into a
    ``StagingRing``, paired with a memcpy of the same bytes (``paired_with_memcpy``). With streaming stores,
    what the engine does (``median_gbps``, ``ratio``), and with cached ones (``cached_gbps``, ``cached_ratio``)."""
    from pdpush import kvcodec
    from pdpush.layout import StagingShares

    n = layout.num_chunks(tokens)
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, (layout.layers, layout.components, tokens, layout.kv_heads, layout.row_bytes),
                       dtype=np.uint8)
    sh = StagingShares(layout, 1, 1, n)
    segs = kvcodec.segments([(0, 0, n)], tokens, layout.chunk_tokens)
    per = sh.share_bytes

    def write(place: np.ndarray) -> None:
        plan = kvcodec.stage_plan(sh, 0, segs)
        for layer in range(layout.layers):
            kvcodec.stage_planned(place[layer * per:(layer + 1) * per].reshape(sh.share_shape()), tuple(src[layer]),
                                  plan, stream=True)

    got = interleaved_with_memcpy({"streamed": write, "cached": write}, per * layout.layers, layout.layers, reps,
                                  streaming={"cached": False})
    cached = got["cached"]
    return {**got["streamed"], "cached_gbps": cached["median_gbps"], "cached_ratio": cached["ratio"]}


def measure_paged_stage(layout, tokens: int, slots: int = 32, reps: int = 5) -> dict:
    """Median GB/s of the vLLM connector's staging copy from paged blocks (CPU_ATTN's tiles: K
    dimension-major ``[D, N]``, V token-major, blocks scattered) into staging (a ``StagingRing``),
    ``layout.layers`` layers: one pass (``kvcodec.gather``, what the connector does, its table in the cache's
    memory order; ``ratio``: against a memcpy paired with each repetition) and, for comparison, the same in
    staging's order (``staging_order_*``) and the two passes it replaced (gather token-major rows, then
    ``kvcodec.stage``), the three taken in turn in each repetition (``interleaved_with_memcpy``)."""
    import torch

    from pdpush import kvcodec
    from pdpush.integrations import vllm_layout as vl
    from pdpush.layout import StagingShares

    if layout.kind != "mha" or layout.dtype not in ("bfloat16", "float16", "float32"):
        return {"error": f"the paged copy is measured for attention K/V in 16/32-bit floats, not {layout.kind} "
                         f"{layout.dtype}"}
    N, D, H = slots, layout.head_dim, layout.kv_heads
    d, n = torch.arange(D)[None, :], torch.arange(N)[:, None]
    maps = (d * N + n, N * D + n * D + d)  # the vec kernel's tile: K[n, d] at d * N + n, then V token-major
    paged = vl.PagedKV("CPU_ATTN", D, maps)
    blocks = -(-tokens // N)
    g = torch.Generator().manual_seed(3)
    dt = getattr(torch, layout.dtype)
    caches = [torch.randint(-100, 100, (2 * blocks, H, N, 2 * D), generator=g).to(dt) for _ in range(layout.layers)]
    order = torch.randperm(2 * blocks, generator=g)[:blocks].tolist()  # a request's blocks, scattered
    sm = vl.SlotMap(order, N, torch.arange(tokens), layout.chunk_tokens)
    blk, off = sm.addresses(N)
    chunks = layout.num_chunks(tokens)
    sh = StagingShares(layout, 1, 1, chunks)
    segs = kvcodec.segments([(0, 0, chunks)], tokens, layout.chunk_tokens, new_only=True)
    per = sh.share_bytes
    # in the cache's memory order, as the connector reads it (kvcodec.source_order)
    table = paged.rows(caches[0], blk, off, *kvcodec.share_rows(sh, 0, segs, H))
    base, sel, emap, dst_rows = kvcodec.source_order(*table)

    def layer_of(place: np.ndarray, layer: int) -> np.ndarray:
        return place[layer * per:(layer + 1) * per].reshape(sh.share_shape())

    def one_pass(place: np.ndarray) -> None:
        for layer, kv in enumerate(caches):
            kvcodec.gather(layer_of(place, layer), sh, vl.storage(kv), base, sel, emap, stream=True, dst_rows=dst_rows)

    def staging_order(place: np.ndarray) -> None:
        for layer, kv in enumerate(caches):
            kvcodec.gather(layer_of(place, layer), sh, vl.storage(kv), *table, stream=True)

    def two_pass(place: np.ndarray) -> None:
        for layer, kv in enumerate(caches):
            kvcodec.stage(layer_of(place, layer), paged.gather(kv, blk, off), sh, 0, segs)

    got = interleaved_with_memcpy({"one": one_pass, "two": two_pass, "staged": staging_order}, per * layout.layers,
                                  layout.layers, reps)
    one, two, staged = got["one"], got["two"], got["staged"]
    return {"one_pass_gbps": one["median_gbps"], "one_pass_ratio": one["ratio"], "memcpy_gbps": one["memcpy_gbps"],
            "two_pass_gbps": two["median_gbps"], "staging_order_gbps": staged["median_gbps"],
            "staging_order_ratio": staged["ratio"]}


def measure_two_copy(layer_bytes: int, layers: int, slots: int = 4, reps: int = 3, ring_bytes: int = 0,
                     dst_copies: int = 1) -> dict:
    """The one-host limit of an end-to-end push, with no pdpush code: a copier process memcpys each layer
    into a staging slot, this process puts it (native ``put_loop``, one put and its flush) into a peer
    process, pipelined over ``slots`` slots in flight; pipes say which slot is full and that one is free again.
    Every byte is copied twice, as on this host pdpush copies it twice. Median GB/s.

    A push's footprint: the slots advance through a ring of ``ring_bytes`` (the sender's staging, which the
    engine writes block after block), and each request goes to the next of ``dst_copies`` places in the peer
    (the receiver's pool, request after request). Four slots written again and again stay in this core's
    cache, which a push's staging never does."""
    copier = None
    ring_slots = max(slots, ring_bytes // layer_bytes)
    req = layer_bytes * layers
    with _peer(req * dst_copies) as (w, ep, info):
        staging, shmid, _ = w.alloc_shared(layer_bytes * ring_slots)
        from pdpush_native import put_loop

        full_r, full_w = os.pipe()
        free_r, free_w = os.pipe()
        copier = subprocess.Popen([sys.executable, "-m", "pdpush_tools.bench.ceiling", "copier", str(shmid),
                                   str(layer_bytes), str(layers), str(slots), str(ring_slots),
                                   str(reps + dst_copies), str(full_w), str(free_r)], pass_fds=(full_w, free_r),
                                  env=_env(), preexec_fn=die_with_parent)
        os.close(full_w)
        os.close(free_r)
        full, free = os.fdopen(full_r, "rb", buffering=0), os.fdopen(free_w, "wb", buffering=0)
        rates = []
        try:
            for n in range(reps + dst_copies):
                dst = info["address"] + (n % dst_copies) * req
                t = time.perf_counter()
                for layer in range(layers):
                    slot = int.from_bytes(_read_exactly(full, 4), "little")  # the copier has filled it
                    put_loop(w.worker.handle, ep.handle, ep.rkey.handle, staging.address + slot * layer_bytes,
                             dst + layer * layer_bytes, layer_bytes, 1, 1, 1, 60.0)
                    free.write(b"\x01")
                rates.append(req / (time.perf_counter() - t) / 1e9)
        finally:
            full.close()
            free.close()
            _stop(copier)
        staging.close()
    rates = rates[dst_copies:]  # the first pass over each place in the peer faults its pages in
    return {"median_gbps": statistics.median(rates), "samples_gbps": rates, "slots": slots, "ring_slots": ring_slots,
            "dst_copies": dst_copies}


def _read_exactly(f, n: int) -> bytes:
    b = f.read(n)
    while len(b) < n:
        more = f.read(n - len(b))
        if not more:
            raise EOFError("measure_two_copy's copier stopped")
        b += more
    return b


def _copier(shmid: int, layer_bytes: int, layers: int, slots: int, ring_slots: int, passes: int, full_fd: int,
            free_fd: int) -> None:
    """measure_two_copy's copier: each layer's bytes into the ring's next slot once the putter is at most
    ``slots`` behind, then say which."""
    from pdpush.shm import Attached

    st = Attached(shmid, layer_bytes * ring_slots)
    src = np.frombuffer(np.random.default_rng(1).bytes(layer_bytes * layers), dtype=np.uint8)
    full, free = os.fdopen(full_fd, "wb", buffering=0), os.fdopen(free_fd, "rb", buffering=0)
    n = 0
    for _ in range(passes):
        for layer in range(layers):
            slot = n % ring_slots
            if n >= slots:
                free.read(1)  # the putter is done with the oldest slot in flight
            np.copyto(st.array[slot * layer_bytes:(slot + 1) * layer_bytes],
                      src[layer * layer_bytes:(layer + 1) * layer_bytes])
            full.write(slot.to_bytes(4, "little"))
            n += 1
    for _ in range(min(n, slots)):  # the putter frees every slot: take the last ones before leaving
        free.read(1)
    st.close()


def measure_memcpy(layer_bytes: int, layers: int, reps: int = 5) -> dict:
    a = np.ones(layer_bytes * layers, dtype=np.uint8)
    b = np.empty_like(a)
    rates = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        for layer in range(layers):
            s = slice(layer * layer_bytes, (layer + 1) * layer_bytes)
            np.copyto(b[s], a[s])
        rates.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    rates = rates[1:]
    return {"median_gbps": statistics.median(rates), "samples_gbps": rates}



if __name__ == "__main__" and sys.argv[1:2] == ["copier"]:
    _copier(*(int(x) for x in sys.argv[2:10]))
