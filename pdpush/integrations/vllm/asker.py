"""Questions to the receiver's local socket that never make vLLM's scheduler loop wait.

The connector's scheduler side asks the receiver two things while requests run: whether a pushed
request has begun arriving (``scheduler.py``, for each decode request whose push has not begun) and
what the pool holds (``events.py``). Asked on the scheduler's thread with a blocking round trip, each
question stalls every running request's next step by the receiver's reply time. ``Asker`` sends each
question without waiting and reads the answers without waiting, at the scheduler's next call: its own
DEALER (the receiver answers a connection's questions in order), at most ``max_inflight`` outstanding,
a deadline for each. A receiver that misses one gets a fresh socket (a late answer can never answer
another question) and no questions for ``retry_s``. So does one whose connection drops (a receiver restarted): the
questions it had go unanswered, and the new receiver's answers to later ones would otherwise be matched to them,
by order, until the deadline.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any

import zmq

from pdpush import control, protocol
from pdpush.errors import PdpushError, error_from_code
from pdpush.protocol import Error, Msg

MAX_FRAME = 1 << 20
DROPPED = "the receiver's connection dropped (a receiver restarted?): its questions go unanswered"


class Lost(Exception):
    """The receiver did not answer in time, or the socket failed: ``tags`` were outstanding."""

    def __init__(self, why: str, tags: list[Any]) -> None:
        super().__init__(why)
        self.tags = tags


class Asker:
    def __init__(self, endpoint: str, *, timeout_s: float, retry_s: float, max_inflight: int,
                 max_frame: int = MAX_FRAME) -> None:
        s = str(endpoint)
        self.endpoint = s if "://" in s else f"ipc://{s}"
        self.timeout_s, self.retry_s, self.max_inflight, self.max_frame = timeout_s, retry_s, max_inflight, max_frame
        self.sock: zmq.Socket | None = None
        self._dropped: zmq.Socket | None = None  # the socket's monitor: its connection dropped
        self.inflight: deque[tuple[Any, float]] = deque()  # (tag, sent at), in the order asked
        self.down_until = 0.0

    def down(self, now: float) -> bool:
        """Not asking: the receiver missed a deadline less than ``retry_s`` ago."""
        return now < self.down_until

    def room(self, now: float) -> bool:
        return not self.down(now) and len(self.inflight) < self.max_inflight

    def ask(self, msg: Msg, tag: Any, now: float) -> bool:
        """Send ``msg`` now if the socket takes it without waiting; its answer comes back with ``tag``."""
        if not self.room(now):
            return False
        try:
            if self.sock is None:
                self.sock = control.dealer(self.endpoint, self.max_frame)
                self._dropped = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            if self._was_dropped() and self.inflight:
                tags = [t for t, _ in self.inflight] + [tag]
                self._fail(now)
                raise Lost(DROPPED, tags)
            self.sock.send(protocol.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:  # the questions in flight go with the socket: their askers hear it too
            tags = [t for t, _ in self.inflight] + [tag]
            self._fail(now)
            raise Lost(f"{type(e).__name__}: {e}", tags) from None
        self.inflight.append((tag, now))
        return True

    def answers(self, now: float) -> list[tuple[Any, Msg]]:
        """The answers that have arrived, each with its question's tag. Raises ``Lost`` (after closing
        the socket) when the oldest question is past its deadline: the answers read before it are lost
        with it, so ask them again."""
        got: list[tuple[Any, Msg]] = []
        try:
            if self._was_dropped() and self.inflight:
                raise Lost(DROPPED, [t for t, _ in self.inflight])
            while self.inflight and self.sock is not None:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = protocol.decode(frames[-1], self.max_frame)  # raises with its question still in flight
                if isinstance(msg, Error) and protocol.local_mismatch(err := error_from_code(msg.code, msg.message)):
                    raise err  # a receiver of another local protocol: lasting, so down for retry_s as if lost
                got.append((self.inflight.popleft()[0], msg))
        except Lost as e:
            self._fail(now)
            raise e from None
        except (zmq.ZMQError, PdpushError) as e:
            tags = [t for t, _ in got] + [t for t, _ in self.inflight]
            self._fail(now)
            raise Lost(f"{type(e).__name__}: {e}", tags) from None
        if self.inflight and now - self.inflight[0][1] > self.timeout_s:
            tags = [t for t, _ in got] + [t for t, _ in self.inflight]
            self._fail(now)
            raise Lost(f"no answer within {self.timeout_s} s", tags)
        return got

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for an answer (only where nothing else would run meanwhile)."""
        if self.sock is not None and self.inflight and timeout_s > 0:
            self.sock.poll(int(timeout_s * 1000), zmq.POLLIN)

    def _was_dropped(self) -> bool:
        """Whether the socket's connection dropped since the last look (what the monitor said is read away: a drop
        with nothing in flight lost nothing, and the socket reconnects by itself)."""
        dropped = False
        while self._dropped is not None and self._dropped.poll(0):
            self._dropped.recv_multipart()
            dropped = True
        return dropped

    def close(self) -> None:
        if self._dropped is not None:
            with contextlib.suppress(zmq.ZMQError):  # (the socket may be gone already)
                self.sock.disable_monitor()
            self._dropped.close(0)
            self._dropped = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        self.inflight.clear()

    def _fail(self, now: float) -> None:
        self.close()
        self.down_until = now + self.retry_s
