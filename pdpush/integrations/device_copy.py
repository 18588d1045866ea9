"""Copies between an engine's GPU KV and pdpush's host memory, on side CUDA streams (imports torch).

Prefill: ``D2HStager.put_layer`` runs where the forward produces a layer. On CUDA it records an
event on the compute stream, and on a side stream waits for that event, rearranges the layer's new
chunks into staging's order on the device (``staging_order``), copies them into the sender's
staging (page-locked in this process) and records a second event. The forward does not wait for
any of it. The layer is handed to the sender only once that second event has completed
(``pdpush.handover`` decides which and in what order):

* ``thread`` (the default on CUDA): a completion thread waits on the oldest copy's event and posts
  each finished layer at once (``PushHandle.post_layers_ready``), while the forward goes on.
* ``poll``: the engine's own thread hands over whatever has completed each time it stages a layer,
  and the rest when it waits.

``wait(handle, timeout_s)`` (a connector's ``wait_for_save``, the transformers finish) returns once
every copy of the request has been handed over, or raises ``HandOverTimeout`` at its deadline and
gives the request up. Tensors a copy reads are kept referenced until its event has completed, so
the caching allocator cannot hand their memory to later compute while the copy still reads it.

Decode: ``H2DLoader`` copies a request's pages of one layer from the pool (page-locked in this
process) to the device on a side stream; ``finish`` makes the compute stream wait on the copy's
event (no host wait) and returns the layer token-major, ``[tokens, heads, D]``.

CPU fallback: with a CPU device nothing here touches CUDA. ``D2HStager`` in ``sync`` mode (the CPU
default) is ``PushHandle.put_layer``; ``thread`` and ``poll`` still run their hand-over logic on
the CPU with copies that are complete at once (or fences a test controls).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch

from pdpush.errors import ConfigError, HandOverTimeout, PdpushError
from pdpush.handover import HandOverQueue

log = logging.getLogger("pdpush.device_copy")

MODES = ("sync", "poll", "thread")
_TORCH_STORAGE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def host_tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch view of a staging or pool array (numpy storage dtype; bfloat16 is stored as uint16)."""
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def chunk_token_index(tokens: int, chunk_tokens: int, new_chunks: list[int], device) -> torch.Tensor:
    """The prompt positions of the new chunks' tokens, in staging order."""
    idx = [torch.arange(c * chunk_tokens, min(tokens, (c + 1) * chunk_tokens)) for c in new_chunks]
    return torch.cat(idx).to(device) if idx else torch.empty(0, dtype=torch.int64, device=device)


def staging_order(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, n_chunks: int, chunk_tokens: int,
                  units: int) -> torch.Tensor:
    """``k``, ``v`` ``[tokens, heads, D]`` (one rank's heads) -> ``[units, n_chunks, heads/units, 2, T, D]``,
    staging's order (layout.StagingShares), on their device. ``index`` (``chunk_token_index``) picks
    the new chunks' tokens; the tail of a partial last chunk is left unwritten, as on the host path."""
    h, d = k.shape[1], k.shape[2]
    out = k.new_empty(n_chunks * chunk_tokens, 2, h, d)
    m = index.numel()
    out[:m, 0] = k.index_select(0, index)
    out[:m, 1] = v.index_select(0, index)
    return out.view(n_chunks, chunk_tokens, 2, units, h // units, d).permute(3, 0, 4, 2, 1, 5).contiguous()


class _Done:
    """The fence of a copy that is complete when it returns (CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class D2HStager:
    """Layers from the device into the sender's staging, handed over as their copies complete."""

    def __init__(self, device: torch.device | str, *, mode: str | None = None, timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, fence: Callable[[], Any] | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.mode = mode or ("thread" if self.cuda else "sync")
        if self.mode not in MODES:
            raise ConfigError(f"hand-over mode {self.mode!r}: choose one of {MODES}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._fence = fence  # tests: a fence factory standing in for CUDA events on the CPU
        self._queue = HandOverQueue(timeout_s)
        self._cv = threading.Condition()
        self._failed: dict[Hashable, PdpushError] = {}
        self._index: dict[Hashable, torch.Tensor] = {}
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        # (req_id, layer, clock) of recent hand-overs, for measurements
        self.handed_over: deque[tuple[str, int, float]] = deque(maxlen=4096)
        self._stop = False
        self._thread: threading.Thread | None = None
        if self.mode == "thread":
            self._thread = threading.Thread(target=self._run, name="pdpush-d2h", daemon=True)
            self._thread.start()

    # ---- the engine's thread ----
    def put_layer(self, handle, layer: int, k: torch.Tensor | Callable[[], tuple[torch.Tensor, torch.Tensor]],
                  v: torch.Tensor | None = None, *, new_only: bool = False) -> None:
        """Stage layer ``layer`` and hand it over once copied; never waits for the copy.

        ``k``, ``v``: ``[tokens, heads, D]`` on the device, this rank's heads or all the model's; every
        prompt token, or with ``new_only`` exactly the new chunks' tokens in order. ``k`` may instead be
        a function returning ``(k, v)`` (``v`` None): a gather out of a paged cache, run on the side
        stream after the compute, so that the compute stream never runs it."""
        if self.mode == "sync" and v is not None and not new_only:
            handle.put_layer(layer, k, v)
            self.handed_over.append((handle.req_id, layer, self._clock()))
            return
        self._raise_failed(handle)
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                k, v, dst, src = self._stage(handle, layer, k, v, new_only)
                if src is not None:
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event(blocking=self.mode == "thread")
                done.record(self._stream)
            keep: Any = (k, v, src)
        else:
            k, v, dst, src = self._stage(handle, layer, k, v, new_only)
            if src is not None:
                dst.copy_(src)
            done, keep = (self._fence() if self._fence else _Done()), None
        with self._cv:
            self._queue.submit(handle, layer, done, self._clock(), keep)
            self._cv.notify_all()
        if self.mode != "thread":
            self._hand_over(post=False)

    def _stage(self, handle, layer: int, k, v, new_only: bool):
        """(k, v, staging view, the layer in staging's order on the device or None if nothing is new)."""
        if v is None:
            k, v = k()
        lay = handle.client.layout
        h0, h1 = handle.heads
        if k.shape[1] == lay.kv_heads and h1 - h0 != lay.kv_heads:
            k, v = k[:, h0:h1], v[:, h0:h1]
        if handle not in self._index:
            idx = (torch.arange(sum(min(handle.tokens, (c + 1) * lay.chunk_tokens) - c * lay.chunk_tokens
                                    for c in handle.new_chunk_indexes), device=k.device) if new_only else
                   chunk_token_index(handle.tokens, lay.chunk_tokens, handle.new_chunk_indexes, k.device))
            self._index[handle] = idx
            if self.mode == "thread":
                handle.client._conn.allow_posts()
        index = self._index[handle]
        need = index.numel() if new_only else handle.tokens
        if k.shape[1] != h1 - h0 or v.shape[1] != h1 - h0 or min(k.shape[0], v.shape[0]) < need:
            raise ValueError(f"layer {layer}: got K {tuple(k.shape)}, V {tuple(v.shape)}; rank {handle.tp_rank} "
                             f"needs {need} tokens x {h1 - h0} heads")
        dst = host_tensor(handle.staging_layer(layer), lay.dtype)
        n = len(handle.new_chunk_indexes)
        src = staging_order(k, v, index, n, lay.chunk_tokens, dst.shape[0]).to(dst.dtype) if n else None
        return k, v, dst, src

    def wait(self, handle, timeout_s: float | None = None) -> None:
        """Return once every copy of ``handle`` has been handed over. Raises ``HandOverTimeout`` at the
        deadline (the request is then given up here: ``handle.abort``), or the hand-over's own error."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = self._clock() + limit
        try:
            while True:
                if self.mode != "thread":
                    self._hand_over(post=False)
                with self._cv:
                    self._raise_failed(handle)
                    left = self._queue.pending(handle)
                    if not left:
                        return
                    if self._clock() >= deadline:
                        self._queue.drop(handle)
                        raise HandOverTimeout(f"request {handle.req_id!r}: {left} layer copies did not complete "
                                              f"in {limit:.1f} s",
                                              req_id=handle.req_id)
                    if self.mode == "thread":
                        self._cv.wait(min(0.05, max(0.0, deadline - self._clock())))
                        continue
                    head = self._queue.head()
                if head is not None and hasattr(head.fence, "synchronize") and self.cuda:
                    head.fence.synchronize()  # the oldest copy: poll mode's host wait
                else:
                    time.sleep(0.0002)
        except HandOverTimeout:
            handle.abort("device-to-host copies timed out")
            raise
        finally:
            if not self._queue.pending(handle):
                self._index.pop(handle, None)

    def drop(self, handle) -> None:
        """Give ``handle`` up here: its copies are never handed over."""
        with self._cv:
            self._queue.drop(handle)
            self._failed.pop(handle, None)
            self._index.pop(handle, None)

    def pending(self, handle=None) -> int:
        with self._cv:
            return self._queue.pending(handle)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---- hand-over (the completion thread, or the engine's thread in poll mode) ----
    def _raise_failed(self, handle) -> None:
        err = self._failed.pop(handle, None)
        if err is not None:
            self._index.pop(handle, None)
            raise err

    def _hand_over(self, post: bool) -> int:
        with self._cv:
            ready = self._queue.ready()
            now = self._clock()
            for req in self._queue.overdue(now):
                self._queue.drop(req)
                self._failed[req] = HandOverTimeout(
                    f"request {req.req_id!r}: a layer copy did not complete in {self.timeout_s:.1f} s",
                    req_id=req.req_id)
            # consecutive layers of one request go in one message
            groups: list[tuple[Any, list[int]]] = []
            for c in ready:
                if groups and groups[-1][0] is c.request:
                    groups[-1][1].append(c.layer)
                else:
                    groups.append((c.request, [c.layer]))
            for handle, layers in groups:
                if handle in self._failed:
                    continue
                try:
                    (handle.post_layers_ready if post else handle.layers_ready)(layers)
                except PdpushError as e:
                    self._failed[handle] = e
                    self._queue.drop(handle)
                    continue
                except ValueError as e:  # a layer handed over twice: the engine's bug, reported on its thread
                    self._failed[handle] = PdpushError(str(e))
                    self._queue.drop(handle)
                    continue
                self.handed_over.extend((handle.req_id, la, now) for la in layers)
            if ready:
                self._cv.notify_all()
            return len(ready)

    def _run(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)  # this thread's events and waits are on the engine's device
        while True:
            with self._cv:
                while not self._stop and self._queue.head() is None:
                    self._cv.wait()
                if self._stop:
                    return
                head = self._queue.head()
            try:
                if not head.fence.query():
                    sync = getattr(head.fence, "synchronize", None)
                    if sync is not None:
                        sync()  # releases the GIL; a blocking event sleeps rather than spins
                    else:
                        time.sleep(0.0002)
                self._hand_over(post=True)
            except Exception:  # noqa: BLE001 - the thread must outlive one bad request
                log.exception("pdpush: device-to-host hand-over")
                time.sleep(0.01)


class H2DLoader:
    """One layer of an opened request from the pool to the device, on a side stream."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None

    def start(self, req, layer: int, timeout_s: float | None = None):
        """Wait for ``layer`` to land, then start copying this rank's heads of the request's pages to
        the device: ``[chunks, heads, 2, T, D]``. Returns a ticket for ``finish``."""
        lay = req.layout
        parts = [host_tensor(view, lay.dtype) for _, view in req.layer_shards(layer, timeout_s=timeout_s)]
        heads = sum(p.shape[1] for p in parts)
        n = len(req.pages)
        if not self.cuda:
            pages = torch.as_tensor(req.pages, dtype=torch.int64)
            return torch.cat([p[pages] for p in parts], 1), None
        dst = torch.empty((n, heads, 2, lay.chunk_tokens, lay.head_dim), dtype=parts[0].dtype, device=self.device)
        with torch.cuda.stream(self._stream):
            at = 0
            for p in parts:
                k = p.shape[1]
                for j, first, m in req.page_runs:  # one copy per run of consecutive pages (usually one)
                    dst[j:j + m, at:at + k].copy_(p[first:first + m], non_blocking=True)
                at += k
            done = torch.cuda.Event()
            done.record(self._stream)
        return dst, done

    def ready(self, ticket) -> torch.Tensor:
        """The copied pages ``[chunks, heads, 2, T, D]``, for use on the current stream: it waits on the
        copy's event (the host does not), and the pages' memory is kept until that stream is done with it."""
        pages, done = ticket
        if done is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(done)
            pages.record_stream(cur)  # allocated on the side stream, read on this one
        return pages

    def finish(self, ticket, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[tokens, heads, D]`` on the device, ordered after the copy on the current stream."""
        pages = self.ready(ticket)
        kv = pages.permute(2, 0, 3, 1, 4).reshape(2, -1, pages.shape[1], pages.shape[-1])[:, :tokens]
        return kv[0].contiguous(), kv[1].contiguous()
