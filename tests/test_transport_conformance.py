"""Conformance of the native data plane: the UCX transport's posted batches and polled completions
(pdpush/transport/base.py), and the sender's per-layer path built on them (native/src/pusher.cpp).

The peer is a real second process (``python -m pdpush_tools.peer``) serving a
region allocated as the receiver's pool is; bytes are read back through its
SysV segment. Stalls use UCX over tcp and a SIGSTOPped peer (shared memory needs
no peer progress, so nothing can stall it); every process is stopped by pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from pdpush.errors import TransferError, TransportTimeout
from pdpush.shm import Attached, array_at
from pdpush.transport.base import PutOp

REGION = 8 << 20
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


class Peer:
    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pdpush_tools.peer", str(REGION)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", **env})
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("peer did not start")
        self.info = json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def world(monkeypatch):
    """Factory for (worker, peers) with a given UCX_TLS; everything torn down by pid."""
    made: list = []
    peers: list[Peer] = []
    eps: list = []

    def make(env: dict[str, str] | None = None):
        from pdpush.transport.ucx import UcxWorker

        env = env or {}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        w = UcxWorker()
        src, _, _ = w.alloc_shared(REGION)
        made.append((w, src))
        return w, src

    def peer(w, env: dict[str, str] | None = None):
        p = Peer(env or {})
        peers.append(p)
        ep = w.connect("127.0.0.1", p.info["port"])
        ep.set_rkey(bytes.fromhex(p.info["rkey"]), 10.0)
        eps.append(ep)
        return p, ep

    try:
        yield make, peer
    finally:
        for ep in eps:
            ep.close()
        for p in peers:
            p.stop()
        for _w, src in made:
            src.close()


def _poll_until(w, tokens: set, timeout_s: float = 10.0) -> list:
    got = []
    deadline = time.monotonic() + timeout_s
    while tokens - {c.token for c in got}:
        assert time.monotonic() < deadline, f"completions missing: {tokens - {c.token for c in got}}"
        got += w.poll(time.monotonic())
    return got


@pytest.mark.parametrize("env", [{}, TCP], ids=["default", "tcp"])
def test_batches_complete_in_posting_order_with_their_bytes(world, env):
    make, peer = world
    w, src = make(env)
    p, ep = peer(w, env)
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, REGION, dtype=np.uint8)
    array_at(src.address, REGION)[:] = data
    n, size = 16, 256 << 10
    t = time.monotonic()
    for i in range(n):  # every post returns at once: nothing waits for the peer here
        ops = [PutOp(src.address + i * size, p.info["address"] + i * size, size // 2),
               PutOp(src.address + i * size + size // 2, p.info["address"] + i * size + size // 2, size // 2)]
        assert ep.post_puts(ops, ("batch", i), t + 10) == 2
    got = _poll_until(w, {("batch", i) for i in range(n)})
    assert [c.token for c in got] == [("batch", i) for i in range(n)]
    assert all(c.error is None and c.puts == 2 for c in got)
    assert ep.in_flight == 0 and w.in_flight == 0
    remote = Attached(p.info["shmid"], REGION)
    try:
        assert np.array_equal(remote.array[:n * size], data[:n * size])
    finally:
        remote.close()


def test_a_stalled_peer_times_out_at_its_deadline_and_holds_only_its_own_batches(world):
    make, peer = world
    w, src = make(TCP)
    slow, slow_ep = peer(w, TCP)
    fast, fast_ep = peer(w, TCP)
    os.kill(slow.proc.pid, signal.SIGSTOP)
    size = 4 << 20
    t0 = time.monotonic()
    slow_ep.post_puts([PutOp(src.address, slow.info["address"], size)], "slow-1", t0 + 1.0)
    assert time.monotonic() - t0 < 0.5  # posting never waits for the peer (a ucp fence did, on tcp)
    slow_ep.post_puts([PutOp(src.address, slow.info["address"], size)], "slow-2", t0 + 5.0)
    for i in range(5):  # the healthy peer's batches complete while the stalled one's are pending
        fast_ep.post_puts([PutOp(src.address, fast.info["address"], size)], ("fast", i), time.monotonic() + 10)
        got = _poll_until(w, {("fast", i)})
        assert [c.error for c in got if c.token == ("fast", i)] == [None]
    assert slow_ep.in_flight == 2
    got = _poll_until(w, {"slow-1", "slow-2"}, timeout_s=10)
    by = {c.token: c for c in got}
    assert isinstance(by["slow-1"].error, TransportTimeout)
    assert isinstance(by["slow-2"].error, TransferError)  # behind a timed-out batch: the endpoint is failed
    assert time.monotonic() - t0 >= 1.0
    assert not slow_ep.alive
    with pytest.raises(TransferError):
        slow_ep.post_puts([PutOp(src.address, slow.info["address"], 16)], "late", time.monotonic() + 1)


@pytest.mark.parametrize("env", [{}, TCP], ids=["default", "tcp"])
def test_peer_death_fails_its_batches_and_further_posts(world, env):
    make, peer = world
    w, src = make(env)
    p, ep = peer(w, env)
    ep.post_puts([PutOp(src.address, p.info["address"], 1 << 20)], "before", time.monotonic() + 10)
    assert [c.error for c in _poll_until(w, {"before"})] == [None]
    p.proc.kill()
    p.proc.wait(10)
    deadline = time.monotonic() + 10
    failed = None
    i = 0
    while failed is None:  # a put+flush may still "succeed" right after the death (notes/ucx.md)
        assert time.monotonic() < deadline, "peer death never surfaced"
        try:
            ep.post_puts([PutOp(src.address, p.info["address"], 1 << 20)], ("after", i), time.monotonic() + 5)
        except TransferError as e:
            failed = e
            break
        for c in _poll_until(w, {("after", i)}):
            if c.error is not None:
                assert isinstance(c.error, TransferError)
                failed = c.error
        w.dispatch_closed()
        i += 1
    assert failed is not None


def test_closing_an_endpoint_with_batches_in_flight_reports_them(world):
    make, peer = world
    w, src = make(TCP)
    p, ep = peer(w, TCP)
    os.kill(p.proc.pid, signal.SIGSTOP)
    ep.post_puts([PutOp(src.address, p.info["address"], 4 << 20)], "pending", time.monotonic() + 30)
    ep.close()
    got = _poll_until(w, {"pending"}, timeout_s=2)
    assert isinstance(got[0].error, TransferError)


@pytest.mark.parametrize("env", [{}, TCP], ids=["default", "tcp"])
def test_native_batches_split_puts_at_max_put_and_complete_whole(world, env):
    """The native queue under the endpoint: a put above ``max_put`` goes as several, the batch completes
    once (its flush after all of them), and every byte lands."""
    import pdpush_native as native

    make, peer = world
    w, src = make(env)
    p, ep = peer(w, env)
    data = np.random.default_rng(2).integers(0, 256, REGION, dtype=np.uint8)
    array_at(src.address, REGION)[:] = data
    q = native.Batches(ep.handle, ep.rkey.handle, 64 << 10)
    try:
        due = time.monotonic() + 10
        assert q.post([PutOp(src.address, p.info["address"], 1 << 20), (src.address + (1 << 20),
                                                                         p.info["address"] + (1 << 20), 1000)],
                      due) == 17
        assert q.post([], due) == 0 and len(q) == 2  # a flush alone is a batch too
        got: list[int] = []
        deadline = time.monotonic() + 10
        while len(got) < 2:
            assert time.monotonic() < deadline, got
            native.progress(w.worker.handle)
            got += q.reap(time.monotonic())
        assert got == [0, 0] and len(q) == 0
    finally:
        q.drop_all()
    remote = Attached(p.info["shmid"], REGION)
    try:
        assert np.array_equal(remote.array[:(1 << 20) + 1000], data[:(1 << 20) + 1000])
    finally:
        remote.close()


# ------------------------------------------------- the sender's native per-layer path (pusher.cpp)

LB = 64 << 10  # a layer's bytes
READY_AT = 6 << 20  # the peer's readiness words (a u64 per layer here)
WORDS_AT = 7 << 20  # the lease words in staging, put as readiness words
RING_AT = (7 << 20) + 4096


def _pusher(w, src, timeout_s: float = 10.0):
    import pdpush_native as native

    from pdpush.transport.ucx import MAX_PUT_BYTES

    return native.Pusher(w.worker.handle, src.address, REGION, MAX_PUT_BYTES, timeout_s)


def _request(pu, src, p, handle: int, layers: int = 4, tp: int = 1, ranks=(3,), moves: bool = True,
             grant: bool = True, eid: int = 1) -> None:
    dst = p.info["address"]
    share = LB // tp
    pu.add_request(handle, eid, [(0, dst + la * LB, dst + READY_AT + la * 8, LB if moves else 0)
                                 for la in range(layers)],
                   [[(src.address + WORDS_AT, 0, 8)]], tp)
    for i, cid in enumerate(ranks):  # two puts for a rank's share: the path posts every span
        half = share // 2
        pu.add_rank(handle, cid, 0, layers, [[(i * share, i * share, half), (i * share + half, i * share + half,
                                                                            share - half)]])
    if grant and moves:
        for la in range(layers):
            pu.grant(handle, la, la * LB)


def _poll(pu, want: int, timeout_s: float = 10.0):
    landed, failed = [], []
    deadline = time.monotonic() + timeout_s
    while len(landed) < want and not failed:
        assert time.monotonic() < deadline, f"landed {landed}, waiting for {want}"
        a, b = pu.poll()
        landed += a
        failed += b
    return landed, failed


@pytest.mark.parametrize("env", [{}, TCP], ids=["default", "tcp"])
def test_the_native_path_posts_each_layer_handed_over_and_lands_it_in_order_with_its_readiness_words(world, env):
    from pdpush import ring

    make, peer = world
    w, src = make(env)
    p, ep = peer(w, env)
    data = np.random.default_rng(3).integers(0, 256, 4 * LB, dtype=np.uint8)
    array_at(src.address, 4 * LB)[:] = data
    array_at(src.address + WORDS_AT, 8).view(np.uint64)[0] = 0xABCDEF  # the lease id
    slots = array_at(src.address + RING_AT, 16 * 8).view(np.uint64)
    slots[:] = 0
    pu = _pusher(w, src)
    try:
        pu.add_endpoint(1, ep.handle, ep.rkey.handle, p.info["address"], REGION)
        pu.add_ring(3, src.address + RING_AT, 16)
        _request(pu, src, p, 7)
        slots[0] = ring.encode(7, 0, 2)  # layers 0 and 1 from the ring, 2 and 3 by message
        slots[1] = ring.encode(99, 0, 1)  # a request it does not know: refused, for the session to count
        assert pu.take() == (2, [(3, 99, 0, 1, 1)]) and not slots.any()  # slots given back
        assert pu.hand(3, 7, 2, 2) == 0
        assert pu.in_flight == 0 and pu.pending()
        pu.post()
        assert pu.in_flight == 1  # one batch: every layer handed over in the pass
        landed, failed = _poll(pu, 4)
        assert failed == [] and [(h, la) for h, la, _, _ in landed] == [(7, la) for la in range(4)]
        assert all(s >= 0 for _, _, s, _ in landed) and pu.in_flight == 1  # the readiness words' batch
        _poll(pu, 0)
        deadline = time.monotonic() + 10
        while pu.in_flight:
            assert time.monotonic() < deadline
            pu.poll()
        stats = pu.stats()
        assert stats["handovers_ring"] == 2 and stats["layers_handed"] == 4 and stats["bytes_put"] == 4 * LB
        # refusals: nothing of a refused hand-over is taken
        assert pu.hand(4, 7, 0, 1) == 2  # not one of the request's ranks
        assert pu.hand(3, 7, 3, 2) == 3  # past its stage's layers
        assert pu.hand(3, 7, 0xFFFFFFFF, 1) == 3  # a range that would wrap 32 bits
        assert pu.check(3, 7, 0, 1) == 4 and pu.check(3, 7, 3, 1) == 4  # check() says why and takes nothing
        assert pu.hand(3, 7, 0, 1) == 4  # handed over already
        _request(pu, src, p, 8, grant=False)
        assert pu.hand(3, 8, 0, 1) == 5  # its block not granted
        pu.drop_request(8)
        assert pu.hand(3, 8, 0, 1) == 1
    finally:
        pu.close()
    remote = Attached(p.info["shmid"], REGION)
    try:
        assert np.array_equal(remote.array[:4 * LB], data)
        assert list(remote.array[READY_AT:READY_AT + 32].view(np.uint64)) == [0xABCDEF] * 4
    finally:
        remote.close()


@pytest.mark.parametrize("env", [{}, TCP], ids=["default", "tcp"])
def test_a_receiver_claiming_a_pool_larger_than_its_rkey_maps_here_is_refused(world, env):
    """Over a shared-memory lane a put is this process's own copy to the peer's mapped base + offset, with no range
    check in UCX: a receiver whose HelloAck claims more pool than it registered would have the sender write past
    that mapping (at 1 TiB past it, the sender died of SIGSEGV). The endpoint refuses such a pool when it joins the
    pusher. Over tcp nothing is mapped here: the receiver's own side bounds it."""
    from pdpush.errors import TransferError

    make, peer = world
    w, src = make(env)
    p, ep = peer(w, env)
    dst = p.info["address"]
    pu = _pusher(w, src)
    try:
        if ep.rkey.local_address(dst) is not None:
            with pytest.raises(TransferError, match="larger than the region its rkey maps here"):
                ep.attach(pu, 1, (dst, 1 << 40))
            # a base claimed off the segment's start: UCX maps it to wherever the offset lands in this process (a
            # base claimed below it, at this process's own staging); the pool must start where the segment does
            with pytest.raises(TransferError, match="is not the start of a shared-memory segment"):
                ep.attach(pu, 1, (dst + 4096, REGION - 4096))
        else:
            assert env == TCP
        ep.attach(pu, 1, (dst, REGION))  # what it registered: taken
    finally:
        pu.close()


def test_the_native_path_refuses_a_plan_that_would_put_outside_the_receivers_pool(world):
    """The last line of defence under the session's checks: a layer, a rank's span or a readiness word whose put
    would leave the pool the receiver registered (the endpoint's ``base`` and ``bytes``), or come from outside
    staging, is refused when planned, before any put; nothing is posted and a plan inside it still goes."""
    make, peer = world
    w, src = make()
    p, ep = peer(w)
    dst, words = p.info["address"], [[(src.address + WORDS_AT, 0, 8)]]
    pu = _pusher(w, src)
    try:
        with pytest.raises(ValueError, match="wraps"):
            pu.add_endpoint(1, ep.handle, ep.rkey.handle, (1 << 64) - 8, 16)
        pu.add_endpoint(1, ep.handle, ep.rkey.handle, dst, REGION)
        for layers, ready in (([(0, dst + REGION, dst + READY_AT, LB)], words),  # a layer past the pool
                              ([(0, dst - LB, dst + READY_AT, LB)], words),  # before it
                              ([(0, dst, dst + REGION - 4, LB)], words),  # its readiness word across the end
                              ([(0, dst, dst + READY_AT, LB)], [[(src.address + REGION, 0, 8)]])):  # from past staging
            with pytest.raises(ValueError, match="outside the receiver's pool"):
                pu.add_request(9, 1, layers, ready, 1)
        with pytest.raises(ValueError, match="no receiver endpoint"):
            pu.add_request(9, 2, [(0, dst, dst + READY_AT, LB)], words, 1)
        pu.add_request(9, 1, [(0, dst + REGION - LB, dst + READY_AT, LB)], words, 1)  # the last LB of the pool
        for span in ((0, 1, LB), (0, LB, 1), (0, (1 << 64) - 1, 2), (LB, 0, 1), (1, 0, LB)):  # a span past it
            with pytest.raises(ValueError, match="outside its layer's block or the receiver's pool"):
                pu.add_rank(9, 3, 0, 1, [[span]])
        pu.add_rank(9, 3, 0, 1, [[(0, 0, LB)]])
        with pytest.raises(ValueError, match="a grant outside"):
            pu.grant(9, 0, (1 << 64) - 1)
        assert pu.in_flight == 0 and not pu.pending()
    finally:
        pu.close()


def test_the_native_path_lands_a_layer_once_every_tp_rank_s_share_is_in(world):
    make, peer = world
    w, src = make()
    p, ep = peer(w)
    pu = _pusher(w, src)
    try:
        pu.add_endpoint(1, ep.handle, ep.rkey.handle, p.info["address"], REGION)
        _request(pu, src, p, 5, layers=2, tp=2, ranks=(3, 4))
        assert pu.hand(3, 5, 0, 2) == 0
        pu.post()
        deadline = time.monotonic() + 2
        while pu.in_flight and time.monotonic() < deadline:  # rank 0's shares flush: nothing lands yet
            assert pu.poll() == ([], [])
        assert pu.hand(4, 5, 1, 1) == 0 and pu.hand(4, 5, 0, 1) == 0
        pu.post()
        landed, _ = _poll(pu, 2)
        assert sorted((h, la) for h, la, _, _ in landed) == [(5, 0), (5, 1)]
        _request(pu, src, p, 6, layers=2, moves=False)  # nothing new to move: it lands as it is handed over
        assert pu.hand(3, 6, 0, 2) == 0 and [(h, la) for h, la, _, _ in pu.poll()[0]] == [(6, 0), (6, 1)]
    finally:
        pu.close()


def test_the_native_path_times_a_stalled_receiver_out_and_holds_nothing_else(world):
    import pdpush_native as native

    make, peer = world
    w, src = make(TCP)
    slow, slow_ep = peer(w, TCP)
    fast, fast_ep = peer(w, TCP)
    pu = _pusher(w, src, timeout_s=1.0)
    try:
        pu.add_endpoint(1, slow_ep.handle, slow_ep.rkey.handle, slow.info["address"], REGION)
        pu.add_endpoint(2, fast_ep.handle, fast_ep.rkey.handle, fast.info["address"], REGION)
        os.kill(slow.proc.pid, signal.SIGSTOP)
        _request(pu, src, slow, 1, layers=16)  # 1 MiB into a stopped peer over tcp
        _request(pu, src, fast, 2, eid=2)
        t0 = time.monotonic()
        assert pu.hand(3, 1, 0, 8) == 0
        pu.post()
        assert pu.hand(3, 1, 8, 8) == 0  # a second batch behind the first: both fail with it
        pu.post()
        assert pu.in_flight == 2
        for la in range(4):  # the healthy receiver's layers land while the stalled one's are in flight
            assert pu.hand(3, 2, la, 1) == 0
            pu.post()
            landed, failed = _poll(pu, 1)
            assert [(h, x) for h, x, _, _ in landed] == [(2, la)] and failed == []
        landed, failed = _poll(pu, 1, timeout_s=10)
        assert landed == [] and failed == [(1, native.TIMED_OUT)] and time.monotonic() - t0 >= 1.0
        assert pu.hand(3, 1, 0, 1) == 1  # a failed receiver takes nothing more (the session ends its requests)
        deadline = time.monotonic() + 5
        while pu.in_flight:  # the fast receiver's readiness words; nothing of the stalled one is left
            assert time.monotonic() < deadline
            pu.poll()
    finally:
        pu.close()


@pytest.mark.parametrize("env", [{}, TCP], ids=["default", "tcp"])
def test_the_native_wait_runs_the_layers_and_returns_only_when_the_session_has_something_to_do(world, env):
    """``Pusher.wait``, the sender's loop between two looks of its session: it takes the ring's records when
    the doorbell rings (its idle word set while it sleeps), puts them and reaps them by itself, and returns
    for a request whose every layer landed with its readiness words, for any landing when ``eager``, for a
    refused record, for a readable fd of the session's, or at its timeout; never for a layer in between."""
    import threading

    from pdpush import ring

    make, peer = world
    w, src = make(env)
    p, ep = peer(w, env)
    data = np.random.default_rng(5).integers(0, 256, 2 * LB, dtype=np.uint8)
    array_at(src.address, 2 * LB)[:] = data
    array_at(src.address + WORDS_AT, 8).view(np.uint64)[0] = 0x5EED  # the lease id, put as readiness words
    slots = array_at(src.address + RING_AT, 16 * 8).view(np.uint64)
    slots[:] = 0
    idle = src.address + RING_AT + 16 * 8  # the idle word, after the ring
    idle_word = array_at(idle, 8).view(np.uint64)
    idle_word[0] = 0
    sock_r, sock_w = os.pipe()  # stands for one of the session's fds (a socket's, the lifelines')
    bell_r, bell_w = os.pipe()
    os.set_blocking(bell_r, False)
    records = iter(range(16))
    seen_idle: list[int] = []
    pu = _pusher(w, src)

    def wait(timeout_s: float, eager: bool = False):
        t = time.monotonic()
        out = pu.wait(timeout_s, [sock_r], bell_r, w.epoll_fd, idle, 0.002, eager)
        return out, time.monotonic() - t

    def hand_later(handle: int, layer: int) -> threading.Thread:
        def hand() -> None:  # an engine: its record, then the bell (the sender said it was idle)
            time.sleep(0.05)
            seen_idle.append(int(idle_word[0]))
            slots[next(records)] = ring.encode(handle, layer, 1)
            os.write(bell_w, b"\x01")

        th = threading.Thread(target=hand)
        th.start()
        return th

    try:
        pu.add_endpoint(1, ep.handle, ep.rkey.handle, p.info["address"], REGION)
        pu.add_ring(3, src.address + RING_AT, 16)
        _request(pu, src, p, 7, layers=2)
        out, took = wait(0.3)
        assert out == ([], 0, []) and took >= 0.3  # nothing to do: it sleeps to its timeout
        th = hand_later(7, 0)
        (ready, rung, refused), took = wait(0.6)
        th.join()
        # layer 0 went out and landed while it slept on: not the request's last, nothing for the session yet
        assert (ready, rung, refused) == ([], 1, []) and took >= 0.6 and seen_idle == [1] and idle_word[0] == 0
        landed, failed = pu.poll()
        assert [(h, la) for h, la, _, _ in landed] == [(7, 0)] and failed == []
        th = hand_later(7, 1)
        t_last = time.monotonic()
        (ready, rung, refused), took = wait(10)
        th.join()
        assert (ready, rung, refused) == ([], 1, []) and took < 5  # the last layer and every word are in
        landed, _ = pu.poll()
        assert [(h, la) for h, la, _, _ in landed] == [(7, 1)] and sorted(pu.take_words()) == [7, 7]
        assert t_last <= landed[0][3] <= time.monotonic()  # when it landed, on time.monotonic()'s clock

        _request(pu, src, p, 8, layers=2)
        slots[next(records)] = ring.encode(8, 0, 1)  # taken at once: no bell needed while it is awake
        (ready, rung, refused), took = wait(10, eager=True)
        assert (ready, refused) == ([], []) and took < 5  # eager: a landing is enough
        assert [(h, la) for h, la, _, _ in pu.poll()[0]] == [(8, 0)]

        slots[next(records)] = ring.encode(99, 0, 1)  # a request it does not know
        (ready, rung, refused), took = wait(10)
        assert refused == [(3, 99, 0, 1, 1)] and took < 5
        os.write(sock_w, b"\x01")
        (ready, rung, refused), took = wait(10)
        assert ready == [sock_r] and took < 5
    finally:
        pu.close()
        for fd in (sock_r, sock_w, bell_r, bell_w):
            os.close(fd)
    remote = Attached(p.info["shmid"], REGION)
    try:
        assert np.array_equal(remote.array[:2 * LB], data)
        assert list(remote.array[READY_AT:READY_AT + 16].view(np.uint64)) == [0x5EED] * 2
    finally:
        remote.close()


@pytest.mark.parametrize("env", [{}, TCP], ids=["default", "tcp"])
def test_the_native_path_reports_a_dead_receiver(world, env):
    make, peer = world
    w, src = make(env)
    p, ep = peer(w, env)
    pu = _pusher(w, src, timeout_s=5.0)
    try:
        pu.add_endpoint(1, ep.handle, ep.rkey.handle, p.info["address"], REGION)
        p.proc.kill()
        p.proc.wait(10)
        deadline = time.monotonic() + 10
        handle = 0
        while ep.alive:  # a put+flush may still "succeed" right after the death (notes/ucx.md)
            assert time.monotonic() < deadline, "peer death never surfaced"
            handle += 1
            _request(pu, src, p, handle, layers=1)
            if pu.hand(3, handle, 0, 1) == 1:
                break  # the path saw its puts fail already
            pu.post()
            _, failed = pu.poll()
            if failed:
                assert failed[0][0] == 1 and failed[0][1] < 0
                break
            w.progress()
            w.dispatch_closed()
        pu.drop_endpoint(1)  # what the sender does once it knows: its batches go
        assert pu.in_flight == 0 and pu.poll() == ([], [])
    finally:
        pu.close()


@pytest.mark.parametrize("how", ["dropped", "added again"])
def test_the_native_path_forgets_a_receivers_flights_when_it_is_dropped_or_added_again(world, how):
    """A receiver dropped with batches in flight, or added again under its id (the session's reconnection drops the
    old one first, but nothing below made it: its flights stayed counted, and every wait after slept at most 1 ms,
    for good): its flights leave the count, and UCX completes them as canceled later."""
    make, peer = world
    w, src = make(TCP)
    p, ep = peer(w, TCP)
    pu = _pusher(w, src)
    try:
        pu.add_endpoint(1, ep.handle, ep.rkey.handle, p.info["address"], REGION)
        os.kill(p.proc.pid, signal.SIGSTOP)
        try:
            _request(pu, src, p, 1, layers=16)
            assert pu.hand(3, 1, 0, 16) == 0
            pu.post()
            assert pu.in_flight == 1
            if how == "dropped":
                pu.drop_endpoint(1)
                assert pu.in_flight == 0 and pu.poll() == ([], []) and pu.hand(3, 1, 0, 1) == 1
            else:
                pu.add_endpoint(1, ep.handle, ep.rkey.handle, p.info["address"], REGION)
                assert pu.in_flight == 0 and pu.stats()["puts_in_flight"] == 0
            ep.close()
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        for _ in range(100):
            w.progress()
    finally:
        pu.close()


def test_an_endpoints_transports_are_asked_of_ucx_until_it_is_wired_up_then_kept(world, monkeypatch):
    """The daemons' metrics name each endpoint's lanes every refresh (100 ms); below UCX 1.14 each answer is printed
    to a file and parsed (~0.4 ms an endpoint, in the daemon's loop). A wired-up endpoint's are asked once."""
    from pdpush.transport import ucp

    make, peer = world
    w, _ = make(TCP)
    p, ep = peer(w, TCP)
    real, calls = ucp.ep_transports, []
    monkeypatch.setattr(ucp, "ep_transports", lambda h: calls.append(h) or real(h))
    rkey, ep.rkey = ep.rkey, None  # as while it wires up: asked each time
    first = ep.transports()
    assert ep.transports() == first and len(calls) == 2
    ep.rkey = rkey  # wired up
    assert ep.transports() == first and ep.transports() == first and len(calls) == 3
    assert any(t.startswith("tcp/") for t in first), first


def test_a_flooded_doorbell_is_drained_a_bounded_amount_a_wake(world):
    """An engine that keeps writing the doorbell FIFO (the same uid may) cannot hold the sender's wait reading it:
    a wake reads at most 64 KiB, the rest at the next looks (it stays readable), so a wait ends near its deadline.
    Before, a wake read until the FIFO was empty: 1 MiB in one wake here, and an engine writing as fast as it could
    held a wait of 10 ms for 50 ms."""
    import fcntl

    make, _ = world
    w, src = make(TCP)
    bell_r, bell_w = os.pipe()
    os.set_blocking(bell_r, False)
    size = fcntl.fcntl(bell_w, 1031, 1 << 20)  # F_SETPIPE_SZ: room for 1 MiB of rings
    os.write(bell_w, b"\x01" * size)
    sock_r, sock_w = os.pipe()  # one of the session's fds, readable: a wait ends after the look that sees it
    os.write(sock_w, b"\x01")
    pu = _pusher(w, src)
    try:
        for _ in range(100):  # (a wait that spun on UCX's progress looked at the session's fds alone: nothing read)
            ready, rung, _ = pu.wait(1.0, [sock_r], bell_r, w.epoll_fd, 0, 0.0, False)
            assert ready == [sock_r] and rung <= 64 << 10
            if rung:
                break
        assert rung and len(os.read(bell_r, size)) == size - rung  # the rest is still there
    finally:
        pu.close()
        for fd in (bell_r, bell_w, sock_r, sock_w):
            os.close(fd)
