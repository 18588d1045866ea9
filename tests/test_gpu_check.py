"""`make gpu-check` where no GPU is: the same script on the CPU with a tiny model (its logic, the
JSON it writes), and the wheel list it installs from agrees with the project's pins."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # benches and a matrix variant: make test-slow (make test stays under 40 minutes)
def test_the_gpu_check_runs_on_the_cpu_and_reports_every_mode(tmp_path):
    out = tmp_path / "gpu-check.json"
    r = subprocess.run([sys.executable, "-m", "pdpush_tools.bench.gpu_check", "--device", "cpu", "--small", "--repeats",
                        "2", "--json", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    res = json.loads(out.read_text())
    assert "error" not in res, {k: v.get("traceback") for k, v in res.items() if isinstance(v, dict) and "error" in v}
    assert "ucx_tls_fallback" not in res, res["ucx_tls_fallback"]  # loopback here: UCX's own transports work
    assert r.returncode == (0 if res["ok"] else 1), r.stderr[-3000:]
    assert res["staging"]["bytes_equal"] and res["staging"]["d2h_pinned_gbps"] > 0
    d = res["demo"]
    assert d["tokens_match"]
    assert set(d["modes"]) == {"eager", "pipelined_thread", "pipelined_poll"}
    assert d["modes"]["pipelined_thread"]["handover"] == "thread"
    assert d["modes"]["pipelined_poll"]["handover"] == "poll"
    for m in d["modes"].values():
        assert m["tokens_match"] and m["logits_match"] and m["distinct_tokens"] > 2
        assert len(m["forward_ms"]["all"]) == 2 and m["forward_ms"]["median"] > 0
        assert m["slowdown_ok"] == (m["slowdown"] <= 0.05)
    assert len(d["forward_push_off_ms"]["all"]) == 2
    fp8 = res["fp8"]  # float8 KV through the stager and the daemons, back byte for byte
    assert fp8["bytes_equal"] and fp8["release_after_copies"] and len(fp8["cases"]) == 2, fp8
    assert {c["layout"]["dtype"] for c in fp8["cases"]} == {"float8_e4m3fn", "float8_e5m2"}
    cli = res["cli_demo"]  # `pdpush demo --device cpu --layer-compute-ms 0`, as the check runs it on CUDA
    assert cli["rc"] == 0 and cli["device"] == "cpu" and cli["tokens_match"] and cli["logits_match"], cli


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def test_gpu_wheels_are_the_versions_the_project_pins():
    gpu, main = _pins(ROOT / "requirements-gpu.txt"), _pins(ROOT / "requirements.txt")
    assert gpu and all(main.get(name) == ver for name, ver in gpu.items()), \
        {n: (v, main.get(n)) for n, v in gpu.items() if main.get(n) != v}
    make = (ROOT / "Makefile").read_text()
    assert "gpu-wheels:" in make and "gpu-check:" in make and "scripts/gpu-check.sh" in make
