"""The shipped configs work as is on one host, `pdpush status` reads them, and the bench can use them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdpush import launch

ROOT = Path(__file__).resolve().parents[1]


def test_daemons_with_shipped_configs_and_bench_against_them(tmp_path):
    rx = tx = None
    try:
        rx = launch.start_receiver(tmp_path, config=ROOT / "configs/receiver.toml")
        tx = launch.start_sender(tmp_path, config=ROOT / "configs/sender.toml")
        assert rx.info["control_endpoint"] == "tcp://127.0.0.1:5710" and rx.info["ucx_port"] == 5711
        for cfg, role in (("receiver", "receiver"), ("sender", "sender")):
            r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "status", "--config",
                                str(ROOT / f"configs/{cfg}.toml"), "--json"], capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["role"] == role
        out = tmp_path / "b.json"
        r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "bench", "--tokens", "700", "--requests", "1",
                            "--receiver-config", str(ROOT / "configs/receiver.toml"),
                            "--sender-config", str(ROOT / "configs/sender.toml"), "--json", str(out)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(out.read_text())
        assert res["verified"] and res["layout"]["layers"] == 32
    finally:
        for d in (tx, rx):
            if d is not None:
                d.stop()
    # with the daemons gone, status fails (non-zero), it does not hang
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "status", "--config",
                        str(ROOT / "configs/receiver.toml")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "did not answer" in r.stderr


def test_the_readmes_one_host_vllm_commands_are_the_script_make_vllm_one_host_runs():
    """`make vllm-one-host` runs examples/vllm-one-host.sh; the README shows its commands verbatim."""
    script = (ROOT / "examples/vllm-one-host.sh").read_text()
    start, end = "# --- the README's commands start here ---\n", "# --- end of the README's commands ---"
    block = script[script.index(start) + len(start):script.index(end)]
    assert block.strip() and block in (ROOT / "README.md").read_text()
    assert "vllm-one-host:" in (ROOT / "Makefile").read_text()
    for name in ("kv_producer", "kv_consumer"):  # the connectors read the shipped daemon configs, as the daemons do
        extra = json.loads((ROOT / f"configs/vllm/{name}.json").read_text())["kv_connector_extra_config"]
        for key in ("sender_config", "receiver_config"):
            if key in extra:
                assert (ROOT / extra[key]).is_file(), extra[key]


def test_the_shipped_router_config_loads():
    from pdpush.config import RouterConfig, load

    cfg = load(RouterConfig, ROOT / "configs/router.toml")
    assert cfg.host == "127.0.0.1" and cfg.decode[0].receiver == "tcp://127.0.0.1:5710"
