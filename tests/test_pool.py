"""Page allocator, leases, quarantine, chunk index: pure logic, with a property test."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pdpush.errors import PoolExhausted, RemoteProtocolError, RequestTooLarge
from pdpush.layout import runs
from pdpush.pool import PagePool


def keys(prefix: int, n: int) -> list[bytes]:
    return [bytes([prefix, i]) * 8 for i in range(n)]


def test_allocate_commit_reuse_release():
    p = PagePool(8, quarantine_ms=100)
    a = p.allocate("a", keys(1, 3), now_ms=0, lease_ms=1000)
    assert a.already_sent_indexes == [] and a.new_pages == [0, 1, 2]
    assert p.commit("a", 1) == 3
    p.release("a")  # nobody opened it: a release with no opener is harmless
    b = p.allocate("b", keys(1, 2) + keys(2, 2), now_ms=2, lease_ms=1000)
    assert b.already_sent_indexes == [0, 1]
    assert len(b.new_pages) == 2
    assert p.requests["b"].pages[:2] == [0, 1]
    p.check()


def test_request_prefix_counts_matching_leading_keys_of_a_live_request():
    p = PagePool(8)
    p.allocate("a", keys(1, 3), now_ms=0, lease_ms=1000)
    assert p.request_prefix("a", keys(1, 3)) == 3           # leased: still arriving, but it carries them
    assert p.request_prefix("a", keys(1, 2) + keys(9, 4)) == 2  # a longer prompt diverging after chunk 1
    assert p.request_prefix("a", keys(9, 3)) == 0           # another prompt: nothing
    assert p.request_prefix("zz", keys(1, 3)) == 0 and p.request_prefix(None, keys(1, 3)) == 0
    p.commit("a", 1)
    assert p.request_prefix("a", keys(1, 1)) == 1
    p.open("a")
    p.release("a")  # committed and released: gone
    assert p.request_prefix("a", keys(1, 3)) == 0
    p.check()


def test_contiguous_first_fit_and_runs():
    p = PagePool(10)
    p.allocate("a", keys(1, 3), 0, 1000)
    p.allocate("b", keys(2, 3), 0, 1000)
    p.abort("a", 0)
    p.tick(10_000)  # quarantine over
    c = p.allocate("c", keys(3, 4), 10_000, 1000)
    assert c.new_pages == [6, 7, 8, 9]  # first run long enough
    d = p.allocate("d", keys(4, 3), 10_000, 1000)
    assert runs(d.new_pages) == [(0, 0, 3)]
    p.check()


def test_exhausted_is_immediate_and_typed_then_lru_eviction():
    p = PagePool(4, retry_after_ms=25)
    p.allocate("a", keys(1, 4), 0, 1000)
    with pytest.raises(PoolExhausted) as e:
        p.allocate("b", keys(2, 1), 0, 1000)
    assert e.value.retry_after_ms == 25
    p.commit("a", 0)
    p.open("a")
    with pytest.raises(PoolExhausted):  # committed but still open: pinned, not evictable
        p.allocate("b", keys(2, 1), 0, 1000)
    p.release("a")
    b = p.allocate("b", keys(2, 2), 0, 1000)  # evicts the 2 least recently used chunks
    assert sorted(b.new_pages) == [0, 1]
    assert p.counters["chunks_evicted"] == 2
    with pytest.raises(RequestTooLarge):
        p.allocate("huge", keys(3, 5), 0, 1000)
    p.check()


def test_expired_lease_goes_through_quarantine():
    p = PagePool(4, quarantine_ms=500)
    p.allocate("a", keys(1, 2), now_ms=0, lease_ms=100)
    assert p.tick(99) == []
    assert p.tick(100) == ["a"]
    assert p.free_pages == 2 and p.quarantined_pages == 2
    with pytest.raises(PoolExhausted):
        p.allocate("b", keys(2, 3), 200, 1000)
    p.tick(600)
    assert p.free_pages == 4 and p.quarantined_pages == 0
    assert p.counters["leases_expired"] == 1
    p.check()


def test_duplicate_and_unknown_requests_are_protocol_errors():
    p = PagePool(4)
    p.allocate("a", keys(1, 1), 0, 1000)
    with pytest.raises(RemoteProtocolError):
        p.allocate("a", keys(1, 1), 0, 1000)
    with pytest.raises(RemoteProtocolError):
        p.commit("zzz", 0)
    with pytest.raises(RemoteProtocolError):
        p.allocate("b", [b"x" * 16, b"x" * 16], 0, 1000)


def test_same_chunk_committed_twice_stays_private():
    p = PagePool(6)
    p.allocate("a", keys(1, 2), 0, 1000)
    p.allocate("b", keys(1, 2), 0, 1000)  # both in flight: neither is indexed yet
    p.commit("a", 0)
    assert p.commit("b", 0) == 0
    p.open("b")
    p.release("b")
    p.check()
    assert p.free_pages == 4


class PoolMachine(RuleBasedStateMachine):
    """Random operations in random order never break the accounting."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(16, quarantine_ms=50, committed_ttl_ms=500)
        self.now = 0
        self.n = 0

    @rule(prefix=st.integers(0, 3), n=st.integers(1, 6), lease=st.integers(1, 300))
    def allocate(self, prefix, n, lease):
        self.n += 1
        try:
            self.pool.allocate(f"r{self.n}", keys(prefix, n), self.now, lease)
        except (PoolExhausted, RequestTooLarge, RemoteProtocolError):
            pass

    @rule(data=st.data())
    def act(self, data):
        if not self.pool.requests:
            return
        rid = data.draw(st.sampled_from(sorted(self.pool.requests)))
        op = data.draw(st.sampled_from(["commit", "abort", "open", "release"]))
        try:
            getattr(self.pool, op)(rid, self.now) if op in ("commit", "abort") else getattr(self.pool, op)(rid)
        except RemoteProtocolError:
            pass

    @rule(dt=st.integers(0, 400))
    def tick(self, dt):
        self.now += dt
        self.pool.tick(self.now)

    @invariant()
    def whole(self):
        self.pool.check()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
