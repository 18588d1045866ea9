"""asker.py: questions to the receiver's local socket that never wait, against a real ZeroMQ ROUTER
standing in for the receiver (the real receiver answers through the same socket type; the connector
tests in test_vllm.py ask a real one)."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from pdpush import protocol
from pdpush.integrations.vllm.asker import Asker, Lost
from pdpush.protocol import Query, QueryReply


class Answerer:
    """A ROUTER on an ipc socket that answers each Query with QueryReply(held_prefix=len(keys)), after
    ``delay_s``, while ``answering``."""

    def __init__(self, path: str, delay_s: float = 0.0) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"ipc://{path}")
        self.delay_s, self.answering, self.stop = delay_s, True, threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = protocol.decode(frame, 1 << 20)
            if self.answering and isinstance(msg, Query):
                time.sleep(self.delay_s)
                self.sock.send_multipart([ident, protocol.encode(QueryReply(held_prefix=len(msg.chunk_keys)))])

    def close(self) -> None:
        self.stop.set()
        self.t.join(5)
        self.sock.close(0)


@pytest.fixture
def answerer(tmp_path):
    a = Answerer(str(tmp_path / "rx.sock"))
    try:
        yield a, str(tmp_path / "rx.sock")
    finally:
        a.close()


def _q(n: int) -> Query:
    return Query(chunk_keys=[bytes(16)] * n)


def _until_answers(asker: Asker, n: int, deadline_s: float = 5.0) -> list:
    got, end = [], time.monotonic() + deadline_s
    while len(got) < n and time.monotonic() < end:
        asker.wait(0.05)
        got += asker.answers(time.monotonic())
    return got


def test_answers_come_back_with_their_questions_tags_in_order_and_nothing_waits(answerer):
    _, path = answerer
    a = Asker(path, timeout_s=5, retry_s=1, max_inflight=4)
    try:
        assert all(a.ask(_q(n), f"r{n}", time.monotonic()) for n in (1, 2, 3, 4))
        assert not a.ask(_q(5), "r5", time.monotonic())  # max_inflight: refused, not queued
        early = a.answers(time.monotonic())  # whatever has come back already: nothing is waited for
        got = early + _until_answers(a, 4 - len(early))
        assert [(t, m.held_prefix) for t, m in got] == [("r1", 1), ("r2", 2), ("r3", 3), ("r4", 4)]
        assert a.ask(_q(6), "r6", time.monotonic())  # room again
        assert [t for t, _ in _until_answers(a, 1)] == ["r6"]
    finally:
        a.close()


def test_a_receiver_that_misses_the_deadline_loses_every_question_and_is_not_asked_for_retry_s(answerer):
    ans, path = answerer
    ans.answering = False
    a = Asker(path, timeout_s=0.2, retry_s=30, max_inflight=8)
    try:
        now = time.monotonic()
        assert a.ask(_q(1), "x", now) and a.ask(_q(2), "y", now)
        assert a.answers(now + 0.1) == []  # within the deadline: nothing yet, no error, and no wait for one
        with pytest.raises(Lost, match="no answer within 0.2 s") as e:
            a.answers(now + 0.3)
        assert e.value.tags == ["x", "y"]
        assert a.sock is None and not a.inflight  # a fresh socket next time: a late answer answers nothing
        assert a.down(now + 29) and not a.ask(_q(1), "z", now + 29)
        ans.answering = True
        assert not a.down(now + 31) and a.ask(_q(3), "z", now + 31)
        assert [(t, m.held_prefix) for t, m in _until_answers(a, 1)] == [("z", 3)]
    finally:
        a.close()


def test_a_receiver_that_is_not_there_costs_a_deadline_never_a_wait(tmp_path):
    a = Asker(str(tmp_path / "nobody.sock"), timeout_s=0.2, retry_s=5, max_inflight=8)
    try:
        t0 = time.monotonic()
        assert a.ask(_q(1), "x", t0)  # queued until the peer connects: nothing waits
        a.wait(0.05)
        assert a.answers(time.monotonic()) == []
        with pytest.raises(Lost):
            a.answers(t0 + 0.25)
        assert time.monotonic() - t0 < 1.0
    finally:
        a.close()


@pytest.fixture
def scripted(tmp_path):
    """An asker, and a bare ROUTER standing in for its receiver: ``answer(tag, frame)`` asks, and answers with
    ``frame``."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{tmp_path}/rx.sock")
    a = Asker(str(tmp_path / "rx.sock"), timeout_s=5, retry_s=5, max_inflight=8)

    def answer(tag: str, frame: bytes) -> None:
        assert a.ask(_q(1), tag, time.monotonic())
        assert sock.poll(5000)
        ident, _ = sock.recv_multipart()
        sock.send_multipart([ident, frame])

    try:
        yield a, answer
    finally:
        a.close()
        sock.close(0)


def test_an_answer_that_is_not_a_message_loses_the_questions(scripted):
    a, answer = scripted
    answer("x", b"\xc1garbage")
    with pytest.raises(Lost, match="RemoteProtocolError") as e:
        _until_answers(a, 1)
    assert e.value.tags == ["x"] and a.down(time.monotonic())


def _skewed_answers() -> dict:
    import msgpack

    old_reply = msgpack.unpackb(protocol.encode(QueryReply(held_prefix=1)), raw=False)
    del old_reply["local_version"]
    return {
        # a daemon of a newer local protocol refuses the Query (``protocol._check_local``)
        "newer daemon": protocol.encode(protocol.Error(
            code=protocol.ErrorCode.INCOMPATIBLE_PEER, message="query for None is of local protocol 2, this pdpush "
            "speaks 3: install one pdpush version in the engine's environment and the daemons'")),
        # a daemon of local protocol 1 did not number queries: it refuses the field itself
        "release-1 daemon": protocol.encode(protocol.Error(
            code=protocol.ErrorCode.BAD_MESSAGE,
            message="invalid message at query.local_version: Extra inputs are not permitted")),
        # and its answer carries no version, which this side refuses as it reads it
        "release-1 answer": msgpack.packb(old_reply, use_bin_type=True),
    }


@pytest.mark.parametrize("who", list(_skewed_answers()))
def test_a_receiver_of_another_local_protocol_loses_the_questions_and_is_not_asked_for_retry_s(scripted, who):
    """A decode scheduler's receiver of another pdpush answers its Query with a refusal, or with an answer of other
    rules: a lasting condition. The asker takes it as a lost receiver (no question for ``retry_s``) rather than as
    one request's error, which would have the connector log and ask again at every request. Another error answer is
    just an answer."""
    a, answer = scripted
    answer("other", protocol.encode(protocol.Error(code=protocol.ErrorCode.BAD_MESSAGE,
                                                   message="invalid message at query.chunk_keys")))
    (tag, got), = _until_answers(a, 1)
    assert tag == "other" and isinstance(got, protocol.Error) and not a.down(time.monotonic())
    answer("x", _skewed_answers()[who])
    with pytest.raises(Lost, match="local") as e:
        _until_answers(a, 1)
    assert e.value.tags == ["x"] and a.down(time.monotonic())


def test_a_send_that_fails_loses_every_question_in_flight_with_it(answerer):
    """A send that fails (not a full queue) closes the socket, and the questions in flight go with it: each must
    be named in the Lost, or its asker waits for an answer that never comes (a request held at every step)."""
    a, path = answerer
    a.answering = False
    asker = Asker(path, timeout_s=5.0, retry_s=1.0, max_inflight=8)
    now = time.monotonic()
    assert asker.ask(_q(1), "X", now)
    asker.sock.close(0)  # the socket fails under the next send
    with pytest.raises(Lost) as e:
        asker.ask(_q(1), "Y", now)
    assert e.value.tags == ["X", "Y"] and not asker.inflight and asker.down(now)


def test_a_receiver_restarted_with_questions_in_flight_loses_them_rather_than_answering_them_with_others(tmp_path):
    """The receiver restarts while a question waits (it died unanswered): the socket reconnects to the new one by
    itself, and its answers to later questions were matched, by order, to the lost ones until the deadline (a
    question with one key answered "2 held"). The drop is seen now: the questions in flight are lost, named, and the
    next ones, on a fresh socket, get their own answers."""
    path = str(tmp_path / "rx.sock")
    old = Answerer(path)
    old.answering = False  # it dies with the question unanswered
    a = Asker(path, timeout_s=5.0, retry_s=0.2, max_inflight=8)
    new = None
    try:
        assert a.ask(_q(1), "lost", time.monotonic())
        time.sleep(0.1)  # (the question reached the old receiver)
        old.close()
        new = Answerer(path)
        time.sleep(0.5)  # the socket has reconnected to the new receiver
        with pytest.raises(Lost, match="dropped") as e:
            a.ask(_q(2), "next", time.monotonic())
            a.wait(1.0)
            a.answers(time.monotonic())  # (where the drop was not seen at the ask)
        assert "lost" in e.value.tags and not a.inflight
        time.sleep(0.25)  # retry_s
        assert a.ask(_q(3), "again", time.monotonic())
        assert [(t, m.held_prefix) for t, m in _until_answers(a, 1)] == [("again", 3)]
    finally:
        a.close()
        if new is not None:
            new.close()
