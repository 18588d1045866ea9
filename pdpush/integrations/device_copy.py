"""Copies between an engine's GPU KV and pdpush's host memory, on side CUDA streams (imports torch).

Prefill: ``D2HStager.put_layer`` runs where the forward produces a layer. On CUDA it records an
event on the compute stream, and on a side stream waits for that event, rearranges the layer's new
chunks into staging's order on the device (``kvcodec.stage``), copies them into the sender's
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
event (no host wait) and returns the layer token-major, ``[tokens, heads, D]`` per component.

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

import torch

from pdpush import kvcodec
from pdpush.errors import ConfigError, HandOverTimeout, PdpushError
from pdpush.handover import HandOverQueue
from pdpush.layout import runs

log = logging.getLogger("pdpush.device_copy")

MODES = ("sync", "poll", "thread")

class _Done:
    """The fence of a copy that is complete when it returns (CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


QUIESCE_S = 2.0  # poll and sync modes: how long a failed request's Abort waits for its copies (then none is sent)

class D2HStager:
    """Layers from the device into the sender's staging, handed over as their copies complete."""

    def __init__(self, device: torch.device | str, *, mode: str | None = None, timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, fence: Callable[[], Any] | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # "cuda": the current one (the completion thread sets it by index)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.mode = mode or ("thread" if self.cuda else "sync")
        if self.mode not in MODES:
            raise ConfigError(f"hand-over mode {self.mode!r}: choose one of {MODES}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._fence = fence  # tests: a fence factory standing in for CUDA events on the CPU
        self._queue = HandOverQueue(timeout_s)
        self._cv = threading.Condition()
        self._failed: dict[Hashable, PdpushError] = {}
        self._after: dict[Hashable, list[Callable[[], None]]] = {}  # handle -> what waits for its copies to end
        self._index: dict[Hashable, bool] = {}  # handle -> its staging takes only new tokens
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        # (req_id, layer, clock) of recent hand-overs, for measurements
        self.handed_over: deque[tuple[str, int, float]] = deque(maxlen=4096)
        self._stop = False
        self._dead = ""  # why the completion thread stopped, where it did without being asked
        self._thread: threading.Thread | None = None
        if self.mode == "thread":
            self._thread = threading.Thread(target=self._run, name="pdpush-d2h", daemon=True)
            self._thread.start()

    # ---- the engine's thread ----
    def put_layer(self, handle, layer: int, *comps: torch.Tensor | Callable[[], tuple[torch.Tensor, ...]],
                  new_only: bool = False) -> None:
        """Stage layer ``layer`` and hand it over once copied; never waits for the copy.

        ``comps``: the layout's components (K and V, or an MLA latent), ``[tokens, heads, D]`` on the
        device, this rank's heads or all the model's; every prompt token, or with ``new_only`` exactly
        the new chunks' tokens in order. Or one function returning them: a gather out of a paged cache,
        run on the side stream after the compute, so that the compute stream never runs it."""
        if self.mode == "sync" and not callable(comps[0]) and not new_only:
            handle.put_layer(layer, *comps)
            self.handed_over.append((handle.req_id, layer, self._clock()))
            return
        self._raise_failed(handle)
        given = comps  # (a gather's function holds its index tensors: kept with the copy, which reads them)
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                comps, dst, src = self._stage(handle, layer, comps, new_only)
                if src is not None:
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event(blocking=self.mode == "thread")
                done.record(self._stream)
            keep: Any = (given, comps, src)  # until the copy completes: freed before, the allocator hands
            # their memory to the compute stream, which overwrites it while the side stream still reads it
        else:
            comps, dst, src = self._stage(handle, layer, comps, new_only)
            if src is not None:
                dst.copy_(src)
            done, keep = (self._fence() if self._fence else _Done()), None
        with self._cv:
            self._queue.submit(handle, layer, done, self._clock(), keep)
            self._cv.notify_all()
        if self.mode != "thread":
            self._hand_over(post=False)

    def _stage(self, handle, layer: int, comps, new_only: bool):
        """(the components, the staging view, the layer in staging's order on the device, or None if
        nothing is new): ``kvcodec.stage`` runs on the components' device."""
        if callable(comps[0]):
            comps = tuple(comps[0]())
        if handle not in self._index:
            self._index[handle] = new_only
            handle.after_writes = lambda fn, handle=handle: self.after_writes(handle, fn)  # its Abort waits
            if self.mode == "thread":
                handle.client._conn.allow_posts()
            else:  # a Begin of its id again, while its Abort waits for copies, hands over those that ended
                handle.progress = lambda: self._hand_over(post=False)
        if self.mode != "thread" and not handle.granted(layer):
            self._settle()  # this thread hands copies over: those queued must go, their blocks come back
        dst = torch.from_numpy(handle.staging_layer(layer)).view(-1)
        if not handle.new_chunks(layer):
            return comps, dst, None
        src = torch.empty(dst.numel(), dtype=torch.uint8, device=comps[0].device)
        try:
            kvcodec.stage(src, comps, handle.layer_shares(layer), handle.tp_rank,
                          handle.layer_segments(layer, self._index[handle]))
        except ValueError as e:
            raise ValueError(f"layer {layer}: rank {handle.tp_rank}: {e}") from None
        return comps, dst, src

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
                        if self._dead:
                            self._queue.drop(handle)
                            raise HandOverTimeout(f"request {handle.req_id!r}: {self._dead}", req_id=handle.req_id)
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
            with self._cv:  # (the completion thread pops the queue meanwhile)
                if not self._queue.pending(handle):
                    self._index.pop(handle, None)

    def _settle(self) -> None:
        """Poll and sync modes: wait for every queued copy and hand it over (bounded by ``timeout_s``), before
        this thread waits for a staging block that those copies' layers may be holding."""
        deadline = self._clock() + self.timeout_s
        while True:
            self._hand_over(post=False)
            with self._cv:
                head = self._queue.head() if self._queue.pending() else None
            if head is None or self._clock() >= deadline:
                return
            if self.cuda and hasattr(head.fence, "synchronize"):
                head.fence.synchronize()
            else:
                time.sleep(0.0002)

    def after_writes(self, handle, fn: Callable[[], None]) -> None:
        """Call ``fn`` (the request's Abort) once none of ``handle``'s copies still writes its staging, dropped ones
        too: at once if none does. The Abort tells the sender that this engine has stopped writing that staging,
        which the sender then grants to other requests: a copy still queued on the side stream would write into
        theirs. Thread mode: the completion thread calls it when the last one ends, and the engine's thread goes on
        meanwhile. Poll and sync modes: this thread waits for them, up to ``QUIESCE_S``; copies that have not ended
        by then send it from a later hand-over, once they have (until then the sender keeps the blocks, up to the
        request's lease)."""
        with self._cv:
            threaded = self.mode == "thread" and not self._dead  # (a thread that could not start sends none)
            if threaded and self._queue.running(handle) is not None:
                self._after.setdefault(handle, []).append(fn)
                self._cv.notify_all()
                return
        if threaded or self.quiesce(handle, min(self.timeout_s, QUIESCE_S)):
            fn()
            return
        with self._cv:
            self._after.setdefault(handle, []).append(fn)

    def quiesce(self, handle, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``handle``'s copies still writing its staging (dropped ones too): True once
        none is. Its Abort tells the sender that this engine has stopped writing that staging, which the sender
        then grants to other requests: a copy still queued on the side stream would write into theirs."""
        return self.quiesce_where(lambda h: h == handle, timeout_s)

    def quiesce_where(self, match: Callable[[Any], bool], timeout_s: float) -> bool:
        """``quiesce`` for the copies of every request ``match`` picks (one connection's, before it closes: closing
        it unmaps the staging they write)."""
        deadline = self._clock() + timeout_s
        while True:
            with self._cv:
                fence = self._queue.running_of(match)
            if fence is None:
                return True
            if self._clock() >= deadline:
                return False
            if self.cuda and hasattr(fence, "synchronize"):
                fence.synchronize()
            else:
                time.sleep(0.0002)

    def drop(self, handle) -> None:
        """Give ``handle`` up here: its copies are never handed over (they still complete: ``quiesce``)."""
        with self._cv:
            self._queue.drop(handle)
            self._failed.pop(handle, None)
            self._index.pop(handle, None)

    def pending(self, handle=None) -> int:
        with self._cv:
            return self._queue.pending(handle)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop, once the copies still writing staging have ended (up to ``timeout_s``: the engine closes that
        staging next), sending the Aborts that waited for them."""
        try:
            self.quiesce_where(lambda h: True, timeout_s)
        except Exception as e:  # noqa: BLE001 - a CUDA error poisoned the context: stop all the same
            log.warning("pdpush: the copies into staging could not be waited for at close: %s", e)
        finally:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            if self._thread is not None:
                self._thread.join(timeout_s)
            try:
                self._run_due()
            except Exception as e:  # noqa: BLE001 - (as above: the events cannot be asked)
                log.warning("pdpush: the aborts waiting for copies could not be sent at close: %s", e)

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
        self._run_due()
        return len(ready)

    def _run_due(self) -> None:
        """The Aborts whose requests' copies have all ended (``after_writes``)."""
        with self._cv:
            due = [fn for h in [h for h in self._after if self._queue.running(h) is None] for fn in self._after.pop(h)]
        for fn in due:  # (outside the lock: an Abort's post may take the connection's)
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - its engine's connection is gone (so is what it would have told);
                log.warning("pdpush: an abort after its copies ended: %s", e)  # the other Aborts still go

    def _run(self) -> None:
        if self.cuda:
            try:
                torch.cuda.set_device(self.device)  # this thread's events and waits are on the engine's device
            except Exception as e:  # noqa: BLE001 - said at each wait, never a silent thread gone
                log.exception("pdpush: the device-to-host hand-over thread cannot start")
                self._dead = f"the hand-over thread could not start: {e}"
                return
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

    def __init__(self, device: torch.device | str, fence: Callable[[], Any] | None = None) -> None:
        """``fence``: tests, a factory of fences standing in for the copies' CUDA events on the CPU (a copy whose
        completion the test decides)."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._fence = fence

    def start(self, req, layer: int, timeout_s: float | None = None):
        """Wait for ``layer`` to land, then start copying this rank's heads of the request's pages of it
        (``layer_pages``) to the device: row bytes ``[chunks, heads, C, T, D * B]``. Returns a ticket for ``finish``;
        its fence (``fence_of``) says when the copy no longer reads the pool."""
        if not self.cuda or not req.geometry.heads_aligned:  # pool shards split heads: put pages together here
            pages = torch.from_numpy(req.read_layer(layer, timeout_s=timeout_s))  # a copy: read when this returns
            return (pages, self._fence() if self._fence else None) if not self.cuda \
                else (pages.to(self.device, non_blocking=False), None)
        parts = [torch.from_numpy(view) for _, view in req.layer_shards(layer, timeout_s=timeout_s)]
        heads = sum(p.shape[1] for p in parts)
        pages = req.layer_pages(layer)  # its layer group's (a sliding window's chunks only)
        with torch.cuda.stream(self._stream):
            # allocated on the side stream that writes it: its memory is reused only in that stream's order (a
            # prefetch dropped by a failed load cannot be handed out while its copy still writes), and the
            # record_stream in ``ready`` then keeps it for the compute stream that reads it
            dst = torch.empty((len(pages), heads, *parts[0].shape[2:]), dtype=torch.uint8, device=self.device)
            at = 0
            for p in parts:
                k = p.shape[1]
                for j, first, m in runs(pages):  # one copy per run of consecutive pages (usually one)
                    dst[j:j + m, at:at + k].copy_(p[first:first + m], non_blocking=True)
                at += k
            done = torch.cuda.Event()
            done.record(self._stream)
        return dst, done

    @staticmethod
    def fence_of(ticket):
        """The copy's event (or a test's fence); None for a copy done when ``start`` returned."""
        return ticket[1]

    def ready(self, ticket) -> torch.Tensor:
        """The copied pages (row bytes ``[chunks, heads, C, T, D * B]``), for use on the current stream: it waits on the
        copy's event (the host does not), and the pages' memory is kept until that stream is done with it."""
        pages, done = ticket
        if done is not None and self.cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(done)
            pages.record_stream(cur)  # allocated on the side stream, read on this one
        return pages

    def finish(self, ticket, tokens: int, dtype: str) -> tuple[torch.Tensor, ...]:
        """Each component ``[tokens, heads, D]`` (of ``dtype``) on the device, ordered after the copy on
        the current stream."""
        rows = kvcodec.elements(kvcodec.page_rows_to_tokens(self.ready(ticket), tokens), dtype)
        return tuple(rows[:, :, c].contiguous() for c in range(rows.shape[2]))


class CopyHolds:
    """Requests whose pool pages a copy to the device may still read: each is released (``req.release()``, so the
    receiver may reuse its pages) only once every such copy has completed, as its fence's ``query()`` says. The
    engine's thread never waits on them; ``poll`` runs each step, and ``drain`` at shutdown."""

    def __init__(self) -> None:
        self._held: list[tuple[Any, list]] = []  # (request, fences of copies from its pages)

    def __len__(self) -> int:
        return len(self._held)

    def release(self, req, fences: list, on_error: Callable[[Any, PdpushError], None]) -> None:
        """Release ``req`` now if no copy from it is running, else once they have all completed."""
        pending = [f for f in fences if f is not None and not f.query()]
        if pending:
            self._held.append((req, pending))
        else:
            self._release(req, on_error)

    def poll(self, on_error: Callable[[Any, PdpushError], None]) -> int:
        """Release those whose copies have all completed; how many are still held."""
        still = []
        for req, fences in self._held:
            fences = [f for f in fences if not f.query()]
            if fences:
                still.append((req, fences))
            else:
                self._release(req, on_error)
        self._held = still
        return len(still)

    def drain(self, on_error: Callable[[Any, PdpushError], None]) -> None:
        """Shutdown: wait for every copy (the engine is stopping), then release."""
        for _, fences in self._held:
            for f in fences:
                f.synchronize()
        self.poll(on_error)

    @staticmethod
    def _release(req, on_error) -> None:
        try:
            req.release(wait=False)  # (in the engine's step: a receiver that does not read must not hold it)
        except PdpushError as e:
            on_error(req, e)
