"""Byte-range allocators for the sender's shared staging region (pure logic).

The region is split in two (``split``): a small area of per-request metadata (each request's grant table
and readiness words, held for its whole life) and the layer area, where each layer of a request in
flight gets its block when the sender grants it and gives it back once its flush completes.

``StagingAllocator`` is next fit over a sorted, coalescing free list: it carries on from where its last
allocation ended and wraps around. Layer blocks live roughly first-in first-out, so it behaves as a
ring there, and a block held longer (a slow receiver's) is stepped over rather than blocking the space
freed behind it. Imports nothing heavy.
"""

from __future__ import annotations

import bisect

from pdpush.errors import PoolExhausted, RequestTooLarge

ALIGN = 4096
MIN_BYTES = 1 << 20  # the least staging a sender takes (config.SenderConfig.staging_bytes)


def split(nbytes: int) -> tuple[int, int]:
    """(metadata bytes, layer bytes) of a staging region of ``nbytes``: 1/32 of it for metadata, between
    64 KiB and 16 MiB (a request's metadata is 8 bytes per layer and per new chunk), the rest for layers."""
    meta = min(max(64 << 10, nbytes // 32), 16 << 20, nbytes // 4) // ALIGN * ALIGN
    return meta, nbytes - meta


def ahead_bytes(layer_bytes: int, layers: int) -> int:
    """The smallest staging region (``staging_bytes``, at least ``MIN_BYTES``) whose sender grants every block of
    a request of ``layers`` x ``layer_bytes`` at its allocation, when it is the only request in flight (ahead
    grants keep to half of the layer area, counting every block granted and not yet landed, and none are made
    while an engine waits; blocks are rounded to ``ALIGN``), so that none of its layers waits for a
    ``NeedStaging`` round trip. Twice the request is not enough: ``split``'s metadata area comes out first."""
    need = 2 * layers * (-(-layer_bytes // ALIGN) * ALIGN)
    n = need
    while split(n)[1] < need:
        n = need + split(n)[0]  # the metadata grows with the region: a few rounds at most
    return max(n, MIN_BYTES)


class StagingAllocator:
    """Blocks of ``[base, base + size)``, ``align``-aligned; offsets are from the region's start."""

    def __init__(self, size: int, base: int = 0, what: str = "staging", align: int = ALIGN) -> None:
        self.size, self.base, self.what, self.align = size, base, what, align
        self._free: list[tuple[int, int]] = [(base, size)]  # sorted (offset, length)
        self.used: dict[int, int] = {}
        self._rover = base  # where the next search starts

    def rounded(self, nbytes: int) -> int:
        return max(self.align, -(-nbytes // self.align) * self.align)

    def fits(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` could ever be allocated here (the area is big enough)."""
        return self.rounded(nbytes) <= self.size

    def alloc(self, nbytes: int) -> int:
        n = self.rounded(nbytes)
        if n > self.size:
            raise RequestTooLarge(f"a block of {nbytes} bytes does not fit {self.what} ({self.size} bytes)")
        k = len(self._free)
        first = max(0, bisect.bisect_right(self._free, (self._rover, self.base + self.size + 1)) - 1)
        for j in range(k + 1 if k else 0):  # the rover's range from the rover, the others, then it from its start
            i = (first + j) % k
            off, ln = self._free[i]
            at = max(off, self._rover) if j == 0 else off
            if at + n <= off + ln:
                self._take(i, at, n)
                return at
        raise PoolExhausted(f"{self.what} full: need {n} bytes, {self.free_bytes} free in fragments",
                            retry_after_ms=20)

    def alloc_run(self, sizes: list[int]) -> list[int]:
        """Blocks for the longest prefix of ``sizes`` that fits, each its own (``free`` gives one back): back to
        back where the free range at the rover holds them all (a request's layers granted at once: one search
        instead of one per layer), else one by one, as ``alloc`` would, up to the first that does not fit."""
        if not sizes:
            return []  # (an empty run must not split the free range at the rover)
        ns = [self.rounded(nb) for nb in sizes]
        total = sum(ns)
        k = len(self._free)
        if k:
            i = max(0, bisect.bisect_right(self._free, (self._rover, self.base + self.size + 1)) - 1)
            off, ln = self._free[i]
            at = max(off, self._rover)
            if at + total <= off + ln:
                self._take(i, at, total)
                del self.used[at]
                out = []
                for n in ns:
                    self.used[at] = n
                    out.append(at)
                    at += n
                return out
        out = []
        for nb in sizes:
            try:
                out.append(self.alloc(nb))
            except PoolExhausted:
                break
        return out

    def _take(self, i: int, at: int, n: int) -> None:
        off, ln = self._free[i]
        pieces = [(off, at - off)] if at > off else []
        if off + ln > at + n:
            pieces.append((at + n, off + ln - at - n))
        self._free[i:i + 1] = pieces
        self.used[at] = n
        self._rover = at + n if at + n < self.base + self.size else self.base

    def free(self, off: int) -> None:
        n = self.used.pop(off)
        i = bisect.bisect_left(self._free, (off, 0))
        self._free.insert(i, (off, n))
        # coalesce with the right, then the left neighbour
        if i + 1 < len(self._free) and off + n == self._free[i + 1][0]:
            self._free[i] = (off, n + self._free[i + 1][1])
            self._free.pop(i + 1)
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            po, pn = self._free[i - 1]
            self._free[i - 1] = (po, pn + self._free[i][1])
            self._free.pop(i)

    @property
    def free_bytes(self) -> int:
        return sum(n for _, n in self._free)
