"""The sender's doorbell (doorbell.py): a FIFO an engine rings to wake a sleeping sender without
ZeroMQ's I/O threads. Its two ends on their own, then real daemons: an idle sender woken by it."""

from __future__ import annotations

import os
import select
import time

import numpy as np

from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.doorbell import Bell, Doorbell, path_for
from pdpush.layout import KVLayout
from tests.helpers import kv, read_back, rx_opts, sock

LAY = KVLayout(layers=8, kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=8, model_id="default")


def test_a_ring_wakes_the_poll_and_drain_empties_it(tmp_path):
    d = Doorbell(str(tmp_path / "s.bell"))
    try:
        p = select.poll()
        p.register(d.fileno(), select.POLLIN)
        assert p.poll(0) == []  # no writer but its own: silence, not a hang-up
        b = Bell(d.path)
        assert b.ring() and b.ring()
        assert p.poll(1000) == [(d.fileno(), select.POLLIN)]
        assert d.drain() == 2
        assert p.poll(0) == []
        b.close()
        assert not b.ring()  # closed: the caller wakes the sender by message
    finally:
        d.close()
    assert not os.path.exists(d.path)


def test_a_full_fifo_is_a_wake_up_already_pending(tmp_path):
    d = Doorbell(str(tmp_path / "s.bell"))
    try:
        b = Bell(d.path)
        assert all(b.ring() for _ in range(70_000))  # past a pipe's 64 KiB: full, still True
        assert d.drain() >= 65_536
    finally:
        d.close()


def test_a_bell_without_a_sender_or_with_a_wrong_path_answers_false(tmp_path):
    d = Doorbell(str(tmp_path / "s.bell"))
    path = d.path
    b = Bell(path)
    d.close()  # the sender is gone: no reader
    assert not b.ring()
    os.mkfifo(path)
    assert not Bell(path).ring()  # a FIFO nobody reads cannot be opened without blocking
    (tmp_path / "file").write_bytes(b"")
    assert not Bell(str(tmp_path / "file")).ring()  # not a FIFO
    assert not Bell(str(tmp_path / "missing")).ring()
    assert not Bell("").ring()


def test_a_stale_fifo_of_a_killed_sender_is_replaced(tmp_path):
    path = str(tmp_path / "s.bell")
    os.mkfifo(path)
    d = Doorbell(path)
    try:
        assert Bell(path).ring() and d.drain() == 1
    finally:
        d.close()


def test_an_idle_sender_is_woken_by_its_doorbell_and_every_layer_lands(daemons):
    """A sender that sleeps (its idle word set) is rung, not sent a Wake message; each request pushed after
    it idles lands byte for byte."""
    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    assert os.path.exists(path_for(sock(tx)))
    pc = PrefillClient(LAY, sock(tx), timeout_s=30)
    dc = DecodeClient(sock(rx), timeout_s=30)
    try:
        for i in range(5):
            k, v = kv(LAY, 20, seed=i)
            h = pc.begin(f"rung-{i}", list(range(100 * i, 100 * i + 20)))
            assert h._bell is not None
            for layer in range(LAY.layers):
                h.stage_layer(layer, k[layer], v[layer])
            time.sleep(0.1)  # the sender goes to sleep
            h.layers_ready(list(range(LAY.layers)))
            assert h.finish(timeout_s=30).layers == LAY.layers
            gk, gv = read_back(dc, f"rung-{i}", LAY, 20)
            assert np.array_equal(gk, k) and np.array_equal(gv, v)
        # a hand-over rings only while the sender sleeps; it wakes every 20 ms for its timers, so not every one
        assert status(sock(tx))["doorbell_rings"] >= 1
    finally:
        pc.close()
        dc.close()
    tx.stop()
    assert not os.path.exists(path_for(sock(tx)))  # removed when the sender stops
