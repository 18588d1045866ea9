"""Host names resolved off a daemon's loop. ``getaddrinfo`` blocks for as long as the DNS server takes (seconds
where one is slow or gone, as in a cluster whose DNS is under load), and the sender's loop serves every engine
and receiver: resolving a receiver's name there stalled them all. A lookup here runs on a thread of its own and
is looked at, without waiting, on each pass. Callers that want the same name while it resolves share one
lookup; nothing is cached after it: each asks the DNS again (a receiver restarted elsewhere under its name, a
Kubernetes pod, is found at its new address).

An address (IPv4 or IPv6) needs no lookup, and gets no thread.
"""

from __future__ import annotations

import socket
import threading

MAX_PENDING = 64  # names resolving at once; past it, a lookup fails at once (a DNS server that never answers
                  # must not cost a thread per request)

_lock = threading.Lock()
_inflight: dict[str, Lookup] = {}  # host -> its lookup running


class Lookup:
    """One host name's lookup: ``done``, then ``addresses`` (IPv4 first; ``address`` the first) or ``error``."""

    __slots__ = ("host", "addresses", "error", "done")

    def __init__(self, host: str) -> None:
        self.host = host
        self.addresses: list[str] = []
        self.error: str | None = None
        self.done = False

    @property
    def address(self) -> str | None:
        return self.addresses[0] if self.addresses else None

    def _end(self, addresses: list[str], error: str | None) -> None:
        self.addresses, self.error = addresses, error
        self.done = True  # (last: callers read addresses or error once they see done)


def is_address(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return True
        except OSError:
            pass
    return False


def lookup(host: str) -> Lookup:
    """Start resolving ``host``, or join the lookup of it already running; the result is ``done`` at once for an
    address, else once its thread ends."""
    if is_address(host):
        out = Lookup(host)
        out._end([host], None)
        return out
    with _lock:
        out = _inflight.get(host)
        if out is not None:
            return out
        out = Lookup(host)
        if len(_inflight) >= MAX_PENDING:
            out._end([], f"{MAX_PENDING} host names are being resolved already")
            return out
        _inflight[host] = out
    try:
        threading.Thread(target=_resolve, args=(out,), name="pdpush-resolve", daemon=True).start()
    except RuntimeError as e:  # no thread to be had (a container's pids limit)
        _finish(out, [], f"no thread to resolve it: {e}")
    return out


def _resolve(out: Lookup) -> None:
    addresses: list[str] = []
    error = None
    try:
        infos = socket.getaddrinfo(out.host, None, type=socket.SOCK_STREAM)
        # IPv4 first (stable): a receiver bound to 0.0.0.0 listens on IPv4 only, whatever the name has besides
        for *_, sockaddr in sorted(infos, key=lambda info: info[0] != socket.AF_INET):
            if sockaddr[0] not in addresses:
                addresses.append(sockaddr[0])
        if not addresses:
            error = "no address"
    except Exception as e:  # noqa: BLE001 - whatever it is, the caller hears it as this name's failure
        error = str(e) or type(e).__name__
    _finish(out, addresses, error)


def _finish(out: Lookup, addresses: list[str], error: str | None) -> None:
    with _lock:
        if _inflight.get(out.host) is out:
            del _inflight[out.host]
    out._end(addresses, error)


def tcp_host_port(endpoint: str) -> tuple[str, str] | None:
    """The host (brackets stripped) and port of a ``tcp://host:port`` zmq endpoint; None for another kind (``ipc://``,
    ``inproc://``), which names no host, or one with a source address (``tcp://src;host:port``), left to libzmq."""
    if not endpoint.startswith("tcp://") or ";" in endpoint:
        return None
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host:
        return None
    return host.strip("[]"), port


def at_address(endpoint: str, address: str) -> str:
    """``endpoint`` (``tcp://host:port``) with its host replaced by ``address`` (an IPv6 one in brackets)."""
    _, port = tcp_host_port(endpoint)
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


async def settled(look: Lookup, timeout_s: float) -> Lookup:
    """``look``, once done or ``timeout_s`` has passed (then maybe not done), for asyncio code: the lookup runs on its
    thread; this only looks at it, a few ms apart."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + timeout_s, 0.001
    while not look.done and loop.time() < deadline:
        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        pause = min(pause * 2, 0.02)
    return look


async def address_of(host: str, timeout_s: float, last: str | None = None) -> tuple[str | None, str]:
    """The address ``host`` gives, looked up off the loop within ``timeout_s`` (asyncio code), and "". Where the lookup
    fails: ``last``, the address it gave before (a DNS server down is not a peer gone), or None, and why."""
    look = await settled(lookup(host), timeout_s)
    if look.address is not None:
        return look.address, ""
    return last, f"cannot resolve {host!r}: {look.error or f'no answer within {timeout_s:.1f} s'}"


class Followed:
    """Where one connection to a host name went, and whether the name still gives it: a peer named by a host name
    (a Kubernetes pod) can move while the address reached still answers (the old pod not yet gone), or go silent
    there for good, and a connection by address would never see it. ``reached`` records the address connected to;
    ``moved``, asked now and then without waiting, looks the name up again every ``recheck_s`` on a thread and
    answers the new address once a finished lookup no longer lists the one reached. A lookup that fails keeps it
    (a DNS server down is not a peer gone). Clock-free: callers pass ``now`` (seconds, monotonic)."""

    __slots__ = ("host", "recheck_s", "address", "_at", "_look")

    def __init__(self, host: str, recheck_s: float) -> None:
        self.host, self.recheck_s = host, recheck_s
        self.address: str | None = None
        self._at = 0.0  # when ``address`` was last confirmed
        self._look: Lookup | None = None

    def reached(self, address: str, now: float) -> None:
        self.address, self._at, self._look = address, now, None

    def moved(self, now: float) -> str | None:
        if self.address is None or is_address(self.host):
            return None
        look = self._look
        if look is None:
            if now - self._at >= self.recheck_s:
                self._look = lookup(self.host)
            return None
        if not look.done:
            return None
        self._look, self._at = None, now
        if look.addresses and self.address not in look.addresses:
            return look.address
        return None
