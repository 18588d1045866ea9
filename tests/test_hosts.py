"""The hosts-in-a-box harness (pdpush_tools.harness.hosts): namespaces, links, impairments, process control.
Root only (skipped otherwise); as root, a namespace that can't be made fails the test."""

from __future__ import annotations

import json
import os
import select
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pdpush_tools.harness.hosts import Host, Hosts, HostsError, HostSpec, LinkSpec

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="simulated hosts need root"),
              pytest.mark.timeout(60)]

PY = sys.executable

# small programs run inside the hosts; each prints one line when it is ready
PROGRAMS = {
    "whoami.py": """
        import os, socket, sys, time
        procs = {}
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    procs[p] = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
                except OSError:
                    pass
        print(json.dumps({"hostname": socket.gethostname(), "pid": os.getpid(), "ppid": os.getppid(),
                          "monotonic": time.monotonic(), "procs": procs, "cwd": os.getcwd(),
                          "net": sorted(os.listdir("/sys/class/net")), "shm": sorted(os.listdir("/dev/shm")),
                          "boot_id": open("/proc/sys/kernel/random/boot_id").read()}))
    """,
    "sleeper.py": """
        import sys, time
        print("ready", flush=True)
        time.sleep(60)
    """,
    "counter.py": """
        import sys, time
        n = 0
        print("ready", flush=True)
        while True:
            n += 1
            with open(sys.argv[1] + ".tmp", "w") as f:
                f.write(str(n))
            os.replace(sys.argv[1] + ".tmp", sys.argv[1])
            time.sleep(0.01)
    """,
    "sink.py": """
        # TCP server: total bytes received written to argv[2] after every recv; at EOF prints throughput
        import socket, sys, time
        s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
        print("ready", flush=True)
        c, _ = s.accept()
        n, t0 = 0, None
        while (b := c.recv(1 << 20)):
            t0 = t0 or time.monotonic()
            n += len(b)
            with open(sys.argv[2] + ".tmp", "w") as f:
                f.write(str(n))
            os.replace(sys.argv[2] + ".tmp", sys.argv[2])
        print(json.dumps({"bytes": n, "seconds": time.monotonic() - (t0 or time.monotonic())}), flush=True)
    """,
    "source.py": """
        # TCP client: argv[3] bytes every argv[4] s for argv[5] s (forever if 0)
        import socket, sys, time
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
        chunk, every, for_s = b"x" * int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
        print("ready", flush=True)
        end = time.monotonic() + for_s
        while not for_s or time.monotonic() < end:
            c.sendall(chunk)
            if every:
                time.sleep(every)
        c.close()
    """,
    "echo.py": """
        import socket, sys
        s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
        print("ready", flush=True)
        c, _ = s.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while (b := c.recv(65536)):
            c.sendall(b)
    """,
    "ping.py": """
        import socket, statistics, sys, time
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(int(sys.argv[3])):
            t = time.monotonic()
            c.sendall(b"p")
            assert c.recv(1) == b"p"
            rtts.append((time.monotonic() - t) * 1e3)
        print(json.dumps(rtts))
    """,
    "udp_recv.py": """
        # counts distinct datagram sequence numbers until 1 s without any
        import socket, sys
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        s.bind(("0.0.0.0", int(sys.argv[1])))
        print("ready", flush=True)
        seqs = []
        s.settimeout(30)
        s.recv(2048)
        s.settimeout(1.0)
        try:
            while True:
                seqs.append(int(s.recv(2048)[:8]))
        except socket.timeout:
            pass
        print(json.dumps({"count": len(set(seqs)), "in_order": seqs == sorted(seqs)}), flush=True)
    """,
    "udp_send.py": """
        import socket, sys, time
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        dst = (sys.argv[1], int(sys.argv[2]))
        s.sendto(b"-1".ljust(200), dst)  # the first one waits for ARP; not counted
        time.sleep(0.2)
        for i in range(int(sys.argv[3])):
            s.sendto(str(i).encode().ljust(200), dst)
            if i % 50 == 49:
                time.sleep(0.002)  # paced: no drop but the relay's
    """,
    "term.py": """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(0)))
        print("ready", flush=True)
        time.sleep(60)
        sys.exit(3)
    """,
    "drainer.py": """
        # like pdpush's daemons: SIGTERM when the parent dies, and SIGTERM starts a slow drain
        import ctypes, signal, sys, time
        def drain(*a):
            time.sleep(1.0)
            open(sys.argv[1], "w").write("drained")
            sys.exit(0)
        signal.signal(signal.SIGTERM, drain)
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        print("ready", flush=True)
        time.sleep(60)
    """,
    "shm.py": """
        # SysV shm by key (argv[2]) and a /dev/shm file: "create" or "probe"
        import ctypes, sys
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        key, IPC_CREAT = int(sys.argv[2]), 0o1000
        if sys.argv[1] == "create":
            shmid = libc.shmget(key, 4096, IPC_CREAT | 0o600)
            assert shmid >= 0, ctypes.get_errno()
            addr = libc.shmat(shmid, None, 0)
            ctypes.memmove(addr, b"hello", 5)
            open(f"/dev/shm/pdpush-{key}", "w").write("x")
        shmid = libc.shmget(key, 0, 0)
        found = shmid >= 0 and ctypes.string_at(libc.shmat(shmid, None, 0), 5) == b"hello"
        print(json.dumps({"shm": found, "file": os.path.exists(f"/dev/shm/pdpush-{key}")}))
    """,
}


def write_programs(d: Path) -> None:
    for name, body in PROGRAMS.items():
        (d / name).write_text("import json, os\n" + textwrap.dedent(body))


class Box:
    """Hosts made by a test, closed at its end; programs by name; launched processes reaped."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.made: list[Hosts] = []
        self.procs: list[subprocess.Popen] = []
        write_programs(tmp)

    def make(self, names, **kw) -> Hosts:
        h = Hosts.make(self.tmp / f"box{len(self.made)}", names, **kw)
        self.made.append(h)
        return h

    def start(self, host: Host, prog: str, *args: object, ready: bool = True) -> subprocess.Popen:
        p = host.popen([PY, str(self.tmp / prog), *map(str, args)], stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        if ready:
            assert line(p, 15) == "ready"
        return p

    def run(self, host: Host, prog: str, *args: object, timeout: float = 30):
        r = host.run([PY, str(self.tmp / prog), *map(str, args)], timeout=timeout)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def close(self) -> None:
        for h in self.made:
            h.close()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            if p.stdout:
                p.stdout.close()


@pytest.fixture
def box(tmp_path):
    b = Box(tmp_path)
    try:
        yield b
    finally:
        b.close()


def line(p: subprocess.Popen, timeout_s: float) -> str:
    assert p.stdout is not None
    if not select.select([p.stdout], [], [], timeout_s)[0]:
        raise AssertionError(f"{p.args}: no output within {timeout_s}s")
    return p.stdout.readline().strip()


def until(pred: Callable[[], object], timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (v := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout_s}s")
        time.sleep(0.02)
    return v


def count(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- namespaces ---------------------------------------------------------------------------------------------


def test_hostnames_pids_proc_sys_cwd(box):
    hosts = box.make(["alpha", "beta"])
    a, b = hosts["alpha"], hosts["beta"]
    sleeper = box.start(b, "sleeper.py", "marker-of-beta")
    wa, wb = box.run(a, "whoami.py"), box.run(b, "whoami.py")
    assert (wa["hostname"], wb["hostname"]) == ("alpha", "beta")
    assert wa["pid"] < 50 and wa["ppid"] == 0  # a small pid; the launcher is outside the namespace
    assert wa["cwd"] == os.getcwd()
    assert wa["net"] == ["eth0", "lo"]  # its own /sys
    assert not any("marker-of-beta" in c for c in wa["procs"].values())
    assert any("marker-of-beta" in c for c in wb["procs"].values())
    assert "1" in wa["procs"] and len(wa["procs"]) < 10
    inner = b.inner_pid(sleeper.pid)
    assert inner in b.pids() and b.init_pid in b.pids() and inner not in a.pids()
    assert a.addr != b.addr and a.dir.is_dir() and a.dir != b.dir
    assert len({wa["boot_id"], wb["boot_id"], Path("/proc/sys/kernel/random/boot_id").read_text()}) == 3


@pytest.mark.parametrize("offsets", [(0, 86400), (86400, 0)])
def test_monotonic_clock_offsets(box, offsets):
    hosts = box.make({"a": HostSpec(offsets[0]), "b": HostSpec(offsets[1])})
    for h in hosts:
        t0 = time.monotonic()
        inside = box.run(h, "whoami.py")["monotonic"]
        t1 = time.monotonic()
        assert t0 + h.clock_offset_s <= inside <= t1 + h.clock_offset_s


def test_bad_specs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="clock_offset_s"):
        Hosts.make(tmp_path, {"a": HostSpec(-5)})
    with pytest.raises(ValueError, match="host name"):
        Hosts.make(tmp_path, ["Bad_Name"])


def test_ipc_and_dev_shm_are_per_host(box):
    hosts = box.make(["a", "b"])
    key = 0x5D0000 + os.getpid() % 0xFFFF
    assert box.run(hosts["a"], "shm.py", "create", key) == {"shm": True, "file": True}
    assert box.run(hosts["a"], "shm.py", "probe", key) == {"shm": True, "file": True}
    assert box.run(hosts["b"], "shm.py", "probe", key) == {"shm": False, "file": False}
    assert not Path(f"/dev/shm/pdpush-{key}").exists()


# -- links --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("relay", [False, True])
def test_tcp_cut_and_restore(box, relay):
    hosts = box.make({"a": HostSpec(), "b": HostSpec(link=LinkSpec(relay=relay))})
    a, b = hosts["a"], hosts["b"]
    got = box.tmp / "got"
    box.start(a, "sink.py", 5001, got)
    box.start(b, "source.py", a.addr, 5001, 1000, 0.01, 0)
    until(lambda: count(got) > 10_000, 10, "streaming")
    b.link(False)
    time.sleep(0.3)  # what was in flight lands
    stalled = count(got)
    time.sleep(1.0)
    assert count(got) == stalled, "data crossed a pulled cable"
    b.link(True)
    until(lambda: count(got) > stalled + 10_000, 15, "TCP resuming after the cable is back")


def stream(box: Box, src: Host, dst: Host, seconds: float, port: int) -> float:
    """Mbit/s of one TCP stream from src to dst."""
    sink = box.start(dst, "sink.py", port, box.tmp / f"sink-{port}")
    box.start(src, "source.py", dst.addr, port, 1 << 20, 0, seconds, ready=False)
    r = json.loads(line(sink, seconds + 15))
    return r["bytes"] * 8 / r["seconds"] / 1e6


def test_rate_limit_and_change(box):
    hosts = box.make({"a": HostSpec(), "b": HostSpec(link=LinkSpec(rate_mbit=40))})
    a, b = hosts["a"], hosts["b"]
    assert 25 < stream(box, b, a, 1.5, 5001) < 48
    b.set_rate(None)
    assert stream(box, b, a, 0.5, 5002) > 200
    b.set_rate(15)
    assert 9 < stream(box, a, b, 1.5, 5003) < 18  # the other direction too


def rtts(box: Box, src: Host, dst: Host, port: int, n: int = 30) -> list[float]:
    box.start(dst, "echo.py", port)
    return box.run(src, "ping.py", dst.addr, port, n)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_relayed_delay_and_idle_cost(box):
    hosts = box.make({"a": HostSpec(), "b": HostSpec(link=LinkSpec(delay_ms=5)), "c": HostSpec()})
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    slow = statistics.median(rtts(box, b, a, 5001))
    assert 10.0 <= slow < 16.0, slow  # 5 ms each way
    assert statistics.median(rtts(box, c, a, 5002)) < 2.0
    b.set_link(delay_ms=0)
    assert statistics.median(rtts(box, b, a, 5003)) < 2.0
    relay = b._relay
    assert relay is not None
    before = cpu_s(relay.pid)
    time.sleep(1.0)
    assert cpu_s(relay.pid) - before < 0.05, "the idle relay spins"


def test_relayed_loss(box):
    hosts = box.make({"a": HostSpec(), "b": HostSpec(link=LinkSpec(loss=0.01))}, seed=7)
    a, b = hosts["a"], hosts["b"]
    n = 5000
    recv = box.start(a, "udp_recv.py", 5001)
    assert b.run([PY, str(box.tmp / "udp_send.py"), a.addr, "5001", str(n)], timeout=30).returncode == 0
    received = json.loads(line(recv, 15))["count"]
    lost = b.relay_stats()["host_to_switch"]["lost"]
    assert 0.003 * n <= n - received <= 0.025 * n, (received, lost)
    assert abs((n - received) - lost) <= 3  # the relay lost them (and maybe an ARP/IPv6 frame or two)


def test_relayed_jitter_never_reorders(box):
    hosts = box.make({"a": HostSpec(), "b": HostSpec(link=LinkSpec(delay_ms=3, jitter_ms=3))})
    a, b = hosts["a"], hosts["b"]
    recv = box.start(a, "udp_recv.py", 5001)
    assert b.run([PY, str(box.tmp / "udp_send.py"), a.addr, "5001", "1000"], timeout=30).returncode == 0
    assert json.loads(line(recv, 15)) == {"count": 1000, "in_order": True}
    samples = rtts(box, b, a, 5002, 40)
    assert max(samples) - min(samples) > 1.0  # the delay varies (0 to 6 ms a way, never reordered)


def test_hold_and_release(box):
    hosts = box.make({"a": HostSpec(), "b": HostSpec(link=LinkSpec(relay=True))})
    a, b = hosts["a"], hosts["b"]
    with pytest.raises(HostsError, match="no relay"):
        a.hold()
    got = box.tmp / "got"
    box.start(a, "sink.py", 5001, got)
    box.start(b, "source.py", a.addr, 5001, 1000, 0.01, 0)
    until(lambda: count(got) > 5_000, 10, "streaming")
    b.hold()
    time.sleep(0.2)
    held_at = count(got)
    time.sleep(0.8)
    assert count(got) == held_at
    assert b.relay_stats()["host_to_switch"]["queued"] > 0
    b.release()
    until(lambda: count(got) >= held_at + 50_000, 5, "the held data delivered")  # ~1 s of 100 kB/s


# -- processes ----------------------------------------------------------------------------------------------


def test_freeze_and_thaw(box):
    a = box.make(["a"])["a"]
    n = box.tmp / "n"
    p = box.start(a, "counter.py", n)
    until(lambda: count(n) > 3, 10, "counting")
    assert a.inner_pid(p.pid) in a.freeze()
    time.sleep(0.1)
    frozen = count(n)
    time.sleep(0.4)
    assert count(n) == frozen
    a.thaw()
    until(lambda: count(n) > frozen + 5, 5, "counting again")


def test_freeze_reaches_a_container_within_the_host(box):
    """A process in a PID namespace of its own inside the host (a container's engine: ``unshare --pid``) is the
    host's too: frozen with it. Matched by the host's namespace alone, it counted on while the host was frozen."""
    a = box.make(["a"])["a"]
    n = box.tmp / "n"
    p = a.popen(["unshare", "--pid", "--fork", "--kill-child", PY, str(box.tmp / "counter.py"), str(n)],
                stdout=subprocess.PIPE, text=True)
    box.procs.append(p)
    assert line(p, 15) == "ready"
    until(lambda: count(n) > 3, 10, "counting")
    a.freeze()
    time.sleep(0.1)
    frozen = count(n)
    time.sleep(0.4)
    assert count(n) == frozen, "the container's process counted on while its host was frozen"
    a.thaw()
    until(lambda: count(n) > frozen + 5, 5, "counting again")


def test_crash_kills_everything_and_the_rest_lives(box):
    hosts = box.make({"a": HostSpec(link=LinkSpec(relay=True)), "b": HostSpec()})
    a, b = hosts["a"], hosts["b"]
    ps = [box.start(a, "sleeper.py") for _ in range(2)]
    inner = [a.inner_pid(p.pid) for p in ps]
    init = a.init_pid
    a.crash()
    assert not any(alive(pid) for pid in [init, *inner]) and a.pids() == []
    for p in ps:
        assert p.wait(5) == 128 + signal.SIGKILL
    with pytest.raises(HostsError, match="crashed"):
        a.prefix()
    assert b.run(["true"]).returncode == 0

    def switch_ports() -> str:
        return subprocess.run(["nsenter", f"--net=/proc/{hosts.switch_pid}/ns/net", "ip", "-o", "link"],
                              capture_output=True, text=True, check=True).stdout

    until(lambda: f" {a.port}:" not in switch_ports(), 5, "the crashed host's switch port gone")
    assert f" {b.port}@" in switch_ports()


def test_enter_signals_and_exit_status(box):
    a = box.make(["a"])["a"]
    p = box.start(a, "term.py")
    p.send_signal(signal.SIGTERM)
    assert line(p, 10) == "got SIGTERM"
    assert p.wait(10) == 0
    assert a.run(["sh", "-c", "exit 3"]).returncode == 3
    assert a.run(["sh", "-c", "kill -KILL $$"]).returncode == 128 + signal.SIGKILL
    assert a.run(["no-such-program-here"]).returncode == 127
    p = box.start(a, "term.py")
    inner = a.inner_pid(p.pid)
    p.kill()  # a crash of the launcher is a crash of the command
    assert p.wait(5) == -signal.SIGKILL
    until(lambda: not alive(inner), 5, "the inner process killed with its launcher")
    drained = box.tmp / "drained"
    p = box.start(a, "drainer.py", drained)
    inner = a.inner_pid(p.pid)
    p.kill()  # its own PDEATHSIG would drain it: the host's init SIGKILLs it
    until(lambda: not alive(inner), 0.8, "a command with its own parent-death signal killed with its launcher")
    time.sleep(0.5)
    assert not drained.exists()
    p = box.start(a, "term.py")
    inner = a.inner_pid(p.pid)
    a.kill(p)  # SIGKILL of the command itself
    assert p.returncode == 128 + signal.SIGKILL and not alive(inner) and a.pids() == [a.init_pid]


def root_state() -> tuple[str, str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return netns, "\n".join(sorted(x.split(":")[1] for x in links.splitlines()))


def our_pids(hosts: Hosts) -> list[int]:
    pids = [hosts.switch_pid]
    for h in hosts:
        pids += [h.init_pid, h._unshare.pid, *([h._relay.pid] if h._relay else [])]
    return pids


def test_close_leaves_nothing(box):
    before = root_state()
    hosts = box.make({"a": HostSpec(), "b": HostSpec(link=LinkSpec(relay=True, rate_mbit=100))})
    box.start(hosts["a"], "sleeper.py")
    pids = our_pids(hosts) + hosts["a"].pids()
    hosts.close()
    assert not [p for p in pids if alive(p)]
    assert root_state() == before


def test_sigkill_of_the_owner_leaves_nothing(box):
    before = root_state()
    owner = subprocess.Popen([PY, "-c", textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from pdpush_tools.harness.hosts import Hosts, HostSpec, LinkSpec
        hosts = Hosts.make(Path({str(box.tmp)!r}), {{"a": HostSpec(), "b": HostSpec(link=LinkSpec(delay_ms=1))}})
        p = hosts["a"].popen([sys.executable, "-c", "import time; time.sleep(60)"])
        inner = hosts["a"].inner_pid(p.pid)
        pids = [hosts.switch_pid, inner, p.pid] + [x for h in hosts for x in (h.init_pid, h._unshare.pid)]
        print(json.dumps(pids + [hosts["b"]._relay.pid]), flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    box.procs.append(owner)
    pids = json.loads(line(owner, 20))
    owner.kill()
    owner.wait(5)
    until(lambda: not [p for p in pids if alive(p)], 10, "everything of a SIGKILLed owner gone")
    assert root_state() == before
