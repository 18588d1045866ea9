"""A fleet of real vLLM OpenAI servers with pdpush between them, for tests/test_fleet.py,
tests/test_fleet_2p.py and ``make bench-fleet``: one receiver per decode instance, one sender on the
prefill side, prefill and decode ``vllm.entrypoints.openai.api_server`` processes (the vLLM venv), each
prefill instance optionally publishing its vLLM KV events (``kv_events=True``: its own PUB and replay
ports, for the router's ``kv_events``), a colocated engine for reference tokens, and ``pdpush router``
processes started on demand. A server can be restarted on the same port and event endpoints. Everything
is stopped by pid on the way out, even on failure. Imports no vLLM or torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdpush import launch
from pdpush.client import status
from pdpush.launch import die_with_parent
from pdpush_tools.harness.ports import free_port, free_ports
from pdpush_tools.harness.vllm_cluster import ROOT, Engine, engine_env, require_vllm_python

BLOCK_SIZE, MAX_MODEL_LEN = 32, 512  # as pdpush_tools.harness.vllm_engine's (not imported: it sets vLLM's environment)


def _die_with_us() -> None:
    """In the child, before exec: SIGTERM when the launching thread dies (Linux), so that a test run
    that is itself killed leaves no server behind."""
    die_with_parent(signal.SIGTERM)


def kv_events_config(pub_port: int, replay_port: int, topic: str = "kv") -> dict:
    """An engine's ``--kv-events-config``: vLLM binds its PUB socket only for a wildcard (or ipc)
    endpoint and connects otherwise, so the engine side says ``*``; ``Server.events_source`` is how
    a router on this host reaches it."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
            "replay_endpoint": f"tcp://*:{replay_port}", "topic": topic}


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group (its engine core is
    a child process), stopped by the group's id. ``kv_events``: its ``--kv-events-config``
    (``kv_events_config``). ``restart`` stops it and starts it again with the same arguments: the same
    port and event endpoints, an empty cache. ``cpus``: the CPUs it and its engine core run on (``taskset``;
    the engine's OpenMP threads follow its affinity, one per CPU)."""

    def __init__(self, role: str, model: Path, ktc: dict | None, log: Path, llm_args: dict | None = None,
                 env: dict | None = None, kv_events: dict | None = None, cpus: str | None = None) -> None:
        self.role, self.log, self.kv_events = role, log, kv_events
        self.starts = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the engine's worker in the engine core process ("uni", vLLM's default for one GPU; on CPU it
        # also takes VLLM_ENABLE_V1_MULTIPROCESSING=0). With vLLM's CPU default ("mp") the worker
        # process busy-polls its queue for a second after every step (measured: a whole core), and
        # three servers' workers spinning on two cores starve the one that has work
        args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "m",
                "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
                "--enforce-eager", "--seed", "0", "--host", "127.0.0.1", "--port", str(self.port),
                "--distributed-executor-backend", "uni"]
        for k, v in (llm_args or {}).items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        if ktc is not None:
            args += ["--kv-transfer-config", json.dumps(ktc)]
        if kv_events is not None:
            args += ["--kv-events-config", json.dumps(kv_events)]
        self._args = [*(["taskset", "-c", cpus] if cpus else []), str(require_vllm_python()), *args]
        self._env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                     **engine_env(), **(env or {})}
        self._start()

    def _start(self) -> None:
        self._log = open(self.log, "a" if self.starts else "w")
        if self.starts:
            self._log.write(f"\n---- restart {self.starts} ----\n")
            self._log.flush()
        self.starts += 1
        self.proc = subprocess.Popen(self._args, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True, preexec_fn=_die_with_us, env=self._env)

    @property
    def events_source(self) -> dict | None:
        """Where a router on this host follows its KV events (the router's ``kv_events`` entry)."""
        if self.kv_events is None:
            return None
        here = {k: self.kv_events[k].replace("*", "127.0.0.1") for k in ("endpoint", "replay_endpoint")}
        return {**here, "topic": self.kv_events.get("topic", "")}

    def restart(self, timeout_s: float = 300) -> None:
        """Stop it (SIGTERM to its group, as an operator would) and start it again, the same way, on the
        same port and event endpoints; returns once it answers /health."""
        self.stop()
        self._start()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # a server that is starting; bounded by the deadline
        raise RuntimeError(f"{self.role} server not up within {timeout_s}s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGKILL the whole group, as a crash would."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()

    def metric(self, name: str, label: str = "") -> float:
        """Sum of a Prometheus counter on this server's /metrics over its label sets (those with
        ``label``, e.g. ``source="local_compute"``, if given)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith(name) and ln[len(name)] in " {" and label in ln)


@dataclass
class Fleet:
    work: Path
    model: Path
    receivers: list[launch.Daemon]
    sender: launch.Daemon
    prefill: list[Server]
    decode: list[Server]
    colocated: Engine | None
    routers: list[launch.Daemon] = field(default_factory=list)

    def rx_sock(self, i: int) -> str:
        return self.receivers[i].info["local_endpoint"].removeprefix("ipc://")

    def rx_status(self, i: int) -> dict:
        return status(self.rx_sock(i))

    def kv_events(self) -> dict:
        """The router's ``kv_events``: each prefill instance that publishes them, by URL."""
        return {p.url: p.events_source for p in self.prefill if p.events_source is not None}

    def router(self, prefill: list[str] | None = None, **opts) -> launch.Daemon:
        """A router in front of the fleet (``prefill``: other prefill URLs instead of the fleet's)."""
        r = launch.start_router(self.work, prefill=prefill or [p.url for p in self.prefill],
                                decode=[{"url": d.url, "receiver": rx.info["control_endpoint"]}
                                        for d, rx in zip(self.decode, self.receivers, strict=True)], **opts)
        self.routers.append(r)
        return r


@contextlib.contextmanager
def openai_fleet(work: Path, model: Path, layout: dict, common: dict, *, decodes: int = 2, prefills: int = 1,
                 pool_pages: int = 256, staging_bytes: int = 64 << 20, llm_args: dict | None = None,
                 colocated: bool = True, prefault: bool = False, cores: dict[str, str] | None = None,
                 kv_events: bool = False):
    """``cores``: role ("prefill", "decode") -> the CPUs its servers run on (``Server``'s ``cpus``), e.g. to
    keep prefill and decode off each other's cores as they would be on separate hosts. (Not
    VLLM_CPU_OMP_THREADS_BIND: vLLM 0.32 reads it only in its multiprocess executor, and these servers run
    the "uni" one, so each engine ran one OpenMP thread per core of the host, on any core.) ``kv_events``: each prefill instance publishes its vLLM KV events on ports of
    its own (``Fleet.kv_events()`` gives the router's config for them)."""
    bind = cores or {}
    receivers: list[launch.Daemon] = []
    servers: list[Server] = []
    tx = None
    coloc = None
    f = None
    try:
        for _ in range(decodes):
            receivers.append(launch.start_receiver(work, pool_pages=pool_pages, prefault=prefault, **layout))
        tx = launch.start_sender(work, staging_bytes=staging_bytes, prefault=prefault)
        rx_eps = [rx.info["control_endpoint"] for rx in receivers]
        tx_sock = tx.info["ingress_endpoint"].removeprefix("ipc://")
        base = {"kv_connector": "PdpushConnector", "kv_connector_module_path": "pdpush.integrations.vllm"}
        ports = free_ports(2 * prefills) if kv_events else []
        prefill = []
        for i in range(prefills):
            prefill.append(Server("prefill", model, {**base, "kv_role": "kv_producer", "kv_connector_extra_config": {
                **common, "sender_socket": tx_sock, "receiver": rx_eps[0], "allowed_receivers": rx_eps}},
                work / f"prefill{i}.log", llm_args, None,
                kv_events_config(ports[2 * i], ports[2 * i + 1]) if kv_events else None, bind.get("prefill")))
            servers.append(prefill[-1])
        decode = [Server("decode", model, {**base, "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                                           "kv_connector_extra_config": {
                                               **common, "receiver_socket": rx.info["local_endpoint"].removeprefix(
                                                   "ipc://")}},
                         work / f"decode{i}.log", llm_args, cpus=bind.get("decode")) for i, rx in enumerate(receivers)]
        servers += decode
        if colocated:
            # the reference engine idles while others are measured, but its loop still wakes: off the decode's cores
            coloc = Engine("colocated", model, {}, work / "colocated.log", llm_args,
                           prefix=["taskset", "-c", bind["prefill"]] if "prefill" in bind else None)
        for s in servers:
            s.wait_ready()
        if coloc is not None:
            coloc.ready()
        f = Fleet(work, model, receivers, tx, prefill, decode, coloc)
        yield f
    finally:
        for r in (f.routers if f else []):
            r.stop()
        for s in servers:
            s.stop()
        if coloc is not None:
            coloc.stop()
        if tx is not None:
            tx.stop()
        for rx in receivers:
            rx.stop()
