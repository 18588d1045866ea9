"""ZeroMQ sockets for the control plane and the local endpoints: bytes in/out, caps, errors.

The only module that creates zmq sockets. zmq exceptions are mapped to pdpush
errors here; ``zmq.Again`` never escapes. Imports no UCX or torch.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

import zmq

from pdpush import protocol
from pdpush.errors import ConfigError, ConnectError, ResourceError
from pdpush.protocol import Msg

# zmq drops a peer that sends a frame over MAXMSGSIZE; keep some slack over our own cap so
# that an oversized-but-plausible frame still gets a typed error reply instead of silence.
_ZMQ_SLACK = 1 << 20


def context() -> zmq.Context:
    return zmq.Context.instance()


def _harden(sock: zmq.Socket, max_frame: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame + _ZMQ_SLACK)


def bind_router(endpoint_host: str, port: int, max_frame: int,
                configure: Callable[[zmq.Socket], None] | None = None, hwm: int = 0) -> tuple[zmq.Socket, str]:
    """A ROUTER on tcp://host:port (port 0 = any free port). Returns (socket, endpoint).

    ``configure`` runs before bind (CURVE server options must be set before it). ``hwm``: messages queued per peer
    before ``send`` says it is full (0: zmq's 1000).
    """
    sock = context().socket(zmq.ROUTER)
    _harden(sock, max_frame)
    if configure is not None:
        configure(sock)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply that cannot go says so (``send``), never vanishes
    # a peer that names its connection (a sender's DEALER: ``dealer(named=True)``) and makes it again after it broke
    # takes its name over, though this end has not yet seen the old connection end (a silent drop)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if hwm:
        sock.setsockopt(zmq.SNDHWM, hwm)
    host = f"[{endpoint_host}]" if ":" in endpoint_host else endpoint_host
    if ":" in endpoint_host:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as e:
        sock.close()
        why = f"cannot bind control endpoint tcp://{host}:{port}: {e}"
        if e.errno == zmq.EADDRINUSE:  # the host's state, not the config's: a start-up failure (exit 3, restarted)
            raise ResourceError(why) from e
        raise ConfigError(why) from e
    return sock, f"tcp://{host}:{port}"


def check_port_free(host: str, port: int, what: str) -> None:
    """ResourceError (a start-up failure: exit 3, restarted) where a process already listens on tcp ``host:port``.
    A daemon checks its fixed ports before it faults in its pool or staging (about 1 s per GiB), which each try
    of a restarted daemon would otherwise pay before finding its port taken. A look, not a reservation: the real
    bind still says so where a process takes the port in between; any other error (an address not on this host, a
    name that does not resolve) is left to the real bind to report."""
    import errno
    import socket

    if port <= 0:
        return
    try:
        infos = socket.getaddrinfo(None if host in ("", "*") else host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return
    for family, kind, proto, _, addr in infos[:1]:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listeners do: TIME_WAIT is no owner
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ResourceError(f"cannot bind {what} on {host}:{port}: another process listens "
                                        "there") from e


def private_dir(d: Path, create: bool = True) -> None:
    """Check (and with ``create``, make, mode 0700) the directory of a daemon's local sockets, lifelines and doorbell:
    a real directory, owned by this uid, that nobody else can write. Another local user who made it first (say
    ``/tmp/pdpush-<uid>`` before the daemon's first start) could otherwise replace the sockets with impostors that hand
    engines their own shared-memory ids. Raises ConfigError saying what is wrong and how to fix it."""
    if create:
        d.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        raise ConfigError(f"socket directory {d} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"socket directory {d} is not a directory (a symlink or a file): remove it, or set "
                          "XDG_RUNTIME_DIR or the socket path elsewhere")
    if st.st_uid != os.getuid():
        raise ConfigError(f"socket directory {d} belongs to uid {st.st_uid}, not to this process's uid {os.getuid()}: "
                          "another user could replace its sockets; remove it, or use a directory of this user's "
                          "(XDG_RUNTIME_DIR, or systemd's RuntimeDirectory)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"socket directory {d} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                          f"chmod go-w {d}")


def check_local(path: Path) -> None:
    """ConfigError where ``bind_local`` could not take ``path``: its directory not this user's alone (or not
    creatable), or another process serving it. A daemon looks before it faults in its pool or staging (about 1 s
    per GiB), as for its ports; ``bind_local`` looks again."""
    try:
        private_dir(path.parent)
    except PermissionError as e:
        raise ConfigError(f"cannot create the socket directory {path.parent}: {e}") from None
    if (path.exists() or path.is_symlink()) and _answers(path):
        raise ConfigError(f"another process serves {path}: give this daemon its own socket (local_socket / "
                          "ingress_socket), or stop the other one")


def bind_local(path: Path, max_frame: int) -> tuple[zmq.Socket, str]:
    """A ROUTER on a unix socket only this user can reach: its directory checked (``private_dir``), the socket
    created 0600 (no window where another user could connect)."""
    check_local(path)
    if path.exists() or path.is_symlink():
        path.unlink()  # a stale socket from a killed daemon
    sock = context().socket(zmq.ROUTER)
    _harden(sock, max_frame)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply that cannot go says so (``send``), never vanishes
    ep = f"ipc://{path}"
    old = os.umask(0o177)  # zmq's I/O thread creates the socket file: 0600 from the start
    try:
        sock.bind(ep)
    except zmq.ZMQError as e:
        sock.close()
        raise ConfigError(f"cannot bind local endpoint {ep}: {e}") from e
    finally:
        os.umask(old)
    os.chmod(path, 0o600)  # and if the bind raced the umask, now (connecting needs write permission on it)
    return sock, ep


# How long a daemon that stops gives what it queued for its peer daemons to leave (a receiver's index farewell, a
# sender's last aborts): closed with no linger, zmq dropped what a backlog held (frames queued behind large ones).
FAREWELL_LINGER_MS = 1000


def close_peer_socket(sock: zmq.Socket) -> None:
    """Close a socket to peer daemons, keeping what it queued for them to send until ``shutdown`` (its linger)."""
    sock.close(linger=FAREWELL_LINGER_MS)


def shutdown(timeout_s: float = FAREWELL_LINGER_MS / 1000 + 1) -> bool:
    """At a daemon process's end: close what is left open and wait, ``timeout_s`` at most, for what the closed
    sockets queued to leave (each socket's linger bounds it; a thread keeps any other wait bounded too). Whether it
    ended in time."""
    import threading

    t = threading.Thread(target=context().destroy, kwargs={"linger": 0}, name="zmq-shutdown", daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


def close_local(sock: zmq.Socket, endpoint: str) -> None:
    """Close a ``bind_local`` socket and remove its file (zmq leaves it behind; the next start would find it stale)."""
    sock.close(0)
    Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


def _answers(path: Path) -> bool:
    """Whether a live process accepts connections on the unix socket ``path``."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def _connect(sock: zmq.Socket, endpoint: str, max_frame: int, hwm: int,
             configure: Callable[[zmq.Socket], None] | None, routing_id: bytes | None = None) -> zmq.Socket:
    _harden(sock, max_frame)
    if configure is not None:  # CURVE client options must be set before connect
        configure(sock)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.SNDHWM, hwm)
    if "://[" in endpoint:  # an IPv6 address: libzmq refuses to reach one unless told (a bracketed one got nothing)
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close()
        raise ConnectError(f"cannot connect to {endpoint}: {e}") from e
    return sock


def dealer(endpoint: str, max_frame: int, configure: Callable[[zmq.Socket], None] | None = None,
           named: bool = False) -> zmq.Socket:
    """``named``: the socket names its connection (a random routing id, which ZeroMQ presents again when it makes the
    connection again after it broke), so that the peer's ROUTER knows it for the same one, and keeps its session."""
    # Frames queue until the peer connects; every caller waits with a deadline, and a peer
    # declared dead gets a fresh socket, so nothing stale is replayed to a restarted peer.
    routing_id = b"\x01" + secrets.token_bytes(15) if named else None  # (never a zero byte first: libzmq's own ids)
    return _connect(context().socket(zmq.DEALER), endpoint, max_frame, 10000, configure, routing_id)


def async_dealer(endpoint: str, max_frame: int, configure: Callable[[zmq.Socket], None] | None = None):
    """A DEALER for asyncio code (the router's chunk-index subscriptions)."""
    import zmq.asyncio

    return _connect(zmq.asyncio.Context.instance().socket(zmq.DEALER), endpoint, max_frame, 100, configure)


def send(sock: zmq.Socket, msg: Msg, identity: bytes | None = None) -> bool:
    """Send without blocking; False if the peer cannot take it now: gone, or its queue at the high-water mark (our
    ROUTERs are ROUTER_MANDATORY, so neither is silent). Callers count what they could not send."""
    return send_frame(sock, protocol.encode(msg), identity)


def send_frame(sock: zmq.Socket, payload: bytes, identity: bytes | None = None) -> bool:
    """``send`` of an encoded frame (one message, or a batch: ``protocol.encode_batch``)."""
    frames = [payload]
    if identity is not None:
        frames.insert(0, identity)
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False
    except zmq.ZMQError:
        return False


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # as ints: pyzmq's enums cost a few us a call


def readable(sock: zmq.Socket) -> bool:
    """A frame is waiting on ``sock``. Asked before a non-blocking receive: ~2 us, where the ``zmq.Again`` of an empty
    socket (the common case in a loop that looks at every socket each pass) costs ~11 us."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


def recv_ready(sock: zmq.Socket, limit: int = 256, copy: bool = True):
    """The frames waiting on ``sock`` (each a multipart message), up to ``limit``, without waiting."""
    for _ in range(limit):
        if not readable(sock):
            return
        try:
            yield sock.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return
