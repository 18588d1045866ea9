"""A network partition, made by this test with two network namespaces joined by a veth pair.

The receiver and the sender run in different namespaces, and UCX is forced onto
tcp (the honest stand-in for a NIC: on one host it would otherwise use shared
memory, which no link-down can cut). Every address used lives inside the
namespaces this test creates, and the test removes them.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdpush import launch
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.errors import PdpushError
from pdpush.layout import KVLayout
from pdpush_tools.bench import netns
from tests.helpers import kv, rx_opts

LAY = KVLayout(4, 2, 64, "float16", 16)


def _ip(*args: str) -> None:
    netns.ip(*args)


@pytest.fixture
def two_hosts():
    try:
        h = netns.TwoHosts.make()
    except netns.Unavailable as e:
        pytest.skip(str(e))
    try:
        yield h
    finally:
        h.close()


def test_link_down_mid_transfer_is_detected_on_both_sides(two_hosts, tmp_path):
    tcp_only = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "all"}
    rx = tx = None
    try:
        rx = launch.start_receiver(tmp_path, prefix=["ip", "netns", "exec", two_hosts["d"]], host=two_hosts["d_addr"],
                                   ucx_env=tcp_only, lease_ms=3000, quarantine_ms=500, prefault=False, insecure=True,
                                   **rx_opts(LAY, pool_pages=32))
        tx = launch.start_sender(tmp_path, prefix=["ip", "netns", "exec", two_hosts["p"]],
                                 default_receiver=rx.info["control_endpoint"], ucx_env=tcp_only,
                                 layer_timeout_ms=2000, control_timeout_ms=2000, staging_bytes=64 << 20,
                                 prefault=False)
        rx_sock = rx.info["local_endpoint"].removeprefix("ipc://")
        pc = PrefillClient(LAY, tx.info["ingress_endpoint"].removeprefix("ipc://"), timeout_s=15)
        dc = DecodeClient(rx_sock, timeout_s=15)
        k, v = kv(LAY, 200, 9)
        # a healthy transfer across the link first
        h = pc.begin("healthy", list(range(200)))
        for layer in range(LAY.layers):
            h.put_layer(layer, k[layer], v[layer])
        h.finish()
        with dc.open("healthy") as req:
            got = np.concatenate([r.view(np.uint8) for r in req.layer_runs(3)]).ravel()
            assert got.size and req.committed
        # now cut the link in the middle of a request
        h = pc.begin("cut", list(range(1000, 1200)))
        h.put_layer(0, k[0], v[0])
        req = dc.open("cut", timeout_s=5)
        req.wait_layer(0, timeout_s=5)
        _ip("-n", two_hosts["p"], "link", "set", two_hosts["vp"], "down")
        t0 = time.monotonic()
        with pytest.raises(PdpushError):  # prefill side: typed failure within the layer deadline
            for layer in range(1, LAY.layers):
                h.put_layer(layer, k[layer], v[layer])
            h.finish(timeout_s=15)
        t_sender = time.monotonic() - t0
        with pytest.raises(PdpushError):  # decode side: the lease expires, the waiter gets a typed error
            req.wait_layer(LAY.layers - 1, timeout_s=15)
        t_decode = time.monotonic() - t0
        assert t_sender < 8 and t_decode < 8, (t_sender, t_decode)
        deadline = time.monotonic() + 10
        while status(rx_sock)["leases_active"]:
            assert time.monotonic() < deadline, "lease never expired"
            time.sleep(0.1)  # polling status; bounded
        st = status(rx_sock)
        assert st["leases_expired"] >= 1 or st["requests_failed"] >= 1
        print(f"partition detected: prefill side {t_sender * 1000:.0f} ms, decode side {t_decode * 1000:.0f} ms")
        pc.close()
        dc.close()
    finally:
        for d in (tx, rx):
            if d is not None:
                d.stop()


def test_a_partitioned_receiver_does_not_hold_up_another_receivers_requests(two_hosts, tmp_path):
    """Receiver A sits across the veth link, receiver B beside the sender. A's link goes down with A's puts
    in flight; B's requests through the same sender must all complete while A's request is still pending
    (the sender's loop never waits on A). Judged by completion order, not by a clock."""
    tcp_only = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "all"}
    in_p = ["ip", "netns", "exec", two_hosts["p"]]
    daemons = []
    pc = None
    try:
        rx_a = launch.start_receiver(tmp_path, prefix=["ip", "netns", "exec", two_hosts["d"]],
                                     host=two_hosts["d_addr"], ucx_env=tcp_only, lease_ms=30000, prefault=False,
                                     insecure=True, **rx_opts(LAY, pool_pages=64))
        daemons.append(rx_a)
        rx_b = launch.start_receiver(tmp_path, prefix=in_p, ucx_env=tcp_only, prefault=False,
                                     **rx_opts(LAY, pool_pages=128))
        daemons.append(rx_b)
        a, b = rx_a.info["control_endpoint"], rx_b.info["control_endpoint"]
        tx = launch.start_sender(tmp_path, prefix=in_p, default_receiver=a, ucx_env=tcp_only,
                                 layer_timeout_ms=8000, control_timeout_ms=8000, lease_ms=30000,
                                 staging_bytes=64 << 20, prefault=False)
        daemons.append(tx)
        tx_sock = tx.info["ingress_endpoint"].removeprefix("ipc://")
        pc = PrefillClient(LAY, tx_sock, timeout_s=30)
        k, v = kv(LAY, 200, 9)
        for rcv in (a, b):  # both sessions up first
            h = pc.begin(f"warm-{rcv}", list(range(200)), receiver=rcv)
            for layer in range(LAY.layers):
                h.put_layer(layer, k[layer], v[layer])
            h.finish()
        cut = pc.begin("cut", list(range(1000, 1200)), receiver=a)
        _ip("-n", two_hosts["p"], "link", "set", two_hosts["vp"], "down")
        for layer in range(LAY.layers):  # handed over; their puts to A cannot complete now
            cut.put_layer(layer, k[layer], v[layer])
        for i in range(6):
            h = pc.begin(f"b-{i}", list(range(5000 + 300 * i, 5200 + 300 * i)), receiver=b)
            for layer in range(LAY.layers):
                h.put_layer(layer, k[layer], v[layer])
            assert h.finish().layers == LAY.layers
        st = status(tx_sock)
        assert st["requests_done"] == 2 + 6
        assert st["requests_failed"] == 0 and st["requests_inflight"] == 1, st  # A's request still pending
        with pytest.raises(PdpushError):  # and it fails at its own deadline, typed
            cut.finish(timeout_s=30)
        assert status(tx_sock)["requests_failed"] == 1
    finally:
        if pc is not None:
            pc.close()
        for d in reversed(daemons):
            d.stop()
