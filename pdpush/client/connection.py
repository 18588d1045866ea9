"""What both engine-side clients share: the connection to a daemon (``Connection``: its lifeline, which carries
the messages both ways, and its mailboxes by request), the shared memory segments a client holds
(``Attachments``), how a decode client waits (``WaitPolicy``), and ``status``.

Imports numpy only.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from pdpush import lifeline, protocol
from pdpush.errors import (
    BrokenResourceError,
    PdpushError,
    ProtocolError,
    RemoteProtocolError,
    TransportTimeout,
    error_from_code,
)
from pdpush.lifeline import Lifeline
from pdpush.protocol import (
    Committed,
    Error,
    LayerAvailable,
    Msg,
    StagingGranted,
    StatusReply,
    StatusRequest,
)
from pdpush.shm import Attached

NOTICES = (LayerAvailable, Committed)  # what a daemon tells a request's reader unasked: never a reply



@dataclass(frozen=True)
class WaitPolicy:
    """How a decode client waits for a layer (``DecodeRequest.wait_layer``): it re-reads the layer's
    readiness words in a tight loop for ``spin_s``, then every ``nap_s`` until ``nap_window_s``, then
    waits on the receiver's ``LayerAvailable`` in ``slice_s`` slices, re-reading the words between.
    The words land by a remote put, which nothing on this host sees but a read; the receiver's notice
    comes with the request's Commit (or, where checksums are on, once it has verified the layer).

    The default was measured (``pdpush bench --scenario decode_wait``, BENCHMARKS.md): a 200 us spin
    for a layer already landing, then the receiver's wake-up, re-reading the words every millisecond
    (the words land before the receiver's notice, which takes two more hops). It costs a fraction of
    the CPU of spinning or napping. On a box with cores to spare a longer spin sees the words sooner;
    where the decode engine shares cores with the daemons, spinning slows the sender it waits for."""

    spin_s: float = 0.0002
    nap_s: float = 0.0001
    nap_window_s: float = 0.0002  # no naps: after the spin, the receiver wakes the wait
    slice_s: float = 0.001


DEFAULT_WAIT = WaitPolicy()


def on_host(x):
    if type(x).__module__.startswith("torch") and x.device.type != "cpu":
        return x.cpu()
    return x


def raise_error(msg: Msg) -> None:
    if isinstance(msg, Error):
        raise error_from_code(msg.code, msg.message, msg.req_id, msg.retry_after_ms)


def untakeable(e: Exception, what: str, req_id: str) -> PdpushError:
    """What to raise for a daemon's answer this engine cannot take (``e``, from building on it): the typed error
    itself, or a RemoteProtocolError that says which answer."""
    if isinstance(e, PdpushError):
        return e
    return RemoteProtocolError(f"{what} of {req_id!r}: the daemon's answer does not hold: {e}", req_id=req_id)


class Connection:
    """An engine's connection to its local daemon: messages both ways over its lifeline (lifeline.py), request and
    reply helpers, and a mailbox per request."""

    def __init__(self, sock_path: str | Path, max_frame: int = protocol.DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        # our own identity, which the lifeline names to the daemon: the daemon's answers and our liveness, no pid
        self.ident = secrets.token_bytes(16)
        self._life_path = lifeline.path_for(str(sock_path))
        self.life: Lifeline | None = None
        self.mail: dict[str | None, list[Msg]] = {}
        # mail is kept only for a request this side has open (``begin`` to ``end``) or a call waits on; any other's,
        # a late answer to one it ended or a daemon's mistake, is dropped: no mailbox is made for an id the daemon names
        self._open: set[str] = set()
        self._calls: dict[str | None, int] = {}  # calls waiting on a reply about a request, by request
        self.peer_id = ""  # learnt from BeginOk/OpenOk: the local daemon's start (a new one: it restarted)
        # The lifeline is used by one thread at a time, under ``lock``. A completion thread
        # (integrations/device_copy.py) never waits for it: ``post`` queues its frame in ``_outbox``, which
        # whoever holds the lock sends first; waits then run in short slices so that queued frames leave soon.
        self.lock = threading.Lock()
        self._outbox: deque[list] = deque()  # [frame, its number(, begun)]: the first may be partly written
        self._numbering = threading.Lock()  # frames are numbered in the order they join the outbox
        self._numbered = 0
        self._written = 0  # the number of the last frame written whole
        self._inbox: deque[bytes] = deque()  # frames read, not yet decoded
        self._closed = False
        self._lost = False  # a lifeline died and none replaced it yet (_reline)
        self._slice_s = 0.25
        self._owed: dict[str | None, int] = {}  # replies still to come to calls that timed out, by request (call)

    def allow_posts(self, slice_s: float = 0.002) -> None:
        """Another thread will ``post``: wait for replies in ``slice_s`` slices, sending its frames between."""
        self._slice_s = min(self._slice_s, slice_s)

    def post(self, msg: Msg) -> None:
        """Send from any thread without waiting: now if the lifeline is free, else by its current user. Dropped
        while the daemon it was for is gone and no other answers: it was about that daemon's requests."""
        frame = lifeline.frame(protocol.encode(msg))
        with self._numbering:
            if self._lost:
                return
            self._numbered += 1
            self._outbox.append([frame, self._numbered])
        self._flush_if_free()

    def flush(self) -> None:
        """Write what posts left queued (the socket was full then), as far as it takes it now, without waiting."""
        self._flush_if_free()

    def _flush_if_free(self) -> None:
        if self._outbox and self.lock.acquire(blocking=False):
            try:
                self._flush()  # a full socket leaves the rest for the next holder of the lock
            finally:
                self.lock.release()

    def _flush(self) -> None:
        """Write queued frames (lock held), as far as the lifeline takes them now."""
        life = self.life
        if life is None:
            return
        while self._outbox:
            head = self._outbox[0]
            n = life.write(head[0])
            if n < len(head[0]):
                if n:
                    head[0] = head[0][n:]
                    if len(head) == 2:
                        head.append(True)  # begun: it must end whole, whatever its sender decides
                return
            self._written = head[1]
            self._outbox.popleft()

    def _line(self, deadline: float) -> Lifeline:
        """The open lifeline (lock held), connecting one until ``deadline`` where there is none: the daemon may
        be starting."""
        while True:
            life = self._reline()
            if life is not None:
                return life
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"no pdpush daemon answers at {self._life_path}")
            time.sleep(0.01)  # a daemon that is starting: its socket appears; bounded by the deadline

    def send(self, msg: Msg, timeout_s: float) -> None:
        """Send ``msg``, by ``timeout_s``: TransportTimeout where the daemon does not read it by then (a frame
        that has begun to be written is finished all the same: a stream cannot lose half a frame), and
        BrokenResourceError where the daemon dies first."""
        deadline = time.monotonic() + timeout_s
        frame = lifeline.frame(protocol.encode(msg))
        try:
            with self.lock:
                life = self._line(deadline)
                with self._numbering:  # the common case: nothing queued before it (a post joins the queue under
                    self._numbered += 1  # this lock), and the socket takes it whole
                    n = self._numbered
                    done = life.write(frame) if not self._outbox else 0
                    if done == len(frame):
                        self._written = n
                        return
                    self._outbox.append([frame[done:], n, True] if done else [frame, n])  # the rest, as any queued
            while True:
                with self.lock:
                    if self.life is not life:  # it died and was replaced: what was queued for it went with it
                        raise BrokenResourceError("the local pdpush daemon died (its lifeline closed)")
                    self._flush()  # posted frames go first: a hand-over before the finish that follows it
                    if self._written >= n:
                        return
                    if not life.usable():
                        self._unqueue(n)
                        raise BrokenResourceError("the local pdpush daemon died (its lifeline closed)")
                    if time.monotonic() > deadline:
                        self._unqueue(n)
                        raise TransportTimeout("local daemon is not accepting messages")
                life.wait(0.01, write=True)
        finally:
            self._flush_if_free()

    def _unqueue(self, n: int) -> None:
        """Take frame ``n`` back (lock held) unless it has begun to be written: a stream cannot lose half a frame."""
        with self._numbering:
            for i, f in enumerate(self._outbox):
                if f[1] == n:
                    if len(f) == 2:
                        del self._outbox[i]
                    return

    def recv_for(self, req_id: str | None, deadline: float, grants: bool = False, life: Lifeline | None = None) -> Msg:
        """Next message about ``req_id`` (others are kept for their owners). A ``StagingGranted`` is for
        a wait on staging (``grants``); anyone else drops it (a late one, after its wait timed out). ``life``: the
        lifeline the request went out on: BrokenResourceError once that daemon is gone (its request with it), though
        the connection has reached a restarted daemon since."""
        try:
            return self._recv_for(req_id, deadline, grants, life)
        finally:
            self._flush_if_free()

    def drain(self) -> None:
        """Sort what has arrived into the mailboxes, without waiting (skipped while another thread holds
        the lifeline): a prefill engine notices its request's failure at its next layer."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            self._flush()
            if self.life is not None:
                self._inbox.extend(self.life.frames())
            while self._inbox:
                self._file(protocol.decode_answer(self._inbox.popleft(), self.max_frame))
        finally:
            self.lock.release()

    def _file(self, msg: Msg) -> str | None:
        """Keep ``msg`` in its request's mailbox (unless this side ended the request); its req_id."""
        if did := getattr(msg, "daemon_id", ""):
            self.peer_id = did
        rid = getattr(msg, "req_id", None)
        self._keep(rid, msg)
        return rid

    def _wanted(self, rid: str | None) -> bool:
        """Whether mail about ``rid`` has a reader to come: a request open here, a call waiting, or none named."""
        return rid is None or rid in self._open or rid in self._calls

    def _keep(self, rid: str | None, msg: Msg) -> None:
        """File ``msg`` in ``rid``'s mailbox if it has a reader to come; else drop it (a reply owed to a call that
        timed out is paid with it: the next call about ``rid`` takes its own)."""
        if self._wanted(rid):
            self.mail.setdefault(rid, []).append(msg)
        elif not isinstance(msg, NOTICES) and rid in self._owed:
            self._late(rid)

    def _recv_one(self, deadline: float) -> Msg:
        """The next message from the daemon, by ``deadline`` (TransportTimeout); BrokenResourceError once it is
        gone and everything it sent before is read."""
        with self.lock:
            self._flush()
            while True:
                if self._inbox:
                    return protocol.decode_answer(self._inbox.popleft(), self.max_frame)
                life = self.life
                if life is None:
                    raise BrokenResourceError("no local pdpush daemon: this connection has sent it nothing")
                self._inbox.extend(life.frames())
                if self._inbox:
                    continue
                if not life.alive():
                    raise BrokenResourceError("the local pdpush daemon died (its lifeline closed)")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout("no reply before the deadline")
                life.wait(left)

    def _recv_for(self, req_id: str | None, deadline: float, grants: bool, life: Lifeline | None = None) -> Msg:
        box = self.mail.get(req_id)
        while box:
            msg = box.pop(0)
            if not box:
                del self.mail[req_id]  # an empty box kept for every request would grow without bound
            if grants or not isinstance(msg, StagingGranted):
                return msg
        alive_check = time.monotonic() + 0.25
        while True:
            try:  # wait in slices, checking every 250 ms that the daemon is still alive
                msg = self._recv_one(min(deadline, time.monotonic() + self._slice_s))
            except TransportTimeout:
                if time.monotonic() < min(deadline, alive_check):
                    continue
                alive_check = time.monotonic() + 0.25
                if not self.daemon_alive() or (life is not None and not life.alive()):
                    raise BrokenResourceError("the local pdpush daemon died (its lifeline closed)") from None
                if time.monotonic() >= deadline:
                    raise
                continue
            if did := getattr(msg, "daemon_id", ""):
                self.peer_id = did
            rid = getattr(msg, "req_id", None)
            if rid == req_id:
                if grants or not isinstance(msg, StagingGranted):
                    return msg
            else:
                self._keep(rid, msg)
            if not self._inbox and time.monotonic() >= deadline:  # other requests' mail, coming without a pause,
                raise TransportTimeout("no reply before the deadline")  # does not extend a wait past what was read

    def end(self, req_id: str) -> None:
        """This side is done with ``req_id``: drop its mail now and whatever arrives for it later."""
        self.mail.pop(req_id, None)
        self._owed.pop(req_id, None)
        self._open.discard(req_id)

    def begin(self, req_id: str) -> None:
        """A new request under ``req_id``: its mail is wanted (until ``end``)."""
        self._open.add(req_id)

    def lifeline(self) -> Lifeline | None:
        """This connection's lifeline to its daemon, opened anew when the daemon it had died (a restarted one
        is another daemon); None while no daemon serves the socket."""
        with self.lock:
            return self._reline()

    def _reline(self) -> Lifeline | None:
        """``lifeline`` with the lock held. What was queued for a daemon that died is dropped with its lifeline
        (a frame half written among it): none of it is for the next daemon. What it sent before it died is
        still read."""
        if self._closed:
            raise BrokenResourceError("this connection to the local pdpush daemon is closed")
        if self.life is None or not self.life.usable():
            if self.life is not None:
                self.life.close()
                self.life = None
                with self._numbering:
                    self._outbox.clear()
                    self._lost = True  # until another daemon answers, posts are for the dead one's requests
            self.life = Lifeline.connect(self._life_path, self.ident, self.max_frame)
            if self.life is not None:
                self._owed.clear()  # (a new daemon answers none of the old one's calls)
                with self._numbering:
                    self._lost = False
        return self.life

    def daemon_alive(self) -> bool:
        """False once the daemon this connection's lifeline reached has died."""
        return self.life is None or self.life.alive()

    def call(self, msg: Msg, req_id: str | None, timeout_s: float) -> Msg:
        """Send ``msg``, and its reply (its typed error raised). A notice about the request that comes first
        (a layer landed, it committed) is not the reply: it stays in the request's mailbox, in order. A call that
        times out leaves its reply owed: when it comes, it is dropped, never taken for the next call's."""
        with self._numbering:
            self._calls[req_id] = self._calls.get(req_id, 0) + 1  # its reply is filed for it, whoever reads it
        try:
            self.send(msg, timeout_s)
            life = self.life
            try:
                reply = self.reply(req_id, time.monotonic() + timeout_s, check=False)
            except TransportTimeout:  # (no answer came: one that came and says "timeout" is raised below)
                if self.life is life:  # (a restarted daemon owes nothing)
                    self._owed[req_id] = self._owed.get(req_id, 0) + 1
                raise
        finally:
            with self._numbering:
                if self._calls[req_id] > 1:
                    self._calls[req_id] -= 1
                else:
                    del self._calls[req_id]
        raise_error(reply)
        return reply

    def reply(self, req_id: str | None, deadline: float, check: bool = True, life: Lifeline | None = None) -> Msg:
        """The reply about ``req_id`` to a message already sent (its typed error raised, unless not ``check``),
        by ``deadline`` (TransportTimeout); notices that come first stay in the request's mailbox, in order; replies
        owed to calls that timed out are dropped. ``life``: as ``recv_for``'s."""
        notices: list[Msg] = []
        try:
            while isinstance(reply := self.recv_for(req_id, deadline, life=life), NOTICES) or self._late(req_id):
                if isinstance(reply, NOTICES):
                    notices.append(reply)
        finally:
            if notices and self._wanted(req_id):
                self.mail[req_id] = notices + self.mail.get(req_id, [])
        if check:
            raise_error(reply)
        return reply

    def _late(self, req_id: str | None) -> bool:
        """Whether the reply just taken about ``req_id`` is owed to an earlier call that timed out (then dropped)."""
        n = self._owed.get(req_id, 0)
        if n:
            if n > 1:
                self._owed[req_id] = n - 1
            else:
                del self._owed[req_id]
        return bool(n)

    def close(self) -> None:
        """Close the lifeline, after what is queued that the socket takes now (the daemon reads it before the
        hang-up). A closed connection sends nothing more."""
        with self.lock:
            self._closed = True
            if self.life is not None:
                self._flush()
                self.life.close()


class Attachments:
    """Attached shm segments with a count of live users each.

    A restarted daemon hands out a new shmid; the old segment is detached as soon
    as nothing uses it, so a dead daemon's memory is not kept alive by its clients.
    """

    def __init__(self, readonly: bool = False) -> None:
        self._segs: dict[int, Attached] = {}
        self._users: dict[int, int] = {}
        self.pin = False  # page-lock each segment for this process's CUDA copies (Attached.pin)
        self.readonly = readonly  # attach each so that this process cannot write it (a decode engine's, the pool)

    def pin_all(self) -> None:
        """Pin every segment, now and from now on (a no-op where CUDA is not available)."""
        self.pin = True
        for a in self._segs.values():
            a.pin()

    def hold(self, shmid: int, nbytes: int) -> Attached:
        a = self._segs.get(shmid)
        if a is None:
            for old in [i for i in self._segs if not self._users.get(i)]:
                self._segs.pop(old).close()
                self._users.pop(old, None)
            a = self._segs[shmid] = Attached(shmid, nbytes, self.readonly)
            if self.pin:
                a.pin()
            a.populate_async()  # the daemon's pages mapped here ahead of this engine's first copies
        self._users[shmid] = self._users.get(shmid, 0) + 1
        return a

    def populated(self, timeout_s: float) -> bool:
        """Wait, up to ``timeout_s`` in all, for every segment held to be mapped in (``Attached.populate_async``):
        for a process that wants its start-up behind it before it is measured; whether they all are."""
        deadline = time.monotonic() + timeout_s
        return all(a.populated(max(0.0, deadline - time.monotonic())) for a in list(self._segs.values()))

    def drop(self, shmid: int) -> None:
        if self._users.get(shmid):
            self._users[shmid] -= 1

    def close(self) -> None:
        for a in self._segs.values():
            a.close()
        self._segs.clear()
        self._users.clear()


def status_of(conn: Connection, timeout_s: float) -> dict:
    """The daemon's stats, over ``conn``."""
    reply = conn.call(StatusRequest(), None, timeout_s)
    if not isinstance(reply, StatusReply):
        raise ProtocolError(f"unexpected {reply.type} in reply to a status request")
    return dict(reply.stats)


def status(sock_path: str | Path, timeout_s: float = 2.0) -> dict:
    """Ask a local daemon for its stats."""
    c = Connection(sock_path)
    try:
        return status_of(c, timeout_s)
    finally:
        c.close()


# ---------------------------------------------------------------------------- prefill side

