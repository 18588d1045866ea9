"""pdpush across hosts, in the hosts harness (pdpush_tools/harness/hosts.py): each host has its own network,
IPC, PID, UTS, mount and time namespace, so nothing passes through shared memory, a pid or a clock reading by
accident. UCX is not told which transport to use: it must find a network one by itself, and every test
asserts what each endpoint uses.

Root only (CI runs as root): on root, a harness that cannot make its namespaces fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdpush import launch
from pdpush.client import status
from pdpush_tools.harness.hosts import Hosts, HostSpec
from tests.helpers import rx_opts, until
from tests.host_engine import LAY, digest, parse_ids, token_kv

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hosts harness needs root (CI runs as root)")

DAY = 86_400


def engine(host, *args: str, own_pid_ns: bool = False) -> subprocess.Popen:
    """tests/host_engine.py inside ``host`` (with a PID namespace of its own: a container beside its daemon)."""
    argv = [sys.executable, "-m", "tests.host_engine", *args]
    if own_pid_ns:
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *argv]
    return host.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path.cwd())


def lines(p: subprocess.Popen, timeout_s: float = 60) -> list[dict]:
    out, err = p.communicate(timeout=timeout_s)
    got = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert got, f"engine printed nothing (rc {p.returncode}):\n{out}\n{err}"
    return got


def next_line(p: subprocess.Popen, timeout_s: float = 60) -> dict:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise AssertionError("the engine said nothing in time")
    line = p.stdout.readline()
    assert line.startswith("{"), (line, p.stderr.read() if p.poll() is not None else "")
    return json.loads(line)


def stop(p: subprocess.Popen, host) -> None:
    if p.poll() is None:
        host.kill(p)


class Pair:
    """A receiver on host ``d`` (its address, no shared memory with ``p``) and a sender on host ``p``."""

    def __init__(self, hosts: Hosts, rx: dict | None = None, tx: dict | None = None) -> None:
        self.p, self.d = hosts["p"], hosts["d"]
        self.rx = launch.start_receiver(self.d.dir, prefix=self.d.prefix(), host=self.d.addr, insecure=True,
                                        local_socket=str(self.d.dir / "rx.sock"), prefault=False,
                                        **{**rx_opts(LAY, pool_pages=64), **(rx or {})})
        try:
            self.tx = launch.start_sender(self.p.dir, prefix=self.p.prefix(),
                                          default_receiver=self.rx.info["control_endpoint"],
                                          ingress_socket=str(self.p.dir / "tx.sock"), staging_bytes=16 << 20,
                                          prefault=False, **(tx or {}))
        except BaseException:
            self.rx.stop()
            raise
        self.tx_sock, self.rx_sock = str(self.p.dir / "tx.sock"), str(self.d.dir / "rx.sock")

    def stop(self) -> None:
        for d in (self.tx, self.rx):
            d.stop()

    def assert_network_transport(self) -> str:
        """Every lane of the sender's endpoint to the receiver, and of the receiver's from it, is a network
        transport on the host's own interface: nothing crossed through shared memory or loopback."""
        tx = json.loads(status(self.tx_sock)["ucx_transports"])
        rx = json.loads(status(self.rx_sock)["ucx_transports"])
        used = " ".join([*tx.values(), *rx])
        assert tx and rx and used, (tx, rx)
        for lane in used.split():
            transport, device = lane.split("/", 1)
            assert transport in ("tcp", "rc", "rc_mlx5", "dc_mlx5", "ud", "ud_mlx5") and device == "eth0", (tx, rx)
        return used


@pytest.mark.parametrize("ahead", ["decode", "prefill"])
def test_a_push_and_its_prefix_reuse_cross_two_hosts_with_clocks_a_day_apart(tmp_path, ahead):
    """The decode host booted a day later than the prefill host (its CLOCK_MONOTONIC a day ahead), or the
    other way round. The engine hands its 4 layers over 50 ms apart, as a prefill's compute would: the
    request must pass byte for byte (before leases crossed the wire as durations, every such request failed
    with the decode host ahead). A second prompt sharing two chunks moves only its new one."""
    spec = {"p": HostSpec(DAY if ahead == "prefill" else 0), "d": HostSpec(DAY if ahead == "decode" else 0)}
    with Hosts.make(tmp_path, spec) as hosts:
        pair = Pair(hosts)
        try:
            first, second = "0:48", "0:32,1000:1016"
            for req, ids, skipped in (("first", first, 0), ("second", second, 2)):
                got = lines(engine(pair.p, "prefill", "--sock", pair.tx_sock, "--req", req, "--ids", ids,
                                   "--gap-ms", "50"))[-1]
                assert got.get("layers") == LAY.layers and got["skipped"] == skipped, got
                read = lines(engine(pair.d, "decode", "--sock", pair.rx_sock, "--req", req, "--ids", ids))[-1]
                k, v = token_kv(LAY, parse_ids(ids))
                assert read.get("k") == digest(k) and read["v"] == digest(v), read
            print("transports:", pair.assert_network_transport())
        finally:
            pair.stop()


def test_an_engine_in_its_own_pid_namespace_that_dies_fails_its_request_at_once(tmp_path):
    """The prefill engine runs in a PID namespace of its own beside its sender (a container), and the decode
    engine likewise beside its receiver. Killed -9 after handing over one layer, the prefill engine's request
    fails within 5 s on the sender, and the decode engine waiting for its layers gets a typed error; not at
    the 30 s lease. (It used to report pid 1, which the sender probed in its own namespace.)"""
    with Hosts.make(tmp_path, ["p", "d"]) as hosts:
        pair = Pair(hosts, rx={"lease_ms": 30_000}, tx={"lease_ms": 30_000})
        pf = dec = None
        try:
            pf = engine(pair.p, "prefill", "--sock", pair.tx_sock, "--req", "dies", "--ids", "0:48",
                        "--die-after", "1", own_pid_ns=True)
            assert next_line(pf) == {"handed": 1}
            dec = engine(pair.d, "decode", "--sock", pair.rx_sock, "--req", "dies", "--ids", "0:48",
                         "--expect-failure", own_pid_ns=True)
            assert next_line(dec) == {"opened": True}
            t0 = time.monotonic()
            pair.p.kill(pf)
            until(lambda: status(pair.tx_sock)["requests_failed"] >= 1, 5, "the sender failing the dead engine's request")
            t_sender = time.monotonic() - t0
            got = next_line(dec, 10)
            t_decode = time.monotonic() - t0
            assert got["error"] in ("Aborted", "BrokenResourceError"), got
            assert t_sender < 5 and t_decode < 5, (t_sender, t_decode)
            until(lambda: status(pair.rx_sock)["leases_active"] == 0, 5, "the receiver freeing the lease")
            print(f"engine death seen: sender {t_sender * 1000:.0f} ms, decode reader {t_decode * 1000:.0f} ms")
        finally:
            for proc, host in ((pf, pair.p), (dec, pair.d)):
                if proc is not None:
                    stop(proc, host)
            pair.stop()


@pytest.mark.parametrize("daemon", ["sender", "receiver"])
def test_a_daemon_killed_is_seen_by_its_engine_in_another_pid_namespace_at_once(tmp_path, daemon):
    """The engine waits on its daemon from a PID namespace of its own: the daemon killed -9 ends that wait
    with a typed error within 5 s, not at the engine's 60 s timeout."""
    with Hosts.make(tmp_path, ["p", "d"]) as hosts:
        pair = Pair(hosts)
        proc = None
        host = pair.p if daemon == "sender" else pair.d
        try:
            if daemon == "sender":  # the engine hands one layer over, then waits for the request's end
                proc = engine(pair.p, "prefill", "--sock", pair.tx_sock, "--req", "w", "--ids", "0:48",
                              "--die-after", "1", "--hang", "--timeout", "60", own_pid_ns=True)
                assert next_line(proc) == {"handed": 1}
            else:  # the decode engine waits for a request that nobody pushes yet
                pf = engine(pair.p, "prefill", "--sock", pair.tx_sock, "--req", "w", "--ids", "0:48",
                            "--die-after", "1")
                assert next_line(pf) == {"handed": 1}
                proc = engine(pair.d, "decode", "--sock", pair.rx_sock, "--req", "w", "--ids", "0:48",
                              "--expect-failure", "--timeout", "60", own_pid_ns=True)
                assert next_line(proc) == {"opened": True}
            time.sleep(0.3)  # the engine is inside its wait
            t0 = time.monotonic()
            (pair.tx if daemon == "sender" else pair.rx).kill()
            got = next_line(proc, 15)
            seen = time.monotonic() - t0
            assert got["error"] == "BrokenResourceError" and "died" in got["message"], got
            assert seen < 5, seen
            print(f"{daemon} death seen by its engine in {seen * 1000:.0f} ms")
            if daemon == "receiver":
                stop(pf, pair.p)
        finally:
            if proc is not None:
                stop(proc, host)
            pair.stop()
