"""Run a command inside a simulated host of ``hosts.py``:

    python -m pdpush_tools.harness.enter <init_pid> -- cmd args...

Joins the IPC, UTS, network, time, PID and mount namespaces of the host whose init has root-namespace pid
``init_pid`` (all fds opened first, then ``setns`` each, mount last), then forks: the time and PID
namespaces only apply to children. The child (a small pid inside the host, its CLOCK_MONOTONIC offset) asks
for SIGKILL when this launcher dies, returns to the caller's working directory (joining the mount namespace
moved it to the host's root) and execs the command with the inherited environment. This launcher forwards
SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to it, waits, and exits with its status (128+N when killed by
signal N). So ``Popen(prefix + cmd).send_signal(SIGTERM)`` reaches the command, and ``.kill()`` of the
launcher kills the command like a crash.

That holds even for a command that sets its own parent-death signal (pdpush's daemons ask for SIGTERM,
which replaces ours): before the command runs, the launcher hands the host's init the read end of a pipe
only it writes to and a pidfd of the command (SCM_RIGHTS over the init's abstract unix socket); when the
launcher dies the pipe reads EOF and the init SIGKILLs the command.

Inside, ``os.getppid()`` is 0: the launcher is outside the host's PID namespace. A command whose launcher
was SIGKILLed stays a zombie until the machine's init reaps it (``Host.kill`` avoids that).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys

from pdpush.launch import die_with_parent

NAMESPACES = ("ipc", "uts", "net", "time", "pid", "mnt")  # mnt last: it changes what /proc/<pid> means
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
USAGE = "usage: python -m pdpush_tools.harness.enter <init_pid> -- cmd args..."
INIT_SOCKET = "\0pdpush-hosts-init"  # the host init's abstract unix socket (one per network namespace)
REGISTER_TIMEOUT_S = 10.0


class EnterError(RuntimeError):
    """The host's namespaces could not be joined, or its init could not take the command's watch."""


def join(init_pid: int) -> None:
    """setns into every namespace of ``init_pid`` (time and pid: for the children to come)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fds: list[tuple[str, int]] = []
    try:
        for ns in NAMESPACES:
            try:
                fds.append((ns, os.open(f"/proc/{init_pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)))
            except OSError as e:
                raise EnterError(f"host init {init_pid}: cannot open its {ns} namespace: {e}") from e
        for ns, fd in fds:
            if libc.setns(fd, 0) != 0:
                raise EnterError(f"setns into the {ns} namespace of {init_pid}: {os.strerror(ctypes.get_errno())}")
    finally:
        for _, fd in fds:
            os.close(fd)


def register(alive_r: int, child: int) -> None:
    """Hand the host's init our alive pipe and a pidfd of ``child``: it SIGKILLs the child once we are gone."""
    pidfd = os.pidfd_open(child)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(REGISTER_TIMEOUT_S)
            s.connect(INIT_SOCKET)
            socket.send_fds(s, [b"watch"], [alive_r, pidfd])
            if s.recv(16) != b"ok":
                raise EnterError("the host's init did not take the command's watch")
    finally:
        os.close(pidfd)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print(USAGE, file=sys.stderr)
        return 2
    init_pid, cmd = int(argv[0]), argv[2:]
    cwd = os.getcwd()
    try:
        join(init_pid)
        os.chdir(cwd)
    except (EnterError, OSError) as e:
        print(f"enter: {e}", file=sys.stderr)
        return 125
    # block the forwarded signals across the fork: none is lost between fork() and the handlers below
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    go_r, go_w = os.pipe()  # "g" once the init watches the child; EOF if we die first
    alive_r, alive_w = os.pipe()  # the init's copy of alive_r reads EOF once we are gone; nobody writes
    child = os.fork()
    if child == 0:
        try:
            for fd in (go_w, alive_r, alive_w):
                os.close(fd)
            die_with_parent(signal.SIGKILL)
            if os.read(go_r, 1) != b"g":  # the launcher died, or could not hand the watch over
                os._exit(128 + signal.SIGKILL)
            os.close(go_r)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            os.execvp(cmd[0], cmd)
        except OSError as e:
            print(f"enter: cannot run {cmd[0]!r}: {e}", file=sys.stderr)
        finally:
            os._exit(127)
    os.close(go_r)
    try:
        register(alive_r, child)
    except (EnterError, OSError) as e:
        print(f"enter: the host's init (pid {init_pid}) can't watch the command: {e}", file=sys.stderr)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        return 125
    os.close(alive_r)
    os.write(go_w, b"g")
    os.close(go_w)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:  # it has just exited: waitpid returns next
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
