"""The test harness's port picker: ports that no process is given implicitly (see
pdpush_tools/harness/ports.py for the race it closes)."""

from __future__ import annotations

import socket

from pdpush_tools.harness import ports


def test_ports_are_distinct_free_and_below_the_kernels_ephemeral_range():
    low = ports._ephemeral_low()
    got = ports.free_ports(50) + [ports.free_port() for _ in range(50)]
    assert len(set(got)) == 100
    assert all(p < low for p in got)
    for p in got[:10]:
        with socket.socket() as s:
            s.bind(("0.0.0.0", p))


def test_a_port_someone_holds_is_never_handed_out(monkeypatch):
    import itertools

    monkeypatch.setattr(ports, "_next", itertools.count(0))  # walk from the span's start, where the held ports are
    held = []
    try:
        for p in range(ports._span_now.start, ports._span_now.start + 200):
            s = socket.socket()
            try:
                s.bind(("0.0.0.0", p))
            except OSError:
                s.close()
                continue
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert len(taken) > 100
        got = ports.free_ports(300)
        assert not taken & set(got) and max(got) >= ports._span_now.start + 200
    finally:
        for s in held:
            s.close()
