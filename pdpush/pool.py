"""Page allocator, quarantine and the chunk index (pure logic): who owns each page.

Every page is in exactly one place at any time (``check()`` asserts it):
  free        -> can be handed out
  leased      -> allocated to an uncommitted request; a sender may be writing it
  indexed     -> a complete chunk in the index (prefix cache), refcounted, LRU
  private     -> committed, but its key was indexed meanwhile by another request;
                 owned by the request until it is dropped
  unfenced    -> reclaimed from an aborted or expired lease while its sender may still have writes to it
                 in flight: it stays out of use until ``settle`` (the sender says its writes settled, or
                 the endpoint carrying them is closed), then goes to quarantine
  quarantine  -> reclaimed from an expired or aborted lease; a one-sided write
                 cannot be revoked, so it waits out a grace period before reuse
  read-held   -> an aborted request's record, while a decode that opened it may still be reading its
                 pages (pushed ones, and the held chunks it pinned): nothing of it moves, its pins stay,
                 until its readers let go (``abort_held``), when it is aborted as above

The pool knows which pages a request holds, not where the request is in its
life: leases, deadlines, readers and TTLs belong to the receiver session, which
calls ``commit``/``abort``/``drop`` as they happen. Time comes in as ``now_ms``
arguments (no clock here); no I/O. Imports numpy only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pdpush.errors import (
    DuplicateRequest,
    PoolExhausted,
    RemoteProtocolError,
    RequestTooLarge,
    UnexpectedMessage,
    UnknownRequest,
)


@dataclass
class _Entry:
    page: int
    refs: int = 0


@dataclass
class PoolRequest:
    req_id: str
    keys: list[bytes]
    pages: list[int]            # one page per chunk, in chunk order
    new_idx: list[int]          # chunk indexes this request writes
    held_idx: list[int]         # chunk indexes already in the index at alloc time
    indexed: bool = False       # committed: its new pages went to the index (or stayed private)
    pinned: list[bytes] = field(default_factory=list)
    private: list[int] = field(default_factory=list)
    owner: str = ""  # whom its pages count against while they wait after an abort (``held_by``): its sender

    @property
    def new_pages(self) -> list[int]:
        return [self.pages[i] for i in self.new_idx]


class PagePool:
    def __init__(self, num_pages: int, *, quarantine_ms: int = 2000, retry_after_ms: int = 50,
                 indexed: bool = True) -> None:
        """``indexed`` False: pages one request owns (the receiver's state slots), never shared through the
        index: a committed request's new pages stay private to it until it is dropped."""
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        self.indexed = indexed
        self.quarantine_ms = quarantine_ms
        self.retry_after_ms = retry_after_ms
        self._free = np.ones(num_pages, dtype=bool)
        self._nfree = num_pages
        self._quarantine: list[tuple[int, list[int], str]] = []  # (release_at_ms, pages, owner)
        self._unfenced: dict[str, tuple[str, list[int]]] = {}  # req_id -> (owner, pages a late write may still reach)
        self._read_held: dict[int, PoolRequest] = {}  # hold -> an aborted request's record its readers keep (``hold``)
        self._holds = 0
        self._held_reqs: dict[str, int] = {}  # owner -> its requests with unfenced pages (``held_by``)
        self._held_pages: dict[str, int] = {}  # owner -> its pages unfenced or in quarantine
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        self.requests: dict[str, PoolRequest] = {}
        self.counters = {"chunks_evicted": 0, "chunks_hit": 0, "exhausted": 0}
        self.changes: list[tuple[str, list[bytes]]] = []  # index changes not yet taken: ("stored"|"evicted", keys)

    # ---- queries ----
    @property
    def free_pages(self) -> int:
        return self._nfree

    @property
    def quarantined_pages(self) -> int:
        return sum(len(p) for _, p, _ in self._quarantine)

    @property
    def unfenced_pages(self) -> int:
        return sum(len(p) for _, p in self._unfenced.values())

    @property
    def chunks_cached(self) -> int:
        return len(self._index)

    def held_prefix(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self._index:
                break
            n += 1
        return n

    @property
    def read_holds(self) -> list[int]:
        return list(self._read_held)

    @property
    def read_held_pages(self) -> int:
        return sum(len(r.new_idx) for r in self._read_held.values())

    def held_by(self, owner: str) -> tuple[int, int]:
        """What ``owner``'s aborted requests keep out of use: (requests whose late writes may still land, or whose
        readers keep them; pages unfenced, read-held or in quarantine). An owner that aborts request after request
        holds them as it held its leases."""
        return self._held_reqs.get(owner, 0), self._held_pages.get(owner, 0)

    @staticmethod
    def _count(d: dict[str, int], owner: str, n: int) -> None:
        if v := d.get(owner, 0) + n:
            d[owner] = v
        else:
            d.pop(owner, None)

    def held(self, keys: list[bytes]) -> int:
        """How many of ``keys`` are held complete (an allocation would take no page for them)."""
        return sum(k in self._index for k in keys)

    # ---- allocation ----
    def allocate(self, req_id: str, keys: list[bytes], owner: str = "") -> PoolRequest:
        """Pages for the chunks not held complete; held ones are pinned for this request (``owner``: its sender)."""
        if req_id in self.requests:
            raise DuplicateRequest(f"request {req_id!r} already exists")
        if len(set(keys)) != len(keys):
            raise RemoteProtocolError(f"request {req_id!r} repeats a chunk key")
        held = [i for i, k in enumerate(keys) if k in self._index]
        new = [i for i, k in enumerate(keys) if k not in self._index]
        if len(new) > self.num_pages:
            raise RequestTooLarge(f"request {req_id!r} needs {len(new)} pages; the pool has {self.num_pages}",
                                  req_id=req_id)
        if len(new) > self._nfree:
            self._evict(len(new) - self._nfree, protect={keys[i] for i in held})
        if len(new) > self._nfree:
            self.counters["exhausted"] += 1
            raise PoolExhausted(
                f"pool exhausted: request {req_id!r} needs {len(new)} pages, {self._nfree} free, "
                f"{self.quarantined_pages} quarantined, {self.unfenced_pages} waiting for their writers' fence, "
                f"{self.read_held_pages} for their readers",
                req_id=req_id, retry_after_ms=self.retry_after_ms)
        new_pages = self._take(len(new))
        pages = [0] * len(keys)
        for i, p in zip(new, new_pages, strict=False):
            pages[i] = p
        pinned = []
        for i in held:
            e = self._index[keys[i]]
            e.refs += 1
            self._index.move_to_end(keys[i])
            pages[i] = e.page
            pinned.append(keys[i])
        self.counters["chunks_hit"] += len(held)
        req = PoolRequest(req_id, list(keys), pages, new, held, pinned=pinned, owner=owner)
        self.requests[req_id] = req
        return req

    def _take(self, n: int) -> list[int]:
        """n free pages, as few runs as possible: first fit, else largest runs first."""
        if n == 0:
            return []
        idx = np.flatnonzero(self._free)
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [len(idx)]))
        lengths = ends - starts
        fit = np.flatnonzero(lengths >= n)
        if len(fit):
            s = idx[starts[fit[0]]]
            chosen = list(range(int(s), int(s) + n))
        else:
            chosen = []
            for r in np.argsort(-lengths, kind="stable"):
                take = min(int(lengths[r]), n - len(chosen))
                s = int(idx[starts[r]])
                chosen.extend(range(s, s + take))
                if len(chosen) == n:
                    break
        self._free[chosen] = False
        self._nfree -= n
        return chosen

    def _give(self, pages: list[int]) -> None:
        if pages:
            assert not self._free[pages].any(), "double free"
            self._free[pages] = True
            self._nfree += len(pages)

    def _evict(self, need: int, protect: set[bytes]) -> None:
        """Free ``need`` pages by evicting unpinned chunks, oldest first; or, where that many cannot go, none
        (a request that would still not fit must not empty the prefix cache on its way to being refused)."""
        victims = []
        for k, e in self._index.items():
            if len(victims) >= need:
                break
            if e.refs == 0 and k not in protect:
                victims.append(k)
        if len(victims) < need:
            return
        for k in victims:
            self._give([self._index.pop(k).page])
        self.counters["chunks_evicted"] += len(victims)
        if victims:
            self.changes.append(("evicted", victims))

    # ---- ownership changes, called by the session as the request's life goes on ----
    def commit(self, req_id: str) -> int:
        """The leased pages hold complete chunks: index them. Returns how many were indexed."""
        req = self._get(req_id)
        if req.indexed:
            raise UnexpectedMessage(f"request {req_id!r} is already committed")
        stored = []
        for i in req.new_idx:
            k = req.keys[i]
            if k in self._index or not self.indexed:  # another request committed the same chunk meanwhile
                req.private.append(req.pages[i])  # this request keeps reading its own copy
                continue
            self._index[k] = _Entry(req.pages[i], refs=1)
            req.pinned.append(k)
            stored.append(k)
        req.indexed = True
        if stored:
            self.changes.append(("stored", stored))
        return len(stored)

    def take_changes(self) -> list[tuple[str, list[bytes]]]:
        out, self.changes = self.changes, []
        return out

    def indexed_keys(self) -> list[bytes]:
        return list(self._index)

    def abort(self, req_id: str, now_ms: int, published: bool = True, fenced: bool = True) -> None:
        """Reclaim an uncommitted lease: its pages go to quarantine (``published`` False: its pages were never
        told to anyone, so nothing can write them late; they are free at once. ``fenced`` False: writes to
        them may still be in flight; they wait, unfenced, for ``settle``)."""
        req = self._get(req_id)
        if req.indexed:
            raise UnexpectedMessage(f"request {req_id!r} is committed; cannot abort")
        self._abort(req, now_ms, published, fenced)
        del self.requests[req_id]

    def hold(self, req_id: str) -> int:
        """Abort uncommitted ``req_id`` while a decode that opened it may still read its pages: its record leaves
        (a retry of the id can allocate) but keeps its pages and its pins, out of use, until ``abort_held``. Returns
        the hold."""
        req = self._get(req_id)
        if req.indexed:
            raise UnexpectedMessage(f"request {req_id!r} is committed; cannot abort")
        self._holds += 1
        self._read_held[self._holds] = req
        del self.requests[req_id]
        self._count(self._held_reqs, req.owner, 1)
        self._count(self._held_pages, req.owner, len(req.new_idx))
        return self._holds

    def abort_held(self, hold: int, now_ms: int, fenced: bool = True) -> None:
        """The readers of held request ``hold`` let go: it is aborted as ``abort`` does (its pages published)."""
        req = self._read_held.pop(hold)
        self._count(self._held_reqs, req.owner, -1)
        self._count(self._held_pages, req.owner, -len(req.new_idx))
        self._abort(req, now_ms, True, fenced)

    def _abort(self, req: PoolRequest, now_ms: int, published: bool, fenced: bool) -> None:
        req_id = req.req_id
        if published and not fenced:
            if req_id not in self._unfenced:
                self._unfenced[req_id] = (req.owner, [])
                self._count(self._held_reqs, req.owner, 1)
            self._unfenced[req_id][1].extend(req.new_pages)
            self._count(self._held_pages, req.owner, len(req.new_idx))
        elif published:
            self._quarantine.append((now_ms + self.quarantine_ms, req.new_pages, req.owner))
            self._count(self._held_pages, req.owner, len(req.new_idx))
        else:
            self._give(req.new_pages)
        self._unpin(req)

    def settle(self, req_id: str, now_ms: int) -> None:
        """No write to aborted ``req_id``'s pages can land any more: they go to quarantine."""
        if req_id not in self._unfenced:
            return
        owner, pages = self._unfenced.pop(req_id)
        self._count(self._held_reqs, owner, -1)
        if pages:
            self._quarantine.append((now_ms + self.quarantine_ms, pages, owner))

    def drop(self, req_id: str) -> None:
        """A committed request nobody reads any more: unpin its chunks, free its private pages."""
        req = self._get(req_id)
        if not req.indexed:
            raise UnexpectedMessage(f"request {req_id!r} is not committed; abort it instead")
        self._unpin(req)
        self._give(req.private)
        del self.requests[req_id]

    def _unpin(self, req: PoolRequest) -> None:
        for k in req.pinned:
            e = self._index.get(k)
            if e is not None:
                e.refs -= 1
        req.pinned = []

    def tick(self, now_ms: int) -> None:
        """Release quarantined pages whose grace period is over."""
        if self._quarantine:
            keep = []
            for at, pages, owner in self._quarantine:
                if now_ms >= at:
                    self._give(pages)
                    self._count(self._held_pages, owner, -len(pages))
                else:
                    keep.append((at, pages, owner))
            self._quarantine = keep

    def get(self, req_id: str) -> PoolRequest:
        return self._get(req_id)

    def _get(self, req_id: str) -> PoolRequest:
        req = self.requests.get(req_id)
        if req is None:
            raise UnknownRequest(f"unknown request {req_id!r}")
        return req

    def check(self) -> None:
        """Assert the accounting invariant: every page in exactly one place."""
        owner = np.zeros(self.num_pages, dtype=np.int32)
        owner[self._free] += 1
        for _, pages, _ in self._quarantine:
            owner[pages] += 1
        for _, pages in self._unfenced.values():
            owner[pages] += 1
        for e in self._index.values():
            owner[e.page] += 1
        for r in [*self.requests.values(), *self._read_held.values()]:
            if not r.indexed:
                owner[r.new_pages] += 1
            else:
                owner[r.private] += 1
        reqs: dict[str, int] = {}
        pages_of: dict[str, int] = {}
        for o, p in self._unfenced.values():
            self._count(reqs, o, 1)
            self._count(pages_of, o, len(p))
        for _, p, o in self._quarantine:
            self._count(pages_of, o, len(p))
        for r in self._read_held.values():
            self._count(reqs, r.owner, 1)
            self._count(pages_of, r.owner, len(r.new_idx))
        assert (reqs, pages_of) == (self._held_reqs, self._held_pages), "held_by's counts drift"
        bad = np.flatnonzero(owner != 1)
        assert len(bad) == 0, f"pages not in exactly one place: {bad[:10].tolist()} counts {owner[bad[:10]].tolist()}"
        assert self._nfree == int(self._free.sum())
        for k, e in self._index.items():
            expect = sum(r.pinned.count(k) for r in [*self.requests.values(), *self._read_held.values()])
            assert e.refs == expect, f"refcount drift on a chunk: {e.refs} != {expect}"
