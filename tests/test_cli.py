"""The command line a newcomer meets first: --version on every entry point, and help that names every flag in
full at 80 columns."""

from __future__ import annotations

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
    flags = [f for p in cmd.params for f in [*p.opts, *p.secondary_opts] if f.startswith("--")]
    assert flags and all(f in r.output for f in flags), (flags, r.output)
