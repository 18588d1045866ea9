"""A fleet of real vLLM OpenAI servers with pdpush between them, for tests/test_fleet.py and
``make bench-fleet``: one receiver per decode instance, one sender on the prefill side, prefill and
decode ``vllm.entrypoints.openai.api_server`` processes (the vLLM venv), a colocated engine for
reference tokens, and ``pdpush router`` processes started on demand. Everything is stopped by pid
on the way out, even on failure. Imports no vLLM or torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdpush import launch
from pdpush.client import status
from pdpush_tools.harness.vllm_cluster import ROOT, Engine, require_vllm_python

BLOCK_SIZE, MAX_MODEL_LEN = 32, 512  # as pdpush_tools.harness.vllm_engine's (not imported: it sets vLLM's environment)


def _die_with_us() -> None:
    """In the child, before exec: SIGTERM when the launching thread dies (Linux), so that a test run
    that is itself killed leaves no server behind."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group (its engine core is
    a child process), stopped by the group's id."""

    def __init__(self, role: str, model: Path, ktc: dict | None, log: Path, llm_args: dict | None = None,
                 env: dict | None = None) -> None:
        self.role, self.log = role, log
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
        self._log = open(log, "w")
        self.proc = subprocess.Popen([str(require_vllm_python()), *args], stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True, preexec_fn=_die_with_us,
                                     env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                                          "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **launch.QUIET_UCX, **(env or {})})

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

    def router(self, **opts) -> launch.Daemon:
        r = launch.start_router(self.work, prefill=[p.url for p in self.prefill],
                                decode=[{"url": d.url, "receiver": rx.info["control_endpoint"]}
                                        for d, rx in zip(self.decode, self.receivers, strict=True)], **opts)
        self.routers.append(r)
        return r


@contextlib.contextmanager
def openai_fleet(work: Path, model: Path, layout: dict, common: dict, *, decodes: int = 2, prefills: int = 1,
                 pool_pages: int = 256, staging_bytes: int = 64 << 20, llm_args: dict | None = None,
                 colocated: bool = True, prefault: bool = False, cores: dict[str, str] | None = None):
    """``cores``: role ("prefill", "decode") -> the CPUs its servers' compute threads are bound to
    (VLLM_CPU_OMP_THREADS_BIND), e.g. to keep prefill and decode off each other's cores as they would
    be on separate hosts."""
    bind = {role: {"VLLM_CPU_OMP_THREADS_BIND": c} for role, c in (cores or {}).items()}
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
        prefill = [Server("prefill", model, {**base, "kv_role": "kv_producer", "kv_connector_extra_config": {
            **common, "sender_socket": tx_sock, "receiver": rx_eps[0], "allowed_receivers": rx_eps}},
            work / f"prefill{i}.log", llm_args, bind.get("prefill")) for i in range(prefills)]
        servers += prefill
        decode = [Server("decode", model, {**base, "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                                           "kv_connector_extra_config": {
                                               **common, "receiver_socket": rx.info["local_endpoint"].removeprefix(
                                                   "ipc://")}},
                         work / f"decode{i}.log", llm_args, bind.get("decode")) for i, rx in enumerate(receivers)]
        servers += decode
        if colocated:
            coloc = Engine("colocated", model, {}, work / "colocated.log", llm_args)
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
