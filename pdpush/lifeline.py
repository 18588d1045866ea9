"""Lifelines: each engine connection's stream to its local daemon, which also tells either end the other died.

An engine connection (``client.Connection``) opens a lifeline, a unix SOCK_STREAM socket, to its daemon at
``<local socket>.life``. Every message between them rides it, both ways, in frames: a 4-byte big-endian length,
then that many bytes. The engine's first frame names the connection (its identity, 1..255 bytes); every frame
after it is one protocol message (``protocol.encode``), at most the daemon's ``max_frame_bytes``.

* **Why messages ride it.** They went through a ZeroMQ DEALER on the daemon's local socket before. A ZeroMQ hop
  passes each message through an I/O thread in the sender's process and another in the receiver's, and each of
  them must be woken: a round trip between two processes here took 141 us back to back and 510 us after 50 ms
  idle, against 10 us and 156 us for the same bytes over a unix socket (BENCHMARKS.md). A request's begin, its
  answer and its Done each took one such hop.
* **Liveness, with no pid.** A pid means nothing across PID namespaces: an engine in a container of its own
  reports pid 1, and probing it from the daemon's namespace finds nothing, or another process. When either
  process dies the kernel closes its end, and the other sees the hang-up at once, in whatever PID namespace each
  runs: the daemon fails that connection's requests, the engine fails its waits.
* **Bounds.** A frame over the cap, or a first frame that is no identity, closes the lifeline (the engine sees
  a daemon that went away). So does an engine that does not read what the daemon writes it: past ``MAX_QUEUED``
  bytes unread (its requests fail as at its death, and what they held comes back). Across all lifelines, what is
  queued either way (answers unread, frames begun) is capped (``MAX_QUEUED_ALL``): past it, the lifeline holding
  the most goes. A healthy engine's answers are never dropped for another's sake.

``Lifelines`` is the daemon's side (one epoll fd for its poller); ``Lifeline`` the engine's. The daemon's local
ZeroMQ socket still serves what is not an engine's connection (a decode scheduler's queries). Imports no zmq.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import time
from pathlib import Path
from typing import NamedTuple

from pdpush.errors import IncompatiblePeer, UnexpectedMessage

MAX_IDENT = 255
MAX_LINES = 4096  # lifelines a daemon keeps at once; more are refused (closed at once)
HELLO_TIMEOUT_S = 5.0  # a lifeline that has not named its connection by then is closed
MAX_QUEUED = 16 << 20  # bytes a daemon keeps for one engine that is not reading them: past it, the lifeline goes
MAX_QUEUED_ALL = 256 << 20  # bytes queued either way (frames begun, answers unread) for all of them together
NAMED, FRAME, GONE = "named", "frame", "gone"  # what ``Lifelines.service`` reports, in order
_READ = 1 << 18  # bytes one recv takes
_READ_PER_LOOK = 4 << 20  # bytes one look reads from one lifeline: one busy engine does not hold up the others
# frames one look takes from one lifeline: 4 MiB of empty frames made a million events of one look (seconds of the
# daemon's loop); the rest wait for the next look, and nothing more is read from that lifeline until they are taken
FRAMES_PER_LOOK = 1024
_IN = select.EPOLLIN | select.EPOLLRDHUP


def path_for(local_socket: str | Path) -> Path:
    """The lifeline socket beside a daemon's local (unix) socket path."""
    return Path(str(local_socket).removeprefix("ipc://") + ".life")


def frame(payload: bytes) -> bytes:
    """``payload`` as one frame of a lifeline."""
    return len(payload).to_bytes(4, "big") + payload


def split(buf: bytearray, max_frame: int, limit: int = 1 << 62) -> tuple[list[bytes], bool]:
    """The whole frames at the head of ``buf`` (at most ``limit``), taken out of it; what is left is the start of
    the next. And whether the stream is still sound: False at a frame longer than ``max_frame`` (nothing past it
    can be trusted), after the frames before it."""
    out: list[bytes] = []
    i, n = 0, len(buf)
    sound = True
    while n - i >= 4 and len(out) < limit:
        k = int.from_bytes(buf[i:i + 4], "big")
        if k > max_frame:
            sound = False
            break
        if n - i - 4 < k:
            break
        out.append(bytes(buf[i + 4:i + 4 + k]))
        i += 4 + k
    if i:
        del buf[:i]
    return out, sound


def _read(sock: socket.socket, buf: bytearray, limit: int) -> bool:
    """Append what ``sock`` has (up to about ``limit`` bytes) to ``buf`` without waiting; False at its end (the
    peer closed it, or it failed). A read that comes back short has emptied the socket: no read after it to
    learn so (the empty read raises, which costs a few us)."""
    got = 0
    while got < limit:
        try:
            data = sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        buf += data
        got += len(data)
        if len(data) < _READ:
            return True
    return True


def off_lifeline(msg, path: Path) -> UnexpectedMessage:
    """The error for an engine's message (a Begin, an Open, ...) that came on a daemon's ZeroMQ socket, which takes
    only what is not an engine's connection (a status request; a decode scheduler's Query or Withdraw at the
    receiver)."""
    return UnexpectedMessage(f"{msg.type} on the daemon's ZeroMQ socket: an engine's connection sends its messages "
                             f"on its lifeline, {path} (local protocol 3)", req_id=getattr(msg, "req_id", None))


class Event(NamedTuple):
    """A connection's lifeline opened (NAMED: its first), sent a frame (FRAME), or closed (GONE: its last)."""

    kind: str
    ident: bytes
    payload: bytes = b""


class _Line:
    """One engine connection's lifeline, at the daemon."""

    __slots__ = ("sock", "ident", "rbuf", "wbuf", "deadline", "writing", "doomed", "ended")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        self.ident = b""  # named by its first frame
        self.rbuf, self.wbuf = bytearray(), bytearray()
        self.writing = False  # registered for EPOLLOUT: wbuf waits for room
        self.doomed = False  # closed at the next look: its engine does not read, or it holds the most
        self.ended = False  # its end was read: it goes once the frames read before it are taken


class Lifelines:
    """The daemon's side: accepts lifelines, reads their frames, writes its answers, and says which connections'
    lifelines opened and which closed."""

    def __init__(self, path: Path, max_frame: int) -> None:
        self.path = Path(path)
        self.max_frame = max_frame
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # a stale one of a killed daemon (the local socket's bind already refused a live one)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # 0600 from the start: no window where another user could connect
        try:
            self._listener.bind(str(self.path))
        finally:
            os.umask(old)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._epoll = select.epoll()
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        self._paused_until = 0.0  # out of fds: the listener is not watched until then (it would wake every look)
        self._lines: dict[int, _Line] = {}  # fd -> line, named or not yet
        self._pending: set[int] = set()  # lines with whole frames read and not taken yet (over FRAMES_PER_LOOK)
        self._named: dict[bytes, _Line] = {}  # identity -> its lifeline (the latest, where it opened more)
        self._count: dict[bytes, int] = {}  # identity -> its lifelines open
        self._queued = 0  # bytes in every line's wbuf
        self._buffered = 0  # bytes in every line's rbuf (frames begun)
        self.refused = 0
        self.bad_frames = 0
        self.dropped_for_bounds = 0  # lifelines closed for what they left queued (unread answers, frames begun)

    def fileno(self) -> int:
        """Readable when a lifeline connects, sends, closes, or has room again for what waits to be written."""
        return self._epoll.fileno()

    def has(self, ident: bytes) -> bool:
        return ident in self._count

    def pending(self) -> bool:
        """Whether frames read are still to be taken (``service`` takes them, without a wake-up of ``fileno``)."""
        return bool(self._pending)

    def service(self, now: float | None = None) -> list[Event]:
        """Accept, read, write, reap, without waiting: what happened since the last call, in order. A connection
        is NAMED before its frames and GONE after them (what an engine sent before it went counts), and a
        connection that closes and opens again is GONE before it is NAMED again."""
        now = time.monotonic() if now is None else now
        out: list[Event] = []
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        taken = set()
        for _ in range(4):  # an accept's hello may already be queued: read it in the same call
            events = self._epoll.poll(0)
            if not events:
                break
            for fd, ev in events:
                if fd == self._listener.fileno():
                    self._accept(now)
                    continue
                line = self._lines.get(fd)
                if line is None:
                    continue
                if ev & select.EPOLLOUT:
                    self._write(line)
                if ev & ~select.EPOLLOUT and fd not in taken:  # (one look a call: its next frames at the next)
                    taken.add(fd)
                    self._take(line, out)
        for fd in [fd for fd in self._pending if fd not in taken]:  # frames read before: no event says so
            self._take(self._lines[fd], out)
        for line in [ln for ln in self._lines.values() if ln.doomed or (not ln.ident and now > ln.deadline)]:
            self.dropped_for_bounds += line.doomed
            self._drop(line, out)
        return out

    def send(self, ident: bytes, payload: bytes) -> bool:
        """Write ``payload`` as a frame to ``ident``'s engine, or queue it until its lifeline has room; False where
        it has none open, or keeps ``MAX_QUEUED`` bytes it has not read (``MAX_QUEUED_ALL`` for every engine)."""
        line = self._named.get(ident)
        size = 4 + len(payload)
        room = max(MAX_QUEUED, self.max_frame + 4)  # any one answer fits an engine that reads
        if line is None or line.doomed:
            return False
        if len(line.wbuf) + size > room:  # its engine does not read: it goes, as if it died (its requests fail)
            self._doom(line)
            return False
        if self._queued + self._buffered + size > max(MAX_QUEUED_ALL, room):
            self._doom_biggest()
            if line.doomed:
                return False
        line.wbuf += frame(payload)
        self._queued += size
        if not line.writing:
            self._write(line)
        return True

    def _doom(self, line: _Line) -> None:
        """``line`` goes at the next look; what it holds stops counting now (its engine hears nothing more)."""
        line.doomed = True
        self._queued -= len(line.wbuf)
        self._buffered -= len(line.rbuf)
        line.wbuf.clear()
        line.rbuf.clear()

    def _doom_biggest(self) -> None:
        """Queued bytes past ``MAX_QUEUED_ALL``: the lifeline that holds the most (unread, or begun) goes."""
        held = [ln for ln in self._lines.values() if not ln.doomed and (ln.wbuf or ln.rbuf)]
        if held:
            self._doom(max(held, key=lambda ln: len(ln.wbuf) + len(ln.rbuf)))

    def _accept(self, now: float) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of fds: the connection waits in the backlog; look again in 100 ms
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.refused += 1
                    self._epoll.unregister(self._listener.fileno())
                    self._paused_until = now + 0.1
                return
            if len(self._lines) >= MAX_LINES:
                self.refused += 1
                conn.close()
                continue
            conn.setblocking(False)
            self._lines[conn.fileno()] = _Line(conn, now + HELLO_TIMEOUT_S)
            self._epoll.register(conn.fileno(), _IN)

    def _take(self, line: _Line, out: list[Event]) -> None:
        """Read what ``line`` has: its name, if this is its first frame, then its frames; reap it at its end, or at
        a frame that breaks the framing (after the frames before it)."""
        if line.doomed:
            return
        fd = line.sock.fileno()
        before = len(line.rbuf)
        if fd not in self._pending and not line.ended and not _read(line.sock, line.rbuf, _READ_PER_LOOK):
            line.ended = True
        sound = True
        if not line.ident:
            hello, sound = split(line.rbuf, MAX_IDENT, limit=1)
            if hello and not hello[0]:
                sound = False  # an empty identity
            elif hello:
                self._name(line, hello[0], out)
        more = False
        if line.ident and sound:
            frames, sound = split(line.rbuf, self.max_frame, limit=FRAMES_PER_LOOK)
            out.extend(Event(FRAME, line.ident, f) for f in frames)
            more = len(frames) == FRAMES_PER_LOOK  # (maybe more whole frames: the next look takes them first)
        self._buffered += len(line.rbuf) - before
        if self._queued + self._buffered > max(MAX_QUEUED_ALL, 2 * self.max_frame):
            self._doom_biggest()
        if not sound:
            self.bad_frames += 1
        if more and sound:
            self._pending.add(fd)
        else:
            self._pending.discard(fd)
        if not sound or (line.ended and not more):
            self._drop(line, out)

    def _name(self, line: _Line, ident: bytes, out: list[Event]) -> None:
        line.ident = ident
        self._named[ident] = line
        self._count[ident] = self._count.get(ident, 0) + 1
        if self._count[ident] == 1:
            out.append(Event(NAMED, ident))

    def _write(self, line: _Line) -> None:
        """Write what ``line`` has queued, as far as it has room; wait for room (EPOLLOUT) for the rest."""
        before = len(line.wbuf)
        while line.wbuf:
            try:
                n = line.sock.send(line.wbuf, socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # its engine is gone: its end is read (and the line reaped) at the next look
                line.wbuf.clear()
                break
            del line.wbuf[:n]
        self._queued -= before - len(line.wbuf)
        want = bool(line.wbuf)
        if want != line.writing:
            line.writing = want
            self._epoll.modify(line.sock.fileno(), _IN | select.EPOLLOUT if want else _IN)

    def _drop(self, line: _Line, out: list[Event]) -> None:
        fd = line.sock.fileno()
        self._epoll.unregister(fd)
        del self._lines[fd]
        self._pending.discard(fd)
        self._queued -= len(line.wbuf)
        self._buffered -= len(line.rbuf)
        line.sock.close()
        ident = line.ident
        if not ident:
            return
        if self._named.get(ident) is line:
            del self._named[ident]
            for other in self._lines.values():  # another lifeline of the same connection answers from now on
                if other.ident == ident:
                    self._named[ident] = other
        left = self._count[ident] - 1
        if left:
            self._count[ident] = left
        else:
            del self._count[ident]
            out.append(Event(GONE, ident))

    def stats(self) -> dict:
        return {"lifelines": len(self._lines), "lifelines_refused": self.refused,
                "lifeline_bad_frames": self.bad_frames, "lifeline_queued_bytes": self._queued,
                "lifeline_buffered_bytes": self._buffered, "lifelines_dropped_for_bounds": self.dropped_for_bounds}

    def close(self) -> None:
        for line in self._lines.values():
            line.sock.close()
        self._lines.clear()
        self._named.clear()
        self._count.clear()
        self._epoll.close()
        self._listener.close()
        try:
            self.path.unlink()
        except OSError:
            pass


class Lifeline:
    """The engine's side: one per connection to a daemon. Never waits unless asked to (``wait``)."""

    def __init__(self, sock: socket.socket, max_frame: int) -> None:
        self._sock = sock
        self.max_frame = max_frame
        self._rbuf = bytearray()
        self._dead = False  # its end was read (or the stream broke): nothing more comes
        self.write_failed = False  # a write failed: nothing more goes

    @classmethod
    def connect(cls, path: Path, ident: bytes, max_frame: int) -> Lifeline | None:
        """A lifeline to the daemon serving ``path``, named ``ident``; None when no daemon serves it (not started
        yet, or gone). IncompatiblePeer for a daemon whose lifelines carry no messages (local protocol 2 and
        before: a packet socket)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(1.0)
            s.connect(str(path))
            s.sendall(frame(ident))
            s.setblocking(False)
        except OSError as e:
            s.close()
            if e.errno == errno.EPROTOTYPE:
                raise IncompatiblePeer(f"the pdpush daemon at {path} is of an older local protocol (its lifelines "
                                       "carry no messages): install one pdpush version in the engine's environment "
                                       "and the daemons' (`pdpush --version` prints it)") from None
            return None
        return cls(s, max_frame)

    def fileno(self) -> int:
        return self._sock.fileno()

    def write(self, data: bytes | memoryview) -> int:
        """Write as much of ``data`` as the socket takes now: how many bytes (0 once a write failed: the daemon
        is gone, though what it sent before can still be read)."""
        if self.write_failed:
            return 0
        try:
            return self._sock.send(data, socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            self.write_failed = True
            return 0

    def frames(self) -> list[bytes]:
        """The whole frames the daemon has sent so far, without waiting. A frame over the cap ends the lifeline,
        after the frames before it: nothing after it can be read."""
        if not self._dead and self._readable() and not _read(self._sock, self._rbuf, 1 << 62):
            self._dead = True
        got, sound = split(self._rbuf, self.max_frame)
        if not sound:
            self._dead = True
            self._rbuf.clear()
        return got

    def _readable(self) -> bool:
        """Whether a read would not block (data, or the daemon's end), without reading: a read of an empty
        socket raises, which costs a few us, and an engine looks twice a layer (Connection.drain) and at its
        liveness once (alive). A poll object of its own per look: threads of one engine look at once."""
        p = select.poll()
        p.register(self._sock.fileno(), select.POLLIN)
        try:
            return bool(p.poll(0))
        except OSError:  # closed under it by another thread: a read says the rest
            return True

    def wait(self, timeout_s: float, write: bool = False) -> bool:
        """Wait up to ``timeout_s`` for something to read (or room to write); whether it came."""
        p = select.poll()
        p.register(self._sock.fileno(), select.POLLOUT if write else select.POLLIN)
        return bool(p.poll(max(0, int(timeout_s * 1000 + 0.999))))

    def alive(self) -> bool:
        """False once the daemon's end closed (the daemon died or restarted) and all it sent before is read."""
        if self._dead:
            return False
        if not self._readable():  # nothing to read, not even its end
            return True
        try:
            data = self._sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if not data:
            self._dead = True
        return not self._dead

    def usable(self) -> bool:
        """Whether messages can still go both ways: no write failed, and the daemon's end is not closed."""
        return not self.write_failed and self.alive()

    def close(self) -> None:
        self._dead = True
        self._sock.close()
