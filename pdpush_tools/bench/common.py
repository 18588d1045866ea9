"""Shared pieces of the benchmarks: synthetic KV, and one timed request through the real daemons.

The decode side runs in a thread with its own DecodeClient and records when each
layer becomes visible; the prefill side can emulate per-layer compute with a
sleep (a GPU's compute costs the host no CPU) and push pipelined or eager.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

from pdpush.client import DecodeClient, PrefillClient, WaitPolicy
from pdpush.errors import PdpushError
from pdpush.launch import die_with_parent
from pdpush.layout import KVLayout


def child(target, *args) -> None:
    """A benchmark's engine process (the target of a multiprocessing ``spawn`` Process): it dies with the bench, so
    a bench that is itself killed (the OOM killer, say) leaves no engine holding gigabytes behind. Then
    ``target(*args)``."""
    import multiprocessing as mp

    bench = mp.parent_process()
    die_with_parent(signal.SIGKILL)
    if bench is not None and os.getppid() != bench.pid:  # the bench died before the request took effect
        os._exit(128 + signal.SIGKILL)
    target(*args)


class Source:
    """Synthetic KV for one request: random bytes, ``[layers, tokens, H, D*dtype]`` per component of the
    layout (K and V, or an MLA latent)."""

    def __init__(self, layout: KVLayout, token_ids: list[int], rng: np.random.Generator,
                 prefix_of: Source | None = None, shared_tokens: int = 0) -> None:
        self.token_ids = token_ids
        n = len(token_ids)
        shape = (layout.layers, n, layout.kv_heads, layout.row_bytes)
        size = int(np.prod(shape))
        self.comps = [np.frombuffer(rng.bytes(size), dtype=np.uint8).reshape(shape).copy()
                      for _ in range(layout.components)]
        if prefix_of is not None and shared_tokens:  # same prefix -> same KV, as a real model would give
            for c, p in zip(self.comps, prefix_of.comps, strict=True):
                c[:, :shared_tokens] = p[:, :shared_tokens]

    def layer(self, layer: int) -> list[np.ndarray]:
        """The components of one layer, as ``put_layer`` takes them."""
        return [c[layer] for c in self.comps]


class LazySource:
    """Synthetic KV for one request made a layer at a time from its seed, the same bytes every time: an engine with
    many requests in flight holds one layer of one at once, not all of them (``Source`` holds every layer)."""

    def __init__(self, layout: KVLayout, token_ids: list[int], seed: int) -> None:
        self.layout, self.token_ids, self.seed = layout, token_ids, seed

    def layer(self, layer: int) -> list[np.ndarray]:
        lay = self.layout
        rng = np.random.default_rng((self.seed, layer))
        shape = (len(self.token_ids), lay.kv_heads, lay.row_bytes)
        size = int(np.prod(shape))
        return [np.frombuffer(rng.bytes(size), dtype=np.uint8).reshape(shape) for _ in range(lay.components)]


class StampedSource:
    """Synthetic KV for one request made a layer at a time, cheap to make and to make again for the check: a copy of
    one of ``BASES`` random layers (made once per process for the request's shape: random bytes come at ~1 GB/s here,
    a copy at ~4), with the first 8 bytes of every token's row of every head replaced by a stamp of the request's
    seed and the layer, so that a page of another request or another layer never passes for this one. Where engines
    made every layer with ``LazySource``, the random bytes, not pdpush, bounded a stream at ~1 GB/s."""

    BASES = 4
    _bases: dict[tuple, list[list[np.ndarray]]] = {}

    def __init__(self, layout: KVLayout, token_ids: list[int], seed: int) -> None:
        self.layout, self.token_ids, self.seed = layout, token_ids, seed

    def layer(self, layer: int) -> list[np.ndarray]:
        lay = self.layout
        shape = (len(self.token_ids), lay.kv_heads, lay.row_bytes)
        key = (shape, lay.components)
        if key not in self._bases:
            rng = np.random.default_rng(7)
            size = int(np.prod(shape))
            self._bases[key] = [[np.frombuffer(rng.bytes(size), dtype=np.uint8).reshape(shape)
                                 for _ in range(lay.components)] for _ in range(self.BASES)]
        base = self._bases[key][(self.seed * 7 + layer) % self.BASES]
        # the seed and the layer mixed into all 8 bytes (odd multipliers: each alone is one to one), so that even a
        # row of under 8 bytes keeps some of both
        mixed = (self.seed * 0x9E3779B97F4A7C15 ^ layer * 0xC2B2AE3D27D4EB4F) & (1 << 64) - 1
        stamp = np.frombuffer(np.uint64(mixed).tobytes(), np.uint8)
        n = min(8, lay.row_bytes)
        out = []
        for c, b in enumerate(base):
            a = b.copy()
            a[:, :, :n] = stamp[:n] ^ np.uint8(c)  # (each component its own)
            out.append(a)
        return out


def verify(req, src: Source | LazySource | StampedSource, layout: KVLayout) -> bool:
    """Every byte of the request's heads (all of them, or a decode rank's) equals the source's."""
    h0, h1 = req.heads
    for layer in range(layout.layers):
        got = req.kv_bytes(layer, wait=True)
        if not all(np.array_equal(g, w[:, h0:h1]) for g, w in zip(got, src.layer(layer), strict=True)):
            return False
    return True


# The bench's decode side: it re-reads the last layer's readiness words every 50 us (a sleep, which leaves the GIL
# and a core to the engine thread beside it), so a request's clock stops within ~50 us of its last layer landing.
# The default wait (client.WaitPolicy) trades up to ~1 ms of that for CPU: the decode_wait scenario measures it.
OBSERVER = WaitPolicy(spin_s=0.0, nap_s=50e-6, nap_window_s=3600.0)
# Until the last layer is near, ``watch_layers`` looks every millisecond instead. A 50 us nap wakes ~7,000 times a
# second here, each wake ~24 us of CPU (17% of a core): through a whole request that took ~10% of this 2-core box
# from the engine's copy and the sender's puts (4 MiB layers, 2026-12-05: end to end 4.73 GB/s against 5.23 with
# every layer watched every millisecond; the two-copy reference, which has no observer, 6.53 and 6.47 in the same
# runs). "Near": the bytes still to come would take under NEAR_LOOKS looks at the pace the layers have landed so
# far, taken FASTER times faster (at first, when no pace is known yet, at FASTEST_BPS, above any copy on these
# hosts: memcpy is 7-14 GB/s here). A look that comes late only makes pdpush's time longer.
EARLY_LOOK_S = 1e-3
NEAR_LOOKS = 3
FASTER = 1.5
FASTEST_BPS = 25e9


def watch_layers(req, deadline: float) -> list[float]:
    """Wait for every layer of the decode request ``req`` in order, the one near the end by the client's policy
    (above); when each was seen."""
    layers = req.layout.layers  # what push_one pushes and verify checks
    left = [sum(req.plan.layer_bytes(la) for la in range(first, layers)) for first in range(layers)]
    seen: list[float] = []
    for layer in range(layers):
        while not req.landed(layer):
            pace = FASTEST_BPS
            if len(seen) >= 2 and seen[-1] - seen[0] >= 2 * EARLY_LOOK_S and left[1] > left[len(seen)]:
                pace = min(FASTEST_BPS, FASTER * (left[1] - left[len(seen)]) / (seen[-1] - seen[0]))
            if layer == layers - 1 or left[layer] / pace <= NEAR_LOOKS * EARLY_LOOK_S:
                req.wait_layer(layer, timeout_s=max(0.0, deadline - time.monotonic()))
                break
            if req.poll_committed() or time.monotonic() > deadline:  # (raises the push's failure)
                req.wait_layer(layer, timeout_s=0)
                break
            time.sleep(EARLY_LOOK_S)
        seen.append(time.perf_counter())
    return seen


# A decode side that spins on the readiness words (``push_handed_over``): the clock stops when they land.
SPIN = WaitPolicy(spin_s=60.0)


def push_handed_over(pc: PrefillClient, dc: DecodeClient, req_id: str, src: Source, layout: KVLayout) -> dict:
    """Transport only, timed in one thread: every layer staged first (as a GPU's D2H DMA leaves them), then
    handed over at once, and the same thread waits for each layer on the decode side (``dc``: its policy, a
    spin for ``SPIN``). The hand-over does not block, so nothing else is on the clock: no second thread's GIL
    switching or naps (``push_one``'s decode side). Every byte is checked after. Times are perf_counter
    seconds: ``seconds`` from the hand-over to the last layer seen."""
    h = pc.begin(req_id, src.token_ids)
    try:
        req = dc.open(req_id)
        try:
            for layer in range(layout.layers):
                h.stage_layer(layer, *src.layer(layer))
            t0 = time.perf_counter()
            h.layers_ready(list(range(layout.layers)))
            for layer in range(layout.layers):
                req.wait_layer(layer)
            t1 = time.perf_counter()
            done = h.finish()
            req.wait_committed()
            ok = verify(req, src, layout)
        finally:
            req.release()
    except BaseException:
        h.abort("the bench's request failed")  # (nothing, where it finished)
        raise
    return {"req_id": req_id, "seconds": t1 - t0, "bytes_sent": done.bytes_sent,
            "goodput_gbps": done.bytes_sent / (t1 - t0) / 1e9, "verified": ok}


def push_one(pc: PrefillClient, dc: DecodeClient, req_id: str, src: Source, layout: KVLayout, *,
             compute_s: float = 0.0, pipelined: bool = True, check: bool = True, prestaged: bool = False) -> dict:
    """Push one request; the decode side verifies every byte. Times are monotonic seconds.

    ``prestaged``: the engine's output is already in staging before the clock starts (as a GPU's
    D2H DMA into the staging memory would leave it, at no host CPU cost); the clock then measures
    only the transport: hand-over -> sender put -> receiver -> visible on the decode side.
    """
    seen: dict = {"arrivals": []}

    def decode_side() -> None:
        try:
            req = dc.open(req_id, timeout_s=60)
            seen["arrivals"] = watch_layers(req, time.monotonic() + 60)
            req.wait_committed(60)
            seen["verified"] = verify(req, src, layout) if check else None
            req.release()
        except PdpushError as e:
            seen["error"] = f"{type(e).__name__}: {e}"

    th = threading.Thread(target=decode_side, daemon=True)
    th.start()
    t0 = time.perf_counter()
    h = pc.begin(req_id, src.token_ids)
    t_begun = time.perf_counter()  # the begin answered: a begin made ahead (at scheduling time) is over by now
    copy_s = 0.0
    layer_end = []
    if prestaged:
        for layer in range(layout.layers):
            h.stage_layer(layer, *src.layer(layer))
        t0 = t_begun = time.perf_counter()
        h.layers_ready(list(range(layout.layers)))  # all at once, as a DMA that finished would hand them over
        layer_end = [t0] * layout.layers
        pipelined = None  # nothing left to hand over
    for layer in range(layout.layers if pipelined is not None else 0):
        if compute_s:
            time.sleep(compute_s)  # emulated GPU compute of this layer
        layer_end.append(time.perf_counter())
        if pipelined:
            t = time.perf_counter()
            h.put_layer(layer, *src.layer(layer))
            copy_s += time.perf_counter() - t
    t_end = layer_end[-1]  # prefill compute is over; what the decode side still waits for is exposed
    if pipelined is False:
        for layer in range(layout.layers):
            t = time.perf_counter()
            h.put_layer(layer, *src.layer(layer))
            copy_s += time.perf_counter() - t
    done = h.finish(timeout_s=60)
    th.join(120)
    if "error" in seen or th.is_alive():
        raise PdpushError(f"decode side of {req_id}: {seen.get('error', 'timed out')}")
    t_vis = seen["arrivals"][-1]
    return {"req_id": req_id, "bytes_sent": done.bytes_sent, "puts": done.puts, "chunks_skipped": done.chunks_skipped,
            "seconds": t_vis - t0, "goodput_gbps": done.bytes_sent / (t_vis - t0) / 1e9 if done.bytes_sent else 0.0,
            "begin_s": t_begun - t0,
            "begun_goodput_gbps": done.bytes_sent / (t_vis - t_begun) / 1e9 if done.bytes_sent else 0.0,
            "exposed_s": t_vis - t_end, "client_copy_s": copy_s, "layer_end": layer_end,
            "arrivals": seen["arrivals"], "verified": seen.get("verified")}
