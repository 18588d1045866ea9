"""The router's subscription to one receiver's chunk-index feed (index.py), on asyncio.

All decisions (gaps, epochs, when to ask for a snapshot) are ``IndexView``'s; this moves frames.

A receiver named by a host name (a Kubernetes pod's) is reached by address: its name resolves on a thread
(transport/resolve.py), never on the I/O thread that every zmq socket of the router shares. libzmq resolves a
connect's name there, again at each reconnect; one name slow to answer stalled every feed and subscription, and
their views were dropped as silent. The name is looked up again at each new socket, and every ``recheck_s``
(``resolve.Followed``): a receiver that moved is followed.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq

from pdpush import control, protocol
from pdpush.errors import PdpushError
from pdpush.index import IndexView
from pdpush.protocol import IndexEvent, IndexSnapshot, IndexSubscribe, Unread, Withdraw
from pdpush.transport import resolve

log = logging.getLogger("pdpush.router.feeds")

MAX_FRAME = 96 << 20  # a snapshot of a million-page pool is 16 MiB of keys
KEEPALIVE_S = 3.0
RESOLVE_TIMEOUT_S = 10.0  # a name's lookup, at most (then the feed tries again, RETRY_S on)
RETRY_S = 1.0


def now_ms() -> int:
    return int(time.monotonic() * 1000)


class Feed:
    """Keeps ``view`` equal to the receiver's index: subscribe, fold events, re-snapshot on a gap,
    a new epoch or silence; a fresh socket after silence (the receiver may have restarted)."""

    def __init__(self, endpoint: str, view: IndexView, silence_s: float, configure=None, on_change=None,
                 on_withdrawn=None, recheck_s: float = 30.0) -> None:
        self.endpoint, self.view, self.silence_ms = endpoint, view, int(silence_s * 1000)
        self._configure = configure
        self._on_change = on_change or (lambda kind: None)
        self._on_withdrawn = on_withdrawn or (lambda push_id: None)  # the receiver's Ok to a withdrawal
        self.sock = None
        self.connected_ms = 0
        hp = resolve.tcp_host_port(endpoint)
        self._name = resolve.Followed(hp[0], recheck_s) if hp and not resolve.is_address(hp[0]) else None
        self._renew = False  # the socket is to be replaced (silent, or its receiver moved)
        self._failed: str | None = None  # why the last new socket could not be made (logged once)
        self._moved_to: str | None = None  # the address a look just found the name moved to: connected to next

    async def _connect(self) -> bool:
        """A fresh socket to the receiver, by address where it is named, in place of the last one; False where its
        name did not resolve or the socket could not be made (logged once per reason): the last socket, if any, is
        kept meanwhile (withdrawals still queue on it) and the next try makes a new one."""
        target = self.endpoint
        address = None
        if self._name is not None:
            address, self._moved_to = self._moved_to, None
            if address is None:  # (a lookup that fails keeps the last address)
                address, why = await resolve.address_of(self._name.host, RESOLVE_TIMEOUT_S, self._name.address)
                if address is None:
                    return self._failing(why)
            target = resolve.at_address(self.endpoint, address)
        try:
            sock = control.async_dealer(target, MAX_FRAME, self._configure)
        except (PdpushError, zmq.ZMQError) as e:  # (a bad endpoint, no file descriptor, a CURVE option refused)
            return self._failing(f"{type(e).__name__}: {e}")
        self.close()
        self.sock, self._renew, self._failed = sock, False, None
        if address is not None:
            self._name.reached(address, time.monotonic())
        self.connected_ms = now_ms()
        return True

    def _failing(self, why: str) -> bool:
        if why != self._failed:
            log.warning("index feed of %s: %s", self.endpoint, why)
        self._failed = why
        return False

    async def _send(self, snapshot: bool) -> None:
        try:
            await self.sock.send(protocol.encode(IndexSubscribe(snapshot=snapshot)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # not connected yet: the next keep-alive or re-subscription tries again

    async def withdraw(self, push_id: str, reason: str, unread: bool = False) -> bool:
        """Tell the receiver that push ``push_id`` will not come (``protocol.Withdraw``), or, ``unread``, that nobody
        will read it (``protocol.Unread``: its client hung up, or no decode engine took a leg naming it), on the feed's socket: its ``Ok`` comes back on it
        (``on_withdrawn``), an ``Error`` is logged. False where it could not be queued (no socket, or its queue
        full); a queued one is lost with the socket if the receiver is not reached before a reconnection.
        Unacknowledged, the decode waits for the push as long as its ``push_wait_s``."""
        if self.sock is None:
            return False
        try:
            msg = (Unread if unread else Withdraw)(req_id=push_id, reason=reason[:1024])
            await self.sock.send(protocol.encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    async def run(self) -> None:
        last_keepalive = 0.0
        while True:
            try:
                if self.sock is None or self._renew:
                    if not await self._connect():
                        await asyncio.sleep(RETRY_S)
                        continue
                    self.view.asked_ms = now_ms()  # a fresh socket subscribes at once
                    await self._send(True)
                    last_keepalive = time.monotonic()
                if await self.sock.poll(250, zmq.POLLIN):
                    self._on_frame(await self.sock.recv_multipart())
                t = now_ms()
                moved = self._name.moved(time.monotonic()) if self._name is not None else None
                if self.view.synced and self.view.silent(t, self.silence_ms):
                    log.warning("index feed of %s silent for %.1f s: distrusted until a snapshot", self.endpoint,
                                self.silence_ms / 1000)
                    self._lose("silent")
                elif not self.view.synced and t - self.connected_ms >= self.silence_ms and \
                        self.view.silent(t, self.silence_ms):
                    self._renew = True  # never answered: a fresh socket (a restarted receiver, a new address)
                elif moved is not None:
                    log.warning("index feed of %s: %r now resolves to %s, not %s: following it there", self.endpoint,
                                self._name.host, moved, self._name.address)
                    self._lose("moved")
                    self._moved_to = moved
                elif self.view.want_snapshot(t):
                    await self._send(True)
                    last_keepalive = time.monotonic()
                elif time.monotonic() - last_keepalive >= KEEPALIVE_S:
                    await self._send(False)
                    last_keepalive = time.monotonic()
            except asyncio.CancelledError:
                self.close()
                raise
            except Exception:  # noqa: BLE001 - a bad frame or a socket error must not end the feed
                log.exception("index feed of %s", self.endpoint)
                await asyncio.sleep(0.5)

    def _lose(self, why: str) -> None:
        """What the view held is no longer known: dropped until a snapshot from a fresh socket."""
        if self.view.synced:
            self.view.lose()
            self._on_change(why)
        self._renew = True

    def _on_frame(self, frames: list[bytes]) -> None:
        try:  # what one pass of the receiver's loop had for us: one message or a batch (daemon.Outbox)
            msgs = protocol.decode_batch(frames[-1], MAX_FRAME)
        except PdpushError as e:
            log.warning("index feed of %s: bad frame: %s", self.endpoint, e)
            return
        for msg in msgs:
            if isinstance(msg, PdpushError):
                log.warning("index feed of %s: bad message: %s", self.endpoint, msg)
            else:
                self._on_msg(msg, now_ms())

    def _on_msg(self, msg: protocol.Msg, t: int) -> None:
        if isinstance(msg, IndexSnapshot):
            self.view.on_snapshot(msg, t)
            self._on_change("snapshot")
            log.info("index feed of %s: snapshot of %d chunks (epoch %s, seq %d)", self.endpoint, len(msg.keys),
                     msg.epoch, msg.seq)
        elif isinstance(msg, IndexEvent):
            if not self.view.on_event(msg, t):
                self._on_change("gap")
                log.info("index feed of %s: out of sync at seq %d (%s); asking for a snapshot", self.endpoint,
                         msg.seq, msg.kind)
        elif isinstance(msg, protocol.Ok) and msg.req_id:  # (only a withdrawal is answered Ok on this socket)
            self._on_withdrawn(msg.req_id)
        elif isinstance(msg, protocol.Error):
            log.warning("index feed of %s: %s: %s", self.endpoint, msg.code.value, msg.message)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
