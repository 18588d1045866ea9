"""A pure-Python model of the sender's native per-layer path (``pdpush_native.Pusher``,
native/src/pusher.cpp) for the sans-I/O session tests: it takes the session's put plans, checks each
hand-over the way the native path does (the refusals of ``put_plan``), and turns each into a posted
batch the test completes. The real path is covered by the daemons' tests and test_pusher.py; this only
lets the session tests drive the session's side of the contract without UCX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdpush.sessions import put_plan
from pdpush.sessions.tx_actions import Hand, PlanGrants, PlanRank, PlanRequest, Unplan
from pdpush.transport.base import PutOp


@dataclass
class Posted:
    """One hand-over's puts (kind "data"), or one landed layer's readiness words (kind "ready")."""

    endpoint: str
    ops: list[PutOp]
    token: tuple[int, tuple[int, ...], str, bytes]  # (handle, layers, kind, engine connection)
    deadline_ms: int


@dataclass
class _Req:
    plan: PlanRequest
    left: list[int]
    blocks: dict[int, int] = field(default_factory=dict)
    ranks: dict[bytes, tuple[PlanRank, set[int]]] = field(default_factory=dict)


class FakePusher:
    def __init__(self, staging: int, timeout_ms: int) -> None:
        self.staging, self.timeout_ms = staging, timeout_ms
        self.reqs: dict[int, _Req] = {}
        self.posted: list[Posted] = []
        self.landed: list[tuple[int, int]] = []
        self.words: list[int] = []  # a handle per layer whose readiness words' flush completed (take_words)
        self.words_in: set[tuple[int, int]] = set()  # (handle, layer): the words in the pool, as a receiver reads them
        self.dead: set[str] = set()

    def apply(self, a, now: int) -> list | None:
        """Carry out a plan action; for ``Hand``, its refusals as ``on_refused`` takes them. None: not one."""
        if isinstance(a, PlanRequest):
            self.reqs[a.handle] = _Req(a, [a.tp] * len(a.layers))
        elif isinstance(a, PlanRank):
            self.reqs[a.handle].ranks[a.ident] = (a, set())
        elif isinstance(a, PlanGrants):
            self.reqs[a.handle].blocks.update(a.grants)
        elif isinstance(a, Unplan):
            self.reqs.pop(a.handle, None)
        elif isinstance(a, Hand):
            return self.hand_all(a.ident, [(a.handle, la, 1) for la in a.layers], now)
        else:
            return None
        return []

    def hand_all(self, ident: bytes, records: list[tuple[int, int, int]], now: int) -> list:
        return [(h, f, n, why) for h, f, n in records if (why := self.hand(ident, h, f, n, now))]

    def hand(self, ident: bytes, handle: int, first: int, n: int, now: int) -> int:
        r = self.reqs.get(handle)
        if r is None or r.plan.endpoint in self.dead:
            return put_plan.UNKNOWN
        if ident not in r.ranks:
            return put_plan.NOT_YOURS
        rank, posted = r.ranks[ident]
        layers = range(first, first + n)
        if not n or first < rank.first or first + n > rank.end:
            return put_plan.RANGE
        if any(la in posted for la in layers):
            return put_plan.DUPLICATE
        if any(r.plan.layers[la][3] and la not in r.blocks for la in layers):
            return put_plan.UNGRANTED
        posted.update(layers)
        ops, moving = [], []
        for la in layers:
            group, dst, _, nbytes = r.plan.layers[la]
            if not nbytes:  # nothing new: the share is in as it is handed over
                self.landed += self._share(r, handle, la, r.plan.endpoint, ident, now)
                continue
            moving.append(la)
            src = self.staging + r.blocks[la]
            ops += [PutOp(src + s, dst + d, b) for s, d, b in rank.ranges[group]]
        if moving:
            self.posted.append(Posted(r.plan.endpoint, ops, (handle, tuple(moving), "data", ident),
                                      now + self.timeout_ms))
        return 0

    def land(self, p: Posted, now: int) -> list[tuple[int, int]]:
        """``p``'s flush completed: the layers it completes (every share in), their readiness words posted."""
        r = self.reqs.get(p.token[0])
        if r is None:
            return []
        if p.token[2] == "ready":
            self.words.append(p.token[0])
            self.words_in.add((p.token[0], p.token[1][0]))
            return []
        return [x for la in p.token[1] for x in self._share(r, p.token[0], la, p.endpoint, p.token[3], now)]

    def settled(self, handle: int, endpoint: str) -> bool:
        """None of ``handle``'s writes to ``endpoint`` is in flight (a dead endpoint vouches for nothing)."""
        return endpoint not in self.dead and not any(p.token[0] == handle and p.endpoint == endpoint
                                                     for p in self.posted)

    def take_landed(self) -> list[tuple[int, int]]:
        """Layers that landed as they were handed over (nothing new to move), as the native poll reports them."""
        out, self.landed = self.landed, []
        return out

    def take_words(self) -> list[int]:
        """Handles whose one layer's readiness words completed, one per layer (``Pusher.take_words``)."""
        out, self.words = self.words, []
        return out

    def _share(self, r: _Req, handle: int, la: int, endpoint: str, ident: bytes, now: int) -> list[tuple[int, int]]:
        r.left[la] -= 1
        if r.left[la]:
            return []
        group, _, ready, _ = r.plan.layers[la]
        ops = [PutOp(s, ready + d, b) for s, d, b in r.plan.ready[group]]
        if ops:
            self.posted.append(Posted(endpoint, ops, (handle, (la,), "ready", ident), now + self.timeout_ms))
        return [(handle, la)]
