"""PeerTable: the sender's receivers by endpoint, and each one's life (pure logic).

A receiver's ``Peer`` is made by the first request for it (``for_begin``, which refuses a request
whose layout is not the one the receiver said it serves). Its first waiting request sends ``Hello``
(``wait``); the ``HelloAck`` opens the data plane (``Connect``); the shell says it is up (``ready``).
A refused hello (``refused``), a hello unanswered in time (``expired``), a lost socket or failed puts
(``fail``) end it, and the next request says hello afresh; except where it never came up (a hello refused or
unanswered, a data plane that did not open): then, for ``HOLD_MS``, requests for it fail at once with that error
(``for_begin``), rather than each making a socket, a hello and an endpoint that fail the same way, at the
engines' request rate.

The requests are the session's: the table says which wait on a peer and which peers failed; the
session advances or fails the requests, and resets the peer (``ResetPeer``) after.

Imports no zmq, UCX, torch or clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pdpush import protocol
from pdpush.errors import IncompatiblePeer, PdpushError, RemoteProtocolError, TransportTimeout, error_from_code
from pdpush.layout import KVLayout
from pdpush.protocol import SENDER_PEER, Begin, Error, Hello, HelloAck, LayoutSpec, PeerEvent, PeerState
from pdpush.sessions import Log
from pdpush.sessions.tx_actions import Connect, ToPeer

HOLD_MS = 1000  # how long a receiver that did not come up is not tried again (at most control_timeout_ms)


@dataclass
class Peer:
    endpoint: str
    state: PeerState = PeerState.NEW
    ack: HelloAck | None = None
    deadline_ms: int = 0
    waiting: list[str] = field(default_factory=list)  # req_ids waiting for it to be READY
    held_until_ms: int = 0  # it did not come up: not tried again before then (``for_begin``)
    held_error: PdpushError | None = None  # why

    def layout_error(self, spec: LayoutSpec) -> IncompatiblePeer | None:
        """A request's layout against the one the receiver acknowledged (None: the same)."""
        if spec == self.ack.layout:
            return None
        mine, theirs = spec.kv_layout, self.ack.layout.kv_layout
        return IncompatiblePeer(f"layout differs from receiver {self.endpoint}'s, request vs receiver: "
                                f"{mine.mismatch(theirs)}")


class PeerTable:
    """The sender's receivers by endpoint."""

    def __init__(self, control_timeout_ms: int, default_receiver: str = "",
                 check_receiver: Callable[[str], None] | None = None) -> None:
        self.control_timeout_ms = control_timeout_ms
        self.default_receiver = default_receiver
        self._check_receiver = check_receiver  # raises for a receiver the sender may not push to
        self.peers: dict[str, Peer] = {}

    def get(self, endpoint: str) -> Peer | None:
        return self.peers.get(endpoint)

    def for_begin(self, begin: Begin, layout: KVLayout, now: int) -> Peer:
        """The peer a new request (its ``begin``, of ``layout``) goes to, made if it is new: the receiver it
        names or the default one; one not allowed, known to serve another layout, or held down after it did not
        come up, is refused."""
        receiver = begin.receiver or self.default_receiver
        if not receiver:
            raise RemoteProtocolError("no receiver named and no default_receiver configured")
        if self._check_receiver is not None:
            self._check_receiver(receiver)
        peer = self.peers.get(receiver)
        if peer is not None and peer.ack is not None and peer.ack.layout != begin.layout:
            theirs = peer.ack.layout.kv_layout
            raise IncompatiblePeer(f"receiver {receiver} serves another layout, request vs receiver: "
                                   f"{layout.mismatch(theirs)} (receiver {theirs.describe()})")
        if peer is None:
            peer = self.peers[receiver] = Peer(receiver)
        elif peer.state in (PeerState.NEW, PeerState.DEAD) and now < peer.held_until_ms and peer.held_error:
            err = peer.held_error
            raise type(err)(f"{err} ({peer.held_until_ms - now} ms before receiver {receiver} is tried again)",
                            retry_after_ms=peer.held_until_ms - now)
        return peer

    def _hold(self, p: Peer, err: PdpushError, now: int) -> None:
        """``p`` did not come up: requests for it fail with ``err`` for ``HOLD_MS``."""
        p.held_until_ms, p.held_error = now + min(HOLD_MS, self.control_timeout_ms), err

    def wait(self, peer: Peer, req_id: str, begin: Begin, now: int, out: list) -> None:
        """``req_id`` waits for ``peer`` to be READY; a peer with no hello in flight says hello."""
        peer.waiting.append(req_id)
        if peer.state in (PeerState.NEW, PeerState.DEAD):
            layout = begin.layout.kv_layout
            peer.state = SENDER_PEER.next(peer.state, PeerEvent.HELLO, f"receiver {peer.endpoint}")
            peer.deadline_ms = now + self.control_timeout_ms
            out.append(ToPeer(peer.endpoint, Hello(version=protocol.PROTOCOL_VERSION,
                                                   fingerprint=layout.fingerprint(), layout=begin.layout)))

    def hello_ack(self, p: Peer, msg: HelloAck, out: list) -> None:
        """The receiver answered hello: open the data plane to it."""
        if p.state is PeerState.HELLO_SENT:
            p.state = SENDER_PEER.next(p.state, PeerEvent.HELLO_ACK, f"receiver {p.endpoint}")
            p.ack = msg
            out.append(Connect(p.endpoint, msg))

    def refused(self, p: Peer, msg: Error, now: int, out: list) -> PdpushError:
        """The receiver refused hello (``p`` is HELLO_SENT): the error its waiting requests fail with."""
        err = error_from_code(msg.code, f"receiver refused hello: {msg.message}")
        out.append(Log(logging.WARNING, str(err)))
        p.state = SENDER_PEER.next(p.state, PeerEvent.REFUSED, f"receiver {p.endpoint}")
        self._hold(p, err, now)
        return err

    def connecting(self, endpoint: str) -> Peer | None:
        """The peer at ``endpoint`` if its data plane is wiring up."""
        p = self.peers.get(endpoint)
        return p if p is not None and p.state is PeerState.CONNECTING else None

    def ready(self, p: Peer, out: list) -> list[str]:
        """The data plane to ``p`` is up: the req_ids that waited for it."""
        p.state = SENDER_PEER.next(p.state, PeerEvent.CONNECTED, f"receiver {p.endpoint}")
        out.append(Log(logging.INFO, f"receiver {p.endpoint} ready (pool {p.ack.pool_pages} pages x "
                                     f"{p.ack.page_bytes} B)"))
        waiting, p.waiting = p.waiting, []
        return waiting

    def live(self, endpoint: str) -> Peer | None:
        """The peer at ``endpoint`` if it has a hello, a data plane or both in flight (one that can fail)."""
        p = self.peers.get(endpoint)
        return p if p is not None and p.state in (PeerState.HELLO_SENT, PeerState.CONNECTING,
                                                  PeerState.READY) else None

    def expired(self, now: int) -> list[tuple[Peer, PdpushError]]:
        """Peers whose hello (or data plane) is not up by its deadline, with the error they fail with."""
        return [(p, TransportTimeout(f"receiver {p.endpoint} did not answer hello within {self.control_timeout_ms} "
                                     "ms (down, unreachable, or refusing our CURVE key)"))
                for p in self.peers.values()
                if p.state in (PeerState.HELLO_SENT, PeerState.CONNECTING) and now > p.deadline_ms]

    def fail(self, p: Peer, err: PdpushError, now: int, out: list) -> None:
        """``p`` failed: DEAD until the next request says hello (the session fails its requests); held down
        first where it never came up."""
        out.append(Log(logging.WARNING, f"receiver {p.endpoint} failed: {err}"))
        if p.state in (PeerState.HELLO_SENT, PeerState.CONNECTING):
            self._hold(p, err, now)
        if SENDER_PEER.allows(p.state, PeerEvent.FAIL):
            p.state = SENDER_PEER.next(p.state, PeerEvent.FAIL, f"receiver {p.endpoint}")
        p.ack = None

    def forget_idle(self, in_use: set[str]) -> list[str]:
        """Forget the receivers that failed (DEAD) or never said hello (NEW), with no request waiting on them and
        none of ``in_use`` (the endpoints live requests are on); their endpoints. The next request for one says
        hello afresh, as it would have; a sender that sees receivers come and go at new addresses keeps none."""
        gone = [e for e, p in self.peers.items()
                if p.state in (PeerState.NEW, PeerState.DEAD) and not p.waiting and e not in in_use]
        for e in gone:
            del self.peers[e]
        return gone

    def known(self) -> int:
        return len(self.peers)

    def connected(self) -> int:
        return sum(1 for p in self.peers.values() if p.state is PeerState.READY)
