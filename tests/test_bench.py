"""`pdpush bench --scenario goodput` runs the real daemons and verifies every byte."""

from __future__ import annotations

import json
import subprocess
import sys


def test_goodput_bench_small(tmp_path):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "pdpush.cli_entry", "bench", "--scenario", "goodput", "--layers", "4",
                        "--kv-heads", "2", "--head-dim", "64", "--dtype", "float16", "--tokens", "300",
                        "--chunk-tokens", "32", "--requests", "2", "--prefix-shared", "0.5", "--json", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["verified"] is True
    assert res["puts_per_layer"] == 1
    for key in ("bytes_total", "goodput_gbps", "ceiling_gbps", "ratio", "bytes_sent_first", "bytes_sent_second",
                "staging_copy_gbps", "ratio_staging_copy", "paged_stage_gbps", "paged_two_pass_gbps"):
        assert res[key] > 0, key
    # 300 tokens = 10 chunks of 32 (last partial); sharing 150 tokens = 4 full chunks
    assert res["chunks_skipped_second"] == 4
    page = 32 * 2 * 2 * 64 * 2
    assert res["bytes_sent_first"] == 4 * 10 * page and res["bytes_sent_second"] == 4 * 6 * page
