"""Lifelines carry an engine connection's messages both ways, in frames, and say when either end dies (lifeline.py).

The daemon's side (``Lifelines``) and the engine's (``Lifeline``) here in one process over a real unix socket; the
real daemons at the end."""

from __future__ import annotations

import errno
import os
import random
import resource
import socket
import time

import pytest

from pdpush import launch, lifeline, protocol
from pdpush.client import status
from pdpush.layout import KVLayout
from tests.helpers import low_nofile_prefix, nofile_limits, round_trip, rx_opts, sock, until

MAX_FRAME = 1 << 20


def test_frames_are_split_whole_and_a_frame_over_the_cap_ends_the_stream_after_those_before_it():
    buf = bytearray(lifeline.frame(b"a") + lifeline.frame(b"") + lifeline.frame(b"bcd") + lifeline.frame(b"xyz")[:5])
    assert lifeline.split(buf, 16) == ([b"a", b"", b"bcd"], True)
    assert bytes(buf) == lifeline.frame(b"xyz")[:5]  # the start of the next stays
    buf += lifeline.frame(b"xyz")[5:]
    assert lifeline.split(buf, 16, limit=1) == ([b"xyz"], True) and not buf
    assert lifeline.split(bytearray(lifeline.frame(b"ok") + lifeline.frame(b"x" * 17)), 16) == ([b"ok"], False)


class Pair:
    """A daemon's lifelines and one engine's lifeline to it; what the daemon's looks gathered, in order."""

    def __init__(self, tmp_path, ident: bytes = b"engine-1") -> None:
        self.path = tmp_path / "d.sock.life"
        self.daemon = lifeline.Lifelines(self.path, MAX_FRAME)
        self.engine = lifeline.Lifeline.connect(self.path, ident, MAX_FRAME)
        assert self.engine is not None
        self.named: list[bytes] = []
        self.frames: list[bytes] = []
        self.gone: list[bytes] = []
        self.looks: list[int] = []  # frames each look took

    def service(self) -> None:
        evs = self.daemon.service()
        self.looks.append(sum(ev.kind == lifeline.FRAME for ev in evs))
        for ev in evs:
            {lifeline.NAMED: self.named, lifeline.GONE: self.gone}.get(ev.kind, self.frames).append(
                ev.payload if ev.kind == lifeline.FRAME else ev.ident)

    def look(self, want, until_s: float = 5.0) -> None:
        """The daemon looks until ``want()`` holds, or ``until_s`` passed."""
        deadline = time.monotonic() + until_s
        while not want() and time.monotonic() < deadline:
            self.service()
            time.sleep(0.001)  # bounded by the deadline

    def write_all(self, data: bytes, timeout_s: float = 5.0) -> None:
        """The engine writes ``data`` whole, while the daemon reads (each side as it would, without waiting)."""
        view, deadline = memoryview(data), time.monotonic() + timeout_s
        while view:
            view = view[self.engine.write(view):]
            assert time.monotonic() < deadline, "the daemon did not take the bytes"
            self.service()

    def close(self) -> None:
        self.engine.close()
        self.daemon.close()


def test_an_engine_is_named_before_its_frames_and_gone_after_them(tmp_path):
    p = Pair(tmp_path)
    try:
        big = os.urandom(3 * MAX_FRAME // 4)  # larger than a socket's buffer: written and read in parts
        p.write_all(lifeline.frame(b"one") + lifeline.frame(big) + lifeline.frame(b"three"))
        p.engine.close()  # it dies with its last frames sent: they count
        p.look(lambda: p.gone)
        assert p.named == [b"engine-1"] and p.gone == [b"engine-1"]
        assert p.frames == [b"one", big, b"three"]
        assert not p.daemon.has(b"engine-1")
    finally:
        p.close()


def test_the_daemon_answers_in_order_whatever_the_engine_has_room_for(tmp_path):
    p = Pair(tmp_path)
    try:
        p.look(lambda: p.named)
        msgs = [os.urandom(random.Random(i).randrange(1, MAX_FRAME // 2)) for i in range(12)]  # MBs: not one buffer
        for m in msgs:
            assert p.daemon.send(b"engine-1", m)
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got) < len(msgs) and time.monotonic() < deadline:
            p.engine.wait(0.01)
            got += p.engine.frames()
            p.daemon.service()  # the rest is written as the engine makes room (EPOLLOUT)
        assert got == msgs
        assert not p.daemon.send(b"nobody", b"x")
    finally:
        p.close()


def test_an_engine_that_does_not_read_costs_the_daemon_a_bounded_queue_and_its_lifeline(tmp_path, monkeypatch):
    """An engine that does not read: the socket's buffers, then its queue, then its lifeline is closed, as if it had
    died (its requests fail; what they held comes back). Before, the daemon dropped its answers past the queue and
    kept it; and past the cap for every engine together, a few such engines had every healthy engine's answers
    dropped."""
    monkeypatch.setattr(lifeline, "MAX_QUEUED", 4 * MAX_FRAME)
    p = Pair(tmp_path)
    healthy = lifeline.Lifeline.connect(p.path, b"engine-2", MAX_FRAME)
    try:
        p.look(lambda: len(p.named) == 2)
        sent = sum(p.daemon.send(b"engine-1", b"x" * (MAX_FRAME // 2)) for _ in range(64))
        assert 0 < sent < 64  # the socket's buffers, then the queue, then refused (the shell counts it)
        assert p.daemon.stats()["lifeline_queued_bytes"] <= 4 * MAX_FRAME
        p.look(lambda: p.gone)
        assert p.gone == [b"engine-1"] and p.daemon.stats()["lifelines_dropped_for_bounds"] == 1
        assert p.daemon.stats()["lifeline_queued_bytes"] == 0
        assert p.daemon.send(b"engine-2", b"answer")  # the others are answered
    finally:
        healthy.close()
        p.close()


def test_frames_begun_and_never_finished_cost_the_daemon_a_bounded_buffer(tmp_path, monkeypatch):
    """Lifelines that each send most of a large frame and stop: past the cap on what all of them hold, the one
    holding the most goes, one at a time, and never one that holds nothing (an idle engine). Before, 4,096 of them
    could hold 4,096 x max_frame_bytes (48 grew a sender by 385 MB)."""
    monkeypatch.setattr(lifeline, "MAX_QUEUED_ALL", 3 * MAX_FRAME)
    p = Pair(tmp_path)
    others = []
    try:
        for i in range(5):
            e = lifeline.Lifeline.connect(p.path, f"half-{i}".encode(), MAX_FRAME)
            others.append(e)
            data = memoryview(lifeline.frame(b"y" * MAX_FRAME)[:-1])  # all but its last byte
            deadline = time.monotonic() + 5
            while data and time.monotonic() < deadline:
                data = data[e.write(data):]
                p.service()
        p.look(lambda: len(p.gone) >= 2)
        st = p.daemon.stats()
        assert st["lifeline_buffered_bytes"] <= 3 * MAX_FRAME and st["lifelines_dropped_for_bounds"] == len(p.gone), st
        assert 2 <= len(p.gone) <= 3 and b"engine-1" not in p.gone, p.gone  # the idle engine stays
        assert p.engine.alive() and p.daemon.send(b"engine-1", b"still answered")
    finally:
        for e in others:
            e.close()
        p.close()


@pytest.mark.parametrize("bad", ["over the cap", "no name", "silent"])
def test_a_lifeline_that_breaks_the_framing_is_closed_and_the_engine_sees_it(tmp_path, bad):
    path = tmp_path / "d.sock.life"
    daemon = lifeline.Lifelines(path, MAX_FRAME)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        if bad == "over the cap":  # named, then a length past the cap: nothing after it can be trusted
            s.sendall(lifeline.frame(b"e") + (MAX_FRAME + 1).to_bytes(4, "big"))
        elif bad == "no name":  # a first frame longer than any identity
            s.sendall(lifeline.frame(b"e" * (lifeline.MAX_IDENT + 1)))
        gone: list[bytes] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            accepted = daemon.stats()["lifelines"] > 0  # a silent one is closed once its hello is overdue
            later = lifeline.HELLO_TIMEOUT_S + 1 if bad == "silent" and accepted else 0
            gone += [ev.ident for ev in daemon.service(time.monotonic() + later) if ev.kind == lifeline.GONE]
            try:
                if s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                    break
            except BlockingIOError:
                pass
            time.sleep(0.001)  # bounded by the deadline
        assert daemon.stats()["lifelines"] == 0
        assert gone == ([b"e"] if bad == "over the cap" else [])
        assert daemon.stats()["lifeline_bad_frames"] == (0 if bad == "silent" else 1)
        s.settimeout(5)
        assert s.recv(1) == b""  # closed: the engine's waits see the daemon gone
    finally:
        s.close()
        daemon.close()


def test_real_daemons_survive_garbage_on_their_lifelines_and_serve_the_next_engine(daemons):
    """Random bytes, a frame over the cap, and a named connection sending messages that are not valid: each daemon
    answers what it can read with a typed error, closes what it cannot, and then serves a real push and read."""
    layout = KVLayout(2, 2, 64, "float16", 16)
    rx = daemons.receiver(**rx_opts(layout))
    tx = daemons.sender(rx)
    rnd = random.Random(11)
    for d in (tx, rx):
        path = lifeline.path_for(sock(d))
        for i in range(20):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(str(path))
                if i % 2:  # named: then frames that are not messages
                    s.sendall(lifeline.frame(f"junk-{i}".encode()))
                    for _ in range(3):
                        s.sendall(lifeline.frame(rnd.randbytes(rnd.randrange(0, 64))))
                    reply, _ = lifeline.split(_read_some(s), MAX_FRAME)
                    assert reply and isinstance(protocol.decode_answer(reply[0]), protocol.Error), reply
                else:
                    s.sendall(rnd.randbytes(rnd.randrange(1, 4096)))
            finally:
                s.close()
        until(lambda d=d: status(sock(d))["lifelines"] <= 1, 10, "the broken lifelines closed")
    round_trip(tx, rx, layout, "after-garbage", list(range(40)), seed=9)
    assert tx.alive() and rx.alive()



def test_begins_naming_receivers_that_cannot_be_used_are_refused_and_leave_nothing_behind(daemons):
    """An engine's Begins name receivers that cannot be used: not an endpoint at all, or one nobody answers at. The
    first are refused at once, typed; the second fail by their hello's deadline. Before, each malformed one raised
    out of the daemon's loop pass (a traceback, and ~10 ms with nothing served: 1,000 froze the sender 10 s), and
    the sender kept a record per receiver address it had ever been named, for good."""
    layout = KVLayout(2, 2, 64, "float16", 16)
    spec = protocol.LayoutSpec(**layout.to_dict())
    rx = daemons.receiver(**rx_opts(layout))
    tx = daemons.sender(rx, control_timeout_ms=300)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(str(lifeline.path_for(sock(tx))))
        s.sendall(lifeline.frame(b"engine-bad"))
        bad = [f"bogus-{i}" for i in range(200)] + ["tcp://127.0.0.1:0", "tcp://:5710", "ipc:///tmp/x"]
        unanswered = [f"tcp://127.0.0.1:{port}" for port in range(1, 21)]  # nothing listens there
        s.sendall(b"".join(lifeline.frame(protocol.encode(protocol.Begin(
            req_id=f"b{i}", receiver=r, layout=spec, chunk_keys=[bytes(16)], last_chunk_tokens=4)))
            for i, r in enumerate(bad + unanswered)))
        answers: list = []
        buf = bytearray()
        deadline = time.monotonic() + 20
        while len(answers) < len(bad) + len(unanswered) and time.monotonic() < deadline:
            buf += s.recv(1 << 16)
            frames, ok = lifeline.split(buf, MAX_FRAME)
            assert ok
            answers += [protocol.decode_answer(f) for f in frames]
        errors = {a.req_id: a for a in answers if isinstance(a, protocol.Error)}
        assert len(errors) == len(bad) + len(unanswered), answers[:5]
        assert all(errors[f"b{i}"].code is protocol.ErrorCode.BAD_MESSAGE for i in range(len(bad))), errors["b0"]
        assert "tcp://host:port" in errors["b0"].message
        assert all(errors[f"b{len(bad) + i}"].code is protocol.ErrorCode.TIMEOUT for i in range(len(unanswered)))
    finally:
        s.close()
    until(lambda: status(sock(tx))["receivers_known"] == 0, 10, "the receivers nothing uses forgotten")
    st = status(sock(tx))
    assert st["loop_errors"] == 0 and st["action_errors"] == 0, st
    round_trip(tx, rx, layout, "after-bad-receivers", list(range(40)), seed=3)
    assert "Traceback" not in tx.log()

def test_a_connection_closed_and_opened_again_is_gone_before_it_is_named_again(tmp_path):
    p = Pair(tmp_path)
    try:
        p.look(lambda: p.named)
        p.engine.close()
        again = lifeline.Lifeline.connect(p.path, b"engine-1", MAX_FRAME)  # the same connection, a new lifeline
        again.write(lifeline.frame(b"after"))
        events: list = []
        deadline = time.monotonic() + 5
        while not any(e.kind == lifeline.FRAME for e in events) and time.monotonic() < deadline:
            events += p.daemon.service()
            time.sleep(0.001)  # bounded by the deadline
        assert [(e.kind, e.payload) for e in events] == [(lifeline.GONE, b""), (lifeline.NAMED, b""),
                                                         (lifeline.FRAME, b"after")]
        assert p.daemon.has(b"engine-1")
        again.close()
    finally:
        p.close()


def test_what_was_queued_for_a_daemon_that_died_never_reaches_the_next(tmp_path):
    """A frame half written to a daemon that then dies, and frames posted behind it, are dropped with its lifeline:
    the restarted daemon reads the engine's next message whole, and nothing before it."""
    from pdpush.client.connection import Connection

    path = tmp_path / "d.sock"
    first = lifeline.Lifelines(lifeline.path_for(path), 4 << 20)
    conn = Connection(path, max_frame=4 << 20)
    try:
        assert conn.lifeline() is not None
        conn.post(protocol.Query(chunk_keys=[os.urandom(16) for _ in range(100_000)]))  # ~1.8 MB: not one write
        conn.post(protocol.Abort(req_id="r", reason="stale"))
        assert conn._outbox, "the socket took everything: the frame must be cut off for this test"
        first.close()  # dies without reading
        second = lifeline.Lifelines(lifeline.path_for(path), 4 << 20)
        try:
            conn.send(protocol.StatusRequest(), 5)
            events: list = []
            deadline = time.monotonic() + 5
            while not any(e.kind == lifeline.FRAME for e in events) and time.monotonic() < deadline:
                events += second.service()
                time.sleep(0.001)  # bounded by the deadline
            frames = [protocol.decode(e.payload) for e in events if e.kind == lifeline.FRAME]
            assert [type(m) for m in frames] == [protocol.StatusRequest]
            assert second.stats()["lifeline_bad_frames"] == 0
        finally:
            second.close()
    finally:
        conn.close()


def test_two_threads_of_an_engine_look_at_its_lifeline_at_once(tmp_path):
    """A completion thread checks the sender's liveness (alive) while the engine's thread reads its mail (frames):
    neither look may fail for the other's."""
    import threading

    p = Pair(tmp_path)
    errors: list[BaseException] = []
    stop = time.monotonic() + 0.5

    def look(fn):
        try:
            while time.monotonic() < stop:
                fn()
        except BaseException as e:  # noqa: BLE001 - any failure is the finding
            errors.append(e)

    try:
        p.look(lambda: p.named)
        ts = [threading.Thread(target=look, args=(f,)) for f in (p.engine.alive, p.engine.frames, p.engine.alive)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(5)
        assert not errors, errors
    finally:
        p.close()


def _read_some(s: socket.socket) -> bytearray:
    buf = bytearray()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        buf += s.recv(1 << 16)
        if len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "big"):
            return buf
    return buf


def test_a_daemon_under_a_low_open_files_limit_raises_it_and_takes_more_than_1024_engines(tmp_path):
    """Started with a soft limit of 1,024 open files, each daemon raises its own to its hard limit (up to 65,536),
    as servers do, and keeps 1,100 engines' lifelines open at once. Before, its accepts failed past ~1,000
    descriptors (EMFILE): it refused engines and paused its listener."""
    prefix, hard, want = low_nofile_prefix()
    n = min(1100, want - 300)  # (fewer under a hard limit this low: this process's own sockets count against it too)
    soft0, hard0 = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard0, hard0))  # this test's own n connections, and the daemons'
    layout = KVLayout(2, 2, 64, "float16", 16)
    started, conns = [], []
    try:
        rx = launch.start_receiver(tmp_path, prefix=prefix, prefault=False, **rx_opts(layout))
        started.append(rx)
        tx = launch.start_sender(tmp_path, prefix=prefix, prefault=False, staging_bytes=64 << 20,
                                 default_receiver=rx.info["control_endpoint"])
        started.append(tx)
        for d in (rx, tx):
            assert nofile_limits(d.pid) == (want, hard)
            assert d.info["open_files_limit"] == want and status(sock(d))["open_files_limit"] == want
            path = str(lifeline.path_for(sock(d)))
            for i in range(n):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conns.append(s)
                s.setblocking(False)  # (a daemon that stopped accepting fails here, not at the suite's timeout)
                until(lambda s=s, p=path: s.connect_ex(p) in (0, errno.EISCONN), 10, "a connection (the backlog full)")
                s.setblocking(True)
                s.sendall(lifeline.frame(f"engine-{i}".encode()))  # named: kept past the hello's deadline
            until(lambda d=d: status(sock(d))["lifelines"] >= n, 20, f"{n} lifelines open at the {d.role}")
            assert status(sock(d))["lifelines_refused"] == 0
            for s in conns:
                s.close()
            conns.clear()
        round_trip(tx, rx, layout, "many-lines", list(range(40)))  # and they serve on
    finally:
        for s in conns:
            s.close()
        for d in reversed(started):
            d.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft0, hard0))


def test_one_look_takes_a_bounded_number_of_frames_and_the_rest_come_in_order_at_the_next(tmp_path):
    """An engine that sends a flood of tiny frames costs the daemon at most ``FRAMES_PER_LOOK`` of them per look
    (4 MiB of empty frames made a million events of one look: seconds of the daemon's loop); the rest come at the
    next looks, in order, with no new event to wake them (``pending``), and its GONE after them."""
    p = Pair(tmp_path)
    p.look(lambda: p.named)
    n = 5 * lifeline.FRAMES_PER_LOOK + 7
    p.engine._sock.sendall(b"".join(lifeline.frame(i.to_bytes(4, "big")) for i in range(n)))  # (in the socket's
    p.engine.close()  # buffer whole: one read takes it all, and its end)
    time.sleep(0.05)
    p.looks.clear()
    deadline = time.monotonic() + 10
    while not p.gone and time.monotonic() < deadline:
        p.service()
        if not p.daemon.pending():
            time.sleep(0.001)
    assert p.gone == [b"engine-1"]
    assert [int.from_bytes(f, "big") for f in p.frames] == list(range(n))
    assert max(p.looks) <= lifeline.FRAMES_PER_LOOK and sum(1 for k in p.looks if k) >= 5, p.looks
    p.daemon.close()


def test_a_flood_of_empty_frames_costs_each_look_a_bounded_number(tmp_path):
    p = Pair(tmp_path)
    p.look(lambda: p.named)
    p.write_all(bytes(4 << 20), timeout_s=60)  # a million empty frames, the daemon looking as the engine writes
    p.look(lambda: len(p.frames) == 1 << 20, until_s=60)
    assert len(p.frames) == 1 << 20 and set(p.frames) == {b""}
    assert max(p.looks) <= lifeline.FRAMES_PER_LOOK, max(p.looks)
    p.close()
