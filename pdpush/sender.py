"""Sender daemon: local ingress + staging + per-receiver control sessions + UCX puts.

One thread runs everything, including UCX progress. For each request:
  Begin (client) -> [Hello/HelloAck + UCX connect, once per receiver]
  -> AllocRequest -> AllocResponse -> BeginOk (client: staging slot, skip list)
  -> per LayerReady (client): puts of the new chunks, coalesced by page run,
     one flush, then LayerDone -> Finish (client) -> Commit -> CommitAck -> Done.
A request counts as delivered only on the CommitAck. Every wait has a deadline.
Imports ucxx only through pdpush.transport.ucx, when started.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from enum import Enum

import xxhash
import zmq

from pdpush import control, protocol
from pdpush.config import SenderConfig
from pdpush.errors import ErrorCode, PdpushError, PoolExhausted, ProtocolError, TransportError
from pdpush.layout import KVLayout
from pdpush.protocol import (
    Abort,
    AllocRequest,
    AllocResponse,
    Begin,
    BeginOk,
    Commit,
    CommitAck,
    Done,
    Error,
    Finish,
    Hello,
    HelloAck,
    LayerDone,
    LayerReady,
    Ok,
    StatusReply,
    StatusRequest,
)
from pdpush.staging import StagingAllocator

log = logging.getLogger("pdpush.sender")


class PeerState(Enum):
    NEW = "new"
    HELLO_SENT = "hello_sent"
    READY = "ready"
    DEAD = "dead"


class TxState(Enum):
    WAIT_PEER = "wait_peer"
    ALLOCATING = "allocating"
    ALLOC_BACKOFF = "alloc_backoff"  # receiver said pool_exhausted; retrying within a budget
    STREAMING = "streaming"
    COMMITTING = "committing"


@dataclass
class Peer:
    endpoint: str
    sock: zmq.Socket
    state: PeerState = PeerState.NEW
    ack: HelloAck | None = None
    ep: object | None = None
    deadline: float = 0.0
    waiting: list[str] = field(default_factory=list)


@dataclass
class TxRequest:
    req_id: str
    client: bytes
    peer: Peer
    begin: Begin
    layout: KVLayout
    state: TxState
    deadline: float
    t0: float
    staging_off: int | None = None
    n_new: int = 0
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (new-chunk idx, first page, n)
    skipped: int = 0
    layers_sent: set[int] = field(default_factory=set)
    finish: bool = False
    puts: int = 0
    bytes_sent: int = 0
    layer_done_ms: list[float] = field(default_factory=list)
    alloc_attempts: int = 0
    t_alloc: float = 0.0


class Sender:
    def __init__(self, cfg: SenderConfig) -> None:
        self.cfg = cfg
        self.peers: dict[str, Peer] = {}
        self.reqs: dict[str, TxRequest] = {}
        self.draining = False
        self.counters = {"requests_total": 0, "requests_done": 0, "requests_failed": 0, "bytes_pushed": 0,
                         "puts": 0, "layers_pushed": 0, "chunks_skipped": 0, "alloc_retries": 0}
        self._poller_dirty = True
        self.keys = None
        if cfg.curve_secret_key_file:
            from pdpush import auth

            self.keys = auth.load_keypair(cfg.curve_secret_key_file)

    # ---- lifecycle ----
    def start(self) -> dict:
        from pdpush import shm
        from pdpush.transport.ucx import UcxWorker

        self.ucx = UcxWorker(dict(self.cfg.ucx_env))
        self.region, self.shmid, self.backing = self.ucx.alloc_shared(self.cfg.staging_bytes)
        if self.cfg.prefault:
            shm.prefault(self.region.address, self.region.length)
        self.staging = StagingAllocator(self.region.length)
        self.ingress, self.ingress_endpoint = control.bind_local(self.cfg.ingress_socket_path(),
                                                                 self.cfg.max_frame_bytes)
        from pdpush.metrics import Metrics

        self.metrics = Metrics("sender", self.cfg.metrics_host, self.cfg.metrics_port)
        self._last_refresh = 0.0
        return {"role": "sender", "ingress_endpoint": self.ingress_endpoint, "staging_bytes": self.region.length,
                "shmid": self.shmid, "backing": self.backing, "metrics_endpoint": self.metrics.endpoint}

    def close(self) -> None:
        for p in self.peers.values():
            self._drop_peer_transport(p)
            p.sock.close(0)
        if getattr(self, "ingress", None) is not None:
            self.ingress.close(0)
        if getattr(self, "region", None) is not None:
            self.region.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()

    def begin_drain(self) -> None:
        self.draining = True

    def drained(self) -> bool:
        return not self.reqs

    def abort_all(self, reason: str) -> None:
        for r in list(self.reqs.values()):
            self._fail(r, ErrorCode.SHUTTING_DOWN, reason, tell_receiver=True)

    def _poller(self) -> zmq.Poller:
        if self._poller_dirty:
            self.poller = zmq.Poller()
            self.poller.register(self.ingress, zmq.POLLIN)
            self.poller.register(self.ucx.epoll_fd, zmq.POLLIN)
            for p in self.peers.values():
                self.poller.register(p.sock, zmq.POLLIN)
            self._poller_dirty = False
        return self.poller

    # ---- loop ----
    def step(self, timeout_ms: int) -> None:
        self.ucx.progress()
        poller = self._poller()
        events = dict(poller.poll(timeout_ms if self.ucx.arm() else 0))
        self.ucx.progress()
        self.ucx.dispatch_closed()
        for p in list(self.peers.values()):
            if p.sock in events:
                for _ in range(256):
                    try:
                        frames = p.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_peer(p, frames[-1])
        for _ in range(256):
            try:
                frames = self.ingress.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) >= 2:
                self._on_ingress(frames[0], frames[-1])
        self._check_deadlines()
        now = time.monotonic()
        if now - self._last_refresh > 0.1:  # gauges ~10 times a second
            self._last_refresh = now
            self.metrics.refresh(self.stats())

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for p in self.peers.values():
            if p.state is PeerState.HELLO_SENT and now > p.deadline:
                self._peer_failed(p, ErrorCode.TIMEOUT, f"receiver {p.endpoint} did not answer hello within "
                                  f"{self.cfg.control_timeout_ms} ms (down, unreachable, or refusing our CURVE key)")
        for r in list(self.reqs.values()):
            if r.state is TxState.ALLOC_BACKOFF and now >= r.deadline:
                self._send_alloc(r)
            elif r.state in (TxState.ALLOCATING, TxState.COMMITTING, TxState.WAIT_PEER) and now > r.deadline:
                self._fail(r, ErrorCode.TIMEOUT, f"no {r.state.value} reply from {r.peer.endpoint} within "
                           f"{self.cfg.control_timeout_ms} ms", tell_receiver=True)
            elif r.state is TxState.STREAMING and now > r.deadline:
                self._fail(r, ErrorCode.TIMEOUT, "prefill engine did not finish the request before the lease "
                           "deadline", tell_receiver=True)

    # ---- ingress (prefill engine) ----
    def _on_ingress(self, ident: bytes, payload: bytes) -> None:
        msg = None
        try:
            msg = protocol.decode(payload, self.cfg.max_frame_bytes)
            if isinstance(msg, Begin):
                self._begin(ident, msg)
            elif isinstance(msg, LayerReady):
                self._layer_ready(ident, msg)
            elif isinstance(msg, Finish):
                self._finish(ident, msg)
            elif isinstance(msg, Abort):
                r = self._client_req(ident, msg.req_id)
                self._fail(r, ErrorCode.ABORTED, msg.reason or "aborted by prefill engine", tell_receiver=True)
            elif isinstance(msg, StatusRequest):
                control.send(self.ingress, StatusReply(stats=self.stats()), ident)
            else:
                raise ProtocolError(f"sender does not accept {msg.type} on the ingress", code=ErrorCode.UNEXPECTED)
        except PdpushError as e:
            rid = getattr(msg, "req_id", None)
            control.send(self.ingress, protocol.error(e.code, str(e), rid), ident)

    def _client_req(self, ident: bytes, req_id: str) -> TxRequest:
        r = self.reqs.get(req_id)
        if r is None or r.client != ident:
            raise ProtocolError(f"unknown request {req_id!r}", code=ErrorCode.UNKNOWN_REQUEST)
        return r

    def _begin(self, ident: bytes, msg: Begin) -> None:
        if self.draining:
            raise PdpushError("sender is draining", code=ErrorCode.SHUTTING_DOWN)
        if msg.req_id in self.reqs:
            raise ProtocolError(f"request {msg.req_id!r} already in flight", code=ErrorCode.DUPLICATE_REQUEST)
        layout = KVLayout(**msg.layout.model_dump())
        if len(msg.chunk_keys) > 0 and layout.layers * len(msg.chunk_keys) * layout.page_bytes > self.staging.size:
            raise PdpushError(f"request needs more staging than staging_bytes={self.staging.size}",
                              code=ErrorCode.TOO_LARGE)
        receiver = msg.receiver or self.cfg.default_receiver
        peer = self._peer(receiver)
        now = time.monotonic()
        r = TxRequest(msg.req_id, ident, peer, msg, layout, TxState.WAIT_PEER,
                      now + self.cfg.control_timeout_ms / 1000, now)
        if peer.ack is not None and peer.ack.layout != msg.layout:
            raise PdpushError(f"receiver {receiver} serves layout {peer.ack.layout.model_dump()}, request has "
                              f"{msg.layout.model_dump()}", code=ErrorCode.INCOMPATIBLE_PEER)
        self.reqs[r.req_id] = r
        self.counters["requests_total"] += 1
        if peer.state is PeerState.READY:
            self._send_alloc(r)
        else:
            peer.waiting.append(r.req_id)
            if peer.state in (PeerState.NEW, PeerState.DEAD):
                self._hello(peer, msg)

    def _peer(self, endpoint: str) -> Peer:
        p = self.peers.get(endpoint)
        if p is None:
            p = Peer(endpoint, self._dealer(endpoint))
            self.peers[endpoint] = p
            self._poller_dirty = True
        return p

    def _dealer(self, endpoint: str) -> zmq.Socket:
        configure = None
        if self.keys is not None:
            from pdpush import auth

            spec = self.cfg.receiver_keys.get(endpoint) or self.cfg.receiver_public_key
            if not spec:
                raise PdpushError(f"no CURVE public key configured for receiver {endpoint} (receiver_keys or "
                                  "receiver_public_key)", code=ErrorCode.INCOMPATIBLE_PEER)
            server_key = auth.load_public_keys(spec)[0]
            keys = self.keys

            def configure(sock):
                auth.make_client(sock, keys, server_key)

        return control.dealer(endpoint, self.cfg.max_frame_bytes, configure)

    def _hello(self, peer: Peer, begin: Begin) -> None:
        layout = KVLayout(**begin.layout.model_dump())
        hello = Hello(version=protocol.PROTOCOL_VERSION, fingerprint=layout.fingerprint(), layout=begin.layout)
        peer.state = PeerState.HELLO_SENT
        peer.deadline = time.monotonic() + self.cfg.control_timeout_ms / 1000
        if not control.send(peer.sock, hello):
            self._peer_failed(peer, ErrorCode.PEER_DEAD, f"receiver {peer.endpoint} is not reachable")

    def _send_alloc(self, r: TxRequest) -> None:
        b = r.begin
        r.state = TxState.ALLOCATING
        r.alloc_attempts += 1
        r.t_alloc = time.monotonic()
        r.deadline = time.monotonic() + self.cfg.control_timeout_ms / 1000
        msg = AllocRequest(req_id=r.req_id, chunk_keys=b.chunk_keys, last_chunk_tokens=b.last_chunk_tokens,
                           lease_ms=self.cfg.lease_ms)
        if not control.send(r.peer.sock, msg):
            self._fail(r, ErrorCode.PEER_DEAD, f"receiver {r.peer.endpoint} is not reachable")

    def _layer_ready(self, ident: bytes, msg: LayerReady) -> None:
        r = self._client_req(ident, msg.req_id)
        if r.state is not TxState.STREAMING:
            raise ProtocolError(f"layer_ready for {r.req_id!r} in state {r.state.value}", code=ErrorCode.UNEXPECTED)
        if msg.layer >= r.layout.layers or msg.layer in r.layers_sent:
            raise ProtocolError(f"layer {msg.layer} out of range or already sent", code=ErrorCode.BAD_MESSAGE)
        try:
            self._push_layer(r, msg.layer)
        except TransportError as e:
            # a put that failed or did not flush in time: this endpoint is not trustworthy any more;
            # fail its requests and start afresh (hello, new endpoint) on the next request
            self._fail(r, e.code, str(e), tell_receiver=True)
            self._peer_failed(r.peer, e.code, f"data plane to {r.peer.endpoint} failed: {e}")
        except PdpushError as e:
            self._fail(r, e.code, str(e), tell_receiver=True)

    def _push_layer(self, r: TxRequest, layer: int) -> None:
        from pdpush.transport.ucx import PutOp

        pb = r.layout.page_bytes
        ack = r.peer.ack
        checksum = None
        if r.n_new:
            src_layer = self.region.address + r.staging_off + layer * r.n_new * pb
            ops = [PutOp(src_layer + idx * pb, ack.pool_base + (layer * ack.pool_pages + page) * pb, n * pb)
                   for idx, page, n in r.runs]
            t = time.monotonic()
            r.puts += r.peer.ep.put_many(ops, self.cfg.layer_timeout_ms / 1000)
            self.metrics.layer_seconds.observe(time.monotonic() - t)
            nbytes = r.n_new * pb
            r.bytes_sent += nbytes
            self.counters["bytes_pushed"] += nbytes
            self.metrics.bytes.inc(nbytes)
            if self.cfg.checksums:
                from pdpush.shm import array_at

                checksum = xxhash.xxh3_64_intdigest(array_at(src_layer, nbytes))
        r.layers_sent.add(layer)
        self.counters["layers_pushed"] += 1
        self.metrics.layers.inc()
        if not control.send(r.peer.sock, LayerDone(req_id=r.req_id, layer=layer, checksum=checksum)):
            raise PdpushError(f"receiver {r.peer.endpoint} is not reachable", code=ErrorCode.PEER_DEAD)
        r.layer_done_ms.append((time.monotonic() - r.t0) * 1000)
        if r.finish and len(r.layers_sent) == r.layout.layers:
            self._send_commit(r)

    def _finish(self, ident: bytes, msg: Finish) -> None:
        r = self._client_req(ident, msg.req_id)
        if r.state is not TxState.STREAMING:
            raise ProtocolError(f"finish for {r.req_id!r} in state {r.state.value}", code=ErrorCode.UNEXPECTED)
        r.finish = True
        if len(r.layers_sent) == r.layout.layers:
            self._send_commit(r)

    def _send_commit(self, r: TxRequest) -> None:
        r.state = TxState.COMMITTING
        r.deadline = time.monotonic() + self.cfg.control_timeout_ms / 1000
        if not control.send(r.peer.sock, Commit(req_id=r.req_id)):
            self._fail(r, ErrorCode.PEER_DEAD, f"receiver {r.peer.endpoint} is not reachable")

    # ---- receiver replies ----
    def _on_peer(self, p: Peer, payload: bytes) -> None:
        try:
            msg = protocol.decode(payload, self.cfg.max_frame_bytes)
        except PdpushError as e:
            log.warning("bad frame from receiver %s: %s", p.endpoint, e)
            return
        if isinstance(msg, HelloAck):
            self._on_hello_ack(p, msg)
        elif isinstance(msg, AllocResponse):
            r = self.reqs.get(msg.req_id)
            if r is not None and r.state is TxState.ALLOCATING:
                self._on_alloc(r, msg)
            else:  # we gave up on it; do not hold the receiver's pages
                control.send(p.sock, Abort(req_id=msg.req_id, reason="sender no longer wants it"))
        elif isinstance(msg, CommitAck):
            r = self.reqs.get(msg.req_id)
            if r is not None and r.state is TxState.COMMITTING:
                self._done(r)
        elif isinstance(msg, Error):
            r = self.reqs.get(msg.req_id) if msg.req_id else None
            if (r is not None and r.peer is p and r.state is TxState.ALLOCATING
                    and msg.code is ErrorCode.POOL_EXHAUSTED and self._backoff(r, msg.retry_after_ms or 20, msg.message)):
                return
            if r is not None and r.peer is p:
                self._fail(r, msg.code, f"receiver: {msg.message}", retry_after_ms=msg.retry_after_ms)
            elif p.state is PeerState.HELLO_SENT:
                self._peer_failed(p, msg.code, f"receiver refused hello: {msg.message}", dead=False)
            else:
                log.warning("error from receiver %s: %s %s", p.endpoint, msg.code.value, msg.message,
                            extra={"req_id": msg.req_id})
        elif isinstance(msg, Ok):
            pass
        else:
            log.warning("unexpected %s from receiver %s", msg.type, p.endpoint)

    def _backoff(self, r: TxRequest, retry_after_ms: int, why: str) -> bool:
        """Retry an exhausted allocation later, within ``alloc_retry_budget_ms`` of the first try."""
        now = time.monotonic()
        retry_at = now + retry_after_ms / 1000
        if retry_at - r.t0 > self.cfg.alloc_retry_budget_ms / 1000:
            self._fail(r, ErrorCode.POOL_EXHAUSTED,
                       f"receiver pool exhausted; gave up after {r.alloc_attempts} attempts in "
                       f"{(now - r.t0) * 1000:.0f} ms (alloc_retry_budget_ms={self.cfg.alloc_retry_budget_ms}); "
                       f"receiver: {why}")
            return True
        r.state = TxState.ALLOC_BACKOFF
        r.deadline = retry_at
        self.counters["alloc_retries"] += 1
        return True

    def _on_hello_ack(self, p: Peer, ack: HelloAck) -> None:
        if p.state is not PeerState.HELLO_SENT:
            return
        try:
            self._drop_peer_transport(p)
            ep = self.ucx.connect(self._ucx_host(p.endpoint, ack.ucx_host), ack.ucx_port)
            ep.stream_send(ack.ucx_token, self.cfg.control_timeout_ms / 1000)  # binds the endpoint to this session
            ep.set_rkey(ack.rkey, self.cfg.control_timeout_ms / 1000)
            ep.on_close(lambda _e, p=p: self._on_ep_closed(p))
        except PdpushError as e:
            self._peer_failed(p, ErrorCode.PEER_DEAD, f"cannot open the data plane to {p.endpoint}: {e}")
            return
        p.ep, p.ack, p.state = ep, ack, PeerState.READY
        log.info("receiver %s ready (pool %d pages x %d B)", p.endpoint, ack.pool_pages, ack.page_bytes)
        waiting, p.waiting = p.waiting, []
        for rid in waiting:
            r = self.reqs.get(rid)
            if r is None:
                continue
            if r.begin.layout != ack.layout:
                self._fail(r, ErrorCode.INCOMPATIBLE_PEER, "layout differs from the receiver's")
            else:
                self._send_alloc(r)

    @staticmethod
    def _ucx_host(control_endpoint: str, advertised: str) -> str:
        """Connect UCX to the host we reached the control plane on, unless it advertises a specific one."""
        if advertised not in ("0.0.0.0", "::", ""):
            return advertised
        return control_endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")

    def _on_ep_closed(self, p: Peer) -> None:
        if p.state is PeerState.READY:
            self._peer_failed(p, ErrorCode.PEER_DEAD, f"UCX endpoint to {p.endpoint} closed (receiver died?)")

    def _on_alloc(self, r: TxRequest, a: AllocResponse) -> None:
        self.metrics.alloc_rtt.observe(time.monotonic() - r.t_alloc)
        self.metrics.chunks_hit.inc(len(a.already_sent_indexes))
        layout = r.layout
        n_chunks = len(r.begin.chunk_keys)
        r.skipped = len(a.already_sent_indexes)
        r.n_new = n_chunks - r.skipped
        if sum(n for _, n in a.page_runs) != r.n_new:
            self._fail(r, ErrorCode.BAD_MESSAGE, "receiver's page runs do not cover the new chunks",
                       tell_receiver=True)
            return
        idx = 0
        for page, n in a.page_runs:
            r.runs.append((idx, page, n))
            idx += n
        try:
            r.staging_off = self.staging.alloc(max(1, layout.layers * r.n_new * layout.page_bytes))
        except PdpushError as e:
            self._fail(r, e.code, str(e), tell_receiver=True)
            return
        r.state = TxState.STREAMING
        # the engine has until just before the lease ends to hand over every layer
        lease_left = a.expires_at_ms / 1000 - time.monotonic()
        r.deadline = time.monotonic() + max(0.0, min(self.cfg.lease_ms / 1000, lease_left) * 0.9)
        self.counters["chunks_skipped"] += r.skipped
        control.send(self.ingress, BeginOk(req_id=r.req_id, already_sent_indexes=a.already_sent_indexes,
                                           staging_shmid=self.shmid, staging_bytes=self.region.length,
                                           staging_offset=r.staging_off,
                                           new_chunks=r.n_new, daemon_pid=os.getpid()), r.client)

    def _done(self, r: TxRequest) -> None:
        self._release(r)
        self.counters["requests_done"] += 1
        self.metrics.requests.inc()
        self.metrics.request_seconds.observe(time.monotonic() - r.t0)
        control.send(self.ingress, Done(req_id=r.req_id, bytes_sent=r.bytes_sent, puts=r.puts,
                                        layers=len(r.layers_sent), chunks_skipped=r.skipped,
                                        layer_done_ms=r.layer_done_ms), r.client)

    def _release(self, r: TxRequest) -> None:
        if r.staging_off is not None:
            self.staging.free(r.staging_off)
            r.staging_off = None
        self.reqs.pop(r.req_id, None)

    def _fail(self, r: TxRequest, code: ErrorCode, why: str, tell_receiver: bool = False,
              retry_after_ms: int | None = None) -> None:
        if r.req_id not in self.reqs:
            return
        log.warning("request failed: %s: %s", code.value, why, extra={"req_id": r.req_id})
        if tell_receiver and r.state in (TxState.ALLOCATING, TxState.STREAMING, TxState.COMMITTING):
            control.send(r.peer.sock, Abort(req_id=r.req_id, reason=why[:1000]))
        self._release(r)
        self.counters["requests_failed"] += 1
        self.metrics.failures.labels(code.value).inc()
        control.send(self.ingress, protocol.error(code, why, r.req_id, retry_after_ms), r.client)

    def _peer_failed(self, p: Peer, code: ErrorCode, why: str, dead: bool = True) -> None:
        log.warning("%s", why)
        p.state = PeerState.DEAD if dead else PeerState.NEW
        p.ack = None
        self._drop_peer_transport(p)
        for r in [r for r in self.reqs.values() if r.peer is p]:
            self._fail(r, code, why)
        p.waiting = []
        if dead:  # a fresh socket next time: the old one may hold queued frames for a dead peer
            p.sock.close(0)
            p.sock = self._dealer(p.endpoint)
            self._poller_dirty = True

    def _drop_peer_transport(self, p: Peer) -> None:
        if p.ep is not None:
            ep, p.ep = p.ep, None
            ep.close()

    def stats(self) -> dict:
        return {"role": "sender", "ingress_endpoint": self.ingress_endpoint,
                "requests_inflight": len(self.reqs),
                "receivers_connected": sum(1 for p in self.peers.values() if p.state is PeerState.READY),
                "staging_bytes_free": self.staging.free_bytes, "draining": self.draining,
                "metrics_endpoint": self.metrics.endpoint, **self.counters}


__all__ = ["Sender", "PoolExhausted"]
