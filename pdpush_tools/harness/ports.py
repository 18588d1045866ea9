"""Ports for processes that cannot bind port 0 and report it (vLLM's HTTP server and its KV-event
sockets, a config file written before its daemon starts).

Asking the kernel for a free port (bind to 0, close, hand the number on) races: until the process it
is meant for binds it, any process that binds or connects with port 0 may be given the same number
from the ephemeral range. A vLLM server's engine core makes such sockets while it starts, so one
server could take the port chosen for its neighbour's event publisher (seen in CI: ``ZMQError: Address
already in use``). The kernel hands out implicit ports only from ``ip_local_port_range``; ports picked
here lie below it, and this process never hands out the same one twice, so the only way to lose one is
to another process that names it explicitly.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading

_FLOOR = 10_000  # below this lie well-known services (and ports people configure by hand)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _span() -> range:
    low = _ephemeral_low()
    return range(_FLOOR, low) if low - _FLOOR >= 2_000 else range(1_024, 65_536)


_lock = threading.Lock()
_span_now = _span()
# a random start per process, so that two runs on one machine rarely walk the same ports
_next = itertools.count(random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little")).randrange(len(_span_now)))


def _bindable(port: int) -> bool:
    """Whether nothing holds ``port`` on any address, for TCP (vLLM binds its PUB sockets to ``*``)."""
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports, free now, outside the kernel's ephemeral range, never handed out before
    by this process."""
    out: list[int] = []
    with _lock:
        for _ in range(len(_span_now)):
            if len(out) == n:
                break
            port = _span_now[next(_next) % len(_span_now)]
            if _bindable(port):
                out.append(port)
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} of {n} free ports in {_span_now.start}..{_span_now.stop - 1}")
    return out


def free_port() -> int:
    return free_ports(1)[0]
