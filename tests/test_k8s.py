"""deploy/k8s: the Kustomize manifests render (``kubectl kustomize``), every object passes Kubernetes' own schemas
(kubernetes-validate, strict: no unknown field), and what pdpush needs of a pod holds in what would be applied:
the daemon and its engine in one pod (one IPC namespace, no shared PID namespace), one uid, IPC_LOCK, the runtime
socket directory on an emptyDir named by XDG_RUNTIME_DIR in both, keys from Secrets only, the RDMA resource, probes
on the daemon's own config, and configs that pdpush's own loader takes, naming pods that exist.

No skip: kubectl and kubernetes-validate are required (CI runs as root with both). ``test_the_checks_catch`` breaks
the rendered objects one way at a time and expects the checks to fail.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from pdpush.config import ReceiverConfig, RouterConfig, SenderConfig, load

ROOT = Path(__file__).resolve().parents[1]
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
TARGETS = {"base": ROOT / "deploy/k8s", "xpyd": ROOT / "deploy/k8s/overlays/xpyd"}
UID = 10001  # docker/Dockerfile's pdpush user and group
RDMA = "rdma/hca_shared_devices_a"  # deploy/k8s/base/rdma.yaml: the one place it is named
SIDES = {"pdpush-decode": ("receiver", ReceiverConfig), "pdpush-prefill": ("sender", SenderConfig)}


@functools.cache
def _rendered(name: str) -> str:
    r = subprocess.run([KUBECTL, "kustomize", str(TARGETS[name])], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"kubectl kustomize {TARGETS[name]}: {r.stderr}"
    return r.stdout


def render(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(_rendered(name)) if d]


def find(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def config_map(objs: list[dict], name: str) -> dict:
    """A ConfigMap by the name written in the manifests (kustomize may add a hash suffix)."""
    found = [o for o in objs if o["kind"] == "ConfigMap" and (o["metadata"]["name"] == name or
                                                              o["metadata"]["name"].startswith(name + "-"))]
    assert len(found) == 1, f"ConfigMap {name}: {len(found)}"
    return found[0]


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def env(c: dict, name: str):
    return next((e for e in c.get("env", []) if e["name"] == name), None)


def volume_at(pod: dict, c: dict, path: str) -> tuple[dict, str]:
    """The volume a path in container ``c`` lies on, and the path inside that volume (no subPath mounts here)."""
    best = None
    for m in c.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if (path == mp or path.startswith(mp + "/")) and (best is None or len(mp) > len(best["mountPath"])):
            best = m
    assert best is not None, f"{path} is on no volume of container {c['name']}"
    assert "subPath" not in best, f"{best['mountPath']}: a subPath mount never sees a ConfigMap or Secret update"
    vol = next(v for v in pod["volumes"] if v["name"] == best["name"])
    return vol, path[len(best["mountPath"].rstrip("/")):].lstrip("/")


def file_of(objs: list[dict], pod: dict, c: dict, path: str) -> str:
    """The text a container reads at ``path``, from the ConfigMap mounted there."""
    vol, rel = volume_at(pod, c, path)
    assert "configMap" in vol, f"{path} in {c['name']}: not a ConfigMap ({vol})"
    return find(objs, "ConfigMap", vol["configMap"]["name"])["data"][rel]


def arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def loaded(cls, text: str, tmp: Path):
    p = tmp / f"{cls.__name__}.toml"
    p.write_text(text)
    return load(cls, p)


@pytest.fixture(autouse=True)
def _no_pdpush_env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("PDPUSH_")]:
        monkeypatch.delenv(k)  # the configs are checked as the files say, not as this shell overrides them


# ---- the checks (each raises AssertionError naming what is wrong) ------------------------------------------------

def check_pods(objs: list[dict]) -> None:
    for sts, (daemon_name, _cls) in SIDES.items():
        pod = find(objs, "StatefulSet", sts)["spec"]["template"]["spec"]
        assert not pod.get("hostIPC") and not pod.get("hostPID"), f"{sts}: the node's IPC or PID namespace"
        assert not pod.get("shareProcessNamespace"), f"{sts}: a shared PID namespace (the lifelines need none)"
        daemon = next(c for c in pod.get("initContainers", []) if c["name"] == daemon_name)
        assert daemon.get("restartPolicy") == "Always", f"{sts}: {daemon_name} is not a sidecar"
        engine = next(c for c in pod["containers"] if c["name"] == "vllm")
        uids = set()
        for c in containers(pod):
            sc, psc = c.get("securityContext", {}), pod.get("securityContext", {})
            uid, gid = sc.get("runAsUser", psc.get("runAsUser")), sc.get("runAsGroup", psc.get("runAsGroup"))
            assert (uid, gid) == (UID, UID), f"{sts}/{c['name']}: runs as {uid}:{gid}, not {UID}:{UID}"
            uids.add(uid)
            assert "IPC_LOCK" in sc.get("capabilities", {}).get("add", []), f"{sts}/{c['name']}: no IPC_LOCK"
        assert uids == {UID}  # the engine attaches the daemon's 0600 shared memory
        # the socket directory: XDG_RUNTIME_DIR on one emptyDir, the same in both
        runtime = [env(c, "XDG_RUNTIME_DIR") for c in (daemon, engine)]
        assert all(runtime) and runtime[0]["value"] == runtime[1]["value"], f"{sts}: XDG_RUNTIME_DIR {runtime}"
        vols = [volume_at(pod, c, runtime[0]["value"]) for c in (daemon, engine)]
        assert vols[0] == vols[1] and vols[0][1] == "" and "emptyDir" in vols[0][0], f"{sts}: runtime dir on {vols}"
        # RDMA: the daemons drive the NIC
        assert daemon.get("resources", {}).get("limits", {}).get(RDMA) == 1, f"{sts}/{daemon_name}: no {RDMA}"
        # probes on the daemon's own config: all three answered by its loop (the metrics port is a thread of its
        # own, live while the loop is stuck)
        cfg_path = arg(daemon["command"], "--config")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            cmd = daemon[probe]["exec"]["command"]
            assert cmd[:2] == ["pdpush", "status"] and arg(cmd, "--config") == cfg_path, f"{sts}: {probe} {cmd}"


def check_keys(objs: list[dict], tmp: Path) -> None:
    """Every key path a config names lies on a Secret volume of the container that reads it; no Secret is shipped."""
    assert not [o for o in objs if o["kind"] == "Secret"], "keys are made by `pdpush keygen`, never shipped"
    readers = []
    for sts, (daemon_name, cls) in SIDES.items():
        pod = find(objs, "StatefulSet", sts)["spec"]["template"]["spec"]
        daemon = next(c for c in pod["initContainers"] if c["name"] == daemon_name)
        readers.append((pod, daemon, loaded(cls, file_of(objs, pod, daemon, arg(daemon["command"], "--config")), tmp)))
    pod = find(objs, "Deployment", "pdpush-router")["spec"]["template"]["spec"]
    router = pod["containers"][0]
    readers.append((pod, router, loaded(RouterConfig, file_of(objs, pod, router, arg(router["command"], "--config")),
                                        tmp)))
    for pod, c, cfg in readers:
        paths = [cfg.curve_secret_key_file]
        paths += getattr(cfg, "allowed_senders", []) + getattr(cfg, "allowed_readers", [])
        paths += [getattr(cfg, "receiver_public_key", None)] + [d.receiver_public_key for d in getattr(cfg, "decode", [])]
        assert cfg.curve_secret_key_file, f"{c['name']}: CURVE off"
        for p in [p for p in paths if p]:
            vol, _ = volume_at(pod, c, p)
            assert "secret" in vol, f"{c['name']}: {p} is not on a Secret volume ({vol})"


# ---- the tests ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_rendered_object_passes_the_kubernetes_schemas_strictly(name):
    objs = render(name)
    kinds = sorted((o["kind"], o["metadata"]["name"].split("-")[1]) for o in objs)
    assert ("StatefulSet", "decode") in kinds and ("StatefulSet", "prefill") in kinds and \
        ("Deployment", "router") in kinds
    version = kubernetes_validate.latest_version()
    for o in objs:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{o['kind']}/{o['metadata']['name']}: {str(e).splitlines()[0]}")


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_each_daemon_and_its_engine_share_ipc_a_uid_and_a_socket_dir_and_nothing_else(name):
    check_pods(render(name))


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_keys_come_from_secrets_only(name, tmp_path):
    check_keys(render(name), tmp_path)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_configs_load_with_pdpush_own_loader_and_name_pods_that_exist(name, tmp_path, monkeypatch):
    objs = render(name)
    decode = find(objs, "StatefulSet", "pdpush-decode")
    prefill = find(objs, "StatefulSet", "pdpush-prefill")
    dpod, ppod = decode["spec"]["template"]["spec"], prefill["spec"]["template"]["spec"]
    receiver = next(c for c in dpod["initContainers"] if c["name"] == "receiver")
    rx_path = arg(receiver["command"], "--config")
    rx = loaded(ReceiverConfig, file_of(objs, dpod, receiver, rx_path), tmp_path)
    assert rx.host == "0.0.0.0" and rx.curve_secret_key_file and rx.allowed_readers  # CURVE, routers may read
    assert rx.metrics_host == "0.0.0.0"  # Prometheus scrapes it from outside the pod
    ports = {p["name"]: p["containerPort"] for p in receiver["ports"]}
    assert (ports["control"], ports["ucx"], ports["metrics"]) == (rx.control_port, rx.ucx_port, rx.metrics_port)
    # the decode engine's connector reads the receiver's own file, from the same ConfigMap
    dengine = next(c for c in dpod["containers"] if c["name"] == "vllm")
    ref = env(dengine, "KV_TRANSFER_CONFIG")["valueFrom"]["configMapKeyRef"]
    consumer = json.loads(find(objs, "ConfigMap", ref["name"])["data"][ref["key"]])
    assert consumer["kv_role"] == "kv_consumer" and "$(KV_TRANSFER_CONFIG)" in dengine["args"]
    assert consumer["kv_connector_extra_config"]["receiver_config"] == rx_path
    assert file_of(objs, dpod, dengine, rx_path) == file_of(objs, dpod, receiver, rx_path)
    runtime = Path(env(receiver, "XDG_RUNTIME_DIR")["value"])
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))  # as in both containers
    assert rx.local_socket_path().parent == runtime / "pdpush"  # the daemon makes it, 0700, in the emptyDir
    # the prefill side
    sender = next(c for c in ppod["initContainers"] if c["name"] == "sender")
    tx = loaded(SenderConfig, file_of(objs, ppod, sender, arg(sender["command"], "--config")), tmp_path)
    pengine = next(c for c in ppod["containers"] if c["name"] == "vllm")
    ref = env(pengine, "KV_TRANSFER_CONFIG")["valueFrom"]["configMapKeyRef"]
    producer = json.loads(find(objs, "ConfigMap", ref["name"])["data"][ref["key"]])["kv_connector_extra_config"]
    assert producer["sender_config"] == arg(sender["command"], "--config")
    loaded(ReceiverConfig, file_of(objs, ppod, pengine, producer["receiver_config"]), tmp_path)  # chunk_tokens, model
    # the router: its file as a fixed-name ConfigMap (SIGHUP reads it again), naming pods the StatefulSets make
    rpod = find(objs, "Deployment", "pdpush-router")["spec"]["template"]["spec"]
    router = rpod["containers"][0]
    vol, _ = volume_at(rpod, router, arg(router["command"], "--config"))
    assert vol["configMap"]["name"] == "pdpush-router"  # no hash suffix: `kubectl apply` updates it in place
    rt = loaded(RouterConfig, file_of(objs, rpod, router, arg(router["command"], "--config")), tmp_path)
    assert rt.host == "0.0.0.0"

    def pod_of(url: str, sts: dict, port_name: str) -> str:
        u = urlsplit(url)
        pod, svc = u.hostname.split(".", 1)
        ordinal = int(pod.rsplit("-", 1)[1])
        assert pod.startswith(sts["metadata"]["name"] + "-") and ordinal < sts["spec"]["replicas"], url
        assert svc == sts["spec"]["serviceName"], url
        service = find(objs, "Service", svc)
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]}[port_name] == u.port, url
        return pod

    assert len(rt.prefill) == prefill["spec"]["replicas"] and len(rt.decode) == decode["spec"]["replicas"]
    assert len({pod_of(u, prefill, "http") for u in rt.prefill}) == len(rt.prefill)
    for d in rt.decode:  # its vLLM and its receiver: one pod
        assert pod_of(d.url, decode, "http") == pod_of(d.receiver, decode, "control")
        assert d.receiver in producer["allowed_receivers"]
    assert tx.default_receiver in producer["allowed_receivers"]


# each way of breaking the rendered base, and what check_pods says of it
BREAKS = {
    "engine runs as root": lambda o: _pod(o, "pdpush-decode")["containers"][0].setdefault(
        "securityContext", {}).update(runAsUser=0),
    "no IPC_LOCK on the sender": lambda o: _daemon(o, "pdpush-prefill", "sender")["securityContext"][
        "capabilities"].update(add=[]),
    "hostPath socket dir": lambda o: next(v for v in _pod(o, "pdpush-decode")["volumes"] if v["name"] == "run").update(
        {"emptyDir": None, "hostPath": {"path": "/run/x"}}) or _strip_none(o),
    "engine without XDG_RUNTIME_DIR": lambda o: _pod(o, "pdpush-prefill")["containers"][0].update(env=[
        e for e in _pod(o, "pdpush-prefill")["containers"][0]["env"] if e["name"] != "XDG_RUNTIME_DIR"]),
    "shared PID namespace": lambda o: _pod(o, "pdpush-decode").update(shareProcessNamespace=True),
    "no RDMA resource": lambda o: _daemon(o, "pdpush-decode", "receiver")["resources"]["limits"].pop(RDMA),
    "probe on another config": lambda o: _daemon(o, "pdpush-decode", "receiver")["readinessProbe"]["exec"][
        "command"].__setitem__(3, "/etc/pdpush/sender.toml"),
}


def _pod(objs: list[dict], sts: str) -> dict:
    return find(objs, "StatefulSet", sts)["spec"]["template"]["spec"]


def _daemon(objs: list[dict], sts: str, name: str) -> dict:
    return next(c for c in _pod(objs, sts)["initContainers"] if c["name"] == name)


def _strip_none(objs: list[dict]) -> None:
    for v in _pod(objs, "pdpush-decode")["volumes"]:
        for k in [k for k, x in v.items() if x is None]:
            del v[k]


SAID = {"engine runs as root": "vllm: runs as 0:10001", "no IPC_LOCK on the sender": "sender: no IPC_LOCK",
        "hostPath socket dir": "runtime dir on", "engine without XDG_RUNTIME_DIR": "XDG_RUNTIME_DIR",
        "shared PID namespace": "shared PID namespace", "no RDMA resource": f"receiver: no {RDMA}",
        "probe on another config": "readinessProbe"}


@pytest.mark.parametrize("what", sorted(BREAKS))
def test_the_checks_catch(what):
    """Each way of breaking the rendered base fails the checks above, saying why (so they can fail)."""
    objs = copy.deepcopy(render("base"))
    check_pods(objs)
    BREAKS[what](objs)
    with pytest.raises(AssertionError, match=SAID[what]):
        check_pods(objs)


def test_the_checks_catch_a_key_outside_a_secret_and_a_strict_schema_miss(tmp_path):
    objs = copy.deepcopy(render("base"))
    cm = config_map(objs, "pdpush-config")
    cm["data"]["receiver.toml"] = cm["data"]["receiver.toml"].replace('"/keys/receiver.key_secret"',
                                                                      '"/etc/pdpush/receiver.key_secret"')
    with pytest.raises(AssertionError, match="not on a Secret volume"):
        check_keys(objs, tmp_path)
    router = copy.deepcopy(find(objs, "Deployment", "pdpush-router"))
    router["spec"]["template"]["spec"]["containers"][0]["ipcLock"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(router, kubernetes_validate.latest_version(), strict=True)
