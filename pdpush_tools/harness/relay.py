"""The user-space link relay of ``hosts.py``: forwards Ethernet frames between two TAP devices, one in a
simulated host's network namespace (its ``eth0``) and one in the switch namespace (a port of ``br0``),
delaying, jittering and dropping them on the way, because this kernel has no ``netem``.

    python -m pdpush_tools.harness.relay --host-ns /proc/P/ns/net --host-if eth0 \\
        --switch-ns /proc/S/ns/net --switch-if t0 [--delay-ms D] [--jitter-ms J] [--loss L] [--seed N]

It creates the host-side TAP inside the host's namespace and the switch-side one inside the switch's (a TAP
is made in the namespace of the process that opens it), stays in the switch namespace, prints ``ready``
and then serves. Control: one command a line on stdin, one reply line (``ok ...`` or ``err ...``) on stdout;
stdin's end stops it.

    set <delay_ms> <jitter_ms> <loss>   change the impairments (frames already queued keep their due time)
    hold / release                      queue every frame and forward none / forward all held, in order
    down / up                           cable pulled: the host's TAP loses carrier, in-flight frames are lost
    stats                               ``ok {json}``: counters per direction

How faithful, per direction (host->switch, switch->host), each direction a FIFO:

* delay and jitter: departure = max(previous departure, arrival + delay + uniform(-jitter, +jitter)). Frames
  never reorder (netem reorders under jitter unless rate-limited; we don't), so jitter shows up as delay
  variation only, and a large jitter compresses toward the running maximum. Timing is select(2)'s (timer
  slack 1 ns): a frame leaves ~0.1-0.3 ms after its due time in a VM (timer wakeup latency), more when the
  CPUs are busy; never before.
* loss: independent Bernoulli per frame (seeded ``random.Random``), no bursts (netem's ``loss`` without
  a correlation). A frame is an MTU-sized packet (the TAPs have no offloads, so the kernel segments TCP
  before the relay sees it), so loss applies per packet as on a wire.
* hold: frames are queued (up to ``--max-queue-mb`` a direction; more are dropped like a full switch buffer)
  with the due time of their arrival, so ``release`` sends every overdue frame at once, in order.
* down: the host-side TAP's carrier is switched off (TUNSETCARRIER: the host sees NO-CARRIER, its queue
  stops) and every frame arriving from either side, or already queued, is dropped.
* throughput: one Python process copying frames (two syscalls a frame), see hosts.py for what it sustains;
  idle, it sleeps in select(2) until a frame, a command or the next due time.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import json
import os
import random
import select
import struct
import sys
import time
from dataclasses import dataclass, field

TUNSETIFF = 0x400454CA
TUNSETCARRIER = 0x400454E2  # _IOW('T', 226, int), Linux >= 5.0
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
PR_SET_TIMERSLACK = 29
READ_BATCH = 64  # frames read from one TAP before looking at the others
FRAME_MAX = 65536


class RelayError(RuntimeError):
    """The relay could not enter a namespace or open a TAP device, or one of its TAPs went away."""


def setns(path: str, nstype: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, nstype) != 0:
            err = ctypes.get_errno()
            raise RelayError(f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def open_tap(name: str) -> int:
    """A non-blocking fd of a new TAP device ``name`` (no packet-info header, no offloads) in the current
    network namespace; the device lives as long as the fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError as e:
        os.close(fd)
        raise RelayError(f"TUNSETIFF {name}: {e}") from e
    return fd


@dataclass
class Direction:
    """One way through the relay: frames read from ``src`` are written to ``dst`` when due."""

    name: str
    src: int
    dst: int
    queue: collections.deque = field(default_factory=collections.deque)  # (due, frame), due non-decreasing
    queued_bytes: int = 0
    last_due: float = 0.0
    forwarded: int = 0
    lost: int = 0  # the loss impairment
    down_dropped: int = 0  # the link was down
    overflow: int = 0  # the queue was full
    write_errors: int = 0

    def stats(self) -> dict:
        return {"forwarded": self.forwarded, "lost": self.lost, "down_dropped": self.down_dropped,
                "overflow": self.overflow, "write_errors": self.write_errors, "queued": len(self.queue)}


class Relay:
    def __init__(self, host_fd: int, switch_fd: int, delay_ms: float, jitter_ms: float, loss: float, seed: int,
                 max_queue_bytes: int) -> None:
        self.host_fd, self.switch_fd = host_fd, switch_fd
        self.up_dir = Direction("host->switch", host_fd, switch_fd)
        self.down_dir = Direction("switch->host", switch_fd, host_fd)
        self.dirs = (self.up_dir, self.down_dir)
        self.rng = random.Random(seed)
        self.max_queue_bytes = max_queue_bytes
        self.held = False
        self.link_up = True
        self.set(delay_ms, jitter_ms, loss)

    def set(self, delay_ms: float, jitter_ms: float, loss: float) -> None:
        if delay_ms < 0 or jitter_ms < 0 or not 0.0 <= loss <= 1.0:
            raise ValueError(f"bad impairment: delay {delay_ms} ms, jitter {jitter_ms} ms, loss {loss}")
        self.delay, self.jitter, self.loss = delay_ms / 1e3, jitter_ms / 1e3, loss

    def carrier(self, up: bool) -> None:
        fcntl.ioctl(self.host_fd, TUNSETCARRIER, struct.pack("i", int(up)))
        self.link_up = up
        if not up:
            for d in self.dirs:
                d.down_dropped += len(d.queue)
                d.queue.clear()
                d.queued_bytes = 0

    def receive(self, d: Direction, now: float) -> None:
        for _ in range(READ_BATCH):
            try:
                frame = os.read(d.src, FRAME_MAX)
            except BlockingIOError:
                return
            except OSError as e:  # the device is gone (its namespace died): the link is no more
                raise RelayError(f"reading {d.name}: {e}") from e
            if not self.link_up:
                d.down_dropped += 1
                continue
            if self.loss and self.rng.random() < self.loss:
                d.lost += 1
                continue
            if not self.held and not d.queue and not self.delay and not self.jitter:
                self.send(d, frame)
                continue
            if d.queued_bytes + len(frame) > self.max_queue_bytes:
                d.overflow += 1
                continue
            due = now + self.delay + (self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
            d.last_due = max(d.last_due, due)
            d.queue.append((d.last_due, frame))
            d.queued_bytes += len(frame)

    def send(self, d: Direction, frame: bytes) -> None:
        try:
            os.write(d.dst, frame)
            d.forwarded += 1
        except OSError:  # device down or its queue full: the frame is lost, as on a wire
            d.write_errors += 1

    def flush(self, now: float) -> float | None:
        """Send what is due; the next due time, if any (and not held)."""
        if self.held:
            return None
        nxt: float | None = None
        for d in self.dirs:
            q = d.queue
            while q and q[0][0] <= now:
                _, frame = q.popleft()
                d.queued_bytes -= len(frame)
                self.send(d, frame)
            if q and (nxt is None or q[0][0] < nxt):
                nxt = q[0][0]
        return nxt

    def command(self, line: str) -> str:
        words = line.split()
        try:
            if words[:1] == ["set"] and len(words) == 4:
                self.set(float(words[1]), float(words[2]), float(words[3]))
            elif words == ["hold"]:
                self.held = True
            elif words == ["release"]:
                self.held = False
            elif words in (["down"], ["up"]):
                self.carrier(words[0] == "up")
            elif words == ["stats"]:
                return "ok " + json.dumps({"host_to_switch": self.up_dir.stats(),
                                           "switch_to_host": self.down_dir.stats()})
            else:
                return f"err unknown command {line!r}"
        except (ValueError, OSError) as e:
            return f"err {e}"
        return "ok"

    def serve(self, control: int, reply) -> None:
        pending = b""
        readers = [self.host_fd, self.switch_fd, control]
        while True:
            nxt = self.flush(time.monotonic())
            timeout = None if nxt is None else max(0.0, nxt - time.monotonic())
            readable, _, _ = select.select(readers, [], [], timeout)
            now = time.monotonic()
            for fd in readable:
                if fd == control:
                    chunk = os.read(control, 4096)
                    if not chunk:
                        return  # the harness is gone
                    pending += chunk
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        reply(self.command(line.decode()))
                else:
                    self.receive(self.up_dir if fd == self.host_fd else self.down_dir, now)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host-ns", required=True)
    p.add_argument("--host-if", default="eth0")
    p.add_argument("--switch-ns", required=True)
    p.add_argument("--switch-if", required=True)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-queue-mb", type=float, default=64.0)
    a = p.parse_args(argv)
    ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake at due times, not up to 50 us later
    setns(a.host_ns, CLONE_NEWNET)
    host_fd = open_tap(a.host_if)
    setns(a.switch_ns, CLONE_NEWNET)
    switch_fd = open_tap(a.switch_if)
    relay = Relay(host_fd, switch_fd, a.delay_ms, a.jitter_ms, a.loss, a.seed, int(a.max_queue_mb * 2**20))

    def reply(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    reply("ready")
    try:
        relay.serve(sys.stdin.fileno(), reply)
    except (RelayError, BrokenPipeError) as e:
        print(f"relay: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
