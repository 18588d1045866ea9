"""Clients used inside engines: PrefillClient (to the sender) and DecodeClient (to the receiver).

Canonical KV input/output at this API: per layer, the layout's components each shaped
``[tokens, kv_heads, head_dim]`` (token-major): K and V for attention, the latent
``[tokens, 1, D]`` for MLA. Engine layouts (HF ``[B, H, S, D]``, vLLM paged blocks) are
converted by the integrations; the bytes are placed by the KV codec (kvcodec.py).

In-page layout: ``page[H, C, chunk_tokens, head_dim]`` (see layout.py).
Zero-copy: the prefill side writes straight into the sender's staging
memory; the decode side gets views straight into the receiver's pool.

Imports numpy and zmq; torch only when a torch tensor is passed or asked for.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from pdpush import control, kvcodec, lifeline, protocol, ring
from pdpush.config import default_sender_socket
from pdpush.doorbell import Bell
from pdpush.errors import (
    Aborted,
    BrokenResourceError,
    PdpushError,
    ProtocolError,
    TransportTimeout,
    UnexpectedMessage,
    error_from_code,
)
from pdpush.layout import KVLayout, PoolGeometry, StagingShares, chunk_keys, rank_heads, runs
from pdpush.lifeline import Lifeline
from pdpush.plan import RequestPlan, tokens_of
from pdpush.protocol import (
    Abort,
    Begin,
    BeginOk,
    Bye,
    Claim,
    ClaimOk,
    Committed,
    Done,
    Error,
    Finish,
    LayerAvailable,
    LayerReady,
    LayoutSpec,
    Msg,
    NeedStaging,
    Open,
    OpenOk,
    Query,
    QueryReply,
    Release,
    StagingGranted,
    StatusReply,
    StatusRequest,
    Wake,
)
from pdpush.shm import Attached


@dataclass(frozen=True)
class WaitPolicy:
    """How a decode client waits for a layer (``DecodeRequest.wait_layer``): it re-reads the layer's
    readiness words in a tight loop for ``spin_s``, then every ``nap_s`` until ``nap_window_s``, then
    waits on the receiver's ``LayerAvailable`` in ``slice_s`` slices, re-reading the words between.
    The words land by a remote put, which nothing on this host sees but a read; the receiver's notice
    follows that layer's ``LayerDone``.

    The default was measured (``pdpush bench --scenario decode_wait``, BENCHMARKS.md): a 200 us spin
    for a layer already landing, then the receiver's wake-up, re-reading the words every millisecond
    (the words land before the receiver's notice, which takes two more hops). It costs a fraction of
    the CPU of spinning or napping. On a box with cores to spare a longer spin sees the words sooner;
    where the decode engine shares cores with the daemons, spinning slows the sender it waits for."""

    spin_s: float = 0.0002
    nap_s: float = 0.0001
    nap_window_s: float = 0.0002  # no naps: after the spin, the receiver wakes the wait
    slice_s: float = 0.001


DEFAULT_WAIT = WaitPolicy()


def _endpoint(sock: str | Path) -> str:
    s = str(sock)
    return s if "://" in s else f"ipc://{s}"


def _on_host(x):
    if type(x).__module__.startswith("torch") and x.device.type != "cpu":
        return x.cpu()
    return x


def _raise(msg: Msg) -> None:
    if isinstance(msg, Error):
        raise error_from_code(msg.code, msg.message, msg.req_id, msg.retry_after_ms)


class _Conn:
    """A DEALER to a local daemon, with request/reply helpers and a per-request mailbox."""

    def __init__(self, sock_path: str | Path, max_frame: int = protocol.DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        # our own identity, which the lifeline names to the daemon (lifeline.py): liveness with no pid
        self.ident = secrets.token_bytes(16)
        self.sock = control.dealer(_endpoint(sock_path), max_frame,
                                   lambda s: s.setsockopt(zmq.IDENTITY, self.ident))
        self._life_path = lifeline.path_for(str(sock_path))
        self.life: Lifeline | None = None
        self.mail: dict[str | None, list[Msg]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()  # requests this side gave up on: late mail is dropped
        self.peer_id = ""  # learnt from BeginOk/OpenOk: the local daemon's start (a new one: it restarted)
        # The socket is used by one thread at a time, under ``lock``. A completion thread
        # (integrations/device_copy.py) never waits for it: ``post`` queues its frame in ``_outbox``, which
        # whoever holds the lock sends first; waits then run in short slices so that queued frames leave soon.
        self.lock = threading.Lock()
        self._outbox: deque[bytes] = deque()
        self._slice_s = 0.25

    def allow_posts(self, slice_s: float = 0.002) -> None:
        """Another thread will ``post``: wait for replies in ``slice_s`` slices, sending its frames between."""
        self._slice_s = min(self._slice_s, slice_s)

    def post(self, msg: Msg) -> None:
        """Send from any thread without waiting: now if the socket is free, else by its current user."""
        self._outbox.append(protocol.encode(msg))
        self._flush_if_free()

    def _flush_if_free(self) -> None:
        if self._outbox and self.lock.acquire(blocking=False):
            try:
                self._flush()  # a full socket leaves the rest for the next holder of the lock
            finally:
                self.lock.release()

    def _flush(self) -> None:
        """Send queued frames (lock held); a full socket keeps the rest for the next holder."""
        while self._outbox:
            try:
                self.sock.send(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outbox.popleft()

    def send(self, msg: Msg, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        frame = protocol.encode(msg)
        try:
            while True:
                with self.lock:
                    self._flush()  # posted frames go first: a hand-over before the finish that follows it
                    if not self._outbox:
                        try:
                            self.sock.send(frame, zmq.NOBLOCK)
                            return
                        except zmq.Again:
                            pass
                    if time.monotonic() > deadline:
                        raise TransportTimeout("local daemon is not accepting messages") from None
                    self.sock.poll(10, zmq.POLLOUT)
        finally:
            self._flush_if_free()

    def recv_for(self, req_id: str | None, deadline: float, grants: bool = False) -> Msg:
        """Next message about ``req_id`` (others are kept for their owners). A ``StagingGranted`` is for
        a wait on staging (``grants``); anyone else drops it (a late one, after its wait timed out)."""
        try:
            return self._recv_for(req_id, deadline, grants)
        finally:
            self._flush_if_free()

    def drain(self) -> None:
        """Sort what has arrived into the mailboxes, without waiting (skipped while another thread holds
        the socket): a prefill engine notices its request's failure at its next layer."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            self._flush()
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
                self._file(protocol.decode(frames[-1], self.max_frame))
        finally:
            self.lock.release()

    def _file(self, msg: Msg) -> str | None:
        """Keep ``msg`` in its request's mailbox (unless this side ended the request); its req_id."""
        if did := getattr(msg, "daemon_id", ""):
            self.peer_id = did
        rid = getattr(msg, "req_id", None)
        if rid not in self._ended:
            self.mail.setdefault(rid, []).append(msg)
        return rid

    def _recv_one(self, deadline: float) -> Msg:
        with self.lock:
            self._flush()
            return control.recv_until(self.sock, deadline, self.max_frame)

    def _recv_for(self, req_id: str | None, deadline: float, grants: bool) -> Msg:
        box = self.mail.get(req_id)
        while box:
            msg = box.pop(0)
            if grants or not isinstance(msg, StagingGranted):
                return msg
        alive_check = time.monotonic() + 0.25
        while True:
            try:  # wait in slices, checking every 250 ms that the daemon is still alive
                msg = self._recv_one(min(deadline, time.monotonic() + self._slice_s))
            except TransportTimeout:
                if time.monotonic() < min(deadline, alive_check):
                    continue
                alive_check = time.monotonic() + 0.25
                if not self.daemon_alive():
                    raise BrokenResourceError("the local pdpush daemon died (its lifeline closed)") from None
                if time.monotonic() >= deadline:
                    raise
                continue
            if did := getattr(msg, "daemon_id", ""):
                self.peer_id = did
            rid = getattr(msg, "req_id", None)
            if rid == req_id:
                if grants or not isinstance(msg, StagingGranted):
                    return msg
            elif rid not in self._ended:
                self.mail.setdefault(rid, []).append(msg)

    def end(self, req_id: str) -> None:
        """This side is done with ``req_id``: drop its mail now and whatever arrives for it later."""
        self.mail.pop(req_id, None)
        self._ended[req_id] = None
        self._ended.move_to_end(req_id)
        while len(self._ended) > 4096:
            self._ended.popitem(last=False)

    def begin(self, req_id: str) -> None:
        """A new request under ``req_id``: its mail is wanted again."""
        self._ended.pop(req_id, None)

    def lifeline(self) -> Lifeline | None:
        """This connection's lifeline to its daemon, opened anew when the daemon it had died (a restarted one
        is another daemon); None while no daemon serves the socket."""
        if self.life is None or not self.life.alive():
            if self.life is not None:
                self.life.close()
            self.life = Lifeline.connect(self._life_path, self.ident)
        return self.life

    def daemon_alive(self) -> bool:
        """False once the daemon this connection's lifeline reached has died."""
        return self.life is None or self.life.alive()

    def call(self, msg: Msg, req_id: str | None, timeout_s: float) -> Msg:
        self.send(msg, timeout_s)
        reply = self.recv_for(req_id, time.monotonic() + timeout_s)
        _raise(reply)
        return reply

    def close(self, linger_ms: int = 0) -> None:
        with self.lock:
            self.sock.close(linger_ms)
        if self.life is not None:
            self.life.close()


class _Attachments:
    """Attached shm segments with a count of live users each.

    A restarted daemon hands out a new shmid; the old segment is detached as soon
    as nothing uses it, so a dead daemon's memory is not kept alive by its clients.
    """

    def __init__(self) -> None:
        self._segs: dict[int, Attached] = {}
        self._users: dict[int, int] = {}
        self.pin = False  # page-lock each segment for this process's CUDA copies (Attached.pin)

    def pin_all(self) -> None:
        """Pin every segment, now and from now on (a no-op where CUDA is not available)."""
        self.pin = True
        for a in self._segs.values():
            a.pin()

    def hold(self, shmid: int, nbytes: int) -> Attached:
        a = self._segs.get(shmid)
        if a is None:
            for old in [i for i in self._segs if not self._users.get(i)]:
                self._segs.pop(old).close()
                self._users.pop(old, None)
            a = self._segs[shmid] = Attached(shmid, nbytes)
            if self.pin:
                a.pin()
        self._users[shmid] = self._users.get(shmid, 0) + 1
        return a

    def drop(self, shmid: int) -> None:
        if self._users.get(shmid):
            self._users[shmid] -= 1

    def close(self) -> None:
        for a in self._segs.values():
            a.close()
        self._segs.clear()
        self._users.clear()


def status(sock_path: str | Path, timeout_s: float = 2.0) -> dict:
    """Ask a local daemon for its stats."""
    c = _Conn(sock_path)
    try:
        reply = c.call(StatusRequest(), None, timeout_s)
        assert isinstance(reply, StatusReply)
        return dict(reply.stats)
    finally:
        c.close()


# ---------------------------------------------------------------------------- prefill side

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
        # group 0's (every layer's, where the model has one layer group: no sliding windows; none without
        # attention layers)
        g0 = self.plan.groups[0] if self.plan.groups else None
        self.new_chunk_indexes = g0.new_chunks if g0 else []
        self.new_runs = g0.new_runs if g0 else []  # contiguous chunk-index ranges
        self.shares = self._shares[0] if g0 else None
        self._shmid = ok.staging_shmid
        st = client._segments.hold(ok.staging_shmid, ok.staging_bytes)
        self._base = st.array  # the whole staging region: the sender grants each layer a block of it
        self._grants = st.array[ok.staging_offset:ok.staging_offset + self.plan.grant_words * 8].view(np.uint64)
        self._ring = client._ring(ok, st)  # this connection's hand-over ring, if the sender offers one
        self._bell = client._bell(ok.doorbell, ok.daemon_id) if self._ring is not None else None  # wakes it
        self._handle = ok.handle  # how its records name this request
        self._daemon_id = ok.daemon_id  # the sender whose staging (and ring) this request writes
        self._life = client._conn.life  # that sender's lifeline: closed, it died
        self._sent: set[int] = set()
        self._done: Done | None = None
        self._aborted: str | None = None
        self._finishing = False

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

    def staging_layer(self, layer: int) -> np.ndarray:
        """Raw writable bytes of this rank's share of layer ``layer``, shaped ``StagingShares.share_shape``
        ``[units, new_chunks, unit bytes]`` (layout.py); ``kvcodec.stage`` fills them. Waits for the
        layer's staging block where staging is full (``_block``)."""
        self._check_open()
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
        the sender this engine has stopped writing its staging (which it keeps until then)."""
        self._end()
        self.client._conn.post(Abort(req_id=self.req_id, reason="the prefill engine saw the request end"))
        _raise(msg)
        raise ProtocolError(f"unexpected {msg.type} for {self.req_id!r} while it was being pushed")

    def put_layer(self, layer: int, *comps) -> None:
        """Copy layer ``layer``'s new chunks into staging, then push (``stage_layer``)."""
        self.stage_layer(layer, *comps)
        self.layer_ready(layer)

    def stage_layer(self, layer: int, *comps, new_only: bool = False) -> None:
        """Copy layer ``layer``'s new chunks into staging without handing it over yet. ``comps`` are the
        layout's components (K and V, or an MLA latent), each ``[tokens, heads, D]``: this rank's heads, or
        all the model's (this rank's are taken); the prompt's tokens, or (``new_only``) only the new chunks'
        tokens back to back (``new_chunks(layer)``: with sliding windows, a layer's group has its own).
        A tensor on a device is copied to the host first."""
        comps = tuple(_on_host(x) for x in comps)
        try:
            kvcodec.stage(self.staging_layer(layer), comps, self.layer_shares(layer), self.tp_rank,
                          self.layer_segments(layer, new_only))
        except ValueError as e:
            raise ValueError(f"layer {layer}: {e}") from None

    def share_rows(self, layer: int, src_heads: int):
        """What each row of this rank's share of ``layer`` holds (``kvcodec.share_rows``, the new chunks'
        tokens back to back), for ``stage_gathered``; None where the share's units cut rows. The same for
        every layer of a group: compute once, gather every layer."""
        return kvcodec.share_rows(self.layer_shares(layer), self.tp_rank, self.layer_segments(layer, True),
                                  src_heads)

    def stage_gathered(self, layer: int, src, base, sel, emap) -> None:
        """Copy layer ``layer``'s share into staging straight from an engine's own memory (a paged KV
        cache's host bytes ``src``), one pass, no copy between (``kvcodec.gather``: rows addressed by
        ``base``/``sel``/``emap`` in ``share_rows``' order); hand it over as ``stage_layer``'s."""
        try:
            kvcodec.gather(self.staging_layer(layer), self.layer_shares(layer), src, base, sel, emap)
        except (ValueError, IndexError) as e:
            raise ValueError(f"layer {layer}: {e}") from None

    def staging_state(self, s: int) -> np.ndarray:
        """Raw writable bytes of this rank's units of state layer ``s``, ``[units / tp, unit bytes]``
        (layout.py); ``kvcodec.stage_state`` fills them. Waits for its block like ``staging_layer``."""
        lay = self.client.layout
        if not 0 <= s < lay.state_layers:
            raise ValueError(f"state layer {s} out of range (the layout has {lay.state_layers})")
        self._check_open()
        off = self._block(lay.layers + s)
        k = lay.state_units // self.tp_size
        page = self._base[off:off + lay.state_page_bytes].reshape(lay.state_units, lay.state_unit_bytes)
        return page[self.tp_rank * k:(self.tp_rank + 1) * k]

    def stage_state(self, s: int, tensors: dict) -> None:
        """Copy this rank's recurrent state of state layer ``s`` into staging: its engine tensors by name
        (``kvcodec.stage_state``); hand it over as the layer ``layout.layers + s`` (``layer_ready``), before
        staging the next one (each has its own block, given back when it lands)."""
        kvcodec.stage_state(self.staging_state(s)[None], [{k: _on_host(v) for k, v in tensors.items()}],
                            self.client.layout, self.tp_size, self.tp_rank)

    def layer_ready(self, layer: int) -> None:
        """Tell the sender layer ``layer`` is in staging; it pushes it at once (non-blocking here)."""
        self.layers_ready([layer])

    def layers_ready(self, layers: list[int]) -> None:
        """Hand several staged layers over in one message (eager mode, or layers that finished together)."""
        self._check_open()
        self._mark_sent(layers)
        self._hand_over(list(layers), wait=True)

    def post_layers_ready(self, layers: list[int]) -> None:
        """``layers_ready`` from a completion thread: never waits for the socket (``_Conn.post``).
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
        if (conn.peer_id and self._daemon_id and conn.peer_id != self._daemon_id) or not self._sender_alive():
            raise BrokenResourceError(f"request {self.req_id!r}: the sender it began on died or restarted",
                                      req_id=self.req_id)
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
            conn.post(LayerReady(req_id=self.req_id, layers=[la for a, n in spans[done:] for la in range(a, a + n)]))
        elif w.sender_idle():
            self._wake()

    def _wake(self) -> None:
        """Wake a sleeping sender: its doorbell, from the kernel; else (none offered, or the sender is gone) a
        ``Wake`` message, through ZeroMQ's I/O threads."""
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

    def _sender_alive(self) -> bool:
        return self._life is None or self._life.alive()

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
        if self._base is not None:
            self._base = self._grants = None
            self.client._segments.drop(self._shmid)

    def finish(self, timeout_s: float | None = None) -> Done:
        """Commit; returns once the receiver acknowledged every byte (or raises a typed error)."""
        self._check_not_aborted()
        if self._done is not None:
            return self._done
        t = timeout_s if timeout_s is not None else self.client.timeout_s
        try:
            reply = self.client._conn.call(Finish(req_id=self.req_id), self.req_id, t)
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
            self.client._conn.send(Finish(req_id=self.req_id), self.client.timeout_s)

    def poll_done(self, timeout_s: float = 0.0) -> Done | None:
        """The commit's outcome if it has come (raises its typed error if it failed), else None."""
        self._check_not_aborted()
        if self._done is not None:
            return self._done
        if not self._finishing:
            raise UnexpectedMessage(f"request {self.req_id!r}: poll_done before finish_nowait")
        try:
            reply = self.client._conn.recv_for(self.req_id, time.monotonic() + timeout_s)
        except TransportTimeout:
            return None
        self._end()
        _raise(reply)
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
        self.client._conn.end(self.req_id)
        self.client._conn.send(Abort(req_id=self.req_id, reason=reason), self.client.timeout_s)


class PrefillClient:
    """Hands finished layers to the local sender daemon through shared staging memory."""

    def __init__(self, layout: KVLayout, sender_socket: str | Path | None = None, *,
                 receiver: str = "", timeout_s: float = 30.0, pin_cuda: bool = False) -> None:
        self.layout = layout
        self.spec = LayoutSpec(**layout.to_dict())
        self.receiver = receiver
        self.timeout_s = timeout_s
        self._conn = _Conn(sender_socket or default_sender_socket())
        self._segments = _Attachments()
        self._rings: dict[int, ring.RingWriter] = {}  # by staging shmid: this connection's ring in it
        self._bells: dict[tuple[str, int], Bell] = {}  # by (path, sender pid): the sender's doorbell (doorbell.py)
        self._rings_lock = threading.Lock()
        self._begun = False  # a Begin went out: close() says Bye, so the sender may reuse this one's ring
        if pin_cuda:  # staging is page-locked in this process, for asynchronous device-to-host copies
            self._segments.pin_all()

    def begin(self, req_id: str, token_ids, receiver: str | None = None, *, tp_rank: int = 0,
              tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
              layers: tuple[int, int] | None = None) -> PushHandle:
        """Allocate on the receiver; returns a handle that says which chunks to send.

        Tensor parallelism: each of ``tp_size`` ranks begins the same ``req_id`` with the same prompt
        and pushes its own share of each page (``StagingShares``); they share one allocation, and the
        request commits once every rank has finished. Every rank gets the same ``already_sent_indexes``.
        Pipeline parallelism: each stage's ranks do the same with ``pp_rank``/``pp_size`` and their
        stage's ``layers`` ``(first, end)``, and push only those."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("empty prompt")
        keys = chunk_keys(ids, self.layout)
        self._conn.begin(req_id)
        self._conn.lifeline()  # before the Begin: the sender fails the request if this process dies
        msg = Begin(req_id=req_id, receiver=receiver or self.receiver, layout=self.spec, chunk_keys=keys,
                    last_chunk_tokens=self.layout.last_chunk_tokens(len(ids)), tp_rank=tp_rank, tp_size=tp_size,
                    pp_rank=pp_rank, pp_size=pp_size,
                    first_layer=layers[0] if layers else 0, end_layer=layers[1] if layers else 0,
                    handover_ring=ring.available())
        self._begun = True
        reply = self._conn.call(msg, req_id, self.timeout_s)
        if not isinstance(reply, BeginOk):
            raise ProtocolError(f"unexpected {reply.type} in reply to begin")
        return PushHandle(self, req_id, len(ids), reply, tp_rank, tp_size,
                          range(*layers) if layers else range(self.layout.push_layers))

    def status(self) -> dict:
        reply = self._conn.call(StatusRequest(), None, self.timeout_s)
        return dict(reply.stats)  # type: ignore[union-attr]

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
        linger = 0
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
                except (PdpushError, zmq.ZMQError):
                    linger = 500  # no answer: what is queued still gets its chance to leave
        finally:
            self._segments.close()
            self._conn.close(linger)


# ----------------------------------------------------------------------------- decode side

class DecodeRequest:
    """An opened request: zero-copy views of each layer as it lands in the pool."""

    def __init__(self, client: DecodeClient, ok: OpenOk, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.client = client
        self.req_id = ok.req_id
        self.layout = KVLayout(**ok.layout.model_dump())
        self.geometry = PoolGeometry(self.layout, ok.pool_pages, ok.pool_shards, ok.state_slots)
        self.heads = rank_heads(self.layout.kv_heads, tp_size, tp_rank)  # the KV heads [h0, h1) this rank reads
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.state_slot = ok.state_slot
        self.pages = list(ok.pages)  # one per item (plan.py): group 0's chunks, then each window group's
        self.tokens = tokens_of(self.layout, ok.chunks or len(self.pages), ok.last_chunk_tokens)
        new = set(ok.new_idx)
        self.plan = RequestPlan(self.layout, self.tokens, [i for i in range(len(self.pages)) if i not in new])
        if self.plan.items != len(self.pages):
            raise ProtocolError(f"open of {ok.req_id!r}: {len(self.pages)} pages for {self.plan.items} items")
        # each group's pages, in chunk order (``layer_chunks``)
        self._group_pages = [[self.pages[i] for i in range(gp.first_item, gp.first_item + len(gp.chunks))]
                             for gp in self.plan.groups]
        self.ready: set[int] = set(ok.layers_ready)
        self.committed = ok.committed
        if ok.committed:  # a committed request has every layer (its state layers too)
            self.ready.update(range(self.layout.push_layers))
        self.pool_pages = ok.pool_pages
        self._shmid = ok.shmid
        self._pool = client._segments.hold(ok.shmid, self.geometry.total_bytes)
        self.page_runs = runs(self._group_pages[0]) if self._group_pages else []
        # readiness words (layout.py): a layer has landed when every new page of its group holds our lease id
        self.lease_id = ok.lease_id
        self._new_pages = [np.array([self.pages[i] for i in range(gp.first_item, gp.first_item + len(gp.chunks))
                                     if i in new], dtype=np.int64) for gp in self.plan.groups]
        kv, words = self.layout.kv_bytes(ok.pool_pages), self.layout.layers * ok.pool_pages * 8
        self._words = (self._pool.array[kv:kv + words].view(np.uint64).reshape(self.layout.layers, ok.pool_pages)
                       if ok.ready_in_pool and ok.lease_id else None)
        self._released = False
        self.broken: str | None = None
        self._life = client._conn.life  # the receiver's lifeline: closed, it died

    def _pump(self, deadline: float) -> None:
        try:
            msg = self.client._conn.recv_for(self.req_id, deadline)
        except BrokenResourceError as e:
            self.broken = str(e)
            raise BrokenResourceError(f"request {self.req_id!r}: {e}; its pages are not valid") from None
        self._apply(msg)

    def _check_receiver(self) -> None:
        if self.broken is None and self._life is not None and not self._life.alive():
            self.broken = "receiver died (its lifeline closed)"
        if self.broken is not None:
            raise BrokenResourceError(f"request {self.req_id!r}: {self.broken}; its pages are not valid")

    def _landed(self, layer: int) -> bool:
        """The layer's readiness words say it is in the pool (no message needed)."""
        w = self._words
        return w is not None and layer < self.layout.layers and bool(
            (w[layer, self._new_pages[self.layout.group_of(layer).index]] == self.lease_id).all())

    def landed(self, layer: int) -> bool:
        """Whether layer ``layer`` is in the pool now (never waits)."""
        if layer in self.ready:
            return True
        if self._landed(layer):
            self.ready.add(layer)
            return True
        return False

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Wait until layer ``layer`` is in the pool: its readiness words in the pool say so, or the
        receiver's LayerAvailable does, as the client's ``WaitPolicy`` says (a decode engine usually
        waits for layers already on the way)."""
        if not 0 <= layer < self.layout.push_layers:
            raise ValueError(f"layer {layer} out of range")
        t = time.monotonic()
        deadline = t + (timeout_s if timeout_s is not None else self.client.timeout_s)
        pol = self.client.wait
        spin_until, nap_until = t + pol.spin_s, t + pol.nap_window_s
        box = self.client._conn.mail.get(self.req_id)
        while box:
            self._apply(box.pop(0))
        while layer not in self.ready:
            if self._landed(layer):
                self.ready.add(layer)
                return
            now = time.monotonic()
            if spin_until <= now < nap_until:
                time.sleep(pol.nap_s)
            try:  # an error or a notice from the receiver, if one came
                self._pump(now if now < nap_until else min(deadline, now + pol.slice_s))
            except TransportTimeout:
                if time.monotonic() >= deadline and not self._landed(layer):
                    raise TransportTimeout(f"layer {layer} of {self.req_id!r} did not arrive in time") from None

    def _apply(self, msg: Msg) -> None:
        if isinstance(msg, LayerAvailable):
            self.ready.update(msg.layers)
        elif isinstance(msg, Committed):
            self.committed = True
            self.ready.update(range(self.layout.push_layers))
        else:
            if isinstance(msg, Error):
                self.broken = f"{msg.code.value}: {msg.message}"
            _raise(msg)

    def poll_committed(self) -> bool:
        """Whether the push has committed (every layer landed), never waiting; raises its typed error if it
        failed, or if the receiver died."""
        box = self.client._conn.mail.get(self.req_id)
        while box:
            self._apply(box.pop(0))
        while not self.committed:
            try:
                self._pump(time.monotonic())
            except TransportTimeout:
                break
        self._check_receiver()
        return self.committed

    def wait_committed(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.client.timeout_s)
        while not self.committed:
            self._pump(deadline)

    def _ready_layer(self, layer: int, wait: bool, timeout_s: float | None) -> None:
        if wait:
            self.wait_layer(layer, timeout_s)
        self._check_receiver()  # never hand out pages of a dead receiver as if they were valid
        if layer not in self.ready:
            raise UnexpectedMessage(f"layer {layer} of {self.req_id!r} is not ready")

    def layer_shards(self, layer: int, wait: bool = True,
                     timeout_s: float | None = None) -> list[tuple[int, np.ndarray]]:
        """This rank's heads of layer ``layer`` in the whole pool, zero-copy: one ``(first head, view)``
        per pool shard they span (usually one), the view row bytes ``[pool_pages, heads, C, T, D * B]``;
        the first head counts from this rank's first. This request's chunks are at ``self.pages``. Only
        where shards are whole heads (``PoolGeometry.heads_aligned``); ``read_layer`` reads any pool."""
        self._ready_layer(layer, wait, timeout_s)
        g, lay = self.geometry, self.layout
        per = lay.kv_heads // g.shards
        out, at = [], 0
        for s, j, k in g.heads(*self.heads):
            off = g.offset(layer, s, 0)
            shard = self._pool.array[off:off + g.pages * g.shard_bytes].reshape(
                g.pages, per, lay.components, lay.chunk_tokens, lay.row_bytes)
            out.append((at, shard[:, j:j + k]))
            at += k
        return out

    def layer_runs(self, layer: int, wait: bool = True, timeout_s: float | None = None) -> list[np.ndarray]:
        """Zero-copy views of this rank's heads, one per run of consecutive pages: row bytes
        ``[n, heads, C, T, D * B]``. Where the heads span several pool shards, use ``read_layer``."""
        parts = self.layer_shards(layer, wait, timeout_s)
        if len(parts) != 1:
            raise ValueError(f"heads {self.heads} span {len(parts)} pool shards: use read_layer()")
        view = parts[0][1]
        return [view[p:p + n] for _, p, n in runs(self.layer_pages(layer))]

    def layer_chunks(self, layer: int) -> range:
        """The chunks this request holds of ``layer``: every chunk, or for a sliding-window layer those of
        its window (``KVLayout.group_chunks``); ``layer_pages`` are their pages."""
        return self.plan.of(layer).chunks

    def layer_pages(self, layer: int) -> list[int]:
        return self._group_pages[self.layout.group_of(layer).index]

    def group_pages(self, group: int) -> list[int]:
        """Layer group ``group``'s pages, one per chunk of ``plan.groups[group].chunks``."""
        return self._group_pages[group]

    def pool_bytes(self, layer: int, wait: bool = True, timeout_s: float | None = None) -> np.ndarray:
        """The whole pool region's bytes, once ``layer`` is ready (for ``kvcodec.read_rows``/``read_pages``)."""
        self._ready_layer(layer, wait, timeout_s)
        return self._pool.array[:self.geometry.region_bytes]

    def read_layer(self, layer: int, wait: bool = True, timeout_s: float | None = None) -> np.ndarray:
        """A copy of this rank's heads of the layer's pages (``layer_chunks``): row bytes
        ``[chunks, heads, C, T, D * B]``."""
        pool = self.pool_bytes(layer, wait, timeout_s)
        return kvcodec.read_pages(pool, self.geometry, layer, np.asarray(self.layer_pages(layer), dtype=np.int64),
                                  self.heads)

    def _layer_tokens(self, layer: int) -> int:
        return self.tokens - self.layer_chunks(layer).start * self.layout.chunk_tokens

    def kv_bytes(self, layer: int, wait: bool = True, timeout_s: float | None = None) -> tuple[np.ndarray, ...]:
        """This rank's heads of one layer as bytes, one ``[tokens, heads, D * B]`` per component (K and V,
        or the MLA latent; a copy). A sliding-window layer's start at its first chunk's first token."""
        rows = kvcodec.page_rows_to_tokens(self.read_layer(layer, wait, timeout_s), self._layer_tokens(layer))
        return tuple(rows[:, :, c] for c in range(self.layout.components))

    def layer_kv(self, layer: int, wait: bool = True, timeout_s: float | None = None):
        """This rank's heads of one layer as torch tensors, one ``[tokens, heads, D]`` per component (as
        ``kv_bytes``)."""
        import torch

        rows = torch.from_numpy(np.ascontiguousarray(
            kvcodec.page_rows_to_tokens(self.read_layer(layer, wait, timeout_s), self._layer_tokens(layer))))
        x = kvcodec.elements(rows, self.layout.dtype)
        return tuple(x[:, :, c].clone() for c in range(self.layout.components))

    def state_bytes(self, wait: bool = True, timeout_s: float | None = None) -> np.ndarray:
        """This rank's units of the request's state, zero-copy: ``[state_layers, units / tp, unit bytes]``
        (state layer ``s`` lands as the layer ``layout.layers + s``; this waits for them all)."""
        lay = self.layout
        if self.state_slot < 0:
            raise ValueError(f"request {self.req_id!r} carries no state")
        for s in range(lay.state_layers):
            self._ready_layer(lay.layers + s, wait, timeout_s)
        lay.check_state_tp(self.tp_size)
        off = self.geometry.state_at(self.state_slot)
        k = lay.state_units // self.tp_size
        return self._pool.array[off:off + lay.state_slot_bytes].reshape(
            lay.state_layers, lay.state_units, lay.state_unit_bytes)[:, self.tp_rank * k:(self.tp_rank + 1) * k]

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.client._segments.drop(self._shmid)  # views handed out must not be used after this
            if self.broken is not None:
                self.client._conn.end(self.req_id)
                return
            try:
                self.client._conn.call(Release(req_id=self.req_id), self.req_id, self.client.timeout_s)
            finally:
                self.client._conn.end(self.req_id)

    def __enter__(self) -> DecodeRequest:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class DecodeClient:
    """Reads pushed KV from the local receiver's pool, zero-copy."""

    def __init__(self, receiver_socket: str | Path, *, timeout_s: float = 30.0, pin_cuda: bool = False,
                 wait: WaitPolicy = DEFAULT_WAIT) -> None:
        self.timeout_s = timeout_s
        self.wait = wait
        self._conn = _Conn(receiver_socket)
        self._segments = _Attachments()
        if pin_cuda:  # the pool is page-locked in this process, for asynchronous host-to-device copies
            self._segments.pin_all()

    def open(self, req_id: str, timeout_s: float | None = None, *, tp_rank: int = 0,
             tp_size: int = 1) -> DecodeRequest:
        """Open a request (waits until its allocation exists on the receiver). A decode rank of
        ``tp_size`` reads its own heads (``layout.rank_heads``: replicated where TP exceeds the KV heads)."""
        self._conn.begin(req_id)
        self._conn.lifeline()  # the receiver releases this engine's opens if it dies, and we see the receiver die
        reply = self._conn.call(Open(req_id=req_id, tp_size=tp_size), req_id,
                                timeout_s if timeout_s is not None else self.timeout_s)
        if not isinstance(reply, OpenOk):
            raise ProtocolError(f"unexpected {reply.type} in reply to open")
        return DecodeRequest(self, reply, tp_rank, tp_size)

    def held_prefix(self, token_ids, layout: KVLayout) -> int:
        """How many leading chunks of this prompt the receiver holds complete."""
        return self.query(token_ids, layout).held_prefix

    def query(self, token_ids, layout: KVLayout, req_id: str | None = None,
              timeout_s: float | None = None) -> QueryReply:
        """Ask the chunk index about a prompt: chunks held complete, and (with ``req_id``) how many
        of its leading chunks that pushed request, possibly still arriving, carries."""
        msg = Query(chunk_keys=chunk_keys([int(t) for t in token_ids], layout), req_id=req_id)
        reply = self._conn.call(msg, None, timeout_s if timeout_s is not None else self.timeout_s)
        if not isinstance(reply, QueryReply):
            raise ProtocolError(f"unexpected {reply.type} in reply to query")
        return reply

    def claim(self, req_id: str, token_ids, layout: KVLayout, lease_ms: int = 30_000,
              timeout_s: float | None = None) -> int:
        """Make ``req_id`` a request of the prompt's leading chunks the receiver already holds, with
        no push: ``open`` then reads it like a pushed one. Returns the chunks claimed (0: none held,
        nothing made). They stay pinned until released, or ``lease_ms`` if never opened."""
        ids = [int(t) for t in token_ids]
        keys = chunk_keys(ids, layout)
        last = len(ids) - (len(keys) - 1) * layout.chunk_tokens
        reply = self._conn.call(Claim(req_id=req_id, chunk_keys=keys, last_chunk_tokens=last, lease_ms=lease_ms),
                                req_id, timeout_s if timeout_s is not None else self.timeout_s)
        if not isinstance(reply, ClaimOk):
            raise ProtocolError(f"unexpected {reply.type} in reply to claim")
        return reply.chunks

    def close(self) -> None:
        self._segments.close()
        self._conn.close()
