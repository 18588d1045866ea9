"""When a layer copied off the device may be handed to the sender (pure logic; clock-free).

An engine with a GPU cache copies each finished layer into pinned staging on a side stream and
records an event after the copy (integrations/device_copy.py). The layer may be handed over only
once that event has completed: before, staging does not yet hold its bytes. ``HandOverQueue``
decides which layers are handed over, in which order, and which waits have run out of time:

* Copies are handed over in the order they were submitted, and a layer never before the one
  submitted ahead of it. Copies on one stream complete in that order anyway; a fence that reports
  done early (another stream, a spurious query) cannot reorder hand-overs.
* Every copy has a deadline (``now`` + ``timeout`` at submit). ``overdue(now)`` names the requests
  whose oldest copy has passed it; the shell gives those requests up rather than wait forever.
* A request can be dropped (``drop``): its copies are never handed over, and its fences are
  returned so that the shell can keep their tensors alive until they complete.

Fences are anything with ``query() -> bool`` (``torch.cuda.Event`` is one). The queue never blocks
and never reads a clock; the shell passes ``now`` in whatever unit it likes, consistently.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol


class Fence(Protocol):
    def query(self) -> bool: ...


@dataclass
class Copy:
    """One layer's copy in flight: ``keep`` holds whatever must outlive it (source tensors)."""

    request: Hashable
    layer: int
    fence: Fence
    deadline: float
    keep: Any = None


@dataclass
class HandOverQueue:
    timeout: float
    _q: deque[Copy] = field(default_factory=deque)
    _dropped: set[Hashable] = field(default_factory=set)

    def submit(self, request: Hashable, layer: int, fence: Fence, now: float, keep: Any = None) -> None:
        if any(c.request == request and c.layer == layer for c in self._q):
            raise ValueError(f"layer {layer} of {request!r} is already being copied")
        self._dropped.discard(request)
        self._q.append(Copy(request, layer, fence, now + self.timeout, keep))

    def ready(self) -> list[Copy]:
        """The copies that may be handed over now, oldest first: the completed head of the queue.
        A dropped request's completed copies leave the queue without being returned."""
        out: list[Copy] = []
        while self._q and self._q[0].fence.query():
            c = self._q.popleft()
            if c.request not in self._dropped:
                out.append(c)
        if not any(c.request in self._dropped for c in self._q):
            self._dropped.clear()
        return out

    def head(self) -> Copy | None:
        """The copy a completion thread should wait for next."""
        return self._q[0] if self._q else None

    def pending(self, request: Hashable | None = None) -> int:
        """Copies not yet handed over (of ``request``, or all), dropped ones excluded."""
        return sum(1 for c in self._q if c.request not in self._dropped and (request is None or c.request == request))

    def overdue(self, now: float) -> list[Hashable]:
        """Requests with a copy past its deadline, each once, oldest first."""
        out: list[Hashable] = []
        for c in self._q:
            if c.deadline <= now and c.request not in self._dropped and c.request not in out:
                out.append(c.request)
        return out

    def running(self, request: Hashable) -> Fence | None:
        """A copy of ``request`` still writing staging (a fence not done), dropped ones included; None once none
        is: only then may the sender be told that this engine has stopped writing that request's staging."""
        return self.running_of(lambda r: r == request)

    def running_of(self, match: Callable[[Hashable], bool]) -> Fence | None:
        """``running`` for any request that ``match`` picks (those of one connection, say)."""
        return next((c.fence for c in self._q if match(c.request) and not c.fence.query()), None)

    def drop(self, request: Hashable) -> int:
        """Never hand over ``request``'s copies. They stay queued (their fences and ``keep`` with
        them) until they complete, so that nothing they read is freed under them. Returns how many."""
        n = self.pending(request)
        if n:
            self._dropped.add(request)
        return n

    def __len__(self) -> int:
        return len(self._q)
