"""A network partition, made by this test with two network namespaces joined by a veth pair.

The receiver and the sender run in different namespaces, and UCX is forced onto
tcp (the honest stand-in for a NIC: on one host it would otherwise use shared
memory, which no link-down can cut). Every address used lives inside the
namespaces this test creates, and the test removes them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time

import numpy as np
import pytest

from pdpush import launch
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.errors import PdpushError
from pdpush.layout import KVLayout
from tests.test_push_integration import _kv, _rx_opts

LAY = KVLayout(4, 2, 64, "float16", 16)
NET = "10.213.77"  # lives only inside this test's namespaces


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = secrets.token_hex(3)
    ns_p, ns_d = f"pdp-p-{tag}", f"pdp-d-{tag}"
    vp, vd = f"vp{tag}", f"vd{tag}"
    try:
        _ip("netns", "add", ns_p)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    try:
        _ip("netns", "add", ns_d)
        _ip("link", "add", vp, "type", "veth", "peer", "name", vd)
        _ip("link", "set", vp, "netns", ns_p)
        _ip("link", "set", vd, "netns", ns_d)
        for ns, dev, addr in ((ns_p, vp, f"{NET}.1/30"), (ns_d, vd, f"{NET}.2/30")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield {"p": ns_p, "d": ns_d, "vp": vp, "d_addr": f"{NET}.2"}
    finally:
        for ns in (ns_p, ns_d):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_link_down_mid_transfer_is_detected_on_both_sides(two_hosts, tmp_path):
    tcp_only = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "all"}
    rx = tx = None
    try:
        rx = launch.start_receiver(tmp_path, prefix=["ip", "netns", "exec", two_hosts["d"]], host=two_hosts["d_addr"],
                                   ucx_env=tcp_only, lease_ms=3000, quarantine_ms=500, prefault=False, insecure=True,
                                   **_rx_opts(LAY, pool_pages=32))
        tx = launch.start_sender(tmp_path, prefix=["ip", "netns", "exec", two_hosts["p"]],
                                 default_receiver=rx.info["control_endpoint"], ucx_env=tcp_only,
                                 layer_timeout_ms=2000, control_timeout_ms=2000, staging_bytes=64 << 20,
                                 prefault=False)
        rx_sock = rx.info["local_endpoint"].removeprefix("ipc://")
        pc = PrefillClient(LAY, tx.info["ingress_endpoint"].removeprefix("ipc://"), timeout_s=15)
        dc = DecodeClient(rx_sock, timeout_s=15)
        k, v = _kv(LAY, 200, 9)
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
