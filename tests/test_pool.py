"""Page allocator, quarantine, chunk index: pure logic, with a property test.

Leases, readers and TTLs are the receiver session's (tests/test_sessions.py)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pdpush.errors import PoolExhausted, RemoteProtocolError, RequestTooLarge, UnexpectedMessage
from pdpush.layout import runs
from pdpush.pool import PagePool


def keys(prefix: int, n: int) -> list[bytes]:
    return [bytes([prefix, i]) * 8 for i in range(n)]


def test_allocate_commit_reuse_drop():
    p = PagePool(8, quarantine_ms=100)
    a = p.allocate("a", keys(1, 3))
    assert a.held_idx == [] and a.new_pages == [0, 1, 2]
    assert p.commit("a") == 3
    b = p.allocate("b", keys(1, 2) + keys(2, 2))
    assert b.held_idx == [0, 1]
    assert len(b.new_pages) == 2
    assert p.get("b").pages[:2] == [0, 1]
    p.drop("a")
    p.check()


def test_contiguous_first_fit_and_runs():
    p = PagePool(10)
    p.allocate("a", keys(1, 3))
    p.allocate("b", keys(2, 3))
    p.abort("a", 0)
    p.tick(10_000)  # quarantine over
    c = p.allocate("c", keys(3, 4))
    assert c.new_pages == [6, 7, 8, 9]  # first run long enough
    d = p.allocate("d", keys(4, 3))
    assert runs(d.new_pages) == [(0, 0, 3)]
    p.check()


def test_exhausted_is_immediate_and_typed_then_lru_eviction():
    p = PagePool(4, retry_after_ms=25)
    p.allocate("a", keys(1, 4))
    with pytest.raises(PoolExhausted) as e:
        p.allocate("b", keys(2, 1))
    assert e.value.retry_after_ms == 25 and e.value.req_id == "b"
    p.commit("a")
    with pytest.raises(PoolExhausted):  # committed and still held by its request: pinned, not evictable
        p.allocate("b", keys(2, 1))
    p.drop("a")
    b = p.allocate("b", keys(2, 2))  # evicts the 2 least recently used chunks
    assert sorted(b.new_pages) == [0, 1]
    assert p.counters["chunks_evicted"] == 2
    with pytest.raises(RequestTooLarge):
        p.allocate("huge", keys(3, 5))
    p.check()


def test_aborted_lease_goes_through_quarantine():
    p = PagePool(4, quarantine_ms=500)
    p.allocate("a", keys(1, 2))
    p.abort("a", 100)
    assert p.free_pages == 2 and p.quarantined_pages == 2
    with pytest.raises(PoolExhausted):
        p.allocate("b", keys(2, 3))
    p.tick(599)
    assert p.quarantined_pages == 2
    p.tick(600)
    assert p.free_pages == 4 and p.quarantined_pages == 0
    p.check()


def test_a_read_held_abort_keeps_its_pages_and_pins_until_its_readers_let_go():
    p = PagePool(4, quarantine_ms=500)
    p.allocate("base", keys(1, 2))
    p.commit("base")
    p.drop("base")  # two chunks indexed, unpinned
    p.allocate("a", keys(1, 3), owner="s")  # holds them, one new page
    hold = p.hold("a")
    assert "a" not in p.requests and p.read_held_pages == 1 and p.held_by("s") == (1, 1)
    with pytest.raises(PoolExhausted):  # the pinned chunks cannot be evicted for it
        p.allocate("b", keys(2, 3))
    p.allocate("a", keys(3, 1))  # a retry of the id is another record
    p.check()
    p.abort("a", 0, published=False)
    p.abort_held(hold, 100, fenced=True)
    assert p.read_held_pages == 0 and p.quarantined_pages == 1 and p.held_by("s") == (0, 1)
    p.allocate("b", keys(2, 2))  # evicts the unpinned chunks now
    p.check()


def test_duplicate_unknown_and_wrong_order_are_typed():
    p = PagePool(4)
    p.allocate("a", keys(1, 1))
    with pytest.raises(RemoteProtocolError):
        p.allocate("a", keys(1, 1))
    with pytest.raises(RemoteProtocolError):
        p.commit("zzz")
    with pytest.raises(RemoteProtocolError):
        p.allocate("b", [b"x" * 16, b"x" * 16])
    with pytest.raises(UnexpectedMessage):
        p.drop("a")  # not committed: abort it instead
    p.commit("a")
    with pytest.raises(UnexpectedMessage):
        p.abort("a", 0)


def test_same_chunk_committed_twice_stays_private():
    p = PagePool(6)
    p.allocate("a", keys(1, 2))
    p.allocate("b", keys(1, 2))  # both in flight: neither is indexed yet
    p.commit("a")
    assert p.commit("b") == 0
    p.drop("b")
    p.check()
    assert p.free_pages == 4


class PoolMachine(RuleBasedStateMachine):
    """Random operations in random order never break the accounting."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(16, quarantine_ms=50)
        self.now = 0
        self.n = 0
        self.holds: list[int] = []

    @rule(prefix=st.integers(0, 3), n=st.integers(1, 6))
    def allocate(self, prefix, n):
        self.n += 1
        try:
            self.pool.allocate(f"r{self.n}", keys(prefix, n))
        except (PoolExhausted, RequestTooLarge, RemoteProtocolError):
            pass

    @rule(data=st.data())
    def act(self, data):
        if not self.pool.requests:
            return
        rid = data.draw(st.sampled_from(sorted(self.pool.requests)))
        op = data.draw(st.sampled_from(["commit", "abort", "drop", "hold"]))
        try:
            if op == "abort":
                self.pool.abort(rid, self.now)
            elif op == "hold":
                self.holds.append(self.pool.hold(rid))
            else:
                getattr(self.pool, op)(rid)
        except RemoteProtocolError:
            pass

    @rule(data=st.data())
    def let_go(self, data):
        if self.holds:
            hold = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
            self.pool.abort_held(hold, self.now, fenced=data.draw(st.booleans()))

    @rule(dt=st.integers(0, 400))
    def tick(self, dt):
        self.now += dt
        self.pool.tick(self.now)

    @invariant()
    def whole(self):
        self.pool.check()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_request_that_would_not_fit_evicts_nothing():
    """Eviction frees room only for a request it lets in: one that would still not fit is refused with the prefix
    cache untouched (before, it emptied the cache on its way to the refusal, and each retry did it again)."""
    p = PagePool(8)
    for i in range(6):
        p.allocate(f"c{i}", keys(10 + i, 1))
        p.commit(f"c{i}")
        p.drop(f"c{i}")
    p.allocate("held", keys(20, 2))
    assert p.chunks_cached == 6 and p.free_pages == 0
    p.take_changes()
    with pytest.raises(PoolExhausted):
        p.allocate("big", keys(30, 7))  # 6 evictable + 0 free < 7
    assert p.chunks_cached == 6 and p.counters["chunks_evicted"] == 0 and not p.take_changes()  # no "evicted"
    assert sorted(p.allocate("fits", keys(40, 6)).new_pages) == list(range(6))  # all 6 evicted for one that fits
    assert p.counters["chunks_evicted"] == 6
    p.check()
