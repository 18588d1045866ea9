"""Hosts in a box: several simulated hosts on one Linux machine (root only), for tests that need separate
machines: each host has its own network, IPC, PID (its own /proc), UTS (hostname), mount (its own /dev/shm
tmpfs and /sys) and time namespace (CLOCK_MONOTONIC and CLOCK_BOOTTIME ahead by ``clock_offset_s``), all
hosts joined through a Linux bridge in a private "switch" network namespace. Each host also has its own boot
id and /etc/machine-id (UCX takes the boot id for its system id). Nothing is created in the root network
namespace and no ``ip netns`` name is used: every namespace lives exactly as long as the processes started
here, which ask for SIGKILL when the thread that started them dies (``PR_SET_PDEATHSIG``), so even a
SIGKILLed test leaves nothing behind; make the hosts from a thread that outlives them (the main one).

Not separate: the filesystem but /etc/hosts and /etc/resolv.conf (a unix socket bound to a path is reachable from every host, so give each host
its own paths, e.g. under ``Host.dir``; abstract ones are per host), CLOCK_REALTIME (no namespace has it: the
hosts' wall clocks agree, like NTP-synced machines), the CPUs, memory and cgroups, users.

    with Hosts.make(tmp_path, {"a": HostSpec(), "b": HostSpec(86400, LinkSpec(delay_ms=5))}) as hosts:
        p = hosts["a"].popen([sys.executable, "server.py"])     # runs inside host a
        hosts["b"].run([sys.executable, "client.py", hosts["a"].addr], timeout=30)

Each host is an init process (``unshare ... python -m pdpush_tools.harness.hosts --init NAME``, PID 1 of its
namespace: sets the hostname, mounts /dev/shm and /sys, gives the host its own /etc/hosts and /etc/resolv.conf
(``Host.etc``), brings ``lo`` up, reaps orphans); commands enter it
through ``python -m pdpush_tools.harness.enter <init_pid> -- cmd`` (``Host.prefix()``).

The links, and how faithful each impairment is:

* plain link: a veth pair, ``eth0`` (``10.213.<random>.<i+1>/24``, MTU ``mtu``, 1500 by default) in the host,
  its peer a port of ``br0`` in the switch namespace. Kernel speed, TSO/GSO on.
* ``rate_mbit``: ``tbf`` on both ends (host egress and switch-port egress), settable at any time
  (``set_rate``): a token bucket with a burst of ~2 ms of traffic (at least 32 KiB) and a 50 ms queue, so
  throughput is shaped to ~the rate and a bulk flow sees up to ~50 ms of queueing delay, like a small
  switch buffer; beyond that, tail drop.
* ``link(False)``: the switch-side port goes down, the host's ``eth0`` loses carrier (a pulled cable): its
  frames are dropped and TCP retransmits with backoff, resuming at its next RTO after ``link(True)``.
* ``delay_ms``, ``jitter_ms``, ``loss`` (or ``relay=True``): the host's ``eth0`` is a TAP device and a
  user-space relay (``relay.py``, see its docstring for the details) forwards its frames to a TAP port of
  ``br0``, impairing both directions the same way: each direction FIFO (jitter never reorders), Bernoulli
  loss per frame, timing within ~0.3 ms of the due time on an idle box. ``hold()``/``release()`` queue
  every frame then forward the lot in order (a partition that heals without loss); ``set_link`` changes
  the impairments. The relay is one Python process (a core when busy, nothing when idle): measured ~0.9-1.2
  Gbit/s of one TCP stream at MTU 1500 (~0.8 with a delay), ~3.3 Gbit/s at MTU 9000, on a 2-core VM; it adds
  ~0.03 ms of RTT without delay, and ~0.15-0.35 ms a pass with one (the VM's timer wakeup latency); a relayed
  link's ``eth0`` has no offloads.
* ``freeze()``: SIGSTOP of every process of the host but its init (the kernel still ACKs TCP until the
  socket buffers fill, unlike a frozen VM); ``crash()``: SIGKILL of the init, which kills every process of
  the host at once, and the host's link disappears.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdpush.launch import die_with_parent
from pdpush_tools.harness.enter import INIT_SOCKET

NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,31}")
CMD_TIMEOUT_S = 10.0  # one ip/tc command, one relay command
ETC_OWN = ("hosts", "resolv.conf")  # files of /etc each host has its own copy of (Host.etc)


class HostsError(RuntimeError):
    """A namespace, link or process of the simulated hosts could not be set up or driven."""


@dataclass(frozen=True)
class LinkSpec:
    """Impairments of a host's link to the switch. Any delay, jitter or loss (or ``relay=True``, to change
    them or ``hold()`` later) puts a user-space relay on the link."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    rate_mbit: float | None = None
    relay: bool = False

    @property
    def relayed(self) -> bool:
        return self.relay or bool(self.delay_ms or self.jitter_ms or self.loss)


@dataclass(frozen=True)
class HostSpec:
    clock_offset_s: int = 0  # CLOCK_MONOTONIC and CLOCK_BOOTTIME ahead of the machine's by this (>= 0)
    link: LinkSpec | None = None


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL when the thread that started us dies."""
    if not die_with_parent(signal.SIGKILL):
        os._exit(127)


def _ns_run(pid: int, argv: Sequence[str], stdin: str | None = None) -> str:
    """``argv`` in the network namespace of ``pid``; its stdout, or HostsError with its stderr."""
    full = ["nsenter", f"--net=/proc/{pid}/ns/net", "--", *argv]
    try:
        r = subprocess.run(full, input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT_S,
                           preexec_fn=_die_with_parent)
    except subprocess.TimeoutExpired as e:
        raise HostsError(f"{' '.join(argv)} in netns of {pid}: no answer in {CMD_TIMEOUT_S}s") from e
    if r.returncode != 0:
        what = " ".join(argv) + (f" <<{stdin!r}" if stdin else "")
        raise HostsError(f"{what} in netns of {pid} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _ns_id(pid: int, ns: str) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/{ns}")
    except OSError:
        return None
    return st.st_dev, st.st_ino


NS_GET_PARENT = 0xB702  # ioctl on a namespace's fd: its parent's (linux/nsfs.h, _IO(0xb7, 0x2))


def _pidns_within(pid: int, ns: tuple[int, int]) -> bool:
    """Whether ``pid``'s PID namespace is ``ns`` or one nested inside it (a container's within a host: ``unshare
    --pid``), walked up through its parents."""
    try:
        fd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY)
    except OSError:
        return False
    try:
        for _ in range(32):  # (the kernel nests PID namespaces 32 deep at most)
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == ns:
                return True
            try:
                parent = fcntl.ioctl(fd, NS_GET_PARENT)
            except OSError:  # the root of what this process sees
                return False
            os.close(fd)
            fd = parent
        return False
    finally:
        os.close(fd)


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stop(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """SIGKILL and reap one of our processes."""
    if proc.poll() is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired as e:
            raise HostsError(f"pid {proc.pid} ({proc.args!r}) still alive {timeout_s}s after SIGKILL") from e


def _tbf(mbit: float, mtu: int) -> list[str]:
    bytes_s = mbit * 125_000
    burst = max(32768, 4 * mtu, int(bytes_s * 0.002))
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms"]


@dataclass(eq=False)
class Host:
    name: str
    addr: str
    init_pid: int
    clock_offset_s: int
    dir: Path
    spec: HostSpec
    _hosts: Hosts = field(repr=False)
    _index: int = field(repr=False)
    _unshare: subprocess.Popen = field(repr=False)
    _relay: subprocess.Popen | None = field(default=None, repr=False)
    _relay_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _rate: float | None = field(default=None, repr=False)
    _pidns: tuple[int, int] | None = field(default=None, repr=False)
    crashed: bool = False

    # -- running things inside ------------------------------------------------------------------------------

    def prefix(self) -> list[str]:
        """The argv prefix that runs a command inside this host."""
        self._alive()
        return [sys.executable, "-m", "pdpush_tools.harness.enter", str(self.init_pid), "--"]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """``argv`` inside this host; the Popen is the launcher's (signals are forwarded, see enter.py)."""
        return subprocess.Popen([*self.prefix(), *argv], **kw)

    def run(self, argv: Sequence[str], timeout: float = 30.0, **kw: Any) -> subprocess.CompletedProcess:
        """``argv`` inside this host to completion (text output captured unless told otherwise)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run([*self.prefix(), *argv], timeout=timeout, **kw)

    def etc(self, name: str) -> Path:
        """The file this host reads as ``/etc/<name>`` (``hosts`` or ``resolv.conf``), a copy of the machine's
        at the start: write it in place (``write_text``) to change this host's name lookups alone."""
        if name not in ETC_OWN:
            raise HostsError(f"/etc/{name} is the machine's, shared by every host; a host has its own {ETC_OWN}")
        path = self.dir / f".etc-{name}"
        if not path.exists():
            raise HostsError(f"this machine has no /etc/{name}, so host {self.name} has none of its own")
        return path

    def pids(self) -> list[int]:
        """Every live process of this host (its PID namespace, and those nested in it: a container's), as
        root-namespace pids, the init included. (Zombies are left out: see ``kill`` for the ones a SIGKILLed
        launcher leaves.)"""
        if self._pidns is None:
            return []
        return [p for p in _all_pids() if (_ns_id(p, "pid") == self._pidns or _pidns_within(p, self._pidns))
                and _state(p) not in ("Z", None)]

    def inner_pid(self, outer_pid: int, timeout_s: float = 5.0) -> int:
        """The root-namespace pid of the command that the ``enter`` launcher ``outer_pid`` runs."""
        deadline = time.monotonic() + timeout_s
        while True:
            for p in _all_pids():
                if _ppid(p) == outer_pid and _ns_id(p, "pid") == self._pidns:
                    return p
            if _ppid(outer_pid) is None:
                raise HostsError(f"launcher {outer_pid} is gone: no command of {self.name} to find")
            if time.monotonic() > deadline:
                raise HostsError(f"launcher {outer_pid} has no child in {self.name} after {timeout_s}s")
            time.sleep(0.01)  # bounded polling: the launcher forks right after joining the namespaces

    def kill(self, launcher: subprocess.Popen, timeout_s: float = 5.0) -> None:
        """Crash one command started by ``popen``: SIGKILL the command itself, then reap the launcher.
        ``launcher.kill()`` crashes it too (see enter.py), but its zombie is then reparented to the
        machine's init (the launcher's reaper, outside the host) and the host can't finish crashing until
        that init reaps it (about a second here)."""
        if launcher.poll() is None:
            try:
                os.kill(self.inner_pid(launcher.pid, timeout_s), signal.SIGKILL)
            except (HostsError, ProcessLookupError):
                launcher.kill()
        launcher.wait(timeout_s)

    def freeze(self, timeout_s: float = 5.0) -> list[int]:
        """SIGSTOP every process of the host but its init, rescanning until no new one appears."""
        self._alive()
        stopped: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while True:
            new = [p for p in self.pids() if p != self.init_pid and p not in stopped]
            if not new:
                return sorted(stopped)
            if time.monotonic() > deadline:
                raise HostsError(f"{self.name}: processes kept appearing for {timeout_s}s while freezing")
            for p in new:
                try:
                    os.kill(p, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
                stopped.add(p)

    def thaw(self) -> None:
        """SIGCONT every process of the host."""
        for p in self.pids():
            if p != self.init_pid:
                try:
                    os.kill(p, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def crash(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the init: the kernel kills every process of the host; returns when all are gone. The
        host can't be used afterwards."""
        if self.crashed:
            return
        self.crashed = True
        try:
            os.kill(self.init_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        try:
            self._unshare.wait(timeout_s)
        except subprocess.TimeoutExpired as e:
            zombies = [(p, _ppid(p)) for p in _all_pids() if _ns_id(p, "pid") == self._pidns and _state(p) == "Z"]
            raise HostsError(f"{self.name}: init {self.init_pid} not gone {timeout_s}s after SIGKILL; the kernel "
                             f"waits for these zombies (pid, parent) to be reaped: {zombies}") from e
        while left := self.pids():
            if time.monotonic() > deadline:
                raise HostsError(f"{self.name}: processes {left} still alive {timeout_s}s after the crash")
            time.sleep(0.01)  # bounded polling for the kernel's reaping
        if self._relay is not None:
            _stop(self._relay)

    # -- the link ------------------------------------------------------------------------------------------

    @property
    def port(self) -> str:
        """This host's port on the switch's bridge (a device of the switch namespace)."""
        return f"p{self._index}"

    def link(self, up: bool) -> None:
        """Plug (True) or pull (False) the cable: the switch port goes up/down, the host's eth0 gains/loses
        carrier."""
        self._alive()
        if self._relay is not None:
            self._relay_cmd("up" if up else "down")
        _ns_run(self._hosts.switch_pid, ["ip", "link", "set", self.port, "up" if up else "down"])

    def set_rate(self, mbit: float | None) -> None:
        """Shape both directions of the link to ``mbit`` (tbf), or remove the shaping (None)."""
        self._alive()
        if mbit is not None and mbit <= 0:
            raise ValueError(f"rate must be > 0 Mbit/s, not {mbit}")
        for pid, dev in ((self.init_pid, "eth0"), (self._hosts.switch_pid, self.port)):
            if mbit is not None:
                _ns_run(pid, ["tc", "qdisc", "replace", "dev", dev, "root", *_tbf(mbit, self._hosts.mtu)])
            elif self._rate is not None:
                _ns_run(pid, ["tc", "qdisc", "del", "dev", dev, "root"])
        self._rate = mbit

    def set_link(self, delay_ms: float = 0.0, jitter_ms: float = 0.0, loss: float = 0.0) -> None:
        """Change a relayed link's impairments (both directions)."""
        self._relay_cmd(f"set {delay_ms} {jitter_ms} {loss}")

    def hold(self) -> None:
        """Relayed links: queue every frame both ways, forward none (a partition that will heal)."""
        self._relay_cmd("hold")

    def release(self) -> None:
        """Relayed links: forward everything held, in order, and go on forwarding."""
        self._relay_cmd("release")

    def relay_stats(self) -> dict:
        """Relayed links: the relay's counters, {"host_to_switch": {...}, "switch_to_host": {...}}."""
        return json.loads(self._relay_cmd("stats"))

    def _relay_cmd(self, line: str) -> str:
        self._alive()
        relay = self._relay
        if relay is None:
            raise HostsError(f"{self.name}: its link has no relay (give it LinkSpec(relay=True) or a delay, "
                             "jitter or loss) for hold/release/set_link/relay_stats")
        with self._relay_lock:
            if relay.poll() is not None:
                raise HostsError(f"{self.name}: its relay exited with {relay.returncode}")
            assert relay.stdin is not None and relay.stdout is not None
            relay.stdin.write(line + "\n")
            relay.stdin.flush()
            reply = _readline(relay.stdout, CMD_TIMEOUT_S, f"{self.name}'s relay answering {line!r}")
        if not reply.startswith("ok"):
            raise HostsError(f"{self.name}'s relay refused {line!r}: {reply}")
        return reply[2:].strip()

    def _alive(self) -> None:
        if self.crashed:
            raise HostsError(f"host {self.name} has crashed (or the hosts were closed)")


def _readline(stream: Any, timeout_s: float, what: str) -> str:
    """One line from a pipe of ours, with a deadline."""
    p = select.poll()  # (poll, not select: a process with more than 1,024 fds open has them numbered past select's)
    p.register(stream, select.POLLIN)
    if not p.poll(timeout_s * 1000):
        raise HostsError(f"{what}: nothing within {timeout_s}s")
    line = stream.readline()
    if not line:
        raise HostsError(f"{what}: the process closed its output")
    return line.strip()


@dataclass(eq=False)
class Hosts:
    """The simulated hosts and their switch; ``close()`` (or the ``with`` block's end) removes everything."""

    workdir: Path
    mtu: int
    subnet: int
    switch_pid: int = 0
    hosts: dict[str, Host] = field(default_factory=dict)
    _switch: subprocess.Popen | None = field(default=None, repr=False)
    _pending: list[subprocess.Popen] = field(default_factory=list, repr=False)  # inits not yet in ``hosts``
    _closed: bool = False

    @classmethod
    def make(cls, workdir: Path, names: list[str] | dict[str, HostSpec], *, mtu: int = 1500,
             seed: int | None = None, timeout_s: float = 20.0) -> Hosts:
        specs = dict(names) if isinstance(names, dict) else {n: HostSpec() for n in names}
        for name, spec in specs.items():
            if not NAME_RE.fullmatch(name):
                raise ValueError(f"host name {name!r}: lowercase letters, digits and '-', at most 32")
            if not isinstance(spec.clock_offset_s, int) or spec.clock_offset_s < 0:
                raise ValueError(f"host {name}: clock_offset_s must be an int >= 0 (the kernel refuses a "
                                 f"negative monotonic clock), not {spec.clock_offset_s!r}")
        if not 0 < len(specs) < 255:
            raise ValueError(f"1 to 254 hosts, not {len(specs)}")
        if os.geteuid() != 0:
            raise HostsError("simulated hosts need root (namespaces, bridges, TAP devices)")
        rng = random.Random(seed)
        self = cls(Path(workdir), mtu, rng.randrange(256))
        try:
            self._start_switch()
            for name, spec in specs.items():  # every init starts at once, then each is wired up
                self._pending.append(self._start_init(name, spec))
            for i, (name, spec) in enumerate(specs.items()):
                self._finish_host(i, name, spec, self._pending[i], timeout_s, rng.randrange(2**31))
        except BaseException:
            self.close()
            raise
        return self

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts.values())

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_switch(self) -> None:
        self._switch = subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"], stdin=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
        self.switch_pid = self._switch.pid
        deadline = time.monotonic() + CMD_TIMEOUT_S
        root_net = _ns_id(os.getpid(), "net")
        while _ns_id(self.switch_pid, "net") in (root_net, None):  # unshare has not exec'd sleep yet
            if self._switch.poll() is not None:
                raise HostsError(f"unshare --net failed: {self._switch.stderr.read().decode().strip()}")
            if time.monotonic() > deadline:
                raise HostsError(f"the switch namespace was not made within {CMD_TIMEOUT_S}s")
            time.sleep(0.005)  # bounded polling
        _ns_run(self.switch_pid, ["ip", "-b", "-"],
                "link set lo up\n"
                f"link add br0 mtu {self.mtu} type bridge forward_delay 0 stp_state 0\n"
                "link set br0 up\n")

    def _start_init(self, name: str, spec: HostSpec) -> subprocess.Popen:
        hdir = self.workdir / name
        hdir.mkdir(parents=True, exist_ok=True)
        off = str(spec.clock_offset_s)
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--net", "--ipc", "--uts", "--mount", "--time",
                "--monotonic", off, "--boottime", off, "--kill-child", "--",
                sys.executable, "-m", "pdpush_tools.harness.hosts", "--init", name, str(hdir)]
        with open(hdir / "init.log", "wb") as log:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                    text=True, preexec_fn=_die_with_parent)

    def _finish_host(self, i: int, name: str, spec: HostSpec, proc: subprocess.Popen, timeout_s: float,
                     seed: int) -> Host:
        """Wait for the init of host ``name``, then give it its link."""
        hdir = self.workdir / name

        def failed(why: str) -> HostsError:
            log = (hdir / "init.log").read_text(errors="replace")[-4000:]
            return HostsError(f"host {name}: {why}; its init.log:\n{log}")

        try:
            line = _readline(proc.stdout, timeout_s, f"host {name}'s init")
        except HostsError as e:
            raise failed(str(e)) from e
        if line != "ready":
            raise failed(f"its init said {line!r}")
        assert proc.stdout is not None
        proc.stdout.close()
        inits = [p for p in _all_pids() if _ppid(p) == proc.pid]
        if len(inits) != 1:
            raise failed(f"unshare {proc.pid} has children {inits}, not one init")
        init_pid = inits[0]
        host = Host(name=name, addr=f"10.213.{self.subnet}.{i + 1}", init_pid=init_pid,
                    clock_offset_s=spec.clock_offset_s, dir=hdir, spec=spec, _hosts=self, _index=i,
                    _unshare=proc, _pidns=_ns_id(init_pid, "pid"))
        self.hosts[name] = host  # from here on, close() removes it
        link = spec.link or LinkSpec()
        if link.relayed:
            argv = [sys.executable, "-m", "pdpush_tools.harness.relay",
                    "--host-ns", f"/proc/{init_pid}/ns/net", "--host-if", "eth0",
                    "--switch-ns", f"/proc/{self.switch_pid}/ns/net", "--switch-if", host.port,
                    "--delay-ms", str(link.delay_ms), "--jitter-ms", str(link.jitter_ms), "--loss", str(link.loss),
                    "--seed", str(seed)]
            with open(hdir / "relay.log", "wb") as relay_log:
                host._relay = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=relay_log,
                                               text=True, preexec_fn=_die_with_parent)
            try:
                line = _readline(host._relay.stdout, timeout_s, f"host {name}'s relay")
            except HostsError as e:
                log = (hdir / "relay.log").read_text(errors="replace")[-4000:]
                raise HostsError(f"{e}; its relay.log:\n{log}") from e
            if line != "ready":
                raise HostsError(f"host {name}'s relay said {line!r}")
            _ns_run(self.switch_pid, ["ip", "link", "set", host.port, "mtu", str(self.mtu), "master", "br0", "up"])
        else:
            _ns_run(self.switch_pid, ["ip", "link", "add", host.port, "mtu", str(self.mtu), "master", "br0", "up",
                                      "type", "veth", "peer", "name", "eth0", "netns", str(init_pid),
                                      "mtu", str(self.mtu)])
        _ns_run(init_pid, ["ip", "-b", "-"],
                f"addr add {host.addr}/24 dev eth0\nlink set eth0 mtu {self.mtu} up\n")
        if link.rate_mbit is not None:
            host.set_rate(link.rate_mbit)
        return host

    def close(self, timeout_s: float = 10.0) -> None:
        """Kill every host and the switch (their links go with them); raises if anything survives."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        for proc in self._pending:  # (the unshare of an init that never became a host)
            if proc.returncode is None and not any(h._unshare is proc for h in self.hosts.values()):
                try:
                    _stop(proc)
                except HostsError as e:
                    errors.append(str(e))
            if proc.stdout is not None:
                proc.stdout.close()
        for host in self.hosts.values():
            try:
                host.crash(timeout_s)
            except HostsError as e:
                errors.append(str(e))
            try:
                if host._relay is not None:
                    _stop(host._relay)
            except HostsError as e:
                errors.append(str(e))
        if self._switch is not None:
            try:
                _stop(self._switch)
            except HostsError as e:
                errors.append(str(e))
            if self._switch.stderr:
                self._switch.stderr.close()
        for host in self.hosts.values():
            for stream in (host._relay.stdin, host._relay.stdout) if host._relay else ():
                if stream is not None:
                    stream.close()
        if errors:
            raise HostsError("closing the simulated hosts: " + "; ".join(errors))


# -- the init of a host (PID 1 of its namespace) -------------------------------------------------------------

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC = 0x2, 0x4, 0x8, 0x1000, 0x4000


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fs, opts = (x.encode() if x is not None else None for x in (fstype, data))
    if libc.mount(source.encode(), target.encode(), fs, ctypes.c_ulong(flags), opts) != 0:
        raise HostsError(f"mount {source} on {target}: {os.strerror(ctypes.get_errno())}")


def _lo_up() -> None:
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, siocgifflags, struct.pack("16sh22x", b"lo", 0)))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh22x", b"lo", flags | iff_up))


def init_main(hostname: str, hdir: Path) -> int:
    """PID 1 of a host: hostname, a private /dev/shm, this network namespace's /sys (the cgroup tree kept),
    its own boot id and machine id (files in ``hdir`` mounted over the machine's), ``lo`` up; prints
    ``ready``, then reaps orphans until killed."""
    import socket
    import uuid

    if os.getpid() != 1:
        raise HostsError(f"the init must be pid 1 of its namespace, not {os.getpid()}")
    socket.sethostname(hostname)
    # the machine's identity: UCX's system id is the boot id, and "same system id" means "try shared memory"
    for target, text in (("/proc/sys/kernel/random/boot_id", f"{uuid.uuid4()}\n"),
                         ("/etc/machine-id", f"{uuid.uuid4().hex}\n")):
        if os.path.exists(target):
            source = hdir / f".{os.path.basename(target)}"
            source.write_text(text)
            _mount(str(source), target, None, MS_BIND)
    for name in ETC_OWN:  # the host's own name lookups: a copy of the machine's, written by Host.etc
        target = f"/etc/{name}"
        if os.path.exists(target):
            source = hdir / f".etc-{name}"
            source.write_bytes(Path(target).read_bytes())
            _mount(str(source), target, None, MS_BIND)
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    cgroup = os.open("/sys/fs/cgroup", os.O_PATH) if os.path.isdir("/sys/fs/cgroup") else None
    _mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if cgroup is not None:
        _mount(f"/proc/self/fd/{cgroup}", "/sys/fs/cgroup", None, MS_BIND | MS_REC)
        os.close(cgroup)
    _lo_up()
    wake_r, wake_w = os.pipe()  # SIGCHLD wakes the select below
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
    signal.set_wakeup_fd(wake_w)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(INIT_SOCKET)  # abstract: this host's network namespace only
    listener.listen(128)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    watched: dict[int, int] = {}  # a launcher's alive pipe -> the pidfd of its command
    while True:
        while True:  # reap every child that has exited
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        for fd in select.select([wake_r, listener, *watched], [], [])[0]:
            if fd == wake_r:
                while True:
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        break
            elif fd is listener:
                _watch_launcher(listener, watched)
            else:  # EOF: the launcher is gone, its command goes with it (whatever its own PDEATHSIG)
                pidfd = watched.pop(fd)
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:  # it had exited
                    pass
                os.close(pidfd)
                os.close(fd)


def _watch_launcher(listener: Any, watched: dict[int, int]) -> None:
    """The init accepts one launcher (enter.py): the read end of its alive pipe and its command's pidfd."""
    import socket

    try:
        conn, _ = listener.accept()
    except OSError:
        return
    with conn:
        conn.settimeout(CMD_TIMEOUT_S)
        try:
            _, fds, _, _ = socket.recv_fds(conn, 16, 2)
        except OSError:
            return
        if len(fds) == 2:
            watched[fds[0]] = fds[1]
            conn.send(b"ok")
        else:
            for fd in fds:
                os.close(fd)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--init":
        sys.exit("usage: python -m pdpush_tools.harness.hosts --init <hostname> <host dir>")
    sys.exit(init_main(sys.argv[2], Path(sys.argv[3])))
