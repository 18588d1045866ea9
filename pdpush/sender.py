"""Sender daemon: the shell around ``SenderSession`` (sockets, UCX, metrics), on one thread.

For each request:
  Begin (client) -> [Hello/HelloAck + UCX connect, once per receiver]
  -> AllocRequest -> AllocResponse -> BeginOk (client: staging slot, skip list)
  -> per layer handed over (a record in the client's ring in staging, ring.py, or a LayerReady):
     puts of the new chunks, coalesced by page run, and one flush per receiver per pass, posted
     without waiting; readiness words (and a LayerDone, with checksums) when every rank's share is flushed
  -> Finish (client) -> Done once every layer's readiness words are flushed (completion on the data path),
     or, with checksums or state layers, Commit -> CommitAck -> Done.
An engine's messages come and go on its connection's lifeline (lifeline.py, a unix stream); the
ZeroMQ ingress socket serves other local clients. Every decision is the session's; this module
polls sockets and carries out the session's actions. The per-layer path is native (``pdpush_native.Pusher``,
native/src/pusher.cpp): it takes ring records, posts puts and flushes, reaps
completions and puts readiness words, and this loop hands the session what
landed, in batches. The loop never waits on one receiver:
a stalled receiver's puts time out at their own deadlines. Loads UCX only
through pdpush.transport.ucx, when started.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import secrets
import time
from collections import deque
from urllib.parse import urlsplit

import numpy as np
import xxhash
import zmq

from pdpush import control, lifeline, protocol, ring
from pdpush.config import SenderConfig, endpoint_error, endpoint_host_port, is_loopback
from pdpush.daemon import (
    Outbox,
    WireCount,
    count_dropped,
    count_skewed,
    log_ucx,
    now_ms,
    settle_interface,
    ucx_stats,
)
from pdpush.errors import (
    ConnectError,
    IncompatiblePeer,
    PdpushError,
    RemoteProtocolError,
    TransferError,
    TransportTimeout,
)
from pdpush.layout import PoolGeometry, combine_digests
from pdpush.protocol import Abort, Msg, StatusReply, StatusRequest, Wake
from pdpush.sessions.sender import (
    CloseRing,
    Connect,
    FillWords,
    ForgetPeer,
    Hand,
    OpenRing,
    PlanGrants,
    PlanRank,
    PlanRequest,
    ResetPeer,
    SenderLimits,
    SenderSession,
    StagingInfo,
    ToClient,
    ToPeer,
    Unplan,
)
from pdpush.sessions.tx_actions import action_owner
from pdpush.shm import array_at
from pdpush.transport import resolve

log = logging.getLogger("pdpush.sender")


SPIN_S = 0.002  # how long the native wait spins on UCX progress after a post or a completion
_SOCKET_ERRORS = (PdpushError, zmq.ZMQError, OSError, ValueError)  # a receiver's control socket cannot be made


class _Wiring:
    """The data plane to a receiver being set up, by ``deadline``: its UCX host's ``lookup``, then ``ep`` wiring up."""

    __slots__ = ("ack", "pool", "deadline", "lookup", "ep")

    def __init__(self, ack, pool: tuple[int, int], deadline: float, lookup: resolve.Lookup) -> None:
        self.ack, self.pool, self.deadline, self.lookup = ack, pool, deadline, lookup  # pool: (address, bytes)
        self.ep = None


class Sender:
    def __init__(self, cfg: SenderConfig) -> None:
        self.cfg = cfg
        self.session: SenderSession | None = None
        self.socks: dict[str, zmq.Socket] = {}  # receiver endpoint -> control DEALER
        # a receiver named by a host name: the address its DEALER connects to, resolved off the loop (``_named``;
        # libzmq resolves a name on its I/O thread, which every socket shares: a slow DNS answer held them all)
        self._addrs: dict[str, str] = {}  # receiver endpoint -> its address, until the receiver fails
        self._naming: dict[str, tuple[resolve.Lookup, float, list[bytes]]] = {}  # -> lookup, deadline, frames held
        self._followed: dict[str, resolve.Followed] = {}  # a named receiver -> its name, looked at again now and then
        self.eps: dict[str, object] = {}  # receiver endpoint -> UCX endpoint
        self._connecting: dict[str, _Wiring] = {}  # receiver endpoint -> its data plane being set up
        self._regions: dict[str, tuple[int, int]] = {}  # receiver endpoint -> its region (address, bytes), to populate
        self._populated: dict[str, int] = {}  # receiver endpoint -> bytes of its region mapped here (each its thread's)
        self.pusher = None  # the native per-layer path (pdpush_native.Pusher), once started
        self._eids: dict[str, int] = {}  # receiver endpoint -> its id in the pusher (until the session forgets it)
        self._eid_names: dict[int, str] = {}
        self._next_eid = itertools.count(1)
        self._unreachable: dict[str, str] = {}  # receiver endpoint -> why its socket could not be made (this pass)
        self._receiver_keys: dict[str, bytes] = {}
        self._default_key: bytes | None = None
        self.conns = _Connections()  # engine connections -> their ids in the pusher
        self._unsettled: list[tuple[int, int, str, str]] = []  # aborted requests' puts in flight (_settled)
        self.shell_counters = {"loop_errors": 0, "action_errors": 0, "doorbell_rings": 0, "ingress_dropped": 0,
                               "local_protocol_refused": 0, "receivers_moved": 0}
        self.wire = WireCount()  # control messages to and from receivers
        self.outbox = Outbox(self.wire)  # what a loop pass has for each receiver: one frame each, at its end
        self._watch_dirty = True  # the fds and sockets the native wait watches for the loop (_watched)
        self._last_refresh = 0.0
        self._last_tick = 0
        self._idle = 0  # the sender's idle word in staging (ring.py), set while it sleeps: its address
        self.doorbell = None  # the FIFO engines ring to wake it (doorbell.py), with the rings
        self.keys = None
        if cfg.curve_secret_key_file:
            from pdpush import auth

            self.keys = auth.load_keypair(cfg.curve_secret_key_file)
            # the receivers' public keys, read now: a missing or bad key file fails the start, not every request
            self._receiver_keys = {e: auth.load_public_keys(k)[0] for e, k in cfg.receiver_keys.items()}
            self._default_key = (auth.load_public_keys(cfg.receiver_public_key)[0] if cfg.receiver_public_key
                                 else None)

    # ---- lifecycle ----
    def start(self, stop=None) -> dict:
        """Make the staging and bind the engines' endpoints; ``stop()``: a signal came, its prefault ends there."""
        from pdpush import shm
        from pdpush.transport.auto import open_transport

        if self.cfg.host != "127.0.0.1":  # (PDPUSH_HOST may be a receiver's or a router's on the same host)
            log.warning("host %r is ignored: a sender opens no control port (its /metrics address is metrics_host; "
                        "UCX's lanes listen where ucx_env UCX_NET_DEVICES says)",
                        self.cfg.host)
        # (a taken port fails the start, exit 3, before the staging's prefault: receiver.py)
        control.check_port_free(self.cfg.metrics_host, self.cfg.metrics_port, "the metrics endpoint")
        control.check_local(self.cfg.ingress_socket_path())  # (its directory, and no live daemon on it)
        remote = urlsplit(self.cfg.default_receiver).hostname or ""
        if remote and not is_loopback(remote):  # (UCX lists its devices once: the one toward the receiver runs)
            settle_interface(remote, route=True, stop=stop)
        self.ucx = open_transport(dict(self.cfg.ucx_env))  # (not pinned: a request may name any receiver)
        self.ucx_info = log_ucx(self.ucx, None if is_loopback(remote) else f"default_receiver {remote}",
                                self.cfg.staging_bytes)
        self.region, self.shmid, self.backing = self.ucx.alloc_shared(self.cfg.staging_bytes)
        if self.cfg.prefault:
            shm.prefault(self.region.address, self.region.length, stop=stop)
            if stop is not None and stop():  # (told to stop: no endpoint is bound, close() frees the staging)
                return {}
        self.ingress, self.ingress_endpoint = control.bind_local(self.cfg.ingress_socket_path(),
                                                                 self.cfg.max_frame_bytes)
        # the engines' connections: their messages both ways, and their deaths (lifeline.py)
        self.lifelines = lifeline.Lifelines(lifeline.path_for(self.cfg.ingress_socket_path()), self.cfg.max_frame_bytes)
        from pdpush.metrics import Metrics

        self.metrics = Metrics("sender", self.cfg.metrics_host, self.cfg.metrics_port)
        c = self.cfg
        if c.handover_ring_slots:
            from pdpush.doorbell import Doorbell, path_for

            self.doorbell = Doorbell(path_for(self.cfg.ingress_socket_path()))
        self.session = SenderSession(
            SenderLimits(lease_ms=c.lease_ms, control_timeout_ms=c.control_timeout_ms,
                         layer_timeout_ms=c.layer_timeout_ms, alloc_retry_budget_ms=c.alloc_retry_budget_ms,
                         ring_slots=c.handover_ring_slots, words=c.completion == "words" and not c.checksums),
            StagingInfo(self.region.address, self.shmid, self.region.length, secrets.token_hex(8),
                        self.doorbell.path if self.doorbell else ""),
            c.default_receiver, check_receiver=self._check_receiver)
        self.pusher = self.ucx.pusher(self.region.address, self.region.length, c.layer_timeout_ms / 1000)
        self._words = shm.array_at(self.region.address, self.region.length).view(np.uint64)  # staging's 8-byte words
        if c.handover_ring_slots:
            self._words[self.session.rings.idle_offset // 8] = 0
            self._idle = self.region.address + self.session.rings.idle_offset
        return {"role": "sender", "ingress_endpoint": self.ingress_endpoint, "staging_bytes": self.region.length,
                "shmid": self.shmid, "backing": self.backing, "metrics_endpoint": self.metrics.endpoint}

    def close(self) -> None:
        if getattr(self, "outbox", None):
            self._guard(self._flush_peers)  # aborts of a drain that timed out, say
        if self.pusher is not None:
            self.pusher.close()  # its batches go before the endpoints and the worker do
        for ep in list(self.eps.values()):
            ep.close()
        self.eps.clear()
        for sock in self.socks.values():
            control.close_peer_socket(sock)  # (the last aborts, queued, leave by the process's end)
        if getattr(self, "ingress", None) is not None:
            control.close_local(self.ingress, self.ingress_endpoint)
        if getattr(self, "lifelines", None) is not None:
            self.lifelines.close()
        if self.doorbell is not None:
            self.doorbell.close()
        if getattr(self, "region", None) is not None:
            self.region.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        if getattr(self, "ucx", None) is not None:  # its close-signal pipe and listener (the receiver's did already)
            self.ucx.close()

    def internal_error(self) -> None:
        """A pass of the daemon's loop raised (daemon.run logs it): counted with the shell's own."""
        self.shell_counters["loop_errors"] += 1

    def begin_drain(self) -> None:
        self.session.begin_drain()

    def drained(self) -> bool:
        return self.session.drained()

    def abort_all(self, reason: str) -> None:
        self._apply(self.session.abort_all(reason, now_ms()))

    def _watched(self) -> tuple[list[int], list[zmq.Socket]]:
        """The fds the native wait returns on (the sockets', the lifelines' and UCX's closed endpoints'), and the
        sockets."""
        if self._watch_dirty:
            socks = [self.ingress, *self.socks.values()]
            self._watch = ([s.getsockopt(zmq.FD) for s in socks] + [self.lifelines.fileno(), self.ucx.closed_fd],
                           socks)
            self._watch_dirty = False
        return self._watch

    # ---- loop ----
    def step(self, timeout_ms: int) -> None:
        """One look of the session. Between two, the native wait (``Pusher.wait``) takes the engines' hand-overs,
        posts their puts and reaps their completions by itself; it returns when a socket or a lifeline has
        something, a request has all it needs from this side, a receiver failed, a record was refused, or
        ``timeout_ms`` passed."""
        if self._connecting or self._naming:
            timeout_ms = min(timeout_ms, 1)  # wire-ups complete on progress, lookups on threads: look every ms
        self._flush_peers()  # nothing for a receiver waits on the wait
        fds, socks = self._watched()
        if any(control.readable(s) for s in socks) or self.lifelines.pending():  # (a zmq socket's fd tells only of
            timeout_ms = 0  # what comes after a look; an engine's frames read and not taken, of none)
        ready, rung, refused = self.pusher.wait(
            timeout_ms / 1000, fds, self.doorbell.fileno() if self.doorbell is not None else -1, self.ucx.epoll_fd,
            self._idle, SPIN_S, self.cfg.checksums or bool(self._unsettled) or self.session.wants_each_landing)
        self.shell_counters["doorbell_rings"] += rung
        if refused:
            self._refused(refused)
        self._finishes()
        self._reap()
        self.ucx.dispatch_closed()
        for endpoint, sock in list(self.socks.items()):
            for frames in control.recv_ready(sock):
                self._guard(self._on_peer_frame, endpoint, frames[-1])
                if self.socks.get(endpoint) is not sock:
                    break  # the peer was reset while handling that frame
        for frames in control.recv_ready(self.ingress):
            if len(frames) >= 2:
                self._guard(self._on_ingress_frame, frames[0], frames[-1], False)
        # after the ingress: what an engine sent before it went counts
        if self.lifelines.fileno() in ready or self.lifelines.pending():
            self._lifelines()
        self.pusher.post()  # everything handed over in this pass: one batch per receiver
        self._reap()
        t = now_ms()
        if t - self._last_tick >= 5:
            self._last_tick = t
            self._apply(self.session.on_tick(t))
        if time.monotonic() - self._last_refresh > 0.1:  # gauges ~10 times a second
            self._last_refresh = time.monotonic()
            self._lifelines()  # a lifeline's hello that never came is closed by its deadline
            if self._followed:
                self._recheck_names()
            self.metrics.refresh(self.stats())
        self._flush_peers()

    def _flush_peers(self, endpoint: str | None = None) -> None:
        """Send what the pass has for each receiver (``Outbox``); one that cannot take it is lost to its requests."""
        for _ in range(4):  # a lost receiver's failures may have more for the others
            if not self.outbox:
                return
            for ep in self.outbox.flush(self._send_to, endpoint):
                self._apply(self.session.on_peer_lost(ep, self._unreachable.pop(ep, f"receiver {ep} is not reachable"),
                                                      now_ms()))

    def _send_to(self, endpoint: str, frame: bytes) -> bool:
        try:
            sock = self._sock(endpoint)
        except _SOCKET_ERRORS as e:  # its socket cannot be made: its requests fail
            self._unreachable[endpoint] = f"receiver {endpoint}: {e}"
            return False
        if sock is None:  # its host name is resolving: the frame waits for its socket (``_named``)
            self._naming[endpoint][2].append(frame)
            return True
        return control.send_frame(sock, frame)

    def _named(self) -> None:
        """Receivers whose host names have resolved: their sockets, and the frames that waited for them, in order; or
        their requests fail (the name does not resolve, or not within ``control_timeout_ms``)."""
        for endpoint, (look, deadline, held) in list(self._naming.items()):
            if not look.done and time.monotonic() < deadline:
                continue
            if self._naming.get(endpoint, (None,))[0] is not look:
                continue  # (reset by an action of an earlier one in this pass)
            del self._naming[endpoint]
            why = None
            if look.address is not None:
                self._resolved(endpoint, look)
                try:
                    sock = self._sock(endpoint)
                    if not all(control.send_frame(sock, frame) for frame in held):
                        why = f"receiver {endpoint} is not reachable"
                except _SOCKET_ERRORS as e:
                    why = f"receiver {endpoint}: {e}"
            else:
                why = f"receiver {endpoint}: cannot resolve {look.host!r}: " + (
                    look.error or f"no answer within {self.cfg.control_timeout_ms} ms")
            if why is not None:
                self._apply(self.session.on_peer_lost(endpoint, why, now_ms()))

    def _recheck_names(self) -> None:
        """Each named receiver's name, looked up again every ``name_recheck_ms`` on a thread (``resolve.Followed``):
        one that no longer resolves to the address its socket reached (the receiver moved: a pod rescheduled) fails
        that receiver, and the next request reaches the new one. libzmq looked the name up again at each reconnect;
        a connection to a host gone silent never reconnects. A lookup that fails keeps the address."""
        now = time.monotonic()
        for endpoint, name in list(self._followed.items()):
            moved = name.moved(now)
            if moved is None:
                continue
            self.shell_counters["receivers_moved"] += 1
            log.warning("receiver %s: %r now resolves to %s, not %s: connecting there", endpoint, name.host, moved,
                        name.address)
            self._apply(self.session.on_peer_lost(endpoint, f"receiver {endpoint}: {name.host!r} now resolves "
                                                  f"to {moved}, not {name.address}", now_ms()))
            self._reset(endpoint)  # (where no request was in flight, the session had nothing to fail)

    def _lifelines(self) -> None:
        """Engine connections whose lifeline opened, what they sent, and which closed (their process died):
        lifeline.py."""
        for ev in self.lifelines.service():
            if ev.kind == lifeline.FRAME:
                self._take_ring(ev.ident)  # its records were written before this frame was sent
                self._guard(self._on_ingress_frame, ev.ident, ev.payload)
            elif ev.kind == lifeline.NAMED:
                self.session.on_lifeline(ev.ident)
            else:
                self._apply(self.session.on_client_gone(ev.ident, now_ms()))

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a bug in the shell must not end the daemon either
            self.shell_counters["loop_errors"] += 1
            log.exception("internal error handling a frame")

    def _reap(self) -> None:
        """UCX progress (endpoint errors and closes too: without it an idle sender never saw a
        receiver die, and spun on its fd), then what the native path completed: layers landed (one
        notice per request) and receivers whose puts failed."""
        self.ucx.progress()
        if self._naming:
            self._named()
        if self._connecting:
            self._connects()
        landed, failed = self.pusher.poll()
        if self._unsettled:
            self._settle()
        words = self.pusher.take_words()  # layers' readiness words in the pool (completion on the data path)
        if landed or words:  # (before a failure of the same pass: what completed before it did land)
            for _, _, seconds, _ in landed:  # one sample per layer that moved: its batch's post-to-flush time
                if seconds >= 0:
                    self.metrics.layer_seconds.observe(seconds)
            sums = [self._checksum(seq, layer) for seq, layer, _, _ in landed] if self.cfg.checksums else None
            self._apply(self.session.on_landed([(seq, layer) for seq, layer, _, _ in landed], now_ms(), sums, words,
                                               [at * 1000 for _, _, _, at in landed]))
        for eid, status in failed:
            endpoint = self._eid_names[eid]
            err = self.ucx.put_failure(endpoint, status)
            self._apply(self.session.on_peer_lost(endpoint, str(err), now_ms(), err))

    def _checksum(self, seq: int, layer: int) -> int | None:
        """A landed layer's checksum over its shares in staging; None for one that moved nothing."""
        spans = self.session.layer_checksum_spans(seq, layer)
        return combine_digests([xxhash.xxh3_64_intdigest(array_at(a, n)) for a, n in spans]) if spans else None

    def _take_ring(self, ident: bytes) -> int:
        """Take the records in ``ident``'s ring (layers handed over); how many."""
        cid = self.conns.ids.get(ident)
        if cid is None:
            return 0
        n, refused = self.pusher.take(cid)
        if refused:
            self._refused(refused)
        self._finishes()
        return n

    def _finishes(self) -> None:
        """The engines' finish records taken from their rings (after those rings' layer records): each is its
        request's Finish, for the session to decide."""
        by_conn: dict[int, list[int]] = {}
        for cid, handle in self.pusher.take_finished():
            by_conn.setdefault(cid, []).append(handle)
        for cid, handles in by_conn.items():
            ident = self.conns.idents.get(cid)
            if ident is not None:
                self._guard(lambda i=ident, hs=handles: self._apply(self.session.on_ring_finish(i, hs, now_ms())))

    def _refused(self, refused: list[tuple[int, int, int, int, int]]) -> None:
        by_conn: dict[int, list] = {}
        for cid, handle, first, n, why in refused:
            by_conn.setdefault(cid, []).append((handle, first, n, why))
        for cid, records in by_conn.items():
            ident = self.conns.idents.get(cid)
            if ident is not None:
                self._guard(lambda i=ident, rs=records: self._apply(self.session.on_refused(i, rs, now_ms())))

    def _on_ingress_frame(self, ident: bytes, payload: bytes, on_lifeline: bool = True) -> None:
        """A message from an engine's connection (on its lifeline), or from a local ZeroMQ client, which may only
        ask for the status: a request begun there would outlive its engine unseen."""
        try:
            msg = protocol.decode(payload, self.cfg.max_frame_bytes)
        except PdpushError as e:
            if protocol.local_mismatch(e):
                count_skewed(self.shell_counters, e, log)
            self._to_local(ident, protocol.error_reply(e))
            return
        if isinstance(msg, StatusRequest):
            self._to_local(ident, StatusReply(stats=self.stats()))
            return
        if not on_lifeline:
            self._to_local(ident, protocol.error_reply(lifeline.off_lifeline(msg, self.lifelines.path)))
            return
        if isinstance(msg, Wake):
            return  # its records are taken already (_take_ring before each frame)
        self._apply(self.session.on_ingress(ident, msg, now_ms()))

    def _on_peer_frame(self, endpoint: str, payload: bytes) -> None:
        try:
            msgs = protocol.decode_batch(payload, self.cfg.max_frame_bytes)
        except PdpushError as e:
            log.warning("bad frame from receiver %s: %s", endpoint, e)
            return
        self.wire.count("in", *(m.type if isinstance(m, Msg) else "invalid" for m in msgs))
        for msg in msgs:
            if not isinstance(msg, Msg):
                log.warning("bad message from receiver %s: %s", endpoint, msg)
            elif self.socks.get(endpoint) is not None:  # not reset by one before it
                self._apply(self.session.on_peer(endpoint, msg, now_ms()))

    def _apply(self, actions: list) -> None:
        """Carry out the session's actions in order. One that raises (a native call, say) fails only the
        request it belonged to; the rest of the batch, other requests' messages among them, still goes."""
        todo = deque(actions)
        while todo:
            a = todo.popleft()
            try:
                self._do(a, todo)
            except Exception as exc:  # noqa: BLE001 - one action never costs the others theirs
                self.shell_counters["action_errors"] += 1
                todo.extend(self.session.on_action_failed(type(a).__name__, exc, action_owner(a), now_ms()))

    def _do(self, a, todo: deque) -> None:
        """One action; what it sets off (a lost peer's failures, a connection's outcome) joins ``todo``. A
        request costs a dozen actions or so: dispatch is by type, not a chain of isinstance."""
        do = self._doers.get(type(a))
        if do is None:
            self.metrics.apply(a, log)
        else:
            do(a, todo)

    @functools.cached_property
    def _doers(self) -> dict:
        return {ToClient: self._to_client, ToPeer: self._to_peer, Hand: lambda a, _: self._hand(a),
                PlanGrants: self._plan_grants,
                PlanRequest: lambda a, _: self.pusher.add_request(a.handle, self._eid(a.endpoint), a.layers, a.ready,
                                                                  a.tp),
                PlanRank: lambda a, _: self.pusher.add_rank(a.handle, self.conns.ref(a.ident, a.handle), a.first,
                                                            a.end, a.ranges),
                Unplan: self._unplan, Connect: lambda a, todo: todo.extend(self._connect(a)),
                FillWords: self._fill_words, ResetPeer: self._reset_peer, ForgetPeer: self._forget_peer, OpenRing: self._open_ring,
                CloseRing: self._close_ring}

    def _to_client(self, a: ToClient, _todo) -> None:
        self._to_local(a.ident, a.msg)

    def _to_local(self, ident: bytes, msg: Msg) -> None:
        """To an engine's connection over its lifeline; to a local ZeroMQ client (no lifeline) on the ingress."""
        sent = (self.lifelines.send(ident, protocol.encode(msg)) if self.lifelines.has(ident)
                else control.send(self.ingress, msg, ident))
        if not sent:
            count_dropped(self.shell_counters, "ingress_dropped", msg.type, log)

    def _to_peer(self, a: ToPeer, _todo) -> None:
        self.outbox.post(a.endpoint, self._settled(a) if a.handle else a.msg)

    def _plan_grants(self, a: PlanGrants, _todo) -> None:
        """The native path first (it takes a hand-over of a layer only once granted), then the grant table."""
        for layer, off in a.grants:
            self.pusher.grant(a.handle, layer, off)
        words, base = self._words, (a.table - self.region.address) // 8
        for layer, off in a.grants:
            words[base + layer] = off + 1

    def _unplan(self, a: Unplan, _todo) -> None:
        self.pusher.drop_request(a.handle)
        self.conns.unref_request(a.handle)

    def _fill_words(self, a: FillWords, _todo) -> None:
        i = (a.address - self.region.address) // 8
        self._words[i:i + a.count] = a.value

    def _reset_peer(self, a: ResetPeer, _todo) -> None:
        self._flush_peers(a.endpoint)  # what was for the old connection goes on it
        self._reset(a.endpoint)

    def _forget_peer(self, a: ForgetPeer, _todo) -> None:
        self._reset(a.endpoint)
        if (eid := self._eids.pop(a.endpoint, None)) is not None:
            self._eid_names.pop(eid, None)

    def _open_ring(self, a: OpenRing, _todo) -> None:
        self.pusher.add_ring(self.conns.ref(a.ident), a.address, a.slots)

    def _close_ring(self, a: CloseRing, _todo) -> None:
        cid = self.conns.ids.get(a.ident)
        if cid is not None:
            self.pusher.drop_ring(cid)
            self.conns.unref(a.ident)

    # ---- receivers ----
    def _settled(self, a: ToPeer) -> Msg:
        """An Abort of a request whose puts may be in flight: settled if none is (the receiver may reuse its
        pages at once); else sent unsettled, and a settled one follows once they complete (``_settle``). An
        endpoint that failed or was dropped vouches for nothing: the receiver fences it."""
        eid = self._eids.get(a.endpoint)
        if eid is not None and self.pusher.settled(a.handle, eid):
            return a.msg.model_copy(update={"settled": True})
        if eid is not None and a.endpoint in self.eps:
            self._unsettled.append((a.handle, eid, a.endpoint, a.msg.req_id))
        return a.msg

    def _settle(self) -> None:
        still = []
        for handle, eid, endpoint, rid in self._unsettled:
            if endpoint not in self.eps:
                continue  # reset: the receiver sees its endpoint close, or fences it
            if self.pusher.settled(handle, eid):
                self.outbox.post(endpoint, Abort(req_id=rid, reason="its writes settled", settled=True))
            else:
                still.append((handle, eid, endpoint, rid))
        self._unsettled = still

    def _check_receiver(self, endpoint: str) -> None:
        if (why := endpoint_error(endpoint)) is not None:  # (a request's typo: refused here, not a socket's error)
            raise RemoteProtocolError(why)
        if self.keys is not None and self._server_key(endpoint) is None:
            raise IncompatiblePeer(f"no CURVE public key configured for receiver {endpoint} (receiver_keys or "
                                   "receiver_public_key)")

    def _server_key(self, endpoint: str) -> bytes | None:
        return self._receiver_keys.get(endpoint, self._default_key)

    def _sock(self, endpoint: str) -> zmq.Socket | None:
        """The receiver's control socket; None while its host name resolves (a lookup started here, if none is)."""
        sock = self.socks.get(endpoint)
        if sock is None:
            if endpoint in self._naming:
                return None
            host, port = endpoint_host_port(endpoint)
            address = self._addrs.get(endpoint)
            if address is None:
                look = resolve.lookup(host)
                if not look.done:
                    self._naming[endpoint] = (look, time.monotonic() + self.cfg.control_timeout_ms / 1000, [])
                    return None
                if look.address is None:
                    raise ConnectError(f"cannot resolve {host!r}: {look.error}")
                address = self._resolved(endpoint, look)
            sock = self.socks[endpoint] = self._dealer(
                endpoint, f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}")
            self._watch_dirty = True
        return sock

    def _resolved(self, endpoint: str, look: resolve.Lookup) -> str:
        """The address receiver ``endpoint`` is reached at, from now until it fails; a name's is checked again
        (``_recheck_names``)."""
        self._addrs[endpoint] = look.address
        if not resolve.is_address(look.host):
            self._followed[endpoint] = resolve.Followed(look.host, self.cfg.name_recheck_ms / 1000)
            self._followed[endpoint].reached(look.address, time.monotonic())
        return look.address

    def _dealer(self, endpoint: str, address: str) -> zmq.Socket:
        """A DEALER to receiver ``endpoint``, connected to ``address`` (``tcp://<its address>:<port>``)."""
        configure = None
        if self.keys is not None:
            from pdpush import auth

            server_key = self._server_key(endpoint)
            keys = self.keys

            def configure(sock):
                auth.make_client(sock, keys, server_key)

        return control.dealer(address, self.cfg.max_frame_bytes, configure, named=True)

    def _connect(self, a: Connect) -> list:
        """Start the data plane to a receiver and return at once: the loop finishes it (``_connects``) while it
        goes on serving every other receiver, ring and engine (a receiver whose UCX listener never answers holds up
        nobody but its own requests, and those only until ``control_timeout_ms``)."""
        ack = a.ack
        self._drop_ep(a.endpoint)
        try:  # the region this sender's puts write: the native path refuses any put outside it
            pool = (ack.pool_base, PoolGeometry(ack.layout.kv_layout, ack.pool_pages, ack.pool_shards,
                                                ack.state_slots).total_bytes)
        except ValueError as e:  # (an ack the session refuses)
            return self.session.on_connected(a.endpoint, IncompatiblePeer(f"receiver {a.endpoint}: {e}"), now_ms())
        # a host name resolves on a thread (resolve.py): the endpoint is made once it has (``_connects``)
        w = _Wiring(ack, pool, time.monotonic() + self.cfg.control_timeout_ms / 1000,
                    resolve.lookup(self._ucx_host(a.endpoint, ack.ucx_host, self._addrs.get(a.endpoint))))
        if w.lookup.done:
            try:
                self._dial(a.endpoint, w)
            except PdpushError as e:
                return self.session.on_connected(a.endpoint, e, now_ms())
        self._connecting[a.endpoint] = w
        if self.cfg.prefault:  # once wired up (_connects): populate that region, where it is mapped here
            self._regions[a.endpoint] = pool
        return []

    def _ep_closed(self, endpoint: str, ep) -> None:
        """UCX endpoint ``ep`` to ``endpoint`` closed: its receiver is lost, unless ``ep`` was replaced already (it
        failed, this loop reset the peer in the same pass, and a new request dialled it again: its close, dispatched
        later, would fail the new connection's request)."""
        if self.eps.get(endpoint) is ep:
            self._apply(self.session.on_peer_lost(endpoint, f"UCX endpoint to {endpoint} closed (receiver died?)",
                                                  now_ms()))

    def _dial(self, endpoint: str, w: _Wiring) -> None:
        """The receiver's UCX host is resolved: its endpoint, wiring up (or a typed error)."""
        if w.lookup.address is None:
            raise ConnectError(f"cannot resolve {w.lookup.host!r}, receiver {endpoint}'s UCX host: {w.lookup.error}")
        ep = self.ucx.connect(w.lookup.address, w.ack.ucx_port)
        self.eps[endpoint] = ep
        ep.begin_wireup(w.ack.ucx_token, w.ack.rkey)  # the token binds the endpoint to this session
        w.ep = ep

    def _connects(self) -> None:
        """Host names resolved (their endpoints made now), and endpoints whose wire-up completed, failed or ran
        past its deadline: the session hears the outcome."""
        for endpoint, w in list(self._connecting.items()):
            ep, pool = w.ep, w.pool
            try:
                if ep is None and w.lookup.done and time.monotonic() < w.deadline:
                    self._dial(endpoint, w)
                    continue
                if ep is None or not ep.wired_up():
                    if time.monotonic() < w.deadline:
                        continue
                    raise TransportTimeout(f"UCX connection to {endpoint} did not complete within "
                                           f"{self.cfg.control_timeout_ms} ms" + (
                                               "" if ep else f": resolving {w.lookup.host!r} took all of it"))
                ep.on_close(lambda e, endpoint=endpoint: self._ep_closed(endpoint, e))
                ep.attach(self.pusher, self._eid(endpoint), pool)
                if (region := self._regions.pop(endpoint, None)) is not None:
                    self._populated[endpoint] = 0  # (the thread only updates it: stats() may sum meanwhile)
                    ep.populate_peer(*region, lambda n, endpoint=endpoint: self._populated.__setitem__(endpoint, n))
                err = None
            except Exception as e:  # noqa: BLE001 - any failure ends this wire-up (kept, it failed every pass)
                if ep is not None:
                    try:
                        ep.cancel_wireup()
                    except Exception:  # noqa: BLE001 - (the connection fails all the same)
                        log.exception("cancelling the wire-up to %s", endpoint)
                err = e if isinstance(e, PdpushError) else TransferError(
                    f"UCX connection to {endpoint}: {type(e).__name__}: {e}")
                if not isinstance(e, PdpushError):
                    log.exception("wiring up the UCX endpoint to %s", endpoint)
            del self._connecting[endpoint]
            self._apply(self.session.on_connected(endpoint, err, now_ms()))

    def _hand(self, a: Hand) -> None:
        """A LayerReady's layers, taken whole or not at all (as its Python checks did before)."""
        cid = self.conns.ids.get(a.ident)
        runs = ring.runs(list(a.layers))
        if cid is None:  # no plan names the connection: the request ended meanwhile
            refused = [(0, a.handle, runs[0][0], runs[0][1], 1)]
        else:
            refused = [(cid, a.handle, first, n, why) for first, n in runs
                       if (why := self.pusher.check(cid, a.handle, first, n))][:1]
        if refused and cid is not None:
            self._refused(refused)
        elif refused:
            self._apply(self.session.on_refused(a.ident, [r[1:] for r in refused], now_ms()))
        if refused:
            return
        for first, n in runs:
            self.pusher.hand(cid, a.handle, first, n)

    def _eid(self, endpoint: str) -> int:
        eid = self._eids.get(endpoint)
        if eid is None:
            eid = self._eids[endpoint] = next(self._next_eid)
            self._eid_names[eid] = endpoint
        return eid

    @staticmethod
    def _ucx_host(control_endpoint: str, advertised: str, reached: str | None = None) -> str:
        """Connect UCX to the host we reached the control plane on (``reached``: the address its name resolved
        to), unless it advertises a specific one."""
        if advertised not in ("0.0.0.0", "::", ""):
            return advertised
        return reached or endpoint_host_port(control_endpoint)[0]

    def _drop_ep(self, endpoint: str) -> None:
        # its aborted requests' puts may still land: never "settled" now (the receiver fences this sender instead),
        # whatever a new endpoint under the same id says, which ``_connect`` may attach before ``_settle`` looks
        self._unsettled = [u for u in self._unsettled if u[2] != endpoint]
        self._connecting.pop(endpoint, None)
        self._regions.pop(endpoint, None)
        ep = self.eps.pop(endpoint, None)
        if endpoint in self._eids:
            self.pusher.drop_endpoint(self._eids[endpoint])  # its batches, before the endpoint goes
        if ep is not None:
            ep.close()
        self._populated.pop(endpoint, None)  # (its thread stopped in the close)

    def _reset(self, endpoint: str) -> None:
        """A failed receiver: drop its data plane, and its socket (it may hold frames queued for a dead peer), and
        the address its name had (a receiver restarted elsewhere under the same name is looked up anew)."""
        self._drop_ep(endpoint)
        for named in (self._addrs, self._naming, self._followed):
            named.pop(endpoint, None)
        sock = self.socks.pop(endpoint, None)
        if sock is not None:
            sock.close(0)
            self._watch_dirty = True

    def transports(self) -> dict[str, str]:
        """Each receiver's endpoint: the UCX transports and devices its lanes use (``tcp/eth0``, ...)."""
        return {e: " ".join(ep.transports()) for e, ep in self.eps.items() if ep.alive}

    def stats(self) -> dict:
        return {"role": "sender", "ingress_endpoint": self.ingress_endpoint, **self.session.stats(),
                "ucx_transports": json.dumps(self.transports()), **ucx_stats(self.ucx_info),
                **self.pusher.stats(), **self.lifelines.stats(), "metrics_endpoint": self.metrics.endpoint, **self.shell_counters,
                # receivers' pools mapped into this process in advance (their endpoints' threads; prefault)
                "peer_bytes_populated": sum(self._populated.values()),
                **self.wire.stats()}


class _Connections:
    """Engine connections (ZeroMQ identities) by their ids in the pusher, while a ring or a planned request
    names them: an id goes once nothing does, so a sender that serves many short connections keeps none."""

    def __init__(self) -> None:
        self.ids: dict[bytes, int] = {}
        self.idents: dict[int, bytes] = {}
        self._refs: dict[bytes, int] = {}
        self._by_request: dict[int, list[bytes]] = {}
        self._next = 0

    def ref(self, ident: bytes, handle: int | None = None) -> int:
        cid = self.ids.get(ident)
        if cid is None:
            self._next = (self._next + 1) & 0xFFFFFFFF
            while self._next in self.idents or not self._next:
                self._next = (self._next + 1) & 0xFFFFFFFF
            cid = self.ids[ident] = self._next
            self.idents[cid] = ident
        self._refs[ident] = self._refs.get(ident, 0) + 1
        if handle is not None:
            self._by_request.setdefault(handle, []).append(ident)
        return cid

    def unref(self, ident: bytes) -> None:
        left = self._refs.get(ident, 0) - 1
        if left > 0:
            self._refs[ident] = left
            return
        self._refs.pop(ident, None)
        cid = self.ids.pop(ident, None)
        self.idents.pop(cid, None)

    def unref_request(self, handle: int) -> None:
        for ident in self._by_request.pop(handle, ()):
            self.unref(ident)


__all__ = ["Sender"]
