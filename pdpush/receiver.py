"""Receiver daemon: protocol + pool + UCX transport + control sockets, on one thread.

Endpoints:
  * ZMQ ROUTER (tcp, loopback by default) for senders: Hello, AllocRequest,
    LayerDone, Commit, Abort, Status.
  * UCX listener: senders' endpoints; their one-sided puts land in the pool.
  * ZMQ ROUTER on a 0600 unix socket for the local decode engine: Open,
    Release, Query, Status; the receiver pushes LayerAvailable/Committed.

A bad frame gets a typed Error reply and changes nothing. Imports ucxx only
through pdpush.transport.ucx, when started.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash
import zmq

from pdpush import control, protocol
from pdpush.config import ReceiverConfig, is_loopback
from pdpush.errors import ErrorCode, PdpushError, PoolExhausted, ProtocolError
from pdpush.layout import runs
from pdpush.pool import PagePool
from pdpush.protocol import (
    Abort,
    AllocRequest,
    AllocResponse,
    Commit,
    CommitAck,
    Committed,
    Hello,
    HelloAck,
    LayerAvailable,
    LayerDone,
    LayoutSpec,
    Msg,
    Ok,
    Open,
    OpenOk,
    Query,
    QueryReply,
    Release,
    ReqEvent,
    ReqState,
    StatusReply,
    StatusRequest,
)

log = logging.getLogger("pdpush.receiver")

PARKED_OPEN_MS = 120_000
TOKEN_BYTES = 32
MAX_TOKENS = 4096


def now_ms() -> int:
    return int(time.monotonic() * 1000)


@dataclass
class RxRequest:
    req_id: str
    sender: bytes
    state: ReqState
    layers_done: set[int] = field(default_factory=set)
    watchers: set[bytes] = field(default_factory=set)
    new_runs: list[tuple[int, int, int]] = field(default_factory=list)
    last_chunk_tokens: int = 0
    t_alloc: float = 0.0


class Receiver:
    def __init__(self, cfg: ReceiverConfig) -> None:
        self.cfg = cfg
        self.layout = cfg.layout
        self.spec = LayoutSpec(**self.layout.to_dict())
        self.pool = PagePool(cfg.pool_pages, quarantine_ms=cfg.quarantine_ms, committed_ttl_ms=cfg.committed_ttl_ms)
        self.reqs: dict[str, RxRequest] = {}
        self.sessions: set[bytes] = set()  # sender identities that completed Hello
        self.parked: dict[str, list[tuple[bytes, int]]] = {}  # req_id -> [(decode identity, since)]
        self.finished: OrderedDict[str, str] = OrderedDict()  # recently ended req_id -> why (bounded)
        self.ucx_peers: list = []  # endpoints that presented a valid session token
        self.ucx_pending: list = []  # (endpoint, stream request, buffer, deadline) awaiting their token
        self.tokens: dict[bytes, bytes] = {}  # one-time UCX session token -> control identity
        self.auth = None
        self.draining = False
        self.counters = {"requests_total": 0, "requests_committed": 0, "requests_failed": 0,
                         "bad_messages": 0, "bytes_received": 0, "layers_received": 0,
                         "checksum_failures": 0, "ucx_peers_rejected": 0}
        self._last_tick = 0

    # ---- lifecycle ----
    def start(self) -> dict:
        from pdpush import shm
        from pdpush.transport.ucx import UcxWorker

        cfg = self.cfg
        env = dict(cfg.ucx_env)
        self.ucx = UcxWorker(env)
        self.region, self.shmid, self.backing = self.ucx.alloc_shared(cfg.pool_bytes)
        if cfg.prefault:
            shm.prefault(self.region.address, self.region.length)
        self.pinned = shm.pin_if_cuda(self.region.address, self.region.length)
        self.rkey = self.region.pack_rkey()
        self.ucx_port = self.ucx.listen(cfg.ucx_port, self._on_ucx_peer)
        configure = None
        if cfg.curve_secret_key_file:
            from pdpush import auth

            keys = auth.load_keypair(cfg.curve_secret_key_file)
            allowed = [k for spec in cfg.allowed_senders for k in auth.load_public_keys(spec)]
            self.auth = auth.Authenticator(allowed)

            def configure(sock):
                auth.make_server(sock, keys)

            log.info("CURVE authentication on: %d sender key(s) allowed", len(allowed))
        elif cfg.insecure and not is_loopback(cfg.host):
            log.warning("INSECURE: control plane exposed on %s without authentication", cfg.host)
        self.router, self.control_endpoint = control.bind_router(cfg.host, cfg.control_port, cfg.max_frame_bytes,
                                                                 configure)
        self.local, self.local_endpoint = control.bind_local(cfg.local_socket_path(), cfg.max_frame_bytes)
        from pdpush.metrics import Metrics

        self.metrics = Metrics("receiver", cfg.metrics_host, cfg.metrics_port)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.local, zmq.POLLIN)
        self.poller.register(self.ucx.epoll_fd, zmq.POLLIN)
        return {"role": "receiver", "control_endpoint": self.control_endpoint, "local_endpoint": self.local_endpoint,
                "ucx_port": self.ucx_port, "pool_bytes": cfg.pool_bytes, "shmid": self.shmid, "backing": self.backing,
                "fingerprint": self.layout.fingerprint(), "auth": "curve" if self.auth else "none",
                "metrics_endpoint": self.metrics.endpoint}

    def close(self) -> None:
        for s in ("router", "local"):
            sock = getattr(self, s, None)
            if sock is not None:
                sock.close(0)
        for ep in self.ucx_peers + [p[0] for p in self.ucx_pending]:
            ep.close()
        self.ucx_peers, self.ucx_pending = [], []
        if self.auth is not None:
            self.auth.stop()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        if getattr(self, "region", None) is not None:
            self.region.close()
        if getattr(self, "ucx", None) is not None:
            self.ucx.close()

    def begin_drain(self) -> None:
        self.draining = True

    def drained(self) -> bool:
        return not any(r.state in (ReqState.ALLOCATED, ReqState.STREAMING) for r in self.reqs.values())

    def abort_all(self, reason: str) -> None:
        for r in list(self.reqs.values()):
            if r.state in (ReqState.ALLOCATED, ReqState.STREAMING):
                self._fail(r, ErrorCode.ABORTED, reason)

    # ---- loop ----
    def step(self, timeout_ms: int) -> None:
        self.ucx.progress()
        if self.ucx.arm():
            events = dict(self.poller.poll(timeout_ms))
        else:
            events = dict(self.poller.poll(0))
        self.ucx.progress()
        self.ucx.dispatch_closed()
        for _ in range(256):  # bounded batch so the tick below always runs
            if not self._drain_one(self.router, self._on_control):
                break
        for _ in range(256):
            if not self._drain_one(self.local, self._on_local):
                break
        if self.ucx_pending:
            self._check_ucx_peers()
        t = now_ms()
        if t - self._last_tick >= 10 or events:
            self._tick(t)

    def _drain_one(self, sock, handler) -> bool:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if len(frames) < 2:
            return True  # nothing to reply to
        reply = self.handle_frame(frames[0], frames[-1], handler)
        if reply is not None:
            control.send(sock, reply, frames[0])
        return True

    def handle_frame(self, ident: bytes, payload: bytes, handler) -> Msg | None:
        """Bytes from a peer -> reply. Any pdpush error becomes a typed Error reply; state is untouched."""
        msg = None
        try:
            msg = protocol.decode(payload, self.cfg.max_frame_bytes)
            return handler(ident, msg)
        except PdpushError as e:
            if isinstance(e, ProtocolError):
                self.counters["bad_messages"] += 1
            retry = e.retry_after_ms if isinstance(e, PoolExhausted) else None
            rid = getattr(e, "req_id", None) or getattr(msg, "req_id", None)
            log.info("error reply to peer: %s: %s", e.code.value, e, extra={"req_id": rid})
            return protocol.error(e.code, str(e), rid, retry)

    def _tick(self, t: int) -> None:
        if t // 100 != self._last_tick // 100:  # gauges ~10 times a second
            self.metrics.refresh(self.stats())
        self._last_tick = t
        for rid in self.pool.tick(t):
            r = self.reqs.get(rid)
            if r is not None:
                log.warning("lease expired", extra={"req_id": rid})
                self._fail(r, ErrorCode.LEASE_EXPIRED, "lease expired before commit", pool_done=True)
        for rid in [rid for rid in self.reqs if rid not in self.pool.requests]:
            self._forget(rid, "committed and released (or past its TTL)")
        for rid, waiters in list(self.parked.items()):
            waiters[:] = [(i, s) for i, s in waiters if t - s < PARKED_OPEN_MS]
            if not waiters:
                del self.parked[rid]

    # ---- UCX ----
    def _on_ucx_peer(self, ep) -> None:
        """A new UCX peer must send a one-time token from a HelloAck on its stream, or be dropped."""
        req, buf = ep.post_stream_recv(TOKEN_BYTES)
        self.ucx_pending.append((ep, req, buf, time.monotonic() + self.cfg.ucx_token_timeout_ms / 1000))

    def _check_ucx_peers(self) -> None:
        now = time.monotonic()
        still, rejected = [], []
        for ep, req, buf, deadline in self.ucx_pending:
            if req.completed:
                token = buf.tobytes()
                if ep.request_ok(req) and self.tokens.pop(token, None) is not None:
                    self.ucx_peers.append(ep)
                    ep.on_close(lambda e: self.ucx_peers.remove(e) if e in self.ucx_peers else None)
                else:
                    rejected.append((ep, "invalid session token"))
            elif now > deadline or not ep.alive:
                rejected.append((ep, "no session token in time"))
            else:
                still.append((ep, req, buf, deadline))
        # drop every reference to the pending receives first: a live request keeps its endpoint open
        self.ucx_pending = still
        del req, buf
        for ep, why in rejected:
            self._reject_ucx_peer(ep, why)

    def _reject_ucx_peer(self, ep, why: str) -> None:
        log.warning("dropping UCX peer: %s", why)
        self.counters["ucx_peers_rejected"] += 1
        ep.close()

    # ---- sender control ----
    def _on_control(self, ident: bytes, msg: Msg) -> Msg | None:
        if isinstance(msg, Hello):
            return self._hello(ident, msg)
        if isinstance(msg, StatusRequest):
            return StatusReply(stats=self.stats())
        if ident not in self.sessions:
            raise ProtocolError(f"{msg.type} before hello", code=ErrorCode.UNEXPECTED)
        if isinstance(msg, AllocRequest):
            return self._alloc(ident, msg)
        if isinstance(msg, LayerDone):
            return self._layer_done(ident, msg)
        if isinstance(msg, Commit):
            return self._commit(ident, msg)
        if isinstance(msg, Abort):
            r = self._owned(ident, msg.req_id)
            protocol.transition(r.state, ReqEvent.ABORT, r.req_id)
            self._fail(r, ErrorCode.ABORTED, msg.reason or "aborted by sender")
            return Ok(req_id=msg.req_id)
        raise ProtocolError(f"receiver does not accept {msg.type} on the control endpoint",
                            code=ErrorCode.UNEXPECTED)

    def _hello(self, ident: bytes, msg: Hello) -> Msg:
        if msg.version != protocol.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {msg.version} unsupported (receiver speaks "
                                f"{protocol.PROTOCOL_VERSION})", code=ErrorCode.INCOMPATIBLE_PEER)
        mine = self.layout.fingerprint()
        if msg.fingerprint != mine or msg.layout != self.spec:
            raise ProtocolError(f"layout mismatch: sender {msg.layout.model_dump()} (fp {msg.fingerprint}) vs "
                                f"receiver {self.spec.model_dump()} (fp {mine})", code=ErrorCode.INCOMPATIBLE_PEER)
        self.sessions.add(ident)
        token = secrets.token_bytes(TOKEN_BYTES)
        self.tokens[token] = ident
        while len(self.tokens) > MAX_TOKENS:  # unused tokens of peers that never connected
            self.tokens.pop(next(iter(self.tokens)))
        return HelloAck(ucx_token=token, version=protocol.PROTOCOL_VERSION, fingerprint=mine, layout=self.spec,
                        pool_base=self.region.address, pool_pages=self.cfg.pool_pages,
                        page_bytes=self.layout.page_bytes, rkey=self.rkey,
                        ucx_host=self.cfg.host, ucx_port=self.ucx_port)

    def _alloc(self, ident: bytes, msg: AllocRequest) -> Msg:
        if self.draining:
            raise PdpushError("receiver is draining", code=ErrorCode.SHUTTING_DOWN)
        if len(msg.chunk_keys) > self.cfg.max_chunks_per_request:
            raise ProtocolError(f"{len(msg.chunk_keys)} chunks exceeds the cap of "
                                f"{self.cfg.max_chunks_per_request}", code=ErrorCode.TOO_LARGE)
        if msg.last_chunk_tokens > self.layout.chunk_tokens:
            raise ProtocolError("last_chunk_tokens exceeds chunk_tokens")
        if msg.req_id in self.reqs:
            raise ProtocolError(f"request {msg.req_id!r} already exists", code=ErrorCode.DUPLICATE_REQUEST)
        self._check_sender_caps(ident, msg)
        lease = min(msg.lease_ms, self.cfg.lease_ms)
        t = now_ms()
        try:
            a = self.pool.allocate(msg.req_id, msg.chunk_keys, t, lease)
        except PdpushError as e:
            e.req_id = msg.req_id  # type: ignore[attr-defined]
            raise
        r = RxRequest(msg.req_id, ident, ReqState.ALLOCATED, last_chunk_tokens=msg.last_chunk_tokens,
                      t_alloc=time.monotonic())
        self.metrics.chunks_hit.inc(len(a.already_sent_indexes))
        r.new_runs = runs(a.new_pages)
        self.reqs[msg.req_id] = r
        self.counters["requests_total"] += 1
        log.debug("alloc %d chunks, %d held", len(msg.chunk_keys), len(a.already_sent_indexes),
                  extra={"req_id": msg.req_id})
        for dident, _ in self.parked.pop(msg.req_id, []):
            self._reply_open(dident, msg.req_id)
        return AllocResponse(req_id=msg.req_id, already_sent_indexes=a.already_sent_indexes,
                             page_runs=[(p, n) for _, p, n in r.new_runs], lease_id=a.lease_id,
                             expires_at_ms=a.expires_at_ms)

    def _check_sender_caps(self, ident: bytes, msg: AllocRequest) -> None:
        mine = [r for r in self.reqs.values()
                if r.sender == ident and r.state in (ReqState.ALLOCATED, ReqState.STREAMING)]
        if len(mine) >= self.cfg.max_leases_per_sender:
            raise PdpushError(f"sender holds {len(mine)} leases (max_leases_per_sender)",
                              code=ErrorCode.POOL_EXHAUSTED)
        cap = self.cfg.max_inflight_bytes_per_sender
        if cap:
            page_set = self.layout.layers * self.layout.page_bytes  # one page index in every layer
            held = sum(n for r in mine for _, _, n in r.new_runs) * page_set
            if held + len(msg.chunk_keys) * page_set > cap:
                raise PdpushError(f"sender would hold {held + len(msg.chunk_keys) * page_set} bytes uncommitted "
                                  f"(max_inflight_bytes_per_sender={cap})", code=ErrorCode.POOL_EXHAUSTED)

    def _owned(self, ident: bytes, req_id: str) -> RxRequest:
        r = self.reqs.get(req_id)
        if r is None or r.sender != ident:
            raise ProtocolError(f"unknown request {req_id!r}", code=ErrorCode.UNKNOWN_REQUEST)
        return r

    def _layer_done(self, ident: bytes, msg: LayerDone) -> Msg | None:
        r = self._owned(ident, msg.req_id)
        if msg.layer >= self.layout.layers:
            raise ProtocolError(f"layer {msg.layer} out of range (0..{self.layout.layers - 1})")
        r.state = protocol.transition(r.state, ReqEvent.LAYER_DONE, r.req_id)
        if msg.checksum is not None and self.cfg.verify_checksums:
            got = self._layer_checksum(r, msg.layer)
            if got != msg.checksum:
                self.counters["checksum_failures"] += 1
                self._fail(r, ErrorCode.CHECKSUM_MISMATCH, f"layer {msg.layer} checksum mismatch")
                return protocol.error(ErrorCode.CHECKSUM_MISMATCH, f"layer {msg.layer} checksum mismatch", r.req_id)
        if msg.layer not in r.layers_done:
            r.layers_done.add(msg.layer)
            nbytes = sum(n for _, _, n in r.new_runs) * self.layout.page_bytes
            self.counters["layers_received"] += 1
            self.counters["bytes_received"] += nbytes
            self.metrics.layers.inc()
            self.metrics.bytes.inc(nbytes)
            for w in r.watchers:
                control.send(self.local, LayerAvailable(req_id=r.req_id, layer=msg.layer), w)
        return None  # LayerDone is not acknowledged: the Commit ack covers it

    def layer_bytes(self, layer: int, first_page: int, n: int):
        from pdpush.shm import array_at

        pb = self.layout.page_bytes
        off = (layer * self.cfg.pool_pages + first_page) * pb
        return array_at(self.region.address + off, n * pb)

    def _layer_checksum(self, r: RxRequest, layer: int) -> int:
        h = xxhash.xxh3_64()
        for _, p, n in r.new_runs:
            h.update(self.layer_bytes(layer, p, n))
        return h.intdigest()

    def _commit(self, ident: bytes, msg: Commit) -> Msg:
        r = self._owned(ident, msg.req_id)
        if r.new_runs and len(r.layers_done) != self.layout.layers:
            missing = sorted(set(range(self.layout.layers)) - r.layers_done)
            raise ProtocolError(f"commit of {r.req_id!r} with layers missing: {missing[:8]}",
                                code=ErrorCode.UNEXPECTED)
        r.state = protocol.transition(r.state, ReqEvent.COMMIT, r.req_id)
        n = self.pool.commit(r.req_id, now_ms())
        self.counters["requests_committed"] += 1
        self.metrics.requests.inc()
        self.metrics.request_seconds.observe(time.monotonic() - r.t_alloc)
        if not r.new_runs:
            for w in r.watchers:
                for layer in range(self.layout.layers):
                    control.send(self.local, LayerAvailable(req_id=r.req_id, layer=layer), w)
            r.layers_done = set(range(self.layout.layers))
        for w in r.watchers:
            control.send(self.local, Committed(req_id=r.req_id), w)
        log.debug("committed %d new chunks", n, extra={"req_id": r.req_id})
        return CommitAck(req_id=r.req_id, chunks_committed=n)

    def _fail(self, r: RxRequest, code: ErrorCode, why: str, pool_done: bool = False) -> None:
        if r.state in (ReqState.ALLOCATED, ReqState.STREAMING):
            r.state = ReqState.EXPIRED if code is ErrorCode.LEASE_EXPIRED else ReqState.ABORTED
            self.counters["requests_failed"] += 1
            self.metrics.failures.labels(code.value).inc()
            if code is ErrorCode.LEASE_EXPIRED:
                self.metrics.leases_expired.inc()
            if not pool_done:
                self.pool.abort(r.req_id, now_ms())
        for w in r.watchers:
            control.send(self.local, protocol.error(code, why, r.req_id), w)
        self._forget(r.req_id, f"failed: {code.value}: {why}")

    def _forget(self, req_id: str, why: str) -> None:
        self.reqs.pop(req_id, None)
        self.finished[req_id] = why
        while len(self.finished) > 4096:
            self.finished.popitem(last=False)

    # ---- local decode endpoint ----
    def _on_local(self, ident: bytes, msg: Msg) -> Msg | None:
        if isinstance(msg, Open):
            if msg.req_id not in self.reqs and msg.req_id in self.finished:
                raise PdpushError(f"request {msg.req_id!r} is gone: {self.finished[msg.req_id]}",
                                  code=ErrorCode.UNKNOWN_REQUEST)
            if msg.req_id not in self.reqs:
                waiters = self.parked.setdefault(msg.req_id, [])
                if len(waiters) < 16 and len(self.parked) < 65536:
                    waiters.append((ident, now_ms()))
                    return None  # answered when the AllocRequest arrives
                raise PdpushError("too many parked opens", code=ErrorCode.TOO_LARGE)
            self._reply_open(ident, msg.req_id)
            return None
        if isinstance(msg, Release):
            r = self.reqs.get(msg.req_id)
            if r is not None:
                r.watchers.discard(ident)
            if msg.req_id in self.pool.requests:
                self.pool.release(msg.req_id)
            if msg.req_id in self.reqs and msg.req_id not in self.pool.requests:
                self._forget(msg.req_id, "committed and released")
            return Ok(req_id=msg.req_id)
        if isinstance(msg, Query):
            return QueryReply(held_prefix=self.pool.held_prefix(msg.chunk_keys),
                              request_chunks=self.pool.request_prefix(msg.req_id, msg.chunk_keys),
                              request_gone=msg.req_id is not None and msg.req_id not in self.reqs
                              and msg.req_id in self.finished)
        if isinstance(msg, StatusRequest):
            return StatusReply(stats=self.stats())
        raise ProtocolError(f"receiver does not accept {msg.type} on the local endpoint",
                            code=ErrorCode.UNEXPECTED)

    def _reply_open(self, ident: bytes, req_id: str) -> None:
        r = self.reqs[req_id]
        preq = self.pool.open(req_id)
        r.watchers.add(ident)
        reply = OpenOk(req_id=req_id, shmid=self.shmid, pool_base=self.region.address,
                       pool_pages=self.cfg.pool_pages, layout=self.spec, pages=preq.pages,
                       last_chunk_tokens=r.last_chunk_tokens,
                       layers_ready=sorted(r.layers_done), committed=r.state is ReqState.COMMITTED,
                       daemon_pid=os.getpid())
        control.send(self.local, reply, ident)

    def stats(self) -> dict:
        p = self.pool
        return {"role": "receiver", "control_endpoint": self.control_endpoint,
                "pool_pages_total": p.num_pages, "pool_pages_free": p.free_pages,
                "pool_pages_quarantined": p.quarantined_pages, "chunks_cached": p.chunks_cached,
                "chunks_hit": p.counters["chunks_hit"], "leases_active": p.leases_active,
                "leases_expired": p.counters["leases_expired"],
                "requests_inflight": sum(1 for r in self.reqs.values()
                                         if r.state in (ReqState.ALLOCATED, ReqState.STREAMING)),
                "ucx_peers": len(self.ucx_peers), "ucx_peers_pending": len(self.ucx_pending),
                "auth": "curve" if self.auth else "none", "draining": self.draining,
                "metrics_endpoint": self.metrics.endpoint, **self.counters}
