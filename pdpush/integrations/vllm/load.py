"""The connector's load path, on each decode TP rank: opens the pushed request on the receiver, and scatters this rank's
heads of each layer from the pool into vLLM's blocks, layer by layer in the forward (``wait_for_layer_load``) or
asynchronously between steps (``poll_async_loads``); a GPU cache copies on a side stream (``H2DLoader``), and a loaded
request's pages go back only once those copies have completed (``CopyHolds``). A mixin of ``worker.WorkerSide``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pdpush import kvcodec, protocol
from pdpush.client import DecodeRequest, PendingOpen
from pdpush.errors import (
    BrokenResourceError,
    ConnectError,
    PdpushError,
    RequestFailed,
    TransportError,
    TransportTimeout,
)
from pdpush.integrations import vllm_layout as vl
from pdpush.integrations.vllm.metadata import REQUEST_ERRORS as _REQUEST_ERRORS
from pdpush.integrations.vllm.metadata import LoadSpec
from pdpush.integrations.vllm.stats import LoadFailure, LoadRoute

log = logging.getLogger("pdpush.vllm")

# layers a device load copies ahead of the one it scatters: their buffers are device memory vLLM did not budget
# (a 32k-token request of an 8B model is 4 GiB whole), held across steps by an asynchronous load
PREFETCH_LAYERS = 2


@dataclass
class _Load:
    spec: LoadSpec
    req: DecodeRequest | None
    dst: list[vl.SlotMap]  # by vLLM KV cache group: the tokens it loads (a sliding window's: its window's)
    src_page: list[torch.Tensor]  # by vLLM group: each token's page in the pool
    src_chunk: list[torch.Tensor]  # by vLLM group: each token's chunk among its layers' pages
    layers_done: int = 0
    failed: str | None = None
    tickets: dict = field(default_factory=dict)  # a CUDA cache: layer -> H2D copy started (H2DLoader)
    copies: list = field(default_factory=list)  # the fences of every H2D copy started from its pages (CopyHolds)
    dev_idx: dict = field(default_factory=dict)  # a CUDA cache: vLLM group -> indexes on the device
    rows: dict = field(default_factory=dict)  # a CPU cache: vLLM group -> its one-pass copy's tables (_scatter)
    state_blocks: list[int] = field(default_factory=list)  # the state groups' blocks the state goes into
    deadline: float = 0.0  # an asynchronous load: its push must have committed by then
    reason: LoadFailure | None = None  # why it failed (with ``failed``, the message): ``fail``
    opened: float = 0.0  # perf_counter at its open (an asynchronous load waits from then on)
    waited: float = 0.0  # seconds the forward spent on it (a layerwise load: its open and its layers)
    pending: PendingOpen | None = None  # its open, sent and not answered yet (``_settle``)
    bound: int = 0  # the worker's metadata binds when it was opened (``poll_async_loads``: aborted before this step)

    @property
    def block_ids(self) -> set[int]:
        return {b for d in self.dst if d is not None for b in d.block_ids} | set(self.state_blocks)

    @property
    def path(self) -> LoadRoute:
        if self.spec.claim:
            return LoadRoute.CLAIM
        return LoadRoute.ASYNC if self.spec.asynchronous else LoadRoute.LAYERWISE

    def fail(self, reason: LoadFailure, why: str) -> None:
        self.reason, self.failed = reason, why

    def fail_on(self, e: Exception, where: str) -> None:
        """A failure raised by the receiver, the pool or the copy, classified by its type."""
        self.fail(failure_of(e), f"{where}: {e}" if where else str(e))


def failure_of(e: Exception) -> LoadFailure:
    if isinstance(e, TransportTimeout):
        return LoadFailure.TIMEOUT
    if isinstance(e, (RequestFailed, BrokenResourceError)):
        return LoadFailure.PUSH_FAILED
    if isinstance(e, PdpushError):
        return LoadFailure.RECEIVER
    return LoadFailure.COPY


def _release_failed(req: DecodeRequest, e: PdpushError) -> None:
    log.warning("pdpush: release of %s: %s", req.req_id, e)


def _comps(rows: torch.Tensor, dtype: str, kv: torch.Tensor) -> list[torch.Tensor]:
    """Row bytes ``[tokens, heads, C, D * B]`` as the C components in the cache's own dtype (an fp8
    cache may be held as uint8: the bytes are viewed, never converted)."""
    x = kvcodec.elements(rows, dtype)
    if x.dtype != kv.dtype and x.element_size() == kv.element_size():
        x = x.view(kv.dtype)
    return [x[:, :, c] for c in range(x.shape[2])]


class LoadPath:
    """The load path's methods (``WorkerSide`` holds the state)."""

    def _open_loads(self, specs: list[LoadSpec]) -> None:
        """This step's loads: every open sent first, then the answers taken that are needed before the forward
        (asynchronous loads, states). Sent and waited for one at a time, a receiver that answered none held the
        step a full ``load_timeout_s`` per load (8 loads: 80 s), every running request with it; their waits
        overlap now, each from its own send."""
        due = [ld for spec in specs if (ld := self._open_load(spec)) is not None]
        for ld in due:
            t0 = time.perf_counter()
            try:
                self._settle(ld)
            finally:
                spent = time.perf_counter() - t0
                ld.waited += spent
                self.stats.load_wait_us += int(spent * 1e6)

    def _open_load(self, spec: LoadSpec) -> _Load | None:
        """A load's open, sent without waiting; the load where its answer is needed before the forward
        (``_open_loads`` takes it then), else None (a layerwise load takes it at its first layer)."""
        lay = self.layout
        prompt = spec.tokens or spec.end + 1
        pushed = prompt - 1 if lay.state_layers else prompt  # a model with state: the prefill stopped one short
        dst, state_blocks = [], []
        try:  # each vLLM group: the tokens its layers load (a sliding window's: those of its window)
            for vi, pg in enumerate(self._pgroup):
                if pg < 0:  # a state group
                    state_blocks.extend(self._state_targets(spec, vi))
                    dst.append(None)
                    continue
                group = lay.groups[pg]
                dst.append(self._group_dst(spec, vi, group, lay.group_chunks(group, pushed).start))
        except (ValueError, IndexError) as e:  # the blocks do not cover the load: a bug, loud but not fatal
            log.exception("pdpush: load of %s (%s): %s", spec.req_id, spec.push_id, e)
            failed = _Load(spec, None, [], [], [], bound=self._binds)
            failed.fail(LoadFailure.BLOCKS, str(e))
            if spec.asynchronous:
                self._async.append(failed)
                return None
            bs = self.block_size  # the blocks of the tokens it was to load (those before are this engine's own,
            blocks = {b for ids in spec.block_ids for b in ids[spec.start // bs:-(-spec.end // bs)] if b}  # shared)
            blocks = blocks or {b for ids in spec.block_ids for b in ids if b}  # (none there: all, to be recomputed)
            self.stats.load_fail(failed.path, LoadFailure.BLOCKS, 0.0, blocks=len(blocks))
            self._load_errors.update(blocks)
            return None
        t0 = time.perf_counter()
        load_ = _Load(spec, None, dst, [], [], state_blocks=state_blocks,
                      deadline=time.monotonic() + self.settings.load_timeout_s, opened=t0, bound=self._binds)
        (self._async if spec.asynchronous else self._loads).append(load_)
        # Planned from the prefill's answer (no question asked): the push is on the receiver already, or it never
        # began there (refused at once: ``exists``). Its open waits as long as a question would have (query_timeout_s);
        # one that missed it says the receiver is not answering: such loads are not tried for receiver_retry_s. An
        # open that cannot even be sent (no receiver, or one not reading) says so too, for every load: each waited out
        # its send's deadline before the forward, every step, for as long as the receiver was down.
        s = self.settings
        wait = min(s.load_timeout_s, s.query_timeout_s) if spec.prefix_key else s.load_timeout_s
        if time.monotonic() < self._receiver_down_until:
            load_.fail_on(ConnectError("the receiver missed an open's deadline lately: not asked for "
                                       "receiver_retry_s"), "open")
        else:
            try:
                load_.pending = self.receiver.get().open_nowait(spec.push_id, timeout_s=wait, tp_rank=self.tp_rank,
                                                                tp_size=self.tp_size, exists=bool(spec.prefix_key))
            except _REQUEST_ERRORS as e:
                load_.fail_on(e, "open")
                if isinstance(e, (TransportError, BrokenResourceError)) or protocol.local_mismatch(e):
                    self._receiver_down_until = time.monotonic() + s.receiver_retry_s
        spent = time.perf_counter() - t0
        load_.waited += spent
        self.stats.load_wait_us += int(spent * 1e6)
        # a layerwise load takes the answer at its first layer (wait_for_layer_load), its round trip under the
        # compute before it; a state goes in before the forward (Mamba layers have no load hook), and an
        # asynchronous load would wait a step for it: those take it before the forward (_open_loads)
        return load_ if spec.asynchronous or lay.state_layers else None

    def _settle(self, ld: _Load) -> None:
        """A load's open, sent without waiting (``_open_load``): wait for its answer (up to the load's timeout
        from the send) and take it; a failed open fails the load."""
        pending, ld.pending = ld.pending, None
        if pending is None:
            return
        try:
            req = pending.wait()
        except TransportTimeout as e:
            pending.abandon()  # its answer may still come: the receiver releases what it opened
            ld.fail_on(e, "open")
            if ld.spec.prefix_key:  # (its open waited query_timeout_s, as a question would have)
                self._receiver_down_until = time.monotonic() + self.settings.receiver_retry_s
            return
        except _REQUEST_ERRORS as e:
            ld.fail_on(e, "open")
            if protocol.local_mismatch(e):  # a receiver of another pdpush: loads planned without asking stop a while
                self._receiver_down_until = time.monotonic() + self.settings.receiver_retry_s
            return
        try:
            self._opened(ld, req)
        except _REQUEST_ERRORS as e:  # (its release goes with the load's: ``req`` is set)
            ld.fail_on(e, "open")

    def _opened(self, load_: _Load, req: DecodeRequest) -> None:
        """The receiver's answer to a load's open: check that the push is the one this load needs, and where
        in the pool each token's rows are."""
        lay, spec, dst = self.layout, load_.spec, load_.dst
        load_.req = req
        if req.layout.fingerprint() != lay.fingerprint():
            load_.fail(LoadFailure.MISMATCH, f"layout mismatch: pushed {req.layout}, this engine has {lay}")
        elif spec.prefix_key and req.last_key != spec.prefix_key:
            load_.fail(LoadFailure.MISMATCH, f"the push {spec.push_id!r} is not of this prompt's first {req.tokens} "
                                             f"tokens (its last chunk key differs)")
        elif req.tokens < spec.end:
            load_.fail(LoadFailure.MISMATCH, f"the push carries {req.tokens} tokens, {spec.end} needed")
        elif lay.state_layers and spec.end != req.tokens:  # its state is after all of them: all, or nothing
            load_.fail(LoadFailure.MISMATCH,
                       f"a load of tokens [{spec.start}, {spec.end}) with a state after {req.tokens}")
        else:
            for i, (d, pg) in enumerate(zip(dst, self._pgroup, strict=True)):
                if d is None:
                    load_.src_chunk.append(None)
                    load_.src_page.append(None)
                    continue
                chunks = req.plan.groups[pg].chunks
                group = lay.groups[pg]
                if group.window:  # the push's own window (a claim's is of its shorter prompt), which must hold
                    # every token the decode's next one attends to: [end - W + 1, end)
                    if max(0, spec.end - group.window + 1) < chunks.start * lay.chunk_tokens:
                        load_.fail(LoadFailure.MISMATCH,
                                   f"the push holds the window of tokens from {chunks.start * lay.chunk_tokens}, the "
                                   f"decode's token {spec.end} attends from {spec.end - group.window + 1}")
                        break
                    d = dst[i] = self._group_dst(spec, i, group, chunks.start)
                rel = d.chunk_idx - chunks.start
                if len(rel) and (int(rel.min()) < 0 or int(rel.max()) >= len(chunks)):
                    load_.fail(LoadFailure.MISMATCH,
                               f"the push holds chunks {chunks} of layer group {pg}, the load needs others")
                    break
                load_.src_chunk.append(rel)
                load_.src_page.append(torch.tensor(req.group_pages(pg), dtype=torch.int64)[rel])
            if lay.state_layers and load_.failed is None and not spec.asynchronous:
                self._load_state(load_)

    def _group_dst(self, spec: LoadSpec, vi: int, group, first_chunk: int) -> vl.SlotMap:
        """The tokens of ``[spec.start, spec.end)`` that vLLM group ``vi``'s layers load: from chunk
        ``first_chunk`` on (a window's first), and for a window not in vLLM's null block (out of its window)."""
        t = np.arange(max(spec.start, first_chunk * self.layout.chunk_tokens), spec.end)
        blocks = spec.block_ids[vi]
        if group.window and len(t):
            t = t[np.asarray(blocks, dtype=np.int64)[t // self.block_size] != 0]
        return self._slots(blocks, t, bool(group.window))

    def _state_targets(self, spec: LoadSpec, vi: int) -> list[int]:
        """State group ``vi``'s blocks a load writes the state into: the one the forward reads the running
        state from (the last), and the one before where it differs (vLLM copies that one into the last
        before the step)."""
        blocks = spec.block_ids[vi]
        prompt = spec.tokens or spec.end + 1
        prev = blocks[(prompt - 2) // self.block_size] if prompt >= 2 else 0
        return list(dict.fromkeys(b for b in (blocks[-1], prev) if b))

    def _load_state(self, ld: _Load) -> None:
        """The pushed running state into the decode's state blocks, before its forward (Mamba layers have no
        load hook): it lands last, so this waits for the push's end (``load_timeout_s``, then recompute)."""
        t0 = time.perf_counter()
        n_bytes = 0
        try:
            state = kvcodec.read_state(torch.from_numpy(ld.req.state_bytes(timeout_s=self.settings.load_timeout_s)),
                                       self.layout, self.tp_size, self.tp_rank)
            for vi, pg in enumerate(self._pgroup):
                if pg >= 0:
                    continue
                targets = self._state_targets(ld.spec, vi)
                for name in self._vgroup_names[vi]:
                    if name not in self._state_of:
                        continue
                    for b in targets:
                        for tname, view in self._state_views(name, b).items():
                            view.copy_(state[self._state_of[name]][tname])
                            n_bytes += view.nbytes
            self.stats.load_states += 1
            self.stats.load_bytes += n_bytes
        except _REQUEST_ERRORS as e:
            ld.fail_on(e, "state")
        finally:
            spent = time.perf_counter() - t0
            ld.waited += spent
            self.stats.load_state_us += int(spent * 1e6)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads:
            return
        t0 = time.perf_counter()
        for ld in self._loads:
            t1 = time.perf_counter()
            self._settle(ld)
            self._load_layer(ld, layer_name)
            ld.waited += time.perf_counter() - t1
        self.stats.load_wait_us += int((time.perf_counter() - t0) * 1e6)

    def _load_layer(self, ld: _Load, layer_name: str) -> None:
        """One layer of one load, from the pool into vLLM's blocks (it waits for the layer to land)."""
        if ld.failed is not None or ld.req is None:
            return
        layer = self._layer_of[layer_name]
        vg = self._vgroup_of[layer_name]
        kv = self._kv_caches[layer_name]
        n = self._paged.slots_per_block(kv)
        if self._loader is not None:
            self._load_layer_staged(ld, layer, vg, kv, n)
            return
        try:
            dst = ld.dst[vg]
            pool = ld.req.pool_bytes(layer, timeout_s=self.settings.load_timeout_s)
            if dst.tokens and self._scatter(ld, vg, layer, layer_name, kv, n, pool):
                pass
            elif dst.tokens:
                pool = torch.from_numpy(pool)
                rows = kvcodec.read_rows(pool, ld.req.geometry, layer, ld.src_page[vg], dst.chunk_rows,
                                         ld.req.heads)
                comps = _comps(rows, self.layout.dtype, kv)
                self._paged.scatter(kv, *dst.addresses(n), *comps)
                self.stats.load_bytes += sum(c.nbytes for c in comps)
            ld.layers_done += 1
            self.stats.load_layers += 1
        except _REQUEST_ERRORS as e:
            ld.fail_on(e, f"layer {layer}")

    def _scatter(self, ld: _Load, vg: int, layer: int, layer_name: str, kv: torch.Tensor, n: int, pool) -> bool:
        """One layer from the pool straight into a CPU cache's blocks, one native pass (``kvcodec.scatter``,
        every address checked) where the pushed elements are the cache's own (no conversion) and the pool's
        shards are whole heads; False: the caller copies through row tensors instead."""
        lay, geom, dst = self.layout, ld.req.geometry, ld.dst[vg]
        eb = kvcodec.DTYPES[lay.dtype].bytes
        if (kv.device.type != "cpu" or not geom.heads_aligned or eb != kv.element_size()
                or not hasattr(self._paged, "rows") or not kvcodec.can_scatter()):
            return False
        h0, h1 = ld.req.heads
        nt, nh, C = len(dst.chunk_rows), h1 - h0, lay.components
        src, geo = self._storages.get(layer_name, kv)
        key = (vg, geo)  # every layer of a group alike: tables made once
        if key not in ld.rows:
            blk, off = dst.addresses(n)
            idx = np.arange(nt * nh * C)
            base, sel, emap = self._paged.rows(kv, blk, off, idx % C, idx // (nh * C), idx // C % nh)
            ld.rows[key] = None if emap.shape[1] * eb != lay.row_bytes else (  # None: rows are not the map's
                emap, *kvcodec.scatter_order(  # read in the pool's memory order
                    base, sel, kvcodec.pool_row_offsets(geom, 0, ld.src_page[vg], dst.chunk_rows, (h0, h1))))
        if ld.rows[key] is None:
            return False
        emap, base, sel, at0 = ld.rows[key]
        kvcodec.scatter(src, base, sel, emap, eb, pool, at0 + geom.offset(layer, 0, 0))
        self.stats.load_bytes += nt * nh * C * lay.row_bytes
        return True

    def poll_async_loads(self, finished: set[str] | frozenset[str] = frozenset()) -> tuple[set[str], set[str]]:
        """Asynchronous loads (``load_mode``; always for a model of several KV cache groups, whose failed loads
        vLLM can only take as a failed request), once per engine step, outside the forward: the layers that
        have landed are copied in order, at most ``async_layers_per_step`` over all loads, so that no step
        pays for a whole request's copy; a load whose every layer is copied and whose push has committed
        gets its state (if any) and is done. One that failed, or whose push did not commit by its deadline, fails
        (vLLM recomputes it from its first token); one committed waits for the budget as long as it takes (a burst
        of loads used to time out behind each other, their KV all there). ``finished``: the requests vLLM has ended
        since the last step (its ``finished_req_ids``); one whose load still waits was aborted (its client hung up):
        the load is given up now, its pool pages released and its id returned as loaded, so that vLLM frees its
        blocks at once rather than once its push commits or ``load_timeout_s`` passes. Returns (loaded, failed) vLLM
        ids."""
        self._holds.poll(_release_failed)  # loads whose copies to the device have completed since
        self.receiver.flush()  # (releases and give-ups sent without waiting, where the socket was full)
        done: set[str] = set()
        failed: set[str] = set()
        t0 = time.perf_counter()
        budget = self.settings.async_layers_per_step
        names = self._load_order
        for ld in list(self._async):
            if ld.spec.req_id in finished and ld.bound < self._binds:  # (not a load of this step's: its id reused)
                self._async.remove(ld)
                log.info("pdpush: load of %s (%s) given up: vLLM aborted the request", ld.spec.req_id, ld.spec.push_id)
                done.add(ld.spec.req_id)  # (finished_recving of a finished request: vLLM frees its blocks)
                if ld.req is not None:
                    self._holds.release(ld.req, ld.copies, _release_failed)
                continue
            if ld.failed is None:
                try:
                    while (ld.layers_done < len(names) and budget > 0 and ld.failed is None
                           and ld.req.landed(self._layer_of[names[ld.layers_done]])):
                        self._load_layer(ld, names[ld.layers_done])
                        budget -= 1
                    if ld.failed is None and not (ld.layers_done == len(names) and ld.req.poll_committed()):
                        # the deadline bounds the wait for the push; once it has committed, what is left is this
                        # engine's own copy at the budget's pace, behind the loads ahead of it: never timed out
                        if time.monotonic() < ld.deadline or ld.req.poll_committed():
                            continue
                        ld.fail(LoadFailure.TIMEOUT,
                                f"the push did not commit within load_timeout_s={self.settings.load_timeout_s} "
                                f"({ld.layers_done} of {len(names)} layers copied)")
                except _REQUEST_ERRORS as e:
                    ld.fail_on(e, "")
            if ld.failed is None and self.layout.state_layers:
                self._load_state(ld)
            self._async.remove(ld)
            waited = time.perf_counter() - ld.opened if ld.opened else 0.0  # the request waited all along
            if ld.failed is None:
                done.add(ld.spec.req_id)
                self.stats.loaded(ld.path, ld.spec.end - ld.spec.start, waited, asynchronous=True)
            else:
                failed.add(ld.spec.req_id)
                self.stats.load_fail(ld.path, ld.reason or LoadFailure.COPY, waited, asynchronous=True)
                log.error("pdpush: load of %s (%s) failed, it will be recomputed: %s", ld.spec.req_id,
                          ld.spec.push_id, ld.failed)
            if ld.req is not None:
                self._holds.release(ld.req, ld.copies, _release_failed)
        if failed:
            self._reset_if_idle()
        self.stats.load_wait_us += int((time.perf_counter() - t0) * 1e6)
        return done, failed

    def _load_layer_staged(self, ld: _Load, layer: int, vg: int, kv: torch.Tensor, n: int) -> None:
        """A GPU cache: this layer's pages go up on a side stream (H2DLoader), with the next layers that have
        already landed (``PREFETCH_LAYERS``) started behind it; the scatter on the compute stream waits on its event.
        (On a CPU cache with ``handover`` set, the same logic with copies done at once.)"""
        try:
            req, loader = ld.req, self._loader
            # prefetch what has landed, in order, PREFETCH_LAYERS ahead at most: each is a device buffer outside vLLM's
            # memory budget, and an asynchronous load copies only a few layers a step
            for later in range(layer + 1, min(self.layout.layers, layer + 1 + PREFETCH_LAYERS)):
                if later in ld.tickets:
                    continue
                if not req.landed(later):
                    break
                ld.tickets[later] = loader.start(req, later)
                ld.copies.append(loader.fence_of(ld.tickets[later]))
                self.stats.load_layers_prefetched += 1
            ticket = ld.tickets.pop(layer, None)
            if ticket is None:
                ticket = loader.start(req, layer, self.settings.load_timeout_s)
                ld.copies.append(loader.fence_of(ticket))
            pages = loader.ready(ticket)  # the compute stream waits on the copy; the host does not
            if vg not in ld.dev_idx:
                d = ld.dst[vg]
                ld.dev_idx[vg] = (ld.src_chunk[vg].to(kv.device), d.chunk_rows.to(kv.device),
                                  *(a.to(kv.device) for a in d.addresses(n)))
            ci, rows, blk, off = ld.dev_idx[vg]
            comps = _comps(pages[ci, :, :, rows], self.layout.dtype, kv)
            self._paged.scatter(kv, blk, off, *comps)
            self.stats.load_bytes += sum(c.nbytes for c in comps)
            ld.layers_done += 1
            self.stats.load_layers += 1
            self.stats.load_layers_copied += 1
        except _REQUEST_ERRORS as e:
            ld.fail_on(e, f"layer {layer}")

    def get_block_ids_with_load_errors(self) -> set[int]:
        # called after every forward: settle this step's loads
        self._holds.poll(_release_failed)
        for ld in self._loads:
            if ld.pending is not None:  # no layer of the forward asked for it
                ld.pending.abandon()
                ld.pending = None
            if ld.failed is None and ld.layers_done != self.layout.layers:
                ld.fail(LoadFailure.INCOMPLETE, f"only {ld.layers_done} of {self.layout.layers} layers were loaded")
            if ld.failed is None:
                self.stats.loaded(ld.path, ld.spec.end - ld.spec.start, ld.waited)
            else:
                self.stats.load_fail(ld.path, ld.reason or LoadFailure.COPY, ld.waited, blocks=len(ld.block_ids))
                self._load_errors.update(ld.block_ids)
                log.error("pdpush: load of %s (%s) failed, its blocks will be recomputed: %s",
                          ld.spec.req_id, ld.spec.push_id, ld.failed)
            if ld.req is not None:
                self._holds.release(ld.req, ld.copies, _release_failed)
        failed = any(ld.failed for ld in self._loads)
        self._loads.clear()
        if failed:
            self._reset_if_idle()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _reset_if_idle(self) -> None:
        """After a failed load, a fresh connection to the receiver, so that late replies to the failed open cannot
        answer the next request; only while no load holds the pool's pages (closing the client unmaps the pool
        under an asynchronous load's views: the engine would crash at its next poll)."""
        if not self._async and not self._loads and not self._holds.poll(_release_failed):
            self.receiver.reset()
