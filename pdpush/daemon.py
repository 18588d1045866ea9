"""Daemon plumbing shared by both daemons (and the router): logging, signals, readiness, exit codes, limits.

``run(server)`` = startup, main loop, drain, shutdown. The first SIGTERM/SIGINT
drains; a second forces exit. Readiness is a ready-file (JSON, written
atomically) and ``READY=1`` to $NOTIFY_SOCKET under systemd, never a sleep.
Imports no UCX or torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from enum import IntEnum
from pathlib import Path
from typing import Protocol

from pdpush import protocol
from pdpush.doctor import OPEN_FILES_NEEDED, OPEN_FILES_WANTED
from pdpush.protocol import Msg


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1
    CONFIG = 2
    STARTUP = 3
    FORCED = 130


class Server(Protocol):
    def start(self, stop: Callable[[], bool] | None = None) -> dict: ...  # stop: a signal came, the start ends soon
    def step(self, timeout_ms: int) -> None: ...
    def begin_drain(self) -> None: ...
    def drained(self) -> bool: ...
    def abort_all(self, reason: str) -> None: ...
    def close(self) -> None: ...
    def internal_error(self) -> None: ...  # a loop pass raised (a bug): counted (pdpush_internal_errors_total)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        req_id = getattr(record, "req_id", None)
        if req_id is not None:
            out["req_id"] = req_id
        fields = getattr(record, "fields", None)  # structured extras (the router's decisions)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _ReqIdSuffix(logging.Filter):
    """Text logs: every line about a request ends with its req_id."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "req_id", None)
        record.req_suffix = f" [req_id={rid}]" if rid is not None else ""
        return True


def setup_logging(level: str, fmt: str, role: str) -> None:
    h = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        h.setFormatter(_JsonFormatter())
    else:
        h.addFilter(_ReqIdSuffix())
        h.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s%(req_suffix)s"))
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level.upper())


def sd_notify(state: str) -> None:
    """Send a systemd notify datagram if $NOTIFY_SOCKET is set; never raises."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as e:
        logging.getLogger("pdpush.daemon").warning("sd_notify(%s) failed: %s", state, e)


def write_ready_file(path: str, info: dict) -> None:
    p = Path(path)
    tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, p)


def error_kind(e: BaseException) -> str:
    """An error's kind, for counting its repeats: its type and where it was raised (file:line)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" at {Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno}" if tb is not None else ""
    return type(e).__name__ + where


def remove_ready_file(path: str, pid: int) -> None:
    """Remove the ready file at ``path`` if it still announces ``pid`` (another instance may have written its own
    there since: a restarted one, under a supervisor that does not wait for this one's end)."""
    p = Path(path)
    try:
        if json.loads(p.read_text()).get("pid") == pid:
            p.unlink(missing_ok=True)
    except (OSError, ValueError, AttributeError):
        pass  # gone, unreadable, or not one of ours: left alone


def raise_open_files(log: logging.Logger, wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft limit on open files to ``wanted``, or to its hard limit where that is lower, as
    servers do (Go's runtime does it for every program). A shell's or a container's soft limit is often 1,024
    (containerd 2's default, with a hard limit far above): a daemon out of descriptors refuses engines (an accept
    that fails pauses its listener), and a router takes its engines for unreachable and ejects them. Warns where
    the hard limit keeps it below ``OPEN_FILES_NEEDED``. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    target = wanted if hard == inf else min(wanted, hard)
    if soft != inf and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # (a hard limit lowered under us; a sandbox that forbids it)
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, e)
    if soft != inf and soft < OPEN_FILES_NEEDED:
        log.warning("the open-files limit is %d (hard %s), below the %d that a busy daemon needs: raise it "
                    "(LimitNOFILE=65536, ulimit -n, --ulimit nofile=65536)", soft,
                    "unlimited" if hard == inf else hard, OPEN_FILES_NEEDED)
    return -1 if soft == inf else soft


def die_with_launcher(signals: dict) -> None:
    """Started by pdpush.launch (tests, bench, demo): drain when the launcher dies (Linux prctl)."""
    launcher = os.environ.get("PDPUSH_LAUNCHER_PID")
    if not launcher or not sys.platform.startswith("linux"):
        return
    from pdpush.launch import die_with_parent

    parent = os.getppid()  # 0 where the parent is outside our PID namespace (a launcher entering a host's)
    die_with_parent(signal.SIGTERM)
    # it died before the prctl took effect: we were reparented, to init, unless init is the launcher itself (a
    # container's entrypoint, in this daemon's own PID namespace)
    if os.getppid() != parent or (parent == 1 and not (launcher == "1" and _same_pid_namespace())):
        signals["count"] += 1


def _same_pid_namespace() -> bool:
    """Whether this process's PID namespace is its launcher's (``PDPUSH_LAUNCHER_PIDNS``)."""
    try:
        return os.readlink("/proc/self/ns/pid") == os.environ.get("PDPUSH_LAUNCHER_PIDNS")
    except OSError:
        return False


def now_ms() -> float:
    """The daemons' sessions' clock: monotonic milliseconds, with their fraction. Whole milliseconds made a round
    trip of 0.4 ms (``pdpush_alloc_rtt_seconds``) read as 0 or 1 ms, and a request of a few ms as +-1 ms of
    itself."""
    return time.monotonic() * 1000


def run(server: Server, ready_file: str | None, drain_timeout_s: float) -> int:
    log = logging.getLogger("pdpush.daemon")
    signals = {"count": 0}

    def on_signal(signum, _frame) -> None:
        signals["count"] += 1

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    die_with_launcher(signals)
    open_files = raise_open_files(log)
    watchdog_us = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    last_wd = time.monotonic()
    code = ExitCode.OK
    drain_deadline: float | None = None
    loop_errors: dict[str, int] = {}  # by kind: a new bug is logged at once, whatever another repeats
    wrote = False  # the ready file is this process's to remove (another instance's is not)
    started = False  # past it, an error is no start-up failure (exit 3, which a supervisor retries as one)
    try:  # (a start that fails part way closes what it opened: its sockets, its memory)
        if signals["count"]:  # its launcher died before it could tie itself to it
            log.info("the launcher is gone: not starting")
            return int(code)
        # a signal while it starts ends its prefault (minutes on a big pool) where it is, and the daemon stops
        # having served nothing; only counted here, never raised
        info = server.start(stop=lambda: signals["count"] > 0)
        if signals["count"]:
            log.info("stopped while starting: nothing was served")
            return int(code)
        # (after the start: UCX takes SIGHUP for its own debug handler, UCX_DEBUG_SIGNO, and swallowed it. The router
        # reloads on SIGHUP; a daemon's pool, staging and peers are made at start-up only, and it says so)
        signal.signal(signal.SIGHUP, lambda _s, _f: log.warning(
            "SIGHUP ignored: the daemon reads its config at start-up only; restart it to change it (SIGTERM drains)"))
        info["pid"] = os.getpid()
        info["open_files_limit"] = open_files
        if ready_file:
            write_ready_file(ready_file, info)
            wrote = True
        sd_notify("READY=1\nSTATUS=serving")
        log.info("ready: %s", json.dumps(info))
        started = True
        while True:
            passed = False
            try:
                server.step(20)
                passed = True
            except Exception as e:  # noqa: BLE001 - the top-level guard: a bug in one pass never ends the daemon
                kind = error_kind(e)
                n = loop_errors[kind] = loop_errors.get(kind, 0) + 1
                if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... of each kind: one that repeats every pass
                    log.exception("internal error in the daemon loop (%s, %d so far); serving on", kind, n)
                with contextlib.suppress(Exception):
                    server.internal_error()
                time.sleep(0.01)  # must not spin, nor flood the log
            # (only a pass that completed feeds the watchdog: one that fails every pass is restarted by systemd)
            if watchdog_us and passed and time.monotonic() - last_wd > watchdog_us / 2e6:
                sd_notify("WATCHDOG=1")
                last_wd = time.monotonic()
            if signals["count"] >= 2:
                log.warning("second signal: forcing exit")
                server.abort_all("forced shutdown")
                code = ExitCode.FORCED
                break
            if signals["count"] == 1 and drain_deadline is None:
                log.info("draining (up to %.1fs)", drain_timeout_s)
                sd_notify("STOPPING=1")
                server.begin_drain()
                drain_deadline = time.monotonic() + drain_timeout_s
            if drain_deadline is not None:
                if server.drained():
                    break
                if time.monotonic() > drain_deadline:
                    log.warning("drain timeout: aborting in-flight work")
                    server.abort_all("drain timeout")
                    code = ExitCode.FAILURE  # (work was lost: a supervisor should see it, as for a forced exit)
                    break
    except Exception:
        if not started:
            raise
        log.exception("internal error while serving or draining: stopping")  # (a pass's own errors serve on)
        code = ExitCode.FAILURE
    finally:
        try:
            server.close()
        except Exception:
            if not started:
                raise
            log.exception("closing the daemon")
            code = ExitCode.FAILURE
        finally:
            if wrote:
                remove_ready_file(ready_file, os.getpid())
    return int(code)


class WireCount:
    """The control messages a daemon exchanges with its peer daemons (sender <-> receiver), by direction and
    type: what a request costs on the wire between hosts (``pdpush bench --scenario latency`` divides it by
    the requests). A frame is one wire message; one that carries several (a batch: ``Outbox``) counts each of
    them as its share. Engine <-> daemon messages on the host are not counted here."""

    def __init__(self) -> None:
        self.by: dict[str, float] = {}
        self.frames = {"in": 0, "out": 0}

    def count(self, direction: str, *msg_types: str) -> None:
        """One frame, in ``direction``, carrying messages of ``msg_types``."""
        self.frames[direction] += 1
        share = 1 / len(msg_types)
        for t in msg_types:
            key = f"{direction}:{t}"
            self.by[key] = self.by.get(key, 0) + share

    def stats(self) -> dict:
        return {"wire_messages_in": self.frames["in"], "wire_messages_out": self.frames["out"],
                "wire_messages": json.dumps({k: round(v, 3) for k, v in sorted(self.by.items())})}


class Outbox:
    """Control messages for the peer daemons, held until the end of the loop's pass, then each peer gets what the
    pass has for it in as few frames as fit (``protocol.encode_batch``: at most ``MAX_BATCH`` messages and about
    ``batch_bytes`` a frame; a larger message goes alone): one wire message that its requests share. The order of
    the messages to each peer is kept; nothing waits for a later pass."""

    def __init__(self, wire: WireCount, batch_bytes: int = 256 << 10) -> None:
        self.wire = wire
        self.batch_bytes = batch_bytes
        self.by: dict = {}  # peer -> [(type, encoded)]

    def post(self, peer, msg: Msg) -> None:
        self.by.setdefault(peer, []).append((msg.type, protocol.encode(msg)))

    def __bool__(self) -> bool:
        return bool(self.by)

    def flush(self, send: Callable[[object, bytes], bool], peer=None) -> list:
        """Send what is held (for ``peer``, or for every peer) through ``send(peer, frame) -> sent``; the peers that
        could not take a frame (what is left for them is dropped: their requests' deadlines fail them, typed)."""
        peers = [peer] if peer is not None else list(self.by)
        failed = []
        for p in peers:
            held = self.by.pop(p, None)
            while held:
                n, size = 1, len(held[0][1])
                while n < len(held) and n < protocol.MAX_BATCH and size + len(held[n][1]) <= self.batch_bytes:
                    size += len(held[n][1])
                    n += 1
                part, held = held[:n], held[n:]
                if not send(p, protocol.encode_batch([e for _, e in part])):
                    failed.append(p)
                    break
                self.wire.count("out", *(t for t, _ in part))
        return failed


def count_dropped(counters: dict, key: str, what: str, log: logging.Logger) -> None:
    """A message its peer could not take (gone, or not reading: its queue at the high-water mark): counted in
    ``counters[key]`` and logged at the 1st, 2nd, 4th, ... drop, so a peer that stopped reading does not flood the log.
    The peer's own deadlines make the loss a typed timeout there, never a hang."""
    n = counters[key] = counters[key] + 1
    if n & (n - 1) == 0:
        log.warning("could not send %s (%s: peer gone or not reading): %d dropped so far", what, key, n)


def count_skewed(counters: dict, err: Exception, log: logging.Logger) -> None:
    """An engine's Begin, Open, Claim or Query of another local protocol than this daemon's (``protocol._check_local``),
    refused: counted in ``counters["local_protocol_refused"]`` and logged at the 1st, 2nd, 4th, ... (an engine of
    another image sends one a request), so that the daemon's operator sees it too, not only the engine's."""
    n = counters["local_protocol_refused"] = counters.get("local_protocol_refused", 0) + 1
    if n & (n - 1) == 0:
        log.warning("refused an engine's request of another local protocol (%d so far; install one pdpush version in "
                    "the engines and the daemons): %s", n, err)


def settle_interface(address: str, route: bool, stop: Callable[[], bool] | None = None) -> str | None:
    """Before the daemon makes its UCX context, which lists its tcp devices once (netif.py): wait a while for the
    interface that takes connections to ``address`` (a receiver's bind address: netif.listening_interface), or that
    ``route`` reaches it through (a sender's receiver), where it is up but not running yet. Returns that
    interface's name where it still is not running, else None."""
    from pdpush import netif

    log = logging.getLogger("pdpush.daemon")
    t0 = time.monotonic()
    try:
        name = netif.route_interface(address) if route else netif.listening_interface(address)
        late = netif.wait_running([name], stop=stop) if name is not None else []
    except (OSError, ValueError) as e:  # advice only: a host whose interfaces cannot be read starts as before
        log.info("could not read the network interfaces for %s: %s", address, e)
        return None
    waited = time.monotonic() - t0
    if late:
        log.warning("network interface %s (for %s) is up without a carrier %.1f s on: UCX starts without it, so "
                    "peers that reach this daemon through it are refused until it restarts with it running", name,
                    address, waited)
        return name
    if waited > 0.05:
        log.info("waited %.2f s for network interface %s (for %s) to run before starting UCX", waited, name, address)
    return None


def log_ucx(transport, exposed: str | None, registered_bytes: int) -> dict:
    """Log which UCX the daemon runs (version, library, how chosen), what it can use, and what the host offers
    (memlock against the ``registered_bytes`` of its pool or staging, hugepages, CUDA); where it talks to other
    hosts (``exposed`` names the address that says so), warn once if none of that is RDMA."""
    from pdpush.doctor import host_facts  # (the module is loaded already: its name is looked up where it is used)
    from pdpush.transport.ucx_lib import no_rdma_warning, open_tcp_warning

    info = transport.describe()
    info["host"] = host = host_facts(sorted({a.split("/")[0] for a in info["available"]}), registered_bytes)
    log = logging.getLogger("pdpush.daemon")
    memlock = "unlimited" if host["memlock_bytes"] == -1 else f"{host['memlock_bytes']} bytes"
    log.info("UCX %s (%s) from %s; transports: %s; memlock %s for %d bytes; hugepages %d free; CUDA transports: %s",
             info["version"], info["source"], info["library"], " ".join(info["available"]), memlock,
             registered_bytes, host["hugepages"]["free"], " ".join(host["cuda"]["ucx_transports"]) or "none")
    if warning := no_rdma_warning(info, exposed) if exposed else None:
        log.warning("%s", warning)
    if tcp := open_tcp_warning(info):  # (an operator who chose the devices hears it once, quietly)
        log.log(logging.INFO if os.environ.get("UCX_NET_DEVICES") else logging.WARNING, "%s", tcp)
    if info["rdma"] and host["memlock_bytes"] != -1 and host["memlock_bytes"] < registered_bytes:
        log.warning("the locked-memory limit (%s) is below the %d bytes the NIC must register: raise it "
                    "(LimitMEMLOCK=infinity, --ulimit memlock=-1, IPC_LOCK)", memlock, registered_bytes)
    return info


def ucx_stats(info: dict) -> dict:
    """What ``pdpush status`` says of the daemon's UCX and host."""
    host = info["host"]
    return {"ucx_version": info["version"], "ucx_library": info["library"], "ucx_source": info["source"],
            "ucx_available": " ".join(info["available"]), "ucx_rdma": info["rdma"],
            "memlock_bytes": host["memlock_bytes"], "memlock_needed_bytes": host["memlock_needed_bytes"],
            "hugepages_free": host["hugepages"]["free"], "open_files_limit": host["open_files"]["soft"],
            "cuda_transports": " ".join(host["cuda"]["ucx_transports"]), "gdrcopy": host["cuda"]["gdrcopy"]}
