"""The command line a newcomer meets first: --version on every entry point, and help that names every flag in
full at 80 columns."""

from __future__ import annotations

import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from pdpush import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("role", ["pdpush", "receiver", "sender"])
def test_every_entry_point_prints_its_version(role):
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    argv = [sys.executable, "-m", "pdpush.cli_entry", *([] if role == "pdpush" else [role]), "--version"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith(f"pdpush {want} (control protocol "), r.stdout + r.stderr


def _commands():
    """(the Typer app, its arguments before --help, the click command they reach)."""
    group = typer.main.get_command(cli.app)
    yield cli.app, [], group
    for name, cmd in group.commands.items():
        yield cli.app, [name], cmd
    for app in (cli.receiver_app, cli.sender_app):
        yield app, [], typer.main.get_command(app)


@pytest.mark.parametrize("app,args,cmd", [pytest.param(*c, id=" ".join([c[2].name, *c[1]])) for c in _commands()])
def test_help_at_80_columns_names_every_flag_in_full(app, args, cmd):
    """Rich's help panels cut long flags at 80 columns (`--local-prefill-m…`); the help is plain text."""
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert r.exit_code == 0, r.output
    assert "…" not in r.output and max(len(x) for x in r.output.splitlines()) <= 80, r.output
    flags = [f for p in cmd.params if not getattr(p, "hidden", False)  # (the sender's --bind: kept, ignored)
             for f in [*p.opts, *p.secondary_opts] if f.startswith("--")]
    assert flags and all(f in r.output for f in flags), (flags, r.output)


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdpush.cli_entry", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("body,role", [
    ('host = "0.0.0.0"\nlocal_socket = "{d}/rx.sock"\n', "receiver"),  # exposed: its daemon ran with --insecure
    ('completion = "commit"\nname_recheck_ms = 30000\ningress_socket = "{d}/tx.sock"\n', "sender"),
])
def test_status_reads_any_config_its_daemon_could_run_with_and_tells_the_roles_apart(tmp_path, body, role):
    """A receiver exposed without keys runs with --insecure (or PDPUSH_INSECURE in its own environment): its
    status and doctor, which have no --insecure, read its config all the same (they refused it, exit 2). A sender's
    keys are all told apart from a receiver's (one with completion and name_recheck_ms only was read as a
    receiver's, and refused)."""
    cfg = tmp_path / "d.toml"
    cfg.write_text(body.format(d=tmp_path))
    r = _run("status", "--config", str(cfg), "--timeout", "0.5")
    assert r.returncode == 1 and "did not answer" in r.stderr and {"receiver": "rx.sock", "sender": "tx.sock"}[role] in r.stderr, \
        r.stderr
    assert "Traceback" not in r.stderr


def test_a_config_of_keys_both_roles_have_asks_for_the_role(tmp_path):
    cfg = tmp_path / "d.toml"
    cfg.write_text("metrics_port = 9999\n")
    r = _run("status", "--config", str(cfg), "--timeout", "0.5")
    assert r.returncode == 2 and "--role" in r.stderr, r.stderr
    r = _run("status", "--config", str(cfg), "--timeout", "0.5", "--role", "sender")
    assert r.returncode == 1 and "sender-9999.sock" in r.stderr, r.stderr
    for bad in ("nan", "0", "-1", "inf"):
        r = _run("status", "--config", str(cfg), "--role", "sender", "--timeout", bad)
        assert r.returncode == 2 and "--timeout" in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)


def test_a_sender_says_it_has_no_address_to_bind(tmp_path):
    """A sender opens no control port: ``host`` (its config, PDPUSH_HOST shared with a receiver, or --bind, kept
    for the scripts that pass it to both daemons) is ignored, and it says so at start (it said nothing; --bind's help
    claimed it set the network endpoints, and it is hidden now)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    with taken:  # (its metrics port taken: the start ends at once, exit 3, after the warning)
        cfg = tmp_path / "tx.toml"
        cfg.write_text(f'host = "0.0.0.0"\ningress_socket = "{tmp_path}/tx.sock"\n'
                       f"metrics_port = {taken.getsockname()[1]}\nprefault = false\n")
        r = _run("sender", "--config", str(cfg))
        assert r.returncode == 3 and "opens no control port" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = _run("sender", "--config", str(cfg), "--bind", "10.9.9.9")
        assert r.returncode == 3 and "'10.9.9.9' is ignored" in r.stderr, r.stderr
    r = _run("sender", "--help")
    assert r.returncode == 0 and "--bind" not in r.stdout


def test_keygen_into_a_directory_it_cannot_write_says_so_in_a_line(tmp_path):
    r = _run("keygen", "rx", "--dir", "/proc/pdpush-no-such-dir")
    assert r.returncode == 1 and "cannot write the key pair" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_router_tokenizer_that_is_not_a_directory_is_a_config_error_at_once(tmp_path):
    """tokenizer = a path that is not there: exit 2 at once, saying so (transformers took the name for a model hub's
    and tried the internet for 49 s, or downloaded one)."""
    pytest.importorskip("transformers")  # (the router extra has none: test_router covers that case)
    r = _run("router", "--port", "0", "--prefill", "http://127.0.0.1:9", "--decode",
             "http://127.0.0.1:9=tcp://127.0.0.1:9", "--tokenizer", str(tmp_path / "mytok"), timeout=120)
    assert r.returncode == 2 and "no such directory" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("role", ["receiver", "sender"])
def test_a_socket_directory_it_cannot_use_fails_the_start_before_the_prefault(tmp_path, role):
    """A local socket in a directory others can write (or not this user's): exit 2, before the pool or the staging
    is made and faulted in (a minute for a big pool), as for a taken port."""
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    key = "local_socket" if role == "receiver" else "ingress_socket"
    r = _run(role, "--config", str(tmp_path / "c.toml")) if (tmp_path / "c.toml").write_text(
        f'{key} = "{d}/d.sock"\nmetrics_port = -1\n' + ("control_port = 0\nucx_port = 0\n" if role == "receiver"
                                                         else "")) else None
    assert r.returncode == 2 and "writable by its group or others" in r.stderr, r.stderr[-2000:]
    assert "UCX " not in r.stderr  # (UCX, the pool or staging after it, never opened)
