"""Lifelines: an engine and its local daemon see each other die, with no pid.

A pid means nothing across PID namespaces: an engine in a container of its own reports pid 1, and probing it
from the daemon's namespace finds nothing, or another process. So liveness rides a connection instead. Each
engine connection opens a lifeline, a unix SOCK_SEQPACKET socket, to its daemon at ``<local socket>.life``,
and names its ZeroMQ identity in the one packet it ever sends. When either process dies the kernel closes its
end, and the other sees the hang-up at once, in whatever PID namespace each runs: the daemon fails that
connection's requests, the engine fails its waits.

``Lifelines`` is the daemon's side (one epoll fd for its poller); ``Lifeline`` the engine's. Imports no zmq.
"""

from __future__ import annotations

import os
import select
import socket
import time
from pathlib import Path

MAX_IDENT = 255
MAX_LINES = 4096  # lifelines a daemon keeps at once; more are refused (closed at once)
HELLO_TIMEOUT_S = 5.0  # a lifeline that has not named its connection by then is closed


def path_for(local_socket: str | Path) -> Path:
    """The lifeline socket beside a daemon's local (unix) socket path."""
    return Path(str(local_socket).removeprefix("ipc://") + ".life")


class Lifelines:
    """The daemon's side: accepts lifelines and says which connections' lifelines have closed."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # a stale one of a killed daemon (the local socket's bind already refused a live one)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)  # 0600 from the start: no window where another user could connect
        try:
            self._listener.bind(str(self.path))
        finally:
            os.umask(old)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._epoll = select.epoll()
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        self._pending: dict[int, tuple[socket.socket, float]] = {}  # fd -> (socket, hello deadline)
        self._lines: dict[int, tuple[socket.socket, bytes]] = {}  # fd -> (socket, connection identity)
        self._count: dict[bytes, int] = {}  # identity -> its lifelines open
        self.refused = 0

    def fileno(self) -> int:
        """Readable when a lifeline connects, names itself or closes."""
        return self._epoll.fileno()

    def has(self, ident: bytes) -> bool:
        return ident in self._count

    def service(self, now: float | None = None) -> tuple[list[bytes], list[bytes]]:
        """Accept, read names, reap: (identities that opened their first lifeline, identities whose last
        lifeline closed) since the last call."""
        now = time.monotonic() if now is None else now
        named: list[bytes] = []
        gone: list[bytes] = []
        for _ in range(4):  # an accept's hello may already be queued: read it in the same call
            events = self._epoll.poll(0)
            if not events:
                break
            for fd, _ in events:
                if fd == self._listener.fileno():
                    self._accept(now)
                elif fd in self._pending:
                    self._hello(fd, named)
                elif fd in self._lines:
                    self._check(fd, gone)
        for fd in [fd for fd, (_, deadline) in self._pending.items() if now > deadline]:
            self._drop_pending(fd)
        return named, gone

    def _accept(self, now: float) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(self._pending) + len(self._lines) >= MAX_LINES:
                self.refused += 1
                conn.close()
                continue
            conn.setblocking(False)
            self._pending[conn.fileno()] = (conn, now + HELLO_TIMEOUT_S)
            self._epoll.register(conn.fileno(), select.EPOLLIN | select.EPOLLRDHUP)

    def _hello(self, fd: int, named: list[bytes]) -> None:
        conn, _ = self._pending[fd]
        try:
            ident = conn.recv(MAX_IDENT + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            ident = b""
        if not ident or len(ident) > MAX_IDENT:
            self._drop_pending(fd)
            return
        del self._pending[fd]
        self._lines[fd] = (conn, ident)
        self._count[ident] = self._count.get(ident, 0) + 1
        if self._count[ident] == 1:
            named.append(ident)

    def _check(self, fd: int, gone: list[bytes]) -> None:
        conn, ident = self._lines[fd]
        try:
            data = conn.recv(1, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            return  # nothing more is ever sent; a stray packet is ignored
        self._epoll.unregister(fd)
        del self._lines[fd]
        conn.close()
        left = self._count[ident] - 1
        if left:
            self._count[ident] = left
        else:
            del self._count[ident]
            gone.append(ident)

    def _drop_pending(self, fd: int) -> None:
        conn, _ = self._pending.pop(fd)
        self._epoll.unregister(fd)
        conn.close()

    def stats(self) -> dict:
        return {"lifelines": len(self._lines), "lifelines_refused": self.refused}

    def close(self) -> None:
        for conn, _ in [*self._pending.values(), *self._lines.values()]:
            conn.close()
        self._pending.clear()
        self._lines.clear()
        self._count.clear()
        self._epoll.close()
        self._listener.close()
        try:
            self.path.unlink()
        except OSError:
            pass


class Lifeline:
    """The engine's side: one per connection to a daemon; ``alive()`` never waits."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._dead = False

    @classmethod
    def connect(cls, path: Path, ident: bytes) -> Lifeline | None:
        """A lifeline to the daemon serving ``path``; None when no daemon serves it (not started yet, or gone)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.settimeout(1.0)
            s.connect(str(path))
            s.send(ident)
            s.setblocking(False)
        except OSError:
            s.close()
            return None
        return cls(s)

    def alive(self) -> bool:
        """False once the daemon's end closed (the daemon died or restarted)."""
        if self._dead:
            return False
        try:
            data = self._sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if not data:
            self._dead = True
        return not self._dead

    def close(self) -> None:
        self._dead = True
        self._sock.close()
