"""The shipped configs work as is on one host, `pdpush status` reads them, and the bench can use them;
docker/compose.yaml models two hosts with configs/compose/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdpush import launch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # benches and a matrix variant: make test-slow (make test stays under 40 minutes)
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
    assert cfg.concurrent_legs == "auto"  # a string the legs' policy reads as "at once where idle", not True


def test_concurrent_legs_takes_auto_true_or_false_from_the_environment_and_refuses_the_rest(monkeypatch):
    from pdpush.config import RouterConfig, load
    from pdpush.errors import ConfigError

    for raw, want in (("auto", "auto"), ("true", True), ("false", False)):
        monkeypatch.setenv("PDPUSH_CONCURRENT_LEGS", raw)
        assert load(RouterConfig, ROOT / "configs/router.toml").concurrent_legs == want
    monkeypatch.setenv("PDPUSH_CONCURRENT_LEGS", "sometimes")
    with pytest.raises(ConfigError, match="concurrent_legs"):
        load(RouterConfig, ROOT / "configs/router.toml")


def test_an_index_silence_shorter_than_two_heartbeats_is_refused(monkeypatch):
    """Under the receivers' 1 s heartbeat every feed went silent between beats and was made again and again."""
    from pdpush.config import RouterConfig, load
    from pdpush.errors import ConfigError

    monkeypatch.setenv("PDPUSH_INDEX_SILENCE_S", "0.5")
    with pytest.raises(ConfigError, match="index_silence_s"):
        load(RouterConfig, ROOT / "configs/router.toml")
    monkeypatch.setenv("PDPUSH_INDEX_SILENCE_S", "2.0")
    assert load(RouterConfig, ROOT / "configs/router.toml").index_silence_s == 2.0


def test_compose_models_two_hosts(tmp_path):
    """docker/compose.yaml is two hosts: a decode side (receiver) and a prefill side (sender), each with its own
    IPC namespace, runtime volume and keys, and only the `fabric` network between them. No Docker engine runs
    here: the file is checked against the configs it names, and its keys script runs on local folders."""
    import re

    import yaml

    from pdpush import auth, lifeline
    from pdpush import config as C

    compose = yaml.safe_load((ROOT / "docker/compose.yaml").read_text())
    svc = compose["services"]
    sides = {"decode": ("receiver", "decode-check", "decode-ipc"), "prefill": ("sender", "prefill-check", "prefill-ipc")}
    assert set(svc) == {"keys", *sides["decode"], *sides["prefill"]}
    assert svc["receiver"]["restart"] == svc["sender"]["restart"] == "unless-stopped"  # a crashed daemon comes back

    def mounts(name: str) -> dict[str, str]:  # path in the container -> volume or host folder
        return {v.split(":")[1]: v.split(":")[0] for v in svc[name].get("volumes", [])}

    def host_path(p: str) -> Path:
        assert p.startswith("/etc/pdpush/")
        return ROOT / "configs" / p.removeprefix("/etc/pdpush/")

    cfg_path = {"receiver": host_path(svc["receiver"]["command"][-1]), "sender": host_path(svc["sender"]["command"][-1])}
    rx = C.load(C.ReceiverConfig, cfg_path["receiver"])
    tx = C.load(C.SenderConfig, cfg_path["sender"])
    sock = {"receiver": rx.local_socket_path(), "sender": tx.ingress_socket_path()}
    metrics = {"receiver": rx.metrics_port, "sender": tx.metrics_port}
    for s in svc.values():  # no PID namespace shared (lifelines), nor the host's IPC namespace; ports on loopback
        assert "pid" not in s and s.get("ipc") != "host"
        assert all(str(p).startswith("127.0.0.1:") for p in s.get("ports", []))

    run_volume, key_volume = {}, {}
    for side, (daemon, check, holder) in sides.items():
        d, c, h = svc[daemon], svc[check], svc[holder]
        # the side's IPC namespace is held by a container of its own, which outlives the daemon's restarts (a daemon
        # that owned it came back in a new one, its engine left in the old: the pool out of its sight)
        assert h["ipc"] == "shareable" and h["network_mode"] == "none" and h["command"] == ["sleep", "infinity"]
        assert h["restart"] == "unless-stopped" and h["init"] is True and not h.get("volumes")
        assert h["shm_size"]  # the /dev/shm its joiners get (an engine's worker queues; Docker's default is 64 MB)
        # the daemon joins it; memlock for its shared memory (pool or staging)
        assert d["ipc"] == f"service:{holder}" and d["ulimits"]["memlock"] == -1
        assert d["depends_on"][holder]["condition"] == "service_started"
        assert (ROOT / "docker" / mounts(daemon)["/etc/pdpush"]).resolve() == (ROOT / "configs").resolve()
        hc = d["healthcheck"]["test"]
        assert hc[1:4] == ["pdpush", "status", "--config"] and host_path(hc[4]) == cfg_path[daemon]
        assert f"127.0.0.1:{metrics[daemon]}:{metrics[daemon]}" in d["ports"]
        # the socket and its lifeline beside it are in the side's runtime volume
        run_dir = str(sock[daemon].parent)
        assert lifeline.path_for(sock[daemon]).parent == sock[daemon].parent
        run_volume[side], key_volume[side] = mounts(daemon)[run_dir], mounts(daemon)["/keys"]
        # the engine's place: the daemon's IPC namespace and runtime volume, nothing else; checked once
        assert c["ipc"] == f"service:{holder}" and c["network_mode"] == "none" and c["ulimits"]["memlock"] == -1
        assert mounts(check)[run_dir] == run_volume[side] and "/keys" not in mounts(check)
        assert c["depends_on"][daemon]["condition"] == "service_healthy"
        script = c["command"][-1]
        assert "/proc/sysvipc/shm" in script and f"pdpush status --config {d['command'][-1]}" in script
    assert len(set(run_volume.values()) | set(key_volume.values())) == 4  # each side's volumes are its own
    assert set(run_volume.values()) | set(key_volume.values()) <= set(compose["volumes"])
    for side, names in sides.items():  # no container joins the other side's IPC namespace or volumes
        other = "prefill" if side == "decode" else "decode"
        for n in names:
            assert svc[n].get("ipc") not in (f"service:{sides[other][0]}", f"service:{sides[other][2]}")
            assert not {run_volume[other], key_volume[other]} & set(mounts(n).values())

    # between the sides only the network: the receiver's control and UCX ports on `fabric`, CURVE on
    assert svc["receiver"]["networks"] == svc["sender"]["networks"] == ["fabric"] and set(compose["networks"]) == {"fabric"}
    assert {str(rx.control_port), str(rx.ucx_port)} <= {str(p) for p in svc["receiver"]["expose"]}
    assert tx.default_receiver == f"tcp://receiver:{rx.control_port}"
    assert rx.host == "0.0.0.0" and rx.curve_secret_key_file and rx.allowed_senders
    assert tx.curve_secret_key_file and tx.receiver_public_key
    assert set(svc["sender"]["depends_on"]) == {"keys", "prefill-ipc"}  # nor on the decode side

    # the keys script, run on local folders: each side gets what its config names, and no other secret
    k = svc["keys"]
    assert k["network_mode"] == "none" and k["user"] == "root"
    dirs = {target: tmp_path / vol for target, vol in mounts("keys").items()}
    assert set(mounts("keys").values()) == set(key_volume.values())
    for p in dirs.values():
        p.mkdir()
    script = k["command"][-1]
    assert "chown -R pdpush:pdpush" in script  # the daemons run as pdpush (docker/Dockerfile)
    subst = {**{t: str(p) for t, p in dirs.items()}, "/tmp/keys": str(tmp_path / "staging"),
             "chown -R pdpush:pdpush": "true"}
    local = re.sub("|".join(map(re.escape, sorted(subst, key=len, reverse=True))), lambda m: subst[m.group(0)], script)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # pdpush
    r = subprocess.run(["sh", "-ec", local], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (tmp_path / "staging").exists()
    vol_dir = {vol: tmp_path / vol for vol in key_volume.values()}

    def in_volume(side: str, p: str) -> Path:
        assert p.startswith("/keys/")
        return vol_dir[key_volume[side]] / p.removeprefix("/keys/")

    rx_files = [rx.curve_secret_key_file, *rx.allowed_senders]
    tx_files = [tx.curve_secret_key_file, tx.receiver_public_key]
    assert sorted(f.name for f in vol_dir[key_volume["decode"]].iterdir()) == sorted(Path(p).name for p in rx_files)
    assert sorted(f.name for f in vol_dir[key_volume["prefill"]].iterdir()) == sorted(Path(p).name for p in tx_files)
    rx_pair = auth.load_keypair(str(in_volume("decode", rx.curve_secret_key_file)))
    tx_pair = auth.load_keypair(str(in_volume("prefill", tx.curve_secret_key_file)))
    assert auth.load_public_keys(str(in_volume("prefill", tx.receiver_public_key))) == [rx_pair.public]
    assert [kk for p in rx.allowed_senders for kk in auth.load_public_keys(str(in_volume("decode", p)))] == [tx_pair.public]
    for side, f in (("decode", rx.curve_secret_key_file), ("prefill", tx.curve_secret_key_file)):
        assert in_volume(side, f).stat().st_mode & 0o077 == 0
    before = {p: p.read_bytes() for v in vol_dir.values() for p in v.iterdir()}
    r = subprocess.run(["sh", "-ec", local], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and {p: p.read_bytes() for p in before} == before  # made once

    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    assert re.search(r"^USER pdpush$", dockerfile, re.M) and "/opt/pdpush/.venv" in dockerfile
    # RDMA-ready: the data plane linked against Debian's UCX (ib, rdmacm), the verbs providers at run time, and a
    # fixed uid for engines in other containers
    assert "libucx-dev" in dockerfile and "PDPUSH_UCX=system" in dockerfile
    assert all(p in dockerfile for p in ("libucx0", "rdma-core", "ibverbs-providers"))
    assert re.search(r"useradd .*--uid 10001 ", dockerfile) and re.search(r"groupadd .*--gid 10001 ", dockerfile)
    owned = re.search(r"chown pdpush:pdpush ([^&\n]*)", dockerfile).group(1).split()
    assert {"/keys", str(sock["receiver"].parent), str(sock["sender"].parent)} <= set(owned)  # volumes made there
    for port in (rx.control_port, rx.ucx_port, rx.metrics_port, tx.metrics_port):
        assert str(port) in re.search(r"^EXPOSE (.*)$", dockerfile, re.M).group(1)
