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


def test_endpoints_are_split_and_rewritten_to_an_address():
    assert resolve.tcp_host_port("tcp://rx-0.decode:5710") == ("rx-0.decode", "5710")
    assert resolve.tcp_host_port("tcp://[fd00::7]:5557") == ("fd00::7", "5557")
    assert resolve.tcp_host_port("ipc:///run/pdpush/rx.sock") is None
    assert resolve.tcp_host_port("tcp://nohost") is None
    assert resolve.tcp_host_port("tcp://10.0.0.9;rx-0:5710") is None  # a source address: libzmq's to read
    assert resolve.at_address("tcp://rx-0:5710", "10.9.8.7") == "tcp://10.9.8.7:5710"
    assert resolve.at_address("tcp://rx-0:5710", "fd00::7") == "tcp://[fd00::7]:5710"


def test_a_followed_name_is_looked_up_again_each_recheck_and_a_move_is_told_once(gated):
    gate, calls, answers = gated
    gate.set()
    answers["rx-0"] = [(socket.AF_INET, "10.0.0.1")]
    f = resolve.Followed("rx-0", recheck_s=10.0)
    assert f.moved(100.0) is None and calls == []  # nothing reached yet: nothing to look at
    f.reached("10.0.0.1", 0.0)
    assert f.moved(9.9) is None and calls == []  # not due
    assert f.moved(10.0) is None  # due: a lookup starts, and the caller goes on
    _wait(f._look)
    assert calls == ["rx-0"]
    assert f.moved(10.5) is None  # the same address: confirmed at 10.5
    assert f.moved(20.0) is None and calls == ["rx-0"]
    answers["rx-0"] = [(socket.AF_INET, "10.0.0.2"), (socket.AF_INET6, "fd00::2")]
    assert f.moved(20.5) is None
    _wait(f._look)
    assert calls == ["rx-0", "rx-0"]
    assert f.moved(21.0) == "10.0.0.2"  # moved: the new address
    assert f.moved(21.1) is None  # told once; the caller connects there and says so with reached()
    f.reached("10.0.0.2", 22.0)
    del answers["rx-0"]  # the DNS forgets the name (a server failing): the address is kept
    assert f.moved(32.0) is None
    _wait(f._look)
    assert f.moved(32.5) is None and f.address == "10.0.0.2"


def test_a_followed_address_is_never_looked_up(gated):
    gate, calls, _ = gated
    f = resolve.Followed("10.0.0.1", recheck_s=0.1)
    f.reached("10.0.0.1", 0.0)
    assert f.moved(100.0) is None and calls == []


def test_settled_waits_for_a_lookup_on_the_loop_with_a_deadline(gated):
    import asyncio

    gate, _, answers = gated
    answers["rx-0"] = [(socket.AF_INET, "10.0.0.1")]

    async def main():
        look = resolve.lookup("rx-0")
        t0 = time.monotonic()
        assert not (await resolve.settled(look, 0.05)).done and time.monotonic() - t0 < 1.0  # the deadline
        ticks = 0

        async def tick():  # the loop serves others while it waits
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        t = asyncio.create_task(tick())
        asyncio.get_running_loop().call_later(0.1, gate.set)
        got = await resolve.settled(look, 5.0)
        t.cancel()
        assert got.address == "10.0.0.1" and ticks >= 5

    asyncio.run(main())
