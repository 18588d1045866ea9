"""The host's network interfaces, as UCX will see them when a daemon starts it.

UCX lists its tcp devices once, when its context is made (``ucp_init``), and keeps only those that are up *and*
running (``IFF_UP | IFF_RUNNING``). A device that is up but not running yet at that moment is never used by that
daemon: a peer's connection that arrives on it is rejected (``UCS_ERR_REJECTED``: "a device which was not present
during UCP initialization"), and the daemon never learns why. The window is real: Linux marks the second end of a
veth pair running up to a second after it is up where both ends have the same interface index (its link-watch
treats that carrier event as not urgent), as they do when a pair is made inside two namespaces; a daemon started
by the same script, or right after its network, falls in it. ``wait_running`` lets it pass first, bounded.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import time
from collections.abc import Callable

SIOCGIFCONF, SIOCGIFFLAGS = 0x8912, 0x8913
IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x1, 0x8, 0x40
SETTLE_S = 2.0  # a daemon's start waits at most this long for its interfaces (the kernel's own delay: up to 1 s)


def flags(name: str) -> int | None:
    """An interface's flags (``SIOCGIFFLAGS``), or None where it is gone."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack("16sH22x", os.fsencode(name)[:15], 0))
        except OSError:
            return None
    return struct.unpack("16sH22x", raw)[1]


def interface_of(address: str) -> str | None:
    """The interface that holds ``address`` (an IPv4 or IPv6 literal), or None (none here, or not a literal)."""
    try:
        packed = socket.inet_pton(socket.AF_INET6 if ":" in address else socket.AF_INET, address)
    except OSError:
        return None
    if len(packed) == 16:
        try:
            with open("/proc/net/if_inet6") as f:  # address, index, prefix, scope, flags, name
                for line in f:
                    hexaddr, *_, name = line.split()
                    if bytes.fromhex(hexaddr) == packed:
                        return name
        except OSError:
            pass
        return None
    for label, held in _ipv4_addresses():
        if held == packed:
            return label.split(":")[0]  # (an address with a label of its own, eth0:vip, is eth0's)
    return None


def _ipv4_addresses(most: int = 1024) -> list[tuple[str, bytes]]:
    """Every IPv4 address here, with its label (``SIOCGIFCONF``: secondary addresses and labelled ones too)."""
    buf = ctypes.create_string_buffer(most * 40)  # struct ifreq: 40 bytes, its sockaddr_in from byte 16
    conf = struct.pack("iL", ctypes.sizeof(buf), ctypes.addressof(buf))  # struct ifconf: length, then the buffer
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        length = struct.unpack("iL", fcntl.ioctl(s.fileno(), SIOCGIFCONF, conf))[0]
    raw = buf.raw[:length]
    return [(os.fsdecode(raw[i:i + 16].split(b"\0", 1)[0]), raw[i + 20:i + 24]) for i in range(0, len(raw) - 39, 40)]


def default_interface(ipv6: bool = False) -> str | None:
    """The interface of this host's default route (the lowest metric), from /proc; None where it has none."""
    best: tuple[int, str] | None = None
    try:
        with open("/proc/net/ipv6_route" if ipv6 else "/proc/net/route") as f:
            for line in f:
                c = line.split()
                if ipv6:  # destination, its prefix length, source, its length, next hop, metric, ..., device
                    if len(c) == 10 and int(c[0], 16) == 0 and c[1] == "00" and c[9] != "lo":
                        metric = int(c[5], 16)
                        best = min(best or (metric, c[9]), (metric, c[9]))
                elif len(c) >= 8 and c[1] == "00000000" and c[7] == "00000000" and int(c[3], 16) & 1:  # RTF_UP
                    metric = int(c[6])
                    best = min(best or (metric, c[0]), (metric, c[0]))
    except (OSError, ValueError):
        return None
    return best[1] if best else None


def listening_interface(host: str) -> str | None:
    """The interface a daemon bound to ``host`` takes its peers' connections on: the one that holds it, or for a
    wildcard (0.0.0.0, ::) the default route's (peers most often come that way; none: None)."""
    if host in ("0.0.0.0", "::"):
        return default_interface(ipv6=host == "::")
    return interface_of(host)


def route_interface(address: str) -> str | None:
    """The interface this host would reach ``address`` (an IP literal) through: a datagram socket's connect picks
    the route and sends nothing."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        socket.inet_pton(family, address)  # a literal only: a name would be looked up here, with no deadline
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return interface_of(s.getsockname()[0].split("%")[0])
    except OSError:
        return None


def not_running(names: list[str]) -> list[str]:
    """Those of ``names`` that are up but not running (no carrier yet): a UCX context made now would leave them
    out. (A name that is gone, or down, is not waited for: nothing will change that soon.)"""
    out = []
    for name in names:
        f = flags(name)
        if f is not None and f & IFF_UP and not f & IFF_LOOPBACK and not f & IFF_RUNNING:
            out.append(name)
    return out


def wait_running(names: list[str], timeout_s: float = SETTLE_S, look: Callable[[list[str]], list[str]] = not_running,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 stop: Callable[[], bool] | None = None) -> list[str]:
    """Wait, up to ``timeout_s`` (or until ``stop`` says so: the daemon was told to stop), until none of ``names``
    is up without running; those that still are then (a link with no carrier: the caller says so, and UCX goes
    without them)."""
    deadline = clock() + timeout_s
    while True:
        pending = look(names) if names else []
        if not pending or clock() >= deadline or (stop is not None and stop()):
            return pending
        sleep(0.01)  # a kernel flag, no event to wait on here; bounded by the deadline
