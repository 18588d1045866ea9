"""Host names resolved off a daemon's loop. ``getaddrinfo`` blocks for as long as the DNS server takes (seconds
where one is slow or gone, as in a cluster whose DNS is under load), and the sender's loop serves every engine
and receiver: resolving a receiver's name there stalled them all. A lookup here runs on a thread of its own and
is looked at, without waiting, on each pass. Each connection resolves its name anew: a receiver restarted
elsewhere under the same name (a Kubernetes pod) is found at its new address.

An address (IPv4 or IPv6) needs no lookup, and gets no thread.
"""

from __future__ import annotations

import socket
import threading

MAX_PENDING = 16  # lookups running at once; past it, a lookup fails at once (a DNS server that never answers
                  # must not cost a thread per receiver named)

_lock = threading.Lock()
_pending = 0


class Lookup:
    """One host name's lookup: ``done``, then ``address`` (its first address, as a string) or ``error``."""

    __slots__ = ("host", "address", "error", "done")

    def __init__(self, host: str) -> None:
        self.host = host
        self.address: str | None = None
        self.error: str | None = None
        self.done = False


def is_address(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return True
        except OSError:
            pass
    return False


def lookup(host: str, family: int = socket.AF_UNSPEC) -> Lookup:
    """Start resolving ``host`` (to an address of ``family``); the result is ``done`` at once for an address, else
    once its thread ends."""
    global _pending
    out = Lookup(host)
    if is_address(host):
        out.address, out.done = host, True
        return out
    with _lock:
        if _pending >= MAX_PENDING:
            out.error, out.done = f"{MAX_PENDING} host names are being resolved already", True
            return out
        _pending += 1
    threading.Thread(target=_resolve, args=(out, family), name="pdpush-resolve", daemon=True).start()
    return out


def _resolve(out: Lookup, family: int) -> None:
    global _pending
    try:
        out.address = socket.getaddrinfo(out.host, None, family, socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError) as e:
        out.error = str(e) or type(e).__name__
    finally:
        with _lock:
            _pending -= 1
        out.done = True  # (last: the loop reads address or error once it sees done)
