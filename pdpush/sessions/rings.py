"""HandoverRings: which engine connection has which hand-over ring in staging (pure logic).

pdpush/ring.py has the ring's format. A connection that asks for one (``Begin.handover_ring``) gets
its ring with its first ``BeginOk``, from the staging metadata area, and keeps it until it says
``Bye`` or its process dies: an engine may write its ring whenever it holds one, so a ring is never
reused before then. Rings take at most half of the metadata area, so that grant tables always have
the other half; a connection that gets none (that half is full, or rings are off) hands layers over
by message, as before.

The session calls it; it appends ``FillWords`` (a fresh ring cleared), ``OpenRing`` and ``CloseRing``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdpush.errors import PoolExhausted, RequestTooLarge
from pdpush.sessions import Counters
from pdpush.sessions.tx_actions import CloseRing, FillWords, OpenRing
from pdpush.staging import StagingAllocator


@dataclass
class _Ring:
    offset: int


class HandoverRings:
    def __init__(self, meta: StagingAllocator, address: int, slots: int, counters: Counters) -> None:
        self.meta, self.address, self.slots, self.counters = meta, address, slots, counters
        self.idle_offset = meta.alloc(64) if slots else 0  # the sender's idle word, one for every ring
        self._rings: dict[bytes, _Ring] = {}
        self._reserve = meta.size // 2  # rings' share of the metadata area: grant tables keep the rest

    def open(self, ident: bytes, lifeline: bool, out: list) -> tuple[int, int]:
        """The connection's ring as (offset in staging, slots); (0, 0) when it has none."""
        ring = self._rings.get(ident)
        if ring is None:
            if not self.slots or not lifeline:  # without a lifeline, a dead engine's ring would never come back
                return 0, 0
            need = self.meta.rounded(self.slots * 8)
            try:
                if self.meta_bytes + need > self._reserve:
                    raise PoolExhausted("the rings' half of the staging metadata is full")
                ring = _Ring(self.meta.alloc(need))
            except (PoolExhausted, RequestTooLarge):
                self.counters.add("rings_refused")
                return 0, 0
            self._rings[ident] = ring
            out.append(FillWords(self.address + ring.offset, 0, self.slots))
            out.append(OpenRing(ident, self.address + ring.offset, self.slots))
        return ring.offset, self.slots

    def of(self, ident: bytes) -> tuple[int, int]:
        ring = self._rings.get(ident)
        return (ring.offset, self.slots) if ring is not None else (0, 0)

    def close(self, ident: bytes, out: list) -> None:
        """The connection will not write its ring again (``Bye``, or its process died)."""
        ring = self._rings.pop(ident, None)
        if ring is not None:
            out.append(CloseRing(ident))
            self.meta.free(ring.offset)


    @property
    def meta_bytes(self) -> int:
        """Staging metadata the rings and the idle word hold."""
        return sum(self.meta.used.get(o, 0) for o in [*(r.offset for r in self._rings.values()), self.idle_offset]
                   if self.slots)

    def stats(self) -> dict:
        return {"handover_rings": len(self._rings)}
