"""Receiver daemon: the shell around ``ReceiverSession`` (sockets, UCX, metrics), on one thread.

Endpoints:
  * ZMQ ROUTER (tcp, loopback by default) for senders: Hello, AllocRequest,
    LayerDone, Commit, Abort, Status; and for routers: IndexSubscribe, after
    which the chunk-index events go out on it (index.py), Withdraw (a push
    that will not come: sessions/receiver.py) and Unread (one nobody will read).
  * UCX listener on the configured address: senders' endpoints; their
    one-sided puts land in the pool.
  * the lifelines (lifeline.py), a 0600 unix stream socket, for the local decode
    engine's connections: Open, Claim, Release, Query, Status; the receiver
    pushes LayerAvailable/Committed on them too.
  * ZMQ ROUTER on a 0600 unix socket for the other local clients: a decode
    scheduler's Query and Withdraw (a push it will not read), and Status
    (an Open or Claim there is refused: it would outlive its engine unseen).

Every decision is the session's; this module moves bytes and carries out its
actions. A frame that does not decode gets a typed Error reply; an exception
anywhere in handling one frame is logged and the loop goes on. Loads UCX
only through pdpush.transport.ucx, when started.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time

import xxhash
import zmq

from pdpush import control, lifeline, protocol
from pdpush.config import ReceiverConfig, is_loopback
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
from pdpush.errors import ConfigError, PdpushError
from pdpush.layout import READY_WORD, combine_digests
from pdpush.protocol import Msg, Query, StatusReply, StatusRequest, Withdraw
from pdpush.sessions.receiver import FenceSender, PoolInfo, ReceiverLimits, ReceiverSession, ToDecode, ToSender

log = logging.getLogger("pdpush.receiver")

TOKEN_BYTES = 32
MAX_UCX_PENDING = 256  # UCX endpoints waiting for their token (a sender opens one per receiver): more are closed at once


class Receiver:
    def __init__(self, cfg: ReceiverConfig) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        self.session: ReceiverSession | None = None
        self.ucx_peers: list = []  # endpoints that presented a valid session token
        self.sender_eps: dict[bytes, list] = {}  # sender session (control identity) -> its UCX endpoints
        self.ucx_pending: list = []  # (endpoint, stream request, buffer, deadline) awaiting their token
        self._ucx_over: list = []  # endpoints accepted past MAX_UCX_PENDING: closed at the next pass
        self.auth = None
        self.reader_keys: frozenset[str] = frozenset()
        self.shell_counters = {"ucx_peers_rejected": 0, "loop_errors": 0, "senders_fenced": 0, "control_dropped": 0,
                               "local_dropped": 0, "local_protocol_refused": 0}
        self.wire = WireCount()  # control messages to and from senders
        self.outbox = Outbox(self.wire)  # what a loop pass has for each sender: one frame each, at its end
        self._last_tick = 0
        self._words = None  # the pool's readiness words, as an array (``_words_landed``)
        self._last_refresh = 0

    # ---- lifecycle ----
    def start(self, stop=None) -> dict:
        """Make the pool and bind the endpoints; ``stop()``: a signal came, the pool's prefault ends where it is."""
        from pdpush import shm
        from pdpush.transport.auto import open_transport
        from pdpush.transport.ucx import local_only_env

        cfg = self.cfg
        # the ports first too: one taken fails the start (exit 3) before a big pool's prefault, not after it
        control.check_port_free(cfg.host, cfg.control_port, "the control endpoint")
        if "rdmacm" not in {**os.environ, **cfg.ucx_env}.get("UCX_SOCKADDR_TLS", ""):  # (its own port space)
            control.check_port_free(cfg.host, cfg.ucx_port, "the UCX listener")
        control.check_port_free(cfg.metrics_host, cfg.metrics_port, "the metrics endpoint")
        control.check_local(cfg.local_socket_path())  # (its directory, and no live daemon on it: before the prefault)
        if cfg.curve_secret_key_file:  # the keys first: a bad key file fails the start before a big pool's prefault
            from pdpush import auth

            keys = auth.load_keypair(cfg.curve_secret_key_file)
            readers = [k for spec in cfg.allowed_readers for k in auth.load_public_keys(spec)]
            # a key listed as a reader is a reader only, though allowed_senders names it too (a directory of keys,
            # as `pdpush keygen --dir` fills one, holds the router's beside the senders'): it had a sender's rights
            listed = [k for spec in cfg.allowed_senders for k in auth.load_public_keys(spec)]
            allowed = [k for k in listed if k not in readers]
            if listed and not allowed:  # (the same folder in both lists, say: every Hello would be refused)
                raise ConfigError("every key in allowed_senders is in allowed_readers too: no sender could push "
                                  "(a reader's key is a reader's only)")
            if len(allowed) < len(listed):
                log.warning("%d key(s) in both allowed_senders and allowed_readers: readers only (no Hello, no "
                            "writes)", len(listed) - len(allowed))
        if not is_loopback(cfg.host):  # (UCX lists its devices once: the one that takes senders' connections runs)
            settle_interface(cfg.host, route=False, stop=stop)
        self.ucx = open_transport(local_only_env(cfg.ucx_env, is_loopback(cfg.host)))
        self.ucx_info = log_ucx(self.ucx, None if is_loopback(cfg.host) else f"host {cfg.host}", cfg.pool_bytes)
        self.region, self.shmid, self.backing = self.ucx.alloc_shared(cfg.pool_bytes)
        if cfg.prefault:
            shm.prefault(self.region.address, self.region.length, stop=stop)
            if stop is not None and stop():  # (told to stop: no endpoint is bound, close() frees the pool)
                return {}
        # no cudaHostRegister here: pinning is per process, and the daemon copies nothing with CUDA;
        # a decode engine pins its own mapping of the pool (DecodeClient(pin_cuda=True))
        self.rkey = self.region.pack_rkey()
        self.ucx_port = self.ucx.listen(cfg.host, cfg.ucx_port, self._on_ucx_peer)
        configure = None
        if cfg.curve_secret_key_file:
            from pdpush import auth

            self.auth = auth.Authenticator(allowed + readers)
            self.reader_keys = frozenset(k.decode() for k in readers)  # as the frames' User-Id names them (Z85)

            def configure(sock):
                auth.make_server(sock, keys)

            log.info("CURVE authentication on: %d sender key(s), %d reader key(s) allowed", len(allowed), len(readers))
        elif cfg.insecure and not is_loopback(cfg.host):
            log.warning("INSECURE: control plane exposed on %s without authentication", cfg.host)
        # a sender's replies in flight are bounded by design (AllocResponse, CommitAck or Error, and an Abort's Ok per
        # lease, max_leases_per_sender leases): the queue holds all of them, so only a peer that stopped reading (or a
        # router's feed far behind, which resubscribes on the gap) ever meets it, and that is counted
        self.router, self.control_endpoint = control.bind_router(cfg.host, cfg.control_port, cfg.max_frame_bytes,
                                                                 configure, hwm=max(1000, 4 * cfg.max_leases_per_sender))
        self.local, self.local_endpoint = control.bind_local(cfg.local_socket_path(), cfg.max_frame_bytes)
        # the decode engines' connections: their messages both ways, and their deaths (lifeline.py)
        self.lifelines = lifeline.Lifelines(lifeline.path_for(cfg.local_socket_path()), cfg.max_frame_bytes)
        from pdpush.metrics import Metrics

        self.metrics = Metrics("receiver", cfg.metrics_host, cfg.metrics_port)
        info = PoolInfo(base=self.region.address, pages=cfg.pool_pages, shmid=self.shmid, rkey=self.rkey,
                        ready_base=self.region.address + self.layout.kv_bytes(cfg.pool_pages), ucx_host=cfg.host,
                        ucx_port=self.ucx_port, daemon_id=secrets.token_hex(8), shards=cfg.pool_shards,
                        state_slots=cfg.geometry.state_slots)
        self.session = ReceiverSession(self.layout, cfg.pool_pages, limits_of(cfg, self.reader_keys), info,
                                       new_token=lambda: secrets.token_bytes(TOKEN_BYTES),
                                       layer_checksum=self._layer_checksum, words_landed=self._words_landed,
                                       epoch=secrets.token_hex(8), new_lease=lambda: secrets.randbits(64) or 1)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.local, zmq.POLLIN)
        self.poller.register(self.ucx.epoll_fd, zmq.POLLIN)
        self.poller.register(self.lifelines.fileno(), zmq.POLLIN)
        return {"role": "receiver", "control_endpoint": self.control_endpoint, "local_endpoint": self.local_endpoint,
                "ucx_port": self.ucx_port, "pool_bytes": cfg.pool_bytes, "shmid": self.shmid, "backing": self.backing,
                "fingerprint": self.layout.fingerprint(), "auth": "curve" if self.auth else "none",
                "metrics_endpoint": self.metrics.endpoint}

    def close(self) -> None:
        if self.session is not None and getattr(self, "router", None) is not None:
            try:  # chunk-index subscribers drop this receiver's keys at once
                self._apply(self.session.farewell(now_ms()))
                self._flush_senders()
            except Exception:  # noqa: BLE001 - closing goes on regardless
                log.exception("sending the index farewell")
        if getattr(self, "router", None) is not None:
            control.close_peer_socket(self.router)  # (the farewell, queued, leaves by the process's end)
        if getattr(self, "local", None) is not None:
            control.close_local(self.local, self.local_endpoint)
        for ep in self.ucx_peers + [p[0] for p in self.ucx_pending]:
            ep.close()
        self.ucx_peers, self.ucx_pending = [], []
        if getattr(self, "lifelines", None) is not None:
            self.lifelines.close()
        if self.auth is not None:
            self.auth.stop()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        if getattr(self, "region", None) is not None:
            self.region.close()
        if getattr(self, "ucx", None) is not None:
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

    # ---- loop ----
    def step(self, timeout_ms: int) -> None:
        """One pass. Only what woke the poll is looked at (a socket with a frame, a lifeline's change), and the
        rest each tick: over tcp every arrival of a sender's put wakes the loop for UCX progress alone."""
        self.ucx.progress()
        events = dict(self.poller.poll(timeout_ms if self.ucx.arm() and not self.lifelines.pending() else 0))
        self.ucx.progress()
        self.ucx.dispatch_closed()
        if self.router in events:
            for frames in control.recv_ready(self.router, copy=False):  # bounded, so the tick below always runs
                self._on_frames(frames, local=False)
        if self.local in events:
            for frames in control.recv_ready(self.local, copy=False):
                self._on_frames(frames, local=True)
        if self.ucx_pending or self._ucx_over:
            self._check_ucx_peers()
        t = now_ms()
        due = t - self._last_tick >= 10
        if due or self.lifelines.fileno() in events or self.lifelines.pending():  # (a hello's deadline: each tick)
            for ev in self.lifelines.service():
                if ev.kind == lifeline.FRAME:
                    self._guarded(self._on_frame, ev.ident, ev.payload, True, on_lifeline=True)
                elif ev.kind == lifeline.GONE:  # a decode connection whose engine died: its opens are released
                    self._apply(self.session.on_reader_gone(ev.ident, now_ms()))
        if due:
            self._last_tick = t
            self._apply(self.session.on_tick(t))
            if t - self._last_refresh >= 100:  # gauges ~10 times a second
                self._last_refresh = t
                self.metrics.refresh(self.stats())
        self._flush_senders()

    def _flush_senders(self) -> None:
        """Send what the pass has for each sender (and router) in one frame (``Outbox``)."""
        if self.outbox:
            for _ in self.outbox.flush(lambda ident, frame: control.send_frame(self.router, frame, ident)):
                count_dropped(self.shell_counters, "control_dropped", "a frame", log)

    def _on_frames(self, frames: list, local: bool) -> None:
        if len(frames) < 2:
            return  # nothing to reply to
        # with CURVE, the peer's public key (Z85) as the authenticator admitted it: roles and caps go by key
        peer = _user_id(frames[-1]) if self.auth is not None and not local else ""
        self._guarded(self._on_frame, frames[0].bytes, frames[-1].bytes, local, peer)

    def _guarded(self, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a bug in the shell must not end the daemon either
            self.shell_counters["loop_errors"] += 1
            log.exception("internal error handling a frame")

    def _on_frame(self, ident: bytes, payload: bytes, local: bool, peer: str = "", on_lifeline: bool = False) -> None:
        """A frame from a sender (or a router), from a decode engine's connection (on its lifeline), or from a
        local ZeroMQ client, which may only ask (Query, status) or withdraw a push (a decode scheduler that stopped
        waiting for it): an open made there would outlive its engine."""
        try:  # a peer daemon's frame may carry a batch (daemon.Outbox); an engine's is one message
            msgs = [protocol.decode(payload, self.cfg.max_frame_bytes)] if local else \
                protocol.decode_batch(payload, self.cfg.max_frame_bytes)
        except PdpushError as e:
            if local and protocol.local_mismatch(e):
                count_skewed(self.shell_counters, e, log)
            self._apply(self.session.bad_frame(ident, e, local))
            return
        kinds = [m.type if isinstance(m, Msg) else "invalid" for m in msgs if not isinstance(m, StatusRequest)]
        if kinds and not local:  # a status request is not a message between the daemons
            self.wire.count("in", *kinds)
        for msg in msgs:
            if isinstance(msg, PdpushError):
                self._apply(self.session.bad_frame(ident, msg, local))
            elif isinstance(msg, StatusRequest):
                self._apply(self.session.look(now_ms()))  # requests whose readiness words are in count as committed
                if local:
                    self._to_local(ident, StatusReply(stats=self.stats()))
                else:
                    control.send(self.router, StatusReply(stats=self.stats()), ident)
            elif local and not on_lifeline and not isinstance(msg, (Query, Withdraw)):  # (a decode scheduler's)
                self._apply(self.session.bad_frame(ident, lifeline.off_lifeline(msg, self.lifelines.path), local))
            else:
                t = now_ms()
                self._apply(self.session.on_local(ident, msg, t) if local else
                            self.session.on_control(ident, msg, t, peer))

    def _apply(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, ToSender):
                self.outbox.post(a.ident, a.msg)
            elif isinstance(a, ToDecode):
                self._to_local(a.ident, a.msg)
            elif isinstance(a, FenceSender):
                self._fence(a.ident)
            else:
                self.metrics.apply(a, log)

    def _to_local(self, ident: bytes, msg: Msg) -> None:
        """To a decode engine's connection over its lifeline; to a local ZeroMQ client (no lifeline) on the local
        socket."""
        sent = (self.lifelines.send(ident, protocol.encode(msg)) if self.lifelines.has(ident)
                else control.send(self.local, msg, ident))
        if not sent:
            count_dropped(self.shell_counters, "local_dropped", msg.type, log)

    # ---- UCX ----
    def _on_ucx_peer(self, ep) -> None:
        """A new UCX peer must send a one-time token from a HelloAck on its stream, or be dropped."""
        if len(self.ucx_pending) >= MAX_UCX_PENDING:  # the UCX port takes connections from anyone who can reach it
            self._ucx_over.append(ep)
            return
        req, buf = ep.post_stream_recv(TOKEN_BYTES)
        self.ucx_pending.append((ep, req, buf, time.monotonic() + self.cfg.ucx_token_timeout_ms / 1000))

    def _check_ucx_peers(self) -> None:
        now = time.monotonic()
        still, rejected = [], [(ep, f"over {MAX_UCX_PENDING} waiting for their token") for ep in self._ucx_over]
        self._ucx_over = []
        for ep, req, buf, deadline in self.ucx_pending:
            if req.completed:
                ident = self.session.accept_ucx_token(buf.tobytes()) if ep.request_ok(req) else None
                if ident is not None:
                    self.ucx_peers.append(ep)
                    self.sender_eps.setdefault(ident, []).append(ep)
                    ep.on_close(lambda e, i=ident: self._ucx_peer_closed(i, e))
                else:
                    rejected.append((ep, "invalid session token"))
            elif now > deadline or not ep.alive:
                rejected.append((ep, "no session token in time"))
            else:
                still.append((ep, req, buf, deadline))
        # drop every reference to the pending receives first: a live request keeps its endpoint open
        self.ucx_pending = still
        del req, buf
        for ep, why in rejected:  # (logged at the 1st, 2nd, 4th, ...: a flood of connects makes no flood of lines)
            n = self.shell_counters["ucx_peers_rejected"] = self.shell_counters["ucx_peers_rejected"] + 1
            if n & (n - 1) == 0:
                log.warning("dropping UCX peer: %s (%d dropped so far)", why, n)
            ep.close()

    def _ucx_peer_closed(self, ident: bytes, ep) -> None:
        """A sender's endpoint closed (it died, restarted, or closed it): once it has none left, none of its
        writes can land, and its requests in flight cannot complete."""
        if ep in self.ucx_peers:
            self.ucx_peers.remove(ep)
        eps = self.sender_eps.get(ident, [])
        if ep in eps:
            eps.remove(ep)
        if not eps:
            self.sender_eps.pop(ident, None)
            self._apply(self.session.on_sender_lost(ident, now_ms()))
        ep.close()  # (a failed endpoint still holds its UCX handle until closed: one a sender's reconnect, for good)

    def _fence(self, ident: bytes) -> None:
        """Close every UCX endpoint of a sender session (force: its in-flight operations are canceled, and
        what its peer still sends on the connection finds it closed): no late write of it lands after this."""
        eps = self.sender_eps.pop(ident, [])
        for ep in eps:
            if ep in self.ucx_peers:
                self.ucx_peers.remove(ep)
            ep.close()
        self.shell_counters["senders_fenced"] += 1
        self.metrics.senders_fenced.inc()
        log.warning("fenced a sender: closed its %d UCX endpoint(s) before reusing its requests' pages", len(eps))

    # ---- pool bytes ----
    def _layer_checksum(self, ranges: list[list[tuple[int, int]]]) -> int:
        from pdpush.shm import array_at

        digests = []
        for share in ranges:
            h = xxhash.xxh3_64()
            for off, n in share:
                h.update(array_at(self.region.address + off, n))
            digests.append(h.intdigest())
        return combine_digests(digests)

    def _words_landed(self, r) -> bool:
        """Whether every readiness word of request ``r`` (layout.py: ready[layer, page]) holds its lease id."""
        import numpy as np

        from pdpush.shm import array_at

        if self._words is None:  # ready[layer, page], flat
            n = self.layout.layers * self.cfg.pool_pages
            self._words = array_at(self.region.address + self.layout.kv_bytes(self.cfg.pool_pages), n * READY_WORD
                                   ).view(np.uint64)
        if r.words_at is None:  # the request's words' indexes, once: last layer first (the last to land, mostly)
            pp = self.cfg.pool_pages
            r.words_at = np.concatenate([(np.asarray(layers[::-1], dtype=np.int64)[:, None] * pp
                                          + np.asarray(pages, dtype=np.int64)[None, :]).ravel()
                                         for layers, pages in r.plan.ready_cells()])
        return bool((self._words[r.words_at] == r.lease_id).all())

    def transports(self) -> dict[str, str]:
        """Each sender's endpoint, by its peer's address: the UCX transports and devices its lanes use."""
        return {ep.peer(): " ".join(ep.transports()) for ep in self.ucx_peers if ep.handle is not None}

    def stats(self) -> dict:
        return {"role": "receiver", "control_endpoint": self.control_endpoint, **self.session.stats(),
                "ucx_peers": len(self.ucx_peers), "ucx_peers_pending": len(self.ucx_pending),
                "ucx_endpoints": self.ucx.endpoints(),
                **self.lifelines.stats(), "ucx_transports": json.dumps(self.transports()), **ucx_stats(self.ucx_info),
                "auth": "curve" if self.auth else "none", "metrics_endpoint": self.metrics.endpoint,
                **self.shell_counters, **self.wire.stats()}


def _user_id(frame) -> str:
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:  # no metadata: not an authenticated connection
        return ""


def limits_of(cfg: ReceiverConfig, reader_keys: frozenset[str] = frozenset()) -> ReceiverLimits:
    return ReceiverLimits(lease_ms=cfg.lease_ms, quarantine_ms=cfg.quarantine_ms,
                          committed_ttl_ms=cfg.committed_ttl_ms, max_chunks_per_request=cfg.max_chunks_per_request,
                          max_leases_per_sender=cfg.max_leases_per_sender,
                          max_inflight_bytes_per_sender=cfg.max_inflight_bytes_per_sender,
                          verify_checksums=cfg.verify_checksums, reader_keys=reader_keys)
