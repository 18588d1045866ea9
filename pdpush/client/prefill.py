"""The prefill engine's client (``PrefillClient``) to its sender, and a request's push (``PushHandle``):
begin, write each finished layer into staging, hand it over (by the hand-over ring and the doorbell, or by
message), finish.

Imports numpy; torch only when a torch tensor is passed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from pdpush import kvcodec, ring
from pdpush.client.connection import Attachments, Connection, on_host, raise_error, status_of, untakeable
from pdpush.config import default_sender_socket
from pdpush.doorbell import Bell
from pdpush.errors import (
    Aborted,
    BrokenResourceError,
    DuplicateRequest,
    IncompatiblePeer,
    PdpushError,
    ProtocolError,
    RemoteProtocolError,
    TransportTimeout,
    UnexpectedMessage,
)
from pdpush.layout import KVLayout, StagingShares, chunk_keys, rank_heads
from pdpush.plan import RequestPlan
from pdpush.protocol import (
    Abort,
    Begin,
    BeginOk,
    Bye,
    Done,
    Finish,
    LayerReady,
    LayoutSpec,
    Msg,
    NeedStaging,
    StagingGranted,
    Wake,
)
from pdpush.shm import Attached


class PushHandle:
    """One request being pushed. Write layers (in any order, as they finish), then ``finish()``."""

    def __init__(self, client: PrefillClient, req_id: str, tokens: int, ok: BeginOk, tp_rank: int = 0,
                 tp_size: int = 1, layers: range | None = None) -> None:
        self.client = client
        self.req_id = req_id
        self.tokens = tokens
        lay = client.layout
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.layers = layers if layers is not None else range(lay.push_layers)  # this stage's (pipeline parallelism)
        self.heads = rank_heads(lay.kv_heads, tp_size, tp_rank)  # the KV heads [h0, h1) this rank pushes
        self.already_sent_indexes: list[int] = list(ok.already_sent_indexes)  # items (plan.py)
        self.plan = RequestPlan(lay, tokens, self.already_sent_indexes)
        self._shares = [StagingShares(lay, tp_size, ok.pool_shards, gp.n_new) for gp in self.plan.groups]
        self._segs: dict[tuple[int, bool], list] = {}
        self._stage_plans: dict[tuple[int, bool], kvcodec.StagePlan] = {}  # stage_plan: by (group, new_only)
        # group 0's (every layer's, where the model has one layer group: no sliding windows; none without
        # attention layers)
        g0 = self.plan.groups[0] if self.plan.groups else None
        self.new_chunk_indexes = g0.new_chunks if g0 else []
        self.new_runs = g0.new_runs if g0 else []  # contiguous chunk-index ranges
        self.shares = self._shares[0] if g0 else None
        self._shmid = ok.staging_shmid
        _check_staging_words(ok, self.plan.grant_words)
        st = client._segments.hold(ok.staging_shmid, ok.staging_bytes)
        try:
            self._base = st.array  # the whole staging region: the sender grants each layer a block of it
            self._grants = st.array[ok.staging_offset:ok.staging_offset + self.plan.grant_words * 8].view(np.uint64)
            self._ring = client._ring(ok, st)  # this connection's hand-over ring, if the sender offers one
            self._bell = client._bell(ok.doorbell, ok.daemon_id) if self._ring is not None else None  # wakes it
        except BaseException:
            client._segments.drop(ok.staging_shmid)
            raise
        self._handle = ok.handle  # how its records name this request
        # how its Abort waits for writes into its staging still running elsewhere (a device's copies on a side
        # stream: device_copy.D2HStager sets it): after_writes(fn) calls fn once they are done
        self.after_writes: Callable[[Callable[[], None]], None] | None = None
        # and, where no thread of the stager's own sees them end (poll and sync modes), what hands over those that have
        # (sending a waiting Abort): a Begin of the id again calls it while it waits (``Stopping``)
        self.progress: Callable[[], object] | None = None
        # the Finish goes as a record after the layers' records (ring.py FINISH), while no layer went by message
        self._ring_finish = ok.ring_finish and self._ring is not None
        self._daemon_id = ok.daemon_id  # the sender whose staging (and ring) this request writes
        self._life = client._conn.life  # that sender's lifeline: closed, it died
        self._sent: set[int] = set()
        self._done: Done | None = None
        self._aborted: str | None = None
        self._finishing = False
        self._finish_deadline = 0.0  # finish_nowait's: the client's finish_timeout_s from the Finish

    def new_chunks(self, layer: int) -> list[int]:
        """The chunks whose pages of ``layer`` this request writes (its layer group's new items)."""
        return self.plan.of(layer).new_chunks

    def layer_shares(self, layer: int) -> StagingShares:
        return self._shares[self.plan.of(layer).group.index]

    def layer_segments(self, layer: int, new_only: bool = False) -> list:
        """``kvcodec.segments`` of ``layer``'s new chunks (``new_only``: their tokens back to back)."""
        gp = self.plan.of(layer)
        key = (gp.group.index, new_only)
        if key not in self._segs:
            self._segs[key] = kvcodec.segments(gp.new_runs, self.tokens, self.client.layout.chunk_tokens, new_only)
        return self._segs[key]

    def stage_plan(self, layer: int, new_only: bool = False) -> kvcodec.StagePlan:
        """``kvcodec.stage_plan`` of this rank's share of ``layer``: the same for every layer of its group."""
        gp = self.plan.of(layer)
        key = (gp.group.index, new_only)
        plan = self._stage_plans.get(key)
        if plan is None:
            plan = self._stage_plans[key] = kvcodec.stage_plan(self._shares[gp.group.index], self.tp_rank,
                                                               self.layer_segments(layer, new_only))
        return plan

    def staging_layer(self, layer: int) -> np.ndarray:
        """Raw writable bytes of this rank's share of layer ``layer``, shaped ``StagingShares.share_shape``
        ``[units, new_chunks, unit bytes]`` (layout.py); ``kvcodec.stage`` fills them. Waits for the
        layer's staging block where staging is full (``_block``). A layer handed over already is refused: once
        it lands its block may be another request's."""
        self._check_open()
        self._check_unsent(layer)
        gp = self.plan.of(layer)
        sh = self._shares[gp.group.index]
        if not gp.n_new:
            return self._base[:0].reshape(sh.share_shape())
        off = self._block(layer) + sh.share_offset(0, self.tp_rank)
        return self._base[off:off + sh.share_bytes].reshape(sh.share_shape())

    def granted(self, layer: int) -> bool:
        """Whether ``layer``'s staging is there to write now (``staging_layer`` would not wait)."""
        return not self.plan.layer_bytes(layer) or bool(self._grants is not None and self._grants[layer])

    def _block(self, unit: int) -> int:
        """Where the sender put ``unit``'s staging block (plan.py). A request that fits in staging has every
        block granted with its BeginOk; otherwise the engine asks for the block when it is about to write
        it and waits, in the order engines asked, for layers in flight to give theirs back: the forward
        feels the backpressure, bounded by the client's timeout and ended by the request's own failure."""
        word = int(self._grants[unit])
        if word:
            return word - 1
        conn, timeout = self.client._conn, self.client.timeout_s
        conn.send(NeedStaging(req_id=self.req_id, unit=unit), timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = conn.recv_for(self.req_id, deadline, grants=True)
            except TransportTimeout:
                raise TransportTimeout(f"request {self.req_id!r}: the sender granted no staging for layer {unit} "
                                       f"within {timeout:g} s (staging is held by the layers in flight)",
                                       req_id=self.req_id) from None
            if isinstance(reply, StagingGranted):
                if reply.unit == unit:
                    return int(self._grants[unit]) - 1
                continue  # a late one, for a wait that timed out
            self._failed(reply)

    def _failed(self, msg: Msg) -> None:
        """An asynchronous end of the request (its receiver died, its lease expired...): raise it, and tell
        the sender this engine has stopped writing its staging (which it keeps until then), once it has."""
        self._end()
        self._stopped(Abort(req_id=self.req_id, reason="the prefill engine saw the request end"))
        raise_error(msg)
        raise ProtocolError(f"unexpected {msg.type} for {self.req_id!r} while it was being pushed")

    def put_layer(self, layer: int, *comps) -> None:
        """Copy layer ``layer``'s new chunks into staging, then push (``stage_layer``, then ``layer_ready``
        without a second look at the request's mail: ``stage_layer`` looked before the copy; a failure that
        came during it surfaces at the next layer or the finish, and the sender refuses a late hand-over)."""
        self.stage_layer(layer, *comps)
        self._ready([layer])

    def stage_layer(self, layer: int, *comps, new_only: bool = False) -> None:
        """Copy layer ``layer``'s new chunks into staging without handing it over yet. ``comps`` are the
        layout's components (K and V, or an MLA latent), each ``[tokens, heads, D]``: this rank's heads, or
        all the model's (this rank's are taken); the prompt's tokens, or (``new_only``) only the new chunks'
        tokens back to back (``new_chunks(layer)``: with sliding windows, a layer's group has its own).
        A tensor on a device is copied to the host first."""
        comps = tuple(on_host(x) for x in comps)
        try:
            kvcodec.stage_planned(self.staging_layer(layer), comps, self.stage_plan(layer, new_only), stream=True)
        except ValueError as e:
            raise ValueError(f"layer {layer}: {e}") from None

    def share_rows(self, layer: int, src_heads: int):
        """What each row of this rank's share of ``layer`` holds (``kvcodec.share_rows``, the new chunks'
        tokens back to back), for ``stage_gathered``; None where the share's units cut rows. The same for
        every layer of a group: compute once, gather every layer."""
        return kvcodec.share_rows(self.layer_shares(layer), self.tp_rank, self.layer_segments(layer, True),
                                  src_heads)

    def stage_gathered(self, layer: int, src, base, sel, emap, dst_rows=None, hand_over: bool = False) -> None:
        """Copy layer ``layer``'s share into staging straight from an engine's own memory (a paged KV
        cache's host bytes ``src``), one pass, no copy between (``kvcodec.gather``: rows addressed by
        ``base``/``sel``/``emap`` in ``share_rows``' order, or in another with ``dst_rows``:
        ``kvcodec.source_order``); hand it over as ``stage_layer``'s, or here (``hand_over``: ``layer_ready``
        without looking at the request's mail again)."""
        try:
            kvcodec.gather(self.staging_layer(layer), self.layer_shares(layer), src, base, sel, emap, stream=True,
                           dst_rows=dst_rows)
        except (ValueError, IndexError) as e:
            raise ValueError(f"layer {layer}: {e}") from None
        if hand_over:
            self._ready([layer])

    def staging_state(self, s: int) -> np.ndarray:
        """Raw writable bytes of this rank's units of state layer ``s``, ``[units / tp, unit bytes]``
        (layout.py); ``kvcodec.stage_state`` fills them. Waits for its block like ``staging_layer``."""
        lay = self.client.layout
        if not 0 <= s < lay.state_layers:
            raise ValueError(f"state layer {s} out of range (the layout has {lay.state_layers})")
        self._check_open()
        self._check_unsent(lay.layers + s)
        off = self._block(lay.layers + s)
        k = lay.state_units // self.tp_size
        page = self._base[off:off + lay.state_page_bytes].reshape(lay.state_units, lay.state_unit_bytes)
        return page[self.tp_rank * k:(self.tp_rank + 1) * k]

    def stage_state(self, s: int, tensors: dict) -> None:
        """Copy this rank's recurrent state of state layer ``s`` into staging: its engine tensors by name
        (``kvcodec.stage_state``); hand it over as the layer ``layout.layers + s`` (``layer_ready``), before
        staging the next one (each has its own block, given back when it lands)."""
        kvcodec.stage_state(self.staging_state(s)[None], [{k: on_host(v) for k, v in tensors.items()}],
                            self.client.layout, self.tp_size, self.tp_rank)

    def layer_ready(self, layer: int) -> None:
        """Tell the sender layer ``layer`` is in staging; it pushes it at once (non-blocking here)."""
        self.layers_ready([layer])

    def layers_ready(self, layers: list[int]) -> None:
        """Hand several staged layers over in one message (eager mode, or layers that finished together)."""
        self._check_open()
        self._ready(layers)

    def _ready(self, layers: list[int]) -> None:
        """The hand-over of layers staged, once the request's mail was looked at."""
        self._mark_sent(layers)
        self._hand_over(list(layers), wait=True)

    def post_layers_ready(self, layers: list[int]) -> None:
        """``layers_ready`` from a completion thread: never waits for the socket (``Connection.post``).
        An asynchronous failure of the request surfaces on this handle's next call from its owner."""
        self._check_not_aborted()
        if self._done is not None or self._base is None or self._finishing:
            raise UnexpectedMessage(f"request {self.req_id!r} has ended")
        self._mark_sent(layers)
        self._hand_over(list(layers), wait=False)

    def _hand_over(self, layers: list[int], wait: bool) -> None:
        """Records in the connection's ring (ring.py), the sender woken if it sleeps; without a ring, a
        ``LayerReady``. A full ring is waited for (``wait``: the owner thread, bounded by the client's
        timeout) or, from a completion thread, the rest goes by message: a record is never overwritten."""
        conn, w = self.client._conn, self._ring
        if w is not None and w.closed:
            raise UnexpectedMessage(f"request {self.req_id!r}: its client is closed")
        self._check_sender()
        if w is None:
            msg = LayerReady(req_id=self.req_id, layers=layers)
            conn.send(msg, self.client.timeout_s) if wait else conn.post(msg)
            return
        spans = ring.runs(layers)
        recs = [ring.encode(self._handle, a, n) for a, n in spans]
        done = w.push(recs)
        if done < len(recs) and wait:
            done = self._wait_ring(w, recs, spans, done)
        if done < len(recs):
            self._ring_finish = False  # a record taken later would overtake that message: the Finish follows it
            conn.post(LayerReady(req_id=self.req_id, layers=[la for a, n in spans[done:] for la in range(a, a + n)]))
        elif w.sender_idle():
            self._wake()

    def _send_finish(self, timeout_s: float) -> None:
        """The Finish: a record in the ring after the layers' (no ZeroMQ hop on either side), the sender woken
        if it sleeps; a ``Finish`` message where the sender offers no ring for it, the ring is full, or a layer
        went by message (a message sent after it keeps the order)."""
        if self._ring_finish:  # (which holds only with a ring)
            self._check_sender()  # (a message would reach a restarted sender, which says it does not know it)
            if self._ring.push([ring.encode_finish(self._handle)]):
                if self._ring.sender_idle():
                    self._wake()
                return
        self.client._conn.send(Finish(req_id=self.req_id), timeout_s)

    def _wake(self) -> None:
        """Wake a sleeping sender: its doorbell, from the kernel; else (none offered, or the sender is gone) a
        ``Wake`` message on the connection's lifeline."""
        if self._bell is None or not self._bell.ring():
            self.client._conn.post(Wake())

    def _wait_ring(self, w: ring.RingWriter, recs: list[int], spans: list[tuple[int, int]], done: int) -> int:
        """The ring is full: the sender has not taken records yet. Wait for room until the timeout; then
        the layers not handed over are the engine's again (it may hand them over later)."""
        self._wake()
        deadline, nap = time.monotonic() + self.client.timeout_s, 50e-6
        while done < len(recs):
            time.sleep(nap)
            nap = min(nap * 2, 0.001)
            done += w.push(recs[done:])
            err = None
            if done < len(recs) and time.monotonic() > deadline:
                err = TransportTimeout(f"request {self.req_id!r}: the sender took no hand-over for "
                                       f"{self.client.timeout_s:g} s (its ring of {w.slots} records is full)",
                                       req_id=self.req_id)
            elif done < len(recs) and not self._sender_alive():
                err = BrokenResourceError("the local pdpush daemon died (its lifeline closed)", req_id=self.req_id)
            if err is not None:
                self._sent.difference_update(la for a, n in spans[done:] for la in range(a, a + n))
                raise err
        return done

    def _check_sender(self) -> None:
        """The sender this request began on is the one there, and alive: its staging and ring are read."""
        conn = self.client._conn
        if (conn.peer_id and self._daemon_id and conn.peer_id != self._daemon_id) or not self._sender_alive():
            raise BrokenResourceError(f"request {self.req_id!r}: the sender it began on died or restarted",
                                      req_id=self.req_id)

    def _sender_alive(self) -> bool:
        return self._life is None or self._life.alive()

    def _check_unsent(self, layer: int) -> None:
        if layer in self._sent:
            raise ValueError(f"layer {layer} already handed over: its staging is not this request's to write now")

    def _mark_sent(self, layers: list[int]) -> None:
        again = [la for la in layers if la in self._sent]
        if again or len(set(layers)) != len(layers):
            raise ValueError(f"layer {again[0] if again else layers} already handed over")
        self._sent.update(layers)

    @property
    def layers_handed_over(self) -> int:
        return len(self._sent)

    def _check_open(self) -> None:
        self._check_not_aborted()
        if self._done is not None or self._base is None:
            raise UnexpectedMessage(f"request {self.req_id!r} has ended")
        conn = self.client._conn
        conn.drain()
        box = conn.mail.get(self.req_id)
        while box and isinstance(box[0], StagingGranted):
            box.pop(0)  # a late grant, for a wait that timed out
        if box:  # an asynchronous failure (receiver died, lease expired...) surfaces here
            self._failed(box.pop(0))

    def _end(self) -> None:
        """The request has ended here (done, failed or given up): its staging and its mailbox go (a long-lived
        engine's connection kept an empty one for every request it had pushed)."""
        if self._base is not None:
            self._base = self._grants = None
            self.client._segments.drop(self._shmid)
        self.client._conn.end(self.req_id)

    def finish(self, timeout_s: float | None = None) -> Done:
        """Finish; returns once every byte is in the receiver's pool: its readiness words flushed (completion on the
        data path), or the receiver's CommitAck (or raises a typed error)."""
        self._check_not_aborted()
        if self._done is not None:
            return self._done
        t = timeout_s if timeout_s is not None else self.client.timeout_s
        deadline = time.monotonic() + t
        try:
            self._send_finish(t)
            reply = self.client._conn.reply(self.req_id, deadline, life=self._life)
        finally:
            self._end()
        if not isinstance(reply, Done):
            raise ProtocolError(f"unexpected {reply.type} while finishing {self.req_id!r}")
        self._done = reply
        return reply

    def finish_nowait(self) -> None:
        """Ask for the commit without waiting; collect the outcome with ``poll_done()``."""
        if self._done is None and not self._finishing:
            self._check_open()
            self._finishing = True
            self._finish_deadline = time.monotonic() + self.client.finish_timeout_s
            self._send_finish(self.client.timeout_s)

    def poll_done(self, timeout_s: float = 0.0) -> Done | None:
        """The commit's outcome if it has come (raises its typed error if it failed), else None; TransportTimeout
        once the client's ``finish_timeout_s`` from ``finish_nowait`` has passed with no answer (a sender alive but
        silent: a late answer is then dropped)."""
        self._check_not_aborted()
        if self._done is not None:
            return self._done
        if not self._finishing:
            raise UnexpectedMessage(f"request {self.req_id!r}: poll_done before finish_nowait")
        try:
            reply = self.client._conn.recv_for(self.req_id, min(time.monotonic() + timeout_s, self._finish_deadline),
                                               life=self._life)
        except BrokenResourceError:  # the sender it began on is gone: no answer can come
            self._end()
            raise BrokenResourceError(f"request {self.req_id!r}: the sender it began on died or restarted",
                                      req_id=self.req_id) from None
        except TransportTimeout:
            try:  # no answer will come from a sender that died or restarted since (its finish record went with it)
                self._check_sender()
            except BrokenResourceError:
                self._end()
                raise
            if time.monotonic() < self._finish_deadline:
                return None
            self._end()
            raise TransportTimeout(f"request {self.req_id!r}: the sender did not answer its finish within "
                                   f"{self.client.finish_timeout_s:g} s", req_id=self.req_id) from None
        self._end()
        raise_error(reply)
        if not isinstance(reply, Done):
            raise ProtocolError(f"unexpected {reply.type} while finishing {self.req_id!r}")
        self._done = reply
        return reply

    def _check_not_aborted(self) -> None:
        if self._aborted is not None:
            raise Aborted(f"request {self.req_id!r} was aborted here: {self._aborted}", req_id=self.req_id)

    def abort(self, reason: str = "") -> None:
        """Give the request up. The sender's late reply is dropped; ``finish()`` then raises ``Aborted``."""
        if self._done is not None or self._aborted is not None:
            return
        self._aborted = reason or "aborted"
        self._end()
        self._stopped(Abort(req_id=self.req_id, reason=reason), wait=True)

    def _stopped(self, msg: Abort, wait: bool = False) -> None:
        """Tell the sender that this engine has stopped writing the request's staging (``msg``, an Abort): the
        sender then grants those blocks to other requests. A device's copies into them may still be queued on a
        side stream (``after_writes``): the Abort then goes once they are done, from the thread that sees them
        end (copies that never end send none: the sender keeps the blocks until the request's lease runs out).
        ``wait``: sent now, waiting up to the client's timeout, where nothing else writes."""
        conn = self.client._conn
        if self.after_writes is not None:
            stopping = self.client._stopping
            stopping.begins(self.req_id, self.progress)  # (a Begin of the id again waits for this Abort: ``Stopping``)

            def stopped() -> None:
                try:
                    conn.post(msg)
                finally:
                    stopping.ends(self.req_id)

            self.after_writes(stopped)
        elif wait:
            conn.send(msg, self.client.timeout_s)
        else:
            conn.post(msg)


STOPPING_WAIT_S = 2.0  # how long a Begin waits for its id's earlier push's copies to end (an engine's step waits)


class Stopping:
    """Request ids whose ended push's Abort waits for a device's copies into its staging (``after_writes``). A Begin
    of such an id waits for that Abort to go first: the sender takes a Begin of an id whose earlier push failed as
    that engine's word that it stopped writing the earlier one's staging, and would grant it to other requests
    while the copies still write it; and an Abort sent after the Begin would end the new push, not the old."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        # where no thread of the stager's own sees copies end (poll and sync modes), what hands over those that have
        # (and so sends their Aborts), by id: ``wait`` calls it while it waits
        self._progress: dict[str, Callable[[], object]] = {}
        self._cv = threading.Condition()

    def begins(self, req_id: str, progress: Callable[[], object] | None = None) -> None:
        with self._cv:
            self._ids[req_id] = self._ids.get(req_id, 0) + 1
            if progress is not None:
                self._progress[req_id] = progress

    def ends(self, req_id: str) -> None:
        with self._cv:
            if (n := self._ids.get(req_id, 0) - 1) > 0:
                self._ids[req_id] = n
            else:
                self._ids.pop(req_id, None)
                self._progress.pop(req_id, None)
            self._cv.notify_all()

    def wait(self, req_id: str, timeout_s: float) -> None:
        """Until no Abort of ``req_id`` waits for copies; ``DuplicateRequest`` after ``timeout_s`` (this push of
        the id fails, no other: its earlier one's copies have not ended)."""
        if not self._ids:  # (every Begin asks: the common case takes no lock)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            if (progress := self._progress.get(req_id)) is not None:
                progress()
            with self._cv:
                if req_id not in self._ids:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DuplicateRequest(f"request {req_id!r}: the copies of its earlier push into staging have not "
                                           f"ended within {timeout_s:g} s: not begun again until they have",
                                           req_id=req_id)
                self._cv.wait(min(left, 0.001) if progress is not None else left)


def _check_staging_words(ok: BeginOk, grant_words: int) -> None:
    """The words a BeginOk places in staging (its grant table, the ring and its idle word) lie within it, aligned:
    the ring is written through raw addresses, where a word past the segment would fault the engine."""
    spans = [(ok.staging_offset, grant_words * 8)]
    if ok.ring_slots:
        spans += [(ok.ring_offset, ok.ring_slots * 8), (ok.idle_offset, 8)]
    for at, n in spans:
        if at % 8 or at + n > ok.staging_bytes:
            raise RemoteProtocolError(f"begin of {ok.req_id!r}: the sender's answer places {n} bytes at {at} of its "
                                      f"{ok.staging_bytes}-byte staging", req_id=ok.req_id)


class PendingBegin:
    """A Begin sent and not answered yet (``PrefillClient.begin_nowait``): the allocation's round trip to the
    receiver runs while the engine computes its first layers. ``wait()`` gives the request's handle."""

    def __init__(self, client: PrefillClient, req_id: str, tokens: int, tp_rank: int, tp_size: int,
                 layers: tuple[int, int] | None) -> None:
        self.client, self.req_id, self.tokens = client, req_id, tokens
        self.tp_rank, self.tp_size, self.layers = tp_rank, tp_size, layers
        self.deadline = time.monotonic() + client.timeout_s  # from the send, as a blocking begin's
        self._aborted = False
        self.life = client._conn.life  # the sender it goes to: one that died answers nothing (a restarted one neither)

    def answered(self) -> bool:
        """Whether ``wait()`` would not wait: the answer (or an error) is here, the begin was aborted, its
        deadline passed or the sender died. Never waits; a look at the socket (``Connection.drain``)."""
        if self._aborted or time.monotonic() >= self.deadline:
            return True
        conn = self.client._conn
        conn.drain()
        return bool(conn.mail.get(self.req_id)) or not conn.daemon_alive()

    def wait(self) -> PushHandle:
        """The receiver's answer: the handle (which chunks to send), or its typed error; TransportTimeout past the
        client's ``timeout_s`` from the send."""
        if self._aborted:
            raise Aborted(f"request {self.req_id!r} was aborted before its begin was answered", req_id=self.req_id)
        c = self.client
        if not c._conn.mail.get(self.req_id) and not c._conn.daemon_alive():  # (not after a wait for it to answer)
            raise BrokenResourceError("the local pdpush daemon died (its lifeline closed)", req_id=self.req_id)
        reply = c._conn.recv_for(self.req_id, self.deadline, life=self.life)
        try:
            raise_error(reply)
        except IncompatiblePeer:  # (an answer of another local protocol, say): the sender ends what it began
            self.abort("the engine could not take the sender's answer")
            raise
        except PdpushError:  # refused: nothing more will come for it
            c._conn.end(self.req_id)
            raise
        if not isinstance(reply, BeginOk):
            self.abort(f"the engine could not take the sender's answer ({reply.type})")
            raise RemoteProtocolError(f"unexpected {reply.type} in reply to begin", req_id=self.req_id)
        try:
            return PushHandle(c, self.req_id, self.tokens, reply, self.tp_rank, self.tp_size,
                              range(*self.layers) if self.layers else range(c.layout.push_layers))
        except (ValueError, IndexError, PdpushError) as e:  # an answer this engine cannot take: the sender ends it
            with contextlib.suppress(PdpushError, OSError):
                self.abort("the engine could not take the sender's answer")
            raise untakeable(e, "begin", self.req_id) from None

    def abort(self, reason: str = "") -> None:
        """Give the request up before its answer is taken: the sender ends it (and its allocation), the answer is
        dropped."""
        if not self._aborted:
            self._aborted = True
            self.client._conn.end(self.req_id)
            self.client._conn.send(Abort(req_id=self.req_id, reason=reason), self.client.timeout_s)


class PrefillClient:
    """Hands finished layers to the local sender daemon through shared staging memory."""

    def __init__(self, layout: KVLayout, sender_socket: str | Path | None = None, *,
                 receiver: str = "", timeout_s: float = 30.0, pin_cuda: bool = False,
                 finish_timeout_s: float | None = None) -> None:
        """``finish_timeout_s``: how long ``poll_done`` waits for the sender's answer to a finish (default: 60 s, or
        ``timeout_s`` if longer). The sender ends a request its lease (30 s by default) did not see through, and says
        so; this bounds the wait on a sender alive but silent, and must not cut a large push's puts short."""
        self.layout = layout
        self.spec = LayoutSpec(**layout.to_dict())
        self.receiver = receiver
        self.timeout_s = timeout_s
        self.finish_timeout_s = finish_timeout_s if finish_timeout_s is not None else max(timeout_s, 60.0)
        self._conn = Connection(sender_socket or default_sender_socket())
        self._segments = Attachments()
        self._rings: dict[int, ring.RingWriter] = {}  # by staging shmid: this connection's ring in it
        self._bells: dict[tuple[str, int], Bell] = {}  # by (path, sender pid): the sender's doorbell (doorbell.py)
        self._rings_lock = threading.Lock()
        self._begun = False  # a Begin went out: close() says Bye, so the sender may reuse this one's ring
        self._stopping = Stopping()
        if pin_cuda:  # staging is page-locked in this process, for asynchronous device-to-host copies
            self._segments.pin_all()

    def begin(self, req_id: str, token_ids, receiver: str | None = None, *, tp_rank: int = 0,
              tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
              layers: tuple[int, int] | None = None, extra: Sequence[bytes] = ()) -> PushHandle:
        """Allocate on the receiver; returns a handle that says which chunks to send.

        Tensor parallelism: each of ``tp_size`` ranks begins the same ``req_id`` with the same prompt
        and pushes its own share of each page (``StagingShares``); they share one allocation, and the
        request commits once every rank has finished. Every rank gets the same ``already_sent_indexes``.
        Pipeline parallelism: each stage's ranks do the same with ``pp_rank``/``pp_size`` and their
        stage's ``layers`` ``(first, end)``, and push only those. ``extra``: what besides its tokens each chunk's KV
        depends on (``layout.chunk_keys``: a LoRA adapter, an image, a tenant's salt); its decode must name the same."""
        return self.begin_nowait(req_id, token_ids, receiver, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                                 pp_size=pp_size, layers=layers, extra=extra).wait()

    def begin_nowait(self, req_id: str, token_ids, receiver: str | None = None, *, tp_rank: int = 0,
                     tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                     layers: tuple[int, int] | None = None, extra: Sequence[bytes] = ()) -> PendingBegin:
        """``begin`` without waiting for the allocation: call it before the forward, and ``wait()`` on the result
        once ``answered()`` (or at the forward's end), so that the round trip to the receiver overlaps the compute."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("empty prompt")
        keys = chunk_keys(ids, self.layout, extra)
        self._stopping.wait(req_id, min(self.timeout_s, STOPPING_WAIT_S))
        self._conn.begin(req_id)
        self._conn.lifeline()  # before the Begin: the sender fails the request if this process dies
        msg = Begin(req_id=req_id, receiver=receiver or self.receiver, layout=self.spec, chunk_keys=keys,
                    last_chunk_tokens=self.layout.last_chunk_tokens(len(ids)), tp_rank=tp_rank, tp_size=tp_size,
                    pp_rank=pp_rank, pp_size=pp_size,
                    first_layer=layers[0] if layers else 0, end_layer=layers[1] if layers else 0,
                    handover_ring=ring.available())
        self._begun = True
        pending = PendingBegin(self, req_id, len(ids), tp_rank, tp_size, layers)
        self._conn.send(msg, self.timeout_s)
        pending.life = self._conn.life  # the one it went out on (the send connects anew where the daemon died)
        return pending

    def wait_mapped(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the daemon's segments this client holds to be mapped into this process (a
        thread does it from their first use on, ``Attachments.populated``); whether they are."""
        return self._segments.populated(timeout_s)

    def status(self) -> dict:
        return status_of(self._conn, self.timeout_s)

    def _ring(self, ok: BeginOk, staging: Attached) -> ring.RingWriter | None:
        if not ok.ring_slots or not ring.available():
            return None
        with self._rings_lock:  # one writer per ring, whichever thread begins first
            w = self._rings.get(ok.staging_shmid)
            if w is None or w.address != staging.address + ok.ring_offset:
                # one ring per connection; a new segment is a restarted sender's, its old ring gone with it
                for old in self._rings.values():
                    old.close()
                w = ring.RingWriter(staging.address + ok.ring_offset, ok.ring_slots,
                                    staging.address + ok.idle_offset)
                self._rings = {ok.staging_shmid: w}
            return w

    def _bell(self, path: str, daemon_id: str) -> Bell | None:
        """The doorbell the sender offers (``BeginOk.doorbell``), opened once per sender process (a restarted
        sender makes its FIFO anew at the same path); None: wake it by message."""
        if not path:
            return None
        with self._rings_lock:
            b = self._bells.get((path, daemon_id))
            if b is None:
                for old in self._bells.values():  # one sender per connection: another is a restarted one's
                    old.close()
                b = Bell(path)
                self._bells = {(path, daemon_id): b}
            return b

    def close(self) -> None:
        try:
            with self._rings_lock:
                for w in self._rings.values():
                    w.close()  # handles still open write no more records (a completion thread's, say)
                self._rings.clear()
                for b in self._bells.values():
                    b.close()
                self._bells.clear()
            if self._begun and self._conn.daemon_alive():
                self._begun = False
                try:  # the sender may give this connection's ring to another now. Its answer comes after
                    # everything sent before it was handled: only then does the lifeline close, so an Abort
                    # just sent is not taken for this process's death
                    self._conn.call(Bye(), None, 1.0)
                except PdpushError:
                    pass  # no answer: what is queued still gets written as the connection closes
        finally:
            self._segments.close()
            self._conn.close()


# ----------------------------------------------------------------------------- decode side

