"""StagingGrants: the sender's staging by request (pure logic; docs/layout.md, "Staging: the layers in flight").

Each request gets a metadata block (its grant table, a u64 per layer: the layer's block offset + 1,
or 0 until granted; then a readiness word per new item) and, layer by layer, a block of the layer area:

  * ahead, at allocation, in layer order while the layer area stays at most half full and no engine
    waits (a request that fits never asks);
  * when its engine asks (``NeedStaging``), in the order engines asked; the head waits for room and
    nothing overtakes it. A block asked for is written at once, and blocks granted ahead hold at most
    half of the area, so an engine that asks gets room whatever order engines write requests in;
  * back when the layer lands (every rank's share flushed), or, for a request that failed, once each of
    its engines has said it stopped writing (Abort, Finish, a new Begin), died, or ``lease_ms`` passed.

The session calls it; it appends ``PlanGrants`` (blocks granted: the native path's plan and the grant
table), ``FillWords`` (a grant table cleared) and ``ToClient`` (``StagingGranted``) actions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdpush.errors import PoolExhausted, RemoteProtocolError, RequestTooLarge
from pdpush.layout import KVLayout
from pdpush.plan import RequestPlan, meta_bytes
from pdpush.protocol import StagingGranted, TxState
from pdpush.sessions import Counters
from pdpush.sessions.tx_actions import FillWords, PlanGrants, StagingInfo, ToClient
from pdpush.sessions.tx_request import TxRequest
from pdpush.staging import StagingAllocator, split


@dataclass
class _Held:
    """Staging of a failed request that one of its engines may still be writing."""

    until_ms: int
    blocks: list[tuple[StagingAllocator, int]]  # (allocator, offset)
    handle: int = 0  # the request's handle (its seq): how a finish record in the engine's ring names it


class StagingGrants:
    def __init__(self, info: StagingInfo, counters: Counters, lease_ms: int) -> None:
        self.info, self.counters, self.lease_ms = info, counters, lease_ms
        meta, layers = split(info.nbytes)
        self.meta = StagingAllocator(meta, 0, "staging metadata", align=64)  # a request's is a few hundred bytes
        self.layers = StagingAllocator(layers, meta)  # the layers in flight
        self._queue: deque[tuple[TxRequest, int, int]] = deque()  # (request, layer, bytes) asked for, in order
        self._head_waited = False
        self._held: dict[tuple[str, bytes], _Held] = {}  # by (req_id, engine)

    # ---- a request's life ----
    def check(self, layout: KVLayout, tokens: int) -> None:
        """Raise ``RequestTooLarge`` unless a ``tokens``-token request of ``layout`` can ever move. Its metadata is
        counted before it is planned: a plan holds every item of every group (an engine's layout of 4,096 groups
        and a long prompt made the sender plan for minutes, in gigabytes, before refusing it)."""
        items = layout.item_count(tokens)
        if not self.meta.fits(need := meta_bytes(layout, items)):
            raise RequestTooLarge(f"the request's {items} items need {need} bytes of staging metadata (of "
                                  f"{self.meta.size}); raise staging_bytes ({self.info.nbytes})")
        whole = RequestPlan(layout, tokens)  # (nothing held)
        biggest = max((nb for _, nb in whole.staging_units()), default=0)
        if self.layers.rounded(biggest) > self.layers.size // 2:
            raise RequestTooLarge(f"one layer of the request needs {biggest} bytes of staging (at most half of its "
                                  f"{self.layers.size} layer bytes); raise staging_bytes ({self.info.nbytes})")

    def open(self, r: TxRequest, out: list) -> None:
        """The request's metadata, its grant table cleared (raises ``PoolExhausted`` when full)."""
        r.grant.meta_off = self.meta.alloc(r.plan.meta_bytes)
        out.append(FillWords(self.info.address + r.grant.meta_off, 0, r.plan.grant_words))

    def words(self, r: TxRequest) -> int:
        """Staging address of the request's readiness words, after its grant table."""
        return self.info.address + r.grant.meta_off + r.plan.grant_words * 8

    def ahead(self, r: TxRequest, out: list) -> None:
        """At allocation: the request's blocks in layer order while the area stays half free, unless an
        engine waits (it comes first)."""
        if self._queue:
            return
        area = self.layers
        used, units = area.size - area.free_bytes, []
        for layer, nbytes in r.plan.staging_units():
            used += area.rounded(nbytes)
            if used > area.size // 2:
                break
            units.append((layer, nbytes))
        if not units:
            return
        offs = area.alloc_run([nb for _, nb in units])
        self._give(r, [(layer, off) for (layer, _), off in zip(units, offs, strict=False)], out)  # those that fit, in layer order

    def ask(self, r: TxRequest, ident: bytes, layer: int, posted: set[int], out: list) -> None:
        """Engine ``ident`` is about to write ``layer`` and found no block (``posted``: its layers handed over)."""
        units = dict(r.plan.staging_units())
        if layer not in units:
            raise RemoteProtocolError(f"request {r.req_id!r} has no staging for layer {layer}")
        if layer in r.grant.blocks:  # granted already (another rank asked first)
            out.append(ToClient(ident, StagingGranted(req_id=r.req_id, unit=layer)))
            return
        if layer in posted:
            raise RemoteProtocolError(f"layer {layer} of {r.req_id!r} was handed over already")
        waiting = r.grant.asked.setdefault(layer, set())
        if not waiting:
            self._queue.append((r, layer, units[layer]))
            self.counters.add("staging_asks")
        waiting.add(ident)
        self.pump(out)

    def land(self, r: TxRequest, layer: int) -> None:
        """Every share of ``layer`` is flushed: its block goes back (``pump`` hands it on)."""
        off = r.grant.blocks.pop(layer, None)
        if off is not None:
            self.layers.free(off)

    def release(self, r: TxRequest, now: int, told: bool = True) -> None:
        """The request ended. Committed: its staging goes back now (every layer landed; its engines wait in
        ``finish()``). Failed: an engine that has not heard may still read its grant table and write its
        blocks, so they are held until each engine has said it stopped, died, or ``lease_ms`` passed; unless
        no engine was ever ``told`` where they are (it failed before its BeginOk): they go back now."""
        blocks = [(self.layers, off) for off in r.grant.blocks.values()]
        if r.grant.meta_off is not None:
            blocks.append((self.meta, r.grant.meta_off))
        r.grant.blocks.clear()
        r.grant.meta_off = None
        if r.state is TxState.DONE or not told:
            for alloc, off in blocks:
                alloc.free(off)
            return
        if not blocks:
            return
        until = now + self.lease_ms
        for i, k in enumerate(r.ranks.values()):  # the first engine holds the blocks, the others empty holds
            mine = blocks if i == 0 else []
            held = self._held.get((r.req_id, k.client))
            if held is not None:  # an earlier failed request of that id and engine, not acknowledged yet
                held.blocks.extend(mine)
                held.until_ms = max(held.until_ms, until)
                held.handle = r.seq
            else:
                self._held[(r.req_id, k.client)] = _Held(until, mine, r.seq)

    # ---- failed requests' engines ----
    def held(self, req_id: str | None, ident: bytes) -> bool:
        return (req_id, ident) in self._held

    def held_by_handle(self, handle: int, ident: bytes) -> str | None:
        """The failed request whose staging ``ident`` may still write, named by its handle (a finish record
        names no req_id); None if there is none."""
        return next((rid for (rid, who), h in self._held.items() if who == ident and h.handle == handle), None)

    def stopped(self, req_id: str, ident: bytes, out: list) -> None:
        """Engine ``ident`` has stopped writing failed request ``req_id``'s staging."""
        key = (req_id, ident)
        if key in self._held:
            self._unhold(key)
            self.pump(out)

    def on_tick(self, now: int, out: list) -> None:
        late = [k for k, h in self._held.items() if now >= h.until_ms]
        for k in late:
            self._unhold(k)
        if late:
            self.pump(out)

    def on_client_gone(self, ident: bytes, out: list) -> None:
        """Engine connection ``ident`` is gone (its lifeline closed): it writes no staging any more."""
        gone = [k for k in self._held if k[1] == ident]
        for k in gone:
            self._unhold(k)
        if gone:
            self.pump(out)

    # ---- grants ----
    @property
    def waiting(self) -> bool:
        """Engines wait for blocks (``pump`` grants them as landings give blocks back)."""
        return bool(self._queue)

    def pump(self, out: list) -> None:
        """Grant the blocks engines wait for, in the order they asked, while they fit."""
        q = self._queue
        while q:
            r, layer, nbytes = q[0]
            if r.state is not TxState.STREAMING:  # it ended meanwhile
                q.popleft()
                continue
            try:
                off = self.layers.alloc(nbytes)
            except PoolExhausted:
                if not self._head_waited:
                    self._head_waited = True
                    self.counters.add("staging_waits")
                return
            q.popleft()
            self._head_waited = False
            self._give(r, [(layer, off)], out)
            granted = StagingGranted(req_id=r.req_id, unit=layer)
            out.extend(ToClient(c, granted) for c in r.grant.asked.pop(layer, ()))

    def _give(self, r: TxRequest, given: list[tuple[int, int]], out: list) -> None:
        """``given`` (layer, block offset) are the request's: one action for the native path and the grant table."""
        if given:
            r.grant.blocks.update(given)
            out.append(PlanGrants(r.seq, self.info.address + r.grant.meta_off, tuple(given)))

    def _unhold(self, key: tuple[str, bytes]) -> None:
        h = self._held.pop(key)
        other = next((k for k in self._held if k[0] == key[0]), None)
        if other is not None:  # another engine of the request may still write: it keeps the blocks
            self._held[other].blocks.extend(h.blocks)
            return
        for alloc, off in h.blocks:
            alloc.free(off)

    def stats(self) -> dict:
        return {"staging_bytes_free": self.layers.free_bytes, "staging_grants_waiting": len(self._queue),
                # failed requests' blocks and grant tables, until their engines say they stopped
                "staging_held_bytes": sum(a.used[off] for h in self._held.values() for a, off in h.blocks)}
