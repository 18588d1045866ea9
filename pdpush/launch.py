"""Start the real daemons as subprocesses and stop them by pid (tests, bench, demo).

Readiness comes from the daemon's ready-file, never from a sleep; every wait
has a deadline, and ``stop()`` escalates SIGTERM -> SIGKILL by pid. A daemon
started here also drains when its launcher dies (PR_SET_PDEATHSIG, which fires
when the launching *thread* exits: launch from a thread that outlives the daemon).
Imports no UCX or torch.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pdpush.errors import TransportTimeout

QUIET_UCX = {"UCX_WARN_UNUSED_ENV_VARS": "n"}
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux for ``sig`` when the thread that started this process exits (``PR_SET_PDEATHSIG``): a launcher
    that is itself killed (the OOM killer, say) leaves nothing of its own running. False where it cannot be asked.
    Call it first thing in the child (or as a ``preexec_fn``); a parent that died before it did is seen by the
    caller as a changed ``os.getppid()``."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def _pid_namespace() -> str:
    """This process's PID namespace (its daemons tell a launcher that is PID 1 there, alive, from init)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


class Daemon:
    def __init__(self, role: str, args: list[str], workdir: Path, env: dict | None = None,
                 ready_timeout_s: float = 60.0, prefix: list[str] | None = None) -> None:
        self.role = role
        self.workdir = workdir
        self.ready_path = workdir / f"{role}-{os.getpid()}-{time.monotonic_ns()}.ready.json"
        self.log_path = workdir / f"{role}-{time.monotonic_ns()}.log"
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("PDPUSH_")}
        # the daemon asks the kernel for SIGTERM when we die (daemon.die_with_parent): a runner
        # that is itself killed or crashes must not leave daemons running in their own sessions
        full_env = {**inherited, **QUIET_UCX, "PDPUSH_LAUNCHER_PID": str(os.getpid()),
                    "PDPUSH_LAUNCHER_PIDNS": _pid_namespace(), **(env or {})}
        exe = [*(prefix or []), sys.executable, "-m", "pdpush.cli_entry", role]  # prefix: e.g. ip netns exec
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(exe + args + ["--ready-file", str(self.ready_path)], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        self.pid = self.proc.pid
        try:
            self.info = self._wait_ready(ready_timeout_s)
        except BaseException:  # (a SystemExit from exit_on_signals, say): the caller has no daemon to stop
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_path.exists():
                return json.loads(self.ready_path.read_text())
            if self.proc.poll() is not None:
                self.stop()  # its log file is ours to close
                raise RuntimeError(f"{self.role} exited with {self.proc.returncode} before ready:\n{self.log()}")
            time.sleep(0.02)  # polling a file the daemon writes once; bounded by the deadline
        self.stop()
        raise TransportTimeout(f"{self.role} not ready within {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of *this* PID namespace runs (not a zombie): for the processes this launcher
    started. Daemons and engines never judge each other by pid (lifeline.py)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_receiver(workdir: Path, *, config: Path | None = None, env: dict | None = None,
                   prefix: list[str] | None = None, **opts) -> Daemon:
    args = ["--config", str(config)] if config else []
    if config is None:  # private ports and socket, so that tests never collide
        opts.setdefault("control_port", 0)
        opts.setdefault("ucx_port", 0)
        opts.setdefault("local_socket", str(workdir / f"rx-{time.monotonic_ns()}.sock"))
        opts.setdefault("metrics_port", 0)
    return Daemon("receiver", args, workdir, {**_settings_env(opts), **(env or {})}, prefix=prefix)


def start_sender(workdir: Path, *, config: Path | None = None, env: dict | None = None,
                 prefix: list[str] | None = None, **opts) -> Daemon:
    args = ["--config", str(config)] if config else []
    if config is None:
        opts.setdefault("ingress_socket", str(workdir / f"tx-{time.monotonic_ns()}.sock"))
        opts.setdefault("metrics_port", 0)
    return Daemon("sender", args, workdir, {**_settings_env(opts), **(env or {})}, prefix=prefix)


def start_router(workdir: Path, *, config: Path | None = None, env: dict | None = None,
                 prefix: list[str] | None = None, flags: list[str] | None = None, **opts) -> Daemon:
    """``pdpush router``; ``info["url"]`` is its base URL. ``flags``: its command line's own."""
    args = (["--config", str(config)] if config else []) + list(flags or [])
    if config is None:
        opts.setdefault("port", 0)
    return Daemon("router", args, workdir, {**_settings_env(opts), **(env or {})}, prefix=prefix)


def _settings_env(opts: dict) -> dict[str, str]:
    """Settings as PDPUSH_* variables: every config field can be set, and they override the file."""
    out: dict[str, str] = {}
    for k, v in opts.items():
        if v is None:
            continue
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, (dict, list)):
            v = json.dumps(v)
        out[f"PDPUSH_{k.upper()}"] = str(v)
    return out


_SCRATCH: list[Path] = []  # this process's scratch directories, removed at its exit (_remove_scratch)


def scratch_dir(prefix: str = "pdpush-") -> Path:
    """A fresh directory for daemons' sockets, ready files and logs. It goes when this process exits, unless it
    ends on an unhandled exception or ``PDPUSH_KEEP_SCRATCH`` is set (a failed test session sets it): then it
    stays, named on stderr, for its logs. (Every bench and test run left one in /tmp before.)"""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    if not _SCRATCH:
        atexit.register(_remove_scratch)
    _SCRATCH.append(d)
    return d


@contextlib.contextmanager
def exit_on_signals(signals: tuple[int, ...] = (signal.SIGTERM,)):
    """While in this block, ``signals`` end the process as ``sys.exit(128 + signo)`` would, so that its ``finally``
    blocks stop the daemons it started (by pid) and its scratch directories go (``_remove_scratch`` runs at exit,
    which a signal's default action skips: a bench stopped with SIGTERM left them in /tmp). The first signal
    raises; a second acts as it would have before (a stop that hangs can still be ended). A signal ignored before
    (``nohup``) stays ignored, and the handlers before are back after the block. For tools (bench, demo) in their
    main thread; elsewhere it changes nothing. (Not SIGHUP: UCX, once loaded, installs its own handler for it.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) or signal.SIG_DFL for s in signals}  # (None: a handler not set from Python)
    before = {s: h for s, h in before.items() if h is not signal.SIG_IGN}

    def raise_exit(signo: int, _frame) -> None:
        for s, h in before.items():
            signal.signal(s, h)
        raise SystemExit(128 + signo)

    for s in before:
        signal.signal(s, raise_exit)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _remove_scratch() -> None:
    left = [d for d in _SCRATCH if d.exists()]
    if os.environ.get("PDPUSH_KEEP_SCRATCH") or getattr(sys, "last_value", None) is not None:
        for d in left:
            print(f"pdpush: kept {d} (its daemons' logs)", file=sys.stderr)
        return
    for d in left:
        shutil.rmtree(d, ignore_errors=True)
