"""netif.py: a daemon's start waits for the interface UCX must list (UCX lists its tcp devices once, up and
running only; a connection that arrives on one it left out is rejected)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdpush import netif

ROOT = Path(__file__).resolve().parents[1]


def test_wait_running_returns_once_none_is_pending_and_at_its_deadline_at_most():
    clock = {"t": 0.0}
    seen = iter([["eth1"], ["eth1"], []])
    assert netif.wait_running(["eth1"], 2.0, look=lambda names: next(seen), clock=lambda: clock["t"],
                              sleep=lambda s: clock.__setitem__("t", clock["t"] + s)) == []
    assert clock["t"] < 0.05
    clock["t"] = 0.0
    assert netif.wait_running(["eth1"], 2.0, look=lambda names: names, clock=lambda: clock["t"],
                              sleep=lambda s: clock.__setitem__("t", clock["t"] + s)) == ["eth1"]
    assert 2.0 <= clock["t"] < 2.05
    assert netif.wait_running([], 2.0, look=lambda names: pytest.fail("looked with nothing to wait for")) == []
    clock["t"] = 0.0  # a daemon told to stop meanwhile stops waiting
    assert netif.wait_running(["eth1"], 2.0, look=lambda names: names, clock=lambda: clock["t"],
                              sleep=lambda s: clock.__setitem__("t", clock["t"] + s),
                              stop=lambda: clock["t"] > 0.1) == ["eth1"]
    assert clock["t"] < 0.15


def test_the_interfaces_of_addresses_and_routes_here():
    assert netif.interface_of("127.0.0.1") == "lo" and netif.route_interface("127.0.0.1") == "lo"
    assert netif.interface_of("0.0.0.0") is None and netif.interface_of("not-an-address") is None
    assert netif.route_interface("receiver.example") is None  # (a name is never looked up here)
    assert netif.not_running(["lo", "no-such-interface"]) == []
    # a wildcard bind takes connections on every interface: the default route's is the one waited for
    assert netif.listening_interface("0.0.0.0") == netif.default_interface()
    assert netif.listening_interface("127.0.0.1") == "lo"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="needs root and iproute2 (CI runs as root: it runs there)")
def test_ucx_made_after_the_wait_lists_a_veth_end_that_had_no_carrier_yet(tmp_path):
    """A veth pair made inside two namespaces: both ends have the same interface index, and Linux marks the end
    brought up second running up to a second later. A UCX context made in that window leaves the device out, and
    a sender's connection through it is refused (UCS_ERR_REJECTED). Made after ``wait_running`` (as the
    receiver's start does for its bind address), it lists it."""
    tag = secrets.token_hex(3)
    p, d, vp, vd = f"pdp-np-{tag}", f"pdp-nd-{tag}", f"np{tag}", f"nd{tag}"
    made = []
    try:
        for ns in (p, d):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", vp, "netns", p, "type", "veth", "peer", "name", vd, "netns", d)
        for ns, dev, addr in ((p, vp, "10.213.78.1/30"), (d, vd, "10.213.78.2/30")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", d, "addr", "add", "10.213.78.6/30", "dev", vd)  # a secondary address (a VIP) is found too,
        _ip("-n", d, "addr", "add", "10.213.78.10/30", "dev", vd, "label", f"{vd}:v")  # and one with a label
        _ip("-n", p, "link", "set", vp, "up")
        t_up = time.monotonic()
        _ip("-n", d, "link", "set", vd, "up")  # (the end whose carrier comes late)
        probe = ("import json, sys, time\n"
                 "from pdpush import daemon, netif\n"
                 "t0 = time.monotonic()\n"
                 "late = daemon.settle_interface('10.213.78.2', route=False)\n"  # (as the receiver's start does)
                 "waited = time.monotonic() - t0\n"
                 "from pdpush.transport.auto import open_transport\n"
                 "t = open_transport({'UCX_TLS': 'tcp', 'UCX_NET_DEVICES': 'all'})\n"
                 "print(json.dumps({'late': late, 'waited': waited, 'available': t.describe()['available'],\n"
                 "                  'vip': netif.interface_of('10.213.78.6'),\n"
                 "                  'labelled': netif.interface_of('10.213.78.10'),\n"
                 "                  'default': netif.listening_interface('0.0.0.0')}))\n"
                 "t.close()\n")
        r = subprocess.run(["ip", "netns", "exec", d, sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=60, cwd=ROOT, env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"})
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["late"] is None and f"tcp/{vd}" in out["available"], (out, time.monotonic() - t_up)
        assert out["vip"] == out["labelled"] == vd
        assert out["default"] is None  # (no default route in there: nothing to wait for)
        assert netif.flags(vd) is None  # (not in this namespace: the probe read its own)
    finally:
        for ns in made:  # (the pair goes with them)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
