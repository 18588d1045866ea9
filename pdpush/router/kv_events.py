"""The router's subscription to a prefill engine's vLLM KV events, on asyncio: frames in, and the
engine's ``EngineCacheView`` (engine_cache.py) kept from them. Every decision is the view's.

vLLM's ``ZmqEventPublisher`` sends each ``KVEventBatch`` on a PUB socket as three frames: the topic,
the sequence number (8 bytes, big-endian) and the batch (msgpack: ``[ts, [event, ...], dp_rank]``, an
event a map tagged ``{"type": "BlockStored", ...}``, or in older vLLM an array ``["BlockStored",
...]``). Its replay socket (a ROUTER) answers a request of one frame, the first sequence number wanted,
with the batches it still holds from there (the same three frames each) and an end frame whose sequence
is -1: several replies to one request, so the router asks from a DEALER (a REQ socket keeps only the
first). ``decode_batch`` reads a batch, checking every field it uses; ``EngineEvents`` subscribes, asks
the replay socket for everything it still holds (so an idle engine's cache is known at once), fills a
gap from it with a deadline, and hands batches to the view.

Named endpoints are reached by address, resolved on a thread (transport/resolve.py), as the receiver feeds are
(feeds.py says why). A subscription is a silent socket, so libzmq's heartbeats tell a connection whose engine is
gone, and the name is looked up again every ``recheck_s``: an engine that came back at another address is
subscribed to there (``Moved``), its view cleared.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgpack
import zmq
import zmq.asyncio

from pdpush.router.engine_cache import Cleared, EngineCacheView, Event, Removed, Stored
from pdpush.transport import resolve

log = logging.getLogger("pdpush.router.kv_events")

MAX_BATCH_BYTES = 64 << 20
REPLAY_TIMEOUT_S = 2.0
END_SEQ = -1
RESOLVE_TIMEOUT_S = 10.0
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 1000, 3000  # a connection unanswered this long is dropped, and made again

# each event type's fields in vLLM's order (distributed/kv_events.py), for the array form
_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
           "extra_keys", "group_idx")
_REMOVED = ("block_hashes", "medium", "group_idx")


class BadBatch(ValueError):
    """A frame that is not a KV event batch."""


class Unresolved(ConnectionError):
    """The publisher's host name did not resolve: nothing was subscribed."""


class Moved(ConnectionError):
    """The publisher's host name now gives another address (``address``) than the one subscribed to."""

    def __init__(self, message: str, address: str) -> None:
        super().__init__(message)
        self.address = address


def _fields(e, names: tuple[str, ...]) -> dict:
    if isinstance(e, dict):
        return {k: e.get(k) for k in names}
    return dict(zip(names, list(e[1:]) + [None] * (len(names) - len(e) + 1), strict=False))


def _hashes(v) -> list:
    if not isinstance(v, list) or not all(isinstance(h, (int, bytes)) for h in v):
        raise BadBatch("block_hashes: a list of ints or bytes")
    return v


def _event(e) -> Event | None:
    kind = e.get("type") if isinstance(e, dict) else (e[0] if isinstance(e, list) and e else None)
    if kind == "BlockStored":
        f = _fields(e, _STORED)
        toks, bs = f["token_ids"], f["block_size"]
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise BadBatch("token_ids: a list of ints")
        if not isinstance(bs, int) or bs <= 0:
            raise BadBatch("block_size: a positive int")
        parent = f["parent_block_hash"]
        if parent is not None and not isinstance(parent, (int, bytes)):
            raise BadBatch("parent_block_hash: an int, bytes or null")
        extra = f["extra_keys"]
        return Stored(_hashes(f["block_hashes"]), parent, toks, bs, f["lora_id"], f["medium"], f["lora_name"],
                      extra if isinstance(extra, list) else None, f["group_idx"])
    if kind == "BlockRemoved":
        f = _fields(e, _REMOVED)
        return Removed(_hashes(f["block_hashes"]), f["medium"], f["group_idx"])
    if kind == "AllBlocksCleared":
        return Cleared()
    return None  # an event this router does not know: not about what it matches


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one ``KVEventBatch``; ``BadBatch`` if it is not one."""
    if len(payload) > MAX_BATCH_BYTES:
        raise BadBatch(f"a batch of {len(payload)} bytes (at most {MAX_BATCH_BYTES})")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise BadBatch(f"not msgpack: {e}") from None
    events = obj[1] if isinstance(obj, list) and len(obj) >= 2 else (obj.get("events") if isinstance(obj, dict)
                                                                    else None)
    if not isinstance(events, list):
        raise BadBatch("not a KVEventBatch ([ts, events, dp_rank])")
    out = []
    for e in events:
        ev = _event(e)
        if ev is not None:
            out.append(ev)
    return out


def _seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise BadBatch(f"a sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


@dataclass(frozen=True)
class Source:
    """Where an engine publishes (its ``--kv-events-config``, as this host reaches it)."""

    endpoint: str
    replay_endpoint: str = ""
    topic: str = ""


class EngineEvents:
    """Keeps ``view`` following one engine's events: subscribe, fill gaps from the replay buffer, and
    count what could not be read (``bad_batches``)."""

    def __init__(self, source: Source, view: EngineCacheView, ctx: zmq.asyncio.Context | None = None,
                 recheck_s: float = 30.0, address: str | None = None, last: str | None = None) -> None:
        self.source, self.view = source, view
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sub: zmq.asyncio.Socket | None = None
        self.bad_batches = 0
        self.replays = 0
        self._dup: tuple[int, int] | None = None  # the last replay's batches: live copies of them are dropped
        self._live_last: int | None = None  # the last live batch's number: one not above it is a restart
        hp = resolve.tcp_host_port(source.endpoint)
        self._name = resolve.Followed(hp[0], recheck_s) if hp and not resolve.is_address(hp[0]) else None
        self._address = address  # where the name was just seen to have moved (``Moved``): no lookup for it again
        self._last = last  # where it was reached last: taken again where a lookup fails (a DNS server down)

    @property
    def reached(self) -> str | None:
        """The address the publisher's name gave, where it is named and was reached."""
        return self._name.address if self._name is not None else None

    async def _at(self, endpoint: str, timeout_s: float, followed: resolve.Followed | None = None,
                  last: str | None = None) -> str:
        """``endpoint`` by address: its name looked up within ``timeout_s``, else ``last`` (the address it gave
        before), else ``Unresolved``."""
        hp = resolve.tcp_host_port(endpoint)
        if hp is None or resolve.is_address(hp[0]):
            return endpoint
        address, why = await resolve.address_of(hp[0], timeout_s, last)
        if address is None:
            raise Unresolved(why)
        if why:
            log.warning("KV events at %s: %s; subscribing at its last address, %s", endpoint, why, address)
        if followed is not None:
            followed.reached(address, time.monotonic())
        return resolve.at_address(endpoint, address)

    @staticmethod
    def _connect(sock: zmq.asyncio.Socket, target: str) -> None:
        if "://[" in target:  # an IPv6 address: libzmq reaches one only when told
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(target)

    async def _open(self) -> None:
        if self._name is not None and self._address is not None:
            self._name.reached(self._address, time.monotonic())
            target = resolve.at_address(self.source.endpoint, self._address)
        else:
            target = await self._at(self.source.endpoint, RESOLVE_TIMEOUT_S, self._name, self._last)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        self.sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        self._connect(self.sub, target)

    async def run(self) -> None:
        await self._open()
        if self.source.replay_endpoint:  # what the engine holds now, before it publishes again: an idle
            self.replays += 1            # engine's cache is seen at once, not after its next batch
            first, upto = await self._replay(0)
            if first is not None:
                self._dup = (first, upto)
        while True:
            if await self.sub.poll(1000, zmq.POLLIN):
                frames = await self.sub.recv_multipart()
                await self._maybe_replay(frames)
                self._on_frames(frames)
            moved = self._name.moved(time.monotonic()) if self._name is not None else None
            if moved is not None:
                raise Moved(f"{self._name.host!r} now resolves to {moved}, not {self._name.address}", moved)

    async def _maybe_replay(self, frames: list[bytes]) -> None:
        """Fill the gap before a live batch from the replay buffer."""
        try:
            seq = _seq(frames[1]) if len(frames) == 3 else None
        except BadBatch:
            return
        if seq is None:
            return
        if (self._live_last is not None and seq <= self._live_last) or (self._dup is not None and seq > self._dup[1]):
            self._dup = None  # a live number that went back is a restarted engine, never a copy of a replayed batch
        self._live_last = seq
        if self._dup is not None and seq >= self._dup[0]:
            return  # a live copy of a batch the last replay brought
        self.view.check_restart(seq)
        start = self.view.wants_replay(seq)
        if start is None:
            return
        if not self.source.replay_endpoint:
            return  # the gap stays: the view counts it and starts again (on_batch)
        self.replays += 1
        first, upto = await self._replay(start)
        if first is not None:
            self._dup = (first, upto)

    async def _replay(self, start: int) -> tuple[int | None, int]:
        """Ask the replay buffer for the batches from ``start`` and apply them: the first and the last one's
        numbers (None: none came, within the deadline)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLAY_TIMEOUT_S
        first, upto = None, -1
        try:
            hp = resolve.tcp_host_port(self.source.replay_endpoint)
            if hp is not None and self._name is not None and hp[0] == self._name.host and self._name.address:
                target = resolve.at_address(self.source.replay_endpoint, self._name.address)  # the publisher's
            else:
                target = await self._at(self.source.replay_endpoint, REPLAY_TIMEOUT_S)
        except Unresolved as e:
            log.warning("replay from %s failed: %s", self.source.replay_endpoint, e)
            return first, upto
        req = self.ctx.socket(zmq.DEALER)  # a REQ socket would take the first reply only
        try:
            req.setsockopt(zmq.LINGER, 0)
            req.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
            self._connect(req, target)
            await req.send_multipart([b"", start.to_bytes(8, "big", signed=True)])  # as a REQ would frame it
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await req.poll(int(left * 1000), zmq.POLLIN):
                    log.warning("replay from %s timed out", self.source.replay_endpoint)
                    return first, upto
                frames = await req.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                seq = _seq(frames[1]) if len(frames) == 3 else None
                if seq == END_SEQ:
                    return first, upto
                if seq is not None:
                    first = seq if first is None else first
                    upto = max(upto, seq)
                self._on_frames(frames, replayed=True)
        except (zmq.ZMQError, BadBatch) as e:
            log.warning("replay from %s failed: %s", self.source.replay_endpoint, e)
            return first, upto
        finally:
            req.close(0)

    def _on_frames(self, frames: list[bytes], replayed: bool = False) -> None:
        seq = None
        try:
            if len(frames) != 3:
                raise BadBatch(f"{len(frames)} frames (topic, sequence, batch)")
            seq = _seq(frames[1])
            events = decode_batch(frames[2])
            dup = self._dup is not None and self._dup[0] <= seq <= self._dup[1]
            self.view.on_batch(seq, events, replayed=replayed or dup)
        except (BadBatch, ValueError, TypeError, OverflowError) as e:
            self.bad_batches += 1
            log.warning("bad KV event batch from %s: %s", self.source.endpoint, e)
            if seq is not None:
                self.view.lost(seq, "bad_batch")  # its events are missing: what the view held may be stale

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close(0)
