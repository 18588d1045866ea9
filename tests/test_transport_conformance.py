"""Conformance of the UCX transport to pdpush/transport/base.py: posted batches, polled completions.

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
        assert q.post([PutOp(src.address, p.info["address"], 1 << 20), (src.address + (1 << 20),
                                                                         p.info["address"] + (1 << 20), 1000)]) == 17
        assert q.post([]) == 0 and len(q) == 2  # a flush alone is a batch too
        got: list[int] = []
        deadline = time.monotonic() + 10
        while len(got) < 2:
            assert time.monotonic() < deadline, got
            native.progress(w.worker.handle)
            got += q.reap()
        assert got == [0, 0] and len(q) == 0
    finally:
        q.drop_all()
    remote = Attached(p.info["shmid"], REGION)
    try:
        assert np.array_equal(remote.array[:(1 << 20) + 1000], data[:(1 << 20) + 1000])
    finally:
        remote.close()
