"""One UCX per process, chosen on purpose (pdpush/transport/ucx_lib.py, native/CMakeLists.txt's PDPUSH_UCX):
a daemon maps exactly the libucp its pdpush_native was built against, refuses to start beside another one
(naming both), and ``pdpush doctor`` says what that UCX can do.

``PDPUSH_EXPECT_UCX`` (``make test-ucx-system`` sets it to ``system``) says which UCX this run must be on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdpush import launch
from pdpush.client import status
from pdpush.layout import KVLayout
from pdpush.transport import ucx_lib
from tests.helpers import rx_opts, sock

LAY = KVLayout(4, 2, 64, "float16", 16)

EXPECT = os.environ.get("PDPUSH_EXPECT_UCX", "")


def _system_libucp() -> str:
    out = subprocess.run(["pkg-config", "--variable=libdir", "ucx"], capture_output=True, text=True)
    path = Path(out.stdout.strip() or "/usr/lib/x86_64-linux-gnu") / "libucp.so.0"
    if not path.exists():
        pytest.fail(f"no system libucp at {path}: install Debian's libucx-dev (make test does)")
    return str(path)


def _wheel_libucp() -> str:
    import libucx

    return str(Path(libucx.__file__).parent / "lib" / "libucp.so.0")


def test_maps_parsing_finds_each_libucp_once():
    maps = ("7f00-7f01 r-xp 00000000 08:01 12 /opt/a/libucp.so.0.0.0\n"
            "7f01-7f02 r--p 00001000 08:01 12 /opt/a/libucp.so.0.0.0\n"
            "7f02-7f03 r-xp 00000000 08:01 13 /usr/lib/libucs.so.0\n"
            "7f03-7f04 r-xp 00000000 08:01 14 /usr/lib/x86_64-linux-gnu/libucp.so.0\n"
            "7f04-7f05 rw-p 00000000 00:00 0 \n")
    assert ucx_lib.mapped(maps) == ["/opt/a/libucp.so.0.0.0", "/usr/lib/x86_64-linux-gnu/libucp.so.0"]


def test_a_daemon_maps_exactly_one_libucp_the_one_it_was_built_against(daemons):
    rx = daemons.receiver(**rx_opts(LAY))
    maps = Path(f"/proc/{rx.pid}/maps").read_text()
    built = ucx_lib.build()
    assert [os.path.realpath(p) for p in ucx_lib.mapped(maps)] == [os.path.realpath(built.library)], maps
    st = status(sock(rx))
    assert os.path.samefile(st["ucx_library"], built.library) and st["ucx_source"] == built.source
    assert "tcp/" in st["ucx_available"] and st["memlock_needed_bytes"] == rx.info["pool_bytes"]
    assert isinstance(st["memlock_bytes"], int) and isinstance(st["hugepages_free"], int)
    if EXPECT:
        assert built.source == EXPECT, built
    if EXPECT == "system":
        assert os.path.samefile(built.library, _system_libucp()) and st["ucx_version"].startswith("1.13"), st


def test_a_daemon_beside_a_second_libucp_is_refused_naming_both(tmp_path):
    """Another libucp is already in the process (LD_PRELOAD here; a library that brings its own UCX alike): two
    UCX instances abort in the second one's constructor, so the daemon stops first with a typed error."""
    built = ucx_lib.build().library
    other = _system_libucp() if ucx_lib.build().source == "wheel" else _wheel_libucp()
    assert not os.path.samefile(built, other)
    with pytest.raises(RuntimeError) as e:
        launch.start_receiver(tmp_path, env={"LD_PRELOAD": other}, **rx_opts(LAY))
    log = str(e.value)
    assert "exited with 3" in log or "exited with 2" in log, log
    assert "refusing to start UCX" in log and other in log and built in log, log


def test_doctor_names_the_transports_and_says_there_is_no_rdma_device():
    out = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "doctor", "--json"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode in (0, 1), out.stderr
    facts = json.loads(out.stdout)
    ucx = facts["ucx"]
    assert os.path.isabs(ucx["library"]) and os.path.samefile(ucx["library"], ucx_lib.build().library)
    assert "tcp" in ucx["transports"] and ucx["version"] and isinstance(facts["memlock_bytes"], int)
    assert facts["open_files"]["hard"] == -1 or facts["open_files"]["hard"] >= facts["open_files"]["soft"] > 0
    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        assert facts["rdma_capable"] is False
        assert any("no RDMA device" in n for n in facts["notes"]), facts
        text = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "doctor"], capture_output=True, text=True,
                              timeout=60).stdout
        assert "RDMA: no (devices: none)" in text and "tcp/" in text, text


def test_doctor_says_in_a_line_why_ucx_cannot_start():
    """A UCX that cannot start (here: asked for a transport it lacks) is what doctor is for: one line naming it and
    the UCX_* settings, exit 2 (as the daemons fail), not a traceback and exit 1 (which means "warnings")."""
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "doctor"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "UCX_TLS": "no_such_transport"})
    assert r.returncode == 2 and "cannot start" in r.stderr and "no_such_transport" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_doctor_says_in_a_line_why_libucp_cannot_load(monkeypatch):
    """A libucp that cannot load (a library it needs missing, a partial native build) raised OSError or ImportError
    out of doctor: a traceback, and exit 1, which means "warnings". One line and exit 2, as for a UCX that cannot
    start."""
    from typer.testing import CliRunner

    from pdpush import doctor
    from pdpush.cli import app

    for exc in (OSError("libnuma.so.1: cannot open shared object file"), ImportError("pdpush_native._dataplane")):
        monkeypatch.setattr(doctor, "gather", lambda *a, exc=exc: (_ for _ in ()).throw(exc))
        r = CliRunner().invoke(app, ["doctor"])
        assert r.exit_code == 2 and f"{type(exc).__name__}: {exc}" in r.output, (r.exit_code, r.output, r.exception)


def test_doctor_judges_memlock_and_rdma_from_facts():
    from pdpush.doctor import judge

    base = {"ucx": {"components": ["self", "tcp"], "resources": [["tcp", "eth0"]], "source": "wheel",
                    "library": "/x/libucp.so.0"}, "rdma_capable": False, "rdma_devices": [],
            "memlock_bytes": 8 << 20, "memlock_needed_bytes": 1 << 30}
    warnings, notes = judge(base)  # no RDMA: nothing is registered, and the daemons do not warn (a note only)
    assert warnings == [] and any("locked-memory limit" in n for n in notes) and any("tcp/eth0" in n for n in notes)
    warnings, _ = judge({**base, "rdma_capable": True})
    assert len(warnings) == 1 and "locked-memory limit" in warnings[0] and "LimitMEMLOCK" in warnings[0]
    warnings, _ = judge({**base, "rdma_devices": ["mlx5_0"], "memlock_bytes": -1})
    assert len(warnings) == 1 and "mlx5_0" in warnings[0] and "PDPUSH_UCX=system" in warnings[0]
    warnings, _ = judge({**base, "memlock_bytes": -1, "open_files": {"soft": 1024, "hard": 4096}})
    assert len(warnings) == 1 and "open-files hard limit (4096)" in warnings[0] and "LimitNOFILE" in warnings[0]
    for hard in (-1, 524288):  # the soft limit alone is no matter: a daemon raises it to the hard one
        assert judge({**base, "memlock_bytes": -1, "open_files": {"soft": 1024, "hard": hard}})[0] == []


def test_each_peers_transport_is_a_metric_and_in_status(daemons):
    import httpx

    from pdpush.client import PrefillClient
    from tests.helpers import kv, push, until

    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    try:
        k, v = kv(LAY, 20, 1)
        push(pc, "m", list(range(20)), k, v)
    finally:
        pc.close()
    lanes = json.loads(status(sock(tx))["ucx_transports"])
    assert list(lanes) == [rx.info["control_endpoint"]] and lanes[rx.info["control_endpoint"]], lanes
    first = lanes[rx.info["control_endpoint"]].split()[0].split("/")
    line = (f'pdpush_peer_transport_info{{device="{first[1]}",peer="{rx.info["control_endpoint"]}",'
            f'transport="{first[0]}"}} 1.0')
    until(lambda: line in httpx.get(tx.info["metrics_endpoint"], timeout=5).text, 10, f"{line} on /metrics")
    assert json.loads(status(sock(rx))["ucx_transports"]), "the receiver names its sender's lanes too"
