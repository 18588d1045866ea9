"""The data-plane interface: posted puts and flushes, completions polled by the loop. The daemons and tools
get a transport from ``auto.open_transport``.

Nothing here ever waits. ``Endpoint.post_puts`` posts a batch of one-sided
puts and one flush and returns at once; the owner's loop calls
``Transport.poll(now)``, which makes progress on every endpoint and returns the
batches that finished since the last call. Guarantees a conforming transport
gives (``tests/test_transport_conformance.py`` checks them against UCX):

  * ordering: one endpoint's batches complete in the order they were posted;
  * completion: a batch completes only when its flush does, i.e. its bytes
    were written remotely (delivery still needs the receiver's ack);
  * failure: a batch on a dead endpoint completes with a ``TransferError``;
    posting on a dead endpoint raises ``TransferError`` at once;
  * timeout: a batch not done by its deadline completes with a
    ``TransportTimeout``, and the endpoint is failed (its later batches too);
  * isolation: a stalled endpoint holds only its own batches.

Loads no UCX; implementations (``ucx.py``) do.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pdpush.errors import TransportError


class PutOp(NamedTuple):
    """One contiguous put: local address -> remote address, ``nbytes`` long (a tuple: the native data
    plane reads it as one)."""

    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class Completion:
    """A posted batch finished: ``error`` is None when its flush completed."""

    token: Hashable
    puts: int
    error: TransportError | None = None


class Endpoint(Protocol):
    name: str

    @property
    def alive(self) -> bool: ...

    def post_puts(self, ops: Sequence[PutOp], token: Hashable, deadline: float) -> int:
        """Post ``ops`` and one flush; returns the number of puts posted. Never waits (not even a
        fence: ``ucp_worker_fence`` blocked on a stalled tcp peer here, so order comes from flushes)."""
        ...

    @property
    def in_flight(self) -> int:
        """Batches posted and not yet completed."""
        ...

    def set_rkey(self, packed: bytes, timeout_s: float) -> None:
        """The peer's packed remote key, once its wire-up completed (puts need it)."""
        ...

    def attach(self, pusher, eid: int, pool: tuple[int, int]) -> None:
        """Join the native per-layer data plane (``Transport.pusher``) as its endpoint ``eid``; ``pool``: the peer's
        pool (address, bytes), which the native path refuses any put to leave."""
        ...

    def stream_send(self, payload: bytes, timeout_s: float) -> None:
        """Bytes on the endpoint's own stream (the one-time session token)."""
        ...

    def begin_wireup(self, token: bytes, packed_rkey: bytes) -> None:
        """Start connecting: the session token on the stream, then the rkey once connected; returns at once."""
        ...

    def wired_up(self) -> bool:
        """Whether ``begin_wireup``'s wire-up has completed; never waits. Raises TransferError if it failed."""
        ...

    def cancel_wireup(self) -> None:
        """Give a wire-up in progress up."""
        ...

    def on_close(self, cb: Callable) -> None:
        """``cb(endpoint)`` runs (from ``Transport.dispatch_closed``) once the endpoint failed or closed."""
        ...

    def peer(self) -> str:
        """The address of its other end."""
        ...

    def transports(self) -> list[str]:
        """The transports and devices its lanes use (``tcp/eth0``)."""
        ...

    def close(self) -> None: ...


class Transport(Protocol):
    """One worker of the data plane, progressed by the thread that owns it (notes/ucx.md)."""

    @property
    def epoll_fd(self) -> int:
        """An fd to sleep on (after ``arm``): it turns readable when the transport has work."""
        ...

    def arm(self) -> bool:
        """True if it is safe to sleep on ``epoll_fd``; False means progress again first."""
        ...

    def progress(self) -> None:
        """Progress: completions, endpoint errors and closes, accepted connections."""
        ...

    def poll(self, now: float) -> list[Completion]:
        """Progress every endpoint; the batches that completed (or failed, or timed out)."""
        ...

    def alloc_shared(self, nbytes: int):
        """Registered memory a local process can map: (region, SysV shmid, backing)."""
        ...

    def listen(self, host: str, port: int, on_endpoint: Callable) -> int:
        """Accept peers on ``host:port`` (0: any free port); returns the port."""
        ...

    def connect(self, host: str, port: int) -> Endpoint: ...

    def dispatch_closed(self) -> None:
        """Run the close callbacks of endpoints that failed or closed since the last call."""
        ...

    @property
    def closed_fd(self) -> int:
        """An fd readable while an endpoint has failed or closed and ``dispatch_closed`` has not run."""
        ...

    def pusher(self, address: int, length: int, timeout_s: float):
        """The native per-layer data plane over this transport, for the staging region at ``address``."""
        ...

    def put_failure(self, endpoint: str, status: int) -> TransportError:
        """The typed error for a put+flush of the pusher's that ended with ``status``: TransportTimeout for a
        stalled or partitioned peer, TransferError otherwise."""
        ...

    def describe(self) -> dict:
        """Its UCX: version, library, how it was chosen, every transport/device it can use, ``rdma``."""
        ...

    def endpoints(self) -> int:
        """Endpoints open (made or accepted, and not closed): a daemon's count of them must not grow."""
        ...

    def close(self) -> None: ...
