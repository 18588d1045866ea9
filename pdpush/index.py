"""Chunk-index events: the receiver's ``IndexFeed`` publishes them, a router's ``IndexView`` folds
them into its copy of where KV is. Pure logic (no sockets, no clock: ``now`` in milliseconds).

The protocol (messages in protocol.py), on the receiver's control endpoint:
  * a router sends ``IndexSubscribe``; the receiver answers with an ``IndexSnapshot`` (every key
    held, the last sequence number folded in, its epoch), then sends every change as an
    ``IndexEvent`` (``stored``, ``evicted``, ``cleared``), each with the next sequence number;
  * once a second with no change it sends a ``heartbeat`` carrying the current sequence number and
    its load, so a subscriber notices a lost event (a gap) even when nothing else moves;
  * a subscriber that finds a gap, a new epoch (the receiver restarted) or silence asks for a new
    snapshot. Its view is exact again as soon as the snapshot arrives.
  * subscribers re-subscribe (``snapshot=False``) every few seconds; one unheard for
    ``expire_ms`` is dropped, so a router that went away costs nothing.

Events are sent without blocking: a subscriber that cannot take one misses it, sees the gap at the
next event or heartbeat, and resynchronizes. The index is soft state: a router can always rebuild
it from the receivers, and several routers can subscribe side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdpush.protocol import IndexEvent, IndexLoad, IndexSnapshot, LayoutSpec

HEARTBEAT_MS = 1000
EXPIRE_MS = 15_000
MAX_SUBSCRIBERS = 64


class IndexFeed:
    """The receiver side: who subscribes, the sequence, and the messages to send them."""

    def __init__(self, epoch: str, layout: LayoutSpec, *, heartbeat_ms: int = HEARTBEAT_MS,
                 expire_ms: int = EXPIRE_MS, max_subscribers: int = MAX_SUBSCRIBERS) -> None:
        self.epoch, self.layout = epoch, layout
        self.heartbeat_ms, self.expire_ms, self.max_subscribers = heartbeat_ms, expire_ms, max_subscribers
        self.seq = 0
        self.subscribers: dict[bytes, int] = {}  # identity -> last heard (ms)
        self._last_sent = 0

    def subscribe(self, ident: bytes, snapshot: bool, keys: list[bytes], load: IndexLoad,
                  now: int) -> list[tuple[bytes, IndexSnapshot]]:
        """A (re-)subscription. Returns the snapshot to send, if one was asked for.
        Past ``max_subscribers`` the one heard from longest ago is dropped."""
        self.subscribers[ident] = now
        if len(self.subscribers) > self.max_subscribers:
            del self.subscribers[min(self.subscribers, key=self.subscribers.__getitem__)]
        if not snapshot:
            return []
        return [(ident, IndexSnapshot(epoch=self.epoch, seq=self.seq, layout=self.layout, keys=keys, load=load))]

    def change(self, kind: str, keys: list[bytes], load: IndexLoad, now: int) -> list[tuple[bytes, IndexEvent]]:
        """One change to the index: the next sequence number, to every subscriber."""
        self.seq += 1
        self._last_sent = now
        ev = IndexEvent(epoch=self.epoch, seq=self.seq, kind=kind, keys=keys, load=load)
        return [(i, ev) for i in self.subscribers]

    def tick(self, load: IndexLoad, now: int) -> list[tuple[bytes, IndexEvent]]:
        """Expire silent subscribers; a heartbeat if nothing was sent for ``heartbeat_ms``."""
        for i in [i for i, t in self.subscribers.items() if now - t >= self.expire_ms]:
            del self.subscribers[i]
        if not self.subscribers or now - self._last_sent < self.heartbeat_ms:
            return []
        self._last_sent = now
        ev = IndexEvent(epoch=self.epoch, seq=self.seq, kind="heartbeat", load=load)
        return [(i, ev) for i in self.subscribers]


@dataclass
class IndexView:
    """One receiver's chunk index as a router sees it."""

    epoch: str | None = None
    seq: int = 0
    keys: set[bytes] = field(default_factory=set)
    layout: LayoutSpec | None = None
    load: IndexLoad | None = None
    synced: bool = False  # False: the keys may be wrong; ask for a snapshot and do not trust them
    last_heard_ms: int = -(1 << 62)
    resyncs: int = 0  # snapshots taken after the first (gaps, restarts, silences)
    snapshots: int = 0
    asked_ms: int = -(1 << 62)  # when a snapshot was last asked for

    def on_snapshot(self, snap: IndexSnapshot, now: int) -> None:
        self.resyncs += self.snapshots > 0
        self.snapshots += 1
        self.epoch, self.seq, self.layout, self.load = snap.epoch, snap.seq, snap.layout, snap.load
        self.keys = set(snap.keys)
        self.synced = True
        self.last_heard_ms = now

    def on_event(self, ev: IndexEvent, now: int) -> bool:
        """Fold one event in. False: the view is out of sync (a gap, or another epoch): it is
        cleared, and the caller must ask for a snapshot."""
        self.last_heard_ms = now
        self.load = ev.load
        if not self.synced:
            return False  # waiting for a snapshot: events before it are folded into it
        expected = self.seq if ev.kind == "heartbeat" else self.seq + 1
        if ev.epoch != self.epoch or ev.seq != expected:
            if ev.epoch == self.epoch and ev.seq <= self.seq:
                return True  # a late duplicate of one already folded in (a snapshot overtook it)
            self.lose()
            return False
        self.seq = ev.seq
        if ev.kind == "stored":
            self.keys.update(ev.keys)
        elif ev.kind == "evicted":
            self.keys.difference_update(ev.keys)
        elif ev.kind == "cleared":
            self.keys.clear()
        return True

    def want_snapshot(self, now: int, retry_ms: int = 2000) -> bool:
        """Whether to ask for a snapshot now: out of sync, and none asked for within ``retry_ms``
        (one is on its way: events that overtake it must not trigger a storm of them)."""
        if self.synced or now - self.asked_ms < retry_ms:
            return False
        self.asked_ms = now
        return True

    def silent(self, now: int, silence_ms: int) -> bool:
        return now - self.last_heard_ms >= silence_ms

    def lose(self) -> None:
        """Out of sync or unheard: nothing is known until the next snapshot."""
        self.synced = False
        self.keys = set()

    def held_prefix(self, keys: list[bytes]) -> int:
        """Leading ``keys`` held (0 while out of sync)."""
        if not self.synced:
            return 0
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n
