"""Operations: Prometheus metrics, systemd notify, unit files, the compose pair, logs and status."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdpush import config as C
from pdpush import launch
from pdpush.client import PrefillClient, status
from pdpush.errors import PdpushError
from pdpush.layout import KVLayout
from tests.helpers import kv, push, rx_opts, sock

ROOT = Path(__file__).resolve().parents[1]
LAY = KVLayout(2, 2, 64, "float16", 16)


def _scrape(endpoint: str) -> dict[str, float]:
    text = urllib.request.urlopen(endpoint, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_move_after_a_transfer(daemons):
    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    rx_ep, tx_ep = rx.info["metrics_endpoint"], tx.info["metrics_endpoint"]
    assert rx_ep.startswith("http://127.0.0.1:") and tx_ep.startswith("http://127.0.0.1:")
    before_rx, before_tx = _scrape(rx_ep), _scrape(tx_ep)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    try:
        k, v = kv(LAY, 40, 1)
        _, done = push(pc, "metered", list(range(40)), k, v)
        push(pc, "metered-2", list(range(40)), k, v)  # all chunks held: 3 hits
        pc.begin("aborted", list(range(900, 916))).abort("test")
    finally:
        pc.close()
    deadline = time.monotonic() + 5
    while True:  # gauges refresh ~10 times a second
        after_rx, after_tx = _scrape(rx_ep), _scrape(tx_ep)
        seen = {"chunks_cached": after_rx.get("pdpush_chunks_cached"),
                "leases_active": after_rx.get("pdpush_leases_active"),
                "aborted": after_tx.get('pdpush_failures_total{reason="aborted"}'),
                "receivers_connected": after_tx.get("pdpush_receivers_connected")}
        if seen == {"chunks_cached": 3, "leases_active": 0, "aborted": 1, "receivers_connected": 1}:
            break
        assert time.monotonic() < deadline, repr((seen, {k: v for k, v in after_tx.items() if "failures" in k}))
        time.sleep(0.05)  # polling the scrape; bounded
    assert after_tx["pdpush_bytes_pushed_total"] - before_tx.get("pdpush_bytes_pushed_total", 0) == done.bytes_sent
    assert after_rx["pdpush_bytes_received_total"] - before_rx.get("pdpush_bytes_received_total", 0) == done.bytes_sent
    assert after_tx["pdpush_layer_transfer_seconds_count"] >= LAY.layers
    assert after_tx["pdpush_alloc_rtt_seconds_count"] >= 2
    assert after_tx["pdpush_request_seconds_count"] == 2 and after_rx["pdpush_request_seconds_count"] == 2
    # timed to the microsecond, not in whole milliseconds (a 0.4 ms round trip read as 0 or 1 ms)
    for m, name in ((after_tx, "pdpush_alloc_rtt_seconds_sum"), (after_tx, "pdpush_request_seconds_sum"),
                    (after_rx, "pdpush_request_seconds_sum")):
        assert abs(m[name] * 1000 - round(m[name] * 1000)) > 1e-6, (name, m[name])
    assert after_tx["pdpush_chunks_hit_total"] == 3 and after_rx["pdpush_chunks_hit_total"] == 3
    assert after_rx["pdpush_chunks_cached"] == 3
    # 3 pages cached, the aborted lease's page waiting (unfenced until its settled Abort, then quarantined for
    # 2 s: on a loaded box either may be over by now), the rest free; its page is settled within moments
    pages = {st: after_rx.get(f'pdpush_pool_pages{{state="{st}"}}', 0) for st in ("free", "quarantined", "unfenced")}
    assert sum(pages.values()) == 61 and pages["free"] >= 60, pages
    deadline = time.monotonic() + 5
    while _scrape(rx_ep).get('pdpush_pool_pages{state="unfenced"}', 0):
        assert time.monotonic() < deadline, "the aborted request's writes never settled"
        time.sleep(0.05)  # polling the scrape; bounded
    assert after_rx["pdpush_leases_active"] == 0
    assert after_tx["pdpush_receivers_connected"] == 1
    assert status(sock(rx))["metrics_endpoint"] == rx_ep


def test_sd_notify_ready_stopping_watchdog(tmp_path):
    path = tmp_path / "notify.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(path))
    srv.settimeout(30)
    d = None
    try:
        d = launch.start_sender(tmp_path, env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"},
                                staging_bytes=8 << 20, prefault=False)
        msgs = []
        while not any("WATCHDOG=1" in m for m in msgs):
            msgs.append(srv.recv(4096).decode())
        assert "READY=1" in msgs[0]
        d.proc.send_signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in msgs):
            msgs.append(srv.recv(4096).decode())
        assert d.proc.wait(15) == 0
    finally:
        srv.close()
        if d is not None:
            d.stop()


@pytest.mark.parametrize("unit", ["pdpush-receiver.service", "pdpush-sender.service"])
def test_systemd_units(tmp_path, unit):
    text = (ROOT / "configs/systemd" / unit).read_text()
    for needle in ("Type=notify", "LimitMEMLOCK=infinity", "NoNewPrivileges=yes", "ProtectSystem=strict",
                   "PrivateTmp=yes", "User=pdpush",
                   "RuntimeDirectoryPreserve=yes",  # the two units share /run/pdpush: one stopping keeps the other's
                   "RestartPreventExitStatus=2",  # a bad config is not restarted every 2 s
                   "StartLimitBurst=5"):  # nor a start that fails every time, or a crash loop, for good
        assert needle in text, needle
    if "receiver" in unit:  # READY=1 after the pool's prefault: longer than systemd's default 90 s on a big pool
        assert re.search(r"TimeoutStartSec=\d+min", text)
    stop = int(re.search(r"TimeoutStopSec=(\d+)", text).group(1))
    role = "receiver" if "receiver" in unit else "sender"
    cfg = C.load(C.ReceiverConfig if role == "receiver" else C.SenderConfig, ROOT / f"configs/{role}.toml")
    assert stop > cfg.drain_timeout_s
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed; the unit's content was checked above")
    # verify with ExecStart pointing at this checkout's real entry point
    exe = Path(sys.executable).parent / f"pdpush-{role}"
    local = tmp_path / unit
    local.write_text(text.replace("/opt/pdpush/.venv/bin/pdpush-" + role, str(exe)))
    r = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if unit in line or "Failed" in line]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr


def test_json_logs_carry_req_id(daemons):
    rx = daemons.receiver(**rx_opts(LAY), log_format="json", log_level="debug")
    tx = daemons.sender(rx, log_format="json")
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    try:
        k, v = kv(LAY, 20, 2)
        push(pc, "logged-req", list(range(20)), k, v)
        with pytest.raises(PdpushError):
            pc.begin("logged-req-2", list(range(20)), receiver="tcp://127.0.0.1:1")  # nobody there
    finally:
        pc.close()
    rx.stop()
    tx.stop()
    for d, rid in ((rx, "logged-req"), (tx, "logged-req-2")):
        lines = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
        assert lines and all({"ts", "level", "msg"} <= set(line) for line in lines)
        assert any(line.get("req_id") == rid for line in lines), d.log()


def test_status_table_readable(daemons):
    rx = daemons.receiver(**rx_opts(LAY))
    cfg = rx.workdir / "rx.toml"
    cfg.write_text(f'local_socket = "{sock(rx)}"\nlayers = 2\n')
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "status", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "120"})
    assert r.returncode == 0 and "pool_pages_free" in r.stdout and "leases_active" in r.stdout


def test_an_exception_in_the_daemon_loop_is_logged_and_the_daemon_serves_on(caplog):
    """The top-level guard covers the whole loop pass, not only frame handling (a bug in reaping
    completions once ended the sender)."""
    import os
    import signal

    from pdpush import daemon

    class Flaky:
        steps = 0
        closed = False
        internal = 0

        def start(self, stop=None) -> dict:
            return {}

        def step(self, timeout_ms: int) -> None:
            self.steps += 1
            if 2 <= self.steps <= 5:
                raise ValueError("a bug in one pass")
            if self.steps == 6:
                raise KeyError("another bug")
            if self.steps == 7:
                os.kill(os.getpid(), signal.SIGTERM)

        def begin_drain(self) -> None:
            pass

        def drained(self) -> bool:
            return self.steps >= 8

        def internal_error(self) -> None:
            self.internal += 1

        def abort_all(self, reason: str) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    server = Flaky()
    try:
        with caplog.at_level("ERROR"):
            assert daemon.run(server, None, 5.0) == 0
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    assert server.steps >= 8 and server.closed
    assert "a bug in one pass" in caplog.text and "serving on" in caplog.text
    # each kind logged at its 1st, 2nd, 4th, ...: a new bug at once, though another repeated before it (the count
    # was one for all kinds: the KeyError, the 5th error, went unlogged); every one counted for the metric
    logged = [r.getMessage() for r in caplog.records if "internal error" in r.getMessage()]
    assert [m.split(" at ")[0] for m in logged] == ["internal error in the daemon loop (ValueError"] * 3 + [
        "internal error in the daemon loop (KeyError"], logged
    assert server.internal == 5


def test_internal_errors_are_exported_as_a_counter():
    from pdpush.metrics import Metrics

    m = Metrics("sender", "127.0.0.1", -1)
    seen = []
    # the shell's loop, and the session's handlers and failed actions (the errors it answers "internal" and serves
    # on: they were only in ``pdpush status``, and the alert on this counter never fired for them). A failed action
    # is the session's internal error too (on_action_failed): the shell's action_errors is not counted again
    for loop, action, session in ((0, 0, 0), (3, 0, 0), (3, 0, 0), (5, 0, 0), (5, 1, 1), (5, 1, 4)):
        m.refresh({"requests_inflight": 0, "loop_errors": loop, "action_errors": action, "internal_errors": session,
                   "receivers_connected": 1, "staging_bytes_free": 0})
        seen.append(m.registry.get_sample_value("pdpush_internal_errors_total"))
    assert seen == [0, 3, 3, 5, 6, 9]


def test_a_peers_transport_lanes_stay_set_between_refreshes_and_go_when_gone():
    """The lanes are set, not cleared and set again on every refresh (a scrape in between found none), and a lane
    that went is removed."""
    import json

    from pdpush.metrics import Metrics

    m = Metrics("sender", "127.0.0.1", -1)
    base = {"requests_inflight": 0, "loop_errors": 0, "receivers_connected": 1, "staging_bytes_free": 0}
    removed = []
    real = m.peer_transport.remove
    m.peer_transport.remove = lambda *lab: (removed.append(lab), real(*lab))
    lanes = {"rx": "tcp/lo sysv/memory"}
    for _ in range(3):
        m.refresh({**base, "ucx_transports": json.dumps(lanes)})
    assert removed == []
    got = m.registry.get_sample_value
    assert got("pdpush_peer_transport_info", {"peer": "rx", "transport": "sysv", "device": "memory"}) == 1
    m.refresh({**base, "ucx_transports": json.dumps({"rx": "tcp/lo"})})
    assert removed == [("rx", "sysv", "memory")]
    assert got("pdpush_peer_transport_info", {"peer": "rx", "transport": "sysv", "device": "memory"}) is None
    assert got("pdpush_peer_transport_info", {"peer": "rx", "transport": "tcp", "device": "lo"}) == 1


@pytest.mark.parametrize("fails", ["drain", "close"])
def test_an_error_after_the_start_exits_1_not_as_a_failed_start_and_keeps_a_successors_ready_file(tmp_path, fails,
                                                                                                   caplog):
    """An error out of the daemon's drain or close, long after its start, is logged and exits 1 (FAILURE); it used to
    escape ``run`` and the CLI reported it as "start-up failed", exit 3. At exit the ready file is removed only where
    it still names this process: a successor that wrote its own since keeps it."""
    import signal

    from pdpush import daemon

    ready = tmp_path / "ready.json"

    class Failing:
        steps = 0

        def start(self, stop=None) -> dict:
            return {}

        def step(self, timeout_ms: int) -> None:
            self.steps += 1
            if self.steps == 3:
                daemon.write_ready_file(str(ready), {"pid": 1})  # a successor's, written over this one's
                os.kill(os.getpid(), signal.SIGTERM)

        def begin_drain(self) -> None:
            if fails == "drain":
                raise ValueError("a bug in the drain")

        def drained(self) -> bool:
            return True

        def abort_all(self, reason: str) -> None:
            pass

        def close(self) -> None:
            if fails == "close":
                raise ValueError("a bug in the close")

    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        with caplog.at_level("ERROR"):
            assert daemon.run(Failing(), str(ready), 5.0) == daemon.ExitCode.FAILURE
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    assert f"a bug in the {fails}" in caplog.text
    assert json.loads(ready.read_text()) == {"pid": 1}


_QUEUES_AND_EXITS = r"""
import sys
from pdpush import control
sock, ep = control.bind_router("127.0.0.1", 0, 4 << 20)
print(ep, flush=True)
ident, _ = sock.recv_multipart()  # the peer's hello
for i in range(32):  # a backlog, the last of it what matters most (a farewell, the last aborts)
    assert control.send_frame(sock, i.to_bytes(4, "little") + bytes(1 << 20), ident)
control.close_peer_socket(sock)
sys.exit(0 if control.shutdown() else 1)
"""


def test_what_a_daemon_queued_for_its_peers_leaves_before_its_process_ends():
    """A daemon's sockets to its peer daemons close with a linger, and the process waits for it (1 s at most):
    closed with none, zmq dropped what a backlog held, the receiver's index farewell and the sender's last aborts
    queued behind it (a review's probe: 151 of 240 large frames delivered)."""
    from pdpush import control

    p = subprocess.Popen([sys.executable, "-c", _QUEUES_AND_EXITS], stdout=subprocess.PIPE, text=True)
    try:
        import zmq

        peer = control.context().socket(zmq.DEALER)
        peer.setsockopt(zmq.RCVHWM, 2)  # a peer that takes frames in as it reads them, a little behind: the
        peer.connect(p.stdout.readline().strip())  # backlog outgrows the kernel's buffers, the rest stays queued
        try:
            peer.send(b"hello")
            time.sleep(0.3)
            got = []
            while peer.poll(5000):
                got.append(int.from_bytes(peer.recv()[:4], "little"))
                if got[-1] == 31:
                    break
        finally:
            peer.close(0)
        assert p.wait(30) == 0
        assert got == list(range(32)), f"{len(got)} of 32 frames came"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_second_daemon_never_takes_over_a_live_socket(tmp_path):
    """Two senders on one host with the same socket: the second stops with the reason (it used to
    unlink the first one's socket as stale and take its engines)."""
    tx = launch.start_sender(tmp_path, staging_bytes=8 << 20)
    try:
        path = tx.info["ingress_endpoint"].removeprefix("ipc://")
        with pytest.raises(RuntimeError, match="another process serves"):
            launch.start_sender(tmp_path, staging_bytes=8 << 20, ingress_socket=path)
        assert status(path)["role"] == "sender"
    finally:
        tx.stop()
    assert C.default_sender_socket(9711).name == "sender-9711.sock" and C.default_sender_socket(-1).name == "sender.sock"


@pytest.mark.parametrize("how", ["clean", "raises", "keep"])
def test_scratch_directories_go_at_exit_unless_a_failure_needs_their_logs(tmp_path, how):
    """launch.scratch_dir (the benches' and harness's daemons' sockets and logs): removed when the process exits
    normally; kept, and named, when it ends on an unhandled exception or with PDPUSH_KEEP_SCRATCH set."""
    code = ("import sys; from pdpush import launch; d = launch.scratch_dir('pdpush-scratch-test-'); "
            "(d / 'sender.log').write_text('x'); print(d, flush=True); "
            + ("raise RuntimeError('the run failed')" if how == "raises" else "sys.exit(0)"))
    env = {k: v for k, v in os.environ.items() if k != "PDPUSH_KEEP_SCRATCH"}
    if how == "keep":
        env["PDPUSH_KEEP_SCRATCH"] = "1"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    d = Path(p.stdout.strip())
    try:
        assert d.name.startswith("pdpush-scratch-test-"), p
        if how == "clean":
            assert p.returncode == 0 and not d.exists(), p.stderr
        else:
            assert (d / "sender.log").exists() and f"kept {d}" in p.stderr, p.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_tool_stopped_by_sigterm_stops_its_daemons_and_removes_its_scratch_directory():
    """A bench or demo told to stop (SIGTERM, as a CI timeout or ``kill`` sends) runs its ``finally`` blocks and
    exit hooks (``launch.exit_on_signals``): the receiver it started is stopped by pid and its scratch
    directory goes. A signal's default action skipped both, and left the directory in /tmp."""
    code = ("import time; from pdpush import launch\n"
            "with launch.exit_on_signals():\n"
            "    d = launch.scratch_dir('pdpush-scratch-test-')\n"
            "    rx = launch.start_receiver(d, pool_pages=2, layers=2, kv_heads=1, head_dim=16, dtype='float16',"
            " chunk_tokens=8)\n"
            "    try:\n"
            "        print(d, rx.pid, flush=True)\n"
            "        time.sleep(120)\n"
            "    finally:\n"
            "        rx.stop()\n")
    env = {k: v for k, v in os.environ.items() if k != "PDPUSH_KEEP_SCRATCH"}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    d, rx_pid = None, None
    try:
        line = p.stdout.readline().split()
        assert len(line) == 2, p.stderr.read() if p.poll() is not None else line
        d, rx_pid = Path(line[0]), int(line[1])
        assert d.exists() and launch.pid_alive(rx_pid)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 128 + signal.SIGTERM, p.stderr.read()
        assert not d.exists(), p.stderr.read()
        assert not launch.pid_alive(rx_pid)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        if rx_pid is not None and launch.pid_alive(rx_pid):
            os.kill(rx_pid, signal.SIGKILL)
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


def test_a_receiver_on_ipv6_loopback_is_reached_byte_for_byte(daemons):
    """A receiver bound to an IPv6 address, named by it (``tcp://[::1]:port``): the sender's control socket must
    be told IPv6 (libzmq otherwise sent it nothing, and every request waited out its deadline). UCX's tcp lanes
    take an IPv4 address unless ``UCX_TCP_AF_PRIO`` puts inet6 first, on both daemons (docs/operations.md)."""
    from pdpush.client import DecodeClient
    from tests.helpers import read_back

    lay = KVLayout(4, 2, 16, "float16", 8)
    v6 = {"UCX_TCP_AF_PRIO": "inet6,inet"}
    rx = daemons.receiver(**rx_opts(lay), host="::1", env=v6)
    assert rx.info["control_endpoint"].startswith("tcp://[::1]:")
    tx = daemons.sender(rx, control_timeout_ms=3000, env=v6)
    pc, dc = PrefillClient(lay, sock(tx), timeout_s=10), DecodeClient(sock(rx), timeout_s=10)
    try:
        k, v = kv(lay, 24, seed=5)
        push(pc, "v6", list(range(24)), k, v)
        gk, gv = read_back(dc, "v6", lay, 24)
        assert (gk == k).all() and (gv == v).all()
    finally:
        pc.close()
        dc.close()


def _receiver_toml(tmp_path: Path, name: str, **over) -> Path:
    f = tmp_path / f"{name}.toml"
    opts = {**rx_opts(LAY), "control_port": 0, "ucx_port": 0, "metrics_port": -1,
            "local_socket": str(tmp_path / f"{name}.sock"), "ready_file": str(tmp_path / f"{name}.ready"), **over}
    f.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in opts.items() if v is not None))
    return f


def test_a_signal_while_the_daemon_starts_stops_it_then_and_a_failed_start_keeps_anothers_ready_file(tmp_path):
    """SIGTERM while the receiver faults in its pool (minutes, on a big one) stops it there, exit 0, nothing served:
    the signal used to be only counted until the start was done. And a second receiver whose start fails (its control
    port is the first one's: exit 3) leaves the first one's ready file alone: it removed it, though it never wrote
    it, and whatever waited on that file saw a live daemon as gone."""
    log = tmp_path / "big.log"
    cfg = _receiver_toml(tmp_path, "big", pool_pages=131072, prefault=True)  # 2 GiB: about 2 s of prefault here
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "pdpush.cli_entry", "receiver", "--config", str(cfg)],
                             stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "transports:" not in log.read_text():  # logged just before the pool is made and faulted in
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.01)  # polling its log; bounded
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, log.read_text()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    text = log.read_text()
    assert "stopped while starting" in text and "ready:" not in text, text[-2000:]
    assert not (tmp_path / "big.ready").exists()
    # a live receiver's ready file, and a second receiver on its control port
    first = launch.start_receiver(tmp_path, **rx_opts(LAY), prefault=False)
    try:
        port = int(first.info["control_endpoint"].rsplit(":", 1)[1])
        ready = tmp_path / "first.ready"
        ready.write_text(json.dumps(first.info))  # (as its own ready file: what a supervisor waits on)
        cfg2 = _receiver_toml(tmp_path, "second", control_port=port, prefault=False, ready_file=str(ready))
        r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "receiver", "--config", str(cfg2)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 3 and "another process listens" in r.stderr, r.stderr[-2000:]
        assert ready.exists()
    finally:
        first.stop()


@pytest.mark.parametrize("launcher, parent, same_ns, drains", [("1", 1, True, False), ("1", 1, False, True),
                                                               ("4242", 1, True, True), ("4242", 4242, True, False)])
def test_a_daemon_drains_at_start_only_where_its_launcher_died(monkeypatch, launcher, parent, same_ns, drains):
    """Started by a launcher (pdpush.launch: tests, bench, demo), a daemon drains if the launcher died before the
    daemon could tie itself to it (it was reparented, to PID 1). A launcher that is PID 1 itself, a container's
    entrypoint in the daemon's own PID namespace, is alive: its daemons used to drain right after they were ready.
    PID 1 of another namespace (a launcher that entered a host's) is init there: its daemon was orphaned."""
    from pdpush import daemon

    monkeypatch.setenv("PDPUSH_LAUNCHER_PIDNS", os.readlink("/proc/self/ns/pid") if same_ns else "pid:[1]")
    monkeypatch.setenv("PDPUSH_LAUNCHER_PID", launcher)
    monkeypatch.setattr(launch, "die_with_parent", lambda sig: None)
    monkeypatch.setattr(os, "getppid", lambda: parent)
    signals = {"count": 0}
    daemon.die_with_launcher(signals)
    assert signals["count"] == int(drains)


def test_a_router_whose_launcher_died_before_it_was_up_does_not_serve(monkeypatch):
    """The router ignored what ``die_with_launcher`` found: orphaned in its own session, it served on with nobody
    to stop it. It now returns before it builds or binds anything."""
    from pdpush.config import RouterConfig
    from pdpush.router import app

    monkeypatch.setenv("PDPUSH_LAUNCHER_PIDNS", os.readlink("/proc/self/ns/pid"))
    monkeypatch.setenv("PDPUSH_LAUNCHER_PID", "4242")
    monkeypatch.setattr(launch, "die_with_parent", lambda sig: None)
    monkeypatch.setattr(os, "getppid", lambda: 1)  # reparented: the launcher is gone

    def built(*a, **k):
        raise AssertionError("the router was built")

    monkeypatch.setattr(app, "Router", built)
    app.serve(RouterConfig(prefill=["http://a:8100"], decode=[{"url": "http://b:8100", "receiver": "tcp://127.0.0.1:1"}]))


@pytest.mark.parametrize("signals_sent", [1, 2])
def test_a_signal_during_start_ends_it_having_served_nothing(tmp_path, signals_sent):
    """``daemon.run`` with a stand-in server whose start waits, as a prefault does, until told to stop: SIGTERM (and
    a second signal on its heels) ends the start, and the daemon exits 0 without a ready file or a pass of its loop.
    The handler only counts: nothing is raised inside the start (a raise there could land between a segment's
    creation and its removal mark, and leak it)."""
    import threading

    from pdpush import daemon

    class Starting:
        steps, closed, stopped = 0, False, False

        def start(self, stop=None):
            deadline = time.monotonic() + 30
            while not stop():
                assert time.monotonic() < deadline, "never told to stop"
                time.sleep(0.005)
            self.stopped = True
            return {}

        def step(self, timeout_ms):
            self.steps += 1

        def close(self):
            self.closed = True

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    server = Starting()
    timers = [threading.Timer(0.2 + 0.01 * i, os.kill, (os.getpid(), signal.SIGTERM if i == 0 else signal.SIGINT))
              for i in range(signals_sent)]
    try:
        for t in timers:
            t.start()
        code = daemon.run(server, str(tmp_path / "ready.json"), drain_timeout_s=5)
    finally:
        for t in timers:  # every signal sent (and handled by the daemon's handler) before pytest's come back
            t.join(10)
        time.sleep(0.05)
        for s, h in old.items():
            signal.signal(s, h)
    assert code == 0 and server.stopped and server.closed and server.steps == 0
    assert not (tmp_path / "ready.json").exists()


def test_a_daemon_whose_launcher_is_gone_does_not_start(monkeypatch, tmp_path):
    """The launcher died before the daemon could tie itself to it: the daemon exits 0 without making its pool or
    binding a port (it used to start whole, announce itself ready, then drain)."""
    from pdpush import daemon

    class Never:
        started = closed = False

        def start(self, stop=None):
            self.started = True
            return {}

        def close(self):
            self.closed = True

    monkeypatch.setattr(daemon, "die_with_launcher", lambda signals: signals.__setitem__("count", 1))
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    server = Never()
    try:
        code = daemon.run(server, str(tmp_path / "ready.json"), drain_timeout_s=5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert code == 0 and not server.started and server.closed and not (tmp_path / "ready.json").exists()
