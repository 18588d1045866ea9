"""The connector's push path, on each prefill TP rank: at each finished layer (``save_kv_layer``) this rank's KV of the
step's pushes is gathered into its share of the sender's staging (a GPU cache: on a side stream, ``D2HStager``) and
handed over; ``wait_for_save`` settles the step's hand-overs. A mixin of ``worker.WorkerSide``, whose state it uses."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdpush import kvcodec, protocol
from pdpush.client import PushHandle
from pdpush.errors import Aborted, BrokenResourceError, PdpushError, TransportError
from pdpush.integrations import vllm_layout as vl
from pdpush.integrations.vllm.metadata import REQUEST_ERRORS as _REQUEST_ERRORS
from pdpush.integrations.vllm.metadata import PushSpec
from pdpush.integrations.vllm.stats import PushFailure

log = logging.getLogger("pdpush.vllm")


@dataclass(eq=False)  # (found in lists by identity: two pushes are never "equal")
class _Push:
    spec: PushSpec
    handle: PushHandle
    src: list[vl.SlotMap]    # by vLLM KV cache group: its layers' new chunks' tokens in vLLM's cache, in order
    layers_sent: int = 0
    dev_addr: dict = field(default_factory=dict)  # a CUDA cache: (group, slots) -> slot addresses on its device
    rows: dict = field(default_factory=dict)  # (group, slots, shape, strides) -> the one-pass gather's rows, or None
    states_sent: int = 0  # state layers handed over (in model order: those before each attention layer first)


class PushPath:
    """The push path's methods (``WorkerSide`` holds the state)."""

    def _begin_push(self, spec: PushSpec) -> None:
        """Send the push's Begin without waiting (before the forward): its allocation's round trip to the receiver
        runs while the first layers compute. The answer is taken at the first finished layer after it came
        (``_begun``): the forward never waits for it but at its end (``wait_for_save``)."""
        if time.monotonic() < self._sender_down_until:  # the forward must not wait on a sender that is not there
            self.stats.push_fail(PushFailure.SENDER_DOWN)
            return
        t0 = time.perf_counter()
        try:
            pending = self._asked(spec, lambda: self._sender().begin_nowait(
                spec.push_id, spec.token_ids, spec.receiver or None, tp_rank=self.tp_rank, tp_size=self.tp_size,
                pp_rank=self.pp_rank, pp_size=self.pp_size,
                layers=(self.stage.start, self.stage.stop) if self.pp_size > 1 else None, extra=spec.extra))
            if pending is not None:
                self._pending.append((spec, pending))
        finally:
            self.stats.push_stage_us += int((time.perf_counter() - t0) * 1e6)

    def _begun(self, wait: bool) -> None:
        """The answers to this step's Begins that came (``wait``: all of them, at the forward's end): each push's
        handle. A push begun late takes the step's layers finished before (``_step_layers``) at once: the
        forward never waits for an answer at a layer (measured on the side-by-side's prefill: 0.4 to 1.4 ms)
        while a prompt's blocks stay as the forward wrote them until the step ends."""
        t0 = time.perf_counter()
        try:
            pending, self._pending = self._pending, []
            for spec, p in pending:
                # an answer before said the sender is gone (and closed the connection this Begin went out on)
                if time.monotonic() < self._sender_down_until or p.client is not self._prefill:
                    self.stats.push_fail(PushFailure.SENDER_DOWN)
                    continue
                if not wait and not (looked := self._asked(spec, p.answered)):
                    if looked is False:  # (None: the look failed it, counted)
                        self._pending.append((spec, p))
                    continue
                handle = self._asked(spec, p.wait)
                if handle is not None and (push := self._start_push(spec, handle)) is not None:
                    for name, kv_layer in self._step_layers:
                        if push not in self._pushes:  # that layer failed it
                            break
                        self._save_layer(push, name, kv_layer)
        finally:
            if not self._pending:
                self._step_layers.clear()
            self.stats.push_stage_us += int((time.perf_counter() - t0) * 1e6)

    def _asked(self, spec: PushSpec, ask):
        """``ask()``'s result (a begin or its answer), or None where the push cannot go: counted and logged."""
        try:
            return ask()
        except _REQUEST_ERRORS as e:
            if not isinstance(e, (TransportError, BrokenResourceError)) and not protocol.local_mismatch(e):
                self.stats.push_fail(PushFailure.REFUSED)  # the receiver refused this one (pool exhausted, ...)
                # (aborted: its decode no longer waits for it, and recomputes; expected where legs went at once)
                log.log(logging.WARNING if isinstance(e, Aborted) else logging.ERROR, "pdpush: cannot push %s (%s): %s",
                        spec.req_id, spec.push_id, e)
                return None
            # no sender, it died, or it speaks another local protocol than this engine: stop asking for a while
            self.stats.push_fail(PushFailure.SENDER)
            log.error("pdpush: cannot push %s (%s), and not trying for %.0f s: %s", spec.req_id, spec.push_id,
                      self.settings.sender_retry_s, e)
            self._sender_down_until = time.monotonic() + self.settings.sender_retry_s
            self._drop_sender(f"the connection to the sender is given up ({type(e).__name__}: {e})")
        return None

    def _drop_sender(self, why: str) -> None:
        """Close the connection to the sender (a fresh one next time: a late reply must not answer another begin).
        Its pushes still staging fail first: they cannot complete (the sender fails a closed connection's
        requests), and one staged after the close would touch its detached staging (the engine faulted). Where a
        device copy may still write that staging, the connection stays open until its copies end (``_retired``):
        the sender must not grant those blocks to another engine meanwhile."""
        client, self._prefill = self._prefill, None
        if client is None:
            return
        for p in list(self._pushes):
            if p.handle.client is client:
                self._pushes.remove(p)
                self.stats.push_fail(PushFailure.SENDER)
                log.error("pdpush: push of %s (%s) failed: %s", p.spec.req_id, p.spec.push_id, why)
                if self._stager is not None:
                    self._stager.drop(p.handle)
        for h in [h for h in self._finishing if h.client is client]:
            self._finishing.remove(h)
            self.stats.push_fail(PushFailure.COMMIT)
            log.error("pdpush: commit of %s failed: %s", h.req_id, why)
        self._retired.append(client)
        self._close_retired()

    def _close_retired(self, wait_s: float = 0.0) -> None:
        """Close the connections given up (``_drop_sender``) once no device copy writes their staging: those of the
        pushes failed with them, and of any failed before (dropped, their copies still run)."""
        for client in list(self._retired):
            if self._stager is None or self._stager.quiesce_where(lambda h, c=client: h.client is c, wait_s):
                self._retired.remove(client)
                try:
                    client.close()
                except (PdpushError, OSError) as e:
                    log.warning("pdpush: closing the connection to the sender: %s", e)

    def _start_push(self, spec: PushSpec, handle: PushHandle) -> _Push | None:
        """The push's state (its sources in vLLM's cache), once its Begin was answered; None where it has nothing
        to move or cannot go."""
        lay = self.layout
        T = lay.chunk_tokens
        n = len(spec.token_ids)
        if not handle.plan.n_new and not lay.state_layers:  # the receiver holds every item: nothing to move
            # (the sender may have died since its answer: counted as any Begin's failure, never out of the forward)
            if not self._asked(spec, lambda: handle.finish_nowait() or True):
                return None
            self._finishing.append(handle)
            self.stats.push_requests += 1
            return None
        src = []
        try:  # each vLLM group's layers: their pdpush group's new chunks (a sliding window's: of its window)
            for vi, pg in enumerate(self._pgroup):
                if pg < 0:  # a state group: its running state, gathered once the forward is done
                    src.append(None)
                    continue
                gp = handle.plan.groups[pg]
                tokens = np.concatenate([np.arange(c * T, min(n, (c + 1) * T)) for c in gp.new_chunks]) \
                    if gp.new_chunks else np.empty(0, dtype=np.int64)
                src.append(self._slots(spec.block_ids[vi], tokens, bool(gp.group.window)))
        except (ValueError, IndexError) as e:  # vLLM's blocks do not cover the prompt: a bug, loud but not fatal
            log.exception("pdpush: push of %s (%s): %s", spec.req_id, spec.push_id, e)
            self.stats.push_fail(PushFailure.BLOCKS)
            try:
                handle.abort(str(e)[:200])
            except PdpushError:
                pass  # (the sender gone too: it ends the request with the connection)
            return None
        push = _Push(spec, handle, src)
        self._pushes.append(push)
        self.stats.events.append(("begun", spec.push_id, -1, time.monotonic()))
        self.stats.push_requests += 1
        self.stats.push_tokens_staged += sum(sm.tokens for sm in src if sm is not None)
        return push

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._pending:  # Begins of this step: those answered meanwhile start, with the layers before this one
            self._begun(wait=False)
            if self._pending:  # the rest take this layer when their answer comes
                self._step_layers.append((layer_name, kv_layer))
        if not self._pushes:  # decode steps and unmarked requests: nothing to do
            return
        t0 = time.perf_counter()
        for p in list(self._pushes):
            if p in self._pushes:  # (not failed by an earlier one's layer: with its connection, say)
                self._save_layer(p, layer_name, kv_layer)
        self.stats.push_stage_us += int((time.perf_counter() - t0) * 1e6)

    def _save_layer(self, p: _Push, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Stage push ``p``'s share of one finished layer and hand it over; a failure fails that push alone."""
        layer = self._layer_of[layer_name]
        vg = self._vgroup_of[layer_name]
        n = self._paged.slots_per_block(kv_layer)
        try:
            if self._stager is not None:  # gather and copy on a side stream, hand over when the copy is done
                addr = p.dev_addr.get((vg, n))
                if addr is None:
                    addr = p.dev_addr[vg, n] = tuple(a.to(kv_layer.device) for a in p.src[vg].addresses(n))
                self._stager.put_layer(p.handle, layer, lambda a=addr: self._paged.gather(kv_layer, *a),
                                       new_only=True)
                p.layers_sent += 1
                self.stats.push_layers += 1
                self.stats.push_layers_copied += 1
                return
            src, geo = self._storages.get(layer_name, kv_layer)
            if p.src[vg].tokens and (rows := self._gather_rows(p, vg, layer, kv_layer, n, geo)) is not None:
                p.handle.stage_gathered(layer, src, *rows, hand_over=True)  # one pass, cache to staging
            else:
                if p.src[vg].tokens:  # [new tokens, heads, D] each, then into staging
                    comps = self._paged.gather(kv_layer, *p.src[vg].addresses(n))
                    p.handle.stage_layer(layer, *comps, new_only=True)
                p.handle.layer_ready(layer)
            self.stats.events.append(("layer_ready", p.spec.push_id, layer, time.monotonic()))
            p.layers_sent += 1
            self.stats.push_layers += 1
            if self._state_before.get(layer_name, 0) > p.states_sent:  # state layers the forward has passed
                self._push_state(p, self._state_before[layer_name])
        except _REQUEST_ERRORS as e:
            self._fail_push(p, f"layer {layer}: {e}", PushFailure.STAGE)

    def _gather_rows(self, p: _Push, vg: int, layer: int, kv_layer: torch.Tensor, n: int, geo: tuple):
        """Where each row of this rank's share of the group's layers lives in vLLM's cache (``kvcodec.gather``:
        one pass from the paged blocks into staging), computed at the group's first layer, as every layer of
        it has the same shape and strides (``geo``: ``Storages``). None where that cannot run here (no native
        copy, a cache on a device, units that cut rows): the layer is gathered, then staged."""
        key = (vg, n, geo)
        if key not in p.rows:
            rows = None
            if kv_layer.device.type == "cpu" and kvcodec.can_gather():
                heads = 1 if isinstance(self._paged, vl.PagedLatent) else kv_layer.shape[1]
                what = p.handle.share_rows(layer, heads)
                if what is not None:  # read in the cache's memory order
                    rows = kvcodec.source_order(*self._paged.rows(kv_layer, *p.src[vg].addresses(n), *what))
            p.rows[key] = rows
        return p.rows[key]

    def _push_state(self, p: _Push, upto: int) -> None:
        """The prompt's running state of state layers ``[p.states_sent, upto)``, after its last token here
        (the prefill stopped one short of the prompt: ``SchedulerSide.on_new_request``), from each state
        group's last block (vLLM keeps a request's running state there), as this rank's units of them
        (kvcodec.stage_state), each handed over as the layer ``layout.layers + s``. Mamba and GDN layers
        have no save hook: the state of those before an attention layer goes at that layer's save (while the
        forward goes on), the rest once the forward is done (``wait_for_save``)."""
        t0 = time.perf_counter()
        names = self._state_names()[p.states_sent:upto]
        tensors = [self._state_views(name, p.spec.block_ids[self._vgroup_of[name]][-1]) for name in names]
        for s, t in enumerate(tensors, p.states_sent):  # each handed over as soon as it is in: its block comes back
            p.handle.stage_state(s, t)
            p.handle.layer_ready(self.layout.layers + s)
        self.stats.events.append(("state_ready", p.spec.push_id, self.layout.layers + upto - 1, time.monotonic()))
        p.states_sent = upto
        self.stats.push_state_layers += len(names)
        self.stats.push_state_us += int((time.perf_counter() - t0) * 1e6)

    def _fail_push(self, p: _Push, why: str, reason: PushFailure) -> None:
        self.stats.push_fail(reason)
        log.error("pdpush: push of %s (%s) failed: %s", p.spec.req_id, p.spec.push_id, why)
        self._pushes.remove(p)
        if self._stager is not None:
            self._stager.drop(p.handle)
        try:
            p.handle.abort(why[:200])
        except PdpushError:
            pass

    def wait_for_save(self) -> None:
        if self._pending:  # answers that had not come by the last layer (or a forward with no save hook)
            self._begun(wait=True)
        for p in self._pushes:
            self.stats.events.append(("forward_done", p.spec.push_id, -1, time.monotonic()))
        for p in list(self._pushes):
            if p.layers_sent != len(self.stage):
                self._fail_push(p, f"only {p.layers_sent} of this stage's {len(self.stage)} layers were produced",
                                PushFailure.INCOMPLETE)
                continue
            try:
                if self._stager is not None:
                    # every copy handed over before the commit; also, vLLM may reuse these blocks once the
                    # step ends, so no copy may still be reading them (with a deadline: HandOverTimeout)
                    t0 = time.perf_counter()
                    try:
                        self._stager.wait(p.handle, self.settings.timeout_s)
                    finally:
                        self.stats.push_handover_wait_us += int((time.perf_counter() - t0) * 1e6)
                if p.states_sent < self.layout.state_layers:  # those after the last attention layer
                    self._push_state(p, self.layout.state_layers)
                p.handle.finish_nowait()  # the commit completes in the background; the decode side waits for layers
                self._finishing.append(p.handle)
            except _REQUEST_ERRORS as e:
                self._fail_push(p, str(e), PushFailure.STAGE)
                continue
            self._pushes.remove(p)

    def _reap_finishing(self, wait_s: float = 0.0) -> None:
        if self._retired:
            self._close_retired()
        deadline = time.monotonic() + wait_s
        for h in list(self._finishing):
            try:
                done = h.poll_done(max(0.0, deadline - time.monotonic()))
            except PdpushError as e:
                self.stats.push_fail(PushFailure.COMMIT)
                log.error("pdpush: commit of %s failed: %s", h.req_id, e)
                self._finishing.remove(h)
                continue
            if done is not None:
                for i, ms in enumerate(done.layer_done_ms):  # sender clock: ms after it got the begin
                    self.stats.events.append(("sender_layer_done_ms", h.req_id, i, ms))
                self.stats.push_committed += 1
                self.stats.push_bytes_sent += done.bytes_sent
                self.stats.push_chunks_skipped += done.chunks_skipped
                self._finishing.remove(h)

    # ---- decode: load ----
