"""UCX data plane: one worker per daemon, a listener, endpoints, coalesced puts.

Built on ``ucp.py``, a ctypes binding of libucp's set-up calls (context, worker, listener, endpoints,
stream, memory maps, rkeys); the per-batch work, posting puts and their flush and reaping completions, is
native (``pdpush_native``, native/src/dataplane.cpp). Both use the one libucp ``ucx_lib`` chose. Progress
runs on the thread that issues the work (a separate progress thread cost 2.5-8x bandwidth here, see
notes/ucx.md).

Every UcpError is mapped to a pdpush TransportError here; none escapes. Loads UCX only in
``UcxWorker.__init__``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from pdpush.errors import ConnectError, TransferError, TransportError, TransportTimeout
from pdpush.transport.base import Completion, PutOp

log = logging.getLogger("pdpush.ucx")

# Safe *and* fast on one host (notes/ucx.md): error handling stays on for every
# endpoint, shm transports keep their own error handling on, the receiver pool
# is allocated by UCX in SysV shm, and unused-variable warnings stay quiet.
SAFE_DEFAULTS: dict[str, str] = {
    "UCX_SYSV_ERROR_HANDLING": "y",
    "UCX_POSIX_ERROR_HANDLING": "y",
    "UCX_ALLOC_PRIO": "md:sysv",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # A restarted receiver must get its listener port back while old connections sit in TIME_WAIT.
    "UCX_TCP_CM_REUSEADDR": "y",
}

MAX_PUT_BYTES = (4 << 30) - (1 << 20)  # a single put above 4 GiB falls back to tcp


def local_only_env(ucx_env: Mapping[str, str], local_only: bool,
                   environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``ucx_env`` for a daemon whose UCX peers are all on this host (``local_only``: a receiver bound to loopback,
    whose listener no other host reaches): UCX's network devices pinned to the loopback one, unless
    ``UCX_NET_DEVICES`` is set already (in ``ucx_env`` or the environment). UCX's tcp lanes otherwise listen on
    every interface, and UCX trusts whoever connects to them: its tcp puts and its software RMA carry raw
    addresses and check no rkey, so a peer that reaches such a port can write anywhere in the daemon's memory
    without a hello or a token (SECURITY.md). On one host the KV moves over shared memory: nothing is lost."""
    env, environ = dict(ucx_env), os.environ if environ is None else environ
    if local_only and "UCX_NET_DEVICES" not in env and "UCX_NET_DEVICES" not in environ:
        env["UCX_NET_DEVICES"] = "lo"
    return env


def configure_env(overrides: Mapping[str, str] | None = None) -> None:
    """Set UCX_* variables before the first UCX context is created.

    Precedence: explicit overrides (config) > the process environment > SAFE_DEFAULTS.
    """
    for k, v in SAFE_DEFAULTS.items():
        os.environ.setdefault(k, v)
    for k, v in (overrides or {}).items():
        os.environ[k] = str(v)


def put_failure(endpoint: str, status: int) -> TransportError:
    """The typed error for a put+flush to ``endpoint`` that ended with a native ``status`` (not OK): a
    timeout means a stalled or partitioned peer."""
    import pdpush_native as native

    from pdpush.transport import ucp

    if status == native.TIMED_OUT:
        return TransportTimeout(f"put+flush to {endpoint} did not complete by its deadline (stalled or "
                                "partitioned receiver)")
    return TransferError(f"put+flush to {endpoint} failed: {ucp.status_name(status)}")


@dataclass
class _Batch:
    """Posted puts and their flush (their requests and deadline are the native queue's, in the same order)."""

    token: Hashable
    puts: int


class _Closable:
    """Error state and close callbacks, common to connected and accepted endpoints."""

    def __init__(self, worker: UcxWorker, name: str) -> None:
        self._worker = worker
        self.name = name
        self.error: str | None = None
        self._on_close: list[Callable] = []
        self._transports: list[str] = []  # its lanes', once UCX could say (``transports``)

    @property
    def alive(self) -> bool:
        return self.error is None

    def on_close(self, cb: Callable) -> None:
        """``cb(endpoint)`` once it has closed, from ``UcxWorker.dispatch_closed``; one registered after it closed
        runs at the next dispatch (its close may have been dispatched already, with no callback to run)."""
        self._on_close.append(cb)
        if self.error is not None and self not in self._worker._closed:
            self._worker._closed.append(self)
            self._worker._signal_closed()

    def _closed(self, why: str = "endpoint closed or peer died") -> None:
        # Runs inside a UCX callback: only record it. Tearing the endpoint down from
        # here deadlocked; the owner runs the callbacks from dispatch_closed().
        if self.error is None:
            self.error = why
        self._worker._closed.append(self)
        self._worker._signal_closed()

    def peer(self) -> str:
        """The address of its other end (``ip:port``), or its name where UCX cannot say."""
        from pdpush.transport import ucp

        return (ucp.ep_remote(self.handle) if self.handle is not None else "") or self.name

    def transports(self) -> list[str]:
        """The UCX transports and devices its lanes use, as ``tcp/eth0``; empty where UCX cannot say. Asked of UCX
        until it says, then kept: a wired-up endpoint keeps its lanes, and below UCX 1.14 (Debian's 1.13, the RDMA
        build) each answer is printed to a file and parsed, ~0.4 ms an endpoint, which the metrics' refresh every
        100 ms paid for every receiver in the daemon's loop."""
        from pdpush.transport import ucp

        if self._transports or self.handle is None:
            return self._transports
        lanes = [f"{t}/{d}" for t, d in ucp.ep_transports(self.handle)]
        if self._lanes_final():  # (while it wires up, UCX may still change them)
            self._transports = lanes
        return lanes

    def _lanes_final(self) -> bool:
        return True  # an accepted endpoint is asked only once it presented its token: its lanes are set

    def _run_close_callbacks(self) -> None:
        log.info("ucx endpoint %s closed: %s", self.name, self.error)
        cbs, self._on_close = self._on_close, []
        for cb in cbs:
            cb(self)


def _reap_raw(reqs: list[int]) -> tuple[list[int], str | None]:
    """Raw ucp requests that have completed are freed: (those still in progress, the first failure's name or None)."""
    from pdpush.transport import ucp

    still, failure = [], None
    for r in reqs:
        st = ucp.request_status(r)
        if st == ucp.UCS_INPROGRESS:
            still.append(r)
            continue
        ucp.request_free(r)
        if st != ucp.UCS_OK and failure is None:
            failure = ucp.status_name(st)
    return still, failure


class Endpoint(_Closable):
    """A UCX endpoint we connected, with error handling on, plus the peer's unpacked rkey."""

    def __init__(self, worker: UcxWorker, handle: int, name: str) -> None:
        super().__init__(worker, name)
        self.handle: int | None = handle
        self.rkey = None
        self._batches: deque[_Batch] = deque()
        self._native = None  # pdpush_native.Batches, once the rkey is known
        self._wireup: tuple[list[int], object, bytes] | None = None  # (raw requests, token buffer, packed rkey)
        self._populating = None  # populate_peer's shm.Populating

    def set_rkey(self, packed: bytes, timeout_s: float = 5.0) -> None:
        """Unpack the peer's rkey once wire-up is complete.

        An rkey unpacked while the endpoint is still wiring up goes stale when
        UCX reconfigures the lanes (a later put segfaulted here), so flush
        first: the flush completes only once the endpoint is connected.
        """

        self.flush(timeout_s)
        self._unpack(packed)

    def _unpack(self, packed: bytes) -> None:
        """The peer's rkey, on an endpoint whose wire-up has completed."""
        from pdpush.transport import ucp

        try:
            self.rkey = ucp.RemoteKey(self.handle, packed)
        except ucp.UcpError as e:
            raise TransferError(f"cannot unpack rkey from {self.name}: {e}") from e
        from pdpush_native import Batches

        self._native = Batches(self.handle, self.rkey.handle, MAX_PUT_BYTES)

    def populate_peer(self, remote: int, nbytes: int, progress: Callable[[int], None]) -> bool:
        """Where a shared-memory transport mapped the peer's region into this process (the rkey's unpack
        attached it), populate this process's page tables for ``[remote, remote + nbytes)`` of it on a thread
        (``shm.populate``): the first put into each of its pages then takes no page fault here.
        ``progress(bytes so far)`` is called from that thread. The close stops it first (within a piece of
        ``shm.populate``). False where nothing is mapped here."""
        from pdpush import shm

        local = self.rkey.local_address(remote) if self.rkey is not None else None
        if local is None or self._populating is not None:
            return False
        self._populating = shm.Populating(local, nbytes, progress)
        return True

    def begin_wireup(self, token: bytes, packed_rkey: bytes) -> None:
        """Send the one-time session token and a flush, and return at once: the owner's loop goes on serving
        everyone else while this endpoint connects (``wired_up`` says when it has). The flush completes only once
        the endpoint is connected; the rkey is unpacked then (see ``set_rkey``)."""
        from pdpush.transport import ucp

        if self.error is not None or self.handle is None:
            raise TransferError(f"endpoint {self.name} is dead: {self.error}")
        buf = ctypes.create_string_buffer(token, len(token))  # kept until the send completes
        reqs: list[int] = []
        try:
            r = ucp.stream_send_nbx(self.handle, ctypes.addressof(buf), len(token))
            reqs += [r] if r is not None else []
            r = ucp.flush_nbx(self.handle)
            reqs += [r] if r is not None else []
        except ucp.UcpError as e:
            for r in reqs:
                ucp.request_free(r)
            raise TransferError(f"wire-up of {self.name} failed: {e}") from e
        self._wireup = (reqs, buf, packed_rkey)

    def _lanes_final(self) -> bool:
        return self._wireup is None and self.rkey is not None  # its wire-up has completed

    def wired_up(self) -> bool:
        """Whether the wire-up ``begin_wireup`` started has completed (then the rkey is unpacked); never waits
        (the owner progresses the worker). Raises TransferError if it failed or the endpoint died."""
        if self._wireup is None:
            return self.rkey is not None
        reqs, buf, packed = self._wireup
        still, failed = _reap_raw(reqs)
        failure = self.error or failed
        self._wireup = (still, buf, packed)
        if failure is not None:
            self.cancel_wireup()
            raise TransferError(f"wire-up of {self.name} failed: {failure}")
        if still:
            return False
        self._wireup = None
        self._unpack(packed)
        return True

    def cancel_wireup(self) -> None:
        """Give a wire-up in progress up (its requests are dropped; UCX completes them with the endpoint)."""
        from pdpush.transport import ucp

        if self._wireup is not None:
            for r in self._wireup[0]:
                ucp.request_free(r)
            self._worker._retired_bufs.append(self._wireup[1])  # UCX may read it until the endpoint's close cancels
            self._wireup = None

    def attach(self, pusher, eid: int, pool: tuple[int, int]) -> None:
        """Join ``pusher`` (``UcxWorker.pusher``) as its endpoint ``eid``: its puts go here, with the peer's rkey, each
        inside ``pool`` (the peer's address and bytes: a plan that leaves it is refused)."""
        if self.handle is None or self.rkey is None:
            raise TransferError(f"endpoint {self.name} has no rkey")
        base, nbytes = pool
        local = self.rkey.local_address(base)
        if local is not None:  # a shared-memory lane: a put is this process's copy to local + offset, unchecked
            from pdpush import shm

            # UCX's rkey_ptr adds the offset to where it mapped the peer's segment, whatever the offset: the pool
            # must be that whole segment's mapping from its start (a base claimed off it could land in any other
            # mapping of this process, its own staging included), and fit in it
            m = shm.mapping_of(local)
            if m is None or m[0] != local or not m[2].startswith(("/SYSV", "/dev/shm/")):
                raise TransferError(f"endpoint {self.name}: the receiver's pool base {base:#x} is not the start of a "
                                    f"shared-memory segment its rkey maps here ({m[2] if m else 'nothing mapped'}; "
                                    "a same-host pool is SysV or posix shared memory, UCX's sysv or posix lanes)")
            if local + nbytes > m[1]:
                raise TransferError(f"endpoint {self.name}: the receiver's pool ({nbytes} bytes from {base:#x}) is "
                                    f"larger than the region its rkey maps here ({m[1] - local} bytes)")
        pusher.add_endpoint(eid, self.handle, self.rkey.handle, base, nbytes)

    def stream_send(self, payload: bytes, timeout_s: float) -> None:
        """Send bytes on this endpoint's stream (used for the one-time session token)."""
        from pdpush.transport import ucp

        if self.error is not None or self.handle is None:
            raise TransferError(f"endpoint {self.name} is dead: {self.error}")
        buf = ctypes.create_string_buffer(payload, len(payload))
        try:
            r = ucp.stream_send_nbx(self.handle, ctypes.addressof(buf), len(payload))
        except ucp.UcpError as e:
            raise TransferError(f"stream send to {self.name} failed: {e}") from e
        self._worker.wait_raw([r] if r is not None else [], timeout_s, f"stream send to {self.name}")

    def flush(self, timeout_s: float) -> None:
        from pdpush.transport import ucp

        if self.error is not None:
            raise TransferError(f"endpoint {self.name} is dead: {self.error}")
        try:
            r = ucp.flush_nbx(self.handle)
        except ucp.UcpError as e:
            raise TransferError(f"flush to {self.name} failed: {e}") from e
        self._worker.wait_raw([r] if r is not None else [], timeout_s, f"flush to {self.name}")
        if self.error is not None:
            raise TransferError(f"endpoint {self.name} died: {self.error}")

    @property
    def in_flight(self) -> int:
        return len(self._batches)

    def post_puts(self, ops: Sequence[PutOp], token: Hashable, deadline: float) -> int:
        """Post the puts and one flush, and return at once (see transport/base.py).

        The batch completes through ``UcxWorker.poll``. A put that UCX finished
        inline (shared memory) costs its copy here; nothing waits for a peer.
        """
        from pdpush_native import UcpError

        if self.error is not None:
            raise TransferError(f"endpoint {self.name} is dead: {self.error}")
        if self._native is None:
            raise TransferError(f"endpoint {self.name} has no rkey")
        try:
            puts = self._native.post(ops, deadline)
        except UcpError as e:
            raise TransferError(f"put to {self.name} failed: {e}") from e
        self._batches.append(_Batch(token, puts))
        self._worker._busy.add(self)
        return puts

    def _reap(self, now: float, out: list[Completion]) -> None:
        """Completed batches, head first (one endpoint's batches complete in posting order); a batch past
        its deadline times out and fails the endpoint, and nothing behind a failure completes."""
        import pdpush_native as native

        if self._native is None:  # closed: its batches were reported already
            return
        for status in self._native.reap(now):
            b = self._batches.popleft()
            if status == 0:
                out.append(Completion(b.token, b.puts))
                continue
            if status == native.CANCELED:  # behind a failure
                err: TransportError = TransferError(f"endpoint {self.name} failed: {self.error}")
            else:
                err = put_failure(self.name, status)
                self.error = self.error or str(err)
            out.append(Completion(b.token, b.puts, err))
        if self._batches and self.error is not None:  # the endpoint died (its close callback said)
            self._native.drop_all()
            for b in self._batches:
                out.append(Completion(b.token, b.puts, TransferError(f"put+flush to {self.name} failed: {self.error}")))
            self._batches.clear()

    def close(self) -> None:
        self.cancel_wireup()
        if self._populating is not None:  # before the rkey goes, and with it the mapping the thread populates
            self._populating.stop()
            self._populating = None
        if self._batches:  # closing cancels them; report them as failed on the next poll
            self._worker._orphans.extend(
                Completion(b.token, b.puts, TransferError(f"endpoint {self.name} closed")) for b in self._batches)
            self._batches.clear()
        if self._native is not None:
            self._native.drop_all()
            self._native = None
        rkey, self.rkey = self.rkey, None
        if self.handle is not None:
            from pdpush.transport import ucp

            # force: cancels the endpoint's in-flight operations (a pending receive keeps it alive otherwise,
            # so the peer would never notice); the close request is kept until it completes
            self._worker._by_handle.pop(self.handle, None)
            r = ucp.ep_close_nbx(self.handle)
            if r is not None:
                self._worker._closing_raw.append(r)
            self.handle = None
        # The rkey goes once the puts using it are cancelled (by the close, or the endpoint's failure) and
        # before the endpoint object is (ucp_rkey_destroy's contract); not before, while puts may be queued.
        if rkey is not None:
            rkey.destroy()


class _StreamRecv:
    """A posted stream receive on an accepted endpoint; poll ``completed``."""

    def __init__(self, ep: int, nbytes: int) -> None:
        import numpy as np

        from pdpush.transport import ucp

        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.status, self._req = ucp.stream_recv_nbx(ep, self.buf.ctypes.data, nbytes)

    @property
    def completed(self) -> bool:
        from pdpush.transport import ucp

        if self._req is not None:
            st = ucp.request_status(self._req)
            if st == ucp.UCS_INPROGRESS:
                return False
            ucp.request_free(self._req)
            self._req, self.status = None, st
        return True

    def drop(self) -> None:
        from pdpush.transport import ucp

        if self._req is not None:
            ucp.request_free(self._req)  # UCX releases it when the close has canceled it
            self._req = None


class AcceptedEndpoint(_Closable):
    """An endpoint made from a connection request on our listener (raw ucp, error handling on).

    The receiver only reads a session token from it; the peer's one-sided puts need nothing here.
    """

    def __init__(self, worker: UcxWorker, handle: int) -> None:
        super().__init__(worker, "peer")
        self.handle: int | None = handle
        self._recvs: list[_StreamRecv] = []

    def post_stream_recv(self, nbytes: int) -> tuple[_StreamRecv, object]:
        """Post a receive of exactly ``nbytes`` on the stream; returns (request, buffer)."""
        if self.handle is None:
            raise TransferError(f"endpoint {self.name} is closed")
        r = _StreamRecv(self.handle, nbytes)
        self._recvs.append(r)
        return r, r.buf

    @staticmethod
    def request_ok(req: _StreamRecv) -> bool:
        return req.completed and req.status == 0

    def close(self) -> None:
        from pdpush.transport import ucp

        if self.handle is None:
            return
        self._worker._by_handle.pop(self.handle, None)
        r = ucp.ep_close_nbx(self.handle)  # force: cancels what is posted (the buffers stay with us)
        if r is not None:
            self._worker._closing_raw.append(r)
        self.handle = None
        for rv in self._recvs:
            rv.drop()


class UcxWorker:
    """A UCX context + worker, progressed by the owning thread.

    ``epoll_fd`` can be put in a zmq.Poller; call ``arm()`` before sleeping.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        configure_env(env)
        from pdpush.transport import ucp

        try:
            self.context = ucp.Context(ucp.UCP_FEATURE_RMA | ucp.UCP_FEATURE_WAKEUP | ucp.UCP_FEATURE_STREAM)
            self.worker = ucp.Worker(self.context.handle)
        except ucp.UcpError as e:
            raise TransportError(f"cannot initialise UCX: {e}") from e
        self.listener = None
        self._closed: list[_Closable] = []
        self._busy: set[Endpoint] = set()  # endpoints with batches in flight
        self._by_handle: dict[int, _Closable] = {}  # every open endpoint, by its ucp_ep_h
        self._closing_raw: list[int] = []  # close requests of endpoints we closed
        self._retired_bufs: deque = deque(maxlen=4096)  # send buffers of wire-ups given up (UCX may still read them)
        self._on_accept: Callable[[AcceptedEndpoint], None] | None = None
        self._err_cb = ucp.ERR_CB(self._ep_failed)  # kept alive with the worker
        self._orphans: list[Completion] = []  # batches of endpoints closed while in flight
        # readable while an endpoint's close waits for dispatch_closed: a loop that sleeps elsewhere (the
        # sender's native wait) watches it
        self._closed_r, self._closed_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def describe(self) -> dict:
        """This worker's UCX: version, library, how it was chosen, and every transport/device it can use."""
        from pdpush.transport import ucp, ucx_lib

        _, b = ucx_lib.load()
        comps, res = ucx_lib.parse_print_info(self.context.print_info())
        return {"version": ucp.version_string(), "library": os.path.realpath(b.library), "source": b.source,
                "components": comps, "available": [f"{t}/{d}" for t, d in res],
                "rdma": any(t in ucx_lib.RDMA_TRANSPORTS for t, _ in res)}

    def put_failure(self, endpoint: str, status: int) -> TransportError:
        """The typed error for a native put+flush status (``Pusher.poll``'s failures)."""
        return put_failure(endpoint, status)

    def pusher(self, address: int, length: int, timeout_s: float):
        """The native per-layer data plane (``pdpush_native.Pusher``) over this worker, for the staging region at
        ``address``; endpoints join it with ``Endpoint.attach``."""
        from pdpush_native import Pusher

        return Pusher(self.worker.handle, address, length, MAX_PUT_BYTES, timeout_s)

    def endpoints(self) -> int:
        return len(self._by_handle)

    @property
    def closed_fd(self) -> int:
        """Readable while an endpoint has closed and ``dispatch_closed`` has not run its callbacks."""
        return self._closed_r

    def _signal_closed(self) -> None:
        if self._closed_w < 0:  # the worker is closed (UCX runs this callback only inside progress)
            return
        with contextlib.suppress(BlockingIOError):  # full: readable already
            os.write(self._closed_w, b"\x01")

    def dispatch_closed(self) -> None:
        """Run on_close callbacks of endpoints that closed since the last call."""
        if not self._closed:
            return
        with contextlib.suppress(BlockingIOError):
            while self._closed_r >= 0 and os.read(self._closed_r, 4096):
                pass
        while self._closed:
            self._closed.pop(0)._run_close_callbacks()

    @property
    def epoll_fd(self) -> int:
        return self.worker.epoll_fd

    def progress(self) -> None:
        while self.worker.progress():
            pass
        if self._closing_raw:
            self._reap_raw_closes()
        if self.listener is not None and self.listener.requests:
            self._accept()

    def _accept(self) -> None:
        from pdpush.transport import ucp

        reqs, self.listener.requests = self.listener.requests, []
        for conn in reqs:
            try:
                h = ucp.ep_from_conn_request(self.worker.handle, conn, self._err_cb)
            except ucp.UcpError as e:
                log.warning("cannot accept a UCX connection: %s", e)
                continue
            ep = self._by_handle[h] = AcceptedEndpoint(self, h)
            self._on_accept(ep)

    def _ep_failed(self, _arg, handle, status) -> None:
        from pdpush.transport import ucp

        ep = self._by_handle.get(handle)
        if ep is not None:
            ep._closed(f"peer failed: {ucp.status_name(status)}")

    def _reap_raw_closes(self) -> None:
        from pdpush.transport import ucp

        still = []
        for r in self._closing_raw:
            if ucp.request_status(r) == ucp.UCS_INPROGRESS:
                still.append(r)
            else:
                ucp.request_free(r)
        self._closing_raw = still

    def poll(self, now: float) -> list[Completion]:
        """Progress, then collect completed batches from every busy endpoint (transport/base.py)."""
        import pdpush_native as native

        out, self._orphans = self._orphans, []
        if not self._busy:
            return out
        native.progress(self.worker.handle)
        for ep in list(self._busy):
            ep._reap(now, out)
            if not ep._batches:
                self._busy.discard(ep)
        return out

    @property
    def in_flight(self) -> int:
        return sum(ep.in_flight for ep in self._busy)

    def arm(self) -> bool:
        """True if it is safe to sleep on ``epoll_fd``; False means progress again."""
        from pdpush.transport import ucp

        try:
            return self.worker.arm()
        except ucp.UcpError as e:
            raise TransportError(f"cannot arm the UCX worker: {e}") from e

    def listen(self, host: str, port: int, on_endpoint: Callable[[AcceptedEndpoint], None]) -> int:
        """Accept peers on ``host:port`` only (port 0: any free one); ``on_endpoint`` runs from ``progress()``."""
        from pdpush.transport import ucp

        try:
            self.listener = ucp.Listener(self.worker.handle, host, port)
        except ucp.UcpError as e:
            raise TransportError(f"cannot listen for UCX on {host}:{port}: {e}") from e
        self._on_accept = on_endpoint
        return self.listener.port

    def connect(self, host: str, port: int) -> Endpoint:
        from pdpush.transport import ucp

        try:
            h = ucp.ep_connect(self.worker.handle, host, port, self._err_cb)
        except ucp.UcpError as e:
            raise ConnectError(f"cannot connect UCX to {host}:{port}: {e}") from e
        ep = self._by_handle[h] = Endpoint(self, h, f"{host}:{port}")
        return ep

    def alloc_shared(self, nbytes: int):
        """Shared memory other local processes can attach by shmid, usable as a put target/source.

        First choice: UCX allocates it (SysV via UCX_ALLOC_PRIO=md:sysv), which is what makes
        intra-host puts memcpy-fast with error handling on. Where UCX cannot (e.g. UCX_TLS=tcp
        loads no sysv memory domain), we create the SysV segment ourselves and register it.
        Returns (region, shmid, backing).
        """
        from pdpush import shm
        from pdpush.errors import ResourceError
        from pdpush.transport import ucp

        try:
            region = ucp.MemRegion(self.context.handle, nbytes)
            try:
                return region, shm.shmid_of(region.address), "ucx-sysv"
            except ResourceError:
                region.close()
        except ucp.UcpError as e:
            log.info("UCX cannot allocate shared memory (%s); registering a SysV segment instead", e)
        shmid, addr = shm.create_private(nbytes)
        try:
            region = ucp.MemRegion(self.context.handle, nbytes, address=addr)
        except ucp.UcpError as e:
            shm.detach(addr)
            raise TransportError(f"cannot register {nbytes} bytes with UCX: {e}") from e
        region.on_close = lambda: shm.detach(addr)
        return region, shmid, "sysv-registered"

    def wait_raw(self, reqs: list[int], timeout_s: float, what: str) -> None:
        """Progress until every raw ucp request completes; free them all."""
        from pdpush.transport import ucp

        deadline = time.monotonic() + timeout_s
        pending = list(reqs)
        failure: str | None = None
        try:
            while pending:
                self.worker.progress()
                pending, failed = _reap_raw(pending)
                failure = failure or failed
                if pending and time.monotonic() > deadline:
                    raise TransportTimeout(f"{what} did not complete within {timeout_s:.1f}s")
        finally:
            for r in pending:
                ucp.request_free(r)  # UCX completes it later; we just drop our ref
        if failure is not None:
            raise TransferError(f"{what} failed: {failure}")

    def close(self) -> None:
        for ep in list(self._by_handle.values()):
            ep.close()
        if self.listener is not None:
            self.listener.destroy()
            self.listener = None
        for fd in (self._closed_r, self._closed_w):  # the close-signal pipe (closed_fd); a later callback skips it
            if fd >= 0:
                os.close(fd)
        self._closed_r = self._closed_w = -1
