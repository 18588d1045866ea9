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

import fcntl
import os
import socket
import struct
import time
from collections.abc import Callable

SIOCGIFFLAGS, SIOCGIFADDR = 0x8913, 0x8915
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
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            # the address asked for in the request: the kernel answers with it where the interface holds it (a
            # secondary address too), else with its first
            ask = struct.pack("16sHH4s16x", os.fsencode(name)[:15], socket.AF_INET, 0, packed)
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, ask)
            except OSError:  # (no IPv4 address)
                continue
            if raw[20:24] == packed:
                return name
    return None


def listening_interface(host: str) -> str | None:
    """The interface a daemon bound to ``host`` takes its peers' connections on: the one that holds it, or for a
    wildcard (0.0.0.0, ::) the default route's (peers most often come that way; none: None)."""
    if host in ("0.0.0.0", "::"):
        return route_interface("192.0.2.1" if host == "0.0.0.0" else "2001:db8::1")  # (documentation addresses)
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
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Wait, up to ``timeout_s``, until none of ``names`` is up without running; those that still are then (a
    link with no carrier: the caller says so, and UCX goes without them)."""
    deadline = clock() + timeout_s
    while True:
        pending = look(names) if names else []
        if not pending or clock() >= deadline:
            return pending
        sleep(0.01)  # a kernel flag, no event to wait on here; bounded by the deadline
