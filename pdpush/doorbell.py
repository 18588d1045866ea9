"""The sender's doorbell: a FIFO beside its ingress socket, one byte to wake a sender that sleeps.

An engine that hands a layer over through its ring (ring.py) wakes the sender only when the sender's
idle word says it sleeps. It used to post a ZeroMQ ``Wake``; that message goes through a ZeroMQ I/O
thread in the engine and another in the sender before the sender's poll sees it, and on a loaded
2-core host those threads waited for a CPU: the sender woke 0.2 to 3 ms after the hand-over, most of
a one-chunk request's latency (BENCHMARKS.md). A byte written to a FIFO the sender polls wakes it
from the kernel, with no thread between.

* ``Doorbell`` (the sender): makes the FIFO (0600, beside the ingress socket, whose directory guards
  it the same way), polls its read end, ``drain``s it when it rings, and removes it on close. It
  holds a write end of its own, so that no writer means no hang-up event, only silence.
* ``Bell`` (an engine): opens the FIFO's write end once per sender (``BeginOk.doorbell``) and
  ``ring``s it; a full FIFO means a wake-up is already pending, which is as good. A sender that
  is gone (no reader) or a path that cannot be opened makes ``ring`` answer False, and the engine
  posts a ``Wake`` message instead (an older sender offers no doorbell at all).

A byte carries nothing: anyone who can write the FIFO can only wake the sender, which then looks at
its rings as it would on its next pass. Imports no zmq.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path


def path_for(ingress_socket: Path | str) -> str:
    """The doorbell of the sender whose ingress socket is ``ingress_socket``."""
    return f"{ingress_socket}.bell"


class Doorbell:
    """The sender's end: a FIFO it polls (``fileno``) and drains."""

    def __init__(self, path: str) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISFIFO(os.lstat(path).st_mode):  # a previous sender's, left by a kill -9
                os.unlink(path)
        os.mkfifo(path, 0o600)  # in the sender's checked socket directory (control.private_dir)
        self._r = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            self._w = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)  # ours: no writer left: no hang-up
        except OSError:
            os.close(self._r)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        if not stat.S_ISFIFO(os.fstat(self._r).st_mode):
            self.close()
            raise OSError(f"{path} is not the FIFO this sender made")

    def fileno(self) -> int:
        return self._r

    def drain(self) -> int:
        """Read every byte rung so far; how many."""
        n = 0
        while True:
            try:
                b = os.read(self._r, 4096)
            except BlockingIOError:
                return n
            if not b:
                return n
            n += len(b)

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class Bell:
    """An engine's end of one sender's doorbell, shared by the client's threads: a bell that fails is
    marked dead, and its descriptor is closed only by ``close`` (under the lock), never while another
    thread may be writing to it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._dead = False
        try:  # no reader (the sender is gone) is ENXIO; a missing or wrong path, another OSError
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            self._fd = -1
            return
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            fd = -1
        self._fd = fd

    def ring(self) -> bool:
        """Wake the sender; False if it cannot be rung (the caller wakes it by message)."""
        with self._lock:
            if self._fd < 0 or self._dead:
                return False
            try:
                os.write(self._fd, b"\0")
            except BlockingIOError:
                return True  # full: the sender has a wake-up pending already
            except OSError:
                self._dead = True  # no reader any more (EPIPE): the sender is gone
                return False
            return True

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = -1
