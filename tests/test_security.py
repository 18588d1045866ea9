"""Authenticated control plane, token-bound data plane, exposure refusal, bounded input, fuzzing."""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from pdpush import auth, protocol
from pdpush import config as C
from pdpush.client import DecodeClient, PrefillClient, status
from pdpush.errors import PdpushError, TransferError
from pdpush.layout import KVLayout, chunk_keys
from tests.helpers import kv, push, read_back, round_trip, rx_opts, sock, until

LAY = KVLayout(2, 2, 64, "float16", 16)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    out = {}
    for name in ("receiver", "sender", "stranger"):
        pub, sec = auth.keygen(d, name)
        out[name] = (str(pub), str(sec))
    assert oct(os.stat(out["sender"][1]).st_mode & 0o777) == "0o600"
    return out


def test_authenticated_pair_works(daemons, keys):
    rx = daemons.receiver(**rx_opts(LAY), curve_secret_key_file=keys["receiver"][1],
                          allowed_senders=[keys["sender"][0]])
    assert rx.info["auth"] == "curve"
    tx = daemons.sender(rx, curve_secret_key_file=keys["sender"][1], receiver_public_key=keys["receiver"][0])
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)
    try:
        k, v = kv(LAY, 50, 1)
        push(pc, "authed", list(range(50)), k, v)
        k2, v2 = read_back(dc, "authed", LAY, 50)
        assert np.array_equal(k2, k) and np.array_equal(v2, v)
        assert status(sock(rx))["ucx_peers"] == 1
    finally:
        pc.close()
        dc.close()


def test_a_decode_engine_maps_the_pool_read_only_and_the_prefill_engine_its_staging_read_write(daemons):
    """A decode engine reads the receiver's pool and never writes it: the receiver commits a push on the readiness
    words in the pool, and every reader shares its chunks. So its mapping is read-only (a write faults in that
    engine), and an engine cannot forge the words of another request, nor change committed KV. Before, it was
    mapped read-write. The prefill engine's mapping of its staging is still writable: it writes layers there."""
    rx = daemons.receiver(**rx_opts(LAY))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)

    def perms(address: int) -> str:
        for line in Path("/proc/self/maps").read_text().splitlines():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.split()[1]
        raise AssertionError(f"{address:#x} not mapped")

    try:
        k, v = kv(LAY, 50, 2)
        push(pc, "ro", list(range(50)), k, v)
        k2, v2 = read_back(dc, "ro", LAY, 50)
        assert np.array_equal(k2, k) and np.array_equal(v2, v)
        (pool,) = dc._segments._segs.values()
        (staging,) = pc._segments._segs.values()
        assert perms(pool.address) == "r--s" and perms(staging.address) == "rw-s"
    finally:
        pc.close()
        dc.close()


@pytest.mark.parametrize("who", ["no-keys", "unlisted-key"])
def test_unauthenticated_sender_gets_nothing(daemons, keys, who):
    rx = daemons.receiver(**rx_opts(LAY), curve_secret_key_file=keys["receiver"][1],
                          allowed_senders=[keys["sender"][0]])
    extra = {} if who == "no-keys" else {"curve_secret_key_file": keys["stranger"][1],
                                         "receiver_public_key": keys["receiver"][0]}
    tx = daemons.sender(rx, control_timeout_ms=1500, **extra)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    try:
        with pytest.raises(PdpushError, match="did not answer hello"):
            pc.begin("sneaky", list(range(40)))
    finally:
        pc.close()
    st_ = status(sock(rx))
    assert st_["requests_total"] == 0 and st_["pool_pages_free"] == 64 and st_["ucx_peers"] == 0
    # a raw plaintext client gets no reply at all: no pool base, no rkey
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(rx.info["control_endpoint"])
    with contextlib.suppress(zmq.Again):  # (a send that blocked here waited for good: once the plaintext handshake
        # failed, the socket could have no peer to queue the frame for; either way nothing may come back)
        s.send(protocol.encode(protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(),
                                              layout=protocol.LayoutSpec(**LAY.to_dict()))), zmq.NOBLOCK)
    assert s.poll(1000) == 0
    s.close(0)


def test_receiver_refuses_to_expose_itself_without_auth():
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "receiver", "--config",
                        str(ROOT / "configs/receiver.toml"), "--bind", "0.0.0.0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "without authentication" in r.stderr and "pdpush keygen" in r.stderr and "--insecure" in r.stderr


def test_insecure_exposure_is_explicit_and_logged(tmp_path):
    """--insecure starts it, with a warning (inside a private network namespace: nothing is exposed)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a private network namespace")
    ns = f"pdp-sec-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, f"as root, a network namespace could not be made: {made.stderr}"  # (CI: root)
    proc = None
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        ready = tmp_path / "ready.json"
        env = {**os.environ, "PDPUSH_CONTROL_PORT": "0", "PDPUSH_UCX_PORT": "0", "PDPUSH_PREFAULT": "false",
               "PDPUSH_POOL_PAGES": "2", "PDPUSH_LOCAL_SOCKET": str(tmp_path / "rx.sock"),
               "UCX_WARN_UNUSED_ENV_VARS": "n"}
        log = open(tmp_path / "log", "w")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "pdpush.cli_entry", "receiver",
                                 "--bind", "0.0.0.0", "--insecure", "--ready-file", str(ready)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.05)  # waiting for the ready-file; bounded
        assert "INSECURE" in (tmp_path / "log").read_text()
    finally:
        try:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:  # killed, by its pid, and the namespace still goes
                    proc.kill()
                    proc.wait(15)
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_an_exposed_receiver_started_insecure_has_a_config_its_engines_and_tools_still_read(tmp_path):
    """A receiver exposed with ``--insecure`` (or PDPUSH_INSECURE in its own environment) keeps a TOML that, read to
    serve, is refused; its decode engine's connector reads that file for the receiver's socket and layout, and
    refused it too, so the decode vLLM engine did not start. Read to find the daemon (``read_receiver``), it is
    not judged: the connector, ``pdpush status`` / ``doctor`` and the demo and bench all read it that way."""
    from pdpush.integrations.vllm.settings import ConnectorSettings, Endpoints

    toml = tmp_path / "receiver.toml"
    toml.write_text('host = "0.0.0.0"\nlocal_socket = "/run/pdpush/rx-test.sock"\nchunk_tokens = 32\n')
    with pytest.raises(C.ConfigError, match="without authentication"):
        C.load(C.ReceiverConfig, toml)  # to serve: refused, as the daemon without --insecure refuses it
    assert str(C.read_receiver(toml).local_socket_path()) == "/run/pdpush/rx-test.sock"
    assert Endpoints.of(ConnectorSettings(receiver_config=str(toml))).receiver_socket == "/run/pdpush/rx-test.sock"


def _listening(pid: int) -> list[str]:
    """The addresses of ``pid``'s listening tcp sockets (/proc: its socket inodes against /proc/net/tcp{,6})."""
    import socket as so
    import struct

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for family, path in ((so.AF_INET, "/proc/net/tcp"), (so.AF_INET6, "/proc/net/tcp6")):
        with open(path) as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = fields[1].split(":")
            raw = b"".join(struct.pack("=I", int(addr[i:i + 8], 16)) for i in range(0, len(addr), 8))  # (host order)
            out.append(f"{so.inet_ntop(family, raw)}:{int(port, 16)}")
    return out


def test_a_receiver_on_loopback_listens_on_no_other_interface_and_a_sender_that_does_says_so(daemons, monkeypatch):
    """A receiver bound to loopback (the default) opens no port on another interface: UCX's tcp lanes, which listen
    on every interface unless told otherwise, are pinned to the loopback device (``ucx.local_only_env``): no
    other host reaches its listener, so no peer is lost. Anyone who reaches a UCX tcp port can write anywhere in
    that daemon's memory, with no hello and no token (UCX's tcp puts and software RMA check no rkey: SECURITY.md).
    A sender is not pinned (a request may name a receiver on any host): where its tcp lanes listen beyond
    loopback, it logs the warning that says so and what to pin. (A host with loopback alone shows neither.)"""
    import ipaddress

    from pdpush.transport.ucx import local_only_env

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)  # (the daemons inherit this environment: their defaults)
    rx = daemons.receiver(**rx_opts(LAY, pool_pages=4))
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=30)
    try:
        h = pc.begin("local-only", list(range(40)))  # the data plane up between them (its lanes wired)
        k, v = kv(LAY, 40, 1)
        for layer in range(LAY.layers):
            h.put_layer(layer, k[layer], v[layer])
        h.finish(timeout_s=30)
    finally:
        pc.close()
    ports = _listening(rx.pid)
    assert ports and all(ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback for a in ports), ports
    lanes = " ".join(json.loads(status(sock(rx))["ucx_transports"]).values()).split()
    assert all(t == "tcp/lo" for t in lanes if t.startswith("tcp/")), lanes
    assert "UCX's tcp lanes listen on" not in rx.log()
    beyond = [a for a in _listening(tx.pid) if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]
    assert ("UCX's tcp lanes listen on tcp/" in tx.log()) == bool(beyond), (beyond, tx.log()[-2000:])
    # the rule itself: the operator's choice (ucx_env, then the environment) stands; peers elsewhere: untouched
    assert local_only_env({}, True, {}) == {"UCX_NET_DEVICES": "lo"}
    assert local_only_env({"UCX_NET_DEVICES": "eth1"}, True, {}) == {"UCX_NET_DEVICES": "eth1"}
    assert local_only_env({}, True, {"UCX_NET_DEVICES": "mlx5_0:1"}) == {}
    assert local_only_env({"UCX_TLS": "tcp"}, False, {}) == {"UCX_TLS": "tcp"}


def test_config_validation_of_auth(tmp_path, keys):
    with pytest.raises(C.ConfigError, match="allowed_senders"):
        C.load(C.ReceiverConfig, curve_secret_key_file=keys["receiver"][1])
    with pytest.raises(C.ConfigError, match="curve_secret_key_file"):
        C.load(C.SenderConfig, receiver_public_key=keys["receiver"][0])
    cfg = C.load(C.ReceiverConfig, host="10.0.0.1", curve_secret_key_file=keys["receiver"][1],
                 allowed_senders=[keys["sender"][0]])
    assert cfg.host == "10.0.0.1"  # exposed, but authenticated: allowed


def test_a_senders_receiver_settings_fail_its_start_not_each_request(tmp_path, keys):
    """A receiver endpoint that is not one, a lease past the protocol's cap, or a receiver key file that is missing
    or not a key: refused when the sender starts, typed. Before, each started cleanly, and then every request failed
    as a hello or allocation timeout, with a traceback per request in the log, pointing at the network."""
    for bad in ({"default_receiver": "127.0.0.1:5710"}, {"receiver_keys": {"tcp://rx": keys["receiver"][0]},
                                                         "curve_secret_key_file": keys["sender"][1]},
                {"lease_ms": 3_600_001}):
        with pytest.raises(C.ConfigError, match="default_receiver|receiver_keys|lease_ms"):
            C.load(C.SenderConfig, **bad)
    (tmp_path / "not.key").write_text("not a certificate")
    for key in (str(tmp_path / "missing.key"), str(tmp_path / "not.key")):
        cfg = C.load(C.SenderConfig, curve_secret_key_file=keys["sender"][1], receiver_public_key=key)
        from pdpush.sender import Sender

        with pytest.raises(C.ConfigError, match="key"):
            Sender(cfg)


def test_key_files_that_would_let_in_no_one_or_anyone_are_refused(tmp_path, keys):
    """An allowlist directory with no key (every sender refused, silently), a secret key others may read, a 40-character
    string that is no Z85 key: each a ConfigError, which the receiver meets before it allocates its pool. And keygen
    keeps an existing pair unless --force: a new one locks the daemon out of its peers' allowlists."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(C.ConfigError, match="no public key"):
        auth.load_public_keys(str(empty))
    with pytest.raises(C.ConfigError, match="Z85"):
        auth.load_public_keys("~" * 40)
    with pytest.raises(C.ConfigError, match="Z85"):
        auth.load_public_keys("#" * 40)
    loose = tmp_path / "loose.key_secret"
    shutil.copy(keys["receiver"][1], loose)
    for mode in (0o644, 0o460):  # world-readable; group-writable
        os.chmod(loose, mode)
        with pytest.raises(C.ConfigError, match="chmod 600"):
            auth.load_keypair(str(loose))
    os.chmod(loose, 0o440)  # a Kubernetes secret volume with fsGroup (defaultMode 0400 plus group read): taken
    assert auth.load_keypair(str(loose)).secret
    d = Path(keys["receiver"][0]).parent
    with pytest.raises(C.ConfigError, match="--force"):
        auth.keygen(d, "receiver")
    before = auth.load_public_keys(keys["receiver"][0])
    pub, sec = auth.keygen(d, "receiver", True)
    assert auth.load_public_keys(str(pub)) != before
    assert (os.stat(pub).st_mode & 0o777, os.stat(sec).st_mode & 0o777) == (0o644, 0o600)
    # --force makes the files afresh: the new secret is never written into an existing file (its mode, 0644 say,
    # kept meanwhile) nor through a link there
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    os.chmod(victim, 0o644)
    os.unlink(sec)
    os.symlink(victim, sec)
    pub, sec = auth.keygen(d, "receiver", True)
    assert victim.read_text() == "untouched" and not os.path.islink(sec)
    assert os.stat(sec).st_mode & 0o777 == 0o600 and auth.load_keypair(str(sec)).secret
    dangling = d / "other.key_secret"  # a link to nothing: it is there (exists() said not, and keygen wrote through it)
    os.symlink(tmp_path / "nowhere", dangling)
    with pytest.raises(C.ConfigError, match="--force"):
        auth.keygen(d, "other")
    auth.keygen(d, "other", True)
    assert not (tmp_path / "nowhere").exists() and not os.path.islink(dangling)
    f = tmp_path / "r.toml"
    f.write_text(f"curve_secret_key_file = '{keys['receiver'][1]}'\nallowed_senders = ['{empty}']\n"
                 f"local_socket = '{tmp_path}/r.sock'\ncontrol_port = 0\nucx_port = 0\nmetrics_port = 0\n")
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "receiver", "--config", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no public key" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    # the same folder of keys in both lists: every sender a reader only, so none could push: refused at start
    both = Path(keys["sender"][0]).parent
    f.write_text(f"curve_secret_key_file = '{keys['receiver'][1]}'\nallowed_senders = ['{both}']\n"
                 f"allowed_readers = ['{both}']\n"
                 f"local_socket = '{tmp_path}/r.sock'\ncontrol_port = 0\nucx_port = 0\nmetrics_port = 0\n")
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "receiver", "--config", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no sender could push" in r.stderr, r.stderr[-2000:]


def test_a_start_that_fails_on_the_host_exits_3_with_one_line_and_leaves_no_socket(tmp_path, keys):
    """The sender's metrics port is taken, or its receiver's key file is missing: exit 3 (start-up) or 2 (config),
    with one line saying why and no traceback, and the sockets it had bound are gone. Before: a traceback and exit 1,
    after the staging was allocated, with its engine sockets left on disk."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        for extra, code, why in ((["--bind", "127.0.0.1"], 3, "start-up failed"), ([], 2, "missing.key")):
            f = tmp_path / f"s{code}.toml"
            f.write_text(f"metrics_port = {taken.getsockname()[1] if code == 3 else 0}\n"
                         f"ingress_socket = '{tmp_path}/s{code}.sock'\nstaging_bytes = {16 << 20}\nprefault = false\n"
                         + (f"curve_secret_key_file = '{keys['sender'][1]}'\n"
                            f"receiver_public_key = '{tmp_path}/missing.key'\n" if code == 2 else ""))
            r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "sender", "--config", str(f), *extra],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == code and why in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
            assert not list(tmp_path.glob(f"s{code}.sock*")), list(tmp_path.iterdir())
        # the receiver's control, UCX or metrics port taken (an old receiver not yet gone): the host's state,
        # restarted by systemd (exit 3), not a bad config (exit 2, which the units never restart); found before the
        # pool is made and faulted in (about 1 s per GiB, which each restart used to pay first)
        port = taken.getsockname()[1]
        for which, ports in (("the control endpoint", (port, 0, 0)), ("the UCX listener", (0, port, 0)),
                             ("the metrics endpoint", (0, 0, port))):
            f = tmp_path / "r.toml"
            f.write_text(f"control_port = {ports[0]}\nucx_port = {ports[1]}\nmetrics_port = {ports[2]}\n"
                         f"local_socket = '{tmp_path}/r.sock'\nprefault = true\n"
                         + "".join(f"{k} = {json.dumps(v)}\n" for k, v in rx_opts(LAY).items() if v is not None))
            r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "receiver", "--config", str(f)],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 3 and f"cannot bind {which} on 127.0.0.1:{port}: another process listens" \
                in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
            assert "transports:" not in r.stderr, r.stderr[-3000:]  # (before UCX, its pool and its prefault)
    finally:
        taken.close()


def test_ucx_peer_without_a_valid_token_is_dropped(daemons):
    from pdpush.transport.ucx import UcxWorker

    rx = daemons.receiver(**rx_opts(LAY), ucx_token_timeout_ms=500)
    w = UcxWorker()
    closed = []
    silent = w.connect("127.0.0.1", rx.info["ucx_port"])
    silent.on_close(closed.append)
    liar = w.connect("127.0.0.1", rx.info["ucx_port"])
    liar.on_close(closed.append)
    late = w.connect("127.0.0.1", rx.info["ucx_port"])  # its callback comes after its close was dispatched
    with contextlib.suppress(TransferError):  # the receiver may reset it before the send completes
        liar.stream_send(secrets.token_bytes(32), 5)  # a token the receiver never issued
    deadline = time.monotonic() + 10
    while (len(closed) < 2 or late.alive) and time.monotonic() < deadline:
        w.progress()
        w.dispatch_closed()
        time.sleep(0.01)  # polling our own UCX worker; bounded
    assert {id(e) for e in closed} == {id(silent), id(liar)}, "the receiver did not drop the token-less peers"
    assert not late.alive
    # a callback registered on an endpoint already closed still runs, at the next dispatch (the receiver registers
    # its sender's once the token is in: a peer that died in that step went unnoticed until its requests' leases)
    late.on_close(closed.append)
    w.dispatch_closed()
    assert closed[-1] is late
    st_ = status(sock(rx))
    assert st_["ucx_peers_rejected"] == 3 and st_["ucx_peers"] == 0 and st_["ucx_peers_pending"] == 0
    silent.close()
    liar.close()
    late.close()
    # a real sender (which presents its HelloAck token) still gets in
    tx = daemons.sender(rx)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    try:
        k, v = kv(LAY, 20, 2)
        push(pc, "legit", list(range(20)), k, v)
        assert status(sock(rx))["ucx_peers"] == 1
    finally:
        pc.close()


_FLOOD = """
import select, sys, time
from pdpush.transport.ucx import UcxWorker
w = UcxWorker()
eps = [w.connect("127.0.0.1", int(sys.argv[1])) for _ in range(int(sys.argv[2]))]
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0.01)[0]:  # until its stdin closes
    w.progress()
"""


def test_a_flood_of_ucx_connects_costs_the_receiver_a_bounded_number_of_endpoints(daemons):
    """The UCX port needs no key: anyone who reaches it can connect. Endpoints waiting for their token are capped
    (MAX_UCX_PENDING); past it, a connect is closed at once, and the drops are logged at the 1st, 2nd, 4th, ...
    Before, 400 connects held 400 endpoints (828 fds) until their token deadline, with a log line each. (The flood
    runs in a process of its own: its fds go with it.)"""
    from pdpush.receiver import MAX_UCX_PENDING

    rx = daemons.receiver(**rx_opts(LAY), ucx_token_timeout_ms=8000)
    n = MAX_UCX_PENDING + 44
    flood = subprocess.Popen([sys.executable, "-c", _FLOOD, str(rx.info["ucx_port"]), str(n)], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # polling the receiver's status; bounded
            st_ = status(sock(rx))
            if st_["ucx_peers_pending"] + st_["ucx_peers_rejected"] >= n:
                break
            time.sleep(0.05)
        assert st_["ucx_peers_pending"] == MAX_UCX_PENDING and st_["ucx_peers_rejected"] == 44, st_
        assert rx.log().count("dropping UCX peer") <= 7  # 1, 2, 4, ..., 32
    finally:
        flood.stdin.close()
        try:
            flood.wait(10)
        except subprocess.TimeoutExpired:
            flood.kill()
            flood.wait(10)
    until(lambda: status(sock(rx))["ucx_peers_pending"] == 0, 30, "the token-less endpoints dropped")
    round_trip(daemons.sender(rx), rx, LAY, "after-flood", list(range(20)))  # and a real sender gets in


def test_per_sender_caps(daemons):
    rx = daemons.receiver(**rx_opts(LAY), max_leases_per_sender=2, max_chunks_per_request=8)
    tx = daemons.sender(rx, alloc_retry_budget_ms=0)
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    try:
        pc.begin("a", list(range(16)))
        pc.begin("b", list(range(100, 116)))
        with pytest.raises(PdpushError, match="max_leases_per_sender"):
            pc.begin("c", list(range(200, 216)))
        with pytest.raises(PdpushError, match="exceeds the cap"):
            pc.begin("d", list(range(300, 300 + 16 * 9)))
    finally:
        pc.close()


def _random_frame(rnd: random.Random, keys: list[bytes]) -> bytes:
    kind = rnd.randrange(6)
    if kind == 0:
        return rnd.randbytes(rnd.randrange(0, 200))
    if kind == 1:
        return msgpack.packb(rnd.choice([None, 1, -5, "x", [1, 2], {"a": 1}, {1: 2}, b"\x00" * 20]))
    types = ["hello", "alloc", "layer_done", "commit", "abort", "status", "open", "release", "query", "begin",
             "error", "hello_ack", rnd.randbytes(3).hex()]
    fields = {"req_id": lambda: rnd.choice(["r1", "r2", "", "x" * 300, 7]),
              "layer": lambda: rnd.choice([0, 1, 2, -1, 1 << 40, "0"]),
              "chunk_keys": lambda: rnd.sample(keys, rnd.randrange(0, 4)) + ([b"short"] if rnd.random() < .2 else []),
              "last_chunk_tokens": lambda: rnd.choice([1, 16, 17, 0]),
              "lease_ms": lambda: rnd.choice([1, 50, 10**9]),
              "version": lambda: rnd.choice([1, 2]),
              "fingerprint": lambda: rnd.choice([LAY.fingerprint(), "bad"]),
              "layout": lambda: rnd.choice([LAY.to_dict(), {**LAY.to_dict(), "layers": 9}, {}]),
              "checksum": lambda: rnd.choice([None, 0, 12345]),
              "code": lambda: rnd.choice(["pool_exhausted", "zzz"]),
              "message": lambda: "m"}
    obj = {"type": rnd.choice(types)}
    for f in rnd.sample(list(fields), rnd.randrange(0, len(fields))):
        obj[f] = fields[f]()
    if kind == 5:  # a well-formed message now and then, so the fuzzer reaches deep states
        good = [protocol.Hello(version=protocol.PROTOCOL_VERSION, fingerprint=LAY.fingerprint(), layout=protocol.LayoutSpec(**LAY.to_dict())),
                protocol.AllocRequest(req_id=f"f{rnd.randrange(50)}", chunk_keys=rnd.sample(keys, 2),
                                      last_chunk_tokens=16, lease_ms=200),
                protocol.LayerDone(req_id=f"f{rnd.randrange(50)}", layers=[rnd.randrange(2)]),
                protocol.Commit(req_id=f"f{rnd.randrange(50)}", layers=rnd.randrange(3)), protocol.Abort(req_id=f"f{rnd.randrange(50)}")]
        return protocol.encode(rnd.choice(good))
    return msgpack.packb(obj)


def test_fuzzed_live_receiver_survives(daemons):
    # committed_ttl_ms: a fuzzed request that commits (a Commit naming every layer suffices since protocol 5) and is
    # never read keeps its pages until its TTL, a private copy among them where another commit indexed its key first
    rx = daemons.receiver(**rx_opts(LAY, pool_pages=32), lease_ms=300, quarantine_ms=200, committed_ttl_ms=500)
    rnd = random.Random(7)
    keys = [k for i in range(8) for k in chunk_keys(list(range(i * 100, i * 100 + 32)), LAY)]
    socks = []
    for _ in range(4):
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(rx.info["control_endpoint"])
        socks.append(s)
    local = zmq.Context.instance().socket(zmq.DEALER)
    local.setsockopt(zmq.LINGER, 0)
    local.connect(rx.info["local_endpoint"])
    sent = 0
    try:
        for i in range(10_000):
            target = local if i % 5 == 0 else socks[i % 4]
            target.send(_random_frame(rnd, keys))
            sent += 1
            if i % 500 == 0:  # drain replies so nothing backs up
                for s in socks + [local]:
                    while s.poll(0):
                        s.recv_multipart()
        assert rx.alive()
        deadline = time.monotonic() + 30
        while True:  # the backlog is processed, fuzzed leases expire, quarantine drains: the pool is whole
            st_ = status(sock(rx), timeout_s=10)
            if st_["bad_messages"] > 1000 and st_["leases_active"] == 0 and st_["pool_pages_quarantined"] == 0 \
                    and st_["pool_pages_free"] + st_["chunks_cached"] == 32:
                break
            assert time.monotonic() < deadline, st_
            time.sleep(0.1)  # polling status; bounded
    finally:
        for s in socks + [local]:
            s.close(0)
    assert sent >= 10_000
    tx = daemons.sender(rx)  # and it still serves a valid request
    pc = PrefillClient(LAY, sock(tx), timeout_s=10)
    dc = DecodeClient(sock(rx), timeout_s=10)
    try:
        k, v = kv(LAY, 33, 3)
        push(pc, "after-fuzz", list(range(5000, 5033)), k, v)
        k2, v2 = read_back(dc, "after-fuzz", LAY, 33)
        assert np.array_equal(k2, k) and np.array_equal(v2, v)
    finally:
        pc.close()
        dc.close()


def test_ucx_listener_binds_only_the_configured_address(daemons):
    """The UCX listener used to listen on every interface whatever ``host`` said."""
    import socket

    rx = daemons.receiver(**rx_opts(LAY))  # host 127.0.0.1 (the default)
    port = rx.info["ucx_port"]
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):  # another loopback address of this host: nobody listens there
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    with open("/proc/net/tcp") as f:  # and the kernel agrees: the listening socket is bound to 127.0.0.1
        listening = [line.split() for line in f.read().splitlines()[1:] if line.split()[3] == "0A"]
    mine = [row[1] for row in listening if int(row[1].split(":")[1], 16) == port]
    assert mine == [f"0100007F:{port:04X}"], mine


def test_a_socket_directory_another_user_could_write_or_own_is_refused(tmp_path):
    """Issue 34 item 9: a daemon refuses a socket directory that is a symlink, is writable by others or belongs to
    another uid (someone who made ``/tmp/pdpush-<uid>`` first could swap its sockets for impostors); one it creates
    is 0700, with its sockets 0600. Each refusal is a real daemon failing to start, with the fix in its message."""
    from pdpush import launch

    LAY2 = KVLayout(2, 1, 32, "float16", 16)

    def refused(d: Path, why: str) -> None:
        with pytest.raises(RuntimeError, match=why):
            launch.start_receiver(tmp_path, local_socket=str(d / "rx.sock"), prefault=False, **rx_opts(LAY2))

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    refused(shared, "writable by its group or others")
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    refused(tmp_path / "link", "is not a directory")
    if os.getuid() == 0:  # as CI runs: a directory of another uid
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, 12345, 12345)
        refused(theirs, "belongs to uid 12345")
    fresh = tmp_path / "made" / "pdpush"
    d = launch.start_receiver(tmp_path, local_socket=str(fresh / "rx.sock"), prefault=False, **rx_opts(LAY2))
    try:
        assert (os.stat(fresh).st_mode & 0o777) == 0o700 and (os.stat(fresh / "rx.sock").st_mode & 0o777) == 0o600
        assert status(str(fresh / "rx.sock"))["pool_pages_total"] > 0
    finally:
        d.stop()
