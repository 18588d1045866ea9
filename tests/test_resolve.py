"""pdpush/transport/resolve.py: host names resolved on threads, bounded (the real lookups go through a DNS server of
the hosts harness in tests/test_two_hosts.py; here the blocking resolver is a stand-in, driven directly)."""

from __future__ import annotations

import socket
import threading
import time

from pdpush.transport import resolve


def _wait(look: resolve.Lookup, timeout_s: float = 5.0) -> resolve.Lookup:
    deadline = time.monotonic() + timeout_s
    while not look.done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert look.done
    return look


def test_an_address_needs_no_lookup_and_no_thread():
    for host in ("10.1.2.3", "::1", "fe80::1"):
        look = resolve.lookup(host)
        assert look.done and look.address == host and look.error is None
    assert not resolve.is_address("rx-0.decode") and not resolve.is_address("")


def test_a_name_resolves_on_a_thread_without_blocking_the_caller(monkeypatch):
    gate = threading.Event()

    def slow(host, port, family=0, type=0, *_):
        gate.wait(5)
        if host == "missing":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.9.8.7", 0))]

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    t0 = time.monotonic()
    ok, missing = resolve.lookup("rx-0"), resolve.lookup("missing")
    assert time.monotonic() - t0 < 0.5 and not ok.done and not missing.done  # the caller went on
    gate.set()
    assert _wait(ok).address == "10.9.8.7" and ok.error is None
    assert _wait(missing).address is None and "not known" in missing.error


def test_lookups_past_the_cap_fail_at_once_and_the_cap_comes_back(monkeypatch):
    gate = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: (gate.wait(5), [(2, 1, 6, "", ("10.0.0.1", 0))])[1])
    held = [resolve.lookup(f"rx-{i}") for i in range(resolve.MAX_PENDING)]
    over = resolve.lookup("one-too-many")
    assert over.done and over.address is None and "being resolved already" in over.error
    gate.set()
    for look in held:
        assert _wait(look).address == "10.0.0.1"
    assert _wait(resolve.lookup("after")).address == "10.0.0.1"  # the threads gave their places back
