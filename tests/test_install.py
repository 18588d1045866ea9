"""pdpush installs as one package (pyproject.toml): pip builds native/ into it, and extras split the sides.

The quick checks read what this venv's install says of itself: the extras of each side (the engine side
with neither UCX nor torch, UCX with the daemons), the console scripts, and the native code loaded as the
engines load it (``_copy``, no libucp). The slow ones (make test-slow) do what an operator does, in fresh
venvs: ``python -m build`` (an sdist, then a wheel from it), the wheel with the daemons' extra starting a
real ``pdpush-receiver``, and ``pip install`` of the tree giving the CLI and the native code.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import signal
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SIDES = ("engine", "daemons", "router", "demo", "bench", "test")
BIN = Path(sys.prefix) / "bin"
NO_LIBUCP = ("import pdpush, pdpush.cli, pdpush.kvcodec, pdpush_native._copy, sys; "
             "maps = open('/proc/self/maps').read(); "
             "print(int('libucp' in maps), int('torch' in sys.modules))")


def _requires(extra: str | None) -> set[str]:
    """The names pdpush's installed metadata requires for ``extra`` (None: the base), self-references expanded."""
    names: set[str] = set()
    for line in md.metadata("pdpush").get_all("Requires-Dist") or []:
        r = Requirement(line)
        if (extra is None and r.marker is None) or (extra and r.marker and r.marker.evaluate({"extra": extra})):
            names |= {e for x in r.extras for e in _requires(x)} if r.name == "pdpush" else {r.name.lower()}
    return names | (_requires(None) if extra else set())


def test_the_installed_metadata_splits_the_sides_and_names_no_torch():
    assert set(SIDES) <= set(md.metadata("pdpush").get_all("Provides-Extra"))
    base = _requires(None)
    assert {"pyzmq", "msgpack", "msgspec", "pydantic", "pydantic-settings", "xxhash", "numpy", "typer"} <= base, base
    assert _requires("engine") == base, "the engine side needs nothing beyond the base (vLLM brings torch)"
    assert {"libucx-cu12", "prometheus-client"} <= _requires("daemons")
    assert {"starlette", "uvicorn", "httpx"} <= _requires("router") and "libucx-cu12" not in _requires("router")
    for side in (None, *SIDES):
        assert "torch" not in _requires(side), f"{side or 'the base'} requires torch: a bare torch is the CUDA build"
        assert "ucxx" not in str(_requires(side))
    build = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    assert {r.name for r in build} == {"scikit-build-core", "nanobind", "libucx-cu12"}
    assert all(str(r.specifier).startswith("==") for r in build), build


def test_the_console_scripts_run_from_the_install():
    want = PYPROJECT["project"]["version"]
    for script in ("pdpush", "pdpush-receiver", "pdpush-sender"):
        r = subprocess.run([str(BIN / script), "--version"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.startswith(f"pdpush {want} "), (script, r.stdout + r.stderr)
    r = subprocess.run([str(BIN / "pdpush"), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "demo" in r.stdout and "router" in r.stdout, r.stdout + r.stderr


def test_the_native_code_is_pdpushs_and_the_engine_side_loads_no_libucp_and_no_torch():
    files = {str(f) for f in md.files("pdpush") or []}
    assert any(f.startswith("pdpush_native/_copy") for f in files), sorted(files)
    assert any(f.startswith("pdpush_native/_dataplane") for f in files) and "pdpush_native/_ucx_build.py" in files
    r = subprocess.run([sys.executable, "-c", NO_LIBUCP], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.split() == ["0", "0"], r.stdout + r.stderr


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    return path / "bin"


def _pip_install(bindir: Path, *what: str) -> None:
    r = subprocess.run([str(bindir / "python"), "-m", "pip", "install", "-q", "-c", str(ROOT / "requirements.txt"),
                        *what], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


@pytest.mark.slow  # builds twice and installs into fresh venvs: minutes (make test-slow)
@pytest.mark.timeout(1800)
def test_the_built_wheel_with_the_daemons_extra_runs_a_real_receiver(tmp_path):
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (sdist,), (wheel,) = dist.glob("pdpush-*.tar.gz"), dist.glob("pdpush-*.whl")
    with tarfile.open(sdist) as t:
        assert any(n.endswith("/native/CMakeLists.txt") for n in t.getnames())
    names = zipfile.ZipFile(wheel).namelist()
    for want in ("pdpush_native/_copy", "pdpush_native/_dataplane", "pdpush_native/_ucx_build.py",
                 "pdpush_native/__init__.py", "pdpush/cli.py", "pdpush_tools/cli.py"):
        assert any(n.startswith(want) for n in names), want
    assert not any("__pycache__" in n for n in names)

    bindir = _venv(tmp_path / "venv")
    _pip_install(bindir, f"{wheel}[daemons]")
    has_torch = subprocess.run([str(bindir / "python"), "-c", "import torch"], capture_output=True, timeout=60)
    assert has_torch.returncode != 0, "the daemons' extra brought torch"

    ready = tmp_path / "ready.json"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PDPUSH_")}, "PDPUSH_METRICS_PORT": "-1",
           "PDPUSH_LAUNCHER_PID": str(os.getpid()), "UCX_WARN_UNUSED_ENV_VARS": "n"}
    argv = [str(bindir / "pdpush-receiver"), "--control-port", "0", "--ucx-port", "0", "--no-prefault",
            "--local-socket", str(tmp_path / "rx.sock"), "--layers", "2", "--kv-heads", "1", "--head-dim", "64",
            "--dtype", "float16", "--chunk-tokens", "16", "--pool-pages", "8", "--ready-file", str(ready)]
    with open(tmp_path / "receiver.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                start_new_session=True)
    try:
        for _ in range(1200):  # a minute, in waits on the child itself: it either writes the file or exits
            if ready.exists():
                break
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                continue
            break
        log_text = (tmp_path / "receiver.log").read_text(errors="replace")
        assert ready.exists() and proc.poll() is None, log_text
        info = json.loads(ready.read_text())
        assert info["control_endpoint"].startswith("tcp://"), info
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        libucp = {line.split()[-1] for line in maps.splitlines() if "/libucp.so" in line}
        assert libucp and all(p.startswith(str(tmp_path / "venv")) for p in libucp), libucp
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    assert proc.returncode == 0, (tmp_path / "receiver.log").read_text(errors="replace")


@pytest.mark.slow  # compiles native/ and installs into a fresh venv: minutes (make test-slow)
@pytest.mark.timeout(1800)
def test_pip_install_of_the_tree_gives_the_cli_and_the_native_code_without_ucx(tmp_path):
    """No extra: what the engine side gets (the row copies, loading no libucp), and no libucx."""
    bindir = _venv(tmp_path / "venv")
    _pip_install(bindir, str(ROOT))
    r = subprocess.run([str(bindir / "pdpush"), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "status" in r.stdout and "demo" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([str(bindir / "python"), "-c", NO_LIBUCP], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["0", "0"], r.stdout + r.stderr
    assert not list(bindir.parent.glob("lib/python*/site-packages/libucx")), "UCX came without the daemons' extra"
