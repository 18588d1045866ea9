"""pdpush/transport/resolve.py: host names resolved on threads, shared while they resolve, bounded (the real lookups
go through a DNS server of the hosts harness in tests/test_two_hosts.py; here the blocking resolver is a stand-in,
driven directly)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pdpush.transport import resolve


def _wait(look: resolve.Lookup, timeout_s: float = 5.0) -> resolve.Lookup:
    deadline = time.monotonic() + timeout_s
    while not look.done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert look.done
    return look


@pytest.fixture
def gated(monkeypatch):
    """getaddrinfo that waits for the gate, then answers ``answers[host]`` (or raises for a host not there)."""
    gate, calls, answers = threading.Event(), [], {}

    def slow(host, port, family=0, type=0, *_):
        calls.append(host)
        gate.wait(5)
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(fam, socket.SOCK_STREAM, 6, "", (addr, 0)) for fam, addr in answers[host]]

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    return gate, calls, answers


def test_an_address_needs_no_lookup_and_no_thread():
    for host in ("10.1.2.3", "::1", "fe80::1"):
        look = resolve.lookup(host)
        assert look.done and look.address == host and look.error is None
    assert not resolve.is_address("rx-0.decode") and not resolve.is_address("")


def test_a_name_resolves_on_a_thread_ipv4_first_and_callers_share_its_lookup(gated):
    gate, calls, answers = gated
    answers["rx-0"] = [(socket.AF_INET6, "fd00::7"), (socket.AF_INET, "10.9.8.7"), (socket.AF_INET, "10.9.8.7")]
    t0 = time.monotonic()
    ok, again, missing = resolve.lookup("rx-0"), resolve.lookup("rx-0"), resolve.lookup("missing")
    assert time.monotonic() - t0 < 0.5 and not ok.done and not missing.done  # the caller went on
    assert again is ok  # one lookup for the name
    gate.set()
    assert _wait(ok).addresses == ["10.9.8.7", "fd00::7"] and ok.address == "10.9.8.7" and ok.error is None
    assert calls.count("rx-0") == 1
    assert _wait(missing).address is None and "not known" in missing.error
    assert resolve.lookup("rx-0") is not ok  # done: the next caller asks the DNS again (a moved name is found)


def test_lookups_past_the_cap_fail_at_once_and_the_cap_comes_back(gated):
    gate, _, answers = gated
    answers.update({f"rx-{i}": [(socket.AF_INET, "10.0.0.1")] for i in range(resolve.MAX_PENDING)})
    answers["after"] = [(socket.AF_INET, "10.0.0.2")]
    held = [resolve.lookup(f"rx-{i}") for i in range(resolve.MAX_PENDING)]
    assert resolve.lookup("rx-0") is held[0]  # a name already resolving costs no place
    over = resolve.lookup("one-too-many")
    assert over.done and over.address is None and "being resolved already" in over.error
    gate.set()
    for look in held:
        assert _wait(look).address == "10.0.0.1"
    assert _wait(resolve.lookup("after")).address == "10.0.0.2"  # the threads gave their places back


def test_a_lookup_that_gets_no_thread_fails_and_gives_its_place_back(gated, monkeypatch):
    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    look = resolve.lookup("rx-no-thread")
    assert look.done and look.address is None and "no thread" in look.error
    assert not resolve._inflight
