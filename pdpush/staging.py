"""Byte-range allocator for the sender's shared staging region (pure logic).

First fit over a sorted free list, coalescing on free. Imports nothing heavy.
"""

from __future__ import annotations

import bisect

from pdpush.errors import PoolExhausted, RequestTooLarge

ALIGN = 4096


class StagingAllocator:
    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted (offset, length)
        self.used: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int:
        n = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if n > self.size:
            raise RequestTooLarge(f"request needs {nbytes} staging bytes; staging_bytes is {self.size}")
        for i, (off, ln) in enumerate(self._free):
            if ln >= n:
                if ln == n:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + n, ln - n)
                self.used[off] = n
                return off
        raise PoolExhausted(f"staging full: need {n} bytes, {self.free_bytes} free in fragments", retry_after_ms=20)

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
